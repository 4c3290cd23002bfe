"""A full training step (forward, loss, backward, SGD): single device vs stock vs minidp.

Groups are ``step-<model>-<device>``; within a group compare the rows (one run, same machine):
``single`` (the plain module), ``stock`` (``torch.nn.DataParallel``), ``minidp-x1/x2/x4``.
On the CPU, stock DataParallel has no replicas: without a GPU it calls the module directly, so
its row there is the single-device step plus its wrapper's call. On CUDA both run K replicas on GPU 0.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minidp
from minidp.cli.bench import training_step

from .common import DEVICES, device_ids, run
from .models import STEP_MODELS, batch


def wrap(variant: str, module: nn.Module, device: str) -> nn.Module:
    if variant == "single":
        return module
    if variant == "stock":  # CPU: no CPU ids exist, a direct call (the module itself where a GPU would be taken)
        if device == "cpu":                                           # CUDA: 2 replicas on GPU 0
            return module if torch.cuda.is_available() else nn.DataParallel(module)
        return nn.DataParallel(module, device_ids(device, 2))
    return minidp.DataParallel(module, device_ids(device, int(variant.removeprefix("minidp-x"))))


@pytest.mark.parametrize("variant", ["single", "stock", "minidp-x1", "minidp-x2", "minidp-x4"])
@pytest.mark.parametrize("model_name", sorted(STEP_MODELS))
@pytest.mark.parametrize("device", DEVICES)
def bench_training_step(benchmark, device, model_name, variant):
    benchmark.group = f"step-{model_name}-{device}"
    torch.manual_seed(0)
    module = STEP_MODELS[model_name][0]().to(device)
    run(benchmark, training_step(wrap(variant, module, device), *batch(model_name, device)), rounds=10)
