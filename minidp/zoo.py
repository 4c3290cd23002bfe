"""A small zoo of models that exercise every path of data parallelism.

Each entry builds a model and a batch for it; the tests, ``minidp.verify``, the command line and the
benchmarks all draw from here, so "the MLP" means the same thing everywhere.

| name        | what it exercises                                                              |
|-------------|--------------------------------------------------------------------------------|
| mlp         | the plain case: a tensor in, a tensor out                                      |
| cnn         | the tutorial's small CNN, trained on dict batches ``{'image', 'label'}``       |
| vgg_split   | ``minidp.data_parallel`` called on sub-modules inside ``forward``              |
| resnet_bn   | a residual block with BatchNorm: per-chunk batch statistics, running buffers   |
| lstm        | a recurrent model, batch along ``dim=1``, tuple outputs                        |
| kwargs_dict | keyword arguments in, a dict with a tensor, a string and ``None`` out          |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .data_parallel import data_parallel
from .devices import DeviceLike


class MLP(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """The tutorial's kind of image classifier: two conv blocks and a linear head (1x28x28 images)."""

    def __init__(self, classes: int = 10, channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 7 * 7, classes))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(image))


class VGGSplit(nn.Module):
    """The tutorial's pattern: the model itself is not wrapped; its ``forward`` parallelises its parts."""

    def __init__(self, device_ids: Optional[Sequence[DeviceLike]] = None, classes: int = 10) -> None:
        super().__init__()
        self.device_ids = device_ids
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * 14 * 14, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = data_parallel(self.features, x, self.device_ids)
        return data_parallel(self.classifier, x, self.device_ids)


class ResNetBlockBN(nn.Module):
    """A residual block with BatchNorm, then a pooled linear head."""

    def __init__(self, channels: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.head(torch.relu(x + y).mean(dim=(2, 3)))


class LSTMModel(nn.Module):
    """Sequence-first LSTM: the batch is dim 1, so DataParallel needs ``dim=1``."""

    def __init__(self, features: int = 6, hidden: int = 12) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, (h, _) = self.lstm(x)
        return self.head(out), h


class KwargsDict(nn.Module):
    """Keyword arguments in; a dict with a tensor, a string and ``None`` out."""

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(features, features)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        return {"y": self.proj(x) * mask * scale, "kind": "masked", "extra": None}


@dataclass
class ZooEntry:
    """How to build one zoo model and a batch for it (``inputs``, ``kwargs``), and its batch ``dim``."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[tuple, dict]]
    dim: int = 0
    loss: Callable[[Any], torch.Tensor] = lambda output: output.pow(2).mean()


def _images(batch: int, generator: torch.Generator, channels: int = 1, size: int = 28) -> torch.Tensor:
    return torch.randn(batch, channels, size, size, generator=generator)


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in [
        ZooEntry("mlp", MLP, lambda b, g: ((torch.randn(b, 16, generator=g),), {})),
        ZooEntry("cnn", SmallCNN, lambda b, g: ((_images(b, g),), {})),
        ZooEntry("vgg_split", VGGSplit, lambda b, g: ((_images(b, g),), {})),
        ZooEntry("resnet_bn", ResNetBlockBN, lambda b, g: ((_images(b, g, 3, 8),), {})),
        ZooEntry(
            "lstm", LSTMModel, lambda b, g: ((torch.randn(5, b, 6, generator=g),), {}), dim=1,
            loss=lambda output: output[0].pow(2).mean() + output[1].pow(2).mean(),
        ),
        ZooEntry(
            "kwargs_dict", KwargsDict,
            lambda b, g: ((torch.randn(b, 8, generator=g),), {"mask": torch.rand(b, 8, generator=g), "scale": 0.5}),
            loss=lambda output: output["y"].pow(2).mean(),
        ),
    ]
}
