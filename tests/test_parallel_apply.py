"""Step 3, parallel_apply: every replica on its chunk at once, one thread each (docs/stock-behaviour.md B23-B27)."""

from __future__ import annotations

import copy
import threading
import time
import traceback
import warnings

import pytest
import torch
from torch import nn

import minidp
from .helpers import cpu_ids, garbage_left_by, requires_cuda
from .stock_emulation import emulated_stock


class Probe(nn.Module):
    """Records, from inside its forward, the thread and thread-local state it ran under."""

    def __init__(self, tag: int = 0) -> None:
        super().__init__()
        self.tag = tag
        self.seen: dict = {}

    def forward(self, x: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
        self.seen = {
            "thread": threading.current_thread(),
            "grad": torch.is_grad_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"),
            "autocast_dtype": torch.get_autocast_dtype("cpu"),
            "inference_mode": torch.is_inference_mode_enabled(),
        }
        return x * self.tag + offset


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError("no such feature")


class Slow(nn.Module):
    finished = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)
        Slow.finished = True
        return x


def test_outputs_come_back_in_replica_order(generator):
    """B25: ``outputs[i]`` is ``modules[i](*inputs[i], **kwargs_tup[i])``, as in stock."""
    modules = [Probe(tag) for tag in range(4)]
    inputs = [(torch.randn(2, generator=generator),) for _ in modules]
    kwargs = [{"offset": float(i)} for i in range(4)]
    outputs = minidp.parallel_apply(modules, inputs, kwargs)
    with emulated_stock():
        stock = nn.parallel.parallel_apply(modules, inputs, kwargs, [0, 1, 2, 3])
    for i, (ours, theirs) in enumerate(zip(outputs, stock)):
        assert torch.equal(ours, inputs[i][0] * i + i) and torch.equal(ours, theirs)


def test_a_non_tuple_input_is_one_argument(generator):
    """B24: a tensor input is passed whole, not unpacked row by row."""
    x = torch.randn(3, 2, generator=generator)
    out = minidp.parallel_apply([Probe(1), Probe(1)], [x, x])
    assert all(torch.equal(o, x) for o in out)


class MeetsOthers(nn.Module):
    """Waits until every replica is inside its forward: passes only if all of them run at once."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.barrier.wait()
        return x


def test_all_replicas_run_at_the_same_time(generator):
    barrier = threading.Barrier(4, timeout=10)
    x = torch.randn(2, generator=generator)
    outputs = minidp.parallel_apply([MeetsOthers(barrier) for _ in range(4)], [(x,)] * 4)
    assert len(outputs) == 4


def test_a_single_module_runs_in_the_calling_thread(generator):
    single = Probe()
    minidp.parallel_apply([single], [(torch.randn(2, generator=generator),)])
    assert single.seen["thread"] is threading.current_thread()


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_grad_mode_is_carried_into_every_thread(grad_enabled, generator):
    """B27: threads start with grad mode on; each worker re-enters the caller's."""
    modules = [nn.Linear(2, 2) for _ in range(3)]
    probes = [Probe(1) for _ in range(3)]
    with torch.set_grad_enabled(grad_enabled):
        outputs = minidp.parallel_apply(modules, [(torch.randn(1, 2, generator=generator),)] * 3)
        minidp.parallel_apply(probes, [(torch.zeros(1),)] * 3)
    assert [o.requires_grad for o in outputs] == [grad_enabled] * 3
    assert [p.seen["grad"] for p in probes] == [grad_enabled] * 3


def test_autocast_and_its_dtype_are_carried_into_every_thread():
    """B27: stock re-enters autocast without its dtype; minidp keeps the caller's dtype."""
    probes = [Probe(1) for _ in range(3)]
    with torch.autocast("cpu", dtype=torch.float16):
        minidp.parallel_apply(probes, [(torch.zeros(1),)] * 3)
    assert [(p.seen["autocast"], p.seen["autocast_dtype"]) for p in probes] == [(True, torch.float16)] * 3


def test_inference_mode_is_carried_into_every_thread():
    """B27: stock leaves inference mode behind in the caller's thread; minidp's workers re-enter it."""
    probes = [Probe(1) for _ in range(3)]
    with torch.inference_mode():
        minidp.parallel_apply(probes, [(torch.zeros(1),)] * 3)
    assert [p.seen["inference_mode"] for p in probes] == [True] * 3


def test_a_training_batchnorm_runs_under_inference_mode_as_on_one_device(generator):
    """Replica 1's buffer copies are made under inference mode; updated in place by a worker outside it, they raise."""
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5)).double()
    twin = copy.deepcopy(model)
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    with torch.inference_mode():
        output = minidp.DataParallel(model, cpu_ids(2))(x)
    expected = minidp.reference.chunked_reference(twin, (x,), replicas=2)
    assert torch.allclose(output, expected, rtol=1e-12, atol=0)
    assert torch.equal(model[1].running_mean, twin[1].running_mean)


def test_an_exception_is_reraised_with_its_type_replica_device_and_traceback(generator):
    """B26: 'Caught KeyError in replica 1 on device cpu', with the replica's traceback."""
    x = torch.randn(2, generator=generator)
    with pytest.raises(KeyError) as caught:
        minidp.parallel_apply([Probe(), Fails(), Probe()], [(x,)] * 3, devices=cpu_ids(3))
    message = str(caught.value)
    assert "replica 1" in message and "cpu" in message and "no such feature" in message
    assert "in forward" in message and 'raise KeyError("no such feature")' in message
    original = caught.value.__cause__
    assert isinstance(original, KeyError)
    frames = traceback.extract_tb(original.__traceback__)
    assert frames[-1].name == "forward" and frames[-1].filename == __file__


def test_replicas_that_raise_leave_no_reference_cycles(generator):
    """B36: stock's error keeps no traceback, so it leaves no cycle; minidp's keeps each replica's as its cause (the
    test above), and leaves none either: the replicas, and what their frames hold, go at once."""
    x = torch.randn(2, generator=generator)

    def failing_call():
        with pytest.raises(KeyError):
            minidp.parallel_apply([Fails(), Fails()], [(x,)] * 2, devices=cpu_ids(2))

    failing_call()  # the process's first replica threads load what it keeps (ctypes' types: cycles of their own)
    assert garbage_left_by(failing_call) == 0


def test_no_thread_is_left_running_after_an_exception(generator):
    """Replica 0 fails at once; the error surfaces only after the slow replica has finished."""
    Slow.finished = False
    x = torch.randn(2, generator=generator)
    with pytest.raises(KeyError):
        minidp.parallel_apply([Fails(), Slow()], [(x,)] * 2)
    assert Slow.finished


def test_devices_default_to_each_modules_device(generator):
    """Without ``devices``, replica i runs where its parameters live (the CPU here)."""
    outputs = minidp.parallel_apply([nn.Linear(2, 1), nn.Linear(2, 1)], [(torch.randn(1, 2, generator=generator),)] * 2)
    assert [o.device.type for o in outputs] == ["cpu", "cpu"]


def test_without_devices_a_plain_function_runs_where_its_inputs_are(generator):
    """Any callable is a replica (B24: stock takes the device of a function's inputs); a function has no tree to
    search for tensors (``modules()`` was called on it: AttributeError)."""
    x = torch.randn(2, 2, generator=generator)
    with emulated_stock():
        stock = nn.parallel.parallel_apply([lambda t: t * 2, lambda t: t * 3], [(x,), (x,)])
    ours = minidp.parallel_apply([lambda t: t * 2, lambda t: t * 3], [(x,), (x,)])
    assert all(torch.equal(a, b) for a, b in zip(ours, stock))


def test_each_replica_of_a_call_gets_a_thread_of_its_own_and_threads_are_reused_across_calls():
    """Stock starts one new thread per replica per call (B25); minidp keeps its threads."""
    probes = [Probe(i) for i in range(4)]
    inputs = [(torch.ones(1),) for _ in probes]
    minidp.parallel_apply(probes, inputs)  # warm up: the first call may start threads
    before = threading.active_count()
    for _ in range(20):
        minidp.parallel_apply(probes, inputs)
        assert len({p.seen["thread"] for p in probes}) == len(probes)
    assert threading.active_count() <= before + len(probes)


def test_without_devices_a_replica_runs_where_its_parameters_are_though_it_lists_none():
    """B24: stock runs every replica on the current device when ``devices`` is None; minidp on the
    replica's own device. A replica's parameters are plain attributes, so they are found there."""
    from minidp.step3_parallel_apply import _module_device

    (replica,) = minidp.replicate(nn.Linear(2, 2, device="meta"), ["meta"])
    assert list(replica.parameters()) == []
    assert _module_device(replica, (3,)) == torch.device("meta")


def dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))


def test_replicas_that_draw_from_the_generator_they_share_are_warned_about():
    """Stock's replicas draw from their own GPU's generator each (docs/stock-behaviour.md B40); CPU replicas share the
    CPU's, so which one gets which numbers changes between runs, and a checkpointed layer recomputes other ones."""
    drops = dropout_model()
    with pytest.warns(UserWarning, match="2 replicas on cpu drew random numbers"):
        minidp.parallel_apply([drops, drops], [torch.randn(2, 4), torch.randn(2, 4)], devices=cpu_ids(2))


def test_the_warning_says_another_threads_draw_meanwhile_reads_as_the_replicas():
    """The generator is the process's (B40): a data pipeline's thread drawing while replicas that draw nothing run
    moves it too, and the warning cannot tell; it says so, and that nothing is wrong then."""
    running, drawn = threading.Event(), threading.Event()

    def waits_for_another_draw(x: torch.Tensor) -> torch.Tensor:
        running.set()
        drawn.wait(10)
        return x

    pipeline = threading.Thread(target=lambda: (running.wait(10), torch.rand(3), drawn.set()))
    with pytest.warns(UserWarning, match="another thread of this process drew from it meanwhile"):
        pipeline.start()
        minidp.parallel_apply([waits_for_another_draw] * 2, [torch.randn(2, 4)] * 2, devices=cpu_ids(2))
    pipeline.join()


@pytest.mark.parametrize("replicas, training", [(2, False), (1, True)], ids=["nothing drawn", "one replica"])
def test_replicas_that_share_no_draws_from_a_generator_get_no_warning(replicas, training):
    drops = dropout_model().train(training)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minidp.parallel_apply([drops] * replicas, [torch.randn(2, 4)] * replicas, devices=cpu_ids(replicas))


@pytest.mark.cuda
@requires_cuda
def test_replicas_on_side_streams_train_alike_from_a_cpu_batch_and_from_one_on_the_gpu(generator):
    """On a repeated GPU id, replicas 1.. run on side streams of their own. A batch that starts on the CPU is copied
    chunk by chunk on the current stream, so those chunks (and the replicas' private buffer copies) must stay out
    of the allocator's reach until the side streams are done with them; a batch already on the GPU is cut into views
    of memory the caller holds. Over steps that free and allocate a lot, both train to the same bits."""
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 8)).double().cuda()
    twins = [copy.deepcopy(model) for _ in range(2)]
    wrappers = [minidp.DataParallel(twin, [0, 0, 0]) for twin in twins]
    optimizers = [torch.optim.SGD(twin.parameters(), lr=0.05) for twin in twins]
    for _ in range(20):
        batch = torch.randn(96, 64, generator=generator, dtype=torch.float64)
        for wrapper, optimizer, inputs in zip(wrappers, optimizers, (batch, batch.cuda())):
            optimizer.zero_grad()
            wrapper(inputs).pow(2).mean().backward()
            optimizer.step()
    for (name, ours), theirs in zip(twins[0].state_dict().items(), twins[1].state_dict().values()):
        assert torch.equal(ours, theirs), name
