"""minidp: data parallelism for PyTorch from explicit primitives.

The five steps of ``torch.nn.DataParallel``, each a public function in a module of its own, numbered:

1. :func:`scatter` (``minidp/step1_scatter.py``): cut the batch into one chunk per device;
2. :func:`replicate` (``minidp/step2_replicate.py``): copy the module onto each device;
3. :func:`parallel_apply` (``minidp/step3_parallel_apply.py``): run every replica on its chunk, in threads;
4. :func:`gather` (``minidp/step4_gather.py``): join the outputs on one device;
5. the reduction (``minidp.step5_reduce``, summing with ``minidp.comm.reduce_add_coalesced``), run by
   autograd in the backward of step 2: every replica's gradients summed into the original parameters.

:class:`DataParallel` and :func:`data_parallel` compose them (``minidp/wrapper.py``); a
:class:`ReplicaCache` keeps the replica modules between steps. :class:`SyncBatchNorm` normalises by
the statistics of the whole batch across the replicas.
:func:`parallel_criterion` computes the loss on the replicas, without gathering their outputs;
:func:`calibrate` measures the devices and returns ``chunk_weights`` for uneven splits.
:func:`trace` records every step of every replica; :func:`verify` checks a model's numbers.
:func:`set_parallel_backward` runs the backwards of CPU replicas in parallel where their threads fit the cores (the default), always, or never;
:func:`set_parallel_backward_threads` chooses their intra-op threads: the caller's (bitwise the serial backward) or a share.
"""

from . import comm
from .calibration import calibrate
from .comm import get_reduce_backend, set_reduce_backend
from .parallel_backward import (
    get_parallel_backward,
    get_parallel_backward_threads,
    set_parallel_backward,
    set_parallel_backward_threads,
)
from .criterion import parallel_criterion
from .device_ids import DeviceInfo, devices
from .replica_cache import ReplicaCache
from .step1_scatter import scatter, scatter_kwargs
from .step2_replicate import replicate
from .step3_parallel_apply import parallel_apply
from .step4_gather import gather
from .sync_batchnorm import SyncBatchNorm
from .tracing import Trace, trace, write_trace_artifacts
from .verification import VerifyReport, verify
from .wrapper import DataParallel, data_parallel

# The processes' layer, imported with the package: a SyncBatchNorm that no wrapper gave an exchange (a model never
# wrapped, a copy of a wrapped one, one under torch's DDP) then synchronises across the processes of a job, as
# torch's layer does, whether or not the user imported minidp.distributed (which sets that exchange up).
from . import distributed

__all__ = [
    "DataParallel",
    "DeviceInfo",
    "ReplicaCache",
    "SyncBatchNorm",
    "Trace",
    "VerifyReport",
    "calibrate",
    "comm",
    "data_parallel",
    "devices",
    "distributed",
    "gather",
    "get_parallel_backward",
    "get_parallel_backward_threads",
    "get_reduce_backend",
    "parallel_apply",
    "parallel_criterion",
    "replicate",
    "scatter",
    "scatter_kwargs",
    "set_parallel_backward",
    "set_parallel_backward_threads",
    "set_reduce_backend",
    "trace",
    "verify",
    "write_trace_artifacts",
]
__version__ = "0.1.0"
