"""replicate: DistributedDataParallel as a composable API, the module left as it is.

``replicate(model)`` is torch's ``torch.distributed._composable.replicate.replicate`` (the data parallelism
torchtitan applies with ``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=...)``), rebuilt on minidp's
:class:`~minidp.distributed.DistributedDataParallel`: no wrapper, so the model keeps its attributes and its
state-dict keys, and its forward runs DDP's two halves around it, as two hooks:

* a forward pre-hook runs what DDP does before the module (:meth:`DistributedDataParallel.enter_forward`: the
  reducer prepared, buffers synced, low precision cast); at the first forward it first builds the DDP object, on
  the module's parameters (``ignored_modules``' and those of sub-modules ``fully_shard`` shards left out), which
  broadcasts rank 0's parameters as DDP's construction does;
* a forward hook runs what DDP does after it (:meth:`DistributedDataParallel.leave_forward`), so that the backward
  reduces every gradient in buckets, as under the wrapper.

As torch's, the DDP object holds the parameters in an ``nn.ParameterList`` and not the module, so the module's
buffers are not broadcast (torch's replicate does not sync them either), and the module's class becomes
``Replicated<its class>``, which adds :meth:`ReplicatedModule.set_requires_gradient_sync` (gradient accumulation
without the all-reduce) and :meth:`ReplicatedModule.register_comm_hook` (kept until the DDP object exists), and
refuses ``copy.deepcopy``. Everything else is DistributedDataParallel's, with its keyword arguments.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed._composable.replicate import DDP as TorchReplicated

from ..step2_replicate import check_is_module
from .batchnorm import attach_exchange
from .checks import managed_by_fully_shard
from .ddp import DistributedDataParallel
from .isinstance_only import give_methods

# Where a module keeps its state, in its __dict__ (fully_shard leaves a module holding it alone, as FSDP2 leaves torch's).
REPLICATE_STATE = "_minidp_replicate_state"


class ReplicateState:
    """What ``replicate`` keeps for a module: its DDP object once built, and what builds it (torch's
    ``_ReplicateState``)."""

    def __init__(self, module: nn.Module, ignored_modules: set[nn.Module], ddp_kwargs: dict[str, Any]) -> None:
        self.module = module
        self.ignored_modules = ignored_modules
        self.ddp_kwargs = ddp_kwargs
        self.ddp: Optional[DistributedDataParallel] = None
        self._no_sync = False  # torch's name: set_requires_gradient_sync(False) sets it
        self.comm_hooks: list[tuple[tuple, dict]] = []
        self.recording = False
        self.inside_ddp_forward: Optional[contextlib.AbstractContextManager] = None  # entered for the module's forward

    @property
    def _ddp_weakref(self) -> weakref.ref:
        """A weak reference to the DDP object, by torch's name (upstream's tests read it); as torch's, there from the
        first forward, which builds it."""
        if self.ddp is None:
            raise AttributeError("_ddp_weakref: the DDP object is built at the module's first forward")
        return weakref.ref(self.ddp)

    # torch's _ReplicateState's attributes, which code written for it reads (replicate.state(m)._ddp.register_comm_hook)
    @property
    def _ddp(self) -> DistributedDataParallel:
        """The DDP object, by torch's name; as torch's, there from the first forward, which builds it."""
        if self.ddp is None:
            raise AttributeError("_ddp: the DDP object is built at the module's first forward")
        return self.ddp

    @property
    def has_initialized(self) -> bool:
        """Whether the first forward built the DDP object."""
        return self.ddp is not None

    @property
    def _param_list(self) -> nn.ParameterList:
        """The parameters DDP reduces (empty before the first forward, as torch's)."""
        return self.ddp.module if self.ddp is not None else nn.ParameterList()

    @property
    def _param_names(self) -> list[str]:
        """Their names under the module (empty before the first forward, as torch's)."""
        reduced = {id(p) for p in self._param_list}
        return [name for name, p in self.module.named_parameters() if id(p) in reduced]

    def parameters(self) -> list[nn.Parameter]:
        """The module's parameters DDP reduces: in the module's order, without the ignored modules' and those of
        sub-modules ``fully_shard`` shards (either library's: their class derives from FSDPModule)."""
        left_out = {id(p) for m in self.ignored_modules for p in m.parameters()}
        left_out |= {id(p) for m in self.module.modules() if managed_by_fully_shard(m) for p in m.parameters()}
        return [p for p in self.module.parameters() if id(p) not in left_out]

    @torch._disable_dynamo(recursive=True)
    def build(self) -> DistributedDataParallel:
        """The DDP object, made at the first forward (torch's ``lazy_init``), with the comm hooks registered so far.
        Out of ``torch.compile``'s sight, as torch's ``lazy_init`` is: a first forward compiled would trace its
        collectives (the check that every rank holds the same model)."""
        kwargs = dict(self.ddp_kwargs)
        if "device_id" in kwargs:  # torch's replicate: a CPU device (or None) means device_ids=None
            device_id = kwargs.pop("device_id")
            cpu = device_id is None or (isinstance(device_id, torch.device) and device_id.type == "cpu")
            kwargs["device_ids"] = None if cpu else [device_id]
        self.ddp = DistributedDataParallel(nn.ParameterList(self.parameters()), **kwargs)
        # The DDP object holds the parameters, not the module: its own attach reaches no layer of the module.
        attach_exchange(self.module, self.ddp.process_group, replicas=1)
        for args, hook_kwargs in self.comm_hooks:
            self.ddp.register_comm_hook(*args, **hook_kwargs)
        self.comm_hooks.clear()
        return self.ddp

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ddp = self.ddp if self.ddp is not None else self.build()
        ddp.require_backward_grad_sync = not self._no_sync
        # The module's forward runs inside the wrapper's _inside_ddp_forward, entered here and left in the post-hook:
        # the DDP object is torch DDP's active module, so dynamo's DDPOptimizer splits a compiled forward at the
        # bucket boundaries (torch's replicate sets it in its pre-hook too, and clears it in its post-hook).
        self.inside_ddp_forward = ddp._inside_ddp_forward()
        self.inside_ddp_forward.__enter__()
        self.recording, args, kwargs = ddp.enter_forward(args, kwargs)
        return args, kwargs

    def after_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self.inside_ddp_forward.__exit__(None, None, None)
        return self.ddp.leave_forward(output, self.recording)


def state(module: nn.Module) -> Optional[ReplicateState]:
    """The state ``replicate`` keeps on ``module``, ``None`` where it was not applied (torch's ``replicate.state(module)``,
    the lookup of its ``contract``)."""
    return module.__dict__.get(REPLICATE_STATE)


class ReplicatedModule(TorchReplicated):
    """The methods ``replicate`` adds to the module's class (torch's composable ``DDP`` class, from which it derives
    for ``isinstance`` alone: each of its methods is defined here)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:
        # A container's slice (``sequential[1:]``) is made by ``type(self)(...)``: of the original class, as torch's
        # composable DDP class makes it (its __new__), since the slice is not replicated.
        original = cls.original_class
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """``False``: the backwards that follow accumulate gradients locally, without the all-reduce (DDP's
        ``no_sync()``); ``True``: the next backward reduces the sum."""
        state(self)._no_sync = not requires_gradient_sync

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> None:
        """DDP's ``register_comm_hook``, registered on the DDP object when the first forward builds it."""
        state(self).comm_hooks.append((args, kwargs))

    def __deepcopy__(self, memo: dict) -> None:
        raise AssertionError("DDP does not support deepcopy. Please use state dict for serialization.")


def replicate(module: nn.Module, ignored_modules: Optional[Iterable[nn.Module]] = None, **kwargs: Any) -> nn.Module:
    """Make ``module`` data parallel in place, DDP's way; returns ``module``.

    ``kwargs`` are :class:`DistributedDataParallel`'s (``process_group`` or ``device_mesh``, ``bucket_cap_mb``,
    ``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``...), and ``device_id`` (an int or a
    ``torch.device``; a CPU device means ``device_ids=None``), as torch's ``replicate`` takes them.
    ``ignored_modules``: sub-modules whose parameters are left alone (not broadcast, not reduced).
    """
    check_is_module(module, "module")  # torch's fails on a function with AttributeError, deep in its contract
    if "device_id" in kwargs and not isinstance(kwargs["device_id"], (int, torch.device)):
        raise RuntimeError(f"Expected device_id to be int or torch.device, but got {type(kwargs['device_id'])}")
    if managed_by_fully_shard(module):
        raise RuntimeError("Cannot apply `replicate()` on a Module already managed by `fully_shard`")
    if REPLICATE_STATE in module.__dict__:  # torch's contract() refuses it with AssertionError: code may catch that
        raise AssertionError(f"replicate was already applied to this {type(module).original_class.__name__}; "
                             f"apply it once per module (each composable API can only be applied to a module once)")
    replicated = ReplicateState(module, set(ignored_modules or ()), kwargs)
    module.__dict__[REPLICATE_STATE] = replicated
    # Named in torch's registry of composable APIs, as torch's contract names its replicate: torch's fully_shard on a
    # module above this one then leaves this one's parameters whole, to its DDP (_is_composable_with_fsdp), and torch's
    # replicate refuses to be applied on top.
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())["replicate"] = RegistryItem()
    module.register_forward_pre_hook(replicated.before_forward, with_kwargs=True)
    module.register_forward_hook(replicated.after_forward)
    give_methods(module, ReplicatedModule, "DDP")  # torch's replicate names the class DDP<its class> too
    return module


replicate.state = state  # type: ignore[attr-defined]  # torch's replicate.state(module), by the same name
