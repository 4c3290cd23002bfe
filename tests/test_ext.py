"""The csrc extension's reduce_add_coalesced: bitwise equal to the plain torch reduction.

Every case compares against torch_reduce (tests/_ext_helpers.py), which is the arithmetic of the
core's "torch" backend: add replica by replica, half types accumulated in float32.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings

import pytest
import torch

from ._ext_helpers import assert_bitwise_equal, random_replicas, torch_reduce
from .helpers import fresh_python
from minidp import ext

CPU = torch.device("cpu")
ODD_SIZES = [(1,), (3,), (17,), (1023,), (1025,), (4097,), (65537,), (3, 5, 7)]


def check(inputs, destination=CPU):
    assert_bitwise_equal(ext.reduce_add_coalesced(inputs, destination), torch_reduce(inputs, destination))


# --- same results as the torch reduction --------------------------------------------------


@pytest.mark.parametrize("num_replicas", range(1, 9))
def test_matches_reference_for_each_replica_count(extension, generator, num_replicas):
    check(random_replicas(ODD_SIZES, num_replicas, torch.float32, generator))


@pytest.mark.parametrize("dtype", ext.SUPPORTED_DTYPES, ids=str)
def test_matches_reference_for_each_dtype(extension, generator, dtype):
    check(random_replicas(ODD_SIZES, 3, dtype, generator))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference_on_one_huge_tensor(extension, generator, dtype):
    check(random_replicas([(8 * 2**20,)], 4, dtype, generator))


def test_matches_reference_on_thousands_of_tiny_tensors(extension, generator):
    sizes = torch.randint(1, 8, (3000,), generator=generator).tolist()
    check(random_replicas([(n,) for n in sizes], 4, torch.float32, generator))


def test_matches_reference_with_mixed_dtypes_across_positions(extension, generator):
    inputs = [[] for _ in range(3)]
    for dtype in ext.SUPPORTED_DTYPES:
        for k, replica in enumerate(random_replicas([(33,), (5000,)], 3, dtype, generator)):
            inputs[k] += replica
    check(inputs)


def test_empty_tensors_give_empty_results(extension, generator):
    check(random_replicas([(0,), (5,), (3, 0), (0,), (9,), (0, 4)], 2, torch.float32, generator))


def test_only_empty_tensors(extension, generator):
    check(random_replicas([(0,), (2, 0)], 3, torch.float16, generator))


def test_zero_dimensional_tensors(extension, generator):
    check(random_replicas([(), (4,), ()], 5, torch.float64, generator))


def test_replicas_without_tensors_give_no_results(extension):
    assert ext.reduce_add_coalesced([[], [], []], CPU) == []


def test_non_contiguous_inputs(extension, generator):
    base = random_replicas([(64, 48), (300,)], 3, torch.float32, generator)
    inputs = [[matrix.t(), vector[::3]] for matrix, vector in base]
    assert not inputs[0][0].is_contiguous() and not inputs[0][1].is_contiguous()
    check(inputs)


def test_infinities_and_nans_propagate_like_the_reference(extension):
    values = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0, float("inf")])
    inputs = [[values], [values.flip(0)], [values.roll(1)]]
    torch.testing.assert_close(
        ext.reduce_add_coalesced(inputs, CPU), torch_reduce(inputs, CPU), rtol=0, atol=0, equal_nan=True
    )


# --- what comes back ----------------------------------------------------------------------


def test_one_replica_gives_copies_not_aliases(extension, generator):
    inputs = random_replicas([(10,), (2, 3)], 1, torch.float32, generator)
    outputs = ext.reduce_add_coalesced(inputs, CPU)
    for out, original in zip(outputs, inputs[0]):
        assert torch.equal(out, original)
        assert out.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()


def test_results_are_contiguous_with_replica_zero_shapes_and_dtypes(extension, generator):
    inputs = random_replicas([(4, 5), (7,)], 2, torch.bfloat16, generator)
    outputs = ext.reduce_add_coalesced(inputs, CPU)
    assert [(o.shape, o.dtype, o.device, o.is_contiguous()) for o in outputs] == [
        (t.shape, t.dtype, CPU, True) for t in inputs[0]
    ]


def test_reduce_add_into_writes_the_given_outputs(extension, generator):
    inputs = random_replicas([(100,), (3, 3)], 4, torch.float16, generator)
    outputs = [torch.empty_like(t) for t in inputs[0]]
    ext.load().reduce_add_into(inputs, outputs)
    assert_bitwise_equal(outputs, torch_reduce(inputs, CPU))


# --- CPU sums in memory kept mapped between calls -------------------------------------------
# DDP writes gradients into bucket memory it keeps for the module's life (gradient_as_bucket_view,
# torch/nn/parallel/distributed.py); here a block is reused only once no sum over it is alive.


def _pointers(tensors):
    return [t.data_ptr() for t in tensors]


def test_sums_dropped_by_the_caller_are_written_into_the_same_memory_next_time(extension, generator):
    inputs = random_replicas([(64, 3), (5,), (0,), ()], 3, torch.float32, generator)
    first = ext.reduce_add_coalesced(inputs, CPU)
    where = _pointers(first)
    del first
    again = ext.reduce_add_coalesced(inputs, CPU)
    assert _pointers(again) == where
    assert_bitwise_equal(again, torch_reduce(inputs, CPU))


def test_a_sum_still_held_is_never_overwritten(extension, generator):
    """A user keeping one gradient (or a view of it) past zero_grad(set_to_none=True) keeps its values."""
    inputs = random_replicas([(64, 3), (5,)], 3, torch.float32, generator)
    later = random_replicas([(64, 3), (5,)], 3, torch.float32, generator)
    first = ext.reduce_add_coalesced(inputs, CPU)
    kept, view, expected = first[1], first[0][2:], [t.clone() for t in first]
    del first
    second = ext.reduce_add_coalesced(later, CPU)
    assert torch.equal(kept, expected[1]) and torch.equal(view, expected[0][2:])
    assert set(_pointers(second)).isdisjoint(_pointers([kept, view]))
    assert_bitwise_equal(second, torch_reduce(later, CPU))


def test_sums_are_tensors_of_their_own_not_views_of_each_other(extension, generator):
    outputs = ext.reduce_add_coalesced(random_replicas([(8,), (8,)], 2, torch.float32, generator), CPU)
    assert all(o._base is None for o in outputs)
    before = [o._version for o in outputs]
    outputs[0].add_(1)  # an in-place change of one sum does not count as a change of the others
    assert [o._version for o in outputs] == [before[0] + 1, before[1]]


def test_memory_whose_python_storage_object_was_seen_is_reused_once_dropped(extension, generator):
    """``tensor.untyped_storage()`` makes a Python object that torch keeps alive while C++ holds the memory."""
    inputs = random_replicas([(16,)], 2, torch.float32, generator)
    first = ext.reduce_add_coalesced(inputs, CPU)
    where = _pointers(first)
    assert first[0].untyped_storage().nbytes() >= 64
    del first
    assert _pointers(ext.reduce_add_coalesced(inputs, CPU)) == where


def test_the_last_call_says_which_block_it_wrote_into_and_whether_it_kept_it_from_an_earlier_call(extension, generator):
    # what the memory ledger reads of a reduction (minidp/tracing/memory.py): a block made now, or one taken again
    ext.release_reduce_outputs()
    inputs = random_replicas([(16,), (3,)], 2, torch.float32, generator)
    first = ext.reduce_add_coalesced(inputs, CPU)
    block = first[0].untyped_storage().data_ptr()
    assert ext.reduce_output_last_block() == (block, False)
    del first
    ext.reduce_add_coalesced(inputs, CPU)
    assert ext.reduce_output_last_block() == (block, True)
    ext.forget_reduce_output_last_block()  # until the next call: a reduction that made none names no block
    assert ext.reduce_output_last_block() == (0, False)


def test_release_reduce_outputs_lets_go_of_the_kept_memory(extension, generator):
    ext.reduce_add_coalesced(random_replicas([(1024,)], 2, torch.float32, generator), CPU)
    assert ext.reduce_output_bytes() >= 4096
    ext.release_reduce_outputs()
    assert ext.reduce_output_bytes() == 0


# --- errors name the tensor and the replica -----------------------------------------------


def test_shape_mismatch_names_tensor_and_replica(extension, generator):
    inputs = random_replicas([(2,), (3,), (1,), (4, 6)], 3, torch.float32, generator)
    inputs[2][3] = torch.zeros(4, 5)
    with pytest.raises(ValueError, match=r"tensor 3 of replica 2 has shape \(4, 5\) but replica 0's has \(4, 6\)"):
        ext.reduce_add_coalesced(inputs, CPU)


def test_dtype_mismatch_names_tensor_and_replica(extension, generator):
    inputs = random_replicas([(2,), (3,)], 2, torch.float32, generator)
    inputs[1][1] = inputs[1][1].half()
    with pytest.raises(TypeError, match="tensor 1 of replica 1 has dtype torch.float16 but replica 0's has torch.float32"):
        ext.reduce_add_coalesced(inputs, CPU)


def test_tensor_count_mismatch_names_replica(extension, generator):
    inputs = random_replicas([(2,), (3,), (4,)], 2, torch.float32, generator)
    inputs[1].pop()
    with pytest.raises(ValueError, match="replica 1 has 2 tensors but replica 0 has 3"):
        ext.reduce_add_coalesced(inputs, CPU)


def test_unsupported_dtype_is_rejected(extension):
    with pytest.raises(TypeError, match="tensor 0 of replica 0 has dtype torch.int64; supported are"):
        ext.reduce_add_coalesced([[torch.ones(3, dtype=torch.int64)]] * 2, CPU)


def test_no_replicas_is_rejected(extension):
    with pytest.raises(ValueError, match="at least one replica"):
        ext.reduce_add_coalesced([], CPU)


MISMATCHES = """
import torch
from minidp import ext
cpu = torch.device("cpu")
for inputs in ([[torch.ones(3)], []], [[torch.ones(3)], [torch.ones(4)]], [[torch.ones(2)], [torch.ones(2).double()]]):
    try:
        ext.reduce_add_coalesced(inputs, cpu)
    except (TypeError, ValueError) as error:
        print(type(error).__name__, error)
"""


@pytest.mark.fresh_interpreter
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_errors_keep_their_numbers_when_the_compiler_links_the_cpp_runtime_statically(tmp_path):
    """A CUDA image's compiler wrapper (its CXX) linked the C++ runtime into the extension, as
    ``g++ -static-libstdc++`` does: messages formatted by std::ostream then lost their numbers here and
    crashed the process on a GPU machine. The extension is built that way, in a fresh process, as
    ``ext.load()`` builds it, and its errors must come out whole."""
    wrapper = tmp_path / "g++-static-runtime"
    wrapper.write_text('#!/bin/sh\nexec g++ "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    environment = {"CXX": str(wrapper), "TORCH_EXTENSIONS_DIR": str(tmp_path / "build"), "MINIDP_EXT": "1"}
    result = fresh_python("-c", MISMATCHES, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "ValueError replica 1 has 0 tensors but replica 0 has 1",
        "ValueError tensor 0 of replica 1 has shape (4,) but replica 0's has (3,)",
        "TypeError tensor 0 of replica 1 has dtype torch.float64 but replica 0's has torch.float32",
    ]


# --- building and switching it off --------------------------------------------------------


@pytest.fixture
def unloaded(monkeypatch):
    """The extension module as if not extension yet; the real one comes back after the test."""
    monkeypatch.setattr(ext, "_module", None)
    monkeypatch.setattr(ext, "_failure", None)
    monkeypatch.delenv("MINIDP_EXT", raising=False)
    return monkeypatch


def fail_build(verbose):
    raise RuntimeError("compiler exploded")


def test_minidp_ext_0_disables_without_building(unloaded):
    unloaded.setenv("MINIDP_EXT", "0")
    unloaded.setattr(ext, "_build", lambda verbose: pytest.fail("extension although disabled"))
    assert not ext.is_available()
    with pytest.raises(RuntimeError, match="disabled by MINIDP_EXT=0"):
        ext.load()


@pytest.mark.parametrize("value", ["false", "off", "2", "yes"])
def test_a_minidp_ext_value_other_than_0_or_1_is_refused_listing_those_that_work(unloaded, value):
    """Taken as unset, ``false`` and ``off`` would build what was meant to be off."""
    unloaded.setenv("MINIDP_EXT", value)
    unloaded.setattr(ext, "_build", lambda verbose: pytest.fail("built although MINIDP_EXT is not understood"))
    for call in (ext.is_available, ext.load):
        with pytest.raises(ValueError, match=f"MINIDP_EXT='{value}' is not understood") as error:
            call()
        assert all(works in str(error.value) for works in ("MINIDP_EXT=0", "MINIDP_EXT=1", "unset"))


def test_failed_build_warns_once_and_reports_unavailable(unloaded):
    unloaded.setattr(ext, "_build", fail_build)
    with pytest.warns(RuntimeWarning, match="compiler exploded"):
        assert not ext.is_available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ext.is_available()


def test_failed_build_raises_when_minidp_ext_is_1(unloaded):
    unloaded.setenv("MINIDP_EXT", "1")
    unloaded.setattr(ext, "_build", fail_build)
    with pytest.raises(RuntimeError, match="compiler exploded"):
        ext.is_available()


def test_missing_sources_are_reported_with_their_path(unloaded, tmp_path):
    unloaded.setattr(ext, "CSRC", tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ext._build(verbose=False)


# --- on GPUs ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestCuda:
    GPU0 = torch.device("cuda", 0)

    @pytest.mark.parametrize("dtype", ext.SUPPORTED_DTYPES, ids=str)
    def test_matches_reference_for_each_dtype(self, extension, generator, dtype):
        check(random_replicas(ODD_SIZES, 3, dtype, generator, self.GPU0), self.GPU0)

    @pytest.mark.parametrize("num_replicas", [1, 2, 5, 8])
    def test_replicas_on_the_same_gpu(self, extension, generator, num_replicas):
        check(random_replicas(ODD_SIZES, num_replicas, torch.float32, generator, self.GPU0), self.GPU0)

    def test_one_huge_tensor(self, extension, generator):
        check(random_replicas([(32 * 2**20,)], 4, torch.float32, generator, self.GPU0), self.GPU0)

    def test_thousands_of_tiny_tensors(self, extension, generator):
        sizes = torch.randint(1, 8, (3000,), generator=generator).tolist()
        check(random_replicas([(n,) for n in sizes], 4, torch.float16, generator, self.GPU0), self.GPU0)

    def test_empty_and_zero_dimensional_tensors(self, extension, generator):
        check(random_replicas([(0,), (), (5,), (2, 0), ()], 3, torch.float64, generator, self.GPU0), self.GPU0)

    def test_misaligned_inputs(self, extension, generator):
        # Contiguous views one element into their storage: not 16-byte aligned.
        base = random_replicas([(1 + 1000,)], 3, torch.float32, generator, self.GPU0)
        check([[t[1:]] for (t,) in base], self.GPU0)

    def test_non_contiguous_inputs(self, extension, generator):
        base = random_replicas([(64, 48)], 3, torch.bfloat16, generator, self.GPU0)
        check([[t.t()] for (t,) in base], self.GPU0)

    def test_inputs_on_the_host(self, extension, generator):
        inputs = random_replicas(ODD_SIZES, 3, torch.float32, generator)
        inputs[0] = [t.to(self.GPU0) for t in inputs[0]]
        check(inputs, self.GPU0)

    def test_runs_on_the_current_stream(self, extension, generator):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            inputs = random_replicas(ODD_SIZES, 3, torch.float32, generator, self.GPU0)
            outputs = ext.reduce_add_coalesced(inputs, self.GPU0)
            expected = torch_reduce(inputs, self.GPU0)
        side.synchronize()
        assert_bitwise_equal(outputs, expected)

    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
    @pytest.mark.parametrize("destination", [0, 1])
    def test_inputs_on_a_second_gpu(self, extension, generator, destination):
        inputs = [
            [t.to(torch.device("cuda", k % 2)) for t in replica]
            for k, replica in enumerate(random_replicas(ODD_SIZES + [(4 * 2**20,)], 4, torch.float16, generator))
        ]
        check(inputs, torch.device("cuda", destination))


@pytest.mark.parametrize(
    "nvcc_release, outcome",
    [("13.0", "ok"), ("13.2", "warns"), ("12.8", "raises")],
)
def test_nvcc_must_match_torchs_cuda_major_version(monkeypatch, nvcc_release, outcome):
    """torch links extensions across CUDA minor versions; a different major version cannot work."""
    fake = subprocess.CompletedProcess([], 0, stdout=f"Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.1")
    monkeypatch.setattr(ext.subprocess, "run", lambda *args, **kwargs: fake)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if outcome == "raises":
            with pytest.raises(RuntimeError, match="install a CUDA 13.x toolkit"):
                ext._check_nvcc()
        else:
            ext._check_nvcc()
    assert any("nvcc CUDA 13.2" in str(w.message) for w in caught) == (outcome == "warns")
