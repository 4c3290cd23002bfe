"""Rank 0's (or another rank's) parameters and buffers, copied into every rank's tensors in place.

DDP broadcasts the parameters and buffers once at construction (``_sync_module_states``) and the
buffers again before every forward that follows a synchronised one (``_sync_buffers``), so that
BatchNorm's running statistics are rank 0's everywhere. Both go through
``dist._broadcast_coalesced``: the tensors flattened into one buffer per dtype and device, one
broadcast each. This is the same in Python.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with rank 0's values (a collective)."""
    broadcast_from(tensors, group, 0)


def broadcast_from(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, rank: int) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with those of ``rank`` (its rank in ``group``).

    The broadcast values are copied back on every rank, ``rank`` too, as ``dist._broadcast_coalesced`` copies them:
    so a tensor no copy can write (a buffer made by ``expand``, whose elements share memory) fails on every rank
    alike, after the collective, rather than on the receiving ones only while ``rank`` goes on to its next collective
    alone. Each copy (of a tensor with elements) is an in-place write: it moves the tensor's version counter, as
    torch's moves it at construction (a graph recorded through a parameter before it was wrapped and overwritten then
    fails autograd's check, not back-propagates through rank 0's values); the forward's buffer sync keeps them, as
    torch's does (``torch.autograd._unsafe_preserve_version_counter`` around the call:
    ``DistributedDataParallel._sync_buffers``).
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t.detach())
    with torch.no_grad():
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            dist.broadcast(flat, group=group, group_src=rank)
            pieces = flat.split([t.numel() for t in members])
            filled = [t for t in members if t.numel()]  # torch's writes no empty tensor: its version stays
            if filled:
                torch._foreach_copy_(filled, [piece.view_as(t) for piece, t in zip(pieces, members) if t.numel()])
