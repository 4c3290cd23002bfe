"""Step 4, gather: joining the replicas' outputs into one (docs/stock-behaviour.md B28-B30)."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import minidp
from .stock_emulation import swapped, emulated_stock, stock_functions

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    source: str


@pytest.mark.parametrize("target", ["cpu", -1, torch.device("cpu")])
def test_tensors_are_concatenated_on_the_target_device(target, generator):
    """B29: ``'cpu'`` and ``-1`` both mean the CPU; minidp also takes ``torch.device('cpu')``,
    which stock refuses, and does not emit stock's FutureWarning for ``-1`` (B29)."""
    parts = [torch.randn(n, 3, generator=generator) for n in (4, 4, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = minidp.gather(parts, target)
    assert torch.equal(out, torch.cat(parts)) and out.device.type == "cpu"


def test_gather_along_dim(generator):
    parts = [torch.randn(2, n, generator=generator) for n in (3, 1)]
    assert torch.equal(minidp.gather(parts, "cpu", dim=1), torch.cat(parts, 1))


def test_containers_are_rebuilt_like_stock(generator):
    """B28: dicts (type kept), lists, tuples and namedtuples are gathered element by element."""
    def output(n):
        t = torch.randn(n, 2, generator=generator)
        return {"a": [t, (t * 2,)], "b": collections.OrderedDict(c=t), "p": Pair(t, t + 1)}

    outputs = [output(3), output(2)]
    ours = minidp.gather(outputs, "cpu")
    with emulated_stock():
        stock = nn.parallel.gather(outputs, 0)
    assert type(ours["b"]) is collections.OrderedDict and type(ours["p"]) is Pair
    assert isinstance(ours["a"], list) and isinstance(ours["a"][1], tuple)
    assert torch.equal(ours["a"][0], stock["a"][0]) and torch.equal(ours["p"].right, stock["p"].right)
    assert torch.equal(ours["a"][1][0], torch.cat([o["a"][1][0] for o in outputs]))


def test_dict_keys_may_come_in_any_order(generator):
    """Keys are matched by name (replica 0's order is kept), not by position."""
    a, b = torch.randn(2, 1, generator=generator), torch.randn(1, 1, generator=generator)
    out = minidp.gather([{"x": a, "y": a}, {"y": b, "x": b}], "cpu")
    assert list(out) == ["x", "y"] and torch.equal(out["y"], torch.cat([a, b]))


def test_dataclasses_are_gathered_field_by_field(generator):
    """Beyond stock (which fails on a dataclass: it is not iterable)."""
    parts = [Prediction(torch.randn(n, 2, generator=generator), "net") for n in (2, 3)]
    out = minidp.gather(parts, "cpu")
    assert type(out) is Prediction and out.logits.shape == (5, 2)
    assert out.source == ["net", "net"]


def test_scalars_become_a_vector_with_stocks_warning(generator):
    """B30: 0-dim outputs (a per-replica loss) gather into a vector with one entry per
    replica, with the warning text of stock's ``Gather.forward`` (run here on meta tensors)."""
    losses = [torch.randn((), generator=generator) for _ in range(3)]
    with pytest.warns(UserWarning) as ours:
        vector = minidp.gather(losses, "cpu")
    assert torch.equal(vector, torch.stack(losses))
    with swapped(torch._C, "_gather", lambda tensors, dim, destination: torch.cat(tensors, dim)):
        with pytest.warns(UserWarning) as stock:
            stock_functions.Gather.apply(0, 0, *[loss.to("meta") for loss in losses])
    assert [str(w.message) for w in ours] == [str(w.message) for w in stock]


def test_gradient_of_a_scalar_gather_goes_back_to_each_scalar(generator):
    losses = [torch.randn((), generator=generator, requires_grad=True) for _ in range(2)]
    with pytest.warns(UserWarning):
        minidp.gather(losses, "cpu").sum().backward()
    assert all(loss.grad.shape == () and loss.grad.item() == 1.0 for loss in losses)


def test_none_gathers_to_none():
    """B28: ``None`` stays ``None``, in containers too."""
    assert minidp.gather([None, None], "cpu") is None
    assert minidp.gather([(None,), (None,)], "cpu") == (None,)
    assert minidp.gather([{"k": None}, {"k": None}], "cpu") == {"k": None}


def test_strings_become_a_list_not_a_map_object():
    """Where stock silently returns ``'<map object at ...>'`` (B28), minidp lists the values."""
    with emulated_stock():
        stock = nn.parallel.gather(["train", "train"], 0)
    assert stock.startswith("<map object")
    assert minidp.gather(["train", "eval"], "cpu") == ["train", "eval"]


def test_numbers_become_a_list():
    """Where stock raises ``'int' object is not iterable`` (B28)."""
    assert minidp.gather([1, 2, 3], "cpu") == [1, 2, 3]


def test_gradient_of_gather_is_a_scatter(generator):
    """Autograd records to/cat: the gathered output's gradient is split back onto each part."""
    parts = [torch.randn(n, 2, generator=generator, requires_grad=True) for n in (3, 1)]
    weights = torch.randn(4, 2, generator=generator)
    (minidp.gather(parts, "cpu") * weights).sum().backward()
    assert torch.equal(parts[0].grad, weights[:3]) and torch.equal(parts[1].grad, weights[3:])


def test_0_dim_outputs_along_another_dim_are_a_clear_error():
    """B30: stock fails with 'Dimension specified as -1 but tensor has no dimensions'; minidp says
    what to do instead."""
    with pytest.raises(ValueError, match="0-dim tensor, which has no dim 1"):
        minidp.gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu", dim=1)
