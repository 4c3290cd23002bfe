"""Checks that run inside every rank of a job started by ``minidp.distributed.launch``: minidp's
``fully_shard`` against torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) in the same process,
on the same data; each returns plain facts that tests/test_fully_shard.py asserts on.
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import minidp.distributed as md
from minidp.distributed.fully_shard import sharded_groups


class Block(nn.Module):
    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Net(nn.Module):
    """Sizes that 2 and 3 do not divide (padded shards), a bias of 2 (an empty shard on rank 2 of 3),
    parameters of the root's own (``norm``, ``head``) next to three sharded blocks."""

    def __init__(self, features: int = 13, hidden: int = 29, classes: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(features)
        self.blocks = nn.ModuleList([Block(features, hidden), Block(hidden, hidden), Block(hidden, 7)])
        self.head = nn.Linear(7, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Tied(nn.Module):
    """One weight used by two modules (an embedding tied to its output layer), sharded as one group."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(13, 13)
        self.outer = nn.Linear(13, 13)
        self.outer.weight = self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x)))


def shard(model: nn.Module, function: Callable[..., Any], reshard_after_forward: bool) -> nn.Module:
    """Sub-modules first, the root last, as FSDP2 asks."""
    for block in getattr(model, "blocks", ()):
        function(block, reshard_after_forward=reshard_after_forward)
    return function(model, reshard_after_forward=reshard_after_forward)


MODELS = {"net": Net, "tied": Tied}


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def local(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A DTensor's local shard (FSDP2's parameters, gradients and optimizer state); a tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def first_difference(ours: nn.Module, theirs: nn.Module, optimizers: tuple) -> Optional[str]:
    """The first shard, gradient or optimizer state that is not bitwise equal to FSDP2's, or None."""
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        pairs = [("parameter", a, local(b)), ("gradient", a.grad, local(b.grad))]
        state_a, state_b = optimizers[0].state.get(a, {}), optimizers[1].state.get(b, {})
        pairs += [(f"optimizer state {key!r}", state_a.get(key), local(value)) for key, value in state_b.items()]
        for what, x, y in pairs:
            if (x is None) != (y is None):
                return f"{what} of {name}: {'None' if x is None else 'set'} here, {'None' if y is None else 'set'} in FSDP2"
            if x is not None and (x.shape != y.shape or not torch.equal(x, y)):
                return f"{what} of {name}: {tuple(x.shape)} here, {tuple(y.shape)} in FSDP2, or different values"
    return None


def against_fsdp2(seed: int, model: str = "net", dtype: torch.dtype = torch.float32, optimizer: str = "sgd",
                  reshard_after_forward: bool = True, steps: int = 3, micro_batches: int = 1,
                  unsynced: Optional[str] = None) -> dict:
    """Train FSDP2 and minidp side by side from the same weights (seeded alike on every rank, as
    FSDP2 requires), each rank on its own batches; after every backward and every step, the first
    difference. ``micro_batches`` > 1: that many backwards per step, their sharded gradients summed.
    ``unsynced``: each step's backwards but the last run after ``set_requires_gradient_sync(False)`` on
    the root, the last after ``True``: ``"all"`` with ``recurse=True`` (no reduce-scatter until the last),
    ``"root"`` with ``recurse=False`` (only the root's group accumulates unreduced)."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    theirs = MODELS[model]().to(dtype)
    ours = copy.deepcopy(theirs)
    full = {k: v.clone() for k, v in theirs.state_dict().items()}
    shard(theirs, torch_fully_shard, reshard_after_forward)
    shard(ours, md.fully_shard, reshard_after_forward)
    optimizers = (OPTIMIZERS[optimizer](ours.parameters()), OPTIMIZERS[optimizer](theirs.parameters()))
    differences = []
    for step in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        for micro in range(micro_batches):
            x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 100 * step + 10 * micro + rank),
                            dtype=dtype)
            for sharded in (ours, theirs):
                if unsynced is not None:
                    sharded.set_requires_gradient_sync(micro == micro_batches - 1, recurse=unsynced == "all")
                sharded(x).pow(2).mean().backward()
            differences.append(first_difference(ours, theirs, optimizers))
        for opt in optimizers:
            opt.step()
        differences.append(first_difference(ours, theirs, optimizers))
    ours_full = md.full_state_dict(ours)
    theirs_full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in theirs.state_dict().items()}
    state_dict_equal = list(ours_full) == list(theirs_full) and all(
        torch.equal(ours_full[k], theirs_full[k]) for k in ours_full)
    ours.load_state_dict(full)  # the initial weights back, whole, on every rank
    reloaded = md.full_state_dict(ours)
    return {"differences": differences, "state_dict_equal": state_dict_equal,
            "reloaded": all(torch.equal(reloaded[k], full[k]) for k in full),
            "shard_shapes": [tuple(p.shape) for p in ours.parameters()]}


def collectives_when_unsynced(seed: int, recurse: bool) -> dict:
    """Three backwards, the first two after ``set_requires_gradient_sync(False, recurse=recurse)`` on
    the root, the last after ``True``: each backward's reduce-scatters and all-gathers (the timeline),
    and which groups had the switch off during the first two."""
    torch.manual_seed(seed)
    model = shard(Net(), md.fully_shard, True)
    whole_bytes = sum(p.numel() * p.element_size() for p in Net().parameters())
    counts, switched_off, gradient_bytes = [], [], []
    for micro in range(3):
        model.set_requires_gradient_sync(micro == 2, recurse=recurse)
        model(torch.randn(4, 13)).sum().backward()
        if micro == 0:  # the groups' names (under the root) are set at the first forward
            switched_off = [g.name for g in sharded_groups(model) if not g.requires_gradient_sync]
        timeline = md.sharded_timeline(model)
        counts.append({stage: sum(e["stage"] == stage for e in timeline) for stage in ("reduce-scatter", "all-gather")})
        gradient_bytes.append(md.memory_ledger(model)["gradients"])
    return {"counts": counts, "switched_off": switched_off, "class": type(model).__name__,
            "is_net": isinstance(model, Net), "block_class": type(model.blocks[0]).__name__,
            "gradient_bytes": gradient_bytes, "whole_bytes": whole_bytes,
            "shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def unshard_and_reshard(seed: int) -> dict:
    """``unshard()`` then ``reshard()`` on one block, by each: the weight's local shape after each, and whether the
    unsharded weight equals the whole one."""
    torch.manual_seed(seed)
    whole = Net()
    results = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        model = shard(copy.deepcopy(whole), function, True)
        block = model.blocks[1]
        block.unshard()
        unsharded = local(block.linear.weight)
        equal = torch.equal(unsharded, whole.blocks[1].linear.weight)
        shape = tuple(unsharded.shape)
        block.reshard()
        results[name] = {"unsharded": shape, "equal": equal, "resharded": tuple(local(block.linear.weight).shape)}
    return results


def deepcopies(seed: int) -> dict:
    """``copy.deepcopy`` of a sharded model before its first forward and after a backward (when its whole
    parameters' storage is freed), in minidp and in FSDP2: per library, what each raised."""
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    outcomes: dict[str, list[str]] = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        torch.manual_seed(seed)
        model = shard(Net(), function, True)
        outcomes[name] = []
        for trained in (False, True):
            if trained:
                model(x).sum().backward()
            try:
                copy.deepcopy(model)
                outcomes[name].append("copied")
            except AssertionError as error:
                outcomes[name].append(f"{type(error).__name__}: {error}")
    return outcomes


def already_wrapped(seed: int) -> dict:
    """fully_shard on a module it already sharded, on one torch's fully_shard sharded, on a DDP: the errors."""
    errors = {}
    for name, wrap in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard), ("ddp", md.DistributedDataParallel)):
        wrapped = wrap(Net())
        try:
            md.fully_shard(wrapped)
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return errors


def shared_between_groups(seed: int) -> dict:
    """A weight shared by two modules sharded as two groups: minidp's error at the second
    fully_shard, and FSDP2's (at the first forward)."""
    errors = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        model = Tied()
        try:
            function(model.inner)
            function(model.outer)
            function(model)
            model(torch.randn(2, 13))
        except ValueError as error:
            errors[name] = str(error)
    return errors


def freed_once_dropped(seed: int) -> dict:
    """Train a model sharded by each for two steps, drop it and its optimizer: whether it is still alive."""
    torch.manual_seed(seed)
    alive = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        model = shard(Net(), function, True)
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(4, 13)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        dropped = weakref.ref(model)
        del model, optimizer
        gc.collect()
        alive[name] = dropped() is not None
    return alive


def mismatched_model(seed: int) -> str:
    """Rank 1 builds a wider hidden layer: the error on each rank."""
    model = Net(hidden=29 if dist.get_rank() == 0 else 30)
    try:
        shard(model, md.fully_shard, True)
    except ValueError as error:
        return str(error)
    return "no error"


def raise_in_step_2(failing_rank: int) -> None:
    """Train; rank ``failing_rank`` raises in step 2 while the others go on into the all-gathers."""
    model = shard(Net(), md.fully_shard, True)
    for step in range(1, 4):
        if step == 2 and dist.get_rank() == failing_rank:
            raise RuntimeError(f"planted failure in step 2 on rank {failing_rank}")
        model(torch.randn(4, 13)).sum().backward()


def run_checks(checks: dict[str, tuple[Callable[..., Any], dict]], seed: int) -> dict[str, Any]:
    """Run ``checks`` (name: (function, keyword arguments)) in order, each given ``seed``; their results by name."""
    return {name: function(seed=seed, **kwargs) for name, (function, kwargs) in checks.items()}


def timeline_and_memory(seed: int, steps: int = 3) -> dict:
    """The third step's timeline of every rank (the first has nothing to prefetch), and the memory
    ledgers of the same model under minidp's DDP and sharded, after a step of AdamW; and, in the middle
    of the sharded model's forwards, the ledger's gathered bytes next to the storage the gathered
    parameters hold then."""
    torch.manual_seed(seed)
    ledgers, mid_forward = {}, []
    for name in ("ddp", "sharded"):
        model = Net(features=64, hidden=256, classes=8)
        model = md.DistributedDataParallel(model) if name == "ddp" else shard(model, md.fully_shard, True)
        if name == "sharded":  # runs after fully_shard's own pre-hook: the root and this block are gathered
            model.blocks[1].register_forward_pre_hook(lambda *_: mid_forward.append((
                md.memory_ledger(model)["gathered"],
                sum(p.gathered.untyped_storage().nbytes() for g in sharded_groups(model) for p in g.params
                    if p.gathered is not None))))
        optimizer = torch.optim.AdamW(model.parameters())
        for step in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 64)).pow(2).mean().backward()
            optimizer.step()
        ledgers[name] = md.memory_ledger(model, optimizer)
    return {"timelines": md.gather_timelines(md.sharded_timeline(model)), "ledgers": ledgers,
            "table": md.format_ledgers(ledgers), "gathered_mid_forward": mid_forward}


@record
def _main() -> None:
    dist.init_process_group("gloo")
    raise_in_step_2(int(sys.argv[1]))
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun: torchrun --nproc_per_node=2 -m tests.fsdp_checks FAILING_RANK
    _main()
