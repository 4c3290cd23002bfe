"""Bad input: a clear error that names the argument and the fix, raised before anything changes.

Each test gives the model gradients and BatchNorm statistics first, and checks after the error that
parameters, gradients and buffers are exactly as they were: no replica ran, nothing was reduced.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import re
import threading
import types

import pytest
import torch
from torch import nn

import minidp
from minidp import comm
from .helpers import cpu_ids, requires_cuda
from .stock_emulation import emulated_stock


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
    """B22: a lazy module refuses to be replicated (``_replicate_for_data_parallel``, which stock's
    replicate calls for each module) with a sentence that code may match; minidp's message starts with
    that sentence, word for word, then names the parameter and the fix."""
    with pytest.raises(RuntimeError) as stock:
        nn.LazyLinear(3)._replicate_for_data_parallel()
    stock_sentence = str(stock.value).split(". ")[0] + "."
    assert stock_sentence == "Modules with uninitialized parameters can't be used with `DataParallel`."
    with pytest.raises(RuntimeError, match="not initialized yet.*run one forward pass") as ours:
        minidp.DataParallel(nn.LazyLinear(3), cpu_ids(2))(torch.randn(4, 4, generator=generator))
    assert str(ours.value).startswith(stock_sentence + " 'weight' is not initialized yet")


def test_a_lazy_module_on_one_device_initialises_itself_as_in_stock(generator):
    """B9: with one device stock calls the module itself, and a lazy module's first forward initialises it;
    nothing is replicated, so minidp runs it too."""
    x = torch.randn(4, 5, generator=generator)
    for wrapper, ids, emulation in ((nn.DataParallel, [0], emulated_stock()), (minidp.DataParallel, cpu_ids(1), contextlib.nullcontext())):
        lazy = nn.LazyLinear(3)
        with emulation:
            assert wrapper(lazy, ids)(x).shape == (4, 3)
        assert lazy.weight.shape == (3, 5)


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


def test_empty_device_ids_with_a_gpu_are_an_error(model, monkeypatch):
    """With a GPU, stock fails with an IndexError on ``device_ids[0]`` (B2); without one it calls the module (B1,
    tests/test_data_parallel.py). A GPU is made visible to minidp's checks; nothing runs."""
    for module in (minidp.device_ids, importlib.import_module("minidp.wrapper")):
        monkeypatch.setattr(module, "visible_gpus", lambda: 2)
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


class BatchNormThenOddOutput(nn.Module):
    """BatchNorm, then an output with one key more in every replica whose chunk has fewer than 3 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.bn(x)
        return {"y": y} if x.shape[0] >= 3 else {"y": y, "extra": y}


def test_outputs_gather_refuses_leave_the_running_statistics_as_they_were(generator):
    """Stock gathers a dict by replica 0's keys, so it drops the extra key and keeps the step (B28); minidp refuses
    the outputs, and a step refused changes nothing: replica 0's BatchNorm update is put back, as when a replica
    raises (test below)."""
    model = BatchNormThenOddOutput()
    before = snapshot(model)
    with pytest.raises(ValueError, match="extra keys"):
        minidp.DataParallel(model, cpu_ids(2))(torch.randn(5, 4, generator=generator))  # chunks 3, 2
    assert_untouched(model, before)
    with pytest.raises(ValueError, match="extra keys"):
        minidp.data_parallel(model, torch.randn(5, 4, generator=generator), cpu_ids(2))
    assert_untouched(model, before)


# --------------------------------------------------------------------------------------------------
# a step that fails part way
# --------------------------------------------------------------------------------------------------


class FailsOnShortChunks(nn.Module):
    """BatchNorm, then an error in every replica whose chunk has fewer than 4 rows (the last of 11 on 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        if x.shape[0] < 4:
            raise ValueError("a planted fault in the replica with the short chunk")
        return y


def test_a_step_that_fails_in_one_replica_leaves_the_running_statistics_as_they_were(generator):
    """Stock keeps replica 0's BatchNorm update when replica 2 fails (replica 0 shares the original's
    buffers, docs/stock-behaviour.md B21, and B26: the error is re-raised after every thread ended).
    minidp puts them back: a failed step changes nothing."""
    model = FailsOnShortChunks()
    model.bn.running_mean.normal_(generator=generator)
    before = snapshot(model)
    with pytest.raises(ValueError, match="replica 2"):
        minidp.DataParallel(model, cpu_ids(3))(torch.randn(11, 4, generator=generator))
    assert_untouched(model, before)
    with pytest.raises(ValueError, match="replica 2"):
        minidp.data_parallel(model, torch.randn(11, 4, generator=generator), cpu_ids(3))
    assert_untouched(model, before)


@pytest.mark.parametrize("cache_replicas", [True, False], ids=["cached", "built-anew"])
def test_a_failed_step_puts_back_the_buffers_of_replicas_cached_or_built_anew(cache_replicas, generator):
    """The buffers to put back come from the replica cache where it bound the replicas, from the tree elsewhere:
    both give back what the step before left, the third step failing after two that ran."""
    model = FailsOnShortChunks()
    wrapper = minidp.DataParallel(model, cpu_ids(3), cache_replicas=cache_replicas)
    for _ in range(2):
        wrapper(torch.randn(12, 4, generator=generator)).sum().backward()
    assert_a_failed_step_changes_nothing(wrapper, model, generator)


def test_a_failed_step_puts_back_a_buffer_replaced_since_the_replicas_were_cached(generator):
    """A buffer replaced between steps (``.to()`` does so) rebuilds the cached replicas, and the snapshot is of the new one."""
    model = FailsOnShortChunks()
    wrapper = minidp.DataParallel(model, cpu_ids(3))
    wrapper(torch.randn(12, 4, generator=generator)).sum().backward()
    model.bn.running_mean = torch.randn(4, generator=generator)
    assert_a_failed_step_changes_nothing(wrapper, model, generator)


def assert_a_failed_step_changes_nothing(wrapper: nn.Module, model: FailsOnShortChunks, generator: torch.Generator) -> None:
    """A batch of 11 on 3 replicas fails in replica 2, after replica 0 updated the statistics it shares with ``model``."""
    before = snapshot(model)
    with pytest.raises(ValueError, match="replica 2"):
        wrapper(torch.randn(11, 4, generator=generator))
    assert_untouched(model, before)


class CountsInABufferThatRequiresGrad(nn.Module):
    """Adds 1 to a buffer that requires grad (a leaf, or a clone of its weight: an average of the weights kept wrongly)
    after its last use in forward, under no_grad; fails in a replica whose chunk has fewer than 4 rows."""

    def __init__(self, leaf: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3).double()
        self.register_buffer("count", torch.zeros(3, dtype=torch.float64, requires_grad=True) if leaf
                             else self.lin.weight.sum(1).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) + self.count
        with torch.no_grad():
            self.count.add_(1)
        if x.shape[0] < 4:
            raise ValueError("a planted fault in the replica with the short chunk")
        return y


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_a_failed_step_puts_back_a_buffer_that_requires_grad(grad_mode, generator):
    """As every buffer (the tests above): replica 0 holds it as the original (under no_grad, docs/stock-behaviour.md
    B21) or an alias of it (in grad mode, where every CPU replica does), so the failed step's changes are undone."""
    model = CountsInABufferThatRequiresGrad()
    before = snapshot(model)
    with torch.set_grad_enabled(grad_mode), pytest.raises(ValueError, match="replica 2"):
        minidp.DataParallel(model, cpu_ids(3))(torch.randn(11, 4, generator=generator, dtype=torch.float64))
    assert_untouched(model, before)


def test_stock_keeps_half_of_a_failed_step(generator):
    """The behaviour the test above improves on, measured on stock under the emulation of its CUDA calls."""
    from .stock_emulation import emulated_stock

    model = FailsOnShortChunks()
    before = model.bn.num_batches_tracked.clone()
    with emulated_stock(), pytest.raises(ValueError):
        torch.nn.DataParallel(model, [0, 1, 2])(torch.randn(11, 4, generator=generator))
    assert not torch.equal(model.bn.num_batches_tracked, before)


def test_the_step_after_a_failed_one_computes_what_one_device_computes(generator):
    model = FailsOnShortChunks().double()
    wrapper = minidp.DataParallel(model, cpu_ids(3))
    with pytest.raises(ValueError):
        wrapper(torch.randn(11, 4, generator=generator, dtype=torch.float64))
    twin = copy.deepcopy(model)
    x = torch.randn(12, 4, generator=generator, dtype=torch.float64)
    assert torch.allclose(wrapper(x), minidp.reference.chunked_reference(twin, (x,), replicas=3), rtol=1e-12, atol=0)
    assert torch.allclose(model.bn.running_mean, twin.bn.running_mean, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------------
# what is checked when DataParallel is built
# --------------------------------------------------------------------------------------------------


def test_an_unknown_reduce_backend_is_refused_when_dataparallel_is_built(model):
    with pytest.raises(ValueError, match=r"reduce_backend must be one of \('auto', 'torch', 'ext'\), got 'bogus'"):
        minidp.DataParallel(model, cpu_ids(2), reduce_backend="bogus")


def test_ext_where_the_extension_is_disabled_is_refused_when_dataparallel_is_built(model, monkeypatch, generator):
    """Refused before the forward, which would already have updated the BatchNorm statistics."""
    monkeypatch.setenv("MINIDP_EXT", "0")
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"reduce_backend='ext' needs the minidp extension.*MINIDP_EXT=0"):
        minidp.DataParallel(model, cpu_ids(2), reduce_backend="ext")(torch.randn(6, 4, generator=generator))
    with pytest.raises(RuntimeError, match=r"backend='ext' needs the minidp extension"):
        minidp.set_reduce_backend("ext")
    assert_untouched(model, before)


# --------------------------------------------------------------------------------------------------
# arguments checked where they enter: devices, dim, the module, the inputs
# --------------------------------------------------------------------------------------------------


BAD_DEVICE_CALLS = [
    (lambda m, x, d: minidp.scatter(x, [d, "cpu"]), "target_devices[0]"),
    (lambda m, x, d: minidp.scatter_kwargs((x,), {}, ["cpu", d]), "target_devices[1]"),
    (lambda m, x, d: minidp.replicate(m, ["cpu", d]), "devices[1]"),
    (lambda m, x, d: minidp.parallel_apply([m, m], [(x,), (x,)], None, ["cpu", d]), "devices[1]"),
    (lambda m, x, d: minidp.gather([x, x], d), "target_device"),
    (lambda m, x, d: comm.broadcast(x, ["cpu", d]), "devices[1]"),
    (lambda m, x, d: comm.broadcast_coalesced([x], [d]), "devices[0]"),
    (lambda m, x, d: comm.copy_coalesced([x], d), "device"),
    (lambda m, x, d: comm.scatter(x, ["cpu", d]), "devices[1]"),
    (lambda m, x, d: comm.gather([x, x], 0, d), "destination"),
    (lambda m, x, d: comm.reduce_add([x, x], d), "destination"),
    (lambda m, x, d: comm.reduce_add_coalesced([[x], [x]], d), "destination"),
    (lambda m, x, d: minidp.DataParallel(m, cpu_ids(2), output_device=d)(x), "output_device"),
    (lambda m, x, d: minidp.DataParallel(m, [0, 0], output_device=d)(x), "output_device"),
    (lambda m, x, d: minidp.DataParallel(m, ["cpu", d])(x), "device_ids[1]"),
    (lambda m, x, d: minidp.DataParallel(m, [d, 0])(x), "device_ids[0]"),
    (lambda m, x, d: minidp.data_parallel(m, x, cpu_ids(2), output_device=d), "output_device"),
]


@pytest.mark.filterwarnings("ignore:device_ids=.* names GPUs, but this machine has none")
@pytest.mark.parametrize("device", ["gpu", -2, "cuda:x"])
@pytest.mark.parametrize("call,argument", BAD_DEVICE_CALLS)
def test_a_misspelled_device_is_an_error_naming_the_argument_and_what_works(model, call, argument, device, generator):
    """Stock passes the spelling to torch (``RuntimeError: Expected one of cpu, cuda, ... device type``,
    ``Device index must not be negative``), which names neither the argument nor the spellings that
    work. Integer ids on a machine without a GPU (``[0, 0]``) are a direct call (B1), but ``-2`` and
    ``output_device='gpu'`` are checked there too."""
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"{re.escape(argument)}: {re.escape(repr(device) if isinstance(device, str) else str(device))} "
                                         r"is not a device: a device is an int \(a CUDA ordinal.*-1 means the CPU\), a string "
                                         r"such as 'cpu'"):
        call(model, torch.randn(6, 4, generator=generator), device)
    assert_untouched(model, before)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x: comm.scatter(x, cpu_ids(2), dim=4), r"dim=4 is out of range for tensor, which has 2 dimension\(s\) \(6, 4\): dim must be in -2\.\.1"),
        (lambda x: comm.scatter(x, cpu_ids(2), dim=-3), r"dim=-3 is out of range for tensor, which has 2 dimension\(s\)"),
        (lambda x: comm.gather([x, x], dim=4), r"gather: dim=4 is out of range for tensor 0, which has 2 dimension\(s\) \(6, 4\)"),
        (lambda x: minidp.gather([x, x], "cpu", dim=2), r"output: .*dim=2 is out of range for tensor 0"),
    ],
)
def test_a_dim_out_of_range_in_comm_names_dim_and_the_tensors_dims(call, message, generator):
    """B15: stock fails inside torch (``IndexError: Dimension out of range`` or ``tuple index out of range``);
    minidp raises the same type with dim and the tensor's dimensions in the message."""
    with pytest.raises(IndexError, match=message):
        call(torch.randn(6, 4, generator=generator))


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: minidp.DataParallel(m, cpu_ids(2), dim="0"),
        lambda m, x: minidp.DataParallel(m, [0, 1], dim=1.0),
        lambda m, x: minidp.data_parallel(m, x, cpu_ids(2), dim="0"),
        lambda m, x: minidp.scatter(x, cpu_ids(2), dim="0"),
        lambda m, x: minidp.gather([x, x], "cpu", dim=True),
        lambda m, x: comm.scatter(x, cpu_ids(2), dim="0"),
    ],
)
def test_dim_that_is_not_an_int_is_a_type_error_naming_dim_at_once(model, call, generator):
    """Stock keeps ``dim='0'`` and fails at the first forward, deep inside torch.chunk."""
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"dim must be an int \(the batch dimension, e.g. 0\), got"):
        call(model, torch.randn(6, 4, generator=generator))
    assert_untouched(model, before)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("to_sparse", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr], ids=["coo", "csr"])
def test_a_sparse_input_is_an_error_that_says_what_works(model, to_sparse, generator):
    """Stock cannot cut a sparse tensor either: its scatter fails in the dispatcher (``Could not run
    'aten::as_strided' with arguments from the 'SparseCPU' backend``, B37). minidp names the input and
    says what works instead: a dense tensor, or the tensor inside a non-tensor object (shared whole)."""
    x = to_sparse(torch.randn(6, 4, generator=generator))
    with pytest.raises((NotImplementedError, RuntimeError)):
        with emulated_stock():
            nn.parallel.scatter((x,), [0, 1])
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"inputs\[0\] is a torch\.sparse_\w+ tensor, which cannot be cut into chunks.*"
                                        r"inputs\[0\]\.to_dense\(\).*inside a non-tensor object"):
        minidp.DataParallel(model, cpu_ids(2))(x)
    assert_untouched(model, before)


class PackedLSTM(nn.Module):
    """An LSTM over a PackedSequence, its output padded again."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)

    def forward(self, packed: nn.utils.rnn.PackedSequence) -> torch.Tensor:
        return nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)[0]


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_a_packed_sequence_input_is_an_error_that_says_what_works(keyword, generator):
    """docs/stock-behaviour.md B12: a PackedSequence is a namedtuple, which stock's scatter cuts field by field, each by
    rows: with equal lengths, every replica runs some time steps of every sequence, and stock returns a wrong result,
    shaped (16, 3, 5) for (8, 6, 5), with no error. minidp names the input and says what works instead."""
    model = PackedLSTM()
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(8, 6, 4, generator=generator), torch.full((8,), 6),
                                               batch_first=True)
    with emulated_stock():
        assert nn.DataParallel(model, [0, 1])(packed).shape == (16, 3, 5)
    before = snapshot(model)
    wrapper = minidp.DataParallel(model, cpu_ids(2))
    path = r"kwargs\['packed'\]" if keyword else r"inputs\[0\]"
    with pytest.raises(TypeError, match=path + r" is a PackedSequence, which cannot be cut into chunks.*padded batch and "
                                              r"its lengths.*pack_padded_sequence"):
        wrapper(packed=packed) if keyword else wrapper(packed)
    assert_untouched(model, before)


def test_a_packed_sequence_runs_whole_on_one_device_as_stock(generator):
    """With one device nothing is cut: the module runs the PackedSequence as it is, as stock's one GPU does."""
    model = PackedLSTM()
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(8, 6, 4, generator=generator), torch.tensor([6, 5, 5, 4, 3, 2, 2, 1]),
                                               batch_first=True)
    with emulated_stock():
        expected = nn.DataParallel(model, [0])(packed)
    assert torch.equal(minidp.DataParallel(model, cpu_ids(1))(packed), expected)
    assert torch.equal(minidp.data_parallel(model, (packed,), cpu_ids(1)), expected)


class Shared:
    """A non-tensor object: scatter gives every replica the same one, tensors and all (B12)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_a_sparse_tensor_inside_a_non_tensor_object_reaches_every_replica_whole(generator):
    """What the sparse error recommends works: the object is shared, its tensor is not cut."""
    sparse = torch.randn(3, 4, generator=generator).to_sparse()

    class AddsShared(nn.Module):
        def forward(self, x, shared):
            return x + shared.tensor.to_dense().sum()

    x = torch.randn(6, 4, generator=generator)
    out = minidp.DataParallel(AddsShared(), cpu_ids(2))(x, Shared(sparse))
    assert torch.equal(out, x + sparse.to_dense().sum())


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda x: minidp.DataParallel(lambda y: y, cpu_ids(2)), "module"),
        (lambda x: minidp.DataParallel(lambda y: y, [0, 1]), "module"),
        (lambda x: minidp.data_parallel(lambda y: y, x, cpu_ids(2)), "module"),
        (lambda x: minidp.replicate("str", cpu_ids(2)), "network"),
        (lambda x: minidp.replicate("str", []), "network"),
    ],
)
def test_something_other_than_a_module_is_a_type_error_at_once(call, argument, generator):
    """Stock keeps a function as ``self.module`` and fails at the first forward (``'function' object has no
    attribute 'parameters'``), or passes it through where there is no GPU (B1)."""
    with pytest.raises(TypeError, match=rf"{argument} must be an nn\.Module, got .* of type (function|str)"):
        call(torch.randn(4, 4, generator=generator))


@pytest.mark.parametrize(
    "inputs,kwargs,message",
    [
        ("x", [], r"kwargs must be a dict of keyword arguments or None, got a list"),
        ("x", ("k",), r"kwargs must be a dict of keyword arguments or None, got a tuple"),
        ("bare", None, r"inputs must be the tuple of positional arguments, got a Tensor; pass \(x,\)"),
    ],
)
def test_scatter_kwargs_takes_a_tuple_and_a_dict(inputs, kwargs, message, generator):
    """Stock scatters a list given as ``kwargs`` into pieces that ``**`` cannot unpack, and iterates over a
    bare tensor given as ``inputs`` row by row."""
    x = torch.randn(4, 2, generator=generator)
    with pytest.raises(TypeError, match=message):
        minidp.scatter_kwargs((x,) if inputs == "x" else x, kwargs if kwargs != [] else [x], cpu_ids(2))


# --------------------------------------------------------------------------------------------------
# compiled modules: the compiled call is bound to the original module
# --------------------------------------------------------------------------------------------------


COMPILED_ADVICE = r"Give DataParallel the original module, and compile inside it: decorate the class's forward with @torch\.compile"


def test_a_torch_compiled_module_is_refused_at_construction_saying_what_works(model):
    """Stock fails inside a replica (``InternalTorchDynamoError``, B38); minidp's ``replicate`` could not
    copy the wrapper's tree (a bare ``KeyError``). Now: a ``TypeError`` when ``DataParallel`` is built."""
    compiled = torch.compile(model, backend="eager")
    before = snapshot(model)
    with pytest.raises(TypeError, match=rf"the module is a torch\.compile\(\)d module \(an OptimizedModule around Sequential\).*{COMPILED_ADVICE}"):
        minidp.DataParallel(compiled, cpu_ids(2))
    with pytest.raises(TypeError, match=COMPILED_ADVICE):
        minidp.replicate(compiled, cpu_ids(2))
    assert_untouched(model, before)


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_compiled_submodule_is_refused_before_the_step_changes_anything(model, how, generator):
    """A sub-module compiled after ``DataParallel`` was built (so the constructor could not see it): the
    forward refuses it before any replica runs, with the cache on and off. ``m.compile()`` keeps a call
    bound to the original in the module's ``__dict__``, which every replica's shallow copy would share (B38)."""
    dp = minidp.DataParallel(model, cpu_ids(2))
    dp(torch.randn(6, 4, generator=generator)).sum().backward()
    if how == "torch.compile":
        model[2] = torch.compile(model[2], backend="eager")
        expected = r"'2' is a torch\.compile\(\)d module"
    else:
        model[2].compile(backend="eager")
        expected = r"'2' \(Linear\) was compiled in place with Module\.compile\(\)"
    before = snapshot(model)
    with pytest.raises(TypeError, match=rf"{expected}.*{COMPILED_ADVICE}"):
        dp(torch.randn(6, 4, generator=generator))
    assert_untouched(model, before)


def _calling_its_bound_forward(module: nn.Module):
    forward = module.forward  # a method bound to the module, in the closure of what replaces it
    return lambda *args, **kwargs: forward(*args, **kwargs)


def _wrapping_its_bound_forward(module: nn.Module):
    @functools.wraps(module.forward)  # the bound method, as __wrapped__
    def forward(x: torch.Tensor) -> torch.Tensor:
        return 2 * type(module).forward(module, x)

    return forward


def _bound_but_closing_over_another_module(module: nn.Module, other: nn.Module):
    return types.MethodType(lambda self, x: nn.Linear.forward(self, other(x)), module)  # `other`: the original's


def _closing_over_a_list_of_modules(module: nn.Module, other: nn.Module):
    modules = [other, module]  # one level inside a value of the closure
    return types.MethodType(lambda self, x: nn.Linear.forward(modules[1], modules[0](x)), module)


def _passing_a_buffer_of_another_module(module: nn.Module, other: nn.Module):
    # the module is swapped for each replica's copy, the buffer would not be: every replica would update the original's
    return functools.partial(lambda self, mean, x: nn.Linear.forward(self, x - mean), module, other.running_mean)


@pytest.mark.parametrize("patch", [_calling_its_bound_forward, _wrapping_its_bound_forward,
                                   _bound_but_closing_over_another_module, _closing_over_a_list_of_modules,
                                   _passing_a_buffer_of_another_module],
                         ids=["closure", "wraps", "other_module", "list_of_modules", "buffer_in_a_partial"])
def test_a_forward_on_the_instance_that_holds_the_module_is_refused_before_the_step_changes_anything(model, patch, generator):
    """A forward patched on the instance, holding the original module, another module of the model (or a method bound
    to one) in its closure: every replica's shallow copy shares it, so every replica would run the original's
    parameters and buffers (B38's reason for compiled calls; on CPU replicas a BatchNorm's statistics updated from
    every chunk at once), and no replica can put its own copy in their place, as it does for the module a method is
    bound to (tests/test_replicate.py, ``bound_on_the_instance``). Set after DataParallel was built: the forward
    refuses it, cache on or off."""
    dp = minidp.DataParallel(model, cpu_ids(2))
    dp(torch.randn(6, 4, generator=generator)).sum().backward()
    model[2].forward = patch(model[2]) if patch in (_calling_its_bound_forward, _wrapping_its_bound_forward) else \
        patch(model[2], model[1])
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"'2' \(Linear\) has a forward set on the instance that holds a module, "
                                        r"parameter or buffer of the model.*types\.MethodType\(f, m\)"):
        dp(torch.randn(6, 4, generator=generator))
    assert_untouched(model, before)


def test_parametrized_replicas_inside_parametrize_cached_are_refused_naming_the_module(generator):
    """torch's parametrization cache is one dict keyed by the original module: inside ``parametrize.cached()`` every
    replica would read the tensor the first one computed (``spectral_norm`` would advance its power iteration in that
    replica only). Refused before any replica runs; outside ``cached()`` the step runs."""
    from torch.nn.utils import parametrizations, parametrize

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    parametrizations.spectral_norm(model[2])
    dp, x = minidp.DataParallel(model, cpu_ids(2)), torch.randn(6, 4, generator=generator)
    before = snapshot(model)
    with parametrize.cached(), pytest.raises(RuntimeError, match=r"'2' of replica 0 is parametrized .*outside parametrize\.cached\(\)"):
        dp(x)
    assert_untouched(model, before)
    dp(x).sum().backward()


class CompiledForward(nn.Module):
    """What the compiled-module error recommends: the class's forward compiled, so every replica runs it
    with itself as ``self`` (B38). (``backend="eager"``: the compiler's front end without a C++ toolchain.)"""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3, dtype=torch.float64)

    @torch.compile(backend="eager")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def test_a_compiled_forward_inside_the_module_runs_on_every_replica(generator):
    model = CompiledForward()
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    expected = model(x)
    expected.sum().backward()
    expected_grad = model.linear.weight.grad.clone()
    model.zero_grad()
    out = minidp.DataParallel(model, cpu_ids(2))(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(model.linear.weight.grad, expected_grad, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------------
# every public primitive checks its arguments when it is called, before anything runs
# --------------------------------------------------------------------------------------------------


def rows(x: torch.Tensor) -> torch.Tensor:
    """A tensor whose length (2) equals the number of modules: stock would run each module on one of its rows."""
    return torch.stack([x, x])


BAD_ARGUMENTS = [
    # (call, error, message): a call with one bad argument, and what it must raise at once
    (lambda m, x: minidp.replicate(m, cpu_ids(2), reduce_backend="bogus"), ValueError,
     r"reduce_backend must be one of \('auto', 'torch', 'ext'\), got 'bogus'"),
    (lambda m, x: minidp.ReplicaCache().replicate(m, cpu_ids(2), reduce_backend="bogus"), ValueError,
     r"reduce_backend must be one of \('auto', 'torch', 'ext'\), got 'bogus'"),
    (lambda m, x: minidp.ReplicaCache().replicate(lambda y: y, cpu_ids(2)), TypeError, r"network must be an nn\.Module"),
    (lambda m, x: minidp.ReplicaCache(max_entries=0), ValueError, r"max_entries must be at least 1, got 0"),
    (lambda m, x: minidp.ReplicaCache(max_entries="4"), TypeError, r"max_entries must be a positive int .*, got '4'"),
    (lambda m, x: minidp.ReplicaCache(max_entries=True), TypeError, r"max_entries must be a positive int .*, got True"),
    (lambda m, x: minidp.replicate(m, cpu_ids(2), "False"), TypeError, r"detach must be True or False, got 'False'"),
    (lambda m, x: minidp.ReplicaCache().replicate(m, cpu_ids(2), "False"), TypeError,
     r"detach must be True or False, got 'False'"),
    (lambda m, x: minidp.trace(ledger="no"), TypeError, r"ledger must be True or False, got 'no'"),
    (lambda m, x: minidp.DataParallel(m, ["cpu", "meta"]), ValueError,
     r"device_ids\[1\]: the meta device cannot run a replica beside cpu \(device_ids\[0\]\): meta tensors hold"),
    (lambda m, x: minidp.data_parallel(m, x, ["cpu", "meta"]), ValueError,
     r"device_ids\[1\]: the meta device .*meta tensors hold no data"),
    (lambda m, x: minidp.parallel_apply([m, 3], [(x,), (x,)]), TypeError,
     r"parallel_apply: modules\[1\] \(of type int\) cannot be called"),
    (lambda m, x: minidp.parallel_apply([m, m], rows(x)), TypeError,
     r"parallel_apply: inputs must be a list with one entry per module \(replica\), got Tensor"),
    (lambda m, x: minidp.parallel_apply([m, m], [(x,), (x,)], [{}, [x]]), TypeError,
     r"parallel_apply: kwargs_tup\[1\] is of type list; give a dict of keyword arguments per module"),
    (lambda m, x: minidp.gather(rows(x), "cpu"), TypeError, r"gather: outputs must be a list with one output per replica, got Tensor"),
    (lambda m, x: minidp.scatter(x, cpu_ids(2), chunk_sizes=6), TypeError, r"chunk_sizes must be a list of ints, one size per device"),
    (lambda m, x: minidp.scatter("no tensor", cpu_ids(2), chunk_sizes=[6]), ValueError,
     r"chunk_sizes has 1 entries but there are 2 devices"),
    (lambda m, x: minidp.scatter_kwargs((), {}, cpu_ids(2), dim="0"), TypeError, r"dim must be an int"),
    (lambda m, x: minidp.scatter_kwargs((), {}, []), ValueError, r"target_devices is empty"),
    (lambda m, x: minidp.scatter_kwargs((), {}, cpu_ids(2), chunk_sizes=[True, 5]), ValueError, r"chunk_sizes must be positive ints"),
    (lambda m, x: comm.scatter(x, chunk_sizes=[2, 4], out=[torch.empty(3, 4), torch.empty(3, 4)]), ValueError,
     r"scatter: give chunk_sizes or out, not both"),
    (lambda m, x: comm.gather([x, x], 0, "cpu", out=torch.empty(12, 4)), ValueError, r"gather: give destination or out, not both"),
    (lambda m, x: comm.gather([x, x], 0, out=torch.empty(12, 5)), ValueError, r"gather: out\[0\] has shape \(12, 5\), where \(12, 4\) is needed"),
    (lambda m, x: minidp.data_parallel(m, x, cpu_ids(2), module_kwargs=[x]), TypeError,
     r"module_kwargs must be a dict of keyword arguments or None, got a list"),
    (lambda m, x: minidp.data_parallel(m, x, cpu_ids(2), replica_cache=True), TypeError,
     r"replica_cache must be a ReplicaCache you keep between calls, or None; got True"),
    (lambda m, x: minidp.data_parallel(m, x, None, chunk_weights=[1, -1]), ValueError,
     r"chunk_weights\[1\] is -1: every weight must be a positive finite number"),
    (lambda m, x: minidp.DataParallel(m, cpu_ids(2), cache_replicas="no"), TypeError,
     r"cache_replicas must be True, False or a ReplicaCache, got 'no'"),
    (lambda m, x: minidp.DataParallel(m, cpu_ids(2), gather_output="False"), TypeError,
     r"gather_output must be True or False, got 'False'"),
    (lambda m, x: minidp.parallel_criterion(nn.MSELoss(), [x, x], torch.cat([x, x]), dim="0"), TypeError, r"dim must be an int"),
    (lambda m, x: minidp.calibrate(lambda y: y, x, cpu_ids(2)), TypeError, r"model must be an nn\.Module"),
    (lambda m, x: minidp.calibrate(m, x, cpu_ids(2), loss_fn="sum"), TypeError,
     r"loss_fn must be a function from the model's output to a scalar, got str"),
    (lambda m, x: minidp.verify(lambda y: y, x, cpu_ids(2)), TypeError, r"module must be an nn\.Module"),
    (lambda m, x: minidp.verify(m, x, cpu_ids(2), dim="0"), TypeError, r"dim must be an int"),
    (lambda m, x: minidp.verify(m, x, cpu_ids(2), loss="mse"), TypeError, r"loss must be callable"),
    (lambda m, x: minidp.verify(m, x, cpu_ids(2), wrapper="DataParallel"), TypeError, r"wrapper must be callable"),
    (lambda m, x: minidp.verify(m, x, cpu_ids(2), rtol=-1), ValueError, r"rtol must be a positive number"),
    (lambda m, x: minidp.verify(m, x, cpu_ids(2), dtype=torch.int64), TypeError, r"dtype must be a floating-point torch\.dtype"),
]


@pytest.mark.parametrize("call,error,message", BAD_ARGUMENTS)
def test_a_bad_argument_is_refused_at_the_call_naming_it(model, call, error, message, generator):
    """Stock keeps what it is given and fails later, if at all: a backend at the first backward, a
    non-callable module inside a replica after the others ran, a tensor passed as the list of inputs
    or outputs cut into its rows. minidp refuses each at the call, before any replica runs (the
    model's BatchNorm statistics would show one)."""
    before = snapshot(model)
    with pytest.raises(error, match=message):
        call(model, torch.randn(6, 4, generator=generator))
    assert_untouched(model, before)


def test_an_unknown_reduce_backend_is_refused_by_replicate_before_the_forward(model, generator):
    """The backend is used only in the backward, by the reduction; a misspelling used to be found there,
    after the forward had updated the running statistics. Now the replicas are never built."""
    cache = minidp.ReplicaCache()
    before = snapshot(model)
    for replicate in (minidp.replicate, cache.replicate):
        with pytest.raises(ValueError, match="reduce_backend must be one of"):
            replicate(model, cpu_ids(2), reduce_backend="bogus")
    assert cache.info().misses == 0
    assert_untouched(model, before)


@pytest.mark.parametrize(
    "call,shapes,message",
    [
        (comm.scatter, [(3, 4), (3, 5)], r"scatter: out\[1\] has shape \(3, 5\), where \(6, 4\) outside dim 0 is needed"),
        (comm.broadcast, [(6, 4), (6, 5)], r"broadcast: out\[1\] has shape \(6, 5\), where \(6, 4\) is needed"),
    ],
)
def test_a_bad_out_tensor_is_refused_before_any_is_written(call, shapes, message, generator):
    """torch's error would come from ``out[1]``'s copy, after ``out[0]`` was written."""
    out = [torch.zeros(shape) for shape in shapes]
    with pytest.raises(ValueError, match=message):
        call(torch.randn(6, 4, generator=generator), out=out)
    assert all(not o.any() for o in out)


def test_out_pieces_that_do_not_add_up_to_the_tensor_are_refused(generator):
    with pytest.raises(ValueError, match=r"scatter: the sizes of out along dim 0 add up to 5, but the tensor has 6 rows there"):
        comm.scatter(torch.randn(6, 4, generator=generator), out=[torch.zeros(3, 4), torch.zeros(2, 4)])


# --------------------------------------------------------------------------------------------------
# torch.jit.trace: it records the calling thread only, and the replicas run in threads of their own
# --------------------------------------------------------------------------------------------------


TRACE_ADVICE = r"Trace the module itself \(torch\.jit\.trace\(dp\.module, example_inputs\)\) and give the traced module"


@pytest.mark.parametrize("how", ["DataParallel", "data_parallel", "parallel_apply"])
def test_tracing_several_replicas_is_refused_before_anything_changes(model, generator, how):
    """docs/stock-behaviour.md B41: stock fails inside the trace (the replicas' outputs, made in threads the tracer
    does not record, cannot become constants); minidp refuses before it scatters, saying what to trace instead."""
    x = torch.randn(6, 4, generator=generator)
    calls = {
        "DataParallel": lambda: minidp.DataParallel(model, cpu_ids(2)),
        "data_parallel": lambda: lambda inputs: minidp.data_parallel(model, inputs, cpu_ids(2)),
        "parallel_apply": lambda: lambda inputs: minidp.parallel_apply([model, model], [inputs[:3], inputs[3:]]),
    }
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=rf"torch\.jit\.trace cannot record 2 replicas.*{TRACE_ADVICE}"):
        torch.jit.trace(calls[how](), x)
    assert_untouched(model, before)


def test_a_module_traced_alone_runs_under_data_parallel_as_the_module(generator):
    """docs/stock-behaviour.md B41: the fix the refusal names, a ScriptModule on two CPU replicas."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    traced = torch.jit.trace(model, x)
    output = minidp.DataParallel(traced, cpu_ids(2))(x)
    output.sum().backward()
    expected = model(x)
    expected.sum().backward()
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    assert all(torch.equal(t.grad, p.grad) for t, p in zip(traced.parameters(), model.parameters()))


def test_a_one_device_data_parallel_traces_as_its_module(generator):
    """docs/stock-behaviour.md B41: one device calls the module in the caller's thread, so the trace is the module's."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    traced = torch.jit.trace(minidp.DataParallel(model, cpu_ids(1)), torch.randn(6, 4, generator=generator, dtype=torch.float64))
    y = torch.randn(6, 4, generator=generator, dtype=torch.float64)  # a trace keeps the sizes it saw
    torch.testing.assert_close(traced(y), model(y), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# a forward that changes a parameter in place: the replicas on the module's device share its memory
# --------------------------------------------------------------------------------------------------


class _CountsInAFrozenParameter(nn.Module):
    """Keeps a count of its forwards in a parameter that requires no grad, added to in place in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3).double()
        self.count = nn.Parameter(torch.zeros((), dtype=torch.float64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.count.add_(1)
        return self.lin(x)


def test_a_forward_that_changes_a_frozen_parameter_in_place_fails_the_step_pointing_to_a_buffer(generator):
    """docs/stock-behaviour.md B42: a parameter that requires no grad reaches replica 0 as the original, unrefused, so
    stock's count lands once (the other replica counts in its copy); minidp's replicas share it, so it lands twice:
    the step fails, naming it, and says where such state belongs."""
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    stock_model = _CountsInAFrozenParameter()
    with emulated_stock():
        nn.DataParallel(stock_model, [0, 1])(x)
    assert stock_model.count.item() == 1
    model = _CountsInAFrozenParameter()
    with pytest.raises(RuntimeError, match=r"changed parameter\(s\) \['count'\] in place.*\['count'\] require\(s\) no "
                                           r"grad: stock lets replica 0's change land once.*register_buffer"):
        minidp.DataParallel(model, cpu_ids(2))(x)
    assert model.count.item() == 2


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "clone-of-a-parameter"])
@pytest.mark.parametrize("how", ["DataParallel", "data_parallel"])
def test_a_forward_that_changes_a_buffer_that_requires_grad_in_place_fails_the_step_naming_it(leaf, how, generator):
    """docs/stock-behaviour.md B19, B42: a buffer that requires grad reaches the replicas through Broadcast, as the
    parameters do: stock's replica 0 changes the original once (after the buffer's last use), the other replicas
    copies. minidp's CPU replicas alias it, so the change lands once per replica: the step fails, naming the buffer and
    how to keep such state, and the buffer is put back."""
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    torch.manual_seed(0)
    stock_model = CountsInABufferThatRequiresGrad(leaf)
    start = stock_model.count.detach().clone()
    with emulated_stock():
        nn.DataParallel(stock_model, [0, 1])(x).sum().backward()
    assert torch.equal(stock_model.count.detach(), start + 1)
    torch.manual_seed(0)
    model = CountsInABufferThatRequiresGrad(leaf)
    before = snapshot(model)
    call = minidp.DataParallel(model, cpu_ids(2)) if how == "DataParallel" else (
        lambda inputs: minidp.data_parallel(model, inputs, cpu_ids(2)))
    with pytest.raises(RuntimeError, match=r"changed buffer\(s\) \['count'\] in place, which require\(s\) grad.*put "
                                           r"back.*register it detached"):
        call(x)
    assert_untouched(model, before)


class _ScalesItsWeight(nn.Module):
    """Doubles its linear layer's weight in place in forward, in grad mode or under ``torch.no_grad()``."""

    def __init__(self, grad_mode: bool) -> None:
        super().__init__()
        self.lin, self.norm, self.grad_mode = nn.Linear(4, 3).double(), nn.BatchNorm1d(3).double(), grad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.nullcontext() if self.grad_mode else torch.no_grad():
            self.lin.weight.mul_(2)
        return self.norm(self.lin(x))


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("how", ["DataParallel", "data_parallel"])
def test_a_forward_that_changes_a_parameter_in_place_fails_the_step_naming_it(grad_mode, how, generator):
    """docs/stock-behaviour.md B42: stock refuses the change in replica 0 (a view of the original parameter); minidp's
    replicas alias the parameter, so the change lands once per replica: the step fails, naming the parameter, the
    buffers put back, and the message says the parameter holds every replica's change."""
    model = _ScalesItsWeight(grad_mode)
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    with emulated_stock(), pytest.raises(RuntimeError, match=r"Output 0 of _Broadcast(Backward)? is a view"):  # 2.13, 2.11
        nn.DataParallel(model, [0, 1])(x)
    buffers = [b.clone() for b in model.buffers()]
    call = minidp.DataParallel(model, cpu_ids(2)) if how == "DataParallel" else (
        lambda inputs: minidp.data_parallel(model, inputs, cpu_ids(2)))
    with pytest.raises(RuntimeError, match=r"changed parameter\(s\) \['lin\.weight'\] in place.*holds all of them"):
        call(x)
    assert all(torch.equal(b, saved) for b, saved in zip(model.buffers(), buffers))


def test_a_parameter_another_thread_updates_during_the_forward_fails_the_step_naming_that_thread_as_a_cause(generator):
    """minidp/wrapper.py, step_guarded: the check of the replicas' in-place changes reads the parameters' version
    counters, which do not say which thread moved them. An optimizer's step in another thread while this one runs a
    forward of the same model reads as the forward's change (stock's replicas are copies, and its step runs): the
    step fails, and the message says that another thread may have made the change, and what to do."""
    model = nn.Linear(4, 3).double()
    updated = []

    def another_threads_step(module: nn.Module, inputs: tuple) -> None:
        if not updated:  # once, in the first replica's forward, by a thread of its own
            updated.append(True)
            worker = threading.Thread(target=_update_without_grad, args=(model.weight,))
            worker.start()
            worker.join()

    model.register_forward_pre_hook(another_threads_step)
    with pytest.raises(RuntimeError, match=r"changed parameter\(s\) \['weight'\].*another thread.*copy of the model"):
        minidp.DataParallel(model, cpu_ids(2))(torch.randn(6, 4, generator=generator, dtype=torch.float64))


def _update_without_grad(parameter: torch.Tensor) -> None:
    with torch.no_grad():
        parameter.add_(0.0)
