"""The cases the differential tests run, and how their results are compared.

The reference itself (what stock ``DataParallel`` computes on n GPUs, on one device, chunk by chunk)
is :func:`minidp.reference.chunked_reference`; ``test_against_stock`` checks it against stock.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import minidp
from .helpers import RTOL_FLOAT64, max_relative_error
from minidp import zoo
from minidp.nested import map_tensors, tensors_in
from minidp.reference import chunked_reference
from minidp.zoo import ZOO
from .stock_emulation import emulated_stock, swapped

# (replicas, rows): even and uneven batches; 5 rows on 4 replicas use 3, 2 rows on 4 use 2.
SPLITS = [(1, 6), (2, 6), (3, 10), (4, 10), (4, 5), (4, 2)]

Call = Callable[[nn.Module, tuple, dict], Any]


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
# the reference, as a call
# --------------------------------------------------------------------------------------------------


def plain_data_parallel(module: nn.Module, inputs: Any, device_ids=None, output_device=None, dim=0, module_kwargs=None):
    """What ``data_parallel`` computes, on one device: the module applied to the whole input."""
    return module(*(inputs if isinstance(inputs, tuple) else (inputs,)), **(module_kwargs or {}))


def reference_call(replicas: int, dim: int) -> Call:
    """The reference as a ``Call``; a model that parallelises its own parts calls them plainly."""

    def call(model, args, kwargs):
        with swapped(zoo, "data_parallel", plain_data_parallel):
            return chunked_reference(model, args, kwargs, replicas, dim)

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


def wrapped_call(case: Case, wrapper: type, device_ids: list) -> Call:
    """Run the case's model under ``wrapper`` (a DataParallel class) on ``device_ids``; a model
    that parallelises its own parts is given the ids instead."""

    def call(model, args, kwargs):
        if case.parallelises_itself:
            model.device_ids = device_ids
            return model(*args, **kwargs)
        return wrapper(model, device_ids, dim=case.dim)(*args, **kwargs)

    return call


def minidp_forward_backward(case: Case, device_ids: list) -> Result:
    return forward_backward(case, wrapped_call(case, minidp.DataParallel, device_ids))


def stock_forward_backward(case: Case, device_ids: list, emulate: bool = True) -> Result:
    """Stock DataParallel (in the VGG model: stock data_parallel), forward and backward; integer ``device_ids`` are
    "GPUs" that are the CPU, under the emulation (``emulate=False``: stock as it runs on this machine)."""
    with emulated_stock() if emulate else contextlib.nullcontext():
        with swapped(zoo, "data_parallel", nn.parallel.data_parallel):
            return forward_backward(case, wrapped_call(case, nn.DataParallel, device_ids))


def tensor_leaves(obj: Any) -> dict[str, torch.Tensor]:
    """Every tensor inside ``obj``, by its path."""
    return dict(tensors_in(obj, "output"))


def assert_tensors_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str,
                         exact: bool = False) -> None:
    """Equal keys, shapes, dtypes and devices; floating-point values to float64 rounding, or bit for bit (``exact``)."""
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual)} != {sorted(expected)}"
    for key in expected:
        a, e = actual[key], expected[key]
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what} {key}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        assert a.device == e.device, f"{what} {key}: on {a.device}, expected {e.device}"
        if e.is_floating_point() and not exact:
            error = max_relative_error(a, e)
            assert error <= RTOL_FLOAT64, f"{what} {key}: relative error {error:.3g} > {RTOL_FLOAT64}"
        else:
            assert torch.equal(a, e), f"{what} {key}: {a} != {e}"


def assert_same_results(actual: Result, expected: Result, compare_non_tensors: bool = True, exact: bool = False) -> None:
    """Outputs, every parameter's gradient and every buffer agree to float64 rounding, or bit for bit (``exact``)."""
    if compare_non_tensors:
        assert _skeleton(actual.output) == _skeleton(expected.output)
    assert_tensors_close(tensor_leaves(actual.output), tensor_leaves(expected.output), "output", exact)
    assert_tensors_close(actual.grads, expected.grads, "gradient of", exact)
    assert_tensors_close(actual.buffers, expected.buffers, "buffer", exact)


def _skeleton(obj: Any) -> Any:
    """``obj`` with its tensors replaced by a marker: the structure and non-tensor values."""
    return map_tensors(lambda t: "<tensor>", obj)
