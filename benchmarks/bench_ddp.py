"""minidp.distributed.DistributedDataParallel against torch DDP: step time, and all-reduce time hidden by the backward.

    python benchmarks/bench_ddp.py                   # 2 Gloo processes on this machine, the table below
    python benchmarks/bench_ddp.py --rounds 10       # shorter (MINIDP_BENCH_QUICK=1 does the same)
    python benchmarks/bench_ddp.py --backend nccl    # one GPU per process; skipped, with the reason, if NCCL refuses

Method: two processes (``minidp.distributed.launch``, one thread each), each holding two copies of
the same model, one wrapped by torch DDP and one by minidp's; both train in the same processes, on
the same batches, in alternating order round after round (torch first in even rounds), after a
warm-up that includes the bucket rebuild. A step is ``zero_grad``, forward, loss, backward,
``optimizer.step`` (SGD), timed on every rank from a barrier; the step's time is the slowest rank's.
Printed: the median step of each and their ratio (minidp / torch: below 1 is faster).

Hidden share: the part of the all-reduce time that overlaps the backward's computation, from the
moment the gradient reaches the output to the last gradient accumulated. For minidp it is read from
its own timeline (the timed steps themselves). torch DDP's reducer is C++ and keeps no per-bucket
times, so extra rounds time it with a communication hook that launches each bucket's all-reduce when
the built-in reduction would (the division by the world size comes after it, where the built-in
divides while filling the bucket) and records launch and completion, plus a hook per parameter for
the last gradient; these rounds are not counted in the step times. Machines shared with other work
make single runs noisy: compare ratios over several runs.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import minidp.distributed as md  # noqa: E402
from benchmarks.processes import launch_from_command_line, slowest_rank_medians  # noqa: E402
from minidp.zoo import SmallCNN, resnet18

TorchDDP = nn.parallel.DistributedDataParallel

def deep_mlp() -> nn.Module:
    """Eight 1024x1024 layers (32 MiB of float32): several buckets at the default 25 MiB cap."""
    layers = [m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(1024, 10))

CASES = {
    # name: (model, one rank's batch, DDP options)
    "demo CNN, batch 32/rank": (SmallCNN, lambda g: torch.randn(32, 1, 28, 28, generator=g), {}),
    "MLP 8x1024 (32 MiB), batch 64/rank": (deep_mlp, lambda g: torch.randn(64, 1024, generator=g), {}),
    "same, bucket_cap_mb=4": (deep_mlp, lambda g: torch.randn(64, 1024, generator=g), {"bucket_cap_mb": 4}),
    # many small parameters and BatchNorm buffers: the per-parameter Python hook costs most here
    "ResNet-18 (62 params, 43 MiB), batch 8/rank": (resnet18, lambda g: torch.randn(8, 3, 32, 32, generator=g), {}),
}

def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, sync: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start

class _StockTimeline:
    """Per-bucket launch and completion times of torch DDP, through a hook that launches as its built-in reduction does."""

    def __init__(self, ddp: TorchDDP) -> None:
        self.events: list[dict] = []
        self.last_gradient = 0.0
        self.output_gradient: Optional[float] = None
        ddp.register_comm_hook(dist.group.WORLD, self.hook)
        for p in ddp.module.parameters():
            p.register_post_accumulate_grad_hook(self._gradient)

    def hook(self, group, bucket):  # no annotations: stock checks them
        # launched at once, as the built-in reduction launches its pre-divided bucket (the division
        # comes after, outside the timed all-reduce)
        event = {"stage": "all-reduce", "bucket": bucket.index(), "start": time.perf_counter(), "end": None}
        self.events.append(event)
        future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
        future.add_done_callback(lambda _: event.__setitem__("end", time.perf_counter()))
        return future.then(lambda f: f.value()[0].div_(group.size()))

    def _gradient(self, _: torch.Tensor) -> None:
        self.last_gradient = time.perf_counter()

    def mark_output(self, output: torch.Tensor) -> torch.Tensor:
        def note(grad: torch.Tensor) -> None:
            self.output_gradient = time.perf_counter()

        output.register_hook(note)
        return output

    def timeline(self) -> list[dict]:
        backward = {"stage": "backward", "bucket": None, "start": self.output_gradient, "end": self.last_gradient}
        return [backward, *self.events]

def run_case(name: str, rounds: int, warmup: int, device_kind: str) -> dict:
    """One rank's part of a case; returns its step times and hidden shares."""
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    build, batch, options = CASES[name]
    torch.manual_seed(0)
    theirs_module = build().to(device)
    ours_module = build().to(device)
    ours_module.load_state_dict(theirs_module.state_dict())
    ids = [rank] if device_kind == "cuda" else None
    wrapped = {"torch": TorchDDP(theirs_module, device_ids=ids, **options),
               "minidp": md.DistributedDataParallel(ours_module, device_ids=ids, **options)}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in wrapped.items()}
    generator = torch.Generator().manual_seed(rank)
    inputs = [batch(generator).to(device) for _ in range(4)]
    sync = device_kind == "cuda"
    times: dict[str, list[float]] = {"torch": [], "minidp": []}
    shares: dict[str, list[float]] = {"torch": [], "minidp": []}
    for r in range(warmup + rounds):
        for key in (("torch", "minidp") if r % 2 == 0 else ("minidp", "torch")):
            elapsed = _step(wrapped[key], optimizers[key], inputs[r % len(inputs)], sync)
            if r >= warmup:
                times[key].append(elapsed)
                if key == "minidp":
                    shares["minidp"].append(md.hidden_share(wrapped["minidp"].timeline()))
    # torch DDP's per-bucket times: separate rounds, with the timing hook
    timed_theirs = TorchDDP(build().to(device), device_ids=ids, **options)
    stock = _StockTimeline(timed_theirs)
    for r in range(warmup + max(3, rounds // 2)):
        stock.events = []
        stock.mark_output(timed_theirs(inputs[r % len(inputs)])).float().pow(2).mean().backward()
        if r >= warmup:
            shares["torch"].append(md.hidden_share(stock.timeline()))
    return {"times": times, "shares": shares, "buckets": len(wrapped["minidp"].bucket_plan())}

def run_all(rounds: int, warmup: int, device_kind: str) -> dict:
    return {name: run_case(name, rounds, warmup, device_kind) for name in CASES}

def summarise(per_rank: list[dict]) -> list[tuple]:
    rows = []
    for name in CASES:
        medians = slowest_rank_medians(per_rank, name)
        hidden = {k: statistics.median(s for r in per_rank for s in r[name]["shares"][k]) for k in ("torch", "minidp")}
        rows.append((name, per_rank[0][name]["buckets"], medians["torch"] * 1e3, medians["minidp"] * 1e3,
                     medians["minidp"] / medians["torch"], hidden["torch"], hidden["minidp"]))
    return rows

def main() -> None:
    per_rank = launch_from_command_line("minidp.distributed vs torch DDP, 2 processes on this machine", run_all, default_rounds=60, default_warmup=4)
    if per_rank is None:
        return
    print(f"{'case':44} {'buckets':>7} {'torch ms':>9} {'minidp ms':>9} {'ratio':>6} {'hidden torch':>12} {'hidden minidp':>13}")
    for name, buckets, theirs, ours, ratio, hidden_theirs, hidden_ours in summarise(per_rank):
        print(f"{name:44} {buckets:7d} {theirs:9.2f} {ours:9.2f} {ratio:6.3f} {hidden_theirs:12.0%} {hidden_ours:13.0%}")

if __name__ == "__main__":
    main()
