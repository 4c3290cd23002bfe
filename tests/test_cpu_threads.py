"""CPU replicas share the machine's cores: each runs with its share of the caller's intra-op threads.

Stock DataParallel has no CPU replicas; without this, K replicas would each start a full OpenMP
team on the same cores.
"""

from __future__ import annotations

import importlib
import threading
import time

import pytest
import torch
from torch import nn

import minidp

from .helpers import cpu_ids


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
