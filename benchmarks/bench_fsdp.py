"""minidp.distributed.fully_shard against torch's FSDP2: step time, and the memory a step adds per rank.

    python benchmarks/bench_fsdp.py                   # 2 Gloo processes on this machine
    python benchmarks/bench_fsdp.py --rounds 10       # shorter (MINIDP_BENCH_QUICK=1 does the same)
    python benchmarks/bench_fsdp.py --backend nccl    # one GPU per process; skipped, with the reason, if NCCL refuses

Method: two processes (``minidp.distributed.launch``, one thread each), each holding two copies of
the same model, every block and then the root sharded by torch's ``fully_shard`` in one and by
minidp's in the other; both train in the same processes, on the same batches, in alternating order
round after round (torch first in even rounds), after a warm-up. A step is ``zero_grad``, forward,
loss, backward, ``optimizer.step`` (AdamW), timed on every rank from a barrier; the step's time is
the slowest rank's. Printed: the median step of each and their ratio (minidp / torch: below 1 is
faster).

Memory: what a step adds on top of what the rank held before it (the gathered parameters, the
full gradients before their reduce-scatter, the collectives' buffers), the highest over the timed
steps of any rank. On GPUs, ``torch.cuda.max_memory_allocated`` above the allocation at the step's
start. On the CPU, the peak resident set above the step's start (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``), with glibc told to hand blocks of 64 KiB and more back to the
system at once (``MALLOC_MMAP_THRESHOLD_=65536``, set before the processes start), so that a freed
gathered parameter leaves the resident set; page-granular. Both hold the same shards between steps
(FSDP2's padded local tensors; minidp's padded shards), so the steady part is the same for both.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned ranks: see the docstring

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import minidp.distributed as md  # noqa: E402
from benchmarks.processes import launch_from_command_line, slowest_rank_medians  # noqa: E402


def deep_mlp(width: int = 1024, depth: int = 8) -> nn.Sequential:
    """``depth`` blocks of a ``width`` x ``width`` linear layer and a ReLU (4 MiB each at 1024), then a head."""
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


CASES = {
    # name: (model, one rank's batch)
    "MLP 8x1024 (32 MiB), batch 64/rank": (deep_mlp, lambda g: torch.randn(64, 1024, generator=g)),
    "MLP 16x512 (16 MiB), batch 32/rank": (lambda: deep_mlp(512, 16), lambda g: torch.randn(32, 512, generator=g)),
}


def _resident(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, cuda: bool) -> tuple[float, int]:
    """One step's seconds and the bytes it added at its peak."""
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the peak resident set starts again from the current one
        before = _resident("VmRSS")
    start = time.perf_counter()
    optimizer.zero_grad()
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _resident("VmHWM")
    return elapsed, peak - before


def run_case(name: str, rounds: int, warmup: int, device_kind: str) -> dict:
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    build, batch = CASES[name]
    models = {}
    for key, shard in (("torch", torch_fully_shard), ("minidp", md.fully_shard)):
        torch.manual_seed(0)  # the same weights on every rank and in both
        model = build().to(device)
        for block in list(model)[:-1]:
            shard(block)
        models[key] = shard(model)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    generator = torch.Generator().manual_seed(rank)
    inputs = [batch(generator).to(device) for _ in range(4)]
    times: dict[str, list[float]] = {"torch": [], "minidp": []}
    added: dict[str, list[int]] = {"torch": [], "minidp": []}
    for r in range(warmup + rounds):
        for key in (("torch", "minidp") if r % 2 == 0 else ("minidp", "torch")):
            elapsed, extra = _step(models[key], optimizers[key], inputs[r % len(inputs)], device_kind == "cuda")
            if r >= warmup:
                times[key].append(elapsed)
                added[key].append(extra)
    return {"times": times, "added": added, "ledger": md.memory_ledger(models["minidp"], optimizers["minidp"])}


def run_all(rounds: int, warmup: int, device_kind: str) -> dict:
    return {name: run_case(name, rounds, warmup, device_kind) for name in CASES}


def summarise(per_rank: list[dict]) -> list[tuple]:
    rows = []
    for name in CASES:
        medians = slowest_rank_medians(per_rank, name)
        peak = {k: max(max(r[name]["added"][k]) for r in per_rank) for k in ("torch", "minidp")}
        rows.append((name, medians["torch"] * 1e3, medians["minidp"] * 1e3, medians["minidp"] / medians["torch"],
                     peak["torch"] / 2**20, peak["minidp"] / 2**20, per_rank[0][name]["ledger"]))
    return rows


def main() -> None:
    per_rank = launch_from_command_line("minidp's fully_shard vs torch's FSDP2, 2 processes on this machine", run_all, default_rounds=40, default_warmup=3)
    if per_rank is None:
        return
    print(f"{'case':38} {'torch ms':>9} {'minidp ms':>9} {'ratio':>6} {'step adds MiB: torch':>21} {'minidp':>7}")
    for name, theirs, ours, ratio, peak_theirs, peak_ours, ledger in summarise(per_rank):
        print(f"{name:38} {theirs:9.2f} {ours:9.2f} {ratio:6.3f} {peak_theirs:21.1f} {peak_ours:7.1f}")
        print(f"{'':38} rank 0 holds between steps: parameters {ledger['parameters'] / 2**20:.1f} MiB, gradients "
              f"{ledger['gradients'] / 2**20:.1f}, AdamW state {ledger['optimizer_state'] / 2**20:.1f} (both alike)")


if __name__ == "__main__":
    main()
