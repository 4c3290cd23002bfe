"""DataParallel and data_parallel: the wrapper module and the function (docs/stock-behaviour.md B1-B11)."""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

import minidp
from .helpers import HAS_CUDA, cpu_ids, garbage_left_by
from .stock_emulation import emulated_stock

data_parallel_module = importlib.import_module("minidp.wrapper")
no_gpu_only = pytest.mark.skipif(HAS_CUDA, reason="describes a machine without a GPU")


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


class Recording(minidp.DataParallel):
    """DataParallel whose four overridable steps (B7) log their calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def scatter(self, inputs, kwargs, device_ids):
        self.calls.append(("scatter", len(device_ids)))
        return super().scatter(inputs, kwargs, device_ids)

    def replicate(self, module, device_ids):
        replicas = super().replicate(module, device_ids)
        weights = [m.weight for r in replicas for m in r.modules() if isinstance(m, nn.Linear)]
        self.calls.append(("replicate", len(device_ids), any(w.requires_grad for w in weights)))
        return replicas

    def parallel_apply(self, replicas, inputs, kwargs):
        self.calls.append(("parallel_apply", len(replicas)))
        return super().parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        self.calls.append(("gather", len(outputs)))
        return super().gather(outputs, output_device)


# --------------------------------------------------------------------------------------------------
# the wrapper module (B5)
# --------------------------------------------------------------------------------------------------


def test_state_dict_keys_are_prefixed_module_as_in_stock():
    model = bn_model()
    ours = minidp.DataParallel(model, cpu_ids(2)).state_dict()
    assert list(ours) == list(nn.DataParallel(model).state_dict())
    assert list(ours) == ["module." + k for k in model.state_dict()]


def test_loading_a_plain_state_dict_fails_as_in_stock_and_module_load_works():
    model, other = bn_model(), bn_model()
    dp = minidp.DataParallel(model, cpu_ids(2))
    with pytest.raises(RuntimeError, match="Missing key"):
        dp.load_state_dict(other.state_dict())
    dp.module.load_state_dict(other.state_dict())
    assert torch.equal(model[0].weight, other[0].weight)
    minidp.DataParallel(bn_model(), cpu_ids(2)).load_state_dict(dp.state_dict())


def test_parameters_are_the_wrapped_modules_own_objects():
    model = bn_model()
    dp = minidp.DataParallel(model, cpu_ids(3))
    assert all(a is b for a, b in zip(dp.parameters(), model.parameters()))
    assert len(list(dp.parameters())) == len(list(model.parameters()))


def test_eval_propagates_and_running_stats_stay_put(generator):
    model = bn_model()
    dp = minidp.DataParallel(model, cpu_ids(2)).eval()
    assert not model.training and not model[1].training
    before = model[1].running_mean.clone()
    dp(torch.randn(6, 4, generator=generator))
    assert torch.equal(model[1].running_mean, before)


# --------------------------------------------------------------------------------------------------
# forward: the four steps in order (B7)
# --------------------------------------------------------------------------------------------------


def test_forward_runs_scatter_replicate_parallel_apply_gather(generator):
    dp = Recording(bn_model(), cpu_ids(3))
    dp(torch.randn(10, 4, generator=generator))
    assert dp.calls == [("scatter", 3), ("replicate", 3, True), ("parallel_apply", 3), ("gather", 3)]


def test_small_batches_use_the_first_devices_only(generator):
    """B7: 5 rows on 4 devices make 3 chunks, so replicas go to the first 3 devices."""
    dp = Recording(nn.Linear(4, 2), cpu_ids(4))
    assert dp(torch.randn(5, 4, generator=generator)).shape == (5, 2)
    assert dp.calls[1:] == [("replicate", 3, True), ("parallel_apply", 3), ("gather", 3)]


def test_no_grad_replicates_detached(generator):
    """B10: under ``torch.no_grad()`` the replicas are cut from autograd (``detach=True``)."""
    dp = Recording(bn_model(), cpu_ids(2))
    with torch.no_grad():
        out = dp(torch.randn(4, 4, generator=generator))
    assert not out.requires_grad
    assert ("replicate", 2, False) in dp.calls


def test_one_device_calls_the_module_without_replicas(generator):
    """B9: a single device id runs the module itself and returns its output as it is."""
    model = bn_model()
    dp = Recording(model, cpu_ids(1))
    x = torch.randn(4, 4, generator=generator)
    assert torch.equal(dp(x), model(x))
    assert [c[0] for c in dp.calls] == ["scatter"]


def test_one_device_returns_a_scalar_output_unchanged_as_stock():
    """B9: no gather with one device, so a 0-dim loss stays 0-dim (no warning, no vector)."""

    class Loss(nn.Module):
        def forward(self, x):
            return x.sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = minidp.DataParallel(Loss(), cpu_ids(1))(torch.ones(3))
    assert out.shape == () and out.item() == 3.0


def test_a_module_without_arguments_runs_once():
    """B8: no inputs at all: one call, on ``device_ids[0]``."""

    class Constant(nn.Module):
        def forward(self):
            return torch.ones(2)

    dp = Recording(Constant(), cpu_ids(3))
    assert torch.equal(dp(), torch.ones(2))
    assert ("parallel_apply", 1) in dp.calls


def test_an_empty_batch_runs_every_replica_on_nothing_as_stock(generator):
    """B15: 0 rows give every device an empty chunk; every replica runs on it, the output has 0 rows, the
    gradients are zeros and replica 0's BatchNorm counts the batch: what stock (emulated) and one device give."""
    model = bn_model().double()
    stock_model = copy.deepcopy(model)
    x = torch.randn(0, 4, dtype=torch.float64, requires_grad=True)
    dp = Recording(model, cpu_ids(3))
    out = dp(x)
    out.sum().backward()
    with emulated_stock():
        stock_out = nn.DataParallel(stock_model, [0, 1, 2])(x)
        stock_out.sum().backward()
    assert ("parallel_apply", 3) in dp.calls
    assert out.shape == stock_out.shape == (0, 2)
    for (name, ours), theirs in zip(model.state_dict().items(), stock_model.state_dict().values()):
        assert torch.equal(ours, theirs), name
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), stock_model.parameters()))


def test_scalar_outputs_become_one_entry_per_replica(generator):
    """B30: a 0-dim output gathers into a vector, one entry per replica used, with a warning."""

    class Total(nn.Module):
        def forward(self, x):
            return x.sum()

    x = torch.randn(5, 1, generator=generator, dtype=torch.float64)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = minidp.DataParallel(Total(), cpu_ids(4))(x)
    assert torch.allclose(out, torch.stack([c.sum() for c in x.chunk(4)]))


def test_output_device_cpu_works(generator):
    """B2: stock refuses ``output_device='cpu'``; minidp gathers there."""
    for output_device in ("cpu", torch.device("cpu"), -1):
        out = minidp.DataParallel(bn_model(), cpu_ids(2), output_device=output_device)(torch.randn(4, 4))
        assert out.device.type == "cpu"


def test_non_tensor_kwargs_with_a_small_batch_run_where_stock_fails(generator):
    """B17 (a): ``dp(x2, scale=3.0)`` on 4 devices. Stock (emulated) pads the 2 input chunks with
    ``()`` to match 4 copies of the kwargs, so replica 2 is called without ``x`` and fails; minidp
    runs 2 replicas, each with its rows and ``scale``."""

    class Scale(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    x2 = torch.randn(2, 3, generator=generator)
    with emulated_stock(), pytest.raises(TypeError, match="in replica 2"):
        nn.DataParallel(Scale(), [0, 1, 2, 3])(x2, scale=3.0)
    assert torch.equal(minidp.DataParallel(Scale(), cpu_ids(4))(x2, scale=3.0), x2 * 3.0)


def test_it_is_an_instance_of_torch_data_parallel_so_libraries_unwrap_it():
    """Libraries find the model inside a DataParallel by ``isinstance(model, torch.nn.DataParallel)`` (accelerate's
    ``extract_model_from_parallel``, ignite's ``Checkpoint``, Lightning Fabric's state dicts) and take its ``module``
    (B5); torch's own functions that refuse a DataParallel refuse it too."""
    model = bn_model()
    dp = minidp.DataParallel(model, cpu_ids(2))
    assert isinstance(dp, nn.DataParallel)
    with pytest.raises(RuntimeError, match="stateless API can't be used with nn.DataParallel"):
        torch.func.functional_call(dp, dict(dp.named_parameters()), (torch.randn(4, 4),))


def test_accelerate_unwraps_it_as_it_unwraps_stock():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    model = bn_model()
    assert accelerate_utils.extract_model_from_parallel(minidp.DataParallel(model, cpu_ids(2))) is model


def test_a_wrapper_saved_by_an_earlier_minidp_loads_and_runs(generator):
    """Earlier wrappers kept the module's device as ``source_device`` (now stock's ``src_device_obj``): one pickled then
    (``torch.save`` keeps the ``__dict__``) is given stock's names when it is loaded, and runs."""
    model = bn_model()
    state = dict(minidp.DataParallel(model, ["cpu"]).__dict__)
    state["source_device"] = state.pop("src_device_obj")
    earlier = minidp.DataParallel.__new__(minidp.DataParallel)
    earlier.__setstate__(state)
    x = torch.randn(4, 4, generator=generator)
    assert earlier.src_device_obj == torch.device("cpu") and not hasattr(earlier, "source_device")
    assert torch.equal(earlier(x), model(x))


def test_a_subclass_with_stocks_own_forward_runs_on_minidps_steps(generator):
    """Subclasses written against stock copy its ``forward`` (B7: it reads ``device_ids``, ``src_device_obj`` and
    ``output_device``, then calls the four overridable steps): stock's very code runs on minidp's steps."""

    class StockForward(minidp.DataParallel):
        forward = nn.DataParallel.forward

    model = bn_model()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4, generator=generator)
    StockForward(model, cpu_ids(2))(x).sum().backward()
    minidp.DataParallel(reference, cpu_ids(2))(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), reference.buffers(), strict=True))


# --------------------------------------------------------------------------------------------------
# device ids (B1, B2)
# --------------------------------------------------------------------------------------------------


@no_gpu_only
def test_no_device_ids_without_a_gpu_calls_the_module_directly(generator):
    """B1: as stock on a machine without a GPU: ``device_ids == []``, a plain call."""
    model = bn_model()
    dp = Recording(model)
    x = torch.randn(4, 4, generator=generator)
    assert dp.device_ids == nn.DataParallel(model).device_ids == []
    assert torch.equal(dp(x), nn.DataParallel(model)(x))
    assert dp.calls == []


@no_gpu_only
def test_integer_ids_without_a_gpu_call_directly_and_warn_once(monkeypatch):
    """Stock silently ignores ``[0, 1]`` here (B1); minidp does the same but says how to get CPU replicas."""
    monkeypatch.setattr(data_parallel_module, "_warned_no_gpu", False)
    with pytest.warns(UserWarning, match=r"\['cpu', 'cpu'\]"):
        dp = minidp.DataParallel(bn_model(), [0, 1])
    assert dp.device_ids == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minidp.DataParallel(bn_model(), [0, 1])


@no_gpu_only
def test_empty_device_ids_without_a_gpu_call_directly(generator, monkeypatch):
    """B1: stock ignores ``device_ids`` here, so ``list(range(torch.cuda.device_count()))``, which is ``[]`` on such a
    machine, is a plain call; minidp does the same, and says how to get CPU replicas."""
    monkeypatch.setattr(data_parallel_module, "_warned_no_gpu", False)
    model = bn_model()
    x = torch.randn(4, 4, generator=generator)
    with pytest.warns(UserWarning, match=r"names no device.*\['cpu', 'cpu'\]"):
        dp = Recording(model, [])
    assert dp.device_ids == nn.DataParallel(model, []).device_ids == []
    assert torch.equal(dp(x), nn.DataParallel(model, [])(x))
    assert dp.calls == []
    assert torch.equal(minidp.data_parallel(model, x, []), model(x))


@pytest.mark.parametrize(
    "device_ids,output_device,kept_ids,kept_output",
    [([0, 1], None, [0, 1], 0), (["cuda:1", torch.device("cuda", 0)], "cuda:0", [1, 0], 0), ([1, 0], 1, [1, 0], 1)],
)
def test_gpu_ids_are_kept_as_stock_keeps_them(device_ids, output_device, kept_ids, kept_output, monkeypatch):
    """B2: stock keeps each GPU as its index (``torch.device("cuda", dp.device_ids[0])`` works) and
    ``src_device_obj`` as the device of ``device_ids[0]``. Two GPUs are made visible to minidp's checks; nothing runs."""
    for module in (minidp.device_ids, data_parallel_module):
        monkeypatch.setattr(module, "visible_gpus", lambda: 2)
    monkeypatch.setattr(data_parallel_module, "_warn_if_imbalanced", lambda devices: None)  # reads the GPUs' properties
    dp = minidp.DataParallel(bn_model(), device_ids, output_device)
    assert (dp.device_ids, dp.output_device) == (kept_ids, kept_output)
    assert all(type(i) is int for i in dp.device_ids) and type(dp.output_device) is int
    assert dp.src_device_obj == torch.device("cuda", kept_ids[0])


def test_cpu_ids_are_kept_as_devices():
    """Stock has no id for the CPU (B2 refuses it); minidp keeps a CPU replica's id as the device."""
    dp = minidp.DataParallel(bn_model(), ["cpu", "cpu"], output_device="cpu")
    assert dp.device_ids == [torch.device("cpu")] * 2
    assert dp.output_device == dp.src_device_obj == torch.device("cpu")


def test_an_id_beyond_the_visible_gpus_is_an_error_naming_cuda_visible_devices():
    beyond = torch.cuda.device_count()
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        minidp.DataParallel(bn_model(), [f"cuda:{beyond}", "cpu"])


def test_a_single_device_instead_of_a_list_is_a_clear_error():
    """``device_ids='cpu'`` used to be read as the devices 'c', 'p', 'u'."""
    with pytest.raises(TypeError, match=r"device_ids: expected a list of devices"):
        minidp.DataParallel(bn_model(), "cpu")


def test_cpu_spelled_with_an_index_is_the_cpu_the_module_is_on(generator):
    """torch keeps every CPU tensor on ``device("cpu")``, which does not equal ``device("cpu:0")``: an id spelled so
    names that CPU (it used to ask for the module to be moved to "cpu:0", which torch cannot do)."""
    model = bn_model()
    dp = minidp.DataParallel(model, ["cpu:0", torch.device("cpu", 0)], output_device="cpu:0")
    assert dp.device_ids == [torch.device("cpu")] * 2 and dp.output_device == torch.device("cpu")
    x = torch.randn(6, 4, generator=generator)
    assert torch.equal(dp(x), minidp.DataParallel(model, cpu_ids(2))(x))


def test_repeated_cpu_ids_give_that_many_replicas(generator):
    dp = Recording(bn_model(), ["cpu", torch.device("cpu"), "cpu"])
    dp(torch.randn(9, 4, generator=generator))
    assert ("parallel_apply", 3) in dp.calls


class NormalisesInPlace(nn.Module):
    """Scales its input in place before a layer that saves it for the backward, as `x /= 255` at the top of a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        x /= 255
        return self.conv(x)


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_forward_that_changes_its_chunk_in_place_runs_on_replicas_sharing_a_device(replicas, generator):
    """B16: on devices of their own, every replica's chunk but the source device's is a copy, so one replica's in-place
    change of its chunk touches nothing another replica saved. Replicas that share a device get chunks of their own
    too: the gradients are the single device's (with views of one batch, autograd refused the backward, a chunk
    saved by one replica having been changed by another; with CPU replicas in threads, only some of the time)."""
    model = NormalisesInPlace().double()
    x = torch.rand(6, 3, 6, 6, generator=generator, dtype=torch.float64) * 255
    reference = copy.deepcopy(model)
    reference(x.clone()).square().sum().backward()
    minidp.DataParallel(model, cpu_ids(replicas))(x.clone()).square().sum().backward()
    for mine, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, expected.grad, rtol=1e-10, atol=0)


# --------------------------------------------------------------------------------------------------
# the function data_parallel (B11)
# --------------------------------------------------------------------------------------------------


@no_gpu_only
def test_data_parallel_runs_without_a_gpu_where_stock_raises(generator):
    """B11: stock raises 'device type could not be determined'; minidp calls the module."""
    model, x = bn_model(), torch.randn(4, 4, generator=generator)
    with pytest.raises(RuntimeError, match="device type could not be determined"):
        nn.parallel.data_parallel(model, x)
    assert torch.equal(minidp.data_parallel(model, x), model(x))


def test_data_parallel_on_cpu_replicas(generator):
    model = nn.Linear(4, 2).double()
    x = torch.randn(7, 4, generator=generator, dtype=torch.float64)
    assert torch.allclose(minidp.data_parallel(model, x, cpu_ids(3)), model(x), rtol=0, atol=1e-14)


def test_data_parallel_takes_a_list_as_one_argument_and_a_tuple_as_several(generator):
    """B11: only a tuple is unpacked into positional arguments."""

    class CountArguments(nn.Module):
        def forward(self, *args):
            rows = (args[0][0] if isinstance(args[0], list) else args[0]).shape[0]
            return torch.full((rows, 1), float(len(args)))

    x = torch.randn(4, 2, generator=generator)
    assert minidp.data_parallel(CountArguments(), (x, x), cpu_ids(2)).flatten().tolist() == [2.0] * 4
    assert minidp.data_parallel(CountArguments(), [x, x], cpu_ids(2)).flatten().tolist() == [1.0] * 4


@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
def test_a_training_step_leaves_no_reference_cycles(traced, generator):
    """B36 for the whole step, forward and backward, with the cache on and off (the suite's two
    configurations) and under ``minidp.trace()``: nothing is left for the cycle collector."""
    model = bn_model()
    dp = minidp.DataParallel(model, cpu_ids(2))
    x = torch.randn(6, 4, generator=generator)
    dp(x).sum().backward()  # the first step builds what later steps reuse (the cached replicas)

    def step():
        with minidp.trace() if traced else contextlib.nullcontext():
            dp(x).sum().backward()

    assert garbage_left_by(step) == 0


class _FeaturesInParallel(nn.Module):
    """The tutorial's pattern: ``data_parallel(self.features, x, ids)`` inside ``forward``, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.features, self.head = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(minidp.data_parallel(self.features, x, cpu_ids(2)))


@pytest.mark.parametrize("how", ["compiled wrapper", "compiled model calling data_parallel"])
def test_a_compiled_model_runs_its_data_parallel_steps_uncompiled_with_the_same_numbers(generator, how):
    """``torch.compile`` records the calling thread's work only, and the replicas run in threads of their own: their
    steps run outside its graph (a graph break), where tracing them made the compiler fail; the step's numbers are the
    uncompiled ones, bit for bit."""
    if how == "compiled wrapper":
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        wrap = lambda m: minidp.DataParallel(m, cpu_ids(2))  # noqa: E731
    else:
        model, wrap = _FeaturesInParallel().double(), lambda m: m  # noqa: E731
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    results = []
    for compiled in (False, True):
        module = copy.deepcopy(model)
        run = torch.compile(wrap(module), backend="eager") if compiled else wrap(module)
        output = run(x)
        output.square().sum().backward()
        results.append((output.detach(), [p.grad for p in module.parameters()]))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert torch.equal(compiled, eager)
    assert all(torch.equal(c, e) for c, e in zip(compiled_grads, eager_grads))
