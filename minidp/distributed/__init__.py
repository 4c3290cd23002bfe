"""minidp.distributed: torch's DistributedDataParallel rebuilt from steps you can read, on ``torch.distributed``.

One process per rank (``torchrun``, or :func:`launch` on one machine), each with a whole model; in the
backward, each gradient is averaged over the ranks as soon as its bucket is full. The steps, one
module each:

* :mod:`~minidp.distributed.checks`: every rank holds the same model (checked on every rank);
* :mod:`~minidp.distributed.broadcast`: rank 0's parameters and buffers copied to every rank;
* :mod:`~minidp.distributed.buckets`: which gradients share an all-reduce, exactly as torch DDP plans it;
* :mod:`~minidp.distributed.reducer`: the hooks, the asynchronous all-reduces and the write-back;
* :mod:`~minidp.distributed.comm_hooks`: communication hooks checked as torch checks them, the built-in ones;
* :mod:`~minidp.distributed.join`: uneven inputs, ranks out of data shadowing the others (``Join``);
* :mod:`~minidp.distributed.batchnorm`: :class:`minidp.SyncBatchNorm`'s statistics across processes;
* :mod:`~minidp.distributed.logging_data`: torch DDP's runtime statistics (``_get_ddp_logging_data``);
* :mod:`~minidp.distributed.ddp`: :class:`DistributedDataParallel`, which composes them;
* :mod:`~minidp.distributed.replicate`: :func:`replicate`, the same as a composable API (the module left as it is,
  DDP's steps in its forward hooks);
* :mod:`~minidp.distributed.isinstance_only`: why minidp's classes derive from torch's, and what of torch's they refuse;
* :mod:`~minidp.distributed.fully_shard`: :func:`fully_shard`, FSDP2's sharding of parameters,
  gradients and optimizer state (each rank keeps 1/W), :func:`full_state_dict`,
  :func:`register_fsdp_forward_method` and :func:`clip_grad_norm_` (the norm of the whole gradients);
* :mod:`~minidp.distributed.sharded_optimizer_state`: an optimizer's state of those shards in its state dict, as
  FSDP2's DTensors (what ``torch.distributed.checkpoint`` saves and loads);
* :mod:`~minidp.distributed.memory`: what one rank holds, DDP's and sharded, side by side;
* :mod:`~minidp.distributed.zero`: :class:`ZeroRedundancyOptimizer`, each rank keeping the optimizer
  state of its share of the parameters and broadcasting the share it updated;
* :mod:`~minidp.distributed.timeline`: each rank's timings, merged into one Chrome trace;
* :mod:`~minidp.distributed.launch`: N processes on this machine joined over the loopback address.

minidp's core modules never import ``torch.distributed``; only this package does, which ``import minidp`` imports
(so that a ``minidp.SyncBatchNorm`` no wrapper holds synchronises across a job's processes).
"""

from .buckets import GradBucket
from .ddp import DistributedDataParallel
from .fully_shard import (
    clip_grad_norm_, full_state_dict, fully_shard, register_fsdp_forward_method, sharded_timeline,
)
from .launch import RankFailed, launch, run_demo
from .memory import format_ledgers, memory_ledger
from .replicate import replicate
from .timeline import chrome_trace, gather_timelines, hidden_share, plot_timelines, write_chrome_trace
from .zero import ZeroRedundancyOptimizer, optimizer_state_bytes

__all__ = [
    "DistributedDataParallel",
    "GradBucket",
    "RankFailed",
    "ZeroRedundancyOptimizer",
    "chrome_trace",
    "clip_grad_norm_",
    "format_ledgers",
    "full_state_dict",
    "fully_shard",
    "gather_timelines",
    "hidden_share",
    "launch",
    "memory_ledger",
    "optimizer_state_bytes",
    "plot_timelines",
    "register_fsdp_forward_method",
    "replicate",
    "run_demo",
    "sharded_timeline",
    "write_chrome_trace",
]
