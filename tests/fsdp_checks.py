"""Checks that run inside every rank of a job started by ``minidp.distributed.launch``: minidp's
``fully_shard`` against torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) in the same process,
on the same data; each returns plain facts that tests/test_fully_shard.py asserts on.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import inspect
import itertools
import sys
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, UnshardHandle, register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import minidp
import minidp.distributed as md
from minidp.distributed.fully_shard import ShardedModule, sharded_groups

from .helpers import error_of, state_difference, timm_vit, torchvision_resnet18


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

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """Another entry point (a ``generate``) on the root's own parameters: register_fsdp_forward_method."""
        return self.head(torch.tanh(self.norm(x)[:, :7]))


class Tied(nn.Module):
    """One weight used by two modules (an embedding tied to its output layer), sharded as one group."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(13, 13)
        self.outer = nn.Linear(13, 13)
        self.outer.weight = self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x)))


class Embedded(nn.Module):
    """An embedding, whose backward needs none of its weights' values (``set_unshard_in_backward(False)``),
    looked up by indices made from the input, in front of a :class:`Net`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 13)
        self.body = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed((x.abs() * 5).long() % 17).mean(1))


class Branchy(nn.Module):
    """A block, then one of two heads of the root's group, chosen by the rank: each rank leaves a different
    parameter without gradient (``set_reduce_scatter_unused_params``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(13, 13)])
        self.left, self.right = nn.Linear(13, 2), nn.Linear(13, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = self.left if dist.get_rank() % 2 == 0 else self.right
        return head(self.blocks[0](x))


def shard(model: nn.Module, function: Callable[..., Any], reshard_after_forward: Optional[bool],
          policies: tuple[MixedPrecisionPolicy, MixedPrecisionPolicy] = (MixedPrecisionPolicy(),) * 2,
          ignored: tuple[str, ...] = (), grouped: tuple[str, ...] = (), **every_call: Any) -> nn.Module:
    """Sub-modules first (the blocks, an embedding), the root last, as FSDP2 asks; ``policies``: the
    sub-modules' mixed precision policy and the root's; ``ignored``: names of parameters the root's call ignores;
    ``grouped``: names of the root's children sharded together by one call, first (``fully_shard([norm, head])``);
    ``every_call``: more arguments, given to every call (``mesh``, ``shard_placement_fn``, ``offload_policy``)."""
    if grouped:
        function([getattr(model, name) for name in grouped], reshard_after_forward=reshard_after_forward,
                 mp_policy=policies[0], **every_call)
    for part in [*getattr(model, "blocks", ()), *filter(None, [getattr(model, "embed", None)])]:
        function(part, reshard_after_forward=reshard_after_forward, mp_policy=policies[0], **every_call)
    named = dict(model.named_parameters())
    return function(model, reshard_after_forward=reshard_after_forward, mp_policy=policies[1],
                    ignored_params={named[name] for name in ignored}, **every_call)


def _along_columns_where_even(param: nn.Parameter) -> Optional[Shard]:
    """A ``shard_placement_fn``: a matrix whose columns the ranks divide is cut along them (as ``Shard(-1)``, which
    means dim 1), any other parameter along its rows (``None``)."""
    return Shard(-1) if param.dim() == 2 and param.size(1) % dist.get_world_size() == 0 else None


def sharding_arguments(mesh: Optional[tuple[int, ...]] = None, placement: bool = False,
                       offload: bool = False) -> dict[str, Any]:
    """FSDP2's other arguments of ``fully_shard``, given alike to both: a CPU ``mesh`` of that shape (2-D: HSDP,
    replicated over dimension 0), a ``shard_placement_fn`` (:func:`_along_columns_where_even`), CPU offload."""
    arguments: dict[str, Any] = {}
    if mesh is not None:
        names = ("replicate", "shard") if len(mesh) == 2 else None  # FSDP2 asks HSDP's mesh for its names
        arguments["mesh"] = init_device_mesh("cpu", mesh, mesh_dim_names=names)
    if placement:
        arguments["shard_placement_fn"] = _along_columns_where_even
    if offload:
        arguments["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return arguments


# FSDP2's mixed precision policies (param_dtype: the all-gather, forward and backward; reduce_dtype: the
# reduce-scatter; output_dtype: the forward's outputs), the sub-modules' and the root's, given alike to both.
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
POLICIES = {
    "bf16": (BF16, BF16),
    "bf16-reduce-fp32": (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),) * 2,
    "fp16-reduce-fp32": (MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),) * 2,
    "reduce-bf16": (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),) * 2,
    "root-out-fp32": (BF16, MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)),
}


class TwoDtypes(Net):
    """A :class:`Net` whose middle block runs in float64, the rest in float32: groups of two dtypes (one a group)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1].double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.norm(x))
        return self.head(self.blocks[2](self.blocks[1](x.double()).float()))


class Gained(Net):
    """A :class:`Net` whose input is first scaled by ``gain``, a frozen parameter of the root's group (gathered with
    the root's other parameters, never reduced), to which :func:`against_fsdp2` (``frozen``) may give a dtype of its
    own: one call's parameters of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(13) * 3 + 0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x scaled in the gain's dtype where it is a floating-point one, so that a gain gathered in another dtype
        # than FSDP2 gathers it in gives other losses
        gain = self.gain
        scaled = x.to(gain.dtype) * gain if gain.is_floating_point() else x * gain
        return super().forward(scaled.to(x.dtype))


MODELS = {"net": Net, "tied": Tied, "embedded": Embedded, "branchy": Branchy,
          "wide": lambda: Net(hidden=30),  # (30, 30) and (7, 30) weights: columns that 2 and 3 ranks divide
          "two_dtypes": TwoDtypes, "gained": Gained,
          # nobody here wrote these (tests/test_model_libraries.py runs them where their libraries import)
          "timm_vit": timm_vit, "torchvision_resnet18": torchvision_resnet18}
SAMPLE_SHAPES = {"timm_vit": (3, 32, 32), "torchvision_resnet18": (3, 32, 32)}  # one row of a batch: else 13 features


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    """The modules a fully_shard call was applied to, minidp's or FSDP2's."""
    return [m for m in model.modules() if isinstance(m, (ShardedModule, FSDPModule))]


# FSDPModule's setters, each applied alike to both models before every micro-batch's forward
# (model, micro-batch, micro-batches per step); tests/test_fully_shard.py trains with each against FSDP2.
def _forward_prefetch(model: nn.Module, micro: int, micro_batches: int) -> None:
    chain = [model, *model.blocks]  # each module starts the next one's all-gather
    for module, following in zip(chain, chain[1:]):
        module.set_modules_to_forward_prefetch([following])


def _backward_prefetch(model: nn.Module, micro: int, micro_batches: int) -> None:
    model.set_modules_to_backward_prefetch([model.blocks[2], model.blocks[1]])  # two at once
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])


def _keep_between_micro_batches(model: nn.Module, micro: int, micro_batches: int) -> None:
    # gradient accumulation: no reduce-scatter, no reshard, no final wait but in the last micro-batch
    last = micro == micro_batches - 1
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)
    model.set_is_last_backward(last)


def _kept_after_backward(model: nn.Module, micro: int, micro_batches: int) -> None:
    model.set_reshard_after_backward(False)  # with every backward reduced: the next forward gathers nothing


def _reduce_unused(model: nn.Module, micro: int, micro_batches: int) -> None:
    model.set_reduce_scatter_unused_params(True)


def _divide_by_three(model: nn.Module, micro: int, micro_batches: int) -> None:
    for module in sharded_modules(model):
        module.set_gradient_divide_factor(3.0)


def _force_sum(model: nn.Module, micro: int, micro_batches: int) -> None:
    for module in sharded_modules(model):
        module.set_force_sum_reduction_for_comms(True)


def _unshard_by_hand(model: nn.Module, micro: int, micro_batches: int) -> None:
    model.blocks[0].unshard(async_op=True)  # left for its forward to wait for
    model.blocks[1].unshard(async_op=True).wait()


def _reshard_the_root(model: nn.Module, micro: int, micro_batches: int) -> None:
    model.set_reshard_after_forward(True, recurse=False)


def _keep_the_embedding_in_backward(model: nn.Module, micro: int, micro_batches: int) -> None:
    model.embed.set_unshard_in_backward(False)


def _halve_in_a_hook(model: nn.Module, micro: int, micro_batches: int) -> None:
    # set_all_reduce_hook: each group's reduced rows halved in place, before FSDP2's division after the collectives
    for module in sharded_modules(model):
        module.set_all_reduce_hook(_halve)


def _halve(reduced: torch.Tensor) -> None:
    reduced.mul_(0.5)


def _all_reduce_the_last(model: nn.Module, micro: int, micro_batches: int) -> None:
    # HSDP's gradient accumulation: every micro-batch reduce-scattered, only the last one's sum all-reduced
    model.set_requires_all_reduce(micro == micro_batches - 1)


def _fsdp2s_default_comm_buffers(model: nn.Module, micro: int, micro_batches: int) -> None:
    # FSDP2's defaults, set explicitly (as a framework's config may): one reduce-scatter input buffer, torch's allocator
    for module in sharded_modules(model):
        module.set_reduce_scatter_max_input_buffers(1)
        module.set_allocate_memory_from_process_group_for_comm(False)


CONFIGURATIONS: dict[str, Callable[[nn.Module, int, int], None]] = {
    "forward_prefetch": _forward_prefetch,
    "backward_prefetch": _backward_prefetch,
    "keep_between_micro_batches": _keep_between_micro_batches,
    "kept_after_backward": _kept_after_backward,
    "reduce_unused": _reduce_unused,
    "divide_by_three": _divide_by_three,
    "force_sum": _force_sum,
    "unshard_by_hand": _unshard_by_hand,
    "reshard_the_root": _reshard_the_root,
    "embedding_not_gathered_in_backward": _keep_the_embedding_in_backward,
    "all_reduce_the_last": _all_reduce_the_last,
    "all_reduce_hook": _halve_in_a_hook,
    "fsdp2s_default_comm_buffers": _fsdp2s_default_comm_buffers,
}


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}
# One that makes its state (`sum`) when it is built, not at its first step: checkpointed (optimizer_checkpoint)
CHECKPOINTED_OPTIMIZERS = {
    **OPTIMIZERS, "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1),
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
                  reshard_after_forward: Optional[bool] = True, steps: int = 3, micro_batches: int = 1,
                  unsynced: Optional[str] = None, configure: Optional[str] = None, policy: Optional[str] = None,
                  ignored: tuple[str, ...] = (), grouped: tuple[str, ...] = (),
                  mesh: Optional[tuple[int, ...]] = None, placement: bool = False, offload: bool = False,
                  meta: bool = False, frozen: Optional[torch.dtype] = None) -> dict:
    """Train FSDP2 and minidp side by side from the same weights (seeded alike on every rank, as
    FSDP2 requires), each rank on its own batches; after every backward and every step, the first
    difference. ``micro_batches`` > 1: that many backwards per step, their sharded gradients summed.
    ``unsynced``: each step's backwards but the last run after ``set_requires_gradient_sync(False)`` on
    the root, the last after ``True``: ``"all"`` with ``recurse=True`` (no reduce-scatter until the last),
    ``"root"`` with ``recurse=False`` (only the root's group accumulates unreduced). ``configure``: one of
    :data:`CONFIGURATIONS`, applied to both before every micro-batch. ``policy``: one of :data:`POLICIES`.
    ``ignored``: parameters the root's ``fully_shard`` leaves alone (unsharded, unreduced). ``grouped``: children
    of the root sharded as one group by one call (``fully_shard([norm, head])``) before the rest. ``mesh``,
    ``placement``, ``offload``: :func:`sharding_arguments`. ``meta``: both built on the meta device, sharded there,
    then materialised with ``to_empty`` and given the weights by loading a full state dict (FSDP2's through
    ``set_model_state_dict``), the way large models are built. ``frozen``: the ``gained`` model's frozen ``gain`` in
    this dtype, beside parameters of ``dtype``. ``losses_equal``: whether every forward's loss is FSDP2's."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    theirs = MODELS[model]().to(dtype)
    if frozen is not None:  # after the cast, which would give a floating-point gain the model's dtype
        gain = torch.rand(13, dtype=torch.float64) * 3 + 0.5  # float64 values float32 cannot hold; 0 to 3 as int64
        theirs.gain = nn.Parameter(gain.to(frozen), requires_grad=False)
    full = {k: v.clone() for k, v in theirs.state_dict().items()}
    if meta:
        with torch.device("meta"):
            theirs = MODELS[model]().to(dtype)
    ours = copy.deepcopy(theirs)
    policies = (MixedPrecisionPolicy(),) * 2 if policy is None else POLICIES[policy]
    arguments = sharding_arguments(mesh, placement, offload)
    shard(theirs, torch_fully_shard, reshard_after_forward, policies, ignored, grouped, **arguments)
    shard(ours, md.fully_shard, reshard_after_forward, policies, ignored, grouped, **arguments)
    devices_after_to_empty = None
    if meta:
        for sharded in (ours, theirs):
            sharded.to_empty(device="cpu")
        # before any forward, where the sharded state dict a checkpoint is loaded into lives (DCP's resume)
        devices_after_to_empty = [sorted({v.device.type for v in m.state_dict().values()}) for m in (ours, theirs)]
        ours.load_state_dict(full)
        set_model_state_dict(theirs, {k: v.clone() for k, v in full.items()},  # (it turns the values into DTensors)
                             options=StateDictOptions(full_state_dict=True))
    optimizers = (OPTIMIZERS[optimizer](ours.parameters()), OPTIMIZERS[optimizer](theirs.parameters()))
    differences, losses_equal = [], True
    for step in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        for micro in range(micro_batches):
            x = torch.randn(5, *SAMPLE_SHAPES.get(model, (13,)),
                            generator=torch.Generator().manual_seed(seed + 100 * step + 10 * micro + rank),
                            dtype=dtype)
            losses = []
            for sharded in (ours, theirs):
                if configure is not None:
                    CONFIGURATIONS[configure](sharded, micro, micro_batches)
                if unsynced is not None:
                    sharded.set_requires_gradient_sync(micro == micro_batches - 1, recurse=unsynced == "all")
                losses.append(sharded(x).pow(2).mean())
                losses[-1].backward()
            losses_equal &= torch.equal(*losses)
            differences.append(first_difference(ours, theirs, optimizers))
        for opt in optimizers:
            opt.step()
        differences.append(first_difference(ours, theirs, optimizers))
    state_dicts_alike = _state_dict_difference(ours.state_dict(), theirs.state_dict())
    ours_full = md.full_state_dict(ours)
    theirs_full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in theirs.state_dict().items()}
    state_dict_equal = list(ours_full) == list(theirs_full) and all(
        torch.equal(ours_full[k], theirs_full[k]) for k in ours_full)
    ours.load_state_dict(full)  # the initial weights back, whole, on every rank
    reloaded = md.full_state_dict(ours)
    return {"differences": differences, "losses_equal": losses_equal, "state_dict_equal": state_dict_equal,
            "state_dicts_alike": state_dicts_alike,
            "reloaded": all(torch.equal(reloaded[k], full[k]) for k in full), "devices_after_to_empty": devices_after_to_empty,
            "shard_shapes": [tuple(p.shape) for p in ours.parameters()]}


def _state_dict_difference(ours: dict, theirs: dict) -> Optional[str]:
    """The first entry where ``ours`` and ``theirs`` (a ``state_dict()``) differ: in keys, in being a DTensor, in its
    mesh's shape and placements, in its whole shape, or in this rank's values (None: none)."""
    if list(ours) != list(theirs):
        return f"keys {list(ours)} here, {list(theirs)} in FSDP2"
    for key, a in ours.items():
        b = theirs[key]
        if isinstance(a, DTensor) != isinstance(b, DTensor):
            return f"{key}: a DTensor in {'FSDP2' if isinstance(b, DTensor) else 'minidp'} only"
        if isinstance(a, DTensor) and (a.placements != b.placements or a.device_mesh.shape != b.device_mesh.shape):
            return f"{key}: placed {a.placements} on {a.device_mesh.shape} here, {b.placements} on {b.device_mesh.shape}"
        if a.shape != b.shape or not torch.equal(local(a), local(b)):
            return f"{key}: {tuple(a.shape)} here, {tuple(b.shape)} in FSDP2, or different values"
    return None


def checkpoint_round_trip(seed: int, mesh: Optional[tuple[int, ...]] = None) -> dict[str, Any]:
    """``torch.distributed.checkpoint`` on a sharded model: saved from ``state_dict()`` (each rank its rows), loaded
    into a model sharded alike but initialised otherwise (``dcp.load`` into its ``state_dict()``, then
    ``load_state_dict``); whether its whole parameters are then the saved ones, and whether
    ``get_model_state_dict(full_state_dict=True)`` gives what ``full_state_dict`` gives; then the saved model's
    ``state_dict()`` loaded straight into one whose matrices are cut along their columns (a DTensor laid out
    otherwise: gathered whole first), whether that one's whole parameters are the saved ones."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    directory = [tempfile.mkdtemp(prefix="minidp-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    arguments = sharding_arguments(mesh)
    torch.manual_seed(seed)
    saved = shard(MODELS["wide"](), md.fully_shard, True, **arguments)
    saved(torch.randn(5, 13)).sum().backward()  # gathered and freed once: the state dict holds the shards again
    whole = md.full_state_dict(saved)
    gathered_by_dcp = get_model_state_dict(saved, options=StateDictOptions(full_state_dict=True))
    dcp.save(saved.state_dict(), checkpoint_id=directory[0])
    torch.manual_seed(seed + 1)
    loaded = shard(MODELS["wide"](), md.fully_shard, True, **arguments)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=directory[0])
    loaded.load_state_dict(state)
    reloaded = md.full_state_dict(loaded)
    columns = shard(MODELS["wide"](), md.fully_shard, True, **arguments, **sharding_arguments(placement=True))
    columns.load_state_dict(saved.state_dict())
    across_layouts = md.full_state_dict(columns)
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(directory[0])
    return {"reloaded": all(torch.equal(reloaded[k], whole[k]) for k in whole) and list(reloaded) == list(whole),
            "gathered_by_dcp": all(torch.equal(gathered_by_dcp[k], whole[k]) for k in whole),
            "across_layouts": all(torch.equal(across_layouts[k], whole[k]) for k in whole)}


def optimizer_checkpoint(seed: int, mesh: Optional[tuple[int, ...]] = None,
                         optimizer_name: str = "adamw") -> dict[str, Any]:
    """The optimizer's state dict of sharded parameters against FSDP2's, both trained alike with ``optimizer_name`` (a
    name in :data:`CHECKPOINTED_OPTIMIZERS`) for two
    steps: ``get_optimizer_state_dict`` sharded (``alike``: the first difference) and whole (``whole_equal``);
    checkpoints saved by ``torch.distributed.checkpoint`` from either library (``get_state_dict``) and loaded into a
    fresh model and optimizer of either (``set_state_dict``), which then take a third step beside the saved ones:
    ``resumed`` holds the first difference from FSDP2's for each (saved, loaded into); ``whole_loaded``: the same
    after FSDP2's whole optimizer state dict is loaded into a fresh minidp optimizer; ``loaded_before_a_step``: a
    fourth step of a fresh optimizer given ``optimizer.state_dict()`` (through ``torch.save``) before its first."""
    import io
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict, set_state_dict,
    )

    rank = dist.get_rank()
    arguments = sharding_arguments(mesh)
    libraries = {"minidp": md.fully_shard, "FSDP2": torch_fully_shard}

    def fresh(library: str, salt: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed + salt)  # other weights than the saved ones: loading must bring them all
        model = shard(Net(), libraries[library], True, **arguments)
        return model, CHECKPOINTED_OPTIMIZERS[optimizer_name](model.parameters())

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        batch = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 100 * step + rank))
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(seed)
    theirs = Net()
    ours = shard(copy.deepcopy(theirs), md.fully_shard, True, **arguments)
    shard(theirs, torch_fully_shard, True, **arguments)
    pairs = [(model, CHECKPOINTED_OPTIMIZERS[optimizer_name](model.parameters())) for model in (ours, theirs)]
    for step in range(2):
        for model, optimizer in pairs:
            train(model, optimizer, step)
    # compared at once: the state dicts hold the live state (the step counts even in whole ones), which the steps
    # below go on changing
    alike = state_difference(*[get_optimizer_state_dict(model, optimizer) for model, optimizer in pairs])
    whole = [get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
             for model, optimizer in pairs]
    whole_equal = state_difference(*whole) is None
    directory = [tempfile.mkdtemp(prefix="minidp-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    for library, (model, optimizer) in zip(libraries, pairs):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=f"{directory[0]}/{library}")
    resumed = {}
    for saved, loaded in itertools.product(libraries, libraries):
        model, optimizer = resumed[saved, loaded] = fresh(loaded, 1)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=f"{directory[0]}/{saved}")
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    whole_loaded = fresh("minidp", 2)
    # a copy, as read from a file: the whole state dict holds FSDP2's live step counts, which loading would share
    set_optimizer_state_dict(*whole_loaded, copy.deepcopy(whole[1]), options=StateDictOptions(full_state_dict=True))
    whole_loaded[0].load_state_dict(theirs.state_dict())

    def from_fsdp2(model: nn.Module, optimizer: torch.optim.Optimizer, library: str) -> Optional[str]:
        # beside FSDP2's original after the same steps (first_difference compares a minidp model with an FSDP2 one)
        if library == "minidp":
            return first_difference(model, theirs, (optimizer, pairs[1][1]))
        return first_difference(ours, model, (pairs[0][1], optimizer))

    for model, optimizer in [*pairs, *resumed.values(), whole_loaded]:
        train(model, optimizer, 2)
    results = {
        "alike": alike,
        "whole_equal": whole_equal,
        "resumed": {f"saved by {saved}, loaded into {loaded}": from_fsdp2(*resumed[saved, loaded], loaded)
                    for saved, loaded in resumed},
        "whole_loaded": from_fsdp2(*whole_loaded, "minidp"),
    }
    before_a_step = fresh("minidp", 3)
    before_a_step[0].load_state_dict(ours.state_dict())
    saved_bytes = io.BytesIO()
    torch.save(pairs[0][1].state_dict(), saved_bytes)
    before_a_step[1].load_state_dict(torch.load(io.BytesIO(saved_bytes.getvalue()), weights_only=False))
    for model, optimizer in (*pairs, before_a_step):
        train(model, optimizer, 3)
    results["loaded_before_a_step"] = from_fsdp2(*before_a_step, "minidp")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory[0])
    return results


class ColumnDecay(torch.optim.Optimizer):
    """SGD with momentum that also keeps, for a matrix, a statistic per column: a plain 1-D state of the optimizer's
    own making, not shaped like the parameter (as Adafactor's factored second moment is not), which FSDP2's
    optimizer keeps as the plain tensor it is."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                momentum = state.setdefault("momentum", torch.zeros_like(p))
                momentum.mul_(0.9).add_(p.grad)
                p.add_(momentum, alpha=-group["lr"])
                if p.dim() == 2:
                    state.setdefault("column_scale", torch.ones(p.size(-1), dtype=p.dtype)).mul_(0.5)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, step: int) -> None:
    batch = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 100 * step + dist.get_rank()))
    model(batch).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def optimizer_state_unlike_the_parameter(seed: int, steps: int = 2) -> dict[str, Any]:
    """:class:`ColumnDecay` on minidp's shards and on FSDP2's, trained alike: the first difference between their
    ``optimizer.state_dict()`` (``alike``: None), the per-column state plain in both, the momentum FSDP2's DTensor."""
    torch.manual_seed(seed)
    theirs = Net()
    ours = shard(copy.deepcopy(theirs), md.fully_shard, True)
    shard(theirs, torch_fully_shard, True)
    pairs = [(model, ColumnDecay(model.parameters())) for model in (ours, theirs)]
    for step in range(steps):
        for model, optimizer in pairs:
            _train_step(model, optimizer, seed, step)
    ours_state, theirs_state = (optimizer.state_dict() for _, optimizer in pairs)
    return {"alike": state_difference(ours_state, theirs_state),
            "column_scale": [type(state["state"][2]["column_scale"]).__name__ for state in (ours_state, theirs_state)]}


def whole_optimizer_state_loaded_by_hand(seed: int) -> dict[str, Any]:
    """FSDP2's whole optimizer state dict (AdamW, two steps; matrices cut along their columns where the ranks divide
    them) loaded with ``optimizer.load_state_dict`` into minidp's optimizer, trained alike, which cuts this rank's
    rows out of each whole tensor; then every tensor of the loaded dict changed in place. ``owned``: the state
    tensors that are not a contiguous tensor holding its own bytes, as FSDP2's local state is (a view would keep the
    whole tensor alive, and be strided where cut along dim 1); ``resumed``: the first difference from FSDP2 after
    one more step of each (the change to the loaded dict must not reach the optimizer)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    arguments = sharding_arguments(placement=True)
    torch.manual_seed(seed)
    theirs = MODELS["wide"]()
    ours = shard(copy.deepcopy(theirs), md.fully_shard, True, **arguments)
    shard(theirs, torch_fully_shard, True, **arguments)
    pairs = [(model, OPTIMIZERS["adamw"](model.parameters())) for model in (ours, theirs)]
    for step in range(2):
        for model, optimizer in pairs:
            _train_step(model, optimizer, seed, step)
    whole = get_optimizer_state_dict(*pairs[1], options=StateDictOptions(full_state_dict=True))
    loaded = copy.deepcopy(whole)  # as read from a file, keyed by the parameters' names
    names = [name for name, _ in ours.named_parameters()]
    optimizer = pairs[0][1]
    optimizer.load_state_dict({"state": {names.index(name): state for name, state in loaded["state"].items()},
                               "param_groups": [{**group, "params": [names.index(n) for n in group["params"]]}
                                                for group in loaded["param_groups"]]})
    not_owned = [f"{name} {key}" for name, param in ours.named_parameters() for key in ("exp_avg", "exp_avg_sq")
                 if not (optimizer.state[param][key].is_contiguous() and optimizer.state[param][key].untyped_storage(
                 ).nbytes() == optimizer.state[param][key].numel() * optimizer.state[param][key].element_size())]
    for state in loaded["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].add_(1.0)
    for model, optimizer in pairs:
        _train_step(model, optimizer, seed, 2)
    return {"not_owned": not_owned, "resumed": first_difference(ours, theirs, tuple(o for _, o in pairs))}


def param_group_added_after_a_step(seed: int, steps: int = 2) -> dict[str, Any]:
    """An optimizer built on the ignored (unsharded) head only, stepped, then given every sharded parameter by
    ``add_param_group`` and stepped again, in minidp and in FSDP2: the first difference between their
    ``optimizer.state_dict()`` (``alike``: None; FSDP2's state of the added shards is DTensors) and after the
    steps (``differences``)."""
    torch.manual_seed(seed)
    theirs = Net()
    ours = shard(copy.deepcopy(theirs), md.fully_shard, True, ignored=("head.weight", "head.bias"))
    shard(theirs, torch_fully_shard, True, ignored=("head.weight", "head.bias"))
    pairs = [(model, OPTIMIZERS["adamw"](model.head.parameters())) for model in (ours, theirs)]
    differences = []
    for step in range(steps):
        if step == 1:
            for model, optimizer in pairs:
                optimizer.add_param_group({"params": [p for name, p in model.named_parameters()
                                                      if not name.startswith("head.")]})
        for model, optimizer in pairs:
            _train_step(model, optimizer, seed, step)
        differences.append(first_difference(ours, theirs, tuple(optimizer for _, optimizer in pairs)))
    return {"alike": state_difference(*(optimizer.state_dict() for _, optimizer in pairs)),
            "differences": differences}


def _functions_of(module: Any) -> list[Callable]:
    """The functions a module defines, at its top level and in its classes (the originals of wrapped ones)."""
    found = []
    for value in vars(module).values():
        members = vars(value).values() if isinstance(value, type) and value.__module__ == module.__name__ else [value]
        for member in members:
            member = inspect.unwrap(getattr(member, "__func__", member))
            if inspect.isfunction(member) and member.__module__ == module.__name__:
                found.append(member)
    return found


def compiled_as_eager(seed: int, steps: int = 4) -> dict[str, Any]:
    """A sharded model under ``torch.compile``, trained beside the same model run eagerly: the largest difference of
    their losses, and the functions of ``minidp/distributed/fully_shard.py`` that dynamo compiled (it holds compiled
    code for them): none, as FSDP2 keeps its hooks out of dynamo's graphs; traced, their bookkeeping would be
    guarded on and compiled again and again."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    torch.manual_seed(seed)
    eager = shard(Net(), md.fully_shard, True)
    twin = Net()  # (a sharded model cannot be deep-copied: its twin is built with the same weights)
    twin.load_state_dict(md.full_state_dict(eager))
    compiled = torch.compile(shard(twin, md.fully_shard, True))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.05) for model in (eager, compiled)]
    differences = []
    for step in range(steps):
        batch = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 100 * step + dist.get_rank()))
        losses = []
        for model, optimizer in zip((eager, compiled), optimizers):
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        differences.append((losses[0] - losses[1]).abs().item())
    traced = sorted(function.__qualname__ for function in _functions_of(sys.modules["minidp.distributed.fully_shard"])
                    if _debug_get_cache_entry_list(function.__code__))
    torch._dynamo.reset()
    return {"largest_loss_difference": max(differences), "traced": traced}


def compiled_graphs_as_fsdp2(seed: int, steps: int = 3) -> dict[str, int]:
    """The graphs dynamo compiles for a sharded model trained ``steps`` steps under ``torch.compile``, by library."""
    from torch._dynamo.utils import counters

    graphs = {}
    for library, function in (("fsdp2", torch_fully_shard), ("minidp", md.fully_shard)):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(seed)
        model = torch.compile(shard(Net(), function, True))
        for step in range(steps):
            batch = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 100 * step + dist.get_rank()))
            model(batch).sum().backward()
        graphs[library] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs


def forward_method(seed: int) -> dict:
    """``score``, a method other than forward, registered with each library's ``register_fsdp_forward_method``:
    three steps trained through it, the first difference from FSDP2 after each; what it returns without
    the registration (minidp), and what registering a missing method raises."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    theirs = Net()
    ours = shard(copy.deepcopy(theirs), md.fully_shard, True)
    shard(theirs, torch_fully_shard, True)
    x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + rank))
    try:
        ours.score(x)
        unregistered = "ran"
    except RuntimeError as error:
        unregistered = f"{type(error).__name__}"
    register_fsdp_forward_method(theirs, "score")
    md.register_fsdp_forward_method(ours, "score")
    optimizers = (OPTIMIZERS["sgd"](ours.parameters()), OPTIMIZERS["sgd"](theirs.parameters()))
    differences = []
    for step in range(3):
        for opt in optimizers:
            opt.zero_grad()
        x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 10 * step + rank))
        for sharded in (ours, theirs):
            sharded.score(x).pow(2).mean().backward()
        for opt in optimizers:
            opt.step()
        differences.append(first_difference(ours, theirs, optimizers))
    try:
        md.register_fsdp_forward_method(ours, "generate")
        missing = "no error"
    except ValueError as error:
        missing = str(error)
    md.register_fsdp_forward_method(Net(), "score")  # a module not sharded: nothing happens, as in FSDP2
    return {"differences": differences, "unregistered": unregistered, "missing": missing}


class Generates(Net):
    """``generate`` calls ``forward`` (as Hugging Face's does, token after token)."""

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self(torch.cat([x[:, :11], self(x)], dim=1))


def forward_method_calling_forward(seed: int, before_the_optimizer: bool) -> dict:
    """``generate``, registered with each library's ``register_fsdp_forward_method``, run under ``no_grad`` between the
    backward and the optimizer's step (samples logged), with FSDP2's default ``reshard_after_forward``; or once before
    the optimizer is built (a check that the model generates). Three steps, the first difference from FSDP2 after each,
    and the shapes ``named_parameters()`` gives after ``generate`` (the root's: its shards, or its whole parameters)."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    theirs = Generates()
    ours = shard(copy.deepcopy(theirs), md.fully_shard, None)
    shard(theirs, torch_fully_shard, None)
    register_fsdp_forward_method(theirs, "generate")
    md.register_fsdp_forward_method(ours, "generate")
    sample = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + rank))
    if before_the_optimizer:
        with torch.no_grad():
            for sharded in (ours, theirs):
                sharded.generate(sample)
    optimizers = (OPTIMIZERS["sgd"](ours.parameters()), OPTIMIZERS["sgd"](theirs.parameters()))
    differences, shapes = [], []
    for step in range(3):
        x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 10 * step + rank))
        for sharded in (ours, theirs):
            sharded(x).pow(2).mean().backward()
            if not before_the_optimizer:
                with torch.no_grad():
                    sharded.generate(sample)
        shapes.append([tuple(local(p).shape) for p in theirs.parameters()] == [tuple(p.shape) for p in ours.parameters()])
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        differences.append(first_difference(ours, theirs, optimizers))
    return {"differences": differences, "shards_after_generate": shapes}


class _ReturnsAView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).view(-1, 2, 4)[:, 0]


def view_output_warnings(seed: int) -> dict:
    """What each library warns of when a sharded module returns a view (which an in-place op would detach from the
    hook that gathers its parameters for the backward)."""
    warned = {}
    for name, function in (("fsdp2", torch_fully_shard), ("minidp", md.fully_shard)):
        torch.manual_seed(seed)
        model = function(_ReturnsAView())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(torch.randn(3, 8)).sum().backward()
        warned[name] = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
    return warned


class _SeesItsInputs(nn.Module):
    """Notes what its forward is given (each value's type and, for tensors, dtype; inside a container, its items'),
    and returns the container it got with every floating-point tensor through its linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[Any] = []

    def forward(self, batch: Any) -> Any:
        self.seen.append(_described(batch))
        if isinstance(batch, nn.utils.rnn.PackedSequence):
            return batch._replace(data=self.linear(batch.data.to(self.linear.weight.dtype)))
        if isinstance(batch, (set, frozenset)):
            return {self.linear(t.to(self.linear.weight.dtype)) for t in batch}
        return type(batch)({key: self.linear(t.to(self.linear.weight.dtype)) for key, t in batch.items()})


def _described(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    if isinstance(value, (set, frozenset)):
        items = sorted(_described(t) for t in value)
    elif hasattr(value, "items"):
        items = [(key, _described(t)) for key, t in value.items()]
    else:
        items = [_described(t) for t in value]
    return type(value).__name__, items


def _containers(seed: int) -> dict[str, Any]:
    """One batch in each container whose walk differs between libraries (FSDP2 walks with ``_apply_to_tensors``)."""
    rows = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    return {
        "dict": {"x": rows},
        "defaultdict": collections.defaultdict(list, {"x": rows}),
        "OrderedDict": collections.OrderedDict(x=rows),
        "UserDict": collections.UserDict(x=rows),
        "set": {rows},
        "PackedSequence": nn.utils.rnn.pack_sequence([rows, rows[:2]]),
    }


def casts_containers_as_fsdp2(seed: int) -> dict[str, dict[str, Any]]:
    """A module sharded with ``param_dtype=bfloat16`` and ``output_dtype=float64``, given one batch in each container
    of :func:`_containers`: per container and library, what its forward saw and what the caller got back (types and
    dtypes), or the error."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float64)
    seen: dict[str, dict[str, Any]] = {}
    for container, batch in _containers(seed).items():
        seen[container] = {}
        for name, function in (("fsdp2", torch_fully_shard), ("minidp", md.fully_shard)):
            torch.manual_seed(seed)
            model = function(_SeesItsInputs(), mp_policy=policy)
            try:
                with torch.no_grad():
                    output = model(batch)
                seen[container][name] = {"forward saw": model.seen, "returned": _described(output)}
            except Exception as error:  # noqa: BLE001 - both libraries' errors are compared
                seen[container][name] = f"{type(error).__name__}: {error}"
    return seen


# FSDPModule.reset_iter_state and set_reduce_scatter_unused_params are newer than torch 2.11.
FSDP2_RESETS = hasattr(FSDPModule, "reset_iter_state")
FSDP2_REDUCES_UNUSED = hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def _sharded_pair(theirs: nn.Module, optimizer: str, **sharding: Any) -> tuple[nn.Module, nn.Module, tuple]:
    """``theirs`` sharded by FSDP2 beside a copy sharded by minidp, each by :func:`shard` (``reshard_after_forward``
    True, ``sharding`` its other arguments): ``(ours, theirs, (our optimizer, theirs))``, :data:`OPTIMIZERS`
    ``optimizer`` over each model's parameters."""
    ours = copy.deepcopy(theirs)
    shard(theirs, torch_fully_shard, True, **sharding)
    shard(ours, md.fully_shard, True, **sharding)
    return ours, theirs, (OPTIMIZERS[optimizer](ours.parameters()), OPTIMIZERS[optimizer](theirs.parameters()))


def recovers_from_a_failure(seed: int, where: str) -> dict:
    """Train minidp and FSDP2 side by side; in step 1 both raise midway (``where``: in block 1's forward, or in its
    backward, after the root and block 2 have reduced theirs), each is reset with ``reset_iter_state`` on its root,
    and training goes on: the first difference after every later step."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    ours, theirs, optimizers = _sharded_pair(Net(), "adamw")
    failing = {"step": 1}

    def planted(*_: Any) -> None:
        if failing["step"] == step:
            raise RuntimeError("planted")

    def plant_in_backward(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.register_hook(planted)

    for sharded in (ours, theirs):
        if where == "forward":
            sharded.blocks[1].register_forward_pre_hook(planted)
        else:
            sharded.blocks[1].register_forward_hook(plant_in_backward)
    differences, raised = [], []
    for step in range(4):
        for opt in optimizers:
            opt.zero_grad()
        x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + step + 10 * rank))
        for sharded in (ours, theirs):
            try:
                sharded(x).pow(2).mean().backward()
            except RuntimeError as error:
                raised.append(str(error))
                sharded.reset_iter_state()
        if step != failing["step"]:
            for opt in optimizers:
                opt.step()
            differences.append(first_difference(ours, theirs, optimizers))
    return {"differences": differences, "raised": raised}


def grouped_forward_failure(seed: int) -> dict:
    """:class:`Net` with ``norm`` and ``head`` sharded together (``fully_shard([norm, head])``), by each library;
    step 1's forward raises in ``head``, and training goes on without ``reset_iter_state``: per library, the shapes of
    this rank's ``norm.weight`` and ``head.weight`` right after the failure (gathered or this rank's rows), and the
    first difference between the two after every later step."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    ours, theirs, optimizers = _sharded_pair(Net(), "adamw", grouped=("norm", "head"))
    failing = {"now": False}

    def planted(*_: Any) -> None:
        if failing["now"]:
            raise RuntimeError("planted")

    for sharded in (ours, theirs):
        sharded.head.register_forward_pre_hook(planted)
    after_failure, differences = {}, []
    for step in range(4):
        x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + step + 10 * rank))
        if step == 1:
            failing["now"] = True
            for name, sharded in (("minidp", ours), ("fsdp2", theirs)):
                with contextlib.suppress(RuntimeError):
                    sharded(x)
                after_failure[name] = [tuple(local(sharded.norm.weight).shape), tuple(local(sharded.head.weight).shape)]
            failing["now"] = False
        for opt, sharded in zip(optimizers, (ours, theirs)):
            opt.zero_grad()
            sharded(x).pow(2).mean().backward()
            opt.step()
        differences.append(first_difference(ours, theirs, optimizers))
    return {"after_failure": after_failure, "differences": differences}


def handles(seed: int) -> dict:
    """What ``unshard(async_op=True)`` returns, in minidp and in FSDP2, and what setting a prefetch to a module
    neither sharded raises."""
    torch.manual_seed(seed)
    results = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        model = shard(Net(), function, True)
        handle = model.blocks[0].unshard(async_op=True)
        handle.wait()
        handle.wait()  # a second wait does nothing
        whole = tuple(local(model.blocks[0].linear.weight).shape)
        try:
            model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])
            refused = "no error"
        except ValueError as error:
            refused = str(error)
        try:
            model.set_reshard_after_forward(1)
            not_bool = "no error"
        except ValueError as error:
            not_bool = str(error)
        results[name] = {"is_handle": isinstance(handle, UnshardHandle), "whole": whole, "refused": refused,
                         "not_bool": not_bool}
    return results


def collectives_with(seed: int, configure: Optional[str], model: str = "net",
                     reshard_after_forward: Optional[bool] = True, micro_batches: int = 1) -> dict:
    """Two steps of minidp's sharded model under ``configure``: the timeline of each micro-batch of the second."""
    torch.manual_seed(seed)
    sharded = shard(MODELS[model](), md.fully_shard, reshard_after_forward)
    timelines = []
    for step in range(2):
        for micro in range(micro_batches):
            if configure is not None:
                CONFIGURATIONS[configure](sharded, micro, micro_batches)
            sharded(torch.randn(4, 13)).sum().backward()
            timelines.append(md.sharded_timeline(sharded))
    return {"timelines": timelines[micro_batches:]}


def premultiplied(seed: int) -> dict:
    """float32 with a divide factor other than the world size, where FSDP2 reduces with ``PREMUL_SUM(1 / 3)``:
    minidp's gradient shards against each rank's whole gradient times 1 / 3, summed over the ranks in float32 (a
    reference computed here); and what FSDP2 does with that op on Gloo."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    plain = Net()
    ours = shard(copy.deepcopy(plain), md.fully_shard, True)
    _divide_by_three(ours, 0, 1)
    x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + rank))
    ours(x).pow(2).mean().backward()
    plain(x).pow(2).mean().backward()
    equal = True
    for (name, shard_param), whole in zip(ours.named_parameters(), plain.parameters()):
        every = [torch.empty_like(whole.grad) for _ in range(world)]
        dist.all_gather(every, whole.grad)
        expected = every[0] * (1 / 3.0)
        for grad in every[1:]:
            expected = expected + grad * (1 / 3.0)
        rows = torch.chunk(expected, world)[rank] if rank < len(torch.chunk(expected, world)) else expected[:0]
        equal = equal and torch.equal(shard_param.grad, rows)
    torch.manual_seed(seed)
    theirs = shard(Net(), torch_fully_shard, True)
    _divide_by_three(theirs, 0, 1)
    try:
        theirs(x).pow(2).mean().backward()
        fsdp2 = "ran"
    except (RuntimeError, ValueError) as error:
        fsdp2 = f"{type(error).__name__}: {error}".splitlines()[0]
    return {"equal": equal, "fsdp2": fsdp2}


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
            # the shards' .grad are views of the reduce-scatter's output: every rank holds chunk 0's rows of each
            "shard_bytes": sum(-(-p.size(0) // dist.get_world_size()) * p[0].numel() * p.element_size()
                               for p in Net().parameters())}


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


def as_fsdp_modules(seed: int) -> dict:
    """What ``isinstance(..., FSDPModule)`` says of a sharded model and its blocks, and what a slice of a sharded
    ``nn.Sequential`` is, in each library; and what minidp raises for one of FSDPModule's methods it does not run."""
    results: dict[str, Any] = {}
    models = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        torch.manual_seed(seed)
        model = models[name] = shard(Net(), function, True)
        sequential = nn.Sequential(Block(13, 29), Block(29, 7))
        function(sequential[0])
        function(sequential)
        sliced = sequential[1:]  # nn.Sequential.__getitem__: type(self)(...) of the chosen modules
        results[name] = {"root": isinstance(model, FSDPModule),
                         "blocks": all(isinstance(block, FSDPModule) for block in model.blocks),
                         "slice": (type(sliced).__name__, isinstance(sliced, FSDPModule), sliced[0] is sequential[1])}
    try:
        models["minidp"].blocks[0].set_custom_all_gather(None)
        results["refused"] = "nothing raised"
    except NotImplementedError as error:
        results["refused"] = str(error)
    return results


def comm_buffers_beyond_the_defaults(seed: int) -> dict:
    """``set_reduce_scatter_max_input_buffers`` and ``set_allocate_memory_from_process_group_for_comm`` given values
    other than FSDP2's defaults, on a module sharded by each library: per library and call, what it raised."""
    calls = {"max_input_buffers=2": lambda m: m.set_reduce_scatter_max_input_buffers(2),
             "max_input_buffers=True": lambda m: m.set_reduce_scatter_max_input_buffers(True),
             "max_input_buffers=0": lambda m: m.set_reduce_scatter_max_input_buffers(0),
             "allocate=True": lambda m: m.set_allocate_memory_from_process_group_for_comm(True)}
    results = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        model = shard(Net(), function, True)
        results[name] = {call: error_of(lambda: set_it(model)) for call, set_it in calls.items()}
    return results


def dtensor_parameters(seed: int) -> dict:
    """fully_shard on a model whose parameters are already DTensors: a block made tensor-parallel
    (``parallelize_module(..., ColwiseParallel())`` over the ``tp`` dimension of a (1, 2) mesh, then sharded over its
    ``dp`` dimension: FSDP2's 2-D recipe), and a head given ``Replicate`` DTensor parameters on a 1-D mesh. Per case
    and library: the error (type, message), and whether the model was left as it was (its class, the very
    parameters)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    def tensor_parallel(model: nn.Module) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model.blocks[0], mesh["tp"], {"linear": ColwiseParallel()})
        return {"mesh": mesh["dp"]}

    def replicated(model: nn.Module) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (2,))
        for name, param in list(model.head.named_parameters()):
            setattr(model.head, name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()])))
        return {}

    results: dict[str, Any] = {}
    for case, prepare in (("tensor_parallel", tensor_parallel), ("replicated", replicated)):
        for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
            torch.manual_seed(seed)
            model = Net()
            arguments = prepare(model)
            before = list(model.parameters())
            error = error_of(lambda: function(model, **arguments))
            untouched = type(model) is Net and all(a is b for a, b in itertools.zip_longest(before, model.parameters()))
            results[f"{case}-{name}"] = {"error": error, "untouched": untouched}
    return results


def state_dict_kept_vars(seed: int) -> dict:
    """``state_dict(keep_vars=True)`` of a :class:`Net` with a frozen norm and a buffer, sharded by each library: per
    library, each key's (class name, whether an ``nn.Parameter``, ``requires_grad``, placements), whether the buffer's
    entry is the registered buffer itself, and whether each parameter's entry is the registered parameter itself."""
    results = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        torch.manual_seed(seed)
        model = Net()
        model.norm.requires_grad_(False)
        model.register_buffer("scale", torch.ones(3))
        shard(model, function, True)
        kept = model.state_dict(keep_vars=True)
        registered = dict(model.named_parameters())
        results[name] = {
            "entries": {key: (type(value).__name__, isinstance(value, nn.Parameter), value.requires_grad,
                              str(getattr(value, "placements", None))) for key, value in kept.items()},
            "buffer_itself": kept["scale"] is model.scale,
            "parameters_themselves": all(kept[key] is param for key, param in registered.items()),
        }
    return results


def sparse_embedding(seed: int) -> dict:
    """An :class:`Embedded` whose embedding has ``sparse=True``, sharded by the root's call: minidp's error at the call
    and whether the model was left as it was; FSDP2's outcome at the call and at the first backward; ``frozen``: that
    embedding frozen, what a forward and backward of the model sharded by each library raise."""
    def build(requires_grad: bool = True) -> nn.Module:
        torch.manual_seed(seed)
        model = Embedded()
        model.embed = nn.Embedding(17, 13, sparse=True).requires_grad_(requires_grad)
        return model

    ours = build()
    before = list(ours.parameters())
    results: dict[str, Any] = {"minidp": error_of(lambda: md.fully_shard(ours))}
    results["untouched"] = type(ours) is Embedded and all(
        a is b for a, b in itertools.zip_longest(before, ours.parameters()))
    theirs = build()
    results["fsdp2_call"] = error_of(lambda: torch_fully_shard(theirs))
    kind, message = error_of(lambda: theirs(torch.randn(4, 13)).sum().backward())
    results["fsdp2_backward"] = (kind, message.splitlines()[0] if message else message)  # (then the dispatcher's list)
    results["frozen"] = {
        name: error_of(lambda: function(build(requires_grad=False))(torch.randn(4, 13)).sum().backward())
        for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard))}
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
    errors = {name: error_of(lambda: md.fully_shard(wrap(Net())))
              for name, wrap in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard), ("ddp", md.DistributedDataParallel))}
    errors["fsdp2_twice"] = error_of(lambda: torch_fully_shard(torch_fully_shard(Net())))  # torch's contract()
    return errors


def containers_without_forward(seed: int) -> dict:
    """fully_shard on a plain ModuleList and a plain ModuleDict (containers whose forward is nn.Module's), by minidp
    and by FSDP2: the errors, per container."""
    containers = {"ModuleList": lambda: nn.ModuleList([Block(13, 13)]),
                  "ModuleDict": lambda: nn.ModuleDict({"block": Block(13, 13)})}
    return {kind: {name: error_of(lambda: function(make())) for name, function in (("minidp", md.fully_shard),
                                                                                    ("fsdp2", torch_fully_shard))}
            for kind, make in containers.items()}


def states(seed: int) -> dict:
    """``fully_shard.state`` of each module of a Net whose blocks, ``[norm, head]`` (one call) and root were sharded,
    by minidp and by FSDP2: per library, which modules have a state (None: none), numbered by first appearance, so
    that modules sharing one state share a number."""
    results = {}
    for name, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        model = shard(Net(), function, True, grouped=("norm", "head"))
        numbers: dict[int, int] = {}
        results[name] = {}
        for module_name, module in model.named_modules():
            found = function.state(module)
            results[name][module_name] = None if found is None else numbers.setdefault(id(found), len(numbers))
    return results


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


def gradients_of_two_dtypes(seed: int) -> dict[str, Any]:
    """A float64 ``gain`` (:class:`Gained`) that gets gradients beside float32 parameters of one call, in minidp and
    in FSDP2, both of which take the call: per library, what the first forward raises (``forward``), and what the
    backward raises where the gain, frozen for the first step, is unfrozen for the second (``backward``);
    ``recovered``: whether minidp's refused model, its gain then frozen, runs its forward and backward (its refusal
    left nothing half done; FSDP2's, once refused, cannot initialise again)."""
    x = torch.randn(5, 13)

    def sharded(function: Callable[..., Any], requires_grad: bool) -> nn.Module:
        torch.manual_seed(seed)
        model = Gained()
        model.gain = nn.Parameter(model.gain.detach().double(), requires_grad=requires_grad)
        return shard(model, function, True)

    result: dict[str, Any] = {}
    for library, function in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        refused = sharded(function, True)
        result[library] = {"forward": error_of(lambda: refused(x))}
        thawed = sharded(function, False)
        thawed(x).sum().backward()
        thawed.gain.requires_grad_(True)
        result[library]["backward"] = error_of(lambda: thawed(x).sum().backward())
        if function is md.fully_shard:
            refused.gain.requires_grad_(False)
            refused(x).sum().backward()
            result["recovered"] = refused.norm.weight.grad is not None
    return result


def optimizer_in_backward(seed: int, steps: int = 3) -> dict[str, Any]:
    """The optimizer step inside the backward (PyTorch's tutorial "How to save memory by fusing the optimizer step into
    the backward pass"): a post-accumulate-grad hook on each shard steps its own optimizer and drops the gradient.
    FSDP2 runs those hooks once a shard's gradient is reduced; after each step, the first parameter that differs from
    FSDP2's (None: none), and how often minidp ran the hooks."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    theirs = Net()
    ours = copy.deepcopy(theirs)
    calls = [0]
    for model, function in ((ours, md.fully_shard), (theirs, torch_fully_shard)):
        shard(model, function, True)
        optimizers = {p: torch.optim.SGD([p], lr=0.05, momentum=0.9) for p in model.parameters()}

        def step(param: nn.Parameter, optimizers: dict = optimizers, counted: bool = model is ours) -> None:
            optimizers[param].step()
            optimizers[param].zero_grad()
            calls[0] += counted

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
    differences = []
    for step_index in range(steps):
        x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 100 * step_index + rank))
        for model in (ours, theirs):
            model(x).pow(2).mean().backward()
        differences.append(next((name for (name, a), b in zip(ours.named_parameters(), theirs.parameters())
                                 if not torch.equal(a, local(b))), None))
    return {"differences": differences, "calls": calls[0], "parameters": len(list(ours.parameters())),
            "gradients_left": sum(p.grad is not None for p in ours.parameters())}


def _backward_alike(ours: nn.Module, theirs: nn.Module, optimizers: tuple, seed: int, step: int) -> None:
    """Both models' gradients, fresh, for this rank's batch of ``step``."""
    x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 100 * step + dist.get_rank()))
    for model, optimizer in zip((ours, theirs), optimizers):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()


def frozen_and_unfrozen_midway_as_fsdp2(seed: int, steps: int = 4) -> list[Optional[str]]:
    """Train FSDP2 and minidp side by side; after the first step freeze a sharded block's weight, and unfreeze one
    frozen from the start (fine-tuning that thaws layers as it goes): per step, the first difference from FSDP2."""
    torch.manual_seed(seed)
    net = Net()
    net.blocks[2].linear.weight.requires_grad_(False)
    ours, theirs, optimizers = _sharded_pair(net, "sgd")
    differences = []
    for step in range(steps):
        if step == 1:
            for model in (ours, theirs):
                model.blocks[0].linear.weight.requires_grad_(False)
                model.blocks[2].linear.weight.requires_grad_(True)
        _backward_alike(ours, theirs, optimizers, seed, step)
        differences.append(first_difference(ours, theirs, optimizers))
        for optimizer in optimizers:
            optimizer.step()
    return differences


def clips_as_fsdp2(seed: int, norm_type: float, dtype: torch.dtype = torch.float64,
                   mesh: Optional[tuple[int, ...]] = None, steps: int = 3, model: str = "net") -> dict[str, Any]:
    """Gradient clipping beside FSDP2: ``md.clip_grad_norm_`` on minidp's shards, torch's ``clip_grad_norm_`` on
    FSDP2's DTensors, to a max norm every step's gradients exceed. Each step: the two total norms, the largest
    difference of the clipped gradients (this rank's rows) and, after the step, of the parameters. ``model``: a
    name in :data:`MODELS`, cast to ``dtype`` unless it is ``two_dtypes``, which keeps its own."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    ours, theirs, optimizers = _sharded_pair(MODELS[model]() if model == "two_dtypes" else MODELS[model]().to(dtype),
                                             "adamw", **sharding_arguments(mesh))
    steps_seen = []
    for step in range(steps):
        x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + 100 * step + rank), dtype=dtype)
        for model in (ours, theirs):
            (100 * model(x)).pow(2).mean().backward()  # gradients far above the max norm
        ours_norm = md.clip_grad_norm_(ours.parameters(), 0.5, norm_type)
        theirs_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type).full_tensor()
        gradients = _largest_difference([p.grad for p in ours.parameters()], [p.grad for p in theirs.parameters()])
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        parameters = _largest_difference(list(ours.parameters()), list(theirs.parameters()))
        steps_seen.append({"ours": ours_norm.item(), "theirs": theirs_norm.item(), "gradients": gradients,
                           "parameters": parameters})
    return {"steps": steps_seen}


def clipping_whole_beside_sharded(seed: int) -> dict[str, Any]:
    """``ignored_params`` left whole beside sharded ones, one backward, then each library's clipping of all the
    parameters: what it raised, and whether minidp's left every gradient as it was."""
    raised: dict[str, Any] = {}
    for library, wrap, clip in (("minidp", md.fully_shard, md.clip_grad_norm_),
                                ("fsdp2", torch_fully_shard, torch.nn.utils.clip_grad_norm_)):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 17), nn.Tanh(), nn.Linear(17, 3))
        wrap(model, ignored_params={model[2].weight, model[2].bias})
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
        (100 * model(x)).pow(2).mean().backward()
        before = [p.grad.clone() for p in model.parameters()]
        try:
            clip(model.parameters(), 0.05)
            raised[library] = "nothing"
        except (ValueError, RuntimeError) as error:
            raised[library] = str(error)
        if library == "minidp":
            raised["untouched"] = all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    return raised


def used_outside_forward(seed: int) -> dict[str, str]:
    """A sharded weight used outside its module's forward, after the forward resharded it (an L2 penalty added to the
    loss), by FSDP2 and by minidp: what each backward raised."""
    torch.manual_seed(seed)
    theirs = Net()
    ours = copy.deepcopy(theirs)
    raised = {}
    for library, model in (("fsdp2", shard(theirs, torch_fully_shard, True)),
                           ("minidp", shard(ours, md.fully_shard, True))):
        x = torch.randn(5, 13, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
        try:
            (model(x).pow(2).mean() + 0.1 * model.blocks[0].linear.weight.pow(2).sum()).backward()
            raised[library] = "nothing"
        except RuntimeError as error:
            raised[library] = str(error)
    return raised


class _TwoEntries(nn.Module):
    """An encoder with a second entry point beside ``forward`` (CLIP's ``get_text_features``, an ``encode``), whose
    embedding is in the root's group: rank 0 holds rows 0 to 3 of 8, rank 1 rows 4 to 7."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(8, 4)
        self.block = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.embedding(ids)).sum(-1)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.embedding(ids)).mean(1)


def method_other_than_forward(seed: int) -> dict[str, str]:
    """``encode`` of a sharded root, not given to ``register_fsdp_forward_method``, under ``no_grad``, by FSDP2 and by
    minidp: what each raised ("nothing": the encoding matched the unsharded model's; "wrong": it did not)."""
    torch.manual_seed(seed)
    reference = _TwoEntries()
    ids = torch.tensor([[0, 1, 2, 3]])
    raised = {}
    for library, function in (("fsdp2", torch_fully_shard), ("minidp", md.fully_shard)):
        model = copy.deepcopy(reference)
        function(model.block)
        function(model)
        try:
            with torch.no_grad():
                raised[library] = "nothing" if torch.equal(model.encode(ids), reference.encode(ids)) else "wrong"
        except RuntimeError as error:
            raised[library] = str(error)
    return raised


def loss_scalers_seeing_an_inf(seed: int) -> dict[str, bool]:
    """An inf put into rank 1's rows of a sharded gradient, then each loss scaler's check (``unscale_``): whether the
    scaler on this rank found an inf, for torch's plain ``GradScaler`` and its ``ShardedGradScaler``."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    found = {}
    for name, scaler in (("plain", torch.amp.GradScaler("cpu", init_scale=2.0)),
                         ("sharded", ShardedGradScaler("cpu", init_scale=2.0))):
        torch.manual_seed(seed)
        model = md.fully_shard(Net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.randn(4, 13)).sum()).backward()
        if dist.get_rank() == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.unscale_(optimizer)
        flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        found[name] = any(bool(flag) for flag in flags)
    return found


def _largest_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """The largest absolute difference between this rank's elements of ``ours`` and of ``theirs`` (0 where empty)."""
    return max((float((a.detach() - local(b).detach()).abs().amax()) if a.numel() else 0.0)
               for a, b in zip(ours, theirs))


def divide_factor_by_its_old_name(seed: int) -> dict[str, Any]:
    """``set_reduce_scatter_divide_factor``, FSDP2's deprecated name: the warning, and the factor it set; then
    ``set_all_reduce_hook`` with a stream: the error."""
    model = md.fully_shard(Net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(3.0)
    try:
        model.set_all_reduce_hook(_halve, stream=object())
        stream_error = "no error"
    except NotImplementedError as error:
        stream_error = str(error)
    return {"warnings": [(w.category.__name__, str(w.message)) for w in caught],
            "factor": sharded_groups(model)[0].gradient_divide_factor, "stream_error": stream_error}


def refusals(seed: int) -> dict[str, Any]:
    """Arguments of FSDP2's that minidp refuses, each given to fully_shard on a fresh model: the error's type and
    message, and whether the model was left as it was (no shard on it, its class its own)."""
    cases: dict[str, Callable[[nn.Module], Any]] = {
        "uneven_columns": lambda model: md.fully_shard(  # the first block's weight has 13 columns
            model, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None),
        "a_dimension_too_far": lambda model: md.fully_shard(model, shard_placement_fn=lambda p: Shard(2)),
        "not_a_shard": lambda model: md.fully_shard(model, shard_placement_fn=lambda p: "Replicate()"),
        "three_dimensions": lambda model: md.fully_shard(model, mesh=init_device_mesh("cpu", (1, 1, 2))),
        "mesh_and_group": lambda model: md.fully_shard(model, mesh=init_device_mesh("cpu", (2,)),
                                                       process_group=dist.group.WORLD),
        "hsdp_without_names": lambda model: md.fully_shard(model, mesh=init_device_mesh("cpu", (1, 2))),
        "pinned_offload": lambda model: md.fully_shard(model, offload_policy=CPUOffloadPolicy()),
        "non_contiguous": lambda model: md.fully_shard(_transposed_head(model)),
        "mp_policy_none": lambda model: md.fully_shard(model, mp_policy=None),
        "mp_policy_dtype_a_string": lambda model: md.fully_shard(
            model, mp_policy=MixedPrecisionPolicy(param_dtype="bfloat16")),
        "dp_mesh_dims": lambda model: md.fully_shard(model, dp_mesh_dims=("dp",)),
    }
    results = {}
    for name, call in cases.items():
        model = Net()
        before = [p.shape for p in model.parameters()]
        try:
            call(model)
            results[name] = {"error": "no error"}
        except Exception as error:  # noqa: BLE001 - the type is part of what is compared
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        results[name]["untouched"] = (type(model) is Net and [p.shape for p in model.parameters()] == before)
    return results


def _transposed_head(model: nn.Module) -> nn.Module:
    """``model`` with its head's weight laid out transposed: a parameter that is not contiguous."""
    model.head.weight = nn.Parameter(model.head.weight.detach().t().contiguous().t())
    return model


def on_the_meta_device(seed: int) -> dict[str, Any]:
    """A :class:`Net` built on the meta device, sharded there over a CPU mesh (where it will be materialised): the
    error of that, and of a forward before ``to_empty`` (FSDP2 refuses it, naming the first group's parameters by
    their names under the root)."""
    with torch.device("meta"):
        model = Net()
    sharded = error_of(lambda: shard(model, md.fully_shard, True, mesh=init_device_mesh("cpu", (dist.get_world_size(),))))
    return {"sharded": sharded, "forward": error_of(lambda: model(torch.randn(2, 13)))}


def loaded_with_assign(seed: int) -> dict[str, Any]:
    """A :class:`Tied` model built on the meta device and sharded there, given rank 0's whole weights as DTensors laid
    out as its state dict's (``distribute_tensor``), loaded with ``load_state_dict(assign=True)`` (FSDP2's way from a
    rank-0 checkpoint): the load's error; whether every registered parameter is at once its group's shard, and the
    tied weight one parameter again (its two keys assign two); whether each holds this rank's rows of the whole. The
    first error, of sharding or loading, alone if there is one."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(seed)
    full = Tied().state_dict()
    for value in full.values():
        dist.broadcast(value, src=0)
    with torch.device("meta"):
        model = Tied()
    error = error_of(lambda: md.fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),))))
    if error == ("no error", ""):
        loaded = {key: nn.Parameter(distribute_tensor(full[key], value.device_mesh, value.placements))
                  for key, value in model.state_dict().items()}
        error = error_of(lambda: model.load_state_dict(loaded, assign=True))
    if error != ("no error", ""):
        return {"error": error}
    shards = {id(p.shard) for group in sharded_groups(model) for p in group.params}
    rows = [torch.equal(param.detach(), torch.chunk(full[name], dist.get_world_size())[dist.get_rank()])
            for name, param in model.named_parameters()]
    return {"error": error, "shards": all(id(param) in shards for param in model.parameters()),
            "tied": model.outer.weight is model.inner.weight, "rows": rows}


def loaded_with_wrong_shapes(seed: int) -> dict[str, dict[str, Any]]:
    """A two-layer model, each layer and the root sharded by each library, given a state dict whose first layer fits
    and whose second layer's weight is another size: a plain tensor the size of one rank's rows (another model's whole
    weight), and a DTensor of another model sharded alike. For each library and case: the error, and whether the first
    layer's shard changed (torch's load_state_dict loads what fits, then raises)."""
    results: dict[str, dict[str, Any]] = {}
    for library, shard_with in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard)):
        def sharded(width: int) -> nn.Module:
            model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, width))
            for layer in model:
                shard_with(layer)
            return shard_with(model)

        torch.manual_seed(seed)
        rows_of_another = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 4)).state_dict()  # 4 rows: rank r's of 8
        torch.manual_seed(seed + 1)
        cases = {"plain rows": rows_of_another, "dtensor": sharded(7).state_dict()}
        for case, state in cases.items():
            torch.manual_seed(seed + 2)
            model = sharded(8)
            before = local(model[0].weight).clone()
            try:
                model.load_state_dict(state)
                error = "no error"
            except RuntimeError as raised:
                error = str(raised)
            results[f"{library} {case}"] = {"error": error,
                                            "first_changed": not torch.equal(local(model[0].weight), before)}
    return results


class _SharedBlock(nn.Module):
    """One block at three paths (ALBERT's layers): ``state_dict()`` holds it under each, ``layers.0.*`` to
    ``layers.2.*``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(13, 13)] * 3)
        self.head = nn.Linear(13, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _laid_out(layout: str, shard_with: Callable[..., Any], seed: int) -> nn.Module:
    """A model sharded by ``shard_with`` (sub-modules first) in one of the layouts whose state-dict keys are not the
    modules' paths: ``"blocks_wrapped"``, a :class:`Net` whose blocks torch's ``apply_activation_checkpointing``
    wrapped (their keys leave out the wrapper's ``_checkpoint_wrapped_module.``); ``"root_wrapped"``, a :class:`Net`
    in torch's ``checkpoint_wrapper``, sharded whole; ``"nested_wrapped"``, the wrapped blocks of the first (each
    sharded) inside the wrapper of the second; ``"shared_block"``, :class:`_SharedBlock`."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper,
    )

    torch.manual_seed(seed)
    if layout == "shared_block":
        model = _SharedBlock()
        shard_with(model.layers[0])
        return shard_with(model)
    model = Net()
    if layout == "root_wrapped":
        return shard_with(checkpoint_wrapper(model))
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    if layout == "nested_wrapped":
        for block in model.blocks:
            shard_with(block)
        return shard_with(checkpoint_wrapper(model))
    return shard(model, shard_with, True)


def state_dicts_of_layouts(seed: int, layout: str, misshapen: str) -> dict[str, Any]:
    """The model of :func:`_laid_out` ``layout``, by each library: whether ``minidp.distributed.full_state_dict``
    equals FSDP2's whole tensors (``get_model_state_dict(..., full_state_dict=True)``), key for key, and what a state
    dict whose ``misshapen`` weight lost a row does to minidp's: the error, and whether anything was loaded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    models = {library: _laid_out(layout, shard_with, seed)
              for library, shard_with in (("minidp", md.fully_shard), ("fsdp2", torch_fully_shard))}
    ours = md.full_state_dict(models["minidp"])
    theirs = get_model_state_dict(models["fsdp2"], options=StateDictOptions(full_state_dict=True))
    changed = {key: value[:-1] if key == misshapen else value + 1 for key, value in ours.items()}
    before = [local(p).clone() for p in models["minidp"].parameters()]
    error = error_of(lambda: models["minidp"].load_state_dict(changed))
    return {"full_equal": list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours),
            "misshapen_error": error,
            "loaded_anything": any(not torch.equal(local(p), b) for p, b in zip(models["minidp"].parameters(), before))}


def _fine_tuned(seed: int) -> nn.Module:
    """A :class:`Net` whose ``norm`` is a BatchNorm (buffers, which are not sharded; its running mean seeded too), with
    a frozen bias in a block's group and one in the root's (a fine-tuning setup)."""
    torch.manual_seed(seed)
    model = Net()
    model.norm = nn.BatchNorm1d(13)
    model.norm.running_mean.uniform_(-1, 1)
    for frozen in (model.blocks[1].linear.bias, model.head.bias):
        frozen.requires_grad_(False)
    return model


def partial_full_state_dict_loaded(seed: int, steps: int = 2) -> dict[str, Any]:
    """A fine-tuning checkpoint: a full state dict saved without the frozen parameters
    (``get_model_state_dict(..., StateDictOptions(full_state_dict=True, ignore_frozen_params=True))``, by each library
    from a model of other weights), nor a buffer (``norm.running_mean``), loaded with ``set_model_state_dict(...,
    StateDictOptions(full_state_dict=True, strict=False))``, which puts back what ``named_parameters()`` gives for
    every missing key (FSDP2: the DTensor; minidp: the shard itself, this rank's rows). Each load's error and what it
    returned; whether the saved keys, and the loaded models' state dicts, are FSDP2's; whether the frozen parameters
    and the buffer kept their own values and the rest took the saved ones; then ``steps`` steps of AdamW side by side,
    the first difference after every backward and every step."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    theirs = _fine_tuned(seed)
    ours = copy.deepcopy(theirs)
    own = {k: v.clone() for k, v in theirs.state_dict().items()}
    saved = {}
    for library, function in (("ours", md.fully_shard), ("theirs", torch_fully_shard)):
        source = shard(_fine_tuned(seed + 1), function, True)
        saved[library] = get_model_state_dict(source, options=StateDictOptions(full_state_dict=True,
                                                                               ignore_frozen_params=True))
        del saved[library]["norm.running_mean"]
    missing = sorted(set(own) - set(saved["theirs"]))
    saved_keys_alike = list(saved["ours"]) == list(saved["theirs"]) and all(
        torch.equal(saved["ours"][k], saved["theirs"][k]) for k in saved["theirs"])
    expected = {k: (own[k] if k in missing else saved["theirs"][k]).clone() for k in own}
    shard(theirs, torch_fully_shard, True)
    shard(ours, md.fully_shard, True)
    options = StateDictOptions(full_state_dict=True, strict=False)
    returned: dict[str, Any] = {}
    errors = {}
    for library, model in (("ours", ours), ("theirs", theirs)):
        def load(model: nn.Module = model, library: str = library) -> None:
            incompatible = set_model_state_dict(model, dict(saved[library]), options=options)
            returned[library] = (sorted(incompatible.missing_keys), sorted(incompatible.unexpected_keys))
        errors[library] = error_of(load)
    ours_full = md.full_state_dict(ours)
    loaded_as_saved = list(ours_full) == list(expected) and all(torch.equal(ours_full[k], expected[k]) for k in expected)
    alike_after_load = _state_dict_difference(ours.state_dict(), theirs.state_dict())
    optimizers = (OPTIMIZERS["adamw"](ours.parameters()), OPTIMIZERS["adamw"](theirs.parameters()))
    differences = [first_difference(ours, theirs, optimizers)]
    for step in range(steps):
        _backward_alike(ours, theirs, optimizers, seed, step)
        differences.append(first_difference(ours, theirs, optimizers))
        for optimizer in optimizers:
            optimizer.step()
        differences.append(first_difference(ours, theirs, optimizers))
    return {"missing": missing, "saved_keys_alike": saved_keys_alike, "errors": errors, "returned": returned,
            "loaded_as_saved": loaded_as_saved, "alike_after_load": alike_after_load, "differences": differences,
            "alike_after_training": _state_dict_difference(ours.state_dict(), theirs.state_dict())}


def whole_parameter_optimizers(seed: int) -> dict[str, list[str]]:
    """torch's Adafactor and its AdamW built on a :class:`Net` sharded by minidp, and two steps of each: the warnings
    each gave."""
    results = {}
    for name in ("Adafactor", "AdamW"):
        torch.manual_seed(seed)
        model = shard(Net(), md.fully_shard, True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.01)
            model(torch.randn(4, 13)).sum().backward()
            optimizer.step()
            optimizer.step()
        results[name] = [str(warning.message) for warning in caught]
    return results


def child_sharded_after_its_parent(seed: int) -> dict[str, Any]:
    """fully_shard on the root, then on one of its blocks (the wrong order): the second call's error, and whether the
    root's shards kept their shapes (a second sharding of a shard would cut it again)."""
    model = md.fully_shard(Net())
    before = [p.shape for p in model.parameters()]
    try:
        md.fully_shard(model.blocks[0])
        error = "no error"
    except Exception as caught:  # noqa: BLE001 - the type is part of what is compared
        error = f"{type(caught).__name__}: {caught}"
    return {"error": error, "untouched": [p.shape for p in model.parameters()] == before}


def refused_on_one_rank_only(seed: int) -> str:
    """A model whose head's bias is a scalar on rank 1 only (ranks that built different models): the error each rank
    raised. Rank 1 finds it alone, before any collective; the others must hear of it, not wait for rank 1."""
    model = Net()
    if dist.get_rank() == 1:
        model.head.bias = nn.Parameter(torch.zeros(()))
    try:
        md.fully_shard(model)
    except ValueError as error:
        return str(error)
    return "no error"


class SkipsHead(Net):
    """The chunked-loss pattern: a forward that can stop before the head (called later, chunk by chunk)."""

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        x = self.norm(x)
        for block in self.blocks:
            x = block(x)
        return x if skip_head else self.head(x)


def chunked_loss(seed: int, reshard_after_forward: Optional[bool] = True, steps: int = 3, chunks: int = 3) -> dict:
    """The chunked-loss pattern (torchtitan's ``ChunkedCELoss``) with ``fully_shard([norm, head])``: the model's
    forward stops before the head, the head then runs chunk by chunk on the detached output, each chunk's loss
    backward at once, and the output's backward takes the chunks' gradients. Trained beside FSDP2 doing the same;
    after every step's backward and every step, the first difference (None: none)."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    theirs = SkipsHead()
    ours = copy.deepcopy(theirs)
    for model, function in ((ours, md.fully_shard), (theirs, torch_fully_shard)):
        shard(model, function, reshard_after_forward, grouped=("norm", "head"))
    optimizers = (OPTIMIZERS["adamw"](ours.parameters()), OPTIMIZERS["adamw"](theirs.parameters()))
    differences = []
    for step in range(steps):
        x = torch.randn(6, 13, generator=torch.Generator().manual_seed(seed + 100 * step + rank))
        for model in (ours, theirs):
            hidden = model(x, skip_head=True)
            gradients = []
            for chunk in torch.chunk(hidden.detach(), chunks):
                chunk = chunk.contiguous().requires_grad_()
                model.head(chunk).pow(2).mean().backward()
                gradients.append(chunk.grad)
            hidden.backward(torch.cat(gradients))
        differences.append(first_difference(ours, theirs, optimizers))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        differences.append(first_difference(ours, theirs, optimizers))
    return {"differences": differences}


# torch 2.13's FSDP2 completes a group some of whose modules a forward skipped (_force_complete_incomplete_states);
# its 2.11 kept the group gathered and reduced wrong gradients (its release notes say): no reference there.
FSDP2_COMPLETES_PARTIAL_GROUPS = hasattr(torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState,
                                         "_force_complete_incomplete_states")


def mismatched_model(seed: int) -> str:
    """Rank 1 builds a wider hidden layer: the error on each rank."""
    model = Net(hidden=29 if dist.get_rank() == 0 else 30)
    try:
        shard(model, md.fully_shard, True)
    except ValueError as error:
        return str(error)
    return "no error"


def _error_of_sharding(shard_it: Callable[[nn.Module], Any]) -> str:
    """The ``ValueError`` ``shard_it(model)`` raises on this rank, for a model of two layers of one shape."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    try:
        shard_it(model)
    except ValueError as error:
        return str(error)
    return "no error"


def other_layer_per_rank(seed: int) -> str:
    """Rank 0 shards layer 0 then the root, rank 1 layer 2 then the root."""
    def shard_it(model: nn.Module) -> None:
        md.fully_shard(model[0] if dist.get_rank() == 0 else model[2])
        md.fully_shard(model)
    return _error_of_sharding(shard_it)


def mp_policy_per_rank(seed: int) -> str:
    """param_dtype bfloat16 on rank 0, none on rank 1."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dist.get_rank() == 0 else MixedPrecisionPolicy()
    return _error_of_sharding(lambda model: md.fully_shard(model, mp_policy=policy))


def reshard_after_forward_per_rank(seed: int) -> str:
    return _error_of_sharding(lambda model: md.fully_shard(model[0], reshard_after_forward=dist.get_rank() == 0))


def raise_in_step_2(failing_rank: int) -> None:
    """Train; rank ``failing_rank`` raises in step 2 while the others go on into the all-gathers."""
    model = shard(Net(), md.fully_shard, True)
    for step in range(1, 4):
        if step == 2 and dist.get_rank() == failing_rank:
            raise RuntimeError(f"planted failure in step 2 on rank {failing_rank}")
        model(torch.randn(4, 13)).sum().backward()


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


def evaluation_before_training_as_fsdp2(seed: int) -> dict[str, Any]:
    """Two forwards under ``torch.inference_mode()`` before any training (an evaluation-only job), then a training
    step, in both libraries: each evaluation's output (to compare bitwise), and the training step's error or loss."""
    seen: dict[str, Any] = {}
    for name, fully_shard in (("minidp", md.fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))
        fully_shard(model[0])
        fully_shard(model)
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
        with torch.inference_mode():
            seen[name] = [model(x).clone(), model(2 * x).clone()]
        seen[f"{name} training after"] = error_of(lambda: model(x).pow(2).mean().backward())
    return seen


def _two_linears(inner: tuple[int, int], outer: tuple[int, int], reshard_after_forward: bool = True) -> nn.Module:
    """``Linear(*inner)``, tanh, ``Linear(*outer)`` in float64, each linear a group of its own under a root that has
    no parameter: sizes small enough to count every byte by hand (tests/test_fully_shard.py)."""
    model = nn.Sequential(nn.Linear(*inner), nn.Tanh(), nn.Linear(*outer)).double()
    for part in (model[0], model[2], model):
        md.fully_shard(part, reshard_after_forward=reshard_after_forward)
    return model


def observed_figures(seed: int) -> dict:
    """What the observation tools say of the small models of :func:`_two_linears`, after a step of SGD each: the
    memory ledger (two steps, resharding after the forward or not), the allocation ledger of the second step
    (:func:`minidp.tracing.memory.measure_step`) and of a third under ``minidp.trace(ledger=True)``, and the sharded
    timeline."""
    from minidp.tracing.memory import measure_step

    results: dict[str, Any] = {}
    for name, inner, outer, reshard in (("8-5-3", (8, 5), (5, 3), True), ("8-5-3-kept", (8, 5), (5, 3), False),
                                        ("4-4-4", (4, 4), (4, 4), True)):
        torch.manual_seed(seed)
        model = _two_linears(inner, outer, reshard)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(6, inner[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed + dist.get_rank()))

        def step() -> None:
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()

        step()
        _, rows = measure_step(step, model.parameters())
        with minidp.trace(ledger=True) as traced:
            step()
        results[name] = {"ledger": md.memory_ledger(model, optimizer), "held": rows[0].held,
                         "traced held": traced.ledger()[0].held, "timeline": md.sharded_timeline(model)}
    return results


@record
def _main() -> None:
    dist.init_process_group("gloo")
    raise_in_step_2(int(sys.argv[1]))
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun: torchrun --nproc_per_node=2 -m tests.fsdp_checks FAILING_RANK
    _main()
