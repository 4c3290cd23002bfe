"""How CPU replicas share the machine: the intra-op threads each runs with, and the cores they run on.

A CPU kernel of PyTorch splits its work among a *team* of intra-op threads (OpenMP in the usual builds)
and waits, at its end, for the team's slowest member. K CPU replicas that run at once start K teams.
When the teams' threads outnumber the cores, the member that the others wait for is often not running,
and every kernel's end costs a trip through the scheduler (measured: BENCHMARKS.md, "Where the parallel backward
pays"). So

* a forward of CPU replicas runs each with its *share* of the caller's count (:func:`share`), and
* their backwards run in parallel, by default, only where their teams fit the cores
  (:func:`minidp.parallel_backward.applies`).

They also share the libraries below torch, whose first call in a process is not always safe to make from
two threads at once: minidp makes it before any replica runs (:func:`finish_vector_math_setup`).
"""

from __future__ import annotations

import os

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
