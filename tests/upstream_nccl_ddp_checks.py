"""PyTorch's ``DistributedDataParallelTest`` of ``test/distributed/test_c10d_nccl.py``, rank side: the cases that
upstream runs on GPUs with NCCL, ported to the CPU with Gloo (``device_ids=None``, the model on the CPU), against
``minidp.distributed.DistributedDataParallel``, with the helpers they take from ``test/distributed/test_c10d_common.py``.

Source: the PyTorch repository (https://github.com/pytorch/pytorch), BSD-licensed (3-clause); adapted from it,
copyright the PyTorch contributors. The models and the helper test_c10d_common.py shares with test_c10d_gloo.py
are tests/upstream_ddp_checks.py's. Upstream compares DDP with a model trained on the whole batch, or checks a hook's
gradients, as here. With ``MINIDP_UPSTREAM_DDP=torch`` in the environment, :data:`DDP` is torch's own wrapper: every
case passes on it too. Not ported, and why (tests/test_upstream_c10d_nccl.py lists them): the bfloat16 hooks, which
torch's DDP refuses without NCCL (minidp's takes them: README's table); ``test_find_unused_parameters_kwarg``, whose
error minidp words otherwise ("got its gradient twice", as in tests/test_upstream_ddp.py); and
``test_param_layout_mismatch_error``, after which torch's ranks crash over Gloo.
"""

import copy
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from itertools import product

import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powerSGD
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import minidp.distributed as md

from .upstream_ddp_checks import C10dNet, ModuleForDdpCommHook, TwoLinearSoftmax, _ddp_with_process_group, raises

DDP = nn.parallel.DistributedDataParallel if os.environ.get("MINIDP_UPSTREAM_DDP") == "torch" else md.DistributedDataParallel


def rank():
    return dist.get_rank()


def ws():
    return dist.get_world_size()


def pg():
    return dist.distributed_c10d._get_default_group()


class ConvNet(nn.Module):
    def __init__(self, gpus, layouts, dtypes):
        super().__init__()
        self.dtypes = dtypes
        gpus = [gpus] * 4
        self.conv0 = nn.Conv2d(8, 16, (2, 2)).to(device=gpus[0], memory_format=layouts[0], dtype=dtypes[0])
        self.conv1 = nn.Conv2d(16, 32, (2, 2)).to(device=gpus[1], memory_format=layouts[1], dtype=dtypes[1])
        self.conv2 = nn.Conv2d(32, 16, (2, 2)).to(device=gpus[2], memory_format=layouts[2], dtype=dtypes[2])
        self.conv3 = nn.Conv2d(16, 8, (2, 2)).to(device=gpus[3], memory_format=layouts[3], dtype=dtypes[3])

    def forward(self, x):
        x = x.to(self.dtypes[0])
        x = self.conv0(x).to(dtype=self.dtypes[1])
        x = self.conv1(x).to(dtype=self.dtypes[2])
        x = self.conv2(x).to(dtype=self.dtypes[3])
        return self.conv3(x)


class FFTModel(nn.Module):
    def __init__(self, hin, win, n_features):
        super().__init__()
        self.hin, self.win = hin, win
        self.weight = nn.Parameter(torch.ones((n_features, n_features, hin, win // 2 + 1), dtype=torch.cfloat))

    def forward(self, x):
        xc = torch.fft.rfft2(x, s=(self.hin, self.win), dim=(-2, -1), norm="ortho")
        xcw = torch.einsum("nchw,cohw->nohw", xc, self.weight)
        return torch.fft.irfft2(xcw, dim=(-2, -1), norm="ortho")


# ---------------------------------------------------------------- helpers
def _prepare_single_device_module(process_group, devices, device_ids, global_batch_size, gradient_as_bucket_view=False):
    model = C10dNet()
    device = torch.device("cpu")
    ddp_model = DDP(copy.deepcopy(model).to(device), device_ids=device_ids, process_group=process_group,
                    bucket_cap_mb=0.001, gradient_as_bucket_view=gradient_as_bucket_view)
    input = torch.randn(global_batch_size, 2)
    target = torch.randn(global_batch_size, 4)
    return model, ddp_model, input, target


def test_backend_single_device_module_device_ids_None():
    _ddp_with_process_group(pg())


def test_backend_single_device_module_empty_device_ids():
    _ddp_with_process_group(pg(), device_ids=[])


def test_ddp_complex_params_and_grads():
    process_group = pg()
    torch.manual_seed(42 + rank())
    model = nn.Sequential(nn.Linear(4, 8, dtype=torch.cfloat), nn.Linear(8, 2, dtype=torch.cfloat))
    torch.manual_seed(42 + rank())
    ref_model = nn.Sequential(nn.Linear(4, 8, dtype=torch.cfloat), nn.Linear(8, 2, dtype=torch.cfloat))
    ddp_model = DDP(model, process_group=process_group, bucket_cap_mb=0.001)
    torch.manual_seed(100)
    x = torch.randn(16, 4, dtype=torch.cfloat)
    y = torch.randn(16, 2, dtype=torch.cfloat)
    o1 = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    o2 = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    for it in range(5):
        o1.zero_grad()
        torch.mean(torch.abs(ddp_model(x) - y) ** 2).backward()
        o2.zero_grad()
        with torch.no_grad():
            for a, b in zip(ddp_model.parameters(), ref_model.parameters()):
                b.copy_(a)
        torch.mean(torch.abs(ref_model(x) - y) ** 2).backward()
        for p in ref_model.parameters():
            dist.all_reduce(p.grad.data, op=dist.ReduceOp.SUM)
            p.grad.data /= ws()
        for a, b in zip(ddp_model.parameters(), ref_model.parameters()):
            assert a.grad.is_complex()
            assert not torch.allclose(a.grad.imag, torch.zeros_like(a.grad.imag))
            assert torch.allclose(a.grad.real, b.grad.real, rtol=1e-5, atol=1e-5)
            assert torch.allclose(a.grad.imag, b.grad.imag, rtol=1e-5, atol=1e-5)
        o1.step(); o2.step()
    for a, b in zip(ddp_model.parameters(), ref_model.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


class MixedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.complex_fc = nn.Linear(4, 4, dtype=torch.cfloat)
        self.real_fc = nn.Linear(4, 4, dtype=torch.float32)
        self.final_fc = nn.Linear(4, 2, dtype=torch.cfloat)

    def forward(self, xc, xr):
        rb = self.real_fc(xr)
        return self.final_fc(self.complex_fc(xc) + torch.complex(rb, torch.zeros_like(rb)))


def test_ddp_mixed_real_and_complex_params():
    torch.manual_seed(42 + rank())
    model = MixedModule()
    ref_model = MixedModule()
    ddp_model = DDP(model, process_group=pg(), bucket_cap_mb=100)
    o1 = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    o2 = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    torch.manual_seed(100)
    xc = torch.randn(8, 4, dtype=torch.cfloat); xr = torch.randn(8, 4); t = torch.randn(8, 2, dtype=torch.cfloat)
    for it in range(5):
        o1.zero_grad()
        torch.mean(torch.abs(ddp_model(xc, xr) - t) ** 2).backward()
        o2.zero_grad()
        with torch.no_grad():
            for a, b in zip(ddp_model.parameters(), ref_model.parameters()):
                b.copy_(a)
        torch.mean(torch.abs(ref_model(xc, xr) - t) ** 2).backward()
        for p in ref_model.parameters():
            if p.grad is not None and p.grad.is_floating_point():
                dist.all_reduce(p.grad.data)
                p.grad.data /= ws()
        for a, b in zip(ddp_model.parameters(), ref_model.parameters()):
            assert a.grad.is_complex() == b.grad.is_complex()
            if a.grad.is_complex():
                assert not torch.allclose(a.grad.imag, torch.zeros_like(a.grad.imag))
                assert torch.allclose(a.grad.real, b.grad.real, rtol=1e-5, atol=1e-5)
                assert torch.allclose(a.grad.imag, b.grad.imag, rtol=1e-5, atol=1e-5)
            else:
                assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-5)
        o1.step(); o2.step()


def _test_fp16(gradient_as_bucket_view=False):
    model = nn.Linear(1, 1, bias=False).half()
    nn.init.constant_(model.weight, 1)
    ddp_model = DDP(model, process_group=pg(), bucket_cap_mb=0.001, gradient_as_bucket_view=gradient_as_bucket_view)
    input = torch.tensor([[2 ** 15]]).half()
    ddp_model.train()
    ddp_model(input).sum().backward()
    assert not any(torch.isinf(p.grad).any() for p in ddp_model.parameters()), [p.grad for p in ddp_model.parameters()]


def test_fp16():
    _test_fp16()


def test_fp16_grad_is_view():
    _test_fp16(True)


class ForwardReturnValueModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.fc3 = nn.Linear(4, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x, fn):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return fn(F.softmax(x, dim=1), F.softmax(self.fc3(x), dim=1))


def _test_arbitrary_forward_return_value(gradient_as_bucket_view=False):
    model = DDP(ForwardReturnValueModule().float(), process_group=pg(), gradient_as_bucket_view=gradient_as_bucket_view)
    criterion = nn.CrossEntropyLoss()
    input = torch.rand([4, 2])
    target = torch.LongTensor([random.randrange(4) for _ in range(4)])

    def test(box, unbox):
        output = model(input, fn=box)
        criterion(unbox(output), target).backward()

    test(lambda x, y: (x, y), lambda o: o[1])
    test(lambda x, y: ["foo", x, "bar", y], lambda o: o[3])
    test(lambda x, y: ("foo", x, "bar", y), lambda o: o[3])
    test(lambda x, y: {"foo": "bar", "a": x, "b": y}, lambda o: o["b"])
    test(lambda x, y: ["foo", "bar", {"a": x, "b": y}], lambda o: o[2]["b"])
    test(lambda x, y: {"foo": "bar", "list": [0, x, 1, y]}, lambda o: o["list"][3])


def test_arbitrary_forward_return_value():
    _test_arbitrary_forward_return_value()


def test_arbitrary_forward_return_value_grad_is_view():
    _test_arbitrary_forward_return_value(True)


def test_ddp_with_lazy_parameters():
    with raises(RuntimeError, "Modules with uninitialized parameters"):
        DDP(nn.LazyLinear(10), process_group=pg())


def _test_multiple_outputs_multiple_backward(gradient_as_bucket_view=False):
    class MultipleOutputModule(nn.Module):
        def __init__(self):
            super().__init__()

            def define_module():
                return nn.Sequential(nn.Linear(2, 10, bias=False), nn.ReLU(), nn.Linear(10, 4, bias=False), nn.ReLU())

            self.module0 = define_module()
            self.module1 = define_module()

        def forward(self, x):
            return F.softmax(self.module0(x), dim=1), F.softmax(self.module1(x), dim=1)

    model = DDP(MultipleOutputModule(), process_group=pg(), gradient_as_bucket_view=gradient_as_bucket_view)
    criterion = nn.CrossEntropyLoss()
    input = torch.rand([4, 2])
    target = torch.LongTensor([random.randrange(4) for _ in range(4)])
    o1, o2 = model(input)
    criterion(o1, target).backward()
    criterion(o2, target).backward()


def test_multiple_outputs_multiple_backward():
    _test_multiple_outputs_multiple_backward()


def test_multiple_outputs_multiple_backward_grad_is_view():
    _test_multiple_outputs_multiple_backward(True)


def test_no_grad():
    model = DDP(TwoLinearSoftmax(), process_group=pg())
    input = torch.rand([4, 2])

    def check_no_grads():
        for p in model.parameters():
            assert p.requires_grad
            assert p.grad is None

    check_no_grads()
    with torch.no_grad():
        output = model(input)
        assert isinstance(output, torch.Tensor)
    check_no_grads()


def _test_accumulate_gradients_module(gradient_as_bucket_view=False):
    global_batch_size = ws()
    model, ddp_model, input, target = _prepare_single_device_module(pg(), None, None, global_batch_size,
                                                                    gradient_as_bucket_view)

    def step_model(model, input, target):
        model.train()
        F.mse_loss(model(input), target).backward()

    with torch.no_grad():
        ddp_model.train()
        ddp_model.module(input)
    r = rank()
    for iteration in range(4):
        step_model(model, input, target)
        if iteration % 2 == 0:
            step_model(ddp_model.module, input[r:r + 1], target[r:r + 1])
            for i, j in zip(model.parameters(), ddp_model.parameters()):
                try:
                    assert_close(i.grad, j.grad)
                except AssertionError:
                    pass
                else:
                    raise AssertionError("expected not equal")
        else:
            step_model(ddp_model, input[r:r + 1], target[r:r + 1])
            for i, j in zip(model.parameters(), ddp_model.parameters()):
                assert_close(i.grad, j.grad, rtol=1.3e-06, atol=5e-5)
        torch.manual_seed(1337 + iteration)
        input = input[torch.randperm(global_batch_size)]


def test_accumulate_gradients_module():
    _test_accumulate_gradients_module()


def test_accumulate_gradients_module_with_grad_is_view():
    _test_accumulate_gradients_module(True)


def _test_grad_layout(dtypes_list, local_batch_size=4):
    process_group = pg()
    global_batch_size = local_batch_size * ws()
    bucketsizes = (0.000001, 25)
    layer_formats = ([torch.contiguous_format] * 4, [torch.channels_last] * 2 + [torch.contiguous_format] * 2,
                     [torch.channels_last] * 4)
    input = torch.randn((global_batch_size, 8, 8, 8))
    target = torch.randn((global_batch_size, 8, 4, 4))
    s, e = rank() * local_batch_size, (rank() + 1) * local_batch_size

    @contextmanager
    def first_bucket_size(mb):
        old = dist._DEFAULT_FIRST_BUCKET_BYTES
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(mb * 1.0e6)
        try:
            yield
        finally:
            dist._DEFAULT_FIRST_BUCKET_BYTES = old

    for formats, dtypes, bucketsize in product(layer_formats, dtypes_list, bucketsizes):
        with first_bucket_size(bucketsize):
            m = ConvNet("cpu", formats, dtypes)
            m_ddp = DDP(copy.deepcopy(m), process_group=process_group, bucket_cap_mb=bucketsize)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            opt_ddp = torch.optim.SGD(m_ddp.parameters(), lr=0.1)
            has_half = any(p.dtype is torch.half for p in m.parameters())
            tol = 3.0e-3 if has_half else 1.0e-5
            for it in range(3):
                msg = f"iter {it} formats {formats} dtypes {dtypes} bucket {bucketsize}"
                F.mse_loss(m(input).float(), target).backward()
                F.mse_loss(m_ddp(input[s:e]).float(), target[s:e]).backward()
                for i, ((ln, mc), mdc) in enumerate(zip(m.named_children(), m_ddp.module.children())):
                    assert mc.weight.grad.is_contiguous(memory_format=formats[i]), msg
                    assert mdc.weight.grad.is_contiguous(memory_format=formats[i]), msg + " ddp " + ln
                    for (pn, p), pd in zip(mc.named_parameters(), mdc.parameters()):
                        assert_close(p.grad, pd.grad, rtol=tol, atol=tol, msg=msg + ln + pn)
                opt.step(); opt_ddp.step()
                if it == 0:
                    for p, pd in zip(m.parameters(), m_ddp.parameters()):
                        p.grad = None; pd.grad = None
                else:
                    m.zero_grad(); m_ddp.zero_grad()


def test_grad_layout_1devicemodule_1replicaperprocess():
    _test_grad_layout(([torch.float] * 4,))


def test_grad_layout_1devicemodule_1replicaperprocess_half():
    _test_grad_layout(([torch.float] * 2 + [torch.half] * 2, [torch.half] * 4))


def _model_with_hook(hook=None, gradient_as_bucket_view=False, state=None, static_graph=False):
    m = DDP(ModuleForDdpCommHook(), process_group=pg(), gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph)
    if hook is not None:
        m.register_comm_hook(state, hook)
    return m


def _builtin_model(hook, gradient_as_bucket_view=False):
    m = DDP(ModuleForDdpCommHook(), process_group=pg(), gradient_as_bucket_view=gradient_as_bucket_view)
    m._register_builtin_comm_hook(hook)
    return m


def _run_and_verify_hook(model, input, expected_grad):
    output = model(input, rank())
    output.mean().backward()
    for p in model.parameters():
        assert_close(p.grad, expected_grad)


def _test_ddp_comm_hook_allreduce_hook(gradient_as_bucket_view=False, static_graph=False):
    process_group = pg()

    def allreduce_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensors = [bucket.buffer() / ws()]
        return process_group.allreduce(tensors).get_future().then(lambda fut: fut.value()[0])

    m = _model_with_hook(allreduce_hook, gradient_as_bucket_view, None, static_graph)
    _run_and_verify_hook(m, 8, 0.25 * torch.ones(2, 2))


def test_ddp_comm_hook_allreduce_with_future():
    _test_ddp_comm_hook_allreduce_hook()


def test_ddp_comm_hook_allreduce_with_future_grad_is_view():
    _test_ddp_comm_hook_allreduce_hook(gradient_as_bucket_view=True)


def test_ddp_comm_hook_allreduce_with_future_static_graph():
    _test_ddp_comm_hook_allreduce_hook(static_graph=True)


def _test_default_ddp_comm_hooks(gradient_as_bucket_view=False, bf16=False):
    hooks = [default.allreduce_hook, default.fp16_compress_hook] + ([default.bf16_compress_hook] if bf16 else [])
    for hook in hooks:
        m = _model_with_hook(hook, gradient_as_bucket_view, pg())
        _run_and_verify_hook(m, 8, 0.25 * torch.ones(2, 2))


def test_default_ddp_comm_hooks():
    _test_default_ddp_comm_hooks()


def test_default_ddp_comm_hooks_is_view():
    _test_default_ddp_comm_hooks(True)


def _test_compress_wrapper(wrapper, gradient_as_bucket_view=False):
    state = powerSGD.PowerSGDState(process_group=pg())
    for hook, st in [(powerSGD.powerSGD_hook, state), (default.allreduce_hook, pg())]:
        m = _model_with_hook(wrapper(hook), gradient_as_bucket_view, st)
        _run_and_verify_hook(m, 8, 0.25 * torch.ones(2, 2))


def test_fp16_compress_hook_wrapper():
    _test_compress_wrapper(default.fp16_compress_wrapper)


def test_fp16_compress_wrapper_is_view():
    _test_compress_wrapper(default.fp16_compress_wrapper, True)


def _test_powerSGD_ddp_comm_hook(gradient_as_bucket_view=False):
    for ef, warm, batch in product([True, False], [True, False], [True, False]):
        state = powerSGD.PowerSGDState(process_group=pg(), matrix_approximation_rank=1, use_error_feedback=ef,
                                       warm_start=warm, batch_tensors_with_same_shape=batch)
        for hook in [powerSGD.powerSGD_hook, powerSGD.batched_powerSGD_hook]:
            m = _model_with_hook(hook, gradient_as_bucket_view, state)
            _run_and_verify_hook(m, 8, 0.25 * torch.ones(2, 2))


def test_powerSGD_ddp_comm_hook():
    _test_powerSGD_ddp_comm_hook()


def test_powerSGD_ddp_comm_hook_grad_is_view():
    _test_powerSGD_ddp_comm_hook(True)


def _test_builtin_ddp_comm_hooks(gradient_as_bucket_view=False):
    for t in [dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS]:
        m = _builtin_model(t, gradient_as_bucket_view)
        _run_and_verify_hook(m, 8, 0.25 * torch.ones(2, 2))


def test_builtin_ddp_comm_hooks():
    _test_builtin_ddp_comm_hooks()


def test_builtin_ddp_comm_hooks_grad_is_view():
    _test_builtin_ddp_comm_hooks(True)


def test_comm_hook_allreduce_with_then():
    process_group = pg()

    def allreduce_with_then_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = process_group.allreduce([bucket.buffer() / ws()]).get_future()
        return fut.then(lambda f: 10 * f.value()[0]).then(lambda f: 0.5 * f.value())

    m = _model_with_hook(allreduce_with_then_hook)
    _run_and_verify_hook(m, 8, 1.25 * torch.ones(2, 2))


class AcceptsParam(nn.Module):
    def __init__(self, p, factor):
        super().__init__()
        self.a = p
        self.f = factor

    def forward(self, input):
        return input + self.a * self.f


def test_ddp_weight_sharing():
    size = 512 * 512
    dev = rank()
    world = ws()
    p = nn.Parameter(torch.randn(size, requires_grad=True))
    for try_set_to_none, use_bucket_view in product((False, True), (False, True)):
        m = nn.Sequential(AcceptsParam(p, dev + 1), AcceptsParam(p, dev + 1))
        m = DDP(m, bucket_cap_mb=1, gradient_as_bucket_view=use_bucket_view, process_group=pg())
        for _ in range(3):
            m.zero_grad(set_to_none=try_set_to_none)
            m(1).sum().backward()
            analytic = torch.full_like(p, 2.0 * (world * (world + 1.0) / 2.0) / world)
            for name, q in m.named_parameters():
                assert_close(q.grad, analytic, msg=f"{name} set_to_none={try_set_to_none} view={use_bucket_view}")


def test_ddp_packed_sequence():
    seqs = ["sequence_sequence", "seq", "sequence"]
    vocab = ["<pad>"] + sorted({ch for seq in seqs for ch in seq})
    vectorized_seqs = [[vocab.index(tok) for tok in seq] for seq in seqs]
    torch.manual_seed(0)
    embed = nn.Embedding(len(vocab), 4)
    lstm = nn.LSTM(input_size=4, hidden_size=2, batch_first=True)
    lstm_ddp = DDP(copy.deepcopy(lstm), process_group=pg())
    for p1, p2 in zip(lstm.parameters(), lstm_ddp.module.parameters()):
        assert_close(p1, p2)
    seq_lengths = torch.LongTensor(list(map(len, vectorized_seqs)))
    seq_tensor = torch.zeros((len(vectorized_seqs), seq_lengths.max())).long()
    for i, (seq, seq_len) in enumerate(zip(vectorized_seqs, seq_lengths)):
        seq_tensor[i, :seq_len] = torch.LongTensor(seq)
    seq_lengths, perm = seq_lengths.sort(0, descending=True)
    seq_tensor = seq_tensor[perm]
    emb = embed(seq_tensor)
    packed = torch.nn.utils.rnn.pack_padded_sequence(emb, seq_lengths, batch_first=True)
    packed_ddp = torch.nn.utils.rnn.pack_padded_sequence(emb.detach().clone(), seq_lengths, batch_first=True)
    out, (ht, ct) = lstm(packed)
    out_ddp, (ht_ddp, ct_ddp) = lstm_ddp(packed_ddp)
    assert_close(out.data, out_ddp.data)
    assert_close(ht, ht_ddp)
    assert_close(ct, ct_ddp)
    out.data.sum().backward()
    out_ddp.data.sum().backward()
    for p1, p2 in zip(lstm.parameters(), lstm_ddp.parameters()):
        assert_close(p1.grad, p2.grad)


def test_ddp_complex_params():
    N, C, H, W = 1, 4, 16, 16
    ddp_model = DDP(FFTModel(hin=H, win=W, n_features=C), process_group=pg())
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=0.001)
    inp = torch.ones((N, C, H, W), dtype=torch.float32)
    torch.sum(ddp_model(inp)).backward()
    optimizer.step()


def _seq():
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 10))


def test_bucket_cap_mb_list_initialization():
    lst = [10, 25, 50]
    m = DDP(_seq(), process_group=pg(), bucket_cap_mb_list=lst)
    assert m.bucket_bytes_cap_list == [int(c * 1024 * 1024) for c in lst], m.bucket_bytes_cap_list
    assert m.bucket_bytes_cap == int(max(lst) * 1024 * 1024), m.bucket_bytes_cap


def test_bucket_cap_mb_list_default_behavior():
    m = DDP(_seq(), process_group=pg())
    assert m.bucket_bytes_cap == int(25 * 1024 * 1024)
    assert m.bucket_bytes_cap_list == [], m.bucket_bytes_cap_list


def test_bucket_cap_mb_alone():
    m = DDP(_seq(), process_group=pg(), bucket_cap_mb=100)
    assert m.bucket_bytes_cap == int(100 * 1024 * 1024)
    assert m.bucket_bytes_cap_list == [], m.bucket_bytes_cap_list


def test_failure_recovery():
    r, w = rank(), ws()
    # the ranks agree on a file for the new group's store (upstream's test case has one of its own)
    directory = [tempfile.mkdtemp(prefix="minidp_recovery_") if r == 0 else None]
    dist.broadcast_object_list(directory)
    recovery_filename = os.path.join(directory[0], "store")
    model = TwoLinearSoftmax()
    ddp = DDP(model, process_group=pg())
    criterion = nn.CrossEntropyLoss()
    input = torch.rand([4, 2])
    target = torch.LongTensor([random.randrange(4) for _ in range(4)])
    for _ in range(6):
        criterion(ddp(input), target).backward()
    dist.barrier()
    del ddp
    dist.destroy_process_group(pg())
    store = dist.FileStore(recovery_filename, w)
    dist.init_process_group("gloo", store=store, rank=r, world_size=w)
    ddp = DDP(model, process_group=pg())
    input = torch.rand([4, 2])
    for _ in range(6):
        criterion(ddp(input), target).backward()
    dist.barrier()
    if r == 0:
        shutil.rmtree(directory[0], ignore_errors=True)
