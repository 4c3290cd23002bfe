"""Differential tests: minidp computes what stock ``torch.nn.parallel`` computes.

Three references, every zoo model, float64, fresh random inputs, outputs + every parameter's
gradient + every buffer, relative error <= ``RTOL_FLOAT64``:

* the single-device chunk-by-chunk reference (``minidp.reference.chunked_reference``): what stock computes on
  n GPUs (docs/stock-behaviour.md B7, B19-B21: per-chunk BatchNorm statistics, running stats from chunk 0);
* stock itself, its Python code run on the CPU under ``stock_emulation.emulated_stock``;
* stock unpatched where it runs on a CPU build: ``nn.DataParallel`` without a GPU calls the module
  directly (docs/stock-behaviour.md B1), and so must minidp's ``DataParallel`` without device ids.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import minidp
from .helpers import HAS_CUDA, cpu_ids, requires_cuda
from minidp import zoo
from .reference import (
    SPLITS,
    Case,
    assert_same_results,
    forward_backward,
    make_case,
    minidp_forward_backward,
    reference_call,
    stock_forward_backward,
    wrapped_call,
)
from .stock_emulation import emulated_stock, stock_comm


@pytest.mark.parametrize("replicas,rows", SPLITS)
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_matches_chunk_by_chunk_reference(name, replicas, rows, generator):
    case = make_case(name, rows, generator)
    expected = forward_backward(case, reference_call(replicas, case.dim))
    actual = minidp_forward_backward(case, cpu_ids(replicas))
    assert_same_results(actual, expected)


@pytest.mark.parametrize("replicas,rows", SPLITS)
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_matches_stock_emulated(name, replicas, rows, generator):
    """Stock's own scatter/replicate/parallel_apply/gather/reduce code, run on CPU "GPUs" 0..n-1.

    Non-tensor outputs are left out: there minidp differs from stock on purpose (a string gathers
    to a list, not to stock's ``"<map object ...>"``; see test_gather).
    """
    case = make_case(name, rows, generator)
    expected = stock_forward_backward(case, list(range(replicas)))
    actual = minidp_forward_backward(case, cpu_ids(replicas))
    assert_same_results(actual, expected, compare_non_tensors=False)


def test_with_one_intra_op_thread_cpu_replicas_equal_stock_bit_for_bit(generator, one_intra_op_thread):
    """README (parallel_apply's row): a CPU replica's forward runs on its share of the caller's intra-op threads, where
    stock's workers keep the whole count, so kernels that split a sum by thread (BatchNorm on a channels_last input, a
    long reduction) round otherwise; with one thread there is nothing to share, and the results are stock's, bitwise."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(36, 500)).double()
    x = torch.randn(6, 3, 5, 5, generator=generator, dtype=torch.float64).to(memory_format=torch.channels_last)
    case = Case("channels_last_bn", model, (x,), {}, 0, lambda output: output.square().mean())
    assert_same_results(minidp_forward_backward(case, cpu_ids(2)), stock_forward_backward(case, [0, 1]), exact=True)


def test_several_forwards_before_one_backward_add_their_gradients_newest_first_as_one_device(generator,
                                                                                           one_intra_op_thread):
    """README (parallel_apply's row): micro-batches added into one loss. Autograd runs the newest nodes first, by a
    number each thread counts; one device, and minidp's replicas (replica 0 in the caller's thread, the others in
    threads that keep counting), add the calls' gradients newest first. (Stock's fresh threads start counting at zero
    each: its order is another, in float32 a few bits off.)"""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    batches = [torch.randn(4, 8, generator=generator) * 3.0**k for k in range(3)]  # sums that round by their order

    def weight_gradient(calls: list[int]) -> torch.Tensor:
        trained = copy.deepcopy(model)
        wrapper = minidp.DataParallel(trained, cpu_ids(2))
        sum(wrapper(batches[k]).sum() for k in calls).backward()
        return trained[0].weight.grad

    each = [weight_gradient([k]) for k in range(3)]
    newest_first, oldest_first = each[2] + each[1] + each[0], each[0] + each[1] + each[2]
    assert not torch.equal(newest_first, oldest_first)  # else this draw could not tell the orders apart
    assert torch.equal(weight_gradient([0, 1, 2]), newest_first)


def test_a_wgan_gp_critic_step_with_the_serial_backward_equals_stock_bit_for_bit(generator):
    """README (the parallel backward): a loss adding the output to a penalty on its input gradient, made with
    ``create_graph=True``, gets stock's gradients bit for bit with ``set_parallel_backward(False)`` (the parallel
    backward adds the two parts apart: to rounding, ``tests/test_parallel_backward.py -k create_graph_equals``)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = torch.randn(12, 4, generator=generator, dtype=torch.float64)
    previous = minidp.set_parallel_backward(False)
    try:
        results = []
        for wrapper, context in ((lambda m: minidp.DataParallel(m, cpu_ids(2)), contextlib.nullcontext),
                                 (lambda m: nn.DataParallel(m, [0, 1]), emulated_stock)):
            model.zero_grad(set_to_none=True)
            inputs = x.clone().requires_grad_()
            with context():
                output = wrapper(model)(inputs)
                (slope,) = torch.autograd.grad(output.sum(), inputs, create_graph=True)
                (output.mean() + 10 * (slope.norm(2, dim=1) - 1).square().mean()).backward()
            results.append([output, slope, inputs.grad] + [p.grad for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    finally:
        minidp.set_parallel_backward(previous)


def test_matches_stock_emulated_with_repeated_ids(generator):
    """docs/stock-behaviour.md B3: stock accepts repeated ids; minidp's ``['cpu'] * 3`` matches its ``[0, 0, 0]``."""
    case = make_case("mlp", 10, generator)
    expected = stock_forward_backward(case, [0, 0, 0])
    actual = minidp_forward_backward(case, cpu_ids(3))
    assert_same_results(actual, expected)


@pytest.mark.parametrize("cache_replicas", [False, True])
def test_a_scripted_sub_module_matches_stock_emulated(cache_replicas, generator):
    """docs/stock-behaviour.md B22: stock replicates a ScriptModule (its replicas through the C++ module); minidp's
    replicas of it, built anew or from the replica cache, give stock's outputs and gradients, bit for bit."""
    model = nn.Sequential(torch.jit.script(nn.Linear(5, 6)), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(7, 5, dtype=torch.float64, generator=generator)

    def output_and_gradients(wrapper: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        output = wrapper(x)
        output.pow(2).sum().backward()
        return [output] + [p.grad for p in model.parameters()]

    ours = output_and_gradients(minidp.DataParallel(model, cpu_ids(2), cache_replicas=cache_replicas))
    with emulated_stock():
        stock = output_and_gradients(nn.DataParallel(model, [0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(ours, stock, strict=True))


def test_stock_data_parallel_functional_matches(generator):
    """Stock ``data_parallel`` (B11) under emulation equals ``minidp.data_parallel`` with kwargs."""
    case = make_case("kwargs_dict", 10, generator)

    def stock(model, args, kwargs):
        return nn.parallel.data_parallel(model, args, [0, 1, 2], module_kwargs=kwargs)

    def ours(model, args, kwargs):
        return minidp.data_parallel(model, args, cpu_ids(3), module_kwargs=kwargs)

    with emulated_stock():
        expected = forward_backward(case, stock)
    assert_same_results(forward_backward(case, ours), expected, compare_non_tensors=False)


@pytest.mark.skipif(HAS_CUDA, reason="stock calls the module directly only on a machine without a GPU")
@pytest.mark.parametrize("name", [n for n in zoo.ZOO if n != "vgg_split"])
def test_without_device_ids_matches_unpatched_stock_direct_call(name, generator):
    """docs/stock-behaviour.md B1: without a GPU, ``nn.DataParallel(m)(x)`` is ``m(x)``; so is minidp's."""
    case = make_case(name, 7, generator)

    expected = forward_backward(case, wrapped_call(case, nn.DataParallel, None))
    actual = minidp_forward_backward(case, None)
    assert_same_results(actual, expected)
    for key, tensor in expected.grads.items():
        assert torch.equal(actual.grads[key], tensor), "a direct call must agree bit for bit"


def test_emulation_is_undone_on_exit():
    """Patches last only for the block, even when it raises."""
    original_reduce_add = stock_comm.reduce_add
    original_scatter = getattr(torch._C, "_scatter", None)  # a CUDA build of torch has it, with or without a GPU
    with pytest.raises(KeyError), emulated_stock():
        assert torch.accelerator.is_available() and torch._C._scatter is not original_scatter
        raise KeyError
    assert stock_comm.reduce_add is original_reduce_add
    assert getattr(torch._C, "_scatter", None) is original_scatter
    assert torch.accelerator.is_available() == HAS_CUDA


# --------------------------------------------------------------------------------------------------
# on a GPU: repeated ids on one GPU, distinct GPUs, and real stock
# --------------------------------------------------------------------------------------------------

CUDA_ID_LISTS = [[0, 0]] + ([[0, 1]] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("against", ["reference", "stock"])
@pytest.mark.parametrize("device_ids", CUDA_ID_LISTS, ids=str)
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_matches_the_reference_and_real_stock_on_cuda(name, device_ids, against, generator):
    """On GPU ids: the chunk-by-chunk reference, and stock ``nn.DataParallel`` itself (inside the VGG
    model: stock ``data_parallel``). Non-tensor outputs differ from stock on purpose (see test_gather)."""
    case = make_case(name, 10, generator, device="cuda:0")
    if against == "reference":
        expected = forward_backward(case, reference_call(len(device_ids), case.dim))
    else:
        expected = stock_forward_backward(case, device_ids, emulate=False)
    actual = minidp_forward_backward(case, device_ids)
    if against == "stock":  # the one difference, pinned by the test below
        for shared in buffers_stock_shares_between_replicas(case.fresh_model(), device_ids):
            del actual.buffers[shared], expected.buffers[shared]
    assert_same_results(actual, expected, compare_non_tensors=against == "reference")


def buffers_stock_shares_between_replicas(model: nn.Module, device_ids: list) -> set[str]:
    """The buffers that every replica of stock's ``replicate(model, device_ids)`` holds as the original tensor."""
    originals = {name: buffer.data_ptr() for name, buffer in model.named_buffers()}
    replicas = nn.parallel.replicate(model, device_ids)
    return {name for name, buffer in replicas[-1].named_buffers() if buffer.data_ptr() == originals[name]}


@pytest.mark.cuda
@requires_cuda
def test_on_a_repeated_gpu_id_stock_shares_a_buffer_alone_in_its_dtype_and_minidp_does_not(generator):
    """docs/stock-behaviour.md B21: on ids ``[0, 0]`` stock's replica 1 holds the original of a buffer that is the
    only one of its dtype (the checkpointed block's ``num_batches_tracked``), so both replicas count their batches
    on it; minidp gives every replica but the first a copy of its own, as it does on distinct GPUs."""
    case = make_case("checkpoint", 10, generator, device="cuda:0")
    assert buffers_stock_shares_between_replicas(case.fresh_model(), [0, 0]) == {"block.0.num_batches_tracked"}
    model = case.fresh_model()
    copies = minidp.replicate(model, ["cuda:0", "cuda:0"])
    assert copies[1].block[0].num_batches_tracked.data_ptr() != model.block[0].num_batches_tracked.data_ptr()
    stock = stock_forward_backward(case, [0, 0], emulate=False).buffers["block.0.num_batches_tracked"]
    ours = minidp_forward_backward(case, [0, 0]).buffers["block.0.num_batches_tracked"]
    assert (stock.item(), ours.item()) == (4, 2)  # a forward and its recomputation, by each replica or by the first


@pytest.mark.parametrize("calls", [2, 3])
def test_a_wrapper_run_several_times_in_one_graph_gives_stocks_gradients(generator, calls):
    """An output fed back in as the next call's input (an unrolled recurrence): each call's reduction adds its sums
    into the parameters' ``.grad`` through autograd, which adds what meets at one node in the order it runs their
    producers, set by the sequence numbers of the threads that made them. Stock starts new threads at every call;
    minidp's persist, so three sums or more can meet in another order: float32 gradients then agree to rounding. Two
    agree bit for bit (a sum of two is the same either way); so does everything in the serial path's own runs."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))
    x = torch.randn(10, 6, generator=generator)

    def gradients(wrapper: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        h = x
        for _ in range(calls):
            h = wrapper(h)
        h.square().sum().backward()
        return [p.grad for p in model.parameters()]

    previous = minidp.set_parallel_backward(False)
    try:
        ours = gradients(minidp.DataParallel(model, cpu_ids(2)))
    finally:
        minidp.set_parallel_backward(previous)
    with emulated_stock():
        stock = gradients(nn.DataParallel(model, [0, 1]))
    if calls == 2:
        assert all(torch.equal(a, b) for a, b in zip(ours, stock, strict=True))
    else:
        torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)
