"""Batch normalisation across processes: minidp.SyncBatchNorm's exchange, and torch's SyncBatchNorm refused on the CPU.

:class:`minidp.SyncBatchNorm` combines the per-channel statistics (count, mean, biased variance) of
every replica it is told about (see ``minidp/sync_batchnorm.py``). Inside
``minidp.distributed.DistributedDataParallel`` each such layer is given a :class:`ProcessExchange`:
replica 0 of each process hands it the statistics of the process's replicas, and gets back those of
every replica of every process, in (rank, replica) order, so that each replica normalises by the
statistics of the global batch, which is what ``nn.BatchNorm`` computes on all the ranks' samples.

What moves: per layer and step, one all-reduce of a ``world_size x replicas x 2 x channels`` table in
which each process fills its own rows (the others are zeros), and one of the counts (which also tells every
process whether any records the table's backward: all do, whatever their rows, or none). The table's
all-reduce is differentiable (:class:`_SumOverProcesses`): its backward is the all-reduce of the
gradients, so the gradient of the loss of every rank reaches every rank's inputs through the shared
statistics, as in torch's ``SyncBatchNorm`` backward. With several replicas per process, that backward all-reduce runs
on a process group of its own (:func:`group_for_backwards`). Every process must be given the same number of replicas
(``device_ids``); a process whose batch has fewer rows than that runs fewer, and fills the rows of the others
with a count of 0, which weighs nothing in the combination.

``torch.nn.SyncBatchNorm`` synchronises only GPU inputs; torch DDP refuses it on the CPU at
construction (``_passing_sync_batchnorm_handle``), and so does minidp's wrapper, with torch's words.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import sync_batchnorm
from ..sync_batchnorm import SyncBatchNorm, _Statistics


class _SumOverProcesses(torch.autograd.Function):
    """The sum of ``x`` over the processes of ``group``, on every process; d sum / d x_r is the identity
    for every r, so each process's gradient is the sum of every process's gradient of the sum, over
    ``backward_group`` (the same processes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, backward_group: dist.ProcessGroup) -> torch.Tensor:
        ctx.backward_group = backward_group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # The sum is its own adjoint. Applied as this Function, not as an in-place all_reduce, the backward is itself
        # differentiable: under create_graph=True (a gradient penalty) second derivatives cross the processes too.
        return _SumOverProcesses.apply(grad, ctx.backward_group, ctx.backward_group), None, None


_backward_groups: "weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]" = weakref.WeakKeyDictionary()
_backward_groups_lock = threading.Lock()


def group_for_backwards(group: dist.ProcessGroup, replicas: int) -> dist.ProcessGroup:
    """The process group for the backward all-reduce of an exchange over ``group`` with ``replicas`` per process:
    ``group`` itself, or, with several replicas per process and ``group`` spanning the whole job, a group of the same
    processes of its own, made by the first exchange whose backward will run.

    Why another group: the wrapper's buckets are all-reduced over ``group`` in the same backward, each once its
    gradients are in, and Gloo matches a group's collectives by their order on each process. A process whose batch
    has fewer rows than ``device_ids`` runs fewer replicas, so its graph differs from the others': with a SyncBatchNorm
    first, on inputs that require grad, one process reached the statistics' all-reduce while another had started a
    bucket's, and Gloo aborted the job ("collective mismatch"). On a group of their own each kind keeps its order.

    Why only then: ``dist.new_group`` is a collective of every process of the job, which must make their groups in
    the same order (a group's name counts the groups made before it). The first exchange that records its backward
    is such a point: every process of ``group`` runs it (its forward all-reduces), all decide alike whether it records
    (the counts it all-reduces say), and where ``group`` is the job, there is no other process. (A group made with
    ``use_local_synchronization=True``, which only ``group``'s processes need make, is named after the groups each
    process knows, which differ in a job with other subgroups: the first step hung there.) Over a subgroup the
    backward stays on ``group``, and a process with fewer rows than replicas there can still meet the abort."""
    if replicas == 1 or dist.get_world_size(group) != dist.get_world_size():
        return group
    with _backward_groups_lock:
        twin = _backward_groups.get(group)
        if twin is None:
            twin = _backward_groups[group] = dist.new_group(dist.get_process_group_ranks(group))
        return twin


class ProcessExchange:
    """This process's replicas' statistics -> every process's, in rank order (a differentiable collective)."""

    def __init__(self, group: dist.ProcessGroup, replicas: int) -> None:
        self.group, self.replicas = group, replicas  # replicas: how many each process is given, the rows it fills

    def __call__(self, mine: list[_Statistics]) -> list[_Statistics]:
        if not dist.is_initialized():  # the group is gone (destroy_process_group): torch's layer runs as BatchNorm then
            return mine
        world, rank, replicas = dist.get_world_size(self.group), dist.get_rank(self.group), self.replicas
        if len(mine) > replicas:  # the table has a process's replicas' rows, no more: they would spill over the next's
            raise RuntimeError(
                f"minidp.SyncBatchNorm: {len(mine)} chunks of this process's batch met for one exchange across processes "
                f"laid out for {replicas} replica(s) a process: a data_parallel (or DataParallel) runs inside the "
                f"module that minidp.distributed's wrapper wraps, and its replicas' statistics cannot be laid out. Give "
                f"the wrapper the replicas instead (DistributedDataParallel(module, device_ids=['cpu'] * k)), or keep "
                f"the SyncBatchNorm out of the inner call"
            )
        device = mine[0].mean.device
        rows = torch.stack([torch.stack([s.mean.to(device), s.variance.to(device)]) for s in mine])
        blank = rows.new_zeros((replicas, *rows.shape[1:]))
        # a process that runs fewer replicas this step (fewer rows than replicas) leaves its other rows blank, count 0
        rows = torch.cat([rows, blank[len(mine):]])
        table = torch.cat([blank] * rank + [rows] + [blank] * (world - rank - 1))
        # The counts, and last how many processes' tables require grad.
        counts = torch.zeros(world * replicas + 1, dtype=torch.int64, device=device)
        counts[rank * replicas:rank * replicas + len(mine)] = torch.tensor([s.count for s in mine])
        counts[-1] = torch.is_grad_enabled() and table.requires_grad
        dist.all_reduce(counts, group=self.group)
        # The backward's all-reduce runs where autograd reaches the table, so every process must record it, or none:
        # a process whose table is cut off from its inputs' graph (a batch without rows: its statistics are constant
        # zeros) would skip the collective that the others wait in. Decided here, on what every process reports, it
        # holds whatever the local data; a process records it only if one at least has gradients to send.
        if counts[-1] > 0 and torch.is_grad_enabled() and not table.requires_grad:
            table.requires_grad_()
        backward_group = group_for_backwards(self.group, replicas) if table.requires_grad else self.group
        table = _SumOverProcesses.apply(table, self.group, backward_group)
        ready = None
        if table.is_cuda:  # the other replicas read these on their own streams
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        return [_Statistics(int(count), row[0], row[1], ready) for count, row in zip(counts[:-1].tolist(), table)]


def attach_exchange(module: nn.Module, group: dist.ProcessGroup, replicas: int) -> None:
    """Give every :class:`minidp.SyncBatchNorm` in ``module`` the exchange over its own ``process_group``, else over
    ``group`` (the wrapper's), for ``replicas`` replicas per process; none where that group has one process, or does
    not hold this one (its size reads -1 there), as torch's layer then runs as BatchNorm."""
    for layer in module.modules():
        if isinstance(layer, SyncBatchNorm):
            own = group if layer.process_group is None else layer.process_group
            layer.across_processes = ProcessExchange(own, replicas) if dist.get_world_size(own) > 1 else None
            layer.exchange_attached = True


def _lone_exchange(process_group: Optional[dist.ProcessGroup]) -> Optional[ProcessExchange]:
    """The exchange of a layer no wrapper attached one to, running alone in its process (a copy of a wrapped model, as
    an EMA teacher is; a model never wrapped): over its ``process_group``, else the default group, one replica a
    process, as torch's SyncBatchNorm synchronises whenever it trains in a job; none outside a job of several."""
    if not dist.is_initialized():
        return None
    group = dist.group.WORLD if process_group is None else process_group
    return ProcessExchange(group, 1) if dist.get_world_size(group) > 1 else None


sync_batchnorm.lone_exchange = _lone_exchange


def check_torch_sync_batchnorm(module: nn.Module, device: torch.device) -> None:
    """torch DDP's ``_passing_sync_batchnorm_handle``: ``torch.nn.SyncBatchNorm`` needs GPU modules."""
    if device.type == "cpu":
        for name, layer in module.named_modules():
            if isinstance(layer, nn.SyncBatchNorm):
                raise ValueError(
                    f"SyncBatchNorm layers only work with GPU modules ('{name}' is torch.nn.SyncBatchNorm on the CPU); "
                    f"minidp.SyncBatchNorm.convert_sync_batchnorm(module) synchronises on the CPU, across the "
                    f"processes and the replicas of each"
                )
