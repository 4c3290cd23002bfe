"""The demo's synthetic digits: made in code, reproducible, ten distinct classes, tutorial-style dict items."""

from __future__ import annotations

import itertools

import torch

from minidp.digits import SIZE, SyntheticDigits, glyph, make_digits


def test_items_are_dicts_of_image_and_label_like_the_tutorial():
    item = SyntheticDigits(5, seed=0)[3]
    assert set(item) == {"image", "label"}
    assert item["image"].shape == (1, SIZE, SIZE) and item["image"].dtype == torch.float32
    assert item["label"].dtype == torch.int64 and 0 <= int(item["label"]) <= 9


def test_a_dataloader_yields_dict_batches():
    batch = next(iter(torch.utils.data.DataLoader(SyntheticDigits(10, seed=0), batch_size=4)))
    assert batch["image"].shape == (4, 1, SIZE, SIZE) and batch["label"].shape == (4,)


def test_the_same_seed_gives_the_same_images_and_another_seed_does_not():
    images, labels = make_digits(50, seed=3)
    again_images, again_labels = make_digits(50, seed=3)
    other_images, _ = make_digits(50, seed=4)
    assert torch.equal(images, again_images) and torch.equal(labels, again_labels)
    assert not torch.equal(images, other_images)


def test_every_class_appears():
    _, labels = make_digits(500, seed=0)
    assert set(labels.tolist()) == set(range(10))


def test_the_ten_glyphs_are_distinct_at_every_stroke_width():
    for stroke in (2, 3):
        for a, b in itertools.combinations(range(10), 2):
            assert not torch.equal(glyph(a, stroke), glyph(b, stroke)), (a, b, stroke)


def lit_box(picture: torch.Tensor) -> torch.Tensor:
    """The smallest rectangle holding every lit pixel of ``picture``, as booleans."""
    lit = picture > 0
    rows, cols = lit.any(dim=1).nonzero(), lit.any(dim=0).nonzero()
    return lit[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]


def test_without_noise_an_image_is_its_label_s_glyph_moved():
    images, labels = make_digits(50, seed=1, noise=0.0)
    for image, label in zip(images, labels):
        assert any(torch.equal(lit_box(image[0]), lit_box(glyph(int(label), w))) for w in (2, 3))
