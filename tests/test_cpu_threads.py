"""CPU replicas share the machine's cores: each runs with its share of the caller's intra-op threads.

Stock DataParallel has no CPU replicas; without this, K replicas would each start a full OpenMP
team on the same cores.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import minidp

from .helpers import cpu_ids


per_thread = pytest.mark.skipif(
    not importlib.import_module("minidp.step3_parallel_apply").PER_THREAD_INTRA_OP,
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
