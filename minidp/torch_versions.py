"""What differs among the torch releases minidp supports (2.11 and newer), in one place.

minidp is developed on torch 2.13, and its suite runs on 2.13 and on 2.11 (CI runs both); 2.11 lacks a few
things minidp uses. Each name below stands for one such thing, with what minidp does where torch lacks it.
Nothing else in minidp looks at torch's version: it asks here.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch.nn.modules.batchnorm import _BatchNorm

# `nn.BatchNorm*(..., bias=False)` (an affine weight without a bias) arrived in torch 2.12.
BATCHNORM_TAKES_BIAS: bool = "bias" in inspect.signature(_BatchNorm.__init__).parameters

# torch 2.13 renames DistributedDataParallel's `broadcast_buffers` to `forward_sync_buffers` and warns on the old name.
DDP_DEPRECATES_BROADCAST_BUFFERS: bool = (
    "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
)

_foreach_clone = getattr(torch, "_foreach_clone", None)  # torch 2.12 and newer


def clone_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A new copy of each of ``tensors``, on its device, as ``tensor.clone()`` makes it.

    One ``torch._foreach_clone`` call where torch has it (2.12 and newer: a loop in C++, 40% cheaper than a
    ``clone()`` per tensor from Python for ResNet-50's 159 buffers, ``minidp.step2_replicate`` says how that was
    measured); before it, a ``clone()`` each.
    """
    if _foreach_clone is not None:
        return list(_foreach_clone(list(tensors)))
    return [tensor.clone() for tensor in tensors]
