"""What SyncBatchNorm costs: a training step's forward and backward with SyncBatchNorm vs BatchNorm.

    python benchmarks/bench_syncbn.py [--steps 30] [--batch 128] [--width 16] [--replicas 2 4]

The model is a small conv net with a BatchNorm2d after each of its three convs (the same weights
for both variants: the SyncBatchNorm one is ``minidp.SyncBatchNorm.convert_sync_batchnorm`` of a
copy), run by ``minidp.DataParallel`` on CPU replicas. The four variants (BatchNorm and
SyncBatchNorm at each replica count) take turns step by step, so that all see the same machine;
the report is each one's median step time and, per replica count, the ratio of the medians and
the median of the per-step ratios (each SyncBatchNorm step over the BatchNorm step just before it:
steadier when the machine's load changes during the run).

Then, on one thread, what a chunk's per-channel mean and variance cost, forward and backward, in
three ways: SyncBatchNorm's own ``_ChunkMoments`` node, the same two passes in plain ops, and
``torch.var_mean``: why the statistics have an autograd Function of their own.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from typing import Callable

import torch
from torch import nn

import minidp
from minidp.sync_batchnorm import _ChunkMoments


def conv_net(width: int, classes: int = 10) -> nn.Module:
    """Three conv + BatchNorm2d + ReLU blocks on 3x32x32 images, pooled, and a linear head."""
    blocks = []
    for inputs, outputs in ((3, width), (width, 2 * width), (2 * width, 2 * width)):
        conv = nn.Conv2d(inputs, outputs, 3, padding=1, bias=False)
        blocks += [conv, nn.BatchNorm2d(outputs), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(2 * width * 4 * 4, classes))


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()

    return step


def median_ms(function: Callable[[], None], rounds: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def statistics_costs(shape: tuple[int, ...], rounds: int) -> dict[str, float]:
    """Median ms of mean and biased variance per channel of a ``shape`` chunk, forward and backward."""
    x = torch.randn(shape, requires_grad=True)
    dims = [0, *range(2, x.dim())]
    grads = [torch.randn(shape[1]), torch.randn(shape[1])]

    def two_passes() -> tuple[torch.Tensor, torch.Tensor]:
        mean = x.mean(dims)
        return mean, (x - mean.view(1, -1, *[1] * (x.dim() - 2))).square().mean(dims)

    def var_mean() -> tuple[torch.Tensor, torch.Tensor]:
        variance, mean = torch.var_mean(x, dims, correction=0)
        return mean, variance

    ways = {
        "_ChunkMoments": lambda: _ChunkMoments.apply(x),  # float64 statistics: the gradients are cast to them
        "two passes, plain ops": two_passes,
        "torch.var_mean": var_mean,
    }
    def forward_backward(way: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        outputs = way()
        torch.autograd.backward(list(outputs), [grad.to(output.dtype) for grad, output in zip(grads, outputs)])

    return {name: median_ms(functools.partial(forward_backward, way), rounds) for name, way in ways.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant (after 3 warm-up steps)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()

    torch.manual_seed(0)
    model = conv_net(args.width)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    variants: dict[tuple[str, int], Callable[[], None]] = {}
    for k in args.replicas:
        batchnorm = copy.deepcopy(model)
        sync = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
        variants["BatchNorm", k] = forward_backward(minidp.DataParallel(batchnorm, ["cpu"] * k), x, y)
        variants["SyncBatchNorm", k] = forward_backward(minidp.DataParallel(sync, ["cpu"] * k), x, y)

    times: dict[tuple[str, int], list[float]] = {name: [] for name in variants}
    for step in range(3 + args.steps):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            if step >= 3:
                times[name].append(time.perf_counter() - start)

    print(
        f"conv net (3 BatchNorm2d layers, width {args.width}), batch {args.batch} of 3x32x32, forward+backward, "
        f"{args.steps} interleaved steps per variant, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'replicas':>8} {'BatchNorm ms':>13} {'SyncBatchNorm ms':>17} {'ratio of medians':>17} {'per-step ratio':>15}")
    for k in args.replicas:
        plain, synced = (statistics.median(times[name, k]) * 1e3 for name in ("BatchNorm", "SyncBatchNorm"))
        paired = statistics.median(s / b for s, b in zip(times["SyncBatchNorm", k], times["BatchNorm", k]))
        print(f"{k:>8} {plain:>13.2f} {synced:>17.2f} {synced / plain:>17.3f} {paired:>15.3f}")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    shape = (args.batch // 2, args.width, 32, 32)  # the first layer's chunk at 2 replicas
    print(f"\nper-channel mean and variance of a {shape} chunk, forward+backward, one thread, median ms:")
    for name, ms in statistics_costs(shape, args.steps).items():
        print(f"  {name:<22} {ms:8.2f}")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
