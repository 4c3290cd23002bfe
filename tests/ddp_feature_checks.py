"""Checks of torch DDP's features beyond the basic step, run inside every rank of a job started by
``minidp.distributed.launch`` (as :mod:`tests.ddp_checks`, whose comparison helpers they reuse).

Each check drives stock ``torch.nn.parallel.DistributedDataParallel`` and minidp's class side by side
in the same process, on the same data, and returns plain facts for ``tests/test_ddp_*.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import os
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, quantization_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import minidp
import minidp.distributed as md

from .ddp_checks import TorchDDP, _difference
from .helpers import ScaledByBuffer, cpu_ids, error_of, max_relative_error, state_difference


def _quiet(build: Callable[[], Any]) -> Any:
    """Stock DDP warns about deprecated names and create_graph; the checks compare results, not warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build()


def _pair(build: Callable[[], nn.Module], seed: int, **options: Any) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """Stock DDP and minidp's around two copies of one model, different weights on every rank (the
    constructors broadcast rank 0's): (stock wrapper, minidp wrapper, stock module, minidp module)."""
    torch.manual_seed(seed + dist.get_rank())
    theirs_module = build()
    ours_module = copy.deepcopy(theirs_module)
    theirs = _quiet(lambda: TorchDDP(theirs_module, **options))
    ours = md.DistributedDataParallel(ours_module, **options)
    return theirs, ours, theirs_module, ours_module


def _inputs(seed: int, step: int, *shape: int) -> torch.Tensor:
    """This rank's batch at ``step``: different on every rank and step, the same for both wrappers."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1000 * step + dist.get_rank()))


def _tanh_mlp() -> nn.Module:
    """Smooth everywhere, so that second derivatives are not zero (ReLU's are)."""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


# ---- pickling -----------------------------------------------------------------------------------


def _sgd_steps(pairs, seed: int, first_step: int, steps: int) -> list:
    """Train each (wrapper, module, optimizer) of ``pairs`` (stock first) on the same batches; per step,
    the first difference between the two modules."""
    differences = []
    for step in range(first_step, first_step + steps):
        for ddp, _, optimizer in pairs:
            optimizer.zero_grad()
            ddp(_inputs(seed, step, 5, 6)).pow(2).mean().backward()
            optimizer.step()
        differences.append(_difference(pairs[1][1], pairs[0][1]))
    return differences


def pickled_then_trained(seed: int, how: str, static_graph: bool = False) -> dict:
    """Train two steps, copy both wrappers (``how``: "torch.save" or "deepcopy"), train the copies two more
    steps: the copies must go on exactly as stock's copy does, with hooks on their own parameters. Also, per
    library, whether its copy's parameters are the same on every rank after that training (``ranks_agree``)."""
    theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed, **({"static_graph": True} if static_graph else {}))
    pairs = [(d, m, torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)) for d, m in ((theirs, theirs_module), (ours, ours_module))]
    before = _sgd_steps(pairs, seed, 0, 2)

    def copied(ddp: nn.Module) -> nn.Module:
        if how == "deepcopy":
            return _quiet(lambda: copy.deepcopy(ddp))
        buffer = io.BytesIO()
        torch.save(ddp, buffer)
        buffer.seek(0)
        return _quiet(lambda: torch.load(buffer, weights_only=False))

    copies = [copied(theirs), copied(ours)]
    ours_copy = copies[1]
    pairs = [(c, c.module, torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9)) for c in copies]
    after = _sgd_steps(pairs, seed, 2, 2)
    agree = {}
    for name, copy_ in (("stock", copies[0]), ("minidp", copies[1])):
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, [p.detach() for p in copy_.parameters()])
        agree[name] = all(all(map(torch.equal, every_rank[0], other)) for other in every_rank[1:])
    return {
        "differences": before + after,
        "ranks_agree": agree,
        "process_group_is_default": ours_copy.process_group is dist.group.WORLD,
        "shares_parameters": any(a is b for a, b in zip(ours_copy.parameters(), ours_module.parameters())),
        "original_untouched": _difference(ours_module, theirs_module),
    }


class _Kept(logging.Handler):
    """A logging handler that keeps the messages it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def told_none_unused(seed: int) -> dict[str, Any]:
    """minidp's wrapper with ``find_unused_parameters=True``, three steps, on a model whose forward uses every
    parameter, and on one that leaves a layer out: what each logged (torch's reducer prints its notice from C++ to
    the process's stderr, not as a warning), and whether any warning was raised under ``simplefilter("error")``, as
    a program that turns warnings into errors runs. From the notice untold, as in a fresh process (another check of
    the job may have told it)."""
    from minidp.distributed.reducer import LOG, told_none_unused

    told_none_unused.clear()

    seen: dict[str, Any] = {}
    for name, build in (("all_used", _tanh_mlp), ("one_unused", _PartlyUsedBy0)):
        torch.manual_seed(seed)
        kept = _Kept()
        LOG.addHandler(kept)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ddp = md.DistributedDataParallel(build(), find_unused_parameters=True)
                for step in range(3):
                    out = ddp(_inputs(seed, step, 5, 6))
                    (out[0] if isinstance(out, tuple) else out).pow(2).mean().backward()
            seen[name] = kept.messages
        except Warning as warned:
            seen[name] = f"raised {type(warned).__name__}: {warned}"
        finally:
            LOG.removeHandler(kept)
    return seen


def pickled_then_trained_with_python_reducer(seed: int, how: str) -> dict:
    """:func:`pickled_then_trained`, both wrappers built (and copied) under ``torch._dynamo.config.optimize_ddp =
    "python_reducer"``: torch's reduces through per-parameter hooks its ``__init__`` registers, which its
    ``__setstate__`` does not register again."""
    with _optimize_ddp("python_reducer"):
        return pickled_then_trained(seed, how)


def _evaluated_batch_norm() -> nn.Module:
    return _with_batch_norm().eval()


def distributed_checkpoint_as_stock(seed: int) -> dict:
    """``torch.distributed.checkpoint``'s state dict API on both wrappers after two steps of SGD with momentum (a
    model with BatchNorm buffers, in eval mode: DCP takes a plain tensor for one every rank holds alike and saves one
    rank's, while a training BatchNorm's statistics differ between ranks after each forward, under either wrapper):
    ``get_state_dict`` (keys and values, the model's and the optimizer's, sharded and
    whole: ``same_state_dicts``); checkpoints saved with ``dcp.save`` by each wrapper, loaded (``set_state_dict``) into
    a fresh wrapper of the other, on other weights, and trained two more steps beside the saved ones (``resumed``, the
    first difference per step); the same checkpoints loaded into the plain unwrapped model (``plain_loaded``)."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    rank = dist.get_rank()
    wrappers = {"torch": lambda module: _quiet(lambda: TorchDDP(module)), "minidp": md.DistributedDataParallel}
    theirs, ours, theirs_module, ours_module = _pair(_evaluated_batch_norm, seed)
    pairs = [(d, m, torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)) for d, m in ((theirs, theirs_module), (ours, ours_module))]
    _sgd_steps(pairs, seed, 0, 2)

    def state(ddp: nn.Module, optimizer: torch.optim.Optimizer, whole: bool = False) -> dict:
        model_state, optimizer_state = get_state_dict(ddp, optimizer, options=StateDictOptions(full_state_dict=whole))
        return {"model": model_state, "optimizer": optimizer_state}

    same_state_dicts = all(state_difference(state(*pairs[1][::2], whole), state(*pairs[0][::2], whole)) is None
                           for whole in (False, True))
    directory = [tempfile.mkdtemp(prefix="minidp-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    for library, (ddp, _, optimizer) in zip(wrappers, pairs):
        dcp.save(state(ddp, optimizer), checkpoint_id=f"{directory[0]}/{library}")
    loaded = {}  # (saved by, loaded into): a fresh wrapper on other weights, given the checkpoint
    for saved, into in (("torch", "minidp"), ("minidp", "torch")):
        torch.manual_seed(seed + 7)  # (the constructor broadcasts rank 0's weights: the same on every rank)
        ddp = wrappers[into](_evaluated_batch_norm())
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        loaded_state = state(ddp, optimizer)
        dcp.load(loaded_state, checkpoint_id=f"{directory[0]}/{saved}")
        set_state_dict(ddp, optimizer, model_state_dict=loaded_state["model"], optim_state_dict=loaded_state["optimizer"])
        loaded[saved, into] = (ddp, ddp.module, optimizer)
    plain_loaded = {}
    for saved, (_, module, _) in zip(wrappers, pairs):
        plain = _evaluated_batch_norm()
        plain_state = {"model": plain.state_dict()}
        dcp.load(plain_state, checkpoint_id=f"{directory[0]}/{saved}")
        plain.load_state_dict(plain_state["model"])
        plain_loaded[saved] = state_difference(plain.state_dict(), module.state_dict()) is None
    # minidp's beside stock's, the original of each beside the other library's resumed copy (_difference's order)
    beside = {"saved by torch, loaded into minidp": (loaded["torch", "minidp"][1], theirs_module),
              "saved by minidp, loaded into torch": (ours_module, loaded["minidp", "torch"][1])}
    resumed: dict[str, list] = {name: [] for name in beside}
    for step in (2, 3):
        for ddp, _, optimizer in [*pairs, *loaded.values()]:
            optimizer.zero_grad()
            ddp(_inputs(seed, step, 5, 6)).pow(2).mean().backward()
            optimizer.step()
        for name, (mine, stock) in beside.items():
            resumed[name].append(_difference(mine, stock))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory[0])
    return {"same_state_dicts": same_state_dicts, "resumed": resumed, "plain_loaded": plain_loaded,
            "is_torchs_class": isinstance(ours, TorchDDP)}


def tensor_parallel_parameters_on_a_sliced_mesh(seed: int) -> str:
    """minidp's DDP given the data-parallel slice of a (ranks x 1) mesh and a module whose weight is a DTensor on the
    other dimension (tensor parallelism, which torch DDP makes local around each forward): what it raises."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh["tp"], [Replicate()]))
    try:
        md.DistributedDataParallel(model, device_mesh=mesh["dp"])
    except NotImplementedError as error:
        return str(error)
    return "no error"


def pickling_with_a_subgroup(seed: int) -> dict:
    """torch DDP pickles only with the default group; both errors."""
    group = dist.new_group(list(range(dist.get_world_size())))
    errors = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        ddp = _quiet(lambda: wrapper(nn.Linear(3, 3), process_group=group))
        try:
            torch.save(ddp, io.BytesIO())
            errors[name] = "no error"
        except RuntimeError as error:
            errors[name] = str(error)
    return errors


def subgroup_without_rank_0_as_stock(seed: int) -> dict:
    """Both wrappers on a group of the ranks after 0 (global and group ranks differ), trained as
    :func:`tests.ddp_checks.against_torch` trains them: the rebuilt plan is broadcast from the group's rank 0, which is
    not global rank 0. Rank 0 is outside the group (no differences); an error is reported as a difference."""
    group = dist.new_group(list(range(1, dist.get_world_size())))
    if dist.get_rank() == 0:
        return {"differences": []}
    from .ddp_checks import against_torch

    try:
        return against_torch(seed, model="resnet_bn", bucket_cap_mb=0.001, process_group=group)
    except Exception as error:  # every rank of the group meets it alike: reported, not raised into the job
        return {"differences": [f"raised {type(error).__name__}: {error}"]}


# ---- second-order gradients -----------------------------------------------------------------------


class _Power(nn.Module):
    """One parameter, the model of torch's ``test_ddp_create_graph``: stock DDP supports this case."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(3))

    def forward(self) -> torch.Tensor:
        return self.p.pow(3).sum()


def create_graph_as_stock(seed: int) -> dict:
    """``backward(create_graph=True)`` six times (gradients accumulate with their graphs), as in torch's
    test: per backward, the gradient's values, ``requires_grad`` and ``grad_fn``, in stock and minidp, and
    whether minidp's ``.grad`` differentiates to zero (its graph ends in the copy of the mean; stock's
    reaches back through its C++ bucket copies to a value that is no derivative of the mean: stock
    warns that this is not supported, and minidp does not imitate it)."""
    theirs, ours, theirs_module, ours_module = _pair(_Power, seed)
    seen: dict[str, list] = {"stock": [], "minidp": []}
    for name, ddp, module in (("stock", theirs, theirs_module), ("minidp", ours, ours_module)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(6):
                ddp().backward(create_graph=True)
                grad = module.p.grad
                (through,) = torch.autograd.grad(grad.pow(2).sum(), module.p, retain_graph=True)
                seen[name].append((grad.detach().clone(), through, grad.requires_grad, type(grad.grad_fn).__name__))
        if name == "minidp":
            seen["warnings"] = [str(w.message) for w in caught if "create_graph=True" in str(w.message)]
    return {
        "equal": all(torch.equal(a[0], b[0]) and a[2:] == b[2:] for a, b in zip(seen["stock"], seen["minidp"])),
        "through_is_zero": all(not s[1].any() for s in seen["minidp"]),
        "stock": [s[2:] for s in seen["stock"]],
        "warnings": seen["warnings"],
    }


def create_graph_with_several_parameters(seed: int) -> dict:
    """Several parameters (stock raises "a leaf Variable that requires grad is being used in an in-place
    operation" here): minidp's ``.grad`` holds the mean over ranks of every rank's gradient, compared with
    the same model unwrapped on every rank's batch (float64), and keeps ``requires_grad``; as in stock's
    one-parameter case, its graph ends in the copy of the mean, so differentiating through it gives zeros."""
    torch.manual_seed(seed)
    module = _tanh_mlp().double()
    ddp = md.DistributedDataParallel(module)
    single = copy.deepcopy(module)
    x = _inputs(seed, 0, 4, 6).double()
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp(x).pow(2).mean().backward(create_graph=True)
    per_rank = [torch.autograd.grad(single(xr).pow(2).mean(), list(single.parameters())) for xr in everyone]
    mean = [sum(g) / len(everyone) for g in zip(*per_rank)]
    through = torch.autograd.grad(sum(p.grad.pow(2).sum() for p in module.parameters()), list(module.parameters()))
    return {
        "error": max(max_relative_error(p.grad, m) for p, m in zip(module.parameters(), mean)),
        "requires_grad": all(p.grad.requires_grad for p in module.parameters()),
        "through_is_zero": all(not t.any() for t in through),
    }


def gradient_penalty_as_stock(seed: int, steps: int = 3) -> list:
    """A gradient penalty on the inputs (``autograd.grad(create_graph=True)`` inside the loss, WGAN-GP's
    pattern), then an ordinary backward: bitwise stock's parameters after every step."""
    theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed)
    optimizers = [torch.optim.SGD(d.parameters(), lr=0.1) for d in (theirs, ours)]
    differences = []
    for step in range(steps):
        for ddp, optimizer in zip((theirs, ours), optimizers):
            optimizer.zero_grad()
            x = _inputs(seed, step, 5, 6).requires_grad_()
            out = ddp(x)
            (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (out.pow(2).mean() + (slope.norm(dim=1) - 1).pow(2).mean()).backward()
            optimizer.step()
        differences.append(_difference(ours_module, theirs_module))
    return differences


def post_accumulate_grad_hooks_as_stock(seed: int, steps: int = 3, between_forward_and_backward: bool = False,
                                       **options: Any) -> dict:
    """A user's post-accumulate-grad hook registered after wrapping (``between_forward_and_backward``: after the first
    step's forward, before its backward), which doubles ``.grad`` in place: what it saw and the modules after every
    step, stock against minidp (stock's reducer hook runs after every such hook)."""
    theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed, **options)
    seen: dict[str, list] = {"stock": [], "minidp": []}

    def register(name: str, module: nn.Module) -> None:
        for parameter in module.parameters():
            def doubled(p: torch.Tensor, kept: list = seen[name]) -> None:
                kept.append(p.grad.clone())
                p.grad.mul_(2)

            parameter.register_post_accumulate_grad_hook(doubled)

    wrappers = (("stock", theirs, theirs_module), ("minidp", ours, ours_module))
    if not between_forward_and_backward:
        for name, _, module in wrappers:
            register(name, module)
    optimizers = [torch.optim.SGD(d.parameters(), lr=0.1) for d in (theirs, ours)]
    differences = []
    for step in range(steps):
        for (name, ddp, module), optimizer in zip(wrappers, optimizers):
            optimizer.zero_grad()
            loss = ddp(_inputs(seed, step, 5, 6)).pow(2).mean()
            if between_forward_and_backward and step == 0:
                register(name, module)
            loss.backward()
            optimizer.step()
        differences.append(_difference(ours_module, theirs_module))
    same_seen = len(seen["stock"]) == len(seen["minidp"]) and all(map(torch.equal, seen["stock"], seen["minidp"]))
    return {"differences": differences, "same_seen": same_seen, "hook_calls": len(seen["minidp"])}


def swapped_after_wrapping(seed: int) -> dict:
    """``load_state_dict`` on the wrapper with ``torch.__future__.set_swap_module_params_on_conversion(True)``, as a
    resumed run loads its checkpoint, then one step: per wrapper, where it raised (``"load"``, ``"forward"``, or
    ``None``) and the error's type, and whether every gradient is then the ranks' mean."""
    theirs, ours, _, _ = _pair(_tanh_mlp, seed)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    results = {}
    try:
        for name, ddp in (("stock", theirs), ("minidp", ours)):
            where = "load"
            try:
                ddp.load_state_dict(copy.deepcopy(ddp.state_dict()))
                where = "forward"
                ddp(_inputs(seed, 0, 5, 6)).pow(2).mean().backward()
                results[name] = {"raised": None, "averaged": _averaged(ddp)}
            except RuntimeError as error:
                results[name] = {"raised": (where, type(error).__name__), "averaged": None}
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    return results


def parametrized_after_wrapping(seed: int) -> Optional[str]:
    """``register_parametrization`` on a weight of the module minidp's DDP (``find_unused_parameters=True``) wraps,
    after wrapping (it calls ``set_()`` on the weight, which gives it another gradient accumulator), then one step:
    the error's message, ``None`` if none."""
    torch.manual_seed(seed)
    module = _tanh_mlp().double()
    ddp = md.DistributedDataParallel(module, find_unused_parameters=True)

    class Doubled(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return 2 * weight

    parametrize.register_parametrization(module[2], "weight", Doubled())
    try:
        ddp(_inputs(seed, 0, 5, 6).double()).pow(2).mean().backward()
    except RuntimeError as error:
        return str(error)
    return None


def _averaged(ddp: nn.Module) -> bool:
    """Whether every gradient of ``ddp`` is the same on every rank, as a mean of the ranks' is."""
    gradients = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    everyone = [torch.empty_like(gradients) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, gradients)
    return all(torch.equal(gradients, other) for other in everyone)


def _steps_until_an_error(pair: tuple, seed: int, steps: int, step_of: Callable[[nn.Module, int], None]) -> dict:
    """Train ``pair`` (:func:`_pair`) side by side with SGD, ``step_of(wrapper, step)`` running each step's forward and
    backward: per step the first difference, until a step where a wrapper raised (then each one's error, as its type
    and first sentence, and the step)."""
    theirs, ours, theirs_module, ours_module = pair
    optimizers = [torch.optim.SGD(d.parameters(), lr=0.1) for d in (theirs, ours)]
    differences: list = []
    for step in range(steps):
        errors = {}
        for name, ddp, optimizer in (("stock", theirs, optimizers[0]), ("minidp", ours, optimizers[1])):
            optimizer.zero_grad()
            try:  # the cases here raise before any gradient reaches a parameter: no collective is left open
                step_of(ddp, step)
            except RuntimeError as error:
                errors[name] = (type(error).__name__, str(error).split(".")[0])
                continue
            optimizer.step()
        if errors:
            return {"differences": differences, "errors": errors, "step": step}
        differences.append(_difference(ours_module, theirs_module))
    return {"differences": differences, "errors": {}, "step": None}


class _ActorCritic(nn.Module):
    """Two heads that share no parameter, on the same input: a policy and a value, as reinforcement learning's."""

    def __init__(self) -> None:
        super().__init__()
        self.policy, self.value = nn.Linear(6, 3), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy(x).log_softmax(-1), self.value(x)


def two_losses_back_propagated_in_turn(seed: int, steps: int = 3, **options: Any) -> dict:
    """One forward of :class:`_ActorCritic`, then the policy's loss back-propagated, then the value's (no
    ``retain_graph``: the heads share nothing), by each wrapper, for ``steps`` steps of SGD (:func:`_steps_until_an_error`)."""

    def step_of(ddp: nn.Module, step: int) -> None:
        log_probabilities, values = ddp(_inputs(seed, step, 5, 6))
        (-log_probabilities[:, 0].mean()).backward()
        values.pow(2).mean().backward()

    return _steps_until_an_error(_pair(_ActorCritic, seed, **options), seed, steps, step_of)


def two_losses_with_a_rebuild_between(seed: int) -> dict:
    """One forward of :class:`_ActorCritic`, the policy's loss back-propagated, then ``reducer._rebuild_buckets()``, as
    Lightning's manual optimization calls it before each ``manual_backward``, then the value's loss: each wrapper's
    error at the rebuild (type and first sentence, ``None``: none), and where the gradients then differ."""
    theirs, ours, theirs_module, ours_module = _pair(_ActorCritic, seed)
    errors: dict = {}
    for name, ddp in (("stock", theirs), ("minidp", ours)):
        log_probabilities, values = ddp(_inputs(seed, 0, 5, 6))
        (-log_probabilities[:, 0].mean()).backward()
        try:
            ddp.reducer._rebuild_buckets()
            errors[name] = None
        except RuntimeError as error:
            errors[name] = (type(error).__name__, str(error).split(".")[0])
        values.pow(2).mean().backward()
    return {"errors": errors, "gradients": _difference(ours_module, theirs_module)}


class _FailsInBackward(torch.autograd.Function):
    """The identity, whose backward raises: a backward that stops half way, as an error in a custom layer stops it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a backward that fails")


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        hidden = self.first(x)
        return self.second(_FailsInBackward.apply(hidden) if fail else hidden)


def unfinished_reduction_message_as_stock(seed: int, find_unused_parameters: bool) -> dict:
    """A backward that fails after the second layer's gradients (the loop catches the error) leaves the first layer's
    unreduced, and the next forward raises: each wrapper's whole message (``None``: none raised)."""
    theirs, ours, _, _ = _pair(_TwoLayers, seed, find_unused_parameters=find_unused_parameters)
    messages: dict = {}
    for name, ddp in (("stock", theirs), ("minidp", ours)):
        with contextlib.suppress(RuntimeError):
            ddp(_inputs(seed, 0, 5, 6), fail=True).sum().backward()
        try:
            ddp(_inputs(seed, 1, 5, 6))
            messages[name] = None
        except RuntimeError as error:
            messages[name] = str(error)
    return messages


def static_graph_with_find_unused_warnings(seed: int) -> dict:
    """What each constructor warns of, given ``static_graph=True`` and ``find_unused_parameters=True``."""
    warned = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        torch.manual_seed(seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapper(_tanh_mlp(), static_graph=True, find_unused_parameters=True)
        warned[name] = sorted(str(w.message) for w in caught if "find_unused_parameters=true" in str(w.message))
    return warned


class _RunningMean(nn.Module):
    """A linear layer on its inputs less their running mean, a buffer it registers at its first forward (none when
    wrapped), different on every rank (each rank's own batches); ``counter``: a buffer it has from the start too."""

    def __init__(self, counter: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        if counter:
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "running_mean"):
            self.register_buffer("running_mean", torch.zeros(6))
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
            if hasattr(self, "steps"):
                self.steps += 1
        return self.linear(x - self.running_mean)


def buffer_registered_after_wrapping_as_stock(seed: int, counter: bool, steps: int = 3) -> dict:
    """:class:`_RunningMean` trained by each wrapper (:func:`_steps_until_an_error`): torch DDP reads the buffers it syncs
    when wrapping and at each sync (``_assign_modules_buffers``), and syncs only if the last read found one
    (``will_sync_module_buffers``): a model with no buffer when wrapped keeps each rank's own, one with a buffer syncs
    the later one too."""

    def step_of(ddp: nn.Module, step: int) -> None:
        ddp(_inputs(seed, step, 5, 6)).pow(2).mean().backward()

    return _steps_until_an_error(_pair(lambda: _RunningMean(counter), seed), seed, steps, step_of)


def copied_after_a_buffer_was_registered(seed: int) -> dict:
    """A wrapper of :class:`_RunningMean` (no buffer when wrapped) deep-copied after its first forward registered one:
    per wrapper, whether the copy syncs buffers, and its buffer after its first forward (synced from rank 0 first)."""
    theirs, ours, _, _ = _pair(lambda: _RunningMean(False), seed)
    found = {}
    for name, ddp in (("stock", theirs), ("minidp", ours)):
        ddp(_inputs(seed, 0, 5, 6)).pow(2).mean().backward()
        copied = _quiet(lambda: copy.deepcopy(ddp))
        found[name] = {"syncs": copied.will_sync_module_buffers()}
        copied(_inputs(seed, 1, 5, 6))
        found[name]["buffer"] = copied.module.running_mean.tolist()
    return found


def backward_of_some_parameters_with_find_unused(seed: int) -> dict:
    """``find_unused_parameters=True``, then ``loss.backward(inputs=<the head's parameters>)`` (a step that trains one part
    of the model, as a GAN's generator step does), then a whole step: per wrapper, what the head's ``.grad`` became (this
    rank's own gradient, or the mean over the ranks) and the next forward's error, if any (its first sentence)."""
    theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed, find_unused_parameters=True)
    x = _inputs(seed, 0, 5, 6)
    head = list(ours_module[4].parameters())
    local = torch.autograd.grad(ours_module(x).sum(), head)
    mean = [g.clone() for g in local]
    for g in mean:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    outcome = {}
    for name, ddp, module in (("stock", theirs, theirs_module), ("minidp", ours, ours_module)):
        ddp(x).sum().backward(inputs=list(module[4].parameters()))
        grads = [p.grad for p in module[4].parameters()]
        became = ("local" if all(map(torch.equal, grads, local)) else
                  "mean" if all(map(torch.equal, grads, mean)) else "other")
        try:  # stock raises in its forward, before any collective: none is left open
            ddp(_inputs(seed, 1, 5, 6)).sum().backward()
            error = None
        except RuntimeError as caught:
            error = str(caught).split(".")[0]
        outcome[name] = {"head_grad": became, "next_step_error": error}
    return outcome


def output_changed_in_place_as_stock(seed: int, steps: int = 3, sink_clone: bool = True, **options: Any) -> dict:
    """The forward's output changed in place before the loss (``out.mul_(2)`` after a tanh, which saved its output):
    stock clones the outputs with ``find_unused_parameters`` and in a static graph's first iteration
    (``_DDPSink``), so the backward works there (:func:`_steps_until_an_error`)."""
    pair = _pair(lambda: nn.Sequential(_tanh_mlp(), nn.Tanh()), seed, **options)
    for ddp in pair[:2]:
        ddp._set_ddp_sink_clone(sink_clone)

    def step_of(ddp: nn.Module, step: int) -> None:
        output = ddp(_inputs(seed, step, 5, 6))
        output.mul_(2)  # stock without its clone: its function's output is a view, refused here
        output.pow(2).mean().backward()  # else the tanh's backward finds its saved output changed

    return _steps_until_an_error(pair, seed, steps, step_of)


class _Heads(dict):
    """A dict subclass of the user's whose constructor takes the heads by name, and carries an attribute."""

    def __init__(self, main: torch.Tensor, auxiliary: torch.Tensor) -> None:
        super().__init__(main=main, auxiliary=auxiliary)


class _Pair(tuple):
    """A tuple subclass with a constructor of its own."""

    def __new__(cls, main: torch.Tensor, auxiliary: torch.Tensor) -> "_Pair":
        return super().__new__(cls, (main, auxiliary))


@dataclasses.dataclass
class _HeadsInFields:
    main: torch.Tensor
    auxiliary: torch.Tensor


class _HeadsByName(dict):
    """A dict subclass of the user's, without a constructor of its own."""


class _ReturnsAContainer(nn.Module):
    """Two heads on one trunk, returned in a container type of the user's, which torch's pytree takes as a leaf:
    ``pair`` (:class:`_Pair`), ``heads`` (:class:`_Heads`, with a ``rows`` attribute), ``dataclass`` or
    ``dict_subclass``."""

    def __init__(self, container: str) -> None:
        super().__init__()
        self.trunk, self.main, self.auxiliary = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 2)
        self.container = container

    def forward(self, x: torch.Tensor) -> Any:
        hidden = torch.tanh(self.trunk(x))
        main, auxiliary = self.main(hidden), self.auxiliary(hidden)
        if self.container == "pair":
            return _Pair(main, auxiliary)
        if self.container == "dataclass":
            return _HeadsInFields(main, auxiliary)
        if self.container == "dict_subclass":
            return _HeadsByName(main=main, auxiliary=auxiliary)
        heads = _Heads(main, auxiliary)
        heads.rows = x.shape[0]
        return heads


def output_container_as_stock(seed: int, container: str, steps: int = 2, **options: Any) -> dict:
    """A forward returning a container type of the user's where stock passes the outputs through ``_DDPSink``
    (``find_unused_parameters``; a static graph's first iteration): stock flattens them with torch's pytree, which
    leaves a type it does not know as it is; per step the output's type name and ``rows`` attribute in each wrapper,
    and the differences of :func:`_steps_until_an_error`."""
    pair = _pair(lambda: _ReturnsAContainer(container), seed, **options)
    seen: dict[str, list] = {"stock": [], "minidp": []}

    def step_of(ddp: nn.Module, step: int) -> None:
        output = ddp(_inputs(seed, step, 5, 6))
        seen["stock" if ddp is pair[0] else "minidp"].append((type(output).__name__, getattr(output, "rows", None)))
        main, auxiliary = output if container == "pair" else (output["main"], output["auxiliary"])
        (main.pow(2).mean() + auxiliary.mean()).backward()

    result = _steps_until_an_error(pair, seed, steps, step_of)
    agree = {}  # whether each wrapper's ranks hold the same parameters: their gradients were averaged
    for name, module in (("stock", pair[2]), ("minidp", pair[3])):
        flat = torch.cat([p.detach().flatten() for p in module.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, flat)
        agree[name] = all(torch.equal(flat, other) for other in everyone)
    return {**result, "seen": seen, "ranks_agree": agree}


class _MainAndAuxiliary(nn.Module):
    """Two heads on one trunk, returned in a dict: an auxiliary loss may use the second, or not (or the forward may
    not run it: ``auxiliary=False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.main, self.auxiliary = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, auxiliary: bool = True) -> dict:
        hidden = torch.tanh(self.trunk(x))
        return {"main": self.main(hidden), **({"auxiliary": self.auxiliary(hidden)} if auxiliary else {})}


def static_graph_auxiliary_output_as_stock(seed: int, auxiliary_from: Optional[int], steps: int = 4) -> dict:
    """A static graph whose auxiliary output enters the loss from step ``auxiliary_from`` on (``None``: never), beside
    stock (:func:`_steps_until_an_error`; both raise in the forward, if at all)."""

    def step_of(ddp: nn.Module, step: int) -> None:
        output = ddp(_inputs(seed, step, 5, 6))
        uses_auxiliary = auxiliary_from is not None and step >= auxiliary_from
        (output["main"].pow(2).mean() + (output["auxiliary"].pow(2).mean() if uses_auxiliary else 0)).backward()

    return _steps_until_an_error(_pair(_MainAndAuxiliary, seed, static_graph=True), seed, steps, step_of)


def static_graph_accumulating_from_the_first_step(seed: int, steps: int = 3) -> dict:
    """Gradient accumulation from the first step in a static graph (accelerate's ``accumulate()``, Lightning's
    ``accumulate_grad_batches``): a backward under ``no_sync``, then a synchronised one, at every step. minidp's
    against torch DDP without ``static_graph`` (the same graph, reduced bucket by bucket): the first difference per
    step. And what torch's DDP with ``static_graph=True`` does: its reducer fails an internal assert in the first
    synchronised backward (``expect_autograd_hooks_``, torch 2.11 and 2.13), having counted no hook under no_sync."""
    torch.manual_seed(seed + dist.get_rank())
    theirs_module = _tanh_mlp()
    ours_module, static_module = copy.deepcopy(theirs_module), copy.deepcopy(theirs_module)
    theirs = _quiet(lambda: TorchDDP(theirs_module))
    ours = md.DistributedDataParallel(ours_module, static_graph=True)
    pairs = [(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)) for ddp in (theirs, ours)]

    def accumulate(ddp: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        optimizer.zero_grad()
        with ddp.no_sync():
            ddp(_inputs(seed, 2 * step, 5, 6)).pow(2).mean().backward()
        ddp(_inputs(seed, 2 * step + 1, 5, 6)).pow(2).mean().backward()
        optimizer.step()

    differences = []
    for step in range(steps):
        for ddp, optimizer in pairs:
            accumulate(ddp, optimizer, step)
        differences.append(_difference(ours_module, theirs_module))
    static = _quiet(lambda: TorchDDP(static_module, static_graph=True))
    try:
        accumulate(static, torch.optim.SGD(static.parameters(), lr=0.1), 0)
        torch_static = "trained"
    except RuntimeError as error:
        torch_static = str(error).splitlines()[0]
    return {"differences": differences, "torch with static_graph": torch_static}


def static_graph_unused_head_in_a_container(seed: int, container: str, steps: int = 4) -> list:
    """minidp alone, in a static graph (float64): the forward returns :class:`_ReturnsAContainer`'s heads, the
    loss uses the main one only. Per step, the largest relative difference between a gradient and the mean over the
    ranks of an unwrapped copy's gradients on the same batches, or the error (type and first sentence)."""
    torch.manual_seed(seed + dist.get_rank())
    module = _ReturnsAContainer(container).double()
    ddp = md.DistributedDataParallel(module, static_graph=True)
    single = copy.deepcopy(module)  # rank 0's weights, broadcast
    found: list = []
    for step in range(steps):
        x = _inputs(seed, step, 5, 6).double()
        try:
            for model in (ddp, single):
                model.zero_grad()
                output = model(x)
                (output.main if container == "dataclass" else output["main"]).pow(2).mean().backward()
        except RuntimeError as error:  # raised in the forward, before any collective
            found.append(f"{type(error).__name__}: {str(error).split('.')[0]}")
            break
        worst = 0.0
        for ours, alone in zip(module.parameters(), single.parameters()):
            if alone.grad is not None:  # the auxiliary head gets none
                mean = alone.grad.clone()
                dist.all_reduce(mean)
                worst = max(worst, max_relative_error(ours.grad, mean / dist.get_world_size()))
        found.append(worst)
    return found


class _Box:
    """A plain object holding two tensors: neither a dataclass nor a container torch's pytree reads."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first, self.second = first, second


class _ReturnsABox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.first, self.second = _tanh_mlp(), nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> _Box:
        hidden = self.body(x)
        return _Box(self.first(hidden), self.second(hidden))


def static_graph_averaging_against_the_ranks_mean(seed: int, case: str, steps: int = 4) -> dict:
    """Per wrapper, in a static graph (float64): per step, the largest relative difference between a gradient and the
    mean over the ranks of an unwrapped copy's gradients on the same batches. ``case``: ``"input_gradient_first"``, a
    gradient of the output with respect to the inputs before the backward (a saliency map logged, R1's penalty);
    ``"box_output"``, the forward returns :class:`_Box`, whose two heads the loss both uses."""
    found = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        torch.manual_seed(seed + dist.get_rank())
        module = (_ReturnsABox() if case == "box_output" else _tanh_mlp()).double()
        ddp = _quiet(lambda: wrapper(module, static_graph=True))
        single = copy.deepcopy(module)  # rank 0's weights, broadcast
        found[name] = []
        for step in range(steps):
            x = _inputs(seed, step, 5, 6).double().requires_grad_()
            for model in (ddp, single):
                model.zero_grad()
                output = model(x)
                if case == "box_output":
                    (output.first.pow(2).mean() + output.second.pow(2).mean()).backward()
                else:
                    torch.autograd.grad(output.sum(), x, retain_graph=True)
                    output.pow(2).mean().backward()
            worst = 0.0
            for ours, alone in zip(module.parameters(), single.parameters()):
                mean = alone.grad.clone()
                dist.all_reduce(mean)
                worst = max(worst, max_relative_error(ours.grad, mean / dist.get_world_size()))
            found[name].append(worst)
    return found


def frozen_after_wrapping_as_stock(seed: int, frozen_at: Sequence[int], steps: int = 4, static: Optional[str] = "static_graph",
                                   dtype: str = "float32", **options: Any) -> dict:
    """The first layer's weight frozen (``requires_grad_(False)``) after wrapping, at the steps ``frozen_at`` and
    trainable at the others, in a static graph if ``static`` says how (as :func:`uneven_inputs_as_stock`), in ``dtype``,
    beside stock (:func:`_steps_until_an_error`). Where a backward uses it after a static graph's first found it unused,
    both raise at its hook, before their one bucket is full: no collective is left open."""
    pair = _pair(lambda: _tanh_mlp().to(getattr(torch, dtype)), seed,
                 **options, **({"static_graph": True} if static == "static_graph" else {}))
    if static == "set_static_graph":
        for ddp in pair[:2]:
            ddp._set_static_graph()

    def step_of(ddp: nn.Module, step: int) -> None:
        ddp.module[0].weight.requires_grad_(step not in frozen_at)
        ddp(_inputs(seed, step, 5, 6).to(getattr(torch, dtype))).pow(2).mean().backward()

    return _steps_until_an_error(pair, seed, steps, step_of)


def description_as_stock(seed: int) -> dict:
    """What torch DDP says of the module it wraps (``device``, ``device_type``, ``is_multi_device_module``,
    ``_module_parameters``), stock's and minidp's, what each makes of ``device_ids=[]``, and each one's refusal of a module
    without parameters."""
    theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed)

    def described(ddp: nn.Module, module: nn.Module) -> tuple:
        positions = {id(p): i for i, p in enumerate(module.parameters())}
        listed = [positions[id(p)] for p in ddp._module_parameters]
        return (ddp.device, ddp.device_type, ddp.is_multi_device_module, listed)

    empty = [_quiet(lambda: wrapper(_tanh_mlp(), device_ids=[])).device_ids
             for wrapper in (TorchDDP, md.DistributedDataParallel)]
    refusals = []
    for wrapper in (TorchDDP, md.DistributedDataParallel):
        try:
            wrapper(nn.ReLU())
        except RuntimeError as error:
            refusals.append(str(error))
    return {"stock": described(theirs, theirs_module), "minidp": described(ours, ours_module), "empty_device_ids": empty,
            "without_parameters": refusals}


def requires_grad_differs(seed: int) -> dict:
    """``nn.Linear``'s bias frozen on rank 0 only: each wrapper's error at construction (type and message), or None."""
    errors = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        torch.manual_seed(seed)
        model = nn.Linear(3, 2)
        model.bias.requires_grad_(dist.get_rank() != 0)
        try:
            _quiet(lambda: wrapper(model))
            errors[name] = None
        except Exception as error:  # noqa: BLE001 - the type is what is compared
            errors[name] = (type(error).__name__, str(error))
    return errors


def compiled_as_stock(seed: int, steps: int = 3) -> dict:
    """``torch.compile(ddp)`` (AOTAutograd, eager kernels: the backward compiled too), then SGD: bitwise stock's
    parameters after every step; then, compiled alone, where dynamo broke minidp's graph: the functions it was told
    not to trace, each with its count (each reason's line after its title names one)."""
    import torch._dynamo

    def train(wrappers: list[nn.Module], modules: list[nn.Module]) -> list:
        compiled = [torch.compile(ddp, backend="aot_eager") for ddp in wrappers]
        optimizers = [torch.optim.SGD(d.parameters(), lr=0.1) for d in wrappers]
        differences = []
        for step in range(steps):
            for model, optimizer in zip(compiled, optimizers):
                optimizer.zero_grad()
                model(_inputs(seed, step, 5, 6)).pow(2).mean().backward()
                optimizer.step()
            differences.append(_difference(modules[-1], modules[0]))
        return differences

    theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed)
    differences = train([theirs, ours], [theirs_module, ours_module])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    alone = copy.deepcopy(ours_module)
    train([md.DistributedDataParallel(alone)], [alone])
    breaks: dict[str, int] = {}
    for reason, count in torch._dynamo.utils.counters["graph_break"].items():
        explanation = reason.splitlines()[1]
        name = explanation.split("`")[1] if "should not be traced" in explanation else explanation.strip()
        breaks[name] = breaks.get(name, 0) + count
    return {"differences": differences, "breaks": breaks}


class _SplitCounter:
    """A dynamo backend that counts the graphs it is given and runs them as they are: DDPOptimizer gives it one per
    piece of the split graph (upstream's ``CheckSplitsCompiler``, test_dynamo_distributed.py)."""

    def __init__(self) -> None:
        self.compiler_called = 0

    def compile_fn(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.compiler_called += 1
        return gm


class _ToyModel(nn.Module):
    """Upstream's ``ToyModel`` (test_dynamo_distributed.py), narrower: four linear layers, the middle two of 1.4 MiB
    each, so that a 1 MiB bucket cap (DDPOptimizer's first bucket is 1 MiB, and no cap may be smaller) splits it. A
    module of the user's: dynamo compiles a frame of it (one of torch.nn's own, a bare ``nn.Sequential``, it does not
    start a compilation at)."""

    def __init__(self, hidden: int = 600) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 5), nn.ReLU())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


def graph_splits_as_stock(seed: int, composable: bool) -> dict:
    """Upstream's TestSingleProc split tests (``test_graph_split``, ``test_no_split``), on two ranks and against
    torch's own wrapper (``composable``: ``replicate``, torch's and minidp's): a compiled forward and backward with
    ``bucket_cap_mb`` 1 and 25; per cap, how many graphs DDPOptimizer made for each, and the difference in the
    gradients."""
    import torch._dynamo
    from torch.distributed._composable.replicate import replicate as torch_replicate

    wrappers = (torch_replicate, md.replicate) if composable else (TorchDDP, md.DistributedDataParallel)
    seen = {}
    for cap in (1, 25):
        modules, splits = [], []
        for wrap in wrappers:
            torch._dynamo.reset()
            torch.manual_seed(seed)
            module = _ToyModel()
            ddp = _quiet(lambda: wrap(module, bucket_cap_mb=cap))
            counter = _SplitCounter()
            compiled = torch.compile(ddp, backend=counter.compile_fn)
            compiled(_inputs(seed, 0, 20, 10)).sum().backward()
            modules.append(module)
            splits.append(counter.compiler_called)
        seen[cap] = {"stock": splits[0], "minidp": splits[1], "difference": _difference(modules[1], modules[0])}
    torch._dynamo.reset()
    return seen


@contextlib.contextmanager
def _optimize_ddp(mode: Union[bool, str]) -> Iterator[None]:
    """``torch._dynamo.config.optimize_ddp = mode`` for the wrappers built inside, and afterwards what torch's DDP
    changes for the whole process when it is built in the "python_reducer" mode put back (inductor's DDP fusion
    settings, dynamo's tracing into distributed.py), so that the checks run after this one see torch as it was."""
    import torch._dynamo
    import torch._inductor.config

    inductor = torch._inductor.config.save_config()
    inlined = set(torch._dynamo.trace_rules.LEGACY_MOD_INLINELIST)
    try:
        with torch._dynamo.config.patch(optimize_ddp=mode):
            yield
    finally:
        torch._inductor.config.load_config(inductor)
        torch._dynamo.trace_rules.LEGACY_MOD_INLINELIST.intersection_update(inlined)
        torch._dynamo.trace_rules.get_legacy_mod_inlinelist.cache_clear()


def compiled_autograd_as_stock(seed: int, python_reducer: bool, composable: bool = False, steps: int = 3) -> dict:
    """Three SGD steps whose backward runs under compiled autograd (its graph compiled by dynamo, eager kernels),
    in stock and minidp, built with ``optimize_ddp`` "python_reducer" or the default (``composable``: each library's
    ``replicate``). Per wrapper, the first error its steps raised ("ok" if none), and per step the difference."""
    import torch._dynamo.compiled_autograd
    from torch.distributed._composable.replicate import replicate as torch_replicate

    with _optimize_ddp("python_reducer" if python_reducer else True):
        if composable:
            torch.manual_seed(seed + dist.get_rank())
            theirs_module = _tanh_mlp()
            ours_module = copy.deepcopy(theirs_module)
            theirs, ours = torch_replicate(theirs_module), md.replicate(ours_module)
            with torch.no_grad():
                for model in (theirs, ours):  # replicate builds its DDP at the first forward: in this mode
                    model(_inputs(seed, -1, 5, 6))
        else:
            theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed)
    pairs = [("stock", theirs, theirs_module), ("minidp", ours, ours_module)]
    optimizers = {name: torch.optim.SGD(module.parameters(), lr=0.1) for name, _, module in pairs}
    raised = {"stock": "ok", "minidp": "ok"}
    differences = []
    for step in range(steps):
        for name, model, module in pairs:
            if raised[name] != "ok":
                continue
            optimizers[name].zero_grad()
            try:  # the forward too: a reducer left waiting by the last backward raises there
                loss = model(_inputs(seed, step, 5, 6)).pow(2).mean()
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            except RuntimeError as error:
                raised[name] = f"{type(error).__name__}: {error}"
                continue
            optimizers[name].step()
        differences.append(_difference(ours_module, theirs_module))
    return {"raised": raised, "differences": differences}


# ---- communication hooks ---------------------------------------------------------------------------


def _allreduce(state, bucket):
    return default_hooks.allreduce_hook(state, bucket)


def _unnamed_bucket(state, b):
    return default_hooks.allreduce_hook(state, b)


def _int_bucket(state, bucket: int):
    return default_hooks.allreduce_hook(state, bucket)


def _int_result(state, bucket) -> int:
    return default_hooks.allreduce_hook(state, bucket)


def _annotated(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return default_hooks.allreduce_hook(state, bucket)


def _returns_a_number(state, bucket):
    return 5


def comm_hook_errors(seed: int) -> dict:
    """Each way of registering a hook wrongly, in stock and minidp: the error's type and message, or "ok"."""
    builtin = dist.BuiltinCommHookType.ALLREDUCE
    cases: dict[str, Callable[[nn.Module], Any]] = {
        "not_callable": lambda d: d.register_comm_hook(None, 3),
        "bucket_not_named_bucket": lambda d: d.register_comm_hook(None, _unnamed_bucket),
        "bucket_annotation": lambda d: d.register_comm_hook(None, _int_bucket),
        "return_annotation": lambda d: d.register_comm_hook(None, _int_result),
        "stock_annotations": lambda d: d.register_comm_hook(None, _annotated),
        "twice": lambda d: (d.register_comm_hook(None, _allreduce), d.register_comm_hook(None, _allreduce)),
        "hook_then_builtin": lambda d: (d.register_comm_hook(None, _allreduce), d._register_builtin_comm_hook(builtin)),
        "builtin_then_hook": lambda d: (d._register_builtin_comm_hook(builtin), d.register_comm_hook(None, _allreduce)),
        "after_a_backward": lambda d: (d(torch.randn(2, 3)).sum().backward(), d.register_comm_hook(None, _allreduce)),
        "not_a_future": lambda d: (d.register_comm_hook(None, _returns_a_number), d(torch.randn(2, 3)).sum().backward()),
    }
    seen: dict[str, dict] = {}
    for case, call in cases.items():
        for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
            ddp = _quiet(lambda: wrapper(nn.Linear(3, 3)))
            try:
                call(ddp)
                outcome = "ok"
            except Exception as error:  # every kind: the test compares them
                outcome = f"{type(error).__name__}: {error}"
            seen.setdefault(case, {})[name] = outcome
    return seen


def _collective_future(state, bucket):
    """An all-reduce's future as it is: its value is the list of the collective's tensors."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


def _list_of_two(state, bucket):
    future: torch.futures.Future = torch.futures.Future()
    future.set_result([torch.zeros_like(bucket.buffer()), bucket.buffer()])
    return future


def _longer_mean(state, bucket):
    """The mean, in a tensor four elements longer than the bucket."""
    padded = torch.cat([bucket.buffer() / dist.get_world_size(), torch.zeros(4)])
    return dist.all_reduce(padded, async_op=True).get_future().then(lambda f: f.value()[0])


def _shorter_mean(state, bucket):
    """The mean without its last element, in a tensor of its own (stock's views of a slice of the bucket would read
    on into the bucket's storage)."""
    return default_hooks.allreduce_hook(None, bucket).then(lambda f: f.value()[:-1].clone())


HOOK_RESULTS = {"collective_future": _collective_future, "list_of_two": _list_of_two, "longer_mean": _longer_mean,
                "shorter_mean": _shorter_mean}


def failing_comm_hook_as_stock(seed: int) -> dict:
    """A comm hook whose future fails: torch's ``quantization_pertensor_hook``, whose callback reads its all_gather's
    result as NCCL fills it and raises over Gloo (an ``IndexError``, which the future wraps). Each wrapper's error in
    the backward, as its type and first line."""
    errors = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        torch.manual_seed(seed)
        ddp = _quiet(lambda: wrapper(_tanh_mlp()))
        ddp.register_comm_hook(None, quantization_hooks.quantization_pertensor_hook)
        try:
            ddp(_inputs(seed, 0, 5, 6)).pow(2).mean().backward()
            errors[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the type is what is compared
            errors[name] = (type(error).__name__, str(error).splitlines()[0])
    return errors


def hook_results(seed: int) -> dict:
    """Per hook of :data:`HOOK_RESULTS` (each a kind of value its future holds), one backward of a linear layer under
    stock and minidp: ``"ok"`` or the error's type and message, and whether the parameters and gradients came out
    bitwise alike (``same``)."""
    seen: dict[str, dict] = {}
    for case, hook in HOOK_RESULTS.items():
        modules, outcome = {}, {}
        for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
            torch.manual_seed(seed)
            modules[name] = nn.Linear(3, 2)
            ddp = _quiet(lambda: wrapper(modules[name]))
            ddp.register_comm_hook(None, hook)
            try:
                ddp(_inputs(seed, 0, 4, 3)).sum().backward()
                outcome[name] = "ok"
            except Exception as error:  # every kind: the test compares them
                outcome[name] = f"{type(error).__name__}: {error}"
        seen[case] = {**outcome, "same": _difference(modules["minidp"], modules["stock"]) is None}
    return seen


def builtin_hook_as_stock(seed: int, hook_type: str, steps: int = 3) -> list:
    """``_register_builtin_comm_hook(dist.BuiltinCommHookType.<hook_type>)`` in both: bitwise after every step."""
    theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed)
    for ddp in (theirs, ours):
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, hook_type))
    pairs = [(theirs, theirs_module, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)),
             (ours, ours_module, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9))]
    return _sgd_steps(pairs, seed, 0, steps)


# ---- static graph and activation checkpointing ------------------------------------------------------


class Checkpointed(nn.Module):
    """Two layers under ``torch.utils.checkpoint`` (re-entrant or not); with ``twice``, the second layer
    runs again in a second checkpointed segment, so its hook fires twice per backward."""

    def __init__(self, reentrant: bool, twice: bool) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.reentrant, self.twice = reentrant, twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(lambda y: torch.tanh(self.b(torch.tanh(self.a(y)))), x, use_reentrant=self.reentrant)
        if self.twice:
            x = checkpoint(lambda y: torch.tanh(self.b(y)), x, use_reentrant=self.reentrant)
        return self.head(x)


def checkpointing_as_stock(seed: int, reentrant: bool, twice: bool, steps: int = 4, **options: Any) -> dict:
    """Train both wrappers with ``options`` (``find_unused_parameters``, ``static_graph``): stock's outcome
    ("ok" or its error), minidp's, and, where both train, the first difference after every step."""
    outcome: dict[str, Any] = {}
    theirs, ours, theirs_module, ours_module = _pair(lambda: Checkpointed(reentrant, twice), seed, **options)
    pairs = [(theirs, theirs_module, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)),
             (ours, ours_module, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9))]
    differences = []
    for step in range(steps):
        for name, (ddp, _, optimizer) in zip(("stock", "minidp"), pairs):
            if name in outcome:
                continue
            try:
                optimizer.zero_grad()
                # the input requires grad, as re-entrant checkpointing needs to record its segment
                ddp(_inputs(seed, step, 5, 6).requires_grad_()).pow(2).mean().backward()
                optimizer.step()
            except RuntimeError as error:
                outcome[name] = str(error)
        if not outcome:
            differences.append(_difference(ours_module, theirs_module))
    return {"stock": outcome.get("stock", "ok"), "minidp": outcome.get("minidp", "ok"), "differences": differences}


class _AuxiliaryLossKept(nn.Module):
    """A mixture-of-experts layout: the router's load-balancing loss kept on the module for the loop to add, not
    returned, so that the router's parameters are reached only through it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.router = nn.Linear(8, 4), nn.Linear(8, 2)
        self.auxiliary_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.auxiliary_loss = self.router(x).pow(2).mean()
        return self.body(x)


def auxiliary_loss_kept_on_the_module_as_stock(seed: int) -> dict:
    """With ``find_unused_parameters=True``, a backward through a loss the forward's outputs do not lead to: each
    wrapper's error (stock: "Expected to mark a variable ready only once")."""
    theirs, ours, theirs_module, ours_module = _pair(_AuxiliaryLossKept, seed, find_unused_parameters=True)
    outcome = {}
    for name, ddp, module in (("stock", theirs, theirs_module), ("minidp", ours, ours_module)):
        try:
            (ddp(_inputs(seed, 0, 4, 8)).pow(2).mean() + module.auxiliary_loss).backward()
            outcome[name] = "ok"
        except RuntimeError as error:
            outcome[name] = str(error)
    return outcome


def output_node_names_as_stock(seed: int) -> dict:
    """The class name of each wrapper's output's ``grad_fn``, by options: what code that reads the graph sees."""
    names = {}
    for options in ({}, {"find_unused_parameters": True}, {"static_graph": True}):
        theirs, ours, _, _ = _pair(_tanh_mlp, seed, **options)
        key = ",".join(options) or "default"
        names[key] = {name: type(ddp(_inputs(seed, 0, 2, 6)).grad_fn).__name__
                      for name, ddp in (("stock", theirs), ("minidp", ours))}
    return names


class _Recorder:
    """A communication hook that notes each bucket's parameter indices, per backward."""

    def __init__(self, module: nn.Module) -> None:
        self.index_of = {id(p): i for i, p in enumerate(module.parameters())}
        self.backwards: list[list[list[int]]] = []

    def hook(self, state, bucket):  # a method: stock reads the hook's __name__
        self.backwards[-1].append([self.index_of[id(p)] for p in bucket.parameters()])
        return default_hooks.allreduce_hook(state, bucket)


class _Wide(nn.Module):
    """Wide enough for two buckets once rebuilt (1 MiB first bucket); ``never`` is used by no rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 600)
        self.b = nn.Linear(600, 600)
        self.never = nn.Linear(6, 6)
        self.c = nn.Linear(600, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def static_graph_buckets(seed: int, late: bool, steps: int = 4) -> dict:
    """Per backward, the buckets a static graph hands a hook, in stock and minidp (``late``: set by
    ``_set_static_graph()`` after construction rather than ``static_graph=True``), and the parameters."""
    options = {} if late else {"static_graph": True}
    theirs, ours, theirs_module, ours_module = _pair(_Wide, seed, **options)
    recorders = {}
    for name, ddp, module in (("stock", theirs, theirs_module), ("minidp", ours, ours_module)):
        if late:
            ddp._set_static_graph()
        recorders[name] = _Recorder(module)
        ddp.register_comm_hook(None, recorders[name].hook)
    pairs = [(theirs, theirs_module, torch.optim.SGD(theirs.parameters(), lr=0.1)),
             (ours, ours_module, torch.optim.SGD(ours.parameters(), lr=0.1))]
    differences = []
    for step in range(steps):
        for recorder in recorders.values():
            recorder.backwards.append([])
        differences += _sgd_steps(pairs, seed, step, 1)
    return {"stock": recorders["stock"].backwards, "minidp": recorders["minidp"].backwards,
            "differences": differences, "never_grad": [p.grad for p in ours_module.never.parameters()]}


def static_graph_set_late(seed: int) -> dict:
    """``_set_static_graph()`` twice, and after a forward: stock's and minidp's warnings and errors."""
    seen: dict[str, list] = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = wrapper(nn.Linear(3, 3), static_graph=True)
            ddp._set_static_graph()
        after = wrapper(nn.Linear(3, 3))
        after(torch.randn(2, 3)).sum().backward()
        try:
            after._set_static_graph()
            error = "no error"
        except RuntimeError as e:
            error = str(e)
        seen[name] = [[str(w.message) for w in caught if "static_graph" in str(w.message)], error]
    return seen


# ---- uneven inputs: Join ----------------------------------------------------------------------------


def uneven_inputs_as_stock(seed: int, model: str = "tanh_mlp", through: str = "join", batches: Optional[Sequence[int]] = None,
                           static: Optional[str] = None, bucket_cap_mb: Optional[float] = None,
                           **join_options: Any) -> dict:
    """Rank r trains on ``batches[r]`` batches (default 2 + 2r) inside ``ddp.join(**join_options)`` (``through="Join"``:
    ``Join([ddp], **join_options)``), stock then minidp, a static graph if ``static`` says how (``"static_graph"``:
    the argument, ``"set_static_graph"``: ``_set_static_graph()`` after construction), ``bucket_cap_mb`` as given to
    both wrappers (default theirs): the first difference between
    the two models after the context, each one's error if it raised, and the warnings each gave."""
    build = {"tanh_mlp": _tanh_mlp, "batch_norm": lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)),
             "partly_used": _PartlyUsedBy0}[model]
    options = {"find_unused_parameters": True} if model == "partly_used" else {}
    if bucket_cap_mb is not None:
        options["bucket_cap_mb"] = bucket_cap_mb
    theirs, ours, theirs_module, ours_module = _pair(build, seed, **options, **({"static_graph": True} if static ==
                                                                              "static_graph" else {}))
    if static == "set_static_graph":
        for ddp in (theirs, ours):
            ddp._set_static_graph()
    steps = 2 + 2 * dist.get_rank() if batches is None else batches[dist.get_rank()]
    errors, warned = {}, {}
    for name, ddp in (("stock", theirs), ("minidp", ours)):
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        if through == "join":
            context = ddp.join(**join_options)
        else:
            kwargs = {k: v for k, v in join_options.items() if k == "divide_by_initial_world_size"}
            context = Join([ddp], join_options.get("enable", True), join_options.get("throw_on_early_termination", False),
                           **kwargs)
        try:
            with warnings.catch_warnings(record=True) as caught, context:
                warnings.simplefilter("always")
                for step in range(steps):
                    optimizer.zero_grad()
                    out = ddp(_inputs(seed, step, 5, 6))
                    (out[0] if isinstance(out, tuple) else out).pow(2).mean().backward()
                    optimizer.step()
        except RuntimeError as error:
            errors[name] = str(error)
        warned[name] = [str(w.message) for w in caught]
    return {"difference": _difference(ours_module, theirs_module), "errors": errors, "warnings": warned}


def joined_before_a_static_graphs_first_backward(seed: int, steps: int = 3) -> dict:
    """Two ranks, a static graph under ``ddp.join()``: rank 0 has no batch, rank 1 ``steps``. minidp alone (stock's
    collectives stop matching there, and Gloo aborts the process): the first difference between the model after the
    context and rank 1's steps on a plain copy, its gradients halved (rank 0's zeros in the mean over 2 ranks),
    as the names of the parameters not bitwise equal (rank 0's own gradients stay None, so only parameters); then
    rank 0's error at a forward of its own (rank 1 takes no further step, so that no collective is left open)."""
    torch.manual_seed(seed + dist.get_rank())
    module = _tanh_mlp()
    ddp = md.DistributedDataParallel(module, static_graph=True)
    plain = copy.deepcopy(module)  # rank 0's weights, as the constructor broadcast them
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    with ddp.join():
        for step in range(steps * dist.get_rank()):
            optimizer.zero_grad()
            ddp(_inputs(seed, step, 5, 6)).pow(2).mean().backward()
            optimizer.step()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        plain_optimizer.zero_grad()
        batch = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed + 1000 * step + 1))  # rank 1's
        plain(batch).pow(2).mean().backward()
        for p in plain.parameters():
            p.grad = p.grad * (1.0 / 2)  # as the reducer multiplies (mark_variable_ready_dense)
        plain_optimizer.step()
    error = None
    if dist.get_rank() == 0:
        try:
            ddp(_inputs(seed, 0, 5, 6))
        except RuntimeError as caught:
            error = str(caught).split(":")[0]
    unequal = [name for (name, a), b in zip(module.named_parameters(), plain.parameters()) if not torch.equal(a, b)]
    return {"unequal": unequal, "error": error}


class _PartlyUsedBy0(nn.Module):
    """A layer that only rank 0 uses (find_unused_parameters=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.only_rank_0 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if dist.get_rank() == 0:
            h = self.only_rank_0(h)
        return self.head(h)


# ---- runtime statistics: _get_ddp_logging_data ---------------------------------------------------------


def _with_batch_norm() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


class _WithAnIdleLayer(nn.Module):
    """A layer that no rank's forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.idle, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x)))


def logging_data_as_stock(seed: int, steps: int, sample_rate: Optional[int] = None, hook: Optional[str] = None,
                          under_join: bool = False, idle_layer: bool = False, low_precision: Optional[str] = None,
                          **options: Any) -> dict:
    """``_get_ddp_logging_data()`` of both after ``steps`` training steps (``sample_rate``: set first;
    ``hook``: "python" or "builtin"; ``under_join``: inside ``ddp.join()``; ``idle_layer``: a model with a layer
    that no forward runs; ``low_precision``: a dtype's name, both built with ``mixed_precision`` in it for the
    parameters and the buffers, torch's through :func:`torch_mixed_precision_on_the_cpu`), per wrapper."""
    if low_precision is not None:
        from torch.nn.parallel.distributed import _MixedPrecision

        dtype = getattr(torch, low_precision)
        options["mixed_precision"] = _MixedPrecision(param_dtype=dtype, buffer_dtype=dtype)
    data = {}
    with torch_mixed_precision_on_the_cpu() if low_precision else contextlib.nullcontext():
        theirs, ours, _, _ = _pair(_WithAnIdleLayer if idle_layer else _with_batch_norm, seed, **options)
        for name, ddp in (("stock", theirs), ("minidp", ours)):
            if sample_rate is not None:
                ddp._set_ddp_runtime_logging_sample_rate(sample_rate)
            if hook == "python":
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            elif hook == "builtin":
                ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
            with ddp.join() if under_join else contextlib.nullcontext():
                for step in range(steps):
                    ddp(_inputs(seed, step, 5, 6)).pow(2).mean().backward()
            data[name] = ddp._get_ddp_logging_data()
    return data


def graph_not_static_logged_as_stock(seed: int, steps: int = 3) -> dict:
    """Two pairs of wrappers in turn, each trained ``steps`` steps with ``find_unused_parameters`` and a forward that
    runs the auxiliary head at even steps only (the unused parameters change at every step): per pair and wrapper, the
    logged ``can_set_static_graph`` and ``iteration`` (``None``: not logged)."""
    logged: list[dict] = []
    for _ in range(2):
        pair = _pair(_MainAndAuxiliary, seed, find_unused_parameters=True)
        entries = {}
        for name, ddp in (("stock", pair[0]), ("minidp", pair[1])):
            for step in range(steps):
                output = ddp(_inputs(seed, step, 5, 6), auxiliary=step % 2 == 0)
                sum(head.pow(2).mean() for head in output.values()).backward()
            data = ddp._get_ddp_logging_data()
            entries[name] = (data.get("can_set_static_graph"), data.get("iteration"))
        logged.append(entries)
    return {"logged": logged}


def sample_rate_errors(seed: int) -> dict:
    errors = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        try:
            wrapper(nn.Linear(2, 2))._set_ddp_runtime_logging_sample_rate(0)
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return errors


# ---- sparse gradients ------------------------------------------------------------------------------------


class SparseModel(nn.Module):
    """An embedding bag and an embedding with sparse gradients between dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 6, mode="sum", sparse=True)
        self.dense = nn.Linear(6, 6)
        self.embedding = nn.Embedding(20, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, bags: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.dense(self.bag(bags))) + self.embedding(tokens))


def _same_gradient(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is b
    if a.is_sparse or b.is_sparse:
        return (a.is_sparse and b.is_sparse and a.is_coalesced() == b.is_coalesced()
                and torch.equal(a._indices(), b._indices()) and torch.equal(a._values(), b._values()))
    return torch.equal(a, b)


def sparse_gradients_as_stock(seed: int, steps: int = 3, **options: Any) -> dict:
    """SGD on :class:`SparseModel`, each rank its own indices: per step, whether every parameter and
    gradient (sparse: indices, values, coalescing) is stock's, and both rebuilt plans and logged bucket sizes."""
    theirs, ours, theirs_module, ours_module = _pair(SparseModel, seed, **options)
    optimizers = [torch.optim.SGD(d.parameters(), lr=0.1) for d in (theirs, ours)]
    same = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(seed + 100 * step + dist.get_rank())
        bags, tokens = torch.randint(0, 20, (4, 3), generator=generator), torch.randint(0, 20, (4,), generator=generator)
        for ddp, optimizer in zip((theirs, ours), optimizers):
            optimizer.zero_grad()
            ddp(bags, tokens).pow(2).mean().backward()
            optimizer.step()
        same.append(all(torch.equal(a, b) and _same_gradient(a.grad, b.grad)
                        for a, b in zip(ours_module.parameters(), theirs_module.parameters())))
    logged = [d._get_ddp_logging_data() for d in (theirs, ours)]
    return {"same": same, "sparse_grads": [p.grad.is_sparse for p in ours_module.parameters()],
            "plans": [data.get("rebuilt_per_bucket_param_indices") for data in logged],
            "bucket_sizes": [data.get("bucket_sizes") for data in logged]}


# ---- complex parameters ----------------------------------------------------------------------------------


class ComplexModel(nn.Module):
    """A complex128 weight between float64 layers: its gradient gets a bucket of its own (another dtype), which
    torch's reducer all-reduces, and hands a hook, viewed as real."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 4, dtype=torch.float64)
        self.weight = nn.Parameter(torch.randn(4, 3, dtype=torch.complex128))
        self.outer = nn.Linear(3, 2, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer((self.inner(x).to(torch.complex128) @ self.weight).abs())


def _recording_allreduce(state, bucket):
    """torch's ``allreduce_hook``, noting what it was handed: the buffer's dtype and size, the gradients' dtypes
    and shapes, the parameters' dtypes (not the bucket's index: the order of a rebuilt plan's buckets of several
    dtypes is torch's hash map's, docs in minidp/distributed/buckets.py)."""
    state.append((str(bucket.buffer().dtype), bucket.buffer().numel(),
                  [(str(g.dtype), tuple(g.shape)) for g in bucket.gradients()], [str(p.dtype) for p in bucket.parameters()]))
    return default_hooks.allreduce_hook(dist.group.WORLD, bucket)


def complex_parameters_as_stock(seed: int, steps: int = 3, hook: bool = False, **options: Any) -> dict:
    """SGD with momentum on :class:`ComplexModel` under both wrappers: per step the first difference (parameters
    and gradients, bitwise), and with ``hook`` what each backward's hook calls saw (:func:`_recording_allreduce`)."""
    theirs, ours, theirs_module, ours_module = _pair(ComplexModel, seed, **options)
    seen: dict[str, list] = {"stock": [], "minidp": []}
    if hook:
        theirs.register_comm_hook(seen["stock"], _recording_allreduce)
        ours.register_comm_hook(seen["minidp"], _recording_allreduce)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (theirs_module, ours_module)]
    differences, buckets = [], {"stock": [], "minidp": []}
    for step in range(steps):
        for name, ddp, optimizer in zip(("stock", "minidp"), (theirs, ours), optimizers):
            optimizer.zero_grad()
            ddp(_inputs(seed, step, 5, 6).double()).pow(2).mean().backward()
            optimizer.step()
            buckets[name].append(sorted(seen[name]))
            seen[name].clear()
        differences.append(_difference(ours_module, theirs_module))
    return {"differences": differences, **buckets}


# ---- a hook's GradBucket.gradients() for parameters with other strides ----------------------------------


class StridedWeights(nn.Module):
    """A channels-last convolution and a weight stored transposed: two parameters whose gradients lie in their bucket
    in the parameter's own memory order, not row-major."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        self.weight = nn.Parameter(torch.randn(16, 8).t())  # (8, 16), strides (1, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.to(memory_format=torch.channels_last)).mean((2, 3)) @ self.weight


def _strides_then_powersgd(state, bucket):
    """torch's ``powerSGD_hook`` (``state``: a list for what it notes, and its ``PowerSGDState``), noting the strides
    of the bucket's ``gradients()``: PowerSGD views each as a matrix with ``view()``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    seen, powersgd = state
    seen.append([tuple(g.stride()) for g in bucket.gradients()])
    return powerSGD_hook.powerSGD_hook(powersgd, bucket)


def _trained_under_powersgd(pair: tuple, seed: int, steps: int, hook: Callable, start_powerSGD_iter: int,
                            *batch_shape: int) -> dict:
    """SGD on ``pair`` (:func:`_pair`) with torch's PowerSGD hook wrapped by ``hook`` (given a list for what it notes,
    and the ``PowerSGDState``): per step the first difference (parameters and gradients, bitwise), and what each
    wrapper's hook noted."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    theirs, ours, theirs_module, ours_module = pair
    seen: dict[str, list] = {"stock": [], "minidp": []}
    for name, ddp in (("stock", theirs), ("minidp", ours)):
        powersgd = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=start_powerSGD_iter,
                                 min_compression_rate=0.5, random_seed=seed)
        ddp.register_comm_hook((seen[name], powersgd), hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (theirs_module, ours_module)]
    differences = []
    for step in range(steps):
        for ddp, optimizer in zip((theirs, ours), optimizers):
            optimizer.zero_grad()
            ddp(_inputs(seed, step, *batch_shape)).pow(2).mean().backward()
            optimizer.step()
        differences.append(_difference(ours_module, theirs_module))
    return {"differences": differences, **seen}


def powersgd_on_strided_weights_as_stock(seed: int, steps: int = 4) -> dict:
    """:class:`StridedWeights` under both wrappers with torch's PowerSGD hook (rank 1, compressing from the third
    backward on): :func:`_trained_under_powersgd`, the hook noting the strides of the gradients it was handed."""
    return _trained_under_powersgd(_pair(StridedWeights, seed), seed, steps, _strides_then_powersgd, 2, 2, 3, 6, 6)


class TwoDtypes(nn.Module):
    """A float32 layer and a float64 one: a bucket of each dtype, whatever the caps."""

    def __init__(self) -> None:
        super().__init__()
        self.in_float32, self.in_float64 = nn.Linear(6, 6), nn.Linear(6, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_float64(torch.tanh(self.in_float32(x)).double())


def _buckets_then_powersgd(state, bucket):
    """torch's ``powerSGD_hook``, noting what the bucket says of itself and the iteration PowerSGD counts."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    seen, powersgd = state
    seen.append((bucket.index(), bucket.is_last(), [tuple(p.shape) for p in bucket.parameters()], powersgd.iter))
    return powerSGD_hook.powerSGD_hook(powersgd, bucket)


def buckets_a_hook_sees_as_stock(seed: int, static_graph: bool, steps: int = 4) -> dict:
    """:class:`TwoDtypes` under both wrappers with torch's PowerSGD hook, which counts its iterations by ``is_last``
    and all-reduces until it would compress, past these steps (torch's compression of several buckets on Gloo does not
    finish): :func:`_trained_under_powersgd`, the hook noting each bucket's index, ``is_last``, its parameters' shapes
    and PowerSGD's iteration count then."""
    pair = _pair(TwoDtypes, seed, static_graph=static_graph)
    return _trained_under_powersgd(pair, seed, steps, _buckets_then_powersgd, steps + 2, 5, 6)


def zero_overlap_hook_as_stock(seed: int, steps: int = 5) -> dict:
    """torch's ``ZeroRedundancyOptimizer(overlap_with_ddp=True)`` stepped by torch's ``hook_with_zero_step`` under
    each wrapper (tiny buckets, several shards): per step, ``_has_rebuilt_buckets`` under both and the first parameter
    that differs (bitwise). The hook refuses Gloo ("may meet hangs", a check it makes for Gloo alone), so its module is
    told NCCL, which the hook's arithmetic does not depend on: what runs is the hook's, on either wrapper."""
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class _SaysNccl:  # torch.distributed as the hook's module sees it, but for the backend's name
        def __getattr__(self, name: str) -> Any:
            return getattr(dist, name)

        @staticmethod
        def get_backend(*args: Any, **kwargs: Any) -> str:
            return "nccl"

    ddp_zero_hook.dist = _SaysNccl()
    try:
        theirs, ours, theirs_module, ours_module = _pair(_tanh_mlp, seed, bucket_cap_mb=0.0005)
        for ddp, module in ((theirs, theirs_module), (ours, ours_module)):
            zero = ZeroRedundancyOptimizer(module.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01)
            ddp.register_comm_hook(None, ddp_zero_hook.hook_with_zero_step(default_hooks.allreduce_hook, ddp, zero))
        rebuilt, differences = [], []
        for step in range(steps):
            for ddp in (theirs, ours):
                ddp(_inputs(seed, step, 5, 6)).pow(2).mean().backward()
            rebuilt.append((theirs._has_rebuilt_buckets, ours._has_rebuilt_buckets))
            differences.append(_difference(ours_module, theirs_module))
    finally:
        ddp_zero_hook.dist = dist
    return {"rebuilt": rebuilt, "differences": differences}


def optimizer_in_backward_on_strided_weights(seed: int, steps: int = 3) -> list:
    """:class:`StridedWeights` with SGD stepped in minidp's backward (``_apply_optimizer_in_backward``), beside
    stock DDP stepping SGD after its backward: per step the first parameter that differs (bitwise), or None."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    torch.manual_seed(seed + dist.get_rank())
    theirs_module = StridedWeights()
    ours_module = copy.deepcopy(theirs_module)
    _apply_optimizer_in_backward(torch.optim.SGD, ours_module.parameters(), {"lr": 0.1})
    theirs, ours = _quiet(lambda: TorchDDP(theirs_module)), md.DistributedDataParallel(ours_module)
    optimizer = torch.optim.SGD(theirs_module.parameters(), lr=0.1)
    differences = []
    for step in range(steps):
        optimizer.zero_grad()
        theirs(_inputs(seed, step, 2, 3, 6, 6)).pow(2).mean().backward()
        optimizer.step()
        ours(_inputs(seed, step, 2, 3, 6, 6)).pow(2).mean().backward()
        differences.append(next((name for (name, a), b in zip(ours_module.named_parameters(), theirs_module.parameters())
                                 if not torch.equal(a, b)), None))
    return differences


# ---- a parameter's dtype changed after wrapping ------------------------------------------------------------


class TwoLayers(nn.Module):
    """Two linear layers that run in their own dtype, whatever the others' (one of them may be converted)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 4)
        self.second = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x.to(self.first.weight.dtype)).to(self.second.weight.dtype)).float()


def _synchronised(module: nn.Module) -> bool:
    """Whether every rank holds the same gradients (they were averaged; the batches differ)."""
    flat = torch.cat([p.grad.double().flatten() for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], other) for other in gathered)


DTYPE_CHANGES = {"double": lambda ddp: ddp.double(), "bfloat16": lambda ddp: ddp.to(torch.bfloat16),
                 "one_layer": lambda ddp: ddp.module.second.double()}


def dtype_changed_after_wrapping(seed: int, **options: Any) -> dict:
    """:class:`TwoLayers` wrapped in float32, trained a step, then converted through the wrapper (each of
    :data:`DTYPE_CHANGES`), and a step more: per change and wrapper, ``"ok"`` or the error and the step it came in
    (``"forward: ..."``, ``"backward: ..."``), and whether stock's gradients came out averaged."""
    seen: dict[str, dict] = {}
    for change, convert in DTYPE_CHANGES.items():
        outcome: dict[str, Any] = {}
        for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
            torch.manual_seed(seed)
            module = TwoLayers()
            ddp = _quiet(lambda: wrapper(module, **options))
            ddp(_inputs(seed, 0, 4, 5)).pow(2).sum().backward()
            convert(ddp)
            step = "forward"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # stock's static graph warns of the parameters it saw unused
                    loss = ddp(_inputs(seed, 1, 4, 5)).pow(2).sum()
                    step = "backward"
                    loss.backward()
                outcome[name] = "ok"
            except Exception as error:  # every kind: the test compares them
                outcome[name] = f"{step}: {type(error).__name__}: {error}"
            if name == "stock":
                outcome["stock_averaged"] = outcome["stock"] == "ok" and _synchronised(module)
        seen[change] = outcome
    return seen


def channels_last_after_wrapping(seed: int, **options: Any) -> dict:
    """Two float64 convolutions wrapped, then converted to ``channels_last`` through the module (after the buckets
    were laid out for row-major gradients), and one backward: per wrapper, the largest relative error of a gradient
    against the mean of every rank's gradient on one process, and the warnings it gave."""
    def build() -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).double()

    batches = [torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + rank))
               for rank in range(dist.get_world_size())]
    reference = build().to(memory_format=torch.channels_last)
    (sum(reference(x).pow(2).mean() for x in batches) / len(batches)).backward()
    seen: dict[str, Any] = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        module = build()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = wrapper(module, **options)
            module.to(memory_format=torch.channels_last)
            ddp(batches[dist.get_rank()]).pow(2).mean().backward()
        seen[name] = {"error": max(max_relative_error(p.grad, q.grad)
                                   for p, q in zip(module.parameters(), reference.parameters())),
                      "warnings": [str(w.message) for w in caught]}
    return seen


# ---- parameters ignored by name -------------------------------------------------------------------------


class RootAndTied(nn.Module):
    """A root parameter (``named_parameters()`` names it ``"scale"``, torch's reducer ``".scale"``) and a weight
    tied between ``emb`` and ``head``, with ``mid`` registered between them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
        self.emb = nn.Linear(6, 6, bias=False, dtype=torch.float64)
        self.mid = nn.Linear(6, 6, dtype=torch.float64)
        self.head = nn.Linear(6, 6, bias=False, dtype=torch.float64)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x @ self.scale))))


def ignored_by_name_as_stock(seed: int, ignored: Sequence[str], steps: int = 3) -> dict:
    """:class:`RootAndTied` with ``ignored`` named to both wrappers: per step the first difference (parameters and
    gradients, bitwise; an ignored one keeps each rank's own), and for each wrapper the reducer's parameters (their
    positions in ``parameters()``), its names for them and the logged facts that count them."""

    def build() -> nn.Module:
        module = RootAndTied()
        TorchDDP._set_params_and_buffers_to_ignore_for_model(module, list(ignored))
        return module

    theirs, ours, theirs_module, ours_module = _pair(build, seed)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (theirs_module, ours_module)]
    differences = []
    for step in range(steps):
        for ddp, optimizer in zip((theirs, ours), optimizers):
            optimizer.zero_grad()
            ddp(_inputs(seed, step, 5, 6).double()).pow(2).mean().backward()
            optimizer.step()
        differences.append(_difference(ours_module, theirs_module))
    facts = {}
    for name, ddp, module in (("stock", theirs, theirs_module), ("minidp", ours, ours_module)):
        params, _ = ddp._build_params_for_reducer()
        everything = list(module.parameters())
        logged = ddp._get_ddp_logging_data()
        facts[name] = {
            "positions": [next(i for i, q in enumerate(everything) if q is p) for p in params],
            "names": ddp._build_debug_param_to_name_mapping(params),
            "logged": {key: logged.get(key) for key in (
                "num_parameter_tensors", "total_parameter_size_bytes", "bucket_sizes", "rebuilt_per_bucket_param_indices")},
        }
    return {"differences": differences, **facts}


# ---- batch normalisation across processes ----------------------------------------------------------------


def sync_batchnorm_matches_global_batch(seed: int, device_ids: Optional[list] = None, steps: int = 3,
                                        per_rank: Union[int, Sequence[int]] = 6, subgroup: bool = False,
                                        normalised_inputs: bool = False, group_of_rank_0: bool = False) -> float:
    """minidp.SyncBatchNorm inside minidp's DDP (``device_ids``: replicas in each process) against
    ``nn.BatchNorm1d`` in one process on every rank's samples at once, float64, SGD with momentum: the
    largest relative difference in parameters, this rank's outputs and running statistics. ``per_rank``: each
    rank's rows (one count for all, or one per rank). ``subgroup``: the layer converted with a process group of its
    own (of every rank), which its exchange must use. ``normalised_inputs``: the BatchNorm first, on inputs that
    require grad (their statistics' gradient reaches no parameter), and the inputs' gradients compared too.
    ``group_of_rank_0``: a process group of rank 0 alone made first, so that the processes know different groups."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    first = [nn.BatchNorm1d(6), nn.Linear(6, 8)] if normalised_inputs else [nn.Linear(6, 8), nn.BatchNorm1d(8)]
    reference = nn.Sequential(*first, nn.Tanh(), nn.Linear(8, 3)).double()
    norm = 0 if normalised_inputs else 1
    if group_of_rank_0:
        dist.new_group([0])
    group = dist.new_group(list(range(world))) if subgroup else None
    module = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference), group)
    ddp = md.DistributedDataParallel(module, device_ids=device_ids)
    assert module[norm].across_processes.group is (ddp.process_group if group is None else group)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, reference)]
    worst = 0.0
    for step in range(steps):
        rows = per_rank if isinstance(per_rank, int) else per_rank[rank]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, _inputs(seed, step, rows, 6).double())
        total = sum(len(x) for x in everyone)
        outputs, inputs = [], [everyone[rank].requires_grad_(normalised_inputs), torch.cat(everyone).detach()]
        inputs[1].requires_grad_(normalised_inputs)
        # the mean over the global batch: DDP averages the ranks' gradients, so each rank's sum weighs world / total
        for model, optimizer, x, weight in ((ddp, optimizers[0], inputs[0], world / total),
                                            (reference, optimizers[1], inputs[1], 1 / total)):
            optimizer.zero_grad()
            outputs.append(model(x))
            (outputs[-1].pow(2).sum() * weight).backward()
            optimizer.step()
        first = sum(len(x) for x in everyone[:rank])
        pairs = list(zip(module.parameters(), reference.parameters())) + [
            (outputs[0], outputs[1][first:first + rows]),
            (module[norm].running_mean, reference[norm].running_mean),
            (module[norm].running_var, reference[norm].running_var)]
        if normalised_inputs and rows:  # this rank's sum weighs world / total here, 1 / total there
            pairs.append((inputs[0].grad / world, inputs[1].grad[first:first + rows]))
        worst = max([worst, *(max_relative_error(a, b) for a, b in pairs)])
        assert int(module[norm].num_batches_tracked) == int(reference[norm].num_batches_tracked) == step + 1
    return worst


def sync_batchnorm_gradient_penalty(seed: int) -> float:
    """A gradient penalty through minidp.SyncBatchNorm in minidp's DDP against ``nn.BatchNorm1d`` in one process on
    every rank's samples at once, float64: with L the sum of the ranks' losses L_r and G = dL/dX, the parameters'
    gradients of L + |G|^2 there; here each rank's G_r = dL_r/dx_r (create_graph=True; its backward sums over the
    processes, so it is dL/dx_r) and DDP's average of d(L_r + |G_r|^2), times the world size. The largest relative
    difference in G_r and the gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    # no bias before the normalisation, which cancels it: its gradient would be rounding, nothing to compare
    reference = nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()
    module = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    ddp = md.DistributedDataParallel(module)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, _inputs(seed, 0, 5, 6).double())
    x = torch.cat(everyone).requires_grad_()
    loss = reference(x).pow(2).sum()
    (slope,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + slope.pow(2).sum()).backward()
    mine = everyone[rank].clone().requires_grad_()
    loss = ddp(mine).pow(2).sum()
    (my_slope,) = torch.autograd.grad(loss, mine, create_graph=True)
    _quiet(lambda: (loss + my_slope.pow(2).sum()).backward())
    pairs = [(my_slope, slope[5 * rank:5 * rank + 5])] + [
        (p.grad * world, q.grad) for p, q in zip(module.parameters(), reference.parameters())]
    return max(max_relative_error(a, b) for a, b in pairs)


def sync_batchnorm_after_destroy_process_group(seed: int) -> float:
    """A model trained a step under minidp's DDP, then ``destroy_process_group()``, then a training step of the module
    alone against ``nn.BatchNorm1d`` in its state, float64: the largest relative difference in outputs, gradients
    and running statistics."""
    torch.manual_seed(seed)
    # no bias before the normalisation, which cancels it: its gradient would be rounding, nothing to compare
    reference = nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8)).double()
    module = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    md.DistributedDataParallel(module)(_inputs(seed, 0, 4, 6).double()).sum().backward()
    dist.barrier()
    dist.destroy_process_group()
    reference.load_state_dict(module.state_dict())
    generator = torch.Generator().manual_seed(seed)
    x, grad_output = (torch.randn(4, width, dtype=torch.float64, generator=generator) for width in (6, 8))
    outputs = []
    for model in (module, reference):
        model.zero_grad()
        outputs.append(model(x))
        outputs[-1].backward(grad_output)
    pairs = [tuple(outputs)] + [(p.grad, q.grad) for p, q in zip(module.parameters(), reference.parameters())] + [
        (module[1].running_mean, reference[1].running_mean), (module[1].running_var, reference[1].running_var)]
    return max(max_relative_error(a, b) for a, b in pairs)


def sync_batchnorm_no_wrapper_attached(seed: int, how: str) -> float:
    """minidp.SyncBatchNorm training outside any wrapper in a job of several processes, as torch's layer synchronises
    there: a ``copy.deepcopy`` of the module a minidp DDP wraps (an EMA teacher), or (``how="never wrapped"``) a
    converted model no wrapper ever held, against ``nn.BatchNorm1d`` in one process on every rank's samples at once,
    float64, two training forwards: the largest relative difference in this rank's outputs and the running statistics."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    reference = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)).double()
    module = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    if how == "deepcopy":
        ddp = md.DistributedDataParallel(module)
        ddp(_inputs(seed, 0, 5, 6).double()).sum().backward()  # a step of the wrapped model first, as a student's
        module = copy.deepcopy(ddp.module)
        reference[1].load_state_dict(module[1].state_dict())
    worst = 0.0
    for step in (1, 2):
        everyone: list = [None] * world
        dist.all_gather_object(everyone, _inputs(seed, step, 5, 6).double())
        with torch.no_grad():
            pairs = [(module(everyone[rank]), reference(torch.cat(everyone))[5 * rank:5 * rank + 5]),
                     (module[1].running_mean, reference[1].running_mean),
                     (module[1].running_var, reference[1].running_var)]
        worst = max([worst, *(max_relative_error(a, b) for a, b in pairs)])
    return worst


def sync_batchnorm_in_data_parallel_without_a_wrapper(seed: int) -> float:
    """minidp.SyncBatchNorm in a minidp.DataParallel of 2 CPU replicas in each process of the job, no wrapper across
    the processes, rank 0 given one row (one chunk: its replica runs alone) and the others four: each process's replicas
    meet, the processes exchange nothing, so each rank's output is ``nn.BatchNorm1d``'s on its own batch, float64; the
    largest relative difference in the output and the running statistics."""
    torch.manual_seed(seed)
    reference = nn.BatchNorm1d(6).double()
    layer = minidp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    x = _inputs(seed, 0, 1 if dist.get_rank() == 0 else 4, 6, 3).double()
    pairs = [(minidp.DataParallel(layer, cpu_ids(2))(x), reference(x)),
             (layer.running_mean, reference.running_mean), (layer.running_var, reference.running_var)]
    return max(max_relative_error(a.detach(), b.detach()) for a, b in pairs)


class _AroundADataParallel(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = minidp.DataParallel(inner, cpu_ids(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def sync_batchnorm_in_a_nested_data_parallel(seed: int, device_ids: Optional[list] = None) -> Optional[tuple]:
    """minidp.SyncBatchNorm inside a DataParallel of 2 CPU replicas inside the module minidp's DDP wraps: the error of
    the first training forward (its type, and whether it says that the chunks cannot be laid out), ``None`` if none."""
    torch.manual_seed(seed)
    inner = minidp.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)).double())
    ddp = md.DistributedDataParallel(_AroundADataParallel(inner), device_ids=device_ids)
    try:
        ddp(_inputs(seed, 0, 8, 6).double()).sum().backward()
    except RuntimeError as error:
        return type(error).__name__, "cannot be laid out" in str(error)
    return None


def torch_sync_batchnorm_on_cpu(seed: int) -> dict:
    """torch.nn.SyncBatchNorm in a CPU model: both wrappers' errors at construction."""
    errors = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
        try:
            _quiet(lambda: wrapper(model))
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return errors


# ---- native mixed precision ----------------------------------------------------------------------------


class _EventStandIn:
    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass


class _StreamStandIn:
    def __enter__(self) -> "_StreamStandIn":
        return self

    def __exit__(self, *exception: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextlib.contextmanager
def torch_mixed_precision_on_the_cpu():
    """torch DDP's native mixed precision calls accelerator-only APIs, which fail without an accelerator: side
    streams for its copies and its hook (``torch.Stream()``; torch 2.11: "Backend doesn't support create a new
    Stream"), a ``torch.Event()`` per module in its forward pre-hooks to order them ("cpu backend doesn't support
    events") and ``torch.accelerator.current_stream()`` in its hook's end-of-backward callback. On the CPU every
    operation runs in order, so all three stand in as no-ops; torch's own Python and C++ run as they are."""
    saved = torch.Stream, torch.Event, torch.accelerator.current_stream
    torch.Stream, torch.Event, torch.accelerator.current_stream = (
        _StreamStandIn, _EventStandIn, lambda *args, **kwargs: _StreamStandIn())
    try:
        yield
    finally:
        torch.Stream, torch.Event, torch.accelerator.current_stream = saved


def _mixed_precision_model(batch_norm: bool) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), *([nn.BatchNorm1d(16)] if batch_norm else []), nn.Tanh(), nn.Linear(16, 3))


def _mean_low_precision_gradients(module: nn.Module, batch_norm: bool, batches: list, config: Any) -> list:
    """The gradients mixed precision should leave: those of a ``param_dtype`` copy of ``module`` (its buffers as they
    are), accumulated in ``param_dtype`` over ``batches`` (cast to ``param_dtype``) onto the gradients ``module`` has
    (cast likewise), each cast to ``reduce_dtype``, summed over the ranks, divided by their number, in full precision."""
    low = _mixed_precision_model(batch_norm)
    with torch.no_grad():
        for copy_, param in zip(low.parameters(), module.parameters()):
            copy_.data = param.detach().to(config.param_dtype)
            copy_.requires_grad_(param.requires_grad)  # a frozen parameter gets no gradient
            copy_.grad = None if param.grad is None else param.grad.to(config.param_dtype)
        for copy_, buffer in zip(low.buffers(), module.buffers()):
            copy_.data = buffer.detach().clone()
    for x in batches:
        low(x.to(config.param_dtype)).float().pow(2).mean().backward()
    means = []
    for param in low.parameters():
        if param.grad is None:
            means.append(None)
            continue
        grad = param.grad.to(config.reduce_dtype or config.param_dtype)
        dist.all_reduce(grad)
        means.append(grad.div_(dist.get_world_size()).float())
    return means


class _TakesADtype(nn.Module):
    """A forward with a keyword argument named ``dtype`` (the dtype of its output), noting its input's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        self.seen = str(x.dtype)
        return self.linear(x).to(dtype)


def mixed_precision_keyword_named_dtype(seed: int) -> dict:
    """``mixed_precision=_MixedPrecision(param_dtype=bfloat16)``, a forward given ``dtype=torch.float32``: what the
    module's forward saw and what it returned, or the error. minidp alone: torch's DDP passes the forward's keyword
    arguments on to ``_cast_forward_inputs(dtype, *args, **kwargs)``, and raises ("got multiple values for argument
    'dtype'")."""
    from torch.nn.parallel.distributed import _MixedPrecision

    torch.manual_seed(seed)
    module = _TakesADtype()
    ddp = md.DistributedDataParallel(module, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    try:
        output = ddp(_inputs(seed, 0, 4, 6), dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - reported, the test names it
        return {"error": f"{type(error).__name__}: {error}"}
    output.sum().backward()
    return {"error": None, "seen": module.seen, "output": str(output.dtype)}


def mixed_precision_under_join(seed: int, batches: Sequence[int]) -> dict:
    """``mixed_precision=_MixedPrecision(bfloat16, bfloat16, bfloat16)`` under ``ddp.join()``, rank r training
    ``batches[r]`` batches, against the same wrapper trained ``max(batches)`` steps without join, a rank past its
    batches back-propagating its loss times zero (what a rank that joined adds to the mean over the initial world
    size: zero gradients): the first difference of the two models' states after the context (where the last rank to
    join has sent its model to all; the gradients differ: a rank that joined keeps those of its last batch), each one's error if it raised, and the dtypes of the joined model's parameters."""
    from torch.nn.parallel.distributed import _MixedPrecision

    config = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    torch.manual_seed(seed + dist.get_rank())
    joined_module = _mixed_precision_model(False)
    reference_module = copy.deepcopy(joined_module)
    mine = batches[dist.get_rank()]
    errors: dict[str, Optional[str]] = {"joined": None, "reference": None}

    def train(ddp: nn.Module, steps: int, zeroed_from: int) -> None:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            optimizer.zero_grad()
            loss = ddp(_inputs(seed, step, 5, 6)).pow(2).mean()
            (loss * 0 if step >= zeroed_from else loss).backward()
            optimizer.step()

    for name, module, steps in (("joined", joined_module, mine), ("reference", reference_module, max(batches))):
        ddp = md.DistributedDataParallel(module, mixed_precision=config)
        try:
            with ddp.join() if name == "joined" else contextlib.nullcontext():
                train(ddp, steps, zeroed_from=mine)
        except RuntimeError as error:
            errors[name] = str(error)
    return {"difference": state_difference(joined_module.state_dict(), reference_module.state_dict()),
            "errors": errors, "dtypes": sorted({str(p.dtype) for p in joined_module.parameters()})}


def mixed_precision_as_stock(seed: int, param_dtype: str, reduce_dtype: Optional[str], buffer_dtype: Optional[str],
                             steps: int = 4, set_to_none: bool = True, accumulate: bool = False,
                             evaluate: bool = False, zero_grad_every: int = 1, frozen: bool = False,
                             **options: Any) -> dict:
    """``mixed_precision=_MixedPrecision(...)`` (dtypes by name) in both wrappers, torch's through
    :func:`torch_mixed_precision_on_the_cpu`, trained side by side: ``steps`` SGD steps with momentum after a first
    backward that does not step (torch's first all-reduce sums a buffer its gradients were not copied into: its
    ``_set_mixed_precision_param_dtype`` replaces each bucket's buffer and keeps the views of the old one; its
    buckets, rebuilt after the first backward, are right from then on). ``accumulate``: each step after a first
    micro-batch under ``no_sync``; ``evaluate``: after a forward under ``torch.no_grad()``; ``zero_grad_every``: the
    gradients zeroed after that many steps only, so that the next backwards add onto reduced ones; ``frozen``: the first
    layer's weight frozen after wrapping (its gradient stays None, as the reference's). After every backward:
    whether minidp's gradients are the low-precision mean (:func:`_mean_low_precision_gradients`), the dtypes the
    optimizer sees (and an evaluation leaves), and, from the second backward, the first difference from torch's
    parameters, gradients and buffers (or the error torch raised, after which it drops out)."""
    from torch.nn.parallel.distributed import _MixedPrecision

    config = _MixedPrecision(**{name: None if value is None else getattr(torch, value) for name, value in (
        ("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype), ("buffer_dtype", buffer_dtype))})
    batch_norm = buffer_dtype is not None  # BatchNorm's kernel wants its buffers in its input's dtype
    torch.manual_seed(seed + dist.get_rank())
    theirs_module = _mixed_precision_model(batch_norm)
    ours_module = copy.deepcopy(theirs_module)
    with torch_mixed_precision_on_the_cpu():
        theirs = _quiet(lambda: TorchDDP(theirs_module, mixed_precision=config, **options))
    ours = md.DistributedDataParallel(ours_module, mixed_precision=config, **options)
    if frozen:
        for module in (theirs_module, ours_module):
            module[0].weight.requires_grad_(False)
    optimizers = [torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9) for ddp in (theirs, ours)]
    facts: dict[str, Any] = {"mean": [], "dtypes": [], "evaluated": [], "stock": [], "stock_error": None}
    for step in range(steps + 1):
        batches = [_inputs(seed, 100 + step, 5, 6)] * accumulate + [_inputs(seed, step, 5, 6)]
        reference = _mean_low_precision_gradients(ours_module, batch_norm, batches, config)
        wrappers = (ours,) if facts["stock_error"] else (ours, theirs)
        for ddp in wrappers:
            try:
                with torch_mixed_precision_on_the_cpu():
                    if evaluate:
                        with torch.no_grad():
                            ddp(_inputs(seed, 200 + step, 5, 6))
                        if ddp is ours:
                            facts["evaluated"].append(sorted({str(p.dtype) for p in ours_module.parameters()}))
                    for i, x in enumerate(batches):
                        with ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                            ddp(x).float().pow(2).mean().backward()
            except (RuntimeError, AttributeError) as error:
                if ddp is ours:
                    raise
                facts["stock_error"] = f"{type(error).__name__}: {str(error).splitlines()[-1]}"
        facts["mean"].append(all(_same_gradient(p.grad, r) for p, r in zip(ours_module.parameters(), reference)))
        facts["dtypes"].append(sorted({str(t.dtype) for p in ours_module.parameters() for t in (p, p.grad) if t is not None}))
        if step and not facts["stock_error"]:
            facts["stock"].append(_difference(ours_module, theirs_module))
        for optimizer in optimizers:
            if step:
                optimizer.step()
            if step % zero_grad_every == 0:
                optimizer.zero_grad(set_to_none=set_to_none)
        if step and not facts["stock_error"]:
            facts["stock"].append(_difference(ours_module, theirs_module))
    facts["buffers"] = sorted({str(b.dtype) for b in ours_module.buffers()})
    return facts


# ---- a rank that runs out of data without Join ---------------------------------------------------------


def runs_out_without_join(directory: str) -> None:
    """Rank r trains 2 + r steps without Join, then waits at a barrier; each rank writes the error it got
    (or "finished") and the seconds it took to ``directory/rank<r>.txt``. The job's process group has a
    short timeout: the test bounds the time and reads the files."""
    ddp = md.DistributedDataParallel(nn.Linear(4, 4))
    start = time.monotonic()
    try:
        for _ in range(2 + dist.get_rank()):
            ddp(torch.randn(3, 4)).sum().backward()
        dist.barrier()
        outcome = "finished"
    except RuntimeError as error:
        outcome = str(error)
    with open(os.path.join(directory, f"rank{dist.get_rank()}.txt"), "w") as file:
        file.write(f"{time.monotonic() - start:.1f}\n{outcome}")
    # Both files are written before either rank goes on to the job's closing barrier: that barrier fails on the
    # timed-out group, and the first rank it fails in ends the job, which kills the other, maybe mid-write.
    written = dist.FileStore(os.path.join(directory, "written"), 2)
    written.set(f"rank{dist.get_rank()}", "written")
    written.wait(["rank0", "rank1"], timedelta(seconds=60))


def observed_memory(seed: int, gradient_as_bucket_view: bool) -> dict:
    """A float64 MLP 8-16-4 in two buckets (600-byte cap), three steps of SGD with momentum, the second measured by the
    allocation ledger (:func:`minidp.tracing.memory.measure_step`; its buckets rebuilt in that step's forward):
    ``memory_ledger`` after the last step, what each category of the measured step held at most, and of a fourth step
    traced (``minidp.trace(ledger=True)``) without the optimizer's."""
    from minidp.tracing.memory import measure_step

    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    model = md.DistributedDataParallel(module, bucket_cap_mb=600 / 2**20, gradient_as_bucket_view=gradient_as_bucket_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    held = {}
    for step in range(3):
        x = _inputs(seed, step, 6, 8).double()

        def train() -> None:
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()

        if step == 1:
            _, rows = measure_step(train, module.parameters())
            held = rows[0].held
        else:
            train()
    ledger = md.memory_ledger(model, optimizer)
    # A step traced with no optimizer step inside it: only the wrapper can tell the ledger what its parameters are
    x = _inputs(seed, 3, 6, 8).double()
    with minidp.trace(ledger=True) as traced:
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
    return {"ledger": ledger, "held": held, "plan": model.bucket_plan(), "traced held": traced.ledger()[0].held}


def broadcast_copies_as_stock(seed: int, case: str) -> dict:
    """What each wrapper's copies of rank 0's parameters and buffers into every rank's leave.

    ``case`` ``"expanded_buffer"``: a buffer made by ``expand`` (its 4 elements share one), which no copy can write:
    the error of each construction. ``"graph_recorded_before"``: a forward recorded on the plain module (different
    weights on every rank), back-propagated once it is wrapped: each parameter's version counter before and after the
    construction, and the backward's error. ``"buffer_saved_for_backward"``: a forward whose graph saved a buffer, then
    one under ``torch.no_grad()``, which syncs the buffers first (into the saved one), then the first one's backward:
    its error, if any. ``"empty_tensors"``: a parameter and a buffer without elements beside others: every version
    counter after the construction. ``"joined"``: a model with buffers trained 2 steps on rank 0 and 3 on rank 1 under
    ``Join`` (rank 0's buffer syncs then made by its join hook): the buffers' version counters after."""
    results: dict[str, Any] = {}
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        torch.manual_seed(seed + dist.get_rank())
        if case == "empty_tensors":
            module = ScaledByBuffer()
            module.empty = nn.Parameter(torch.zeros(0))
            module.register_buffer("nothing", torch.zeros(0, 3))
            wrapper(module)
            results[name] = {n: t._version for n, t in [*module.named_parameters(), *module.named_buffers()]}
            continue
        if case == "joined":
            module = nn.Sequential(ScaledByBuffer(), nn.BatchNorm1d(4))
            model = wrapper(module)
            with Join([model]):
                for step in range(2 + dist.get_rank()):
                    model(_inputs(seed, step, 6, 4)).sum().backward()
            results[name] = {n: b._version for n, b in module.named_buffers()}
            continue
        if case == "buffer_saved_for_backward":
            model, x = wrapper(ScaledByBuffer()), _inputs(seed, 0, 3, 4)
            loss = model(x).sum()
            with torch.no_grad():
                model(x)
            results[name] = error_of(loss.backward)
            continue
        module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        if case == "expanded_buffer":
            module.register_buffer("expanded", torch.full((1,), float(dist.get_rank())).expand(4))
            results[name] = error_of(lambda: wrapper(module))
            continue
        loss = module(_inputs(seed, 0, 3, 4).double()).sum()
        before = [p._version for p in module.parameters()]
        wrapper(module)
        results[name] = {"versions": (before, [p._version for p in module.parameters()]), "backward": error_of(loss.backward)}
    return results
