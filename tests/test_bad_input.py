"""Bad input: a clear error that names the argument and the fix, raised before anything changes.

Each test gives the model gradients and BatchNorm statistics first, and checks after the error that
parameters, gradients and buffers are exactly as they were: no replica ran, nothing was reduced.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minidp
from .helpers import cpu_ids, requires_cuda


def trained_bn_model(generator: torch.Generator) -> nn.Module:
    """A model with non-trivial gradients and running statistics to watch."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model(torch.randn(8, 4, generator=generator)).sum().backward()
    return model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    state.update({f"buffer {n}": b.clone() for n, b in model.named_buffers() if b.device.type != "meta"})
    return state


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), f"{key} changed although the call failed"


@pytest.fixture
def model(generator) -> nn.Module:
    return trained_bn_model(generator)


def test_a_buffer_off_device_ids_0_says_how_to_move_the_model(model, generator):
    """docs/stock-behaviour.md B6: checked on every forward; minidp's message names the tensor and the fix."""
    model[1].register_buffer("scale", torch.ones(6, device="meta"))
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"'1\.scale' is on meta.*model\.to\('cpu'\)"):
        minidp.DataParallel(model, cpu_ids(2))(torch.randn(6, 4, generator=generator))
    assert_untouched(model, before)
    with pytest.raises(RuntimeError, match=r"device_ids\[0\]"):
        minidp.data_parallel(model, torch.randn(6, 4, generator=generator), cpu_ids(2))
    with pytest.raises(RuntimeError, match=r"model\.to\('cpu'\)"):
        minidp.replicate(model, cpu_ids(2))
    assert_untouched(model, before)


def test_data_parallel_on_one_device_checks_the_module_and_does_not_move_it(generator):
    """B6/B11: stock ``data_parallel`` raises when the module is not on ``device_ids[0]``; minidp
    too, even for one id (where ``DataParallel``'s constructor would move the module, B4)."""
    elsewhere = nn.Linear(4, 2, device="meta")
    with pytest.raises(RuntimeError, match=r"'weight' is on meta.*model\.to\('cpu'\)"):
        minidp.data_parallel(elsewhere, torch.randn(6, 4, generator=generator), cpu_ids(1))
    assert elsewhere.weight.device.type == "meta"


@pytest.mark.cuda
@requires_cuda
def test_a_model_left_on_the_cpu_for_gpu_replicas_says_how_to_move_it(model, generator):
    """B6: stock's message names only the devices; minidp's the tensor and ``model.to('cuda:0')``."""
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"'0\.weight' is on cpu.*model\.to\('cuda:0'\)"):
        minidp.DataParallel(model, [0, 0])(torch.randn(6, 4, generator=generator))
    assert_untouched(model, before)


def test_a_lazy_module_must_run_once_before_replication(generator):
    with pytest.raises(RuntimeError, match="not initialized yet.*run one forward pass"):
        minidp.DataParallel(nn.LazyLinear(3), cpu_ids(2))(torch.randn(4, 4, generator=generator))


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda m, x: minidp.parallel_apply([m, m], [(x,)]), "inputs"),
        (lambda m, x: minidp.parallel_apply([m, m], [(x,)] * 2, [{}]), "kwargs_tup"),
        (lambda m, x: minidp.parallel_apply([m, m], [(x,)] * 2, None, cpu_ids(3)), "devices"),
    ],
)
def test_parallel_apply_lengths_must_match(model, call, argument, generator):
    """B23: stock asserts; minidp raises a ValueError naming the argument, before any replica runs."""
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"2 modules but \d {argument}; give one entry per module"):
        call(model, torch.randn(4, 4, generator=generator))
    assert_untouched(model, before)


def test_no_modules_is_an_error():
    with pytest.raises(ValueError, match="'modules' is empty"):
        minidp.parallel_apply([], [])


@pytest.mark.parametrize("dim", [2, -3])
def test_dim_out_of_range_names_the_input(model, dim, generator):
    """B15: stock raises an IndexError too; minidp says which input and its shape."""
    before = snapshot(model)
    with pytest.raises(IndexError, match=rf"dim={dim} is out of range for inputs\[0\].*\(6, 4\)"):
        minidp.DataParallel(model, cpu_ids(2), dim=dim)(torch.randn(6, 4, generator=generator))
    assert_untouched(model, before)


def test_an_empty_batch_is_an_error(model):
    """Stock scatters 0 rows into n empty chunks (B15) and runs every replica on nothing."""
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"inputs\[0\] is an empty batch"):
        minidp.DataParallel(model, cpu_ids(2))(torch.randn(0, 4))
    assert_untouched(model, before)


def test_a_0_dim_input_has_no_batch_to_split():
    """B15: stock fails inside torch.chunk; minidp names the input."""
    with pytest.raises(ValueError, match="0-dim tensor and has no dim 0"):
        minidp.scatter(torch.tensor(1.0), cpu_ids(2))


@pytest.mark.parametrize(
    "chunk_sizes,message",
    [([3, 3], "add up to 6, but the batch has 10 rows"), ([3, 3, 4], "3 entries but there are 2 devices"), ([10, 0], "positive ints")],
)
def test_chunk_sizes_must_split_the_batch_exactly(chunk_sizes, message, generator):
    x = torch.randn(10, 2, generator=generator)
    with pytest.raises(ValueError, match=message):
        minidp.scatter(x, cpu_ids(2), chunk_sizes=chunk_sizes)
    with pytest.raises(ValueError, match=message):
        minidp.scatter_kwargs((x,), {}, cpu_ids(2), chunk_sizes=chunk_sizes)


def test_tensors_that_cut_into_different_numbers_of_chunks_are_an_error(model, generator):
    """B14: stock zips to the smallest number of chunks and silently drops rows (here: one chunk of the
    mask, so one replica, and 3 of the 6 rows never run); minidp names both tensors and their counts."""
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"inputs\[1\]\['mask'\] has 1 rows along dim 0, which cut by torch.chunk into "
                                         r"1 chunk\(s\) \[1\] for 2 devices, but inputs\[0\] has 6 rows, which cut into 2"):
        minidp.DataParallel(model, cpu_ids(2))(torch.randn(6, 4, generator=generator), {"mask": torch.ones(1, 4)})
    assert_untouched(model, before)


def test_empty_device_ids_are_an_error(model):
    """Stock fails with an IndexError on ``device_ids[0]`` (B2)."""
    with pytest.raises(ValueError, match="device_ids is empty"):
        minidp.DataParallel(model, [])


# --------------------------------------------------------------------------------------------------
# outputs whose structure differs between replicas (stock: KeyError, silent truncation, or zip error)
# --------------------------------------------------------------------------------------------------


class DependsOnChunk(nn.Module):
    """Returns a differently shaped output on the last, smaller chunk of an uneven batch."""

    def __init__(self, odd_output) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.odd_output = odd_output

    def forward(self, x: torch.Tensor):
        y = self.linear(x)
        return self.odd_output(y) if x.shape[0] == 1 else {"y": y, "parts": [y, y]}


@pytest.mark.parametrize(
    "odd_output,message",
    [
        (lambda y: {"z": y, "parts": [y, y]}, r"output: the dict of replica 2 differs from replica 0's: missing keys \['y'\], extra keys \['z'\]"),
        (lambda y: {"y": y, "parts": [y]}, r"output\['parts'\] has 2 elements in replica 0 but 1 in replica 2"),
        (lambda y: {"y": None, "parts": [y, y]}, r"output\['y'\] is a tensor in replica 0 but a NoneType in replica 2"),
        (lambda y: {"y": y, "parts": (y, y)}, r"output\['parts'\] is a list in replica 0 but a tuple in replica 2"),
        (lambda y: {"y": y, "parts": [y, y[:, :1]]}, r"output\['parts'\]\[1\]: .*tensor 2 has shape \(1, 1\)"),
    ],
)
def test_outputs_must_have_the_same_structure_in_every_replica(odd_output, message, generator):
    model = DependsOnChunk(odd_output)
    model.linear(torch.randn(1, 4)).sum().backward()
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        minidp.DataParallel(model, cpu_ids(3))(torch.randn(5, 4, generator=generator))  # chunks 2, 2, 1
    assert_untouched(model, before)
