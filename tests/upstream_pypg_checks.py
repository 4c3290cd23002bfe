"""PyTorch's DDP tests over a process group written in Python, rank side: the bodies of ``AbstractDDPSingleRank``
(``TestDDPWithWorkWrapper``) of ``test/distributed/test_c10d_pypg.py``, run against
``minidp.distributed.DistributedDataParallel`` in a job of one Gloo process.

Source: the PyTorch repository (https://github.com/pytorch/pytorch), BSD-licensed (3-clause); adapted from it,
copyright the PyTorch contributors. Upstream's group, ``LonelyRankProcessGroup``, is a ``dist.ProcessGroup``
subclass of world size 1 that nobody registered with ``torch.distributed`` (its collectives return a finished
``Work``, made from a future); DDP takes it as it is. Upstream runs these with a default group initialised, as the
job here has. ``TestDDPWithWorkSubclass``, whose ``Work`` subclass defines ``wait(self, timeout)`` without a default,
is not ported: torch's own Python collectives (``dist.all_gather_object``, which minidp's constructor checks
with) call ``wait()`` without a timeout, and fail on it; only torch's C++ reducer passes one. With
``MINIDP_UPSTREAM_DDP=torch`` in the environment, :data:`DDP` is torch's own wrapper: every case passes on it too.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

import minidp.distributed as md

from .upstream_ddp_checks import _ddp_with_process_group

DDP = nn.parallel.DistributedDataParallel if os.environ.get("MINIDP_UPSTREAM_DDP") == "torch" else md.DistributedDataParallel


def create_work(result):
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class LonelyRankProcessGroup(dist.ProcessGroup):
    """A group of one process, whose collectives do nothing (an all-gather copies its input), in Python."""

    def __init__(self, rank, world):
        super().__init__(rank, world)
        assert rank == 0
        assert world == 1
        self._rank = rank
        self._world = world

    def broadcast(self, tensor_list, opts):
        return create_work(tensor_list)

    def allgather(self, output_tensors, input_tensor, opts):
        for o, i in zip(output_tensors[0], input_tensor):
            o.copy_(i)
        return create_work(output_tensors)

    def allreduce(self, tensors, opts):
        return create_work(tensors)

    def getSize(self):
        return self._world

    def getBackendName(self):
        return "lonely-pg"

    def __repr__(self):
        return f"PLG w:{self._world} r:{self._rank}"


def test_ddp_invoke_work_object():
    process_group = LonelyRankProcessGroup(0, 1)
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    wrapped_model = model
    input_tensor = torch.rand(2)
    model = DDP(model, process_group=process_group)
    model(input_tensor).sum().backward()
    ddp_grad = wrapped_model[0].bias.grad.clone()
    wrapped_model.zero_grad()
    wrapped_model(input_tensor).sum().backward()
    torch.testing.assert_close(wrapped_model[0].bias.grad, ddp_grad)


def test_ddp_with_pypg():
    _ddp_with_process_group(LonelyRankProcessGroup(0, 1))


def test_ddp_with_pypg_with_grad_views():
    _ddp_with_process_group(LonelyRankProcessGroup(0, 1), gradient_as_bucket_view=True)


def test_ddp_no_init_sync():
    process_group = LonelyRankProcessGroup(0, 1)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    DDP(model, process_group=process_group, init_sync=False)  # upstream counts the waits of its Work subclass only
