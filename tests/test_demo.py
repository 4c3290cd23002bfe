"""``python -m minidp demo``: it trains, learns, says what it runs on, and its options work."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from .helpers import requires_cuda
from minidp.cli import demo
from minidp.cli import build_parser, main
from minidp.tracing.memory import CATEGORIES

TINY = ["--samples", "1000", "--epochs", "3", "--batch-size", "32", "--lr", "5e-3"]


def demo_args(*argv: str):
    return build_parser().parse_args(["demo", *argv])


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for option in ["--epochs", "--batch-size", "--replicas", "--device", "--lr", "--seed", "--samples", "--trace"]:
        assert option in help_text


def test_learns_well_above_chance_on_cpu_replicas():
    results = demo.train(demo_args(*TINY, "--replicas", "2", "--device", "cpu"))
    assert len(results) == 3
    assert results[-1].train_loss < results[0].train_loss
    assert results[-1].held_out_accuracy > 0.3  # chance is 0.1


def test_prints_devices_replicas_and_chunk_sizes(capsys):
    assert main(["demo", "--samples", "100", "--epochs", "1", "--batch-size", "32", "--replicas", "3",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "device_ids=['cpu', 'cpu', 'cpu']: 3 replicas" in out
    assert "batch size 32 -> chunk sizes per replica [11, 11, 10] (last batch 4 -> [2, 2])" in out
    assert "epoch 1/1: train loss" in out and "held-out loss" in out


def test_a_batch_larger_than_the_data_prints_the_chunks_of_the_one_batch_it_makes(capsys):
    assert main(["demo", "--samples", "3", "--epochs", "1", "--batch-size", "64", "--device", "cpu"]) == 0
    assert "batch size 64 -> chunk sizes per replica [2, 1] (the 3 samples make one batch)" in capsys.readouterr().out


def test_same_seed_gives_the_same_run():
    args = ["--samples", "200", "--epochs", "1", "--batch-size", "50", "--device", "cpu", "--seed", "7"]
    assert demo.train(demo_args(*args)) == demo.train(demo_args(*args))


@pytest.mark.parametrize(
    "device, replicas, expected",
    [("cpu", None, ["cpu", "cpu"]), ("cpu", 4, ["cpu"] * 4)],
)
def test_cpu_replicas_default_to_two(device, replicas, expected):
    assert demo.choose_device_ids(device, replicas) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_says_how_to_use_the_cpu():
    with pytest.raises(SystemExit, match="--device cpu"):
        demo.choose_device_ids("cuda", None)


def test_auto_uses_the_cpu_without_a_gpu_and_every_gpu_with_them():
    expected = list(range(torch.cuda.device_count())) or ["cpu", "cpu"]
    assert demo.choose_device_ids("auto", None) == expected


@pytest.mark.cuda
@requires_cuda
def test_more_replicas_than_gpus_repeat_the_gpu_ids():
    gpus = torch.cuda.device_count()
    assert demo.choose_device_ids("cuda", 2 * gpus) == list(range(gpus)) * 2


@pytest.mark.cuda
@requires_cuda
def test_learns_on_the_gpus():
    results = demo.train(demo_args(*TINY, "--device", "cuda"))
    assert results[-1].held_out_accuracy > 0.3


@pytest.mark.parametrize("option", ["--epochs", "--batch-size", "--replicas", "--samples"])
def test_counts_below_one_are_rejected_naming_the_option(option, capsys):
    with pytest.raises(SystemExit):
        main(["demo", option, "0"])
    err = capsys.readouterr().err
    assert option in err and "must be at least 1" in err


def test_trace_writes_the_table_chrome_trace_and_timeline_of_one_step(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["demo", "--samples", "100", "--epochs", "1", "--batch-size", "32", "--replicas", "2",
                 "--device", "cpu", "--trace", str(tmp_path)]) == 0
    assert "one traced step" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir()} == {"table.txt", "trace.json", "timeline.png"}
    assert "forward" in (tmp_path / "table.txt").read_text()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


LOG_RUN = ["demo", "--samples", "100", "--epochs", "2", "--batch-size", "32", "--device", "cpu"]


def test_a_log_gets_one_line_per_epoch_and_no_progress_bar(capsys):
    """Output captured (as in CI or ``> log``): no stream is a terminal, so no bar redraws."""
    assert main(LOG_RUN) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert [line.split(":")[0] for line in captured.out.splitlines() if line.startswith("epoch")] == ["epoch 1/2", "epoch 2/2"]


def test_a_terminal_gets_the_live_progress_bar(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(LOG_RUN) == 0
    assert "\r" in terminal.getvalue() and "batch" in terminal.getvalue()


def test_balanced_trains_exactly_as_the_gathered_run_and_prints_both_ledgers(capsys):
    """The loss on the replicas is the full batch's loss (minidp.parallel_criterion): same run, same numbers."""
    options = ["--samples", "200", "--epochs", "2", "--batch-size", "40", "--replicas", "2", "--device", "cpu"]
    gathered = demo.train(demo_args(*options))
    balanced = demo.train(demo_args(*options, "--balanced"))
    for a, b in zip(gathered, balanced):
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-4)
        assert a.held_out_accuracy == pytest.approx(b.held_out_accuracy, abs=0.02)
    out = capsys.readouterr().out
    assert "the loss on the replicas" in out
    ledger = out.split("memory ledger of one training step, both ways:")[1].splitlines()
    assert "outputs gathered" in ledger[1] and "loss on replicas" in ledger[1]
    device = ledger[ledger.index(next(line for line in ledger if line.startswith("cpu "))) + 1:][:len(CATEGORIES)]
    assert [line.split("  ")[1] for line in device] == list(CATEGORIES)
    for line in device:  # on CPU replicas every category of the device holds memory, both ways
        assert not line.endswith(" 0 B") and "  0 B " not in line, line
    gathered_row = next(line for line in ledger if "gathered outputs" in line).split()
    assert gathered_row[-2:] == ["16", "B"]  # two replicas' numerator and denominator, float32


@pytest.mark.fresh_interpreter
@pytest.mark.parametrize("gpus,processes,device", [(0, 2, "cpu"), (1, 2, "cpu"), (2, 2, "cuda"), (4, 2, "cuda")])
def test_processes_use_nccl_only_where_every_process_has_a_gpu_of_its_own(monkeypatch, gpus, processes, device):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected", seen on a one-GPU machine), so ``--device auto``
    trains on the CPU with Gloo unless there is a GPU per process."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert demo.distributed_device("auto", processes) == device


@pytest.mark.parametrize("gpus", [0, 1])
def test_processes_on_cuda_without_a_gpu_per_process_are_refused_saying_what_works(monkeypatch, gpus):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SystemExit, match="--device cpu") as refused:
        demo.distributed_device("cuda", 2)
    assert (f"this machine has {gpus}" in str(refused.value)) == (gpus > 0)


def test_processes_trains_with_minidp_distributed(capfd):
    assert main(["demo", "--processes", "2", "--device", "cpu", "--samples", "200", "--epochs", "1", "--batch-size", "40"]) == 0
    out = capfd.readouterr().out  # printed by rank 0, a process of its own
    assert "2 processes (gloo, cpu)" in out and "epoch 1/1: train loss" in out
