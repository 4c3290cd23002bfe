"""PyTorch's own DataParallel tests, ported to minidp on CPU replicas.

Source: the PyTorch repository (https://github.com/pytorch/pytorch), file
``test/distributed/test_data_parallel.py`` (classes ``TestDataParallel`` and
``TestDataParallelDeviceType``). PyTorch is BSD-licensed (3-clause); the cases below are adapted
from that file, copyright the PyTorch contributors.

How the port reads: upstream runs on two GPUs (``device_ids=[0, 1]``, or every visible GPU by
default); here every case runs ``minidp.DataParallel`` / ``minidp.data_parallel`` /
``minidp.replicate`` / ``minidp.scatter`` / ``minidp.gather`` / ``minidp.parallel_apply`` on two
CPU replicas (``cpu_ids(2)``). Where a case needs a second, *different* device, the meta device
stands in for it. ``self.assertEqual`` becomes ``torch.testing.assert_close`` (the same comparison:
dtype-dependent tolerances, dtypes and devices checked) or ``torch.equal`` where the original
compares exactly; ``_assertGradAndGradgradChecks`` becomes ``gradcheck`` plus ``gradgradcheck``,
both with ``check_batched_grad=False`` as upstream. Every upstream test name appears here once:
ported, or skipped with the reason it cannot run on CPU replicas. A case marked ``xfail(strict=True)``
fails because of a minidp bug named in its reason; it must pass once the bug is fixed.

The stock behaviour each case relies on is described in docs/stock-behaviour.md (sections cited
per test).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import re
import warnings
from collections import OrderedDict
from copy import deepcopy
from itertools import product

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import gradcheck, gradgradcheck

import minidp
from .helpers import cpu_ids

# Upstream's two GPUs.
TWO = cpu_ids(2)
# A second device unlike the first, where a case needs the module or the replicas elsewhere.
ELSEWHERE = "meta"

assert_close = torch.testing.assert_close
gradcheck = functools.partial(gradcheck, check_batched_grad=False)
gradgradcheck = functools.partial(gradgradcheck, check_batched_grad=False)

# Upstream's ``dtype2prec_DONTUSE``: the absolute tolerance of TestDataParallelDeviceType's comparisons.
PRECISION = {torch.float32: 1e-5, torch.float64: 1e-5, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def replayable_global_seed():
    """Upstream's cases draw from the global generator (``torch.randn``, module initialisation), which
    its TestCase seeds before each test; here each test gets a fresh seed, printed on failure."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"global seed: {seed}")
    torch.manual_seed(seed)


def assert_grad_and_gradgrad_checks(fn, inputs) -> None:
    """Upstream's ``_assertGradAndGradgradChecks``: first and second derivatives against finite differences."""
    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


def needs_cuda(why: str):
    return pytest.mark.skip(reason=f"needs CUDA devices: {why}")


# --------------------------------------------------------------------------------------------------
# TestDataParallel
# --------------------------------------------------------------------------------------------------


def test_data_parallel_buffers_requiring_grad():
    """A buffer that requires grad gets gradients through the replicas (B19, B31)."""

    class TestModule(nn.Module):
        def __init__(self, t):
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.clone().detach())

        def forward(self, x):
            return x * self.t_rg + self.t_not_rg

    m = TestModule(torch.randn(100, requires_grad=True, dtype=torch.float64))
    assert m.t_rg.requires_grad

    dpm = minidp.DataParallel(m, TWO)
    inp = torch.randn(2, 100, dtype=torch.float64)

    def fn(t):
        return dpm(inp)

    assert gradcheck(fn, (m.t_rg,))


def test_data_parallel_rnn():
    """An LSTM that calls ``flatten_parameters()`` in forward: runs under no_grad, and one SGD step
    through DataParallel equals one without it (B10, B22). Sizes shrunk from LSTM(300, 1024) for CPU time."""

    class TestModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(30, 64, 1, batch_first=True, bidirectional=True)

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn(x)

    def step(model):
        opt = torch.optim.SGD(model.parameters(), lr=10)
        output = model(torch.ones(4, 4, 30))
        loss = F.mse_loss(output[0], torch.zeros_like(output[0]))
        loss.backward()
        opt.step()

    with torch.no_grad():
        model = TestModule()
        model_dp = minidp.DataParallel(deepcopy(model), TWO)
        # DataParallel must not crash when grad is disabled (upstream issue #21108).
        model_dp(torch.rand(2, 4, 30))

    step(model)
    step(model_dp)

    for p1, p2 in zip(model.parameters(), model_dp.parameters()):
        assert p1.allclose(p2)


def test_data_parallel_lazy_linear():
    """An uninitialised lazy module cannot be replicated (B22). Upstream matches stock's message,
    which changed across versions (a RuntimeError from the lazy module, later a ValueError from the
    parameter copy); minidp raises a RuntimeError that names the parameter and says to run one
    forward first."""
    with pytest.raises(RuntimeError, match="not initialized yet"):
        model_dp = minidp.DataParallel(nn.LazyLinear(10), TWO)
        model_dp(torch.rand(10, 10))


def test_parallel_apply():
    """Each input is a tuple of positional arguments or one argument (B24)."""
    l1 = nn.Linear(10, 5).to(torch.float)
    l2 = nn.Linear(10, 5).to(torch.float)
    i1 = torch.randn(2, 10, dtype=torch.float)
    i2 = torch.randn(2, 10, dtype=torch.float)
    expected1 = l1(i1)
    expected2 = l2(i2)
    modules = (l1, l2)
    expected_outputs = (expected1, expected2)

    for inputs in [((i1,), (i2,)), (i1, i2)]:
        outputs = minidp.parallel_apply(modules, inputs, None)
        for out, expected in zip(outputs, expected_outputs):
            assert_close(out, expected)


def test_parallel_apply_autocast():
    """The caller's autocast reaches every replica's thread (B27). CPU autocast stands in for CUDA's;
    ``assert_close`` checks the dtype too, so each output must be autocast's."""
    l1 = nn.Linear(10, 5).to(torch.float)
    l2 = nn.Linear(10, 5).to(torch.float)
    i1 = torch.randn(2, 10, dtype=torch.float)
    i2 = torch.randn(2, 10, dtype=torch.float)
    with torch.autocast("cpu"):
        expected1 = l1(i1)
        expected2 = l2(i2)
    modules = (l1, l2)
    expected_outputs = (expected1, expected2)

    for inputs in [((i1,), (i2,)), (i1, i2)]:
        with torch.autocast("cpu"):
            outputs = minidp.parallel_apply(modules, inputs, None)
        for out, expected in zip(outputs, expected_outputs):
            assert_close(out, expected)


def test_parallel_apply_passes_exception():
    """A replica's exception comes back with its type, replica, device and traceback (B26).
    One module used twice, as upstream; the device is the CPU instead of GPU 0."""

    class TestModule(nn.Module):
        def forward(self, *args):
            return {}["wonderful"]

    l1 = TestModule()
    with pytest.raises(KeyError, match=r"Caught KeyError in replica \d on device cpu.\nOriginal Traceback[\s\S]+wonderful"):
        minidp.parallel_apply(modules=(l1, l1), inputs=(None, None))


def test_data_parallel_multiple_input():
    """Several positional arguments, a non-tensor among them, and kwargs (B9, B12, B17). Upstream's
    ``(1, 0)`` device order has no CPU counterpart (both ids would be the CPU) and is left out."""

    class TestModule(nn.Module):
        def forward(self, var1, var2, float1, var3=None):
            if var3 is None:
                return float1 * (var1 * var2)
            else:
                return float1 * (var1 * var2 + var3)

    m = TestModule()
    var1 = torch.randn(5, 5, dtype=torch.float, requires_grad=True)
    var2 = torch.randn(5, 5, dtype=torch.float, requires_grad=True)
    var3 = torch.randn(5, 5, dtype=torch.float, requires_grad=False)

    float1 = torch.randn(1).item()

    expected = m(var1, var2, float1)
    loss = expected.sum()
    loss.backward()
    gvar1_exp = var1.grad.clone()
    gvar2_exp = var2.grad.clone()

    def local_test(out):
        with torch.no_grad():
            var1.grad.fill_(0.0)
            var2.grad.fill_(0.0)
        loss = out.sum()
        loss.backward()
        assert_close(out, expected)
        assert_close(gvar1_exp, var1.grad)
        assert_close(gvar2_exp, var2.grad)

    out = minidp.data_parallel(m, (var1, var2, float1), TWO)
    local_test(out)

    out = minidp.data_parallel(m, (var1, var2, float1), cpu_ids(1))
    local_test(out)

    with torch.no_grad():
        var1.grad.fill_(0.0)
        var2.grad.fill_(0.0)
    expected = m(var1, var2, float1, var3=var3)
    loss = expected.sum()
    loss.backward()
    gvar1_exp = var1.grad.clone()
    gvar2_exp = var2.grad.clone()

    dpm = minidp.DataParallel(TestModule(), TWO)
    out = dpm(var1, var2, float1, var3=var3)
    local_test(out)

    dpm = minidp.DataParallel(TestModule(), device_ids=cpu_ids(1))
    out = dpm(var1, var2, float1, var3=var3)
    local_test(out)

    kwarg_wrap = {"var3": var3}
    out = minidp.data_parallel(m, (var1, var2, float1), TWO, module_kwargs=kwarg_wrap)
    local_test(out)

    out = minidp.data_parallel(m, (var1, var2, float1), cpu_ids(1), module_kwargs=kwarg_wrap)
    local_test(out)


def test_data_parallel_small_back():
    l = nn.Linear(10, 5).float()
    i = torch.randn(20, 10, dtype=torch.float)
    out = minidp.data_parallel(l, i, TWO)
    assert_close(out, l(i))


def test_data_parallel_model_device():
    """The parameters and buffers must be on ``device_ids[0]``, checked at forward time, by the
    module and by the function (B6). Upstream's GPUs 0 and 1 are the CPU and the meta device here:
    ``ALL`` stands for "every GPU" / ``[0, 1]`` (the CPU first), ``FLIPPED`` for ``[1, 0]`` (the
    other device first). Upstream's cases that only differ in which *other* GPU a tensor is on
    collapse into one."""
    l = nn.Linear(2, 2)
    inp = torch.randn(2, 2)
    inp_elsewhere = inp.to(ELSEWHERE)
    ALL, FLIPPED = TWO, [ELSEWHERE] * 2

    error_msg = "module must have its parameters and buffers on device {}"

    def test(inner_m, dp_device, inp, device_ids, should_fail):
        expect_device = torch.device(device_ids[0])
        if should_fail:
            def assert_correct():
                return pytest.raises(RuntimeError, match=error_msg.format(expect_device))
        else:
            assert_correct = contextlib.nullcontext

        # the module
        dpm = minidp.DataParallel(inner_m, device_ids)
        if dp_device is not None:
            dpm = dpm.to(dp_device)

        with assert_correct():
            dpm(inp)

        # the function
        with assert_correct():
            minidp.data_parallel(inner_m.to(dp_device), inp, device_ids)

    def to(module, device):
        # Meta tensors hold no data: leaving the meta device allocates afresh (no value is compared here).
        on_meta = any(t.is_meta for t in module.parameters())
        return module.to_empty(device=device) if on_meta and device != ELSEWHERE else module.to(device)

    test(to(l, ELSEWHERE), None, inp, ALL, should_fail=True)
    test(to(l, "cpu"), None, inp, FLIPPED, should_fail=True)

    test(to(l, "cpu"), None, inp, ALL, should_fail=False)
    test(to(l, "cpu"), ELSEWHERE, inp_elsewhere, FLIPPED, should_fail=False)
    test(to(l, ELSEWHERE), None, inp_elsewhere, FLIPPED, should_fail=False)

    s = nn.Sequential(to(l, ELSEWHERE))
    test(s, None, inp, ALL, should_fail=True)

    s = nn.Sequential(to(deepcopy(l), "cpu"), to(l, ELSEWHERE))
    test(s, None, inp, ALL, should_fail=True)
    test(s, None, inp_elsewhere, FLIPPED, should_fail=True)

    s = nn.Sequential(to(l, "cpu"), to(deepcopy(l), "cpu"))
    test(s, None, inp, ALL, should_fail=False)
    test(s, None, inp_elsewhere, FLIPPED, should_fail=True)
    test(to(s, ELSEWHERE), None, inp_elsewhere, FLIPPED, should_fail=False)
    test(s, None, inp, ALL, should_fail=True)


def test_data_parallel_model_no_refcycles():
    """One forward leaves no garbage that only the cycle collector can free (B36: stock clears its
    recursive closures; minidp's scatter and gather walk with plain functions). Automatic collection
    is paused while counting, so that it cannot free the cycles before the count."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x)

    gc.collect()
    gc.disable()
    try:
        model = minidp.DataParallel(Model(), TWO)
        data = torch.randn(1)
        model(data)
        refcycles = gc.collect()
    finally:
        gc.enable()
    assert refcycles == 0


def test_data_parallel_no_grad():
    """Grad mode reaches the replicas' threads: off under no_grad, on otherwise (B10, B27)."""

    class Layer(nn.Module):
        def forward(self, x):
            assert not torch.is_grad_enabled()
            return x

    l = Layer()
    i = torch.randn(20, 10, dtype=torch.float)
    with torch.no_grad():
        minidp.data_parallel(l, i, TWO)
    with pytest.raises(AssertionError):
        minidp.data_parallel(l, i, TWO)


def test_data_parallel():
    """Output and parameter gradients equal a single-device run (B7, B31). Upstream's ``(1, 0)``
    order and its ``torch.cuda.device`` context have no CPU counterpart; the output device is checked."""
    l = nn.Linear(10, 5).float()
    i = torch.randn(20, 10, dtype=torch.float)
    expected_out = l(i)
    loss = expected_out.sum()
    loss.backward()
    expected_grads = [param.grad.clone() for param in l.parameters()]

    l.zero_grad()
    out = minidp.data_parallel(l, i, TWO)
    loss = out.sum()
    loss.backward()
    assert out.device == torch.device("cpu")
    assert_close(out, expected_out)
    for expected, param in zip(expected_grads, l.parameters()):
        assert_close(param.grad, expected)

    # Without device ids: every visible GPU; on a machine with none, a direct call.
    first = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    minidp.data_parallel(l.to(first), i.to(first))


def test_data_parallel_sparse():
    """Sparse gradients (an Embedding with ``sparse=True``) are reduced across replicas (B31)."""
    l = nn.Embedding(10, 5, sparse=True)
    i = torch.randint(10, (20, 5), dtype=torch.long)
    expected_out = l(i)
    loss = expected_out.sum()
    loss.backward()
    expected_grads = [param.grad.clone() for param in l.parameters()]

    l.zero_grad()
    out = minidp.data_parallel(l, i, TWO)
    loss = out.sum()
    loss.backward()
    assert out.device == torch.device("cpu")
    assert_close(out, expected_out)
    for expected, param in zip(expected_grads, l.parameters()):
        assert_close(param.grad.coalesce(), expected.coalesce())

    first = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    minidp.data_parallel(l.to(first), i.to(first))


def test_data_parallel_nested_output():
    """Lists, tuples and dicts in the output are gathered element by element, types kept (B28)."""

    def fn(input):
        return [input, (input.sin(), input.cos(), [input.add(1)]), input, OrderedDict(a=input, b=[input.sin()])]

    class Net(nn.Module):
        def forward(self, input):
            return fn(input)

    i = torch.randn(2, 2).float()
    output = minidp.data_parallel(Net(), i, TWO)
    assert_close(output, fn(i))
    assert isinstance(output[0], torch.Tensor)
    assert isinstance(output[1], tuple)
    assert isinstance(output[1][0], torch.Tensor)
    assert isinstance(output[1][1], torch.Tensor)
    assert isinstance(output[1][2], list)
    assert isinstance(output[1][2][0], torch.Tensor)
    assert isinstance(output[2], torch.Tensor)
    assert isinstance(output[3], dict)
    assert len(output[3]) == 2
    assert "a" in output[3]
    assert "b" in output[3]
    assert isinstance(output[3]["a"], torch.Tensor)
    assert isinstance(output[3]["b"], list)
    assert isinstance(output[3]["b"][0], torch.Tensor)


def test_data_parallel_nested_input():
    """Tensors nested in tuples of the input are scattered (B12)."""

    def fn(input):
        return input[1][0]

    class Net(nn.Module):
        def forward(self, *input):
            return fn(input)

    i = torch.randn(20, 3, dtype=torch.float)
    input = (i.cos(), (i.sin(), i), i.sin())
    output = minidp.data_parallel(Net(), input, TWO)
    assert_close(output, fn(input))


def test_data_parallel_module_zero_inputs():
    """A forward without arguments runs once, on ``device_ids[0]`` (B8, B9, B11)."""

    class TestModule(nn.Module):
        def forward(self):
            t = torch.eye(2, 3)
            return t + (1 - t)

    def check(output, expected):
        assert output.device == torch.device("cpu")
        assert_close(output, expected)

    expected = torch.ones(2, 3)
    model = TestModule()

    check(minidp.DataParallel(model, cpu_ids(1))(), expected)
    check(minidp.DataParallel(model, TWO)(), expected)
    check(minidp.data_parallel(model, None, cpu_ids(1)), expected)
    check(minidp.data_parallel(model, (), TWO), expected)


def test_data_parallel_device_args():
    """``output_device`` and ``device_ids`` given as ``torch.device`` objects (B2)."""
    cpu = torch.device("cpu")

    # output_device
    l = nn.Linear(10, 5).to(cpu, torch.float)
    i = torch.randn(20, 10, dtype=torch.float, device=cpu, requires_grad=True)
    out = minidp.data_parallel(l, i, device_ids=TWO, output_device=cpu)
    assert_close(out, l(i))

    # device_ids
    l = nn.Linear(10, 5).to(cpu, torch.float)
    i = torch.randn(20, 10, dtype=torch.float, device=cpu, requires_grad=True)
    out = minidp.data_parallel(l, i, device_ids=(cpu, cpu), output_device=cpu)
    assert_close(out, l(i))


def test_data_parallel_function_deletion():
    """A gradient penalty (``autograd.grad`` with ``create_graph=True`` through DataParallel), then
    backward: the parameters get the second-order gradients (upstream issue #16532; B31)."""

    def gradient_penalty(net, x):
        output = net(x)
        loss = torch.autograd.grad(
            outputs=output, inputs=x, grad_outputs=x.new_ones(output.size()), create_graph=True, retain_graph=True
        )[0].mean()
        return loss

    net = nn.Linear(4, 1)
    dpn = minidp.DataParallel(net, TWO)
    x = torch.ones(2, 4, requires_grad=True)

    dpn.zero_grad()
    loss = gradient_penalty(dpn, x)
    loss.backward()
    grads = [p.grad for p in net.parameters()]
    assert len(grads) == 2
    assert_close(torch.tensor([[0.25, 0.25, 0.25, 0.25]]), grads[0])
    assert_close(torch.tensor([0.0]), grads[1])


def _test_scatter(tensor):
    x = tensor.detach().requires_grad_()
    result = minidp.scatter(x, TWO)
    assert len(result) == 2
    assert_close(result[0], x[:2])
    assert result[0].device == torch.device("cpu")
    assert_close(result[1], x[2:])
    assert result[1].device == torch.device("cpu")
    grad = result[0].detach().clone().fill_(2)
    result[0].backward(grad)
    assert_close(x.grad[:2], grad)
    assert_close(x.grad[2:], grad.clone().zero_())
    assert_grad_and_gradgrad_checks(lambda y: minidp.scatter(y, TWO), (x,))


def test_scatter_cpu():
    """A CPU tensor cut into one chunk per replica; its gradients come back (B15, B32)."""
    _test_scatter(torch.randn((4, 4), dtype=torch.float64))


@needs_cuda("scatters a tensor that starts on a GPU; on CPU replicas the source is the CPU, as in test_scatter_cpu")
def test_scatter_gpu():
    pass


def test_data_parallel_complex():
    """Complex parameters and inputs go through the replicas (B33). Upstream expects stock's CUDA
    path to hand back the real view of the result (shape ``[1, 10, 2]``); minidp keeps the complex
    tensor, so the port compares with the complex result itself, exactly. A second call with two
    rows makes the parameter reach two replicas (upstream's one row uses one)."""

    class Cplx(nn.Module):
        def __init__(self):
            super().__init__()
            self.cplx = nn.Parameter(torch.zeros(1, 10, dtype=torch.cfloat))

        def forward(self, x):
            return x + self.cplx

    cplx = minidp.DataParallel(Cplx(), TWO)
    for rows in (1, 2):
        input = torch.rand(rows, 10, dtype=torch.cfloat)
        result = cplx(input)
        assert result.size() == torch.Size([rows, 10]) and result.dtype == torch.cfloat
        assert torch.equal(torch.view_as_real(result), torch.view_as_real(input))


def _test_gather(output_device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the scalars' warning, once per gradcheck evaluation
        inputs = (
            torch.randn(2, 4, requires_grad=True, dtype=torch.double),
            torch.randn(2, 4, requires_grad=True, dtype=torch.double),
        )
        result = minidp.gather(inputs, output_device)
        assert result.size() == torch.Size([4, 4])
        assert_close(result[:2], inputs[0])
        assert_close(result[2:], inputs[1])
        assert not result.is_cuda
        grad = torch.randn((4, 4), dtype=torch.double)
        result.backward(grad)
        assert_close(inputs[0].grad, grad[:2])
        assert_close(inputs[1].grad, grad[2:])
        assert_grad_and_gradgrad_checks(lambda x, y: minidp.gather((x, y), output_device), inputs)

        # scalar inputs stack into a vector
        inputs = (
            torch.randn((), requires_grad=True, dtype=torch.double),
            torch.randn((), requires_grad=True, dtype=torch.double),
        )
        result = minidp.gather(inputs, output_device)
        assert result.size() == torch.Size([2])
        assert_close(result[0], inputs[0])
        assert_close(result[1], inputs[1])
        assert not result.is_cuda
        grad = torch.randn(2, dtype=torch.double)
        result.backward(grad)
        assert_close(inputs[0].grad, grad[0])
        assert_close(inputs[1].grad, grad[1])
        assert_grad_and_gradgrad_checks(lambda x, y: minidp.gather((x, y), output_device), inputs)


def test_gather_cpu():
    """Gather onto the CPU named by ``-1``; scalars become a vector; gradients flow back (B29, B30, B32)."""
    _test_gather(-1)


@needs_cuda("gathers onto GPU 0; on CPU replicas the target is the CPU, as in test_gather_cpu")
def test_gather_gpu():
    pass


def test_gather_different_len_dicts():
    """Replicas returning dicts with different keys are an error (B28)."""
    inputs = (
        {"a": torch.randn(1, 2, requires_grad=True)},
        {
            "b": torch.randn(1, 2, requires_grad=True),
            "a": torch.randn(1, 2, requires_grad=True),
        },
    )
    with pytest.raises(ValueError):
        _ = minidp.gather(inputs, target_device="cpu")


def test_replicate():
    """Each replica computes what the module computes, on its device (B19, B20). Upstream loops
    over ``replica.parameters()``, which is empty on a replica (B20); the port checks the
    parameter attributes themselves."""
    module = nn.Linear(10, 5).float()
    input = torch.randn(2, 10, dtype=torch.float)
    expected_output = module(input)
    for devices in [tuple(TWO), TWO]:
        replicas = minidp.replicate(module, devices)
        for i, replica in enumerate(replicas):
            assert list(replica.parameters()) == []
            for p in (replica.weight, replica.bias):
                assert p.device == torch.device(devices[i])
            replica_input = input.to(devices[i])
            assert_close(replica(replica_input), expected_output)


def test_replicate_buffers():
    """Buffers reach each replica's device. The meta device is replica 1's device, so that a
    buffer left on the source device would be caught (B19)."""
    net = nn.Module()
    net.bn = nn.BatchNorm2d(10)
    for devices in [("cpu", ELSEWHERE), ["cpu", ELSEWHERE]]:
        replicas = minidp.replicate(net, devices)
        for i, replica in enumerate(replicas):
            device = torch.device(devices[i])
            assert replica.bn.running_mean.device == device, "buffer on wrong device"
            assert replica.bn.running_var.device == device, "buffer on wrong device"
            assert replica.bn.num_batches_tracked.device == device, "buffer on wrong device"


def test_zero_grad():
    """``zero_grad()`` inside a replica's forward warns that it has no effect (B20). Upstream
    checks the warning inside forward; warning filters are process-wide, not per thread, so the
    port records them around the call instead and counts one per replica."""

    class Net(nn.Module):
        def forward(self, x):
            self.zero_grad()
            return x

    dpm = minidp.DataParallel(Net(), TWO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dpm(torch.rand(4, 3, 6, 5))
    pattern = r"Calling \.zero_grad\(\) from a module created with nn\.DataParallel\(\) has no effect."
    matching = [w for w in caught if issubclass(w.category, UserWarning) and re.match(pattern, str(w.message))]
    assert len(matching) == 2


def test_autocast():
    """A forward decorated with autocast produces autocast's dtype in every replica (B27). CPU
    autocast (bfloat16) stands in for CUDA's (float16)."""

    class Model(nn.Linear):
        def __init__(self):
            super().__init__(8, 8)

        @torch.autocast("cpu")
        def forward(self, input):
            return super().forward(input)

    model = minidp.DataParallel(Model().to(dtype=torch.float32), TWO)
    input = torch.randn((8, 8), dtype=torch.float32)
    assert model(input).dtype is torch.bfloat16


def test_save_replica_module():
    """Replicas can be saved with ``torch.save``, with and without ``detach`` (upstream issue #37182; B34)."""
    module = nn.Linear(8, 8)
    dpm = minidp.replicate(module, devices=TWO, detach=False)
    data = io.BytesIO()
    torch.save(dpm, data)
    dpm = minidp.replicate(module, devices=TWO, detach=True)
    torch.save(dpm, data)


def test_strided_grad_layout():
    """The gradients of channels_last and mixed-precision convolutions keep the parameters' memory
    format and equal the single-device ones, over two steps (B31, B35). Upstream's cuDNN flags have no
    CPU counterpart."""

    class ConvNet(nn.Module):
        def __init__(self, layouts, dtype_list):
            super().__init__()
            self.dtypes = dtype_list
            self.conv0 = nn.Conv2d(8, 16, (2, 2)).to(memory_format=layouts[0], dtype=dtype_list[0])
            self.conv1 = nn.Conv2d(16, 32, (2, 2)).to(memory_format=layouts[1], dtype=dtype_list[1])
            self.conv2 = nn.Conv2d(32, 16, (2, 2)).to(memory_format=layouts[2], dtype=dtype_list[2])
            self.conv3 = nn.Conv2d(16, 8, (2, 2)).to(memory_format=layouts[3], dtype=dtype_list[3])

        def forward(self, x):
            x = x.to(self.dtypes[0])
            x = self.conv0(x).to(self.dtypes[1])
            x = self.conv1(x).to(self.dtypes[2])
            x = self.conv2(x).to(self.dtypes[3])
            x = self.conv3(x)
            return x

    layer_formats = (
        [torch.contiguous_format] * 4,
        [torch.channels_last] * 2 + [torch.contiguous_format] * 2,
        [torch.channels_last] * 4,
    )
    layer_dtypes = (
        [torch.float] * 4,
        [torch.float] * 2 + [torch.half] * 2,
        [torch.half] * 4,
    )

    ndevs = len(TWO)
    input = torch.randn(ndevs * 8, 8, 8, 8, dtype=torch.float)
    target = torch.randn(ndevs * 8, 8, 4, 4, dtype=torch.float)

    for formats, dtype_list in product(layer_formats, layer_dtypes):
        model_msg = f"formats = {formats} dtypes = {dtype_list}"
        m = ConvNet(formats, dtype_list)
        m_dp = minidp.DataParallel(deepcopy(m), device_ids=TWO)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt_dp = torch.optim.SGD(m_dp.parameters(), lr=0.1)
        has_half = any(p.dtype is torch.half for p in m.parameters())
        tol = 1.0e-3 if has_half else 1.0e-5
        # 2 iterations: the first creates the grads, the second works on zeroed ones.
        for it in range(2):
            iter_msg = f"iter = {it} " + model_msg
            F.mse_loss(m(input).float(), target).backward()
            F.mse_loss(m_dp(input).float(), target).backward()
            for i, ((layer_name, m_child), m_dp_child) in enumerate(zip(m.named_children(), m_dp.module.children())):
                named_msg = layer_name + ".weight " + iter_msg
                assert m_child.weight.grad.is_contiguous(memory_format=formats[i]), named_msg
                assert m_dp_child.weight.grad.is_contiguous(memory_format=formats[i]), named_msg
                for (param_name, p), p_dp in zip(m_child.named_parameters(), m_dp_child.parameters()):
                    named_msg = layer_name + "." + param_name + " " + iter_msg
                    assert_close(p.grad, p_dp.grad, rtol=tol, atol=tol, msg=named_msg)
            opt.step()
            opt_dp.step()
            opt.zero_grad()
            opt_dp.zero_grad()


def test_parameter_list_dict_replica():
    """Inside a replica, a ParameterList / ParameterDict holds the replica's copies: equal to the
    originals, requiring grad, and non-leaf (B20). The port also counts that every replica ran the check."""

    class MyMod(nn.Module):
        def __init__(self, data, check_fn):
            super().__init__()
            self.data = data
            self.check_fn = check_fn

        def forward(self, inp):
            self.check_fn(self)
            return inp

    p1 = nn.Parameter(torch.rand(10))
    p2 = nn.Parameter(torch.rand(10))
    key0, key1 = 0, 1
    checked = []

    def check_fn(self_):
        assert_close(p1, self_.data[key0])
        assert_close(p2, self_.data[key1])
        assert self_.data[key0].requires_grad
        assert self_.data[key1].requires_grad
        assert self_.data[key0].grad_fn is not None
        assert self_.data[key1].grad_fn is not None
        checked.append(True)

    module = MyMod(nn.ParameterList([p1, p2]), check_fn)
    model = minidp.DataParallel(module, TWO)
    model(torch.randn((8, 8)))
    assert len(checked) == 2

    key0, key1 = "0", "1"
    module = MyMod(nn.ParameterDict({"0": p1, "1": p2}), check_fn)
    model = minidp.DataParallel(module, TWO)
    model(torch.randn((8, 8)))
    assert len(checked) == 4


# --------------------------------------------------------------------------------------------------
# TestDataParallelDeviceType: upstream instantiates these for CUDA only (test_..._cuda_float32,
# _float64, _float16); here they run on CPU replicas for the same three dtypes.
# --------------------------------------------------------------------------------------------------

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)


def _check_output(out, expected_out, dtype):
    assert out.device == torch.device("cpu")
    assert_close(out, expected_out, atol=PRECISION[dtype], rtol=0)


@DTYPES
def test_data_parallel_module(dtype):
    l = nn.Linear(10, 5).to(dtype=dtype)
    i = torch.randn(20, 10, dtype=dtype)
    expected_out = l(i)
    net = minidp.DataParallel(l, TWO)
    _check_output(net(i), expected_out, dtype)


class _UsesLinear(nn.Module):
    """Upstream's ``Net``: calls the given linear layer on its keyword argument ``input``."""

    def __init__(self, l: nn.Module, key=None) -> None:
        super().__init__()
        self.l = l
        self.key = key

    def forward(self, input):
        return self.l(input if self.key is None else input[self.key])


@DTYPES
def test_data_parallel_module_kwargs_only(dtype):
    """Keyword arguments only: the positional side is padded with empty tuples (B17)."""
    l = nn.Linear(10, 5).to(dtype=dtype)
    i = torch.randn(20, 10, dtype=dtype)
    expected_out = l(i)
    n = minidp.DataParallel(_UsesLinear(l), TWO)
    _check_output(n(input=i), expected_out, dtype)


def _check_kwargs_only_with_unused(unused, dtype):
    """An empty container beside the tensor in a kwarg reaches every replica as it is (B12)."""
    l = nn.Linear(10, 5).to(dtype=dtype)
    i = torch.randn(20, 10, dtype=dtype)
    expected_out = l(i)
    n = minidp.DataParallel(_UsesLinear(l, "data"), TWO)
    _check_output(n(input={"data": i, "unused": unused}), expected_out, dtype)


@DTYPES
def test_data_parallel_module_kwargs_only_empty_list(dtype):
    _check_kwargs_only_with_unused([], dtype)


@DTYPES
def test_data_parallel_module_kwargs_only_empty_dict(dtype):
    _check_kwargs_only_with_unused({}, dtype)


@DTYPES
def test_data_parallel_module_kwargs_only_empty_tuple(dtype):
    _check_kwargs_only_with_unused((), dtype)
