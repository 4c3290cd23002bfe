"""minidp.distributed.ZeroRedundancyOptimizer against torch's, in real Gloo processes on 127.0.0.1.

Each test reads one result of a job: the processes are started once per world size
(``minidp.distributed.launch``, bounded by ``job_timeout``, every process ended by it), run all the
checks of ``zero_checks`` on fresh seeds, and send back plain facts. "Equal" is bitwise
(``torch.equal``). The stock behaviour cited is torch 2.13's
``torch/distributed/optim/zero_redundancy_optimizer.py`` (ZRO below).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from . import ddp_checks
from . import zero_checks as checks
from .helpers import each_rank, job_fixture
from .helpers import assert_no_differences as assert_same_as_torch
from minidp.distributed import RankFailed, ZeroRedundancyOptimizer, launch
from minidp.distributed.zero import partition


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """These checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


JOB_TIMEOUT = 300.0  # seconds for a whole job; the process group's own timeout is launch()'s 60 s

TRAINING = {
    f"{dtype}_{optimizer}_{wrapper}": (checks.against_torch, {"dtype": getattr(torch, dtype), "optimizer": optimizer, "wrapper": wrapper})
    for dtype in ("float32", "float64") for optimizer in ("sgd", "adamw") for wrapper in ("minidp", "torch")
}

TWO_PROCESSES = {
    **TRAINING,
    "bucket_view_sgd": (checks.against_torch, {"optimizer": "sgd", "parameters_as_bucket_view": True}),
    "bucket_view_adamw": (checks.against_torch, {"optimizer": "adamw", "parameters_as_bucket_view": True, "wrapper": "torch"}),
    "bucket_view_unfrozen": (checks.unfrozen_under_bucket_view, {}),
    "add_param_group": (checks.add_param_group, {}),
    "add_param_group_after_lr_change": (checks.add_param_group, {"optimizer": "sgd", "lr_changed_first": True}),
    "closure": (checks.closure, {}),
    "checkpoint": (checks.checkpoint, {"to": 1}),
    "checkpoint_into_another_dtype": (checks.checkpoint_into_another_dtype, {}),
    "state_memory": (checks.state_memory, {}),
    "empty_everywhere": (checks.empty_params, {"ranks": (0, 1)}),
    "empty_on_rank_1": (checks.empty_params, {"ranks": (1,)}),
    "mismatched_shapes": (checks.mismatched_shapes, {}),
    "params_as_a_set": (checks.params_as_a_set, {}),
    "mismatched_groups": (checks.mismatched_groups, {}),
    "mixed_dtypes": (checks.mixed_dtypes, {}),
    "optimizer_class_per_rank": (checks.optimizer_class_per_rank, {}),
    "lr_per_rank": (checks.lr_per_rank, {}),
    "group_lr_per_rank": (checks.group_lr_per_rank, {}),
    "failing_step": (checks.failing_step, {"failing_rank": 1}),
    "error_in_the_step_everywhere": (checks.error_in_the_step_everywhere, {}),
    "add_param_group_refused": (checks.add_param_group_refused_on_one_rank, {}),
    "alone_under_join": (checks.alone_under_join, {}),
    "step_hooks_under_join": (checks.step_hooks_under_join, {}),
    "alone_under_join_empty_first_group": (checks.alone_under_join, {"empty_first_group": True}),
    "no_state": (checks.malformed_state_dict, {"malformed": "no state"}),
    "state_index_past_the_end": (checks.malformed_state_dict, {"malformed": "index past the end"}),
}

THREE_PROCESSES = {
    **TRAINING,
    "bucket_view_adamw": (checks.against_torch, {"optimizer": "adamw", "parameters_as_bucket_view": True}),
    "add_param_group": (checks.add_param_group, {}),
    "checkpoint": (checks.checkpoint, {"to": 2}),
    "state_memory": (checks.state_memory, {}),
    "failing_step": (checks.failing_step, {"failing_rank": 2}),
    "alone_under_join": (checks.alone_under_join, {}),
    "subgroup_without_rank_0": (checks.subgroup_without_rank_0, {}),
}


two = job_fixture("two", ddp_checks.run_checks, 2, TWO_PROCESSES, JOB_TIMEOUT)
three = job_fixture("three", ddp_checks.run_checks, 3, THREE_PROCESSES, JOB_TIMEOUT)


# ---- step 1: the partition ------------------------------------------------------------------------


def test_partition_deals_largest_first_to_the_rank_with_fewest_elements(generator):
    # ZRO lines 689-697: sorted by numel, largest first; each to _get_min_index(sizes), the lowest
    # rank among those with the fewest elements; the totals carry over from group to group
    sizes = [int(n) for n in torch.randint(1, 50, (9,), generator=generator)]
    tensors = [torch.empty(n) for n in sizes]
    groups = [tensors[:5], tensors[5:]]
    shares = partition(groups, 3)
    totals = [0, 0, 0]
    for g, group in enumerate(groups):
        for t in sorted(group, key=lambda t: t.numel(), reverse=True):
            owner = next(r for r in range(3) if any(x is t for x in shares[r][g]))
            assert totals[owner] == min(totals)
            assert all(totals[r] > totals[owner] for r in range(owner))
            totals[owner] += t.numel()
    assert sorted(id(t) for share in shares for group in share for t in group) == sorted(map(id, tensors))


@pytest.mark.parametrize("check", list(TRAINING))
def test_partition_equals_torchs(two, three, check):
    for results in (two, three):
        for result in each_rank(results, check):
            assert result["partition"] == result["torch_partition"]


# ---- steps 2 and 3: bitwise equal to torch's ZeroRedundancyOptimizer --------------------------------


@pytest.mark.parametrize("check", list(TRAINING))
def test_parameters_state_and_settings_equal_torch_after_every_step_two_processes(two, check):
    # every parameter on every rank, this rank's local optimizer state (ZRO's self.optim), and the
    # groups' settings as a StepLR schedule changes them, after each of 4 steps
    assert_same_as_torch(two, check)


@pytest.mark.parametrize("check", list(TRAINING))
def test_parameters_state_and_settings_equal_torch_after_every_step_three_processes(three, check):
    assert_same_as_torch(three, check)


@pytest.mark.parametrize("check", ["bucket_view_sgd", "bucket_view_adamw"])
def test_parameters_as_bucket_view_equals_torch_and_keeps_each_share_in_one_bucket(two, three, check):
    # ZRO _build_param_buckets (lines 1317-1376): each rank's share, per device, in one flat tensor
    for results in (two, three) if check in THREE_PROCESSES else (two,):
        assert_same_as_torch(results, check)
        assert all(result["in_owners_bucket"] for result in each_rank(results, check))


def test_a_parameter_unfrozen_under_bucket_view_joins_its_owners_bucket_and_is_broadcast_as_torchs(two):
    # ZRO step: when the trainable mask changed, the buckets are rebuilt (_build_param_buckets); a weight frozen at
    # construction and unfrozen later is updated by its owner and must reach the other ranks
    assert_same_as_torch(two, "bucket_view_unfrozen")


def test_add_param_group_deals_out_the_new_group_as_torch_does(two, three):
    # ZRO add_param_group (lines 467-511): the new group's parameters partitioned after the others'
    for results in (two, three):
        assert_same_as_torch(results, "add_param_group")
        for result in each_rank(results, "add_param_group"):
            assert result["partitions"][0] == result["partitions"][1]


def test_add_param_group_keeps_the_settings_changed_since_the_last_step_as_torch_does(two):
    # ZRO add_param_group leaves the existing groups' settings alone; they reach the local optimizer at the next step.
    # minidp copied the local optimizer's settings of the last step back over them: a scheduler's cut lr was undone.
    assert_same_as_torch(two, "add_param_group_after_lr_change")


def test_step_with_a_closure_returns_its_loss_and_equals_torch(two):
    # ZRO step (lines 1124-1153): the closure is handed to the local optimizer's step
    assert_same_as_torch(two, "closure")
    for result in each_rank(two, "closure"):
        assert all(ours == theirs for ours, theirs in result["losses"])


def test_a_process_group_without_global_rank_0_trains_and_consolidates_as_torchs(three):
    # ZRO step and consolidate_state_dict: each share is broadcast from its owner's global rank, and the state dicts
    # meet on the group's rank ``to``, not the global rank of that number
    assert_same_as_torch(three, "subgroup_without_rank_0")
    assert [result["same_state_dict"] for result in each_rank(three, "subgroup_without_rank_0")] == [None, True, None]


# ---- checkpoints ------------------------------------------------------------------------------------


def test_consolidated_state_dict_equals_torchs_on_the_target_rank(two, three):
    for results, to in ((two, 1), (three, 2)):
        result = each_rank(results, "checkpoint")[to]
        assert result["same_state_dict"]
        assert result["entries"] == 6  # every parameter has AdamW state after two steps


def test_state_dict_elsewhere_raises_torchs_error(two, three):
    # ZRO state_dict (lines 1243-1248)
    for results, to in ((two, 1), (three, 2)):
        for rank, result in enumerate(each_rank(results, "checkpoint")):
            if rank != to:
                assert result["not_consolidated"].startswith("Optimizer state has not been consolidated on this rank")
                assert f"consolidate_state_dict(to={rank})" in result["not_consolidated"]


def test_state_dicts_load_across_implementations_and_training_goes_on_identically(two, three):
    for results in (two, three):
        for result in each_rank(results, "checkpoint"):
            assert result["after_load"] is None
            assert result["differences"] == [None, None]


def test_a_state_dict_loads_in_its_own_dtype_as_torchs_does_into_parameters_of_another(two):
    # torch's ZeroRedundancyOptimizer.load_state_dict moves each value to its parameter's device, and casts nothing
    # (Optimizer.load_state_dict would cast it to the parameter's dtype): a float32 Adagrad sum stays float32
    for result in each_rank(two, "checkpoint_into_another_dtype"):
        assert result["dtypes"] == [{"torch.float32"}, {"torch.float32"}]
        assert result["differences"] == [None, None]


@pytest.mark.parametrize("check, error", [("no_state", "KeyError"), ("state_index_past_the_end", "IndexError")])
def test_a_malformed_state_dict_is_refused_with_torchs_error_before_anything_is_loaded(two, check, error):
    # ZRO load_state_dict reads state_dict["state"] and maps each index to its parameter before it loads anything:
    # KeyError, IndexError, lr and state untouched; minidp loaded the settings and emptied the state first
    for result in each_rank(two, check):
        assert result["minidp"][0] == result["torch"][0] == error
        assert result["minidp untouched"] and result["torch untouched"]


# ---- memory -----------------------------------------------------------------------------------------


def test_each_rank_holds_its_share_of_the_optimizer_state(two, three):
    for results in (two, three):
        world = len(results)
        memory = each_rank(results, "state_memory")
        plain = memory[0]["plain"]
        assert [m["minidp"] for m in memory] == [m["torch"] for m in memory]  # the same bytes as torch's, rank by rank
        assert sum(m["minidp"] for m in memory) == plain  # nothing held twice
        for m in memory:
            assert m["plain"] == plain
            assert m["minidp"] <= plain / world + m["largest_parameter"]  # the greedy partition's bound
            assert m["minidp"] < plain


# ---- bad input: an error on every rank, never a hang ---------------------------------------------


def test_empty_params_raise_torchs_error_on_every_rank(two):
    # ZRO line 1455
    for kind, message in each_rank(two, "empty_everywhere"):
        assert kind == "ValueError" and "ZeroRedundancyOptimizer got an empty parameter list" in message


def test_empty_params_on_one_rank_raise_on_every_rank_naming_it(two):
    (kind_0, message_0), (kind_1, message_1) = each_rank(two, "empty_on_rank_1")
    assert kind_0 == kind_1 == "ValueError"
    assert "construction failed on rank 1: ZeroRedundancyOptimizer got an empty parameter list" in message_0
    # the failing rank raises its own error, with a note naming it
    assert message_1.startswith(
        "ZeroRedundancyOptimizer got an empty parameter list\nZeroRedundancyOptimizer's construction failed on rank 1 (this rank)"
    )


def test_parameters_that_differ_between_ranks_are_named_on_every_rank(two):
    for kind, message in each_rank(two, "mismatched_shapes"):
        assert kind == "ValueError"
        assert "parameter 2 ('param_groups[0]['params'][2]') has shape (17, 24) on rank 1 and (16, 24) on rank 0" in message


def test_parameters_given_as_a_set_are_refused_on_every_rank_saying_to_give_a_list(two):
    # torch's ZRO takes a set (list(params), _verify_and_init_params), whose order differs between processes: two
    # parameters of one shape trade places between ranks unseen, as torch.optim refuses a set inside a group for
    for kind, message in each_rank(two, "params_as_a_set"):
        assert kind == "TypeError" and "`params` is a set" in message and "list(model.parameters())" in message


def test_parameter_groups_that_differ_between_ranks_are_named_on_every_rank(two):
    for kind, message in each_rank(two, "mismatched_groups"):
        assert kind == "ValueError" and "rank 1 has parameter groups of sizes [3, 3] and rank 0 [6]" in message


@pytest.mark.parametrize("job, named", [
    ("optimizer_class_per_rank", "optimizer_class is 'torch.optim.adam.Adam' on rank 1 and 'torch.optim.sgd.SGD' on rank 0"),
    ("lr_per_rank", "the optimizer's default lr is 0.5 on rank 1 and 0.1 on rank 0"),
    ("group_lr_per_rank", "param_groups[1]['lr'] is 0.2 on rank 1 and 0.05 on rank 0"),
])
def test_an_optimizer_setting_that_differs_between_ranks_is_named_on_every_rank(two, job, named):
    # torch's ZRO takes each: every rank updates its share by its own rule, a model no single configuration gives
    for kind, message in each_rank(two, job):
        assert kind == "ValueError" and named in message
        assert "pass the same optimizer_class and the same optimizer arguments on every rank" in message


def test_parameters_of_two_dtypes_raise_torchs_error(two):
    # ZRO lines 1496-1510
    for kind, message in each_rank(two, "mixed_dtypes"):
        assert kind == "ValueError"
        assert "same dense type for all parameters but got both torch.FloatTensor and torch.DoubleTensor" in message


def test_a_local_step_that_fails_on_one_rank_raises_on_every_rank_with_the_same_parameters_everywhere(two, three):
    # torch's ZRO: the failing rank leaves step() while the others wait in its broadcast (ZRO line 1151)
    for results, failing in ((two, 1), (three, 2)):
        for rank, result in enumerate(each_rank(results, "failing_step")):
            kind, message = result["error"]
            assert kind == "RuntimeError"
            if rank == failing:  # its own error, with a note naming the step
                assert message.startswith(f"planted failure in the second step on rank {failing}\n")
                assert f"(the local step) failed on rank {failing} (this rank)" in message
            else:
                assert f"(the local step) failed on rank {failing}: planted failure in the second step" in message
            assert "load the last checkpoint" in message
            assert result["same_parameters"]


def test_an_error_raised_inside_the_step_on_every_rank_is_raised_as_it_is_as_torch_does(two):
    """ZRO step (lines 1124-1153): the local optimizer's step(closure) raises straight through _local_step and step,
    so `except PlantedError` or `except torch.OutOfMemoryError` catches what the closure raised; minidp rebuilt it
    from its type's name among the built-ins, a RuntimeError for both."""
    for result in each_rank(two, "error_in_the_step_everywhere"):
        for planted in ("PlantedError", "OutOfMemoryError"):
            assert result[f"{planted} minidp"] == result[f"{planted} torch"] == (planted, True)


def test_add_param_group_refused_on_one_rank_is_refused_on_every_rank_and_kept_by_none(two):
    for rank, result in enumerate(each_rank(two, "add_param_group_refused")):
        kind, message = result["error"]
        assert kind == "ValueError" and "some parameters appear in more than one" in message
        assert ("add_param_group failed on rank 1 (this rank)" if rank == 1 else "add_param_group failed on rank 1: some") in message
        assert result["groups"] == result["local_groups"] == 1


def test_as_join_s_only_joinable_a_joined_rank_keeps_stepping_its_share(two, three):
    # torch's ZRO line 1076: step() notifies the Join context, and its join hook calls step() again on a joined
    # rank, so with the optimizer as the first Joinable the joined rank issues one all-reduce more than the others
    # (the next test); minidp's hook steps without notifying (minidp/distributed/join.py, ZeroJoinHook)
    assert_same_as_torch(two, "alone_under_join")
    assert_same_as_torch(three, "alone_under_join")


def test_a_joined_rank_runs_the_step_hooks_as_often_as_the_ranks_still_training_as_torch_does(two):
    """ZRO _ZeROJoinHook.main_hook (line 139) calls zero.step(), so a rank out of data runs the optimizer's step pre-
    and post-hooks, and the global ones, once per iteration of the ranks still training; minidp's hook stepped without
    them."""
    assert_same_as_torch(two, "step_hooks_under_join")
    for result in each_rank(two, "step_hooks_under_join"):
        every_hook_as_often_as_the_last_rank_steps = dict.fromkeys(("pre", "post", "global pre", "global post"), 3)
        assert result["calls"]["minidp"] == result["calls"]["torch"] == every_hook_as_often_as_the_last_rank_steps


def test_as_join_s_only_joinable_an_optimizer_whose_first_group_is_empty_keeps_stepping(two):
    """ZRO join_device (lines 1176-1178) is _default_device, the device of _all_params[0] (line 416): the first
    parameter of any group, so an empty first group, which both optimizers accept, changes nothing; minidp read the
    first group's first parameter, and Join([optimizer]) raised IndexError on every rank."""
    assert_same_as_torch(two, "alone_under_join_empty_first_group")
    for result in each_rank(two, "alone_under_join_empty_first_group"):
        assert result["join_devices"] == ["cpu", "cpu"]


def test_torch_s_optimizer_as_join_s_only_joinable_breaks_the_collectives():
    # the stock behaviour the test above departs from (ZRO line 1076, and _ZeROJoinHook.main_hook calling step()):
    # a joined rank's all-reduce meets the broadcast of a rank still training, and Gloo ends the job
    with pytest.raises(RankFailed):
        launch(checks.torch_alone_under_join, 2, (0,), timeout=10.0, job_timeout=60.0)


def test_overlap_with_ddp_is_refused_with_the_way_out():
    with pytest.raises(NotImplementedError, match="overlap_with_ddp=True is not supported.*leave it False"):
        ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)


def test_without_a_process_group_the_error_says_how_to_make_one():
    # a ValueError, as torch's (distributed_c10d.py, _get_default_group)
    with pytest.raises(ValueError, match="init_process_group.*minidp.distributed.launch"):
        ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
    assert torch.distributed.is_initialized() is False


def test_a_functional_optimizer_is_refused_as_torch_refuses_it():
    # ZRO _get_optimizer_constructor (lines 1668-1675): functional optimizers serve overlap_with_ddp only
    from torch.distributed.optim.functional_sgd import _FunctionalSGD

    with pytest.raises(ValueError, match="Passing in a functional optimizer .* when `overlap_with_ddp=False`"):
        ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), _FunctionalSGD, lr=0.1)
