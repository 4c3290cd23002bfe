"""What the caller's idle OpenMP team costs a step of CPU replicas: the step with it let go, as minidp runs it, and
with it left spinning, in one process, step against step.

    python benchmarks/idle_team.py [--rounds 30] [--replicas 2] [--batch 256]
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 python benchmarks/idle_team.py   # no page faults

A thread about to run a replica on a share of its caller's intra-op threads lets its idle OpenMP team go first
(``minidp.cpu_threads.let_idle_team_go``), so that the team, which GNU OpenMP keeps spinning for milliseconds
after each parallel region, does not take the cores the replicas need. Here the same ``minidp.DataParallel`` step
(``minidp.zoo.SmallCNN``, cross-entropy, SGD; the backward as configured by default) runs both ways, alternating
every round, the other way with that call made a no-op: the two ways share the process, its memory and its
threads, so each round's ratio compares them on the same machine state. Printed: each way's median step and the
median of the rounds' ratios (let go / left spinning).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minidp  # noqa: E402
from benchmarks import models  # noqa: E402
from minidp import cpu_threads  # noqa: E402
from minidp.cli.bench import training_step  # noqa: E402
from minidp.zoo import SmallCNN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--number", type=int, default=5, help="steps per way per round")
    args = parser.parse_args()

    x, y = models.batch("cnn", "cpu", size=args.batch)
    step = training_step(minidp.DataParallel(SmallCNN(), ["cpu"] * args.replicas), x, y)
    ways = {"let go": cpu_threads.let_idle_team_go, "left spinning": lambda: None}
    times: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for r in range(args.rounds):
            for way in list(ways)[:: 1 if r % 2 else -1]:  # which way goes first alternates
                cpu_threads.let_idle_team_go = ways[way]
                step()  # the first step after a switch starts from the other way's state
                start = time.perf_counter()
                for _ in range(args.number):
                    step()
                times[way].append((time.perf_counter() - start) / args.number)
    finally:
        cpu_threads.let_idle_team_go = ways["let go"]
    ratios = [a / b for a, b in zip(times["let go"], times["left spinning"])]
    print(f"SmallCNN, batch {args.batch}, {args.replicas} CPU replicas, {torch.get_num_threads()} intra-op threads, "
          f"{args.rounds} rounds x {args.number} steps each way")
    for way, values in times.items():
        print(f"{way:<14} {statistics.median(values) * 1e3:7.2f} ms a step (median)")
    print(f"let go / left spinning, round by round: median {statistics.median(ratios):.3f} "
          f"(from {min(ratios):.3f} to {max(ratios):.3f})")


if __name__ == "__main__":
    main()
