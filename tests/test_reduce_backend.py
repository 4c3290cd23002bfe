"""Choosing the gradient reduction: minidp.comm's backends, and DataParallel(reduce_backend=...).

Stock reduces with ``comm.reduce_add_coalesced`` inside ``ReduceAddCoalesced`` (docs/stock-behaviour.md B31);
minidp lets the user pick the arithmetic's engine, and every engine must give the same bits.
"""

from __future__ import annotations

import copy

import pytest
import torch

import minidp
from .helpers import cpu_ids
from minidp import comm, ext
from minidp.zoo import MLP


@pytest.fixture
def default_backend():
    """Restores the global backend after a test that changes it."""
    before = minidp.get_reduce_backend()
    yield
    minidp.set_reduce_backend(before)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        comm.reduce_add([torch.ones(2)], backend="nccl")


def test_auto_uses_the_extension_only_once_it_is_loaded(extension):
    assert ext.is_loaded()
    parameter = torch.ones(2)
    assert comm.reduce_backends([parameter], "auto") == ["ext"]
    assert comm.reduce_backends([parameter], "torch") == ["torch"]


def test_set_reduce_backend_changes_the_default(default_backend):
    minidp.set_reduce_backend("torch")
    assert comm.reduce_backends([torch.ones(2)]) == ["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_ext_and_torch_backends_give_the_same_bits(extension, generator, dtype):
    inputs = [[torch.randn(s, generator=generator).to(dtype) for s in [(7, 3), (1,), (1000,)]] for _ in range(3)]
    by_ext = comm.reduce_add_coalesced(inputs, "cpu", backend="ext")
    by_torch = comm.reduce_add_coalesced(inputs, "cpu", backend="torch")
    for a, b in zip(by_ext, by_torch):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b)


def _train(model: torch.nn.Module, backend: str, batches: list[torch.Tensor]) -> torch.nn.Module:
    dp = minidp.DataParallel(model, cpu_ids(3), reduce_backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x in batches:
        optimizer.zero_grad()
        dp(x).pow(2).mean().backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_with_ext_equals_training_with_torch_bitwise(extension, generator, dtype):
    model = MLP().to(dtype)
    batches = [torch.randn(10, 16, generator=generator, dtype=dtype) for _ in range(5)]
    with_ext = _train(copy.deepcopy(model), "ext", batches)
    with_torch = _train(copy.deepcopy(model), "torch", batches)
    for (name, a), b in zip(with_ext.named_parameters(), with_torch.parameters()):
        assert torch.equal(a, b), name


def test_gradients_kept_across_zero_grad_keep_their_values_after_another_step(extension, generator):
    """The ext backend writes CPU sums into memory it reuses between steps: never memory the user still holds."""
    model = MLP().double()
    reference = copy.deepcopy(model)
    dp = minidp.DataParallel(model, cpu_ids(3), reduce_backend="ext")
    dp_reference = minidp.DataParallel(reference, cpu_ids(3), reduce_backend="torch")
    first, second = (torch.randn(9, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    dp(first).pow(2).sum().backward()
    kept = [p.grad for p in model.parameters()]
    values = [g.clone() for g in kept]
    for p in model.parameters():
        p.grad = None  # what zero_grad(set_to_none=True) does
    dp(second).pow(2).sum().backward()
    dp_reference(second).pow(2).sum().backward()
    for grad, value in zip(kept, values):
        assert torch.equal(grad, value)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_the_backward_uses_the_backend_dataparallel_was_given(monkeypatch, generator):
    seen = []
    original = comm.reduce_add_coalesced

    def spy(inputs, destination=None, buffer_size=10485760, *, backend=None):
        seen.append(backend)
        return original(inputs, destination, buffer_size, backend="torch")

    monkeypatch.setattr(comm, "reduce_add_coalesced", spy)
    dp = minidp.DataParallel(MLP(), cpu_ids(2), reduce_backend="ext")
    dp(torch.randn(4, 16, generator=generator)).sum().backward()
    assert seen == ["ext"]


def _gradient_penalty_grads(model: torch.nn.Module, run, x: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``sum(|d loss / d params|^2)``: a second-order gradient through the reduction."""
    params = list(model.parameters())
    first = torch.autograd.grad(run(x).pow(2).sum(), params, create_graph=True)
    penalty = sum(g.pow(2).sum() for g in first)
    return list(torch.autograd.grad(penalty, params))


@pytest.mark.parametrize("backend", ["torch", "ext", "auto"])
def test_second_order_gradients_flow_through_the_reduction_with_every_backend(extension, generator, backend):
    """Stock's ReduceAddCoalesced is an autograd Function whose backward is a broadcast
    (torch/nn/parallel/_functions.py), so gradients of gradients flow through data parallelism."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()
    x = torch.randn(9, 5, generator=generator, dtype=torch.float64)
    dp = minidp.DataParallel(model, cpu_ids(3), reduce_backend=backend)
    parallel = _gradient_penalty_grads(model, dp, x)
    single = _gradient_penalty_grads(model, model, x)
    for a, b in zip(parallel, single):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


def test_auto_hands_what_the_extension_does_not_take_to_the_torch_backend(extension, generator):
    """A complex parameter next to real ones: "auto" sums it with torch, the rest with the extension."""
    real = torch.randn(4, 3, generator=generator)
    complex_grad = torch.randn(4, 3, generator=generator, dtype=torch.complex64)
    assert comm.reduce_backends([real, complex_grad], "auto") == ["ext", "torch"]
    inputs = [[real * (k + 1), complex_grad * (k + 1)] for k in range(3)]
    sums = comm.reduce_add_coalesced(inputs, "cpu", backend="auto")
    assert torch.equal(sums[0], comm.reduce_add_coalesced(inputs, "cpu", backend="torch")[0])
    assert torch.equal(sums[1], inputs[0][1] + inputs[1][1] + inputs[2][1])


def _batched_parameter_gradients(model, wrapped, x, cotangents):
    return torch.autograd.grad(wrapped(x), list(model.parameters()), cotangents, is_grads_batched=True)


def test_batched_gradients_go_to_the_torch_backend_under_auto_and_ext_refuses_them(extension, generator):
    """``autograd.grad(..., is_grads_batched=True)`` runs the backward under vmap: the reduction's inputs are batched
    tensors, with no storage the extension could read. Stock cannot batch its reduction at all (its coalesced reduce
    has no batching rule); "auto" sums them with torch, as the single device's gradients, and "ext" says why not."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    x = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    cotangents = torch.randn(3, 4, 2, generator=generator, dtype=torch.float64)  # three backward passes at once
    expected = _batched_parameter_gradients(model, model, x, cotangents)
    got = _batched_parameter_gradients(model, minidp.DataParallel(model, cpu_ids(2), reduce_backend="auto"), x, cotangents)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match=r"cannot sum tensor 0 .*is_grads_batched=True"):
        _batched_parameter_gradients(model, minidp.DataParallel(model, cpu_ids(2), reduce_backend="ext"), x, cotangents)


def test_ext_refuses_a_tensor_it_cannot_sum_and_names_it(extension):
    with pytest.raises(TypeError, match=r"cannot sum tensor 1 \(torch.complex64.*reduce_backend='auto'"):
        comm.reduce_add_coalesced([[torch.ones(2), torch.ones(2, dtype=torch.complex64)]] * 2, "cpu", backend="ext")


def test_dataparallel_trains_a_complex_model_with_auto_once_the_extension_is_loaded(extension, generator):
    model = torch.nn.Linear(3, 2, dtype=torch.complex128)
    x = torch.randn(6, 3, generator=generator, dtype=torch.complex128)
    minidp.DataParallel(model, cpu_ids(2), reduce_backend="auto")(x).abs().sum().backward()
    parallel = model.weight.grad.clone()
    model.zero_grad()
    model(x).abs().sum().backward()
    assert (parallel - model.weight.grad).abs().max() <= 1e-10 * model.weight.grad.abs().max()


class _EmbedsSomeChunks(torch.nn.Module):
    """A sparse-gradient embedding that a chunk uses only where its first value is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4, sparse=True, dtype=torch.float64)
        self.linear = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, indices, x):
        return self.linear(self.embedding(indices).sum(1) if x[0, 0] > 0 else x)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("first_uses_it", [True, False], ids=["sparse-then-dense", "dense-then-sparse"])
def test_a_sparse_gradient_beside_a_replicas_dense_zeros_is_summed_dense_as_stock_sums_it(extension, generator, backend, first_uses_it):
    # A replica that did not use the embedding hands autograd's dense zeros for it; stock's reduce_add_coalesced makes
    # the position dense (docs/stock-behaviour.md B31). minidp's torch backend added dense to sparse (RuntimeError),
    # "auto" gave the extension a sparse tensor (ValueError).
    from .stock_emulation import emulated_stock

    indices, x = torch.randint(0, 10, (6, 5), generator=generator), torch.randn(6, 4, generator=generator, dtype=torch.float64)
    x[:, 0] = torch.tensor([1.0, 1, -1, -1, 1, 1]) * (1 if first_uses_it else -1) * x[:, 0].abs()
    model = _EmbedsSomeChunks()
    twin = copy.deepcopy(model)
    minidp.DataParallel(model, cpu_ids(3), reduce_backend=backend)(indices, x).sum().backward()
    with emulated_stock(3):
        torch.nn.DataParallel(twin, [0, 1, 2])(indices, x).sum().backward()
    for mine, stock in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine.grad.to_dense(), stock.grad.to_dense()) and mine.grad.layout == stock.grad.layout
