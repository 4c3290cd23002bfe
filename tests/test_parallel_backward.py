"""The backward of CPU replicas in parallel, one worker thread per replica (minidp/parallel_backward.py).

Every test compares the parallel backward with the serial one, where autograd runs the replicas'
backwards one after the other in the calling thread (``minidp.set_parallel_backward(False)``, what
stock DataParallel's autograd does for replicas that share a device), on the same model and batch,
bitwise. The setting is on for every test here and switched by the test itself, so both
configurations of the suite (replica cache, reduce backend) run the same comparison.
The stock behaviours it keeps are those of docs/stock-behaviour.md and of torch's autograd:
``retain_graph`` (torch/autograd/__init__.py, ``backward``), hooks (torch/nn/modules/module.py,
``register_full_backward_hook``; torch/_tensor.py, ``register_hook``), checkpointing
(torch/utils/checkpoint.py).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings
from typing import Optional

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointFunction as TorchsCheckpointFunction, checkpoint
from torch.utils.flop_counter import FlopCounterMode

import minidp
from minidp import cpu_threads, parallel_backward
from minidp.zoo import SmallCNN, VGGSplit

from .helpers import (
    RTOL_FLOAT64, HearsOutputs, cpu_ids, forked_child, fresh_python, garbage_left_by, max_relative_error,
)
from .stock_emulation import emulated_stock


@pytest.fixture(autouse=True)
def parallel_backward_on(monkeypatch, dataparallel_configuration):
    """On in both configurations (the replica cache and the reduce backend still vary): the tests switch it off themselves."""
    monkeypatch.setattr(parallel_backward, "_enabled", True)


def _images(generator: torch.Generator, rows: int = 16, channels: int = 1, size: int = 28) -> torch.Tensor:
    return torch.randn(rows, channels, size, size, generator=generator)


def _in_parallel(output: torch.Tensor) -> bool:
    """Whether the gathered ``output`` comes from a ParallelBackward node (the replicas' backwards in parallel)."""
    return any(type(fn) is parallel_backward.ParallelBackward._backward_cls for fn, _ in output.grad_fn.next_functions)


def _step(model: nn.Module, x: torch.Tensor, parallel: bool, replicas: int = 2, **backward) -> tuple[list, bool]:
    """One step of ``DataParallel(model copy)`` on ``x``: the original parameters' gradients, and whether it ran in parallel."""
    previous = minidp.set_parallel_backward(parallel)
    try:
        module = copy.deepcopy(model)
        output = minidp.DataParallel(module, cpu_ids(replicas))(x)
        output.square().sum().backward(**backward)
        return [p.grad for p in module.parameters()], _in_parallel(output)
    finally:
        minidp.set_parallel_backward(previous)


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _gradients_both_ways(model: nn.Module, step) -> dict[bool, list]:
    """The parameters' gradients after ``step(copy of model, parallel)`` with the serial backward (``False``) and
    the parallel one (``True``)."""
    grads = {}
    for parallel in (False, True):
        previous = minidp.set_parallel_backward(parallel)
        try:
            module = copy.deepcopy(model)
            step(module, parallel)
            grads[parallel] = [p.grad for p in module.parameters()]
        finally:
            minidp.set_parallel_backward(previous)
    return grads


@pytest.mark.parametrize("replicas", [2, 4])
def test_gradients_are_bitwise_those_of_the_serial_backward(generator, replicas):
    model, x = SmallCNN(), _images(generator, 24)
    serial, serial_parallel = _step(model, x, False, replicas)
    parallel, ran_parallel = _step(model, x, True, replicas)
    assert ran_parallel and not serial_parallel
    assert _equal(parallel, serial)


class _RecordsBackwardThreads(nn.Module):
    """Notes, per replica, the intra-op thread count its backward runs with (a hook on its output's gradient)."""

    def __init__(self, seen: dict[int, int]) -> None:
        super().__init__()
        self.linear, self.seen = nn.Linear(3, 3), seen  # `seen` shared by reference with every replica

    def forward(self, x):
        index, y = minidp.replica_group.current().index, self.linear(x)
        y.register_hook(lambda g: self.seen.__setitem__(index, torch.get_num_threads()))
        return y


@pytest.mark.skipif(not cpu_threads.PER_THREAD_INTRA_OP, reason="thread counts are process-wide without OpenMP")
@pytest.mark.parametrize("threads, expected", [("caller", [4, 4]), ("share", [2, 2])])
def test_each_replica_backward_runs_with_the_chosen_thread_count(generator, threads, expected):
    """With ``"caller"`` (the default) the caller's whole count, as autograd's serial backward; with ``"share"``
    the forward's share."""
    seen: dict[int, int] = {}
    previous_count, previous = torch.get_num_threads(), minidp.set_parallel_backward_threads(threads)
    torch.set_num_threads(4)
    try:
        output = minidp.DataParallel(_RecordsBackwardThreads(seen), cpu_ids(2))(torch.randn(4, 3, generator=generator))
        assert _in_parallel(output)
        output.sum().backward()
        assert [seen[0], seen[1]] == expected
        assert torch.get_num_threads() == 4  # the caller's count restored
    finally:
        torch.set_num_threads(previous_count)
        minidp.set_parallel_backward_threads(previous)


def test_shared_threads_give_the_serial_gradients_up_to_rounding(generator):
    """``"share"`` trades bitwise equality for speed: the gradients agree with the serial backward's to float rounding."""
    model, x = SmallCNN().double(), _images(generator, 24).double()
    serial, _ = _step(model, x, False)
    previous = minidp.set_parallel_backward_threads("share")
    try:
        shared, ran_parallel = _step(model, x, True)
    finally:
        minidp.set_parallel_backward_threads(previous)
    assert ran_parallel
    for a, b in zip(shared, serial):
        assert max_relative_error(a, b) < 1e-12


def test_an_unknown_thread_setting_is_refused_and_changes_nothing():
    with pytest.raises(ValueError, match="threads must be 'caller'.*or 'share'.*got 'all'"):
        minidp.set_parallel_backward_threads("all")
    assert minidp.get_parallel_backward_threads() == "caller"


@pytest.mark.fresh_interpreter
def test_the_default_setting_is_auto():
    done = fresh_python("-c", "import minidp; print(minidp.get_parallel_backward())", timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "auto", done.stderr


@pytest.fixture
def auto_on_cores(monkeypatch):
    """``"auto"``, on a machine of as many cores as the test says, with the caller's intra-op threads as it says."""
    previous_count = torch.get_num_threads()

    def machine(cores: int, threads: int, replica_threads: str = "caller") -> None:
        monkeypatch.setattr(parallel_backward, "_enabled", "auto")
        monkeypatch.setattr(parallel_backward, "_threads", replica_threads)
        monkeypatch.setattr(cpu_threads, "cores", lambda: cores)
        torch.set_num_threads(threads)

    yield machine
    torch.set_num_threads(previous_count)


@pytest.mark.parametrize(
    "cores, threads, replicas, replica_threads, parallel",
    [
        (4, 2, 2, "caller", True),  # two teams of 2 on 4 cores
        (3, 2, 2, "caller", False),  # two teams of 2 on 3 cores: a team member would wait for a core
        (2, 2, 4, "caller", False),
        (1, 1, 4, "caller", True),  # one thread each waits for nobody: any number of them
        (4, 4, 2, "caller", False),  # the caller's 4 each: 8 threads
        pytest.param(4, 4, 2, "share", True, marks=pytest.mark.skipif(
            not cpu_threads.PER_THREAD_INTRA_OP, reason="no per-thread count without OpenMP: no share")),
    ],
)
def test_auto_runs_the_backwards_in_parallel_only_where_their_thread_teams_fit_the_cores(
    generator, auto_on_cores, cores, threads, replicas, replica_threads, parallel
):
    """K teams of T threads fit where K x T <= cores, or T is 1 (README, "When it runs"; the measurements behind the
    rule: BENCHMARKS.md, "Where the parallel backward pays")."""
    auto_on_cores(cores, threads, replica_threads)
    output = minidp.DataParallel(nn.Linear(3, 2), cpu_ids(replicas))(torch.randn(8, 3, generator=generator))
    assert _in_parallel(output) is parallel


def test_auto_gives_the_gradients_of_both_ways_bitwise(generator, auto_on_cores):
    """Whichever way ``"auto"`` chooses, the gradients are those of the serial backward (and so of the parallel one)."""
    model, x = SmallCNN(), _images(generator, 24)
    auto_on_cores(1, 2)  # the serial backward with the caller's 2 threads too
    serial, _ = _step(model, x, False)
    for cores in (1, 4):  # the caller's 2 threads each: serial on 1 core, in parallel on 4
        auto_on_cores(cores, 2)
        auto, ran_parallel = _step(model, x, "auto")
        assert ran_parallel is (cores == 4)
        assert _equal(auto, serial)


@pytest.mark.parametrize("setting", ["on", 1, None])
def test_an_unknown_parallel_backward_setting_is_refused_and_changes_nothing(setting):
    before = minidp.get_parallel_backward()
    with pytest.raises(TypeError, match=f"enabled must be 'auto', True or False, got {setting!r}"):
        minidp.set_parallel_backward(setting)
    assert minidp.get_parallel_backward() is before


def test_auto_is_taken_by_value_as_a_config_file_or_a_pickle_gives_it():
    built = "".join(["au", "to"])  # equal to "auto", another object
    previous = minidp.set_parallel_backward(False)
    try:
        minidp.set_parallel_backward(built)
        assert minidp.get_parallel_backward() == "auto"
    finally:
        minidp.set_parallel_backward(previous)


def test_settings_for_a_block_are_set_back_when_it_raises_and_none_leaves_one_alone():
    before = (minidp.get_parallel_backward(), minidp.get_parallel_backward_threads())
    with pytest.raises(KeyError):
        with parallel_backward.parallel_backward_settings(False, "share"):
            assert (minidp.get_parallel_backward(), minidp.get_parallel_backward_threads()) == (False, "share")
            raise KeyError("inside")
    assert (minidp.get_parallel_backward(), minidp.get_parallel_backward_threads()) == before
    with parallel_backward.parallel_backward_settings(threads="share"):
        assert (minidp.get_parallel_backward(), minidp.get_parallel_backward_threads()) == (before[0], "share")
    with pytest.raises(ValueError, match="got 'all'"):  # a bad second setting: the first is set back too
        with parallel_backward.parallel_backward_settings(False, "all"):
            pass
    assert (minidp.get_parallel_backward(), minidp.get_parallel_backward_threads()) == before


def test_each_replica_backward_runs_in_its_own_thread(generator):
    """Replica 0's backward in the calling thread (as its forward), every other one in a worker of its own."""
    threads: dict[int, str] = {}

    class Records(nn.Module):
        def forward(self, x):
            index = minidp.replica_group.current().index
            x.register_hook(lambda g: threads.__setitem__(index, threading.current_thread().name))
            return x * 2

    x = torch.randn(6, 2, generator=generator, requires_grad=True) * 1  # not a leaf: test_an_input_leaf_...
    minidp.DataParallel(Records(), cpu_ids(3))(x).sum().backward()
    assert threads[0] == threading.current_thread().name
    assert len({threads[0], threads[1], threads[2]}) == 3


def test_the_tracer_shows_each_replica_backward_on_its_own_track_from_its_own_thread(generator):
    model = minidp.DataParallel(SmallCNN(), cpu_ids(3))
    with minidp.trace() as step:
        model(_images(generator, 12)).sum().backward()
    threads = {e.replica: e.thread for e in step.events if e.stage == "backward"}
    assert sorted(threads) == [0, 1, 2]  # one event per replica: one track each
    assert threads[0] == threading.current_thread().name and len(set(threads.values())) == 3


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_the_tracer_counts_each_replica_backward_gradients_whichever_way_it_ran(generator, parallel):
    # Parallel: the span is the replica's backward call; serial (no entries): a hook on each replica parameter.
    model = minidp.DataParallel(SmallCNN(), cpu_ids(3))
    previous = minidp.set_parallel_backward(parallel)
    try:
        with minidp.trace() as step:
            output = model(_images(generator, 12))
            output.sum().backward()
    finally:
        minidp.set_parallel_backward(previous)
    assert _in_parallel(output) == parallel
    backwards = {e.replica: e for e in step.events if e.stage == "backward"}
    reduce_start = min(e.start for e in step.events if e.stage == "reduce")
    assert sorted(backwards) == [0, 1, 2]
    for e in backwards.values():
        assert e.detail == "6 gradients at its end"  # SmallCNN's 6 parameters; its input needs no gradient
        assert e.end <= reduce_start  # the reduction waits for every replica's gradients


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_the_tracer_shows_no_backward_for_a_replica_whose_outputs_get_no_gradient(generator, parallel):
    # A loss of replica 0's output alone: autograd runs none of replica 1's nodes, so neither way shows a backward of it.
    module, devices = nn.Linear(4, 2), cpu_ids(2)
    x = torch.randn(6, 4, generator=generator)
    previous = minidp.set_parallel_backward(parallel)
    try:
        with minidp.trace() as step:
            outputs = minidp.parallel_apply(minidp.replicate(module, devices), [(x[:3],), (x[3:],)], devices=devices)
            outputs[0].sum().backward()
    finally:
        minidp.set_parallel_backward(previous)
    assert (type(outputs[0].grad_fn) is parallel_backward.ParallelBackward._backward_cls) == parallel
    assert [(e.replica, e.detail) for e in step.events if e.stage == "backward"] == [(0, "2 gradients at its end")]


def test_a_replica_backward_that_raises_still_ends_its_span_in_the_trace(generator):
    # as a replica's forward that raises keeps its forward event: the trace shows every replica that ran
    class FailsInAWorker(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("planted failure in a replica's backward")
            return grad

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x):
            return FailsInAWorker.apply(self.linear(x))

    model = minidp.DataParallel(Model(), cpu_ids(2))
    with pytest.raises(RuntimeError, match="planted failure"), minidp.trace() as step:
        model(torch.randn(6, 4, generator=generator)).sum().backward()
    assert {e.replica: e.detail for e in step.events if e.stage == "backward"} == {
        0: "2 gradients at its end", 1: "0 gradients at its end"}


def test_a_replica_backward_that_captured_a_tensor_from_outside_is_traced_to_its_last_parameter(generator):
    # The captured tensor keeps the replicas' backwards serial: their entry nodes run, and their pre-hooks end the span.
    scale = torch.randn(3, generator=generator, requires_grad=True)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            return self.linear(x) * scale

    with minidp.trace() as step:
        output = minidp.DataParallel(Scaled(), cpu_ids(2))(torch.randn(4, 4, generator=generator))
        output.sum().backward()
    assert not _in_parallel(output)
    backwards = {e.replica: e for e in step.events if e.stage == "backward"}
    reduce_start = min(e.start for e in step.events if e.stage == "reduce")
    assert sorted(backwards) == [0, 1]
    assert all(e.detail == "2 gradients at its end" and e.end <= reduce_start for e in backwards.values())


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_parallel_apply_says_whether_each_replica_backward_will_be_one_call(generator, parallel):
    # Where it will, a listener needs no hook on the outputs: the call marks the backward's start and end.
    listener = HearsOutputs()
    previous_setting, previous_listener = minidp.set_parallel_backward(parallel), minidp.hooks.set_listener(listener)
    try:
        output = minidp.DataParallel(SmallCNN(), cpu_ids(3))(_images(generator, 12))
    finally:
        minidp.hooks.set_listener(previous_listener)
        minidp.set_parallel_backward(previous_setting)
    assert listener.announced == [(3, parallel)] and _in_parallel(output) == parallel


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_replicate_looks_for_entries_only_where_it_made_them_at_one_tensor_a_group(monkeypatch, parallel, cached):
    # Reading every tensor's grad_fn is what finding them would cost (minidp.parallel_backward.remember_entries): a
    # replica's parameters come through one entry, so the first that requires grad names it (its buffers, which need
    # none, name none); where the replicas got no entries nothing is read, and a replica noted before is left with
    # none noted.
    searched: list[int] = []
    search = parallel_backward._entries_among
    monkeypatch.setattr(parallel_backward, "_entries_among", lambda tensors: searched.append(len(tensors)) or search(tensors))
    model = SmallCNN()
    with parallel_backward.parallel_backward_settings(parallel):
        replicas = (minidp.ReplicaCache().replicate if cached else minidp.replicate)(model, cpu_ids(2))
    assert searched == ([1, 1] if parallel else [0, 0])
    assert all((replica in parallel_backward._bound_entries) == parallel for replica in replicas)
    for replica in replicas if parallel else ():  # the entries a read of every tensor finds
        every_tensor = [v for m in replica.modules() for v in [*m.__dict__.values(), *m._buffers.values()]
                        if isinstance(v, torch.Tensor)]
        assert parallel_backward._bound_entries[replica] == list(search(every_tensor).values())


def test_the_replicas_backward_shows_in_torch_profiler_as_minidp_backward(generator):
    model = minidp.DataParallel(SmallCNN(), cpu_ids(2))
    with torch.profiler.profile() as profile:  # it records the calling thread: replica 0's backward runs there
        output = model(_images(generator, 8))
        output.sum().backward()
    assert _in_parallel(output)
    assert "minidp::backward" in {item.key for item in profile.key_averages()}


def test_every_replicas_backward_shows_in_torch_profiler_recording_all_threads(generator):
    # README: the default profiler records the calling thread only; profile_all_threads records the workers too
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(experimental_config=config) as profile:
        output = minidp.DataParallel(model, cpu_ids(4))(torch.randn(8, 4, generator=generator))
        output.sum().backward()
    assert _in_parallel(output)
    counts = {item.key: item.count for item in profile.key_averages()}
    assert counts["minidp::backward"] == 4 and counts["AddmmBackward0"] == 8  # two linear layers in each replica


def test_hooks_on_replica_modules_inputs_and_parameters_fire_once_each(generator):
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    fired = {"module": 0, "original parameter": 0}
    model[0].register_full_backward_hook(lambda *_: fired.__setitem__("module", fired["module"] + 1))
    model[2].weight.register_hook(lambda g: fired.__setitem__("original parameter", fired["original parameter"] + 1))

    class Hooked(nn.Module):
        """Registers hooks in forward, on its replica's parameter and input: once per replica each."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.calls = inner, {"replica parameter": 0, "replica input": 0}

        def forward(self, x):
            count = self.calls
            self.inner[2].weight.register_hook(lambda g: count.__setitem__("replica parameter", count["replica parameter"] + 1))
            x.register_hook(lambda g: count.__setitem__("replica input", count["replica input"] + 1))
            return self.inner(x)

    hooked = Hooked(model)
    x = torch.randn(6, 4, generator=generator, requires_grad=True) * 1  # not a leaf: test_an_input_leaf_...
    output = minidp.DataParallel(hooked, cpu_ids(3))(x)
    assert _in_parallel(output)
    output.sum().backward()
    assert fired == {"module": 3, "original parameter": 1}
    assert hooked.calls == {"replica parameter": 3, "replica input": 3}


def test_a_grad_that_captures_at_a_shared_node_runs_every_output_s_hooks_hence_an_entry_per_replica(generator):
    """Why each replica's graph ends at an entry of its own, not at its outputs of the shared Broadcast: autograd runs
    the hooks of all a node's outputs when ``torch.autograd.grad`` captures there (ReplicaEntry's docstring). Should
    torch stop doing so, the entries could go."""

    class TwoAliases(torch.autograd.Function):  # a Broadcast to two replicas on the source device, in small
        @staticmethod
        def forward(ctx, tensor):
            return tensor.detach(), tensor.detach()

        @staticmethod
        def backward(ctx, first, second):
            return first

    source = torch.randn(3, generator=generator, requires_grad=True)
    replica_0, replica_1 = TwoAliases.apply(source)
    seen = {0: [], 1: []}
    replica_0.register_hook(lambda g: seen[0].append(g))
    replica_1.register_hook(lambda g: seen[1].append(g))
    (gradient,) = torch.autograd.grad((replica_0 * 2).sum(), [torch.autograd.graph.GradientEdge(replica_0.grad_fn, 0)])
    assert torch.equal(gradient, torch.full((3,), 2.0))
    assert len(seen[0]) == 1 and seen[1] == [None]  # replica 1's hook ran in replica 0's backward


class _ReluInPlaceFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x):
        return self.linear(torch.relu_(x))  # what nn.ReLU(inplace=True) as the first layer does


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
@pytest.mark.parametrize("view", [False, True], ids=["leaf", "view of a leaf"])
def test_an_input_leaf_that_requires_grad_is_refused_an_in_place_change_as_on_one_device(generator, parallel, view):
    # Autograd refuses an in-place change of a leaf that requires grad, or of a view of one ("a leaf Variable that
    # requires grad is being used in an in-place operation"), before it changes anything: each replica raises it (named
    # by its index), whichever way the backwards run, and the caller's tensors keep their values.
    leaves = [torch.randn(4, 6, generator=generator, requires_grad=True) for _ in range(2)]
    inputs = [leaf[1:] if view else leaf for leaf in leaves]
    before = [leaf.detach().clone() for leaf in leaves]
    previous = minidp.set_parallel_backward(parallel)
    try:
        with pytest.raises(RuntimeError, match="Caught RuntimeError in replica 0") as raised:
            minidp.parallel_apply(minidp.replicate(_ReluInPlaceFirst(), cpu_ids(2)), [(x,) for x in inputs], devices=cpu_ids(2))
    finally:
        minidp.set_parallel_backward(previous)
    assert "leaf Variable that requires grad is being used in an in-place operation" in str(raised.value)
    assert _equal(leaves, before)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_a_chunk_of_a_batch_that_requires_grad_is_refused_an_in_place_change_in_the_replica(generator, parallel):
    # The first chunk is a view made by split, a function returning several views, whose in-place change autograd
    # refuses: in replica 0's forward, named, before the batch (a layer's output before the wrapped module) changes.
    x = torch.randn(8, 6, generator=generator).requires_grad_() * 1
    before = x.detach().clone()
    previous = minidp.set_parallel_backward(parallel)
    try:
        with pytest.raises(RuntimeError, match="Caught RuntimeError in replica 0") as raised:
            minidp.DataParallel(_ReluInPlaceFirst(), cpu_ids(2))(x)
    finally:
        minidp.set_parallel_backward(previous)
    assert "is a view" in str(raised.value) and "modified inplace" in str(raised.value)
    assert torch.equal(x.detach(), before)


def test_a_replica_output_changed_in_place_is_back_propagated_as_on_the_serial_path(generator):
    # Autograd takes an in-place change of a tensor that no node saved (a linear layer's output): so does the serial
    # path, and so must the parallel one, whose outputs are aliases of the replicas' (the same version counter).
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        outputs = minidp.DataParallel(module, cpu_ids(2), gather_output=False)(x)
        for output in outputs:
            output.mul_(2)
        torch.cat(outputs).square().sum().backward()

    grads = _gradients_both_ways(nn.Linear(4, 3).double(), step)
    assert _equal(grads[True], grads[False])


class _SharedOutputs(nn.Module):
    """Returns one tensor in several places: twice, with a view of it, or three times."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        self.linear, self.returns = nn.Linear(4, 3), returns

    def forward(self, x):
        y = self.linear(x)
        return {"twice": (y, y), "with_a_view": (y, y[:, :1]), "thrice": (y, y, y)}[self.returns]


@pytest.mark.parametrize("returns", ["twice", "with_a_view", "thrice"])
def test_outputs_that_share_memory_give_the_serial_gradients(generator, returns):
    # join's docstring: outputs that share memory keep the serial backward. Changed in place, the first output's
    # change must reach the second's gradient (autograd tracks it between a tensor and its views); three gradients of
    # one tensor must be summed in the serial path's order.
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        outputs = minidp.DataParallel(module, cpu_ids(2), gather_output=False)(x)
        for first, *rest in outputs:
            first.mul_(3)
        sum((rest[0] * t).sum() for _, *rest in outputs for t in rest).backward()

    grads = _gradients_both_ways(_SharedOutputs(returns).double(), step)
    assert _equal(grads[True], grads[False])


class _Bag:
    """An output object gather rebuilds from its items (``type(first)(items)``, docs/stock-behaviour.md B28), as it does
    Hugging Face's ``DynamicCache``: the walkers do not look inside it."""

    def __init__(self, items) -> None:
        self.items = list(items)

    def __iter__(self):
        return iter(self.items)


class _ReturnsABag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return h * 3, _Bag([h * 2])  # both made from one saved activation


def test_an_output_holding_tensors_in_an_object_gather_rebuilds_from_its_items_keeps_the_serial_backward(generator):
    # The cut would reroute the tensor it sees and not the one in the bag; the loss reaching the replica's nodes
    # through both, the parallel backward freed what the other path still needed ("backward through the graph a
    # second time"). Stock back-propagates it; so does the serial path, which such an output keeps.
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        y, bag = minidp.DataParallel(module, cpu_ids(2))(x)
        assert not _in_parallel(y)
        (y.square().sum() + list(bag)[0].pow(3).sum()).backward()

    grads = _gradients_both_ways(_ReturnsABag().double(), step)
    assert _equal(grads[True], grads[False])


@dataclasses.dataclass
class _WithAnAuxiliary:
    """A dataclass output with a tensor beside its fields, set in ``__post_init__``: gather's shallow copy keeps it,
    the walkers see only the fields."""

    main: torch.Tensor

    def __post_init__(self) -> None:
        self.auxiliary = self.main * 2


class _ReturnsADataclassWithAnAuxiliary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return _WithAnAuxiliary(torch.tanh(self.linear(x)))


def test_a_dataclass_output_with_a_tensor_beside_its_fields_keeps_the_serial_backward(generator):
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        output = minidp.DataParallel(module, cpu_ids(2))(x)
        (output.main.square().sum() + output.auxiliary.sum()).backward()

    grads = _gradients_both_ways(_ReturnsADataclassWithAnAuxiliary().double(), step)
    assert _equal(grads[True], grads[False])


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x):
        return self.first(x), self.second(x)


def test_heads_back_propagated_one_by_one_give_the_serial_gradients_where_the_first_keeps_the_graph(generator):
    # The module docstring: the first backward lets go of every replica's outputs, so the second head's backward is
    # taken where the first kept the graph; the serial path takes it without (autograd frees only what the first ran).
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        first, second = minidp.DataParallel(module, cpu_ids(2))(x)
        first.sum().backward(retain_graph=parallel)
        second.square().sum().backward()

    grads = _gradients_both_ways(_TwoHeads().double(), step)
    assert _equal(grads[True], grads[False])


def test_a_second_head_back_propagated_after_the_graph_was_let_go_of_raises_autograds_error(generator):
    first, second = minidp.DataParallel(_TwoHeads(), cpu_ids(2))(torch.randn(8, 4, generator=generator))
    first.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        second.sum().backward()


def test_retain_graph_lets_a_second_backward_add_the_same_gradients(generator):
    model, x = SmallCNN(), _images(generator)
    once, _ = _step(model, x, True)
    module = copy.deepcopy(model)
    output = minidp.DataParallel(module, cpu_ids(2))(x).square().sum()
    output.backward(retain_graph=True)
    output.backward()
    assert _equal([p.grad for p in module.parameters()], [g + g for g in once])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        output.backward()


class _ParameterFreeHead(nn.Module):
    """Two outputs: a linear layer's, and one that no parameter made."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x), x * 2


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_a_loss_that_reaches_no_replica_parameter_leaves_the_parameters_without_gradients(generator, parallel):
    """Only the head that no parameter made is back-propagated. On one device, and with the replicas' graphs run one by
    one, the backward never reaches the parameters: their ``.grad`` stays None, so that an optimizer skips them (a
    weight decay would move them for a gradient of zeros), and ``torch.autograd.grad`` on them raises autograd's
    error. The parallel backward reaches replicate's node through the one node that joins every replica's entries,
    and must leave them the same."""
    model = _ParameterFreeHead().double()
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True) * 1
    previous = minidp.set_parallel_backward(parallel)
    try:
        _, head = minidp.DataParallel(model, cpu_ids(2))(x)
        assert _in_parallel(head) == parallel
        head.square().sum().backward(retain_graph=True)
        assert all(p.grad is None for p in model.parameters())
        with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
            torch.autograd.grad(head.sum(), list(model.parameters()))
    finally:
        minidp.set_parallel_backward(previous)


def test_a_later_backward_of_a_kept_graph_reaches_the_parameters_an_earlier_one_did_not(generator):
    """The head no parameter made, back-propagated to the batch alone first (the graph kept), then the other head: the
    second backward gives the parameters the serial backward's gradients; what the first said of replicate's node
    (nothing reached it) was that backward's only."""
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True)

    def step(model: nn.Module, parallel: bool) -> None:
        out, head = minidp.DataParallel(model, cpu_ids(2))(x * 1)
        assert _in_parallel(head) == parallel
        torch.autograd.grad(head.sum(), x, retain_graph=True)
        out.square().sum().backward()

    grads = _gradients_both_ways(_ParameterFreeHead().double(), step)
    assert all(g is not None for g in grads[True]) and _equal(grads[True], grads[False])


def test_a_kept_graph_back_propagated_to_the_batch_alone_leaves_replicates_node_nothing_to_keep(generator):
    """``torch.autograd.grad`` of the batch alone, again and again on one kept graph, runs the parallel backward but
    not replicate's node: what the parallel backward tells that node is kept only for a backward that will run it, so
    such a graph holds nothing more for each backward."""
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    out, head = minidp.DataParallel(_ParameterFreeHead().double(), cpu_ids(2))(x * 1)
    assert _in_parallel(head)
    for _ in range(5):
        torch.autograd.grad(out.sum() + head.sum(), x, retain_graph=True)
    nodes, pending = [], [out.grad_fn]
    while pending:  # the graph's nodes, to replicate's
        node = pending.pop()
        nodes.append(node)
        pending += [following for following, _ in node.next_functions if following is not None]
    (replicates,) = {node for node in nodes if type(node) is minidp.step5_reduce.Broadcast._backward_cls}
    assert replicates.unreached_in == {}


@pytest.mark.parametrize("first_head", ["parameters", "no gradient"])
def test_replicas_applied_twice_give_the_parameters_what_either_application_reached(generator, first_head):
    """One ``replicate``, its replicas run twice (two ``parallel_apply`` calls, so two parallel backwards lead to the
    one node of ``replicate``): the loss takes the parameters' head from the first and the head no parameter made from
    the second. The second reaches no parameter; what the first brought is summed all the same, as serially: the
    parameters' gradients, or (a head that reaches the weight with no gradient) autograd's zeros."""
    x = torch.randn(2, 6, 4, generator=generator, dtype=torch.float64)

    def step(model: nn.Module, parallel: bool) -> None:
        replicas = minidp.replicate(model, cpu_ids(2))
        first = minidp.parallel_apply(replicas, [(chunk * 1,) for chunk in x[0].chunk(2)])
        second = minidp.parallel_apply(replicas, [(chunk.requires_grad_() * 1,) for chunk in x[1].chunk(2)])
        assert (type(second[0][1].grad_fn) is parallel_backward.ParallelBackward._backward_cls) == parallel
        (sum(out.sum() for out, _ in first) + sum(head.sum() for _, head in second)).backward()

    model = _ParameterFreeHead().double() if first_head == "parameters" else _TwoHeadsOneWithoutGradient()
    grads = _gradients_both_ways(model, step)
    assert all(g is not None for g in grads[True]) and _equal(grads[True], grads[False])


class _NoGradientForTheWeight(torch.autograd.Function):
    """``x`` scaled by the sum of ``weight``, whose backward returns None for the weight: autograd reaches the
    weight with no gradient."""

    @staticmethod
    def forward(ctx, x, weight):
        return x * weight.detach().sum()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _WeightWithoutGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x):
        return _NoGradientForTheWeight.apply(x, self.weight)


class _TwoHeadsOneWithoutGradient(_WeightWithoutGradient):
    """The weight's head, which reaches it with no gradient, and a head no parameter made."""

    def forward(self, x):
        return super().forward(x), x * 2


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_a_parameter_the_backward_reaches_with_no_gradient_gets_stocks_zeros(generator, parallel):
    """Reached, but handed None (a custom Function's backward returns None for it): stock's Broadcast is run, autograd
    gives it zeros for each replica, and their sum is the parameter's gradient, as the emulation of stock shows
    (docs/stock-behaviour.md B31); unlike a parameter the backward never reaches (the test above)."""
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    stock = _WeightWithoutGradient()
    with emulated_stock(2):
        nn.DataParallel(stock, device_ids=[0, 1])(x.requires_grad_() * 1).sum().backward()
    model = _WeightWithoutGradient()
    previous = minidp.set_parallel_backward(parallel)
    try:
        output = minidp.DataParallel(model, cpu_ids(2))(x * 1)  # not a leaf: test_an_input_leaf_...
        assert _in_parallel(output) == parallel
        output.sum().backward()
    finally:
        minidp.set_parallel_backward(previous)
    assert torch.equal(stock.weight.grad, torch.zeros(4, dtype=torch.float64))
    assert torch.equal(model.weight.grad, stock.weight.grad)


class _Identity(torch.autograd.Function):
    """The identity (a copy) in the forward; each subclass gives the backward a test plants in a replica."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()


class _FailsInBackward(_Identity):
    @staticmethod
    def backward(ctx, grad):
        raise ValueError("planted failure")


class _FailsInReplica(nn.Module):
    def __init__(self, failing: int):
        super().__init__()
        self.linear, self.failing = nn.Linear(4, 4), failing

    def forward(self, x):
        y = self.linear(x)
        membership = minidp.replica_group.current()  # None when called directly
        return _FailsInBackward.apply(y) if membership and membership.index == self.failing else y


def test_a_replica_whose_backward_raises_is_named_and_leaves_the_gradients_untouched(generator):
    # float64: the later step's sum over 3 replicas is compared with one device's (float32 rounding of
    # that split sum differs by a few units in the last place, more than allclose's tolerance for some seeds)
    model = _FailsInReplica(failing=1).double()
    before = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in model.parameters()]
    for p, g in zip(model.parameters(), before):
        p.grad = g.clone()
    wrapped = minidp.DataParallel(model, cpu_ids(3))
    output = wrapped(torch.randn(6, 4, generator=generator, dtype=torch.float64))
    assert _in_parallel(output)
    with pytest.raises(ValueError, match="in the backward of replica 1 on device cpu"):
        output.sum().backward()
    assert _equal([p.grad for p in model.parameters()], before)
    model.failing = None  # the next step runs and sums as usual
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    wrapped(x).sum().backward()
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    reference(x).sum().backward()
    assert all(torch.allclose(p.grad, b + r.grad) for p, b, r in zip(model.parameters(), before, reference.parameters()))


class _StepFailed(Exception):
    """An error a training loop catches by its type, made with two arguments and carrying an attribute."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class _Applies(nn.Module):
    """A module whose forward is the autograd Function it is given."""

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function.apply(x)


class _RaisesAnError(_Identity):
    error: Optional[BaseException] = None  # what the backward raises, the test's own object

    @staticmethod
    def backward(ctx, grad):
        raise _RaisesAnError.error


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_a_replica_backward_raises_the_very_error_it_raised_as_autograd_does(generator, parallel):
    """Autograd re-raises the error a backward raised, the object itself (stock's backward wraps nothing): ``except``
    by its type and its attributes work, whichever way the replicas' backwards ran."""
    _RaisesAnError.error = _StepFailed("planted failure", step=17)
    model = minidp.DataParallel(nn.Sequential(nn.Linear(4, 4), _Applies(_RaisesAnError)), cpu_ids(2))
    previous = minidp.set_parallel_backward(parallel)
    try:
        output = model(torch.randn(6, 4, generator=generator))
        assert _in_parallel(output) == parallel
        named = "in the backward of replica 0 on device cpu" if parallel else None  # a note, where minidp raises it
        with pytest.raises(_StepFailed, match=named) as raised:
            output.sum().backward()
    finally:
        minidp.set_parallel_backward(previous)
    assert raised.value is _RaisesAnError.error and raised.value.step == 17


def test_a_replica_whose_backward_raises_leaves_no_reference_cycles(generator):
    """docs/stock-behaviour.md B36, for the backward: the replica's own error, raised in the caller with its
    traceback, leaves no loop."""
    model, x = _FailsInReplica(failing=0), torch.randn(6, 4, generator=generator)

    def failing_step():
        output = minidp.DataParallel(model, cpu_ids(2))(x)
        assert _in_parallel(output)
        with pytest.raises(ValueError, match="backward of replica 0"):
            output.sum().backward()

    failing_step()  # the process's first replica threads load what it keeps (ctypes' types: cycles of their own)
    assert garbage_left_by(failing_step) == 0


def test_anomaly_detection_keeps_the_serial_backward_and_names_the_users_node(generator):
    """torch/autograd/anomaly_mode.py: a backward that makes a NaN is named by its node, warned with the forward's
    traceback that made it; the cut would add a node of minidp's own to the report, so anomaly mode keeps it out."""
    class MakesNaN(nn.Module):
        def forward(self, x):
            return (x * 0).sqrt()  # sqrt's gradient at 0 is inf; times 0, NaN in MulBackward0

    model = minidp.DataParallel(nn.Sequential(nn.Linear(4, 4), MakesNaN()), cpu_ids(2))
    with torch.autograd.set_detect_anomaly(True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = model(torch.randn(6, 4, generator=generator))
        assert not _in_parallel(output)
        with pytest.raises(RuntimeError, match="^Function 'MulBackward0' returned nan values"):
            output.sum().backward()
    reported = {str(w.message).split()[3] for w in caught if str(w.message).startswith("Error detected in")}
    assert reported == {"MulBackward0."}


def test_second_order_gradients_run_serially_and_equal_the_serial_path(generator):
    """``create_graph=True``: the node runs the replicas' backwards one after the other, in grad mode."""
    model, x = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double(), torch.randn(8, 4, generator=generator, dtype=torch.float64)
    results = {}
    for parallel in (False, True):
        minidp.set_parallel_backward(parallel)
        try:
            module = copy.deepcopy(model)
            output = minidp.DataParallel(module, cpu_ids(2))(x)
            assert _in_parallel(output) == parallel
            grads = torch.autograd.grad(output.sum(), list(module.parameters()), create_graph=True)
            sum(g.square().sum() for g in grads).backward()  # a gradient penalty
            results[parallel] = [*grads, *(p.grad for p in module.parameters())]
        finally:
            minidp.set_parallel_backward(True)
    assert _equal([t.detach() for t in results[True]], [t.detach() for t in results[False]])


class _RoundsToBfloat16(TorchDispatchMode):
    """Rounds every floating result to bfloat16 and back: a precision emulation, a mode whose work changes the numbers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.is_floating_point() and func is not torch.ops.aten.detach.default:
            return result.to(torch.bfloat16).to(result.dtype)
        return result


def test_a_dispatch_mode_around_the_backward_runs_every_replica_s_backward_under_it(generator):
    """A mode belongs to the thread that entered it; autograd runs the backward it starts under it, every replica's
    nodes included (serially, and in stock, whose engine carries it to the threads that run the graph). So the
    replicas' backwards run one after the other under it: torch's FlopCounterMode counts what the serial backward
    does, and a mode that changes the numbers gives the serial gradients, bit for bit."""
    model, x = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double(), torch.randn(8, 4, generator=generator, dtype=torch.float64)
    flops, grads = {}, {}
    for parallel in (False, True):
        minidp.set_parallel_backward(parallel)
        try:
            for mode, results in ((lambda: FlopCounterMode(display=False), flops), (_RoundsToBfloat16, grads)):
                module = copy.deepcopy(model)
                output = minidp.DataParallel(module, cpu_ids(2))(x)
                assert _in_parallel(output) == parallel
                loss = output.square().sum()
                with mode() as active:
                    loss.backward()
                results[parallel] = active.get_total_flops() if results is flops else [p.grad for p in module.parameters()]
        finally:
            minidp.set_parallel_backward(True)
    assert flops[True] == flops[False] > 0
    assert _equal(grads[True], grads[False])


@pytest.mark.parametrize("loss", ["output_and_penalty", "penalty_alone"])
@pytest.mark.parametrize("penalty_on", ["inputs", "parameters"])
def test_a_penalty_on_a_gradient_made_with_create_graph_equals_the_serial_path_to_rounding(generator, penalty_on, loss):
    """A WGAN-GP critic's loss (the output, plus a penalty on its gradient with respect to the inputs, made with
    ``create_graph=True``), or the same with a penalty on the parameters' gradient; or the penalty alone, on the
    gradient of a loss that is not linear in the output (an input-gradient regulariser), whose graph goes back
    through the output. The penalty's graph reaches each replica's nodes by itself, apart from the cut, which
    back-propagates the output's part: the two parts meet at the replicas' entries, where the serial backward adds
    them inside each replica's graph. README says so; stock's gradients bit for bit need
    ``set_parallel_backward(False)``, which ``tests/test_against_stock.py`` compares."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = torch.randn(12, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        inputs = x.clone().requires_grad_()
        output = minidp.DataParallel(module, cpu_ids(2))(inputs * 1)  # not the leaf itself: test_an_input_leaf_...
        assert _in_parallel(output) == parallel
        wrt = [inputs] if penalty_on == "inputs" else list(module.parameters())
        graded = output.sum() if loss == "output_and_penalty" else output.square().sum()
        penalty = 10 * sum((s.norm() - 1).square() for s in torch.autograd.grad(graded, wrt, create_graph=True))
        (output.mean() + penalty if loss == "output_and_penalty" else penalty).backward()

    grads = _gradients_both_ways(model, step)
    for parallel, serial in zip(grads[True], grads[False]):  # rounding, relative to each gradient's largest element
        assert max_relative_error(parallel, serial) < 1e-13


def _penalty_step(call, parameters) -> None:
    """A loss plus a penalty on its parameters' gradient made with ``create_graph=True``, back-propagated at once
    without ``retain_graph``: the usual gradient-penalty step."""
    loss = call().square().sum()
    grads = torch.autograd.grad(loss, parameters, create_graph=True)
    (loss + sum(g.square().sum() for g in grads)).backward()


def test_a_penalty_step_in_a_thread_of_its_own_equals_the_serial_path_to_rounding(generator):
    """A penalty step run from a new thread, after steps in this one: the workers counted more autograd nodes than
    the new thread, so the replicas' nodes come before the node that cuts them in the order autograd runs a graph,
    and the penalty's way into them (the double backward reads what they saved) reached them first, freed them, and
    the cut's backward found them freed. The serial backward takes it; so does the cut, whose second-order
    gradients reach the replicas' nodes only through a backward of minidp's own (``MadeGradients``)."""
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double(), torch.randn(6, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        wrapped = minidp.DataParallel(module, cpu_ids(2))
        for _ in range(3):  # steps in this thread: the workers count the replicas' nodes
            wrapped(x).sum().backward()
        module.zero_grad()
        failures = []

        def penalty_step_here():
            try:
                _penalty_step(lambda: wrapped(x), list(module.parameters()))
            except RuntimeError as error:
                failures.append(error)

        worker = threading.Thread(target=penalty_step_here)
        worker.start()
        worker.join()
        assert not failures, failures

    grads = _gradients_both_ways(model, step)
    for parallel, serial in zip(grads[True], grads[False]):
        assert max_relative_error(parallel, serial) < 1e-13


def test_a_penalty_through_two_wrappers_in_a_row_equals_the_serial_path_to_rounding(generator):
    """``head(encoder(x))``, each a DataParallel, and a penalty on every parameter's gradient: the penalty's graph
    reaches the encoder's replicas' nodes while the cut of the head's region still waits for its turn."""
    encoder, head = nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double(), nn.Linear(8, 3).double()
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)

    def step(model, parallel):
        wrapped_encoder, wrapped_head = (minidp.DataParallel(m, cpu_ids(2)) for m in model)
        _penalty_step(lambda: wrapped_head(wrapped_encoder(x)), list(model.parameters()))

    grads = _gradients_both_ways(nn.ModuleList([encoder, head]), step)
    for parallel, serial in zip(grads[True], grads[False]):
        assert max_relative_error(parallel, serial) < 1e-13


@pytest.mark.parametrize("first", ["parameters", "inputs"])
def test_third_order_gradients_equal_the_serial_path_to_rounding(generator, first):
    """Gradients of gradients of gradients (``create_graph=True`` twice, then a plain one): the second backward through
    the node brings root gradients whose graph leads back into the replicas' entries, which are not put behind a node
    of their own again (a first fix did so, and counted that way twice: relative errors of 0.16 to 0.78)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        inputs = x.clone().requires_grad_()
        output = minidp.DataParallel(module, cpu_ids(2))(inputs * 1)  # not the leaf itself: it keeps them serial
        assert _in_parallel(output) == parallel
        parameters = list(module.parameters())
        wrt = parameters if first == "parameters" else [inputs]
        first_order = torch.autograd.grad(output.tanh().square().sum(), wrt, create_graph=True)
        second_order = torch.autograd.grad(sum(g.square().sum() for g in first_order), parameters, create_graph=True)
        sum(g.pow(3).sum() for g in second_order).backward()

    grads = _gradients_both_ways(model, step)
    for parallel, serial in zip(grads[True], grads[False]):
        assert max_relative_error(parallel, serial) < 1e-12


def test_a_second_backward_that_brings_the_replicas_no_gradient_raises_autograd_s_error(generator):
    """A second backward, without ``retain_graph``, that reaches the replicated region with ``None`` gradients only
    (a Function whose backward gives the output none): autograd's "backward through the graph a second time", as
    the serial backward raises it."""

    class GradientForTheOtherOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, output, other):
            return output.sum() + other.sum()

        @staticmethod
        def backward(ctx, grad):
            return None, grad.expand(3)

    for parallel in (False, True):
        with parallel_backward.parallel_backward_settings(parallel):
            output = minidp.DataParallel(nn.Linear(4, 3).double(), cpu_ids(2))(torch.randn(6, 4, generator=generator, dtype=torch.float64))
            assert _in_parallel(output) == parallel
            output.square().sum().backward()
            with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
                GradientForTheOtherOnly.apply(output, torch.zeros(3, dtype=torch.float64, requires_grad=True)).backward()


@pytest.mark.parametrize("input_requires_grad", [False, True], ids=["tangent_only", "tangent_and_grad"])
def test_a_forward_mode_tangent_comes_out_as_through_the_serial_path(generator, input_requires_grad):
    """``torch.autograd.forward_ad``: a dual input's tangent reaches the output, equal to the serial path's, and the
    gradients after it too (stock refuses: its Scatter has no jvp). The node that cuts the replicas' backwards would
    give aliases without a tangent: an output with one keeps the serial backward."""
    import torch.autograd.forward_ad as forward_ad

    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, direction = (torch.randn(6, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    tangents = {}

    def step(module, parallel):
        with forward_ad.dual_level():
            inputs = forward_ad.make_dual(x.clone().requires_grad_(input_requires_grad), direction)
            output = minidp.DataParallel(module, cpu_ids(2))(inputs)
            tangents[parallel] = forward_ad.unpack_dual(output).tangent
        output.square().sum().backward()

    grads = _gradients_both_ways(model, step)
    assert tangents[False] is not None and torch.equal(tangents[True], tangents[False])
    assert _equal(grads[True], grads[False])


class _Checkpointed(nn.Module):
    """A linear layer, then a block recomputed in the backward: by ``torch.utils.checkpoint``, re-entrant or not, or
    by the re-entrant checkpoint Function ``function`` applied as it is."""

    def __init__(self, use_reentrant: bool = True, function: Optional[type[torch.autograd.Function]] = None):
        super().__init__()
        self.stem, self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 2)
        self.use_reentrant, self.function = use_reentrant, function

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.first(h))

    def forward(self, x):
        h = self.stem(x)
        if self.function is None:
            h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        elif issubclass(self.function, TorchsCheckpointFunction):
            h = self.function.apply(self.block, True, h)  # preserve_rng_state
        else:
            h = self.function.apply(self.block, h)
        return self.second(h)


def test_non_reentrant_checkpointing_runs_in_parallel_with_the_serial_gradients(generator):
    model, x = _Checkpointed(use_reentrant=False), torch.randn(8, 4, generator=generator)
    serial, _ = _step(model, x, False)
    parallel, ran_parallel = _step(model, x, True)
    assert ran_parallel and _equal(parallel, serial)


def test_reentrant_checkpointing_keeps_the_serial_backward(generator):
    """Its backward runs a backward of its own past the replica's entries: the replicas stay serial, as before."""
    model, x = _Checkpointed(use_reentrant=True), torch.randn(8, 4, generator=generator)
    serial, _ = _step(model, x, False)
    parallel, ran_parallel = _step(model, x, True)
    assert not ran_parallel and _equal(parallel, serial)


class _OwnCheckpoint(TorchsCheckpointFunction):
    """torch's re-entrant checkpoint, subclassed (to log, say)."""


class CheckpointFunction(torch.autograd.Function):
    """A copy of torch's re-entrant checkpoint, as Megatron-LM keeps one under this name, with its check that the
    backward was started by ``backward()`` (``torch.autograd._is_checkpoint_valid()``)."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        torch.autograd.backward(outputs, grads)
        return (None, *(t.grad for t in inputs))


@pytest.mark.parametrize("function", [_OwnCheckpoint, CheckpointFunction], ids=["subclass of torch's", "copy"])
def test_a_reentrant_checkpoint_not_torchs_own_class_keeps_the_serial_backward(generator, function):
    # a worker's backward is a torch.autograd.grad, which the copy's check refuses and torch's class refuses itself
    model, x = _Checkpointed(function=function).double(), torch.randn(8, 4, generator=generator, dtype=torch.float64)
    serial, _ = _step(model, x, False)
    parallel, ran_parallel = _step(model, x, True)
    assert not ran_parallel and _equal(parallel, serial)


def test_reentrant_checkpointing_on_three_replicas_keeps_the_serial_backward_to_rounding(generator):
    """Each replica's re-entrant backward adds its share to the parameters' ``.grad`` by itself; the entries' nodes
    take places in autograd's order, so three of them may run in another order than with the setting off (README)."""
    x = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    _assert_serial_to_rounding(_Checkpointed(use_reentrant=True).double(), x, replicas=3)


def _assert_serial_to_rounding(model: nn.Module, x: torch.Tensor, replicas: int) -> None:
    """``model``'s replicas keep the serial backward with the setting on, and give the serial gradients to rounding."""
    serial, _ = _step(model, x, False, replicas=replicas)
    parallel, ran_parallel = _step(model, x, True, replicas=replicas)
    assert not ran_parallel
    for got, expected in zip(parallel, serial, strict=True):
        assert max_relative_error(got, expected) < 1e-13


def test_nested_data_parallel_runs_in_parallel_with_the_serial_gradients(generator):
    """VGGSplit calls data_parallel on its sub-modules inside forward: each inner call cuts its own region."""
    model, x = VGGSplit(cpu_ids(2)), _images(generator, 8)
    serial, _ = _step(model, x, False)
    parallel, ran_parallel = _step(model, x, True)
    assert ran_parallel and _equal(parallel, serial)


def test_a_replica_that_reaches_a_tensor_from_outside_keeps_the_serial_backward(generator):
    """A plain tensor attribute that requires grad is shared by every replica (shallow copies): its
    gradient must be summed across them by autograd, so the backwards stay one after the other."""
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * self.scale

    model = Scaled(3, 3)
    model.scale = torch.randn(3, generator=generator, requires_grad=True)
    x = torch.randn(6, 3, generator=generator)
    grads = {}
    for parallel in (False, True):
        minidp.set_parallel_backward(parallel)
        try:
            model.scale.grad = None
            output = minidp.DataParallel(model, cpu_ids(2))(x)
            assert not _in_parallel(output)
            output.sum().backward()
            grads[parallel] = model.scale.grad
        finally:
            minidp.set_parallel_backward(True)
    assert torch.equal(grads[True], grads[False])



def test_a_replica_given_another_parameter_after_replicate_keeps_the_serial_backward(generator):
    """replicate notes which entries each replica's tensors came through; a replica whose parameter is
    replaced afterwards (by hand, before parallel_apply) is walked, found to reach outside, and stays serial."""
    model = nn.Linear(3, 3)
    outside = torch.randn(3, 3, generator=generator, requires_grad=True)
    x = torch.randn(6, 3, generator=generator)
    grads = {}
    for parallel in (False, True):
        minidp.set_parallel_backward(parallel)
        try:
            outside.grad, model.weight.grad = None, None
            replicas = minidp.replicate(model, cpu_ids(2))
            replicas[1].weight = outside * 1.0  # a plain tensor in autograd, not through the replica's entry
            outputs = minidp.parallel_apply(replicas, list(minidp.scatter(x, cpu_ids(2))))
            output = minidp.gather(outputs, "cpu")
            assert not _in_parallel(output)
            output.square().sum().backward()
            grads[parallel] = (outside.grad, model.weight.grad)
        finally:
            minidp.set_parallel_backward(True)
    assert torch.equal(grads[True][0], grads[False][0]) and torch.equal(grads[True][1], grads[False][1])

TRAIN_STEP = """
import torch, minidp
from torch import nn
minidp.set_parallel_backward(True)  # in parallel whatever the cores ("auto" may keep it serial)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
wrapped = minidp.DataParallel(model, ["cpu"] * 2)
x = torch.randn(8, 4)
def grads(_=None):
    model.zero_grad(set_to_none=True)
    wrapped(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]
expected = grads()  # the parent's worker threads have run a backward from here on
"""


@pytest.mark.fresh_interpreter
def test_a_forked_child_runs_the_parallel_backward():
    script = TRAIN_STEP + forked_child("all(torch.equal(a, b) for a, b in zip(grads(), expected))",
                                       "its first parallel backward")
    done = fresh_python("-c", script, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.fresh_interpreter
def test_ctrl_c_in_the_backward_waits_for_every_replica_then_reraises():
    """Ctrl-C while replica 1's backward computes: KeyboardInterrupt comes from backward() once it is done,
    and the process exits cleanly (a worker left inside a kernel at exit aborts it)."""
    script = """
import signal, threading, time, torch, minidp
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where a background launch left SIGINT ignored
from torch import nn

class SlowBackward(torch.autograd.Function):
    finished, seconds = False, 0.0
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, grad):
        end = time.monotonic() + SlowBackward.seconds
        while time.monotonic() < end:
            grad = grad @ torch.eye(grad.shape[1])
        SlowBackward.finished = True
        return grad

class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(300, 300)
    def forward(self, x):
        y = self.linear(x)
        return SlowBackward.apply(y) if minidp.replica_group.current().index == 1 else y

minidp.set_parallel_backward(True)  # in parallel whatever the cores ("auto" may keep it serial)
model = minidp.DataParallel(Slow(), ["cpu"] * 2)
model(torch.randn(4, 300)).sum().backward()  # a first backward, quick: what torch imports at its first use is done
SlowBackward.seconds = 1.0
output = model(torch.randn(600, 300)).sum()
threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
try:
    output.backward()
except KeyboardInterrupt:
    print("KeyboardInterrupt; replica 1 finished:", SlowBackward.finished)
"""
    done = fresh_python("-c", script, timeout=60)
    assert "KeyboardInterrupt; replica 1 finished: True" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr


class _NoisyGradient(_Identity):
    """The identity, whose backward adds noise drawn from the default generator."""

    @staticmethod
    def backward(ctx, gradient):
        return gradient + torch.randn_like(gradient)


class _NoisyLinear(nn.Linear):
    def forward(self, x):
        return _NoisyGradient.apply(super().forward(x))


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_replicas_whose_backwards_draw_random_numbers_at_once_are_warned_about(generator, parallel):
    """As the forward's draws (tests/test_parallel_apply.py): the serial backward draws replica after replica in a fixed
    order, as stock's does; backwards in parallel draw in threads, in an order no seed repeats, and say so."""
    previous = minidp.set_parallel_backward(parallel)
    try:
        output = minidp.DataParallel(_NoisyLinear(3, 4), cpu_ids(2))(torch.randn(6, 3, generator=generator))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            output.sum().backward()
    finally:
        minidp.set_parallel_backward(previous)
    warned = [w for w in caught if "drew random numbers in their backward" in str(w.message)]
    assert _in_parallel(output) == parallel
    assert len(warned) == parallel and (not warned or "set_parallel_backward(False)" in str(warned[0].message))


class _CheckpointedBlocks(nn.Module):
    """Three blocks under non-reentrant activation checkpointing (torch's default ``preserve_rng_state=True``), no
    random layer: each block's recomputation sets the generator to the state its forward saw, then back."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return x


def test_checkpointed_replicas_leave_the_generator_where_the_backward_found_it(generator):
    """torch.utils.checkpoint's recomputation forks the generator (torch.random.fork_rng): serially each one puts back the
    state it found, and the backward ends where it began. In workers at once, one put back what another had just set,
    and the generator ended at a forward's state: the next draws repeated those made since (half the runs of 20)."""
    model = minidp.DataParallel(_CheckpointedBlocks(), cpu_ids(2))
    for _ in range(12):
        output = model(torch.randn(64, 64, generator=generator))
        noise = torch.rand(64, 64)  # a draw between the forward and the backward moves the generator past the forward's
        before = torch.get_rng_state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (output * noise).sum().backward()
        assert _in_parallel(output)
        assert torch.equal(torch.get_rng_state(), before)


def test_replicas_whose_backwards_draw_leave_the_generator_moved_on_as_the_serial_backward(generator):
    """The generator is put back only where the backwards left it at their forward's state (above): numbers a Function
    drew in the backward are drawn, and the next draws are new ones, as after the serial backward."""
    model = minidp.DataParallel(_NoisyLinear(3, 4), cpu_ids(2))
    output = model(torch.randn(6, 3, generator=generator))
    before = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output.sum().backward()
    assert _in_parallel(output) and not torch.equal(torch.get_rng_state(), before)


def test_replicas_whose_backwards_draw_nothing_get_no_warning(generator):
    output = minidp.DataParallel(nn.Linear(3, 4), cpu_ids(2))(torch.randn(6, 3, generator=generator))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        output.sum().backward()


def test_a_tensor_entering_by_two_routes_gets_the_serial_gradient_up_to_rounding_and_the_replicas_bitwise(generator):
    """The module's docstring: the routes' gradients of a tensor passed twice (and used outside) are added in another
    order; the replicas' parameters get the serial backward's gradients bit for bit."""

    class TwoArguments(nn.Linear):
        def forward(self, a, b):
            return super().forward(a) * b.sum(1, keepdim=True)

    model = TwoArguments(5, 3).double()
    x = torch.randn(8, 5, dtype=torch.float64, generator=generator)
    results = {}
    for parallel in (False, True):
        previous = minidp.set_parallel_backward(parallel)
        try:
            module, leaf = copy.deepcopy(model), x.clone().requires_grad_()
            entering = leaf * 1  # not the leaf itself, which keeps the serial backward (test_an_input_leaf_...)
            output = minidp.DataParallel(module, cpu_ids(2))(entering, entering * 0.5)
            (output.square().sum() + entering.square().sum()).backward()
            assert _in_parallel(output) == parallel
            results[parallel] = [p.grad for p in module.parameters()], leaf.grad
        finally:
            minidp.set_parallel_backward(previous)
    assert _equal(results[True][0], results[False][0])
    # Rounding is relative to the largest gradient, not to each element: an element that nearly cancels (a few
    # in a hundred seeds) differs by 1e-14 of itself and more, while 300 seeds stay under 3e-16 of the largest.
    assert max_relative_error(results[True][1], results[False][1]) < 1e-14


class _Reversible(torch.autograd.Function):
    """A reversible layer's way (RevNet, Reformer): no activation kept; the backward recomputes the block and runs a
    backward of its own through it, which accumulates into the block's parameters."""

    @staticmethod
    def forward(ctx, block, x):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return x + block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            y = x + ctx.block(x)
        torch.autograd.backward(y, grad)
        return None, x.grad


class _ReversibleStack(nn.Module):
    def __init__(self, width: int = 8, function: type = _Reversible) -> None:
        super().__init__()
        self.first = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2))
        self.function = function

    def forward(self, x):
        h = self.first(x)
        for block in self.blocks:
            h = self.function.apply(block, h)
        return h


def test_a_function_whose_backward_runs_a_backward_of_its_own_keeps_the_serial_backward(generator):
    """Run by every worker at once, those backwards added into the original parameters from several threads, in an
    order no run repeated (RevNet-style layers at 4 replicas: 18 different results in 20 runs), and fired the original
    parameters' hooks there; its ``backward`` names one, so the replicas stay serial: the entries kept as identity
    nodes, the serial path's gradients up to rounding, as for re-entrant checkpointing."""
    x = torch.randn(12, 4, generator=generator, dtype=torch.float64)
    _assert_serial_to_rounding(_ReversibleStack().double(), x, replicas=4)


class _ReversibleOnce(_Reversible):
    """The same, its backward under torch's ``once_differentiable`` decorator."""

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return _Reversible.backward(ctx, grad)


class _ReversibleByAHelper(_Reversible):
    """The same, the recomputation's backward run by a helper, as Hugging Face Reformer's ``layer.backward_pass``."""

    @staticmethod
    def backward(ctx, grad):
        return _ReversibleByAHelper.backward_pass(ctx, grad)

    @staticmethod
    def backward_pass(ctx, grad):
        return _Reversible.backward(ctx, grad)


@pytest.mark.parametrize("function", [_ReversibleOnce, _ReversibleByAHelper], ids=["decorated", "by_a_helper"])
def test_a_function_whose_backward_runs_one_under_a_decorator_or_through_a_named_helper_keeps_the_serial_backward(
        generator, function):
    model = _ReversibleStack(function=function).double()
    x = torch.randn(12, 4, generator=generator, dtype=torch.float64)
    _, ran_parallel = _step(model, x, True, replicas=4)
    assert not ran_parallel


class _WithAuxiliaryLoss(nn.Module):
    """Keeps a loss term of each forward in a list every replica shares (replicas are shallow copies), as
    mixture-of-experts layers keep their load-balancing losses."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.auxiliary_losses: list = []

    def forward(self, x):
        h = torch.tanh(self.body(x))
        self.auxiliary_losses.append(h.pow(2).sum())  # a sum: the replicas' terms add up to the whole batch's
        return self.head(h)


def test_a_loss_kept_by_the_forward_outside_its_outputs_is_refused_before_any_gradient_is_accumulated(generator):
    """Autograd would run the replica's nodes on that way in too, beside the replica's own backward: the first to
    finish freed what the other needed ("backward through the graph a second time"), and with retain_graph hooks fired
    twice and gradients were added in another order. The serial backward takes it: the error says so."""
    model, x = _WithAuxiliaryLoss(), torch.randn(8, 4, generator=generator)
    output = minidp.DataParallel(model, cpu_ids(2))(x)
    assert _in_parallel(output)
    loss = output.square().mean() + 0.01 * sum(model.auxiliary_losses)
    with pytest.raises(RuntimeError, match=r"graph of replica 0 by a way other than its outputs.*"
                                           r"set_parallel_backward\(False\)"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_kept_by_the_forward_trains_as_on_one_device_with_the_serial_backward(generator):
    model, x = _WithAuxiliaryLoss().double(), torch.randn(8, 4, generator=generator, dtype=torch.float64)
    reference = copy.deepcopy(model)
    (reference(x).square().mean() + 0.01 * sum(reference.auxiliary_losses)).backward()
    minidp.set_parallel_backward(False)
    output = minidp.DataParallel(model, cpu_ids(2))(x)
    (output.square().mean() + 0.01 * sum(model.auxiliary_losses)).backward()
    for got, expected in zip(model.parameters(), reference.parameters()):
        assert max_relative_error(got.grad, expected.grad) < RTOL_FLOAT64


class _NoInputGradient(torch.autograd.Function):
    """An operation without a gradient for its input (a rounding, an augmentation): its backward raises."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("no gradient for the input")


@pytest.mark.parametrize("how", ["backward_inputs", "autograd_grad"])
def test_a_backward_of_some_parameters_runs_no_replica_node_that_leads_elsewhere(generator, how):
    """A GAN's discriminator step, ``loss.backward(inputs=D's parameters)`` on a batch the generator made: autograd runs
    no node that leads only to tensors not asked for (torch/autograd/__init__.py, ``inputs``), so the rounding's
    backward never runs; each replica's backward asks for the same entries' gradients, and gets the serial ones."""
    generator_model = nn.Linear(3, 4)
    discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    wrapped = nn.Sequential(_Lambda(_NoInputGradient.apply), discriminator)
    z = torch.randn(8, 3, generator=generator)
    grads = {}
    for parallel in (False, True):
        minidp.set_parallel_backward(parallel)
        discriminator.zero_grad(set_to_none=True)
        output = minidp.DataParallel(wrapped, cpu_ids(2))(generator_model(z))
        assert _in_parallel(output) == parallel
        parameters = list(discriminator.parameters())
        if how == "backward_inputs":
            output.mean().backward(inputs=parameters)
            grads[parallel] = [p.grad for p in parameters]
        else:
            grads[parallel] = list(torch.autograd.grad(output.mean(), parameters))
    assert _equal(grads[True], grads[False])
    assert all(p.grad is None for p in generator_model.parameters())


class _Lambda(nn.Module):
    def __init__(self, function) -> None:
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function(x)


def test_each_replicas_output_back_propagated_by_its_own_backward_gives_the_serial_gradients(generator):
    """``gather_output=False`` and one ``backward()`` per replica's output, without retain_graph: each backward runs
    one replica's graph, which autograd frees then, and no other's (the first let go of every replica's outputs, and
    the second raised "backward through the graph a second time")."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(9, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        for output in minidp.DataParallel(module, cpu_ids(3), gather_output=False)(x):
            output.square().sum().backward()

    grads = _gradients_both_ways(model, step)
    assert _equal(grads[True], grads[False])


def test_a_replicas_outputs_back_propagated_after_the_next_step_give_the_serial_gradients(generator):
    """``gather_output=False``: replica 0's output back-propagated at once, replica 1's after another forward. Its
    outputs wait with the node, and so do the replica modules, which a replica cache then leaves to the graph
    (building new ones for the next call) rather than re-binding them under it."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x, y = torch.randn(2, 6, 4, generator=generator, dtype=torch.float64)

    def step(module, parallel):
        wrapper = minidp.DataParallel(module, cpu_ids(2), gather_output=False)
        first = wrapper(x)
        first[0].sum().backward()
        wrapper(y)[0].sum().backward()
        first[1].sum().backward()

    grads = _gradients_both_ways(model, step)
    assert _equal(grads[True], grads[False])


class _CompiledForward(nn.Module):
    """``@torch.compile`` on the class's forward, the way README gives to compile inside DataParallel."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    @torch.compile(backend="aot_eager")
    def forward(self, x):
        return self.layers(x)


def test_a_compiled_forward_runs_the_parallel_backward_with_the_serial_gradients(generator):
    # AOTAutograd's compiled Function names `_backward_impl` in its backward, which runs no backward of its own: only
    # the names `backward` and `backward_pass` keep a Function's replicas serial
    model, x = _CompiledForward(), torch.randn(8, 4, generator=generator)
    serial, _ = _step(model, x, False)
    parallel, ran_parallel = _step(model, x, True)
    assert ran_parallel and _equal(parallel, serial)
