"""torch DDP's features beyond the basic training step, in minidp.distributed, against stock torch DDP in real
Gloo processes on 127.0.0.1 (one job per world size, bounded; see ``tests/test_distributed.py``).

Each test cites the torch 2.13 source it mirrors: ``torch/nn/parallel/distributed.py`` (DDP) and the
behaviour of its C++ reducer as torch's own tests exercise it
(``torch/testing/_internal/distributed/distributed_test.py``).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from . import ddp_checks, ddp_feature_checks as checks
from .helpers import (
    RTOL_FLOAT64, TORCH_DDP_KEEPS_BUFFER_VERSIONS, TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP, TORCH_DDP_TAKES_A_ZERO_BUCKET_CAP,
    assert_no_differences, cpu_ids, each_rank, fresh_python, job_fixture, run_job,
)
from minidp.distributed import RankFailed, launch
from minidp.distributed.reducer import COMPILED_AUTOGRAD_REFUSED, CREATE_GRAPH_WARNING, FOUND_NO_UNUSED_PARAMETERS


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """These checks run in processes of their own: once, not under both configurations of tests/conftest.py."""


JOB_TIMEOUT = 300.0

# DDP's native mixed precision (param, reduce, buffer dtypes; wrapper and training options): upstream's configuration
# (everything in float16) with each of its variations, a reduction in float32, also with gradients kept over two steps
# (the second backward adds onto float32 means cast down), a forward under no_grad before each step, bfloat16
# parameters, buffers left alone, a static graph, a search for unused parameters (whose accumulators change with the
# parameters' dtype).
MIXED_PRECISION = {
    "fp16": {"param_dtype": "float16", "reduce_dtype": "float16", "buffer_dtype": "float16"},
    "fp16_grad_as_bucket_view": {"param_dtype": "float16", "reduce_dtype": "float16", "buffer_dtype": "float16",
                                 "gradient_as_bucket_view": True},
    "fp16_zero_grad_kept": {"param_dtype": "float16", "reduce_dtype": "float16", "buffer_dtype": "float16",
                            "set_to_none": False},
    "fp16_reduce_fp32_gradients_kept": {"param_dtype": "float16", "reduce_dtype": "float32", "buffer_dtype": "float16",
                                        "zero_grad_every": 2},
    "fp16_reduce_fp32": {"param_dtype": "float16", "reduce_dtype": "float32", "buffer_dtype": "float16"},
    "fp16_evaluated": {"param_dtype": "float16", "reduce_dtype": "float16", "buffer_dtype": "float16", "evaluate": True},
    "bf16_no_sync": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "buffer_dtype": "bfloat16", "accumulate": True},
    "bf16_buffers_kept": {"param_dtype": "bfloat16", "reduce_dtype": None, "buffer_dtype": None},
    "fp16_static_graph": {"param_dtype": "float16", "reduce_dtype": "float32", "buffer_dtype": "float16",
                          "static_graph": True},
    "bf16_find_unused": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "buffer_dtype": "bfloat16",
                         "find_unused_parameters": True},
    # a weight frozen after wrapping: no accumulator to look for (the search at every forward, a static graph's first)
    "bf16_find_unused_frozen": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "buffer_dtype": "bfloat16",
                                "find_unused_parameters": True, "frozen": True},
    "fp16_static_graph_frozen": {"param_dtype": "float16", "reduce_dtype": "float32", "buffer_dtype": "float16",
                                 "static_graph": True, "frozen": True},
}

# Where torch's own DDP falls short in these runs, so that only minidp's gradients are checked (against the
# low-precision mean): with gradient_as_bucket_view its gradients leave the mean from the third backward on; under
# no_sync the autograd hooks its forward adds pile up, and the next synchronised backward raises ("marked as ready
# twice"); a forward under no_grad raises in its pre-hook, which reads the grad_fn of a tensor made without one; with
# static_graph its buckets are rebuilt after the second backward, which sums the stale buffer too (NaN from then on);
# with find_unused_parameters its graph search raises (AttributeError); with a weight frozen after wrapping its hook
# casts that weight's gradient, None (AttributeError).
STOCK_MIXED_PRECISION_FALLS_SHORT = {"fp16_grad_as_bucket_view", "bf16_no_sync", "fp16_evaluated", "fp16_static_graph",
                                     "bf16_find_unused", "bf16_find_unused_frozen", "fp16_static_graph_frozen"}

TWO_PROCESSES = {
    "saved": (checks.pickled_then_trained, {"how": "torch.save"}),
    "deepcopied": (checks.pickled_then_trained, {"how": "deepcopy"}),
    "deepcopied_static": (checks.pickled_then_trained, {"how": "deepcopy", "static_graph": True}),
    "deepcopied_python_reducer": (checks.pickled_then_trained_with_python_reducer, {"how": "deepcopy"}),
    "told_none_unused": (checks.told_none_unused, {}),
    "distributed_checkpoint": (checks.distributed_checkpoint_as_stock, {}),
    "pickling_subgroup": (checks.pickling_with_a_subgroup, {}),
    "create_graph": (checks.create_graph_as_stock, {}),
    "create_graph_second": (checks.create_graph_with_several_parameters, {}),
    "gradient_penalty": (checks.gradient_penalty_as_stock, {}),
    "compiled": (checks.compiled_as_stock, {}),
    "graph_splits": (checks.graph_splits_as_stock, {"composable": False}),
    "graph_splits_replicate": (checks.graph_splits_as_stock, {"composable": True}),
    "compiled_autograd_refused": (checks.compiled_autograd_as_stock, {"python_reducer": False}),
    "compiled_autograd_refused_replicate": (checks.compiled_autograd_as_stock, {"python_reducer": False, "composable": True}),
    "python_reducer": (checks.compiled_autograd_as_stock, {"python_reducer": True}),
    "python_reducer_replicate": (checks.compiled_autograd_as_stock, {"python_reducer": True, "composable": True}),
    "description": (checks.description_as_stock, {}),
    "requires_grad_differs": (checks.requires_grad_differs, {}),
    "post_accumulate_hooks": (checks.post_accumulate_grad_hooks_as_stock, {}),
    "backward_of_some_parameters": (checks.backward_of_some_parameters_with_find_unused, {}),
    **{f"two_losses_in_turn_{name}": (checks.two_losses_back_propagated_in_turn, options)
       for name, options in (("default", {}), ("find_unused", {"find_unused_parameters": True}),
                             ("static", {"static_graph": True}))},
    "two_losses_with_a_rebuild_between": (checks.two_losses_with_a_rebuild_between, {}),
    "output_in_place_find_unused": (checks.output_changed_in_place_as_stock, {"find_unused_parameters": True}),
    "output_in_place_static": (checks.output_changed_in_place_as_stock, {"static_graph": True}),
    "output_in_place_not_cloned": (checks.output_changed_in_place_as_stock, {
        "find_unused_parameters": True, "sink_clone": False}),
    **{f"output_container_{container}_{name}": (checks.output_container_as_stock, {"container": container, **options})
       for container in ("heads", "pair")
       for name, options in (("find_unused", {"find_unused_parameters": True}), ("static", {"static_graph": True}))},
    "post_accumulate_hooks_bucket_view": (checks.post_accumulate_grad_hooks_as_stock, {"gradient_as_bucket_view": True}),
    "post_accumulate_hooks_after_forward": (checks.post_accumulate_grad_hooks_as_stock,
                                            {"between_forward_and_backward": True}),
    "swapped_after_wrapping": (checks.swapped_after_wrapping, {}),
    **{case: (checks.broadcast_copies_as_stock, {"case": case})
       for case in ("expanded_buffer", "graph_recorded_before", "buffer_saved_for_backward", "empty_tensors", "joined")},
    "parametrized_after_wrapping": (checks.parametrized_after_wrapping, {}),
    "comm_hook_errors": (checks.comm_hook_errors, {}),
    "hook_results": (checks.hook_results, {}),
    "failing_comm_hook": (checks.failing_comm_hook_as_stock, {}),
    "builtin_allreduce": (checks.builtin_hook_as_stock, {"hook_type": "ALLREDUCE"}),
    "builtin_fp16": (checks.builtin_hook_as_stock, {"hook_type": "FP16_COMPRESS"}),
    **{f"checkpoint_{'reentrant' if r else 'plain'}_{'twice' if t else 'once'}_{'unused' if u else 'all'}_"
       f"{'static' if g else 'dynamic'}": (checks.checkpointing_as_stock, {
           "reentrant": r, "twice": t, "find_unused_parameters": u, "static_graph": g})
       for r in (True, False) for t in (False, True) for u in (False, True) for g in (False, True)},
    **{f"unfinished_message_{name}": (checks.unfinished_reduction_message_as_stock, {"find_unused_parameters": unused})
       for name, unused in (("default", False), ("find_unused", True))},
    "static_graph_with_find_unused_warnings": (checks.static_graph_with_find_unused_warnings, {}),
    "auxiliary_loss_kept": (checks.auxiliary_loss_kept_on_the_module_as_stock, {}),
    "output_node_names": (checks.output_node_names_as_stock, {}),
    "copied_after_a_buffer_was_registered": (checks.copied_after_a_buffer_was_registered, {}),
    **{f"buffer_registered_after_wrapping_{name}": (checks.buffer_registered_after_wrapping_as_stock, {"counter": c})
       for name, c in (("alone", False), ("beside_another", True))},
    **{f"static_averaging_{case}": (checks.static_graph_averaging_against_the_ranks_mean, {"case": case})
       for case in ("input_gradient_first", "box_output")},
    "static_buckets": (checks.static_graph_buckets, {"late": False}),
    "static_buckets_late": (checks.static_graph_buckets, {"late": True}),
    "static_set_late": (checks.static_graph_set_late, {}),
    "static_accumulating_from_the_first_step": (checks.static_graph_accumulating_from_the_first_step, {}),
    "static_auxiliary_later": (checks.static_graph_auxiliary_output_as_stock, {"auxiliary_from": 1}),
    "static_auxiliary_never": (checks.static_graph_auxiliary_output_as_stock, {"auxiliary_from": None}),
    **{f"static_unused_head_{container}": (checks.static_graph_unused_head_in_a_container, {"container": container})
       for container in ("dataclass", "dict_subclass")},
    # the first layer's weight frozen after wrapping: at every step, or at the first only
    **{f"{static}_frozen_{name}": (checks.frozen_after_wrapping_as_stock, {"static": static, **options})
       for static in ("static_graph", "set_static_graph")
       for name, options in (("always", {"frozen_at": range(4)}), ("first_step", {"frozen_at": [0]}))},
    "static_graph_frozen_always_float64": (checks.frozen_after_wrapping_as_stock, {"frozen_at": range(4), "dtype": "float64"}),
    "find_unused_frozen_always": (checks.frozen_after_wrapping_as_stock, {
        "frozen_at": range(4), "static": None, "find_unused_parameters": True}),
    "join": (checks.uneven_inputs_as_stock, {}),
    "join_effective_world_size": (checks.uneven_inputs_as_stock, {"divide_by_initial_world_size": False}),
    "join_generic": (checks.uneven_inputs_as_stock, {"through": "Join", "divide_by_initial_world_size": False}),
    "join_batch_norm": (checks.uneven_inputs_as_stock, {"model": "batch_norm"}),
    "join_find_unused": (checks.uneven_inputs_as_stock, {"model": "partly_used"}),
    "join_throw": (checks.uneven_inputs_as_stock, {"throw_on_early_termination": True}),
    # a bucket per parameter once rebuilt; rank 0 joins after its first backward, before it installs that plan
    "join_rebuilt_small_buckets": (checks.uneven_inputs_as_stock, {"batches": (1, 3), "bucket_cap_mb": 0.0001}),
    # a static graph, a rank out of data after its first backward (which only counts hooks) or its second
    **{f"join_{static}_{'_'.join(map(str, batches))}": (checks.uneven_inputs_as_stock, {"static": static, "batches": batches})
       for static in ("static_graph", "set_static_graph") for batches in ((1, 3), (3, 1), (2, 3))},
    "join_static_no_batch": (checks.joined_before_a_static_graphs_first_backward, {}),
    "logging_constructed": (checks.logging_data_as_stock, {"steps": 0, "bucket_cap_mb": 1}),
    "logging_rebuilt": (checks.logging_data_as_stock, {"steps": 3, "bucket_cap_mb": 1}),
    "logging_sampled": (checks.logging_data_as_stock, {
        "steps": 14, "sample_rate": 2, "find_unused_parameters": True, "gradient_as_bucket_view": True}),
    "logging_static_hook": (checks.logging_data_as_stock, {"steps": 3, "static_graph": True, "hook": "python"}),
    "logging_builtin_join": (checks.logging_data_as_stock, {"steps": 2, "hook": "builtin", "under_join": True}),
    "logging_mixed_precision": (checks.logging_data_as_stock, {"steps": 2, "low_precision": "bfloat16"}),
    # a static graph's first backward, reduced in torch's delay_all_reduce, then the next one
    **{f"logging_static_idle_{steps}": (checks.logging_data_as_stock, {"steps": steps, "static_graph": True, "idle_layer": True})
       for steps in (1, 2)},
    "logging_sample_rate_errors": (checks.sample_rate_errors, {}),
    "sparse": (checks.sparse_gradients_as_stock, {}),
    "sparse_small_buckets": (checks.sparse_gradients_as_stock, {"bucket_cap_mb": 0.0001}),
    "sparse_find_unused": (checks.sparse_gradients_as_stock, {"find_unused_parameters": True}),
    "complex": (checks.complex_parameters_as_stock, {}),
    "complex_bucket_view": (checks.complex_parameters_as_stock, {"gradient_as_bucket_view": True}),
    "complex_hooked": (checks.complex_parameters_as_stock, {"hook": True}),
    "complex_hooked_bucket_view": (checks.complex_parameters_as_stock, {"hook": True, "gradient_as_bucket_view": True}),
    "powersgd_strided": (checks.powersgd_on_strided_weights_as_stock, {}),
    **{f"buckets_a_hook_sees_{name}": (checks.buckets_a_hook_sees_as_stock, {"static_graph": static})
       for name, static in (("dynamic", False), ("static", True))},
    "zero_overlap_hook": (checks.zero_overlap_hook_as_stock, {}),
    "optimizer_in_backward_strided": (checks.optimizer_in_backward_on_strided_weights, {}),
    **{f"dtype_changed_{name}": (checks.dtype_changed_after_wrapping, options)
       for name, options in (("default", {}), ("find_unused", {"find_unused_parameters": True}),
                             ("bucket_view", {"gradient_as_bucket_view": True}), ("static", {"static_graph": True}))},
    **{f"channels_last_after_wrapping_{name}": (checks.channels_last_after_wrapping, {"gradient_as_bucket_view": view})
       for name, view in (("copies", False), ("bucket_view", True))},
    "sync_bn_processes": (checks.sync_batchnorm_matches_global_batch, {}),
    "sync_bn_hybrid": (checks.sync_batchnorm_matches_global_batch, {"device_ids": cpu_ids(2)}),
    "sync_bn_deepcopy": (checks.sync_batchnorm_no_wrapper_attached, {"how": "deepcopy"}),
    "sync_bn_never_wrapped": (checks.sync_batchnorm_no_wrapper_attached, {"how": "never wrapped"}),
    "sync_bn_nested": (checks.sync_batchnorm_in_a_nested_data_parallel, {}),
    "sync_bn_data_parallel_alone": (checks.sync_batchnorm_in_data_parallel_without_a_wrapper, {}),
    "sync_bn_nested_hybrid": (checks.sync_batchnorm_in_a_nested_data_parallel, {"device_ids": cpu_ids(2)}),
    "sync_bn_hybrid_fewer_rows": (checks.sync_batchnorm_matches_global_batch, {"device_ids": cpu_ids(2), "per_rank": [5, 1]}),
    "torch_sync_bn_cpu": (checks.torch_sync_batchnorm_on_cpu, {}),
    "ignored": (ddp_checks.against_torch, {"model": "resnet_bn", "ignored": ["conv2.weight", "bn2.running_mean"]}),
    "ignored_find_unused": (ddp_checks.against_torch, {
        "model": "partly_used", "ignored": ["head.bias", "never.weight"], "find_unused_parameters": True}),
    # names torch's reducer does not match ("scale" for its ".scale", a tied weight under one of its two names), and
    # names it does
    "ignored_unmatched_names": (checks.ignored_by_name_as_stock, {"ignored": ["scale", "emb.weight"]}),
    "ignored_reducer_names": (checks.ignored_by_name_as_stock, {"ignored": [".scale", "emb.weight", "head.weight"]}),
    "no_init_sync": (ddp_checks.against_torch, {"model": "resnet_bn", "init_sync": False}),
    "device_mesh": (ddp_checks.against_torch, {"mesh": True}),
    "device_mesh_slice": (ddp_checks.against_torch, {"mesh": "slice"}),
    "device_mesh_slice_tensor_parallel": (checks.tensor_parallel_parameters_on_a_sliced_mesh, {}),
    **{f"mixed_precision_{name}": (checks.mixed_precision_as_stock, options) for name, options in MIXED_PRECISION.items()},
    "mixed_precision_keyword_named_dtype": (checks.mixed_precision_keyword_named_dtype, {}),
    **{f"mixed_precision_join_{'_'.join(map(str, batches))}": (checks.mixed_precision_under_join, {"batches": batches})
       for batches in ((1, 3), (0, 2))},
}


def _run_checks(checks_by_name: dict, seed: int) -> dict:
    return {name: function(seed=seed, **kwargs) for name, (function, kwargs) in checks_by_name.items()}


THREE_PROCESSES = {
    "join_static_graph_1_4_2": (checks.uneven_inputs_as_stock, {"static": "static_graph", "batches": (1, 4, 2)}),
    "sync_bn_processes": (checks.sync_batchnorm_matches_global_batch, {}),
    "sync_bn_hybrid": (checks.sync_batchnorm_matches_global_batch, {"device_ids": cpu_ids(2)}),
    "subgroup_without_rank_0": (checks.subgroup_without_rank_0_as_stock, {}),
}


# Arguments torch DDP took in 2.13, compared where the installed torch has them.
TORCH_DDP_ARGUMENTS = inspect.signature(ddp_checks.TorchDDP.__init__).parameters


def needs_torch_argument(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(name not in TORCH_DDP_ARGUMENTS, reason=f"this torch's DDP has no {name} to compare with")


if "forward_sync_buffers" in TORCH_DDP_ARGUMENTS:
    TWO_PROCESSES["forward_sync_off"] = (ddp_checks.against_torch, {"model": "resnet_bn", "forward_sync_buffers": False})
if "batched_grad_copy" in TORCH_DDP_ARGUMENTS:
    TWO_PROCESSES["batched_copy"] = (ddp_checks.against_torch, {"model": "resnet_bn", "batched_grad_copy": True})
    TWO_PROCESSES["batched_copy_views"] = (ddp_checks.against_torch, {
        "batched_grad_copy": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 1})
    THREE_PROCESSES["batched_copy"] = (ddp_checks.against_torch, {"model": "resnet_bn", "batched_grad_copy": True})
if "skip_all_reduce_unused_params" in TORCH_DDP_ARGUMENTS:
    skipping = {"model": "some_unused", "find_unused_parameters": True, "skip_all_reduce_unused_params": True,
                "bucket_cap_mb": 0.0001}  # a bucket per parameter
    TWO_PROCESSES["skip_unused"] = (ddp_checks.against_torch, skipping)
    TWO_PROCESSES["skip_unused_hooked"] = (ddp_checks.hook_calls, skipping)
if TORCH_DDP_TAKES_A_ZERO_BUCKET_CAP:  # a bucket per parameter
    TWO_PROCESSES["logging_zero_cap"] = (checks.logging_data_as_stock, {"steps": 3, "bucket_cap_mb": 0})
if TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP:  # no limit: one bucket, before the rebuild and after
    TWO_PROCESSES["logging_negative_cap"] = (checks.logging_data_as_stock, {"steps": 3, "bucket_cap_mb": -1})

if "bucket_cap_mb_list" in TORCH_DDP_ARGUMENTS:
    TWO_PROCESSES["bucket_list"] = (ddp_checks.against_torch, {"model": "resnet_bn", "bucket_cap_mb_list": [0.001, 0.004]})
    TWO_PROCESSES["bucket_list_hooked"] = (ddp_checks.hook_calls, {"bucket_cap_mb_list": [1, 2]})
    TWO_PROCESSES["bucket_list_find_unused"] = (ddp_checks.hook_calls, {
        "bucket_cap_mb_list": [2, 1], "find_unused_parameters": True})


# minidp.SyncBatchNorm's collectives where they once went wrong: a job of their own, as a rank that skips a collective
# the others run aborts every check of its job
SYNC_BATCHNORM = {
    # First: the group of the exchanges' backward all-reduces is made by the first exchange of the job that records a
    # backward with several replicas per process, here after a group of rank 0 alone, which rank 1 does not know.
    "normalised_inputs_fewer_rows_hybrid_other_groups": (checks.sync_batchnorm_matches_global_batch, {
        "device_ids": cpu_ids(2), "per_rank": [5, 1], "normalised_inputs": True, "group_of_rank_0": True}),
    "rank_without_rows": (checks.sync_batchnorm_matches_global_batch, {"per_rank": [5, 0]}),
    "rank_without_rows_hybrid": (checks.sync_batchnorm_matches_global_batch, {"device_ids": cpu_ids(2), "per_rank": [5, 0]}),
    "normalised_inputs_fewer_rows_hybrid": (checks.sync_batchnorm_matches_global_batch, {
        "device_ids": cpu_ids(2), "per_rank": [5, 1], "normalised_inputs": True}),
    "gradient_penalty": (checks.sync_batchnorm_gradient_penalty, {}),
    "layer_process_group": (checks.sync_batchnorm_matches_global_batch, {"subgroup": True}),
    "layer_process_group_hybrid": (checks.sync_batchnorm_matches_global_batch, {"device_ids": cpu_ids(2), "subgroup": True}),
}

# torch logs a graph seen not static once per process (logger.cpp): a job of its own, where no other check came first
ONE_PROCESS = {"graph_not_static": (checks.graph_not_static_logged_as_stock, {})}
one = job_fixture("one", _run_checks, 1, ONE_PROCESS, JOB_TIMEOUT)
two = job_fixture("two", _run_checks, 2, TWO_PROCESSES, JOB_TIMEOUT)
# What the observation tools report of a model small enough to count by hand: a job of its own, a few seconds long.
OBSERVED = {f"observed_{name}": (checks.observed_memory, {"gradient_as_bucket_view": view})
            for name, view in (("copies", False), ("bucket_view", True))}
observed = job_fixture("observed", _run_checks, 2, OBSERVED, JOB_TIMEOUT)
three = job_fixture("three", _run_checks, 3, THREE_PROCESSES, JOB_TIMEOUT)
sync_batchnorm = job_fixture("sync_batchnorm", _run_checks, 2, SYNC_BATCHNORM, JOB_TIMEOUT)


# ---- pickling: DistributedDataParallel.__getstate__ / __setstate__ (distributed.py:1485-1521) ----


@pytest.mark.parametrize("check", ["saved", "deepcopied"])
def test_a_saved_or_deepcopied_wrapper_trains_on_exactly_as_stock(two, check):
    for result in each_rank(two, check):
        assert result["differences"] == [None] * 4
        assert result["process_group_is_default"]  # re-attached to the default group
        assert not result["shares_parameters"]  # the copy's reducer hooks its own parameters
        assert result["original_untouched"] is None


def test_a_deepcopied_static_graph_wrapper_keeps_averaging_where_torchs_copy_lets_its_ranks_drift(two):
    """A copy of a ``static_graph=True`` wrapper (``__setstate__`` builds a new reducer, distributed.py:1485-1521):
    torch's copy no longer averages the gradients, and its ranks' models drift apart; minidp's copy trains as a copy
    of a wrapper without ``static_graph`` does, every rank's model the same (README's table of differences)."""
    for result in each_rank(two, "deepcopied_static"):
        assert result["ranks_agree"] == {"stock": False, "minidp": True}
        assert result["original_untouched"] is None


def test_a_deepcopied_wrapper_built_for_the_python_reducer_keeps_averaging_where_torchs_copy_reduces_nothing(two):
    """Built under ``torch._dynamo.config.optimize_ddp = "python_reducer"``, torch's wrapper reduces in per-parameter
    hooks that only its ``__init__`` registers (``_register_accum_grad_hook``), not ``__setstate__``: its copy leaves
    each rank its own gradients, and the ranks' models drift apart; minidp's copy averages (README's table)."""
    for result in each_rank(two, "deepcopied_python_reducer"):
        assert result["differences"][:2] == [None, None]  # before the copy: bitwise torch's
        assert result["ranks_agree"] == {"stock": False, "minidp": True}
        assert result["original_untouched"] is None


def test_a_search_for_unused_parameters_that_finds_none_says_so_once_a_process_in_torchs_words(two):
    # torch's reducer: TORCH_WARN_ONCE in search_unused_parameters (reducer.cpp), once per process, where a forward
    # used every parameter: the walk of the graph costs at every forward and buys nothing there. Printed by its C++,
    # so a program that turns warnings into errors trains on: minidp logs it (each case ran under
    # warnings.simplefilter("error")). A second wrapper in the process (a GAN's two models, a Trainer resumed) says
    # nothing more
    for seen in each_rank(two, "told_none_unused"):
        assert seen == {"all_used": [FOUND_NO_UNUSED_PARAMETERS], "one_unused": []}


# The opening of a script run in a fresh interpreter: a job of this one process, on a free port of 127.0.0.1.
_ONE_PROCESS_JOB = """
import copy, socket
import torch, torch.distributed as dist
from torch import nn
import minidp.distributed as md

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
"""

_COPIED_AFTER_THE_GROUP_IS_DESTROYED = _ONE_PROCESS_JOB + """
wrappers = {"stock": torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 1)),
            "minidp": md.DistributedDataParallel(nn.Linear(2, 1))}
dist.destroy_process_group()
for name, wrapper in wrappers.items():
    try:
        copy.deepcopy(wrapper)
        print(name, "copied")
    except Exception as error:
        print(name, type(error).__name__, str(error).splitlines()[0][:60])
"""


def test_a_copy_after_the_process_group_is_destroyed_raises_torchs_valueerror():
    # an EMA or export copy taken after training ends: torch's __getstate__ reads the default group first, whose
    # absence is a ValueError (distributed_c10d.py, _get_default_group); minidp's raised a RuntimeError, which code that
    # catches torch's ValueError missed
    done = fresh_python("-c", _COPIED_AFTER_THE_GROUP_IS_DESTROYED, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "stock ValueError Default process group has not been initialized, please make ",
        "minidp ValueError Default process group has not been initialized, please make ",
    ]


_FORWARD_IN_A_DISTRIBUTED_AUTOGRAD_CONTEXT = _ONE_PROCESS_JOB + """
import torch.distributed.autograd as dist_autograd, torch.distributed.rpc as rpc
options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}")
rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=options)
try:
    ddp = md.DistributedDataParallel(nn.Linear(2, 1))
    ddp(torch.ones(1, 2)).sum().backward()
    print("outside a context: trained")
    try:
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [ddp(torch.ones(1, 2)).sum()])
        print("inside a context: no error")
    except RuntimeError as error:
        print("inside a context:", error)
finally:
    rpc.shutdown()
    dist.destroy_process_group()
"""


def test_a_forward_inside_a_distributed_autograd_context_is_refused_saying_what_works():
    # torch's reducer reads and writes the gradients of a dist_autograd context (upstream's
    # ddp_under_dist_autograd_test.py, DdpComparisonTest); minidp's reduces .grad, which distributed autograd never
    # writes: its ranks stepped on their own gradients, silently. Refused at the forward, in a context only
    done = fresh_python("-c", _FORWARD_IN_A_DISTRIBUTED_AUTOGRAD_CONTEXT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "outside a context: trained",
        "inside a context: minidp's DistributedDataParallel cannot reduce gradients that torch.distributed.autograd "
        "computes: this forward runs inside a dist_autograd.context(), whose backward keeps the gradients in the "
        "context, not in .grad, where minidp reduces them. Use torch.nn.parallel.DistributedDataParallel with "
        "distributed autograd, or run this model's forward and loss.backward() outside the context",
    ]


def test_pickling_with_a_non_default_group_raises_stocks_error(two):
    for errors in each_rank(two, "pickling_subgroup"):
        assert errors["minidp"] == errors["stock"]
        assert errors["minidp"].startswith("DDP Pickling/Unpickling are only supported")


# ---- torch.distributed.checkpoint (torch/distributed/checkpoint/state_dict.py: _get_fqns skips DDP's "module.") ----


def test_the_wrapper_is_an_instance_of_torchs_class_as_code_that_unwraps_models_checks(two):
    # isinstance(model, DistributedDataParallel) is how torch's checkpoint API, and frameworks, find the wrapper
    assert all(result["is_torchs_class"] for result in each_rank(two, "distributed_checkpoint"))


def test_get_state_dict_gives_stocks_keys_and_values_for_the_model_and_the_optimizer(two):
    # stock's keys leave out the wrapper's "module." prefix, as the plain model's state dict has none
    assert all(result["same_state_dicts"] for result in each_rank(two, "distributed_checkpoint"))


def test_a_distributed_checkpoint_of_either_wrapper_resumes_training_bitwise_in_the_other(two):
    for result in each_rank(two, "distributed_checkpoint"):
        assert result["resumed"] == {name: [None, None] for name in result["resumed"]} and len(result["resumed"]) == 2


def test_a_distributed_checkpoint_of_either_wrapper_loads_into_the_plain_model(two):
    for result in each_rank(two, "distributed_checkpoint"):
        assert result["plain_loaded"] == {"torch": True, "minidp": True}


# ---- second-order gradients (reducer.cpp's create_graph warning; distributed_test.py test_ddp_create_graph) ----


def test_create_graph_gradients_accumulate_with_their_graph_as_stock(two):
    for result in each_rank(two, "create_graph"):
        assert result["equal"] and result["through_is_zero"]
        assert result["stock"] == [(True, "CopyBackwards")] * 6  # the graph ends in the copy of the mean
        assert result["warnings"] == [CREATE_GRAPH_WARNING]  # once, stock's words


def test_create_graph_with_several_parameters_averages_the_values_where_stock_raises(two):
    for result in each_rank(two, "create_graph_second"):
        assert result["error"] <= RTOL_FLOAT64
        assert result["requires_grad"] and result["through_is_zero"]  # stock's one-parameter semantics


def test_gradient_penalty_on_the_inputs_matches_stock_bitwise(two):
    for differences in each_rank(two, "gradient_penalty"):
        assert differences == [None] * 3


@pytest.mark.parametrize("check", ["post_accumulate_hooks", "post_accumulate_hooks_bucket_view",
                                   "post_accumulate_hooks_after_forward"])
def test_a_users_post_accumulate_grad_hook_runs_before_the_reduction_as_in_stock(two, check):
    # torch's reducer hook is a post-hook of each parameter's gradient accumulator (reducer.cpp, Reducer's
    # constructor: grad_accumulator->add_post_hook), run after every post-accumulate-grad hook of the tensor, whenever
    # it was registered: one registered between a forward and its backward ran after minidp's in that backward
    for result in each_rank(two, check):
        assert result["differences"] == [None] * 3
        assert result["same_seen"] and result["hook_calls"] == 3 * 6  # every parameter of the MLP, every step


def test_a_parameter_swapped_after_wrapping_is_refused_where_torchs_refuses_the_swap(two):
    # torch.utils.swap_tensors (load_state_dict with swap_module_params_on_conversion) moves a parameter's autograd
    # state, and the hook that reduces its gradient with it, to the other tensor. torch's reducer holds references that
    # make the swap fail in load_state_dict; minidp's took it, and every rank stepped on its own gradients, silently.
    # It refuses the next forward now, before any collective.
    for result in each_rank(two, "swapped_after_wrapping"):
        assert result == {"stock": {"raised": ("load", "RuntimeError"), "averaged": None},
                          "minidp": {"raised": ("forward", "RuntimeError"), "averaged": None}}


def test_a_buffer_no_copy_can_write_fails_the_construction_on_every_rank_as_stock(two):
    # dist._broadcast_coalesced copies rank 0's values back on every rank, rank 0 too: a buffer made by expand fails
    # there alike; minidp's copied on the receiving ranks only, and rank 0 went on to its next collective alone
    for result in each_rank(two, "expanded_buffer"):
        assert result["minidp"] == result["stock"]
        assert result["stock"][0] == "RuntimeError" and "more than one element" in result["stock"][1]


def test_the_construction_moves_version_counters_so_a_graph_recorded_before_it_fails_as_stock(two):
    # torch's construction copies rank 0's parameters in place (versions move); a graph recorded on the plain module,
    # whose ranks had other weights, then fails autograd's check instead of mixing rank 0's weights into this rank's
    # saved activations
    for result in each_rank(two, "graph_recorded_before"):
        assert result["minidp"]["versions"] == result["stock"]["versions"]
        assert result["minidp"]["backward"][0] == result["stock"]["backward"][0] == "RuntimeError"
        assert "modified by an inplace operation" in result["minidp"]["backward"][1]


needs_kept_buffer_versions = pytest.mark.skipif(
    not TORCH_DDP_KEEPS_BUFFER_VERSIONS, reason="this torch's DDP moves buffers' version counters in the forward's sync, "
                                                "where torch 2.13's keeps them, as minidp's does")


@pytest.mark.parametrize("case", ["empty_tensors", pytest.param("joined", marks=needs_kept_buffer_versions)])
def test_version_counters_move_where_torchs_move_an_empty_tensor_written_by_no_copy_a_joined_ranks_by_its_syncs(two, case):
    # dist._broadcast_coalesced writes no tensor without elements; a joined rank's buffer syncs
    # (_check_and_sync_module_buffers) keep no version counter, where the forward's do
    for result in each_rank(two, case):
        assert result["minidp"] == result["stock"]


@needs_kept_buffer_versions
def test_the_forwards_buffer_sync_keeps_version_counters_so_a_saved_buffer_still_back_propagates(two):
    # DistributedDataParallel._sync_buffers copies under torch.autograd._unsafe_preserve_version_counter
    for result in each_rank(two, "buffer_saved_for_backward"):
        assert result == {"stock": ("no error", ""), "minidp": ("no error", "")}


def test_a_parameter_given_another_accumulator_after_wrapping_is_named_as_such_by_the_unused_search(two):
    # register_parametrization calls set_() on the weight, which gets a new gradient accumulator: the search for unused
    # parameters (find_unused_parameters=True) counted it unused, then its gradient came, and minidp said it was used
    # outside forward; torch's reducer leaves its gradient unreduced, silently
    for message in each_rank(two, "parametrized_after_wrapping"):
        assert message is not None and "has another gradient accumulator than when it was wrapped" in message


@pytest.mark.parametrize("options", ["default", "find_unused"])
def test_an_unfinished_reduction_is_explained_in_stocks_words_for_the_options_given(two, options):
    # reducer.cpp, ensure_prior_reduction_finished: with find_unused_parameters the advice is not to turn it on but that
    # some outputs took no part in the loss; minidp gave the default's advice to every wrapper
    for result in each_rank(two, f"unfinished_message_{options}"):
        assert result["minidp"] is not None and result["minidp"] == result["stock"]
        assert ("Since `find_unused_parameters=True` is enabled" in result["minidp"]) == (options == "find_unused")


def test_static_graph_with_find_unused_warns_at_construction_as_stock(two):
    # distributed.py, __init__ calls _set_static_graph, which warns that find_unused_parameters is not needed
    for result in each_rank(two, "static_graph_with_find_unused_warnings"):
        assert len(result["stock"]) == 1 and result["minidp"] == result["stock"]


@pytest.mark.parametrize("model", ["alone", "beside_another"])
def test_a_buffer_registered_after_wrapping_is_synced_as_stock_syncs_it(two, model):
    # distributed.py, will_sync_module_buffers and _assign_modules_buffers: the buffers are read when wrapping and at each
    # sync; with none when wrapped, each rank keeps its own for good (minidp broadcast rank 0's once one appeared)
    for result in each_rank(two, f"buffer_registered_after_wrapping_{model}"):
        assert result == {"differences": [None] * 3, "errors": {}, "step": None}


@pytest.mark.parametrize("case", ["input_gradient_first", "box_output"])
def test_a_static_graph_averages_every_step_where_torchs_never_averages(two, case):
    # README, "What torch DDP still has": a static graph's first iteration counts the reducer's hooks through the backward
    # of distributed.py's _DDPSink, and queues the delayed all-reduce there. With a gradient of the inputs taken before
    # that iteration's backward, or outputs in a plain object (no sink sees them), torch's never averages: every rank
    # keeps its own gradients at every step. minidp averages every step, exactly.
    for result in each_rank(two, f"static_averaging_{case}"):
        assert result["minidp"] == [0.0] * 4
        assert min(result["stock"]) > 1e-3
def test_a_copy_reads_the_buffers_to_sync_again_as_stock(two):
    # distributed.py, __setstate__ builds the reducer's parameters again, which reads the buffers: a buffer registered
    # since the original was wrapped is synced by the copy's forwards
    for result in each_rank(two, "copied_after_a_buffer_was_registered"):
        assert result["minidp"] == result["stock"] and result["stock"]["syncs"]


def test_two_losses_back_propagated_in_turn_are_reduced_together_as_stock(two):
    # reducer.cpp finishes when its last bucket is ready, in whichever backward pass: the policy's loss, then the
    # value's (heads that share nothing) end one reduction, every gradient the mean, bitwise stock's at every step.
    # minidp's reducer ended it at the first pass's end: the value head's gradients stayed each rank's own.
    for result in each_rank(two, "two_losses_in_turn_default"):
        assert result == {"differences": [None] * 3, "errors": {}, "step": None}


def test_a_rebuild_of_the_buckets_after_half_a_backward_raises_stocks_error_and_the_reduction_goes_on(two):
    # reducer.cpp, rebuild_buckets: ensure_prior_reduction_finished first. Lightning's manual optimization calls
    # _rebuild_buckets and prepare_for_backward before each manual_backward (a GAN's two losses of one forward): torch
    # raises there, and Lightning says that parameters were not used. minidp's installed the plan and said nothing,
    # and the prepare_for_backward after it dropped the pending reduction: each rank stepped on its own gradients.
    for result in each_rank(two, "two_losses_with_a_rebuild_between"):
        error = ("RuntimeError", "Expected to have finished reduction in the prior iteration before starting a new one")
        assert result == {"errors": {"stock": error, "minidp": error}, "gradients": None}


@pytest.mark.parametrize("options", ["find_unused", "static"])
def test_two_losses_back_propagated_in_turn_through_the_sink_raise_autograds_error_as_stock(two, options):
    # distributed.py, _DDPSink: with find_unused_parameters (and in a static graph's first iteration) the outputs go
    # through one node; the first backward runs the value head's graph too, with no gradient, and frees it, so the
    # second raises autograd's error. minidp's outputs went through no such node: the second backward ran after the
    # reduction had ended, and the ranks' value heads drifted apart, silently.
    for result in each_rank(two, f"two_losses_in_turn_{options}"):
        assert result["step"] == 0
        error = ("RuntimeError", "Trying to backward through the graph a second time (or directly access saved tensors "
                                 "after they have already been freed)")
        assert result["errors"] == {"stock": error, "minidp": error}


def test_a_backward_of_some_parameters_with_find_unused_is_reduced_where_stock_stalls(two):
    # README, "What torch DDP still has": torch's reducer waits for the parameters its search found used, which a
    # backward(inputs=...) never reaches: the head's bucket is left unreduced (each rank's own .grad) and the next forward
    # raises; minidp takes them as unused at the backward's end, averages what the backward made, and trains on
    for result in each_rank(two, "backward_of_some_parameters"):
        assert result["stock"]["head_grad"] == "local"
        assert result["stock"]["next_step_error"] == (
            "Expected to have finished reduction in the prior iteration before starting a new one")
        assert result["minidp"] == {"head_grad": "mean", "next_step_error": None}


def test_an_output_changed_in_place_trains_as_stock_where_stock_clones_the_outputs(two):
    # distributed.py, _post_forward: with find_unused_parameters (and until a static graph's first backward) the
    # outputs go through _DDPSink, whose forward clones them; a tanh's output changed in place is then the clone
    for result in each_rank(two, "output_in_place_find_unused"):
        assert result == {"differences": [None] * 3, "errors": {}, "step": None}


def test_a_static_graphs_first_output_changed_in_place_raises_after_it_as_in_stock(two):
    # the clone only until the first backward: the second step's in-place change meets the tanh's saved output
    for result in each_rank(two, "output_in_place_static"):
        assert result["differences"] == [None] and result["step"] == 1
        assert [kind for kind, _ in result["errors"].values()] == ["RuntimeError"] * 2


def test_without_the_sink_clone_an_output_changed_in_place_raises_as_in_stock(two):
    # _set_ddp_sink_clone(False): no clone (upstream's test_ddp_sink_noclone); stock's function output, a view, refuses
    # the in-place change; minidp's output, the module's own, is refused by autograd's version check in the backward
    for result in each_rank(two, "output_in_place_not_cloned"):
        assert result["differences"] == [] and result["step"] == 0
        assert [kind for kind, _ in result["errors"].values()] == ["RuntimeError"] * 2


@pytest.mark.parametrize("container", ["heads", "pair"])
@pytest.mark.parametrize("when", ["find_unused", "static"])
def test_an_output_container_of_the_users_comes_back_as_it_is_where_stock_clones_the_outputs(two, container, when):
    # distributed.py, _post_forward: _DDPSink's tensors come from torch's pytree, which takes a container type it does
    # not know (a dict subclass with a constructor of its own and an attribute, a tuple subclass) as one leaf. minidp
    # rebuilt it with type(container)(items): the forward raised TypeError, or the attribute was lost.
    # In a static graph stock then has no tensor to pass through _DDPSink, whose backward queues the first iteration's
    # delayed all-reduce: its gradients stay each rank's own, at every step, and its ranks drift apart; minidp's are
    # averaged there as in any static graph.
    for result in each_rank(two, f"output_container_{container}_{when}"):
        assert result["errors"] == {} and (when == "static" or result["differences"] == [None, None])
        assert result["ranks_agree"] == {"stock": when != "static", "minidp": True}
        expected = ("_Pair", None) if container == "pair" else ("_Heads", 5)
        assert result["seen"]["minidp"] == result["seen"]["stock"] == [expected] * 2


def test_the_wrappers_description_of_its_module_is_stocks(two):
    # distributed.py, DistributedDataParallel.__init__: _module_parameters, is_multi_device_module, device_type,
    # device; device_ids=[] taken as None "for backward compatibility"
    for result in each_rank(two, "description"):
        assert result["minidp"] == result["stock"] == (torch.device("cpu"), "cpu", False, list(range(6)))
        assert result["empty_device_ids"] == [None, None]
        stock, minidp = result["without_parameters"]
        assert minidp == stock, (minidp, stock)


def test_a_parameter_that_requires_grad_on_some_ranks_only_is_refused_on_every_rank_as_in_stock(two):
    # distributed.py, _verify_param_shape_across_processes: a RuntimeError at construction, on every rank, where the
    # reducers would wait for different gradients (each rank's own view, rank 1's "Rank 1 has 2 params, while rank 0
    # has inconsistent 1 params"); minidp's is the same on every rank, and names the parameter
    for errors in each_rank(two, "requires_grad_differs"):
        assert errors["stock"][0] == errors["minidp"][0] == "RuntimeError"
        assert errors["stock"][1].startswith("DDP expects same model across all ranks, but Rank ")
        torchs = "DDP expects same model across all ranks, but Rank 0 has 1 params, while rank 1 has inconsistent 2 params"
        assert torchs in errors["minidp"][1]
        assert "parameter 1 ('bias') requires grad on rank 1 and not on rank 0" in errors["minidp"][1]


def test_torch_compile_of_the_wrapper_trains_as_stock_bitwise_and_traces_only_the_module(two):
    # torch DDP means dynamo to compile the module only (distributed.py, _inside_ddp_forward: "dynamo only kicks in
    # for the 'module_to_run' underneath"; measured, its forward breaks the graph at its logger, and twice at
    # _inside_ddp_forward); minidp's forward is skipped as a whole, as is its _inside_ddp_forward, so the graph breaks
    # there and the module's frame is compiled alone, never inside a step of the wrapper's
    for result in each_rank(two, "compiled"):
        assert result["differences"] == [None] * 3
        assert sorted(result["breaks"]) == ["DistributedDataParallel._inside_ddp_forward", "DistributedDataParallel.forward"]


@pytest.mark.parametrize("check", ["graph_splits", "graph_splits_replicate"])
def test_dynamo_splits_the_compiled_module_at_the_buckets_as_for_stock(two, check):
    # upstream's test_dynamo_distributed.py, TestSingleProc.test_graph_split and test_no_split: DDPOptimizer splits
    # the module's graph where its buckets end (convert_frame.py engages it while _get_active_ddp_module() names a
    # wrapper), so that each bucket's all-reduce overlaps the backward of the pieces before it; as many pieces as for
    # torch's wrapper (or torch's replicate), a 1 MiB cap more than the default, and the gradients bitwise stock's
    for seen in each_rank(two, check):
        assert seen[1]["minidp"] == seen[1]["stock"] == 3, seen
        assert seen[25]["minidp"] == seen[25]["stock"] == 2, seen  # the default 1 MiB first bucket splits it once
        assert seen[1]["difference"] is seen[25]["difference"] is None, seen


@pytest.mark.parametrize("check", ["compiled_autograd_refused", "compiled_autograd_refused_replicate"])
def test_compiled_autograd_is_refused_as_stock_refuses_it_before_any_gradient(two, check):
    # reducer.cpp: compiled autograd meeting the C++ reducer's hook raises (the default optimize_ddp); minidp's
    # end-of-backward callback would never run there, leaving every rank with its own gradients. The same error,
    # raised before any gradient is accumulated: every .grad still None, as stock's
    for seen in each_rank(two, check):
        assert seen["raised"]["minidp"] == seen["raised"]["stock"] == f"RuntimeError: {COMPILED_AUTOGRAD_REFUSED}"
        assert seen["differences"] == [None] * 3


@pytest.mark.parametrize("check", ["python_reducer", "python_reducer_replicate"])
def test_python_reducer_under_compiled_autograd_trains_as_stock_bitwise(two, check):
    # distributed.py, optimize_ddp="python_reducer": _register_accum_grad_hook's per-parameter all-reduce, traced
    # by compiled autograd; three steps, bitwise stock's
    for seen in each_rank(two, check):
        assert seen["raised"] == {"stock": "ok", "minidp": "ok"}
        assert seen["differences"] == [None] * 3


# ---- communication hooks: _check_comm_hook (distributed.py:2462), _register_builtin_comm_hook (:2260) ----


@pytest.mark.parametrize("case", ["not_callable", "bucket_annotation", "return_annotation", "stock_annotations",
                                  "twice", "hook_then_builtin", "builtin_then_hook", "after_a_backward"])
def test_comm_hook_registration_is_checked_with_stocks_errors(two, case):
    for seen in each_rank(two, "comm_hook_errors"):
        assert seen[case]["minidp"] == seen[case]["stock"]


def test_a_hook_without_a_bucket_parameter_gets_a_clearer_error_than_stocks_key_error(two):
    for seen in each_rank(two, "comm_hook_errors"):
        assert seen["bucket_not_named_bucket"]["stock"] == "KeyError: 'bucket'"
        assert "define it as hook(state, bucket)" in seen["bucket_not_named_bucket"]["minidp"]


def test_a_hook_that_returns_no_future_is_named_as_stock_names_it(two):
    for seen in each_rank(two, "comm_hook_errors"):
        expected = "DDP communication hook's callback must return a torch.futures.Future object, but got builtins.int"
        assert expected in seen["not_a_future"]["stock"] and expected in seen["not_a_future"]["minidp"]


@pytest.mark.parametrize("case", ["collective_future", "list_of_two"])
def test_a_hooks_future_holding_a_list_is_refused_as_in_stock_with_the_way_out(two, case):
    # reducer.cpp, PythonCommHook::parseHookResult: the hook's future must hold a tensor; stock fails an internal
    # assert on a collective's future (its value the list of its tensors) and a cast to Tensor on a Python list
    for seen in each_rank(two, "hook_results"):
        assert seen[case]["stock"] != "ok"
        assert seen[case]["minidp"].startswith(f"RuntimeError: DDP communication hook '_{case}': the future it returned")
        assert "return fut.then(lambda f: f.value()[0])" in seen[case]["minidp"]


def test_a_hooks_tensor_longer_than_the_bucket_is_read_to_the_buckets_length_as_in_stock(two):
    # reducer.cpp, populate_bucket_views_out: each gradient is viewed at its offset in the hook's result, so a
    # longer tensor's first elements are taken, bitwise as in stock; a shorter one is an error in both
    for seen in each_rank(two, "hook_results"):
        assert seen["longer_mean"] == {"stock": "ok", "minidp": "ok", "same": True}
        assert seen["shorter_mean"]["stock"] != "ok"
        assert "holds a tensor of 7 elements; it must hold one tensor of 8 elements" in seen["shorter_mean"]["minidp"]


def test_a_hooks_own_error_in_its_future_is_raised_as_stock_raises_it_not_taken_for_a_rank_that_left(two):
    # reducer.cpp, finalize_backward: the future's error propagates as it is (quantization_pertensor_hook's callback
    # fails over Gloo: "Got the following error when running the callback: ... IndexError"); only a collective's
    # timeout or closed connection means another rank stopped taking part
    for errors in each_rank(two, "failing_comm_hook"):
        assert errors["minidp"] == errors["stock"]
        assert errors["stock"][0] == "RuntimeError" and "IndexError" in errors["stock"][1]


@pytest.mark.parametrize("hook_type", ["allreduce", "fp16"])
def test_builtin_comm_hooks_give_stocks_bits(two, hook_type):
    for differences in each_rank(two, f"builtin_{hook_type}"):
        assert differences == [None] * 3


# ---- static graph (distributed.py:2589 _set_static_graph, _DDPSink's delayed all-reduce) and checkpointing ----

CHECKPOINT_CASES = [f"{'reentrant' if r else 'plain'}_{'twice' if t else 'once'}_{'unused' if u else 'all'}_"
                    f"{'static' if g else 'dynamic'}"
                    for r in (True, False) for t in (False, True) for u in (False, True) for g in (False, True)]


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_activation_checkpointing_trains_as_stock_or_fails_where_stock_fails(two, case):
    # torch DDP refuses re-entrant checkpointing of a layer used twice, or with find_unused_parameters,
    # unless static_graph=True ("Expected to mark a variable ready only once"); everything else trains
    for result in each_rank(two, f"checkpoint_{case}"):
        if result["stock"] == "ok":
            assert result["minidp"] == "ok" and result["differences"] == [None] * 4
        else:
            assert result["stock"].startswith("Expected to mark a variable ready only once")
            # with find_unused_parameters, the search from the outputs does not see into a re-entrant checkpoint
            said = "was counted unused, then got its gradient" if "_unused_" in case else "got its gradient twice"
            assert said in result["minidp"]


def test_the_outputs_autograd_node_has_stocks_class_name(two):
    # torch passes the outputs through its _DDPSink where it must (find_unused_parameters, static_graph): code that
    # reads the graph by name (type(out.grad_fn).__name__) sees _DDPSinkBackward there; minidp's node was _SinkBackward
    for names in each_rank(two, "output_node_names"):
        for options, by_wrapper in names.items():
            assert by_wrapper["minidp"] == by_wrapper["stock"], options


def test_a_gradient_after_its_parameter_was_counted_unused_is_refused_saying_why_as_stock_refuses_it(two):
    # A loss kept on the module (a router's load-balancing loss) reaches parameters the forward's outputs do not lead
    # to: stock raises "Expected to mark a variable ready only once"; minidp names the parameter, says it was counted
    # unused by the search from the outputs, and what to do, static_graph=True among it (it trains bitwise as stock)
    for result in each_rank(two, "auxiliary_loss_kept"):
        assert result["stock"].startswith("Expected to mark a variable ready only once")
        assert "('router.weight') was counted unused, then got its gradient" in result["minidp"] or \
            "('router.bias') was counted unused, then got its gradient" in result["minidp"]
        assert "static_graph=True" in result["minidp"]


def test_stock_refuses_exactly_the_reentrant_cases_without_static_graph(two):
    refused = {case for case in CHECKPOINT_CASES if each_rank(two, f"checkpoint_{case}")[0]["stock"] != "ok"}
    assert refused == {"reentrant_once_unused_dynamic", "reentrant_twice_all_dynamic", "reentrant_twice_unused_dynamic"}


@pytest.mark.parametrize("check", ["static_buckets", "static_buckets_late"])
def test_static_graph_reduces_all_at_the_end_first_then_rebuilds_after_the_second_backward_as_stock(two, check):
    for result in each_rank(two, check):
        assert result["minidp"] == result["stock"]
        assert result["differences"] == [None] * 4
        assert result["never_grad"] == [None, None]
    first, second, third, _ = each_rank(two, "static_buckets")[0]["stock"]
    assert first == second == [[0, 1, 2, 3, 4, 5, 6, 7]]  # one bucket until the rebuild
    assert third == [[7, 6, 3, 2], [1, 0, 4, 5]]  # arrival order, the unused parameters last


def test_set_static_graph_warns_and_refuses_as_stock(two):
    for seen in each_rank(two, "static_set_late"):
        assert seen["minidp"] == seen["stock"]
        assert seen["minidp"][0] == ["You've set static_graph to be True, no need to set it again."]


def test_a_static_graph_accumulating_gradients_from_its_first_step_trains_as_stock_without_static_graph(two):
    # README's differences: torch's reducer, which counts a static graph's hooks in its first backward, counted none
    # under no_sync and fails an internal assert in the first synchronised one; minidp counts them there
    for result in each_rank(two, "static_accumulating_from_the_first_step"):
        assert result["differences"] == [None] * 3
        assert "expect_autograd_hooks_" in result["torch with static_graph"]


def test_a_static_graphs_output_the_loss_uses_from_the_second_step_on_trains_as_stock(two):
    # distributed.py, _post_forward: the first iteration's outputs go through _DDPSink, whose backward gives an
    # output the loss did not use an undefined gradient; the reducer's hooks still run for the parameters it reaches
    # and count them used (reducer.cpp, autograd_hook), so using that output later is no change of the graph
    for result in each_rank(two, "static_auxiliary_later"):
        assert result == {"differences": [None] * 4, "errors": {}, "step": None}


def test_a_static_graphs_output_the_loss_never_uses_raises_at_the_third_forward_as_in_stock(two):
    # counted in the first backward, awaited in the second, which never brings its gradients: the next forward raises
    for result in each_rank(two, "static_auxiliary_never"):
        assert result["differences"] == [None, None] and result["step"] == 2
        assert result["errors"]["minidp"] == result["errors"]["stock"] == (
            "RuntimeError", "Expected to have finished reduction in the prior iteration before starting a new one")


@pytest.mark.parametrize("container", ["dataclass", "dict_subclass"])
def test_a_static_graphs_unused_head_in_a_dataclass_or_dict_subclass_leaves_every_step_averaged(two, container):
    # distributed.py, _post_forward: torch's pytree takes these containers as leaves, so _DDPSink passes none of their
    # tensors, and the first backward runs no hook behind the unused head: it is a static unused parameter from then
    # on. Stock then never averages (its delayed all-reduce is queued by _DDPSink's backward); minidp counts what the
    # sink passes, as stock's hooks do, and averages every step
    for found in each_rank(two, f"static_unused_head_{container}"):
        assert len(found) == 4 and all(isinstance(worst, float) and worst <= RTOL_FLOAT64 for worst in found), found


@pytest.mark.parametrize("check", ["static_graph_frozen_always", "set_static_graph_frozen_always",
                                   "static_graph_frozen_always_float64", "find_unused_frozen_always"])
def test_a_parameter_frozen_after_wrapping_goes_unused_as_in_stock(two, check):
    # torch's reducer took every parameter's gradient accumulator at construction (Reducer's constructor); a weight
    # frozen since is one no graph reaches: unused in a static graph's first backward (and so in every later one), or
    # at each search for unused parameters; its .grad stays None
    for result in each_rank(two, check):
        assert result["errors"] == {}
        assert result["differences"] == [None] * 4


@pytest.mark.parametrize("check", ["static_graph_frozen_first_step", "set_static_graph_frozen_first_step"])
def test_a_parameter_frozen_in_a_static_graphs_first_step_only_raises_stocks_error_when_used(two, check):
    # unused in the first backward, it gets a gradient in the second: reducer.cpp's autograd_hook raises
    for result in each_rank(two, check):
        assert result["differences"] == [None] and result["step"] == 1
        assert result["errors"]["minidp"] == result["errors"]["stock"]
        assert result["errors"]["minidp"] == ("RuntimeError", "Your training graph has changed in this iteration, e")


# ---- uneven inputs: join() (distributed.py:1989), Join (torch/distributed/algorithms/join.py), _DDPJoinHook ----


@pytest.mark.parametrize("check", ["join", "join_effective_world_size", "join_generic", "join_batch_norm",
                                   "join_find_unused"])
def test_uneven_inputs_under_join_end_with_stocks_model_on_every_rank(two, check):
    # rank 1 trains 4 steps, rank 0 2 and then shadows; the last rank to join sends its model to all
    for result in each_rank(two, check):
        assert result["errors"] == {}
        assert result["difference"] is None


@pytest.mark.parametrize("check", ["join", "join_effective_world_size", "join_generic"])
def test_uneven_inputs_under_join_warn_of_nothing_stock_does_not(two, check):
    # divide_by_initial_world_size=False reads the count of ranks still training from Join's all-reduce, which only
    # its work holds; read through Work.result(), that gave torch's deprecation warning, which torch's C++ never does
    for result in each_rank(two, check):
        assert result["warnings"]["minidp"] == result["warnings"]["stock"]


def test_a_rank_that_joins_before_installing_the_rebuilt_plan_shadows_its_buckets_as_stock(two):
    # _DDPJoinHook.main_hook starts with reducer._rebuild_buckets(): the plan rebuilt after rank 0's only backward
    # (a bucket per parameter) is the one the ranks still training all-reduce by, and the one rank 0 must shadow
    for result in each_rank(two, "join_rebuilt_small_buckets"):
        assert result["errors"] == {}
        assert result["difference"] is None


@pytest.mark.parametrize("check", [f"join_{static}_{batches}" for static in ("static_graph", "set_static_graph")
                                   for batches in ("1_3", "3_1", "2_3")])
def test_uneven_inputs_in_a_static_graph_end_with_stocks_model_on_every_rank(two, check):
    # A static graph rebuilds its buckets after its second backward (reducer.cpp: autograd_hook pushes the arrival
    # order once the first backward has counted the hooks; rebuild_buckets broadcasts rank 0's plan). A rank that ran
    # out of data before then takes part in that broadcast from its join hook, as _DDPJoinHook.main_hook calls
    # _push_all_rebuilt_params and, a round later, _rebuild_buckets on every round (distributed.py:427)
    for result in each_rank(two, check):
        assert result["errors"] == {}
        assert result["difference"] is None


def test_uneven_inputs_in_a_static_graph_on_three_ranks_end_with_stocks_model(three):
    for result in each_rank(three, "join_static_graph_1_4_2"):
        assert result["errors"] == {}
        assert result["difference"] is None


def test_a_rank_joined_before_a_static_graphs_first_backward_shadows_it_and_refuses_to_train_after(two):
    # Where stock's joined rank leaves out the first backward's used-parameter map (_DDPJoinHook.main_hook all-reduces
    # it only with find_unused_parameters) and Gloo aborts on the collectives that no longer match, minidp's shadows
    # it: the model is rank 1's steps alone, averaged with rank 0's zeros. Having counted no hooks, rank 0 then refuses
    # a forward of its own, before any collective
    rank_0, rank_1 = each_rank(two, "join_static_no_batch")
    assert rank_0["unequal"] == [] and rank_1["unequal"] == []
    assert rank_0["error"] == "DistributedDataParallel with static_graph=True on rank 0"
    assert rank_1["error"] is None


def test_throw_on_early_termination_raises_stocks_errors_on_every_rank(two):
    rank_0, rank_1 = each_rank(two, "join_throw")
    assert rank_0["errors"] == {"stock": "Rank 0 exhausted all inputs.", "minidp": "Rank 0 exhausted all inputs."}
    expected = "Detected at least one rank that exhausted inputs. Throwing across all ranks."
    assert rank_1["errors"] == {"stock": expected, "minidp": expected}


# ---- runtime statistics: _get_ddp_logging_data (distributed.py:2552), _set_ddp_runtime_logging_sample_rate ----

LOGGING_CASES = ["logging_constructed", "logging_rebuilt", "logging_sampled", "logging_static_hook",
                 "logging_builtin_join", "logging_mixed_precision", "logging_static_idle_1", "logging_static_idle_2",
                 *(["logging_zero_cap"] if TORCH_DDP_TAKES_A_ZERO_BUCKET_CAP else []),
                 *(["logging_negative_cap"] if TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP else [])]


def _is_timing(key: str) -> bool:
    return key.endswith(("_time", "_start", "_end")) or key.startswith("avg_")


@pytest.mark.parametrize("check", LOGGING_CASES)
def test_logging_data_has_stocks_keys_and_values_but_times(two, check):
    for data in each_rank(two, check):
        assert sorted(data["minidp"]) == sorted(data["stock"])
        assert {k: v for k, v in data["minidp"].items() if not _is_timing(k)} == \
               {k: v for k, v in data["stock"].items() if not _is_timing(k)}


@pytest.mark.parametrize("check", ["logging_rebuilt", "logging_sampled", "logging_static_hook"])
def test_logged_times_are_nanoseconds_between_the_logged_stamps(two, check):
    for data in each_rank(two, check):
        ours = data["minidp"]
        assert ours["forward_compute_time"] == ours["backward_compute_time_start"] - ours["forward_compute_time_start"]
        assert ours["backward_compute_time"] == ours["backward_compute_time_end"] - ours["backward_compute_time_start"]
        assert ours["backward_comm_time"] == ours["backward_comm_time_end"] - ours["backward_comm_time_start"]
        assert ours["backward_compute_comm_overlap_time"] == \
               ours["backward_compute_time_end"] - ours["backward_comm_time_start"]
        # Durations are positive; the overlap (compute's end minus communication's start) can be zero or less, in
        # stock's formula too: a bucket's all-reduce starts only once its last gradient is in (one bucket: the last).
        assert all(ours[f"avg_{k}"] > 0 for k in ("forward_compute_time", "backward_compute_time", "backward_comm_time"))
        assert isinstance(ours["avg_backward_compute_comm_overlap_time"], int)


def test_a_sample_rate_below_one_is_refused_as_stock(two):
    for errors in each_rank(two, "logging_sample_rate_errors"):
        assert errors["minidp"] == errors["stock"] == "DDP runtime logging sample rate should be equal or greater than 1"


# ---- sparse gradients (distributed.py:1554 produces_sparse_gradient; reducer.cpp mark_variable_ready_sparse) ----


@pytest.mark.parametrize("check", ["sparse", "sparse_small_buckets", "sparse_find_unused"])
def test_sparse_gradients_are_reduced_on_their_own_as_stock(two, check):
    for result in each_rank(two, check):
        assert result["same"] == [True] * 3
        assert result["sparse_grads"] == [True, False, False, True, False, False]
        assert result["plans"][1] == result["plans"][0]  # each sparse gradient a bucket of its own
        assert result["bucket_sizes"][1] == result["bucket_sizes"][0]  # a sparse one's at its parameter's dense size


# ---- complex parameters (reducer.cpp: a complex bucket communicated as view_as_real) ----


@pytest.mark.parametrize("check", ["complex", "complex_bucket_view", "complex_hooked", "complex_hooked_bucket_view"])
def test_complex_parameters_train_as_stock_with_their_buckets_communicated_as_real(two, check):
    # torch's reducer keeps a complex parameter's bucket complex and all-reduces it viewed as real; a comm hook is
    # handed that real view (the real dtype, twice the elements) and its result is read back as complex
    for result in each_rank(two, check):
        assert result["differences"] == [None] * 3
        assert result["minidp"] == result["stock"]
        if check.startswith("complex_hooked"):
            complex_bucket = ("torch.float64", 24, [("torch.float64", (4, 3))], ["torch.complex128"])
            assert all(complex_bucket in backward for backward in result["stock"])


# ---- GradBucket.gradients() (reducer.cpp, GradBucket::getGradients) ----


def test_a_hooks_gradients_are_row_major_views_so_powersgd_trains_as_stock_on_strided_weights(two):
    # torch hands a hook each gradient as buffer.slice(offset, offset + numel).view(sizes), row-major whatever the
    # parameter's strides, while the bucket holds a channels-last or transposed gradient in the parameter's memory
    # order; PowerSGD's view(rows, -1) needs the row-major view, and compresses what it reads in that order
    for result in each_rank(two, "powersgd_strided"):
        assert result["differences"] == [None] * 4
        assert result["minidp"] == result["stock"]
        assert result["stock"] == [[(16, 1), (27, 9, 3, 1), (1,)]] * 4  # the transposed weight, the conv's, its bias


@pytest.mark.parametrize("graph", ["dynamic", "static"])
def test_a_hook_is_handed_the_buckets_of_two_dtypes_as_stock_hands_them(two, graph):
    # reducer.cpp: a rebuilt plan lists the buckets still open from a hash table, the float64 one (the dtype met last
    # in the first backward) first; a static graph's first backward reduces every bucket in delay_all_reduce, which
    # tells each hook index 0 and is_last only for one bucket, so PowerSGD counts no iteration there
    for result in each_rank(two, f"buckets_a_hook_sees_{graph}"):
        assert result["differences"] == [None] * 4
        assert result["minidp"] == result["stock"]


def test_torchs_zero_overlap_hook_steps_the_shards_as_under_stock_ddp(two):
    # torch/distributed/algorithms/ddp_comm_hooks/ddp_zero_hook.py reads ddp._has_rebuilt_buckets (distributed.py,
    # set by the forward that installs the rebuilt plan): until then its optimizer steps once, after the backward
    for result in each_rank(two, "zero_overlap_hook"):
        assert result["rebuilt"] == [(False, False)] + [(True, True)] * 4
        assert result["differences"] == [None] * 5


def test_optimizers_stepped_in_the_backward_see_a_strided_weights_gradient_in_its_layout(two):
    # DDP's optimizer-in-backward hook makes each .grad a view of the bucket; in the parameter's own layout, not the
    # row-major gradients() (torch's own hook needs an accelerator: compared with stock DDP then SGD)
    for differences in each_rank(two, "optimizer_in_backward_strided"):
        assert differences == [None] * 3


# ---- a parameter's dtype changed after wrapping (torch: set_data with another dtype gives the parameter a new
# gradient accumulator, and the reducer's hooks on the old one never fire) ----

DTYPE_CHANGED = {"double": "parameter 0 ('first.weight') is torch.float64 now",
                 "bfloat16": "parameter 0 ('first.weight') is torch.bfloat16 now",
                 "one_layer": "parameter 2 ('second.weight') is torch.float64 now"}


@pytest.mark.parametrize("options", ["default", "find_unused", "bucket_view", "static"])
def test_a_parameters_dtype_changed_after_wrapping_is_an_error_at_the_next_forward_naming_it_and_the_fix(two, options):
    # the buckets keep the dtype the parameters had when wrapped: stock leaves each rank its own gradients, silently
    # (or fails in the backward); minidp raises before the module's forward, naming the parameter, both dtypes and the
    # fix, where it would otherwise round the gradients through its old buckets or fail obscurely
    for seen in each_rank(two, f"dtype_changed_{options}"):
        for change, named in DTYPE_CHANGED.items():
            assert not seen[change]["stock_averaged"]
            assert seen[change]["minidp"].startswith(f"forward: RuntimeError: DistributedDataParallel: {named}, but was "
                                                     f"torch.float32 when it was wrapped")
            assert "Convert the module before wrapping it in DistributedDataParallel" in seen[change]["minidp"]


# ---- a module made channels_last after wrapping (torch: the bucket was laid out for the gradients' old strides; its
# reducer warns "Grad strides do not match bucket view strides", reducer.cpp) ----


def test_a_module_made_channels_last_after_wrapping_gets_the_mean_gradient_where_torchs_copies_are_wrong(two):
    # torch's reducer laid its bucket views out in the strides the parameters had when wrapped; without
    # gradient_as_bucket_view the gradients it writes back are wrong, after a warning that says "This is not an error"
    # (README's table of differences); minidp's reduction reads and writes every gradient in its own strides
    for seen in each_rank(two, "channels_last_after_wrapping_copies"):
        assert seen["minidp"] == {"error": pytest.approx(0.0, abs=RTOL_FLOAT64), "warnings": []}
        assert seen["stock"]["error"] > 1e-3
        assert any("Grad strides do not match bucket view strides" in w for w in seen["stock"]["warnings"])


def test_a_module_made_channels_last_after_wrapping_with_bucket_views_gets_the_mean_gradient_as_torchs(two):
    for seen in each_rank(two, "channels_last_after_wrapping_bucket_view"):
        assert seen["minidp"]["error"] <= RTOL_FLOAT64
        assert seen["stock"]["error"] <= RTOL_FLOAT64


# ---- batch normalisation: minidp.SyncBatchNorm across processes; torch's refused on the CPU (distributed.py:2453) ----


@pytest.mark.parametrize("check", ["sync_bn_processes", "sync_bn_hybrid"])
def test_sync_batchnorm_across_every_replica_of_every_process_is_batchnorm_on_the_global_batch(two, three, check):
    for results in (two, three):
        for worst in each_rank(results, check):
            assert worst <= RTOL_FLOAT64


@pytest.mark.parametrize("check", ["sync_bn_deepcopy", "sync_bn_never_wrapped"])
def test_sync_batchnorm_no_wrapper_attached_to_is_batchnorm_on_the_global_batch_in_training(two, check):
    # torch's SyncBatchNorm synchronises whenever it trains with a process group, whatever wraps it (sync_batchnorm.py,
    # forward: need_sync): a copy of a wrapped model (an EMA teacher: copy.deepcopy, swa_utils.AveragedModel) or a
    # model never wrapped normalised each rank by its own batch, silently
    for worst in each_rank(two, check):
        assert worst <= RTOL_FLOAT64


def test_sync_batchnorm_in_a_data_parallel_in_each_process_exchanges_nothing_across_them_whatever_the_rows(two):
    # a replica alone (a batch of one chunk) is still a replica: the layer trains synchronised across the processes
    # only with no replica around it, else a process whose batch made one chunk exchanged and waited, alone, for the
    # others, whose replicas met each other (the job hung)
    for worst in each_rank(two, "sync_bn_data_parallel_alone"):
        assert worst <= RTOL_FLOAT64


@pytest.mark.parametrize("check", ["sync_bn_nested", "sync_bn_nested_hybrid"])
def test_sync_batchnorm_in_a_data_parallel_nested_in_the_wrapped_module_is_refused_saying_what_works(two, check):
    # the exchange's table has rows for the wrapper's replicas of each process: the nested call's chunks spilled over
    # the next process's rows (outputs 0.5 off BatchNorm on the global batch, silently) or the counts' shape (a shape
    # error); each rank raises now, before any collective
    for error in each_rank(two, check):
        assert error == ("RuntimeError", True)


def test_unused_parameters_that_change_are_logged_as_a_graph_not_static_once_per_process_as_stock(one):
    # reducer.cpp, search_unused_parameters: from the second iteration on, an unused set other than the last one's
    # calls Logger::log_if_graph_static(false), which logs can_set_static_graph = 0 and the iteration under a
    # process-wide once flag: the first wrapper logs it at its second step; the next wrappers of the process do not.
    for result in each_rank(one, "graph_not_static"):
        first, second = result["logged"]
        assert first["minidp"] == first["stock"] and first["stock"][0] == 0
        assert second["minidp"] == second["stock"] and second["stock"][0] is None


def test_a_process_with_fewer_rows_than_replicas_still_normalises_by_the_global_batch(two):
    # Rank 1's one row runs one replica of its two: its exchange fills the other's rows with a count of 0. Sized by
    # the replicas run, the two ranks' tables differed and Gloo aborted the job (minidp/distributed/batchnorm.py).
    for worst in each_rank(two, "sync_bn_hybrid_fewer_rows"):
        assert worst <= RTOL_FLOAT64


def test_inputs_normalised_first_on_a_process_with_fewer_rows_than_replicas_are_batchnorm_on_the_global_batch(
        sync_batchnorm):
    """A SyncBatchNorm first, on inputs that require grad: its statistics' backward all-reduce and the wrapper's bucket
    all-reduces come in no fixed order between a process that runs two replicas and one that runs one (a row), and on
    one process group Gloo aborted the job ("collective mismatch"); the backward's all-reduces have a group of their
    own (minidp/distributed/batchnorm.py, ``group_for_backwards``). Outputs, parameters, running statistics and the
    inputs' gradients, as nn.BatchNorm1d's on the global batch."""
    for worst in each_rank(sync_batchnorm, "normalised_inputs_fewer_rows_hybrid"):
        assert worst <= RTOL_FLOAT64


def test_the_backward_all_reduces_group_is_made_alike_where_processes_know_different_groups(sync_batchnorm):
    """The same, where rank 0 made a group of its own before (torch's ``new_group`` leaves rank 1 out of it): the
    backward's group, made with ``use_local_synchronization=True``, was named from the groups each process knew, so
    the two processes made two groups and the first step hung; made by every process of the job, it is one."""
    for worst in each_rank(sync_batchnorm, "normalised_inputs_fewer_rows_hybrid_other_groups"):
        assert worst <= RTOL_FLOAT64


@pytest.mark.parametrize("check", ["rank_without_rows", "rank_without_rows_hybrid"])
def test_sync_batchnorm_with_a_rank_without_rows_is_batchnorm_on_the_global_batch(sync_batchnorm, check):
    """nn.BatchNorm1d on the global batch (5 rows of rank 0, none of rank 1) trains; so does torch's SyncBatchNorm,
    whose backward all-reduces on every rank whatever its rows. minidp's empty rank has constant statistics: its
    table used not to require grad, it skipped the backward's all-reduce that rank 0 ran, and Gloo aborted the job.
    Outputs, parameters and running statistics over three steps, one replica per process and two."""
    for worst in each_rank(sync_batchnorm, check):
        assert worst <= RTOL_FLOAT64


def test_second_derivatives_through_sync_batchnorm_cross_the_processes(sync_batchnorm):
    """A gradient penalty (create_graph=True) through the layer equals nn.BatchNorm1d's on the global batch, whose
    second derivatives autograd gives exactly (the computation the layer stands for). An in-place all-reduce in the
    exchange's backward left the second derivatives of the other ranks out: gradients off by a percent."""
    for worst in each_rank(sync_batchnorm, "gradient_penalty"):
        assert worst <= 1e-12


@pytest.mark.parametrize("check", ["layer_process_group", "layer_process_group_hybrid"])
def test_sync_batchnorm_converted_with_a_process_group_synchronises_over_that_group(sync_batchnorm, check):
    """torch's ``convert_sync_batchnorm(module, process_group)`` gives each layer the group its statistics span
    (``SyncBatchNorm(..., process_group)``; None: the whole world). minidp's took no group (TypeError); now a layer's
    own group is the one its exchange all-reduces over, the wrapper's where it has none. A second group of both ranks:
    the exchange holds that very group, and training equals BatchNorm on the global batch."""
    for worst in each_rank(sync_batchnorm, check):
        assert worst <= RTOL_FLOAT64


def test_sync_batchnorm_after_destroy_process_group_is_batchnorm():
    """torch's SyncBatchNorm synchronises only while torch.distributed is initialized (``need_sync``), and runs
    F.batch_norm after ``destroy_process_group()``. minidp's layer kept the exchange its DDP gave it, and its next
    training forward raised (default process group not initialized). A job of its own: the check ends the group."""
    plan = {"after_destroy": (checks.sync_batchnorm_after_destroy_process_group, {})}
    for worst in each_rank(run_job(_run_checks, 2, plan, JOB_TIMEOUT), "after_destroy"):
        assert worst <= RTOL_FLOAT64


def test_torch_sync_batchnorm_on_the_cpu_is_refused_with_stocks_words_and_the_way_out(two):
    for errors in each_rank(two, "torch_sync_bn_cpu"):
        assert errors["stock"] == "SyncBatchNorm layers only work with GPU modules"
        assert errors["minidp"].startswith("SyncBatchNorm layers only work with GPU modules")
        assert "minidp.SyncBatchNorm.convert_sync_batchnorm" in errors["minidp"]


# ---- a rank that runs out of data without Join: torch DDP waits past the process group's timeout ----


def test_a_rank_out_of_data_without_join_is_an_error_on_every_rank_within_the_timeout(tmp_path):
    # rank 0 stops after 2 steps and waits at a barrier; rank 1's third backward waits for rank 0
    try:
        launch(checks.runs_out_without_join, 2, (str(tmp_path),), timeout=6, job_timeout=120)
    except RankFailed:
        pass  # the job's own closing barrier may fail too, after both ranks wrote what they got
    outcomes = [(tmp_path / f"rank{rank}.txt").read_text().split("\n", 1) for rank in (0, 1)]
    assert all(float(seconds) < 60 for seconds, _ in outcomes)  # the process group's timeout, not a hang
    assert "Timed out" in outcomes[0][1] or "Connection closed" in outcomes[0][1]  # its barrier, outside DDP
    assert "rank 1: the all-reduce of bucket 0 did not complete" in outcomes[1][1]
    assert "with ddp.join():" in outcomes[1][1]


# ---- construction: what is synchronised, and over which ranks (distributed.py:886-1075) -------------


@pytest.mark.parametrize("check", ["ignored", "ignored_find_unused"])
def test_ignored_parameters_and_buffers_are_left_alone_as_stock_leaves_them(two, check):
    # _set_params_and_buffers_to_ignore_for_model: not broadcast at construction (so they keep each rank's
    # initial values), not reduced (local gradients), and an ignored buffer is not broadcast before forwards
    assert_no_differences(two, check)


def test_a_parameter_ignored_by_a_name_stocks_reducer_does_not_match_is_still_reduced_as_in_stock(two):
    # distributed.py _build_params_for_reducer: f"{module_name}.{param_name}" over each module's own parameters, then
    # repeats dropped; a root parameter is ".scale" there (ignoring "scale" keeps it out of the broadcast only), and
    # the tied weight, ignored as "emb.weight", is kept as "head.weight", at head's place, after mid's parameters
    for result in each_rank(two, "ignored_unmatched_names"):
        assert result["differences"] == [None] * 3
        assert result["minidp"] == result["stock"]
        assert result["stock"]["positions"] == [0, 2, 3, 1]
        assert result["stock"]["names"] == {0: ".scale", 1: "mid.weight", 2: "mid.bias", 3: "head.weight"}


def test_parameters_ignored_by_stocks_reducer_names_are_not_reduced_as_in_stock(two):
    for result in each_rank(two, "ignored_reducer_names"):
        assert result["differences"] == [None] * 3
        assert result["minidp"] == result["stock"]
        assert result["stock"]["positions"] == [2, 3]


def test_init_sync_false_neither_checks_nor_broadcasts_as_stock(two):
    assert_no_differences(two, "no_init_sync")


def test_a_one_dimensional_device_mesh_averages_over_its_ranks_as_stock(two):
    assert_no_differences(two, "device_mesh")


def test_a_mesh_sliced_from_a_larger_one_averages_over_its_ranks_as_stock(two):
    # distributed.py: a device_mesh whose root mesh is larger goes through _pre_dp_module_transform (DTensor
    # parameters made local around the forward; none here) and DDP averages over the slice's group
    assert_no_differences(two, "device_mesh_slice")


def test_a_process_group_without_global_rank_0_trains_as_stock_its_rebuilt_plan_from_the_groups_first_rank(three):
    # reducer.cpp, sync_bucket_indices: the rebuilt plan is broadcast from the group's rank 0 (global rank 1 here);
    # small buckets, so that the plan has several and the rebuild matters
    assert_no_differences(three, "subgroup_without_rank_0")


def test_a_sliced_mesh_with_tensor_parallel_parameters_is_refused_with_the_way_out(two):
    # distributed.py: torch DDP turns DTensor parameters local around each forward there (_pre_dp_module_transform)
    for result in each_rank(two, "device_mesh_slice_tensor_parallel"):
        assert "is a slice of a larger mesh and the module has DTensor parameters" in result
        assert "Use torch.nn.parallel.DistributedDataParallel for this model" in result


@needs_torch_argument("forward_sync_buffers")
def test_forward_sync_buffers_false_syncs_buffers_once_at_construction_as_stock(two):
    assert_no_differences(two, "forward_sync_off")


@needs_torch_argument("bucket_cap_mb_list")
def test_a_cap_per_bucket_trains_as_stock_bitwise(two):
    assert_no_differences(two, "bucket_list")


@needs_torch_argument("bucket_cap_mb_list")
@pytest.mark.parametrize("check", ["bucket_list_hooked", "bucket_list_find_unused"])
def test_a_cap_per_bucket_hands_hooks_stocks_buckets_in_every_backward(two, check):
    for result in each_rank(two, check):
        assert result["minidp"] == result["stock"]
        assert result["plans"] == [[indices for _, _, indices in backward] for backward in result["stock"]]


@needs_torch_argument("batched_grad_copy")
@pytest.mark.parametrize("check", ["batched_copy", "batched_copy_views"])
def test_batched_gradient_copies_train_as_stocks_bitwise(two, check):
    # one copy and one division per full bucket (distributed.py: batched_grad_copy), with bucket views too
    assert_no_differences(two, check)


@needs_torch_argument("batched_grad_copy")
def test_batched_gradient_copies_divide_as_stock_where_a_third_is_inexact(three):
    # three ranks: stock's batched path divides the bucket by 3 where its default multiplies each gradient by
    # 1/3, and the bits differ; minidp follows each path
    assert_no_differences(three, "batched_copy")


@needs_torch_argument("skip_all_reduce_unused_params")
def test_skipping_the_all_reduce_of_unused_buckets_trains_as_stock_bitwise(two):
    assert_no_differences(two, "skip_unused")


@needs_torch_argument("skip_all_reduce_unused_params")
def test_buckets_of_unused_parameters_reach_no_hook_as_in_stock(two):
    # reducer.cpp's should_skip_all_reduce_bucket: a bucket whose every parameter is unused launches nothing
    unused = {0, 1, 8, 9}  # never (its bucket is the last one reduced) and branch
    for result in each_rank(two, "skip_unused_hooked"):
        assert result["minidp"] == result["stock"]
        for plan, backward in zip(result["plans"], result["minidp"]):
            skipped = [bucket for bucket in plan if unused.issuperset(bucket)]
            assert skipped and [indices for _, _, indices in backward] == [b for b in plan if b not in skipped]


@pytest.mark.parametrize("case", sorted(MIXED_PRECISION))
def test_native_mixed_precision_reduces_the_low_precision_mean_in_full_precision(two, case):
    """torch DDP's ``mixed_precision`` (torch/nn/parallel/distributed.py, ``_root_copy_hook``, and
    ``ddp_comm_hooks/mixed_precision_hooks.py``): after every backward, each ``.grad`` is the mean over the ranks of
    the ``param_dtype`` gradients, taken in ``reduce_dtype``, bit for bit; the optimizer sees ``float32`` parameters
    and gradients, and so does whoever reads the model after a forward under ``torch.no_grad()``; the buffers are in
    ``buffer_dtype``."""
    config = MIXED_PRECISION[case]
    for rank in each_rank(two, f"mixed_precision_{case}"):
        assert all(rank["mean"]), rank["mean"]
        assert all(dtypes == ["torch.float32"] for dtypes in rank["dtypes"] + rank["evaluated"]), rank
        assert len(rank["evaluated"]) == (len(rank["mean"]) if config.get("evaluate") else 0)
        assert rank["buffers"] == ([f"torch.{config['buffer_dtype']}"] if config["buffer_dtype"] else []), rank["buffers"]


@pytest.mark.parametrize("case", sorted(set(MIXED_PRECISION) - set(STOCK_MIXED_PRECISION_FALLS_SHORT)))
def test_native_mixed_precision_trains_as_stock_bitwise_from_its_second_backward(two, case):
    """The same training with torch's DDP (its accelerator-only calls stood in for:
    ``ddp_feature_checks.torch_mixed_precision_on_the_cpu``): parameters, gradients and buffers bitwise equal after
    every backward and every step from the second backward on (torch's first sums a buffer its gradients never
    reached: ``ddp_feature_checks.mixed_precision_as_stock`` says why)."""
    for rank in each_rank(two, f"mixed_precision_{case}"):
        assert rank["stock_error"] is None, rank["stock_error"]
        assert rank["stock"] and rank["stock"] == [None] * len(rank["stock"]), rank["stock"]


def test_native_mixed_precision_casts_the_inputs_and_passes_a_keyword_named_dtype_as_it_is(two):
    # torch's DDP hands the forward's keyword arguments to _cast_forward_inputs(dtype, *args, **kwargs)
    # (torch/distributed/utils.py), where one named dtype collides with its own: "got multiple values for argument"
    for rank in each_rank(two, "mixed_precision_keyword_named_dtype"):
        assert rank == {"error": None, "seen": "torch.bfloat16", "output": "torch.float32"}


@pytest.mark.parametrize("batches", ["1_3", "0_2"])
def test_native_mixed_precision_under_join_trains_as_if_the_joined_rank_added_zero_gradients(two, batches):
    """A rank out of data under ``join()`` runs the communication hook with its buckets zeroed (torch's
    ``_DDPJoinHook.main_hook``, torch/nn/parallel/distributed.py) outside any backward: the mixed-precision hook's
    end-of-backward step runs there at once (it failed with autograd's "Final callbacks can only be installed during
    backward pass", and the other rank then lost its peer). The model on every rank after the context is the one a
    training without join gives where that rank back-propagates zero gradients, bit for bit, in full precision."""
    for rank in each_rank(two, f"mixed_precision_join_{batches}"):
        assert rank["errors"] == {"joined": None, "reference": None}, rank["errors"]
        assert rank["difference"] is None, rank["difference"]
        assert rank["dtypes"] == ["torch.float32"]


# ---- what the observation tools report: an MLP 8-16-4 in float64 (ddp_feature_checks.observed_memory) ----

MLP_BYTES = (8 * 16 + 16 + 16 * 4 + 4) * 8  # 1696: the parameters, and each other copy of them


def test_with_gradient_as_bucket_view_the_memory_ledger_counts_each_gradient_storage_once(observed):
    # every .grad is a view of its bucket: parameters, gradients (the buckets) and SGD's momentum, no more
    for result in each_rank(observed, "observed_bucket_view"):
        assert result["plan"] == [[3, 2, 1], [0]]  # two buckets: each holds gradients, not a copy of them
        assert result["ledger"] == {"parameters": MLP_BYTES, "gradients": MLP_BYTES, "optimizer_state": MLP_BYTES,
                                    "gathered": 0, "buckets": 0, "transient_peak": 0, "total_peak": 3 * MLP_BYTES}


def test_without_gradient_as_bucket_view_the_memory_ledger_counts_the_buckets_as_one_more_copy(observed):
    for result in each_rank(observed, "observed_copies"):
        assert result["ledger"] == {"parameters": MLP_BYTES, "gradients": MLP_BYTES, "optimizer_state": MLP_BYTES,
                                    "gathered": 0, "buckets": MLP_BYTES, "transient_peak": MLP_BYTES,
                                    "total_peak": 4 * MLP_BYTES}


def test_the_allocation_ledger_counts_ddps_bucket_buffers_as_gradients(observed):
    # the step's buckets (made in its forward, as the plan is rebuilt) and the parameters' .grad, held at once;
    # the inputs are the batch alone (6 x 8 float64)
    for result in each_rank(observed, "observed_copies"):
        assert result["held"]["gradients"] == 2 * MLP_BYTES
        assert result["held"]["inputs"] == 6 * 8 * 8


@pytest.mark.parametrize("check", ["observed_bucket_view", "observed_copies"])
def test_the_ledger_names_ddps_parameters_and_gradients_in_a_step_without_an_optimizer(observed, check):
    """The wrapper names its parameters and their gradients to the ledger (``minidp.hooks.observe_storage``): held
    before the step, the parameters and the last step's ``.grad`` counted as its inputs, beside the batch, where no
    optimizer stepped inside the trace to name them; the last step's gradients count until ``zero_grad`` lets go."""
    for result in each_rank(observed, check):
        held = result["traced held"]
        assert held["parameters"] == MLP_BYTES
        assert held["inputs"] == 6 * 8 * 8
        assert held["gradients"] >= MLP_BYTES
