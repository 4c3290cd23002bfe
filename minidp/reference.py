"""The single-device reference: what data parallelism must compute, written without data parallelism's machinery.

:func:`chunked_reference` runs a module the way ``DataParallel`` runs it on K replicas, but on one
device and one chunk after the other (side by side only where layers must meet, below):

1. the batch is cut by :func:`minidp.scatter_kwargs`, so the chunks are exactly the replicas' chunks
   (``torch.chunk``'s sizes, or ``chunk_sizes``), here all on the module's own device (views);
2. chunk 0 runs on the module itself, so buffers that a forward updates in place (BatchNorm's running
   statistics) change from chunk 0 only, as they do under data parallelism, where replica 0 shares
   the original's buffers;
3. every other chunk runs on a copy of the whole module taken before chunk 0 runs
   (:func:`private_copy`): the very same parameters, its own copies of the buffers, as replicas 1..
   hold private copies of the buffers;
4. the chunk outputs are joined by :func:`minidp.gather`, as the replicas' outputs are; with one
   chunk, the output is returned as it is (``DataParallel`` on one device does not gather).

Why whole copies, not the module called with other buffers swapped in for the call
(``torch.func.functional_call``): a layer may run its forward again *in the backward*
(``torch.utils.checkpoint``, re-entrant or not, recomputes what it did not save). That second
forward updates running statistics a second time, long after the call has returned. Under data
parallelism it runs on the replica that ran the first one: replica 0 updates the original's
statistics twice, each other replica its own private copy twice (and drops it). A copy that
outlives the call gets that right; a swap undone when the call returns would send the other
chunks' second updates into the original's buffers.

Layers that meet the other replicas (:class:`minidp.SyncBatchNorm` normalises by the statistics of every chunk)
need every chunk at once: for a module that has one, the chunks run side by side, each in a thread of its own as
member i of one :class:`minidp.replica_group.ReplicaGroup`, in the caller's thread-local state as parallel_apply
carries it (grad mode, inference mode, autocast) and the caller's intra-op thread count; the copies share each
layer's meeting point, as replicas do. That is all the parallelism here: no streams, no replicate, no reduction.

Autograd records the plain single-device graph: one loss on the joined output sends every chunk's
gradient into the original parameters (the copies hold the same parameter tensors), where they add
up. :func:`minidp.verify` compares a parallel run with this reference, and the tests check the
reference itself against stock ``torch.nn.DataParallel`` (run on the CPU through the tests'
emulation of its CUDA calls).
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .replica_group import ReplicaGroup
from .step1_scatter import scatter_kwargs
from .step3_parallel_apply import CallerState
from .step4_gather import gather
from .sync_batchnorm import SyncBatchNorm


def module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s first parameter or buffer lives (the CPU for a module without tensors)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def private_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` that holds ``module``'s own parameters and copies of its buffers.

    The parameters are the same tensors (a gradient computed through the copy lands in the
    original's ``.grad``); each buffer is a ``clone()``, so in-place updates stay in the copy, and a
    buffer that requires grad sends its gradient back to the original's, as a replica's does.
    """
    shared = {id(p): p for p in module.parameters()}
    shared.update({id(b): b.clone() for b in module.buffers()})
    # where the copies of a SyncBatchNorm meet (a replica, a shallow copy, shares the layer's meeting key)
    shared.update({id(m._meeting_key): m._meeting_key for m in module.modules() if isinstance(m, SyncBatchNorm)})
    return copy.deepcopy(module, memo=shared)


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
    copies = [private_copy(module) for _ in chunk_inputs[1:]]  # before chunk 0 changes the buffers
    calls = [functools.partial(m, *args, **kw) for m, args, kw in zip([module, *copies], chunk_inputs, chunk_kwargs)]
    if len(calls) > 1 and any(isinstance(m, SyncBatchNorm) for m in module.modules()):
        outputs = _side_by_side(calls, device)
    else:
        outputs = [call() for call in calls]
    return outputs[0] if replicas == 1 else gather(outputs, device, dim)


def _side_by_side(calls: Sequence[Callable[[], Any]], device: torch.device) -> list[Any]:
    """Every call at once, call i in a thread of its own as member i of one replica group (the module docstring), in
    the caller's grad mode, inference mode, autocast and intra-op thread count."""
    group, threads, caller = ReplicaGroup(len(calls)), torch.get_num_threads(), CallerState(cpu_replicas=0)
    results: list[Any] = [None] * len(calls)
    errors: list[Optional[BaseException]] = [None] * len(calls)

    def run(i: int) -> None:
        torch.set_num_threads(threads)
        try:
            with group.member(i), caller.enter(device, None):
                results[i] = calls[i]()
        except BaseException as error:  # re-raised in the caller's thread
            errors[i] = error

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    first = next((error for error in errors if error is not None), None)
    if first is not None:
        raise first
    return results
