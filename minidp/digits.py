"""Synthetic digits: a learnable 10-class image data set made in code, so the demo needs no download.

Each image is a seven-segment digit (the kind on a clock radio) drawn on a 1x28x28 canvas, with
a random stroke width, brightness and position, plus Gaussian noise. The same ``seed`` always
gives the same images. Items are dicts ``{'image': 1x28x28 float tensor, 'label': int64 tensor}``,
so a ``DataLoader`` yields the dict batches of the tutorial: ``data['image']``, ``data['label']``.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

SIZE = 28  # images are 1 x SIZE x SIZE
_HEIGHT, _WIDTH = 18, 11  # the glyph's box before it is moved
_MAX_SHIFT = 4  # pixels up/down/left/right; the glyph stays inside the canvas

_MIDDLE = _HEIGHT // 2


def _segments(w: int) -> dict[str, tuple[slice, slice]]:
    """Each segment's (rows, columns) in the glyph box, for stroke width ``w``::

         aaa
         f b
         ggg
         e c
         ddd
    """
    return {
        "a": (slice(0, w), slice(0, _WIDTH)),
        "b": (slice(0, _MIDDLE + 1), slice(_WIDTH - w, _WIDTH)),
        "c": (slice(_MIDDLE, _HEIGHT), slice(_WIDTH - w, _WIDTH)),
        "d": (slice(_HEIGHT - w, _HEIGHT), slice(0, _WIDTH)),
        "e": (slice(_MIDDLE, _HEIGHT), slice(0, w)),
        "f": (slice(0, _MIDDLE + 1), slice(0, w)),
        "g": (slice(_MIDDLE - w // 2, _MIDDLE - w // 2 + w), slice(0, _WIDTH)),
    }


_DIGIT_SEGMENTS = ["abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg"]


def glyph(digit: int, stroke: int = 2) -> torch.Tensor:
    """The clean ``_HEIGHT x _WIDTH`` picture of ``digit`` (0..9): 1 on its segments, 0 elsewhere."""
    picture = torch.zeros(_HEIGHT, _WIDTH)
    segments = _segments(stroke)
    for name in _DIGIT_SEGMENTS[digit]:
        picture[segments[name]] = 1.0
    return picture


def make_digits(samples: int, seed: int, noise: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` images (``samples x 1 x 28 x 28``, float32) and their labels (int64, 0..9)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    strokes = torch.randint(2, 4, (samples,), generator=generator)
    brightness = torch.empty(samples).uniform_(0.6, 1.0, generator=generator)
    shifts = torch.randint(-_MAX_SHIFT, _MAX_SHIFT + 1, (samples, 2), generator=generator)
    glyphs = {(d, w): glyph(d, w) for d in range(10) for w in (2, 3)}

    images = torch.randn(samples, 1, SIZE, SIZE, generator=generator) * noise
    top, left = (SIZE - _HEIGHT) // 2, (SIZE - _WIDTH) // 2
    for i in range(samples):
        row, col = top + int(shifts[i, 0]), left + int(shifts[i, 1])
        picture = glyphs[int(labels[i]), int(strokes[i])]
        images[i, 0, row : row + _HEIGHT, col : col + _WIDTH] += brightness[i] * picture
    return images, labels


class SyntheticDigits(Dataset):
    """``samples`` synthetic digits; item ``i`` is ``{'image': 1x28x28 tensor, 'label': int64 tensor}``."""

    def __init__(self, samples: int, seed: int = 0, noise: float = 0.4) -> None:
        self.images, self.labels = make_digits(samples, seed, noise)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[index], "label": self.labels[index]}
