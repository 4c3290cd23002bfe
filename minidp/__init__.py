"""minidp: data parallelism for PyTorch from explicit primitives.

The five steps of ``torch.nn.DataParallel``, each a public function in a module of its own:

1. :func:`scatter` (``minidp.scatter``): cut the batch into one chunk per device;
2. :func:`replicate` (``minidp.replicate``): copy the module onto each device;
3. :func:`parallel_apply` (``minidp.parallel_apply``): run every replica on its chunk, in threads;
4. :func:`gather` (``minidp.gather``): join the outputs on one device;
5. the reduction (``minidp.comm.reduce_add_coalesced``), run by autograd in the backward of step 2:
   every replica's gradients summed into the original parameters.

:class:`DataParallel` and :func:`data_parallel` compose them (``minidp.data_parallel``).
:func:`trace` records every step of every replica; :func:`verify` checks a model's numbers.
"""

from . import comm
from .comm import get_reduce_backend, set_reduce_backend
from .data_parallel import DataParallel, data_parallel
from .devices import DeviceInfo, devices
from .gather import gather
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter import scatter, scatter_kwargs
from .sync_batchnorm import SyncBatchNorm
from .trace import Trace, trace, write_trace_artifacts
from .verify import VerifyReport, verify

__all__ = [
    "DataParallel",
    "DeviceInfo",
    "SyncBatchNorm",
    "Trace",
    "VerifyReport",
    "comm",
    "data_parallel",
    "devices",
    "gather",
    "get_reduce_backend",
    "parallel_apply",
    "replicate",
    "scatter",
    "scatter_kwargs",
    "set_reduce_backend",
    "trace",
    "verify",
    "write_trace_artifacts",
]
__version__ = "0.1.0"
