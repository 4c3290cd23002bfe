"""Step 4, gather: joining the replicas' outputs into one (docs/stock-behaviour.md B28-B30)."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import minidp
from .helpers import RTOL_FLOAT64, Encoding, LayerCache, cpu_ids, garbage_left_by, max_relative_error
from .stock_emulation import swapped, emulated_stock, stock_functions, stock_scatter_gather

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


class _Scaled(collections.namedtuple("_Scaled", "value")):
    """A namedtuple whose constructor changes what it is given: built by calling its type, it would scale twice."""

    def __new__(cls, value):
        return super().__new__(cls, value * 2)


def test_a_namedtuple_is_rebuilt_with_make_as_stock_rebuilds_it(generator):
    """B28: stock's gather rebuilds a namedtuple with ``_make``, which runs no constructor of the user's."""
    outputs = [_Scaled(torch.randn(3, 2, generator=generator)), _Scaled(torch.randn(2, 2, generator=generator))]
    with emulated_stock():
        stock = nn.parallel.gather(outputs, 0)
    ours = minidp.gather(outputs, "cpu")
    assert type(ours) is _Scaled and torch.equal(ours.value, stock.value)
    assert torch.equal(ours.value, torch.cat([o.value for o in outputs]))


def test_a_single_replicas_output_is_gathered_into_a_new_tensor_as_stock_gathers_it(generator):
    """B28/B29: stock's Gather always allocates: a replica that returns its parameter, or a view of its chunk, gives an
    output whose in-place change reaches neither (a one-row batch on two devices runs one replica)."""

    class FirstColumns(nn.Module):
        def forward(self, x):
            return x[:, :2]

    x = torch.zeros(1, 4)
    output = minidp.DataParallel(FirstColumns(), cpu_ids(2))(x)
    output.add_(1)
    assert torch.equal(x, torch.zeros(1, 4)) and output.stride() == (2, 1)
    weight = nn.Parameter(torch.ones(1, 3))
    single = minidp.gather([weight], "cpu")
    assert single.data_ptr() != weight.data_ptr() and torch.equal(single, weight)


def test_dict_keys_may_come_in_any_order(generator):
    """Keys are matched by name (replica 0's order is kept), not by position."""
    a, b = torch.randn(2, 1, generator=generator), torch.randn(1, 1, generator=generator)
    out = minidp.gather([{"x": a, "y": a}, {"y": b, "x": b}], "cpu")
    assert list(out) == ["x", "y"] and torch.equal(out["y"], torch.cat([a, b]))


def test_a_mapping_that_is_not_a_dict_is_gathered_key_by_key_keeping_its_type(generator):
    """Beyond stock, whose last rule iterates over the mapping's keys and fails (B28)."""
    a, b = torch.randn(2, 1, generator=generator), torch.randn(1, 1, generator=generator)
    out = minidp.gather([Encoding(x=a, y=a), Encoding(y=b, x=b)], "cpu")
    assert type(out) is Encoding and list(out) == ["x", "y"] and torch.equal(out["y"], torch.cat([a, b]))
    with emulated_stock(), pytest.raises(ValueError, match="too many values to unpack"):
        stock_scatter_gather.gather([Encoding(x=a), Encoding(x=b)], 0)


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


# --------------------------------------------------------------------------------------------------
# objects that are neither tensors nor containers: stock's type(obj)(gathered items) (B28)
# --------------------------------------------------------------------------------------------------


class Opaque:
    """Neither a tensor, nor a container, nor iterable."""


class Fixed:
    """Iterable, but its constructor takes no items: it cannot be rebuilt from them."""

    def __init__(self) -> None:
        self.values = [torch.zeros(1)]

    def __iter__(self):
        return iter(self.values)


def layer_cache(rows: int, generator: torch.Generator, layers: int = 2) -> LayerCache:
    return LayerCache((torch.randn(rows, 2, 3, generator=generator), torch.randn(rows, 2, 3, generator=generator)) for _ in range(layers))


def test_an_iterable_object_is_rebuilt_from_its_gathered_items_as_stock_does(generator):
    """B28: stock builds ``type(out)(map(gather_map, zip(*outputs)))``: one cache whose layers hold every
    replica's keys and values, concatenated. minidp builds the same object."""
    outputs = [layer_cache(n, generator) for n in (3, 2)]
    ours = minidp.gather(outputs, "cpu")
    with emulated_stock():
        stock = nn.parallel.gather(outputs, 0)
    assert type(ours) is type(stock) is LayerCache and len(ours.layers) == len(stock.layers) == 2
    for layer, (mine, theirs) in enumerate(zip(ours.layers, stock.layers)):
        assert type(mine) is type(theirs) is tuple
        for position in range(2):
            expected = torch.cat([o.layers[layer][position] for o in outputs])
            assert torch.equal(mine[position], expected) and torch.equal(theirs[position], expected)


class CachingModel(nn.Module):
    """Returns logits and a per-layer cache of keys and values, like a decoder called with ``use_cache=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = nn.ModuleList(nn.Linear(4, 4, dtype=torch.float64) for _ in range(2))
        self.values = nn.ModuleList(nn.Linear(4, 4, dtype=torch.float64) for _ in range(2))

    def forward(self, x: torch.Tensor, use_cache: bool = False):
        layers = []
        for key, value in zip(self.keys, self.values):
            layers.append((key(x), value(x)))
            x = torch.tanh(layers[-1][0] + layers[-1][1])
        return {"logits": x, "cache": LayerCache(layers) if use_cache else None}


def test_a_cache_returned_by_every_replica_equals_the_single_device_cache(generator):
    """Through DataParallel (cache on and off, both backends): the gathered cache is one ``LayerCache``
    equal to the one the module returns for the whole batch, in float64."""
    model = CachingModel()
    x = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    expected = model(x, use_cache=True)["cache"]
    out = minidp.DataParallel(model, cpu_ids(3))(x, use_cache=True)
    assert type(out["cache"]) is LayerCache
    for got_layer, expected_layer in zip(out["cache"], expected, strict=True):
        for got, want in zip(got_layer, expected_layer, strict=True):
            assert max_relative_error(got, want) <= RTOL_FLOAT64


class TwoFields(tuple):
    """A tuple built from two fields, not from one iterable."""

    def __new__(cls, a: object, b: object) -> "TwoFields":
        return super().__new__(cls, (a, b))


@pytest.mark.parametrize(
    "make,message",
    [
        (Opaque, r"output\['state'\] is of type Opaque, which gather cannot join: .* not iterable"),
        (Fixed, r"output\['state'\] is of type Fixed, which gather cannot join: it iterates over 1 items, but "
                r"Fixed\(gathered items\) fails \(TypeError"),
        (lambda: torch.Size([3, 2]), r"output\['state'\] is of type Size, which gather cannot join: Size\(gathered "
                                     r"items\) fails \(torch.Size\(\) takes an iterable of 'int'"),
        (lambda: TwoFields(1, 2), r"output\['state'\] is of type TwoFields, which gather cannot join: "
                                  r"TwoFields\(gathered items\) fails"),
    ],
    ids=["not iterable", "built otherwise", "torch.Size", "tuple built from fields"],
)
def test_an_object_that_cannot_be_rebuilt_is_an_error_naming_its_type_and_path(make, message, generator):
    """Stock fails with ``TypeError: 'Opaque' object is not iterable`` (or the constructor's own error),
    without saying where the object sits in the output."""
    outputs = [{"y": torch.randn(2, 1, generator=generator), "state": make()} for _ in range(2)]
    with emulated_stock(), pytest.raises(TypeError):
        nn.parallel.gather(outputs, 0)
    with pytest.raises(TypeError, match=message):
        minidp.gather(outputs, "cpu")


def test_an_object_of_another_type_in_one_replica_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"output\[1\] is of type LayerCache in replica 0 but of type Opaque in replica 1"):
        minidp.gather([(1, LayerCache()), (2, Opaque())], "cpu")


def test_gpt2_cache_from_every_replica_equals_the_single_device_cache(generator):
    """Hugging Face's ``Trainer`` pattern on a real model, where transformers is installed: GPT-2 (a tiny
    random configuration, float64) with ``use_cache=True`` and ``num_items_in_batch`` one row per
    replica. The gathered cache is one ``DynamicCache`` equal to the single-device cache; the loss vector
    and the cache equal stock's; ``.mean()`` of the loss backpropagates."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(50, (4, 7), generator=generator)
    num_items = torch.tensor([[11.0], [11.0]])

    def cache_of(output):
        return output["cache"] if "cache" in output else output["past_key_values"]  # transformers >= 5: "cache"

    expected = cache_of(model(input_ids=ids, use_cache=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 0-dim losses' gather warning, transformers' deprecations
        ours = minidp.DataParallel(model, cpu_ids(2))(input_ids=ids, labels=ids, num_items_in_batch=num_items, use_cache=True)
        with emulated_stock():
            stock = nn.DataParallel(model, [0, 1])(input_ids=ids, labels=ids, num_items_in_batch=num_items, use_cache=True)
    assert type(cache_of(ours)) is type(expected) is type(cache_of(stock))
    assert cache_of(ours).get_seq_length() == expected.get_seq_length() == 7
    for got_layer, stock_layer, expected_layer in zip(cache_of(ours), cache_of(stock), expected, strict=True):
        for got, theirs, want in zip(got_layer, stock_layer, expected_layer, strict=True):
            if want is None:
                assert got is None and theirs is None
            else:
                assert torch.equal(got, theirs) and max_relative_error(got, want) <= RTOL_FLOAT64
    assert ours["loss"].shape == (2, 1) and torch.equal(ours["loss"], stock["loss"])
    ours["loss"].mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gather_leaves_no_reference_cycles(generator):
    """B36: stock clears its recursive ``gather_map`` closure by hand; minidp walks with a plain function."""
    outputs = [{"a": [torch.randn(n, 2, generator=generator)], "p": Pair(None, "s"), "c": layer_cache(n, generator)} for n in (2, 1)]
    assert garbage_left_by(lambda: minidp.gather(outputs, "cpu")) == 0


@pytest.mark.parametrize("layout", ["sparse_csr", "sparse_csc"])
def test_a_compressed_sparse_output_is_refused_naming_the_tensor_and_what_joins(layout, generator):
    """torch.cat cannot join compressed sparse tensors ("Sparse CSR tensors do not have is_contiguous", which stock's
    gather meets under the emulation too); minidp's error names the output and the layouts that join. A COO output
    joins (its own test above)."""
    outputs = [getattr(torch.randn(2, 3, generator=generator), f"to_{layout}")() for _ in range(2)]
    with emulated_stock(), pytest.raises(RuntimeError, match="do not have is_contiguous"):
        nn.parallel.gather(outputs, 0)
    with pytest.raises(TypeError, match=rf"tensor 0 is a torch\.{layout} tensor, which torch\.cat cannot join.*COO"):
        minidp.gather(outputs, "cpu")
