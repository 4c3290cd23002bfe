"""PyTorch's tests of DDP's registered communication hooks, rank side: each upstream test body, run inside every rank
of a 2-process Gloo job against :data:`DDP` (the cases of ``tests/test_upstream_ddp_comm_hooks.py``).

Adapted from ``test/distributed/algorithms/ddp_comm_hooks/test_ddp_hooks.py`` of the PyTorch repository
(https://github.com/pytorch/pytorch), class ``DistributedDataParallelCommHookTest`` (BSD 3-clause, copyright the
PyTorch contributors); the cases keep upstream's names. Upstream gates every case on two GPUs
(``requires_accelerator_dist_backend``, ``skip_if_lt_x_gpu(2)``) only to place each rank's model on its own GPU
(``device_ids=[device_id]``); here the models stay on the CPU with ``device_ids`` omitted, which is how torch DDP takes
CPU modules, and the hooks run over Gloo. The bodies are upstream's: the hooks registered through torch's own
``register_ddp_comm_hook`` (``DDPCommHookType``), compared with upstream's tolerances to the same model without a hook.
:data:`DDP` is minidp's wrapper, or torch's own with ``MINIDP_UPSTREAM_DDP=torch`` in the environment. The two
quantization cases are kept as upstream wrote them, and stay out of the job: their hooks cannot run over Gloo
(``GLOO_CANNOT_RUN`` in ``tests/test_upstream_ddp_comm_hooks.py`` says why).
"""

# No `from __future__ import annotations`: torch DDP checks a hook's annotations as objects, as written upstream.

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook

from .upstream_ddp_checks import DDP, assert_close


class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p = nn.Parameter(torch.randn(40, 20))

    def forward(self, x):
        return self.p * x


class TestDdpCommHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t0 = Task()

    def forward(self, x, rank):
        return self.t0(x ** (1 + rank))


def _get_grads(hook_type=None):
    """Upstream's ``_get_grads``: the model on the CPU (upstream: ``.to(device_id)``, ``device_ids=[device_id]``), the
    default group as ``process_group`` (upstream makes one per test with ``create_pg``)."""
    process_group = dist.group.WORLD
    model = DDP(TestDdpCommHook(), process_group=process_group)
    if hook_type is not None:
        register_ddp_comm_hook(comm_hook_type=hook_type, model=model, state=process_group)
    return _run_and_get_grads(model)


def _run_and_get_grads(model):
    torch.manual_seed(2020)
    input = torch.randn(40, 20)
    output = model(input, dist.get_rank())
    output.mean().backward()
    param = next(model.parameters())  # the only layer
    return param.grad


def test_ddp_comm_hook_allreduce_hook():
    """The ``allreduce`` hook gives the result of no hook."""
    reference_grads = _get_grads(None)
    hook_grads = _get_grads(DDPCommHookType.ALLREDUCE)
    assert_close(hook_grads, reference_grads, rtol=1e-5, atol=0)


def _close_to_no_hook(hook_type) -> None:
    """Upstream's comparison of a lossy hook: its gradients within ``rtol=1e-5, atol=1e-4`` of no hook's."""
    reference_grads = _get_grads(None)
    hook_grads = _get_grads(hook_type)
    assert_close(hook_grads, reference_grads, rtol=1e-5, atol=1e-4)


def test_ddp_comm_hook_fp16compress_hook():
    """The ``fp16 compress`` hook gives a result close to no hook's."""
    _close_to_no_hook(DDPCommHookType.FP16_COMPRESS)


def test_ddp_comm_hook_quantize_per_tensor_hook():
    """The ``quantize per tensor`` hook gives a result close to no hook's."""
    _close_to_no_hook(DDPCommHookType.QUANTIZE_PER_TENSOR)


def test_ddp_comm_hook_quantize_per_channel_hook():
    """The ``quantize per channel`` hook gives a result close to no hook's."""
    _close_to_no_hook(DDPCommHookType.QUANTIZE_PER_CHANNEL)


def test_ddp_comm_hook_noop_hook():
    """The ``noop`` hook and an all-reduce after it give the result of no hook."""
    reference_grads = _get_grads(None)
    hook_grads = _get_grads(DDPCommHookType.NOOP)
    hook_grads.div_(dist.get_world_size())
    dist.all_reduce(hook_grads)
    assert_close(hook_grads, reference_grads, rtol=1e-5, atol=0)


def test_is_last_hook():
    """``bucket.is_last()`` is True for the last bucket of a backward only. Upstream's model, on the CPU."""

    def hook(flags, bucket):
        flags.append(bucket.is_last())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    flags = []
    model = nn.Sequential(
        nn.Linear(2, 4000, bias=False),
        *[nn.Linear(4000, 4000, bias=False) for _ in range(10)],
    )
    cpu_model = DDP(model)
    cpu_model.register_comm_hook(state=flags, hook=hook)
    input = torch.randn(10, 2)
    cpu_model(input).sum().backward()
    assert flags[-1]
    assert not any(flags[:-1])
