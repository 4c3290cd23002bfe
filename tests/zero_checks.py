"""Checks that run inside every rank of a job started by ``minidp.distributed.launch``: ZeroRedundancyOptimizer.

Each check trains minidp's ``ZeroRedundancyOptimizer`` and torch's
(``torch.distributed.optim.ZeroRedundancyOptimizer``) side by side in the same process, on the same
data, and returns plain facts (booleans, numbers, strings) that tests/test_zero.py asserts on.
:func:`tests.ddp_checks.run_checks` runs many of them in one job.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import minidp.distributed as md

from .ddp_checks import _difference as first_difference
from .helpers import error_of

TorchDDP = nn.parallel.DistributedDataParallel

OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
}
WRAPPERS = {"minidp": md.DistributedDataParallel, "torch": TorchDDP}


def varied(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Parameters of six sizes (288, 24, 384, 16, 80, 5 elements): the greedy partition has choices to make."""
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 5)).to(dtype)


def _batch(seed: int, step: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s batch at ``step``: different for every rank and step, the same on every call."""
    return torch.randn(6, 12, generator=torch.Generator().manual_seed(seed + 1000 * step + rank), dtype=dtype)


def _groups(module: nn.Module, lr: float, only_weights: bool = False) -> list[dict]:
    """Two parameter groups: the weights with the optimizer's defaults, the biases with their own lr, no decay."""
    weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
    return [{"params": weights}] if only_weights else [{"params": weights}, {"params": biases, "lr": lr / 2, "weight_decay": 0.0}]


def _index_partition(module: nn.Module, per_rank_groups: list[list[list[torch.Tensor]]]) -> list[list[list[int]]]:
    """A partition written with the parameters' positions in ``module``, so that two models' can be compared."""
    position = {p: i for i, p in enumerate(module.parameters())}
    return [[[position[p] for p in group] for group in groups] for groups in per_rank_groups]


def _torch_partition(module: nn.Module, zero: TorchZero) -> list[list[list[int]]]:
    return _index_partition(module, [[g["params"] for g in groups] for groups in zero._partition_parameters()])


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b


def _difference(ours: nn.Module, theirs: nn.Module, ours_zero: md.ZeroRedundancyOptimizer, theirs_zero: TorchZero) -> Optional[str]:
    """The first parameter, local optimizer state or group setting that differs (bitwise), or None."""
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        if not torch.equal(a, b):
            return f"parameter {name}: max |difference| {(a - b).abs().max().item():.3g}"
        mine, stock = ours_zero.optim.state.get(a), theirs_zero.optim.state.get(b)
        if not _same_value(mine, stock):
            return f"optimizer state of {name} on rank {dist.get_rank()}: {mine!r} here, {stock!r} in torch"
    for g, (mine, stock) in enumerate(zip(ours_zero.param_groups, theirs_zero.param_groups)):
        settings = [{k: v for k, v in group.items() if k != "params"} for group in (mine, stock)]
        if settings[0] != settings[1]:
            return f"param_groups[{g}]: {settings[0]} here, {settings[1]} in torch"
    return None


def _pair(seed: int, dtype: torch.dtype, wrapper: str) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """torch DDP over one model, ``wrapper`` over a copy; different initial weights on every rank."""
    torch.manual_seed(seed + dist.get_rank())  # the DDP constructors must broadcast rank 0's
    theirs = varied(dtype)
    ours = copy.deepcopy(theirs)
    with warnings.catch_warnings():  # torch 2.13 deprecates the name broadcast_buffers (same meaning)
        warnings.simplefilter("ignore", FutureWarning)
        return ours, theirs, WRAPPERS[wrapper](ours), TorchDDP(theirs)


def _train_step(pairs: list[tuple[nn.Module, Any]], seed: int, step: int, dtype: torch.dtype) -> None:
    for ddp, optimizer in pairs:
        optimizer.zero_grad()
        ddp(_batch(seed, step, dist.get_rank(), dtype)).pow(2).mean().backward()
        optimizer.step()


def against_torch(
    seed: int,
    dtype: torch.dtype = torch.float32,
    optimizer: str = "sgd",
    wrapper: str = "minidp",
    parameters_as_bucket_view: bool = False,
    steps: int = 4,
) -> dict:
    """Train (``wrapper`` DDP + minidp's ZeRO) and (torch DDP + torch's ZeRO) side by side, two parameter
    groups and a StepLR schedule; after every step, the first difference in parameters, in this rank's
    optimizer state, or in the groups' settings. Also both partitions, and whether the bucket views hold."""
    optimizer_class, defaults = OPTIMIZERS[optimizer]
    ours, theirs, ours_ddp, theirs_ddp = _pair(seed, dtype, wrapper)
    ours_zero = md.ZeroRedundancyOptimizer(_groups(ours, defaults["lr"]), optimizer_class,
                                           parameters_as_bucket_view=parameters_as_bucket_view, **defaults)
    theirs_zero = TorchZero(_groups(theirs, defaults["lr"]), optimizer_class,
                            parameters_as_bucket_view=parameters_as_bucket_view, **defaults)
    schedules = [torch.optim.lr_scheduler.StepLR(z, step_size=2, gamma=0.5) for z in (ours_zero, theirs_zero)]
    differences = []
    for step in range(steps):
        _train_step([(ours_ddp, ours_zero), (theirs_ddp, theirs_zero)], seed, step, dtype)
        for schedule in schedules:
            schedule.step()
        differences.append(_difference(ours, theirs, ours_zero, theirs_zero))
    return {
        "differences": differences,
        "partition": _index_partition(ours, ours_zero.shares),
        "torch_partition": _torch_partition(theirs, theirs_zero),
        # with bucket views, every parameter lives in its owner's bucket
        "in_owners_bucket": all(
            any(p.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr() for bucket in ours_zero._buckets[owner])
            for owner, share in enumerate(ours_zero.shares) for group in share for p in group
        ),
    }


def unfrozen_under_bucket_view(seed: int, steps: int = 4, unfrozen_at: int = 2) -> dict:
    """``parameters_as_bucket_view=True`` with the first weight frozen at construction (left out of the buckets) and
    unfrozen before step ``unfrozen_at``: from then on its owner updates it and must send it to the others, so the
    buckets are rebuilt at that step (ZRO step: the trainable mask changed). No DDP: each rank steps from the
    gradients of its own batch. After every step the first difference, as in :func:`against_torch`."""
    optimizer_class, defaults = OPTIMIZERS["sgd"]
    torch.manual_seed(seed)  # the same weights on every rank: the optimizers alone keep them equal
    theirs = varied()
    ours = copy.deepcopy(theirs)
    frozen = [module[0].weight for module in (ours, theirs)]
    for weight in frozen:
        weight.requires_grad_(False)
    zeros = [md.ZeroRedundancyOptimizer(ours.parameters(), optimizer_class, parameters_as_bucket_view=True, **defaults),
             TorchZero(theirs.parameters(), optimizer_class, parameters_as_bucket_view=True, **defaults)]
    differences = []
    with warnings.catch_warnings():  # torch's warns that the trainable parameters changed
        warnings.simplefilter("ignore")
        for step in range(steps):
            if step == unfrozen_at:
                for weight in frozen:
                    weight.requires_grad_(True)
            for module, zero in zip((ours, theirs), zeros):
                zero.zero_grad()
                module(_batch(seed, step, dist.get_rank(), torch.float32)).pow(2).mean().backward()
                zero.step()
            differences.append(_difference(ours, theirs, *zeros))
    return {"differences": differences}


def closure(seed: int, steps: int = 3) -> dict:
    """``step(closure)``: the closure (forward and backward under DDP) runs inside the local step, on every
    rank; the returned losses and the parameters and state after each step, against torch's."""
    optimizer_class, defaults = OPTIMIZERS["sgd"]
    ours, theirs, ours_ddp, theirs_ddp = _pair(seed, torch.float64, "minidp")
    zeros = [md.ZeroRedundancyOptimizer(ours.parameters(), optimizer_class, **defaults),
             TorchZero(theirs.parameters(), optimizer_class, **defaults)]
    differences, losses = [], []
    for step in range(steps):
        x = _batch(seed, step, dist.get_rank(), torch.float64)

        def loss_of(ddp: nn.Module, zero: Any) -> Any:
            def evaluate() -> torch.Tensor:
                zero.zero_grad()
                loss = ddp(x).pow(2).mean()
                loss.backward()
                return loss
            return evaluate

        losses.append([zero.step(loss_of(ddp, zero)).item() for ddp, zero in ((ours_ddp, zeros[0]), (theirs_ddp, zeros[1]))])
        differences.append(_difference(ours, theirs, *zeros))
    return {"differences": differences, "losses": losses}


def add_param_group(seed: int, optimizer: str = "adamw", steps: int = 4, lr_changed_first: bool = False) -> dict:
    """Both ZeROs start with the weights only; after two steps the biases are added as a group of their own
    (``lr_changed_first``: after the first group's lr was cut tenfold, as a scheduler cuts it between steps)."""
    optimizer_class, defaults = OPTIMIZERS[optimizer]
    ours, theirs, ours_ddp, theirs_ddp = _pair(seed, torch.float64, "minidp")
    zeros = [md.ZeroRedundancyOptimizer(_groups(ours, defaults["lr"], only_weights=True), optimizer_class, **defaults),
             TorchZero(_groups(theirs, defaults["lr"], only_weights=True), optimizer_class, **defaults)]
    differences, partitions = [], []
    for step in range(steps):
        if step == 2:
            for zero, module in zip(zeros, (ours, theirs)):
                if lr_changed_first:
                    zero.param_groups[0]["lr"] /= 10
                zero.add_param_group(_groups(module, defaults["lr"])[1])
            partitions = [_index_partition(ours, zeros[0].shares), _torch_partition(theirs, zeros[1])]
        _train_step([(ours_ddp, zeros[0]), (theirs_ddp, zeros[1])], seed, step, torch.float64)
        differences.append(_difference(ours, theirs, *zeros))
    return {"differences": differences, "partitions": partitions}


def checkpoint(seed: int, to: int, optimizer: str = "adamw") -> dict:
    """Train two steps, consolidate on rank ``to``, compare the state dicts; then load each state dict into a
    fresh optimizer of the *other* implementation, train two more steps and compare after each."""
    optimizer_class, defaults = OPTIMIZERS[optimizer]
    ours, theirs, ours_ddp, theirs_ddp = _pair(seed, torch.float64, "minidp")
    zeros = [md.ZeroRedundancyOptimizer(_groups(ours, defaults["lr"]), optimizer_class, **defaults),
             TorchZero(_groups(theirs, defaults["lr"]), optimizer_class, **defaults)]
    for step in range(2):
        _train_step([(ours_ddp, zeros[0]), (theirs_ddp, zeros[1])], seed, step, torch.float64)
    for zero in zeros:
        zero.consolidate_state_dict(to=to)
    result: dict[str, Any] = {}
    if dist.get_rank() == to:
        state_dicts = [zero.state_dict() for zero in zeros]
        result["same_state_dict"] = _same_value(*state_dicts)
        result["entries"] = len(state_dicts[0]["state"])
    else:
        state_dicts = [None, None]
        try:
            zeros[0].state_dict()
            result["not_consolidated"] = "no error"
        except RuntimeError as error:
            result["not_consolidated"] = str(error)
    dist.broadcast_object_list(state_dicts, src=to)
    fresh = [md.ZeroRedundancyOptimizer(_groups(ours, 1.0), optimizer_class, **defaults),
             TorchZero(_groups(theirs, 1.0), optimizer_class, **defaults)]
    fresh[0].load_state_dict(copy.deepcopy(state_dicts[1]))  # torch's state dict into minidp's optimizer
    fresh[1].load_state_dict(copy.deepcopy(state_dicts[0]))  # and minidp's into torch's
    result["after_load"] = _difference(ours, theirs, *fresh)
    result["differences"] = []
    for step in range(2, 4):
        _train_step([(ours_ddp, fresh[0]), (theirs_ddp, fresh[1])], seed, step, torch.float64)
        result["differences"].append(_difference(ours, theirs, *fresh))
    return result


def malformed_state_dict(seed: int, malformed: str) -> dict[str, Any]:
    """After a step of SGD with momentum, a state dict whose groups set lr=123, malformed (``"no state"``: without
    "state"; ``"index past the end"``: state for a parameter index the optimizer does not have), loaded into minidp's
    optimizer and into torch's: per library, the error, and whether lr and this rank's momentum were left as they were."""
    result: dict[str, Any] = {}
    for name, zero_class in (("minidp", md.ZeroRedundancyOptimizer), ("torch", TorchZero)):
        torch.manual_seed(seed)
        module = varied()
        zero = zero_class(module.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        module(_batch(seed, 0, dist.get_rank(), torch.float32)).sum().backward()
        zero.step()
        groups = [dict(group, lr=123.0, params=list(range(len(group["params"])))) for group in zero.param_groups]
        state = {} if malformed == "no state" else {"state": {99: {"momentum_buffer": torch.zeros(1)}}}
        before = [(p, zero.optim.state[p]["momentum_buffer"].clone()) for p in zero.optim.state]
        result[name] = error_of(lambda: zero.load_state_dict({**state, "param_groups": groups}))
        result[f"{name} untouched"] = (
            [g["lr"] for g in zero.param_groups] == [0.1] and len(zero.optim.state) == len(before)
            and all(torch.equal(zero.optim.state[p]["momentum_buffer"], buffer) for p, buffer in before))
    return result


def subgroup_without_rank_0(seed: int, steps: int = 3) -> dict:
    """Both optimizers (each under its own library's DDP) on a group of the ranks after 0, where global and group
    ranks differ: each share is broadcast from its owner's global rank, and consolidate_state_dict(to=0) gathers on
    the group's rank 0 (global rank 1). After every step the first difference, as in :func:`against_torch`; the state
    dicts compared on the group's rank 0. Rank 0 is outside the group; an error is reported as a difference."""
    group = dist.new_group(list(range(1, dist.get_world_size())))
    result: dict[str, Any] = {"differences": [], "same_state_dict": None}
    if dist.get_rank() == 0:
        return result
    optimizer_class, defaults = OPTIMIZERS["adamw"]
    torch.manual_seed(seed + dist.get_rank())  # the DDP constructors must broadcast the group's first rank's
    theirs = varied()
    ours = copy.deepcopy(theirs)
    try:
        with warnings.catch_warnings():  # torch 2.13 deprecates the name broadcast_buffers (same meaning)
            warnings.simplefilter("ignore", FutureWarning)
            ours_ddp = md.DistributedDataParallel(ours, process_group=group)
            theirs_ddp = TorchDDP(theirs, process_group=group)
        zeros = [md.ZeroRedundancyOptimizer(_groups(ours, defaults["lr"]), optimizer_class, process_group=group, **defaults),
                 TorchZero(_groups(theirs, defaults["lr"]), optimizer_class, process_group=group, **defaults)]
        for step in range(steps):
            _train_step([(ours_ddp, zeros[0]), (theirs_ddp, zeros[1])], seed, step, torch.float32)
            result["differences"].append(_difference(ours, theirs, *zeros))
        for zero in zeros:
            zero.consolidate_state_dict(to=0)
        if dist.get_rank(group) == 0:
            result["same_state_dict"] = _same_value(*(zero.state_dict() for zero in zeros))
    except Exception as error:  # every rank of the group meets it alike: reported, not raised into the job
        result["differences"].append(f"raised {type(error).__name__}: {error}")
    return result


def checkpoint_into_another_dtype(seed: int) -> dict:
    """Adagrad trained two steps in float32 under torch's ZeroRedundancyOptimizer, its consolidated state dict loaded
    into float64 models under both implementations, two more steps: per step the first difference (bitwise), and the
    dtypes of this rank's loaded state (torch's load keeps the state dict's dtype)."""
    ours32, theirs32, _, theirs32_ddp = _pair(seed, torch.float32, "minidp")
    saved_zero = TorchZero(_groups(theirs32, 0.1), torch.optim.Adagrad, lr=0.1)
    for step in range(2):
        _train_step([(theirs32_ddp, saved_zero)], seed, step, torch.float32)
    saved_zero.consolidate_state_dict(to=0)
    saved = [saved_zero.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    ours, theirs, ours_ddp, theirs_ddp = _pair(seed, torch.float64, "minidp")
    zeros = [md.ZeroRedundancyOptimizer(_groups(ours, 0.1), torch.optim.Adagrad, lr=0.1),
             TorchZero(_groups(theirs, 0.1), torch.optim.Adagrad, lr=0.1)]
    for zero in zeros:
        zero.load_state_dict(copy.deepcopy(saved[0]))
    dtypes = [{str(value["sum"].dtype) for value in zero.optim.state.values()} for zero in zeros]
    differences = []
    for step in range(2, 4):
        _train_step([(ours_ddp, zeros[0]), (theirs_ddp, zeros[1])], seed, step, torch.float64)
        differences.append(_difference(ours, theirs, *zeros))
    return {"dtypes": dtypes, "differences": differences}


def state_memory(seed: int) -> dict:
    """Bytes of AdamW state on this rank after a step: minidp's ZeRO, torch's, and a plain AdamW on every
    parameter; and the largest parameter's share of it (the greedy partition's bound is 1/W plus that)."""
    torch.manual_seed(seed)
    modules = [varied() for _ in range(3)]
    for module in modules:
        for p in module.parameters():
            p.grad = torch.ones_like(p)
    zeros = [md.ZeroRedundancyOptimizer(modules[0].parameters(), torch.optim.AdamW, lr=0.01),
             TorchZero(modules[1].parameters(), torch.optim.AdamW, lr=0.01)]
    plain = torch.optim.AdamW(modules[2].parameters(), lr=0.01)
    for optimizer in (*zeros, plain):
        optimizer.step()
    largest = max(modules[0].parameters(), key=lambda p: p.numel())
    return {
        "minidp": md.optimizer_state_bytes(zeros[0]),
        "torch": md.optimizer_state_bytes(zeros[1]),
        "plain": md.optimizer_state_bytes(plain),
        "largest_parameter": 2 * largest.numel() * largest.element_size() + 4,  # exp_avg, exp_avg_sq, step
    }


# ---- bad input: the error each rank raises -------------------------------------------------------


def empty_params(seed: int, ranks: tuple[int, ...]) -> tuple[str, str]:
    """``params`` is empty on ``ranks``, a model's parameters elsewhere."""
    params = [] if dist.get_rank() in ranks else list(varied().parameters())
    return error_of(lambda: md.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1))


def mismatched_shapes(seed: int) -> tuple[str, str]:
    """Rank 1's middle layer is one output wider."""
    wide = dist.get_rank() == 1
    module = nn.Sequential(nn.Linear(12, 24), nn.Linear(24, 17 if wide else 16))
    return error_of(lambda: md.ZeroRedundancyOptimizer(module.parameters(), torch.optim.SGD, lr=0.1))


def params_as_a_set(seed: int) -> tuple[str, str]:
    """A model's parameters given as a set (its order follows the tensors' addresses, another in every process)."""
    return error_of(lambda: md.ZeroRedundancyOptimizer(set(varied().parameters()), torch.optim.SGD, lr=0.1))


def mismatched_groups(seed: int) -> tuple[str, str]:
    """The same parameters, in one group on rank 0 and in two on the others."""
    module = varied()
    groups = [{"params": list(module.parameters())}] if dist.get_rank() == 0 else _groups(module, 0.1)
    return error_of(lambda: md.ZeroRedundancyOptimizer(groups, torch.optim.SGD, lr=0.1))


def optimizer_class_per_rank(seed: int) -> tuple[str, str]:
    """SGD on rank 0, Adam on the others, over the same parameters."""
    optimizer = torch.optim.SGD if dist.get_rank() == 0 else torch.optim.Adam
    return error_of(lambda: md.ZeroRedundancyOptimizer(varied().parameters(), optimizer, lr=0.1))


def lr_per_rank(seed: int) -> tuple[str, str]:
    """SGD everywhere, lr 0.1 on rank 0 and 0.5 on the others."""
    lr = 0.1 if dist.get_rank() == 0 else 0.5
    return error_of(lambda: md.ZeroRedundancyOptimizer(varied().parameters(), torch.optim.SGD, lr=lr))


def group_lr_per_rank(seed: int) -> tuple[str, str]:
    """The same defaults everywhere; the second group's own lr 0.05 on rank 0 and 0.2 on the others."""
    groups = _groups(varied(), 0.1 if dist.get_rank() == 0 else 0.4)
    return error_of(lambda: md.ZeroRedundancyOptimizer(groups, torch.optim.SGD, lr=0.1))


def mixed_dtypes(seed: int) -> tuple[str, str]:
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).double())
    return error_of(lambda: md.ZeroRedundancyOptimizer(module.parameters(), torch.optim.SGD, lr=0.1))


class FailsInSecondStep(torch.optim.SGD):
    """SGD whose second step raises on rank ``failing_rank``, as a failing optimizer step would (out of
    memory, a bad gradient)."""

    def __init__(self, params: Any, failing_rank: int, **defaults: Any) -> None:
        super().__init__(params, **defaults)
        self.failing_rank, self.steps = failing_rank, 0

    def step(self, closure=None):
        self.steps += 1
        if self.steps == 2 and dist.get_rank() == self.failing_rank:
            raise RuntimeError(f"planted failure in the second step on rank {dist.get_rank()}")
        return super().step(closure)


def failing_step(seed: int, failing_rank: int) -> dict:
    """Rank ``failing_rank``'s local step raises in the second step: the error each rank raises, and
    whether every rank then holds the same parameters (gathered through the same process group)."""
    module = varied()
    zero = md.ZeroRedundancyOptimizer(module.parameters(), FailsInSecondStep, lr=0.1, failing_rank=failing_rank)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    zero.step()
    error = error_of(zero.step)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)  # the group still works: no rank was left inside a broadcast
    return {"error": error, "same_parameters": all(torch.equal(flat, other) for other in everyone)}


class PlantedError(Exception):
    """An exception type of the user's own: no built-in one has its name."""


def error_in_the_step_everywhere(seed: int) -> dict:
    """A closure that raises on every rank inside the step: a :class:`PlantedError`, then a ``torch.OutOfMemoryError``;
    for minidp's optimizer and torch's, the type's name of what ``step`` raised, and whether it is the very object the
    closure raised."""
    results = {}
    for planted in (PlantedError("planted in the closure"), torch.OutOfMemoryError("planted out of memory")):
        for name, zero_class in (("minidp", md.ZeroRedundancyOptimizer), ("torch", TorchZero)):
            zero = zero_class(varied().parameters(), torch.optim.SGD, lr=0.1)

            def closure() -> float:
                raise planted

            try:
                zero.step(closure)
                results[f"{type(planted).__name__} {name}"] = ("no error", False)
            except Exception as error:
                results[f"{type(planted).__name__} {name}"] = (type(error).__name__, error is planted)
    return results


def add_param_group_refused_on_one_rank(seed: int) -> dict:
    """Rank 1 adds a group holding a parameter already in the optimizer (torch's ValueError); the others
    a new one. Every rank raises, and no rank keeps the new group."""
    module = varied()
    first, extra = list(module.parameters())[:-1], list(module.parameters())[-1]
    zero = md.ZeroRedundancyOptimizer(first, torch.optim.SGD, lr=0.1)
    error = error_of(lambda: zero.add_param_group({"params": [first[0] if dist.get_rank() == 1 else extra]}))
    return {"error": error, "groups": len(zero.param_groups), "local_groups": len(zero.optim.param_groups)}


def step_hooks_under_join(seed: int) -> dict:
    """Uneven inputs under ``Join([ddp, zero])``, rank r training on 1 + 2r batches, minidp's DDP and optimizer, then
    torch's: how often the optimizer's step pre- and post-hooks and the global ones ran on this rank for each, and the
    first difference between the two models after it, or None."""
    ours, theirs, ours_ddp, theirs_ddp = _pair(seed, torch.float64, "minidp")
    optimizer_class, defaults = OPTIMIZERS["sgd"]
    zeros = {"minidp": md.ZeroRedundancyOptimizer(ours.parameters(), optimizer_class, **defaults),
             "torch": TorchZero(theirs.parameters(), optimizer_class, **defaults)}
    calls = {name: dict.fromkeys(("pre", "post", "global pre", "global post"), 0) for name in zeros}

    def counting(when: str):
        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for name, zero in zeros.items():
                if optimizer is zero:  # the global hooks see the local optimizers' steps too
                    calls[name][when] += 1
        return hook

    handles = [register_optimizer_step_pre_hook(counting("global pre")),
               register_optimizer_step_post_hook(counting("global post"))]
    for zero in zeros.values():
        handles += [zero.register_step_pre_hook(counting("pre")), zero.register_step_post_hook(counting("post"))]
    try:
        for ddp, zero in ((ours_ddp, zeros["minidp"]), (theirs_ddp, zeros["torch"])):
            with Join([ddp, zero]):
                for step in range(1 + 2 * dist.get_rank()):
                    zero.zero_grad()
                    ddp(_batch(seed, step, dist.get_rank(), torch.float64)).pow(2).mean().backward()
                    zero.step()
    finally:
        for handle in handles:
            handle.remove()
    return {"calls": calls, "differences": [_difference(ours, theirs, zeros["minidp"], zeros["torch"])]}


def _steps_alone_under_join(zero: torch.optim.Optimizer, module: nn.Module) -> None:
    """Uneven inputs with ``zero``, an Adam over ``module``'s parameters, as ``Join``'s only Joinable: rank r steps
    2 + r times, every gradient ones on every rank (as if averaged)."""
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    with Join([zero]):
        for _ in range(2 + dist.get_rank()):
            zero.step()


def alone_under_join(seed: int, empty_first_group: bool = False) -> dict:
    """:func:`_steps_alone_under_join` with minidp's optimizer (``empty_first_group``: its parameters in a second
    group, after an empty one). A joined rank's hook steps its share from the gradients it holds, so every rank ends
    with what a plain Adam makes of as many steps as the last rank took: the first parameter or gradient that is not
    bitwise equal to the plain Adam's, or None. Also the ``join_device`` of minidp's optimizer and of torch's, built on
    the same groups."""
    torch.manual_seed(seed)  # the same parameters on every rank, as after DDP's construction
    module = varied()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    groups = [{"params": []}, {"params": params}] if empty_first_group else params
    zero = md.ZeroRedundancyOptimizer(groups, torch.optim.Adam, lr=0.01)
    _steps_alone_under_join(zero, module)
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    for p in reference.parameters():
        p.grad = torch.ones_like(p)
    for _ in range(2 + dist.get_world_size() - 1):
        plain.step()
    return {"differences": [first_difference(module, reference)],
            "join_devices": [str(zero.join_device), str(TorchZero(groups, torch.optim.Adam, lr=0.01).join_device)]}


def torch_alone_under_join(seed: int) -> None:
    """:func:`_steps_alone_under_join` with torch's optimizer: its join hook calls ``step()``, which notifies the
    ``Join`` context again, so a joined rank issues one all-reduce more than the others (a job expected to fail)."""
    torch.manual_seed(seed)
    module = varied()
    _steps_alone_under_join(TorchZero(module.parameters(), torch.optim.Adam, lr=0.01), module)
