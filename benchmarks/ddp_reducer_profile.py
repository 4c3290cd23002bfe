"""Where a step of minidp.distributed spends its time: the reducer's Python parts, per step, on every rank.

    python benchmarks/ddp_reducer_profile.py                  # ResNet-18, batch 8 per rank, 2 Gloo processes
    python benchmarks/ddp_reducer_profile.py --steps 20

Each of the reducer's stages is wrapped in a timer (in the benchmark's processes only): the per-parameter
hook as a whole, within it the copy of the gradient into its bucket (``_copy_into_bucket``, the
multiply by 1/world_size that torch's C++ reducer does too), and the end of the backward
(``_finish_backward``: waiting for the all-reduces still in flight, then ``_write_back``, the copy of the
means into ``.grad``, which torch's reducer does too). What is left of the hook after the copy is the
Python bookkeeping that torch does in C++.
"""

from __future__ import annotations

import argparse
import time

import torch

import minidp.distributed as md
from minidp.distributed import reducer
from minidp.zoo import resnet18

STAGES = {"hook": "autograd_hook", "copy into bucket": "_copy_into_bucket", "end of backward": "_finish_backward",
          "write-back": "_write_back"}


def profile(steps: int, warmup: int) -> dict:
    spent = dict.fromkeys(STAGES, 0.0)

    def timed(stage, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[stage] += time.perf_counter() - start
        return wrapper

    for stage, name in STAGES.items():
        setattr(reducer.Reducer, name, timed(stage, getattr(reducer.Reducer, name)))
    torch.manual_seed(0)
    ddp = md.DistributedDataParallel(resnet18())
    x = torch.randn(8, 3, 32, 32)
    for step in range(warmup + steps):
        if step == warmup:
            spent.update(dict.fromkeys(STAGES, 0.0))
            start = time.perf_counter()
        ddp(x).pow(2).mean().backward()
    per_step = {stage: seconds / steps * 1e3 for stage, seconds in spent.items()}
    return {**per_step, "step": (time.perf_counter() - start) / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    for rank, result in enumerate(md.launch(profile, 2, (args.steps, args.warmup), job_timeout=1800)):
        print(f"rank {rank}: " + ", ".join(f"{stage} {ms:.1f} ms" for stage, ms in result.items()))


if __name__ == "__main__":
    main()
