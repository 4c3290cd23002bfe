"""Starting distributed jobs: minidp.distributed.launch, run_demo, and the torchrun example.

A rank that raises must end the job with that rank's error, under ``launch`` (torch.multiprocessing
spawning) and under torchrun, never a hang: the other rank is then blocked in an all-reduce that
will not complete before the process group's timeout, which is set longer than the job's bound.
"""

from __future__ import annotations

import multiprocessing
import re

import pytest

from . import ddp_checks as checks
from .helpers import torchrun
from minidp.distributed import RankFailed, launch, run_demo


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """These checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


def test_a_rank_that_raises_in_step_2_ends_the_launched_job_with_its_error():
    # process-group timeout 300 s > job_timeout 90 s: only ending the job on the error passes
    with pytest.raises(RankFailed, match="rank 1 raised:(.|\n)*planted failure in step 2 on rank 1") as failure:
        launch(checks.raise_in_step_2, 2, (1,), timeout=300, job_timeout=90)
    assert failure.value.rank == 1
    assert multiprocessing.active_children() == []  # rank 0, stuck in its all-reduce, was ended


@pytest.mark.parametrize("code", [3, 0])
def test_a_rank_that_dies_without_raising_is_named_before_the_rank_its_death_made_fail(code):
    # rank 1 ends itself mid-training (os._exit: it sends no error); rank 0's all-reduce then fails on the lost peer.
    # The job named rank 0, whose error came in first, and never rank 1; torchrun lists both.
    with pytest.raises(RankFailed, match=f"rank 1 exited with code {code} without a result") as failure:
        launch(checks.exit_in_step_2, 2, (1, code), timeout=300, job_timeout=90)
    assert failure.value.rank == 1
    assert multiprocessing.active_children() == []


def test_a_rank_that_raises_is_named_before_a_rank_its_error_brought_down_silently():
    # The reverse order: rank 0's error is the cause, rank 1's silent end (after its barrier broke) the consequence.
    with pytest.raises(RankFailed, match="rank 0 raised:(.|\n)*planted failure on rank 0") as failure:
        launch(checks.raise_then_the_other_aborts, 2, (6,), timeout=300, job_timeout=90)
    assert failure.value.rank == 0
    assert multiprocessing.active_children() == []


def test_a_rank_may_start_processes_of_its_own_as_a_dataloader_with_workers_does():
    # torch.multiprocessing.spawn's workers are not daemonic (spawn(daemon=False)), nor are torchrun's: a daemonic one
    # may not have children ("daemonic processes are not allowed to have children")
    assert launch(checks.data_loader_with_workers, 2, job_timeout=120) == [[[0.0, 2.0], [4.0, 6.0]], [[1.0, 3.0], [5.0, 7.0]]]
    assert multiprocessing.active_children() == []


def test_a_script_written_for_torchrun_reads_its_place_and_may_end_the_group_itself():
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE (torch/distributed/run.py), and a script may end
    # with destroy_process_group() or sys.exit(0): the job ends well either way
    results = launch(checks.train_as_a_torchrun_script, 2, ("destroy",), job_timeout=90)
    assert results == [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"} for r in (0, 1)]
    assert launch(checks.train_as_a_torchrun_script, 2, ("exit",), job_timeout=90)[1] is None


def test_a_rank_that_raises_under_torchrun_ends_the_job_with_its_error():
    done = torchrun("-m", "tests.ddp_checks", "1")
    assert done.returncode != 0
    assert "RuntimeError: planted failure in step 2 on rank 1" in done.stdout
    # torchrun's report lists each failed rank; rank 0 fails too (its all-reduce loses its peer), and whichever
    # failure torchrun observed first is its "Root Cause": either may be. Rank 1's entry holds rank 1's own error.
    report = done.stdout.split("tests.ddp_checks FAILED")[1]
    entries = re.split(r"\n\[\d+\]:\n", report)[1:]
    rank_1 = [entry for entry in entries if "rank      : 1 (local_rank: 1)" in entry]
    assert len(rank_1) == 1 and "RuntimeError: planted failure in step 2 on rank 1" in rank_1[0], report


def test_torchrun_example_trains_the_demo_model():
    done = torchrun("examples/ddp_train.py", "--epochs", "2", "--samples", "400", "--batch-size", "40")
    assert done.returncode == 0, done.stdout
    assert "2 processes (gloo, cpu)" in done.stdout and "batch size 40 -> 20 per process" in done.stdout
    assert "epoch 2/2: train loss" in done.stdout
    assert "buckets rebuilt after the first backward, in the order gradients arrived: [[5, 4, 2, 3, 0, 1]]" in done.stdout


def test_run_demo_trains_in_two_processes_with_replicas_and_writes_the_trace(tmp_path, capfd):
    results = run_demo(2, epochs=2, samples=240, batch_size=24, replicas=2, trace=str(tmp_path))
    assert [r["epoch"] for r in results] == [1, 2]
    assert results[1]["train_loss"] < results[0]["train_loss"]
    assert "2 replicas in each" in capfd.readouterr().out
    assert (tmp_path / "ddp_timeline.json").stat().st_size > 0
    assert (tmp_path / "ddp_timeline.png").read_bytes().startswith(b"\x89PNG")
