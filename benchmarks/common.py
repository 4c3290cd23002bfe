"""Shared settings for the benchmarks: quick mode, rounds, devices, and the timing helper."""

from __future__ import annotations

import os

import pytest
import torch

# MINIDP_BENCH_QUICK=1: a few rounds each, so that CI runs every benchmark in well under two minutes.
QUICK = os.environ.get("MINIDP_BENCH_QUICK", "") not in ("", "0")
HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]


def run(benchmark, function, rounds: int = 15, iterations: int = 1) -> None:
    """Time ``function`` with ``rounds`` rounds (3 in quick mode) after one warm-up round."""
    if torch.cuda.is_initialized():  # a GPU benchmark (a CPU one must not initialise CUDA: minidp's hooks would
        inner = function              # then open NVTX ranges that stock never pays)

        def function() -> None:  # GPU work is asynchronous: a step ends when its kernels do
            inner()
            torch.cuda.synchronize()

    benchmark.pedantic(function, rounds=3 if QUICK else rounds, iterations=iterations, warmup_rounds=1)


def device_ids(device: str, count: int) -> list:
    """``count`` replicas on ``device``: ``['cpu'] * count`` or ``[0] * count``."""
    return ["cpu"] * count if device == "cpu" else [0] * count
