"""calibrate: one weight per replica, positive, summing to 1, usable as chunk_weights; the model is
left as it was. (Timings vary: these tests check the contract, never a speed.)"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import minidp
from .helpers import RTOL_FLOAT64, cpu_ids, max_relative_error, requires_cuda
from minidp.calibration import weights_from_measurements


def bn_model(generator: torch.Generator) -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return net


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_returns_one_positive_weight_per_device_summing_to_one(replicas, generator):
    weights = minidp.calibrate(bn_model(generator), torch.randn(8, 4, generator=generator, dtype=torch.float64), cpu_ids(replicas))
    assert len(weights) == replicas and all(isinstance(w, float) and w > 0 for w in weights)
    assert math.isclose(sum(weights), 1.0)


def test_replicas_that_share_a_device_get_equal_weights(generator):
    weights = minidp.calibrate(bn_model(generator), torch.randn(8, 4, generator=generator, dtype=torch.float64), cpu_ids(4))
    assert weights == [weights[0]] * 4


def test_cpu_spelled_with_an_index_is_the_one_cpu(generator):
    """``"cpu:0"`` names the CPU, where every CPU tensor lives (``device("cpu")``): replicas on it share its speed."""
    weights = minidp.calibrate(bn_model(generator), torch.randn(8, 4, generator=generator, dtype=torch.float64),
                               ["cpu", "cpu:0", torch.device("cpu", 0)])
    assert weights == [weights[0]] * 3


def test_the_callers_inputs_get_no_gradient_and_their_graph_is_left_alone(generator):
    """The timed backward passes stop at the model: a sample that requires grad, or that another module made (whose
    graph a second pass would find freed), is left as it was given."""
    leaf = torch.randn(8, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    backbone = nn.Linear(3, 4).double()
    made = backbone(torch.randn(8, 3, generator=generator, dtype=torch.float64))
    for sample in (leaf, made):
        minidp.calibrate(bn_model(generator), sample, cpu_ids(2))
    assert leaf.grad is None and backbone.weight.grad is None


def test_the_weights_drive_a_data_parallel_with_the_full_batch_results(generator):
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    weights = minidp.calibrate(net, x, cpu_ids(3))
    output = minidp.DataParallel(net, cpu_ids(3), chunk_weights=weights)(x)
    assert max_relative_error(output, net(x)) < RTOL_FLOAT64


def test_the_model_is_left_untouched(generator):
    net = bn_model(generator)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    minidp.calibrate(net, torch.randn(8, 4, generator=generator, dtype=torch.float64), cpu_ids(2))
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())  # BatchNorm statistics too
    assert net.training


def test_loss_fn_reduces_an_output_that_is_not_a_tensor(generator):
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x):
            return {"logits": self.linear(x), "count": x.shape[0]}

    x = torch.randn(6, 4, generator=generator)
    with pytest.raises(TypeError, match="loss_fn"):
        minidp.calibrate(Pair(), x, cpu_ids(2))
    assert len(minidp.calibrate(Pair(), x, cpu_ids(2), loss_fn=lambda out: out["logits"].sum())) == 2


@pytest.mark.parametrize(
    "device_ids,steps,message", [([], 3, "device_ids is empty"), (cpu_ids(2), 0, "steps must be a positive int")]
)
def test_bad_arguments_are_named(device_ids, steps, message):
    with pytest.raises(ValueError, match=message):
        minidp.calibrate(nn.Linear(2, 2), torch.zeros(2, 2), device_ids, steps)


# --------------------------------------------------------------------------------------------------
# how speed and free memory combine (measurements given, so that any machine can check the rule)
# --------------------------------------------------------------------------------------------------


def test_a_faster_device_gets_a_proportionally_larger_weight():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    weights = weights_from_measurements([gpu, cpu], {gpu: 0.01, cpu: 0.03}, {gpu: 10**9})
    assert weights == pytest.approx([0.75, 0.25])


def test_a_gpu_gets_no_larger_share_than_its_share_of_free_memory():
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    # Equal speed (shares 1/2, 1/2), but GPU 0 has half GPU 1's free memory (share 1/3):
    # min -> 1/3, 1/2, normalised -> 2/5, 3/5.
    weights = weights_from_measurements([gpu0, gpu1], {gpu0: 0.02, gpu1: 0.02}, {gpu0: 2 * 10**9, gpu1: 4 * 10**9})
    assert weights == pytest.approx([0.4, 0.6])


def test_replicas_on_one_device_share_its_speed_and_memory():
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    weights = weights_from_measurements([gpu0, gpu0, gpu1], {gpu0: 0.01, gpu1: 0.01}, {gpu0: 10**9, gpu1: 10**9})
    assert weights == pytest.approx([0.25, 0.25, 0.5])


@pytest.mark.cuda
@requires_cuda
def test_on_a_gpu_free_memory_is_read_and_the_contract_holds(generator):
    net = nn.Linear(4, 2).cuda()
    weights = minidp.calibrate(net, torch.randn(8, 4, generator=generator), [0, 0])
    assert weights == [0.5, 0.5]
