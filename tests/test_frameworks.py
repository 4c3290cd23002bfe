"""Real training frameworks with minidp's DistributedDataParallel in place of torch's: the same bits.

Each job of ``tests/framework_jobs.py`` runs twice under torchrun (2 Gloo processes on the CPU,
``--standalone``: a free port on this machine): once as the framework ships, with torch DDP, and
once with ``minidp.distributed.DistributedDataParallel`` swapped in before the framework is
imported. Both runs must exit 0, and every rank's losses and final parameters and buffers must be
bitwise equal (``torch.equal``). A test skips where its framework is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .helpers import torchrun


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
}

MINIDP_CLASS = "minidp.distributed.ddp.DistributedDataParallel"
TORCH_CLASS = "torch.nn.parallel.distributed.DistributedDataParallel"


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


@pytest.mark.parametrize("job", list(JOBS))
def test_framework_trains_bitwise_as_with_torch_ddp(job, tmp_path):
    pytest.importorskip(JOBS[job])
    stock = run_job(job, "torch", tmp_path / "torch")
    ours = run_job(job, "minidp", tmp_path / "minidp")
    assert [r["wrapper"] for r in stock] == [TORCH_CLASS] * 2
    assert [r["wrapper"] for r in ours] == [MINIDP_CLASS] * 2  # the framework wrapped the model in minidp's class
    for rank in range(2):
        assert_bitwise_equal(ours[rank], stock[rank], rank)
    for name in ours[0]["parameters"]:  # and DDP kept the ranks' parameters in step
        assert torch.equal(ours[1]["state"][name], ours[0]["state"][name]), f"{name} differs between the ranks"
