"""The command line: every subcommand runs, has --help, and verify's exit status reports failure."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import minidp

from .helpers import CountsCalls
from minidp.cli import COMMANDS, main
from minidp import device_ids
from minidp.cli.args import parse_device_ids
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
    monkeypatch.setattr("minidp.cli.verify.ZOO", {"counts_calls": broken})
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


def test_trace_on_minus_one_runs_its_replicas_on_the_cpu(tmp_path, capsys):
    # -1 is the CPU on the command line (as_device's and stock gather's spelling); passed on as a number, DataParallel
    # would read it as a GPU id, find none, and run the module alone: a trace of nothing
    assert main(["trace", "--model", "mlp", "--devices=-1,-1", "--batch", "8", "--warmup", "0", "--out",
                 str(tmp_path)]) == 0
    forwards = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("name") == "forward"]
    assert len(forwards) == 2


@pytest.mark.parametrize("choice, threads", [("on", 2), ("off", 1)])
def test_trace_runs_the_backwards_the_way_it_is_told_and_sets_the_default_back(tmp_path, choice, threads):
    before = minidp.get_parallel_backward()
    out = tmp_path / "step"
    arguments = ["trace", "--model", "mlp", "--devices", "cpu*2", "--batch", "8", "--warmup", "0"]
    assert main([*arguments, "--parallel-backward", choice, "--out", str(out)]) == 0
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert len({e["args"]["thread"] for e in events if e["name"] == "backward"}) == threads  # 2: one each
    assert minidp.get_parallel_backward() is before


@pytest.mark.parametrize(
    "text, expected",
    [("0,1", [0, 1]), ("cpu*4", ["cpu"] * 4), ("cuda:0,cuda:0", ["cuda:0", "cuda:0"]), ("cpu, 0*2", ["cpu", 0, 0])],
)
def test_device_ids_are_parsed_from_a_comma_list_with_repeats(text, expected, monkeypatch):
    monkeypatch.setattr(device_ids, "visible_gpus", lambda: 2)  # GPU ids 0 and 1 exist: the parsing is under test
    assert parse_device_ids(text) == expected


def test_a_bad_device_list_names_the_fix():
    with pytest.raises(Exception, match="cpu\\*4"):
        parse_device_ids("cpu*x")


def test_verify_draws_no_progress_bar_into_a_log(capsys):
    assert main(["verify", "--devices", "cpu*2", "--models", "mlp"]) == 0
    assert capsys.readouterr().err == ""


BAD_OPTION_VALUES = [
    (["verify", "--devices", "gpu"], "argument --devices: 'gpu' is not a device: use cpu, cuda, cuda:N or a GPU number N"),
    (["verify", "--devices", "-2"], "argument --devices: '-2' is not a device"),
    (["verify", "--devices", f"cuda:{max(9, torch.cuda.device_count())}"], "is out of range: this process sees"),
    (["verify", "--batch", "0"], "argument --batch: must be at least 2, got 0"),
    (["verify", "--batch", "-3"], "argument --batch: must be at least 2, got -3"),
    (["verify", "--batch", "1"], "argument --batch: must be at least 2, got 1: verify gives a row to each of at least two replicas"),
    (["verify", "--devices", "cpu"], "argument --devices: 'cpu' names one device: verify compares at least two replicas"),
    (["trace", "--batch", "0"], "argument --batch: must be at least 1, got 0"),
    (["trace", "--warmup", "-1"], "argument --warmup: must be 0 or more"),
    (["trace", "--devices", "cpu*2,gpu"], "argument --devices: 'gpu' is not a device"),
    (["bench", "--device", "gpu"], "argument --device: 'gpu' is not a device"),
    (["demo", "--seed", str(2**64)], "argument --seed: must be between -2**63 and 2**63 - 1"),
    (["demo", "--lr", "-1"], "argument --lr: must be a finite number above 0, got -1"),
    (["demo", "--lr", "nan"], "argument --lr: must be a finite number above 0, got nan"),
    (["trace", "--devices", "cpu*"], "argument --devices: 'cpu*': the repeat after '*' must be a number from 1 to 1024"),
    (["trace", "--devices", "cpu*99999999999"], "the repeat after '*' must be a number from 1 to 1024"),
    (["trace", "--devices", "cpu*0"], "the repeat after '*' must be a number from 1 to 1024"),
    (["trace", "--out", __file__], "is a file; give a directory"),
    (["trace", "--out", f"{__file__}/step"], f"cannot be made: {__file__!r} is a file; give a directory"),
    (["demo", "--trace", f"{__file__}/step"], "is a file; give a directory"),
    (["verify", "--devices", "mps,mps"], "the commands run on the CPU or CUDA GPUs, not on mps"),
    (["trace", "--devices", "meta*2"], "not on meta; use cpu, cuda, cuda:N or a GPU number N; a list: e.g. 0,1"),
    (["bench", "--device", "meta"], "argument --device: 'meta': the commands run on the CPU or CUDA GPUs"),
    (["bench", "--device", f"cuda:{max(9, torch.cuda.device_count())}"], "; on the command line: cpu"),
]


@pytest.mark.parametrize("argv, message", BAD_OPTION_VALUES, ids=[" ".join(argv) for argv, _ in BAD_OPTION_VALUES])
def test_a_bad_option_value_is_a_usage_error_naming_the_option_and_what_works(argv, message, capsys):
    """As argparse reports any value its type rejects: one line on stderr, exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("option", [["trace", "--out"], ["demo", "--trace"]], ids=["trace --out", "demo --trace"])
def test_an_output_folder_that_cannot_be_made_is_a_usage_error_before_anything_runs(option, tmp_path, capsys):
    # Below a dangling link: its parent is a directory, yet no folder can be made there (as under /proc); the run
    # used to train and trace, then die with a FileNotFoundError traceback.
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SystemExit) as exit_info:
        main([*option, str(tmp_path / "gone" / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[1]}: " in err and "cannot be made" in err and "Traceback" not in err
