"""Steady memory over 1,000 training steps: live tensors and process memory (RSS) must not grow.

    python -m benchmarks.steady_memory [--steps 1000] [--device cpu|cuda] [--replicas 2]

Trains the demo CNN (batch 64) with minidp.DataParallel and prints, every 100 steps, the number of
live ``torch.Tensor`` objects (via gc) and the resident set size (from /proc/self/statm), and on a GPU the bytes
its caching allocator handed out. Exits 1 if any grew between step 100 and the last step (RSS by more than 5%: the
allocator's slack).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
from torch import nn

import minidp
from minidp.zoo import SmallCNN


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))  # type(): no proxy __class__


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def gpu_bytes(device: torch.device) -> int:
    """What the CUDA caching allocator has handed out on ``device`` (0 on the CPU): the RSS does not see GPU memory."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)
    ids = ["cpu"] * args.replicas if device.type == "cpu" else [device.index or 0] * args.replicas
    model = SmallCNN().to(device)
    wrapper = minidp.DataParallel(model, ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    marks: dict[int, tuple[int, int, int]] = {}
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        nn.functional.cross_entropy(wrapper(x), y).backward()
        optimizer.step()
        if step % 100 == 0:
            marks[step] = (live_tensors(), rss_bytes(), gpu_bytes(device))
            gpu = f", GPU {marks[step][2] / 2**20:.1f} MiB allocated" if device.type == "cuda" else ""
            print(f"step {step:5d}: {marks[step][0]} live tensors, RSS {marks[step][1] / 2**20:.1f} MiB{gpu}", flush=True)
    first, last = marks[min(marks)], marks[max(marks)]
    grew = last[0] > first[0] or last[1] > first[1] * 1.05 or last[2] > first[2]
    gpu = f", GPU {first[2] / 2**20:.1f} -> {last[2] / 2**20:.1f} MiB" if device.type == "cuda" else ""
    print(f"live tensors {first[0]} -> {last[0]}, RSS {first[1] / 2**20:.1f} -> {last[1] / 2**20:.1f} MiB{gpu}: "
          f"{'GROWTH' if grew else 'steady'}; cache {wrapper.replica_cache_info()}")
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
