"""Real training frameworks with minidp's DistributedDataParallel, or minidp's fully_shard, in place of torch's: the
same bits.

Each job of ``tests/framework_jobs.py`` runs twice under torchrun (2 Gloo processes on the CPU,
``--standalone``: a free port on this machine): once as the framework ships, with torch DDP (or FSDP2), and
once with ``minidp.distributed.DistributedDataParallel`` (and ``minidp.distributed.fully_shard``) swapped in before
the framework is imported. Both runs must exit 0, and every rank's losses and final parameters and buffers must be
bitwise equal (``torch.equal``); so must the checkpoint Lightning saves of a sharded model. A test skips where its
framework is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .helpers import state_difference, torchrun


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The jobs run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


JOB_TIMEOUT = 400.0  # seconds per torchrun job; importing transformers alone takes a while on a busy machine

# job: the package it needs
JOBS = {
    "trainer": "transformers",
    "accelerate": "accelerate",
    "lightning_auto": "pytorch_lightning",
    "lightning_manual": "pytorch_lightning",
    "ignite": "ignite",
    "fabric_ddp": "lightning_fabric",
    "lightning_fsdp2": "pytorch_lightning",
    "fabric_fsdp2": "lightning_fabric",
    "fabric_replicate": "lightning_fabric",
}

# the class of the wrapper (DDP), or of the sharded or replicated model (fully_shard's, replicate's, made from the
# model's class Blocks)
DDP_CLASSES = {"torch": "torch.nn.parallel.distributed.DistributedDataParallel",
               "minidp": "minidp.distributed.ddp.DistributedDataParallel"}
SHARDED_CLASSES = {"torch": "torch.distributed.fsdp._fully_shard._fsdp_init.FSDPBlocks",
                   "minidp": "minidp.distributed.fully_shard.FSDPBlocks"}
REPLICATED_CLASSES = {"torch": "torch.distributed._composable.replicate.DDPBlocks",
                      "minidp": "minidp.distributed.replicate.DDPBlocks"}


def run_job(job: str, wrapper: str, directory: Path) -> list[dict]:
    """``job`` with ``wrapper`` ("torch" or "minidp") under torchrun; each rank's results."""
    directory.mkdir()
    done = torchrun("-m", "tests.framework_jobs", job, wrapper, str(directory), timeout=JOB_TIMEOUT)
    assert done.returncode == 0, f"{job} with {wrapper}'s DDP exited {done.returncode}:\n{done.stdout[-6000:]}"
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(2)]


def assert_bitwise_equal(ours: dict, stock: dict, rank: int) -> None:
    assert len(ours["losses"]) == len(stock["losses"]) > 0
    for step, (a, b) in enumerate(zip(ours["losses"], stock["losses"])):
        same = torch.equal(a, b) if torch.is_tensor(a) else a == b
        assert same, f"rank {rank}, loss {step}: {a} with minidp, {b} with torch DDP"
    assert ours["state"].keys() == stock["state"].keys()
    for name, tensor in stock["state"].items():
        assert torch.equal(ours["state"][name], tensor), f"rank {rank}: {name} differs from torch DDP's"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(job)``: the job's results with torch's and with minidp's, each job run once per module."""
    done: dict[str, tuple[list[dict], list[dict]]] = {}

    def both(job: str) -> tuple[list[dict], list[dict]]:
        pytest.importorskip(JOBS[job])
        if job not in done:
            directory = tmp_path_factory.mktemp(job)
            done[job] = run_job(job, "torch", directory / "torch"), run_job(job, "minidp", directory / "minidp")
        return done[job]

    return both


@pytest.mark.parametrize("job", list(JOBS))
def test_framework_trains_bitwise_as_with_torch(job, runs):
    stock, ours = runs(job)
    classes = (SHARDED_CLASSES if job.endswith("fsdp2") else REPLICATED_CLASSES if job.endswith("replicate")
               else DDP_CLASSES)
    assert [r["wrapper"] for r in stock] == [classes["torch"]] * 2
    assert [r["wrapper"] for r in ours] == [classes["minidp"]] * 2  # minidp's did the wrapping, or the sharding
    for rank in range(2):
        assert_bitwise_equal(ours[rank], stock[rank], rank)
    for name in ours[0]["parameters"]:  # and the ranks' parameters kept in step
        assert torch.equal(ours[1]["state"][name], ours[0]["state"][name]), f"{name} differs between the ranks"


def test_lightning_checkpoints_a_sharded_model_as_it_checkpoints_fsdp2s(runs, tmp_path):
    # Lightning's ModelParallelStrategy.save_checkpoint: torch.distributed.checkpoint of get_model_state_dict and
    # get_optimizer_state_dict (each rank its part) and Lightning's own meta.pt; made whole, the same bits
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = {}
    for (result, *_), library in zip(runs("lightning_fsdp2"), ["torch", "minidp"]):
        dcp_to_torch_save(result["checkpoint"], tmp_path / f"{library}.pt")
        whole[library] = torch.load(tmp_path / f"{library}.pt", weights_only=False)
    assert set(whole["torch"]) == {"state_dict", "optimizer_0"}
    difference = state_difference(whole["minidp"], whole["torch"], where="minidp's checkpoint")
    assert difference is None, difference
