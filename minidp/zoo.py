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
| checkpoint  | BatchNorm recomputed in the backward (``torch.utils.checkpoint``)              |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .wrapper import data_parallel
from .device_ids import DeviceLike


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
    """The tutorial's pattern: the model itself is not wrapped; its ``forward`` parallelises its parts.

    ``device_ids``: where the parts run, given to every ``data_parallel`` call. ``None``: on the device the parts'
    parameters are on, as one call there; not ``data_parallel``'s ``None`` (every GPU), which would send a copy of
    the model on the CPU, or a replica of it on another GPU, chunks it cannot take.
    """

    def __init__(self, device_ids: Optional[Sequence[DeviceLike]] = None, classes: int = 10) -> None:
        super().__init__()
        self.device_ids = device_ids
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * 14 * 14, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_ids = self.device_ids if self.device_ids is not None else [self.features[0].weight.device]
        x = data_parallel(self.features, x, device_ids)
        return data_parallel(self.classifier, x, device_ids)


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


class CheckpointedBN(nn.Module):
    """A BatchNorm block under ``torch.utils.checkpoint`` (non-re-entrant, torch's recommended mode).

    Checkpointing saves no activation of the block: the backward runs the block's forward again, so
    its BatchNorm updates the running statistics twice per step (``num_batches_tracked`` counts 2).
    (Re-entrant checkpointing is checked in tests/test_recomputation.py: it runs one backward per
    replica inside the backward, and the order in which those add into ``.grad`` is not the same from
    one step to the next, so its float32 gradients are not bitwise repeatable, as the zoo's others are.)
    """

    def __init__(self, channels: int = 4, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv1d(channels, width, 3, padding=1)
        self.block = nn.Sequential(nn.BatchNorm1d(width), nn.ReLU(), nn.Conv1d(width, width, 3, padding=1))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(self.block, self.stem(x), use_reentrant=False)
        return self.head(y.mean(dim=2))


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
        ZooEntry("checkpoint", CheckpointedBN, lambda b, g: ((torch.randn(b, 4, 6, generator=g),), {})),
    ]
}


# --------------------------------------------------------------------------------------------------
# ResNet-shaped networks for the benchmarks (not in ZOO: too slow for the tests). Built in code, the
# layout of torchvision's resnet18 / resnet50: the same module tree, parameter and buffer counts.
# --------------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inputs: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inputs, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inputs, width * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


def _shortcut(inputs: int, outputs: int, stride: int) -> Optional[nn.Module]:
    if inputs == outputs and stride == 1:
        return None
    return nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))


class ResNet(nn.Module):
    """A ResNet for ``channels``-channel images; ``base`` scales every width (64 in the original)."""

    def __init__(self, block: type, layers: Sequence[int], classes: int = 10, channels: int = 3, base: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, base, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inputs, stages = base, []
        for stage, count in enumerate(layers):
            width = base * 2**stage
            blocks = []
            for i in range(count):
                blocks.append(block(inputs, width, 2 if i == 0 and stage > 0 else 1))
                inputs = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(classes: int = 10, channels: int = 3, base: int = 64) -> ResNet:
    """ResNet-18's tree: 62 parameters, 60 buffers, 68 modules (``base=64``: 11M parameters)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], classes, channels, base)


def resnet50(classes: int = 10, channels: int = 3, base: int = 64) -> ResNet:
    """ResNet-50's tree: 161 parameters, 159 buffers, 151 modules."""
    return ResNet(Bottleneck, [3, 4, 6, 3], classes, channels, base)
