"""``python -m minidp bench``: how minidp compares with stock PyTorch, as ratios measured in one run.

Every row times a few variants of one thing *side by side*: the variants take turns, block by
block, for several rounds, and each variant's time is the median of its blocks. Only ratios of
times from the same run are printed, so a busy or slow machine shifts all variants alike.

Rows:

* ``step <model>``: a full training step (forward, loss, backward, optimizer) of one model,
  single device vs stock ``nn.DataParallel`` vs minidp with 1, 2 and 4 replicas. Without a GPU,
  stock ``DataParallel`` calls the module directly (it has no CPU replicas), so its column there
  is the single-device step; on a GPU, stock and minidp both run K replicas on GPU 0.
* ``replicate resnet50``: replicating a ResNet-50-shaped tree (161 parameters, 159 buffers,
  151 modules) with minidp's cache vs without it (vs stock ``replicate`` on a GPU).
* ``forward deep``: the forward of a deep, cheap model (:func:`deep_cheap`: 48 blocks of
  ``Linear``, ``BatchNorm1d`` and ``ReLU``) through ``DataParallel`` with the replica cache vs
  without it; the replicas' graph is then dropped, as a training step's backward leaves it. Beside
  them, the floor of both: the chunks through the model itself, one after the other; the forward with the
  replicas bound once and reused (scatter, parallel_apply and gather only: what no cache removes, so the lowest
  cached/uncached ratio the machine allows); and on CPU
  replicas, the cached forward with the replicas' backwards the other way than the default takes here
  (serial or in parallel, :func:`minidp.set_parallel_backward`): what the parallel backward's cut costs.
* ``overhead``: step time minus the single-device step time of the same batch, for minidp and
  for stock (GPU only): the cost of everything that is not the replicas' own compute.

The benchmarks in ``benchmarks/`` measure the same things with pytest-benchmark, more rounds.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..device_ids import as_device
from ..parallel_backward import applies, parallel_backward_settings
from ..replica_cache import ReplicaCache
from ..step2_replicate import replicate
from ..wrapper import DataParallel
from ..zoo import MLP, SmallCNN, resnet18, resnet50
from .args import parse_device


def side_by_side(variants: dict[str, Callable[[], object]], rounds: int, number: int) -> dict[str, float]:
    """Median seconds per call of each variant; the variants take turns, ``number`` calls per block."""
    for run in variants.values():  # warm-up: first-call costs (allocations, caches) are not steps
        run()
    # GPU work is asynchronous: a block ends when its kernels do. Only where the variants used a GPU: a synchronize
    # would otherwise initialise CUDA, and minidp's hooks then open NVTX ranges in a CPU run, which stock never pays.
    synchronize = torch.cuda.synchronize if torch.cuda.is_initialized() else lambda: None
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            gc.collect()  # a collection triggered by one variant's garbage lands in its own block
            synchronize()
            start = time.perf_counter()
            for _ in range(number):
                run()
            synchronize()
            times[name].append((time.perf_counter() - start) / number)
    return {name: statistics.median(values) for name, values in times.items()}


@dataclass
class StepCase:
    """A model and a batch for a full training step."""

    name: str
    build: Callable[[], nn.Module]
    batch: int
    input_shape: tuple[int, ...]
    classes: int


STEP_CASES = {
    "mlp": StepCase("mlp", MLP, 256, (16,), 4),
    "cnn": StepCase("cnn", SmallCNN, 256, (1, 28, 28), 10),
    "resnet18": StepCase("resnet18", lambda: resnet18(base=16), 32, (3, 32, 32), 10),
}


def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float = 1e-3) -> Callable[[], None]:
    """One SGD step of ``model`` on ``(x, y)``, as a function of no arguments."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        optimizer.step()

    return step


def step_variants(case: StepCase, device: torch.device, replicas: tuple[int, ...]) -> dict[str, Callable[[], None]]:
    """Training steps of ``case`` on ``device``: single, stock DataParallel, minidp with each replica count."""
    torch.manual_seed(0)
    x = torch.randn(case.batch, *case.input_shape, device=device)
    y = torch.randint(0, case.classes, (case.batch,), device=device)
    ids = (lambda k: [device.index or 0] * k) if device.type == "cuda" else (lambda k: ["cpu"] * k)
    model = case.build().to(device)
    # Every variant trains its own copy of the same weights: the same arithmetic, so the same speed.
    variants = {"single": training_step(copy.deepcopy(model), x, y)}
    if device.type == "cuda":
        variants["stock"] = training_step(nn.DataParallel(copy.deepcopy(model), ids(max(replicas))), x, y)
    else:  # stock DataParallel on the CPU: a direct call of the module, as it makes one without a GPU (with one, it
        # would take every GPU: there is no way to give it CPU ids)
        stock = copy.deepcopy(model)
        variants["stock"] = training_step(stock if torch.cuda.is_available() else nn.DataParallel(stock), x, y)
    for k in replicas:
        variants[f"minidp x{k}"] = training_step(DataParallel(copy.deepcopy(model), ids(k)), x, y)
    return variants


def replicate_variants(device: torch.device, replicas: int) -> dict[str, Callable[[], object]]:
    """Replicating a ResNet-50-shaped tree ``replicas`` times: uncached, cached, and stock on a GPU."""
    network = resnet50(base=8).to(device)
    devices = [device] * replicas
    cache = ReplicaCache()

    def cached() -> None:
        cache.replicate(network, devices)
        cache.release(devices)  # what a training step's backward leaves: replicas free to re-bind

    variants: dict[str, Callable[[], object]] = {"uncached": lambda: replicate(network, devices), "cached": cached}
    if device.type == "cuda":
        variants["stock"] = lambda: nn.parallel.replicate(network, [device.index or 0] * replicas)
    return variants


def deep_cheap(blocks: int = 48, width: int = 32) -> nn.Module:
    """A deep, cheap model: ``blocks`` of ``Linear(width, width)``, ``BatchNorm1d`` and ``ReLU`` (3 buffers
    each). Its operations are tiny, so a forward is mostly per-module work: replicating weighs most."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()) for _ in range(blocks)])


def forward_variants(device: torch.device, replicas: int) -> dict[str, Callable[[], object]]:
    """A training forward of :func:`deep_cheap` on ``replicas`` replicas of ``device``, with and without the cache."""
    torch.manual_seed(0)
    model = deep_cheap().to(device)
    x = torch.randn(16 * replicas, 32, device=device)
    ids = [device.index or 0] * replicas if device.type == "cuda" else ["cpu"] * replicas
    cached, uncached = DataParallel(model, ids), DataParallel(copy.deepcopy(model), ids, cache_replicas=False)

    def cached_forward() -> None:
        cached(x)
        cached.replica_cache.release(cached.device_ids)  # no backward follows: the replicas are free to re-bind

    # The forward with replicas bound once and reused as they are: scatter, parallel_apply and gather only, what
    # no cache can take away (not a valid training step: every call's graph shares one Broadcast node).
    prebound = DataParallel(model, ids)
    bound_once = replicate(model, ids)
    prebound.replicate = lambda module, device_ids: bound_once

    chunks = x.chunk(replicas)

    def direct() -> None:  # the replicas' own work, with nothing of data parallelism: the floor of both
        for chunk in chunks:
            model(chunk)

    in_parallel = applies([device] * replicas)  # the default's way ("auto")

    def cached_other_way() -> None:  # the difference is what cutting the graph for the parallel backward costs
        with parallel_backward_settings(not in_parallel):
            cached_forward()

    variants = {"uncached": lambda: uncached(x), "cached": cached_forward, "direct": direct, "bound once": lambda: prebound(x)}
    if device.type == "cpu" and replicas > 1:
        variants[f"cached with the {'serial' if in_parallel else 'parallel'} backward"] = cached_other_way
    return variants


@dataclass
class Row:
    name: str
    seconds: float
    vs_stock: Optional[float]
    vs_single: Optional[float]
    note: str = ""


GROUPS = ("step", "replicate", "forward")


def run_bench(device: torch.device, quick: bool, groups: tuple[str, ...] = GROUPS) -> list[Row]:
    rounds, number = (3, 2) if quick else (7, 5)
    # Weights trained over and over on one batch can drift into denormal numbers, which the CPU
    # handles many times slower, and differently in each variant: flush them while timing.
    flushed = torch.set_flush_denormal(True)
    try:
        return _run_bench(device, rounds, number, groups)
    finally:
        if flushed:
            torch.set_flush_denormal(False)


def _run_bench(device: torch.device, rounds: int, number: int, groups: tuple[str, ...]) -> list[Row]:
    rows: list[Row] = []
    stock_note = "stock: K replicas on GPU" if device.type == "cuda" else "stock: direct call (no GPU)"
    for case in STEP_CASES.values() if "step" in groups else ():
        times = side_by_side(step_variants(case, device, (1, 2, 4)), rounds, number)
        for name, seconds in times.items():
            if name.startswith("minidp"):
                rows.append(
                    Row(f"step {case.name} b{case.batch} {name}", seconds, seconds / times["stock"], seconds / times["single"], stock_note)
                )
        if device.type == "cuda":
            minidp_overhead = times["minidp x4"] - times["single"]
            stock_overhead = times["stock"] - times["single"]
            rows.append(Row(f"overhead {case.name} x4", minidp_overhead, minidp_overhead / stock_overhead, None, "step - single"))
    # the replica cache, cached against uncached: replicate alone on the ResNet-50 tree (against stock too), and
    # the training forward of a deep, cheap model
    for group, variants, label in (("replicate", replicate_variants, "replicate resnet50"),
                                   ("forward", forward_variants, "forward deep")):
        for k in (2, 4) if group in groups else ():
            times = side_by_side(variants(device, k), rounds, 5 * number)
            rows.append(
                Row(
                    f"{label} x{k} cached",
                    times["cached"],
                    times["cached"] / times["stock"] if "stock" in times else None,
                    None,
                    f"uncached {times['uncached'] * 1e3:.2f} ms, cached/uncached {times['cached'] / times['uncached']:.3f}"
                    + (f"; the chunks through the model, one after the other: {times['direct'] * 1e3:.2f} ms"
                       if "direct" in times else "")
                    + (f"; replicas bound once (no replicate step): {times['bound once'] * 1e3:.2f} ms, so cached/uncached "
                       f">= {times['bound once'] / times['uncached']:.3f} here" if "bound once" in times else "")
                    + "".join(f"; {name}: {seconds * 1e3:.2f} ms" for name, seconds in times.items()
                              if name.startswith("cached with")),
                )
            )
    return rows


def format_rows(rows: list[Row]) -> str:
    def ratio(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"{'benchmark':<34} {'minidp ms':>10} {'/ stock':>8} {'/ single':>9}  note", "-" * 90]
    for row in rows:
        lines.append(f"{row.name:<34} {row.seconds * 1e3:>10.2f} {ratio(row.vs_stock):>8} {ratio(row.vs_single):>9}  {row.note}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=parse_device, default=None, help="cpu or cuda (default: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--full", action="store_true", help="more rounds (default: a short run of about a minute)")
    parser.add_argument(
        "--only", type=_groups, default=GROUPS, metavar="ROWS",
        help=f"comma-separated row groups to run, of {', '.join(GROUPS)} (default: all)",
    )


def _groups(text: str) -> tuple[str, ...]:
    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in chosen if name not in GROUPS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown row group(s) {unknown or [text]}; choose from {', '.join(GROUPS)}")
    return chosen


def run(args: argparse.Namespace) -> int:
    # read as every primitive reads a device: "cuda" is the current GPU, 0 is cuda:0
    device = as_device(args.device if args.device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    load = ", load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    print(f"minidp bench on {device}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}{load}")
    print("times are medians of interleaved blocks; ratios compare variants measured in this run\n")
    print(format_rows(run_bench(device, quick=not args.full, groups=args.only)))
    return 0
