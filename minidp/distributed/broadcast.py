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

from .groups import rank_in


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with rank 0's values (a collective)."""
    broadcast_from(tensors, group, 0)


def broadcast_from(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, rank: int) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with those of ``rank`` (its rank in ``group``).

    Version counters are preserved, as DDP preserves them for buffers: a buffer that an earlier
    forward saved for its backward, not yet run, must not fail autograd's version check because
    rank 0's value was copied over it.
    """
    receiving = rank_in(group) != rank
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t.detach())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(tensors)):
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            dist.broadcast(flat, group=group, group_src=rank)
            if receiving:
                torch._foreach_copy_(members, [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in members]), members)])
