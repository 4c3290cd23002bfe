"""Run stock ``torch.nn.parallel`` on the CPU, so minidp can be compared with it on any machine.

Stock ``DataParallel``, ``data_parallel``, ``replicate``, ``scatter``, ``gather`` and
``parallel_apply`` are Python code that bottoms out in a few CUDA-only calls. Inside
:func:`emulated_stock`, integer device ids stand for "GPUs" that are really the CPU, and each of
those calls is replaced by what it computes, on CPU tensors:

============================================  ================================================
CUDA-only piece                                stand-in
============================================  ================================================
``torch._C._scatter``                          ``torch.chunk`` / ``split`` (views, as on the
                                               source GPU)
``torch._C._gather``                           ``torch.cat``
``torch._C._broadcast_coalesced``              the tensors themselves for the first id, fresh
                                               copies for the others (as for distinct GPUs)
``comm.reduce_add``                            stock's non-NCCL sum: first input + the others,
                                               in order
forwards of ``Scatter`` / ``Gather`` /         the same bookkeeping without the "not implemented
``Broadcast`` (they refuse CPU tensors)        for CPU tensors" check and without copy streams;
                                               their *backwards* and ``ReduceAddCoalesced`` stay
                                               stock
``torch.accelerator`` queries                  a CPU "accelerator" with no-op streams
device type discovery in ``data_parallel``     ``"cpu"``, with ``num_gpus`` devices
the placement check of ``DataParallel``        skipped: it compares with a CUDA device, and every
                                               tensor lives on the CPU here
============================================  ================================================

Everything else that runs is stock: structure walking in scatter/gather, kwargs padding, the
replica tree, threads in parallel_apply, the coalescing and ordering in ``reduce_add_coalesced``,
and autograd's wiring of the backward. Every patch is undone when the block exits.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Any, Iterator

import torch

# The submodules, not the functions the package re-exports under the same names.
stock_comm = importlib.import_module("torch.nn.parallel.comm")
stock_functions = importlib.import_module("torch.nn.parallel._functions")
stock_scatter_gather = importlib.import_module("torch.nn.parallel.scatter_gather")
stock_data_parallel_module = importlib.import_module("torch.nn.parallel.data_parallel")


def _c_scatter(tensor, devices, chunk_sizes, dim, streams):
    if chunk_sizes is None:
        return tensor.chunk(len(devices), dim)
    return tensor.split(list(chunk_sizes), dim)


def _c_gather(tensors, dim, destination):
    return torch.cat(list(tensors), dim)


def _c_broadcast_coalesced(tensors, devices, buffer_size):
    return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]


def _reduce_add(inputs, destination=None):
    if len(inputs) == 1:
        return inputs[0]
    result = inputs[0] + inputs[1]
    for other in inputs[2:]:
        result.add_(other)
    return result


class _Broadcast(stock_functions.Broadcast):
    @staticmethod
    def forward(ctx, target_gpus, *inputs):
        ctx.target_gpus = list(target_gpus)
        if not inputs:
            return ()
        ctx.num_inputs = len(inputs)
        ctx.input_device = inputs[0].get_device()
        outputs = stock_comm.broadcast_coalesced(inputs, ctx.target_gpus)
        ctx.mark_non_differentiable(
            *[copies[i] for i, needs_grad in enumerate(ctx.needs_input_grad[1:]) if not needs_grad for copies in outputs]
        )
        return tuple(t for copies in outputs for t in copies)


class _Gather(stock_functions.Gather):
    @staticmethod
    def forward(ctx, target_device, dim, *inputs):
        ctx.target_device = target_device
        ctx.dim = dim
        ctx.input_gpus = tuple(i.get_device() for i in inputs)
        ctx.unsqueezed_scalar = dim == 0 and all(t.dim() == 0 for t in inputs)
        if ctx.unsqueezed_scalar:
            inputs = tuple(t.view(1) for t in inputs)
            warnings.warn(
                "Was asked to gather along dimension 0, but all input tensors were scalars; "
                "will instead unsqueeze and return a vector.",
                stacklevel=2,
            )
        ctx.input_sizes = tuple(i.size(dim) for i in inputs)
        return torch.cat(inputs, dim)


class _Scatter(stock_functions.Scatter):
    @staticmethod
    def forward(ctx, target_gpus, chunk_sizes, dim, input):
        ctx.dim = dim
        ctx.input_device = input.get_device()
        return stock_comm.scatter(input, list(target_gpus), chunk_sizes, dim)


class _Stream:
    """A stream that orders nothing: every "device" is the CPU, which runs kernels in order."""

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None


@contextlib.contextmanager
def swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name = value`` for the duration of the block; restore (or delete) it afterwards."""
    missing = object()
    old = obj.__dict__.get(name, missing) if hasattr(obj, "__dict__") else getattr(obj, name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


@contextlib.contextmanager
def emulated_stock(num_gpus: int = 4) -> Iterator[None]:
    """Within the block, stock ``torch.nn.parallel`` runs on the CPU with ids ``0..num_gpus-1``.

    Ids may repeat (``[0, 0, 0]``); every id is "a GPU" whose tensors are CPU tensors.
    """
    swaps = [
        (torch._C, "_scatter", _c_scatter),
        (torch._C, "_gather", _c_gather),
        (torch._C, "_broadcast_coalesced", _c_broadcast_coalesced),
        (stock_comm, "reduce_add", _reduce_add),
        (stock_functions, "Broadcast", _Broadcast),
        (stock_functions, "Gather", _Gather),
        (stock_functions, "Scatter", _Scatter),
        (stock_scatter_gather, "Gather", _Gather),
        (stock_scatter_gather, "Scatter", _Scatter),
        (torch.accelerator, "is_available", lambda: True),
        (torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cpu")),
        (torch.accelerator, "current_stream", lambda device=None: _Stream()),
        (torch.accelerator, "device_index", lambda device: contextlib.nullcontext()),
        (stock_data_parallel_module, "_get_available_device_type", lambda: "cpu"),
        (stock_data_parallel_module, "_get_all_device_indices", lambda: list(range(num_gpus))),
        (stock_data_parallel_module, "chain", lambda *tensor_lists: iter(())),
    ]
    with contextlib.ExitStack() as stack:
        for obj, name, value in swaps:
            stack.enter_context(swapped(obj, name, value))
        yield
