"""Shared fixtures: device lists, tolerances and helpers used across the test suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

# float64 comparisons: data parallelism only reorders sums, so results agree to rounding.
RTOL_FLOAT64 = 1e-10

ROOT = Path(__file__).resolve().parents[1]

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def cpu_ids(n: int) -> list[str]:
    """``n`` replicas on the CPU."""
    return ["cpu"] * n


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - e| / max(max|e|, tiny)``: one number per tensor, robust to zeros."""
    scale = expected.detach().abs().max().clamp_min(1e-300)
    return ((actual.detach() - expected.detach()).abs().max() / scale).item() if expected.numel() else 0.0


@pytest.fixture
def generator() -> torch.Generator:
    """A fresh, randomly seeded generator: every run draws new inputs; the seed is printed on failure."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


class CountsCalls(nn.Module):
    """Counts its forward calls in a plain attribute: the kind of state data parallelism loses, since
    under DataParallel each replica counts on its own copy and the original's count stays put."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


def fresh_python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python *args`` in a fresh interpreter that imports this checkout's minidp, output captured.

    For what a test process cannot do to itself (fork, Ctrl-C, exit) or must see from a clean
    start; ``timeout`` turns a hang into a failure (``subprocess.TimeoutExpired``), the process killed.
    """
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
