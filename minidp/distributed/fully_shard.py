"""fully_shard: each rank keeps 1/W of every parameter, gathers a module's parameters just before it runs.

``fully_shard(module)`` is torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) rebuilt on plain
tensors and ``torch.distributed``'s all-gather and reduce-scatter, with FSDP2's arithmetic: the same
shards, the same padding, the same collectives on the same flat buffers, the same division of the
gradients, so that training is bitwise equal to FSDP2's (tests/test_fully_shard.py). Call it on the
sub-modules first (each call makes one *group*: the parameters of that module not already in a
group), then on the root.

The steps, and where each lives:

1. **shard** (at ``fully_shard``, :class:`ShardedParameter`): each parameter is cut along dim 0 with
   ``torch.chunk(param, W)``; rank r keeps chunk r, padded with zero rows to the size of chunk 0 so
   that every rank sends the same number of elements (a rank past the last chunk keeps only
   padding). The module's parameter is replaced by an ``nn.Parameter`` of rank r's rows: the
   optimizer is built on these shards (FSDP2 registers a ``DTensor`` there instead, whose local
   tensor is the same rows; see the README for why plain tensors here).
2. **all-gather** (a forward pre-hook, and the backward's first gradient hook on the module's
   outputs when the forward resharded, :meth:`ShardGroup.unshard`): the group's padded shards are
   copied side by side into this rank's slot of one flat buffer ("copy-in"), one
   ``all_gather_single`` (``all_gather_into_tensor``) fills the other ranks' slots, and each parameter's rows are copied out
   of every slot into a buffer of its own ("copy-out"), of which the full parameter is a view. That
   view, an ``nn.Parameter``, is set on the module for its forward; autograd saves it. Parameters of
   several dtypes (a frozen float64 or integer one beside float32 ones) travel as their bytes in a
   ``torch.uint8`` buffer, as FSDP2's do, each copied out in its own dtype; those that get gradients
   must share one, as in FSDP2, for step 4 reduces them in one buffer.
3. **free** (a forward hook with ``reshard_after_forward=True``, and after the backward,
   :meth:`ShardGroup.reshard`): the shard is set back on the module and the gathered buffers' storage
   is released (``untyped_storage().resize_(0)``); the backward's all-gather refills the same storage,
   so the tensors autograd saved are whole again when it needs them.
4. **reduce-scatter** (an autograd function on the module's inputs, whose backward runs once the
   module's backward is done, :meth:`ShardGroup.reduce_gradients`): the full gradients are laid out
   as the all-gather laid out the parameters (rank r's rows of every gradient, padded, in slot r),
   one ``reduce_scatter_single`` (``reduce_scatter_tensor``) leaves each rank the sum of its slot, divided by W as FSDP2 divides
   (:func:`division`), and rank r's rows become the shards' ``.grad``.
5. **prefetch and overlap** (:class:`Iteration`): as FSDP2's backward does, each group's backward
   launches the all-gather of the group that ran just before it in the forward; each
   reduce-scatter is finished (its buffer freed) before the next one starts, FSDP2's one buffer in
   flight. The forward does not prefetch, as FSDP2's does not unless asked
   (``set_modules_to_forward_prefetch``): it would hold two groups' parameters at once.
   *Where they overlap compute* follows FSDP2 too. Off the CPU (NCCL) the collectives are left
   running: the prefetched all-gather runs while this group computes, each reduce-scatter while
   the next group computes its backward, as FSDP2's run on their own CUDA streams. On the CPU
   FSDP2 has no streams and waits for each collective when it is issued (``_fsdp_param_group.py``:
   ``unshard_async_op`` is False; ``_fsdp_collectives.py``, ``foreach_reduce``: the reduce-scatter
   without ``async_op``); minidp does the same
   (``ShardGroup.overlap``), because overlap there costs memory: a reduce-scatter left running
   keeps its full-size input, its output and Gloo's work on it alive through the next group's
   backward, which made a step add 1.56x and 1.37x the memory FSDP2's adds (measured with overlap, before
   this choice: ``python benchmarks/bench_fsdp.py --rounds 16``, BENCHMARKS.md, "Sharding"). What
   waiting costs: Gloo's transfer no longer hides behind the next group's compute on the CPU.
   The arithmetic is the same either way (only when each wait happens changes), so training stays
   bitwise equal to FSDP2.
6. the optimizer steps on the shards, each rank on its own 1/W.

``module.state_dict()`` holds each sharded parameter as FSDP2's does, a DTensor of this rank's rows (so that
``torch.distributed.checkpoint`` saves every rank's part); :func:`full_state_dict` gathers every parameter on every
rank; ``module.load_state_dict`` takes either back (each rank keeps its rows). The optimizer steps plain rows of state
too, and its state dict gives them as FSDP2's DTensors (:mod:`minidp.distributed.sharded_optimizer_state`).

The module keeps its own class's behaviour, but its class becomes a subclass of (:class:`ShardedModule`,
its class), as FSDP2's becomes one of (``FSDPModule``, its class): that is where FSDP2's methods users
call on the module live: ``set_requires_gradient_sync`` (gradient accumulation without the
reduce-scatter), ``unshard`` (also asynchronous: a prefetch by hand) and ``reshard``,
``set_reshard_after_forward`` and ``set_reshard_after_backward``, ``set_modules_to_forward_prefetch`` and
``set_modules_to_backward_prefetch``, ``set_is_last_backward``, ``set_unshard_in_backward``,
``set_reduce_scatter_unused_params``,
``set_gradient_divide_factor`` (and its deprecated name), ``set_force_sum_reduction_for_comms``,
``set_all_reduce_hook``, ``set_requires_all_reduce`` and ``reset_iter_state``. Each changes
when a collective runs, or how the gradients are divided, as FSDP2's does (tests/test_fully_shard.py trains
with each against FSDP2). ``set_reduce_scatter_max_input_buffers(1)`` and
``set_allocate_memory_from_process_group_for_comm(False)``, FSDP2's defaults, are taken and change nothing.
Mixed precision is FSDP2's ``MixedPrecisionPolicy``, given to ``fully_shard``.

FSDP2's ``mesh`` is taken: 1-D, the ranks that shard; 2-D, HSDP, where dimension 1 shards and dimension 0
replicates: each group's shards, once reduce-scattered among the ranks that shard, are all-reduced among the
ranks that hold the same shard (``set_requires_all_reduce(False)`` leaves that out and sums them, FSDP2 alike), and
:func:`division` spreads the average over both collectives as FSDP2 does. ``shard_placement_fn``'s ``Shard(dim)`` cuts
a parameter along another dimension (evenly, as FSDP2 requires): the gathered slices are joined along it, the
gradient's slices stacked along dim 0 for the reduce-scatter, as FSDP2 lays them out. ``CPUOffloadPolicy`` is
taken where it changes nothing, a module on the CPU. Not here: offloading a GPU module, a mesh of its own
for one parameter (``ShardPlacementResult``) and the hooks that replace FSDP2's collectives.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE, ActivationWrapper
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from ..hooks import observe_storage, observe_wait
from ..nested import map_tensors, tensors_in
from .batchnorm import attach_exchange
from .checks import (
    TensorSpec, check_same_everywhere, collectives_on, first_difference, first_setting_difference, raise_on_every_rank,
)
from .isinstance_only import give_methods, refuse_inherited
from .mixed_precision import cast_floating
from .replicate import REPLICATE_STATE
from .sharded_optimizer_state import SHARDED_BY, group_of_shard, watch_optimizers


# torch 2.13 names them all_gather_single and reduce_scatter_single (the older names warn); same calls.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _not_traced(hook: Callable) -> Callable:
    """``hook`` run as it is under ``torch.compile``, not traced: dynamo compiles the module's forward between the hooks,
    as FSDP2's hooks are left out of its graphs (``_dynamo_disable`` on them, ``_fsdp_common.py``). Traced, their
    bookkeeping (the timeline's events, the pass's state) would make dynamo compile the graph again at every step."""
    return torch.compiler.disable(hook, recursive=True, reason="minidp's fully_shard hooks run eagerly")


class Division(NamedTuple):
    """How the gradients are averaged around the collectives (:func:`division`); ``None`` where nothing is done."""

    before: Optional[float]  # divide the reduce-scatter's input
    scale: Optional[float]  # multiply the reduce-scatter's input (FSDP2's PREMUL_SUM, which Gloo lacks)
    reduce_scatter_op: dist.ReduceOp
    all_reduce_op: dist.ReduceOp  # across the replicas of HSDP's 2-D mesh
    after: Optional[float]  # divide the reduced shard


def division(dtype: torch.dtype, world_size: int, factor: Optional[float] = None, force_sum: bool = False,
             replicas: int = 1) -> Division:
    """How FSDP2 averages gradients over ``world_size`` ranks that shard, times ``replicas`` copies of that shard
    (HSDP: a 2-D mesh; 1 otherwise), in ``dtype``.

    FSDP2 (``_fsdp_collectives.py``, ``_get_gradient_divide_factors``), with F = ``world_size * replicas``: float32
    and bfloat16 reduce with ``ReduceOp.AVG`` (the backend divides the sum by the group's size), the reduce-scatter
    over the ranks that shard and then, with HSDP, the all-reduce over the replicas. Other dtypes (float64, float16),
    where FSDP2 guards against overflow, reduce with SUM between two divisions: by p before, where p doubles from 1
    while F % p == 0 and F / p > p, and by F / p after. F = 2: / 2 then / 1; F = 3: / 2 then / 1.5; F = 8: / 4 then
    / 2.

    ``factor`` (``set_gradient_divide_factor``) replaces F. In float32 and bfloat16 a factor other than the ranks
    that shard makes FSDP2 reduce-scatter with ``PREMUL_SUM(1 / factor)``, each rank's gradient multiplied by
    1 / factor inside the collective; only NCCL has that op, so here the input is multiplied by 1 / factor before
    a SUM, the same product in the same dtype; the all-reduce then sums. ``force_sum``
    (``set_force_sum_reduction_for_comms``): SUM always, then a division by F (float32, bfloat16) or the two
    divisions above.
    """
    sum_op = dist.ReduceOp.SUM
    data_parallel_size = world_size * replicas
    overflow_risk = dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            op = sum_op if data_parallel_size == 1 else dist.ReduceOp.AVG
            return Division(None, None, op, op, None)
        if factor == world_size:
            return Division(None, None, dist.ReduceOp.AVG, sum_op, None)
        return Division(None, 1 / factor, sum_op, sum_op, None)
    if factor is None:
        factor = float(data_parallel_size)
    before = 1
    while overflow_risk and factor % before == 0 and factor / before > before:
        before *= 2
    divisors = [None if d == 1 else float(d) for d in (before, factor / before)]  # a division by 1 is skipped
    return Division(divisors[0], None, sum_op, sum_op, divisors[1])


class ShardedParameter:
    """One parameter: rank r's padded rows (the shard the optimizer steps) and, while gathered, the whole.

    ``padded``: this rank's rows plus zero rows, ``padded_size`` (chunk 0's size) on every rank;
    ``shard``: the ``nn.Parameter`` of this rank's rows only, a view at the start of ``padded``;
    ``gathered``: W * padded numel elements, every rank's padded rows in rank order (storage freed
    when resharded); ``full``: the ``nn.Parameter`` of the first ``full_size`` elements of ``gathered``.

    ``dim`` (FSDP2's ``Shard(dim)``, from ``shard_placement_fn``): the dimension cut; "rows" above are
    then slices along it. Only dim 0 may be cut unevenly (as in FSDP2); on another dimension the
    all-gather's slots are joined along it, and the gradient's slices stacked along dim 0 before the
    reduce-scatter (:meth:`whole_from_slots`, :meth:`slots_from_whole`).
    """

    def __init__(self, module: nn.Module, name: str, param: nn.Parameter, rank: int, world_size: int,
                 dim: int = 0, path: str = "") -> None:
        self.module, self.name = module, name
        self.path = path or name  # its name under the module fully_shard was called on, for messages
        self.also_in: list[tuple[nn.Module, str]] = []  # the same parameter registered elsewhere in the group
        self.full_size = param.size()
        self.dim, self.world_size = dim, world_size
        chunks = list(torch.chunk(param.detach(), world_size, dim=dim))  # fewer than W when dim 0 < W
        self.padded_size = chunks[0].size()
        self.shard = nn.Parameter(param.detach().new_empty(0), requires_grad=param.requires_grad)
        self.guarded: Optional[nn.Parameter] = None  # the shard refuse_gradient_of_shard() hooked
        self.refuse_gradient_of_shard()
        self._pad(chunks[rank] if rank < len(chunks) else param.detach().narrow(dim, 0, 0))
        self.gathered: Optional[torch.Tensor] = None  # allocated at the first all-gather
        self.full: Optional[nn.Parameter] = None
        self.compute_dtype = param.dtype  # of the whole parameter: its group's policy may change it (_read_shards)
        self.group: Optional[weakref.ref] = None  # set by the group made of it; also on the shard (clip_grad_norm_)
        # With a reduce dtype other than the compute dtype: the whole gradient summed over unsynchronised
        # backwards in the reduce dtype (FSDP2's unsharded_accumulated_grad), off the whole parameter.
        self.accumulated: Optional[torch.Tensor] = None

    @property
    def places(self) -> list[tuple[nn.Module, str]]:
        """Every ``(module, name)`` it is registered under in its group: its own, then the tied ones (``also_in``)."""
        return [(self.module, self.name), *self.also_in]

    def follows_shard(self) -> bool:
        """Whether ``shard`` is still the registered parameter and a view of ``padded``: ``module.to(dtype or
        device)`` after ``fully_shard`` gives the shard new data, which the all-gather (reading ``padded``) would
        not see, nor the optimizer's updates of it after that; ``module.to_empty()`` from the meta device, or
        ``load_state_dict(assign=True)``, registers a new parameter in its place, on each module that holds it (a tied
        weight's two keys assign two parameters, untying it)."""
        shard, padded = self.shard, self.padded
        return (all(module._parameters.get(name) is shard for module, name in self.places)
                and shard.dtype == padded.dtype and shard.device == padded.device
                and shard.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr())

    def refuse_gradient_of_shard(self) -> None:
        """Make a gradient that reaches the shard an error (:func:`_used_outside_forward`). Every forward of the module
        uses the whole parameter, a leaf of its own, and the reduce-scatter sets the shard's ``.grad`` by hand, so
        autograd reaches the shard only where it was used outside a forward (a penalty on it added to the loss, a hook
        run after the forward resharded): with this rank's rows alone, which FSDP2, whose DTensor does not mix with
        plain tensors, refuses too. The hook costs nothing in a step that never fires it. Called where the shard may
        have begun to need gradients: made, replaced (:meth:`repad`), unfrozen (the all-gather)."""
        if self.shard.requires_grad and self.guarded is not self.shard:
            name = f"{_class_name(self.module)}.{self.name}"
            self.shard.register_hook(functools.partial(_used_outside_forward, name))
            self.guarded = self.shard

    def _pad(self, rows: torch.Tensor) -> None:
        """``padded`` (what this rank contributes to the all-gather): ``rows``, then zero rows up to chunk 0's
        size; ``shard`` (always the same ``nn.Parameter``: the optimizer holds it) a view of its real rows."""
        padded = rows.new_zeros(self.padded_size)
        padded.narrow(self.dim, 0, rows.size(self.dim)).copy_(rows)
        self.padded = padded.view(-1)
        self.shard.data = padded.narrow(self.dim, 0, rows.size(self.dim))

    def repad(self) -> None:
        """Rebuild ``padded`` around the shard's new data (:meth:`follows_shard`), taking as the shard the parameter
        registered in its place if there is a new one (on every module that holds it, so that a tied weight stays
        tied); the whole parameter is made anew at the next all-gather."""
        registered = self.module._parameters.get(self.name)
        if isinstance(registered, nn.Parameter) and registered is not self.shard:
            self.shard = registered
            setattr(registered, SHARDED_BY, self.group)
            self.refuse_gradient_of_shard()
        self.set_on_modules(self.shard)  # the owner's, tied again where another holder got a parameter of its own
        self._pad(self.shard.detach())
        self.gathered = self.full = None

    def has_whole_gradient(self) -> bool:
        """Whether a gradient of the whole parameter waits to be reduced (on it, or summed in the reduce dtype)."""
        return self.accumulated is not None or (self.full is not None and self.full.grad is not None)

    def take_whole_gradient(self) -> Optional[torch.Tensor]:
        """The whole gradient of the backwards since the last reduction, taken off the whole parameter: the sum
        kept in the reduce dtype, with this backward's added (FSDP2's accumulate_unsharded_grad_if_needed),
        else the whole parameter's own ``.grad``."""
        grad = None if self.full is None else self.full.grad
        if self.full is not None:
            self.full.grad = None
        if self.accumulated is None:
            return grad
        total, self.accumulated = self.accumulated, None
        if grad is not None:
            total += grad  # in the reduce dtype
        return total

    @property
    def shard_numel(self) -> int:
        return self.padded.numel()

    def whole_from_slots(self, slots: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The whole parameter (padding included) from ``slots``, every rank's padded slice in rank order (W rows of
        ``padded``'s numel): a view for dim 0; on another dimension the slices joined along it, into ``out``
        (FSDP2's copy-out: ``torch.cat`` of the chunks, ``foreach_all_gather_copy_out``)."""
        stacked = slots.view(self.world_size * self.padded_size[0], *self.padded_size[1:])
        if self.dim == 0:
            return stacked
        joined = list(self.padded_size)
        joined[self.dim] *= self.world_size
        return torch.cat(torch.chunk(stacked, self.world_size, dim=0), dim=self.dim,
                         out=None if out is None else out.view(joined))

    def slots_from_whole(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` laid out for the reduce-scatter, whose slot r is rank r's rows: itself for dim 0, else its slices
        along ``dim`` stacked along dim 0 (FSDP2's ``foreach_reduce``: ``torch.cat(torch.chunk(grad, W, dim), 0)``)."""
        if self.dim == 0 or self.world_size == 1:
            return grad
        return torch.cat(torch.chunk(grad, self.world_size, dim=self.dim), dim=0)

    def set_on_modules(self, tensor: nn.Parameter) -> None:
        """Register ``tensor`` as this parameter on its module(s), past ``nn.Module.__setattr__``'s checks."""
        for module, name in self.places:
            module._parameters[name] = tensor


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs when the gradients of those inputs are ready,
    which is when the module's own backward, and so its parameters' gradients, are complete
    (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx: Any, group: "ShardGroup", *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        ctx.group.reduce_gradients()
        return (None, *grads)


class SharedContext:
    """What every group under one root shares (FSDP2's ``FSDPStateContext``): each group starts with its own, and
    the root's first forward gives them all the root's, so that a setting made on any of them then holds for all."""

    def __init__(self) -> None:
        # False (set_is_last_backward): the backward's end leaves reduce-scatters in flight and prefetched
        # all-gathers pending, for the next micro-batch's backward to take up; on the CPU every collective is
        # done when it is issued, so only the pending all-gathers remain. Set True before the last.
        self.is_last_backward = True


class ShardGroup:
    """The parameters of one ``fully_shard`` call: gathered together, freed together, reduced together."""

    def __init__(self, members: list[nn.Module], params: list[ShardedParameter], process_group: dist.ProcessGroup,
                 reshard_after_forward: Optional[bool], device: torch.device,
                 mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                 replicate_group: Optional[dist.ProcessGroup] = None, mesh: Optional[DeviceMesh] = None) -> None:
        self.members = members  # the modules of the call: one, or several (``fully_shard([norm, head])``)
        self.module = members[0]
        self.params = params
        for p in params:  # weakly, as the shards outlive nothing of the group's
            p.group = weakref.ref(self)
            setattr(p.shard, SHARDED_BY, p.group)
        # Held weakly: torch.distributed keeps the group until destroy_process_group(), which must then free it.
        # Held here, it would outlive that call (a sharded model lives until the garbage collector finds its
        # cycles, at exit if not before), and so would Gloo's worker threads, which can then be freeing the last
        # collective's Python-owned tensors while the interpreter shuts down: an abort ("terminate called without
        # an active exception") at the end of a script that did everything right (examples/fsdp_train.py under
        # torchrun: 2 runs of 12 with the group held here, 0 of 24 with it held weakly).
        self._process_group = weakref.ref(process_group)
        self.rank, self.world_size = process_group.rank(), process_group.size()
        # HSDP (a 2-D mesh): the ranks that hold the same shard, among which each reduced shard is all-reduced.
        self._replicate_group = None if replicate_group is None else weakref.ref(replicate_group)
        self.replicas = 1 if replicate_group is None else replicate_group.size()
        self._mesh = mesh  # the user's: the DTensors of state dicts live on it (else on one made from the group)
        # False: the reduced shards are summed here, not yet all-reduced (set_requires_all_reduce; FSDP2's
        # all_reduce_grads and _partial_reduce_output, in the reduce dtype, before the division after).
        self.requires_all_reduce = True
        self.partial_reduction: Optional[torch.Tensor] = None
        # Called on this rank's reduced rows, after the all-reduce with HSDP, before the division after
        # (ShardedModule.set_all_reduce_hook; FSDP2's _all_reduce_hook).
        self.all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
        # None (FSDP2's default): True, except for the root, which its first forward sets to False (Iteration).
        self.auto_reshard_after_forward = reshard_after_forward is None
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        # What ShardedModule's setters change (FSDP2's FSDPParamGroup attributes of the same names).
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.gradient_divide_factor: Optional[float] = None
        self.force_sum_reduction_for_comms = False
        self.reduce_scatter_unused_params = False
        # Whether reduce_gradients ran since this group's backward last began (FSDP2's POST_BACKWARD state): the
        # end of the backward runs it for the groups where it did not (inputs without gradient, unused modules).
        self.post_backward_ran = False
        # Explicit prefetching (set_modules_to_forward_prefetch, set_modules_to_backward_prefetch); empty: the
        # defaults, no forward prefetch and the previous group in the forward's order in the backward.
        self.forward_prefetch: list[ShardGroup] = []
        self.backward_prefetch: list[ShardGroup] = []
        # Shared by all the root's groups from its first forward on (FSDP2's FSDPStateContext).
        self.context = SharedContext()
        self.mp_policy = mp_policy
        self.device = device
        self._read_shards()
        self.name = ""  # the module's name under the root, set on the first forward
        self.index = 0  # position among the root's groups
        self.iteration: Optional[Iteration] = None  # set by the root's first forward
        self.gathered = False
        # The pre-hook each sub-module holding some of the group's parameters has while the group is not gathered
        # (_refuse_a_forward_on_shards): (module, hook id, hook), set by fully_shard, put in place by reshard() and taken
        # out by unshard(), so that a forward, gathered, meets no hook (nor does torch.compile trace one there).
        self.outside_forward_checks: list[tuple[nn.Module, int, Callable]] = []
        self.pending: Optional[tuple[dist.Work, torch.Tensor]] = None  # an all-gather under way, and its buffer
        # False: the backward keeps the whole gradients on the whole parameters, unreduced, and the next
        # backward adds into them (ShardedModule.set_requires_gradient_sync; FSDP2's reduce_grads).
        self.requires_gradient_sync = True
        # Where one call sharded several modules (``fully_shard([norm, head])``): those still to run forward in this
        # pass, FSDP2's _modules_to_run_forward. The first one's forward gathers, the last one's reshards.
        self.modules_to_run: set[int] = set()
        # Between the forward that gathered and the end of that pass (FSDP2's group state FORWARD): a module of the
        # group that runs then finds its parameters in place; one that runs after (a head called chunk by chunk
        # after the model's forward skipped it) gathers them again and has its own backward reduce them.
        self.forward_open = False
        self._forward_start = 0.0
        self._backward_start: Optional[float] = None

    def _read_shards(self) -> None:
        """The device and dtypes, read from the shards (again after a ``module.to()`` changed them, as FSDP2 reads
        them at its first forward). Mixed precision (FSDP2's _fsdp_param.py, init_dtype_attrs): each whole
        parameter, and so the forward, the backward and its part of the all-gather, in its ``compute_dtype``: the
        policy's ``param_dtype`` for a floating-point parameter (frozen or not), its own dtype for any other (an
        integer is never cast); the gradients reduced in ``reduce_dtype``, then handed to the shards in their own
        dtype. A dtype that needs no cast counts as none. The all-gather carries the parameters in ``gather_dtype``:
        their compute dtype where they share one, else their bytes (``torch.uint8``), as FSDP2's
        ``foreach_all_gather`` carries inputs of several dtypes (``_get_all_gather_input_metadatas``)."""
        if self.params:
            self.device = self.params[0].padded.device
        # Collectives overlap compute only off the CPU, where FSDP2's overlap (its CUDA streams) is
        # too; on the CPU each is waited for at once (the module docstring, step 5, says why).
        self.overlap = self.device.type != "cpu"
        policy = self.mp_policy
        self.reduce_dtype = None if policy.reduce_dtype == policy.param_dtype else policy.reduce_dtype
        for p in self.params:
            cast = policy.param_dtype is not None and p.padded.dtype.is_floating_point
            p.compute_dtype = policy.param_dtype if cast else p.padded.dtype
        compute_dtypes = {p.compute_dtype for p in self.params}
        self.gather_dtype = compute_dtypes.pop() if len(compute_dtypes) == 1 else torch.uint8
        # What the group's whole parameters hold while gathered: every rank's padded rows of each (the
        # storage unshard allocates, and reshard resizes to nothing).
        self._gathered_nbytes = sum(p.shard_numel * p.compute_dtype.itemsize for p in self.params) * self.world_size

    def reshard_for_state_dict(self) -> None:
        """Before a state dict is read or loaded: the shards on the modules, never gathered copies (FSDP2's alike), and
        the group's device read from them again: after ``to_empty()`` from the meta device, before any forward, the
        DTensors' mesh must be made on the shards' new device, not on the meta device."""
        self.reshard()
        self.follow_moved_shards()

    def follow_moved_shards(self) -> None:
        """Rebuild what gathers from the shards that ``module.to(...)`` gave new data (:meth:`ShardedParameter.
        follows_shard`), and the group's device and dtypes from them."""
        moved = [p for p in self.params if not p.follows_shard()]
        for p in moved:
            p.repad()
        if moved:
            self._read_shards()

    def gathered_bytes(self) -> int:
        """Bytes of the whole parameters held now: all of them while gathered, none once resharded."""
        return self._gathered_nbytes if self.gathered else 0

    # ---- all-gather ----------------------------------------------------------------------------

    def launch_all_gather(self) -> None:
        """Copy-in and start the all-gather (asynchronous); :meth:`unshard` finishes it."""
        if self.gathered or self.pending is not None or not self.params:
            return
        self.follow_moved_shards()
        start = time.time()
        sizes = self._slot_sizes()
        slot = sum(sizes)
        flat = torch.empty(slot * self.world_size, dtype=self.gather_dtype, device=self.device)
        mine = flat.narrow(0, slot * self.rank, slot)
        torch._foreach_copy_(list(torch.split(mine, sizes)), self._gather_inputs())
        work = _all_gather(flat, mine, group=self.process_group, async_op=True)
        self._record_when_done(work, "all-gather", start)
        self.pending = (work, flat)
        if not self.overlap:  # FSDP2 on the CPU: the all-gather is done when the call returns
            observe_wait(work)
            if self.iteration is not None:
                self.iteration.poll(waited=work)

    def _slot_sizes(self) -> list[int]:
        """How many elements of ``gather_dtype`` each parameter's padded rows take in a rank's slot of the
        all-gather: their number, or their bytes where the all-gather carries bytes."""
        return [p.shard_numel * p.compute_dtype.itemsize // self.gather_dtype.itemsize for p in self.params]

    def _gather_inputs(self) -> list[torch.Tensor]:
        """What each parameter copies into this rank's slot: its padded rows, which the copy casts to the group's
        one compute dtype, as FSDP2's all-gather inputs are cast (to(param_dtype)); where the group has several,
        the rows cast to their own compute dtype first, then seen as bytes (a copy of bytes casts nothing), as
        FSDP2's ``foreach_all_gather`` views each input (``t.view(torch.uint8)``)."""
        if self.gather_dtype != torch.uint8:
            return [p.padded for p in self.params]
        return [p.padded.to(p.compute_dtype).view(torch.uint8) for p in self.params]

    def unshard(self) -> None:
        """The whole parameters on the module: wait for (or run) the all-gather, then copy-out."""
        if self.gathered or not self.params:
            return
        self.launch_all_gather()
        work, flat = self.pending
        observe_wait(work)
        self.pending = None
        start = time.time()
        if self.iteration is not None:
            self.iteration.poll(waited=work)
        sizes = self._slot_sizes()
        outs, joined = [], []
        for p in self.params:
            if p.gathered is None:  # its own buffer, so that each full parameter starts a fresh allocation
                p.gathered = torch.empty(p.shard_numel * self.world_size, dtype=p.compute_dtype, device=self.device)
            else:
                p.gathered.untyped_storage().resize_(p.shard_numel * self.world_size * p.gathered.element_size())
            slots = p.gathered.view(self.world_size, -1)
            if p.dim != 0:  # the slots land beside it first, then are joined along the dimension cut
                slots = torch.empty_like(slots)
                joined.append((p, slots))
            outs.append(slots.view(self.gather_dtype))  # as bytes where the all-gather carried bytes (FSDP2 alike)
        # Refilling the storage autograd saved is no in-place change of those values: keep their versions. A buffer
        # first made under torch.inference_mode() (an evaluation before any training, as FSDP2 runs one) has none.
        versioned = tuple(p.gathered for p in self.params if not p.gathered.is_inference())
        with torch.autograd._unsafe_preserve_version_counter(versioned):
            torch.split_with_sizes_copy(flat.view(self.world_size, -1), sizes, dim=1, out=outs)
            for p, slots in joined:
                p.whole_from_slots(slots, out=p.gathered)
        for p in self.params:
            if p.full is None:
                view = p.gathered[: p.full_size.numel()].view(p.full_size)  # the padding rows left out
                p.full = nn.Parameter(view, requires_grad=p.shard.requires_grad)
                p.refuse_gradient_of_shard()
            elif p.full.requires_grad != p.shard.requires_grad:  # frozen or unfrozen since: FSDP2 copies the flag at
                p.full.requires_grad_(p.shard.requires_grad)  # every gather (to_unsharded, set_requires_grad_if_needed)
                p.refuse_gradient_of_shard()
            p.set_on_modules(p.full)
        self.gathered = True
        for module, hook_id, _ in self.outside_forward_checks:
            module._forward_pre_hooks.pop(hook_id, None)
        self._record("copy-out", start)
        observe_storage("parameters", [p.gathered for p in self.params])
        if self.iteration is not None:  # the all-gather's buffer (and the slots joined) are still held here
            self.iteration.note_memory(extra=flat.untyped_storage().nbytes() + sum(
                slots.untyped_storage().nbytes() for _, slots in joined))

    def reshard(self) -> None:
        """The shards back on the module; the gathered storage released."""
        if not self.gathered:
            return
        for p in self.params:
            p.set_on_modules(p.shard)
            p.gathered.untyped_storage().resize_(0)
        self.gathered = False
        for module, hook_id, hook in self.outside_forward_checks:
            module._forward_pre_hooks[hook_id] = hook

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group the parameters are sharded over (torch.distributed's collectives take registered groups only,
        and torch.distributed holds those until they are destroyed)."""
        return self._live(self._process_group)

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        """HSDP's other group: the ranks that hold the same shards as this one."""
        return self._live(self._replicate_group)

    def dtensor_mesh(self) -> DeviceMesh:
        """The mesh FSDP2's DTensors of this group's parameters live on: the one given to ``fully_shard``, else one
        made from the group. A mesh made from a group holds the group (its _pg_registry): made for each state dict,
        never kept here, so that the group still ends with destroy_process_group() (the process-group note in
        __init__)."""
        return self._mesh or DeviceMesh.from_group(self.process_group, self.device.type)

    @staticmethod
    def placements(p: ShardedParameter, mesh: DeviceMesh) -> tuple:
        """FSDP2's placements of ``p`` on ``mesh``: ``Shard(dim)``, replicated over HSDP's first dimension."""
        return (Shard(p.dim),) if mesh.ndim == 1 else (Replicate(), Shard(p.dim))

    def as_dtensor(self, p: ShardedParameter, rows: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """``rows`` (this rank's of ``p``) as FSDP2's parameter DTensor on ``mesh``: an alias, not a copy."""
        stride = torch.empty(p.full_size, device="meta").stride()
        return DTensor.from_local(rows, mesh, self.placements(p, mesh), run_check=False, shape=p.full_size,
                                  stride=stride)

    def own_rows(self, p: ShardedParameter, value: torch.Tensor, mesh: Optional[DeviceMesh]) -> torch.Tensor:
        """This rank's rows of ``p`` in ``value``, a tensor loaded for it: a DTensor laid out as :meth:`as_dtensor`
        lays ``p`` out on ``mesh`` gives its local rows (an alias); one laid out otherwise is gathered whole first (a
        collective); a whole plain tensor (``p``'s full size) is cut as the shards were cut; rows are kept (an
        optimizer's state of another shape: a module's state dict is refused any other shape before it comes here).
        Detached: a loaded value is data, and ``load_state_dict(assign=True)`` registers what this returns as the
        parameter, which must be a leaf (the local rows of an ``nn.Parameter(DTensor)`` are a view in its graph)."""
        value = value.detach()
        if isinstance(value, DTensor):
            laid_out_alike = value.device_mesh == mesh and value.placements == self.placements(p, mesh)
            value = value.to_local() if laid_out_alike else value.full_tensor()
        if value.shape == p.full_size:
            chunks = torch.chunk(value, self.world_size, dim=p.dim)
            value = chunks[self.rank] if self.rank < len(chunks) else value.narrow(p.dim, 0, 0)
        return value

    def _live(self, reference: weakref.ref) -> dist.ProcessGroup:
        group = reference()
        if group is None:
            raise RuntimeError(
                f"the process group that {_class_name(self.module)} was sharded over is destroyed "
                f"(torch.distributed.destroy_process_group()): shard the module again in a new group to use it"
            )
        return group

    def drop_pending(self) -> None:
        """A prefetched all-gather that the backward did not use (its group's backward never ran): finish
        it, so that no collective is left behind, and forget its result."""
        if self.pending is not None:
            observe_wait(self.pending[0])
            self.pending = None

    # ---- reduce-scatter ------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Reduce-scatter the full gradients, divide them as FSDP2 does, hand rank r's rows to the shards.

        Run after each forward's part of the backward (FSDP2's post_backward, run as often): with two forwards
        before one backward, the first run may come before autograd has summed both forwards' gradients into the
        whole parameters (it does so once, when both are in); that run finds none, frees the parameters, and
        the next forward's part of the backward gathers them again and reduces the sum."""
        self.post_backward_ran = True
        self.forward_open = False
        self.close_backward()
        if not self.requires_gradient_sync:
            # FSDP2 (_fsdp_param_group.py, post_backward with reduce_grads False): reshard and return; the
            # whole gradient stays on the whole parameter, ``p.full`` (one nn.Parameter for every gather, its
            # .grad in storage of its own, which resharding does not free), where autograd adds the next
            # backward's into it; the next synchronised backward reduce-scatters the sum.
            if self.reshard_after_backward:
                self.reshard()
            if self.reduce_dtype is not None:  # FSDP2 sums them in the reduce dtype (to_accumulated_grad_if_needed)
                for p in filter(ShardedParameter.has_whole_gradient, self.params):
                    whole = p.take_whole_gradient()
                    p.accumulated = whole if whole.dtype == self.reduce_dtype else whole.to(self.reduce_dtype)
            return
        taken = [(p, p.take_whole_gradient()) for p in self.params]
        if self.reduce_scatter_unused_params:  # zeros for those this rank did not use, so every rank sends alike
            taken = [(p, torch.zeros_like(p.full) if grad is None and p.full is not None and p.shard.requires_grad
                      else grad) for p, grad in taken]
        with_grad = [p for p, grad in taken if grad is not None]
        _refuse_gradients_of_two_dtypes(with_grad)  # unfrozen since the first forward checked (FSDP2's foreach_reduce)
        grads = [p.slots_from_whole(grad) for p, grad in taken if grad is not None]
        del taken
        if self.reshard_after_backward:  # else the whole parameters stay for the next forward (FSDP2 alike)
            self.reshard()
        if not grads:
            return
        # One reduce-scatter in flight at a time, as FSDP2 (reduce_scatter_max_input_buffers=1): the
        # previous group's, which overlapped this group's backward, ends before this one's buffer exists.
        # Collectives are launched with async_op=True on every backend (on the CPU, waited for at once);
        # the order in which they are launched, the same on every rank, is what matches them up.
        self.iteration.finish_reductions()
        start = time.time()
        factor = self.gradient_divide_factor
        reduce_dtype = self.reduce_dtype or grads[0].dtype
        before, scale, op, all_reduce_op, after = division(
            reduce_dtype, self.world_size, factor, self.force_sum_reduction_for_comms, self.replicas)
        slot = sum(p.shard_numel for p in with_grad)
        flat = torch.empty(slot * self.world_size, dtype=reduce_dtype, device=self.device)
        # Slot r holds rank r's rows of every gradient, each padded with zeros to chunk 0's size (and cast to
        # the reduce dtype, as FSDP2's copy-in casts them).
        torch._chunk_cat(grads, 0, self.world_size, out=flat.view(self.world_size, -1))
        del grads
        if before is not None:
            flat.div_(before)
        if self.world_size == 1:
            # FSDP2 runs no collective for one rank: it copies the input divided by a custom factor (between the
            # two divisions in float64, so that such a gradient is divided by the factor twice, as FSDP2 does).
            if factor is not None:
                flat.div_(factor)
        elif scale is not None:
            flat.mul_(scale)
        mine = torch.empty(slot, dtype=flat.dtype, device=self.device)
        self.iteration.poll()
        self.iteration.note_memory(extra=flat.untyped_storage().nbytes() + mine.untyped_storage().nbytes())
        work = _reduce_scatter(mine, flat, op=op, group=self.process_group, async_op=True)
        self._record_when_done(work, "reduce-scatter", start)
        self.iteration.reductions.append((self, work, mine, flat, with_grad, all_reduce_op, after))
        if not self.overlap:  # FSDP2 on the CPU: wait at once, and ``flat`` is freed before the next backward
            self.iteration.finish_reductions()

    def finish_reduction(self, work: dist.Work, mine: torch.Tensor, flat: torch.Tensor,
                         with_grad: list[ShardedParameter], all_reduce_op: dist.ReduceOp,
                         after: Optional[float]) -> None:
        # ``flat``, the reduce-scatter's input, stayed referenced (in Iteration.reductions) until this
        # wait: the collective reads it in the background.
        observe_wait(work)
        self.iteration.poll(waited=work)
        if self._replicate_group is not None:  # HSDP: the shards reduced, then summed over their replicas
            if self.partial_reduction is not None:
                mine += self.partial_reduction
            self.partial_reduction = None if self.requires_all_reduce else mine
            if not self.requires_all_reduce:
                return
            start = time.time()
            dist.all_reduce(mine, op=all_reduce_op, group=self.replicate_group)
            self._record("all-reduce", start)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(mine)
        if after is not None:
            mine.div_(after)
        dtype = with_grad[0].shard.dtype  # one for them all (_refuse_gradients_of_two_dtypes), FSDP2's orig_dtype
        if mine.dtype != dtype:  # FSDP2: the sum, divided, in the shards' dtype for the optimizer
            mine = mine.to(dtype)
        offset = 0
        for p in with_grad:
            grad = mine[offset : offset + p.shard.numel()].view(p.shard.size())  # this rank's rows, not its padding
            if p.shard.grad is None:
                p.shard.grad = grad
            else:
                p.shard.grad += grad
            # The shard's gradient is final: its post-accumulate-grad hooks run now, as FSDP2 runs them (an
            # optimizer step inside the backward registers one); autograd never accumulates into the shard itself.
            for hook in (p.shard._post_accumulate_grad_hooks or {}).values():
                hook(p.shard)
            offset += p.shard_numel

    # ---- the hooks -----------------------------------------------------------------------------

    @_not_traced
    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.iteration is None:
            Iteration(self)  # the first group to run forward is the root
        iteration = self.iteration
        args, kwargs = self.cast_inputs(args, kwargs)
        if iteration.backward_started:  # recomputation inside the backward (checkpointing)
            self.unshard()
            return args, kwargs
        if iteration.forward_root is None:
            iteration.begin_forward(self)
        self.forward_open = True
        self.unshard()
        for target in self.forward_prefetch:  # FSDP2: after this group's copy-out, in the order given
            target.launch_all_gather()
        iteration.poll()
        if torch.is_grad_enabled():
            inputs = [t for _, t in tensors_in((args, kwargs)) if t.requires_grad]
            if inputs:
                outputs = iter(_PostBackward.apply(self, *inputs))
                args, kwargs = map_tensors(lambda t: next(outputs) if t.requires_grad else t, (args, kwargs))
        self._forward_start = time.time()
        return args, kwargs

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Floating-point inputs to the policy's ``param_dtype`` where it asks for it (FSDP2's _cast_forward_inputs)."""
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    @_not_traced
    def after_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        iteration = self.iteration
        if iteration.backward_started:
            return self._cast_output(output)
        self.finish_forward(output)
        if iteration.forward_root is self:
            output = iteration.end_forward(output)
        return self._cast_output(output)

    def finish_forward(self, output: Any) -> None:
        """The group's forward pass is over (FSDP2's ``post_forward``): free the parameters (``reshard_after_forward``),
        note its place in the forward's order, and have ``output``'s gradients gather them for the backward.

        Freed whatever ``reshard_after_forward`` says where a forward inside this one already closed the pass: a
        method of :func:`register_fsdp_forward_method` that calls the module (a ``generate`` calling ``forward``), or
        one called inside its forward. FSDP2 keeps the parameters only while the group is in its forward state, which
        the inner pass's end left (``FSDPParamGroup.reshard``); kept, the outer call's gathered copy would serve the
        next forward after an optimizer step, and give an optimizer built then the whole parameters."""
        self._record("forward", self._forward_start)
        inner_pass_closed = not self.forward_open
        self.forward_open = False
        if self.reshard_after_forward or inner_pass_closed:
            self.reshard()
        self.iteration.left_forward(self)
        if torch.is_grad_enabled():
            for _, tensor in tensors_in(output):
                if tensor.requires_grad:
                    if tensor._base is not None:  # FSDP2's warning (_fsdp_state.py, _register_pre_backward_hook)
                        warnings.warn(
                            f"FSDP2-wrapped module ({', '.join(type(m).__name__ for m in self.members) or '?'}) "
                            "returned a view tensor. An in-place op on this view (e.g., `x += y`) will silently drop "
                            "the pre-backward hook and skip the all-gather, which can cause backward to fail or "
                            "produce wrong gradients. Use out-of-place ops (`out = out + y`, not `out += y`) or "
                            "`.clone()` the output before any in-place op.", UserWarning, stacklevel=2)
                    tensor.register_hook(self._before_backward)

    def _cast_output(self, output: Any) -> Any:
        """Floating-point outputs to the policy's ``output_dtype`` (FSDP2's _cast_output_dtype), after the hooks
        went on the outputs as the module made them."""
        if self.mp_policy.output_dtype is None:
            return output
        return cast_floating(output, self.mp_policy.output_dtype)

    @_not_traced
    def _before_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self._backward_start is None:
            self._backward_start = time.time()
        self.iteration.before_backward(self)
        return grad

    def close_backward(self, end: Optional[float] = None) -> None:
        """End this group's ``"backward"`` span (at ``end``, else now), if one is open: its module's backward is done."""
        if self._backward_start is not None:
            self._record("backward", self._backward_start, end)
            self._backward_start = None

    def _record(self, stage: str, start: float, end: Optional[float] = None) -> None:
        """One event of this rank's timeline (:func:`sharded_timeline`); ``bucket`` is the group's index."""
        if self.iteration is not None:
            self.iteration.events.append({"rank": dist.get_rank(), "stage": stage, "bucket": self.index,
                                          "group": self.name, "start": start, "end": time.time() if end is None else end})

    def _record_when_done(self, work: dist.Work, stage: str, start: float) -> None:
        """Record a collective from its launch to when this rank first sees it complete (:meth:`Iteration.poll`)."""
        if self.iteration is not None:
            self.iteration.open_collectives.append((self, work, stage, start))


def _refuse_parameters_on_meta(root: nn.Module) -> None:
    """Refuse, at the root's first forward and before anything is gathered, a group whose registered parameters are
    still on the meta device (a model built there, sharded, and not yet given storage by ``to_empty``), naming them
    under the root, in FSDP2's words (``_fsdp_param_group.py``, ``_validate_no_meta_params``, at its lazy init):
    gathering them would fail deep inside the all-gather, saying neither which parameters nor what to do."""
    names: dict[int, str] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)  # a tied weight by its first name, as FSDP2's fully qualified names
    for group in sharded_groups(root):
        registered = [p.module._parameters.get(p.name) for p in group.params]  # to_empty() registers new ones
        on_meta = [names.get(id(param), p.path) for p, param in zip(group.params, registered) if param.is_meta]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the following were "
                f"still on meta device: {on_meta}\nFor example, call module.to_empty(device) to materialize to device "
                "and call module.reset_parameters() on each module to initialize values.")


def _refuse_gradients_of_two_dtypes(params: list[ShardedParameter]) -> None:
    """Refuse ``params``, the parameters of one group whose gradients would be reduced together, if they have several
    dtypes: one reduce-scatter buffer carries their gradients, in one dtype, and hands them back to the shards in
    their dtype. Only the all-gather carries several (as bytes); frozen parameters have no gradient. FSDP2 refuses
    them too, with ``AssertionError`` (the type raised here, so that code that catches FSDP2's finds it): at its first
    forward ("FSDP expects uniform original parameter dtype", ``_init_mp_dtypes``), where :class:`Iteration` checks
    the parameters that require gradients, and at the reduce-scatter ("FSDP reduce-scatter expects uniform gradient
    dtype", ``foreach_reduce``: one unfrozen since), where :meth:`ShardGroup.reduce_gradients` checks those with one."""
    if len({p.shard.dtype for p in params}) <= 1:  # the case of every step: no names gathered
        return
    by_dtype: dict[torch.dtype, list[str]] = {}
    for p in params:
        by_dtype.setdefault(p.shard.dtype, []).append(f"'{p.path}'")
    found = "; ".join(f"{dtype} for {', '.join(names)}" for dtype, names in by_dtype.items())
    raise AssertionError(
        f"fully_shard: the parameters of one fully_shard call that get gradients must share one dtype (their "
        f"gradients are reduced in one buffer; FSDP2 expects a uniform dtype too), found {found}. Freeze those "
        f"that need none (requires_grad_(False): a frozen parameter of any dtype is gathered beside the others), "
        f"cast the module to one dtype (mp_policy computes in another), shard the others by a fully_shard call "
        f"of their own (on their sub-module, first), or leave them out (ignored_params)")


class Iteration:
    """What the groups under one root share: the order they ran in, the reductions under way, the timeline."""

    def __init__(self, root: ShardGroup) -> None:
        # FSDP2 (_fsdp_param_group.py, _init_mp_dtypes, at its lazy init: the root's first forward) refuses a group
        # whose trainable parameters have several dtypes here, before anything is gathered or set.
        for group in sharded_groups(root.module):
            _refuse_gradients_of_two_dtypes([p for p in group.params if p.shard.requires_grad])
        _refuse_parameters_on_meta(root.module)
        self.groups: list[ShardGroup] = []
        for name, module in root.module.named_modules():
            group = _group_of(module)
            if group is None or group in self.groups:
                continue
            if group.iteration is not None:
                raise RuntimeError(
                    f"fully_shard: '{name}' already ran forward as the root of its own groups; run the forward "
                    f"of the outermost sharded module first")
            group.iteration, group.name, group.index = self, name, len(self.groups)
            group.context = root.context
            self.groups.append(group)
        # FSDP2 (_fsdp_state.py, _lazy_init): the root keeps its parameters after the forward unless told
        # otherwise, as the backward would gather them again at once.
        if root.auto_reshard_after_forward:
            root.reshard_after_forward = False
        self.forward_root: Optional[ShardGroup] = None
        self.post_forward_order: list[ShardGroup] = []  # the backward prefetches in its reverse
        self.backward_started = False
        self.reductions: list[tuple] = []
        self.events: list[dict] = []
        self.peak_transient = 0  # bytes held at once: gathered parameters, all-gather and reduce-scatter buffers
        self.open_collectives: list[tuple[ShardGroup, dist.Work, str, float]] = []

    def poll(self, waited: Optional[dist.Work] = None) -> None:
        """Stamp the end of the collectives that have completed since the last look (at every hook: the
        timeline's ends are late by at most the time between two hooks), and of ``waited``."""
        still_open = []
        for group, work, stage, start in self.open_collectives:
            if work is waited or work.is_completed():
                group._record(stage, start)
            else:
                still_open.append((group, work, stage, start))
        self.open_collectives = still_open

    def note_memory(self, extra: int = 0) -> None:
        """Update :attr:`peak_transient` with what is held now: the gathered parameters, the buffers of the
        reduce-scatters under way and of the all-gathers launched and not yet copied out (a prefetch), plus ``extra``
        bytes the caller holds (the buffer it is copying out of, or reducing)."""
        gathered = sum(g.gathered_bytes() for g in self.groups)  # a sum per group, not per parameter
        in_flight = sum(r[1].untyped_storage().nbytes() + r[2].untyped_storage().nbytes() for _, *r in self.reductions)
        pending = sum(g.pending[1].untyped_storage().nbytes() for g in self.groups if g.pending is not None)
        self.peak_transient = max(self.peak_transient, gathered + in_flight + pending + extra)

    def finish_reductions(self) -> None:
        """Wait for the reduce-scatters under way and hand their rows to the shards' ``.grad``."""
        for group, *reduction in self.reductions:
            group.finish_reduction(*reduction)
        self.reductions = []

    def begin_forward(self, root: ShardGroup) -> None:
        self.forward_root = root
        self.post_forward_order, self.events = [], []
        self.peak_transient = 0
        self.open_collectives = []

    def left_forward(self, group: ShardGroup) -> None:
        self.post_forward_order.append(group)

    def end_forward(self, output: Any) -> Any:
        """The root's forward is over: a group of several modules (``fully_shard([norm, head])``) some of which did not
        run (the chunked-loss pattern: the model's forward stops before the head) is completed here, as torch 2.13's
        FSDP2 completes it (``_force_complete_incomplete_states``; its 2.11 kept it gathered and reduced wrong
        gradients): freed, and gathered again by the gradients of the root's ``output``. A module of it called after
        that (the head, chunk by chunk) gathers the group anew at each call, and each call's backward reduces its
        gradients into the shards. Returns ``output``, cast to each completed group's ``output_dtype``."""
        self.forward_root = None
        for group in reversed(self.groups):
            if group.modules_to_run:
                group.modules_to_run.clear()
                group.finish_forward(output)
                output = group._cast_output(output)
        return output

    def before_backward(self, group: ShardGroup) -> None:
        self.poll()
        group.forward_open = False
        if not self.backward_started:
            self.backward_started = True
            Variable._execution_engine.queue_callback(self.end_backward)
            # The root's backward begins with the first gradient to reach any group: its own hook on the same
            # output may run after this group's (and its all-gather)
            root = self.groups[0]
            if root._backward_start is None:
                root._backward_start = group._backward_start
        group.post_backward_ran = False
        if group.unshard_in_backward:
            group.unshard()
        # Prefetch, as FSDP2's backward does: the group that finished its forward just before this one
        # is the next to run backward; its all-gather runs while this group computes. Modules named by
        # set_modules_to_backward_prefetch replace that default.
        if group in self.post_forward_order:
            position = self.post_forward_order.index(group)
            self.post_forward_order.remove(group)
            if position > 0 and not group.backward_prefetch:
                self._prefetch_for_backward(self.post_forward_order[position - 1])
        for target in group.backward_prefetch:
            self._prefetch_for_backward(target)

    @staticmethod
    def _prefetch_for_backward(target: ShardGroup) -> None:
        if target.unshard_in_backward:  # FSDP2's unshard() does nothing in the backward for such a group
            target.launch_all_gather()

    @_not_traced
    def end_backward(self) -> None:
        """After the whole backward: reduce the groups whose reduction did not run (inputs that needed no gradient,
        a module this rank did not use), the root first, then in module order, as FSDP2's
        ``_root_post_backward_final_callback``; on the last backward
        (:class:`SharedContext`) wait for every reduce-scatter and drop unused prefetches; free what is still
        gathered, except where ``reshard_after_backward`` is off."""
        late = [group for group in self.groups if not group.post_backward_ran]
        # Autograd is done: every group still open ends its backward now, at one moment, before any of them reduces
        # (the root's reduce-scatter is no part of a sub-module's backward), so the root's span holds theirs.
        done = time.time()
        for group in late:
            group.close_backward(done)
        for group in late:
            group.reduce_gradients()
        last = self.groups[0].context.is_last_backward
        if last:
            self.finish_reductions()
        for group in self.groups:
            if last:
                group.drop_pending()
            if group.reshard_after_backward:
                group.reshard()
        self._forget_backward()

    def reset(self) -> None:
        """After a forward or backward that raised (FSDP2's ``reset_iter_state``): wait for the collectives in
        flight and discard their results (the failed step's gradient reductions are lost), put every group's
        shards back, and forget the step, so that the next forward starts afresh."""
        for _, work, *_ in self.reductions:
            observe_wait(work)
        self.reductions = []
        for group in self.groups:
            group.drop_pending()
            group.reshard()
            group.partial_reduction = None
        self.open_collectives = []
        self._forget_backward()

    def _forget_backward(self) -> None:
        # FSDP2's _root_post_backward_final_callback: a module of a group called on its own after the root's forward
        # (the head, chunk by chunk) opened a pass that no forward of the whole group closed; it ends here.
        for group in self.groups:
            group._backward_start = None
            group.post_backward_ran = False
            group.forward_open = False
            group.modules_to_run.clear()
        self.forward_root = None
        self.backward_started = False
        self.post_forward_order = []


# A sharded module keeps its group in its own __dict__, so that the two live and die together. (A module-level
# WeakKeyDictionary would keep both for good: its value, the group, holds the module that is its key.)
_GROUP = "_minidp_shard_group"


def _group_of(module: nn.Module) -> Optional[ShardGroup]:
    """The group that ``fully_shard`` made of ``module``, if it was applied to it."""
    return module.__dict__.get(_GROUP)


class ShardedModule(FSDPModule):
    """FSDP2's ``FSDPModule`` methods, on the modules ``fully_shard`` shards.

    FSDP2 returns the module itself, its class swapped for a subclass of (``FSDPModule``, its class),
    and users call the methods of ``FSDPModule`` on it (``model.set_requires_gradient_sync(False)``).
    ``fully_shard`` does the same with this class: ``type(module)`` becomes ``Sharded<its class>``
    (one per class, made once: :func:`~minidp.distributed.isinstance_only.give_methods`), so that the module keeps
    its attributes, its forward and
    ``isinstance`` to its class, and gains these methods. The state stays in the module's group.

    A subclass of torch's ``FSDPModule`` so that ``isinstance(module, FSDPModule)`` holds, as code that drives FSDP2
    checks it (Lightning Fabric's ``no_backward_sync`` switches the gradient sync off on such modules only): the
    methods defined here are minidp's own, FSDPModule's others are refused by name
    (:mod:`minidp.distributed.isinstance_only`). ``Sharded<cls>(...)``, as a container makes its slices
    (``sequential[1:]``), builds a plain ``cls``, as FSDP2's ``FSDPModule.__new__`` does: it finds ``cls`` at
    ``_orig_cls_mro_index`` in the class's MRO, (Sharded<cls>, ShardedModule, FSDPModule, cls, ...).
    """

    _orig_cls_mro_index = 3

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether the backward reduce-scatters the gradients: ``False`` for gradient accumulation without
        communication (FSDP1's ``no_sync``). Unsynchronised backwards keep each whole gradient on the whole
        parameter, summed over the backwards by autograd; the next backward with ``True`` reduce-scatters
        the sum into the shards' ``.grad``. ``recurse``: every sharded module under this one (this one
        included), else this one's group only (FSDP2's ``FSDPModule.set_requires_gradient_sync``)."""
        for group in _groups_under(self, recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP (a 2-D mesh): whether the backward all-reduces the reduced shards over their replicas. ``False``
        sums them here instead (gradient accumulation with the reduce-scatter only); the next backward with
        ``True`` adds them to its own and all-reduces the sum (FSDP2's ``FSDPModule.set_requires_all_reduce``).
        Without a replicate dimension there is no all-reduce, and it changes nothing."""
        for group in _groups_under(self, recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the forward frees the whole parameters (the backward gathers them again): ``fully_shard``'s
        argument, changed at run time, e.g. ``False`` for evaluation. Setting it on the root overrides FSDP2's
        default there (keep them). ``recurse`` as for :meth:`set_requires_gradient_sync`."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for group in _groups_under(self, recurse):
            group.reshard_after_forward = reshard_after_forward
            group.auto_reshard_after_forward = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether the backward frees the whole parameters. ``False`` keeps them for the next forward, which then
        gathers nothing: for the micro-batches of gradient accumulation, more memory for less communication.
        As in FSDP2, the next forward uses them as they are, so set it back to ``True`` before the backward
        that precedes an optimizer step (else that forward reads the parameters of before the step)."""
        for group in _groups_under(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: this module's backward needs none of its parameters' values (an embedding's), so the
        backward does not gather them; their gradients are reduced as ever (not recursive)."""
        _own_group(self).unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Sharded modules whose all-gathers this module's forward starts, after gathering its own, in this
        order (FSDP2 prefetches nothing in the forward unless told): more overlap, more memory held."""
        _own_group(self).forward_prefetch = _groups_of_modules(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Sharded modules whose all-gathers this module's backward starts, in place of the default, the
        module that ran just before it in the forward."""
        _own_group(self).backward_prefetch = _groups_of_modules(modules)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce-scatter zeros for the parameters this rank's backward gave no gradient: needed where ranks use
        different parameters of a group (conditional branches, mixtures of experts), else the ranks would send
        different gradients to one reduce-scatter (DDP's ``find_unused_parameters`` for sharding)."""
        for group in _groups_under(self, recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step; ``False`` for the micro-batches
        before it, whose end then leaves collectives in flight (:class:`SharedContext`). Shared by the root's
        groups from its first forward on."""
        _own_group(self).context.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the number of ranks (:func:`division` says
        how, as FSDP2 does it). Not recursive."""
        _own_group(self).gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`, deprecated there as here."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Optional[Any] = None) -> None:
        """Call ``hook(reduced)`` on this rank's flat reduced gradient rows of this module's group, in place, at each
        reduction: after the reduce-scatter, or after HSDP's all-reduce, and before FSDP2's division after the
        collectives (FSDP2's ``FSDPModule.set_all_reduce_hook``; an all-reduce of one's own over another group, say).
        Not recursive. ``stream``: FSDP2 runs the hook on it; minidp runs collectives and hook on the current stream,
        so it takes none (and, as FSDP2, never one with HSDP)."""
        group = _own_group(self)
        if stream is not None:
            if group._replicate_group is not None:
                raise ValueError("stream cannot be set when using native HSDP")
            raise NotImplementedError("set_all_reduce_hook: minidp runs the hook on the current stream; leave stream "
                                      "unset")
        group.all_reduce_hook = hook

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``SUM`` only, dividing before and after, never with ``AVG`` (:func:`division`). Not
        recursive."""
        _own_group(self).force_sum_reduction_for_comms = enable

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """FSDP2's default, 1 (one reduce-scatter input buffer in flight), is what minidp does
        (:meth:`ShardGroup.reduce_gradients`): taken, it changes nothing; more is refused, as FSDP2's own."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):  # FSDP2's checks and words
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        if max_input_buffers != 1:
            raise NotImplementedError(_fsdp2s_own("set_reduce_scatter_max_input_buffers"))

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2's default, ``False`` (staging buffers from torch's allocator), is what minidp does: taken, it changes
        nothing; ``True`` (the process group's allocator) is refused, as FSDP2's own."""
        if enable:
            raise NotImplementedError(_fsdp2s_own("set_allocate_memory_from_process_group_for_comm"))

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``.to()``, ``.double()``, ``.to_empty()`` convert the shards, never the gathered copies (FSDP2's _apply):
        # free those first. The next all-gather reads what the conversion left (ShardedParameter.follows_shard).
        # Then the module's own class's (nn.Module's), past FSDPModule's, which would re-register FSDP2's shards.
        _own_group(self).reshard()
        return super(FSDPModule, self)._apply(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> None:
        # As FSDP2's classes (_fully_shard.py, _unimplemented_deepcopy), with its exception type and its words (code
        # written for FSDP2 matches them): after a backward the whole parameters' storage is freed, and a copy of
        # them would read freed memory.
        raise AssertionError(
            f"FSDP does not support deepcopy. Please use state dict for serialization: copy the weights through a "
            f"state dict, e.g. full_state_dict(module) into a new {_class_name(self)} (a copy to shard, if needed)")

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's parameters now and leave them on it, whole (not recursive); its next
        forward uses them without gathering (FSDP2's ``FSDPModule.unshard``). ``async_op=True`` starts the
        all-gather and returns a handle whose ``wait()`` finishes it; the module's forward waits for it
        itself if no one did (a prefetch by hand)."""
        group = _own_group(self)
        if not async_op:
            group.unshard()
            return None
        group.launch_all_gather()
        return PendingUnshard(group)

    def reshard(self) -> None:
        """Free this module's gathered parameters and put the shards back on it (not recursive; FSDP2's
        ``FSDPModule.reshard``)."""
        _own_group(self).reshard()

    def reset_iter_state(self) -> None:
        """After an exception stopped a forward or backward midway: call it on the root, then train on
        (FSDP2's ``FSDPModule.reset_iter_state``). The failed step's gradients are lost; a gradient
        accumulation under way should start again."""
        group = _own_group(self)
        if group.iteration is None:
            return  # no forward has run: nothing to reset
        root = group.iteration.groups[0]
        if root is not group:
            raise RuntimeError(f"reset_iter_state must be called on the root sharded module (the "
                               f"{_class_name(root.module)} whose forward runs first), not on this {_class_name(self)}")
        group.iteration.reset()


def _fsdp2s_own(name: str) -> str:
    return (f"{name} is FSDP2's own (FSDPModule's, run on FSDP2's state: custom collectives, CUDA events, "
            f"communication buffers), which the modules minidp's fully_shard shards derive from for isinstance() only "
            f"and do not run; the README's fully_shard section lists what minidp provides. Use "
            f"torch.distributed.fsdp.fully_shard for it")


refuse_inherited(ShardedModule, FSDPModule, _fsdp2s_own)


class PendingUnshard(UnshardHandle):
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes that all-gather and puts the whole parameters
    on the module; a second ``wait()``, or one after the module's forward has used them, does nothing (FSDP2's
    ``UnshardHandle``, of which this is a subclass)."""

    def __init__(self, group: ShardGroup) -> None:
        self._group: Optional[ShardGroup] = group
        self._launched = group.pending  # None: the parameters were already whole

    def wait(self) -> None:
        group, self._group = self._group, None
        if group is not None and self._launched is not None and group.pending is self._launched:
            group.unshard()


def _groups_under(module: nn.Module, recurse: bool) -> list[ShardGroup]:
    """The group of ``module`` and, with ``recurse``, of every sharded module under it."""
    modules = module.modules() if recurse else [module]
    return [group for group in map(_group_of, modules) if group is not None]


def _groups_of_modules(modules: list[nn.Module]) -> list[ShardGroup]:
    """The groups of ``modules``, every one of which must be sharded itself (FSDP2's error type)."""
    groups = list(map(_group_of, modules))
    for module, group in zip(modules, groups):
        if group is None:
            raise ValueError(f"Expects a module fully_shard was applied to, got a {type(module).__name__} it was not "
                             f"applied to: {module}")
    return groups


def _own_group(module: nn.Module) -> ShardGroup:
    group = _group_of(module)
    if group is None:
        raise RuntimeError(f"this {type(module).__name__} is not sharded itself: fully_shard was not applied to it")
    return group


def _used_outside_forward(name: str, grad: torch.Tensor) -> None:
    """A gradient reached the shard of parameter ``name`` (:meth:`ShardedParameter.refuse_gradient_of_shard`)."""
    raise RuntimeError(
        f"fully_shard: parameter '{name}' was used outside a forward of the module that holds it, where it is this "
        f"rank's rows only (shape {tuple(grad.shape)}), so its gradient would be of those rows alone (FSDP2 refuses "
        f"this too: its DTensor does not mix with plain tensors). Use it inside a forward of that module, or of a "
        f"method given to register_fsdp_forward_method, where it is whole")


def _refuse_a_forward_on_shards(group: ShardGroup, module: nn.Module, args: tuple) -> None:
    """Before the forward of a module inside a group that holds some of its parameters, while the group is not
    gathered: refused, as those parameters are this rank's rows (the module called through a method other than the
    group's forward, or on its own). FSDP2 refuses it too (its DTensors do not mix with plain tensors); run on the
    rows, it gave each rank another answer, and rank 0 the right one (an embedding looks its ids up in its own rows
    where they are few enough), silently. The hook is in place only while the group is not gathered
    (``ShardGroup.outside_forward_checks``), so it raises whenever it runs: inside the group's forward there is no
    hook for dynamo to inline and guard on (always in place, it compiled the model into 4 graphs, where FSDP2's
    makes 1)."""
    raise RuntimeError(
        f"fully_shard: {_class_name(module)} runs its forward while its sharded parameters are this rank's rows "
        f"only: its group, the {' and '.join(map(_class_name, group.members))}, gathers them in its own forward, "
        f"which is not running (a method other than forward called, as generate() or encode(), or the "
        f"sub-module called on its own). Call it inside the sharded module's forward, or register the method "
        f"with register_fsdp_forward_method(module, 'method_name'), or call module.unshard() first (FSDP2 "
        f"refuses it too: its DTensor parameters do not mix with plain tensors)")


def _class_name(module: nn.Module) -> str:
    """The name of ``module``'s class before ``fully_shard`` swapped it ("Net", not "FSDPNet")."""
    return getattr(type(module), "original_class", type(module)).__name__


# Set on a parameter that a fully_shard call replaced by shards (its name there): a module that still
# holds it shares it with a sharded module.
_SHARDED_AS = "_minidp_sharded_as"


def _managed_modules(module: nn.Module) -> list[nn.Module]:
    """``module`` and its sub-modules not inside an earlier ``fully_shard`` nor given to ``replicate``, children before
    parents (FSDP2's ``_get_managed_modules``: a depth-first walk, each module after its children, that does not enter
    a module another composable API manages: replicate's parameters stay whole, reduced by its DDP)."""
    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(sub: nn.Module) -> None:
        if sub is not module and (_group_of(sub) is not None or REPLICATE_STATE in sub.__dict__):
            return
        seen.add(id(sub))
        for child in sub.children():
            if id(child) not in seen:
                visit(child)
        found.append(sub)

    visit(module)
    return found


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if _group_of(module) is not None:
        # torch's contract() refuses it with AssertionError and these words, which code written for FSDP2 may match
        raise AssertionError(
            f"Each distinct composable distributed API can only be applied to a module once: fully_shard was already "
            f"applied to this {_class_name(module)}; apply it once per module (sub-modules first, then the root)")
    if isinstance(module, (FSDPModule, nn.parallel.DistributedDataParallel)):  # minidp's DDP too: a subclass
        raise ValueError(
            f"fully_shard got a module already wrapped ({type(module).__name__}); pass the plain model, "
            f"not one that torch's fully_shard or a DistributedDataParallel already manages")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        # FSDP2's error type and words (_fsdp_init.py): code written for FSDP2 may match them
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: got a {type(module).__name__}; "
            f"shard its items one by one, or the module that calls them")


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[bool] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
    dp_mesh_dims: Optional[Any] = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> nn.Module:
    """Shard ``module``'s parameters over the ranks of ``mesh``, FSDP2's way; returns ``module``.

    Call it on the sub-modules first, then on the root: each call takes the parameters of ``module``
    not already taken by an earlier call, and gathers them together before ``module``'s forward
    (and before its backward when ``reshard_after_forward`` freed them after the forward). Every
    rank must build the same model with the same values (as for FSDP2, nothing is broadcast:
    seed every rank alike, or load a state dict on every rank); checked here on every rank.

    Args:
        module: the module whose parameters become one group; or a list of modules whose parameters become one
            group together (FSDP2's ``fully_shard([norm, head])``): gathered before the first of them runs forward,
            freed after the last one did, or at the end of the root's forward if it ran only some of them (torch
            2.13's FSDP2 alike: :meth:`Iteration.end_forward`). The list is returned.
        mesh: FSDP2's ``DeviceMesh`` (``init_device_mesh``). 1-D: the ranks to shard over. 2-D: HSDP, each
            parameter sharded over the ranks of the mesh's dimension 1 and replicated over those of its dimension 0
            (the reduced shards all-reduced over them). Default: every rank (or ``process_group``).
        reshard_after_forward: free the gathered parameters after the forward and gather them again
            in the backward (less memory); ``False`` keeps them until the backward is done. ``None``
            (FSDP2's default): ``True``, except on the root (the module whose forward runs first), whose
            parameters the backward would gather again at once. FSDP2's int: the number of ranks that
            shard is ``True``, 1 is ``False``; a number between them is refused.
        mp_policy: FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` for the whole floating-point parameters (the
            all-gather, the forward and the backward; the optimizer still steps the shards in their own
            dtype), ``reduce_dtype`` for the reduce-scatter (and for summing unsynchronised backwards),
            ``output_dtype`` for the forward's floating-point outputs, ``cast_forward_inputs`` to cast the
            floating-point inputs to ``param_dtype``.
        shard_placement_fn: FSDP2's: called on each parameter, returns ``Shard(dim)`` to cut it along ``dim``
            rather than dim 0, or ``None`` for dim 0. A dimension other than 0 must divide evenly among the ranks,
            as FSDP2 requires.
        offload_policy: FSDP2's ``OffloadPolicy()`` (nothing offloaded), or ``CPUOffloadPolicy`` for a module on
            the CPU, where the shards, gradients and optimizer state are already (FSDP2 gives the same numbers with
            it there); to offload a GPU module's shards, use FSDP2.
        ignored_params: parameters this call leaves alone (FSDP2's argument): not sharded, their gradients
            not reduced, each rank keeping its own.
        dp_mesh_dims: FSDP2's (torch 2.13): ``None`` only. Which dimensions of an SPMD mesh shard parameters that are
            DTensors already (beside tensor or expert parallelism); minidp shards plain parameters, and refuses it.
        process_group: a 1-D alternative to ``mesh``: the ranks to shard over (minidp's; give one or the other).

    After this call, ``module``'s parameters are this rank's shards (rows of dim 0, or slices along the
    dimension ``shard_placement_fn`` chose): build the
    optimizer afterwards, on ``module.parameters()``. ``module``'s class is then a subclass of
    :class:`ShardedModule` and of its own class, with FSDP2's ``set_requires_gradient_sync``,
    ``unshard`` and ``reshard``, and the setters of ``FSDPModule`` (:class:`ShardedModule`).
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...): minidp shards plain parameters over a 1-D mesh (or HSDP's 2-D one), not "
            "parameters that are DTensors of an SPMD mesh already; leave dp_mesh_dims out, or use "
            "torch.distributed.fsdp.fully_shard for a model parallelised with tensor or expert parallelism")
    roots = list(module) if isinstance(module, (list, tuple)) else [module]
    if not roots:
        raise ValueError("fully_shard got an empty list of modules; give a module, or a list of at least one")
    for root in roots:
        _check_module(root)
    if len({id(root) for root in roots}) != len(roots):
        raise ValueError("fully_shard got the same module twice in its list; give each module once")
    if not dist.is_initialized():  # a ValueError, as torch's (its default mesh's rendezvous)
        raise ValueError(
            "fully_shard needs a process group: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment it reads), or start the processes with minidp.distributed.launch()")
    group, replicate_group = _groups_of(mesh, process_group)
    rank, world_size = group.rank(), group.size()
    reshard_after_forward = _resharding(reshard_after_forward, world_size)
    modules = list({id(sub): sub for root in roots for sub in _managed_modules(root)}.values())
    owners: dict[nn.Parameter, tuple[nn.Module, str]] = {}
    order: list[nn.Parameter] = []
    ignored = ignored_params or set()
    for sub in modules:
        for name, param in sub.named_parameters(recurse=False):
            if param not in owners and param not in ignored:
                owners[param] = (sub, name)
                order.append(param)
    names = {id(p): n for root in roots for n, p in root.named_parameters(remove_duplicate=False)}
    called = type(roots[0]).__name__ if len(roots) == 1 else "[" + ", ".join(type(root).__name__ for root in roots) + "]"
    named = [(names.get(id(p), owners[p][1]), p) for p in order]
    local_error: Optional[Exception] = None
    try:  # what this rank can check alone: another rank's model may pass, and must not wait for this one in vain
        _refuse_sparse_gradients(roots, owners, called)
        dims, device = _checked_here(named, called, shard_placement_fn, world_size, mesh, offload_policy, mp_policy)
    except Exception as error:  # noqa: BLE001 - told to the other ranks, then raised here as it is
        local_error = error
    groups = [ranks for ranks in (group, replicate_group) if ranks is not None]
    with collectives_on(order):
        _raise_on_every_rank_of(groups, local_error, called)
        for ranks in groups:
            _check_same_parameters(named, ranks, reshard_after_forward, mp_policy)
    params = []
    for param in order:
        owner, name = owners[param]
        sharded = ShardedParameter(owner, name, param, rank, world_size, dims[param], names.get(id(param), name))
        for sub in modules:  # the same parameter registered under another module or name of this group
            for other_name, other in sub.named_parameters(recurse=False, remove_duplicate=False):
                if other is param and (sub, other_name) != (owner, name):
                    sharded.also_in.append((sub, other_name))
        sharded.set_on_modules(sharded.shard)
        setattr(param, _SHARDED_AS, f"parameter '{names.get(id(param), name)}' of the {called}")
        params.append(sharded)
    shard_group = ShardGroup(roots, params, group, reshard_after_forward, device, mp_policy, replicate_group, mesh)
    for root in roots:  # minidp.SyncBatchNorm: statistics over the batch of every rank that shards or replicates
        attach_exchange(root, dist.group.WORLD if replicate_group is not None else group, replicas=1)
    watch_optimizers()  # an optimizer built on the shards gives their state as FSDP2's DTensors in its state dict
    for root in roots:
        setattr(root, _GROUP, shard_group)
        if len(roots) == 1:
            root.register_forward_pre_hook(shard_group.before_forward, prepend=True, with_kwargs=True)
            root.register_forward_hook(shard_group.after_forward)
        else:
            root.register_forward_pre_hook(functools.partial(_group_pre_forward, shard_group), prepend=True,
                                           with_kwargs=True)
            # always_call, as FSDP2's group hooks: a member whose forward raised still closes the pass, and frees
            # the gathered parameters (a single module's group waits for reset_iter_state or the next forward there)
            root.register_forward_hook(functools.partial(_group_post_forward, shard_group), always_call=True)
    for root in roots:
        root._register_load_state_dict_pre_hook(functools.partial(_refuse_misshapen_before_loading, root))
    holders = {id(m): m for p in params for m, _ in p.places}
    for holder in holders.values():
        if not any(holder is root for root in roots):  # a root gathers its group before its forward
            hook = functools.partial(_refuse_a_forward_on_shards, shard_group)
            handle = holder.register_forward_pre_hook(hook)  # in place now: the group is not gathered
            shard_group.outside_forward_checks.append((holder, handle.id, hook))
    for holder in holders.values():
        holder._register_load_state_dict_pre_hook(functools.partial(_keep_own_rows, shard_group, holder))
        holder.register_load_state_dict_post_hook(functools.partial(_take_loaded_shards, shard_group))
        holder.register_state_dict_pre_hook(functools.partial(_reshard_before_state_dict, shard_group))
        holder.register_state_dict_post_hook(functools.partial(_shards_as_dtensors, shard_group))
    for root in roots:
        # FSDP2's name for the class (FSDP<its class>): code reads it, Hugging Face's save_pretrained among it (the
        # architecture it writes in the config is the class's name without "FSDP")
        give_methods(root, ShardedModule, "FSDP")
    return module


def state(module: nn.Module) -> Optional[ShardGroup]:
    """The state ``fully_shard`` keeps for ``module``: its group, ``None`` where it was not applied (torch's
    ``fully_shard.state(module)``, the lookup of its ``contract``, whose FSDP2 ``FSDPState`` is likewise one per
    call, shared by the modules of ``fully_shard([a, b])``)."""
    return _group_of(module)


fully_shard.state = state  # type: ignore[attr-defined]  # torch's fully_shard.state(module), by the same name


def _groups_of(mesh: Optional[DeviceMesh], process_group: Optional[dist.ProcessGroup]
               ) -> tuple[dist.ProcessGroup, Optional[dist.ProcessGroup]]:
    """The ranks that shard, and (HSDP) those that hold the same shard, from ``fully_shard``'s ``mesh`` (FSDP2's
    ``_get_mesh_info``: 1-D, every rank shards; 2-D, dimension 1 shards and dimension 0 replicates)."""
    if mesh is None:
        return (process_group if process_group is not None else dist.group.WORLD), None
    if process_group is not None:
        raise ValueError("fully_shard got both mesh and process_group; give one (a 1-D mesh is its process group)")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh (torch.distributed.device_mesh.init_device_mesh), "
                        f"got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:  # FSDP2's refusal and type (_fsdp_init.py, _init_default_fully_shard_mesh):
            # minidp reads the dimensions by position and would run, but a model that runs here must run on FSDP2
            raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified (fully_shard reads "
                                 "dimension 0 as the replicas and dimension 1 as the shards, as FSDP2 does)")
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: 1-D shards over its ranks, 2-D "
                     f"(HSDP) replicates over dimension 0 and shards over dimension 1")


def _resharding(reshard_after_forward: Union[bool, int, None], world_size: int) -> Optional[bool]:
    """``reshard_after_forward`` as a bool (or None, FSDP2's default), checked as FSDP2 checks it
    (``_fsdp_init.py``, ``_get_post_forward_mesh_info``). FSDP2's int N reshards to groups of N ranks after the
    forward: N = 1 is ``False`` (FSDP2 warns, as here), else N = the ranks that shard is ``True`` (1 is tested first:
    with one rank that shards, 1 is both); an N between them, the smaller group, is not supported."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    if not isinstance(reshard_after_forward, int):
        raise ValueError(f"reshard_after_forward should be a bool or an int representing the group size to reshard "
                         f"to, not {reshard_after_forward}")
    if not 1 <= reshard_after_forward <= world_size or world_size % reshard_after_forward:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {world_size}, "
                         f"not {reshard_after_forward}")
    if reshard_after_forward == 1:  # before the test for every rank, as FSDP2: with one rank that shards, 1 is False
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
                      "reshard_after_forward=True (bool)", stacklevel=3)
        return False
    if reshard_after_forward == world_size:
        return True
    raise NotImplementedError(
        f"fully_shard: reshard_after_forward={reshard_after_forward}, resharding to groups of {reshard_after_forward} "
        f"of the {world_size} ranks after the forward, is not supported; pass True (reshard over all of them) or "
        f"False (keep the whole parameters until the backward)")


def _shard_dim(param: nn.Parameter, name: str, shard_placement_fn: Optional[Callable], world_size: int) -> int:
    """The dimension ``param`` is cut along: what ``shard_placement_fn`` says (``Shard(dim)``; ``None``: 0), checked
    as FSDP2 checks it (``_fsdp_param.py``, ``_init_sharded_param``)."""
    placement = None if shard_placement_fn is None else shard_placement_fn(param)
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn returned {placement!r} for parameter '{name}'; minidp takes Shard(dim) "
            f"or None (FSDP2's ShardPlacementResult, a mesh of its own for a parameter, is not supported)")
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():  # FSDP2's type and words: code that catches it finds it
        raise AssertionError(f"fully_shard: shard_placement_fn returned {placement!r} for parameter '{name}': Shard "
                             f"dim {dim} is invalid for {param.dim()}D tensor: {tuple(param.shape)}")
    if dim > 0 and param.size(dim) % world_size != 0:
        raise NotImplementedError(
            f"fully_shard: parameter '{name}' {tuple(param.shape)} cannot be cut evenly along dim {dim} among "
            f"{world_size} ranks: FSDP does not support uneven sharding on dim {dim}, and neither does minidp; only "
            f"dim 0 may be cut unevenly: return Shard(0) or None for it")
    return dim


def _check_placement(device: torch.device, mesh: Optional[DeviceMesh], offload_policy: OffloadPolicy,
                     mp_policy: MixedPrecisionPolicy) -> None:
    """The parameters are on the mesh's kind of device, the policies are FSDP2's classes, and an offload policy asks
    for nothing minidp does not do.
    Parameters on the meta device may meet any mesh: a model built there is sharded there, then materialised on the
    mesh's device by ``to_empty`` (FSDP2 lets them through alike: ``_fsdp_param.py``, ``_init_sharded_param``)."""
    if mesh is not None and device.type != "meta" and mesh.device_type != device.type:
        raise ValueError(
            f"fully_shard: the parameters are on {device} but the mesh is a {mesh.device_type!r} mesh; move the "
            f"module to the mesh's device first (module.to('{mesh.device_type}')), or build the mesh on {device.type}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy (torch.distributed.fsdp), got "
                        f"{type(mp_policy).__name__}; leave it unset for none (MixedPrecisionPolicy())")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        # read where the shards are already made (the gathered buffers' sizes): a string there would fail then, the
        # module left half sharded. Any torch.dtype passes, as FSDP2 takes it (an integer one fails at the forward).
        dtype = getattr(mp_policy, field, None)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"fully_shard: mp_policy.{field} must be a torch.dtype or None, got {dtype!r} of type "
                            f"{type(dtype).__name__}; e.g. MixedPrecisionPolicy({field}=torch.bfloat16)")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy (torch.distributed.fsdp), got "
                        f"{type(offload_policy).__name__}")
    if isinstance(offload_policy, CPUOffloadPolicy):
        if device.type != "cpu":
            raise NotImplementedError(
                f"fully_shard: CPUOffloadPolicy on parameters on {device} is not supported (minidp keeps the shards "
                f"where the parameters are); leave offload_policy unset, or use torch's fully_shard to offload")
        if offload_policy.pin_memory and not torch.accelerator.is_available():
            raise RuntimeError(
                "fully_shard: CPUOffloadPolicy(pin_memory=True) pins the shards in memory for transfers to an "
                "accelerator, and this machine has none (FSDP2 fails here too); pass "
                "CPUOffloadPolicy(pin_memory=False)")


@_not_traced
def _group_pre_forward(group: ShardGroup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before the forward of one of the modules of a ``fully_shard([...])`` group (FSDP2's
    _register_group_forward_hooks and FSDPParamGroup.pre_forward): the first of them to run in a pass gathers the
    group and opens the pass; the others find it open and gathered, and only cast their inputs under a mixed
    precision policy that asks for it. A pass left open by a module called on its own (a chunk of the head) is
    entered again once that call's backward closed it."""
    if not group.modules_to_run:
        group.modules_to_run.update(map(id, group.members))
    if not group.forward_open:
        return group.before_forward(module, args, kwargs)
    group.unshard()  # in place, unless reshard() was called in between
    return group.cast_inputs(args, kwargs)


@_not_traced
def _group_post_forward(group: ShardGroup, module: nn.Module, args: Any, output: Any) -> Any:
    """After the forward of one of them: the last of the pass reshards and closes it (``after_forward``); the
    others only cast their outputs to the policy's ``output_dtype``."""
    if id(module) in group.modules_to_run:
        group.modules_to_run.discard(id(module))
        if not group.modules_to_run:
            return group.after_forward(module, args, output)
    return group._cast_output(output)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` gather and free the module's parameters as its forward does, so that a
    method other than ``forward`` that uses them (a ``generate``) can be called on the sharded module (FSDP2's
    ``register_fsdp_forward_method``; a module ``fully_shard`` was not applied to is left as it is, as there)."""
    group = _group_of(module)
    if group is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{_class_name(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def gathering(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = group.before_forward(module, args, kwargs)
        return group.after_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, gathering)


def _keys_of(group: ShardGroup, holder: nn.Module, prefix: str) -> list[tuple[str, ShardedParameter]]:
    """The state-dict keys under which ``holder`` (with ``prefix``) holds parameters of ``group``."""
    return [(prefix + name, p) for p in group.params for module, name in p.places
            if module is holder]


def _refuse_size_mismatches(module: nn.Module, keys: list[tuple[str, ShardedParameter]], state_dict: dict) -> None:
    """Raise torch's ``load_state_dict`` error, in its words, if a value in ``state_dict`` for one of ``keys`` is not
    its parameter's whole shape (a plain tensor's shape, a DTensor's global one): what FSDP2 reports, where the
    parameter is a DTensor of that shape. A tensor of another model whose shape happens to be one rank's rows would
    otherwise be loaded as that rank's shard, and another rank's rows refused: ranks holding different models. The
    registered shard itself (:func:`_is_own_shard`) is this rank's rows, as FSDP2's registered DTensor is the whole."""
    found = [f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, the shape in current "
             f"model is {p.full_size}." for key, p in keys
             if isinstance(value := state_dict.get(key), torch.Tensor) and value.shape != p.full_size
             and not _is_own_shard(p, value)]
    if found:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(found)
                           + "\n\t(nothing was loaded into the sharded parameters)")


def _is_own_shard(p: ShardedParameter, value: Any) -> bool:
    """Whether ``value``, loaded for ``p``, is ``p``'s shard itself (the very ``nn.Parameter``, or the one registered
    in its place that the group takes as its shard at the load, :meth:`ShardGroup.follow_moved_shards`: after
    ``to_empty()``): what ``named_parameters()`` gives, which torch's ``set_model_state_dict(...,
    StateDictOptions(full_state_dict=True, strict=False))`` puts back for every key its state dict lacks
    (``_load_model_state_dict``: ``state_dict.update(local_state_dict)``), where FSDP2 puts back its DTensor. Loading
    it is loading this rank's rows onto themselves; any other tensor of that shape (another model's rows, another
    shard) is still refused."""
    return value is p.shard or (value.shape != p.full_size and any(
        module._parameters.get(name) is value for module, name in p.places))


def _refuse_misshapen_before_loading(root: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Before ``root.load_state_dict`` (a module fully_shard was called on) loads anything: every sharded parameter of
    its sub-tree is checked (:func:`_refuse_size_mismatches`), so that a refused state dict leaves every module as it
    was; torch's own ``load_state_dict`` reports a size mismatch after loading the rest."""
    # The keys as they are when this hook runs: an activation checkpoint's wrapper that is the root itself has put its
    # segment back already (its pre-hook came first), one deeper does so only when the load reaches it
    keys = [(prefix + key, p) for key, p, _ in _state_dict_keys(root, as_loaded_at_the_root=True)]
    _refuse_size_mismatches(root, keys, state_dict)


def _state_dict_keys(root: nn.Module, as_loaded_at_the_root: bool = False
                     ) -> list[tuple[str, ShardedParameter, ShardGroup]]:
    """Every place of a sharded parameter in ``root``'s sub-tree, at every path a module shared by several has:
    ``(the key root.state_dict() gives it, the parameter, its group)``. The key is the path less what an activation
    checkpoint's wrapper (torch's ``ActivationWrapper``: ``checkpoint_wrapper``, ``offload_wrapper``) leaves out of
    its state dict, the ``_checkpoint_wrapped_module`` segment right under it (its ``_post_state_dict_hook``);
    ``as_loaded_at_the_root``: kept under the root, whose own pre-hook puts it back at the start of a load."""
    places_in: dict[int, list[tuple[str, ShardedParameter, ShardGroup]]] = collections.defaultdict(list)
    for group in sharded_groups(root):
        for p in group.params:
            for module, name in p.places:
                places_in[id(module)].append((name, p, group))
    keys = []
    for holder_path, holder in root.named_modules(remove_duplicate=False):
        for name, p, group in places_in.get(id(holder), ()):
            path = f"{holder_path}.{name}" if holder_path else name
            keys.append((_without_checkpoint_wrappers(root, path, as_loaded_at_the_root), p, group))
    return keys


def _without_checkpoint_wrappers(root: nn.Module, path: str, keep_the_roots: bool) -> str:
    """``path`` (from ``root``) without the ``_checkpoint_wrapped_module`` segments right under an
    ``ActivationWrapper`` (but the one under ``root``, with ``keep_the_roots``)."""
    kept, module = [], root
    for segment in path.split("."):
        under_a_wrapper = isinstance(module, ActivationWrapper) and segment == _CHECKPOINT_WRAPPED_MODULE
        if not under_a_wrapper or (keep_the_roots and module is root):
            kept.append(segment)
        module = getattr(module, segment, None)
    return ".".join(kept)


def _keep_own_rows(group: ShardGroup, holder: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Before ``holder.load_state_dict``: a full tensor in ``state_dict`` is cut to this rank's rows, a DTensor (what
    ``state_dict()`` gives, filled by ``torch.distributed.checkpoint.load``) becomes its local rows, or the whole
    tensor first where it is laid out otherwise (a collective then). So a full state dict, or a sharded one, loads
    into a sharded module; a tensor of any other shape is refused (:func:`_refuse_size_mismatches`)."""
    keys = _keys_of(group, holder, prefix)
    _refuse_size_mismatches(holder, keys, state_dict)
    group.reshard_for_state_dict()  # load into the shards, not into gathered copies
    mesh = group.dtensor_mesh() if any(isinstance(state_dict.get(key), DTensor) for key, _ in keys) else None
    for key, p in keys:
        if state_dict.get(key) is not None and not _is_own_shard(p, state_dict[key]):  # the shard: left as it is
            state_dict[key] = group.own_rows(p, state_dict[key], mesh)


def _take_loaded_shards(group: ShardGroup, holder: nn.Module, incompatible_keys: Any) -> None:
    """After ``holder.load_state_dict``: ``assign=True`` registered new parameters (this rank's rows, from
    :func:`_keep_own_rows`) in place of the shards; the group takes them as its shards at once, as FSDP2's registered
    DTensor is its shard at once, so that what ``parameters()`` gives now is what the group gathers and reduces into.
    A load that copied into the shards moved nothing, and this does nothing."""
    group.follow_moved_shards()


def _reshard_before_state_dict(group: ShardGroup, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """A state dict holds the shards, as they are now (:meth:`ShardGroup.reshard_for_state_dict`)."""
    group.reshard_for_state_dict()


def _shards_as_dtensors(group: ShardGroup, holder: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
    """After ``holder.state_dict()`` (a module that holds parameters of ``group``): its sharded parameters as FSDP2
    gives them, DTensors of this rank's rows (:meth:`ShardGroup.as_dtensor`), so that
    ``torch.distributed.checkpoint`` saves each rank's part and ``get_model_state_dict(..., full_state_dict=True)``
    gathers them whole; plain rows would pass for replicated tensors there, and a checkpoint would keep rank 0's
    rows only."""
    keys = [(key, p) for key, p in _keys_of(group, holder, prefix) if key in state_dict]
    mesh = group.dtensor_mesh() if keys else None  # one mesh for the holder's parameters
    for key, p in keys:
        rows = state_dict[key]
        dtensor = group.as_dtensor(p, rows, mesh)
        # keep_vars=True gave the registered nn.Parameter, where FSDP2 gives its registered nn.Parameter(DTensor):
        # one too here, on the same rows (not that very object: minidp registers plain rows)
        state_dict[key] = nn.Parameter(dtensor, rows.requires_grad) if isinstance(rows, nn.Parameter) else dtensor


def sharded_groups(module: nn.Module) -> list[ShardGroup]:
    """The groups of ``module`` and its sub-modules (one per ``fully_shard`` call), outermost first."""
    groups = []
    for sub in module.modules():
        group = _group_of(sub)
        if group is not None and group not in groups:
            groups.append(group)
    return groups


def sharded_timeline(module: nn.Module) -> list[dict]:
    """This rank's events of the last forward and backward of ``module`` (the root ``fully_shard`` was
    applied to last), in the format of :meth:`minidp.distributed.DistributedDataParallel.timeline`: ``stage`` is
    ``"all-gather"`` and ``"reduce-scatter"`` (from launch to completion: a bar that overlaps a
    compute bar was hidden behind it), ``"copy-out"`` (from the all-gather's wait to the whole parameters set),
    ``"forward"`` (from the group's pre-forward hook, parameters gathered, to its post-forward hook, before it
    reshards) and ``"backward"`` (from the first gradient to reach the module's outputs, for the root the first to
    reach any group's, to the moment its backward is done: the gradients of its inputs computed, or, where no input
    needs one, autograd's end of the whole backward; before its reduce-scatter). A module's forward and backward hold
    its sub-modules', so the root's spans its sub-modules' spans; ``bucket`` is the group's index, ``group`` its
    module's name.
    :func:`minidp.distributed.chrome_trace` merges several ranks' into one trace."""
    group = _group_of(module)
    if group is None or group.iteration is None:
        raise ValueError("sharded_timeline needs the root module fully_shard was applied to, after one forward")
    return sorted(group.iteration.events, key=lambda e: e["start"])


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every sharded parameter whole again, on every rank (a collective:
    call it on every rank). ``module.load_state_dict`` takes it back, each rank keeping its rows. Each
    parameter's padded rows are gathered with one ``all_gather_single`` over its group, the layout its all-gathers
    use, and the padding left out."""
    full = module.state_dict()  # each group resharded, following the parameters registered now (after to_empty())
    for key, p, group in _state_dict_keys(module):
        if isinstance(full.get(key), DTensor):
            gathered = torch.empty(p.shard_numel * group.world_size, dtype=p.padded.dtype, device=p.padded.device)
            _all_gather(gathered, p.padded, group=group.process_group)
            # rank r's padded rows sit in slot r; the real rows are the first full_size[0] of them all
            full[key] = p.whole_from_slots(gathered)[: p.full_size[0]].clone()
    return full


def clip_grad_norm_(parameters: Union[torch.Tensor, Any], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters that ``fully_shard`` sharded: the norm of every gradient
    whole, on every rank (a collective: call it on every rank, with the same parameters), and every gradient scaled by
    ``max_norm / norm`` where that is below 1; returns the total norm.

    torch's own function sees a shard's gradient as a whole tensor, so on minidp's plain shards it would give each
    rank the norm of its own rows, and each rank would clip by another factor. FSDP2's shards are DTensors, whose
    norms torch reduces over the ranks; here the shards' norms, stacked as torch stacks them, are reduced over the
    ranks that shard (p-th powers summed, or the largest for ``inf``; HSDP's replicas hold the same rows), one
    collective for the parameters sharded over the same ranks. Parameters ``fully_shard`` left whole beside sharded
    ones (``ignored_params``, a root not sharded) are refused, as FSDP2 refuses them ("got mixed torch.Tensor and
    DTensor"): their gradients are not reduced over the ranks, so each rank would take another norm and clip its rows
    by another factor; clip them apart. Norms, clipped
    gradients and the steps after them equal FSDP2's bit for bit, on 2 and 3 ranks, HSDP's 2 x 2, and with groups of
    two dtypes (tests/test_fully_shard.py, ``-k clipping``); where a rank's shard is empty, ``inf`` counts it as 0
    (FSDP2's own norm fails there). ``-inf`` takes the smallest over the ranks and 0 sums the counts of nonzero
    entries, as torch's norms of DTensors do.
    """
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grad = [p for p in parameters if p.grad is not None]
    p_norm = float(norm_type)
    # How the shards' norms make the whole parameter's, as DTensor's norm reduces them: the largest for inf, the
    # smallest for -inf, the sum of the counts of nonzero entries for 0, else the sum of p-th powers. A rank past
    # the last rows holds an empty shard, whose norm is the reduction's neutral value (inf for the smallest, else 0).
    op = {float("inf"): dist.ReduceOp.MAX, float("-inf"): dist.ReduceOp.MIN}.get(p_norm, dist.ReduceOp.SUM)
    powered = op == dist.ReduceOp.SUM and p_norm != 0
    empty = float("inf") if op == dist.ReduceOp.MIN else 0.0
    if not with_grad:
        return torch.tensor(0.0)
    each = [torch.linalg.vector_norm(p.grad.detach(), p_norm) if p.grad.numel() else p.grad.new_full((), empty)
            for p in with_grad]
    # FSDP2's order and dtype, which rounding sees: torch's clip_grad_norm_ takes the norms bucketed by device and dtype
    # (_group_tensors_by_device_and_dtype) and stacks them, in the widest dtype; DTensor's norm of that stack makes it
    # whole first (one collective over the ranks that shard), then takes the norm of it. Reduced in its own dtype, or
    # in the parameters' order, a norm of float32 beside float64 rounds otherwise.
    order = [i for _, indices in _group_tensors_by_device_and_dtype([[p.grad for p in with_grad]], with_indices=True)
             .values() for i in indices]
    norms = torch.stack([each[i].to(with_grad[0].grad.device) for i in order])
    by_ranks: dict[dist.ProcessGroup, list[int]] = {}  # positions in the stack; the same order on every rank
    groups = [group_of_shard(p) for p in with_grad]
    _check_all_sharded_or_none(with_grad, groups)
    for position, i in enumerate(order):
        if groups[i] is not None:  # none sharded: a plain clip, of this rank's gradients
            by_ranks.setdefault(groups[i].process_group, []).append(position)
    for ranks, positions in by_ranks.items():
        local = norms[positions]
        if powered:
            local = local.pow(p_norm)
        dist.all_reduce(local, op=op, group=ranks)
        norms[positions] = local.pow(1.0 / p_norm) if powered else local
    total = torch.linalg.vector_norm(norms, p_norm)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            f"clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`")
    torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach)
    return total


def _check_all_sharded_or_none(parameters: list[torch.Tensor], groups: list[Optional[Any]]) -> None:
    """``clip_grad_norm_``'s parameters are all shards or none (``groups``: each one's, or ``None``), checked before
    anything is reduced or clipped (every rank raises alike: they pass the same parameters)."""
    whole = [i for i, group in enumerate(groups) if group is None]
    if whole and len(whole) < len(groups):
        first = parameters[whole[0]]
        raise ValueError(
            f"clip_grad_norm_: {len(whole)} of the {len(parameters)} parameters with gradients were not sharded by "
            f"fully_shard (the first, at position {whole[0]} among them, of shape {tuple(first.shape)}): "
            f"ignored_params, a module left out of fully_shard or given to another wrapper. Where nothing reduced their gradients over "
            f"the ranks, each rank would take another total norm and clip the shards by another factor (FSDP2 refuses "
            f"them too: \"got mixed torch.Tensor and DTensor\"). Shard the modules that hold them, or clip them apart: "
            f"clip_grad_norm_(sharded, max_norm) and torch.nn.utils.clip_grad_norm_(whole, max_norm)")


def _checked_here(
    named: list[tuple[str, nn.Parameter]], called: str, shard_placement_fn: Optional[Callable[[nn.Parameter], Any]],
    world_size: int, mesh: Optional[DeviceMesh], offload_policy: OffloadPolicy, mp_policy: MixedPrecisionPolicy,
) -> tuple[dict[nn.Parameter, int], torch.device]:
    """What one fully_shard call can check on this rank alone, before any shard is made: each parameter sharded once
    (sub-modules before their parent), with a dimension to cut, on one device; the dimension each is cut along, and
    that device. Several dtypes are taken, as FSDP2 takes them (the all-gather carries them as bytes); that those
    which get gradients share one is checked where FSDP2 checks it, at the first forward
    (:func:`_refuse_gradients_of_two_dtypes`): a parameter may still be frozen after this call."""
    for name, param in named:
        if isinstance(param, DTensor):
            # Tensor parallelism (parallelize_module), or a DTensor of one's own: cut here as if plain, it failed only
            # at the first forward, deep inside (a DTensor has no storage to read), the model already cut
            raise NotImplementedError(
                f"fully_shard({called}): parameter '{name}' is already a DTensor ({list(param.placements)} on "
                f"{param.device_mesh}): minidp's fully_shard shards plain tensors only, and does not support DTensor "
                f"parameters (2-D / tensor-parallel models, parallelize_module); use torch's fully_shard "
                f"(torch.distributed.fsdp.fully_shard) for them")
        if hasattr(param, SHARDED_BY):  # its module's parent went first, and left a shard here
            raise ValueError(
                f"fully_shard({called}): parameter '{name}' is already a shard: an earlier fully_shard call on a module "
                f"that holds this one sharded it. Call fully_shard on the sub-modules first, then on their parent "
                f"(the root last), as FSDP2 asks")
        if hasattr(param, _SHARDED_AS):
            raise ValueError(
                f"fully_shard({called}): parameter '{name}' is also {getattr(param, _SHARDED_AS)}, "
                f"which an earlier fully_shard call sharded; a parameter can belong to one group only: call "
                f"fully_shard on a module that holds every user of it (their common parent), not on each user")
        if param.dim() == 0:
            raise ValueError(f"fully_shard: parameter '{name}' is a scalar; sharding needs at least one dimension. "
                             f"Change {name} to a 1D tensor with numel equal to 1.")  # (FSDP2's words)
        if not param.is_contiguous():
            raise NotImplementedError(  # FSDP2's type (_fsdp_param.py): code that catches it finds it
                f"fully_shard: parameter '{name}' is not contiguous (stride {param.stride()}): FSDP does not support "
                f"non-contiguous parameters yet, and neither does minidp; make it contiguous first")
    dims = {param: _shard_dim(param, name, shard_placement_fn, world_size) for name, param in named}
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"fully_shard: the parameters of one call must be on one device, found {sorted(map(str, devices))}")
    device = next(iter(devices)) if devices else torch.device("cpu")
    _check_placement(device, mesh, offload_policy, mp_policy)
    return dims, device


def _refuse_sparse_gradients(roots: list[nn.Module], managed: dict[nn.Parameter, Any], called: str) -> None:
    """Refuse an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True`` whose weight this call shards (one of
    ``managed``): its gradient is a sparse tensor, which the reduce-scatter cannot lay out in its flat buffer. minidp
    failed at the first backward ("reshape is not implemented for sparse tensors"), FSDP2 fails there too, with no word
    of the embedding (``_fsdp_collectives.py``, ``foreach_reduce``: ``torch.ops.fsdp.chunk_cat`` has no sparse
    kernel)."""
    for root in roots:
        for name, sub in root.named_modules():
            # a frozen one makes no gradient: it trains, as in FSDP2 (one unfrozen later fails at the backward)
            sparse = isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad
            if sparse and sub.weight in managed:
                raise NotImplementedError(
                    f"fully_shard({called}): '{name or called}' is an {type(sub).__name__} with sparse=True, whose "
                    f"weight this call shards: sparse gradients cannot be reduce-scattered (FSDP2 fails at the "
                    f"backward too). Build it with sparse=False, or leave its weight out of the call "
                    f"(ignored_params=...), whole and unreduced on each rank")


def _raise_on_every_rank_of(groups: list[dist.ProcessGroup], error: Optional[Exception], called: str) -> None:
    """Raise ``error`` here if there is one, and on the other ranks of ``groups`` the first failing rank's
    (:func:`~minidp.distributed.checks.raise_on_every_rank` in each group): each rank votes in every group before any
    raises, so that none is left waiting in a vote (ranks that built different models all hear of it, as the README
    says)."""
    shared: Optional[Exception] = None
    for ranks in groups:
        try:
            raise_on_every_rank(error, ranks, f"fully_shard({called})")
        except Exception as raised:  # noqa: BLE001 - raised once every group has voted
            shared = shared or raised
    if shared is not None:
        raise shared


def _check_same_parameters(named: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup,
                           reshard_after_forward: Optional[bool] = None,
                           mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> None:
    """Every rank shards the same parameters (names, shapes, dtypes; a sub-module sharded on one rank and another
    of the same shapes on the other differ by name at the parent's call) with the same ``reshard_after_forward``
    and ``mp_policy``: one collective, the same error on every rank. FSDP2 compares none of them: its all-gathers
    and reduce-scatters then pair different parameters (silently wrong), different sizes (Gloo aborts) or none
    (it hangs)."""
    settings = {"reshard_after_forward": reshard_after_forward,
                **{f"mp_policy.{f.name}": getattr(mp_policy, f.name) for f in dataclasses.fields(mp_policy)}}

    def difference(everyone: list) -> Optional[str]:
        found = first_difference([specs for specs, _ in everyone])
        if found is None and (found := first_setting_difference([s for _, s in everyone])) is not None:
            found += " (pass the same reshard_after_forward and mp_policy to this fully_shard call on every rank)"
        return found

    check_same_everywhere(
        ([TensorSpec("parameter", name, tuple(p.shape), p.stride(), str(p.dtype)) for name, p in named],  # contiguous
         settings),
        group, difference, "fully_shard needs the same model and settings",
        "Build the model the same way on every rank and call fully_shard on the same modules in the same order, "
        "with the same arguments",
    )
