"""CPU replicas share the machine: each runs with its share of the caller's intra-op threads, and none
makes the process's first call into MKL's vector math at the same moment as another.

Stock DataParallel has no CPU replicas; without this, K replicas would each start a full OpenMP
team on the same cores.
"""

from __future__ import annotations

import importlib
import os
import threading
import time

import pytest
import torch
from torch import nn

import minidp

from .helpers import cpu_ids, fresh_python


per_thread = pytest.mark.skipif(
    not importlib.import_module("minidp.cpu_threads").PER_THREAD_INTRA_OP,
    reason="torch.set_num_threads is process-wide in this build (no OpenMP): replicas keep the caller's count",
)


class RecordsThreads(nn.Module):
    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.seen = seen  # shared by reference with every replica

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return x


@per_thread
@pytest.mark.parametrize(
    "caller_threads, replicas, expected",
    [(4, 2, [2, 2]), (2, 3, [1, 1, 1])],
    ids=["threads split evenly", "more replicas than threads: one each"],
)
def test_each_cpu_replica_gets_its_share_of_the_callers_threads(caller_threads, replicas, expected):
    seen: list[int] = []
    previous = torch.get_num_threads()
    torch.set_num_threads(caller_threads)
    try:
        minidp.parallel_apply([RecordsThreads(seen)] * replicas, [(torch.ones(1),)] * replicas, devices=cpu_ids(replicas))
        assert seen == expected
        assert torch.get_num_threads() == caller_threads  # the caller's count is restored
    finally:
        torch.set_num_threads(previous)


def test_a_single_cpu_replica_keeps_the_callers_threads():
    seen: list[int] = []
    minidp.parallel_apply([RecordsThreads(seen)], [(torch.ones(1),)], devices=cpu_ids(1))
    assert seen == [torch.get_num_threads()]


class FinishesLast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x


def count_in_a_new_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


@per_thread
def test_a_thread_started_after_a_step_begins_with_the_callers_count():
    """The count is per thread, but every ``torch.set_num_threads`` also stores its value as the count
    each thread started later begins with: after a step that must be the caller's, not a replica's."""
    modules, inputs = [nn.Identity(), FinishesLast()], [(torch.ones(1),)] * 2
    previous = torch.get_num_threads()
    minidp.parallel_apply(modules, inputs, devices=cpu_ids(2))  # a worker thread has run a replica
    torch.set_num_threads(previous + 1)
    try:
        minidp.parallel_apply(modules, inputs, devices=cpu_ids(2))
        assert count_in_a_new_thread() == torch.get_num_threads() == previous + 1
    finally:
        torch.set_num_threads(previous)


@pytest.mark.fresh_interpreter
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_after_import_two_threads_first_tanh_at_once_is_exact():
    """MKL's vector math, which computes torch.tanh on the CPU, can give a less accurate result to one of two
    threads that make the process's first call at once; importing minidp makes that call before any replica
    runs (minidp/cpu_threads.py). tests/first_math_calls_at_once.py forks 300 children from a process that has
    imported minidp and computed nothing; in each, two threads call tanh at the same moment, and each result
    must agree bit for bit with tanh called after. Plain threads rather than replicas, because the race is rarer
    through replicas, each with its share of intra-op threads. Without minidp's call (``--without-minidp``), 3 to
    20 of these 300 children got a wrong tanh."""
    done = fresh_python("tests/first_math_calls_at_once.py", "300", timeout=180)
    assert done.returncode == 0, done.stderr
    assert "children with a call that was not exact: [] failed: []" in done.stdout, done.stdout + done.stderr


# ---- the caller's idle OpenMP team (cpu_threads.let_idle_team_go) ----------------------------------------------

# Run in a fresh interpreter. After a parallel region of the caller's whole team, a parallel_apply whose replica 0
# (in the calling thread) sleeps 50 ms and measures the CPU time every other thread of the process takes meanwhile:
# an idle team member that spins shows there. Printed: the median of 5 tries, in ns, for one CPU replica (it keeps
# the caller's count: nothing is let go) and for two (each on a share of it).
IDLE_TEAM_SCRIPT = """
import os, threading, time
import torch, minidp
from minidp import cpu_threads

def others_cpu_ns():
    me = str(threading.get_native_id())
    total = 0
    for task in os.listdir("/proc/self/task"):
        if task != me:
            try:
                with open(f"/proc/self/task/{task}/schedstat") as stat:
                    total += int(stat.read().split()[0])
            except OSError:  # the thread ended meanwhile (a team let go)
                pass
    return total

class Sleeps(torch.nn.Module):
    def forward(self, x):
        if threading.current_thread() is threading.main_thread():
            before = others_cpu_ns()
            time.sleep(0.05)
            spins.append(others_cpu_ns() - before)
        return x

torch.set_num_threads(cpu_threads.cores())
x = torch.ones(1 << 22)
for replicas in (1, 2):
    spins = []
    for _ in range(5):
        x.mul_(1.0)  # a parallel region of the caller's whole team
        minidp.parallel_apply([Sleeps()] * replicas, [(x,)] * replicas, devices=["cpu"] * replicas)
    print(sorted(spins)[2])
"""


@pytest.mark.fresh_interpreter
@per_thread
@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
                    reason="reads each thread's CPU time from /proc (Linux with scheduler statistics)")
@pytest.mark.skipif(importlib.import_module("minidp.cpu_threads").cores() < 2, reason="needs 2 cores or more")
def test_the_callers_idle_team_does_not_spin_while_replicas_run_on_shares_of_it():
    """libgomp keeps the members of a team that finished a region spinning for milliseconds; a step's backward ends
    on the caller's whole team and the next forward's replicas need those cores, so a thread about to run a replica
    on a share of its caller's threads lets its idle team go (minidp/cpu_threads.py, let_idle_team_go). The control,
    one replica on the caller's whole count, must show the spinning, or this runtime does not spin here and the test
    cannot tell."""
    result = fresh_python("-c", IDLE_TEAM_SCRIPT)
    assert result.returncode == 0, result.stderr
    whole_team_ns, shares_ns = map(int, result.stdout.split())
    if whole_team_ns < 1_000_000:
        pytest.skip(f"the idle team spun {whole_team_ns / 1e6:.3f} ms: this OpenMP runtime does not spin here")
    assert shares_ns < whole_team_ns / 10, (shares_ns, whole_team_ns)
