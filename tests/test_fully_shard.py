"""minidp.distributed.fully_shard against torch's FSDP2 (torch.distributed.fsdp.fully_shard), in real
Gloo processes on 127.0.0.1.

The processes are started once per world size (``minidp.distributed.launch``, bounded by
``job_timeout``, every process ended by it); each runs every check of ``fsdp_checks`` on a fresh
seed and sends back plain facts. "Equal" means bitwise (``torch.equal``): this rank's parameter
shards, their gradients and the optimizer's state, after every backward and every step.

What is compared is FSDP2 in torch 2.13 (torch/distributed/fsdp/_fully_shard/): the shards of
``_fsdp_param.py`` (``_init_sharded_param``: ``torch.chunk`` on dim 0, padded to chunk 0's size),
the all-gather copy-in and copy-out and the reduce-scatter of ``_fsdp_collectives.py``
(``foreach_all_gather``, ``foreach_all_gather_copy_out``, ``foreach_reduce``) and its division of
the gradients (``_get_gradient_divide_factors``: ``ReduceOp.AVG`` in float32, SUM between a
division before and one after in float64).
"""

from __future__ import annotations

import inspect
import itertools
import multiprocessing
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from . import fsdp_checks as checks
from .ddp_checks import run_checks
from .helpers import FSDP2_SHARDS_INTEGER_PARAMETERS, assert_ended_well, each_rank, fresh_python, job_fixture, torchrun
from .helpers import assert_no_differences as assert_same_as_fsdp2
from minidp.cli import main
from minidp.distributed import RankFailed, chrome_trace, fully_shard, launch
from minidp.distributed.fully_shard import ShardedModule, _resharding, division


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """These checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


JOB_TIMEOUT = 300.0  # seconds for a whole job; the process group's own timeout is launch()'s 60 s

DTYPES = {"float32": torch.float32, "float64": torch.float64}
MATRIX = list(itertools.product(DTYPES, checks.OPTIMIZERS, [True, False]))


def _name(dtype: str, optimizer: str, reshard: bool) -> str:
    return f"{dtype}-{optimizer}-{'reshard' if reshard else 'keep'}"


def _against_fsdp2_plan() -> dict:
    return {_name(d, o, r): (checks.against_fsdp2, {"dtype": DTYPES[d], "optimizer": o, "reshard_after_forward": r})
            for d, o, r in MATRIX}


# FSDPModule's setters (fsdp_checks.CONFIGURATIONS), each trained against FSDP2 doing the same: what else each case sets.
CONFIGURED = {
    "forward_prefetch": {},
    "backward_prefetch": {"optimizer": "adamw"},
    "keep_between_micro_batches": {"micro_batches": 3, "steps": 2, "optimizer": "adamw"},
    "divide_by_three": {"dtype": torch.float64},  # float32 would need PREMUL_SUM, which Gloo lacks (below)
    "force_sum": {},
    "unshard_by_hand": {},
    "reshard_the_root": {"reshard_after_forward": None},
    "embedding_not_gathered_in_backward": {"model": "embedded"},
    "all_reduce_hook": {"dtype": torch.float64},  # float64: a division after the hook too
}

UNSYNCED = {"micro_batches": 3, "steps": 2, "unsynced": "all"}

# A frozen parameter of another dtype beside float32 ones in the root's call (fsdp_checks.Gained), without a policy
# and with bf16's, which casts a floating-point one to bf16 too and leaves an integer one as it is.
FROZEN = {"float64": torch.float64, "bfloat16": torch.bfloat16,
          **({"int64": torch.int64} if FSDP2_SHARDS_INTEGER_PARAMETERS else {})}
FROZEN_CASES = [*((name, None) for name in FROZEN), *((name, "bf16") for name in FROZEN if name != "bfloat16")]


def _frozen_name(frozen: str, policy: Optional[str]) -> str:
    return f"frozen-{frozen}" + (f"-{policy}" if policy else "")


TWO_PROCESSES = {
    **_against_fsdp2_plan(),
    "accumulate": (checks.against_fsdp2, {"micro_batches": 2, "optimizer": "adamw"}),
    "evaluation_before_training": (checks.evaluation_before_training_as_fsdp2, {}),
    "tied": (checks.against_fsdp2, {"model": "tied", "dtype": torch.float64}),
    "unsynced-reshard": (checks.against_fsdp2, {"micro_batches": 3, "steps": 2, "unsynced": "all"}),
    "unsynced-keep": (checks.against_fsdp2, {"micro_batches": 3, "steps": 2, "unsynced": "all",
                                             "reshard_after_forward": False, "optimizer": "adamw"}),
    "unsynced-root": (checks.against_fsdp2, {"micro_batches": 3, "steps": 2, "unsynced": "root"}),
    "collectives_unsynced": (checks.collectives_when_unsynced, {"recurse": True}),
    "collectives_unsynced_root": (checks.collectives_when_unsynced, {"recurse": False}),
    "unshard_and_reshard": (checks.unshard_and_reshard, {}),
    "deepcopies": (checks.deepcopies, {}),
    "as_fsdp_modules": (checks.as_fsdp_modules, {}),
    "already_wrapped": (checks.already_wrapped, {}),
    "containers_without_forward": (checks.containers_without_forward, {}),
    "states": (checks.states, {}),
    "shared_between_groups": (checks.shared_between_groups, {}),
    "mismatched_model": (checks.mismatched_model, {}),
    "other_layer_per_rank": (checks.other_layer_per_rank, {}),
    "mp_policy_per_rank": (checks.mp_policy_per_rank, {}),
    "reshard_after_forward_per_rank": (checks.reshard_after_forward_per_rank, {}),
    **{_frozen_name(frozen, policy): (checks.against_fsdp2, {"model": "gained", "frozen": FROZEN[frozen],
                                                             "policy": policy, "optimizer": "adamw"})
       for frozen, policy in FROZEN_CASES},
    "gradients_of_two_dtypes": (checks.gradients_of_two_dtypes, {}),
    "freed_once_dropped": (checks.freed_once_dropped, {}),
    "timeline_and_memory": (checks.timeline_and_memory, {}),
    **{f"configured-{name}": (checks.against_fsdp2, {"configure": name, **arguments})
       for name, arguments in CONFIGURED.items()},
    "root-kept": (checks.against_fsdp2, {"reshard_after_forward": None, "optimizer": "adamw"}),
    **{f"policy-{name}": (checks.against_fsdp2, {"policy": name, "optimizer": "adamw"}) for name in checks.POLICIES},
    **{f"policy-{name}-unsynced": (checks.against_fsdp2, {"policy": name, **UNSYNCED}) for name in checks.POLICIES},
    **({f"recover-{where}": (checks.recovers_from_a_failure, {"where": where}) for where in ("forward", "backward")}
       if checks.FSDP2_RESETS else {}),
    "handles": (checks.handles, {}),
    "forward_method": (checks.forward_method, {}),
    **{f"generate_{when}": (checks.forward_method_calling_forward, {"before_the_optimizer": when == "first"})
       for when in ("first", "every_step")},
    "view_output_warnings": (checks.view_output_warnings, {}),
    "casts_containers": (checks.casts_containers_as_fsdp2, {}),
    "grouped_forward_failure": (checks.grouped_forward_failure, {}),
    **({"unused-params": (checks.against_fsdp2, {"model": "branchy", "configure": "reduce_unused",
                                                 "optimizer": "adamw"})} if checks.FSDP2_REDUCES_UNUSED else {}),
    "ignored-head": (checks.against_fsdp2, {"ignored": ("head.weight", "head.bias"), "optimizer": "adamw"}),
    **{f"grouped-{name}": (checks.against_fsdp2, {"grouped": ("norm", "head"), "reshard_after_forward": r,
                                                  "optimizer": "adamw"})
       for name, r in (("reshard", True), ("keep", False), ("default", None))},
    "grouped-accumulate": (checks.against_fsdp2, {"grouped": ("norm", "head"), "micro_batches": 3, "steps": 2,
                                                  "unsynced": "all"}),
    **({f"chunked-loss-{name}": (checks.chunked_loss, {"reshard_after_forward": r})
        for name, r in (("reshard", True), ("keep", False))} if checks.FSDP2_COMPLETES_PARTIAL_GROUPS else {}),
    "premultiplied": (checks.premultiplied, {}),
    "mesh-1d": (checks.against_fsdp2, {"mesh": (2,), "optimizer": "adamw"}),
    "hsdp-1x2": (checks.against_fsdp2, {"mesh": (1, 2)}),
    "hsdp-2x1": (checks.against_fsdp2, {"mesh": (2, 1), "dtype": torch.float64, "optimizer": "adamw"}),
    "placement": (checks.against_fsdp2, {"model": "wide", "placement": True, "optimizer": "adamw"}),
    "placement-unsynced-keep": (checks.against_fsdp2, {"model": "wide", "placement": True, "reshard_after_forward": False,
                                                       **UNSYNCED}),
    "offload": (checks.against_fsdp2, {"offload": True, "optimizer": "adamw"}),
    "refusals": (checks.refusals, {}),
    "loaded_with_wrong_shapes": (checks.loaded_with_wrong_shapes, {}),
    **{f"state_dicts_{layout}": (checks.state_dicts_of_layouts, {"layout": layout, "misshapen": misshapen})
       for layout, misshapen in (("blocks_wrapped", "blocks.1.linear.weight"), ("root_wrapped", "head.weight"),
                                 ("nested_wrapped", "blocks.1.linear.weight"),
                                 ("shared_block", "layers.1.linear.weight"))},
    "partial_full_state_dict_loaded": (checks.partial_full_state_dict_loaded, {}),
    "whole_parameter_optimizers": (checks.whole_parameter_optimizers, {}),
    "on_the_meta_device": (checks.on_the_meta_device, {}),
    "loaded_with_assign": (checks.loaded_with_assign, {}),
    "optimizer_in_backward": (checks.optimizer_in_backward, {}),
    "checkpoint": (checks.checkpoint_round_trip, {}),
    "optimizer_checkpoint": (checks.optimizer_checkpoint, {}),
    "optimizer_checkpoint_adagrad": (checks.optimizer_checkpoint, {"optimizer_name": "adagrad"}),
    "optimizer_state_unlike_the_parameter": (checks.optimizer_state_unlike_the_parameter, {}),
    "whole_optimizer_state_loaded_by_hand": (checks.whole_optimizer_state_loaded_by_hand, {}),
    "param_group_added_after_a_step": (checks.param_group_added_after_a_step, {}),
    "compiled": (checks.compiled_as_eager, {}),
    "compiled_graphs": (checks.compiled_graphs_as_fsdp2, {}),
    "clip-2": (checks.clips_as_fsdp2, {"norm_type": 2.0, "dtype": torch.float32}),
    "clip-1": (checks.clips_as_fsdp2, {"norm_type": 1.0}),
    "clip-inf": (checks.clips_as_fsdp2, {"norm_type": float("inf"), "dtype": torch.float32}),
    "clip-minus-inf": (checks.clips_as_fsdp2, {"norm_type": float("-inf")}),
    "clip-0": (checks.clips_as_fsdp2, {"norm_type": 0.0}),
    "clip-two-dtypes": (checks.clips_as_fsdp2, {"norm_type": 2.0, "dtype": torch.float32, "model": "two_dtypes"}),
    "clip-whole-beside-sharded": (checks.clipping_whole_beside_sharded, {}),
    "frozen_midway": (checks.frozen_and_unfrozen_midway_as_fsdp2, {}),
    "used_outside_forward": (checks.used_outside_forward, {}),
    "method_other_than_forward": (checks.method_other_than_forward, {}),
    "child_after_parent": (checks.child_sharded_after_its_parent, {}),
    "refused_on_one_rank": (checks.refused_on_one_rank_only, {}),
    "loss_scalers": (checks.loss_scalers_seeing_an_inf, {}),
    "meta": (checks.against_fsdp2, {"meta": True, "optimizer": "adamw"}),
    "meta-tied": (checks.against_fsdp2, {"meta": True, "model": "tied", "dtype": torch.float64}),
    "divide_factor_by_its_old_name": (checks.divide_factor_by_its_old_name, {}),
    "collectives-root-kept": (checks.collectives_with, {"configure": None, "reshard_after_forward": None}),
    "collectives-kept-between": (checks.collectives_with, {"configure": "keep_between_micro_batches",
                                                           "micro_batches": 3}),
    "collectives-kept-after-backward": (checks.collectives_with, {"configure": "kept_after_backward"}),
    "collectives-forward-prefetch": (checks.collectives_with, {"configure": "forward_prefetch"}),
    "collectives-backward-prefetch": (checks.collectives_with, {"configure": "backward_prefetch"}),
    "collectives-embedding": (checks.collectives_with, {"configure": "embedding_not_gathered_in_backward",
                                                        "model": "embedded"}),
    "dtensor_parameters": (checks.dtensor_parameters, {}),
    "state_dict_kept_vars": (checks.state_dict_kept_vars, {}),
    "sparse_embedding": (checks.sparse_embedding, {}),
}
# FSDP2's setters of its communication buffers, compared where the installed torch has them (2.13: not 2.11)
FSDP2_SETS_COMM_BUFFERS = all(hasattr(FSDPModule, name) for name in (
    "set_reduce_scatter_max_input_buffers", "set_allocate_memory_from_process_group_for_comm"))
needs_fsdp2s_comm_buffer_setters = pytest.mark.skipif(
    not FSDP2_SETS_COMM_BUFFERS, reason="this torch's FSDP2 has no communication buffer setters to compare with")
if FSDP2_SETS_COMM_BUFFERS:
    TWO_PROCESSES["fsdp2s_default_comm_buffers"] = (checks.against_fsdp2, {
        "configure": "fsdp2s_default_comm_buffers", "optimizer": "adamw"})
    TWO_PROCESSES["comm_buffers_beyond_the_defaults"] = (checks.comm_buffers_beyond_the_defaults, {})

THREE_PROCESSES = {
    **_against_fsdp2_plan(),
    "accumulate": (checks.against_fsdp2, {"micro_batches": 2, "reshard_after_forward": False}),
    "unsynced-reshard": (checks.against_fsdp2, {"micro_batches": 3, "steps": 2, "unsynced": "all",
                                                "dtype": torch.float64, "optimizer": "adamw"}),
    "unsynced-keep": (checks.against_fsdp2, {"micro_batches": 3, "steps": 2, "unsynced": "all",
                                             "reshard_after_forward": False}),
    "unsynced-root": (checks.against_fsdp2, {"micro_batches": 3, "steps": 2, "unsynced": "root",
                                             "reshard_after_forward": False}),
    "configured-keep_between_micro_batches": (checks.against_fsdp2, {"configure": "keep_between_micro_batches",
                                                                     "micro_batches": 3, "steps": 2}),
    # with 3 ranks a factor of 3 is the world size: float32 reduces with AVG, float64 divides by 2, then by 1.5
    "configured-divide_by_three": (checks.against_fsdp2, {"configure": "divide_by_three", "dtype": torch.float64}),
    "configured-divide_by_three-float32": (checks.against_fsdp2, {"configure": "divide_by_three"}),
    "policy-bf16-reduce-fp32-unsynced": (checks.against_fsdp2, {"policy": "bf16-reduce-fp32", **UNSYNCED}),
    "policy-reduce-bf16": (checks.against_fsdp2, {"policy": "reduce-bf16", "optimizer": "adamw"}),
    "ignored-head": (checks.against_fsdp2, {"ignored": ("head.weight", "head.bias"), "dtype": torch.float64}),
    "grouped-reshard": (checks.against_fsdp2, {"grouped": ("norm", "head"), "dtype": torch.float64}),
    "placement": (checks.against_fsdp2, {"model": "wide", "placement": True, "dtype": torch.float64}),
    # (not inf: FSDP2's own norm fails on the empty shard rank 2 holds, "no identity")
    "clip-2": (checks.clips_as_fsdp2, {"norm_type": 2.0}),
    "clip-3": (checks.clips_as_fsdp2, {"norm_type": 3.0, "dtype": torch.float32}),
    "optimizer_checkpoint": (checks.optimizer_checkpoint, {}),  # rank 2 holds no row of a bias of 2
}

# HSDP: a 2 x 2 mesh, each shard held by 2 ranks (the mesh's dimension 0) and cut among 2 (dimension 1).
FOUR_PROCESSES = {
    "hsdp": (checks.against_fsdp2, {"mesh": (2, 2)}),
    "hsdp-float64": (checks.against_fsdp2, {"mesh": (2, 2), "dtype": torch.float64, "optimizer": "adamw"}),
    "hsdp-keep": (checks.against_fsdp2, {"mesh": (2, 2), "reshard_after_forward": False, "optimizer": "adamw"}),
    "hsdp-all_reduce_the_last": (checks.against_fsdp2, {"mesh": (2, 2), "configure": "all_reduce_the_last",
                                                        "micro_batches": 3, "steps": 2}),
    "hsdp-unsynced": (checks.against_fsdp2, {"mesh": (2, 2), "policy": "bf16-reduce-fp32", **UNSYNCED}),
    "hsdp-divide_by_three": (checks.against_fsdp2, {"mesh": (2, 2), "configure": "divide_by_three",
                                                    "dtype": torch.float64}),
    "hsdp-placement": (checks.against_fsdp2, {"model": "wide", "mesh": (2, 2), "placement": True}),
    "hsdp-all_reduce_hook": (checks.against_fsdp2, {"mesh": (2, 2), "configure": "all_reduce_hook",
                                                    "dtype": torch.float64}),
    "checkpoint": (checks.checkpoint_round_trip, {"mesh": (2, 2)}),
    "optimizer_checkpoint": (checks.optimizer_checkpoint, {"mesh": (2, 2)}),
    "clip-2": (checks.clips_as_fsdp2, {"norm_type": 2.0, "dtype": torch.float32, "mesh": (2, 2)}),
    "clip-inf": (checks.clips_as_fsdp2, {"norm_type": float("inf"), "mesh": (2, 2)}),
}


# What the observation tools report of models small enough to count by hand: a job of its own, a few seconds long.
OBSERVED = {"observed": (checks.observed_figures, {})}

two = job_fixture("two", run_checks, 2, TWO_PROCESSES, JOB_TIMEOUT)
observed = job_fixture("observed", run_checks, 2, OBSERVED, JOB_TIMEOUT)
three = job_fixture("three", run_checks, 3, THREE_PROCESSES, JOB_TIMEOUT)
four = job_fixture("four", run_checks, 4, FOUR_PROCESSES, JOB_TIMEOUT)


def assert_trains_as_fsdp2(results: list[dict], check: str) -> None:
    """Bitwise FSDP2's after every backward and step, its full state dict FSDP2's, and that loaded back."""
    assert_same_as_fsdp2(results, check)
    for rank, result in enumerate(each_rank(results, check)):
        assert result["state_dict_equal"] and result["reloaded"], f"rank {rank}"


# ---- bitwise equal to FSDP2 after every backward and every step ----------------------------------


@pytest.mark.parametrize("dtype,optimizer,reshard", MATRIX)
def test_shards_gradients_and_optimizer_state_equal_fsdp2_two_processes(two, dtype, optimizer, reshard):
    assert_same_as_fsdp2(two, _name(dtype, optimizer, reshard))


@pytest.mark.parametrize("dtype,optimizer,reshard", MATRIX)
def test_shards_gradients_and_optimizer_state_equal_fsdp2_three_processes(three, dtype, optimizer, reshard):
    # with 3 ranks a bias of 2 rows leaves rank 2 an empty shard; float64 divides by 2, then by 1.5
    assert_same_as_fsdp2(three, _name(dtype, optimizer, reshard))


@pytest.mark.parametrize("world", ["two", "three"])
def test_gradients_of_several_backwards_accumulate_in_the_shards_as_fsdp2(world, request):
    assert_same_as_fsdp2(request.getfixturevalue(world), "accumulate")


# ---- set_requires_gradient_sync: gradient accumulation without the reduce-scatter --------------------
# FSDP2: _fully_shard.py, FSDPModule.set_requires_gradient_sync (sets each group's reduce_grads);
# _fsdp_param_group.py, post_backward (reduce_grads False: reshard, keep unsharded_param.grad, return).


@pytest.mark.parametrize("world", ["two", "three"])
@pytest.mark.parametrize("reshard", ["reshard", "keep"])
def test_micro_batches_accumulated_unsynced_then_reduced_once_equal_fsdp2(world, reshard, request):
    # 3 backwards per step, sync off for the first two and on for the last; 2 steps (2 ranks: float32, SGD
    # and AdamW; 3 ranks: float64 AdamW and float32 SGD)
    assert_same_as_fsdp2(request.getfixturevalue(world), f"unsynced-{reshard}")


@pytest.mark.parametrize("world", ["two", "three"])
def test_sync_switched_off_on_the_root_only_equals_fsdp2_doing_the_same(world, request):
    # recurse=False: only the root's group (norm, head) accumulates unreduced; the blocks reduce every backward
    assert_same_as_fsdp2(request.getfixturevalue(world), "unsynced-root")


def test_no_reduce_scatter_runs_in_an_unsynchronised_backward(two):
    for result in each_rank(two, "collectives_unsynced"):
        assert result["switched_off"] == ["", "blocks.0", "blocks.1", "blocks.2"]  # the root's name is ""
        assert [c["reduce-scatter"] for c in result["counts"]] == [0, 0, 4]
        assert [c["all-gather"] for c in result["counts"]] == [8, 8, 8]  # gathered as ever: forward and backward


def test_the_ledger_counts_the_whole_gradients_an_unsynchronised_backward_keeps(two):
    # between unsynchronised backwards each rank holds every whole gradient (FSDP2's unsharded .grad); after
    # the synchronised one, its shard of the sum only
    for result in each_rank(two, "collectives_unsynced"):
        assert result["gradient_bytes"] == [result["whole_bytes"]] * 2 + [result["shard_bytes"]]


def test_recurse_false_switches_off_sync_in_the_root_group_only(two):
    for result in each_rank(two, "collectives_unsynced_root"):
        assert result["switched_off"] == [""]  # the root's group: its own parameters (norm, head)
        assert [c["reduce-scatter"] for c in result["counts"]] == [3, 3, 4]


def test_the_sharded_module_is_an_instance_of_its_own_class_with_fsdp2s_methods(two):
    # FSDP2 (_fsdp_init.py, _apply_to_module): the class becomes FSDP<cls>, a subclass of (FSDPModule, cls)
    for result in each_rank(two, "collectives_unsynced"):
        assert (result["class"], result["is_net"], result["block_class"]) == ("FSDPNet", True, "FSDPBlock")


def test_sharded_modules_are_fsdp_modules_and_a_sliced_container_its_own_class_as_fsdp2s(two):
    # FSDP2 (_fully_shard.py): FSDP<cls> derives from FSDPModule, which code that drives FSDP2 tests for (Lightning
    # Fabric's no_backward_sync: tests/test_frameworks.py); FSDPModule.__new__ makes a container's slice of cls
    for result in each_rank(two, "as_fsdp_modules"):
        assert result["minidp"] == result["fsdp2"] == {"root": True, "blocks": True, "slice": ("Sequential", False, True)}


def test_fsdp_module_methods_minidp_does_not_run_are_refused_by_name(two):
    for result in each_rank(two, "as_fsdp_modules"):
        assert result["refused"].startswith("set_custom_all_gather is FSDP2's own"), result["refused"]
        assert "Use torch.distributed.fsdp.fully_shard for it" in result["refused"]


@needs_fsdp2s_comm_buffer_setters
def test_fsdp2s_default_comm_buffer_settings_are_taken_and_train_as_fsdp2(two):
    """FSDP2's defaults (``_fsdp_param_group.py``: ``reduce_scatter_max_input_buffers = 1``, ``DefaultAllGather`` and
    ``DefaultReduceScatter`` unless ``set_allocate_memory_from_process_group(True)``) are what minidp does, so
    ``set_reduce_scatter_max_input_buffers(1)`` and ``set_allocate_memory_from_process_group_for_comm(False)``, set
    on every sharded module before every step, change nothing: training stays bitwise FSDP2's with the same calls."""
    assert_trains_as_fsdp2(two, "fsdp2s_default_comm_buffers")


@needs_fsdp2s_comm_buffer_setters
def test_comm_buffer_settings_beyond_fsdp2s_defaults_are_refused_by_name_and_bad_values_as_fsdp2(two):
    """More reduce-scatter buffers, or the process group's allocator, are FSDP2's own: refused by name. A bool or a
    count below 1 raise FSDP2's TypeError and ValueError (``_fully_shard.py``,
    ``FSDPModule.set_reduce_scatter_max_input_buffers``)."""
    for result in each_rank(two, "comm_buffers_beyond_the_defaults"):
        for call in ("max_input_buffers=2", "allocate=True"):
            kind, message = result["minidp"][call]
            assert kind == "NotImplementedError" and "is FSDP2's own" in message, call
            assert message.startswith(("set_reduce_scatter_max_input_buffers", "set_allocate_memory_from_process_group_"
                                       "for_comm")), message
        for call in ("max_input_buffers=True", "max_input_buffers=0"):
            assert result["minidp"][call] == result["fsdp2"][call], call


def test_unshard_leaves_the_whole_parameters_on_the_module_and_reshard_the_shards_as_fsdp2(two):
    # FSDP2: _fully_shard.py, FSDPModule.unshard and FSDPModule.reshard (not recursive)
    for rows, result in zip([15, 14], each_rank(two, "unshard_and_reshard")):  # torch.chunk of 29 rows over 2
        assert result["minidp"] == result["fsdp2"]
        assert result["minidp"] == {"unsharded": (29, 29), "equal": True, "resharded": (rows, 29)}


def test_deepcopy_is_refused_before_and_after_training_as_fsdp2_refuses_it(two):
    # FSDP2's classes define __deepcopy__ to raise (_fully_shard.py, _unimplemented_deepcopy): after a backward the
    # whole parameters' storage is freed, and copying it would read freed memory (a crash, before minidp refused)
    for result in each_rank(two, "deepcopies"):
        assert result["fsdp2"] == ["AssertionError: FSDP does not support deepcopy. Please use state dict for "
                                   "serialization."] * 2
        # FSDP2's words first (code written for FSDP2 matches them), then what to do instead
        assert len(result["minidp"]) == 2 and all(
            outcome.startswith("AssertionError: FSDP does not support deepcopy. Please use state dict for "
                               "serialization: ") for outcome in result["minidp"])


def test_a_weight_tied_inside_one_group_is_gathered_once_and_reduced_once_as_fsdp2(two):
    assert_same_as_fsdp2(two, "tied")


def test_each_rank_keeps_its_torch_chunk_rows_padded_to_chunk_0(three):
    # Net's head bias has 2 rows: torch.chunk(bias, 3) gives two chunks of 1, rank 2 none
    shapes = [result["shard_shapes"] for result in each_rank(three, "float32-sgd-reshard")]
    assert [s[0] for s in shapes] == [(5,), (5,), (3,)]  # LayerNorm(13): 5, 5, 3
    assert [s[-1] for s in shapes] == [(1,), (1,), (0,)]


class _Group:
    """What FSDP2's divide-factor rule reads of a process group: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("factor", [None, "world size", 3.0, 0.5])
@pytest.mark.parametrize("force_sum", [False, True])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_gradients_are_divided_before_during_and_after_the_reduction_as_fsdp2_divides_them(dtype, world_size, factor,
                                                                                          force_sum, replicas):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    factor = float(world_size) if factor == "world size" else factor
    hsdp = None if replicas == 1 else _Group(replicas)
    before, after, reduce_op, all_reduce_op = _get_gradient_divide_factors(
        _Group(world_size), hsdp, dtype, "cpu", factor, force_sum)
    ours_before, ours_scale, ours_op, ours_all_reduce_op, ours_after = division(
        dtype, world_size, factor, force_sum, replicas)
    assert (ours_before, ours_after) == tuple(None if d in (None, 1) else d for d in (before, after))  # 1: skipped
    if hsdp is not None:
        assert ours_all_reduce_op == all_reduce_op
    if isinstance(reduce_op, type(dist.ReduceOp.SUM)):
        assert (ours_scale, ours_op) == (None, reduce_op)
    else:  # FSDP2's PREMUL_SUM(1 / factor): here the same product before a SUM
        assert (ours_scale, ours_op) == (1 / factor, dist.ReduceOp.SUM)


# ---- mixed precision: FSDP2's MixedPrecisionPolicy --------------------------------------------------
# FSDP2: _fsdp_api.py (MixedPrecisionPolicy), _fsdp_param.py (init_dtype_attrs: a dtype that needs no cast is
# None; the all-gather inputs cast to param_dtype; to_accumulated_grad_if_needed), _fsdp_collectives.py
# (foreach_reduce: the reduce-scatter in reduce_dtype, then the shards' gradients in the original dtype),
# _fsdp_state.py (_cast_forward_inputs, _cast_output_dtype).


@pytest.mark.parametrize("policy", sorted(checks.POLICIES))
@pytest.mark.parametrize("sync", ["", "-unsynced"])
def test_training_with_a_mixed_precision_policy_equals_fsdp2_with_it(two, policy, sync):
    # "-unsynced": 3 backwards a step, the first two without the reduce-scatter: with a reduce dtype other than
    # the compute dtype, the whole gradients are summed in the reduce dtype, as FSDP2 sums them
    assert_same_as_fsdp2(two, f"policy-{policy}{sync}")


def test_a_group_whose_member_raised_in_its_forward_is_freed_at_once_and_trains_on_as_fsdp2(two):
    # FSDP2 registers a group's post-forward hooks with always_call=True (_fsdp_state.py,
    # _register_group_forward_hooks): the pass closes, and the gathered parameters are freed, even when a member's
    # forward raised; minidp's kept them registered whole until the next forward
    for result in each_rank(two, "grouped_forward_failure"):
        assert result["after_failure"]["minidp"] == result["after_failure"]["fsdp2"]
        assert result["differences"] == [None] * 4


def test_a_policys_casts_reach_into_the_containers_fsdp2s_reach_into_and_no_others(two):
    # FSDP2 casts inputs and outputs with torch's _apply_to_tensors: into dicts (a dict subclass comes back a plain
    # dict), OrderedDicts, sets, not into a UserDict (Hugging Face's BatchFeature) nor a PackedSequence; a UserDict
    # cast where FSDP2 leaves it trained on other numbers
    for seen in each_rank(two, "casts_containers"):
        for container, outcome in seen.items():
            assert outcome["minidp"] == outcome["fsdp2"], container
        assert seen["UserDict"]["minidp"]["forward saw"] == [("UserDict", [("x", "torch.float32")])]
        assert seen["defaultdict"]["minidp"]["returned"] == ("dict", [("x", "torch.float64")])


@pytest.mark.parametrize("name", ["bf16-reduce-fp32-unsynced", "reduce-bf16"])
def test_training_with_a_mixed_precision_policy_equals_fsdp2_on_three_processes(three, name):
    assert_same_as_fsdp2(three, f"policy-{name}")


# ---- FSDPModule's setters: the same training as FSDP2 with the same setting, and what each changes ------------
# FSDP2: _fully_shard.py, FSDPModule.set_* (each sets an attribute of the module's FSDPParamGroup or of the state
# its root shares), read by _fsdp_param_group.py (pre_forward, pre_backward, post_backward, _prefetch_unshard,
# unshard) and _fsdp_state.py (_pre_forward, _pre_backward, _root_post_backward_final_callback); and
# _fsdp_collectives.py, _get_gradient_divide_factors, for the divide factor and the forced SUM.


@pytest.mark.parametrize("name", sorted(CONFIGURED))
def test_training_with_each_fsdp2_setter_equals_fsdp2_with_the_same_setting(two, name):
    assert_same_as_fsdp2(two, f"configured-{name}")


@pytest.mark.parametrize("name", ["keep_between_micro_batches", "divide_by_three", "divide_by_three-float32"])
def test_training_with_fsdp2_setters_equals_fsdp2_on_three_processes(three, name):
    assert_same_as_fsdp2(three, f"configured-{name}")


def _forward_gathers(timeline: list[dict]) -> list[str]:
    """The groups gathered during the forward: all-gathers launched before the root's forward ended."""
    end = _spans(timeline, "forward", "")[0]["end"]
    return [e["group"] for e in timeline if e["stage"] == "all-gather" and e["start"] < end]


def test_by_default_the_root_keeps_its_parameters_from_the_forward_to_the_backward_as_fsdp2(two):
    # FSDP2 (_fsdp_state.py, _lazy_init): reshard_after_forward=None is True, but False on the root
    assert_same_as_fsdp2(two, "root-kept")
    for result in each_rank(two, "collectives-root-kept"):
        timeline = result["timelines"][0]
        assert len(_spans(timeline, "all-gather", "")) == 1
        assert [len(_spans(timeline, "all-gather", f"blocks.{i}")) for i in range(3)] == [2, 2, 2]


def test_parameters_kept_after_the_backward_are_not_gathered_again_by_the_next_forward(two):
    # set_reshard_after_backward(False) in the first two micro-batches of three, sync and the final wait in the last
    for result in each_rank(two, "collectives-kept-between"):
        first, second, last = result["timelines"]
        assert _forward_gathers(first) == ["", "blocks.0", "blocks.1", "blocks.2"]  # resharded by the last step
        assert _forward_gathers(second) == _forward_gathers(last) == []
        assert [len(_spans(t, "reduce-scatter", "")) for t in (first, second, last)] == [0, 0, 1]


def test_parameters_kept_after_a_reduced_backward_are_what_the_next_forward_uses(two):
    # FSDP2 alike: a forward after such a backward gathers nothing, so an optimizer step in between would not be
    # seen; hence set it back to True before the backward that precedes a step (the micro-batches above)
    for result in each_rank(two, "collectives-kept-after-backward"):
        timeline = result["timelines"][0]
        assert _forward_gathers(timeline) == []
        assert len([e for e in timeline if e["stage"] == "reduce-scatter"]) == 4


def test_a_forward_prefetch_starts_the_next_modules_all_gather_before_this_ones_forward(two):
    for timeline in [r["timelines"][0] for r in each_rank(two, "collectives-forward-prefetch")]:
        for current, following in [("", "blocks.0"), ("blocks.0", "blocks.1"), ("blocks.1", "blocks.2")]:
            launched = _spans(timeline, "all-gather", following)[0]["start"]
            assert launched < _spans(timeline, "forward", current)[0]["start"]


def test_a_backward_prefetch_list_replaces_the_default_and_may_start_two_at_once(two):
    # the root prefetches blocks 2 and 1: blocks 1's all-gather starts before blocks 2's backward, where by default
    # blocks 2's backward starts it (test_in_the_backward_the_previous_groups_all_gather_is_launched_...)
    for timeline in [r["timelines"][0] for r in each_rank(two, "collectives-backward-prefetch")]:
        launched = _spans(timeline, "all-gather", "blocks.1")[1]["start"]  # [0] is the forward's
        assert launched < _spans(timeline, "backward", "blocks.2")[0]["start"]


def test_a_module_not_unsharded_in_backward_is_gathered_for_the_forward_only_and_still_reduced(two):
    for timeline in [r["timelines"][0] for r in each_rank(two, "collectives-embedding")]:
        assert len(_spans(timeline, "all-gather", "embed")) == 1
        assert len(_spans(timeline, "reduce-scatter", "embed")) == 1
        assert len(_spans(timeline, "all-gather", "")) == 2  # the root (here resharded after forward) as ever


def test_unshard_async_op_returns_an_fsdp2_unshard_handle_whose_wait_puts_the_whole_parameters_on(two):
    for result in each_rank(two, "handles"):
        assert result["minidp"]["is_handle"] and result["fsdp2"]["is_handle"]
        assert result["minidp"]["whole"] == result["fsdp2"]["whole"] == (29, 13)


def test_setters_refuse_a_module_not_sharded_and_a_non_bool_as_fsdp2(two):
    for result in each_rank(two, "handles"):
        assert result["minidp"]["not_bool"] == result["fsdp2"]["not_bool"]
        assert result["minidp"]["refused"].startswith("Expects a module fully_shard was applied to, got a Linear")
        assert result["fsdp2"]["refused"].startswith("Expects FSDPModule but got")


def test_a_divide_factor_fsdp2_would_premultiply_on_nccl_is_premultiplied_here_and_summed(two):
    # float32, factor 3 on 2 ranks: FSDP2 asks for PREMUL_SUM(1/3), which Gloo refuses; minidp multiplies each
    # rank's gradient by 1/3 and sums, compared with that sum computed from the ranks' whole gradients
    for result in each_rank(two, "premultiplied"):
        assert result["equal"]
        assert result["fsdp2"] == "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"


@pytest.mark.skipif(not checks.FSDP2_REDUCES_UNUSED,
                    reason="this torch's FSDP2 has no set_reduce_scatter_unused_params to compare with")
def test_parameters_one_rank_did_not_use_are_reduced_as_zeros_as_fsdp2(two):
    # FSDP2: FSDPModule.set_reduce_scatter_unused_params; _fsdp_param_group.py, post_backward (unsharded_zero_grad_data).
    # Rank 0 uses the left head, rank 1 the right one: every rank reduce-scatters both, zeros for the one it left.
    assert_same_as_fsdp2(two, "unused-params")


@pytest.mark.skipif(not checks.FSDP2_RESETS, reason="this torch's FSDP2 has no reset_iter_state to compare with")
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_after_a_failure_midway_reset_iter_state_lets_training_go_on_as_fsdp2(two, where):
    # FSDP2: FSDPModule.reset_iter_state; the failed step is skipped by both, the next ones compared
    for result in each_rank(two, f"recover-{where}"):
        assert result["raised"] == ["planted", "planted"]
        assert result["differences"] == [None] * 3


# ---- ignored parameters, and forward methods other than forward ---------------------------------------------
# FSDP2: fully_shard's ignored_params (_fsdp_init.py, _get_managed_states); register_fsdp_forward_method
# (_fully_shard.py: the method wrapped in the module's pre- and post-forward).


@pytest.mark.parametrize("world", ["two", "three"])
def test_ignored_parameters_stay_whole_and_unreduced_on_every_rank_as_fsdp2(world, request):
    # the head's weight and bias: not sharded, each rank's own gradient, each rank's own optimizer step
    assert_same_as_fsdp2(request.getfixturevalue(world), "ignored-head")
    for result in each_rank(request.getfixturevalue(world), "ignored-head"):
        assert result["shard_shapes"][-2:] == [(2, 7), (2,)]


@pytest.mark.parametrize("case", ["grouped-reshard", "grouped-keep", "grouped-default", "grouped-accumulate"])
def test_modules_sharded_as_one_group_by_one_call_train_as_fsdp2(two, case):
    """FSDP2's ``fully_shard([norm, head])`` (_fsdp_state.py, _register_group_forward_hooks): one group for the
    root's first and last layers, gathered before the first runs and freed after the last."""
    assert_same_as_fsdp2(two, case)


@pytest.mark.skipif(not checks.FSDP2_COMPLETES_PARTIAL_GROUPS,
                    reason="FSDP2 before torch 2.13 reduced wrong gradients here: no reference to train beside")
@pytest.mark.parametrize("reshard", ["reshard", "keep"])
def test_a_forward_that_skips_the_head_of_a_group_then_chunks_through_it_trains_as_fsdp2(two, reshard):
    """The chunked loss (FSDP2 in torch 2.13, _fsdp_state.py: _force_complete_incomplete_states completes the group
    at the root's post-forward; each standalone call of the head gathers it again and registers its own
    post-backward, so its gradients are reduced once per chunk and summed in the shards)."""
    assert_same_as_fsdp2(two, f"chunked-loss-{reshard}")


def test_modules_sharded_as_one_group_train_as_fsdp2_on_three_processes(three):
    assert_same_as_fsdp2(three, "grouped-reshard")


def test_a_registered_forward_method_gathers_the_parameters_and_trains_as_fsdp2(two):
    for result in each_rank(two, "forward_method"):
        assert result["unregistered"] == "RuntimeError"  # the shards: wrong shapes for the method's matrix product
        assert result["differences"] == [None] * 3
        assert result["missing"] == "Net does not have a method generate"


@pytest.mark.parametrize("when", ["every_step", "first"])
def test_a_registered_method_that_calls_forward_frees_the_root_after_it_as_fsdp2(two, when):
    # FSDP2 (_fsdp_param_group.py, reshard and post_forward): the inner forward's end leaves the forward state, so the
    # registered method's end frees the root whatever reshard_after_forward says. Kept gathered, the root's next forward
    # ran the copy gathered before the optimizer's step, and an optimizer built after it got the whole parameters
    # (a Hugging Face generate for logged samples, or as a check before the optimizer).
    for result in each_rank(two, f"generate_{when}"):
        assert result == {"differences": [None] * 3, "shards_after_generate": [True] * 3}


def test_a_sharded_module_returning_a_view_is_warned_of_in_fsdp2s_words(two):
    # FSDP2 in torch 2.13 (_fsdp_state.py, _register_pre_backward_hook): an in-place op on such an output drops the hook
    # that gathers the parameters for the backward. minidp's hook is alike, and so is its warning (older FSDP2 has none).
    for result in each_rank(two, "view_output_warnings"):
        assert len(result["minidp"]) == 1 and "FSDP2-wrapped module (FSDP_ReturnsAView) returned a view" in result["minidp"][0]
        assert result["fsdp2"] in ([], result["minidp"])


# ---- FSDP2's mesh (1-D and HSDP's 2-D), shard_placement_fn and offload policy ---------------------------
# FSDP2: _fully_shard.py (fully_shard's mesh, shard_placement_fn, offload_policy); _fsdp_init.py (_get_mesh_info:
# 1-D shards, 2-D replicates over dimension 0 and shards over dimension 1); _fsdp_collectives.py (foreach_reduce:
# the reduce-scatter over the shard group, then the all-reduce over the replicate group, or its sum kept while
# all_reduce_grads is False; a Shard(dim > 0) gradient's chunks concatenated along dim 0 first).


def test_a_one_dimensional_mesh_shards_over_its_ranks_as_fsdp2(two):
    assert_trains_as_fsdp2(two, "mesh-1d")


@pytest.mark.parametrize("check", sorted(name for name in FOUR_PROCESSES if name.startswith("hsdp")
                                          and name != "hsdp-all_reduce_the_last"))
def test_hsdp_on_a_two_by_two_mesh_trains_as_fsdp2s_hsdp(four, check):
    # float32: AVG in the reduce-scatter and in the all-reduce; float64: / 2 before both sums, / 2 after
    assert_trains_as_fsdp2(four, check)


@pytest.mark.parametrize("shape", ["1x2", "2x1"])
def test_hsdp_with_one_replica_or_one_shard_trains_as_fsdp2(two, shape):
    # 1 x 2: the all-reduce over one rank; 2 x 1: no reduce-scatter, each rank holding every parameter whole
    assert_trains_as_fsdp2(two, f"hsdp-{shape}")


def test_hsdp_without_the_all_reduce_sums_the_reduced_shards_then_all_reduces_them_once_as_fsdp2(four):
    # set_requires_all_reduce(False) for 2 of 3 micro-batches: each reduce-scattered, their sum all-reduced in the last
    assert_trains_as_fsdp2(four, "hsdp-all_reduce_the_last")


@pytest.mark.parametrize("world", ["two", "three"])
def test_a_shard_placement_fn_cuts_matrices_along_their_columns_as_fsdp2(world, request):
    results = request.getfixturevalue(world)
    assert_trains_as_fsdp2(results, "placement")
    columns = 30 // {"two": 2, "three": 3}[world]
    for result in each_rank(results, "placement"):
        assert {(30, columns), (7, columns)} <= set(result["shard_shapes"])  # the head's 7 columns: cut by rows


def test_column_shards_kept_whole_between_unsynchronised_backwards_train_as_fsdp2(two):
    assert_trains_as_fsdp2(two, "placement-unsynced-keep")


def test_cpu_offload_of_a_module_on_the_cpu_trains_as_fsdp2_with_it(two):
    assert_trains_as_fsdp2(two, "offload")


def test_fully_shard_takes_every_keyword_fsdp2s_takes_with_its_default():
    # code written for FSDP2 passes its keywords (torch 2.13's fully_shard: dp_mesh_dims=None among them)
    ours, theirs = (inspect.signature(f).parameters for f in (fully_shard, torch.distributed.fsdp.fully_shard))
    assert set(theirs) <= set(ours)
    assert all(ours[name].default == theirs[name].default for name in theirs if name != "module"), theirs


@pytest.mark.parametrize("case,error", [
    # FSDP2's words in each message, and its type, where code written for FSDP2 matches them (upstream's own tests do)
    ("uneven_columns", "NotImplementedError: fully_shard: parameter 'blocks.0.linear.weight' (29, 13) cannot be cut "
                       "evenly along dim 1 among 2 ranks: FSDP does not support uneven sharding on dim 1"),
    ("a_dimension_too_far", "AssertionError: fully_shard: shard_placement_fn returned Shard(dim=2) for parameter "
                            "'norm.weight': Shard dim 2 is invalid for 1D tensor: (13,)"),
    ("not_a_shard", "NotImplementedError: fully_shard: shard_placement_fn returned 'Replicate()' for parameter"),
    ("three_dimensions", "ValueError: fully_shard expects a 1D or 2D DeviceMesh"),
    ("mesh_and_group", "ValueError: fully_shard got both mesh and process_group"),
    ("hsdp_without_names", "AssertionError: Please init the 2D mesh for HSDP with mesh_dim_names specified"),
    ("pinned_offload", "RuntimeError: fully_shard: CPUOffloadPolicy(pin_memory=True)"),
    ("non_contiguous", "NotImplementedError: fully_shard: parameter 'head.weight' is not contiguous (stride (1, 2)): "
                       "FSDP does not support non-contiguous parameters"),
    # FSDP2 takes any mp_policy and fails at the first forward ("'NoneType' object has no attribute 'param_dtype'")
    ("mp_policy_none", "TypeError: fully_shard: mp_policy must be a MixedPrecisionPolicy (torch.distributed.fsdp), "
                       "got NoneType"),
    # FSDP2 takes a dtype given by name and fails at the first forward ("Invalid device string: 'bfloat16'"); minidp
    # failed inside fully_shard ("'str' object has no attribute 'itemsize'"), the parameters already replaced by shards
    ("mp_policy_dtype_a_string", "TypeError: fully_shard: mp_policy.param_dtype must be a torch.dtype or None, got "
                                 "'bfloat16' of type str"),
    # FSDP2 (torch 2.13) shards parameters that are DTensors of an SPMD mesh already along the dimensions named
    ("dp_mesh_dims", "NotImplementedError: fully_shard(dp_mesh_dims=...): minidp shards plain parameters"),
])
def test_arguments_beyond_what_is_supported_are_refused_before_anything_is_sharded(two, case, error):
    if case == "pinned_offload" and torch.accelerator.is_available():
        pytest.skip("pinned memory is there to be had on a machine with an accelerator")
    for result in each_rank(two, "refusals"):
        assert result[case]["error"].startswith(error), result[case]["error"]
        assert result[case]["untouched"]


@pytest.mark.parametrize("case", ["meta", "meta-tied"])
def test_a_model_built_on_the_meta_device_sharded_materialised_and_loaded_trains_as_fsdp2(two, case):
    # the way large models are built (FSDP2: FSDPModule._apply, FSDPParam.reset_sharded_param): fully_shard on the
    # meta device, to_empty(device="cpu") registers new parameters, a full state dict gives them their weights
    assert_trains_as_fsdp2(two, case)


def test_a_model_on_the_meta_device_takes_a_cpu_mesh_and_its_forward_before_to_empty_is_refused_as_fsdp2(two):
    # FSDP2 shards meta parameters over a mesh of any device (to_empty puts them there later), and at the first
    # forward refuses those still on meta, by their names under the root; minidp refused the mesh, then failed deep
    # inside the all-gather ("Tensor on device meta is not on the expected device cpu!")
    for result in each_rank(two, "on_the_meta_device"):
        assert result["sharded"] == ("no error", "")
        kind, message = result["forward"]
        assert kind == "RuntimeError"
        assert message.startswith("FSDP parameters should be materialized from meta device before training, but the "
                                  "following were still on meta device: ['norm.weight', 'norm.bias', 'head.weight', 'head.bias']"), message


def test_a_sharded_state_dict_loaded_with_assign_becomes_the_shards_at_once_and_keeps_a_tie(two):
    # load_state_dict(assign=True) registers what minidp's pre-hook makes of each DTensor: it must be a leaf (the
    # local rows of an nn.Parameter(DTensor) were a view in its graph: "Cannot assign non-leaf Tensor"), the group's
    # shard before any forward (an optimizer built now, its state dict, clipping: all read the group), and a tied
    # weight's two keys must not leave it untied
    for result in each_rank(two, "loaded_with_assign"):
        assert result["error"] == ("no error", ""), result["error"]
        assert result["shards"] and result["tied"] and all(result["rows"]), result


@pytest.mark.parametrize("case", ["meta", "meta-tied"])
def test_the_state_dict_after_to_empty_lives_on_the_new_device_as_fsdp2s(two, case):
    # before any forward: a checkpoint is loaded into it (dcp.load into get_model_state_dict(model)); on the meta
    # device it would take nothing
    for result in each_rank(two, case):
        ours, theirs = result["devices_after_to_empty"]
        assert ours == theirs == ["cpu"]


@pytest.mark.parametrize("world,check", [("two", "clip-2"), ("two", "clip-1"), ("two", "clip-inf"), ("three", "clip-2"),
                                         ("three", "clip-3"), ("four", "clip-2"), ("four", "clip-inf")])
def test_clipping_the_gradient_norm_of_the_shards_clips_as_fsdp2_clips_its_dtensors(world, check, request):
    # torch.nn.utils.clip_grad_norm_ on FSDP2's DTensor gradients reduces the stack of their norms over the ranks in
    # one collective; on plain shards it would see this rank's rows only: minidp.distributed.clip_grad_norm_ reduces
    # the same stack (four: HSDP, over the ranks that shard); the same total norm, clipped gradients and parameters
    # after the step, bit for bit (three too: Gloo sums the same stack in the same order)
    for result in each_rank(request.getfixturevalue(world), check):
        for step in result["steps"]:
            assert step["ours"] > 0.5  # clipped: the gradients' norm is above the max norm
            assert step["ours"] == step["theirs"]
            assert step["gradients"] == 0.0 and step["parameters"] == 0.0


@pytest.mark.parametrize("check", ["clip-minus-inf", "clip-0"])
def test_the_smallest_entry_and_the_count_of_nonzero_entries_clip_as_fsdp2(two, check):
    # DTensor's norm reduces -inf over the ranks by their smallest and 0 by the sum of their counts (then torch's
    # clip_grad_norm_ takes the same order over the parameters' norms): the same norm, gradients and parameters
    for result in each_rank(two, check):
        for step in result["steps"]:
            assert step["ours"] == step["theirs"]
            assert step["gradients"] == 0.0 and step["parameters"] == 0.0


def test_clipping_parameters_left_whole_beside_shards_is_refused_as_fsdp2_refuses_it(two):
    # ignored_params keep gradients each rank made alone: counted into the total norm, every rank took another norm and
    # clipped its rows of the shards by another factor, silently; FSDP2's DTensor norm refuses to mix them
    for result in each_rank(two, "clip-whole-beside-sharded"):
        assert "got mixed torch.Tensor and DTensor" in result["fsdp2"]
        assert "2 of the 4 parameters with gradients were not sharded" in result["minidp"]
        assert "clip them apart" in result["minidp"] and result["untouched"]


def test_clipping_gradients_of_two_dtypes_takes_fsdp2s_norm_bit_for_bit(two):
    # torch's clip_grad_norm_ on FSDP2's DTensors buckets the norms by dtype and stacks them (float32 promoted to
    # float64), and DTensor reduces that stack over the ranks before its norm: a float32 norm reduced in float32, or
    # the norms taken in the parameters' order, round otherwise (about 1e-8 relative apart)
    for result in each_rank(two, "clip-two-dtypes"):
        for step in result["steps"]:
            assert step["ours"] > 0.5
            assert step["ours"] == step["theirs"]
            assert step["gradients"] == 0.0 and step["parameters"] == 0.0


def test_a_sharded_parameter_used_outside_a_forward_is_refused_when_its_gradient_arrives(two):
    # FSDP2 refuses it as its DTensor meets plain tensors ("aten.mul.Tensor got mixed torch.Tensor and DTensor"); on
    # minidp's plain rows the penalty would be of this rank's rows only, silently: the backward raises instead, naming
    # the parameter, before an optimizer could step on that gradient
    for result in each_rank(two, "used_outside_forward"):
        assert "got mixed torch.Tensor and DTensor" in result["fsdp2"]
        assert result["minidp"].startswith("fully_shard: parameter 'Linear.weight' was used outside a forward of the "
                                           "module that holds it")


def test_a_sub_module_run_outside_its_groups_forward_is_refused_before_it_runs_on_the_rows(two):
    # A method of the sharded root other than forward (CLIP's get_text_features, an encode), not registered with
    # register_fsdp_forward_method: FSDP2 refuses it at the first operator ("got mixed torch.Tensor and DTensor"); on
    # minidp's plain rows the embedding looked its ids up in this rank's rows, and rank 1 encoded wrongly, silently.
    # Refused before the embedding runs, on every rank, naming the module, its group and the ways out
    for result in each_rank(two, "method_other_than_forward"):
        assert "got mixed torch.Tensor and DTensor" in result["fsdp2"]
        assert result["minidp"].startswith("fully_shard: Embedding runs its forward while its sharded parameters are "
                                           "this rank's rows only: its group, the _TwoEntries, gathers them")
        assert "register_fsdp_forward_method" in result["minidp"]


def test_parameters_that_are_already_dtensors_are_refused_at_the_call_naming_them_before_anything_changes(two):
    """FSDP2 takes DTensor parameters (``_fsdp_param.py``, ``FSDPParam._init_sharding_spec_tp``: tensor parallelism
    on another mesh dimension, its 2-D recipe) or refuses them at the call; minidp shards plain tensors only, and
    used to cut them and fail at the first forward. Now refused at the call, on every rank alike, the model as it
    was, naming the parameter under the module and the way out."""
    results = each_rank(two, "dtensor_parameters")
    for case, name in (("tensor_parallel", "blocks.0.linear.weight"), ("replicated", "head.weight")):
        errors = [result[f"{case}-minidp"]["error"] for result in results]
        assert all(kind == "NotImplementedError" for kind, _ in errors), errors
        # the same error on every rank (a note after it names the rank)
        assert len({message.splitlines()[0] for _, message in errors}) == 1, errors
        message = errors[0][1]
        assert message.startswith(f"fully_shard(Net): parameter '{name}' is already a DTensor"), message
        assert "use torch's fully_shard (torch.distributed.fsdp.fully_shard)" in message
        assert all(result[f"{case}-minidp"]["untouched"] for result in results), case
    assert all(result["tensor_parallel-fsdp2"]["error"] == ("no error", "") for result in results)  # its 2-D recipe


def test_state_dict_keep_vars_gives_parameters_as_fsdp2s_dtensor_parameters(two):
    """FSDP2 registers ``nn.Parameter(DTensor)`` shards (``_fsdp_param.py``, ``FSDPParam._init_sharded_param``) and
    leaves ``state_dict(keep_vars=True)`` to ``nn.Module._save_to_state_dict``, which gives the registered parameters
    and buffers themselves. minidp's entries are ``nn.Parameter(DTensor)`` too, with the parameter's
    ``requires_grad`` (so that filtering the trainable ones works alike), but not the registered objects: minidp
    registers plain rows (README, "Parameters"). Buffers are the registered ones in both."""
    for result in each_rank(two, "state_dict_kept_vars"):
        assert result["minidp"]["entries"] == result["fsdp2"]["entries"]
        assert result["minidp"]["entries"]["norm.weight"] == ("DTensor", True, False, "(Shard(dim=0),)")
        assert result["minidp"]["buffer_itself"] and result["fsdp2"]["buffer_itself"]
        assert result["fsdp2"]["parameters_themselves"] and not result["minidp"]["parameters_themselves"]


def test_a_sparse_embedding_is_refused_at_the_call_where_fsdp2_fails_in_the_backward(two):
    """A sparse gradient cannot be laid out for the reduce-scatter: FSDP2 takes the call and fails at the backward
    (``_fsdp_collectives.py``, ``foreach_reduce``: ``fsdp::chunk_cat`` has no sparse kernel), naming nothing; minidp
    refuses at the call, the model as it was, naming the embedding and the ways out."""
    for result in each_rank(two, "sparse_embedding"):
        assert result["fsdp2_call"] == ("no error", "")
        assert result["fsdp2_backward"][0] == "NotImplementedError" and "chunk_cat" in result["fsdp2_backward"][1]
        kind, message = result["minidp"]
        assert kind == "NotImplementedError"
        assert message.startswith("fully_shard(Embedded): 'embed' is an Embedding with sparse=True"), message
        assert "sparse=False" in message and "ignored_params" in message
        assert result["untouched"]


def test_a_frozen_sparse_embedding_makes_no_gradient_and_is_taken_as_fsdp2_takes_it(two):
    """A frozen weight has no gradient to reduce-scatter (FSDP2's ``foreach_reduce`` takes those that have one), so
    ``sparse=True`` changes nothing there: sharded and trained as FSDP2 would."""
    for result in each_rank(two, "sparse_embedding"):
        assert result["frozen"] == {"minidp": ("no error", ""), "fsdp2": ("no error", "")}


def test_a_parameter_frozen_or_unfrozen_between_steps_trains_as_fsdp2(two):
    # FSDP2 copies each shard's requires_grad onto the whole parameter at every all-gather (_fsdp_param.py,
    # to_unsharded: set_requires_grad_if_needed): a weight frozen after the first step gets no gradient, one frozen
    # from the start and thawed gets its gradients, as in FSDP2, at every step
    for differences in each_rank(two, "frozen_midway"):
        assert differences == [None] * 4


def test_a_sub_module_sharded_after_its_parent_is_refused_before_its_shards_are_cut_again(two):
    # FSDP2 refuses this order too (sub-modules first, the root last), with an internal assertion; minidp names the
    # parameter and the order to follow
    for result in each_rank(two, "child_after_parent"):
        assert result["error"].startswith("ValueError: fully_shard(Block): parameter 'linear.weight' is already a shard")
        assert result["untouched"]


def test_a_model_refused_on_one_rank_only_is_refused_on_every_rank(two):
    # README: ranks that build different models get the same error on every rank; one that only this rank can see
    # (a scalar parameter) is told to the others, whose first collective would otherwise wait for it in vain
    refused = each_rank(two, "refused_on_one_rank")
    assert refused[1].startswith("fully_shard: parameter 'head.bias' is a scalar")
    assert "Change head.bias to a 1D tensor with numel equal to 1." in refused[1]  # FSDP2's words
    assert refused[0].startswith("fully_shard(Net) failed on rank 1: fully_shard: parameter 'head.bias' is a scalar")


def test_only_a_sharded_grad_scaler_sees_an_inf_in_another_ranks_rows(two):
    # FSDP2's plain GradScaler finds an inf in any rank's shard because DTensor all-reduces its check of DTensor
    # gradients (upstream's test_fully_shard_grad_scaler.py); on plain rows it sees this rank's only, and the ranks
    # would disagree on skipping the step. torch's ShardedGradScaler all-reduces the check: the scaler to use.
    plain, sharded = zip(*[(rank["plain"], rank["sharded"]) for rank in each_rank(two, "loss_scalers")])
    assert plain == (False, True)
    assert sharded == (True, True)


def test_the_deprecated_name_of_the_divide_factor_setter_warns_and_sets_it_as_fsdp2s(two):
    # FSDP2: _fully_shard.py, set_reduce_scatter_divide_factor (@deprecated: "Use `set_gradient_divide_factor` instead")
    for result in each_rank(two, "divide_factor_by_its_old_name"):
        assert result["warnings"] == [("DeprecationWarning", "Use `set_gradient_divide_factor` instead")]
        assert result["factor"] == 3.0


def test_an_all_reduce_hook_on_another_stream_is_refused_with_the_way_out(two):
    for result in each_rank(two, "divide_factor_by_its_old_name"):
        assert "minidp runs the hook on the current stream; leave stream unset" in result["stream_error"]


def test_an_optimizer_step_in_a_shards_post_accumulate_grad_hook_trains_as_fsdp2(two):
    # FSDP2 (_fsdp_collectives.py, foreach_reduce) runs each shard's post-accumulate-grad hooks once its reduced
    # gradient is set: the pattern that fuses the optimizer step into the backward
    for result in each_rank(two, "optimizer_in_backward"):
        assert result["differences"] == [None] * 3
        assert result["calls"] == 3 * result["parameters"]
        assert result["gradients_left"] == 0


# ---- the full state dict -------------------------------------------------------------------------


@pytest.mark.parametrize("world", ["two", "three"])
def test_full_state_dict_equals_fsdp2_full_tensors_on_every_rank(world, request):
    for name, _ in _against_fsdp2_plan().items():
        assert all(r["state_dict_equal"] for r in each_rank(request.getfixturevalue(world), name)), name


@pytest.mark.parametrize("world", ["two", "three", "four"])
def test_the_state_dict_holds_each_ranks_rows_as_dtensors_laid_out_as_fsdp2s(world, request):
    # FSDP2 registers DTensor parameters, so its state_dict() holds DTensors; minidp's holds its plain rows as such
    results = request.getfixturevalue(world)
    names = [name for name, (check, _) in {"two": TWO_PROCESSES, "three": THREE_PROCESSES, "four": FOUR_PROCESSES}[
        world].items() if check is checks.against_fsdp2]
    for name in names:
        for rank, result in enumerate(each_rank(results, name)):
            assert result["state_dicts_alike"] is None, f"{name}, rank {rank}: {result['state_dicts_alike']}"


@pytest.mark.parametrize("world", ["two", "four"])
def test_a_checkpoint_of_the_state_dict_saved_and_loaded_by_torch_distributed_checkpoint_keeps_every_row(world,
                                                                                                        request):
    # torch.distributed.checkpoint saves each rank's part of a DTensor (plain rows would pass for replicated
    # tensors there: rank 0's alone would be kept); "four": HSDP's 2 x 2 mesh
    for result in each_rank(request.getfixturevalue(world), "checkpoint"):
        assert result["reloaded"] and result["gathered_by_dcp"] and result["across_layouts"]


# ---- torch.compile ---------------------------------------------------------------------------------------------
# FSDP2 keeps its hooks out of dynamo's graphs (torch/distributed/fsdp/_fully_shard/_fsdp_common.py, _dynamo_disable)


def test_a_compiled_sharded_model_trains_as_the_eager_one(two):
    for rank, result in enumerate(each_rank(two, "compiled")):
        assert result["largest_loss_difference"] < 1e-5, f"rank {rank}: {result}"


def test_under_torch_compile_the_hooks_run_eagerly_and_are_never_traced(two):
    for rank, result in enumerate(each_rank(two, "compiled")):
        assert result["traced"] == [], f"rank {rank}: dynamo compiled {result['traced']}"


def test_under_torch_compile_a_sharded_model_makes_as_many_graphs_as_fsdp2s(two):
    # a hook dynamo inlines leaves no compiled code of its own, but its guards: the check of a sub-module's forward
    # outside its group's, on the sub-modules at all times, made 4 graphs where FSDP2 makes 1; it is in place only
    # while the group is not gathered now, so the forward meets none
    for graphs in each_rank(two, "compiled_graphs"):
        assert graphs["minidp"] == graphs["fsdp2"], graphs


# ---- the optimizer's state dict ------------------------------------------------------------------
# FSDP2's optimizer state is DTensors, built from its DTensor parameters; minidp's optimizer steps plain rows and gives
# them as those DTensors in its state dict (minidp/distributed/sharded_optimizer_state.py). "four": HSDP's 2 x 2 mesh.


@pytest.mark.parametrize("world", ["two", "three", "four"])
def test_the_optimizers_state_dict_holds_each_ranks_rows_as_dtensors_laid_out_as_fsdp2s(world, request):
    for rank, result in enumerate(each_rank(request.getfixturevalue(world), "optimizer_checkpoint")):
        assert result["alike"] is None, f"rank {rank}: {result['alike']}"


@pytest.mark.parametrize("world", ["two", "three", "four"])
def test_the_optimizers_full_state_dict_equals_fsdp2s_whole_tensors_on_every_rank(world, request):
    # plain rows would come back as they are, each rank's own passing for the whole tensor
    assert all(r["whole_equal"] for r in each_rank(request.getfixturevalue(world), "optimizer_checkpoint"))


@pytest.mark.parametrize("world", ["two", "three", "four"])
def test_an_optimizer_checkpoint_of_either_library_resumes_training_bitwise_in_either(world, request):
    # torch.distributed.checkpoint would keep rank 0's plain rows alone, and every rank would resume from them
    for rank, result in enumerate(each_rank(request.getfixturevalue(world), "optimizer_checkpoint")):
        assert result["resumed"] == dict.fromkeys(result["resumed"]) and len(result["resumed"]) == 4, (
            f"rank {rank}: {result['resumed']}")


def test_an_optimizer_that_makes_its_state_when_built_resumes_from_a_checkpoint_as_fsdp2s(two):
    # Adagrad's `sum` exists before its first step, so get_state_dict does not step it: read as the target dcp.load
    # fills, its state was each rank's plain rows, and the whole tensors saved did not fit them (a size mismatch);
    # every optimizer gets its state dict hooks as it is built (minidp/distributed/sharded_optimizer_state.py)
    for rank, result in enumerate(each_rank(two, "optimizer_checkpoint_adagrad")):
        assert result["alike"] is None and result["whole_equal"], f"rank {rank}: {result['alike']}"
        assert result["resumed"] == dict.fromkeys(result["resumed"]) and len(result["resumed"]) == 4, (
            f"rank {rank}: {result['resumed']}")
        assert result["whole_loaded"] is None and result["loaded_before_a_step"] is None


@pytest.mark.parametrize("world", ["two", "three", "four"])
def test_fsdp2s_whole_optimizer_state_dict_loads_into_the_shards(world, request):
    for rank, result in enumerate(each_rank(request.getfixturevalue(world), "optimizer_checkpoint")):
        assert result["whole_loaded"] is None, f"rank {rank}: {result['whole_loaded']}"


def test_an_optimizer_state_dict_loaded_before_the_first_step_becomes_rows_again(two):
    # a resumed job loads before it steps: the DTensors torch.save kept become this rank's rows at the first step
    for rank, result in enumerate(each_rank(two, "optimizer_checkpoint")):
        assert result["loaded_before_a_step"] is None, f"rank {rank}: {result['loaded_before_a_step']}"



def test_optimizer_state_not_shaped_like_the_parameter_stays_plain_in_the_state_dict_as_fsdp2s(two):
    # a per-column statistic of a matrix's own making (as Adafactor's factored moments are not shaped like it) is no
    # rows of the parameter: FSDP2's optimizer keeps it plain, and so must the state dict; the momentum beside it is
    # FSDP2's DTensor
    for rank, result in enumerate(each_rank(two, "optimizer_state_unlike_the_parameter")):
        assert result["alike"] is None, f"rank {rank}: {result['alike']}"
        assert result["column_scale"] == ["Tensor", "Tensor"], f"rank {rank}"


def test_rows_cut_from_a_loaded_whole_optimizer_state_are_contiguous_and_hold_their_own_bytes(two):
    # a view would keep the whole tensor alive, and be strided where a matrix is cut along dim 1 (shard_placement_fn)
    for rank, result in enumerate(each_rank(two, "whole_optimizer_state_loaded_by_hand")):
        assert result["not_owned"] == [], f"rank {rank}: {result['not_owned']}"


def test_changing_a_loaded_whole_optimizer_state_dict_in_place_leaves_the_optimizer_as_fsdp2s(two):
    # the rows are copies: the next step is bitwise FSDP2's, which never saw the change
    for rank, result in enumerate(each_rank(two, "whole_optimizer_state_loaded_by_hand")):
        assert result["resumed"] is None, f"rank {rank}: {result['resumed']}"


def test_shards_added_by_add_param_group_after_a_step_are_dtensors_in_the_state_dict_as_fsdp2s(two):
    # the optimizer held no shard at its first step (the ignored head only): the step pre-hook must look again when
    # its parameters change in number, or the added shards' state stays plain rows in its state dict
    for rank, result in enumerate(each_rank(two, "param_group_added_after_a_step")):
        assert result["differences"] == [None, None], f"rank {rank}: {result['differences']}"
        assert result["alike"] is None, f"rank {rank}: {result['alike']}"


@pytest.mark.parametrize("case,rows", [("plain rows", 4), ("dtensor", 7)])
def test_a_state_dict_of_another_size_is_refused_in_fsdp2s_words_before_anything_is_loaded(two, case, rows):
    # FSDP2's parameters are DTensors of the whole shape: torch's load_state_dict reports "size mismatch", naming that
    # shape, after loading what fits (a DTensor; a plain tensor it cannot copy into a DTensor at all). minidp's shards
    # are plain rows: a tensor the size of a rank's rows was loaded as them. Now refused on every rank in FSDP2's
    # words, before any layer is loaded.
    mismatches = [f"size mismatch for 1.{name}: copying a param with shape torch.Size([{rows}{rest}]) from checkpoint, "
                  f"the shape in current model is torch.Size([8{rest}])." for name, rest in (("weight", ", 6"), ("bias", ""))]
    for result in each_rank(two, "loaded_with_wrong_shapes"):
        ours, theirs = result[f"minidp {case}"], result[f"fsdp2 {case}"]
        assert all(mismatch in theirs["error"] for mismatch in mismatches)
        assert ours["error"] == ("Error(s) in loading state_dict for FSDPSequential:\n\t" + "\n\t".join(mismatches)
                                 + "\n\t(nothing was loaded into the sharded parameters)")
        assert not ours["first_changed"]
        assert theirs["first_changed"] == (case == "dtensor")


# Layouts whose state-dict keys are not the modules' paths: an activation checkpoint's wrapper leaves its
# "_checkpoint_wrapped_module." out (checkpoint_wrapper.py, _post_state_dict_hook), and puts it back before a load
# reaches it (_pre_load_state_dict_hook); a module at several paths has a key at each.
LAYOUTS = ["blocks_wrapped", "root_wrapped", "nested_wrapped", "shared_block"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_full_state_dict_of_every_layout_equals_fsdp2s_whole_tensors(two, layout):
    # found by the modules' paths, the wrapped blocks' keys, and all but the last path of a shared block, came back
    # as each rank's rows, with no error
    assert all(result["full_equal"] for result in each_rank(two, f"state_dicts_{layout}"))


@pytest.mark.parametrize("layout,misshapen", [("blocks_wrapped", "blocks.1.linear.weight"),
                                              ("root_wrapped", "_checkpoint_wrapped_module.head.weight"),
                                              ("nested_wrapped", "_checkpoint_wrapped_module.blocks.1.linear.weight"),
                                              ("shared_block", "layers.1.linear.weight")])
def test_a_misshapen_state_dict_of_every_layout_loads_nothing(two, layout, misshapen):
    for result in each_rank(two, f"state_dicts_{layout}"):
        kind, message = result["misshapen_error"]
        assert kind == "RuntimeError" and f"size mismatch for {misshapen}" in message, message
        assert message.endswith("(nothing was loaded into the sharded parameters)")
        assert not result["loaded_anything"]


def test_a_full_state_dict_without_the_frozen_parameters_loads_with_strict_false_and_trains_as_fsdp2(two):
    # get_model_state_dict(..., ignore_frozen_params=True) saves no frozen parameter; set_model_state_dict(...,
    # full_state_dict=True, strict=False) puts back what named_parameters() gives for each missing key: FSDP2's DTensor,
    # minidp's shard itself (this rank's rows), which the refusal of one rank's rows passed as a whole weight refused
    # ("size mismatch for blocks.1.linear.bias"). Loaded as FSDP2 loads it (the frozen parameters and a missing buffer
    # keep their values), then two steps bitwise FSDP2's.
    assert_same_as_fsdp2(two, "partial_full_state_dict_loaded")
    for rank, result in enumerate(each_rank(two, "partial_full_state_dict_loaded")):
        assert result["missing"] == ["blocks.1.linear.bias", "head.bias", "norm.running_mean"], f"rank {rank}"
        assert result["errors"] == {"ours": ("no error", ""), "theirs": ("no error", "")}, f"rank {rank}"
        assert result["returned"]["ours"] == result["returned"]["theirs"], f"rank {rank}"
        assert result["saved_keys_alike"] and result["loaded_as_saved"], f"rank {rank}"
        assert result["alike_after_load"] is None and result["alike_after_training"] is None, f"rank {rank}"


def test_an_optimizer_that_reduces_over_whole_parameters_is_warned_of_once_and_an_elementwise_one_is_not(two):
    # minidp's shards are plain rows (README, "Parameters"): Adafactor's row and column means would be this rank's
    # rows' alone, silently; FSDP2's DTensor parameters refuse them (its Adafactor raises on a _NormPartial)
    for result in each_rank(two, "whole_parameter_optimizers"):
        assert len(result["Adafactor"]) == 1, result["Adafactor"]
        assert result["Adafactor"][0].startswith("torch.optim.Adafactor reduces over many elements of each parameter")
        assert result["AdamW"] == []


@pytest.mark.parametrize("world", ["two", "three"])
def test_a_full_state_dict_loads_back_into_the_shards(world, request):
    for name, _ in _against_fsdp2_plan().items():
        assert all(r["reloaded"] for r in each_rank(request.getfixturevalue(world), name)), name


# ---- seen: every rank's timeline and memory ----------------------------------------------------------


def _spans(timeline: list[dict], stage: str, group: str) -> list[dict]:
    return [e for e in timeline if e["stage"] == stage and e["group"] == group]


def test_every_group_is_gathered_in_forward_and_backward_and_reduced_once(two):
    # reshard_after_forward=True: FSDP2's pre_forward and pre_backward unshard, post_backward reduces
    for timeline in two[0]["timeline_and_memory"]["timelines"]:
        for group in ["", "blocks.0", "blocks.1", "blocks.2"]:
            counts = {stage: len(_spans(timeline, stage, group))
                      for stage in ("all-gather", "copy-out", "forward", "backward", "reduce-scatter")}
            assert counts == {"all-gather": 2, "copy-out": 2, "forward": 1, "backward": 1, "reduce-scatter": 1}, group


def test_in_the_backward_the_previous_groups_all_gather_is_launched_before_the_current_one_has_computed(two):
    # FSDP2's _backward_prefetch: the group before it in post-forward order
    for timeline in two[0]["timeline_and_memory"]["timelines"]:
        for current, previous in [("", "blocks.2"), ("blocks.2", "blocks.1"), ("blocks.1", "blocks.0")]:
            assert _spans(timeline, "all-gather", previous)[1]["start"] < _spans(timeline, "backward", current)[0]["end"]


def test_the_forward_gathers_one_group_at_a_time_as_fsdp2(two):
    for timeline in two[0]["timeline_and_memory"]["timelines"]:
        for current, following in [("blocks.0", "blocks.1"), ("blocks.1", "blocks.2")]:
            assert _spans(timeline, "all-gather", following)[0]["start"] > _spans(timeline, "forward", current)[0]["end"]


def test_timelines_merge_into_one_chrome_trace_with_collective_rows(two):
    events = chrome_trace(two[0]["timeline_and_memory"]["timelines"])["traceEvents"]
    rows = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert rows == {(rank, row) for rank in (0, 1) for row in ("forward and backward", "all-gathers", "reduce-scatters")}


def test_each_rank_holds_half_of_ddps_parameters_gradients_and_optimizer_state_between_steps(two):
    for result in each_rank(two, "timeline_and_memory"):
        ddp, sharded = result["ledgers"]["ddp"], result["ledgers"]["sharded"]
        for row in ("parameters", "gradients", "optimizer_state"):
            assert abs(sharded[row] / ddp[row] - 0.5) <= 0.005, row  # a padded or a short row per parameter
        assert sharded["gathered"] == sharded["buckets"] == 0
        assert ddp["buckets"] == ddp["gradients"]  # DDP's buckets: one more copy of the gradients
        assert sharded["total_peak"] < ddp["total_peak"]
        assert "optimizer_state" in result["table"]


# Linear(8, 5), tanh, Linear(5, 3) in float64 on 2 ranks (fsdp_checks._two_linears), each rank's padded rows (chunk 0's):
# group "0": weight 3 x 8 + bias 3 = 27 elements, 216 bytes; whole, 2 x 27 = 54 elements, 432 bytes;
# group "2": weight 2 x 5 + bias 2 = 12 elements, 96 bytes; whole, 24 elements, 192 bytes.
SHARD_BYTES = (3 * 8 + 3 + 2 * 5 + 2) * 8  # 312
WHOLE_0_BYTES = 2 * (3 * 8 + 3) * 8  # 432


def test_the_ledger_counts_the_shards_gradients_with_the_padding_their_storage_holds(observed):
    # each .grad is a view of its group's reduce-scatter output, this rank's padded slot: rank 1's real rows are
    # 192 bytes, its gradients' storage 312, as its parameters'
    for result in each_rank(observed, "observed"):
        ledger = result["8-5-3"]["ledger"]
        assert ledger["gradients"] == ledger["parameters"] == SHARD_BYTES


@pytest.mark.parametrize("case", ["8-5-3", "8-5-3-kept"])
def test_the_ledgers_transient_peak_holds_the_all_gather_buffer_the_parameters_are_copied_out_of(observed, case):
    # the peak: group "0" whole (432) while its all-gather's buffer (432) is still held, resharded after the
    # forward or not
    for result in each_rank(observed, "observed"):
        ledger = result[case]["ledger"]
        assert ledger["transient_peak"] == 2 * WHOLE_0_BYTES
        assert ledger["total_peak"] == 2 * SHARD_BYTES + 2 * WHOLE_0_BYTES  # parameters, gradients, no SGD state


def test_the_ledgers_transient_peak_holds_a_prefetched_all_gathers_buffer(observed):
    # Linear(4, 4), tanh, Linear(4, 4): each group 2 x 4 + 2 = 10 elements a rank (80 bytes), 160 bytes whole. The
    # peak is group "2"'s reduce-scatter (input 160, output 80) while group "0"'s prefetched all-gather holds its
    # buffer (160); a copy-out holds 160 + 160
    for result in each_rank(observed, "observed"):
        assert result["4-4-4"]["ledger"]["transient_peak"] == 160 + 80 + 160


def test_the_allocation_ledger_counts_gathered_parameters_as_parameters(observed):
    # measure_step: the shards (312) and, at most, group "0" whole (432): the groups are never whole at once
    for result in each_rank(observed, "observed"):
        assert result["8-5-3"]["held"]["parameters"] == SHARD_BYTES + WHOLE_0_BYTES


def test_forwards_under_inference_mode_before_any_training_run_as_fsdp2s(two):
    # an evaluation-only job: the gathered buffers are made under inference_mode, without the version counter the
    # refill of a later gather keeps; FSDP2 runs them, and both then refuse to train on those inference tensors (each
    # in its own words: torch's at its in-place refill, minidp's where autograd would save one)
    for result in each_rank(two, "evaluation_before_training"):
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(result["minidp"], result["torch"], strict=True))
        assert result["minidp training after"][0] == result["torch training after"][0] == "RuntimeError"


@pytest.mark.parametrize("ledger", ["held", "traced held"])
def test_the_allocation_ledger_counts_the_batch_alone_as_inputs_not_gloos_reduce_scatter_buffer(observed, ledger):
    # Gloo's reduce-scatter works in a buffer its own thread makes, the size of the group's padded gradient slots
    # (432 and 192 bytes here), which the calling thread's operators meet only in the wait: not held before the step
    for result in each_rank(observed, "observed"):
        assert result["8-5-3"][ledger]["inputs"] == 6 * 8 * 8  # the batch, (6, 8) in float64


@pytest.mark.parametrize("case", ["8-5-3", "8-5-3-kept"])
def test_the_sharded_timelines_root_backward_spans_every_groups_backward(observed, case):
    # group "0" (its input needs no gradient) ends with the root at the end of the whole backward
    for result in each_rank(observed, "observed"):
        backward = {e["group"]: e for e in result[case]["timeline"] if e["stage"] == "backward"}
        root = backward.pop("")
        assert sorted(backward) == ["0", "2"]
        for group, span in backward.items():
            assert root["start"] <= span["start"] and span["end"] <= root["end"], group


def test_the_ledger_counts_the_storage_the_gathered_parameters_hold_mid_forward(two):
    """Whole parameters exist only while their group is gathered: the ledger's count is their storage, then."""
    for result in each_rank(two, "timeline_and_memory"):
        assert result["gathered_mid_forward"]  # one record per forward of the sharded model
        for ledger, storage in result["gathered_mid_forward"]:
            assert ledger == storage > 0


def test_a_sharded_model_is_freed_once_dropped_as_fsdp2s(two):
    # A module-level registry of groups, keyed weakly by module, kept every sharded model alive: its value held the key.
    assert each_rank(two, "freed_once_dropped") == [{"minidp": False, "fsdp2": False}] * 2


# ---- bad input: the same clear error on every rank, never a hang ----------------------------------


def test_a_module_already_sharded_or_wrapped_is_refused_on_every_rank(two):
    for errors in each_rank(two, "already_wrapped"):
        # twice: AssertionError, as torch's contract() raises it ("can only be applied to a module once")
        assert errors["minidp"][0] == errors["fsdp2_twice"][0] == "AssertionError"
        assert errors["minidp"][1].startswith("Each distinct composable distributed API can only be applied to a "
                                              "module once: fully_shard was already applied to this Net")
        assert errors["fsdp2_twice"][1].startswith("Each distinct composable distributed API")
        assert "already wrapped (FSDPNet)" in errors["fsdp2"][1]  # torch's fully_shard swaps the class
        assert "already wrapped (DistributedDataParallel)" in errors["ddp"][1] and "pass the plain model" in errors["ddp"][1]


def test_a_container_without_forward_is_refused_in_fsdp2s_words(two):
    # FSDP2's ValueError and its words (_fsdp_init.py), which code written for FSDP2 may match
    words = "fully_shard does not support containers that do not implement forward"
    for errors in each_rank(two, "containers_without_forward"):
        for kind, error in errors.items():
            assert error["minidp"][0] == error["fsdp2"][0] == "ValueError"
            assert error["fsdp2"][1].startswith(words)
            assert error["minidp"][1].startswith(f"{words}: got a {kind}; shard its items one by one")


def test_fully_shard_state_is_one_per_call_as_fsdp2s(two):
    # torch's fully_shard.state(module) (its contract's lookup): None for a module fully_shard was not applied to, one
    # state per call, shared by the modules of fully_shard([norm, head])
    for result in each_rank(two, "states"):
        assert result["minidp"] == result["fsdp2"]
        assert result["minidp"] == {"": 0, "norm": 1, "blocks": None, "blocks.0": 2, "blocks.0.linear": None,
                                    "blocks.1": 3, "blocks.1.linear": None, "blocks.2": 4, "blocks.2.linear": None,
                                    "head": 1}


def test_a_parameter_shared_between_two_groups_is_refused_where_fsdp2_refuses_it(two):
    """FSDP2 refuses it from torch 2.12 on (``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``); 2.11's does not
    look, and minidp refuses it on every torch."""
    fsdp2_looks = torch.torch_version.TorchVersion(torch.__version__) >= "2.12"
    for errors in each_rank(two, "shared_between_groups"):
        assert "fully_shard(Linear): parameter 'weight' is also parameter 'weight' of the Linear" in errors["minidp"]
        assert "common parent" in errors["minidp"]
        if fsdp2_looks:
            assert "is shared with a parameter already managed by another FSDP group" in errors["fsdp2"]
        else:
            assert "fsdp2" not in errors


def test_an_int_reshard_after_forward_is_read_as_fsdp2_reads_it():
    # FSDP2 (_fsdp_init.py, _get_post_forward_mesh_info): a factor of the ranks that shard; all of them is True, 1 is
    # False with a warning; a group in between (FSDP2 reshards to it) is refused here, and nothing else is an int
    assert _resharding(4, 4) is True and _resharding(None, 4) is None and _resharding(False, 4) is False
    with pytest.warns(UserWarning, match="reshard_after_forward=1 \\(int\\) means resharding parameters to world size 1"):
        assert _resharding(1, 4) is False
    with pytest.raises(ValueError, match="it should be a factor of 4, not 3"):
        _resharding(3, 4)
    with pytest.raises(NotImplementedError, match="reshard_after_forward=2, resharding to groups of 2 of the 4 ranks"):
        _resharding(2, 4)
    with pytest.raises(ValueError, match="should be a bool or an int"):
        _resharding(2.0, 4)


def test_reshard_after_forward_1_with_one_rank_that_shards_is_false_with_a_warning_as_fsdp2():
    """FSDP2 (``_fsdp_init.py``, ``_get_post_forward_mesh_info``) tests an int for 1 before it tests it for the ranks
    that shard: where one rank shards (HSDP's (N, 1) mesh), 1 is both, and FSDP2 reads False and warns."""
    from types import SimpleNamespace

    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info

    one_rank = SimpleNamespace(shard_mesh_size=1)  # all that FSDP2 reads of its mesh info here
    fsdp2_reshards = _get_post_forward_mesh_info(1, one_rank) is not None  # None: the parameters are kept
    with pytest.warns(UserWarning, match="reshard_after_forward=1 \\(int\\) means resharding parameters"):
        assert _resharding(1, 1) is fsdp2_reshards is False


def test_a_list_of_modules_that_is_empty_or_names_one_twice_is_refused_before_anything_is_sharded():
    head = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="empty list of modules"):
        fully_shard([])
    with pytest.raises(ValueError, match="the same module twice"):
        fully_shard([head, head])
    assert not isinstance(head, ShardedModule) and head.weight.shape == (2, 3)


@pytest.mark.parametrize("frozen,policy", FROZEN_CASES)
def test_a_frozen_parameter_of_another_dtype_is_gathered_in_its_own_and_trains_as_fsdp2(two, frozen, policy):
    # FSDP2's all-gather carries inputs of several dtypes as their bytes in one uint8 buffer, each whole parameter
    # copied out in its own dtype (bf16's policy: a floating-point one in bf16, an integer one as it is)
    check = _frozen_name(frozen, policy)
    assert_trains_as_fsdp2(two, check)
    for rank, result in enumerate(each_rank(two, check)):
        assert result["losses_equal"] and result["state_dicts_alike"] is None, f"rank {rank}"


def test_parameters_of_two_dtypes_that_get_gradients_are_refused_where_fsdp2_refuses_them(two):
    # one reduce-scatter buffer carries a group's gradients: FSDP2 takes the call and refuses at the first forward
    # (its lazy init) or, for one unfrozen since, at the backward, with AssertionError; minidp alike, naming them
    for result in each_rank(two, "gradients_of_two_dtypes"):
        assert result["fsdp2"]["forward"][0] == result["fsdp2"]["backward"][0] == "AssertionError"
        assert "FSDP expects uniform original parameter dtype" in result["fsdp2"]["forward"][1]
        assert "FSDP reduce-scatter expects uniform gradient dtype" in result["fsdp2"]["backward"][1]
        for when in ("forward", "backward"):
            kind, message = result["minidp"][when]
            assert kind == "AssertionError", when
            assert "must share one dtype" in message, when
            assert "torch.float32 for 'norm.weight', 'norm.bias', 'head.weight', 'head.bias'" in message, when
            assert "torch.float64 for 'gain'" in message and "requires_grad_(False)" in message, when
        assert result["recovered"]


def test_ranks_with_different_models_raise_the_same_error_naming_the_parameter(two):
    messages = each_rank(two, "mismatched_model")
    assert messages[0] == messages[1]
    assert "parameter 0 ('linear.weight') has shape (30, 13) on rank 1 and (29, 13) on rank 0" in messages[0]


def test_ranks_that_shard_different_submodules_raise_the_same_error_naming_both(two):
    # FSDP2 takes it: the root's all-gathers pair layer 2 on rank 0 with layer 0 on rank 1, silently wrong losses
    messages = each_rank(two, "other_layer_per_rank")
    assert messages[0] == messages[1]
    assert "parameter 0 is '0.weight' on rank 1 and '2.weight' on rank 0" in messages[0]


def test_an_mp_policy_that_differs_between_ranks_raises_the_same_error_naming_the_field(two):
    # FSDP2: the all-gathers differ in size and Gloo aborts the process
    messages = each_rank(two, "mp_policy_per_rank")
    assert messages[0] == messages[1]
    assert "mp_policy.param_dtype is None on rank 1 and torch.bfloat16 on rank 0" in messages[0]
    assert "pass the same reshard_after_forward and mp_policy to this fully_shard call on every rank" in messages[0]


def test_a_reshard_after_forward_that_differs_between_ranks_raises_the_same_error(two):
    # FSDP2: one rank all-gathers again in the backward, the other does not, and both hang
    messages = each_rank(two, "reshard_after_forward_per_rank")
    assert messages[0] == messages[1]
    assert "reshard_after_forward is False on rank 1 and True on rank 0" in messages[0]


def test_a_rank_that_raises_mid_step_ends_the_job_with_its_error():
    # process-group timeout 300 s > job_timeout 90 s: only ending the job on the error passes
    with pytest.raises(RankFailed, match="rank 1 raised:(.|\n)*planted failure in step 2 on rank 1") as failure:
        launch(checks.raise_in_step_2, 2, (1,), timeout=300, job_timeout=90)
    assert failure.value.rank == 1
    assert multiprocessing.active_children() == []


def test_a_rank_that_raises_mid_step_under_torchrun_ends_the_job_with_its_error():
    # rank 0 is then blocked in an all-gather; Gloo sees rank 1's connection close and raises. torchrun lists every
    # rank that failed, and names as root cause the failure of the earliest time, in whole seconds: rank 1's, or rank
    # 0's where both fall in one second (seen on a loaded machine)
    done = torchrun("-m", "tests.fsdp_checks", "1")
    assert done.returncode != 0
    assert "RuntimeError: planted failure in step 2 on rank 1" in done.stdout
    report = done.stdout[done.stdout.index("Failures:"):]  # the other failures, then the root cause
    assert "rank      : 1" in report


# ---- the demo ----------------------------------------------------------------------------------


def test_demo_shard_trains_and_prints_the_steps_and_both_ledgers(tmp_path, capfd):
    argv = ["demo", "--processes", "2", "--device", "cpu", "--shard", "--samples", "200", "--epochs", "1", "--batch-size", "40",
            "--trace", str(tmp_path)]
    assert main(argv) == 0
    out = capfd.readouterr().out  # printed by rank 0, a process of its own
    assert "classifier.1.weight    (10, 1568)       -> (5, 1568)" in out  # step 1: rank 0's rows
    for stage in ("all-gather", "copy-out", "forward", "backward", "reduce-scatter"):
        assert f"classifier.1   {stage}" in out
    ledger = out.split("memory per rank")[1]
    parameters = next(line for line in ledger.splitlines() if line.startswith("parameters")).split()
    assert parameters[-1] == "0.50"  # fully_shard / DDP
    assert (tmp_path / "fsdp_timeline.json").stat().st_size > 0


@pytest.mark.parametrize("argv,message", [
    (["--shard"], "--shard needs --processes N"),
    (["--shard", "--processes", "2", "--replicas", "2"], "--shard and --replicas: choose one"),
])
def test_demo_shard_refuses_what_it_cannot_do(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["demo", *argv])


LAST_WORDS = "loaded the full state dict back into the shards"  # examples/fsdp_train.py's last line


def test_torchrun_example_trains_sharded_and_loads_its_full_state_dict_back(tmp_path):
    done = torchrun("examples/fsdp_train.py", "--epochs", "1", "--samples", "200", "--width", "64",
                    "--save", str(tmp_path / "full.pt"))
    assert_ended_well(done, LAST_WORDS)
    assert "rank 0's shards: [(32, 784), (32,)" in done.stdout  # 64 rows over 2 ranks
    assert "epoch 1/1: train loss" in done.stdout and "loaded the full state dict back" in done.stdout
    saved = torch.load(tmp_path / "full.pt")
    assert saved["1.0.weight"].shape == (64, 784)  # whole, as the model was built


def test_the_torchrun_example_resumed_from_its_checkpoint_ends_as_a_run_that_never_stopped(tmp_path):
    # torch.distributed.checkpoint of the model and AdamW's state after epoch 1, loaded by a new job that trains epoch
    # 2: its final weights are those of one job that trained both epochs, bit for bit
    example = ("examples/fsdp_train.py", "--samples", "200", "--width", "64")
    checkpoint = str(tmp_path / "checkpoint")
    runs = [torchrun(*example, "--epochs", "2", "--save", str(tmp_path / "straight.pt")),
            torchrun(*example, "--epochs", "1", "--checkpoint", checkpoint),
            torchrun(*example, "--epochs", "2", "--checkpoint", checkpoint, "--save", str(tmp_path / "resumed.pt"))]
    for done in runs:
        assert_ended_well(done, LAST_WORDS)
    assert "resumed from" in runs[2].stdout and "epoch 1/2" not in runs[2].stdout
    straight, resumed = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)


def test_the_examples_checkpoint_converts_to_one_file_of_whole_tensors_without_processes(tmp_path):
    # torch.distributed.checkpoint.format_utils.dcp_to_torch_save reads every rank's rows back into whole tensors, in
    # this process alone: the model equals the full state dict the job saved, AdamW's moments are whole too
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = str(tmp_path / "checkpoint")
    done = torchrun("examples/fsdp_train.py", "--epochs", "1", "--samples", "200", "--width", "64",
                    "--checkpoint", checkpoint, "--save", str(tmp_path / "full.pt"))
    assert_ended_well(done, LAST_WORDS)
    dcp_to_torch_save(checkpoint, tmp_path / "converted.pt")
    converted, full = torch.load(tmp_path / "converted.pt", weights_only=False), torch.load(tmp_path / "full.pt")
    assert converted["model"].keys() == full.keys()
    assert all(torch.equal(converted["model"][key], full[key]) for key in full)
    assert converted["optimizer"]["state"]["1.0.weight"]["exp_avg"].shape == (64, 784)


_DESTROYED_GROUP = """
import gc, socket, weakref, torch, torch.distributed as dist
from torch import nn
from minidp.distributed import fully_shard
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
model(torch.randn(3, 4)).sum().backward()
group = weakref.ref(dist.group.WORLD)
gc.disable()  # only reference counting may free the group: a sharded model is a cycle, which waits for the collector
dist.destroy_process_group()
print("group freed:", group() is None)
try:
    model(torch.randn(3, 4))
except RuntimeError as error:
    print("then:", error)
"""


def test_destroy_process_group_frees_the_group_while_a_sharded_model_lives():
    """torch.distributed frees a group at destroy_process_group() (distributed_c10d.py), and with it Gloo's worker
    threads; a sharded model that held it would keep them running into the interpreter's shutdown, where freeing
    the last collective's tensors aborts the process. The model then says what happened if it is used again."""
    done = fresh_python("-c", _DESTROYED_GROUP, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "group freed: True" in done.stdout
    assert "then: the process group that Sequential was sharded over is destroyed" in done.stdout
