"""minidp.SyncBatchNorm: K replicas compute what nn.BatchNorm computes on the full batch.

The reference is stock ``nn.BatchNorm1d/2d/3d`` called once on the whole batch, in float64, from
the same state: outputs, input gradients, weight and bias gradients, running statistics and
``num_batches_tracked`` must agree to ``RTOL_FLOAT64``, for even and uneven chunks. Steps that
involve K > 1 replicas run under ``finishes_within``, so a meeting that hangs fails the test.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Callable

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import minidp
from minidp.distributed.launch import loopback_interface
from minidp.replica_group import ReplicaGroup, ReplicaGroupError, current
from minidp.torch_versions import BATCHNORM_TAKES_BIAS

from .helpers import RTOL_FLOAT64, cpu_ids, finishes_within, fresh_python, max_relative_error, requires_cuda

BOUND_S = 20.0
CHANNELS = 3
BATCHNORM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
FEATURE_SHAPE = {2: (), 3: (5,), 4: (4, 3), 5: (2, 3, 2)}  # (N, C, *these)
# (replicas, batch): even chunks, and uneven ones: 10 on 3 is 4, 4, 2; 7 on 4 is 2, 2, 2, 1.
SPLITS = [(2, 8), (3, 10), (4, 7)]


def batchnorm_pair(rank: int, generator: torch.Generator, **options) -> tuple[nn.Module, minidp.SyncBatchNorm]:
    """A stock BatchNorm for inputs of ``rank`` with random affine parameters, and a SyncBatchNorm in its state."""
    reference = BATCHNORM[rank](CHANNELS, dtype=torch.float64, **options)
    with torch.no_grad():
        if reference.weight is not None:
            reference.weight.copy_(torch.rand(CHANNELS, generator=generator, dtype=torch.float64) + 0.5)
        if reference.bias is not None:
            reference.bias.copy_(torch.randn(CHANNELS, generator=generator, dtype=torch.float64))
    sync = minidp.SyncBatchNorm(CHANNELS, dtype=torch.float64, **options)
    sync.load_state_dict(reference.state_dict())
    return reference, sync


def batch(rank: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Inputs with a per-channel offset and scale, so that the statistics are not those of N(0, 1)."""
    shape = (rows, CHANNELS, *FEATURE_SHAPE[rank])
    offset = torch.randn(CHANNELS, generator=generator, dtype=torch.float64).view(1, -1, *[1] * (rank - 2))
    return 3 * offset + (offset.abs() + 0.5) * torch.randn(shape, generator=generator, dtype=torch.float64)


def forward_backward(model: nn.Module, x: torch.Tensor, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of ``model(x)`` and the gradient of ``(output * grad_output).sum()`` with respect to ``x``."""
    x = x.clone().requires_grad_()
    output = model(x)
    output.backward(grad_output)
    return output.detach(), x.grad


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    error = max_relative_error(actual, expected)
    assert error < RTOL_FLOAT64, f"{what}: relative error {error:.2e}"


def assert_same_state(sync: nn.Module, reference: nn.Module) -> None:
    """Parameter gradients and buffers of ``sync`` (wrapped or not) equal those of ``reference``."""
    for (name, mine), (_, theirs) in zip(sync.named_parameters(), reference.named_parameters()):
        if theirs.grad is None:  # frozen
            assert mine.grad is None, f"{name}.grad: stock has none"
        else:
            assert_close(mine.grad, theirs.grad, f"{name}.grad")
    for (name, mine), (_, theirs) in zip(sync.named_buffers(), reference.named_buffers()):
        if name.endswith("num_batches_tracked"):
            assert torch.equal(mine, theirs), f"{name}: {mine.item()} batches, stock counts {theirs.item()}"
        else:
            assert_close(mine, theirs, name)


def steps_agree(
    reference: nn.Module, parallel: nn.Module, inputs: list[torch.Tensor], generator: torch.Generator
) -> Callable[[], None]:
    """A function that runs one step per input on both models and checks outputs and input gradients."""
    grad_outputs = [torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device) for x in inputs]

    def run() -> None:
        for step, (x, grad_output) in enumerate(zip(inputs, grad_outputs)):
            expected, expected_grad = forward_backward(reference, x, grad_output)
            output, grad = forward_backward(parallel, x, grad_output)
            assert_close(output, expected, f"step {step}: output")
            assert_close(grad, expected_grad, f"step {step}: input gradient")

    return run


class BatchNormThenReLU(nn.BatchNorm2d):
    """A BatchNorm with a forward of its own, as timm's ``BatchNormAct2d``: normalisation, then its ``act`` child."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


def test_converting_a_batchnorm_with_a_forward_of_its_own_warns_that_it_is_not_kept():
    """``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` swaps such a layer for a plain SyncBatchNorm, silently: its
    ``act`` stays a child but is never called. minidp converts alike (a drop-in), and says so, naming the class."""
    with pytest.warns(UserWarning, match=r"BatchNormThenReLU is a BatchNorm with a forward of its own.*\['act'\]"):
        converted = minidp.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(BatchNormThenReLU(3)))
    stock = torch.nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(BatchNormThenReLU(3)))
    assert type(converted[0]) is minidp.SyncBatchNorm and type(stock[0]) is nn.SyncBatchNorm
    assert isinstance(converted[0].act, nn.ReLU) and isinstance(stock[0].act, nn.ReLU)


def test_converting_plain_batchnorm_layers_warns_of_nothing(generator):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minidp.SyncBatchNorm.convert_sync_batchnorm(conv_net(generator))
        minidp.SyncBatchNorm.convert_sync_batchnorm(torch.nn.SyncBatchNorm.convert_sync_batchnorm(conv_net(generator)))


def test_converting_a_converted_model_again_gives_its_layers_the_new_process_group(generator):
    """torch's converter converts its own SyncBatchNorm layers too: a model converted with one group and then with
    another ends with the other (minidp's kept the first)."""
    ours = minidp.SyncBatchNorm.convert_sync_batchnorm(minidp.SyncBatchNorm.convert_sync_batchnorm(conv_net(generator),
                                                                                                  "first"), "second")
    stock = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        conv_net(generator), "first"), "second")
    assert [m.process_group for m in ours.modules() if isinstance(m, minidp.SyncBatchNorm)] == ["second"] * 3
    assert [m.process_group for m in stock.modules() if isinstance(m, nn.SyncBatchNorm)] == ["second"] * 3


@pytest.mark.parametrize("cache_replicas", [True, False], ids=["cached", "fresh"])
@pytest.mark.parametrize("rank", sorted(FEATURE_SHAPE))
@pytest.mark.parametrize("replicas,rows", SPLITS)
def test_k_replicas_equal_batchnorm_on_the_full_batch(generator, replicas, rows, rank, cache_replicas):
    """Outputs, input and parameter gradients, running statistics after two steps: stock BatchNorm's."""
    reference, sync = batchnorm_pair(rank, generator)
    parallel = minidp.DataParallel(sync, cpu_ids(replicas), cache_replicas=cache_replicas)
    inputs = [batch(rank, rows, generator) for _ in range(2)]
    finishes_within(BOUND_S, steps_agree(reference, parallel, inputs, generator))
    assert_same_state(sync, reference)
    assert parallel.replica_cache_info().hits == (1 if cache_replicas else 0)  # step 2 re-bound step 1's replicas


@pytest.mark.parametrize("rank, order", [(2, (1, 0)), (3, (0, 2, 1)), (4, (0, 2, 3, 1)), (5, (0, 2, 3, 4, 1))],
                         ids=["transposed_2d", "transposed_3d", "channels_last", "channels_last_3d"])
def test_each_replicas_output_is_laid_out_as_batchnorms(generator, rank, order):
    """nn.BatchNorm's output is contiguous, or channels-last for a channels-last input, whatever the input's strides;
    the synchronised multiply-add kept a transposed input's, and a model that views it (``y.view(n, -1)``) ran on one
    device and failed on the replicas."""
    reference, sync = batchnorm_pair(rank, generator)
    shape = [8, CHANNELS, *FEATURE_SHAPE[rank]]
    laid_out = [shape[d] for d in order]  # the dimensions in memory order, outermost first
    back = sorted(range(rank), key=order.__getitem__)  # the permutation that puts them back as (N, C, *)
    x = torch.randn(*laid_out, generator=generator, dtype=torch.float64).permute(*back)
    assert list(x.shape) == shape and not x.is_contiguous()
    expected = reference(x)
    model = minidp.DataParallel(sync, cpu_ids(2), gather_output=False)
    outputs = finishes_within(BOUND_S, lambda: model(x))
    for output, rows in zip(outputs, expected.split(4)):
        assert output.stride() == rows.contiguous(memory_format=_layout_of(expected)).stride()


def _layout_of(tensor: torch.Tensor) -> torch.memory_format:
    for layout in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        if tensor.dim() == {torch.channels_last: 4, torch.channels_last_3d: 5}.get(layout, tensor.dim()) \
                and tensor.is_contiguous(memory_format=layout):
            return layout
    raise AssertionError(f"no layout of BatchNorm's: strides {tensor.stride()}")


@pytest.mark.cuda
@requires_cuda
def test_replicas_sharing_one_gpu_on_side_streams_equal_batchnorm_on_the_full_batch(generator):
    """Replicas 1.. run on side streams: each reads the others' statistics only once they are written."""
    reference, sync = batchnorm_pair(4, generator)
    reference.cuda(), sync.cuda()
    parallel = minidp.DataParallel(sync, [0, 0, 0])
    inputs = [batch(4, rows, generator).cuda() for rows in (10, 7)]
    finishes_within(BOUND_S, steps_agree(reference, parallel, inputs, generator))
    assert_same_state(sync, reference)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum=0.1", "cumulative"])
def test_running_statistics_follow_batchnorm_over_several_steps(generator, momentum):
    """``momentum=None`` is BatchNorm's cumulative average, 1 / num_batches_tracked: counted once per step."""
    reference, sync = batchnorm_pair(4, generator, momentum=momentum)
    parallel = minidp.DataParallel(sync, cpu_ids(3))
    for rows in (10, 7, 9):
        finishes_within(BOUND_S, steps_agree(reference, parallel, [batch(4, rows, generator)], generator))
        assert_same_state(sync, reference)
    assert sync.num_batches_tracked.item() == 3


NEEDS_BATCHNORM_BIAS = pytest.mark.skipif(not BATCHNORM_TAKES_BIAS, reason="nn.BatchNorm takes `bias` from torch 2.12 on")
NO_BIAS = {"bias": False} if BATCHNORM_TAKES_BIAS else {}  # torch 2.11's BatchNorm always has its bias


@pytest.mark.parametrize(
    "options",
    [{"affine": False}, pytest.param({"bias": False}, marks=NEEDS_BATCHNORM_BIAS), {"eps": 0.1}],
    ids=["affine=False", "bias=False", "eps=0.1"],
)
def test_the_constructor_options_mean_what_they_mean_for_batchnorm(generator, options):
    reference, sync = batchnorm_pair(4, generator, **options)
    parallel = minidp.DataParallel(sync, cpu_ids(3))
    finishes_within(BOUND_S, steps_agree(reference, parallel, [batch(4, 10, generator)], generator))
    assert_same_state(sync, reference)


def test_the_constructor_and_convert_sync_batchnorm_take_torchs_arguments_in_torchs_order():
    """torch.nn.SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype)
    and its convert_sync_batchnorm(module, process_group=None): minidp's take the same, so a positional call means
    the same; the layers keep the group (the processes they span under minidp's DDP, tests/test_ddp_features.py)."""
    for function in (lambda cls: cls, lambda cls: cls.convert_sync_batchnorm):
        positional = [
            [name for name, p in inspect.signature(function(cls)).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
            for cls in (minidp.SyncBatchNorm, nn.SyncBatchNorm)
        ]
        assert positional[0] == positional[1]
    group = object()  # a stand-in: the layer only keeps it
    assert minidp.SyncBatchNorm(CHANNELS, 1e-5, 0.1, True, True, group).process_group is group
    converted = minidp.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(CHANNELS)), group)
    assert converted[0].process_group is group
    assert minidp.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(CHANNELS)).process_group is None


@pytest.mark.skipif(BATCHNORM_TAKES_BIAS, reason="this torch's BatchNorm takes `bias`")
def test_bias_false_where_batchnorm_has_no_such_option_is_refused_with_the_torch_it_needs():
    with pytest.raises(TypeError, match=r"SyncBatchNorm\(bias=False\) needs torch 2.12 or newer.*freeze it"):
        minidp.SyncBatchNorm(CHANNELS, bias=False)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_without_running_statistics_every_mode_normalises_by_the_full_batch(generator, training):
    """``track_running_stats=False``: BatchNorm uses batch statistics in eval mode too, so the replicas meet."""
    reference, sync = batchnorm_pair(3, generator, track_running_stats=False)
    reference.train(training), sync.train(training)
    parallel = minidp.DataParallel(sync, cpu_ids(3))
    finishes_within(BOUND_S, steps_agree(reference, parallel, [batch(3, 10, generator)], generator))
    assert_same_state(sync, reference)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_processes_exchange_statistics_in_training_only_as_torch_sync_batchnorm(generator, training):
    """torch.nn.SyncBatchNorm synchronises only when ``self.training`` (its ``need_sync``): in eval mode without
    running statistics each process normalises by its own batch, so a rank may run inference alone."""
    reference, sync = batchnorm_pair(3, generator, track_running_stats=False)
    reference.train(training), sync.train(training)
    exchanges = []
    sync.across_processes = lambda statistics: exchanges.append(statistics) or statistics  # a world of one process
    x = batch(3, 6, generator)
    assert_close(sync(x), reference(x), "output")
    assert len(exchanges) == (1 if training else 0)


def test_eval_mode_normalises_by_running_statistics_without_meeting(generator, monkeypatch):
    reference, sync = batchnorm_pair(4, generator)
    meetings = []
    real_meet = ReplicaGroup.meet

    def counted_meet(self, *args, **kwargs):
        meetings.append(args)
        return real_meet(self, *args, **kwargs)

    monkeypatch.setattr(ReplicaGroup, "meet", counted_meet)
    parallel = minidp.DataParallel(sync, cpu_ids(3))
    finishes_within(BOUND_S, steps_agree(reference, parallel, [batch(4, 10, generator)], generator))
    assert len(meetings) == 3  # training: one meeting per replica

    reference.eval(), sync.eval()
    finishes_within(BOUND_S, steps_agree(reference, parallel, [batch(4, 10, generator)], generator))
    assert len(meetings) == 3  # eval: none
    assert_same_state(sync, reference)


@pytest.mark.parametrize("call", ["plain call", "one-device DataParallel", "one-module parallel_apply"])
def test_without_other_replicas_it_is_batchnorm_exactly(generator, call):
    """Nothing to synchronise: the very ``F.batch_norm`` call of stock BatchNorm (bitwise equal)."""
    reference, sync = batchnorm_pair(4, generator)
    model = {
        "plain call": sync,
        "one-device DataParallel": minidp.DataParallel(sync, cpu_ids(1)),
        "one-module parallel_apply": lambda x: minidp.parallel_apply([sync], [x])[0],
    }[call]
    x, grad_output = batch(4, 6, generator), torch.randn(6, CHANNELS, 4, 3, generator=generator, dtype=torch.float64)
    output, grad = forward_backward(model, x, grad_output)
    expected, expected_grad = forward_backward(reference, x, grad_output)
    assert torch.equal(output, expected) and torch.equal(grad, expected_grad)
    for mine, theirs in zip(sync.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
    for mine, theirs in zip(sync.buffers(), reference.buffers()):
        assert torch.equal(mine, theirs)


def test_second_derivatives_equal_batchnorms(generator):
    """A gradient penalty (``create_graph=True``, then backward) differentiates the statistics twice."""
    reference = nn.Sequential(nn.Linear(4, CHANNELS, bias=False), nn.BatchNorm1d(CHANNELS), nn.Tanh()).double()
    model = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    parallel = minidp.DataParallel(model, cpu_ids(3))
    x = torch.randn(10, 4, generator=generator, dtype=torch.float64)

    def penalty_gradient(network: nn.Module) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(network(leaf).pow(3).sum(), leaf, create_graph=True)
        grad.square().sum().backward()
        return leaf.grad

    assert_close(finishes_within(BOUND_S, lambda: penalty_gradient(parallel)), penalty_gradient(reference), "x.grad")
    assert_same_state(model, reference)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_half_precision_input_is_normalised_to_batchnorms_accuracy(generator, dtype):
    # BatchNorm's kernel computes in float32 and rounds once; rounding scale and shift to the input's dtype first, the
    # layer was 13 (bfloat16) and 19 (float16) units of rounding off where the mean is large against the spread.
    reference = nn.BatchNorm2d(CHANNELS)
    model = minidp.DataParallel(minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference)), cpu_ids(3))
    x = (torch.randn(12, CHANNELS, 8, 8, generator=generator) + 20).to(dtype)
    exact = copy.deepcopy(reference).double()(x.double())
    unit = torch.finfo(dtype).eps
    batchnorm_error = (reference(x).double() - exact).abs().max().item() / unit
    assert (model(x).double() - exact).abs().max().item() / unit <= batchnorm_error + 1


def float32_error_sums(generator: torch.Generator, draws: int = 24) -> dict[str, tuple[float, float]]:
    """Float32 BatchNorm on the whole batch and SyncBatchNorm on 3 replicas, against float64 BatchNorm, on inputs whose
    mean is 1000 times their spread: per quantity ("output", "gradients": of the input and the weight), the sums over
    ``draws`` draws of each one's relative error, (SyncBatchNorm's, BatchNorm's)."""
    sums = {"output": [0.0, 0.0], "gradients": [0.0, 0.0]}
    for _ in range(draws):
        reference, _ = batchnorm_pair(4, generator)
        reference.float()
        model = minidp.DataParallel(minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference)), cpu_ids(3))
        # Values that float32 holds exactly, so that both layers' errors are their own, not the input's rounding.
        x = (1000 + torch.randn(10, CHANNELS, 4, 3, generator=generator)).double()
        grad_output = torch.randn(x.shape, generator=generator).double()

        def results(network: nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
            output, grad = forward_backward(network, x.to(dtype), grad_output.to(dtype))
            layer = network.module if isinstance(network, minidp.DataParallel) else network
            return [output.double(), grad.double(), layer.weight.grad.double()]

        exact = results(copy.deepcopy(reference).double(), torch.float64)
        for column, network in enumerate((model, reference)):
            errors = [max_relative_error(*pair) for pair in zip(results(network, torch.float32), exact)]
            sums["output"][column] += errors[0]
            sums["gradients"][column] += errors[1] + errors[2]
    return {quantity: (mine, batchnorms) for quantity, (mine, batchnorms) in sums.items()}


def test_a_float32_output_keeps_batchnorms_accuracy_where_the_mean_is_far_from_the_spread(generator):
    # BatchNorm's kernel rounds each multiply-add once (x * scale + shift, and shift = bias - mean * scale, fused);
    # rounded after each multiply and each add, with float32 statistics, the output was 2.4 to 3.6 times BatchNorm's
    # error over 24 draws (10 seeds), now 1.0 to 1.5 (30 seeds).
    mine, batchnorms = float32_error_sums(generator)["output"]
    assert mine <= 2 * batchnorms, f"{mine / batchnorms:.2f} times BatchNorm's error"


def test_float32_gradients_keep_batchnorms_accuracy_where_the_mean_is_far_from_the_spread(generator):
    # BatchNorm's CPU kernel differentiates through the deviations from the mean, sum(dy * (x - mean)), and sums the
    # statistics in float64. Differentiated as x * scale + shift, the layer took sum(dy * x) and mean * sum(dy) apart,
    # and they cancel: 5.3 to 9.7 times BatchNorm's error over 24 draws (8 seeds), now 1.00 to 1.01 (16 seeds).
    mine, batchnorms = float32_error_sums(generator)["gradients"]
    assert mine <= 2 * batchnorms, f"{mine / batchnorms:.2f} times BatchNorm's error"


def test_the_float32_running_variance_keeps_batchnorms_accuracy_where_the_mean_is_far_from_the_spread(generator):
    # The variance of the batch takes in the squared distances between the chunks' means: rounded to float32, each
    # mean's rounding (at a mean 1000 times the spread, a thousandth of the spread) came into the variance, 120 to 330
    # times BatchNorm's error, which sums in float64 (10 seeds); the chunks' statistics are float64 now: 0.7 to 1.6
    # (40 seeds).
    reference_error = sync_error = 0.0
    for _ in range(8):
        reference = nn.BatchNorm2d(CHANNELS, momentum=1.0)  # the running variance is the batch's unbiased variance
        sync = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
        x = 1000 + torch.randn(10, CHANNELS, 4, 3, generator=generator)
        exact = x.double().var((0, 2, 3))
        reference(x)
        minidp.DataParallel(sync, cpu_ids(3))(x)
        reference_error += max_relative_error(reference.running_var.double(), exact)
        sync_error += max_relative_error(sync.running_var.double(), exact)
    assert sync_error <= 3 * reference_error, f"{sync_error / reference_error:.2f} times BatchNorm's error"


def test_the_chunked_reference_runs_a_synchronised_model_in_the_callers_autocast(generator):
    # its chunks run side by side in threads of their own, which start without the caller's autocast: they ran in
    # float32 where DataParallel's replicas run in bfloat16, and verify under autocast reported FAILED
    model = minidp.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, CHANNELS), nn.BatchNorm1d(CHANNELS)))
    x = torch.randn(10, 4, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = minidp.reference.chunked_reference(copy.deepcopy(model), (x,), replicas=2)
        parallel = minidp.DataParallel(model, cpu_ids(2))(x)
    assert reference.dtype == parallel.dtype == torch.bfloat16


class CheckpointsTheNorm(nn.Module):
    """Linear, then BatchNorm and tanh under activation checkpointing, then Linear."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.linear, self.bn, self.out = nn.Linear(4, CHANNELS), nn.BatchNorm1d(CHANNELS), nn.Linear(CHANNELS, 2)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recomputed = torch.utils.checkpoint.checkpoint(
            lambda h: torch.tanh(self.bn(h)), self.linear(x), use_reentrant=self.use_reentrant
        )
        return self.out(recomputed)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_layer_that_met_replicas_and_is_recomputed_in_the_backward_is_refused(generator, use_reentrant):
    # Recomputed in the backward, the layer runs alone: re-entrant checkpointing gave the chunk's statistics and wrong
    # gradients (43% off on the first weight), the other a CheckpointError about saved tensor counts. The refusal comes
    # before the reduction: the original parameters get no gradient.
    model = minidp.SyncBatchNorm.convert_sync_batchnorm(CheckpointsTheNorm(use_reentrant).double())
    output = minidp.DataParallel(model, cpu_ids(2))(torch.randn(10, 4, generator=generator, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="run again in the backward, alone"):
        output.square().sum().backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("met_as", ["copies", "itself"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_layer_recomputed_without_other_replicas_is_batchnorm_exactly(generator, use_reentrant, met_as):
    """Nothing to synchronise (a plain call), nothing refused: checkpointing recomputes BatchNorm's own call, though the
    layer met replicas before (as DataParallel's copies, or itself, run as every replica of a parallel_apply)."""
    reference = CheckpointsTheNorm(use_reentrant).double()
    model = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    chunks = torch.randn(10, 4, generator=generator, dtype=torch.float64).chunk(2)
    with torch.no_grad():  # met, no backward
        if met_as == "copies":
            minidp.DataParallel(model, cpu_ids(2))(torch.cat(chunks))
        else:
            minidp.parallel_apply([model, model], [(c,) for c in chunks], devices=cpu_ids(2))
    model.load_state_dict(reference.state_dict())  # the running statistics as before the meeting
    x = torch.randn(10, 4, generator=generator, dtype=torch.float64)
    for network in (model, reference):
        network.zero_grad()
        network(x).square().sum().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


def test_a_layer_called_twice_in_one_forward_meets_twice(generator):
    """Each call is its own meeting, and each updates the running statistics, as BatchNorm's calls do."""

    class Twice(nn.Module):
        def __init__(self, norm: nn.Module) -> None:
            super().__init__()
            self.norm = norm

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.norm(x).tanh())

    reference, sync = batchnorm_pair(2, generator)
    parallel = minidp.DataParallel(Twice(sync), cpu_ids(3))
    finishes_within(BOUND_S, steps_agree(Twice(reference), parallel, [batch(2, 10, generator)], generator))
    assert_same_state(sync, reference)
    assert sync.num_batches_tracked.item() == 2


@pytest.mark.parametrize("inner", [2, 1], ids=["two inner replicas", "one inner replica"])
def test_a_layer_inside_a_nested_data_parallel_normalises_by_the_whole_batch(generator, inner):
    """A data_parallel inside each replica of an outer DataParallel (the tutorial's ``data_parallel`` in ``forward``,
    wrapped again): the inner call's replicas meet, and its replica 0 meets the other outer replicas' in the outer
    call's group, so every chunk of every level counts, as in BatchNorm on the full batch."""

    class Inner(nn.Module):
        def __init__(self, norm: nn.Module) -> None:
            super().__init__()
            self.norm = norm

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if inner == 1:  # data_parallel on one device calls the layer itself: a parallel_apply of one replica nests
                return minidp.parallel_apply([self.norm], [x])[0]
            return minidp.data_parallel(self.norm, x, cpu_ids(inner))

    reference, sync = batchnorm_pair(2, generator)
    parallel = minidp.DataParallel(Inner(sync), cpu_ids(3))
    finishes_within(BOUND_S, steps_agree(reference, parallel, [batch(2, 13, generator), batch(2, 8, generator)], generator))
    assert_same_state(sync, reference)


def test_an_empty_chunk_adds_nothing_to_the_statistics(generator):
    """parallel_apply called directly, with chunks of 4, 0 and 3 rows: the statistics of the 7 rows."""
    reference, sync = batchnorm_pair(2, generator)
    x = batch(2, 7, generator).requires_grad_()
    grad_output = torch.randn(x.shape, generator=generator, dtype=torch.float64)

    def run() -> torch.Tensor:
        replicas = minidp.replicate(sync, cpu_ids(3))
        return torch.cat(minidp.parallel_apply(replicas, list(x.split([4, 0, 3]))))

    output = finishes_within(BOUND_S, run)
    output.backward(grad_output)
    expected, expected_grad = forward_backward(reference, x.detach(), grad_output)
    assert_close(output, expected, "output")
    assert_close(x.grad, expected_grad, "input gradient")
    assert_same_state(sync, reference)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_an_empty_batch_gives_an_empty_output_as_batchnorm(generator, momentum):
    """BatchNorm on no rows returns no rows, counts the batch and leaves its running statistics (its kernel returns at
    once): so across replicas that each got none (DataParallel runs every replica on nothing, docs/stock-behaviour.md
    B15)."""
    reference, sync = batchnorm_pair(2, generator, momentum=momentum)
    x = batch(2, 0, generator).requires_grad_()
    expected = reference(x)
    output = finishes_within(BOUND_S, lambda: minidp.DataParallel(sync, cpu_ids(2))(x))
    assert output.shape == expected.shape == x.shape
    output.sum().backward()
    expected.sum().backward()
    for (name, mine), theirs in zip(sync.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad), name
    for (name, mine), theirs in zip(sync.named_buffers(), reference.buffers(), strict=True):
        assert torch.equal(mine, theirs), name


def test_one_value_per_channel_across_all_replicas_is_refused_as_batchnorm_refuses_it(generator):
    reference, sync = batchnorm_pair(2, generator)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        reference(batch(2, 1, generator))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training, got 1 across all"):
        minidp.parallel_apply(minidp.replicate(sync, cpu_ids(2)), list(batch(2, 1, generator).split([1, 0])))


def test_an_input_with_the_wrong_channel_count_is_refused_before_any_state_changes(generator):
    _, sync = batchnorm_pair(2, generator)
    before = copy.deepcopy(sync.state_dict())
    parallel = minidp.DataParallel(sync, cpu_ids(2))
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(num_features=3\) got an input with 5 channels"):
        finishes_within(BOUND_S, lambda: parallel(torch.randn(4, 5, dtype=torch.float64)))
    for name, value in sync.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_input_without_channels_is_refused_with_torchs_words_before_any_state_changes(generator, replicas):
    # torch.nn.SyncBatchNorm.forward: _check_non_zero_input_channels, before anything is counted
    _, sync = batchnorm_pair(2, generator)
    before = copy.deepcopy(sync.state_dict())
    with pytest.raises(ValueError, match="^SyncBatchNorm number of input channels should be non-zero$"):
        nn.SyncBatchNorm(3)(torch.randn(4, 0))
    with pytest.raises(ValueError, match="SyncBatchNorm number of input channels should be non-zero"):  # by replica
        minidp.DataParallel(sync, cpu_ids(replicas))(torch.randn(4, 0, dtype=torch.float64))
    for name, value in sync.state_dict().items():
        assert torch.equal(value, before[name]), name


def conv_net(generator: torch.Generator) -> nn.Module:
    """Two conv blocks with BatchNorm2d (one frozen, one cumulative), a head with BatchNorm1d (no bias, where torch
    has the option); float64.
    Layers before a BatchNorm have no bias: BatchNorm removes it, leaving it a gradient of rounding noise."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 5 * 5, 6, bias=False), nn.BatchNorm1d(6, **NO_BIAS), nn.Linear(6, 3),
    ).double()
    model[4].weight.requires_grad_(False)
    return model


def test_convert_sync_batchnorm_keeps_parameters_buffers_flags_and_requires_grad(generator):
    """As ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: the same Parameter and buffer objects,
    the same options and training flag; other modules untouched."""
    model = conv_net(generator)
    model[8].eval()
    before = dict(model.named_modules())
    converted = minidp.SyncBatchNorm.convert_sync_batchnorm(model)
    stock = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(conv_net(generator)))
    assert converted is model  # the root is no BatchNorm: converted in place
    for (name, module), (_, stock_module) in zip(converted.named_modules(), stock.named_modules()):
        original = before[name]
        if not isinstance(original, nn.modules.batchnorm._BatchNorm):
            assert module is original and type(stock_module) is type(original), name
            continue
        assert type(module) is minidp.SyncBatchNorm and type(stock_module) is nn.SyncBatchNorm, name
        assert module.training == original.training
        for option in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            assert getattr(module, option) == getattr(original, option) == getattr(stock_module, option), option
        for key in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert getattr(module, key) is getattr(original, key), f"{name}.{key}"
    assert not converted[4].weight.requires_grad and converted[1].weight.requires_grad
    assert type(minidp.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm3d(2))) is minidp.SyncBatchNorm


@pytest.mark.parametrize("cache_replicas", [True, False], ids=["cached", "fresh"])
def test_a_converted_network_trains_like_the_stock_one_on_the_full_batch(generator, cache_replicas):
    """Two SGD steps of a conv net, converted and on 3 replicas, against the unconverted one on one device."""
    reference = conv_net(generator)
    model = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    parallel = minidp.DataParallel(model, cpu_ids(3), cache_replicas=cache_replicas)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for rows in (10, 8):
        x = torch.randn(rows, 2, 5, 5, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (rows,), generator=generator)
        for optimizer in optimizers:
            optimizer.zero_grad()
        expected = nn.functional.cross_entropy(reference(x), y)
        expected.backward()
        loss = finishes_within(BOUND_S, lambda: nn.functional.cross_entropy(parallel(x), y))
        loss.backward()
        assert_close(loss, expected, "loss")
        assert_same_state(model, reference)
        for optimizer in optimizers:
            optimizer.step()


# ------------------------------------------------------------------------------------------------
# The meeting never hangs: a replica that fails before it, or skips it, releases the others.
# ------------------------------------------------------------------------------------------------


class MisbehavesIn(nn.Module):
    """``norm(x)``, except in replica ``replica`` while ``armed``: there it raises (``"raise"``) or
    skips the layer (``"skip"``)."""

    def __init__(self, norm: nn.Module, replica: int, how: str) -> None:
        super().__init__()
        self.norm, self.replica, self.how = norm, replica, how
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and current().index == self.replica:
            if self.how == "raise":
                raise KeyError("planted fault")
            return x
        return self.norm(x)


@pytest.mark.parametrize("cache_replicas", [True, False], ids=["cached", "fresh"])
@pytest.mark.parametrize(
    "how,replica,raised,message",
    [
        # the failing replica's own error, of its type, as with BatchNorm (stock re-raises a replica's error as its
        # type, parallel_apply.py): not the meeting it ended in the others ("replica 1 raised KeyError: 'planted
        # fault' before reaching SyncBatchNorm 'norm'"), which would hide it from `except KeyError`
        ("raise", 1, KeyError, "Caught KeyError in replica 1 on device cpu"),
        ("skip", 2, ReplicaGroupError, "replica 2 finished its forward without reaching SyncBatchNorm 'norm' (call 1"),
    ],
    ids=["raises", "skips"],
)
def test_a_replica_that_fails_or_skips_the_meeting_releases_the_others_and_the_next_step_works(
    generator, how, replica, raised, message, cache_replicas
):
    reference, sync = batchnorm_pair(2, generator)
    before = copy.deepcopy(sync.state_dict())
    model = MisbehavesIn(sync, replica, how)
    parallel = minidp.DataParallel(model, cpu_ids(3), cache_replicas=cache_replicas)
    x = batch(2, 10, generator)
    with pytest.raises(raised) as caught:
        finishes_within(BOUND_S, lambda: parallel(x))
    assert message in str(caught.value)
    for name, value in sync.state_dict().items():  # no replica updated the statistics
        assert torch.equal(value, before[name]), name

    model.armed = False
    finishes_within(BOUND_S, steps_agree(reference, parallel, [batch(2, 10, generator)], generator))
    assert_same_state(sync, reference)


def test_replicas_that_reach_the_layers_in_different_orders_are_released(generator):
    """Replica 1 runs ``second`` first: each waits where the other never comes, and both are told."""

    class Swapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = minidp.SyncBatchNorm(CHANNELS), minidp.SyncBatchNorm(CHANNELS)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            order = (self.second, self.first) if current().index == 1 else (self.first, self.second)
            return order[1](order[0](x))

    parallel = minidp.DataParallel(Swapped(), cpu_ids(2))
    with pytest.raises(RuntimeError, match="replicas wait at different meetings") as caught:
        finishes_within(BOUND_S, lambda: parallel(torch.randn(6, CHANNELS)))
    assert "replica 0 at SyncBatchNorm 'first'" in str(caught.value)
    assert "replica 1 at SyncBatchNorm 'second'" in str(caught.value)


# Two Gloo processes on the loopback interface, each a SyncBatchNorm no wrapper holds, in a script that imports minidp
# and nothing of minidp.distributed: the worst relative difference of each rank's outputs and running statistics
# from BatchNorm's on both ranks' rows at once.
_LONE_LAYER_IN_A_JOB = """
import socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
import minidp

def rank_main(rank, port, world, differences):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        reference = nn.BatchNorm1d(3, dtype=torch.float64)
        layer = minidp.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3, dtype=torch.float64))
        rows = [torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        with torch.no_grad():
            mine, everyone = layer(rows[rank]), reference(torch.cat(rows))[5 * rank:5 * rank + 5]
        worst = max(((a - b).abs().max() / b.abs().max()).item()
                    for a, b in ((mine, everyone), (layer.running_mean, reference.running_mean),
                                 (layer.running_var, reference.running_var)))
        differences[rank] = worst
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    differences = mp.Manager().dict()
    mp.spawn(rank_main, args=(port, 2, differences), nprocs=2, join=True)
    print(max(differences.values()))
"""


@pytest.mark.fresh_interpreter
def test_a_layer_no_wrapper_holds_synchronises_across_processes_with_minidp_alone_imported(tmp_path):
    # torch.nn.SyncBatchNorm synchronises whenever it trains in a job of several processes, whatever wraps it; so does
    # minidp's, in a script that imports minidp and not minidp.distributed (which sets up the exchange): the package
    # imports it. Before, such a layer normalised each rank's rows alone, silently.
    script = tmp_path / "lone_layer.py"
    script.write_text(_LONE_LAYER_IN_A_JOB)
    interface = loopback_interface()
    done = fresh_python(str(script), timeout=120, env={"GLOO_SOCKET_IFNAME": interface} if interface else None)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < RTOL_FLOAT64

