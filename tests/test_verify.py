"""minidp.verify: minidp against a chunk-by-chunk single-device reference, the full batch and stock.

``report.ok`` means: DataParallel computes what one device computes, except for the effect of batch
statistics in layers known to have them (BatchNorm, a tracking InstanceNorm, the types named in
``batch_dependent=``), each named in ``report.batch_statistics``. Nothing else may make it fail:
not rounding, not the threads a kernel runs with, not the random draws of Dropout.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import minidp
from minidp.zoo import ZOO, MLP

from .helpers import CountsCalls, LayerCache, cpu_ids, library, requires_cuda


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
    assert report.batch_statistics == ["bn1 (BatchNorm2d)", "bn2 (BatchNorm2d)"]
    assert "differs (info)" in str(report)
    assert "explained by the batch statistics of bn1 (BatchNorm2d), bn2 (BatchNorm2d)" in str(report)


def test_verify_finds_no_batch_dependence_in_an_mlp(generator):
    report = minidp.verify(MLP(), torch.randn(6, 16, generator=generator), cpu_ids(2))
    assert report.ok and not report.batch_dependent


class CountsSamplesInATensorAttribute(nn.Module):
    """Counts its samples in a tensor kept as a plain attribute (neither buffer nor parameter), reassigned by
    forward: on a replica, a shallow copy, the new tensor is lost, as a reassigned int is."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.seen = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + x.shape[0]
        return self.linear(x)


class ScalesByATensorAttribute(nn.Module):
    """Reads a tensor kept as a plain attribute and never assigns it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.scale = torch.tensor(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight * self.scale


@pytest.mark.parametrize("model, name, says", [
    (CountsCalls, "calls", "0 under data parallelism, 1 on one device"),
    (CountsSamplesInATensorAttribute, "seen", "tensor(0.) under data parallelism, tensor(6.) on one device"),
], ids=["an int", "a tensor attribute"])
def test_verify_fails_on_state_that_forward_reassigns(model, name, says, generator):
    report = minidp.verify(model(), torch.randn(6, 4, generator=generator), cpu_ids(2))
    assert not report.ok
    [failure] = report.failures
    assert (failure.kind, failure.name) == ("state", name)
    assert says in str(report)


def test_verify_compares_a_tensor_attribute_that_forward_leaves_alone_and_passes_it(generator):
    report = minidp.verify(ScalesByATensorAttribute(), torch.randn(6, 4, generator=generator), cpu_ids(2))
    assert report.ok, str(report)
    assert [c.name for c in report.checks if c.kind == "state"] == ["1 attribute"]  # scale, the model's only one


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


@pytest.mark.parametrize("gpus,expected", [(0, ["cpu", "cpu"]), (1, [0, 0]), (3, [0, 1, 2])])
def test_the_default_devices_are_several_replicas_wherever_there_is_one_gpu_or_none(monkeypatch, gpus, expected):
    """One GPU alone would give one replica, a direct call (docs/stock-behaviour.md B9): nothing data-parallel to check."""
    monkeypatch.setattr(minidp.device_ids, "visible_gpus", lambda: gpus)
    assert minidp.device_ids.default_device_ids(replicas=2) == expected


@pytest.mark.cuda
@requires_cuda
def test_verify_compares_with_stock_dataparallel_on_gpus_when_asked(generator):
    report = minidp.verify(MLP(), torch.randn(6, 16, generator=generator), [0, 0], stock=True)
    assert report.ok, str(report)
    assert any(c.against == "stock DataParallel" for c in report.checks)


@pytest.mark.cuda
@requires_cuda
def test_verify_leaves_stock_out_by_default_on_a_repeated_gpu_id(generator):
    """docs/stock-behaviour.md B21: there stock's replicas count a lone BatchNorm's batches on the original buffer."""
    entry = ZOO["checkpoint"]
    inputs, _ = entry.batch(6, generator)
    report = minidp.verify(entry.build(), inputs, [0, 0], loss=entry.loss)
    assert report.ok, str(report)
    assert any("stock torch.nn.DataParallel not run" in note for note in report.notes)


# --------------------------------------------------------------------------------------------------
# No false FAILED: rounding, threads and random layers
# --------------------------------------------------------------------------------------------------


class BiasBeforeBatchNorm(nn.Module):
    """``a.bias`` has a true gradient of exactly zero: BatchNorm in training mode subtracts every
    per-feature constant. Its computed gradient is rounding noise, which any correct change of
    summation order changes by all of its size."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


class ThreadsPerReplicaVary(minidp.DataParallel):
    """Correct, but rounds differently: replica i runs with i + 1 intra-op threads, one replica after
    the other, so at least one chunk's kernels block their sums unlike the reference's, whatever one
    count the reference uses."""

    def parallel_apply(self, replicas, inputs, kwargs):
        previous, outputs = torch.get_num_threads(), []
        try:
            for i, (replica, args, kw) in enumerate(zip(replicas, inputs, kwargs)):
                torch.set_num_threads(i + 1)
                outputs.append(replica(*args, **kw))
        finally:
            torch.set_num_threads(previous)
        return outputs


def test_verify_measures_a_zero_gradient_against_its_layer_not_its_own_rounding(generator, two_intra_op_threads):
    # Relative to its own size, a.bias's gradient differs by ~100% between two correct summations.
    report = minidp.verify(BiasBeforeBatchNorm(), torch.randn(8, 16, generator=generator), cpu_ids(2),
                           wrapper=ThreadsPerReplicaVary)
    assert report.ok, str(report)
    [bias] = [c for c in report.checks if c.name == "a.bias" and c.against == "chunked reference"]
    assert bias.rel_error < 1e-12


def test_verify_still_fails_on_a_gradient_that_is_wrong_beyond_rounding(generator):
    class ScalesOneGradient(minidp.DataParallel):
        def forward(self, *inputs, **kwargs):
            output = super().forward(*inputs, **kwargs)
            self.module.b.bias.register_hook(lambda grad: grad * (1 + 1e-6))
            return output

    report = minidp.verify(BiasBeforeBatchNorm(), torch.randn(8, 16, generator=generator), cpu_ids(2),
                           wrapper=ScalesOneGradient)
    assert {c.name for c in report.failures} == {"b.bias"}


THREADS_SEEN: list[int] = []


class RecordsIntraOpThreads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        THREADS_SEEN.append(torch.get_num_threads())
        return self.linear(x)


@pytest.mark.skipif(
    not importlib.import_module("minidp.cpu_threads").PER_THREAD_INTRA_OP,
    reason="torch.set_num_threads is process-wide in this build (no OpenMP): every run keeps the caller's count",
)
def test_verify_runs_every_single_device_forward_with_the_threads_of_a_replica(generator, two_intra_op_threads):
    THREADS_SEEN.clear()
    minidp.verify(RecordsIntraOpThreads(), torch.randn(6, 4, generator=generator), cpu_ids(2))
    # minidp's two replicas, the reference's two chunks, the full batch, the search for random layers
    assert len(THREADS_SEEN) >= 6 and set(THREADS_SEEN) == {1}, THREADS_SEEN
    assert torch.get_num_threads() == 2


class DropsRows(nn.Module):
    """Stochastic depth in miniature: drops whole samples with a small probability in training."""

    def __init__(self, p: float = 0.05) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = (torch.rand(x.shape[0], 1, device=x.device) >= self.p).to(x.dtype)
        return x * keep / (1 - self.p)


def test_verify_runs_random_layers_without_their_randomness_and_names_them(generator):
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Tanh(), DropsRows(), nn.Linear(32, 4))
    report = minidp.verify(model, torch.randn(8, 16, generator=generator), cpu_ids(2))
    assert report.ok, str(report)
    assert report.random_layers == ["1 (Dropout)", "3 (DropsRows)"]
    assert "random layers run with their training flag off in every run: 1 (Dropout), 3 (DropsRows)" in str(report)
    assert model[1].training and model[3].training


def test_verify_leaves_the_global_random_state_as_it_was(generator):
    model, batch = nn.Sequential(nn.Linear(16, 8), nn.Dropout(0.5)), torch.randn(6, 16, generator=generator)
    before = torch.get_rng_state()
    minidp.verify(model, batch, cpu_ids(2))
    assert torch.equal(torch.get_rng_state(), before)


def test_verify_fails_on_randomness_that_no_training_flag_stops(generator):
    class AlwaysNoisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0.1 * torch.randn_like(x)

    model = nn.Sequential(nn.Linear(16, 8), AlwaysNoisy())
    report = minidp.verify(model, torch.randn(6, 16, generator=generator), cpu_ids(2))
    assert not report.ok
    [random] = [c for c in report.failures if c.kind == "random"]
    assert random.name == "1" and "no two runs can be compared" in random.note


# --------------------------------------------------------------------------------------------------
# No false OK: a difference from the full batch is a failure unless batch statistics explain it
# --------------------------------------------------------------------------------------------------


class CountsSamples(nn.Module):
    """Counts the samples it has seen in a buffer: under data parallelism only chunk 0 is counted
    (replica 0 updates the original's buffers, the others private copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.linear(x)


class BatchCentering(nn.Module):
    """Subtracts the batch mean: depends on the batch, and is no BatchNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


def test_verify_fails_on_a_buffer_that_forward_accumulates_over_the_batch(generator):
    report = minidp.verify(CountsSamples(), torch.randn(6, 4, generator=generator), cpu_ids(2))
    assert not report.ok
    [failure] = report.failures
    assert (failure.kind, failure.name, failure.against) == ("buffer", "seen", "full batch")
    assert "belongs to no batch-statistics layer" in failure.note
    assert not report.batch_statistics


def test_verify_fails_on_an_output_that_depends_on_the_batch_without_batch_statistics(generator):
    model = nn.Sequential(nn.Linear(16, 8), BatchCentering(), nn.Tanh(), nn.Linear(8, 4))
    report = minidp.verify(model, torch.randn(6, 16, generator=generator), cpu_ids(2))
    assert not report.ok
    assert {c.kind for c in report.failures} == {"output", "gradient"}
    assert all(c.against == "full batch" and "no batch-statistics layer explains it" in c.note for c in report.failures)


def test_verify_fails_on_batch_dependence_that_a_batchnorm_beside_it_does_not_explain(generator):
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), BatchCentering(), nn.Tanh(), nn.Linear(8, 4))
    report = minidp.verify(model, torch.randn(6, 16, generator=generator), cpu_ids(2))
    assert not report.ok
    assert "output" in {c.kind for c in report.failures}
    assert all("with every BatchNorm on running statistics too" in c.note for c in report.failures)
    # BatchNorm's running statistics do differ from the full batch: that much it explains
    assert report.batch_statistics == ["1 (BatchNorm1d)"]


def test_verify_puts_differences_down_to_a_layer_named_in_batch_dependent(generator):
    model = nn.Sequential(nn.Linear(16, 8), BatchCentering(), nn.Tanh(), nn.Linear(8, 4))
    report = minidp.verify(model, torch.randn(6, 16, generator=generator), cpu_ids(2), batch_dependent=(BatchCentering,))
    assert report.ok and report.batch_dependent, str(report)
    assert report.batch_statistics == ["1 (BatchCentering)"]


def test_verify_refuses_a_batch_dependent_that_is_not_a_module_type(generator):
    with pytest.raises(TypeError, match="batch_dependent must hold nn.Module subclasses"):
        minidp.verify(MLP(), torch.randn(4, 16, generator=generator), cpu_ids(2), batch_dependent=("BatchCentering",))


class MustNotRun(nn.Linear):
    """A model for the refusals that come before anything runs: its forward fails the test."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("verify ran the model before refusing its arguments")


@pytest.mark.parametrize("rows", [0, 1])
def test_verify_refuses_a_batch_that_gives_fewer_than_two_replicas_a_chunk_before_running_anything(generator, rows):
    """One row is one chunk, which DataParallel runs as one plain call; no row, empty chunks: either way nothing
    data-parallel would be compared, and the report would say OK about nothing."""
    message = rf"inputs\[0\] has {rows} rows? along dim 0, which gives {rows} of the 4 replicas a chunk: .* at least 2 rows"
    with pytest.raises(ValueError, match=message):
        minidp.verify(MustNotRun(16, 4), torch.randn(rows, 16, generator=generator), cpu_ids(4))


def test_verify_refuses_a_single_device_before_running_anything(generator):
    with pytest.raises(ValueError, match=r"device_ids names one device \(cpu\): .* at least two replicas"):
        minidp.verify(MustNotRun(16, 4), torch.randn(6, 16, generator=generator), cpu_ids(1))


@pytest.mark.parametrize("norm, name", [
    (lambda: nn.SyncBatchNorm(8), "1 (SyncBatchNorm)"),
    (lambda: nn.BatchNorm1d(8, track_running_stats=False), "1 (BatchNorm1d)"),
], ids=["SyncBatchNorm", "BatchNorm without running statistics"])
def test_verify_explains_the_batch_statistics_of_batchnorm_kin_and_names_them(generator, norm, name):
    model = nn.Sequential(nn.Linear(16, 8), norm(), nn.Tanh(), nn.Linear(8, 4))
    report = minidp.verify(model, torch.randn(6, 16, generator=generator), cpu_ids(2))
    assert report.ok and report.batch_dependent, str(report)
    assert report.batch_statistics == [name]


@pytest.mark.parametrize("replicas", [2, 3])
def test_verify_passes_minidps_syncbatchnorm_whose_replicas_compute_the_full_batch(generator, replicas):
    # Its replicas meet, so the chunked reference runs its chunks side by side where they meet too (minidp.reference);
    # chunk by chunk, each normalised by its own statistics, the reference had the step FAIL by 2 to 38%.
    model = minidp.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4)))
    report = minidp.verify(model, torch.randn(7, 16, generator=generator), cpu_ids(replicas))
    assert report.ok and not report.batch_dependent, str(report)


def test_verify_explains_the_running_statistics_of_a_tracking_instancenorm(generator):
    # InstanceNorm normalizes each sample by itself; only its running statistics average over the batch.
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.InstanceNorm1d(4, track_running_stats=True), nn.Flatten(), nn.Linear(24, 2))
    report = minidp.verify(model, torch.randn(6, 3, 8, generator=generator), cpu_ids(2))
    assert report.ok and report.batch_dependent, str(report)
    assert {c.kind for c in report.info if not c.ok} == {"buffer"}
    assert report.batch_statistics == ["1 (InstanceNorm1d)"]


# --------------------------------------------------------------------------------------------------
# Outputs that gather rebuilds from their items (Hugging Face's DynamicCache): compared item by item
# --------------------------------------------------------------------------------------------------


class ReturnsAPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.linear(x)
        return {"y": y, "pair": LayerCache([(2 * y, torch.tanh(y))])}


class ShiftsTheLastReplicasSecondItem(minidp.DataParallel):
    """A broken step: the last replica's second item of the pair is off by one when it reaches the gather."""

    def gather(self, outputs, output_device):
        (first, second), = outputs[-1]["pair"]
        outputs[-1]["pair"] = LayerCache([(first, second + 1)])
        return super().gather(outputs, output_device)


def test_verify_passes_an_output_object_rebuilt_from_its_items_comparing_each_item(generator):
    report = minidp.verify(ReturnsAPair(), torch.randn(6, 4, generator=generator), cpu_ids(2))
    assert report.ok, str(report)
    assert {"output['pair'][0][0]", "output['pair'][0][1]"} <= {c.name for c in report.checks if c.kind == "output"}


def test_verify_fails_on_an_item_that_one_replica_gets_wrong_inside_such_an_object(generator):
    report = minidp.verify(ReturnsAPair(), torch.randn(6, 4, generator=generator), cpu_ids(2),
                           wrapper=ShiftsTheLastReplicasSecondItem)
    assert {c.name for c in report.failures if c.kind == "output"} == {"output['pair'][0][1]"}


def test_verify_passes_gpt2_with_its_key_value_cache(generator):
    """GPT-2 returns its ``DynamicCache`` (``use_cache`` is on by default); gathered, it equals the one-device cache."""
    transformers = library("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    report = minidp.verify(transformers.GPT2LMHeadModel(config), torch.randint(0, 50, (6, 10), generator=generator),
                           cpu_ids(2))
    assert report.ok, str(report)
    assert any(c.name.endswith("'][1][1]") for c in report.checks if c.kind == "output")  # layer 1's values, compared


# --------------------------------------------------------------------------------------------------
# torchvision models: Dropout, stochastic depth, BatchNorm over two values, zero-gradient shifts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "efficientnet_b0", "shufflenet_v2_x0_5"])
def test_verify_passes_on_torchvision_models(generator, two_intra_op_threads, name):
    models = library("torchvision.models")
    model = getattr(models, name)(num_classes=10)
    # 32x32: the last feature maps are 1x1, so BatchNorm there normalizes over 2 values per channel
    report = minidp.verify(model, torch.randn(4, 3, 32, 32, generator=generator), cpu_ids(2))
    assert report.ok, str(report)
    assert report.batch_statistics


class MasksLogits(nn.Module):
    """Logits with the masked places at -inf, as attention masks and constrained decoding make them."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.arange(6) % 2 == 0
        return self.head(x).masked_fill(~mask, float("-inf"))


def test_verify_passes_outputs_with_infinities_in_the_same_places(generator):
    # inf - inf is NaN: equal infinities read as a NaN error, and the report failed on equal outputs
    report = minidp.verify(MasksLogits(), torch.randn(6, 4, generator=generator), cpu_ids(2),
                           loss=lambda out: out[:, ::2].sum())
    assert report.ok, str(report)


class KeepsAnAverageCopy(nn.Module):
    """A moving average of its layer's weights updated inside forward, over ``parameters()`` (the MoCo idiom)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.average = nn.Linear(4, 3), nn.Linear(4, 3)
        self.average.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for average, current in zip(self.average.parameters(), self.layer.parameters()):
                average.mul_(0.9).add_(current, alpha=0.1)
        return self.layer(x)


def test_verify_fails_on_a_parameter_that_forward_updates_and_names_it(generator):
    # On one device the average moves once; a replica's parameters() is empty, so under DataParallel it never moved,
    # and verify, which compared outputs, gradients and buffers only, said OK
    report = minidp.verify(KeepsAnAverageCopy(), torch.randn(6, 4, generator=generator), cpu_ids(2))
    assert not report.ok
    assert {c.name for c in report.failures} == {"average.weight", "average.bias"}
    assert all(c.kind == "parameter" and "changed by forward" in c.note for c in report.failures)


class CountsTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.head(x), "tokens": int(x.shape[0])}


def test_verify_says_which_outputs_it_left_out_of_the_full_batch_comparison(generator):
    # gather makes a list of the replicas' numbers ([3, 3]) where one device returns one (6): not compared, and said so
    report = minidp.verify(CountsTokens(), torch.randn(6, 4, generator=generator), cpu_ids(2),
                           loss=lambda out: out["logits"].sum())
    assert report.ok
    assert any(note.startswith("not compared with the full batch: output['tokens']") for note in report.notes)


class ReturnsItsLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).square().mean()


def test_verify_explains_a_0_dim_output_gathered_into_a_vector(generator):
    # docs/stock-behaviour.md B30: gather stacks 0-dim outputs into a vector; the report blamed a forward that
    # depends on the batch
    report = minidp.verify(ReturnsItsLoss(), torch.randn(6, 4, generator=generator), cpu_ids(2),
                           loss=lambda out: out.sum())
    output = next(c for c in report.failures if c.kind == "output")
    assert "gather stacks the replicas' 0-dim outputs" in output.note


class ScalesTheFiniteGradient(minidp.DataParallel):
    """A broken reduction: every finite entry of the first layer's weight gradient 1% too large."""

    def forward(self, *inputs, **kwargs):
        output = super().forward(*inputs, **kwargs)
        weight = self.module.weight
        weight.register_hook(lambda g: torch.where(g.isfinite(), g * 1.01, g))
        return output


def test_verify_fails_a_wrong_gradient_beside_an_infinity_in_the_same_place(generator):
    # The layer's scale is its largest finite gradient: an infinity made it infinite, and every error relative to it 0
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    x[:, 0] = 1e300  # one column of the weight's gradient overflows to inf in every run
    report = minidp.verify(nn.Linear(4, 3), x, cpu_ids(2), wrapper=ScalesTheFiniteGradient,
                           loss=lambda out: (out * 1e10).sum())
    assert not report.ok and any(c.name == "weight" and c.kind == "gradient" for c in report.failures)
