"""PyTorch's ``test/distributed/optim/test_zero_redundancy_optimizer.py`` run against
``minidp.distributed.ZeroRedundancyOptimizer``: one job of 1 Gloo process for the single-rank class, one of 2
for the distributed one (upstream's world size without GPUs), one of 4 for the case that checks nothing below 4.

Every upstream test name appears here once, in a class of upstream's name. Ported (bodies in
``tests/upstream_zero_checks.py``): every case upstream runs on the CPU, and those it gates on a GPU only to have
one. Skipped, with the reason: model parallelism over 4 GPUs, the GPU join, and ``overlap_with_ddp``, which minidp
refuses (README, "Sharding the optimizer"). Adapted from PyTorch (BSD 3-clause), copyright the PyTorch
contributors.
"""

from __future__ import annotations

from itertools import product

import pytest

from . import upstream_zero_checks as checks
from .helpers import assert_passed_on_every_rank, launch_upstream


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


SINGLE_RANK = ["test_state_dict", "test_lr_scheduler", "test_step_with_kwargs", "test_step_with_extra_inner_key",
               "test_step_without_closure", "test_zero_grad", "test_constructor", "test_same_dense_param_type"]
DISTRIBUTED = ["test_step", "test_step_with_closure", "test_lr_scheduler", "test_sharding", "test_add_param_group",
               "test_multiple_param_groups", "test_collect_shards", "test_zero_join_cpu"]
PARITY = list(product(["Adam", "AdamW", "SGD"], [False, True]))  # (optimizer_class_str, maximize)


@pytest.fixture(scope="module")
def single_rank() -> list[dict]:
    return launch_upstream(checks.__name__, [(f"SingleRank.{name}", {}) for name in SINGLE_RANK], processes=1)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    parity = [("Distributed.test_local_optimizer_parity", {"optimizer_class_str": c, "maximize": m}) for c, m in PARITY]
    return launch_upstream(checks.__name__, [(f"Distributed.{name}", {}) for name in DISTRIBUTED] + parity)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return launch_upstream(checks.__name__, [("Distributed.test_nondefault_process_group", {})], processes=4)


class TestZeroRedundancyOptimizerSingleRank:
    def test_state_dict(self, single_rank):
        assert_passed_on_every_rank(single_rank, "SingleRank.test_state_dict")

    def test_lr_scheduler(self, single_rank):
        assert_passed_on_every_rank(single_rank, "SingleRank.test_lr_scheduler")

    def test_step_with_kwargs(self, single_rank):
        assert_passed_on_every_rank(single_rank, "SingleRank.test_step_with_kwargs")

    def test_step_with_extra_inner_key(self, single_rank):
        assert_passed_on_every_rank(single_rank, "SingleRank.test_step_with_extra_inner_key")

    def test_step_without_closure(self, single_rank):
        assert_passed_on_every_rank(single_rank, "SingleRank.test_step_without_closure")

    def test_zero_grad(self, single_rank):
        assert_passed_on_every_rank(single_rank, "SingleRank.test_zero_grad")

    def test_constructor(self, single_rank):
        assert_passed_on_every_rank(single_rank, "SingleRank.test_constructor")

    def test_same_dense_param_type(self, single_rank):
        assert_passed_on_every_rank(single_rank, "SingleRank.test_same_dense_param_type")


class TestZeroRedundancyOptimizerDistributed:
    def test_step(self, two_ranks):
        assert_passed_on_every_rank(two_ranks, "Distributed.test_step")

    def test_step_with_closure(self, two_ranks):
        assert_passed_on_every_rank(two_ranks, "Distributed.test_step_with_closure")

    def test_lr_scheduler(self, two_ranks):
        assert_passed_on_every_rank(two_ranks, "Distributed.test_lr_scheduler")

    def test_sharding(self, two_ranks):
        assert_passed_on_every_rank(two_ranks, "Distributed.test_sharding")

    def test_add_param_group(self, two_ranks):
        assert_passed_on_every_rank(two_ranks, "Distributed.test_add_param_group")

    def test_multiple_param_groups(self, two_ranks):
        assert_passed_on_every_rank(two_ranks, "Distributed.test_multiple_param_groups")

    def test_collect_shards(self, two_ranks):
        assert_passed_on_every_rank(two_ranks, "Distributed.test_collect_shards")

    def test_zero_join_cpu(self, two_ranks):
        assert_passed_on_every_rank(two_ranks, "Distributed.test_zero_join_cpu")

    @pytest.mark.parametrize("optimizer_class_str,maximize", PARITY)
    def test_local_optimizer_parity(self, two_ranks, optimizer_class_str, maximize):
        assert_passed_on_every_rank(two_ranks, f"Distributed.test_local_optimizer_parity[{optimizer_class_str}][{maximize}]")

    def test_nondefault_process_group(self, four_ranks):
        assert_passed_on_every_rank(four_ranks, "Distributed.test_nondefault_process_group")

    def test_zero_join_gpu(self):
        pytest.skip("upstream runs it on GPUs only (skip_if_no_gpu); its CPU twin, test_zero_join_cpu, is ported")

    @pytest.mark.parametrize("parameters_as_bucket_view", [False, True])
    def test_zero_model_parallel(self, parameters_as_bucket_view):
        pytest.skip("upstream needs 4 GPUs, two per process (skip_if_lt_x_gpu(4))")

    @pytest.mark.parametrize("use_interleaved_hook,gradient_as_bucket_view,static_graph,shard_buckets",
                             list(product([False, True], repeat=4)))
    def test_ddp_zero_overlap(self, use_interleaved_hook, gradient_as_bucket_view, static_graph, shard_buckets):
        pytest.skip("upstream runs it on GPUs only (skip_if_no_gpu), and it needs overlap_with_ddp=True, which "
                    "minidp.distributed.ZeroRedundancyOptimizer refuses")
