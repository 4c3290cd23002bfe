"""How CPU replicas share the machine: the intra-op threads each runs with, and the cores they run on.

A CPU kernel of PyTorch splits its work among a *team* of intra-op threads (OpenMP in the usual builds)
and waits, at its end, for the team's slowest member. K CPU replicas that run at once start K teams.
When the teams' threads outnumber the cores, the member that the others wait for is often not running,
and every kernel's end costs a trip through the scheduler (measured: BENCHMARKS.md, "Where the parallel backward
pays"). So

* a forward of CPU replicas runs each with its *share* of the caller's count (:func:`share`), and
* their backwards run in parallel, by default, only where their teams fit the cores
  (:func:`minidp.parallel_backward.applies`).
"""

from __future__ import annotations

import os

import torch

# `torch.set_num_threads` sets the calling thread's count under ATen's OpenMP backend (measured:
# other threads keep theirs); under the native thread pool it is process-wide, and K replicas
# setting and restoring it at once would race, so there the replicas keep the caller's count.
PER_THREAD_INTRA_OP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def share(threads: int, replicas: int) -> int:
    """The intra-op threads each of ``replicas`` CPU replicas runs with when they divide ``threads`` (at least 1).

    Without a per-thread count (:data:`PER_THREAD_INTRA_OP`), every replica keeps all ``threads``.
    """
    return max(1, threads // replicas) if PER_THREAD_INTRA_OP else threads


def cores() -> int:
    """The cores this process may run on (its CPU affinity, as ``taskset`` or a container's cpuset leave it).

    A CPU quota (``docker --cpus``) is not seen, as torch's own default thread count does not see it: under a quota
    smaller than these cores, choose the way yourself (:func:`minidp.set_parallel_backward`).
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def teams_fit(replicas: int, threads_each: int) -> bool:
    """Whether ``replicas`` teams of ``threads_each`` intra-op threads can all run at once, each on cores of its own.

    A team of one thread waits for nobody, so single-threaded replicas always fit (more of them than cores are
    time-sliced like any threads).
    """
    return threads_each == 1 or replicas * threads_each <= cores()
