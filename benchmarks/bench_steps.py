"""The steps of one DataParallel forward and backward, alone: scatter, replicate, parallel_apply,
gather and the gradient reduction. Groups: ``<step>-<device>``; ``replicate-*`` compares minidp's
cached and uncached replicate with stock ``torch.nn.parallel.replicate`` (on CUDA, or on the CPU
under the tests' emulation of stock's CUDA-only calls, ``tests/stock_emulation.py``).
"""

from __future__ import annotations

import pytest
import torch

import minidp
from minidp import comm, ext
from minidp.device_ids import as_devices
from minidp.replica_cache import ReplicaCache

from .common import DEVICES, device_ids, run
from .models import resnet50_tree
from tests.stock_emulation import emulated_stock  # stock's replicate, timed on the CPU

REPLICAS = 2


def _images(device: str) -> torch.Tensor:
    return torch.randn(256, 3, 32, 32, device=device)


@pytest.mark.parametrize("device", DEVICES)
def bench_scatter(benchmark, device):
    benchmark.group = f"scatter-{device}"
    x, ids = _images(device), device_ids(device, REPLICAS)
    run(benchmark, lambda: minidp.scatter(x, ids), rounds=50, iterations=10)


@pytest.mark.parametrize("variant", ["uncached", "cached", "stock"])
@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("device", DEVICES)
def bench_replicate(benchmark, device, replicas, variant):
    benchmark.group = f"replicate-resnet50-x{replicas}-{device}"
    network = resnet50_tree().to(device)
    ids = device_ids(device, replicas)
    if variant == "stock":
        if device == "cpu":

            def replicate() -> list:
                with emulated_stock():
                    return torch.nn.parallel.replicate(network, [0] * replicas)

        else:
            replicate = lambda: torch.nn.parallel.replicate(network, ids)  # noqa: E731
        x = torch.randn(2, 3, 32, 32, device=device)
        assert torch.allclose(replicate()[1](x), network(x)), "the stock stand-in must give working replicas"
    elif variant == "cached":
        cache, devices = ReplicaCache(), as_devices(ids)

        def replicate() -> None:
            cache.replicate(network, devices)
            cache.release(devices)  # what a training step's backward leaves: replicas free to re-bind

    else:
        replicate = lambda: minidp.replicate(network, ids)  # noqa: E731
    run(benchmark, replicate, rounds=30, iterations=5)


@pytest.mark.parametrize("device", DEVICES)
def bench_parallel_apply(benchmark, device):
    benchmark.group = f"parallel_apply-{device}"
    layer = torch.nn.Linear(64, 64).to(device)
    ids = device_ids(device, REPLICAS)
    replicas = minidp.replicate(layer, ids, detach=True)
    inputs = [(torch.randn(32, 64, device=device),) for _ in ids]
    run(benchmark, lambda: minidp.parallel_apply(replicas, inputs, devices=ids), rounds=50, iterations=10)


@pytest.mark.parametrize("device", DEVICES)
def bench_gather(benchmark, device):
    benchmark.group = f"gather-{device}"
    outputs = [{"logits": torch.randn(128, 10, device=device), "features": torch.randn(128, 256, device=device)} for _ in range(REPLICAS)]
    run(benchmark, lambda: minidp.gather(outputs, device), rounds=50, iterations=10)


@pytest.mark.parametrize("variant", ["minidp-torch", "minidp-ext", "stock"])
@pytest.mark.parametrize("device", DEVICES)
def bench_gradient_reduction(benchmark, device, variant):
    """Summing the replicas' gradients of the ResNet-50 tree's 161 parameters: the backward of replicate."""
    benchmark.group = f"reduce-resnet50-{device}"
    params = list(resnet50_tree().to(device).parameters())
    grads = [[torch.randn_like(p) for p in params] for _ in range(REPLICAS)]
    if variant == "stock":
        if device == "cpu":
            pytest.skip("stock reduce_add_coalesced needs CUDA tensors")
        reduce = lambda: torch.nn.parallel.comm.reduce_add_coalesced(grads, 0)  # noqa: E731
        try:
            reduce()
        except Exception as error:  # stock's reduction may refuse replicas that share one GPU
            pytest.skip(f"stock reduce_add_coalesced with every replica on GPU 0: {error}")
    else:
        backend = variant.removeprefix("minidp-")
        if backend == "ext" and not ext.is_loaded():
            pytest.skip("the reduction extension is not loaded")
        reduce = lambda: comm.reduce_add_coalesced(grads, device, backend=backend)  # noqa: E731
    run(benchmark, reduce, rounds=30, iterations=5)
