"""Uneven inputs: ranks that run out of data shadow the collectives of those still training.

Without help, a rank with fewer batches leaves its loop while the others wait in the next all-reduce.
``torch.distributed.algorithms.Join`` keeps them matched: a rank that has left the loop (joined) runs
its :class:`JoinHook`'s ``main_hook`` once per iteration of the ranks still training, issuing the same
collectives as their forward and backward, with zeros for its gradients; when every rank has joined,
``post_hook`` copies the model of the last rank to join to all (``_DDPJoinHook`` in torch's
``distributed.py``). The collectives of one iteration, in order, on a rank still training (left) and a
joined one (right):

====================================================  ==============================================
``Join.notify_join_context``: all-reduce of 1          ``Join.__exit__``: all-reduce of 0 (how many
                                                       still train)
buffers: which rank holds the newest (max of the       the same, this rank not a candidate
ranks, the training ones candidates), its broadcast
whether this backward synchronises: all-reduce of 1    all-reduce of 0; sum > 0: shadow the backward
each bucket's all-reduce, in bucket order              each bucket's, of zeros (through the comm hook)
``find_unused_parameters``, or a static graph's       the sum of its last reduction (as torch)
first backward: the used-parameter map
a backward that rebuilds the buckets (the first of     the same broadcast (``_push_all_rebuilt_params``)
a dynamic graph, a static graph's second): rank 0's
plan, broadcast
====================================================  ==============================================

A :class:`~minidp.distributed.ZeroRedundancyOptimizer` in the same ``Join`` shadows its step
(:class:`ZeroJoinHook`): the joined rank steps its share of the parameters and broadcasts it, as the ranks still
training do.

Gradients are divided by the world size the job started with (``divide_by_initial_world_size=True``,
the default: every sample weighs the same), or by the number of ranks still training (the sum of the
first all-reduce), as torch's reducer does (``_set_forward_pass_work_handle``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel.distributed import _BufferCommHookLocation
from torch.optim import Optimizer

from .broadcast import broadcast_from
from .groups import rank_in

# a minidp.distributed.DistributedDataParallel and ZeroRedundancyOptimizer (their modules import this one, so not
# by name here)
DistributedDataParallel = nn.Module
ZeroRedundancyOptimizer = Optimizer


def common_rank(ddp: DistributedDataParallel, candidate: bool) -> int:
    """The largest rank among those with ``candidate`` true, on every rank (``_find_common_rank``)."""
    rank = torch.tensor([rank_in(ddp.process_group) if candidate else -1], device=ddp.join_device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=ddp.process_group)
    if rank.item() == -1:
        raise ValueError("no rank is a candidate: at least one rank must pass candidate=True")
    return int(rank.item())


def sync_backward_vote(ddp: DistributedDataParallel, joined: bool) -> bool:
    """Whether the ranks still training synchronise this backward (``_check_global_requires_backward_grad_sync``):
    they vote 1 (or 0 inside ``no_sync``) without waiting; a joined rank votes 0 and reads the sum."""
    vote = torch.ones(1, device=ddp.join_device) if not joined and ddp.require_backward_grad_sync \
        else torch.zeros(1, device=ddp.join_device)
    work = dist.all_reduce(vote, group=ddp.process_group, async_op=True)
    if not joined:
        return True  # the result is not needed here
    work.wait()
    return vote.item() != 0


class DDPJoinHook(JoinHook):
    """What a joined rank does for a :class:`~minidp.distributed.DistributedDataParallel` (torch's ``_DDPJoinHook``)."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        ddp._logging.entries["join_uneven_inputs"] = 1

    def main_hook(self) -> None:
        """One iteration of the ranks still training, shadowed."""
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        if ddp.will_sync_module_buffers() and ddp._buffer_hook_location() is not _BufferCommHookLocation.POST_FORWARD:
            ddp._sync_buffers(joined=True)
        synchronised = sync_backward_vote(ddp, joined=True)
        ddp.require_forward_param_sync = synchronised
        if synchronised:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: the last one's parameters (and buffers) to all (``_sync_final_model``)."""
        ddp = self.ddp
        ddp._authoritative_rank = common_rank(ddp, candidate=is_last_joiner)  # torch DDP keeps it there too
        broadcast_from(ddp._tensors_to_sync(), ddp.process_group, ddp._authoritative_rank)


class ZeroJoinHook(JoinHook):
    """What a joined rank does for a :class:`~minidp.distributed.ZeroRedundancyOptimizer` (torch's ``_ZeROJoinHook``).

    Once per iteration of the ranks still training, the optimizer's step: this rank's share updated from the
    gradients it holds, then every share broadcast from its owner. Those gradients are the user's to set, as
    torch says of its hook: the joined rank owns a share of the parameters whatever its data, and the ranks still
    training take that share from it. (A DDP in the same ``Join`` shadows the gradients' all-reduce, but leaves
    this rank's ``.grad`` as it was, as torch's does.) The hook calls ``step()``, as torch's does, so that the step's
    pre- and post-hooks (``register_step_post_hook``, the global ones) run on every rank as often; but that step does
    not notify the ``Join`` context: where the optimizer is its first ``Joinable``, torch's hook issues one all-reduce
    more on the joined rank than the ranks still training issue, and the collectives stop matching (on Gloo the job
    fails: ``tests/test_zero.py``, torch 2.11 and 2.13).
    """

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero._shadowing = True
        try:
            self.zero.step()
        finally:
            self.zero._shadowing = False  # this rank's steps after the Join context are its own again
