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


FIRST_TANH_AT_ONCE = """
import os, sys, threading, traceback
import torch
import minidp  # nothing computes before the children are forked: each starts as a fresh process would


def child(seed, threads=2):
    rows = torch.rand(threads, 16, generator=torch.Generator().manual_seed(seed)) * 4 - 2
    together = threading.Barrier(threads)
    outputs = [None] * threads

    def tanh(i):
        together.wait()  # every thread calls tanh at the same moment
        outputs[i] = torch.tanh(rows[i])

    others = [threading.Thread(target=tanh, args=(i,)) for i in range(1, threads)]
    for thread in others:
        thread.start()
    tanh(0)
    for thread in others:
        thread.join()
    return all(torch.equal(output, torch.tanh(row)) for output, row in zip(outputs, rows))


wrong, failed = [], []  # seeds; (seed, exit code) of a child that raised or crashed
for seed in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if child(seed) else 1)
        except BaseException:
            traceback.print_exc()
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 1:
        wrong.append(seed)
    elif code != 0:
        failed.append((seed, code))
print("children whose first tanh was wrong:", wrong, "failed:", failed)
"""


@pytest.mark.fresh_interpreter
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_after_import_two_threads_first_tanh_at_once_is_exact():
    """MKL's vector math, which computes torch.tanh on the CPU, can give a less accurate result to one of two
    threads that make the process's first call at once; importing minidp makes that call before any replica
    runs (minidp/cpu_threads.py). Each child here is a fresh process in which two threads call tanh at the
    same moment: each must agree bit for bit with tanh called after. Plain threads rather than replicas,
    because the race is rarer through replicas (each runs with its share of intra-op threads): without minidp's
    call, 1 child in 400 got a wrong tanh through replicas, and 3 to 20 of these 300 children did."""
    done = fresh_python("-c", FIRST_TANH_AT_ONCE, "300", timeout=180)
    assert done.returncode == 0, done.stderr
    assert "children whose first tanh was wrong: [] failed: []" in done.stdout, done.stdout + done.stderr
