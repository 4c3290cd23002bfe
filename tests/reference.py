"""The single-device reference that data parallelism must reproduce, and the cases it is checked on.

What stock ``DataParallel`` computes on n GPUs, written without any parallel machinery: cut the
batch as ``torch.chunk`` cuts it, run the module on chunk 0 (so buffers such as BatchNorm's running
statistics update from chunk 0 only), run it on every other chunk with the same parameters but
private copies of the buffers taken before the step, and concatenate the outputs along ``dim``.
Gradients then flow from one loss on the concatenated output into the original parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from conftest import RTOL_FLOAT64, max_relative_error
from minidp import zoo
from minidp.zoo import ZOO
from stock_emulation import swapped

# (replicas, rows): even and uneven batches; 5 rows on 4 replicas use 3, 2 rows on 4 use 2.
SPLITS = [(1, 6), (2, 6), (3, 10), (4, 10), (4, 5), (4, 2)]

Call = Callable[[nn.Module, tuple, dict], Any]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (inside dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def to_float64(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


@dataclass
class Case:
    """One zoo model with one batch: ``loss(model(*args, **kwargs))`` is what gets differentiated.

    ``parallelises_itself``: the model calls ``data_parallel`` on its parts and reads the device
    ids from ``model.device_ids``, instead of being wrapped.
    """

    name: str
    prototype: nn.Module
    args: tuple
    kwargs: dict
    dim: int
    loss: Callable[[Any], torch.Tensor]
    parallelises_itself: bool = False
    batch: dict = field(default_factory=dict)

    def fresh_model(self) -> nn.Module:
        return copy.deepcopy(self.prototype)


def make_case(name: str, rows: int, generator: torch.Generator, device: str = "cpu") -> Case:
    """The zoo model ``name`` in float64 (random weights) with a fresh random batch of ``rows`` rows."""
    entry = ZOO[name]
    model = entry.build().double().to(device)
    args, kwargs = map_tensors(lambda t: to_float64(t).to(device), entry.batch(rows, generator))
    if name == "cnn":  # the tutorial's dict batches, trained with cross-entropy
        labels = torch.randint(0, 10, (rows,), generator=generator).to(device)
        batch = {"image": args[0], "label": labels}
        return Case(name, model, (batch["image"],), {}, entry.dim, lambda out: F.cross_entropy(out, labels), batch=batch)
    return Case(name, model, args, kwargs, entry.dim, entry.loss, parallelises_itself=name == "vgg_split")


# --------------------------------------------------------------------------------------------------
# the reference computation
# --------------------------------------------------------------------------------------------------


def split_arguments(args: tuple, kwargs: dict, replicas: int, dim: int) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` per chunk: every top-level tensor cut by ``torch.chunk``, the rest repeated."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    count = len(tensors[0].chunk(replicas, dim)) if tensors else 1

    def piece(value: Any, i: int) -> Any:
        return value.chunk(replicas, dim)[i] if isinstance(value, torch.Tensor) else value

    return [(tuple(piece(v, i) for v in args), {k: piece(v, i) for k, v in kwargs.items()}) for i in range(count)]


def concat(outputs: list[Any], dim: int) -> Any:
    """Join per-chunk outputs: tensors concatenated, containers rebuilt, ``None`` kept, others listed."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, concat([o[k] for o in outputs], dim)) for k in first)
    if isinstance(first, (list, tuple)):
        return type(first)(concat(list(parts), dim) for parts in zip(*outputs))
    return list(outputs)


def chunk_by_chunk(module: nn.Module, args: tuple, kwargs: dict, replicas: int, dim: int = 0) -> Any:
    """``module`` applied as stock DataParallel applies it on ``replicas`` devices, on one device."""
    chunks = split_arguments(args, kwargs, replicas, dim)
    params = dict(module.named_parameters())
    # Replicas other than the first get their buffers copied before anyone runs.
    private_buffers = [{n: b.clone() for n, b in module.named_buffers()} for _ in chunks[1:]]
    outputs = [module(*chunks[0][0], **chunks[0][1])]
    for (chunk_args, chunk_kwargs), buffers in zip(chunks[1:], private_buffers):
        outputs.append(functional_call(module, {**params, **buffers}, chunk_args, chunk_kwargs))
    return outputs[0] if replicas == 1 else concat(outputs, dim)  # one device: no gather (docs/stock-behaviour.md B9)


def plain_data_parallel(module: nn.Module, inputs: Any, device_ids=None, output_device=None, dim=0, module_kwargs=None):
    """What ``data_parallel`` computes, on one device: the module applied to the whole input."""
    return module(*(inputs if isinstance(inputs, tuple) else (inputs,)), **(module_kwargs or {}))


def reference_call(replicas: int, dim: int) -> Call:
    """The reference as a ``Call``; a model that parallelises its own parts calls them plainly."""

    def call(model, args, kwargs):
        with swapped(zoo, "data_parallel", plain_data_parallel):
            return chunk_by_chunk(model, args, kwargs, replicas, dim)

    return call


# --------------------------------------------------------------------------------------------------
# running a case and comparing results
# --------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What one forward and backward left behind."""

    output: Any
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def forward_backward(case: Case, call: Call) -> Result:
    """Run ``call`` on a fresh copy of the case's model, backpropagate the case's loss, collect."""
    model = case.fresh_model()
    output = call(model, case.args, case.kwargs)
    case.loss(output).backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{case.name}: parameter {name} received no gradient"
        grads[name] = p.grad.clone()
    return Result(output, grads, {n: b.clone() for n, b in model.named_buffers()})


def tensor_leaves(obj: Any, path: str = "output") -> dict[str, torch.Tensor]:
    """Every tensor inside ``obj``, by its path."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    found: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            found.update(tensor_leaves(v, f"{path}[{k!r}]"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found.update(tensor_leaves(v, f"{path}[{i}]"))
    return found


def assert_tensors_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual)} != {sorted(expected)}"
    for key in expected:
        a, e = actual[key], expected[key]
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what} {key}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        assert a.device == e.device, f"{what} {key}: on {a.device}, expected {e.device}"
        if e.is_floating_point():
            error = max_relative_error(a, e)
            assert error <= RTOL_FLOAT64, f"{what} {key}: relative error {error:.3g} > {RTOL_FLOAT64}"
        else:
            assert torch.equal(a, e), f"{what} {key}: {a} != {e}"


def assert_same_results(actual: Result, expected: Result, compare_non_tensors: bool = True) -> None:
    """Outputs, every parameter's gradient and every buffer agree to float64 rounding."""
    if compare_non_tensors:
        assert _skeleton(actual.output) == _skeleton(expected.output)
    assert_tensors_close(tensor_leaves(actual.output), tensor_leaves(expected.output), "output")
    assert_tensors_close(actual.grads, expected.grads, "gradient of")
    assert_tensors_close(actual.buffers, expected.buffers, "buffer")


def _skeleton(obj: Any) -> Any:
    """``obj`` with its tensors replaced by a marker: the structure and non-tensor values."""
    if isinstance(obj, torch.Tensor):
        return "<tensor>"
    if isinstance(obj, dict):
        return (type(obj), {k: _skeleton(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return (type(obj), [_skeleton(v) for v in obj])
    return obj
