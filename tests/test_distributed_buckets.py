"""The bucket plan's rules (minidp.distributed.buckets) against torch's own C++ assignment function.

``torch.distributed._compute_bucket_assignment_by_size`` is the function DDP calls (reducer.cpp);
minidp reimplements it in Python, and these tests compare the two on random parameter lists. The
whole DDP (initial and rebuilt plans as DDP makes them) is compared in test_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from minidp.distributed.buckets import (
    NO_LIMIT, BucketCaps, Bucket, GradBucket, assign_buckets, initial_plan, rebuilt_plan,
)


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """minidp.DataParallel's defaults play no part here: once, not under both configurations of tests/conftest.py."""


DTYPES = [torch.float32, torch.float64, torch.float16]


def random_tensors(generator: torch.Generator, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    count = int(torch.randint(1, 14, (), generator=generator))
    sizes = torch.randint(1, 600, (count,), generator=generator).tolist()
    kinds = torch.randint(0, len(dtypes), (count,), generator=generator).tolist()
    return [torch.empty(n, dtype=dtypes[k]) for n, k in zip(sizes, kinds)]


def random_limits(generator: torch.Generator) -> list[int]:
    return torch.randint(1, 3000, (int(torch.randint(1, 4, (), generator=generator)),), generator=generator).tolist()


def test_assignment_in_registration_order_equals_torch_for_mixed_dtypes(generator):
    for _ in range(300):
        tensors, limits = random_tensors(generator, DTYPES), random_limits(generator)
        expected, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
        assert assign_buckets(tensors, limits) == [list(b) for b in expected], (tensors, limits)


def test_assignment_in_arrival_order_equals_torch_unsorted(generator):
    for _ in range(300):
        tensors, limits = random_tensors(generator, [torch.float32]), random_limits(generator)
        order = torch.randperm(len(tensors), generator=generator).tolist()
        arrived = [tensors[i] for i in order]
        expected, _ = dist._compute_bucket_assignment_by_size(arrived, limits, [], order)
        assert assign_buckets(arrived, limits, order) == [list(b) for b in expected], (tensors, limits, order)


def test_assignment_in_arrival_order_equals_torch_for_mixed_dtypes(generator):
    # the buckets still open at the end come out of torch's hash table of them, whose order is the reverse of the
    # order in which their dtypes were first met (reducer.cpp, compute_bucket_assignment_by_size)
    for _ in range(300):
        tensors, limits = random_tensors(generator, DTYPES + [torch.bfloat16]), random_limits(generator)
        order = torch.randperm(len(tensors), generator=generator).tolist()
        arrived = [tensors[i] for i in order]
        expected, _ = dist._compute_bucket_assignment_by_size(arrived, limits, [], order)
        assert assign_buckets(arrived, limits, order) == [list(b) for b in expected], (tensors, limits, order)


def test_a_bucket_closes_once_it_reaches_its_limit_and_may_overshoot():
    tensors = [torch.empty(n) for n in (10, 10, 100, 10)]  # 40, 40, 400, 40 bytes
    assert assign_buckets(tensors, [80, 100]) == [[0, 1], [2], [3]]  # 80 >= 80 closes; 400 overshoots 100


def test_default_caps_are_25_mib_with_a_1_mib_first_bucket_and_explicit_caps_apply_to_every_bucket():
    assert BucketCaps.from_mb(None) == BucketCaps(first=dist._DEFAULT_FIRST_BUCKET_BYTES, cap=25 * 2**20)
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    assert BucketCaps.from_mb(0.5) == BucketCaps(first=2**19, cap=2**19)
    assert BucketCaps.from_mb(0) == BucketCaps(first=0, cap=0)  # torch takes 0: a bucket per parameter


@pytest.mark.skipif(not hasattr(torch.nn.parallel.distributed, "_BucketCapacityConfig"),
                    reason="this torch's DDP has no bucket_cap_mb_list (_BucketCapacityConfig) to compare with")
@pytest.mark.parametrize("bucket_cap_mb, bucket_cap_mb_list", [
    (None, [1, 4, 2]), (0.5, [3, 0.25]), (None, None), (2, None), (-1, None), (-0.5, None), (-1e-9, None)])
def test_caps_equal_torchs_bucket_capacity_config_the_largest_of_a_list_the_cap(bucket_cap_mb, bucket_cap_mb_list):
    # distributed.py, _BucketCapacityConfig.create: with bucket_cap_mb_list the cap (DDP's bucket_bytes_cap, in its
    # logging data) is the largest of the list, and the first bucket's limit is that cap too
    stock = torch.nn.parallel.distributed._BucketCapacityConfig.create(bucket_cap_mb, bucket_cap_mb_list, False)
    caps = BucketCaps.from_mb(bucket_cap_mb, bucket_cap_mb_list)
    assert (caps.cap, caps.first, caps.per_bucket) == (
        stock.bucket_bytes_cap, stock.first_bucket_bytes_cap, stock.per_bucket_bytes_caps)


def test_a_zero_cap_closes_every_bucket_at_its_first_tensor_as_torchs_plan_does():
    tensors = [torch.empty(n) for n in (10, 10, 100, 10)]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, [0])
    assert assign_buckets(tensors, BucketCaps.from_mb(0).limits()) == [list(b) for b in expected] == [[0], [1], [2], [3]]


def test_a_negative_cap_is_no_limit_where_the_reducer_plans_one_bucket_per_dtype():
    # reducer.cpp passes its caps to compute_bucket_assignment_by_size as unsigned sizes: -1 MiB reads as the largest
    tensors = [torch.empty(300_000), torch.empty(10, dtype=torch.float64), torch.empty(300_000)]
    assert BucketCaps.from_mb(-1).limits() == [NO_LIMIT]
    assert rebuilt_plan(tensors, [2, 1, 0], BucketCaps.from_mb(-1)) == [[1], [2, 0]]


def test_initial_plan_is_one_bucket_unless_unused_parameters_are_searched():
    params = [torch.empty(300_000), torch.empty(10), torch.empty(300_000)]  # 1.2 MB, 40 B, 1.2 MB
    assert initial_plan(params, BucketCaps.from_mb(None), find_unused_parameters=False) == [[0, 1, 2]]
    # searched: 1 MiB first, then 25 MiB, in registration order, the list of buckets reversed
    assert initial_plan(params, BucketCaps.from_mb(None), find_unused_parameters=True) == [[1, 2], [0]]


def test_rebuilt_plan_follows_arrival_order_with_the_small_bucket_first():
    params = [torch.empty(300_000), torch.empty(10), torch.empty(300_000)]
    assert rebuilt_plan(params, [2, 1, 0], BucketCaps.from_mb(None)) == [[2], [1, 0]]


def test_bucket_views_share_one_flat_buffer_in_plan_order_with_the_parameters_strides():
    weight = torch.nn.Parameter(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last))
    bias = torch.nn.Parameter(torch.empty(3))
    bucket = Bucket.allocate(0, [1, 0], [weight, bias])
    assert bucket.buffer.numel() == 123
    assert [v.shape for v in bucket.views] == [bias.shape, weight.shape]
    assert bucket.views[1].stride() == weight.stride()
    bucket.buffer.copy_(torch.arange(123.0))
    assert bucket.views[0].tolist() == [0.0, 1.0, 2.0]  # the bias comes first: it is first in the plan
    assert bucket.views[1].flatten().sort().values.tolist() == list(range(3, 123))


def test_a_bucket_refuses_parameters_of_two_dtypes():
    with pytest.raises(ValueError, match="bucket 0 mixes parameter 0 .*torch.float32.* parameter 1 .*torch.float64"):
        Bucket.allocate(0, [0, 1], [torch.empty(2), torch.empty(2, dtype=torch.float64)])


def test_grad_bucket_offers_the_methods_stock_hooks_call():
    params = [torch.nn.Parameter(torch.empty(2, 2)), torch.nn.Parameter(torch.empty(3))]
    bucket = Bucket.allocate(1, [1, 0], params)
    view = GradBucket(bucket, bucket_count=2)
    assert view.index() == 1 and view.is_last()
    assert view.buffer() is bucket.buffer
    assert [p is q for p, q in zip(view.parameters(), [params[1], params[0]])] == [True, True]
    assert [g.shape for g in view.gradients()] == [torch.Size([3]), torch.Size([2, 2])]
    half = bucket.buffer.half()
    view.set_buffer(half)
    assert view.buffer() is half and bucket.buffer is not half
