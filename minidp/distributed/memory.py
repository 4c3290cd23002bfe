"""What one rank holds, in bytes: the ledger that shows what sharding saves.

Between steps a rank of DistributedDataParallel holds the whole model three or four times over:
its parameters, their gradients, the optimizer's state (SGD's momentum: one more copy; Adam's two
moments: two), and DDP's gradient buckets (one more copy of the gradients, unless
``gradient_as_bucket_view``). A rank of :func:`~minidp.distributed.fully_shard` holds 1/W of each
(its padded shard), and for a while in each step the parameters of the groups it has gathered, the
buffers of their all-gathers (until copied out; a prefetched one from its launch) and the buffers of the
reduce-scatters under way ("transient"); between backwards that do not synchronise
(``set_requires_gradient_sync(False)``), every whole gradient.

Every figure counts storages, each once: what a tensor holds is its whole storage (a shard's ``.grad`` is a view of
its group's padded reduce-scatter output, so the padding rows are held too), and a storage two figures could claim is
counted in the first only (with ``gradient_as_bucket_view`` every ``.grad`` is a view of its bucket: gradients, and no
bucket bytes on top).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..comm import storage_bytes
from .ddp import DistributedDataParallel
from .fully_shard import sharded_groups
from .zero import optimizer_state_bytes


def memory_ledger(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
    """This rank's bytes: ``parameters``, ``gradients``, ``optimizer_state``, ``gathered`` (now),
    ``buckets`` (DDP's, those no ``.grad`` is a view of), ``transient_peak`` (the highest bytes of gathered
    parameters, all-gather and reduce-scatter buffers held at once in the last step; DDP's buckets) and
    ``total_peak`` (the steady ones plus it).

    ``model``: a module ``fully_shard`` was applied to (its root), a minidp
    :class:`DistributedDataParallel`, or a plain module; ``optimizer``: any, a
    :class:`~minidp.distributed.ZeroRedundancyOptimizer` too. Each figure is the storages held (a shard and its
    gradient count with their padding), each storage counted once (see the module docstring).
    """
    groups = sharded_groups(model)
    padded = {id(p.shard): p.padded for g in groups for p in g.params}
    params = list(model.parameters())
    counted: set = set()
    ledger = {
        "parameters": storage_bytes((padded.get(id(p), p) for p in params), counted),
        # and the whole gradients unsynchronised backwards keep on the whole parameters, off the module once resharded
        "gradients": storage_bytes([p.grad for p in params] + [
            p.full.grad for g in groups if not g.gathered for p in g.params if p.full is not None] + [
            p.accumulated for g in groups for p in g.params], counted),
        "optimizer_state": 0 if optimizer is None else optimizer_state_bytes(optimizer),
        "gathered": sum(g.gathered_bytes() for g in groups),
        "buckets": storage_bytes([b.buffer for b in model.reducer.buckets], counted)
        if isinstance(model, DistributedDataParallel) else 0,
    }
    iteration = groups[0].iteration if groups else None
    ledger["transient_peak"] = iteration.peak_transient if iteration is not None else ledger["buckets"]
    ledger["total_peak"] = ledger["parameters"] + ledger["gradients"] + ledger["optimizer_state"] + ledger["transient_peak"]
    return ledger


def format_ledgers(ledgers: dict[str, dict[str, int]]) -> str:
    """Ledgers side by side (a column each, in KiB), with each row's ratio to the first column."""
    names = list(ledgers)
    rows = ["parameters", "gradients", "optimizer_state", "gathered", "buckets", "transient_peak", "total_peak"]
    lines = [f"{'bytes per rank (KiB)':<22}" + "".join(f"{n:>16}" for n in names) + f"{'ratio':>10}"]
    for row in rows:
        values = [ledgers[n][row] for n in names]
        ratio = f"{values[-1] / values[0]:.2f}" if values[0] else "-"
        lines.append(f"{row:<22}" + "".join(f"{v / 1024:>16.1f}" for v in values) + f"{ratio:>10}")
    return "\n".join(lines)
