"""verify: does data parallelism change *your* model's numbers?

:func:`verify` runs one training step (forward, loss, backward) of a model three or four ways, each
on its own deep copy, so the model passed in is never touched:

1. **minidp**: wrapped in :class:`minidp.DataParallel` (or the ``wrapper`` given) on ``device_ids``;
2. **chunked reference** (:func:`minidp.reference.chunked_reference`): on one device, chunk by
   chunk, with chunk 0 on the model itself and private buffer copies for the others. This is what
   data parallelism *should* compute, batch-dependent layers (BatchNorm) included;
3. **full batch**: one plain call on the whole batch. Where 2 differs from it the model has
   batch-dependent layers: reported as information (``report.info``), not as a failure. Its Python attributes after
   the step are what a user expects: an attribute that ``forward`` changes (a call counter, say)
   is changed on a replica and lost under data parallelism, and that *is* a failure;
4. **stock** ``torch.nn.DataParallel`` on the same devices, where it can run (CUDA device ids).

Every output, parameter gradient and buffer of 1 is compared with 2 (and 4), as the largest
absolute error and the largest error relative to the reference's largest magnitude.
By default everything runs in float64, so that any error above rounding means a real difference.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .wrapper import DataParallel
from .device_ids import DeviceLike, as_devices
from .nested import leaves, map_tensors
from .reference import chunked_reference

REFERENCE = "chunked reference"
FULL_BATCH = "full batch"
STOCK = "stock DataParallel"


@dataclass
class Check:
    """One compared quantity: ``minidp`` against ``against``."""

    kind: str  # "output", "gradient", "buffer" or "state"
    name: str
    against: str  # for ``report.info``: the chunked reference against this
    abs_error: float
    rel_error: float
    ok: bool
    note: str = ""


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``ok`` is true when every check passed; ``info`` never fails."""

    devices: list[str]
    rtol: float
    checks: list[Check] = field(default_factory=list)
    info: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def batch_dependent(self) -> bool:
        """Whether the full-batch result differs from the chunked one (BatchNorm and the like)."""
        return any(not c.ok for c in self.info)

    def __str__(self) -> str:
        lines = [
            f"verify on {self.devices}: {'OK' if self.ok else 'FAILED'} "
            f"({len(self.checks) - len(self.failures)}/{len(self.checks)} checks within rtol {self.rtol:g})",
            f"{'kind':<9} {'name':<34} {'against':<19} {'max abs err':>12} {'max rel err':>12}  result",
        ]
        # Agreement with the full batch is shown only where it fails: that is the news.
        for c in self.checks + [c for c in self.info if not c.ok]:
            result = ("ok" if c.ok else "FAIL") if c in self.checks else "differs (info: batch-dependent)"
            lines.append(
                f"{c.kind:<9} {c.name:<34} {c.against:<19} {c.abs_error:>12.3g} {c.rel_error:>12.3g}  {result}"
                + (f"  {c.note}" if c.note else "")
            )
        if self.info and not self.batch_dependent:
            lines.append("the full-batch run agrees too: the model has no batch-dependent layer")
        lines.extend(self.notes)
        return "\n".join(lines)


def default_loss(output: Any) -> torch.Tensor:
    """The sum of ``mean(t ** 2)`` over every floating-point tensor in ``output``."""
    return sum(t.pow(2).mean() for t in leaves(output).values() if _is_float_tensor(t))


def verify(
    module: nn.Module,
    inputs: Any,
    device_ids: Optional[Sequence[DeviceLike]] = None,
    kwargs: Optional[dict[str, Any]] = None,
    dim: int = 0,
    loss: Optional[Callable[[Any], torch.Tensor]] = None,
    *,
    wrapper: Callable[..., nn.Module] = DataParallel,
    dtype: Optional[torch.dtype] = torch.float64,
    rtol: Optional[float] = None,
    stock: Optional[bool] = None,
) -> VerifyReport:
    """Check that data parallelism gives ``module`` the numbers it has on one device.

    Args:
        module: the model; left untouched (every run uses a deep copy).
        inputs: the positional arguments of one batch (a tuple; anything else is one argument).
        device_ids: where the replicas run; default every visible GPU, else ``["cpu"] * 2``.
        kwargs: keyword arguments of the batch (scattered like ``inputs``).
        dim: the batch dimension.
        loss: output -> scalar for the backward; default :func:`default_loss`.
        wrapper: the data-parallel class to check, called as ``wrapper(module, device_ids=..., dim=...)``.
        dtype: floating-point parameters, buffers and inputs are converted to it (``None``: kept).
        rtol: largest accepted relative error; default 1e-10 in float64, else 1e-4.
        stock: also run ``torch.nn.DataParallel``; default: when every device is a CUDA GPU.
    """
    devices = as_devices(device_ids if device_ids is not None else _default_devices(), "device_ids")
    if not devices:
        raise ValueError("device_ids is empty: give at least one device, e.g. ['cpu'] * 2")
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    kwargs = dict(kwargs or {})
    loss = loss or default_loss
    rtol = rtol if rtol is not None else (1e-10 if dtype == torch.float64 else 1e-4)
    home = devices[0]
    inputs, kwargs = map_tensors(lambda t: t.to(home, dtype if dtype is not None and t.is_floating_point() else None), (inputs, kwargs))
    report = VerifyReport([str(d) for d in devices], rtol)

    parallel = _fresh(module, home, dtype)
    parallel_output = wrapper(parallel, device_ids=devices, dim=dim)(*inputs, **kwargs)
    loss(parallel_output).backward()
    runs = {"minidp": (parallel, parallel_output)}

    reference = _fresh(module, home, dtype)
    reference_output = chunked_reference(reference, inputs, kwargs, len(devices), dim)
    loss(reference_output).backward()
    runs[REFERENCE] = (reference, reference_output)
    full = _fresh(module, home, dtype)
    full_output = full(*inputs, **kwargs)
    loss(full_output).backward()
    runs[FULL_BATCH] = (full, full_output)

    if stock is None:
        stock = torch.cuda.is_available() and all(d.type == "cuda" for d in devices)
    if stock:
        stock_model = _fresh(module, home, dtype)
        stock_output = nn.DataParallel(stock_model, [d.index for d in devices], home.index, dim)(*inputs, **kwargs)
        loss(stock_output).backward()
        runs[STOCK] = (stock_model, stock_output)
    else:
        report.notes.append("stock torch.nn.DataParallel not run: it needs CUDA device ids")

    for against in (REFERENCE, STOCK):
        if against in runs:
            report.checks.extend(_compare_runs(runs["minidp"], runs[against], against, rtol))
    # Batch dependence is a property of the model: the chunked reference against the full batch.
    report.info.extend(_compare_runs(runs[REFERENCE], runs[FULL_BATCH], FULL_BATCH, rtol))
    report.checks.extend(_compare_state(parallel, full))
    return report


def _default_devices() -> list[DeviceLike]:
    count = torch.cuda.device_count()
    return list(range(count)) if count else ["cpu"] * 2


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _fresh(module: nn.Module, device: torch.device, dtype: Optional[torch.dtype]) -> nn.Module:
    model = copy.deepcopy(module).to(device)
    return model.to(dtype) if dtype is not None else model


# --------------------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------------------


def _compare(kind: str, name: str, actual: Any, expected: Any, against: str, rtol: float) -> Check:
    if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor):
        same = type(actual) is type(expected) and actual == expected
        note = "" if same else f"{_describe(actual)} vs {_describe(expected)}"
        return Check(kind, name, against, 0.0 if same else math.inf, 0.0 if same else math.inf, bool(same), note)
    if actual.shape != expected.shape:
        return Check(kind, name, against, math.inf, math.inf, False,
                     f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.numel() == 0:
        return Check(kind, name, against, 0.0, 0.0, True)
    abs_error = (a - e).abs().max().item()
    rel_error = abs_error / max(e.abs().max().item(), 1e-300)
    if math.isnan(abs_error):
        return Check(kind, name, against, math.nan, math.nan, False, "NaN")
    return Check(kind, name, against, abs_error, rel_error, rel_error <= rtol or abs_error == 0.0)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)}"
    return f"{value!r}" if len(repr(value)) < 40 else f"a {type(value).__name__}"


def _compare_runs(parallel: tuple[nn.Module, Any], other: tuple[nn.Module, Any], against: str, rtol: float) -> list[Check]:
    (model, output), (other_model, other_output) = parallel, other
    found, expected = leaves(output, "output"), leaves(other_output, "output")
    if against == FULL_BATCH:  # only the numbers: gather turns a replica's string into a list of them
        found = {p: v for p, v in found.items() if isinstance(v, torch.Tensor)}
        expected = {p: v for p, v in expected.items() if isinstance(v, torch.Tensor)}
    checks = [
        _compare("output", path, found.get(path, "<missing>"), expected.get(path, "<missing>"), against, rtol)
        for path in list(expected) + [p for p in found if p not in expected]
    ]
    grads = {name: p.grad for name, p in other_model.named_parameters()}
    for name, param in model.named_parameters():
        checks.append(_compare("gradient", name, param.grad, grads[name], against, rtol))
    buffers = dict(other_model.named_buffers())
    for name, buf in model.named_buffers():
        checks.append(_compare("buffer", name, buf, buffers[name], against, rtol))
    return checks


_PLAIN = (bool, int, float, str, bytes, type(None))


def _plain(value: Any) -> bool:
    """Values compared by ``==``: numbers, strings and containers of them (not tensors, not objects)."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _compare_state(parallel: nn.Module, full: nn.Module) -> list[Check]:
    """Python attributes of every sub-module after the step, against the plain full-batch run.

    ``forward`` runs on replicas, which are shallow copies: an attribute it assigns is lost, and a
    shared list it appends to sees every replica. Only plain values are compared; one row for all
    the attributes that agree, one per attribute that does not.
    """
    compared, checks = 0, []
    for (name, module), (_, reference) in zip(parallel.named_modules(), full.named_modules()):
        for key, value in vars(reference).items():
            if key.startswith("_") or key == "training" or not _plain(value):
                continue
            compared += 1
            found = vars(module).get(key, "<missing>")
            if found != value:
                checks.append(Check("state", f"{name}.{key}" if name else key, FULL_BATCH, math.inf, math.inf, False,
                                    f"{found!r} under data parallelism, {value!r} on one device"))
    same = compared - len(checks)
    return [Check("state", f"{same} plain attributes", FULL_BATCH, 0.0, 0.0, True)] + checks
