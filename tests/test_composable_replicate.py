"""minidp.distributed.replicate against torch's composable ``replicate``, in real Gloo processes on 127.0.0.1.

One job of 2 processes runs every check of ``tests/composable_replicate_checks.py`` on a fresh seed; each check trains
the same model with both libraries and returns where they differ, bitwise (``torch.equal``). The stock behaviour cited is
torch 2.13's ``torch/distributed/_composable/replicate.py`` (replicate.py below). PyTorch's own tests of the API run
in ``tests/test_upstream_replicate.py``.
"""

from __future__ import annotations

import pytest

from . import composable_replicate_checks as checks
from .ddp_checks import run_checks
from .helpers import each_rank, job_fixture


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """These checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


JOB_TIMEOUT = 180.0

TRAINING = {
    "plain": {},
    "small-buckets": {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True},
    "ignored": {"ignored": True},
    "hook-allreduce": {"hook": checks.HOOKS["allreduce"]},
    "hook-fp16": {"hook": checks.HOOKS["fp16"]},
    "unused": {"skip_branch": "odd", "find_unused_parameters": True},
    # one micro-batch a step: torch's replicate (and its wrapper under no_sync()) fails an internal assert of its C++
    # reducer (expect_autograd_hooks_) when static_graph meets gradient accumulation
    "static": {"skip_branch": "always", "static_graph": True, "micro_batches": 1},
    "sharded-block": {"shard": "fc2"},
    # FSDP2 leaves a sub-module torch's replicate manages whole (_get_managed_modules: _is_composable_with_fsdp)
    "replicated-block-in-a-sharded-root": {"replicated_child": "fc2", "micro_batches": 1},
    # the same with torch's fully_shard on the root: minidp's replicate names itself in torch's registry of composable
    # APIs, which torch's fully_shard asks (its child was sharded too, and trained otherwise)
    "replicated-block-in-a-root-torch-shards": {"replicated_child": "fc2", "micro_batches": 1, "torchs_fully_shard": True},
    # the DDP object is built at the first forward, out of dynamo's sight (torch's lazy_init): compiled, minidp's
    # raised there, dynamo tracing the check that every rank holds the same model
    "compiled": {"compiled": True},
}
PLAN = {
    **{f"train-{name}": (checks.against_torch, arguments) for name, arguments in TRAINING.items()},
    "itself": (checks.the_module_stays_itself, {}),
    "refusals": (checks.refusals, {}),
    "state": (checks.state_as_torchs, {}),
    "sync_batchnorm": (checks.sync_batchnorm_over_every_rank, {}),
}

two = job_fixture("two", run_checks, 2, PLAN, JOB_TIMEOUT)


@pytest.mark.parametrize("case", list(TRAINING))
def test_replicate_trains_bitwise_as_torchs(two, case):
    # replicate.py: a DDP object on the module's parameters, built at the first forward (rank 0's parameters
    # broadcast), its _pre_forward and _post_forward as forward hooks; set_requires_gradient_sync(False) for all but
    # the last micro-batch of each step; register_comm_hook kept until the DDP object exists; ignored_modules' and
    # fully-sharded sub-modules' parameters left out. Each rank starts from its own parameters (the broadcast evens
    # them), keeps its own BatchNorm statistics (neither library broadcasts buffers), 4 steps of 2 micro-batches.
    for result in each_rank(two, f"train-{case}"):
        assert result["losses"] == 4 * TRAINING[case].get("micro_batches", 2)
        assert result["difference"] is None, result["difference"]


def test_the_replicated_module_keeps_its_class_and_state_dict_keys_and_refuses_deepcopy_as_torchs(two):
    # replicate.py: the class becomes DDP<cls>, a subclass of (DDP, cls); its __new__ makes a container's slice of
    # cls; __deepcopy__ raises "DDP does not support deepcopy"
    for result in each_rank(two, "itself"):
        assert result["minidp"]["is_net"] and result["minidp"]["keys"]
        assert result["minidp"] == result["torch"]
        assert result["minidp"]["slice"] == "Sequential" and result["minidp"]["class"] == "DDPNet"
        assert result["minidp"]["deepcopy"].startswith("DDP does not support deepcopy")
        assert result["minidp"]["state_elsewhere"] is None


def test_the_replicate_state_holds_torchs_attributes_and_torchs_registry_names_it(two):
    # replicate.py: _ReplicateState's has_initialized, _param_names, _param_list (filled by the first forward's
    # lazy_init), _no_sync (set_requires_gradient_sync), _ddp (the DistributedDataParallel: replicate.state(m)._ddp.
    # register_comm_hook), and contract.py's registry, which lists "replicate"; the class derives from replicate.py's DDP
    for result in each_rank(two, "state"):
        assert result["minidp"] == result["torch"]
        assert result["minidp"]["ddp"] and result["minidp"]["registry"] == ["replicate"] and result["minidp"]["class"]
        assert result["minidp"]["seen"][1]["has_initialized"] and result["minidp"]["seen"][1]["no_sync"]


@pytest.mark.parametrize("case,kind,error", [
    ("twice", "AssertionError", "replicate was already applied to this Net"),
    ("sharded", "RuntimeError", "Cannot apply `replicate()` on a Module already managed by `fully_shard`"),
    ("device_id", "RuntimeError", "Expected device_id to be int or torch.device"),
    ("function", "TypeError", "module must be an nn.Module, got <bound method"),
])
def test_bad_input_is_refused_before_anything_changes(two, case, kind, error):
    # replicate.py's own refusals (the last two: its messages and types); twice: torch's contract() refuses a second
    # call too, with AssertionError
    for result in each_rank(two, "refusals"):
        assert result[case][0] == kind and result[case][1].startswith(error), result[case]
        assert result["twice_in_torch"][0] == "AssertionError"
        assert result["twice_in_torch"][1].startswith("Each distinct composable distributed API")


@pytest.mark.parametrize("wrapper", ["ddp", "replicate", "fully_shard"])
def test_minidps_sync_batchnorm_normalises_over_every_ranks_rows_under_each_wrapper(two, wrapper):
    # torch's nn.SyncBatchNorm all-gathers its statistics by itself, whatever wraps it (on GPUs); minidp's layer, the
    # one that synchronises on the CPU, is given its exchange by the wrapper: only its DDP gave it one, so under
    # replicate and fully_shard each rank normalised its own rows, silently
    for differences in each_rank(two, "sync_batchnorm"):
        assert differences[wrapper] <= 1e-12, differences
