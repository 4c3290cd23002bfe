"""DDP's runtime statistics: what torch's ``_get_ddp_logging_data()`` returns, kept in Python.

torch DDP keeps a ``dist.Logger`` (C++, ``logger.cpp``) beside its reducer. It holds two kinds of entries,
returned merged in one dict:

* **construction data**, set once: ``world_size``, ``rank``, ``module_name`` (the wrapped module's class),
  ``device_ids`` (comma-separated, ``""`` for none), ``output_device`` (-1 for none), ``broadcast_buffers``,
  ``has_sync_bn``, ``bucket_cap_bytes``, ``find_unused_parameters``, ``gradient_as_bucket_view``,
  ``backend_name``, ``num_parameter_tensors``, ``total_parameter_size_bytes``, ``dtypes`` (C++ names:
  ``float``, ``double``), ``bucket_sizes`` (bytes per bucket of the first plan), ``is_multi_device_module``,
  the environment (``master_addr``, ``gloo_socket_ifname``..., ``"N/A"`` when unset) and, for Gloo, its
  thread count; ``static_graph`` once set, ``comm_hook`` (the hook's ``__qualname__``, or the built-in
  type) once registered, ``join_uneven_inputs`` once under ``Join``; ``iteration`` starts at 0;
  ``has_error`` (1) and ``error`` (``"<class 'ValueError'>: message"``) once the wrapper has refused a call,
  as torch's ``_log_and_throw`` records it before raising.
* **runtime statistics**, sampled: at the synchronised forward number k (from 0), for k from 1 to 10 and
  then every ``sample_rate``-th one (``_set_ddp_runtime_logging_sample_rate``, default 100), the
  previous iteration's times, in nanoseconds: ``forward_compute_time`` (forward start to its end,
  where the reducer is told to expect the backward), ``backward_compute_time`` (from there to the end
  of the backward), ``backward_comm_time`` (first all-reduce launched to the last one's result written
  back), ``backward_compute_comm_overlap_time`` (first all-reduce launched to the end of the
  backward), their ``*_start``/``*_end`` stamps (ns since the Unix epoch), their running averages
  (``avg_*``, over the sampled iterations); and ``iteration`` (k), ``num_buckets_reduced``,
  ``unused_parameter_size`` (bytes of parameters that got no gradient), ``has_rebuilt_buckets``,
  ``rebuilt_bucket_sizes`` and ``rebuilt_per_bucket_param_indices`` (once rebuilt), and
  ``prev_iteration_grad_ready_order_indices`` (the order gradients arrived in).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .groups import backend_of, rank_in, size_of

DEFAULT_SAMPLE_RATE = 100  # kDDPRuntimeLoggingSampleRate
ALWAYS_SAMPLED = 10  # the first iterations whose statistics are always kept

# the C++ names logger.cpp prints for dtypes (c10::toString)
C10_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                   torch.bfloat16: "c10::BFloat16", torch.complex64: "c10::complex<float>",
                   torch.complex128: "c10::complex<double>"}

ENVIRONMENT = {"cuda_visible_devices": "CUDA_VISIBLE_DEVICES", "master_addr": "MASTER_ADDR",
               "master_port": "MASTER_PORT", "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG"}
GLOO_ENVIRONMENT = {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME", "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}

# statistic: (start stamp, end stamp) among a backward's stamps
INTERVALS = {
    "forward_compute_time": ("forward_compute_start", "backward_compute_start"),
    "backward_compute_time": ("backward_compute_start", "backward_compute_end"),
    "backward_comm_time": ("backward_comm_start", "backward_comm_end"),
    "backward_compute_comm_overlap_time": ("backward_comm_start", "backward_compute_end"),
}


def epoch_ns(perf_counter_time: float) -> int:
    """A ``time.perf_counter()`` reading as nanoseconds since the Unix epoch (one anchor per process), in
    integers: a float holds such a number only to a few hundred nanoseconds."""
    return _ANCHOR_WALL_NS + round((perf_counter_time - _ANCHOR_PERF) * 1e9)


_ANCHOR_WALL_NS, _ANCHOR_PERF = time.time_ns(), time.perf_counter()


# Whether a wrapper of this process has logged its graph as not static (logger.cpp: a `c10::once_flag` for the process)
_graph_static_logged = False


def _joined(values: Sequence[Any], separator: str = ", ") -> str:
    return separator.join(str(v) for v in values)


class LoggingData:
    """The entries of one ``DistributedDataParallel``, as ``dist.Logger`` keeps them."""

    def __init__(self) -> None:
        self.entries: dict[str, Any] = {}
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self._samples = 0

    def set_construction_data(
        self, module: torch.nn.Module, params: Sequence[torch.Tensor], group: dist.ProcessGroup, *,
        device_ids: Optional[Sequence[Any]], output_device: Any, broadcast_buffers: bool, bucket_cap_bytes: int,
        find_unused_parameters: bool, gradient_as_bucket_view: bool, bucket_sizes: Sequence[int],
    ) -> None:
        backend = backend_of(group)
        self.entries.update({
            "world_size": size_of(group),
            "rank": rank_in(group),
            "module_name": type(module).__name__,
            "device_ids": _joined(device_ids or []),
            "output_device": -1 if output_device is None else output_device,
            "broadcast_buffers": int(broadcast_buffers),
            "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())),
            "bucket_cap_bytes": bucket_cap_bytes,
            "find_unused_parameters": int(find_unused_parameters),
            "gradient_as_bucket_view": int(gradient_as_bucket_view),
            "backend_name": backend,
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": _joined(sorted({C10_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
            "bucket_sizes": _joined(bucket_sizes),
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
            "iteration": 0,
        })
        environment = {**ENVIRONMENT, **(GLOO_ENVIRONMENT if backend == "gloo" else {})}
        self.entries.update({key: os.environ.get(name, "N/A") for key, name in environment.items()})
        if backend == "gloo":
            threads = getattr(getattr(group._get_backend(torch.device("cpu")), "options", None), "_threads", None)
            if threads is not None:
                self.entries["gloo_num_threads"] = threads

    def log_graph_not_static(self, iteration: int) -> None:
        """The unused parameters changed between iterations (``Logger::log_if_graph_static(false)``): the graph could
        not have been declared static. torch logs it once per process, for the first wrapper to see it."""
        global _graph_static_logged
        if not _graph_static_logged:
            _graph_static_logged = True
            self.entries["can_set_static_graph"] = 0
            self.entries["iteration"] = iteration

    def set_error(self, error: Exception) -> None:
        """The wrapper refused a call with ``error`` (torch's ``_log_and_throw``: its type, then its message)."""
        self.entries["has_error"] = 1
        self.entries["error"] = f"{type(error)}: {error}"

    def set_reducer_error(self, error: Exception) -> None:
        """The reducer failed with ``error`` (torch's C++ reducer logs its message alone)."""
        self.entries["has_error"] = 1
        self.entries["error"] = str(error)

    def set_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        self.sample_rate = sample_rate

    def should_sample(self, iteration: int) -> bool:
        """Whether the forward number ``iteration`` records the previous iteration (``should_collect_runtime_stats``)."""
        return iteration > 0 and (iteration <= ALWAYS_SAMPLED or iteration % self.sample_rate == 0)

    def record(self, iteration: int, stamps: dict[str, float], runtime: dict[str, Any]) -> None:
        """The previous iteration's statistics (``set_runtime_stats_and_log``): ``stamps`` are its
        ``time.perf_counter()`` readings, ``runtime`` the reducer's other facts about it."""
        self.entries["iteration"] = iteration
        self.entries.update(runtime)
        if not all(stamps.get(name) is not None for pair in INTERVALS.values() for name in pair):
            return  # a backward without all-reduce (no gradient arrived): no times to report
        self._samples += 1
        nanoseconds = {name: epoch_ns(reading) for name, reading in stamps.items()}
        for statistic, (start, end) in INTERVALS.items():
            value = nanoseconds[end] - nanoseconds[start]
            self.entries[statistic] = value
            average = self.entries.get(f"avg_{statistic}", 0)
            self.entries[f"avg_{statistic}"] = int(average + (value - average) / self._samples)
        for stamp in ("forward_compute_time_start", "backward_compute_time_start", "backward_compute_time_end",
                      "backward_comm_time_start", "backward_comm_time_end"):
            self.entries[stamp] = nanoseconds[stamp.replace("_time", "")]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.entries)
