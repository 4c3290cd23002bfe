"""Layers recomputed in the backward: what data parallelism computes there, and how verify judges it.

``torch.utils.checkpoint`` runs a block's forward a second time inside ``backward``, on the replica
that ran it first (docs/stock-behaviour.md B39): a BatchNorm inside updates its running statistics
twice, replica 0 the original's, every other replica its private copy. The chunked reference
(``minidp.reference.chunked_reference``) must compute exactly that, for both checkpointing modes,
since ``minidp.verify`` and the differential tests measure minidp against it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import minidp
from minidp.reference import chunked_reference
from .helpers import cpu_ids, library
from .reference import Case, Result, assert_same_results, forward_backward, stock_forward_backward

MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
ROWS = 7  # uneven chunks on 2, 3 and 4 replicas


class CheckpointedBN(nn.Module):
    """A BatchNorm block under ``torch.utils.checkpoint`` in one mode, after a layer that makes its input require grad."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.stem = nn.Conv1d(3, 6, 1)
        self.block = nn.Sequential(nn.BatchNorm1d(6), nn.ReLU(), nn.Conv1d(6, 6, 1))
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, self.stem(x), use_reentrant=self.use_reentrant).mean(dim=2)


def checkpointed_case(use_reentrant: bool, generator: torch.Generator) -> Case:
    model = CheckpointedBN(use_reentrant).double()
    with torch.no_grad():  # statistics that are not BatchNorm's initial ones: a second update shows
        model.block[0].running_mean.normal_(generator=generator)
        model.block[0].running_var.uniform_(0.5, 2.0, generator=generator)
    x = torch.randn(ROWS, 3, 5, generator=generator, dtype=torch.float64)
    return Case("checkpointed_bn", model, (x,), {}, 0, lambda out: out.pow(2).mean())


def reference_forward_backward(case: Case, replicas: int) -> Result:
    return forward_backward(case, lambda model, args, kwargs: chunked_reference(model, args, kwargs, replicas))


@MODES
@pytest.mark.parametrize("replicas", [2, 3])
def test_stock_updates_the_originals_statistics_twice_from_chunk_0(use_reentrant, replicas, generator):
    """B39, measured on stock under the emulation: two momentum steps, both with chunk 0's batch statistics."""
    case = checkpointed_case(use_reentrant, generator)
    bn = case.prototype.block[0]
    chunk_0 = case.args[0][: -(-ROWS // replicas)]
    with torch.no_grad():
        h = case.prototype.stem(chunk_0)
    mean, var = h.mean(dim=(0, 2)), h.var(dim=(0, 2), unbiased=True)
    expected_mean, expected_var = bn.running_mean.clone(), bn.running_var.clone()
    for _ in range(2):
        expected_mean = (1 - bn.momentum) * expected_mean + bn.momentum * mean
        expected_var = (1 - bn.momentum) * expected_var + bn.momentum * var

    stock = stock_forward_backward(case, list(range(replicas)))
    assert stock.buffers["block.0.num_batches_tracked"].item() == 2
    torch.testing.assert_close(stock.buffers["block.0.running_mean"], expected_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(stock.buffers["block.0.running_var"], expected_var, rtol=1e-12, atol=1e-14)


@MODES
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_the_reference_computes_what_stock_computes(use_reentrant, replicas, generator):
    """Outputs, gradients and buffers of the chunked reference against stock (emulated), then minidp against both."""
    case = checkpointed_case(use_reentrant, generator)
    stock = stock_forward_backward(case, list(range(replicas)))
    reference = reference_forward_backward(case, replicas)
    assert_same_results(reference, stock)
    ours = forward_backward(case, lambda model, args, kwargs: minidp.DataParallel(model, cpu_ids(replicas))(*args))
    assert_same_results(ours, reference)


@MODES
def test_verify_passes_a_model_whose_batchnorm_is_recomputed(use_reentrant, generator):
    case = checkpointed_case(use_reentrant, generator)
    report = minidp.verify(case.prototype, case.args, cpu_ids(3))
    assert report.ok, str(report)
    assert report.batch_statistics == ["block.0 (BatchNorm1d)"]


class BuffersSwappedForTheCall(nn.Module):
    """A wrong data parallelism: chunks 1.. run on the original module with private buffers swapped in
    for the call only (``functional_call``), so what the backward recomputes finds the original's buffers."""

    def __init__(self, module: nn.Module, device_ids: list, dim: int = 0) -> None:
        super().__init__()
        self.module, self.device_ids, self.dim = module, list(device_ids), dim

    def forward(self, *inputs):
        chunks, _ = minidp.scatter_kwargs(inputs, {}, self.device_ids, self.dim)
        parameters = dict(self.module.named_parameters())
        private = [{name: b.clone() for name, b in self.module.named_buffers()} for _ in chunks[1:]]
        outputs = [self.module(*chunks[0])]
        outputs += [functional_call(self.module, {**parameters, **buffers}, args) for args, buffers in zip(chunks[1:], private)]
        return minidp.gather(outputs, self.device_ids[0], self.dim)


@MODES
def test_verify_fails_when_the_recomputation_of_other_chunks_lands_in_the_originals_statistics(use_reentrant, generator):
    case = checkpointed_case(use_reentrant, generator)
    report = minidp.verify(case.prototype, case.args, cpu_ids(3), wrapper=BuffersSwappedForTheCall)
    failed = {c.name for c in report.failures}
    assert failed >= {"block.0.running_mean", "block.0.running_var", "block.0.num_batches_tracked"}, str(report)
    assert all(c.kind == "buffer" and c.against == "chunked reference" for c in report.failures)


class CountsSamples(nn.Module):
    """Not a batch statistic: a buffer that counts the rows its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.linear(x)


class CheckpointedCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.counter = CountsSamples()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.counter, self.stem(x), use_reentrant=False)


def test_verify_fails_on_a_recomputed_sample_counter_that_sees_chunk_0_twice(generator):
    """The full batch counts every row twice; data parallelism counts chunk 0's twice: a failure, as without recomputation."""
    report = minidp.verify(CheckpointedCounter(), torch.randn(6, 4, generator=generator), cpu_ids(2))
    [failure] = report.failures
    assert (failure.kind, failure.name, failure.against) == ("buffer", "counter.seen", "full batch")
    assert "belongs to no batch-statistics layer" in failure.note


def test_a_densenet_with_memory_efficient_layers_verifies_and_matches_stock(generator):
    """torchvision's DenseNet checkpoints the bottleneck of every dense layer (norm1, relu1, conv1) with ``memory_efficient=True``."""
    models = library("torchvision.models")
    model = models.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=3,
                            memory_efficient=True).double()
    x = torch.randn(5, 3, 32, 32, generator=generator, dtype=torch.float64)
    report = minidp.verify(model, (x,), cpu_ids(2))
    assert report.ok, str(report)
    case = Case("densenet", model, (x,), {}, 0, lambda out: out.pow(2).mean())
    stock = stock_forward_backward(case, [0, 1])
    reference = reference_forward_backward(case, 2)
    assert_same_results(reference, stock)
    assert stock.buffers["features.denseblock1.denselayer1.norm1.num_batches_tracked"].item() == 2
