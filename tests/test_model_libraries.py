"""Models nobody here wrote, unchanged: torchvision's and timm's, through every way minidp runs a model.

README's promise is that real training code runs unchanged and gets stock's numbers. These tests take the models of
two libraries as their authors wrote them (BatchNorm and its buffers, a DenseNet that checkpoints its layers, a
GoogLeNet whose training output is a namedtuple with auxiliary heads, squeeze-excitation, channel shuffles, ViTs with a
class token and a position embedding) and compare minidp with torch bit for bit:

* ``minidp.DataParallel`` on 2 CPU replicas against stock ``nn.DataParallel`` (its Python code on the CPU through
  ``tests/stock_emulation.py``), float64: the output, every gradient and every buffer, ``torch.equal``, with one
  intra-op thread, where README's row of ``parallel_apply`` says CPU replicas equal stock bit for bit (with more
  threads a replica's kernels split their sums otherwise, ``tests/test_against_stock.py``);
* ``minidp.distributed.DistributedDataParallel`` against torch's DDP, 2 Gloo processes, 4 steps of SGD with momentum
  from different weights on each rank (``tests/ddp_checks.py``, ``against_torch``);
* ``minidp.distributed.fully_shard`` against torch's FSDP2 on timm's ViT, each of its blocks sharded and then the
  root, as FSDP2's examples do, 3 steps of SGD and of AdamW, and on torchvision's ResNet-18 sharded whole
  (``tests/fsdp_checks.py``, ``against_fsdp2``: gradients, shards and optimizer state after every backward and step,
  the full state dict with its BatchNorm buffers at the end).

torchvision and timm are not in the install: each test skips where they do not import (torchvision's wheels on the
package registry are built against CUDA torch and do not load with torch 2.13's CPU wheel); CI's torch 2.11 job
installs both.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minidp

from . import ddp_checks, fsdp_checks
from .ddp_checks import run_checks
from .helpers import assert_no_differences, cpu_ids, each_rank, library, run_job, timm_vit, torchvision_resnet18
from .reference import Case, assert_same_results, minidp_forward_backward, stock_forward_backward

JOB_TIMEOUT = 240.0  # seconds for the whole job of 2 processes

# name: (library, build from the library's module, image size); the two the DDP and FSDP2 checks train too are built
# by their helpers. Dropout and stochastic depth off: a replica's random draws cannot be stock's (README: one
# generator for all CPU replicas).
MODELS: dict[str, tuple[str, Callable[[Any], nn.Module], int]] = {
    "torchvision-resnet18": ("torchvision.models", lambda m: torchvision_resnet18(), 64),
    "torchvision-densenet121-checkpointed": (
        "torchvision.models", lambda m: m.densenet121(num_classes=10, memory_efficient=True), 64),
    "torchvision-mobilenet_v3_small": ("torchvision.models", lambda m: m.mobilenet_v3_small(num_classes=10, dropout=0.0), 64),
    "torchvision-efficientnet_b0": (
        "torchvision.models", lambda m: m.efficientnet_b0(num_classes=10, dropout=0.0, stochastic_depth_prob=0.0), 64),
    "torchvision-googlenet-aux": (  # in training: GoogLeNetOutputs(logits, aux_logits2, aux_logits1)
        "torchvision.models",
        lambda m: m.googlenet(num_classes=10, aux_logits=True, init_weights=False, dropout=0.0, dropout_aux=0.0), 64),
    "torchvision-shufflenet_v2": ("torchvision.models", lambda m: m.shufflenet_v2_x0_5(num_classes=10), 64),
    "torchvision-regnet_y_400mf": ("torchvision.models", lambda m: m.regnet_y_400mf(num_classes=10), 64),
    "torchvision-vit": ("torchvision.models", lambda m: m.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10), 32),
    "timm-resnet18": ("timm", lambda m: m.create_model("resnet18", num_classes=10), 64),
    "timm-convnext_atto": ("timm", lambda m: m.create_model("convnext_atto", num_classes=10), 64),
    "timm-efficientnet_b0": ("timm", lambda m: m.create_model("efficientnet_b0", num_classes=10), 64),
    "timm-vit": ("timm", lambda m: timm_vit(), 32),
}


def _classification_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits, summed over every head of a namedtuple of them (GoogLeNet's auxiliary ones)."""
    heads = output if isinstance(output, tuple) else (output,)
    return sum(F.cross_entropy(head, labels) for head in heads)


@pytest.mark.parametrize("name", list(MODELS))
def test_data_parallel_on_cpu_replicas_equals_stock_bit_for_bit(name, generator, one_intra_op_thread):
    module_name, build, size = MODELS[name]
    model = build(library(module_name)).double()
    images = torch.randn(6, 3, size, size, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 10, (6,), generator=generator)
    case = Case(name, model, (images,), {}, 0, lambda output: _classification_loss(output, labels))
    with minidp.trace():  # which must change nothing
        ours = minidp_forward_backward(case, cpu_ids(2))
    stock = stock_forward_backward(case, [0, 1])
    assert type(ours.output) is type(stock.output)  # GoogLeNet's namedtuple gathers into its own type
    assert_same_results(ours, stock, exact=True)


@pytest.fixture(scope="module")
def two() -> list[dict]:
    """The DDP and FSDP2 comparisons, in one job of 2 Gloo processes, where both libraries import."""
    library("torchvision")
    library("timm")
    plan = {
        "ddp-torchvision-resnet18": (ddp_checks.against_torch, {"model": "torchvision_resnet18"}),
        "ddp-timm-vit": (ddp_checks.against_torch, {"model": "timm_vit"}),
        "fsdp2-timm-vit-sgd": (fsdp_checks.against_fsdp2, {"model": "timm_vit"}),
        "fsdp2-timm-vit-adamw": (fsdp_checks.against_fsdp2, {"model": "timm_vit", "optimizer": "adamw",
                                                              "reshard_after_forward": False}),
        "fsdp2-torchvision-resnet18": (fsdp_checks.against_fsdp2, {"model": "torchvision_resnet18"}),
    }
    return run_job(run_checks, 2, plan, JOB_TIMEOUT)


@pytest.mark.parametrize("model", ["torchvision-resnet18", "timm-vit"])
def test_distributed_data_parallel_trains_as_torch_ddp_bit_for_bit(two, model):
    assert_no_differences(two, f"ddp-{model}")


@pytest.mark.parametrize("check", ["fsdp2-timm-vit-sgd", "fsdp2-timm-vit-adamw", "fsdp2-torchvision-resnet18"])
def test_fully_shard_trains_as_fsdp2_bit_for_bit(two, check):
    # the ViT: each block sharded, then the root; the ResNet (no blocks attribute): the root alone, one group whose
    # BatchNorm buffers each rank keeps, as FSDP2 does
    assert_no_differences(two, check)
    for result in each_rank(two, check):
        assert result["losses_equal"] and result["state_dict_equal"]
