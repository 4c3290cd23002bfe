"""The benchmarks' models and batches: the zoo's MLP and demo CNN, and a ResNet-18-style network.

The ResNet builders live in ``minidp.zoo`` (``python -m minidp bench`` uses them too; the package
never imports from ``benchmarks/``); this module fixes their sizes for the benchmarks.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from minidp.zoo import MLP, SmallCNN, resnet18, resnet50

from .common import QUICK

# name -> (build, batch size, input shape, classes)
STEP_MODELS: dict[str, tuple[Callable[[], nn.Module], int, tuple[int, ...], int]] = {
    "mlp": (MLP, 256, (16,), 4),
    "cnn": (SmallCNN, 256, (1, 28, 28), 10),  # the demo CNN at batch 256: the 2-CPU-replica target
    "resnet18": (lambda: resnet18(base=8 if QUICK else 16), 16 if QUICK else 32, (3, 32, 32), 10),
}


def resnet50_tree() -> nn.Module:
    """ResNet-50's module tree (161 parameters, 159 buffers, 151 modules) at 1/8 width: replicate's cost
    is in the tree, not in the widths."""
    return resnet50(base=8)


def batch(name: str, device: str, generator_seed: int = 0, size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and class labels for ``name``'s step, ``size`` rows (by default the model's batch size), seeded."""
    _, default_size, shape, classes = STEP_MODELS[name]
    size = default_size if size is None else size
    generator = torch.Generator().manual_seed(generator_seed)
    x = torch.randn(size, *shape, generator=generator)
    y = torch.randint(0, classes, (size,), generator=generator)
    return x.to(device), y.to(device)
