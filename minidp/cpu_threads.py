"""How CPU replicas share the machine: the intra-op threads each runs with, and the cores they run on.

A CPU kernel of PyTorch splits its work among a *team* of intra-op threads (OpenMP in the usual builds)
and waits, at its end, for the team's slowest member. K CPU replicas that run at once start K teams.
When the teams' threads outnumber the cores, the member that the others wait for is often not running,
and every kernel's end costs a trip through the scheduler (measured: BENCHMARKS.md, "Where the parallel backward
pays"). So

* a forward of CPU replicas runs each with its *share* of the caller's count (:func:`share`), and
* their backwards run in parallel, by default, only where their teams fit the cores
  (:func:`minidp.parallel_backward.applies`), and
* the idle OpenMP team of a thread that is about to run a replica on its share is let go first, so that it
  does not spin on the cores the replicas need (:func:`let_idle_team_go`).

They also share the libraries below torch, whose first call in a process is not always safe to make from
two threads at once: minidp makes it before any replica runs (:func:`finish_vector_math_setup`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable, Optional

import torch

# `torch.set_num_threads` sets the calling thread's count under ATen's OpenMP backend (measured:
# other threads keep theirs); under the native thread pool it is process-wide, and K replicas
# setting and restoring it at once would race, so there the replicas keep the caller's count.
PER_THREAD_INTRA_OP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def finish_vector_math_setup() -> None:
    """Make one call into MKL's vector math (VML) in this thread, so that no two threads make the process's first at once.

    In builds with MKL (torch's x86 wheels), tanh, exp, log, sin, cos, erf, sqrt... of float and double CPU
    tensors are computed by VML. Measured with torch 2.13's CPU wheel (MKL 2024.2): when two threads make the
    process's first VML call at once, one of them can get a less accurate result (tanh off by 4e-5, exp by
    2e-4, where the same call made later agrees bit for bit), in 1 to 7 of 100 processes
    (``python tests/first_math_calls_at_once.py 300 --without-minidp``: 3 to 20 of the 300); once one call has
    completed, as minidp's import makes it, no later call of 16 such functions in float or double is, from any
    thread (``python tests/first_math_calls_at_once.py 1500 --functions tanh,sin,log,erf,exp,sqrt,erfinv,tan,atan,
    acos,log10,log2,erfc,asin,cos,trunc``: 0 of the 1,500). The first forward of CPU replicas makes such calls, at once.
    """
    if torch.backends.mkl.is_available():
        torch.exp(torch.zeros(1, dtype=torch.float32, device="cpu"))


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


def let_idle_team_go() -> None:
    """End the idle intra-op threads of the calling thread's OpenMP team, which would spin on cores others need.

    GNU OpenMP (libgomp, the runtime of torch's Linux wheels) keeps the members of a team that finished a parallel
    region spinning for a few milliseconds (300,000 spins by default), so that the next region starts without
    waking them. A training step of CPU replicas ends with the caller's kernels on its whole team (the backward, the
    optimizer) and begins with the replicas' forwards on their shares of it: for the first milliseconds of every
    forward the caller's idle members spin on the cores that the replicas' threads need. Measured on 2 cores
    (``python benchmarks/idle_team.py``, BENCHMARKS.md, "The caller's idle team"): 10 to 16% of the step of 2
    replicas of the CNN.

    So a thread about to run a replica on fewer threads than its caller's lets its team go first, through OpenMP
    5.0's ``omp_pause_resource(omp_pause_soft, host)``: libgomp ends the calling thread's team threads (and only
    that thread's) at once, and the next region that needs them starts new ones, once a step (the backward's first
    kernel): a cost that the benchmark's step includes. Nothing is computed differently. Where the runtime is not
    libgomp, or lacks the call, nothing is done.
    """
    pause = _pause_openmp_team()
    if pause is not None:
        pause()


@functools.cache
def _pause_openmp_team() -> Optional[Callable[[], int]]:
    """The call that ends the calling thread's idle OpenMP team, where libgomp is the runtime and has it; else None."""
    try:
        with open("/proc/self/maps") as maps:  # the copy of libgomp torch loaded (a wheel may carry its own)
            path = next((line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]), None)
    except OSError:  # not Linux: another runtime, whose teams this does not know
        return None
    if path is None:
        return None
    try:
        libgomp = ctypes.CDLL(path)  # the library already mapped: no second copy is loaded
    except OSError:  # its file is gone (replaced since it was loaded)
        return None
    if not hasattr(libgomp, "omp_pause_resource"):  # before OpenMP 5.0 (GCC 9)
        return None
    omp_pause_soft, host = 1, libgomp.omp_get_initial_device()
    return functools.partial(libgomp.omp_pause_resource, omp_pause_soft, host)
