"""The single-device reference: what data parallelism must compute, written without any parallelism.

:func:`chunked_reference` runs a module the way ``DataParallel`` runs it on K replicas, but on one
device and one chunk after the other:

1. the batch is cut by :func:`minidp.scatter_kwargs`, so the chunks are exactly the replicas' chunks
   (``torch.chunk``'s sizes, or ``chunk_sizes``), here all on the module's own device (views);
2. chunk 0 runs on the module itself, so buffers that a forward updates in place (BatchNorm's running
   statistics) change from chunk 0 only, as they do under data parallelism, where replica 0 shares
   the original's buffers;
3. every other chunk runs with the same parameters but private copies of the buffers, taken before
   chunk 0 runs (``torch.func.functional_call``), as replicas 1.. run on private copies;
4. the chunk outputs are joined by :func:`minidp.gather`, as the replicas' outputs are; with one
   chunk, the output is returned as it is (``DataParallel`` on one device does not gather).

Autograd records the plain single-device graph: one loss on the joined output sends every chunk's
gradient into the original parameters, where they add up. :func:`minidp.verify` compares a
parallel run with this reference, and the tests check the reference itself against stock
``torch.nn.DataParallel`` (run on the CPU through the tests' emulation of its CUDA calls).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call

from .step1_scatter import scatter_kwargs
from .step4_gather import gather


def module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s first parameter or buffer lives (the CPU for a module without tensors)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def chunked_reference(
    module: nn.Module,
    inputs: tuple,
    kwargs: Optional[dict[str, Any]] = None,
    replicas: int = 2,
    dim: int = 0,
    chunk_sizes: Optional[Sequence[int]] = None,
) -> Any:
    """``module(*inputs, **kwargs)`` computed as ``DataParallel`` on ``replicas`` devices computes it, on one device."""
    device = module_device(module)
    chunk_inputs, chunk_kwargs = scatter_kwargs(inputs, kwargs, [device] * replicas, dim, chunk_sizes)
    if not chunk_inputs:  # no arguments at all: one call, as DataParallel makes
        chunk_inputs, chunk_kwargs = ((),), ({},)
    parameters = dict(module.named_parameters())
    private_buffers = [{name: b.clone() for name, b in module.named_buffers()} for _ in chunk_inputs[1:]]
    outputs = [module(*chunk_inputs[0], **chunk_kwargs[0])]
    for args, chunk_kw, buffers in zip(chunk_inputs[1:], chunk_kwargs[1:], private_buffers):
        outputs.append(functional_call(module, {**parameters, **buffers}, tuple(args), chunk_kw))
    return outputs[0] if replicas == 1 else gather(outputs, device, dim)
