"""Run stock ``torch.nn.parallel.replicate`` on the CPU, to time its own Python code.

Stock replicate needs two CUDA-only pieces: the C++ ``torch._C._broadcast_coalesced`` and the
``Broadcast`` autograd Function (whose forward refuses CPU tensors). :func:`stock_replicate_on_cpu`
swaps in CPU stand-ins for exactly those two while it runs, doing what the CUDA versions do to
the data (device 0: the tensors themselves; every other device: fresh copies; backward: the sum),
and runs everything else, the Python that builds the replicas, unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

import torch
from torch import nn

# the modules, not the functions of the same names that shadow them in `torch.nn.parallel`
stock_replicate_module = importlib.import_module("torch.nn.parallel.replicate")
stock_functions = importlib.import_module("torch.nn.parallel._functions")  # replicate imports Broadcast from here


def _broadcast_coalesced(tensors, devices, buffer_size=0):
    return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, target_gpus, *inputs):
        ctx.num_inputs = len(inputs)
        outputs = [t for copies in _broadcast_coalesced(inputs, target_gpus) for t in copies]
        ctx.mark_non_differentiable(*[o for o, t in zip(outputs, inputs * len(target_gpus)) if not t.requires_grad])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.num_inputs
        sums = [sum(grads[i::n][1:], grads[i].clone()) for i in range(n)]
        return (None, *sums)


@contextlib.contextmanager
def _cpu_stand_ins() -> Iterator[None]:
    saved = (getattr(torch._C, "_broadcast_coalesced", None), stock_functions.Broadcast)
    torch._C._broadcast_coalesced = _broadcast_coalesced
    stock_functions.Broadcast = _Broadcast
    try:
        yield
    finally:
        stock_functions.Broadcast = saved[1]
        if saved[0] is None:
            del torch._C._broadcast_coalesced
        else:
            torch._C._broadcast_coalesced = saved[0]


def stock_replicate_on_cpu(network: nn.Module, replicas: int) -> list[nn.Module]:
    """Stock ``replicate(network, [0] * replicas)``, its CUDA calls done on the CPU."""
    with _cpu_stand_ins():
        return stock_replicate_module.replicate(network, [0] * replicas)
