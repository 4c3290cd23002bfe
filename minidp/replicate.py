"""Step 2, replicate: one copy of the module per device, whose gradients flow back to the original.

A replica is a shallow copy of every sub-module (``Module._replicate_for_data_parallel``: same class,
same attributes and hooks, its own ``_parameters``, ``_buffers`` and ``_modules`` dicts), wired into
the same tree, with each parameter and buffer replaced by that device's copy.

What moves: the parameters and buffers, once to every device other than the module's own. A replica
on the module's own device copies no parameter: it reads the original storage.

What autograd records: the parameters reach the replicas through :class:`Broadcast`, one autograd
node for all of them. Its backward is step 5, the reduction: it sums the gradient each replica
produced for each parameter, in replica order, onto the module's device, and autograd adds that
sum into the original parameter's ``.grad`` once. So replica parameters are not leaves (they have
no ``.grad`` of their own) and ``replica.parameters()`` is empty, as in stock.

Buffers (BatchNorm's running statistics, say) are not differentiated. Replica 0 shares the
original's buffers, so its in-place updates persist; every other replica works on its own copy,
whose updates are dropped. That is stock's behaviour: running statistics come from chunk 0.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from . import comm
from .devices import DeviceLike, as_devices
from .trace import traced


class Broadcast(torch.autograd.Function):
    """Forward: ``tensors`` onto each device. Backward: the replicas' gradients summed onto the source.

    Outputs are device-major: ``[device 0: t0, t1, ..., device 1: t0, t1, ...]``.
    """

    @staticmethod
    def forward(ctx, devices: list[torch.device], reduce_backend: Optional[str], *tensors: torch.Tensor):
        ctx.source_device = tensors[0].device
        ctx.num_tensors = len(tensors)
        ctx.reduce_backend = reduce_backend
        # On the source device broadcast returns the tensors themselves; autograd turns an input that a
        # Function returns as-is into a view of it: the same storage, with this node as its grad_fn.
        outputs = [t for copies in comm.broadcast_coalesced(tensors, devices) for t in copies]
        ctx.mark_non_differentiable(*[o for o, t in zip(outputs, tensors * len(devices)) if not t.requires_grad])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        n = ctx.num_tensors
        needed = [i for i in range(n) if ctx.needs_input_grad[2 + i]]  # frozen parameters need no sum
        per_replica = [[grads[start + i] for i in needed] for start in range(0, len(grads), n)]
        sums = comm.reduce_add_coalesced(per_replica, ctx.source_device, backend=ctx.reduce_backend)
        result: list[Optional[torch.Tensor]] = [None] * n
        for i, total in zip(needed, sums):
            result[i] = total
        return (None, None, *result)


def check_module_device(network: nn.Module, source_device: torch.device) -> None:
    """Raise unless every parameter and buffer of ``network`` is initialised and on ``source_device``."""
    for name, tensor in list(network.named_parameters()) + list(network.named_buffers()):
        if isinstance(tensor, nn.parameter.UninitializedParameter) or isinstance(tensor, nn.parameter.UninitializedBuffer):
            raise RuntimeError(
                f"'{name}' is not initialized yet (a lazy module): run one forward pass on the original "
                f"module before replicating it"
            )
        if tensor.device != source_device:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {source_device} (device_ids[0]) "
                f"but '{name}' is on {tensor.device}. Move the module first, e.g. model.to('{source_device}')."
            )


def _copy_buffers(
    buffers: list[torch.Tensor], devices: list[torch.device], source_device: torch.device
) -> list[list[torch.Tensor]]:
    """Per device, the buffers to install: the originals for replica 0, private copies for the rest."""
    per_device = comm.broadcast_coalesced(buffers, devices)
    return [
        list(buffers) if replica == 0 else [b.clone() if b is original else b for b, original in zip(copies, buffers)]
        for replica, copies in enumerate(per_device)
    ]


@traced("replicate")
def replicate(
    network: nn.Module,
    devices: Sequence[DeviceLike],
    detach: bool = False,
    *,
    reduce_backend: Optional[str] = None,
) -> list[nn.Module]:
    """Return one replica of ``network`` per entry of ``devices`` (repeats allowed), in order.

    ``network``'s parameters and buffers must be on ``devices[0]``. With ``detach=True`` (what
    ``DataParallel`` uses under ``torch.no_grad()``) the replicas are cut from autograd.
    ``reduce_backend`` picks how the backward sums gradients (see :func:`minidp.comm.set_reduce_backend`).
    """
    devices = as_devices(devices, "devices")
    if not devices:
        return []
    source_device = devices[0]
    check_module_device(network, source_device)

    params = list(network.parameters())
    param_copies = _broadcast_parameters(params, devices, detach, reduce_backend)

    buffers = list(network.buffers())
    differentiable = [b for b in buffers if b.requires_grad and not detach]
    plain = [b for b in buffers if not (b.requires_grad and not detach)]
    buffer_copies = {id(b): [] for b in buffers}
    for group, copies in (
        (differentiable, _broadcast_parameters(differentiable, devices, detach, reduce_backend)),
        (plain, _copy_buffers(plain, devices, source_device)),
    ):
        for b_index, b in enumerate(group):
            buffer_copies[id(b)] = [copies[d][b_index] for d in range(len(devices))]

    modules = list(network.modules())
    module_index = {id(m): i for i, m in enumerate(modules)}
    param_index = {id(p): i for i, p in enumerate(params)}
    replicas = [[m._replicate_for_data_parallel() for m in modules] for _ in devices]
    for d, replica_modules in enumerate(replicas):
        for module, replica in zip(modules, replica_modules):
            for key, child in module._modules.items():
                setattr(replica, key, None if child is None else replica_modules[module_index[id(child)]])
            for key, param in module._parameters.items():
                # A plain tensor set under a name no longer in `_parameters` becomes an attribute.
                setattr(replica, key, None if param is None else param_copies[d][param_index[id(param)]])
            for key, buf in module._buffers.items():
                replica._buffers[key] = None if buf is None else buffer_copies[id(buf)][d]
    return [replica_modules[0] for replica_modules in replicas]


def _broadcast_parameters(
    tensors: list[torch.Tensor], devices: list[torch.device], detach: bool, reduce_backend: Optional[str]
) -> list[list[torch.Tensor]]:
    """Per device, a copy (or a view, on the source device) of each tensor; differentiable unless ``detach``."""
    if not tensors:
        return [[] for _ in devices]
    if detach:
        return [[t.detach() for t in copies] for copies in comm.broadcast_coalesced(tensors, devices)]
    flat = Broadcast.apply(devices, reduce_backend, *tensors)
    n = len(tensors)
    return [list(flat[i : i + n]) for i in range(0, len(flat), n)]
