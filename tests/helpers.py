"""What the tests share besides fixtures: device lists, tolerances, comparisons, and planted-fault modules."""

from __future__ import annotations

import gc
import pytest
import torch
from torch import nn

import minidp
from minidp import ext

# float64 comparisons: data parallelism only reorders sums, so results agree to rounding.
RTOL_FLOAT64 = 1e-10

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def cpu_ids(n: int) -> list[str]:
    """``n`` replicas on the CPU."""
    return ["cpu"] * n


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - e| / max(max|e|, tiny)``: one number per tensor, robust to zeros."""
    scale = expected.detach().abs().max().clamp_min(1e-300)
    return ((actual.detach() - expected.detach()).abs().max() / scale).item() if expected.numel() else 0.0


def garbage_left_by(call) -> int:
    """How many objects only the cycle collector can free after ``call()``. Automatic collection is paused,
    so everything ``call`` allocates stays in the youngest generation, which alone is collected (fast)."""
    gc.disable()
    try:
        gc.collect(0)
        call()
        return gc.collect(0)
    finally:
        gc.enable()


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


# The configurations of DataParallel's defaults that every test runs under (tests/conftest.py).
CONFIGURATIONS = {
    "cached-torch": {"cache_replicas": True, "backend": "torch"},
    "uncached-ext": {"cache_replicas": False, "backend": "auto-with-ext"},
}


def configure_dataparallel(monkeypatch, cache_replicas: bool, backend: str) -> None:
    """Make ``cache_replicas`` DataParallel's default and ``backend`` the global reduce backend for one test.

    ``"auto-with-ext"`` is ``"auto"`` with the extension loaded (``"torch"`` where it cannot be built).
    """
    defaults = dict(minidp.DataParallel.__init__.__kwdefaults__)
    defaults["cache_replicas"] = cache_replicas
    monkeypatch.setattr(minidp.DataParallel.__init__, "__kwdefaults__", defaults)
    if backend == "auto-with-ext":
        backend = "auto" if ext.is_available() else "torch"
    monkeypatch.setattr(minidp.comm, "_default_reduce_backend", backend)
