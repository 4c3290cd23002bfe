"""PyTorch's tests of the composable ``replicate`` API, rank side: each upstream test body, run inside every rank of a
2-process Gloo job against :data:`replicate` (the cases of ``tests/test_upstream_replicate.py``).

Adapted from ``test/distributed/_composable/test_replicate.py`` of the PyTorch repository
(https://github.com/pytorch/pytorch), classes ``ReplicateStateDictTest`` and ``ReplicateTest`` (BSD 3-clause,
copyright the PyTorch contributors); the cases keep upstream's names and bodies. Upstream runs each in processes of
its own with a process group made per test; here one job runs them all on its default group. Two are gated on two
GPUs upstream: ``test_replicate_ignore_module`` only to put each rank's model on its own GPU (it runs here on the
CPU), ``test_replicate_device_id`` to check the CUDA devices after the CPU one (its CPU half runs here). :data:`replicate`
is minidp's, or torch's own with ``MINIDP_UPSTREAM_DDP=torch`` in the environment.
"""

import os
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable.replicate import replicate as torch_replicate

import minidp.distributed as md

from .upstream_ddp_checks import assert_close, assert_not_close

replicate = torch_replicate if os.environ.get("MINIDP_UPSTREAM_DDP") == "torch" else md.replicate


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 2)
        self.fc2 = nn.Linear(2, 2)
        self.fc3 = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x)))


def _check_state_dict_parity(sd_1, sd_2):
    for k1, k2 in zip(sd_1.keys(), sd_2.keys()):
        assert k1 == k2
    for v1, v2 in zip(sd_1.values(), sd_2.values()):
        assert_close(v1, v2)


def test_replicate_single_module_save_load():
    """replicate() on a single module: its state_dict matches the local module's."""
    model = Net()
    replicate_model = replicate(deepcopy(model))
    _check_state_dict_parity(model.state_dict(), replicate_model.state_dict())


def test_replicate_non_root_multiple_save_load():
    """replicate() on several sub-modules: the state_dict matches the local module's."""
    model = Net()
    replicate_model = deepcopy(model)
    replicate(replicate_model.fc1)
    replicate(replicate_model.fc2)
    replicate(replicate_model.fc3)
    _check_state_dict_parity(model.state_dict(), replicate_model.state_dict())


def _compare_module(mod, replicate_mod):
    """Two steps of the local module on the global batch and of the replicated one on this rank's row: the same
    parameters (upstream's tolerances), the input shuffled between the steps."""
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    local_batch_size = 1
    global_batch_size = world_size * local_batch_size
    input = torch.randn(global_batch_size, 2)
    target = torch.randn(global_batch_size, 2)

    def step_model(model, input, target):
        model.train()
        output = model(input)
        loss = F.mse_loss(output, target.to(output.device))
        loss.backward()
        for param in model.parameters():
            with torch.no_grad():
                param -= param.grad
            param.grad = None

    for iteration in range(2):
        step_model(mod, input, target)
        step_model(
            replicate_mod,
            input[rank * local_batch_size : (rank + 1) * local_batch_size],
            target[rank * local_batch_size : (rank + 1) * local_batch_size],
        )
        assert len(list(mod.parameters())) == len(list(replicate_mod.parameters()))
        for i, j in zip(mod.parameters(), replicate_mod.parameters()):
            assert_close(i, j, rtol=1.3e-06, atol=5e-5)
        # Shuffle the input so that DDP input is different
        torch.manual_seed(iteration)
        input = input[torch.randperm(global_batch_size)]


def test_replicate_single_module():
    model = Net()
    replicate_model = replicate(deepcopy(model))
    _compare_module(model, replicate_model)


def test_replicate_ignore_module():
    """Upstream on GPUs (``model = Net().cuda()``); here on the CPU: fc1's gradients stay each rank's own, fc2's
    and fc3's are averaged."""
    torch.manual_seed(dist.get_rank())  # different inputs, hence local gradients, across ranks
    model = Net()
    replicate(model, ignored_modules=[model.fc1])
    inp = torch.randn(5, 2) * (dist.get_rank() + 1)
    out = model(inp) * 10
    out.sum().backward()
    fc1_grad = model.fc1.weight.grad
    tensor_list = [torch.zeros_like(fc1_grad) for _ in range(dist.get_world_size())]
    dist.all_gather(tensor_list, fc1_grad)
    grad, rest = tensor_list[0], tensor_list[1:]
    for g in rest:
        assert_not_close(grad, g)
    for dp_grad in [model.fc2.weight.grad, model.fc3.weight.grad]:
        tensor_list = [torch.zeros_like(dp_grad) for _ in range(dist.get_world_size())]
        dist.all_gather(tensor_list, dp_grad)
        grad, rest = tensor_list[0], tensor_list[1:]
        for g in rest:
            assert_close(grad, g)


def test_replicate_multi_module():
    model = Net()
    replicate_model = deepcopy(model)
    replicate(replicate_model.fc1)
    replicate(replicate_model.fc2)
    replicate(replicate_model.fc3)
    _compare_module(model, replicate_model)


def test_replicate_with_kwargs():
    model = Net()
    replicate_model = replicate(deepcopy(model), bucket_cap_mb=1, gradient_as_bucket_view=True)
    _compare_module(model, replicate_model)


def test_replicate_device_id():
    """Upstream's CPU half (its CUDA half needs GPUs): ``device_id=torch.device("cpu")`` builds, at the first
    forward, a DDP object whose ``device_ids`` is None."""
    model = Net()
    replicate(model, device_id=torch.device("cpu"))
    # DDP instance is attached in first pre forward
    model(torch.randn(2, 2))
    replicate_ddp_weakref = replicate.state(model)._ddp_weakref()
    # Should be None for CPU training
    assert replicate_ddp_weakref.device_ids is None


def test_replicate_wrong_device_id_type():
    model = Net()
    try:
        replicate(model, device_id=[torch.device("cpu")])
    except RuntimeError as error:
        assert "Expected device_id to be int or torch.device" in str(error)
    else:
        raise AssertionError("replicate took a list as device_id")
