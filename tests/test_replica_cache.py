"""Cached replicas (minidp.replica_cache): the same numbers as replicas built anew at every step.

Stock DataParallel rebuilds its replicas at every forward; minidp keeps them and re-binds tensors.
Every test runs the same steps twice, on two identical models: once with ``cache_replicas=False``
(what stock does) and once with the cache, and asserts bitwise-equal outputs, gradients and
buffers (float64). The structural-change tests change both models between steps and assert that
the cache noticed (a rebuild, with its reason) and still agrees.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import types
import weakref
from typing import Any, Callable

import pytest
import torch
from torch import nn

import minidp
from minidp.parallel_backward import parallel_backward_settings
from minidp.replica_cache import ReplicaCache
from minidp.zoo import ZOO, LSTMModel, ResNetBlockBN

from .helpers import RTOL_FLOAT64, ScaledByBuffer, configure_dataparallel, cpu_ids, max_relative_error

pytestmark = pytest.mark.usefixtures("float64")


@pytest.fixture(autouse=True, params=["torch", "auto-with-ext"])
def dataparallel_configuration(request, monkeypatch):
    """These tests are about the cache: it stays on, under both reduce backends (tests/conftest.py)."""
    configure_dataparallel(monkeypatch, True, request.param)
    return request.param


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _flat(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in _flat(v)]
    if isinstance(output, (list, tuple)):
        return [t for v in output for t in _flat(v)]
    return []


class Pair:
    """The same model twice: wrapped without the cache (``fresh``) and with it (``cached``)."""

    def __init__(self, model: nn.Module, devices: list, dim: int = 0, loss: Callable = lambda o: o.pow(2).mean()):
        self.models = [model, copy.deepcopy(model)]
        self.fresh = minidp.DataParallel(self.models[0], devices, dim=dim, cache_replicas=False)
        self.cached = minidp.DataParallel(self.models[1], devices, dim=dim)
        self.loss = loss

    def change(self, edit: Callable[[nn.Module], None]) -> None:
        for model in self.models:
            edit(model)

    def step(self, *inputs: Any, **kwargs: Any) -> None:
        """One forward and backward on both; asserts equal outputs, gradients and buffers."""
        outputs = []
        for wrapper in (self.fresh, self.cached):
            output = wrapper(*inputs, **kwargs)
            if torch.is_grad_enabled():
                self.loss(output).backward()
            outputs.append(output)
        for a, b in zip(_flat(outputs[0]), _flat(outputs[1]), strict=True):
            assert torch.equal(a, b)
        fresh, cached = self.models
        for (name, a), b in zip(fresh.named_parameters(), cached.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), name
            assert a.grad is None or torch.equal(a.grad, b.grad), name
        for (name, a), b in zip(fresh.named_buffers(), cached.buffers(), strict=True):
            assert torch.equal(a, b), name

    @property
    def info(self) -> minidp.replica_cache.ReplicaCacheInfo:
        return self.cached.replica_cache_info()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_cached_replicas_match_fresh_replicas_on_every_zoo_model(name, generator):
    entry = ZOO[name]
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
    model = entry.build()
    if name == "vgg_split":  # its forward calls minidp.data_parallel on its parts: nested replicas
        model.device_ids = cpu_ids(2)
    pair = Pair(model, cpu_ids(3), entry.dim, entry.loss)
    for _ in range(3):
        inputs, kwargs = entry.batch(7, generator)
        pair.step(*inputs, **kwargs)
    assert (pair.info.hits, pair.info.misses) == (2, 1)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_cached_replicas_match_the_single_device_reference(name, generator):
    entry = ZOO[name]
    model = entry.build()
    if name in ("resnet_bn", "checkpoint"):  # in training BatchNorm normalises each chunk by its own statistics
        model.eval()
    reference = copy.deepcopy(model)
    wrapper = minidp.DataParallel(model, cpu_ids(2), dim=entry.dim)
    for _ in range(2):
        inputs, kwargs = entry.batch(6, generator)
        entry.loss(wrapper(*inputs, **kwargs)).backward()
        entry.loss(reference(*inputs, **kwargs)).backward()
    for (name_, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert max_relative_error(q.grad, p.grad) <= RTOL_FLOAT64, name_
    assert wrapper.replica_cache_info().hits == 1


def test_cached_replicas_match_under_no_grad(generator):
    pair = Pair(ResNetBlockBN(), cpu_ids(2))
    with torch.no_grad():
        for _ in range(2):
            pair.step(torch.randn(4, 3, 8, 8, generator=generator))
    assert pair.info.hits == 1


class ShiftedByBuffer(nn.Module):
    """Adds a buffer that requires grad: a leaf, or (``leaf=False``) a clone of a parameter, made with grad on."""

    def __init__(self, leaf: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("shift", torch.randn(3, requires_grad=True) if leaf else self.linear.weight.sum(1).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.shift


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_buffer_that_requires_grad_runs_under_no_grad_with_cached_replicas(mode, generator):
    """docs/stock-behaviour.md B10, B19: under no_grad the replicas are built detached, and a buffer that requires grad
    reaches replica 0 as the original, as any buffer (stock runs it, and so must the cache: nothing to watch)."""
    pair = Pair(ShiftedByBuffer(), cpu_ids(2))
    with mode():
        for _ in range(2):
            pair.step(torch.randn(6, 4, generator=generator))
    assert pair.info.hits == 1


def test_a_non_leaf_buffer_that_requires_grad_keeps_the_cached_replicas_under_no_grad(generator):
    """A buffer cloned from a parameter has a node of its own, which no binding made: the replicas of a forward under
    no_grad have no backward to wait for, and the next call re-binds them (B10), as for any model."""
    wrapper = minidp.DataParallel(ShiftedByBuffer(leaf=False), cpu_ids(2))
    with torch.no_grad():
        for _ in range(3):
            wrapper(torch.randn(6, 4, generator=generator))
    assert (wrapper.replica_cache_info().hits, wrapper.replica_cache_info().misses) == (2, 1)


# --- structural changes: each one is noticed, rebuilds, and the results still agree -------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _changed(pair: Pair, edit: Callable[[nn.Module], None], make_input: Callable[[], torch.Tensor]) -> str:
    """Step, apply ``edit`` to both models, step again; returns the reason of the rebuild."""
    pair.step(make_input())
    misses = pair.info.misses
    pair.change(edit)
    pair.step(make_input())
    assert pair.info.misses == misses + 1, "the change was not noticed"
    pair.step(make_input())  # and the rebuilt skeletons are reused afterwards
    assert pair.info.misses == misses + 1
    return pair.info.last_rebuild_reason


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda m: m.append(nn.Tanh()), "sub-modules ['3'] of the root module"),
        (lambda m: m.__delitem__(1), "['_modules'] of the root module"),  # Sequential makes a new dict
        (lambda m: m.__setitem__(1, nn.Sigmoid()), "sub-modules ['1'] of the root module"),
        (lambda m: setattr(m[0], "weight", nn.Parameter(torch.ones(6, 5) / 4)), "parameters ['weight'] of module '0'"),
        (lambda m: setattr(m[2], "bias", None), "parameters ['bias'] of module '2'"),
        (lambda m: m[1].register_buffer("scale", torch.ones(1)), "buffers ['scale'] of module '1'"),
    ],
    ids=["sub-module added", "sub-module removed", "sub-module replaced", "parameter replaced", "parameter set to None",
         "buffer registered where there was none"],
)
def test_tree_changes_rebuild_the_replicas(edit, reason, generator):
    pair = Pair(_mlp(), cpu_ids(2))
    assert reason in _changed(pair, edit, lambda: torch.randn(6, 5, generator=generator))


def test_an_attribute_renamed_keeping_its_value_and_place_rebuilds_the_replicas(generator):
    # The same values in the same order, and the same sizes: only the keys tell the replicas' `tag` is stale.
    model = _mlp()
    model.tag = [1, 2]

    def rename(m: nn.Module) -> None:
        m.label = m.__dict__.pop("tag")

    reason = _changed(Pair(model, cpu_ids(2)), rename, lambda: torch.randn(6, 5, generator=generator))
    assert "attributes ['label', 'tag'] of the root module" in reason


def test_a_replaced_buffer_rebuilds_the_replicas(generator):
    pair = Pair(ResNetBlockBN(), cpu_ids(2))
    new_mean = torch.randn(8, generator=generator)
    reason = _changed(pair, lambda m: setattr(m.bn1, "running_mean", new_mean.clone()), lambda: torch.randn(4, 3, 8, 8, generator=generator))
    assert "buffers ['running_mean'] of module 'bn1'" in reason


def test_a_buffer_set_to_none_rebuilds_the_replicas(generator):
    pair = Pair(ResNetBlockBN(), cpu_ids(2))
    pair.change(lambda m: m.eval())  # eval BatchNorm without running_var would fail; drop the counter instead
    reason = _changed(pair, lambda m: setattr(m.bn1, "num_batches_tracked", None), lambda: torch.randn(4, 3, 8, 8, generator=generator))
    assert "buffers ['num_batches_tracked'] of module 'bn1'" in reason


def test_train_and_eval_rebuild_the_replicas(generator):
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Dropout(0.0), nn.Linear(6, 2))
    pair = Pair(model, cpu_ids(2))
    make_input = lambda: torch.randn(8, 5, generator=generator)  # noqa: E731
    assert "attributes ['training'] of the root module" in _changed(pair, lambda m: m.eval(), make_input)
    assert "attributes ['training']" in _changed(pair, lambda m: m.train(), make_input)


def test_moving_to_another_dtype_rebuilds_the_replicas(generator):
    pair = Pair(_mlp(), cpu_ids(2))
    pair.step(torch.randn(6, 5, generator=generator))
    pair.change(lambda m: m.to(torch.float32))
    pair.step(torch.randn(6, 5, generator=generator, dtype=torch.float32))
    assert "device or dtype" in pair.info.last_rebuild_reason


def test_a_parameter_moved_off_the_device_in_place_is_refused_as_without_the_cache(generator):
    # The Parameter object stays, so only the placement check sees the move; the rebuild then
    # raises the uncached path's error, naming the parameter and the device (docs/stock-behaviour.md B6: every
    # forward checks that the module is on device_ids[0]).
    pair = Pair(_mlp(), cpu_ids(2))
    pair.step(torch.randn(6, 5, generator=generator))
    for wrapper, model in zip((pair.fresh, pair.cached), pair.models):
        weight = model[0].weight  # moved keeping the object, as `.to()` moves with swap_tensors
        torch.utils.swap_tensors(weight, nn.Parameter(torch.empty_like(weight, device="meta")))
        with pytest.raises(RuntimeError, match=r"on device cpu \(device_ids\[0\]\) but '0.weight' is on meta"):
            wrapper(torch.randn(6, 5, generator=generator))  # kept skeletons would bind the meta weight instead


class Scaled(nn.Module):
    """Reads a plain attribute of the original module at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_a_plain_attribute_set_later_reaches_the_replicas(generator):
    pair = Pair(Scaled(), cpu_ids(2))
    reason = _changed(pair, lambda m: setattr(m, "scale", 3.0), lambda: torch.randn(6, 4, generator=generator))
    assert "attributes ['scale'] of the root module" in reason


class ScaledByList(nn.Module):
    """Reads a mutable attribute of the original module at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scales = [1.0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scales[0]


def test_an_equal_but_new_attribute_rebuilds_the_replicas(generator):
    # A fresh replica shares the new list; a stale skeleton would keep reading the old one.
    pair = Pair(ScaledByList(), cpu_ids(2))
    make_input = lambda: torch.randn(6, 4, generator=generator)  # noqa: E731
    assert "attributes ['scales'] of the root module" in _changed(pair, lambda m: setattr(m, "scales", [1.0]), make_input)
    pair.change(lambda m: m.scales.__setitem__(0, 3.0))
    pair.step(make_input())


class ScalesByCallCount(nn.Module):
    """Writes on itself in forward: a fresh replica always starts from the original's count (0)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * self.calls


def test_what_a_replica_writes_on_itself_is_gone_at_the_next_step(generator):
    pair = Pair(ScalesByCallCount(), cpu_ids(2))
    for _ in range(3):
        pair.step(torch.randn(6, 4, generator=generator))
    assert pair.info.hits == 2
    assert pair.models[1].calls == 0  # as in stock: replicas write on their own copy


class RegistersInForward(nn.Module):
    """Registers a buffer on itself in forward: a fresh replica never has it, so never adds 1."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x) + (1 if "last" in self._buffers else 0)
        self.register_buffer("last", out.detach())
        return out


def test_a_buffer_a_replica_registers_on_itself_is_gone_at_the_next_step(generator):
    pair = Pair(RegistersInForward(), cpu_ids(2))
    for _ in range(3):
        pair.step(torch.randn(6, 4, generator=generator))
    assert pair.info.hits == 2
    assert "last" not in pair.models[1]._buffers


def test_a_hook_added_later_runs_without_a_rebuild(generator):
    pair = Pair(_mlp(), cpu_ids(2))
    pair.step(torch.randn(6, 5, generator=generator))
    pair.change(lambda m: m[1].register_forward_hook(lambda module, args, output: output * 2))
    pair.step(torch.randn(6, 5, generator=generator))
    assert (pair.info.hits, pair.info.misses) == (1, 1)  # hook dicts are shared with the original


def test_a_replaced_lstm_weight_reaches_the_replicas_flat_weights(generator):
    loss = ZOO["lstm"].loss
    pair = Pair(LSTMModel(), cpu_ids(2), dim=1, loss=loss)
    make_input = lambda: torch.randn(5, 6, 6, generator=generator)  # noqa: E731
    reason = _changed(pair, lambda m: setattr(m.lstm, "weight_hh_l0", nn.Parameter(torch.full((48, 12), 0.05))), make_input)
    assert "weight_hh_l0" in reason


class _Neuron(nn.Module):
    """A stateful module as SpikingJelly writes them: its state is a dict its replicas get a copy of, taken when they
    are made (``_replicate_for_data_parallel``), and a forward adds to it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).double()
        self._memories = {"v": 0.0}

    def _replicate_for_data_parallel(self) -> nn.Module:
        replica = super()._replicate_for_data_parallel()
        replica._memories = self._memories.copy()
        return replica

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._memories["v"] = self._memories["v"] + self.linear(x)
        return self._memories["v"]


def test_a_module_that_replicates_itself_its_own_way_gets_the_originals_state_at_every_call(generator):
    """Stock calls a class's own ``_replicate_for_data_parallel`` at every call (docs/stock-behaviour.md, B22), so
    state set on the original between steps (a reset of a neuron's potential, a forward run on one device) reaches
    the next replicas. Skeletons reset to a template taken when they were built brought back the first call's state
    at every later one: such a tree is replicated anew at every call."""
    def run(cache_replicas: bool) -> tuple:
        torch.manual_seed(0)
        neuron = _Neuron()
        wrapper = minidp.DataParallel(neuron, cpu_ids(2), cache_replicas=cache_replicas)
        outputs = []
        for state in (0.0, 1.0, 2.0):
            neuron._memories["v"] = state  # set on the original between steps, as a reset of the network does
            output = wrapper(torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
            output.sum().backward()
            outputs.append(output.detach())
        info = wrapper.replica_cache_info() if cache_replicas else None
        return outputs + [p.grad for p in neuron.parameters()], info

    (cached, info), (uncached, _) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(cached, uncached, strict=True))
    assert torch.equal(cached[2], cached[0] + 2.0)  # each step starts from the state set
    assert info.hits == 0 and "_replicate_for_data_parallel" in info.last_rebuild_reason


def test_an_rnn_which_copies_its_weight_lists_when_replicated_keeps_its_cached_replicas(generator):
    """RNNBase's own ``_replicate_for_data_parallel`` gives each replica copies of its ``_flat_weights`` lists
    (docs/stock-behaviour.md, B22), containers the cache copies at each reset: such a tree keeps its replicas."""
    pair = Pair(LSTMModel(), cpu_ids(2), dim=1, loss=ZOO["lstm"].loss)
    for _ in range(3):
        pair.step(torch.randn(5, 6, 6, generator=generator))
    assert (pair.info.hits, pair.info.misses) == (2, 1)


def test_a_different_device_list_gets_its_own_replicas(generator):
    model = _mlp()
    cache = minidp.replica_cache.ReplicaCache()
    for devices in (cpu_ids(2), cpu_ids(3), cpu_ids(2)):
        wrapper = minidp.DataParallel(model, devices, cache_replicas=cache)
        wrapper(torch.randn(6, 5, generator=generator)).sum().backward()
    info = cache.info()
    assert (info.hits, info.misses, info.entries) == (1, 2, 2)


# --- the switch, the functional form, threads, pickling ------------------------------------------------


def test_cache_replicas_false_builds_every_step(generator):
    wrapper = minidp.DataParallel(_mlp(), cpu_ids(2), cache_replicas=False)
    wrapper(torch.randn(4, 5, generator=generator)).sum().backward()
    wrapper.cache_replicas = True
    wrapper(torch.randn(4, 5, generator=generator)).sum().backward()
    wrapper(torch.randn(4, 5, generator=generator)).sum().backward()
    assert (wrapper.replica_cache_info().hits, wrapper.replica_cache_info().misses) == (1, 1)


def test_data_parallel_builds_replicas_anew_at_every_call_as_stock_does(generator, monkeypatch):
    """Stock's data_parallel calls replicate at every call (torch/nn/parallel/data_parallel.py: data_parallel)."""
    built = []
    monkeypatch.setattr(minidp.wrapper, "replicate", lambda *args, **kwargs: built.append(1) or minidp.replicate(*args, **kwargs))
    model = _mlp()
    for _ in range(3):
        minidp.data_parallel(model, torch.randn(4, 5, generator=generator), cpu_ids(2)).sum().backward()
    assert len(built) == 3


def test_data_parallel_reuses_replicas_from_a_cache_it_is_given(generator):
    model, cache = _mlp(), ReplicaCache()
    for _ in range(3):
        minidp.data_parallel(model, torch.randn(4, 5, generator=generator), cpu_ids(2), replica_cache=cache).sum().backward()
    assert (cache.info().hits, cache.info().misses) == (2, 1)


def test_one_cache_serves_two_data_parallel_calls_of_one_forward(generator):
    """The tutorial's pattern with one cache for both calls: each module keeps its own replicas (an entry per module),
    the same numbers as replicas built anew at every call, as stock's data_parallel builds them."""
    features, classifier = _mlp(), nn.Linear(3, 2)
    fresh_features, fresh_classifier = copy.deepcopy(features), copy.deepcopy(classifier)
    cache = ReplicaCache()
    for _ in range(3):
        x = torch.randn(6, 5, generator=generator)
        hidden = minidp.data_parallel(features, x, cpu_ids(2), replica_cache=cache)
        cached = minidp.data_parallel(classifier, hidden, cpu_ids(2), replica_cache=cache)
        fresh = minidp.data_parallel(fresh_classifier, minidp.data_parallel(fresh_features, x, cpu_ids(2)), cpu_ids(2))
        cached.pow(2).sum().backward()
        fresh.pow(2).sum().backward()
        assert torch.equal(cached, fresh)
    for a, b in zip([*features.parameters(), *classifier.parameters()],
                    [*fresh_features.parameters(), *fresh_classifier.parameters()]):
        assert torch.equal(a.grad, b.grad)
    assert (cache.info().hits, cache.info().misses, cache.info().entries) == (4, 2, 2)


def test_a_cache_drops_the_replicas_of_a_module_that_is_gone(generator):
    """An entry holds its module's parameters (the signature's values): once the module is freed, the next build drops
    it, so a cache that outlives a model does not keep that model's tensors."""
    cache = ReplicaCache()
    model = _mlp()
    minidp.data_parallel(model, torch.randn(4, 5, generator=generator), cpu_ids(2), replica_cache=cache).sum().backward()
    weight = weakref.ref(model[0].weight)
    del model
    gc.collect()
    minidp.data_parallel(_mlp(), torch.randn(4, 5, generator=generator), cpu_ids(2), replica_cache=cache).sum().backward()
    gc.collect()
    assert weight() is None
    assert cache.info().entries == 1


def test_a_data_parallel_inside_a_wrapped_model_leaves_the_outer_cache_its_replicas(generator):
    """A DataParallel in a model another one wraps: its replicas share its cache, whose entries held the outer replicas'
    modules, so the outer cache found them held and built anew at every step. The inner one replicates anew, as stock
    does at every level; the outer keeps its replicas, and the numbers are those of replicas built anew throughout."""
    def nested() -> nn.Module:
        return nn.Sequential(minidp.DataParallel(_mlp(), cpu_ids(2)), nn.Linear(3, 2))

    model = nested()
    fresh_model = copy.deepcopy(model)
    cached = minidp.DataParallel(model, cpu_ids(2))
    fresh = minidp.DataParallel(fresh_model, cpu_ids(2), cache_replicas=False)
    for _ in range(4):
        x = torch.randn(8, 5, generator=generator)
        ours, theirs = cached(x), fresh(x)
        ours.square().sum().backward()
        theirs.square().sum().backward()
        assert torch.equal(ours, theirs)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), fresh_model.parameters()))
    assert (cached.replica_cache_info().hits, cached.replica_cache_info().misses) == (3, 1)


def test_data_parallel_keeps_no_reference_to_a_module_that_references_itself(generator):
    model = _mlp()
    model.myself = [model]  # a cycle through a plain attribute
    minidp.data_parallel(model, torch.randn(4, 5, generator=generator), cpu_ids(2)).sum().backward()
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_concurrent_forwards_on_one_wrapper_do_not_share_replicas(generator):
    model = Scaled()
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    inputs = [torch.randn(6, 4, generator=generator) for _ in range(4)]
    fresh = minidp.DataParallel(model, cpu_ids(2), cache_replicas=False)
    expected = [fresh(x) for x in inputs]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(20):
                assert torch.equal(wrapper(inputs[i]), expected[i])
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


def test_a_pickled_wrapper_starts_with_an_empty_cache(generator):
    wrapper = minidp.DataParallel(_mlp(), cpu_ids(2))
    wrapper(torch.randn(4, 5, generator=generator))
    restored = pickle.loads(pickle.dumps(wrapper))
    x = torch.randn(4, 5, generator=generator)
    assert torch.equal(restored(x), wrapper(x))
    assert (restored.replica_cache_info().hits, restored.replica_cache_info().misses) == (0, 1)


class Checkpointed(nn.Module):
    """Two layers, the first under activation checkpointing: its forward runs again in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.utils.checkpoint.checkpoint(self.first, x, use_reentrant=False).tanh())


def _grads_after(steps, cache: bool, model: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    wrapper = minidp.DataParallel(model, cpu_ids(2), cache_replicas=cache)
    steps(wrapper, batches)
    return [p.grad for p in model.parameters()]


def _one_forward_per_backward(wrapper, batches):
    for x in batches:
        wrapper(x).pow(2).sum().backward()


def _two_forwards_then_one_backward(wrapper, batches):
    for first, second in zip(batches[::2], batches[1::2]):
        (wrapper(first).pow(2).sum() + wrapper(second).pow(2).sum()).backward()


@pytest.mark.parametrize("steps", [_one_forward_per_backward, _two_forwards_then_one_backward])
def test_checkpointed_replicas_rerun_with_their_own_step_s_parameters(steps, generator):
    """Checkpointing re-runs a replica's forward during the backward: cached replicas must still hold
    that step's tensors then, and must not be re-bound by a later forward before their backward ran."""
    model = Checkpointed().double()
    batches = [torch.randn(6, 5, generator=generator, dtype=torch.float64) for _ in range(4)]
    for cached, uncached in zip(_grads_after(steps, True, model, batches), _grads_after(steps, False, model, batches)):
        assert torch.equal(cached, uncached)


def test_replicas_whose_backward_has_not_run_are_not_re_bound(generator):
    wrapper = minidp.DataParallel(_mlp(), cpu_ids(2))
    first = wrapper(torch.randn(4, 5, generator=generator))
    wrapper(torch.randn(4, 5, generator=generator))
    info = wrapper.replica_cache_info()
    assert (info.hits, info.misses) == (0, 2) and "backward has not run" in info.last_rebuild_reason
    first.sum().backward()


def test_replicas_whose_first_parameter_is_frozen_are_watched_until_their_backward_has_run(generator):
    """The Broadcast node is found through the first parameter that autograd records, not the first parameter."""
    model = _mlp()
    next(model.parameters()).requires_grad_(False)
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    first = wrapper(torch.randn(4, 5, generator=generator))
    wrapper(torch.randn(4, 5, generator=generator))
    assert "backward has not run" in wrapper.replica_cache_info().last_rebuild_reason
    first.sum().backward()
    wrapper(torch.randn(4, 5, generator=generator)).sum().backward()
    wrapper(torch.randn(4, 5, generator=generator))
    assert wrapper.replica_cache_info().hits == 1


def test_the_originals_are_known_only_for_replicas_the_cache_bound_and_still_holds(generator):
    """What DataParallel reads before the replicas run (a failed step puts the buffers back, a parameter changed in
    place fails it): the cache's lists where it bound the replicas, with no walk of the tree; any other replica root
    gets None, and the caller walks."""
    model = ResNetBlockBN()
    cache = ReplicaCache()
    root = cache.replicate(model, cpu_ids(2))[0]
    params, buffers = cache.originals(root)
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert [id(b) for b in buffers] == [id(b) for b in model.buffers()]
    assert cache.originals(minidp.replicate(model, cpu_ids(2))[0]) is None
    cache.release(cpu_ids(2))
    assert cache.originals(root) is None


def test_an_earlier_graph_run_again_is_not_the_backward_of_a_later_step(generator):
    """The rule above in any order: a step's graph kept with retain_graph and run again after the next forward
    leaves that forward's replicas pending (each binding's Broadcast speaks for its own replicas only). The serial
    backward: the parallel one's node holds the replicas of a kept graph, and the next forward builds new ones anyway."""
    wrapper = minidp.DataParallel(_mlp(), cpu_ids(2))
    with parallel_backward_settings(False):
        kept = wrapper(torch.randn(4, 5, generator=generator)).sum()
        kept.backward(retain_graph=True)
        pending = wrapper(torch.randn(4, 5, generator=generator)).sum()
        kept.backward()
        wrapper(torch.randn(4, 5, generator=generator))
        assert wrapper.replica_cache_info().hits == 1
        assert "backward has not run" in wrapper.replica_cache_info().last_rebuild_reason
        pending.backward()


def test_release_declares_the_last_replicas_finished_and_empties_them(generator):
    wrapper = minidp.DataParallel(_mlp(), cpu_ids(2))
    wrapper(torch.randn(4, 5, generator=generator))  # no backward: e.g. an evaluation with grad enabled
    wrapper.replica_cache.release(cpu_ids(2))
    (entry,) = wrapper.replica_cache._entries.values()
    held = [m for replica_modules in entry.replicas for m in replica_modules for v in vars(m).values() if isinstance(v, torch.Tensor)]
    assert held == []
    wrapper(torch.randn(4, 5, generator=generator))
    assert wrapper.replica_cache_info().hits == 1


@pytest.mark.parametrize("parallel_backward", [True, False])
def test_replicas_hold_no_tensor_of_their_step_once_its_backward_has_run(parallel_backward, generator):
    """Stock's replicas are freed after their step; cached ones are emptied when their backward has run, so the step's
    copies (replica 1's buffers here; on GPUs, the parameters too) do not stay until the next call."""
    wrapper = minidp.DataParallel(ResNetBlockBN(), cpu_ids(2))
    with parallel_backward_settings(parallel_backward):
        output = wrapper(torch.randn(6, 3, 8, 8, generator=generator))
        replica_copy = weakref.ref(wrapper.replica_cache._entries[next(iter(wrapper.replica_cache._entries))]
                                   .replicas[1][0].get_buffer("bn1.running_mean"))
        output.sum().backward()
    (entry,) = wrapper.replica_cache._entries.values()
    held = [v for replica_modules in entry.replicas for m in replica_modules for registry in ("_parameters", "_buffers")
            for v in getattr(m, registry).values() if v is not None]
    held += [v for replica_modules in entry.replicas for m in replica_modules for v in vars(m).values()
             if isinstance(v, torch.Tensor)]
    assert held == []
    assert replica_copy() is None
    wrapper(torch.randn(6, 3, 8, 8, generator=generator)).sum().backward()
    assert wrapper.replica_cache_info().hits == 1


class ReturnsItsStatistics(nn.Module):
    """BatchNorm, returning its running mean beside the output: an output that is a replica's buffer itself."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.bn(x), self.bn.running_mean


def test_replicas_hold_no_tensor_of_a_forward_under_no_grad_once_it_returns(generator):
    """Stock's replicas are freed with the step (B10: under no_grad, nothing records a graph through them); cached ones
    are emptied as the forward returns, so replica 1's buffer copy lives only in the output that is it (an emptied
    replica drops its dicts' references, not the tensors), and the next call re-binds them."""
    wrapper = minidp.DataParallel(ReturnsItsStatistics(), cpu_ids(2), gather_output=False)
    x = torch.randn(6, 4, generator=generator)
    with torch.no_grad():
        outputs = wrapper(x)
    (entry,) = wrapper.replica_cache._entries.values()
    assert all(v is None for replica_modules in entry.replicas for m in replica_modules for v in m._buffers.values())
    replica_copy = weakref.ref(outputs[1][1])
    expected = torch.nn.functional.batch_norm(x[3:], torch.zeros(4), torch.ones(4), training=True)
    assert max_relative_error(outputs[1][0], expected) <= RTOL_FLOAT64
    assert max_relative_error(outputs[1][1], 0.1 * x[3:].mean(0)) <= RTOL_FLOAT64  # the copy's update, still readable
    del outputs
    assert replica_copy() is None
    with torch.no_grad():
        wrapper(x)
    assert wrapper.replica_cache_info().hits == 1


def test_replicas_held_after_a_forward_under_no_grad_keep_their_tensors(generator):
    """What holds a replica (here a hook's list) holds it as stock's: with its tensors; the next call leaves it."""
    model = ReturnsItsStatistics()
    seen = []
    model.bn.register_forward_hook(lambda module, inputs, output: seen.append(module))
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    with torch.no_grad():
        wrapper(torch.randn(6, 4, generator=generator))
    assert all(isinstance(replica.running_mean, torch.Tensor) for replica in seen)


def test_released_replicas_hold_no_buffer_in_their_registries_nor_their_templates(generator):
    # A BatchNorm replica's _buffers is a container it owns, refilled at every binding: a reset copies its template
    # (all None), so that neither the replicas nor the templates keep a step's buffers (replica 1's are private copies)
    wrapper = minidp.DataParallel(ResNetBlockBN(), cpu_ids(2))
    wrapper(torch.randn(6, 3, 8, 8, generator=generator))
    replica_copy = weakref.ref(wrapper.replica_cache.replicate(wrapper.module, cpu_ids(2))[1].get_buffer("bn1.running_mean"))
    wrapper.replica_cache.release(cpu_ids(2))
    (entry,) = wrapper.replica_cache._entries.values()
    registries = [m._buffers for replica_modules in entry.replicas for m in replica_modules]
    templates = [template["_buffers"] for device_templates in entry.templates for template in device_templates]
    assert all(value is None for buffers in registries + templates for value in buffers.values())
    gc.collect()
    assert replica_copy() is None


def test_cached_replicas_start_each_step_with_the_originals_buffers(generator):
    """Replica 1's BatchNorm updates its private statistics in every forward; the next step must
    start from the original's (what a fresh copy holds), whether the copy is new or refilled."""
    model = ResNetBlockBN()
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    for _ in range(3):
        wrapper(torch.randn(6, 3, 8, 8, generator=generator)).sum().backward()
        replica = wrapper.replica_cache.replicate(model, cpu_ids(2))[1]
        for name, buffer in model.named_buffers():
            copy_ = replica.get_buffer(name)
            assert copy_ is not buffer and torch.equal(copy_, buffer), name
        del replica  # a replica held outside the cache is left to its holder: the next call would build new ones
        wrapper.replica_cache.release(cpu_ids(2))
    assert wrapper.replica_cache_info().misses == 1  # refilled, not built anew


class CheckpointedTwoHeads(nn.Module):
    """One layer twice: as it is, and under activation checkpointing (its recomputation calls the replica's layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), torch.utils.checkpoint.checkpoint(lambda x: self.linear(x).tanh(), x, use_reentrant=False)


def _doubled_weight(wrapper) -> None:
    wrapper.module.linear.weight.data = wrapper.module.linear.weight.data * 2  # a new storage: the next step's aliases


def _a_branch_back_propagated_after_the_next_step(wrapper, batches):
    first, pending = wrapper(batches[0])
    first.pow(2).sum().backward()  # the Broadcast's backward ran, the second head's branch has not
    _doubled_weight(wrapper)
    second, other = wrapper(batches[1])
    (second.sum() + other.sum()).backward()
    pending.pow(2).sum().backward()


def _a_kept_graph_run_again_after_the_next_step(wrapper, batches):
    kept = wrapper(batches[0])[1].pow(2).sum()
    kept.backward(retain_graph=True)
    _doubled_weight(wrapper)
    wrapper(batches[1])[1].pow(2).sum().backward()
    kept.backward()


def _a_kept_graph_run_again_before_the_next_step_s_backward(wrapper, batches):
    kept = wrapper(batches[0])[1].pow(2).sum()
    kept.backward(retain_graph=True)
    pending = wrapper(batches[1])[1].pow(2).sum()
    kept.backward()  # the first step's Broadcast runs again: it says nothing of the second step's replicas
    _doubled_weight(wrapper)
    wrapper(batches[0])[1].sum()
    pending.backward()  # recomputes the second step's replicas


@pytest.mark.parametrize(
    "steps",
    [
        _a_branch_back_propagated_after_the_next_step,
        _a_kept_graph_run_again_after_the_next_step,
        _a_kept_graph_run_again_before_the_next_step_s_backward,
    ],
)
def test_a_graph_that_runs_after_the_next_step_recomputes_with_its_own_replicas(steps, generator):
    """After the Broadcast's backward, a graph may still run a replica's code: a branch not back-propagated yet, or
    a graph kept with retain_graph. While it holds the replicas, the next forward builds new ones, as stock always does.
    (The serial backward: the parallel one's node runs once per graph, so one branch at a time is refused there.)"""
    model = CheckpointedTwoHeads().double()
    batches = [torch.randn(6, 4, generator=generator, dtype=torch.float64) for _ in range(2)]
    with parallel_backward_settings(False):
        pairs = zip(_grads_after(steps, True, model, batches), _grads_after(steps, False, model, batches))
        for cached, uncached in pairs:
            assert torch.equal(cached, uncached)


class RecordsItsInput(nn.Module):
    """A layer whose full backward hook reads what its forward hook wrote on the module: the input it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.linear.register_forward_hook(lambda module, inputs, output: setattr(module, "seen", inputs[0].detach()))
        self.linear.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * module.seen.sum(),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_frozen_model_s_backward_hook_reads_its_own_step_after_a_second_forward(generator):
    """No parameter requires grad (no Broadcast node to watch), the input does: the first forward's backward, run
    after a second forward, must find on its replicas what its own forward wrote there."""
    model = RecordsItsInput().double().requires_grad_(False)
    x1, x2 = (torch.randn(6, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    grads = []
    for cache in (True, False):
        wrapper = minidp.DataParallel(copy.deepcopy(model), cpu_ids(2), cache_replicas=cache)
        first = x1.clone().requires_grad_()
        out = wrapper(first)
        wrapper(x2.clone().requires_grad_())
        out.pow(2).sum().backward()
        grads.append(first.grad)
    assert torch.equal(*grads)


def test_replicas_held_by_a_kept_graph_are_left_to_it(generator):
    """A graph kept with retain_graph may recompute a checkpointed replica again: while it lives, the next forward
    builds new replicas (the cost of a step built anew, as stock's), and the reason says so."""
    wrapper = minidp.DataParallel(Checkpointed(), cpu_ids(2))
    kept = wrapper(torch.randn(4, 5, generator=generator)).pow(2).sum()
    kept.backward(retain_graph=True)
    wrapper(torch.randn(4, 5, generator=generator)).pow(2).sum().backward()
    assert wrapper.replica_cache_info().misses == 2
    assert "held outside the cache" in wrapper.replica_cache_info().last_rebuild_reason


@pytest.mark.parametrize("parallel_backward", [True, False], ids=["parallel-backward", "serial-backward"])
def test_a_training_loop_with_checkpointing_keeps_its_cached_replicas(parallel_backward, generator):
    """A finished backward lets go of the replicas (non-reentrant checkpointing frees its recomputation with the
    saved tensors, the parallel backward's node its runner), so the usual loop, which holds the last loss while
    the next forward runs, is served from the cache."""
    wrapper = minidp.DataParallel(Checkpointed(), cpu_ids(2))
    with parallel_backward_settings(parallel_backward):
        for _ in range(4):
            loss = wrapper(torch.randn(4, 5, generator=generator)).pow(2).sum()
            loss.backward()
    assert (wrapper.replica_cache_info().hits, wrapper.replica_cache_info().misses) == (3, 1)


def test_a_frozen_model_runs_two_forwards_then_one_backward(generator):
    """Siamese nets, adversarial inputs, frozen backbones: no parameter requires grad, the inputs do.
    The second forward must not overwrite the buffer copies the first forward's graph saved."""
    model = ScaledByBuffer().requires_grad_(False)
    wrapper = minidp.DataParallel(model, cpu_ids(3))
    x1 = torch.randn(6, 4, generator=generator, requires_grad=True)
    x2 = torch.randn(6, 4, generator=generator, requires_grad=True)
    (wrapper(x1) - wrapper(x2)).pow(2).sum().backward()
    expected1, expected2 = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
    (model(expected1) - model(expected2)).pow(2).sum().backward()
    assert max_relative_error(x1.grad, expected1.grad) <= RTOL_FLOAT64
    assert max_relative_error(x2.grad, expected2.grad) <= RTOL_FLOAT64


def test_a_graph_kept_with_retain_graph_runs_backward_again_after_another_step(generator):
    model = ScaledByBuffer()
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    x = torch.randn(4, 4, generator=generator, requires_grad=True)
    first = wrapper(x).sum()
    first.backward(retain_graph=True)
    wrapper(torch.randn(4, 4, generator=generator)).sum().backward()
    first.backward()  # the first step's saved buffer copies are untouched by the second step


class Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class BecomesDoubled(nn.Linear):
    """Replaces its own class in its forward: on a replica, for that replica (fresh replicas start as the original)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.__class__ = Doubled
        return nn.Linear.forward(self, x)


def test_a_replica_whose_forward_replaces_its_class_is_not_reused(generator):
    model = BecomesDoubled(4, 4)
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    x = torch.randn(4, 4, generator=generator)
    with torch.no_grad():
        wrapper(x)
        assert torch.equal(wrapper(x), nn.Linear.forward(model, x))
    assert "replaced its class" in wrapper.replica_cache_info().last_rebuild_reason


def test_a_sub_module_whose_class_is_replaced_rebuilds_the_replicas(generator):
    """``module.__class__ = Other`` changes ``forward`` without touching ``__dict__``: the class is in the signature."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    x = torch.randn(4, 4, generator=generator)
    with torch.no_grad():
        wrapper(x)
        model[0].__class__ = Doubled
        assert torch.allclose(wrapper(x), model(x), rtol=1e-12, atol=0)
    assert "class" in wrapper.replica_cache_info().last_rebuild_reason


def test_a_forward_bound_on_the_instance_after_a_step_rebuilds_the_replicas_bound_to_themselves(generator):
    """``m.forward = types.MethodType(f, m)`` (accelerate's mixed-precision patch) sets an attribute, which the
    signature sees: the next call builds replicas, each with ``f`` bound to itself (tests/test_replicate.py,
    ``bound_on_the_instance``), and runs the patch, as stock's fresh copies would (B38)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    x = torch.randn(4, 4, generator=generator)
    with torch.no_grad():
        wrapper(x)
        model[0].forward = types.MethodType(lambda self, x: 2 * nn.Linear.forward(self, x), model[0])
        assert torch.allclose(wrapper(x), model(x), rtol=1e-12, atol=0)
        assert not torch.allclose(wrapper(x), torch.tanh(nn.Linear.forward(model[0], x)))
    assert "attribute" in wrapper.replica_cache_info().last_rebuild_reason


def test_a_torchscript_module_is_replicated_anew_at_every_call(generator):
    """Stock replicates a scripted module (docs/stock-behaviour.md B22); its registries are views of a C++ module, not
    the dicts a skeleton copies: such a tree gets new replicas at every step, with the fresh replicas' numbers."""
    pair = Pair(_mlp(), cpu_ids(2))
    pair.change(lambda model: model.__setitem__(0, torch.jit.script(model[0])))  # torch's deepcopy of one loses its grads
    for _ in range(2):
        pair.step(torch.randn(6, 5, generator=generator))
    assert (pair.info.hits, pair.info.misses) == (0, 2)
    assert "TorchScript" in pair.info.last_rebuild_reason


class _PlainReferences:
    """The modules met, as plain weak references (``weakref.ref`` without a callback), in a dict keyed by them."""

    def __init__(self) -> None:
        self.met: dict = {}

    def __contains__(self, module: nn.Module) -> bool:
        return weakref.ref(module) in self.met

    def add(self, module: nn.Module) -> None:
        self.met[weakref.ref(module)] = True


@pytest.mark.parametrize("kept", [weakref.WeakSet, _PlainReferences], ids=["weak_set", "plain_references"])
def test_a_hook_that_acts_once_per_module_object_acts_at_every_call_as_on_stocks_new_replicas(generator, kept):
    """A forward hook that normalises a module's output the first time it meets the module (the modules seen, kept
    weakly: data-dependent initialisation): stock's replicas are new objects at every call, so it acts at every
    call; the cache's were the same objects, and it acted at the first call only. A weak reference made to a replica
    since the cache bound it counts as one held elsewhere: the next call builds new replicas."""
    def run(cache_replicas: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        met = kept()

        def once_per_module(module, args, output):
            if module not in met:
                met.add(module)
                return output / output.detach().std()
            return output

        model[2].register_forward_hook(once_per_module)
        wrapper = minidp.DataParallel(model, cpu_ids(2), cache_replicas=cache_replicas)
        outputs = []
        for x in torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64):
            output = wrapper(x)
            output.pow(2).mean().backward()
            outputs.append(output.detach())
        return outputs + [p.grad for p in model.parameters()]

    cached, uncached = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(cached, uncached, strict=True))


def test_an_fx_graph_edited_between_calls_runs_edited_as_on_stocks_new_replicas(generator):
    """torch.fx's GraphModule makes its replica from its graph as it is (``GraphModule.__copy__``), so stock's replicas
    run a graph edited in place from the next call on, ``recompile()`` or not; the cache kept the replicas of the first
    call, and their code. A tree that holds a GraphModule is replicated anew at every call, as a TorchScript one is."""
    def run(cache_replicas: bool) -> tuple:
        torch.manual_seed(0)
        graph_module = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double())
        wrapper = minidp.DataParallel(graph_module, cpu_ids(2), cache_replicas=cache_replicas)
        first, second = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        wrapper(first).sum().backward()
        (tanh,) = [node for node in graph_module.graph.nodes if node.op == "call_module" and node.target == "1"]
        with graph_module.graph.inserting_after(tanh):
            tripled = graph_module.graph.call_function(torch.mul, (tanh, 3.0))
        tanh.replace_all_uses_with(tripled)
        tripled.args = (tanh, 3.0)
        output = wrapper(second)
        output.sum().backward()
        info = wrapper.replica_cache_info() if cache_replicas else None
        return [output.detach()] + [p.grad for p in graph_module.parameters()], info

    (cached, info), (uncached, _) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(cached, uncached, strict=True))
    assert info.hits == 0 and "FX GraphModule" in info.last_rebuild_reason
