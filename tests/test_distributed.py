"""minidp.distributed.DistributedDataParallel against stock torch DDP, in real Gloo processes on 127.0.0.1.

Each test reads one result of a job: the processes are started once per world size
(``minidp.distributed.launch``, bounded by ``job_timeout``, every process ended by it), run all the
checks of ``ddp_checks`` on fresh seeds, and send back plain facts. "Equal" here means bitwise
(``torch.equal``) unless a tolerance is named.
"""

from __future__ import annotations

import pytest
import torch

from . import ddp_checks as checks
from .helpers import (
    RTOL_FLOAT64, TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP, TORCH_DDP_TAKES_A_ZERO_BUCKET_CAP, cpu_ids, each_rank, job_fixture,
)
from .helpers import assert_no_differences as assert_same_as_stock
from minidp.distributed import chrome_trace, hidden_share


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """These checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


JOB_TIMEOUT = 240.0  # seconds for a whole job; the process group's own timeout is launch()'s 60 s

TWO_PROCESSES = {
    "float32": (checks.against_torch, {}),
    "float64": (checks.against_torch, {"dtype": torch.float64}),
    "small_buckets": (checks.against_torch, {"model": "resnet_bn", "bucket_cap_mb": 0.001}),
    "no_sync": (checks.against_torch, {"micro_batches": 3}),
    "find_unused": (checks.against_torch, {"model": "partly_used", "find_unused_parameters": True}),
    "batch_norm": (checks.against_torch, {"model": "resnet_bn"}),
    "batch_norm_unsynced": (checks.against_torch, {"model": "resnet_bn", "broadcast_buffers": False}),
    "allreduce_hook": (checks.against_torch, {"hook": "allreduce"}),
    "fp16_compress_hook": (checks.against_torch, {"hook": "fp16_compress"}),
    "bf16_compress_hook": (checks.against_torch, {"hook": "bf16_compress"}),
    "bf16_compress_wrapper": (checks.against_torch, {"hook": "bf16_compress_wrapper"}),
    "bucket_view_set_to_none": (checks.against_torch, {"gradient_as_bucket_view": True}),
    "bucket_view_zeroed": (checks.against_torch, {"gradient_as_bucket_view": True, "set_to_none": False}),
    "hook_buckets_default": (checks.hook_calls, {}),
    "hook_buckets_small": (checks.hook_calls, {"model": "resnet_bn", "bucket_cap_mb": 0.001}),
    "hook_buckets_find_unused": (checks.hook_calls, {"bucket_cap_mb": 1, "find_unused_parameters": True}),
    "full_batch": (checks.matches_full_batch, {}),
    "replicas_full_batch": (checks.matches_full_batch, {"device_ids": cpu_ids(2)}),
    "mismatched_model": (checks.mismatched_model, {}),
    "parameters_in_another_order": (checks.parameters_in_another_order, {}),
    "find_unused_on_one_rank": (checks.argument_on_one_rank, {"name": "find_unused_parameters", "values": (False, True)}),
    "static_graph_on_one_rank": (checks.argument_on_one_rank, {"name": "static_graph", "values": (False, True)}),
    "forward_sync_buffers_on_one_rank": (checks.argument_on_one_rank, {"name": "forward_sync_buffers", "values": (True, False), "model": "resnet_bn"}),
    "forward_sync_buffers_without_buffers": (checks.argument_on_one_rank, {"name": "forward_sync_buffers", "values": (True, False)}),
    "bucket_cap_mb_list_per_rank": (checks.argument_on_one_rank, {"name": "bucket_cap_mb_list", "values": ([25], [0.1] * 8)}),
    "gradient_as_bucket_view_on_one_rank": (checks.argument_on_one_rank, {"name": "gradient_as_bucket_view", "values": (False, True)}),
    "unused_without_find_unused": (checks.unused_without_find_unused, {}),
    "timeline": (checks.timeline_of_a_step, {}),
    "sharded_root": (checks.sharded_module, {"where": "root"}),
    "sharded_child": (checks.sharded_module, {"where": "child"}),
    "bad_hook_result_on_one_bucket": (checks.bad_hook_result_on_one_bucket, {}),
}

if TORCH_DDP_TAKES_A_ZERO_BUCKET_CAP:
    TWO_PROCESSES["zero_cap"] = (checks.against_torch, {"model": "resnet_bn", "bucket_cap_mb": 0})
if TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP:
    TWO_PROCESSES["negative_cap"] = (checks.against_torch, {"model": "resnet_bn", "bucket_cap_mb": -1})
    TWO_PROCESSES["hook_buckets_negative_cap"] = (checks.hook_calls, {"model": "resnet_bn", "bucket_cap_mb": -1})

THREE_PROCESSES = {
    "float32": (checks.against_torch, {}),
    "float64": (checks.against_torch, {"dtype": torch.float64}),
    "batch_norm": (checks.against_torch, {"model": "resnet_bn", "bucket_cap_mb": 0.001}),
    "full_batch": (checks.matches_full_batch, {}),
    "replicas_full_batch": (checks.matches_full_batch, {"device_ids": cpu_ids(2)}),
}


two = job_fixture("two", checks.run_checks, 2, TWO_PROCESSES, JOB_TIMEOUT)
three = job_fixture("three", checks.run_checks, 3, THREE_PROCESSES, JOB_TIMEOUT)


# ---- bitwise equal to torch DDP, every step of SGD with momentum, from different initial weights ----


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parameters_equal_stock_ddp_bitwise_after_every_step_two_processes(two, dtype):
    assert_same_as_stock(two, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parameters_equal_stock_ddp_bitwise_after_every_step_three_processes(three, dtype):
    # with 3 ranks, 1/3 is inexact: only stock's multiply-on-copy (not a division) gives these bits
    assert_same_as_stock(three, dtype)


def test_many_small_buckets_equal_stock_ddp(two):
    assert_same_as_stock(two, "small_buckets")


@pytest.mark.skipif(not TORCH_DDP_TAKES_A_ZERO_BUCKET_CAP, reason="this torch's DDP refuses bucket_cap_mb=0")
def test_a_zero_bucket_cap_a_bucket_per_parameter_equals_stock_ddp(two):
    # torch takes bucket_cap_mb=0 (_BucketCapacityConfig: a 0-byte limit, every bucket closed at its first parameter)
    assert_same_as_stock(two, "zero_cap")


@pytest.mark.skipif(not TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP, reason="compared with torch 2.13's DDP only")
def test_a_negative_bucket_cap_no_limit_equals_stock_ddp(two):
    # torch takes bucket_cap_mb=-1 (_BucketCapacityConfig keeps it; reducer.cpp reads it as an unsigned size: no limit)
    assert_same_as_stock(two, "negative_cap")


def test_no_sync_accumulates_then_reduces_the_sum_as_stock(two):
    assert_same_as_stock(two, "no_sync")


def test_find_unused_parameters_matches_stock_with_rank_dependent_unused_and_ignored_outputs(two):
    # branch: used on rank 0 only; never: unused everywhere (its .grad stays None, as in stock);
    # side: reached from an output the loss ignores
    assert_same_as_stock(two, "find_unused")


@pytest.mark.parametrize("check", ["batch_norm", "batch_norm_unsynced"])
def test_batch_norm_buffers_follow_stock_with_and_without_broadcast_buffers(two, check):
    assert_same_as_stock(two, check)


def test_batch_norm_with_small_buckets_three_processes(three):
    assert_same_as_stock(three, "batch_norm")


@pytest.mark.parametrize("hook", ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "bf16_compress_wrapper"])
def test_stock_comm_hooks_give_stock_results(two, hook):
    assert_same_as_stock(two, hook)


@pytest.mark.parametrize("check", ["bucket_view_set_to_none", "bucket_view_zeroed"])
def test_gradient_as_bucket_view_matches_stock_values_and_bucket_storage(two, check):
    assert_same_as_stock(two, check)
    for result in each_rank(two, check):
        views = result["bucket_views"]  # per step: stock's grads grouped by storage, then minidp's
        assert views[0::2] == views[1::2]
        assert views[-1] == sorted(sorted(b) for b in result["plan"])


# ---- the bucket plan ------------------------------------------------------------------------


@pytest.mark.parametrize("check", ["float32", "small_buckets", "batch_norm"])
def test_bucket_plan_equals_stock_rebuilt_plan(two, check):
    for result in each_rank(two, check):
        assert result["stock_plan"] == ", ".join(" ".join(map(str, b)) for b in result["plan"])


@pytest.mark.parametrize("check", ["hook_buckets_default", "hook_buckets_small", "hook_buckets_find_unused",
                                   *(["hook_buckets_negative_cap"] if TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP else [])])
def test_every_backward_hands_hooks_the_buckets_stock_hands_them(two, check):
    for result in each_rank(two, check):
        assert result["minidp"] == result["stock"]
        # and bucket_plan() announced each backward's buckets beforehand
        assert result["plans"] == [[indices for _, _, indices in backward] for backward in result["stock"]]


def test_first_backward_uses_one_bucket_then_buckets_are_rebuilt_in_arrival_order(two):
    first, second, _ = two[0]["hook_buckets_default"]["stock"]
    assert [indices for _, _, indices in first] == [[0, 1, 2, 3]]
    assert [indices for _, _, indices in second] == [[3, 2], [1, 0]]  # 1 MiB first bucket, overshot by the 2 MiB weight


@pytest.mark.skipif(not TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP, reason="compared with torch 2.13's DDP only")
def test_a_negative_bucket_cap_keeps_every_parameter_in_one_bucket_after_the_rebuild(two):
    # torch's reducer reads the negative cap as an unsigned size, the largest there is (stock's calls, compared above)
    hooked = two[0]["hook_buckets_negative_cap"]["minidp"]
    assert [len(backward) for backward in hooked] == [1, 1, 1]


def test_find_unused_parameters_keeps_the_reversed_initial_plan(two):
    result = two[0]["hook_buckets_find_unused"]
    # 1 MiB caps in registration order: [0] (exactly 1 MiB), [1, 2] (4 KiB + 2 MiB), [3]; reversed
    assert result["plans"][0] == result["plans"][-1] == [[3], [1, 2], [0]]


# ---- equal to one process on the full batch ----------------------------------------------------


@pytest.mark.parametrize("check", ["full_batch", "replicas_full_batch"])
def test_equal_to_one_process_on_the_full_batch(two, three, check):
    for results in (two, three):
        for worst in each_rank(results, check):
            assert worst <= RTOL_FLOAT64


# ---- errors -------------------------------------------------------------------------------------


def test_mismatched_models_raise_on_every_rank_naming_the_parameter(two):
    for message in each_rank(two, "mismatched_model"):
        assert "parameter 0 ('net.0.weight') has shape (33, 16) on rank 1 and (32, 16) on rank 0" in message


def test_mismatched_models_raise_a_runtime_error_as_stock(two):
    # distributed.py, _verify_param_shape_across_processes: torch raises RuntimeError, which code written for it catches
    for message in each_rank(two, "mismatched_model"):
        assert message.startswith("RuntimeError: DistributedDataParallel needs the same model on every rank")


def test_same_shaped_parameters_registered_in_another_order_raise_on_every_rank_naming_both(two):
    # torch compares shapes only: it broadcasts rank 0's values by position and trains a silently wrong model
    for message in each_rank(two, "parameters_in_another_order"):
        assert message.startswith("RuntimeError: DistributedDataParallel needs the same model on every rank")
        assert "parameter 0 is 'b.weight' on rank 1 and 'a.weight' on rank 0" in message


def _refused_setting(message: str, difference: str) -> None:
    assert message.startswith("RuntimeError: DistributedDataParallel needs the same settings on every rank, but ")
    assert difference in message and "Pass the same value on every rank" in message


def test_find_unused_parameters_on_one_rank_only_raises_on_every_rank(two):
    # torch DDP: the ranks' backwards exchange different things, and both time out in Gloo
    for message in each_rank(two, "find_unused_on_one_rank"):
        _refused_setting(message, "find_unused_parameters is True on rank 1 and False on rank 0")


def test_static_graph_on_one_rank_only_raises_on_every_rank(two):
    # torch DDP: Gloo aborts the process ("Received data size doesn't match expected size")
    for message in each_rank(two, "static_graph_on_one_rank"):
        _refused_setting(message, "static_graph is True on rank 1 and False on rank 0")


def test_forward_sync_buffers_on_one_rank_only_raises_on_every_rank(two):
    # torch DDP: rank 0 broadcasts the buffers in each forward, rank 1 does not, and both time out
    for message in each_rank(two, "forward_sync_buffers_on_one_rank"):
        _refused_setting(message, "forward_sync_buffers (or broadcast_buffers, its older name) is False on rank 1 and True on rank 0")


def test_forward_sync_buffers_that_differ_on_a_model_without_buffers_is_harmless_and_taken(two):
    assert each_rank(two, "forward_sync_buffers_without_buffers") == ["no error", "no error"]


def test_bucket_caps_that_differ_between_ranks_raise_on_every_rank(two):
    # torch DDP: the ranks' buckets differ in size, and Gloo aborts the process
    for message in each_rank(two, "bucket_cap_mb_list_per_rank"):
        _refused_setting(message, "bucket_cap_mb_list is [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1] on rank 1 and [25] on rank 0")


def test_gradient_as_bucket_view_on_one_rank_only_is_harmless_and_taken(two):
    # where each .grad lives: the exchanges are the same
    assert each_rank(two, "gradient_as_bucket_view_on_one_rank") == ["no error", "no error"]


def test_a_parameter_without_gradient_fails_the_next_forward_with_stocks_words_and_log(two):
    # reducer.cpp (ensure_prior_reduction_finished): the backward ends, the next forward raises; the indices that
    # got no gradient on this rank, their names unless TORCH_DISTRIBUTED_DEBUG is OFF; logged (_log_and_throw)
    for result in each_rank(two, "unused_without_find_unused"):
        assert result["minidp"] == result["stock"]
    (_, call, message, logged), (_, _, named, _) = two[1]["unused_without_find_unused"]["minidp"]
    assert call == "second forward" and message in logged
    # branch (rank 0 alone uses it), never, and side (its output is not in the loss); names last-registered first
    assert "Parameter indices which did not receive grad for rank 1: 2 3 4 5 8 9" in message
    assert "rank 1: side.bias, side.weight, never.bias, never.weight, branch.bias, branch.weight" in named


def test_a_module_fully_shard_sharded_is_refused_as_torch_refuses_it_before_its_shards_are_overwritten(two):
    # torch's DDP of a module FSDP2 sharded raises NotImplementedError in its construction's broadcast ("Operator
    # c10d.broadcast_.default does not have a sharding strategy registered"); minidp's broadcast overwrote rank 1's
    # shards with rank 0's
    for result in each_rank(two, "sharded_root"):
        kind, message = result["minidp"]
        assert kind == result["torch"][0] == "NotImplementedError"
        assert "cannot wrap a module already managed by `fully_shard` (the module, a FSDPMLP)" in message
        assert result["minidp untouched"]


def test_a_module_with_a_sub_module_fully_shard_sharded_is_refused_naming_it(two):
    # torch's DDP fails there too, on mixing its DTensors with the other parameters in its broadcast (RuntimeError:
    # "aten.cat.default got mixed torch.Tensor and DTensor"); minidp's overwrote rank 1's shards with rank 0's
    for result in each_rank(two, "sharded_child"):
        kind, message = result["minidp"]
        assert kind == "NotImplementedError" and result["torch"][0] == "RuntimeError"
        assert "cannot wrap a module already managed by `fully_shard` (its sub-module 'net.0', a FSDPLinear)" in message
        assert result["minidp untouched"]


def test_a_hook_result_of_the_wrong_size_for_one_bucket_writes_back_no_bucket(two):
    # every bucket's result checked first: no .grad is left averaged while the rest stay local (reducer.cpp writes
    # back bucket by bucket, and fails on that one with "setStorage: ... out of bounds")
    for result in each_rank(two, "bad_hook_result_on_one_bucket"):
        kind, message = result["error"]
        assert kind == "RuntimeError" and "the future it returned for bucket 1 holds a tensor of 1 elements" in message
        assert result["written back"] == []


# ---- timeline ----------------------------------------------------------------------------------


def test_timeline_of_every_rank_merges_into_one_chrome_trace(two):
    timelines = two[0]["timeline"]
    assert [t[0]["rank"] for t in timelines] == [0, 1]
    for timeline in timelines:
        stages = [(e["stage"], e["bucket"]) for e in timeline]
        assert stages == [("bucket ready", 0), ("all-reduce", 0), ("bucket ready", 1), ("all-reduce", 1),
                          ("backward", None), ("write-back", None)]
        assert all(e["start"] <= e["end"] for e in timeline)
        assert 0.0 <= hidden_share(timeline) <= 1.0
    events = chrome_trace(timelines)["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert sorted(e["name"] for e in events if e.get("ph") == "X" and e["pid"] == 1) == [
        "all-reduce 0", "all-reduce 1", "backward", "write-back"]
