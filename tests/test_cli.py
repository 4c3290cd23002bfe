"""The command line: every subcommand runs, has --help, and verify's exit status reports failure."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from conftest import CountsCalls
from minidp.__main__ import COMMANDS, main
from minidp.cli_devices import parse_device_ids
from minidp.zoo import ZooEntry


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help(command, capsys):
    if importlib.util.find_spec(COMMANDS[command][0]) is None:
        pytest.skip(f"{COMMANDS[command][0]} is not in this tree")
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert COMMANDS[command][1] in capsys.readouterr().out


def test_devices_lists_the_cpu_and_every_gpu(capsys):
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["logical", "id"]
    assert lines[1].startswith("cpu")
    gpu_rows = [line for line in lines[1:] if line.split() and line.split()[0].isdigit()]
    assert len(gpu_rows) == torch.cuda.device_count()


def test_verify_on_a_subset_prints_a_passing_table(capsys):
    assert main(["verify", "--devices", "cpu*3", "--models", "mlp", "resnet_bn"]) == 0
    out = capsys.readouterr().out
    assert "2/2 models pass" in out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.split()[:1] in (["mlp"], ["resnet_bn"])}
    assert rows == {"mlp": "pass", "resnet_bn": "pass"}


def test_verify_exits_1_and_shows_the_report_when_a_model_fails(monkeypatch, capsys):
    broken = ZooEntry("counts_calls", CountsCalls, lambda b, g: ((torch.randn(b, 4, generator=g),), {}))
    monkeypatch.setattr("minidp.cli_verify.ZOO", {"counts_calls": broken})
    assert main(["verify", "--devices", "cpu,cpu"]) == 1
    out = capsys.readouterr().out
    assert "counts_calls" in out and "FAIL" in out and "failed: counts_calls" in out


def test_trace_writes_the_table_the_chrome_trace_and_the_timeline(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "step"
    assert main(["trace", "--model", "mlp", "--devices", "cpu*2", "--batch", "8", "--warmup", "0", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["table.txt", "timeline.png", "trace.json"]
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert "forward" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, expected",
    [("0,1", [0, 1]), ("cpu*4", ["cpu"] * 4), ("cuda:0,cuda:0", ["cuda:0", "cuda:0"]), ("cpu, 0*2", ["cpu", 0, 0])],
)
def test_device_ids_are_parsed_from_a_comma_list_with_repeats(text, expected):
    assert parse_device_ids(text) == expected


def test_a_bad_device_list_names_the_fix():
    with pytest.raises(Exception, match="cpu\\*4"):
        parse_device_ids("cpu*x")


def test_verify_draws_no_progress_bar_into_a_log(capsys):
    assert main(["verify", "--devices", "cpu*2", "--models", "mlp"]) == 0
    assert capsys.readouterr().err == ""
