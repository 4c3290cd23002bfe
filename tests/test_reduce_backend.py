"""Choosing the gradient reduction: minidp.comm's backends, and DataParallel(reduce_backend=...).

Stock reduces with ``comm.reduce_add_coalesced`` inside ``ReduceAddCoalesced`` (docs/stock-behaviour.md B31);
minidp lets the user pick the arithmetic's engine, and every engine must give the same bits.
"""

from __future__ import annotations

import copy

import pytest
import torch

import minidp
from conftest import cpu_ids
from minidp import comm, ext
from minidp.zoo import MLP


@pytest.fixture(scope="module")
def extension():
    try:
        return ext.load()
    except RuntimeError as exc:
        pytest.skip(f"the minidp extension cannot be built here: {exc}")


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
    assert comm.resolve_reduce_backend("auto") == "ext"
    assert comm.resolve_reduce_backend("torch") == "torch"


def test_set_reduce_backend_changes_the_default(default_backend):
    minidp.set_reduce_backend("torch")
    assert comm.resolve_reduce_backend() == "torch"


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
