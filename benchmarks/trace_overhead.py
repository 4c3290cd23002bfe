"""What tracing costs: one training step of the demo CNN with and without ``minidp.trace()``.

    python benchmarks/trace_overhead.py [--steps 30] [--batch 256] [--replicas 4]

Traced and untraced steps alternate, so both see the same machine; the medians are compared as a
ratio. Also measured: what an instrumented primitive costs with no tracer active (the flag check).
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

import minidp
from minidp.hooks import observed
from minidp.zoo import ZOO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    entry = ZOO["cnn"]
    model = minidp.DataParallel(entry.build(), ["cpu"] * args.replicas)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, _ = entry.batch(args.batch, torch.Generator().manual_seed(0))

    def step() -> None:
        optimizer.zero_grad()
        entry.loss(model(*inputs)).backward()
        optimizer.step()

    def timed(traced: bool) -> tuple[float, float]:
        """Wall time and CPU time (all threads of the process) of one step."""
        start, cpu_start = time.perf_counter(), time.process_time()
        if traced:
            with minidp.trace():
                step()
        else:
            step()
        return time.perf_counter() - start, time.process_time() - cpu_start

    for _ in range(3):
        step()
    plain, with_trace = [], []
    for _ in range(args.steps):
        plain.append(timed(False))
        with_trace.append(timed(True))
    print(f"cnn, batch {args.batch}, {args.replicas} CPU replicas, {args.steps} steps each, alternating")
    for clock, index in (("wall", 0), ("CPU", 1)):
        p = statistics.median(t[index] for t in plain)
        t = statistics.median(t[index] for t in with_trace)
        print(f"{clock:>4} time per step: tracing off {p * 1e3:.2f} ms, on {t * 1e3:.2f} ms (median): "
              f"overhead {(t / p - 1) * 100:+.1f}%")

    # The flag check alone: an instrumented no-op against the bare no-op.
    def bare() -> None:
        return None

    instrumented = observed("scatter")(bare)
    n = 200000
    off = min(timeit.repeat(instrumented, number=n, repeat=7)) / n
    plain_call = min(timeit.repeat(bare, number=n, repeat=7)) / n
    print(f"an instrumented call with no tracer active: {(off - plain_call) * 1e9:.0f} ns more than the bare call")

if __name__ == "__main__":
    main()
