"""Training with minidp holds no more tensors after many steps than after a few.

Cached replicas live across steps; they must not keep the previous step's tensors (or graph)
alive. Stock DataParallel drops its replicas after every forward; minidp's cache empties them.
(``benchmarks/steady_memory.py`` runs the 1,000-step version and also watches process memory.)
"""

from __future__ import annotations

import gc

import torch
from torch import nn

import minidp

from .helpers import cpu_ids


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))  # type(): no proxy __class__


def test_live_tensors_do_not_grow_over_200_training_steps(generator):
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 2, (16,), generator=generator)

    def steps(count: int) -> None:
        for _ in range(count):
            optimizer.zero_grad()
            nn.functional.cross_entropy(wrapper(x), y).backward()
            optimizer.step()

    steps(20)  # optimizer state, gradients, the cache's skeletons: allocated once
    before = live_tensors()
    steps(200)
    assert live_tensors() <= before
    if wrapper.cache_replicas:  # the skeletons too were built once
        assert wrapper.replica_cache_info().misses == 1
