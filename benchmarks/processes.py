"""The command line and the launch that the multi-process benchmarks share (bench_ddp.py, bench_fsdp.py)."""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Callable, Optional

import torch

import minidp.distributed as md


def launch_from_command_line(
    description: str, run_all: Callable, default_rounds: int, default_warmup: int
) -> Optional[list]:
    """Parse ``--rounds --warmup --processes --backend``, then run ``run_all(rounds, warmup, device_kind)`` on every
    rank (one thread each on the CPU); each rank's result, or ``None`` after saying why NCCL cannot
    run here (fewer GPUs than processes, or NCCL refusing), so the GPU script goes on."""
    parser = argparse.ArgumentParser(description=description)
    quick = os.environ.get("MINIDP_BENCH_QUICK", "") not in ("", "0")
    parser.add_argument("--rounds", type=int, default=10 if quick else default_rounds,
                        help=f"timed steps of each (default {default_rounds})")
    parser.add_argument("--warmup", type=int, default=default_warmup)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    args = parser.parse_args()
    device_kind = "cuda" if args.backend == "nccl" else "cpu"
    if device_kind == "cuda" and torch.cuda.device_count() < args.processes:
        print(f"skipped: --backend nccl needs one GPU per process; this machine has {torch.cuda.device_count()} "
              f"for {args.processes} processes (NCCL refuses two ranks on one GPU)")
        return None
    try:
        per_rank = md.launch(run_all, args.processes, (args.rounds, args.warmup, device_kind), backend=args.backend,
                             threads=None if device_kind == "cuda" else 1, job_timeout=1800)
    except md.RankFailed as failure:
        if args.backend != "nccl":
            raise
        print(f"skipped: NCCL failed: {str(failure).strip().splitlines()[-1]}")
        return None
    print(f"{args.processes} processes, backend {args.backend}, {args.rounds} interleaved steps each after "
          f"{args.warmup} warm-up; load average {os.getloadavg()[0]:.1f}")
    return per_rank


def slowest_rank_medians(per_rank: list[dict], case: str, variants: tuple[str, ...] = ("torch", "minidp")) -> dict[str, float]:
    """Per variant, the median step of ``case`` in seconds, where a step lasts as long as its slowest rank
    (``per_rank[r][case]["times"][variant]``: rank r's step times, in step order)."""
    medians = {}
    for variant in variants:
        steps = zip(*(rank[case]["times"][variant] for rank in per_rank))  # step i of every rank
        medians[variant] = statistics.median(max(step) for step in steps)
    return medians
