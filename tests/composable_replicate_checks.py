"""Rank side of ``tests/test_composable_replicate.py``: minidp's ``replicate`` beside torch's
(``torch.distributed._composable.replicate``), each check run in every rank of one Gloo job.

Each library trains its own copy of the same model on the same data; the checks return where they first differ
(``tests.helpers.state_difference``: every forward's loss and every parameter and buffer after the last step, bitwise).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import DDP as TorchReplicated, replicate as torch_replicate
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import minidp
import minidp.distributed as md

from .helpers import error_of, state_difference

LIBRARIES = {"minidp": (md.replicate, md.fully_shard), "torch": (torch_replicate, torch_fully_shard)}


class Net(nn.Module):
    """BatchNorm (buffers each rank keeps: replicate broadcasts parameters only), a branch some steps skip."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, skip_branch: bool = False) -> torch.Tensor:
        x = torch.tanh(self.fc2(torch.tanh(self.norm(self.fc1(x)))))
        return self.head(x if skip_branch else torch.tanh(self.branch(x)))


def train(seed: int, library: str, steps: int = 4, micro_batches: int = 2, ignored: bool = False,
          hook: Optional[Callable] = None, shard: Optional[str] = None, skip_branch: Optional[str] = None,
          compiled: bool = False, replicated_child: Optional[str] = None, torchs_fully_shard: bool = False,
          **ddp_kwargs: Any) -> dict:
    """``steps`` optimizer steps of SGD with momentum, each over ``micro_batches`` forwards (all but the last with
    ``set_requires_gradient_sync(False)``), every rank starting from other parameters (rank 0's are broadcast).
    ``ignored``: fc1 left out; ``hook``: a comm hook registered before the first forward; ``shard``: the name of a
    sub-module sharded first with the library's ``fully_shard``; ``skip_branch``: ``"odd"`` steps skip ``branch``, or
    ``"always"`` (a static graph that leaves it unused); ``compiled``: every forward, the first too, through
    ``torch.compile`` (the eager backend). ``replicated_child``: the other composition, that sub-module given to the
    library's ``replicate`` and the root to its ``fully_shard`` (which leaves the replicated one whole);
    ``torchs_fully_shard``: torch's ``fully_shard`` there, whichever the library."""
    replicate, fully_shard = LIBRARIES[library]
    if torchs_fully_shard:
        fully_shard = torch_fully_shard
    rank = dist.get_rank()
    # each rank its own parameters, which the first forward's broadcast evens; alike where fully_shard needs them so
    torch.manual_seed(seed if shard is not None or replicated_child is not None else seed + rank)
    model = Net()
    if shard is not None:
        fully_shard(getattr(model, shard))
    if replicated_child is not None:
        replicate(getattr(model, replicated_child), **ddp_kwargs)
        fully_shard(model)
    else:
        replicate(model, ignored_modules=[model.fc1] if ignored else None, **ddp_kwargs)
    if hook is not None:
        model.register_comm_hook(dist.group.WORLD, hook)
    forward = torch.compile(model, backend="eager") if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(seed * 7 + rank)
    losses = []
    for step in range(steps):
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            x = torch.randn(8, 6, generator=data)
            skip = skip_branch == "always" or (skip_branch == "odd" and step % 2 == 1)
            loss = forward(x, skip_branch=skip).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    state = {name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
             for name, tensor in model.state_dict().items()}
    return {"losses": losses, "state": state}


def against_torch(seed: int, **kwargs: Any) -> dict:
    """minidp's replicate and torch's, trained alike: where their losses and states first differ (None: nowhere,
    bitwise), and how many losses there were."""
    ours, theirs = (train(seed, library, **kwargs) for library in ("minidp", "torch"))
    return {"difference": state_difference(ours, theirs, where="minidp's run"), "losses": len(theirs["losses"])}


def the_module_stays_itself(seed: int) -> dict:
    """What replicate leaves of the module: its class (a subclass of its own, and its name), its state-dict keys, a slice of a
    replicated Sequential (of the plain class, as torch's), ``copy.deepcopy`` (refused, as torch's), and what
    ``replicate.state`` says of a module replicate was not applied to (torch's contract: ``None``)."""
    results = {}
    for library, (replicate, _) in LIBRARIES.items():
        torch.manual_seed(seed)
        model = Net()
        keys = list(model.state_dict())
        replicate(model)
        sequential = replicate(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)))
        try:
            copy.deepcopy(model)
            copied = "copied"
        except AssertionError as error:
            copied = str(error)
        results[library] = {"class": type(model).__name__, "is_net": isinstance(model, Net),
                            "keys": list(model.state_dict()) == keys,
                            "slice": type(sequential[1:]).__name__, "deepcopy": copied,
                            "state_elsewhere": replicate.state(nn.Linear(2, 2))}
    return results


def state_as_torchs(seed: int) -> dict:
    """What ``replicate.state(module)`` holds, torch's ``_ReplicateState`` attributes that code reads (``_ddp``, to
    register a comm hook on it), before and after the first forward, per library; and which composable APIs torch's
    registry lists on the module (``_get_registry``, which torch's ``fully_shard`` asks), and whether the module is an
    instance of torch's composable ``DDP`` class."""
    from torch.distributed._composable.contract import _get_registry

    results = {}
    for library, (replicate, _) in LIBRARIES.items():
        torch.manual_seed(seed)
        model = replicate(Net())
        seen = []
        for _ in range(2):
            state = replicate.state(model)
            seen.append({"has_initialized": state.has_initialized, "param_names": list(state._param_names),
                         "param_list": [tuple(p.shape) for p in state._param_list], "no_sync": state._no_sync})
            model.set_requires_gradient_sync(False)
            model(torch.randn(4, 6))
        results[library] = {"seen": seen, "ddp": isinstance(replicate.state(model)._ddp, nn.parallel.DistributedDataParallel),
                            "registry": list(_get_registry(model) or ()), "class": isinstance(model, TorchReplicated)}
    return results


def refusals(seed: int) -> dict:
    """minidp's refusals, each before anything changed: a second replicate of one module, replicate of a module
    fully_shard sharded, a device_id that is a list, a function in place of a module."""
    cases: dict[str, Callable[[nn.Module], Any]] = {
        "twice": lambda model: md.replicate(md.replicate(model)),
        "sharded": lambda model: md.replicate(md.fully_shard(model)),
        "device_id": lambda model: md.replicate(model, device_id=["cpu"]),
        "function": lambda model: md.replicate(model.forward),
    }
    results = {}
    for name, call in cases.items():
        torch.manual_seed(seed)
        results[name] = error_of(lambda: call(Net()))
    results["twice_in_torch"] = error_of(lambda: torch_replicate(torch_replicate(Net())))  # torch's contract()
    return results


HOOKS = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}


def sync_batchnorm_over_every_rank(seed: int) -> dict[str, float]:
    """``minidp.SyncBatchNorm`` under each of minidp's wrappers across processes, rank r with 3 - r rows (uneven): the
    largest difference of its output and running statistics from ``nn.BatchNorm1d`` on every rank's rows at once, in
    float64, by wrapper. minidp's layer needs an exchange over the processes, which only its DDP gave it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randn(3 - r, 4, generator=generator, dtype=torch.float64) for r in range(world)]
    reference = nn.BatchNorm1d(4, dtype=torch.float64)
    expected = reference(torch.cat(batches)).detach().split([len(b) for b in batches])[rank]
    wrappers = {"ddp": md.DistributedDataParallel, "replicate": md.replicate, "fully_shard": md.fully_shard}
    differences = {}
    for name, wrap in wrappers.items():
        layer = minidp.SyncBatchNorm(4, dtype=torch.float64)
        output = wrap(nn.Sequential(layer))(batches[rank]).detach()
        differences[name] = max((output - expected).abs().max().item(),
                                (layer.running_mean - reference.running_mean).abs().max().item(),
                                (layer.running_var - reference.running_var).abs().max().item())
    return differences
