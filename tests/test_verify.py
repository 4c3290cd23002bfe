"""minidp.verify: minidp against a chunk-by-chunk single-device reference, the full batch and stock."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minidp
from minidp.zoo import ZOO, MLP

from .helpers import CountsCalls, cpu_ids, requires_cuda


class DropsLastChunk(minidp.DataParallel):
    """A broken gather: the last replica's output never reaches the caller."""

    def gather(self, outputs, output_device):
        return super().gather(outputs[:-1], output_device)


class PrivateBuffersEverywhere(minidp.DataParallel):
    """A broken replicate: replica 0 gets copies of the buffers too, so running statistics never update."""

    def replicate(self, module, device_ids):
        replicas = super().replicate(module, device_ids)
        for submodule in replicas[0].modules():
            for key, buf in submodule._buffers.items():
                submodule._buffers[key] = None if buf is None else buf.clone()
        return replicas


@pytest.mark.parametrize("name", list(ZOO))
def test_verify_passes_on_every_zoo_model(name, generator):
    entry = ZOO[name]
    inputs, kwargs = entry.batch(7, generator)  # 7 rows on 3 replicas: uneven chunks 3, 3, 1
    report = minidp.verify(entry.build(), inputs, cpu_ids(3), kwargs, dim=entry.dim, loss=entry.loss)
    assert report.ok, str(report)
    assert {c.kind for c in report.checks} >= {"output", "gradient", "state"}


def test_verify_reports_batchnorm_as_batch_dependent_information_not_a_failure(generator):
    entry = ZOO["resnet_bn"]
    inputs, _ = entry.batch(6, generator)
    report = minidp.verify(entry.build(), inputs, cpu_ids(2))
    assert report.ok and report.batch_dependent
    assert "differs (info" in str(report)


def test_verify_finds_no_batch_dependence_in_an_mlp(generator):
    report = minidp.verify(MLP(), torch.randn(6, 16, generator=generator), cpu_ids(2))
    assert report.ok and not report.batch_dependent


def test_verify_fails_on_state_that_forward_mutates(generator):
    report = minidp.verify(CountsCalls(), torch.randn(6, 4, generator=generator), cpu_ids(2))
    assert not report.ok
    [failure] = report.failures
    assert (failure.kind, failure.name) == ("state", "calls")
    assert "0 under data parallelism, 1 on one device" in str(report)


def test_verify_fails_on_a_gather_that_drops_a_chunk(generator):
    report = minidp.verify(MLP(), torch.randn(6, 16, generator=generator), cpu_ids(3), wrapper=DropsLastChunk)
    assert not report.ok
    assert any(c.kind == "output" and "shape (4, 4) vs (6, 4)" in c.note for c in report.failures)


def test_verify_fails_when_running_statistics_do_not_come_from_chunk_0(generator):
    entry = ZOO["resnet_bn"]
    inputs, _ = entry.batch(6, generator)
    report = minidp.verify(entry.build(), inputs, cpu_ids(2), wrapper=PrivateBuffersEverywhere)
    assert {c.name for c in report.failures} >= {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"}
    assert all(c.kind == "buffer" for c in report.failures)


def test_verify_leaves_the_users_model_untouched(generator):
    model = CountsCalls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    minidp.verify(model, torch.randn(6, 4, generator=generator), cpu_ids(2))
    assert model.calls == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_verify_defaults_to_two_cpu_replicas_without_a_gpu(generator):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the default is every GPU")
    report = minidp.verify(MLP(), torch.randn(4, 16, generator=generator))
    assert report.devices == ["cpu", "cpu"]
    assert any("stock torch.nn.DataParallel not run" in note for note in report.notes)


@pytest.mark.cuda
@requires_cuda
def test_verify_compares_with_stock_dataparallel_on_gpus(generator):
    report = minidp.verify(MLP(), torch.randn(6, 16, generator=generator), [0, 0])
    assert report.ok, str(report)
    assert any(c.against == "stock DataParallel" for c in report.checks)
