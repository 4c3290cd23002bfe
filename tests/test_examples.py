"""The scripts in examples/ run as a user runs them (a fresh ``python``), with small sizes."""

from __future__ import annotations

import pytest

from .helpers import ROOT, fresh_python

pytestmark = pytest.mark.fresh_interpreter


def run_example(name: str, *args: str) -> str:
    """Run ``examples/<name>`` in a fresh interpreter that imports this checkout's minidp; return its stdout."""
    done = fresh_python(str(ROOT / "examples" / name), *args)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_tutorial_refuses_a_count_below_one_as_a_usage_error():
    done = fresh_python(str(ROOT / "examples" / "tutorial_multi_gpu.py"), "--batch-size", "0")
    assert done.returncode == 2 and "must be at least 1" in done.stderr and "Traceback" not in done.stderr


def test_tutorial_workflow_trains_with_data_parallel_on_sub_modules():
    out = run_example("tutorial_multi_gpu.py", "--epochs", "2", "--samples", "400", "--batch-size", "40")
    assert "ids=" in out
    assert "epoch 2: mean loss" in out and "test accuracy" in out
    assert "python -m minidp devices" in out and "nvidia-smi" in out


def test_swap_in_gives_torch_nn_dataparallel_s_numbers():
    out = run_example("swap_in.py", "--steps", "4", "--batch-size", "10", "--replicas", "3")
    # The script exits non-zero if any parameter or buffer differs by more than 1e-10 (relative).
    assert "largest relative difference in any parameter or buffer" in out
    loss_rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"], ["4"])]
    assert len(loss_rows) == 4
    for _, stock_loss, minidp_loss in loss_rows:
        assert abs(float(stock_loss) - float(minidp_loss)) <= 1e-10 * abs(float(stock_loss))
