"""The optimizer's state of sharded parameters in its state dict: DTensors of this rank's rows, as under FSDP2.

``fully_shard`` registers plain tensors of this rank's rows as the module's parameters, so the state an optimizer
keeps for them (AdamW's ``exp_avg``, SGD's ``momentum_buffer``) is plain rows too. Saved as they are, they would lie:
``torch.distributed.checkpoint`` takes a plain tensor for one every rank holds alike and keeps rank 0's alone, and
``get_optimizer_state_dict(..., full_state_dict=True)`` would hand back each rank's rows as if they were whole.
FSDP2's parameters are DTensors, so the state its optimizers build from them (``torch.zeros_like(param)``) is
DTensors, which both of those read right.

So, for every optimizer that holds a shard:

* ``optimizer.state_dict()`` gives each state tensor shaped like its shard's rows as the DTensor FSDP2 would hold
  there: the same rows (an alias, as the parameter DTensors of ``module.state_dict()`` are), the parameter's whole
  shape, FSDP2's placements (``ShardGroup.as_dtensor``). Other state (a step count) stays as it is, as under FSDP2.
  The optimizer keeps stepping its plain rows: only the state dict changes.
* ``optimizer.load_state_dict(...)`` turns such a DTensor back into this rank's rows (a whole plain tensor too, cut
  as the shards were: ``ShardGroup.own_rows``), so a checkpoint saved from FSDP2 or from minidp, sharded or whole,
  loads into either.

torch has no hook for an optimizer's creation, and an optimizer is built after ``fully_shard``, on its shards. So
:func:`watch_optimizers` (called by ``fully_shard``) adds one global step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``), which looks at each optimizer it has not seen, or whose
parameters changed in number, and gives the two hooks above to one that holds a shard. It also turns into rows any
DTensor loaded before that first step, into an optimizer that had not stepped yet (a job resumed from a
checkpoint). ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` and ``set_state_dict`` step an
optimizer that holds no state yet themselves (with a learning rate of 0) before they read it, so they meet the hooks;
an optimizer given plain rows by ``load_state_dict`` and saved again before any step gives them as plain rows. An
optimizer that makes its state when it is built (torch's ``Adagrad``, its ``sum``) is not stepped by them: read
before its first step (the target ``get_state_dict`` makes to load a checkpoint into, when a job resumes), its state
would be plain rows, and ``dcp.load`` would refuse the whole tensors saved. So the same function also wraps
``torch.optim.Optimizer.__init__``, once per process: every optimizer built after ``fully_shard`` gets the hooks as
it is made, where it holds a shard (:func:`_watched_from_birth`).

The same hook warns, once per optimizer, where the optimizer is one of torch's whose step reduces over a
parameter's elements (:data:`WHOLE_PARAMETER_OPTIMIZERS`): on plain rows it sees this rank's alone.

This module knows a shard by the weak reference to its group that ``fully_shard`` sets on it (:data:`SHARDED_BY`),
and asks that group for the layout; it imports nothing of ``fully_shard``'s.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

# Set by fully_shard on each shard it registers: a weak reference to its group (for this module and clip_grad_norm_,
# which are given the parameters only).
SHARDED_BY = "_minidp_sharded_by"

_watched: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()  # -> params seen
_hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_step_hook: Optional[Any] = None

# torch's optimizers whose step reduces over many elements of a parameter, not one element at a time: Adafactor's
# row and column means, Muon's orthogonalised update matrix, L-BFGS's dot products over every gradient. On a shard
# (plain rows) each rank's step reads its own rows alone, where the unsharded parameter would give every row the
# same reduction; FSDP2's DTensor parameters reduce over the whole, or refuse (its Adafactor raises).
WHOLE_PARAMETER_OPTIMIZERS = ("Adafactor", "Muon", "LBFGS")


def watch_optimizers() -> None:
    """Install, once per process, the global step pre-hook that gives every optimizer holding a shard its hooks, and
    the same at every optimizer's construction (:func:`_watched_from_birth`)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_before_step)
        torch.optim.Optimizer.__init__ = _watched_from_birth(torch.optim.Optimizer.__init__)


def _watched_from_birth(init: Any) -> Any:
    """``Optimizer.__init__``, then what the first step does (:func:`_before_step`). A subclass calls it before it
    makes any state of its own (Adagrad's ``sum``), and the hooks, registered on the optimizer, serve whatever it makes
    later; an optimizer that holds no shard is looked at and left alone (one pass over its parameters)."""

    @functools.wraps(init)
    def init_and_watch(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        init(optimizer, *args, **kwargs)
        _before_step(optimizer, args, kwargs)

    return init_and_watch


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, in the order its state dict numbers them."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def group_of_shard(param: torch.Tensor) -> Optional[Any]:
    """The group of ``param`` if it is a shard ``fully_shard`` registered and the group lives, else ``None``."""
    reference = getattr(param, SHARDED_BY, None)
    return reference() if reference is not None else None


def _shards_among(params: Iterable[torch.Tensor]) -> dict[int, tuple[Any, Any]]:
    """``id(param)``: ``(group, sharded parameter)`` for each of ``params`` that a live group still registers as a
    shard (one that ``load_state_dict(assign=True)`` or ``to_empty()`` replaced is no longer its group's)."""
    groups = {id(group): group for group in map(group_of_shard, params) if group is not None}
    return {id(sharded.shard): (group, sharded) for group in groups.values() for sharded in group.params}


def _mesh_of(group: Any, meshes: dict[int, Any]) -> Any:
    """The mesh of ``group``'s DTensors, made once per call (a group without a mesh of its own gets one made from its
    process group, which it must not keep: ``ShardGroup.dtensor_mesh``)."""
    if id(group) not in meshes:
        meshes[id(group)] = group.dtensor_mesh()
    return meshes[id(group)]


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _watched.get(optimizer) == count:  # seen with these parameters: the usual step costs one lookup
        return
    _watched[optimizer] = count
    params = _params_of(optimizer)
    shards = _shards_among(params)
    if optimizer not in _hooked and any(id(param) in shards for param in params):
        optimizer.register_state_dict_post_hook(_state_as_dtensors)
        optimizer.register_load_state_dict_post_hook(_state_as_rows)
        _hooked.add(optimizer)
        _state_as_rows(optimizer)  # what was loaded before this first step
        kind = type(optimizer)
        if kind.__module__.startswith("torch.optim") and kind.__name__ in WHOLE_PARAMETER_OPTIMIZERS:
            warnings.warn(
                f"torch.optim.{kind.__name__} reduces over many elements of each parameter in its step, and this "
                f"optimizer holds parameters sharded by minidp's fully_shard: plain tensors of this rank's rows, so "
                f"each rank's step sees its own rows alone and the update differs from the unsharded one. Use an "
                f"optimizer that updates element by element (SGD, Adam, AdamW, ...) with minidp's fully_shard, or "
                f"torch's fully_shard (DTensor parameters) for this one", stacklevel=3)


def _state_as_dtensors(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """After ``optimizer.state_dict()``: each state tensor of a shard, shaped like its rows, as FSDP2's DTensor."""
    params = _params_of(optimizer)
    shards = _shards_among(params)
    meshes: dict[int, Any] = {}
    for index, state in list(state_dict["state"].items()):
        if id(params[index]) not in shards:
            continue
        group, sharded = shards[id(params[index])]
        mesh = _mesh_of(group, meshes)
        rows_shape = params[index].shape
        # a new dict: the state dict's entries are the optimizer's own (Optimizer.state_dict packs them as they are)
        state_dict["state"][index] = {
            key: group.as_dtensor(sharded, value, mesh)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == rows_shape
            else value
            for key, value in state.items()
        }
    return state_dict


def _state_as_rows(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict(...)``: each DTensor (or whole tensor) of a shard's state as this rank's rows."""
    shards = _shards_among(optimizer.state)
    meshes: dict[int, Any] = {}
    for param, state in optimizer.state.items():
        if id(param) not in shards:
            continue
        group, sharded = shards[id(param)]
        for key, value in state.items():
            if isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and value.shape == sharded.full_size
                                              and value.shape != param.shape):
                mesh = _mesh_of(group, meshes)
                # a copy: rows cut from a whole tensor would keep it all alive, and be strided where dim > 0
                state[key] = group.own_rows(sharded, value, mesh).clone(memory_format=torch.contiguous_format)
