"""Step 1, scatter: how a batch is cut into one chunk per replica (docs/stock-behaviour.md B12-B17)."""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses

import pytest
import torch
from torch import nn

import minidp
from .helpers import RTOL_FLOAT64, Encoding, cpu_ids, garbage_left_by, max_relative_error
from .stock_emulation import emulated_stock, stock_scatter_gather

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    label: torch.Tensor
    note: str = "train"


@pytest.mark.parametrize(
    "rows,replicas,sizes",
    [(10, 3, [4, 4, 2]), (10, 4, [3, 3, 3, 1]), (5, 4, [2, 2, 1]), (6, 4, [2, 2, 2]), (4, 3, [2, 2]), (2, 4, [1, 1]), (7, 1, [7])],
)
def test_chunks_follow_torch_chunk(rows, replicas, sizes, generator):
    """B15: sizes are torch.chunk's (ceil(B/n) each, so fewer chunks than devices can come back)."""
    x = torch.randn(rows, 3, generator=generator)
    chunks = minidp.scatter(x, cpu_ids(replicas))
    assert [c.shape[0] for c in chunks] == sizes == [c.shape[0] for c in x.chunk(replicas)]
    assert torch.equal(torch.cat(chunks), x)
    with emulated_stock():
        stock = nn.parallel.scatter(x, list(range(replicas)))
    assert [c.shape[0] for c in stock] == sizes


@pytest.mark.parametrize("chunk_weights", [None, [2, 1, 1]])
def test_an_empty_batch_gives_every_device_an_empty_chunk(chunk_weights):
    """B15: 0 rows give n empty chunks, as torch.chunk cuts them (chunk_weights' shares of 0 rows too)."""
    x = torch.empty(0, 3)
    chunks = minidp.scatter(x, cpu_ids(3), chunk_weights=chunk_weights)
    assert [tuple(c.shape) for c in chunks] == [(0, 3)] * 3
    with emulated_stock():
        assert [tuple(c.shape) for c in nn.parallel.scatter(x, [0, 1, 2])] == [(0, 3)] * 3


def test_chunk_sizes_give_an_explicit_split(generator):
    """``chunk_sizes`` (stock's Scatter argument, for unequal GPUs) splits as torch.split does."""
    x = torch.randn(10, 2, generator=generator)
    chunks = minidp.scatter(x, cpu_ids(3), chunk_sizes=[1, 2, 7])
    assert [c.shape[0] for c in chunks] == [1, 2, 7]
    assert all(torch.equal(a, b) for a, b in zip(chunks, x.split([1, 2, 7])))


def test_scatter_kwargs_passes_chunk_sizes_to_inputs_and_kwargs(generator):
    x, m = torch.randn(6, 2, generator=generator), torch.randn(6, 1, generator=generator)
    inputs, kwargs = minidp.scatter_kwargs((x,), {"mask": m}, cpu_ids(2), chunk_sizes=[5, 1])
    assert [i[0].shape[0] for i in inputs] == [5, 1] and [k["mask"].shape[0] for k in kwargs] == [5, 1]


@pytest.mark.parametrize("container", [list, tuple, Pair], ids=["list", "tuple", "namedtuple"])
def test_scatter_kwargs_gives_each_replica_its_inputs_in_the_container_stock_gives(container, generator):
    """B12: the positional arguments are scattered as the object they are: a list's pieces are lists, a namedtuple's
    of its type, a tuple's tuples."""
    x = torch.randn(4, 3, generator=generator)
    inputs = container((x, x)) if container is not Pair else Pair(x, x)
    ours, _ = minidp.scatter_kwargs(inputs, {}, cpu_ids(2))
    with emulated_stock():
        stock, _ = stock_scatter_gather.scatter_kwargs(inputs, {}, [0, 1])
    assert [type(piece) for piece in ours] == [type(piece) for piece in stock] == [container] * 2


@pytest.mark.parametrize("dim", [1, -1])
def test_scatter_along_another_dim(dim, generator):
    """B15: ``dim`` may be negative; it is wrapped."""
    x = torch.randn(2, 9, generator=generator)
    chunks = minidp.scatter(x, cpu_ids(2), dim=dim)
    assert [c.shape for c in chunks] == [torch.Size([2, 5]), torch.Size([2, 4])]


def test_a_bare_tensor_gives_a_tuple_anything_else_a_list(generator):
    """B13: a top-level tensor scatters into a tuple; any other input into a list."""
    x = torch.randn(4, 1, generator=generator)
    assert isinstance(minidp.scatter(x, cpu_ids(2)), tuple)
    assert isinstance(minidp.scatter((x,), cpu_ids(2)), list)
    assert isinstance(minidp.scatter([x], cpu_ids(2)), list)


def test_the_first_chunk_on_the_source_device_is_a_view_and_the_others_there_copies(generator):
    """B16: a chunk bound for the device the tensor is on shares its storage; stock has one such chunk where each
    replica has a device of its own. Replicas that share the device get chunks of their own, as they would there."""
    x = torch.randn(6, 2, generator=generator)
    first, *others = minidp.scatter(x, cpu_ids(3))
    assert first.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert all(chunk.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for chunk in others)
    assert torch.equal(torch.cat([first, *others]), x)


def test_containers_are_scattered_recursively_like_stock(generator):
    """B12: tuples, lists, dicts (OrderedDict keeps its type) and namedtuples, at any depth."""
    x, y = torch.randn(6, 2, generator=generator), torch.randn(6, generator=generator)
    inputs = (x, [y, {"a": x}], collections.OrderedDict(b=y), Pair(x, y))
    ours = minidp.scatter(inputs, cpu_ids(3))
    with emulated_stock():
        stock = nn.parallel.scatter(inputs, [0, 1, 2])
    assert len(ours) == len(stock) == 3
    for mine, theirs in zip(ours, stock):
        assert _same_structure_and_values(mine, theirs)
        assert type(mine[2]) is collections.OrderedDict and type(mine[3]) is Pair


class _Pair(tuple):
    """A tuple subclass whose constructor takes its two items, not an iterable."""

    def __new__(cls, first, second):
        return super().__new__(cls, (first, second))


def test_tuple_and_list_subclasses_reach_the_replicas_as_plain_tuples_and_lists_as_in_stock(generator):
    """B12: stock's scatter builds plain tuples and lists; a torch.Size, or a subclass whose constructor takes other
    arguments (which rebuilding it by its type would break), reaches each replica as a tuple."""
    x = torch.randn(6, 2, generator=generator)
    inputs = (_Pair(x, x * 2), torch.Size([6, 2]), type("Rows", (list,), {})([x]))
    ours = minidp.scatter(inputs, cpu_ids(2))
    with emulated_stock():
        stock = nn.parallel.scatter(inputs, [0, 1])
    for mine, theirs in zip(ours, stock, strict=True):
        assert _same_structure_and_values(mine, theirs)
        assert [type(part) for part in mine] == [tuple, tuple, list]


def _same_structure_and_values(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_structure_and_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_structure_and_values(u, v) for u, v in zip(a, b))
    return a is b


def test_dataclasses_are_scattered_field_by_field(generator):
    """Beyond stock (which passes a dataclass to every replica whole, B12)."""
    batch = Batch(torch.randn(5, 2, generator=generator), torch.arange(5))
    pieces = minidp.scatter(batch, cpu_ids(2))
    assert [type(p) for p in pieces] == [Batch, Batch]
    assert [p.label.tolist() for p in pieces] == [[0, 1, 2], [3, 4]]
    assert all(p.note is batch.note for p in pieces)
    assert batch.label.shape == (5,), "the original dataclass is left as it was"


def test_defaultdict_keeps_its_type_and_factory(generator):
    """Beyond stock: stock raises 'first argument must be callable or None' rebuilding it (B12)."""
    d = collections.defaultdict(list, x=torch.randn(4, 1, generator=generator))
    pieces = minidp.scatter(d, cpu_ids(2))
    assert all(type(p) is collections.defaultdict and p.default_factory is list for p in pieces)


def test_a_mapping_that_is_not_a_dict_is_scattered_key_by_key_keeping_its_type(generator):
    """Beyond stock, which gives every replica the whole mapping, so that each runs the whole batch (B12)."""
    batch = Encoding(input_ids=torch.arange(10).view(5, 2), mask=torch.randn(5, 2, generator=generator), note="text")
    pieces = minidp.scatter((batch,), cpu_ids(2))
    assert [type(piece) for (piece,) in pieces] == [Encoding, Encoding]
    assert [piece["input_ids"].tolist() for (piece,) in pieces] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9]]]
    assert all(piece["note"] == "text" for (piece,) in pieces)
    with emulated_stock():
        assert all(piece is batch for (piece,) in stock_scatter_gather.scatter((batch,), [0, 1]))


def test_a_model_given_a_batch_mapping_that_is_not_a_dict_returns_the_single_devices_output(generator):
    """The tutorial's ``model(data)`` with ``data['image']``, where the batch is a UserDict (Hugging Face's
    ``BatchFeature``): each replica runs its rows, so the output has the batch's rows, as on one device (in stock,
    each replica runs the whole batch: twice the rows, B12)."""

    class ReadsTheBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 2).double()

        def forward(self, data):
            return self.linear(data["image"])

    module = ReadsTheBatch()
    batch = Encoding(image=torch.randn(5, 3, generator=generator, dtype=torch.float64))
    output, expected = minidp.DataParallel(module, cpu_ids(2))(batch), module(batch)
    assert output.shape == expected.shape == (5, 2) and max_relative_error(output, expected) <= RTOL_FLOAT64


def test_a_mapping_its_type_cannot_rebuild_from_a_dict_is_an_error_naming_it_and_the_fix(generator):
    class Pairs(collections.abc.Mapping):  # a read-only mapping whose constructor takes two sequences, not a dict
        def __init__(self, keys, values):
            self._items = dict(zip(keys, values))

        def __getitem__(self, key):
            return self._items[key]

        def __iter__(self):
            return iter(self._items)

        def __len__(self):
            return len(self._items)

    with pytest.raises(TypeError, match=r"a .*Pairs \(a mapping\) cannot be rebuilt from a dict .*pass a dict instead"):
        minidp.scatter((Pairs(["x"], [torch.randn(4, 1, generator=generator)]),), cpu_ids(2))


def test_non_tensors_reach_every_replica_by_reference(generator):
    """B12: an object scatter does not look inside is the same object on every replica, not a copy."""
    x, opaque, tags = torch.randn(4, 1, generator=generator), object(), {"a", "b"}
    pieces = minidp.scatter((x, opaque, tags, "text"), cpu_ids(2))
    assert all(p[1] is opaque and p[2] is tags and p[3] == "text" for p in pieces)


def test_a_hugging_face_cache_for_several_replicas_is_refused_naming_it_before_any_replica_runs(generator):
    """B12: a ``DynamicCache`` given as ``past_key_values`` is an object scatter gives whole to every replica, and
    stock's docstring warns that a replica writing to such an object corrupts it: every replica's attention appends
    its rows to the one cache. minidp refuses it by name and says how to run a cache; the cache stays empty."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=16)
    model = minidp.DataParallel(transformers.GPT2LMHeadModel(config).double().eval(), cpu_ids(2))
    cache = transformers.DynamicCache()
    with pytest.raises(ValueError, match=r"kwargs\['past_key_values'\] is a Hugging Face DynamicCache, which every one "
                                         r"of the 2 replicas would get whole.*model\.module\(\.\.\.\)"):
        model(input_ids=torch.randint(20, (4, 3), generator=generator), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0


def test_inputs_without_tensors_go_to_every_device():
    """B7/B12: non-tensor inputs are repeated once per device (all devices are used)."""
    assert minidp.scatter(("a", 1), cpu_ids(3)) == [("a", 1)] * 3


def test_inputs_without_tensors_get_containers_of_their_own_on_each_device_as_stock_rebuilds_them():
    """B12: containers are rebuilt even when they hold no tensor (a tuple subclass as a plain tuple), so a replica
    that appends to a list it was given changes neither the caller's nor another replica's."""
    tags = ["start"]
    inputs = (tags, {"a": 3}, torch.Size([2, 3]))
    ours = minidp.scatter(inputs, cpu_ids(2))
    with emulated_stock():
        stock = stock_scatter_gather.scatter(inputs, [0, 1])
    assert ours == stock and [type(piece[2]) for piece in ours] == [type(piece[2]) for piece in stock] == [tuple] * 2
    assert ours[0][0] is not ours[1][0] and all(piece[0] is not tags for piece in ours)


def test_gradient_of_scatter_is_a_gather(generator):
    """Autograd records split/to: the chunks' gradients flow back, concatenated, to the input."""
    x = torch.randn(5, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    chunks = minidp.scatter(x, cpu_ids(3))
    sum((c * w).sum() for c, w in zip(chunks, weights.split([2, 2, 1]))).backward()
    assert torch.equal(x.grad, weights)


# --------------------------------------------------------------------------------------------------
# scatter_kwargs: padding (B17)
# --------------------------------------------------------------------------------------------------


def test_kwargs_only_pads_inputs_with_empty_tuples(generator):
    """B17 (a): kwargs-only calls get ``()`` as positional arguments on every replica, as in stock."""
    k = torch.randn(4, 1, generator=generator)
    inputs, kwargs = minidp.scatter_kwargs((), {"k": k}, cpu_ids(2))
    with emulated_stock():
        stock_inputs, stock_kwargs = nn.parallel.scatter_gather.scatter_kwargs((), {"k": k}, [0, 1])
    assert inputs == stock_inputs == ((), ())
    assert [v["k"].shape[0] for v in kwargs] == [v["k"].shape[0] for v in stock_kwargs] == [2, 2]


@pytest.mark.parametrize("kwargs", [None, {}])
def test_positional_only_pads_kwargs_with_empty_dicts(kwargs, generator):
    """B17 (b): ``kwargs=None`` and ``{}`` are the same; every replica gets ``{}``."""
    x = torch.randn(5, 1, generator=generator)
    inputs, out_kwargs = minidp.scatter_kwargs((x,), kwargs, cpu_ids(4))
    assert len(inputs) == 3 and out_kwargs == ({}, {}, {})


def test_kwargs_that_cut_into_fewer_chunks_than_the_inputs_are_an_error_naming_both(generator):
    """B17 (c)/(d): stock scatters ``(x5,)`` and ``{'k': x2}`` separately on 4 devices (3 chunks
    against 2) and does not pad, or pads so that trailing replicas silently lose ``k``. minidp cuts
    both as one batch, so a replica never runs without its part of ``k``."""
    x5, x2 = torch.randn(5, 1, generator=generator), torch.randn(2, 1, generator=generator)
    with emulated_stock():
        stock_inputs, stock_kwargs = nn.parallel.scatter_gather.scatter_kwargs((x5,), {"k": x2}, [0, 1, 2, 3])
    assert (len(stock_inputs), len(stock_kwargs)) == (3, 2)
    with pytest.raises(ValueError, match=r"kwargs\['k'\] has 2 rows along dim 0, which cut by torch.chunk into 2 "
                       r"chunk\(s\) \[1, 1\] for 4 devices, but inputs\[0\] has 5 rows, which cut into 3"):
        minidp.scatter_kwargs((x5,), {"k": x2}, cpu_ids(4))


def test_non_tensor_kwargs_reach_as_many_replicas_as_the_inputs_where_stock_is_wrong(generator):
    """B17 (a): ``(x2,)`` with ``{'flag': True}`` on 4 devices: stock cuts 2 input chunks but makes 4
    kwargs copies, then pads the inputs with ``()``, so replicas 2 and 3 get no ``x``; minidp gives 2
    of each."""
    x2 = torch.randn(2, 3, generator=generator)
    with emulated_stock():
        stock_inputs, stock_kwargs = nn.parallel.scatter_gather.scatter_kwargs((x2,), {"flag": True}, [0, 1, 2, 3])
    assert [len(i) for i in stock_inputs] == [1, 1, 0, 0] and len(stock_kwargs) == 4
    inputs, kwargs = minidp.scatter_kwargs((x2,), {"flag": True}, cpu_ids(4))
    assert [i[0].shape[0] for i in inputs] == [1, 1] and kwargs == ({"flag": True}, {"flag": True})


# --------------------------------------------------------------------------------------------------
# tensors of different sizes: each cut by its own torch.chunk sizes, into as many chunks (B14, B15)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows,replicas",
    [((6, 3), 2), ((4, 2), 2), ((10, 3), 3), ((7, 4), 4), ((8, 2, 4), 2), ((9, 5), 3)],
)
def test_tensors_of_different_sizes_that_cut_into_as_many_chunks_are_cut_as_stock_cuts_them(rows, replicas, generator):
    """B14/B15: stock cuts every tensor by its own ``torch.chunk``; where the numbers of chunks agree,
    ``zip`` drops nothing and every replica gets its chunk of each tensor. minidp cuts the same chunks."""
    tensors = tuple(torch.randn(n, 2, generator=generator) for n in rows)
    ours = minidp.scatter(tensors, cpu_ids(replicas))
    with emulated_stock():
        stock = nn.parallel.scatter(tensors, list(range(replicas)))
    assert len(ours) == len(stock) == len(tensors[0].chunk(replicas))
    for mine, theirs in zip(ours, stock):
        assert _same_structure_and_values(mine, theirs)
    for i, tensor in enumerate(tensors):
        assert [piece[i].shape[0] for piece in ours] == [c.shape[0] for c in tensor.chunk(replicas)]


class CausalLMWithLossKeywords(nn.Module):
    """The signature Hugging Face's ``Trainer`` calls: ``input_ids``, ``labels`` and ``num_items_in_batch``;
    the loss is summed over the tokens and divided by ``num_items_in_batch``, as transformers' causal-LM
    loss does. Records what each call received (a list in a plain attribute, shared by the replicas)."""

    def __init__(self, vocab: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 6, dtype=torch.float64)
        self.head = nn.Linear(6, vocab, dtype=torch.float64)
        self.received: list[tuple[int, list[float]]] = []

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        self.received.append((input_ids.shape[0], num_items_in_batch.flatten().tolist()))
        logits = self.head(self.embed(input_ids))
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
        )
        return {"loss": loss / num_items_in_batch, "logits": logits}


def test_trainers_num_items_in_batch_gives_each_replica_one_row_as_stock_does(generator):
    """Hugging Face's ``Trainer`` passes ``num_items_in_batch`` as an ``(n_gpu, 1)`` tensor beside a batch of
    4 rows: 2 chunks of ``input_ids`` and 2 rows of ``num_items_in_batch``. Stock gives each replica one
    row (B14: the counts agree, nothing is dropped); so does minidp: same loss vector, same gradients."""
    model = CausalLMWithLossKeywords()
    ids = torch.randint(13, (4, 7), generator=generator)
    num_items = torch.tensor([[11.0], [11.0]], dtype=torch.float64)
    results = []
    for wrapper, emulation, ids_ in ((minidp.DataParallel, contextlib.nullcontext(), cpu_ids(2)), (nn.DataParallel, emulated_stock(), [0, 1])):
        model.zero_grad()
        model.received.clear()
        with emulation:
            out = wrapper(model, ids_)(input_ids=ids, labels=ids, num_items_in_batch=num_items)
            out["loss"].mean().backward()  # Trainer: `loss = loss.mean()` when n_gpu > 1
        results.append((out["loss"].detach(), out["logits"].detach(), [p.grad.clone() for p in model.parameters()],
                        sorted(model.received)))
    (ours, logits, grads, received), (stock, stock_logits, stock_grads, stock_received) = results
    assert received == stock_received == [(2, [11.0]), (2, [11.0])]
    assert ours.shape == stock.shape == (2, 1) and torch.equal(ours, stock) and torch.equal(logits, stock_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))


@pytest.mark.parametrize("rows,replicas", [(1, 2), (5, 4), (4, 3)])
def test_one_row_per_device_beside_a_short_last_batch_gives_the_replicas_that_run_their_rows_as_stock(rows, replicas, generator):
    """Trainer's last batch may cut into fewer chunks than there are devices (1 row on 2; torch.chunk cuts 5 rows on 4,
    and 4 on 3, into 3 and 2), beside ``num_items_in_batch``'s one value per device. Stock's zip (B14) runs the replicas
    the batch fills, each with its row; minidp does the same (it raised, and Trainer stopped at its last step)."""
    model = CausalLMWithLossKeywords()
    ids = torch.randint(13, (rows, 7), generator=generator)
    num_items = torch.arange(1.0, replicas + 1, dtype=torch.float64)[:, None]
    results = []
    for wrapper, emulation, ids_ in ((minidp.DataParallel, contextlib.nullcontext(), cpu_ids(replicas)),
                                     (nn.DataParallel, emulated_stock(replicas), list(range(replicas)))):
        model.zero_grad()
        model.received.clear()
        with emulation:
            out = wrapper(model, ids_)(input_ids=ids, labels=ids, num_items_in_batch=num_items)
            out["loss"].mean().backward()
        results.append((out["loss"].detach(), [p.grad.clone() for p in model.parameters()], sorted(model.received)))
    (ours, grads, received), (stock, stock_grads, stock_received) = results
    assert received == stock_received and len(received) == len(ids.chunk(replicas)) < replicas
    assert torch.equal(ours, stock) and all(torch.equal(a, b) for a, b in zip(grads, stock_grads))


@pytest.mark.parametrize("rows,replicas", [((6, 2), 4), ((6, 1), 2), ((9, 2), 3), ((4, 3), 4)])
def test_tensors_that_cut_into_different_numbers_of_chunks_are_an_error_naming_both(rows, replicas, generator):
    """B14: stock zips the chunks to the smallest number and silently drops the rest: the tensor with
    more chunks loses rows (checked here against stock). minidp names both tensors, their sizes and chunk counts,
    unless those that cut into more hold one value per device (the test above): 4 rows of 2 values on 4 devices are a
    batch, and still an error beside 3 rows."""
    tensors = tuple(torch.randn(n, 2, generator=generator) for n in rows)
    with emulated_stock():
        stock = nn.parallel.scatter(tensors, list(range(replicas)))
    assert sum(t.shape[0] for piece in stock for t in piece) < sum(rows), "stock drops rows"
    first, second = (len(t.chunk(replicas)) for t in tensors)
    with pytest.raises(
        ValueError,
        match=rf"inputs\[1\] has {rows[1]} rows along dim 0, which cut by torch.chunk into {second} chunk\(s\).* "
        rf"but inputs\[0\] has {rows[0]} rows, which cut into {first} chunk\(s\).*same number of chunks",
    ):
        minidp.scatter(tensors, cpu_ids(replicas))


def test_chunk_weights_cut_every_tensor_in_proportion_to_its_own_size(generator):
    """``chunk_weights`` are a rule like torch.chunk's, applied to each tensor's size: a batch of 10 and a
    tensor with one row per replica, weights 3:1, give [8, 2] and [1, 1] rows."""
    x, per_replica = torch.randn(10, 2, generator=generator), torch.randn(2, 1, generator=generator)
    pieces = minidp.scatter((x, per_replica), cpu_ids(2), chunk_weights=[3, 1])
    assert [(a.shape[0], b.shape[0]) for a, b in pieces] == [(8, 1), (2, 1)]
    assert torch.equal(torch.cat([b for _, b in pieces]), per_replica)


def test_explicit_chunk_sizes_split_one_size_so_another_size_is_an_error_naming_both(generator):
    """``chunk_sizes`` are one split of one size (stock's ``Scatter`` argument, B15): a tensor of another
    size cannot follow it, and the error says so."""
    x, other = torch.randn(6, 2, generator=generator), torch.randn(2, 1, generator=generator)
    with pytest.raises(ValueError, match=r"inputs\[1\] has 2 rows along dim 0 but inputs\[0\] has 6, and chunk_sizes "
                                         r"\[4, 2\] split 6 rows only"):
        minidp.scatter((x, other), cpu_ids(2), chunk_sizes=[4, 2])


# --------------------------------------------------------------------------------------------------
# no reference cycles (B36)
# --------------------------------------------------------------------------------------------------


def test_scatter_leaves_no_reference_cycles(generator):
    """B36: stock clears its recursive ``scatter_map`` closure by hand; minidp walks with a plain function."""
    x = torch.randn(6, 2, generator=generator)
    inputs = (x, [x, {"a": x}], Pair(x, x), Batch(x, x))
    assert garbage_left_by(lambda: minidp.scatter(inputs, cpu_ids(3))) == 0
    assert garbage_left_by(lambda: minidp.scatter_kwargs((x,), {"k": [x]}, cpu_ids(2))) == 0


def test_numpy_integers_are_taken_for_dim_and_chunk_sizes(generator):
    # torch.split and torch.cat take numpy's integers (they have __index__), and stock passes dim to them.
    np = pytest.importorskip("numpy")
    x = torch.randn(6, 4, generator=generator)
    pieces = minidp.comm.scatter(x, cpu_ids(2), chunk_sizes=[np.int64(4), np.int64(2)], dim=np.int64(0))
    assert [p.shape[0] for p in pieces] == [4, 2]
    assert torch.equal(minidp.comm.gather(pieces, dim=np.int64(0)), x)
    assert torch.equal(minidp.DataParallel(nn.Identity(), cpu_ids(2), dim=np.int64(0))(x), x)


def test_comm_scatter_to_no_device_is_refused_by_name(generator):
    # stock's torch.chunk(0) refuses it; the rows were divided by the device count (ZeroDivisionError), and an empty
    # batch gave no chunk at all.
    for rows in (6, 0):
        with pytest.raises(ValueError, match="devices is empty"):
            minidp.comm.scatter(torch.randn(rows, 4, generator=generator), [])
