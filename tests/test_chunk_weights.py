"""chunk_weights: batches split in proportion to one weight per device, with the results of an even
split (and of one plain call on the whole batch), outputs and gradients in float64."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn

import minidp
from .helpers import RTOL_FLOAT64, cpu_ids, max_relative_error
from minidp import comm


def mlp(generator: torch.Generator) -> nn.Module:
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return net


def step(wrapper: nn.Module, net: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """One forward and backward: the output and every parameter's gradient."""
    net.zero_grad()
    output = wrapper(x)
    output.backward(grad)
    return output.detach(), [p.grad.clone() for p in net.parameters()]


def assert_same(actual, expected) -> None:
    for a, e in zip([actual[0], *actual[1]], [expected[0], *expected[1]]):
        assert max_relative_error(a, e) < RTOL_FLOAT64


# --------------------------------------------------------------------------------------------------
# the rounding rule: comm.chunk_sizes_for_weights
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch,weights,sizes",
    [
        (10, [3, 1], [8, 2]),  # quotas 7.5, 2.5: the tie of remainders goes to the lower index
        (10, [1, 1, 1], [4, 3, 3]),  # quotas 3.33 each: the one row left to device 0
        (64, [2, 1], [43, 21]),  # quotas 42.67, 21.33
        (64, [0.5, 0.5], [32, 32]),
        (10, [100, 1], [9, 1]),  # quotas 9.9, 0.1 -> 10, 0; device 1 takes a row from device 0
        (3, [1000, 1, 1], [1, 1, 1]),
        (2, [1, 1, 1, 1], [1, 1]),  # fewer rows than devices: the first `batch` devices, a row each
        (7, [0.3], [7]),
    ],
)
def test_sizes_follow_the_largest_remainder_rule(batch, weights, sizes):
    assert comm.chunk_sizes_for_weights(batch, weights) == sizes


def test_sizes_add_up_give_each_device_a_row_and_stay_within_one_row_of_the_quota(generator):
    for _ in range(200):
        batch = int(torch.randint(1, 500, (), generator=generator))
        count = int(torch.randint(1, 9, (), generator=generator))
        weights = (10 ** (torch.rand(count, generator=generator, dtype=torch.float64) * 6 - 3)).tolist()  # 1e-3..1e3
        sizes = comm.chunk_sizes_for_weights(batch, weights)
        assert sum(sizes) == batch and all(s >= 1 for s in sizes), (batch, weights, sizes)
        assert len(sizes) == min(batch, count)
        quotas = [batch * Fraction(w) / sum(map(Fraction, weights)) for w in weights]
        if batch >= count and all(q >= 1 for q in quotas):  # no device needed its minimum row
            assert all(math.floor(q) <= s <= math.floor(q) + 1 for s, q in zip(sizes, quotas)), (batch, weights, sizes)


def test_equal_weights_on_a_divisible_batch_split_evenly():
    assert comm.chunk_sizes_for_weights(12, [0.25] * 4) == [3, 3, 3, 3]


# --------------------------------------------------------------------------------------------------
# scatter and DataParallel follow the weights, with the results of an even split
# --------------------------------------------------------------------------------------------------


def test_scatter_and_scatter_kwargs_cut_in_proportion(generator):
    x, mask = torch.randn(10, 2, generator=generator), torch.randn(10, 1, generator=generator)
    assert [c.shape[0] for c in minidp.scatter(x, cpu_ids(2), chunk_weights=[3, 1])] == [8, 2]
    inputs, kwargs = minidp.scatter_kwargs((x,), {"mask": mask}, cpu_ids(2), chunk_weights=[3, 1])
    assert [i[0].shape[0] for i in inputs] == [8, 2] and [k["mask"].shape[0] for k in kwargs] == [8, 2]


@pytest.mark.parametrize(
    "batch,weights",
    [(9, [1, 3]), (13, [5, 1, 1]), (13, [0.2, 0.3, 0.5]), (10, [1, 2, 3, 4]), (3, [4, 1, 1, 1])],
    ids=str,
)
def test_data_parallels_scatter_step_cuts_the_weighted_chunks(batch, weights, generator):
    wrapper = minidp.DataParallel(mlp(generator), cpu_ids(len(weights)), chunk_weights=weights)
    inputs, _ = wrapper.scatter((torch.randn(batch, 5, generator=generator),), {}, wrapper.device_ids)
    assert [chunk.shape[0] for (chunk,) in inputs] == comm.chunk_sizes_for_weights(batch, weights)


@pytest.mark.parametrize(
    "batch,weights",
    [(9, [1, 3]), (13, [5, 1, 1]), (13, [0.2, 0.3, 0.5]), (10, [1, 2, 3, 4]), (3, [4, 1, 1, 1])],
    ids=str,
)
def test_outputs_and_gradients_equal_an_even_split_and_the_full_batch(batch, weights, generator):
    net, x = mlp(generator), torch.randn(batch, 5, generator=generator, dtype=torch.float64)
    grad = torch.randn(batch, 3, generator=generator, dtype=torch.float64)
    full_batch = step(net, net, x, grad)
    even = step(minidp.DataParallel(net, cpu_ids(len(weights))), net, x, grad)
    weighted = step(minidp.DataParallel(net, cpu_ids(len(weights)), chunk_weights=weights), net, x, grad)
    assert_same(weighted, even)
    assert_same(weighted, full_batch)


def test_data_parallel_takes_chunk_weights_too(generator):
    net, x = mlp(generator), torch.randn(11, 5, generator=generator, dtype=torch.float64)
    grad = torch.randn(11, 3, generator=generator, dtype=torch.float64)
    weighted = step(lambda batch: minidp.data_parallel(net, batch, cpu_ids(3), chunk_weights=[1, 1, 8]), net, x, grad)
    assert_same(weighted, step(net, net, x, grad))


# --------------------------------------------------------------------------------------------------
# bad weights: refused when the DataParallel is built, naming chunk_weights
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights,error,message",
    [
        ([1, 0], ValueError, r"chunk_weights\[1\] is 0"),
        ([1, -2], ValueError, r"chunk_weights\[1\] is -2"),
        ([float("nan"), 1], ValueError, r"chunk_weights\[0\] is nan"),
        ([1, float("inf")], ValueError, r"chunk_weights\[1\] is inf"),
        ([True, 1], ValueError, r"chunk_weights\[0\] is True"),
        (["1", 1], ValueError, r"chunk_weights\[0\] is '1'"),
        ([1, 1, 1], ValueError, "chunk_weights has 3 entries but there are 2 devices"),
        ([], ValueError, "chunk_weights is empty"),
        (2.0, TypeError, "chunk_weights must be a list"),
    ],
    ids=["zero", "negative", "nan", "inf", "bool", "string", "count", "empty", "scalar"],
)
def test_bad_weights_are_refused_at_construction(weights, error, message):
    with pytest.raises(error, match=message):
        minidp.DataParallel(nn.Linear(2, 2), cpu_ids(2), chunk_weights=weights)


def test_chunk_sizes_and_chunk_weights_together_are_refused(generator):
    with pytest.raises(ValueError, match="chunk_sizes or chunk_weights, not both"):
        minidp.scatter(torch.randn(4, 2, generator=generator), cpu_ids(2), chunk_sizes=[2, 2], chunk_weights=[1, 1])
