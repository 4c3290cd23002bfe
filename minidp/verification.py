"""verify: does data parallelism change *your* model's numbers?

:func:`verify` runs one training step (forward, loss, backward) of a model several ways, each on
its own deep copy, so the model passed in is never touched:

1. **minidp**: wrapped in :class:`minidp.DataParallel` (or the ``wrapper`` given) on ``device_ids``;
2. **chunked reference** (:func:`minidp.reference.chunked_reference`): on one device, chunk by
   chunk, with chunk 0 on the model itself and every other chunk on a copy of the model taken
   before the step (the same parameters, private buffers), as the replicas are. This is what data
   parallelism *should* compute, batch statistics (BatchNorm) included;
3. **full batch**: one plain call on the whole batch: what the user computes without data
   parallelism. Its Python attributes after the step are what a user expects too: an attribute
   that ``forward`` changes (a call counter, say) is changed on a replica and lost under data
   parallelism, and that is a failure. So is a tensor kept as a plain attribute (not a buffer) that
   ``forward`` reassigns (``self.seen = self.seen + n``): compared within ``rtol``, as buffers are;
4. **stock** ``torch.nn.DataParallel`` on the same devices, where it can run (CUDA device ids).

Outputs are compared leaf by leaf, and inside the objects that :func:`minidp.gather` rebuilds from
their items (``nested.leaves(..., by_items=True)``: a ``DynamicCache``'s keys and values, each where
iterating over it puts it). The batch must give at least two replicas a chunk: with one, data
parallelism makes one plain call and nothing would be compared, so verify refuses it first.

What ``report.ok`` means: DataParallel computes what one device computes, except for the effect
of batch statistics in the layers known to have them, each named in ``report.batch_statistics``.
So every output, parameter gradient and buffer of 1 must agree with 2 (and 4), and 2 must agree
with 3 except where a batch-statistics layer explains the difference:

* the known batch-statistics layers are BatchNorm and kin (every subclass of torch's
  ``_BatchNorm``: ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, the lazy ones), ``InstanceNorm``
  with ``track_running_stats`` (its running statistics average over the batch), and the layer
  types named in ``batch_dependent=``;
* a **buffer** that differs from the full batch is explained only when it belongs to such a
  layer (BatchNorm's running statistics come from chunk 0 under data parallelism). Any other
  buffer that differs (``self.seen += x.shape[0]``) is state that ``forward`` accumulates over
  the batch, and data parallelism updates it from chunk 0 alone: a failure;
* an **output or gradient** that differs is put down to the batch statistics only when they are
  its cause: 2 and 3 are run again with every BatchNorm on running statistics (its training flag
  off, fixed statistics where it keeps none), and then they must agree. Whatever differs still
  depends on the batch through something else (``x - x.mean(0)``): a failure. A layer named in
  ``batch_dependent=`` cannot be switched like this: with one, differing outputs and gradients
  are put down to it.

Layers recomputed in the backward (``torch.utils.checkpoint``, re-entrant or not; torchvision's
DenseNet with ``memory_efficient=True``) run their forward a second time inside ``backward``, and a
stateful layer among them updates its state a second time: a BatchNorm's running statistics take
two momentum steps and ``num_batches_tracked`` counts 2. Each replica does that on its own
buffers: replica 0 updates the original's statistics twice, from chunk 0; every other replica its
private copy, which is dropped. The chunked reference does the same (its copies live until the
backward is done), so minidp, stock and the reference must agree there as everywhere. Against the
full batch (two updates from the whole batch) such statistics are judged by the rule for buffers
above: explained for a batch-statistics layer, a failure for anything else (a recomputed sample
counter counts chunk 0 twice).

Every run uses the same number of intra-op threads for its forward as a replica gets from
:func:`minidp.parallel_apply` (on the CPU, the caller's threads shared out among the replicas):
kernels block their sums by thread, so different counts round differently, and an ill-conditioned
model (BatchNorm over two values per channel) amplifies that far past any tolerance. The backward
runs in the caller's thread with the caller's count in every run, as minidp's does.

Layers whose forward draws random numbers (Dropout, stochastic depth) cannot be compared draw
for draw: data parallelism draws other numbers than one device does. verify finds them (the
innermost modules whose output changes with the seed while their input does not), runs them with
their training flag off in every run and names them in ``report.random_layers``. Randomness that
does not stop so is a failure: the runs cannot be compared.

Errors: the largest absolute error, and that error relative to a scale. For outputs and buffers
the scale is the expected tensor's largest magnitude. For a gradient it is the largest gradient
magnitude of its **layer** (the module that holds the parameter): the rounding error of a sum
scales with the magnitudes of the terms summed (``eps * sum|terms|``), not with the sum. A bias
whose true gradient is zero (a bias, or a BatchNorm shift, followed by a BatchNorm in training
mode, which subtracts every per-channel constant) sums terms ``dL/dy`` that cancel: its computed
value is rounding noise, and two correct summation orders disagree by all of it. The same terms
make the layer's weight gradient (``sum dL/dy * x``), so that gradient's size is the scale the
bias's rounding lives on. By default everything runs in float64, so that any error above
rounding means a real difference.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from .comm import check_dim
from .device_ids import DeviceLike, as_devices, default_device_ids, generator_state
from .nested import leaves, map_tensors, tensors_in
from .reference import chunked_reference
from .step1_scatter import scatter_kwargs
from .step2_replicate import check_is_module
from .step3_parallel_apply import parallel_apply
from .wrapper import DataParallel

REFERENCE = "chunked reference"
FULL_BATCH = "full batch"
STOCK = "stock DataParallel"


@dataclass
class Check:
    """One compared quantity: ``minidp`` against ``against``."""

    kind: str  # "output", "gradient", "buffer", "parameter" (changed by forward), "state" or "random"
    name: str
    against: str  # for ``report.info``: the chunked reference against this
    abs_error: float
    rel_error: float
    ok: bool
    note: str = ""


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``ok`` is true when every check passed; ``info`` never fails.

    ``info`` holds the chunked reference against the full batch where they agree or a
    batch-statistics layer explains the difference; ``batch_statistics`` names those layers
    (``"bn1 (BatchNorm2d)"``); ``random_layers`` the layers run with their training flag off.
    """

    devices: list[str]
    rtol: float
    checks: list[Check] = field(default_factory=list)
    info: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    batch_statistics: list[str] = field(default_factory=list)
    random_layers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def batch_dependent(self) -> bool:
        """Whether the full-batch result differs from the chunked one, explained by batch statistics."""
        return any(not c.ok for c in self.info)

    def __str__(self) -> str:
        lines = [
            f"verify on {self.devices}: {'OK' if self.ok else 'FAILED'} "
            f"({len(self.checks) - len(self.failures)}/{len(self.checks)} checks within rtol {self.rtol:g})",
            f"{'kind':<9} {'name':<34} {'against':<19} {'max abs err':>12} {'max rel err':>12}  result",
        ]
        # Agreement with the full batch is shown only where it fails: that is the news.
        for c in self.checks + [c for c in self.info if not c.ok]:
            result = ("ok" if c.ok else "FAIL") if c in self.checks else "differs (info)"
            lines.append(
                f"{c.kind:<9} {c.name:<34} {c.against:<19} {c.abs_error:>12.3g} {c.rel_error:>12.3g}  {result}"
                + (f"  {c.note}" if c.note else "")
            )
        if self.batch_dependent:
            lines.append(f"the full batch differs, explained by the batch statistics of {_listed(self.batch_statistics)}")
        elif self.info and not any(c.against == FULL_BATCH and c.kind != "state" and not c.ok for c in self.checks):
            lines.append("the full-batch run agrees too: the model has no batch-dependent layer")
        if self.random_layers:
            lines.append(f"random layers run with their training flag off in every run: {_listed(self.random_layers)}")
        lines.extend(self.notes)
        return "\n".join(lines)


def default_loss(output: Any) -> torch.Tensor:
    """The sum of ``mean(t ** 2)`` over every floating-point tensor in ``output``, those inside an object that gather
    rebuilds from its items (a ``DynamicCache``) included."""
    return sum(t.pow(2).mean() for _, t in tensors_in(output, by_items=True) if t.is_floating_point())


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
    batch_dependent: Sequence[type] = (),
) -> VerifyReport:
    """Check that data parallelism gives ``module`` the numbers it has on one device.

    Args:
        module: the model; left untouched (every run uses a deep copy).
        inputs: the positional arguments of one batch (a tuple; anything else is one argument). The batch must give
            at least two replicas a chunk: 2 rows or more along ``dim`` (a ValueError says so before anything runs).
        device_ids: where the replicas run, at least two (a device may be repeated); default every visible GPU
            where there are several, else two replicas on the one GPU (``[0, 0]``) or on the CPU (``["cpu"] * 2``).
        kwargs: keyword arguments of the batch (scattered like ``inputs``).
        dim: the batch dimension.
        loss: output -> scalar for the backward; default :func:`default_loss`.
        wrapper: the data-parallel class to check, called as ``wrapper(module, device_ids=..., dim=...)``.
        dtype: floating-point parameters, buffers and inputs are converted to it (``None``: kept).
        rtol: largest accepted relative error; default 1e-10 in float64, else 1e-4.
        stock: also run ``torch.nn.DataParallel``; default: when every device is a different CUDA GPU (on a
            repeated GPU id stock hands every replica the original of a buffer alone in its dtype,
            docs/stock-behaviour.md B21, so its buffers would differ from minidp's and from the reference's).
        batch_dependent: your own layer types that compute batch statistics as BatchNorm does, e.g.
            ``(MyNorm,)``: differences from the full batch are put down to them (module docstring).
    """
    check_is_module(module, "module")
    dim = check_dim(dim, "dim")
    devices = as_devices(device_ids if device_ids is not None else default_device_ids(replicas=2), "device_ids")
    if not devices:
        raise ValueError("device_ids is empty: give at least one device, e.g. ['cpu'] * 2")
    for argument, function in (("loss", loss), ("wrapper", wrapper)):
        if function is not None and not callable(function):
            raise TypeError(f"{argument} must be callable (see verify's docstring), got {type(function).__name__}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 < rtol < math.inf):
        raise ValueError(f"rtol must be a positive number (the largest accepted relative error), got {rtol!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (e.g. torch.float64) or None, got {dtype!r}")
    batch_dependent = tuple(batch_dependent)
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in batch_dependent):
        raise TypeError(f"batch_dependent must hold nn.Module subclasses, e.g. (MyNorm,); got {batch_dependent!r}")
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    kwargs = dict(kwargs or {})
    loss = loss or default_loss
    rtol = rtol if rtol is not None else (1e-10 if dtype == torch.float64 else 1e-4)
    home = devices[0]
    inputs, kwargs = map_tensors(lambda t: t.to(home, dtype if dtype is not None and t.is_floating_point() else None), (inputs, kwargs))
    _check_two_replicas_run(inputs, kwargs, devices, dim)
    report = VerifyReport([str(d) for d in devices], rtol)
    threads = _replica_threads(devices) if home.type == "cpu" else None

    def chunked(model: nn.Module) -> Any:
        return chunked_reference(model, inputs, kwargs, len(devices), dim)

    def full_batch(model: nn.Module) -> Any:
        return model(*inputs, **kwargs)

    def one_device(model: nn.Module, forward: Callable[[nn.Module], Any]) -> tuple[nn.Module, Any]:
        """A training step on one device: the forward with a replica's threads, the backward as minidp's."""
        with _intra_op_threads(threads):
            output = forward(model)
        loss(output).backward()
        return model, output

    random_layers, still_random = _random_layers(lambda: _fresh(module, home, dtype), full_batch, threads)
    report.random_layers = [_layer_name(module, name) for name in random_layers]
    report.checks.extend(still_random)

    def fresh() -> nn.Module:
        return _training_flag_off(_fresh(module, home, dtype), random_layers)

    parallel = fresh()
    parallel_output = wrapper(parallel, device_ids=devices, dim=dim)(*inputs, **kwargs)
    loss(parallel_output).backward()
    runs = {"minidp": (parallel, parallel_output)}
    runs[REFERENCE] = one_device(fresh(), chunked)
    runs[FULL_BATCH] = one_device(fresh(), full_batch)

    if stock is None:
        stock = torch.cuda.is_available() and all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices)
    if stock:
        stock_model = fresh()
        stock_output = nn.DataParallel(stock_model, [d.index for d in devices], home.index, dim)(*inputs, **kwargs)
        loss(stock_output).backward()
        runs[STOCK] = (stock_model, stock_output)
    else:
        report.notes.append("stock torch.nn.DataParallel not run: it needs CUDA device ids, each a different GPU")

    for against in (REFERENCE, STOCK):
        if against in runs:
            report.checks.extend(_compare_runs(runs["minidp"], runs[against], against, rtol))

    def on_running_statistics(names: Sequence[str]) -> tuple[tuple[nn.Module, Any], tuple[nn.Module, Any]]:
        return (one_device(_on_running_statistics(fresh(), names), chunked),
                one_device(_on_running_statistics(fresh(), names), full_batch))

    explained, unexplained, layers = _against_the_full_batch(runs[REFERENCE], runs[FULL_BATCH], batch_dependent,
                                                             on_running_statistics, rtol)
    report.info.extend(explained)
    report.checks.extend(unexplained)
    report.batch_statistics = [_layer_name(runs[FULL_BATCH][0], name) for name in layers]
    report.checks.extend(_compare_state(parallel, runs[FULL_BATCH][0], rtol))
    others = [path for path, value in leaves(runs[FULL_BATCH][1], "output", by_items=True).items()
              if not isinstance(value, torch.Tensor) and value is not None]
    if others:
        report.notes.append(
            f"not compared with the full batch: {_listed(others)}, not tensors (gather makes a list of the replicas' "
            f"values)")
    return report


def _check_two_replicas_run(inputs: tuple, kwargs: dict[str, Any], devices: Sequence[torch.device], dim: int) -> None:
    """Raise unless at least two replicas get rows of the batch: with one, DataParallel makes one plain call (with none,
    every replica runs on nothing), so nothing data-parallel would be compared and the report would say OK about nothing.

    The batch is cut as the chunked reference cuts it, by :func:`minidp.scatter_kwargs` (on ``devices[0]`` alone:
    views, nothing copied), which is how the wrapper's scatter cuts it too. Arguments without a tensor are not cut:
    every replica runs on them whole.
    """
    if len(devices) < 2:
        raise ValueError(
            f"device_ids names one device ({devices[0]}): verify compares data parallelism with one device, so it needs "
            f"at least two replicas; a device may be repeated, e.g. ['cpu'] * 2 or [0, 0]")
    found = [(path, int(t.shape[dim])) for root, name in ((inputs, "inputs"), (kwargs, "kwargs")) for path, t in tensors_in(root, name)]
    if not found:
        return
    chunks = zip(*scatter_kwargs(inputs, kwargs, [devices[0]] * len(devices), dim))
    given = sum(any(t.shape[dim] for _, t in tensors_in(chunk)) for chunk in chunks)
    if given >= 2:
        return
    path, rows = min(found, key=lambda pair: pair[1])
    raise ValueError(
        f"{path} has {rows} row{'' if rows == 1 else 's'} along dim {dim}, which gives {given} of the {len(devices)} "
        f"replicas a chunk: nothing data-parallel would run, so nothing would be compared. verify needs a batch of at "
        f"least 2 rows ({len(devices)} give every replica one)")


def _fresh(module: nn.Module, device: torch.device, dtype: Optional[torch.dtype]) -> nn.Module:
    model = copy.deepcopy(module).to(device)
    return model.to(dtype) if dtype is not None else model


def _layer_name(model: nn.Module, name: str) -> str:
    return f"{name or '(the model)'} ({type(model.get_submodule(name)).__name__})"


def _listed(names: Sequence[str], shown: int = 4) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------------------------------
# Threads: every single-device forward runs with the intra-op threads of a replica
# --------------------------------------------------------------------------------------------------


class _IntraOpThreads(nn.Module):
    """A probe: its forward returns the number of intra-op threads it runs with."""

    def forward(self) -> int:
        return torch.get_num_threads()


def _replica_threads(devices: Sequence[torch.device]) -> int:
    """The intra-op threads replica 0 runs with under :func:`minidp.parallel_apply` on ``devices``.

    Asked of parallel_apply itself rather than computed here, so that verify follows whatever
    rule it has for sharing the caller's threads among CPU replicas.
    """
    return parallel_apply([_IntraOpThreads() for _ in devices], [()] * len(devices), devices=devices)[0]


@contextlib.contextmanager
def _intra_op_threads(count: Optional[int]) -> Iterator[None]:
    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------------
# Random layers: the modules that draw random numbers
# --------------------------------------------------------------------------------------------------


def _random_layers(
    build: Callable[[], nn.Module], forward: Callable[[nn.Module], Any], threads: Optional[int]
) -> tuple[list[str], list[Check]]:
    """The modules whose forward draws random numbers, and a failing check if that cannot be stopped.

    Found by what they do to the random number generators, not by what they output (two seeds can
    give a Dropout of small ``p`` the same mask): the full batch runs once without autograd, and a
    module draws when a generator's state changes during its call but during none of its
    children's calls. Their training flags go off (Dropout and stochastic depth then pass their
    input through) and the search runs again, until nothing draws, or until a round finds only
    modules already switched off: their forward draws whatever the flag says, so no run of the
    model can be compared with another, which is a failure.
    """
    random: list[str] = []
    while True:
        drawing = _drawing_modules(_training_flag_off(build(), random), forward, threads)
        new = [name for name in drawing if name not in random]
        if not new:
            break
        random.extend(new)
    if not drawing:
        return random, []
    names = [name or "(the model)" for name in drawing]
    return random, [Check("random", _listed(names), FULL_BATCH, math.inf, math.inf, False,
                          "forward draws random numbers with its training flag off: data parallelism draws other "
                          "numbers than one device, so no two runs can be compared")]


def _generator_states() -> list[bytes]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [generator_state(device) for device in devices]


def _drawing_modules(model: nn.Module, forward: Callable[[nn.Module], Any], threads: Optional[int]) -> list[str]:
    """The names of the modules that draw random numbers in ``forward(model)`` themselves, not through a child.

    The calls open on each thread are a stack (a nested ``data_parallel`` runs copies of
    sub-modules, hooks included, in other threads); each entry remembers the generators' states
    at its start and whether a child drew.
    """
    local, drawing = threading.local(), []

    def before(module: nn.Module, args: tuple) -> None:
        local.__dict__.setdefault("open", []).append([_generator_states(), False])

    def after(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            states, child_drew = local.open.pop()
            drew = states != _generator_states()
            if drew and not child_drew:
                drawing.append(name)
            if drew and local.open:
                local.open[-1][1] = True
        return hook

    handles = [
        handle for name, submodule in model.named_modules()
        for handle in (submodule.register_forward_pre_hook(before), submodule.register_forward_hook(after(name)))
    ]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=cuda), _intra_op_threads(threads), torch.no_grad(), warnings.catch_warnings():
            # A re-entrant checkpoint warns that no input requires grad: true of this search, not of the model.
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad=True", UserWarning)
            forward(model)  # forked: the caller's generators are as they were after this
    finally:
        for handle in handles:
            handle.remove()
    return list(dict.fromkeys(drawing))


def _training_flag_off(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """``model`` with the training flag of each named module off: its own, not its children's."""
    for name in names:
        model.get_submodule(name).training = False
    return model


# --------------------------------------------------------------------------------------------------
# Batch statistics: which differences from the full batch they explain
# --------------------------------------------------------------------------------------------------


def _batch_statistics_layers(model: nn.Module, batch_dependent: tuple[type, ...]) -> dict[str, nn.Module]:
    """The layers known to compute statistics over the batch, by name, in module order."""
    return {
        name: layer for name, layer in model.named_modules()
        if isinstance(layer, (_BatchNorm, *batch_dependent)) or (isinstance(layer, _InstanceNorm) and layer.track_running_stats)
    }


def _normalizes_over_the_batch(layer: nn.Module, batch_dependent: tuple[type, ...]) -> bool:
    """Whether the layer's *output* depends on the batch (InstanceNorm's only averages its running statistics).

    BatchNorm uses the batch's statistics in training mode, and in eval mode when it keeps no
    running statistics (``bn_training`` in torch's ``_BatchNorm.forward``).
    """
    if isinstance(layer, batch_dependent):
        return True
    return isinstance(layer, _BatchNorm) and (layer.training or layer.running_mean is None)


def _against_the_full_batch(
    chunked: tuple[nn.Module, Any],
    full: tuple[nn.Module, Any],
    batch_dependent: tuple[type, ...],
    on_running_statistics: Callable[[Sequence[str]], tuple[tuple[nn.Module, Any], tuple[nn.Module, Any]]],
    rtol: float,
) -> tuple[list[Check], list[Check], list[str]]:
    """The chunked reference against the full batch: the checks explained (or agreeing), the
    failures, and the names of the batch-statistics layers that explain a difference.

    ``on_running_statistics(names)`` runs both again with the named BatchNorm layers on running
    statistics, to tell their effect on outputs and gradients from any other batch dependence.
    """
    layers = _batch_statistics_layers(full[0], batch_dependent)
    normalizing = [name for name, layer in layers.items() if _normalizes_over_the_batch(layer, batch_dependent)]
    explained, failures = _attribute(_compare_runs(chunked, full, FULL_BATCH, rtol), layers, normalizing)
    named_types = any(isinstance(layer, batch_dependent) for layer in layers.values())
    if any(not c.ok and c.kind != "buffer" for c in explained) and not named_types:
        # Only BatchNorm is left to explain outputs and gradients: with it on running statistics in
        # both runs, whatever still differs has another cause.
        still = [c for c in _compare_runs(*on_running_statistics(normalizing), FULL_BATCH, rtol) if not c.ok and c.kind != "buffer"]
        for check in still:
            check.note = ("differs from the full batch with every BatchNorm on running statistics too: "
                          "forward depends on the batch through something else")
        if still:
            explained = [c for c in explained if c.ok or c.kind == "buffer"]
            failures.extend(still)
    causes = {name for c in explained if not c.ok for name in _causes(c, layers, normalizing)}
    return explained, failures, [name for name in layers if name in causes]


def _attribute(checks: list[Check], layers: dict[str, nn.Module], normalizing: list[str]) -> tuple[list[Check], list[Check]]:
    """The chunked reference against the full batch, split into explained (or agreeing) and failures."""
    explained, failures = [], []
    for check in checks:
        causes = [] if check.ok else _causes(check, layers, normalizing)
        if check.ok:
            explained.append(check)
        elif causes:
            check.note = f"batch statistics of {_listed(causes)}"
            explained.append(check)
        elif check.kind == "parameter":
            check.note = _CHANGED_BY_FORWARD
            failures.append(check)
        elif check.note.startswith("shape") and ":" in check.note:  # an explained change of shape: kept
            failures.append(check)
        else:
            check.note = ("differs from the full batch, and belongs to no batch-statistics layer: forward accumulates it "
                          "over the batch, which data parallelism does from chunk 0 alone" if check.kind == "buffer" else
                          "differs from the full batch, and no batch-statistics layer explains it: forward depends on "
                          "the batch (name such a layer type in batch_dependent= if that is intended)")
            failures.append(check)
    return explained, failures


def _causes(check: Check, layers: dict[str, nn.Module], normalizing: list[str]) -> list[str]:
    """The layers whose batch statistics can explain ``check``'s difference from the full batch."""
    if check.kind == "buffer":
        owner = check.name.rpartition(".")[0]
        return [owner] if owner in layers else []
    return normalizing if check.kind in ("output", "gradient") else []


def _on_running_statistics(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """``model`` with each named BatchNorm normalizing by running statistics (fixed ones where it keeps none)."""
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, _BatchNorm):
            if layer.running_mean is None:
                like = next(iter(model.parameters()), None)
                options = {"device": like.device, "dtype": like.dtype} if like is not None else {}
                layer.running_mean = torch.zeros(layer.num_features, **options)
                layer.running_var = torch.ones(layer.num_features, **options)
            layer.training = False
    return model


# --------------------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------------------


def _compare(kind: str, name: str, actual: Any, expected: Any, against: str, rtol: float, scale: Optional[float] = None) -> Check:
    """``actual`` against ``expected``: the error relative to ``scale``, by default ``expected``'s largest magnitude."""
    if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor):
        same = type(actual) is type(expected) and actual == expected
        note = "" if same else f"{_describe(actual)} vs {_describe(expected)}"
        return Check(kind, name, against, 0.0 if same else math.inf, 0.0 if same else math.inf, bool(same), note)
    if actual.shape != expected.shape:
        stacked = kind == "output" and actual.dim() == 1 and expected.dim() == 0  # gather stacks 0-dim outputs
        return Check(kind, name, against, math.inf, math.inf, False,
                     f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
                     + (": gather stacks the replicas' 0-dim outputs, one per replica (as stock does); reduce them, "
                        "or return one per row" if stacked else ""))
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.numel() == 0:
        return Check(kind, name, against, 0.0, 0.0, True)
    # Equal entries count as no error, infinities in the same places too (a masked logit's -inf): inf - inf is NaN.
    # A NaN is equal to nothing, and fails. The scale is the largest finite magnitude.
    abs_error = torch.where(a == e, 0.0, a - e).abs().max().item()
    rel_error = abs_error / max(scale if scale is not None else _largest_finite(e), 1e-300)
    if math.isnan(abs_error):
        return Check(kind, name, against, math.nan, math.nan, False, "NaN")
    return Check(kind, name, against, abs_error, rel_error, rel_error <= rtol or abs_error == 0.0)


def _largest_finite(tensor: torch.Tensor) -> float:
    finite = tensor[tensor.isfinite()]
    return finite.abs().max().item() if finite.numel() else 0.0


def _describe(value: Any) -> str:
    """``value`` for a message: its repr where that is short (``8``, ``tensor(8.)``), else its type (and shape)."""
    if isinstance(value, torch.Tensor) and (value.numel() > 8 or len(repr(value)) >= 40):
        return f"a tensor {tuple(value.shape)}"
    return f"{value!r}" if len(repr(value)) < 40 else f"a {type(value).__name__}"


def _layer_scales(grads: dict[str, Optional[torch.Tensor]]) -> dict[str, float]:
    """The largest gradient magnitude of each layer (the module that holds the parameters): see the module docstring."""
    scales: dict[str, float] = {}
    for name, grad in grads.items():
        layer = name.rpartition(".")[0]
        magnitude = _largest_finite(grad.detach().double()) if isinstance(grad, torch.Tensor) else 0.0
        scales[layer] = max(scales.get(layer, 0.0), magnitude)
    return scales


def _compare_runs(parallel: tuple[nn.Module, Any], other: tuple[nn.Module, Any], against: str, rtol: float) -> list[Check]:
    (model, output), (other_model, other_output) = parallel, other
    # Inside the objects gather rebuilds from their items too (a DynamicCache): item by item, as they are joined.
    found, expected = leaves(output, "output", by_items=True), leaves(other_output, "output", by_items=True)
    if against == FULL_BATCH:  # only the numbers: gather turns a replica's string into a list of them
        found = {p: v for p, v in found.items() if isinstance(v, torch.Tensor)}
        expected = {p: v for p, v in expected.items() if isinstance(v, torch.Tensor)}
    checks = [
        _compare("output", path, found.get(path, "<missing>"), expected.get(path, "<missing>"), against, rtol)
        for path in list(expected) + [p for p in found if p not in expected]
    ]
    grads = {name: p.grad for name, p in other_model.named_parameters()}
    scales = _layer_scales(grads)
    for name, param in model.named_parameters():
        expected_grad = grads[name]
        scale = scales[name.rpartition(".")[0]] if isinstance(expected_grad, torch.Tensor) else None
        checks.append(_compare("gradient", name, param.grad, expected_grad, against, rtol, scale))
    buffers = dict(other_model.named_buffers())
    for name, buf in model.named_buffers():
        checks.append(_compare("buffer", name, buf, buffers[name], against, rtol))
    # No optimizer steps in any run: a parameter that is not where every run started was changed by forward.
    params = dict(other_model.named_parameters())
    for name, param in model.named_parameters():
        check = _compare("parameter", name, param, params[name], against, rtol)
        if not check.ok:
            check.note = _CHANGED_BY_FORWARD
            checks.append(check)
    return checks


_CHANGED_BY_FORWARD = (
    "changed by forward (verify runs no optimizer step), and not alike: an update of a parameter inside forward (a "
    "moving-average copy) runs once per replica on the original's memory, or on nothing where it loops over a "
    "replica's parameters(), which are plain attributes there; update it outside forward, after the optimizer's step")


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


def _compare_state(parallel: nn.Module, full: nn.Module, rtol: float) -> list[Check]:
    """Python attributes of every sub-module after the step, against the plain full-batch run.

    ``forward`` runs on replicas, which are shallow copies: an attribute it assigns is lost, and a
    shared list it appends to sees every replica. Plain values are compared by ``==``; tensors kept
    as plain attributes (``self.seen = torch.zeros(())``, neither parameter nor buffer, which live
    in ``_parameters`` and ``_buffers``) within ``rtol``, as buffers are: reassigned by ``forward``
    (``self.seen = self.seen + n``), such a tensor is lost on a replica just as an int is. Other
    objects are not compared. One row for all the attributes that agree, one per attribute that
    does not.
    """
    compared, checks = 0, []
    for (name, module), (_, reference) in zip(parallel.named_modules(), full.named_modules()):
        for key, value in vars(reference).items():
            is_tensor = isinstance(value, torch.Tensor)
            if key.startswith("_") or key == "training" or not (is_tensor or _plain(value)):
                continue
            compared += 1
            found = vars(module).get(key, "<missing>")
            where = f"{name}.{key}" if name else key
            if is_tensor:
                check = _compare("state", where, found, value, FULL_BATCH, rtol)
                if not check.ok:
                    check.note = f"{_describe(found)} under data parallelism, {_describe(value)} on one device"
                    checks.append(check)
            elif found != value:
                checks.append(Check("state", where, FULL_BATCH, math.inf, math.inf, False,
                                    f"{found!r} under data parallelism, {value!r} on one device"))
    same = compared - len(checks)
    return [Check("state", f"{same} attribute{'' if same == 1 else 's'}", FULL_BATCH, 0.0, 0.0, True)] + checks
