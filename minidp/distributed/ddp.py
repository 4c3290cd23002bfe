"""DistributedDataParallel: one model per process, gradients averaged over the processes in the backward.

The construction, step by step (torch's ``DistributedDataParallel.__init__``):

1. the parameters to reduce: those that require grad, each once, in registration order, less those ignored by
   name as torch's reducer matches names (:func:`~minidp.distributed.checks.reducer_parameters`);
2. every rank's model compared with rank 0's; a difference is the same clear error on every rank
   (:func:`~minidp.distributed.checks.check_same_model`);
3. rank 0's parameters and buffers broadcast to every rank (:mod:`minidp.distributed.broadcast`);
4. the reducer: the bucket plan, one hook per parameter (:mod:`minidp.distributed.reducer`).

Then each forward: rank 0's buffers broadcast again (``broadcast_buffers``, after a synchronised
forward), the module run, and the reducer told to expect this backward's gradients, unless
inside :meth:`DistributedDataParallel.no_sync`.

Beyond torch DDP, ``device_ids`` may name several devices (``["cpu", "cpu"]``, ``[0, 1]``): each
process then runs :class:`minidp.DataParallel` on them (scatter, replicate, parallel_apply,
gather), whose backward sums the replicas' gradients into the parameters of ``module``; the
reducer then averages those sums over the processes.
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.tensor import DTensor
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDistributedDataParallel
from torch.nn.parallel.distributed import _BufferCommHookLocation
from torch.utils._pytree import tree_unflatten

from ..hooks import profiled
from ..torch_versions import DDP_DEPRECATES_BROADCAST_BUFFERS
from ..wrapper import DataParallel
from .batchnorm import attach_exchange, check_torch_sync_batchnorm
from .broadcast import broadcast_from, broadcast_from_rank0
from .buckets import MIB, BucketCaps
from .checks import (
    IGNORED_ATTRIBUTE, check_device_ids, check_materialised, check_no_distributed_autograd, check_not_sharded,
    check_one_device_type, check_same_model, collectives_on, ignored_names, reducer_candidates, reducer_parameters,
    sparse_gradient_flags, synced_tensors,
)
from .comm_hooks import CommHook, builtin_hook, check_comm_hook, optimizer_in_backward_hook
from .isinstance_only import refuse_inherited
from .join import DDPJoinHook, common_rank, sync_backward_vote
from .logging_data import LoggingData
from .mixed_precision import MixedPrecision, allreduce_and_upcast, check_mixed_precision
from .reducer import Reducer, python_reducer_mode, sink_leaves

DeviceLike = Union[int, str, torch.device]


class _DDPSink(torch.autograd.Function):
    """torch DDP's ``_DDPSink``, under its name (code that reads the graph sees ``_DDPSinkBackward``): the outputs
    that autograd records, through one node (clones of them, or, with ``_set_ddp_sink_clone(False)``, themselves).
    Its backward passes each gradient on, and an output the loss did not use gets none (not materialised): autograd
    still runs what lies behind it in that backward pass, so the hooks of the parameters it reaches fire (and count
    them used if they hold a gradient), and its graph is freed with the rest: a second backward into another output
    of the same forward raises autograd's "backward through the graph a second time", as under torch DDP, where the
    first backward's reduction has ended."""

    @staticmethod
    def forward(ctx, clone: bool, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors) if clone else tensors

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        return (None, *grads)


def _through_sink(output: Any, clone: bool) -> Any:
    """``output`` with its tensors that autograd recorded passed through one :class:`_DDPSink`, found as torch finds
    them, with its pytree (:func:`~minidp.distributed.reducer.sink_leaves`: a container type it does not know, a
    dataclass or a dict subclass of the user's, is left as it is). The clones matter too: an output changed in place
    after a function that saved it (``out.mul_(2)`` after a tanh) is then the clone, and the backward works."""
    leaves, spec, recorded = sink_leaves(output)
    if not recorded:
        return output
    for i, passed in zip(recorded, _DDPSink.apply(clone, *[leaves[i] for i in recorded])):
        leaves[i] = passed
    return tree_unflatten(leaves, spec)


class DistributedDataParallel(TorchDistributedDataParallel):
    """Data parallelism across processes, with torch DDP's signature, defaults and arithmetic.

    A subclass of torch's ``DistributedDataParallel`` so that ``isinstance`` holds, as code that finds the wrapper
    checks it: ``torch.distributed.checkpoint``'s ``get_state_dict`` then leaves out the ``module.`` prefix as it does
    for torch's (a checkpoint then loads into either wrapper, or the plain model), frameworks unwrap ``.module``. None
    of torch's code runs but its ``train()``, which calls ``nn.Module``'s: ``__init__`` is ``nn.Module``'s, every
    method torch's forward and backward use is minidp's own, and torch's other methods (its C++ reducer's internals)
    are refused by name (:func:`minidp.distributed.isinstance_only.refuse_inherited`).

    Args:
        module: the model; the same on every rank (checked). Rank 0's parameters and buffers are
            copied to every rank here.
        device_ids: ``None``: run ``module`` as it is (its parameters' device). One or more devices
            (``["cpu", "cpu"]``, ``[0, 1]``): run replicas of it on them inside this process, with
            :class:`minidp.DataParallel`; ``module`` must be on ``device_ids[0]``: GPU ids for a module
            on the CPU raise torch DDP's ``ValueError`` (:func:`~minidp.distributed.checks.check_device_ids`).
        output_device: where those replicas' outputs are gathered (default ``device_ids[0]``). A module on the CPU
            takes none without replicas, nor a GPU one with them (torch DDP's ``ValueError``).
        dim: the batch dimension the replicas split inputs along.
        broadcast_buffers: the older name of ``forward_sync_buffers`` (deprecated by torch 2.13, which warns as
            minidp does there), except that ``False`` also leaves buffers out of the construction's broadcast.
        init_sync: check that every rank has the same model and broadcast rank 0's parameters and buffers
            at construction (default); ``False``: neither (the caller sees to it that they are alike).
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: bucket size in MiB (default 25, with a 1 MiB first bucket; see
            :mod:`minidp.distributed.buckets`); ``bucket_cap_mb_list``: one size per bucket instead.
        find_unused_parameters: allow parameters that get no gradient in a backward: the graph is
            searched after each forward and their buckets do not wait for them.
        gradient_as_bucket_view: leave each ``.grad`` a view of its bucket instead of copying into it.
        static_graph: the graph is the same at every iteration: unused parameters are found once, in
            the first backward, which reduces everything at its end; a parameter used several times
            per backward (re-entrant checkpointing) is reduced after its last use
            (:meth:`~minidp.distributed.reducer.Reducer.set_static_graph`).
        device_mesh: a 1-D ``DeviceMesh`` whose group to average over, instead of ``process_group`` (a slice of a
            larger mesh too, ``mesh["dp"]``, for a module without DTensor parameters: :func:`process_group_of`).
        forward_sync_buffers: copy rank 0's buffers to every rank before each forward (default True), or
            let the hook of :meth:`_register_buffer_comm_hook` make them alike.
        check_reduction: deprecated by torch, no effect (a warning).
        batched_grad_copy: copy a bucket's gradients into it once it is full, then divide it at once (torch
            2.13's option; torch's bits, which differ from the default's where 1/world_size is inexact).
        skip_all_reduce_unused_params: with ``find_unused_parameters`` or ``static_graph``, launch no all-reduce
            for a bucket none of whose parameters got a gradient (every rank must find the same ones unused).

    Parameters and buffers named by :meth:`_set_params_and_buffers_to_ignore_for_model` before wrapping are
    left alone. ``mixed_precision`` (torch's private ``_MixedPrecision``): the forward and backward in its
    ``param_dtype``, the gradients averaged in its ``reduce_dtype``, the buffers in its ``buffer_dtype``, the
    parameters and gradients back in full precision after the backward (:mod:`minidp.distributed.mixed_precision`).
    ``delay_all_reduce_named_params`` with ``param_to_hook_all_reduce`` are refused (``NotImplementedError``).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[DeviceLike]] = None,
        output_device: Optional[DeviceLike] = None,
        dim: int = 0,
        broadcast_buffers: Optional[bool] = None,
        init_sync: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Optional[list[tuple[str, nn.Parameter]]] = None,
        param_to_hook_all_reduce: Optional[nn.Parameter] = None,
        mixed_precision: Optional[Any] = None,
        device_mesh: Optional[Any] = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Optional[list[float]] = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: Optional[bool] = None,
    ) -> None:
        nn.Module.__init__(self)  # not torch DDP's: its class is a base for isinstance() only (see the class docstring)
        Joinable.__init__(self)  # not in a Join context until join() or Join([...]) says so
        refuse_unsupported(
            delay_all_reduce_named_params=delay_all_reduce_named_params, param_to_hook_all_reduce=param_to_hook_all_reduce,
        )
        ignored = ignored_names(module)
        check_not_sharded(module, ignored)
        check_one_device_type(module, ignored)
        check_materialised(module, ignored)
        check_device_ids(module, device_ids, output_device, ignored)  # before len(device_ids): "cpu" is no list
        # torch._dynamo.config.optimize_ddp="python_reducer", read at construction as torch DDP reads it: the gradients
        # reduced by per-parameter hooks that compiled autograd can trace (_register_accum_grad_hook)
        self._use_python_reducer = python_reducer_mode()
        if self._use_python_reducer:
            refuse_with_python_reducer(mixed_precision, bucket_cap_mb_list)
        if mixed_precision is not None:
            check_mixed_precision(mixed_precision)
            if device_ids is not None and len(device_ids) > 1:
                raise NotImplementedError(
                    f"mixed_precision with several replicas per process (device_ids={list(device_ids)}) is not "
                    f"implemented: pass one device_id (or None) to train in mixed precision"
                )
        caps = BucketCaps.from_mb(bucket_cap_mb, bucket_cap_mb_list)
        caps.check_first_plan(find_unused_parameters and not static_graph)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(  # torch's fails later, on an attribute of what it was given
                f"DistributedDataParallel: process_group must be a torch.distributed.ProcessGroup "
                f"(torch.distributed.new_group(ranks)), or None for the default group, got {process_group!r} of type "
                f"{type(process_group).__name__}")
        if not dist.is_initialized():  # a ValueError, as torch's (its _get_default_group's)
            raise ValueError(
                "DistributedDataParallel needs a process group: call torch.distributed.init_process_group() first "
                "(torchrun sets the environment it reads), or start the processes with minidp.distributed.launch()"
            )
        self.module = module
        self.process_group = process_group_of(process_group, device_mesh, module)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = buffer_sync(broadcast_buffers, forward_sync_buffers)
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid using "
                "it.", FutureWarning, stacklevel=2,
            )
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.static_graph = static_graph
        self._ddp_sink_clone = True  # the outputs cloned where torch's _DDPSink clones them (_after_module)
        self._comm_hooks: list[tuple[CommHook, object]] = []  # what register_comm_hook registered, for the Python reducer
        self.device_ids = None if device_ids is None or len(device_ids) == 0 else list(device_ids)  # [] as torch: None
        self.output_device = output_device
        self.mixed_precision = mixed_precision
        self.parameters_to_ignore = ignored
        self._assign_modules_buffers()
        # What torch's helpers take as the broadcast's bucket size (torch.distributed.utils._sync_module_states);
        # minidp's own broadcasts send one flat tensor per dtype.
        self.broadcast_bucket_size = 250 * 1024 * 1024
        self._bucket_caps = caps
        self._attach_replicas()  # before the parameters are listed: DataParallel may move a module to its one device
        # torch DDP's description of the module (frameworks and torch's tests read it): its parameters not ignored,
        # whether they are on several devices, the type of those devices and the first one
        self._module_parameters = [p for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        self.is_multi_device_module = len({p.device for p in self._module_parameters}) > 1
        self.device = self._module_parameters[0].device if self._module_parameters else torch.device("cpu")
        self.device_type = self.device.type
        if init_sync:
            with collectives_on(module.parameters()):
                # what torch's reducer gets is checked too: a parameter ignored by a name its reducer does not match
                check_same_model(module, self.process_group, init_sync_buffers, self.parameters_to_ignore,
                                 reducer_parameters(module, self.parameters_to_ignore)[0],
                                 self._reducer_settings(bucket_cap_mb, bucket_cap_mb_list, init_sync_buffers))
            broadcast_from_rank0(synced_tensors(module, self.parameters_to_ignore, init_sync_buffers), self.process_group)
        self._attach_reducer()
        if static_graph and find_unused_parameters:  # torch's constructor warns as its _set_static_graph does
            _warn_find_unused_is_not_needed(stacklevel=3)
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # whether the last forward was synchronised
        self._buffer_hook: Optional[tuple[object, Callable, _BufferCommHookLocation]] = None
        self._lazy_init_ran = False  # the first forward looks for optimizers in the backward
        self._divide_by_initial_world_size = True  # under Join (see minidp.distributed.join)

    def _reducer_settings(self, bucket_cap_mb: Optional[float], bucket_cap_mb_list: Optional[list[float]],
                          init_sync_buffers: bool) -> dict[str, Any]:
        """The arguments every rank's reducer must share, compared across ranks by the construction's model check
        (the same collective): with different ones the ranks' buckets or exchanges differ, and the backward hangs or
        crashes. Not ``gradient_as_bucket_view`` (where a ``.grad`` lives: the exchanges are the same). The buffer
        settings only where there are buffers to sync (without any, the ranks sync nothing either way)."""
        mixed = self.mixed_precision
        settings: dict[str, Any] = {
            "find_unused_parameters": bool(self.find_unused_parameters),
            "static_graph": bool(self.static_graph),
            "skip_all_reduce_unused_params": bool(self.skip_all_reduce_unused_params),
            "bucket_cap_mb": None if bucket_cap_mb_list else bucket_cap_mb,
            "bucket_cap_mb_list": list(bucket_cap_mb_list) if bucket_cap_mb_list else None,
            "mixed_precision": None if mixed is None else tuple(
                f"{field}={getattr(mixed, field)}" for field in ("param_dtype", "reduce_dtype", "buffer_dtype")),
        }
        if any(name not in self.parameters_to_ignore for name, _ in self.module.named_buffers()):
            settings.update({
                "forward_sync_buffers (or broadcast_buffers, its older name)": bool(self.forward_sync_buffers),
                "the buffers' broadcast at construction (off only with broadcast_buffers=False)": bool(init_sync_buffers),
            })
        return settings

    # The bucket sizes in bytes, under torch DDP's names: the cap, the per-bucket caps ([] without
    # bucket_cap_mb_list), and whether the first bucket is smaller (the defaults' 1 MiB first bucket).
    @property
    def bucket_bytes_cap(self) -> int:
        return self._bucket_caps.cap

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        return list(self._bucket_caps.per_bucket)

    @property
    def bucket_bytes_cap_default(self) -> bool:
        return self._bucket_caps.first < self._bucket_caps.cap

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """Whether the buckets follow the gradients' arrival order yet (torch DDP's flag, set by the forward that
        installs the rebuilt plan). torch's ZeRO overlap hook (``hook_with_zero_step``) reads it: until then, the
        buckets it would map to optimizer shards are not the final ones."""
        return self.reducer.has_rebuilt_buckets

    @property
    def broadcast_buffers(self) -> bool:
        """The older name of ``forward_sync_buffers`` (torch 2.13 keeps both)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Sequence[str]) -> None:
        """Name parameters and buffers (``"fc.weight"``) that a DDP built afterwards on ``module`` leaves alone (torch
        DDP's static method). As in torch, ``named_parameters()`` names keep them out of the broadcasts, while the
        reducer leaves out a parameter only under its ``f"{module_name}.{param_name}"`` names, every one of them: a
        root parameter (``".w"`` there, not ``"w"``) or a tied one ignored under one name only is still reduced, and
        checked (:func:`~minidp.distributed.checks.reducer_candidates`)."""
        setattr(module, IGNORED_ATTRIBUTE, params_and_buffers_to_ignore)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator[Any]:
        """The parameters of ``module`` that DDP reduces (those not ignored), or ``(name, parameter)`` pairs."""
        for name, param in module.named_parameters():
            if not hasattr(param, "_ddp_ignored"):
                yield (name, param) if named_params else param

    def _build_params_for_reducer(self) -> tuple[list[nn.Parameter], list[bool]]:
        """The parameters the reducer reduces, in its order, and whether each gets sparse gradients (torch DDP's
        method of that name; :func:`~minidp.distributed.checks.reducer_parameters`)."""
        params, _ = reducer_parameters(self.module, self.parameters_to_ignore)
        return params, sparse_gradient_flags(self.module, params)

    def _build_debug_param_to_name_mapping(self, parameters: Sequence[nn.Parameter]) -> dict[int, str]:
        """``{position in parameters: name}`` for every parameter the reducer reduces (torch DDP's method); a
        ``ValueError`` (logged) where ``parameters`` and the module's disagree."""
        position = {id(p): i for i, p in enumerate(parameters)}
        mapping = {}
        with self._errors_logged():
            for name, param in reducer_candidates(self.module, self.parameters_to_ignore):
                if id(param) not in position:
                    raise ValueError(
                        f"Param with name {name} found in module parameters, but not DDP parameters. This indicates a "
                        f"bug in minidp.distributed: please report it.")
                mapping[position[id(param)]] = name
            if len(position) != len(mapping):
                raise ValueError(
                    f"Expected param to name mapping to cover all parameters, but got conflicting lengths: "
                    f"{len(position)} vs {len(mapping)}. This indicates a bug in minidp.distributed: please report it.")
        return mapping

    def _attach_replicas(self) -> None:
        """Several replicas per process: a DataParallel over ``device_ids``. It shares ``module``, so it
        is kept out of the registry of sub-modules, where it would repeat every key of the state dict."""
        self.__dict__["_replicas"] = (
            None if self.device_ids is None
            else DataParallel(self.module, self.device_ids, self.output_device, self.dim)
        )

    def _attach_reducer(self) -> None:
        """The reducer of this process's parameters (``_ddp_init_helper``): no collective, so that
        unpickling on one rank alone works."""
        params, names = reducer_parameters(self.module, self.parameters_to_ignore)
        check_torch_sync_batchnorm(self.module, params[0].device)
        # minidp.SyncBatchNorm: statistics of every replica of every process
        attach_exchange(self.module, self.process_group, 1 if self._replicas is None else len(self._replicas.device_ids))
        sparse = sparse_gradient_flags(self.module, params)
        if any(sparse) and self._replicas is not None and len(self._replicas.device_ids) > 1:
            raise ValueError(
                f"'{names[sparse.index(True)]}' has sparse gradients, which several replicas per process "
                f"(device_ids={self.device_ids}) do not sum; pass one device_id (or None), or use sparse=False"
            )
        mixed = self.mixed_precision
        # In mixed precision the gradients arrive in param_dtype, and their buckets are of that dtype: a .grad in full
        # precision cannot be a view of one (minidp.distributed.mixed_precision).
        self.reducer = Reducer(params, names, self.process_group, self._bucket_caps, self.find_unused_parameters,
                               self.gradient_as_bucket_view and mixed is None, self.static_graph, sparse,
                               self.batched_grad_copy, self.skip_all_reduce_unused_params,
                               bucket_dtype=None if mixed is None else mixed.param_dtype)
        self._logging = LoggingData()
        self.reducer.log_error = self._logging.set_reducer_error
        self.reducer.log_graph_not_static = self._logging.log_graph_not_static
        self._logging.set_construction_data(
            self.module, params, self.process_group, device_ids=self.device_ids, output_device=self.output_device,
            broadcast_buffers=self.broadcast_buffers, bucket_cap_bytes=self._bucket_caps.cap,
            find_unused_parameters=self.find_unused_parameters, gradient_as_bucket_view=self.gradient_as_bucket_view,
            # in the parameters' dtype, as torch logs them (mixed precision keeps the buffers in a lower one), and a
            # sparse gradient's bucket at its parameter's dense size, as torch sizes it (it holds no buffer of its own)
            bucket_sizes=[sum(p.numel() for p in b.params) * b.params[0].element_size() for b in self.reducer.buckets],
        )
        if self.static_graph:
            self._logging.entries["static_graph"] = 1
        self.__dict__["_mixed"] = None  # not pickled: rebuilt from mixed_precision, as the reducer is
        if mixed is not None:
            self.__dict__["_mixed"] = MixedPrecision(mixed, self.module, self.parameters_to_ignore, self.process_group)
            self.register_comm_hook(self._mixed, allreduce_and_upcast)
            self._logging.entries["comm_hook"] = "_reducer_allreduce_and_upcast_hook"  # torch's name for its hook
        if self._use_python_reducer:
            # The buckets stay for what reads them (bucket_plan, the logging data) and reduce nothing, as torch's C++
            # reducer does in this mode (its forward never prepares it for a backward): the Python hooks reduce.
            self.reducer._remove_autograd_hooks()
            self._register_accum_grad_hook()

    # ---- pickling: torch.save, copy.deepcopy ------------------------------------------------

    def __getstate__(self) -> dict:
        """What is pickled: everything but the process group, the reducer (its hooks and buckets belong to
        these parameters) and the replicas, as torch DDP drops its process group, reducer and logger."""
        default_group = _default_group_or_none()
        if default_group is None:  # torch's reads the default group first, whose absence is a ValueError
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group: "
                "pickling (or copy.deepcopy of) a DistributedDataParallel needs it, as torch's does. Copy or pickle "
                "the wrapped .module instead, which needs no process group"
            )
        if self.process_group is not default_group:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process group. That "
                "is, when you have called init_process_group and have not passed process_group argument to DDP "
                "constructor"
            )
        state = dict(self.__dict__)
        for transient in ("process_group", "reducer", "_replicas", "_mixed", "_accum_grad_hooks", "_comm_hooks"):
            state.pop(transient, None)
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled (``torch.load``, ``copy.deepcopy``): the default process group, and a fresh reducer with
        hooks on the unpickled parameters (torch DDP's ``__setstate__``). Nothing is broadcast or checked."""
        process_group = _default_group_or_none()
        if process_group is None:  # a ValueError, as torch's (its _get_default_group's)
            raise ValueError(
                "unpickling a DistributedDataParallel needs the default process group: call "
                "torch.distributed.init_process_group() first, or unpickle the wrapped .module instead"
            )
        # a wrapper pickled before `forward_sync_buffers` had it under its older name, now a property
        forward_sync_buffers = state.pop("broadcast_buffers", True)
        nn.Module.__setstate__(self, state)
        self.__dict__.setdefault("forward_sync_buffers", forward_sync_buffers)
        self.__dict__.setdefault("parameters_to_ignore", frozenset())
        self.__dict__.setdefault("_buffer_hook", None)
        self.__dict__.setdefault("_lazy_init_ran", False)
        self.__dict__.setdefault("batched_grad_copy", False)
        self.__dict__.setdefault("skip_all_reduce_unused_params", False)
        self.__dict__.setdefault("mixed_precision", None)
        self.__dict__.setdefault("_use_python_reducer", False)
        self._assign_modules_buffers()  # read again, as torch's __setstate__ does (the copy's forward may add some)
        self._comm_hooks = []  # the reducer is new: no hook registered on it yet
        self.process_group = process_group
        self.__dict__.setdefault("require_forward_param_sync", True)
        self.__dict__.setdefault("require_backward_grad_sync", True)
        self._attach_replicas()
        self._attach_reducer()

    # Under torch.compile, dynamo compiles the module's forward alone, as torch DDP means it to ("dynamo only kicks in
    # for the 'module_to_run' underneath", distributed.py): this frame is skipped (recursive=False: the frames it calls
    # are compiled, the module's among them), and the two steps around the module run as they are (enter_forward,
    # leave_forward, skipped whole: traced, the reducer's clock readings and its search of the output would each break
    # the graph). So the graph breaks only where the wrapper is skipped, never inside its steps, and the module's frame
    # is compiled inside _inside_ddp_forward, which DDPOptimizer needs. The decorators import dynamo at their first
    # call, as torch DDP's forward does.
    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with profiled("minidp.DistributedDataParallel.forward"):
            recording, inputs, kwargs = self.enter_forward(inputs, kwargs)
            with self._inside_ddp_forward():
                output = (self.module if self._replicas is None else self._replicas)(*inputs, **kwargs)
            return self.leave_forward(output, recording)

    # Dynamo's DDPOptimizer splits a compiled graph where the wrapper's buckets would end, so that each bucket's
    # all-reduce starts while the backward of the graph's earlier pieces still runs (torch/_dynamo/backends/
    # distributed.py). It engages only for a frame compiled while torch's DistributedDataParallel._active_ddp_module
    # is set (convert_frame.py asks _get_active_ddp_module() of torch's class, and reads the wrapper's
    # bucket_bytes_cap), which torch DDP sets around its module's forward: the same here, on torch's class (an
    # attribute set on this subclass would not be seen there). The previous value is restored, not cleared, for a DDP
    # inside another (torch's reason: TorchRec wraps embeddings in an inner DDP); the function itself is skipped by
    # dynamo, as torch's is.
    @contextmanager
    @torch._disable_dynamo(recursive=False)
    def _inside_ddp_forward(self) -> Iterator[None]:
        """The module's forward runs with this wrapper as torch DDP's active module (DDPOptimizer reads it)."""
        previous = TorchDistributedDataParallel._active_ddp_module
        TorchDistributedDataParallel._active_ddp_module = self
        try:
            yield
        finally:
            TorchDistributedDataParallel._active_ddp_module = previous

    @torch._disable_dynamo
    def enter_forward(self, inputs: tuple, kwargs: dict) -> tuple[bool, tuple, dict]:
        """What DDP does before the module's forward (torch's ``_pre_forward``): prepare the reducer, sync the
        buffers, cast to low precision; whether this forward records a graph, and the inputs to give the module.
        :func:`minidp.distributed.replicate` calls it from a forward pre-hook."""
        if self._use_python_reducer:  # as torch's _pre_forward: nothing to prepare, the hooks reduce by themselves
            return False, inputs, kwargs
        recording = self._before_module()
        if self._mixed is not None:  # the parameters and inputs in low precision (minidp.distributed.mixed_precision)
            self._mixed.to_low_precision(recording)
            inputs, kwargs = self._mixed.cast_inputs(inputs, kwargs)
            if self.find_unused_parameters and recording:
                self.reducer.find_accumulators()  # the new dtype gave each parameter a new accumulator
        return recording, inputs, kwargs

    @torch._disable_dynamo
    def leave_forward(self, output: Any, recording: bool) -> Any:
        """What DDP does after the module's forward (torch's ``_post_forward``): the next backward reduces if this
        forward recorded and syncs (searching ``output``'s graph with ``find_unused_parameters``)."""
        if self._use_python_reducer:  # as torch's _post_forward
            return output
        if self._mixed is not None and not recording:
            self._mixed.after_unrecorded_forward()
        return self._after_module(output, recording)

    def _before_module(self) -> bool:
        """Before the module's forward: whether this forward records a graph (and so prepares a backward)."""
        if not self._lazy_init_ran:
            self._lazy_init_ran = True
            self._setup_in_backward_optimizers()
        recording = torch.is_grad_enabled()
        if recording and self.require_backward_grad_sync:
            # the previous iteration's statistics, when sampled (set_runtime_stats_and_log), before a rebuild
            if self._logging.should_sample(self.reducer.iteration):
                self._logging.record(self.reducer.iteration, self.reducer.last_stamps, self.reducer.runtime_facts())
            self.reducer.prepare_for_forward()
        if recording:
            check_no_distributed_autograd()
            self.reducer.before_forward()
        # under Join: tell the joined ranks that this one still trains (minidp.distributed.join)
        work = Join.notify_join_context(self)
        self.reducer.set_forward_pass_work(work, self._divide_by_initial_world_size)
        if self.will_sync_module_buffers() and self._buffer_hook_location() is not _BufferCommHookLocation.POST_FORWARD:
            self._sync_buffers(joined=False)
        if self._join_config.enable:
            sync_backward_vote(self, joined=False)
        return recording

    def _after_module(self, output: Any, recording: bool) -> Any:
        """After the module's forward: the next backward reduces if this forward recorded and syncs."""
        if self.will_sync_module_buffers() and self._buffer_hook_location() is _BufferCommHookLocation.POST_FORWARD:
            self._sync_buffers(joined=False)
        self.require_forward_param_sync = recording and self.require_backward_grad_sync
        if self.require_forward_param_sync:
            self.reducer.prepare_for_backward(output)
        static_first = self.static_graph and self.reducer._counting()
        if (self.find_unused_parameters and not self.static_graph) or static_first:
            output = _through_sink(output, self._ddp_sink_clone)
        return output

    def _assign_modules_buffers(self) -> None:
        """The buffers DDP syncs, read from the module again (torch DDP's method: a module may replace its buffers
        between forwards): ``modules_buffers``, and ``named_module_buffers`` by name. Read at construction and at each
        sync only, as torch reads them: a model with no buffer when wrapped is never synced, even if its forward
        registers one later (each rank keeps its own), and one with buffers syncs those it has at each forward."""
        named = {n: b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore}
        self.modules_buffers = list(named.values())
        self.named_module_buffers = named

    def _sync_buffers(self, joined: bool) -> None:
        """The buffers made alike on every rank (``_sync_buffers``): by the buffer hook if one is registered,
        else broadcast from rank 0, or under Join from the newest rank still training (rank 0 may have joined
        with stale buffers; ``joined``: this rank has)."""
        self._assign_modules_buffers()
        # A buffer an earlier forward saved for its backward, not run yet, must not fail autograd's version check
        # because rank 0's value was copied over it: the forward's copies keep the version counters, as torch's keep
        # them. A joined rank's move them, as torch's (_DDPJoinHook.main_hook: _check_and_sync_module_buffers).
        keep_versions = (nullcontext() if joined
                         else torch.autograd._unsafe_preserve_version_counter(tuple(self.modules_buffers)))
        with torch.no_grad(), keep_versions:
            if self._buffer_hook is None:
                source = common_rank(self, candidate=not joined) if self._join_config.enable else 0
                broadcast_from(self.modules_buffers, self.process_group, source)
                return
            state, hook, _ = self._buffer_hook
            futures = hook(state, self.named_module_buffers)
        if futures is not None:
            self.reducer._install_post_backward_futures(futures)

    def _register_accum_grad_hook(self) -> None:
        """The Python reducer (``torch._dynamo.config.optimize_ddp="python_reducer"``; torch DDP's method of this name,
        the same arithmetic): a post-accumulate-grad hook on each parameter that requires grad, which divides its
        gradient by the world size and all-reduces it at once, alone, with a functional collective, or hands
        ``(param.grad, param)`` to each hook ``register_comm_hook`` registered (not a bucket: such a hook must be written
        for it). No buckets, no end-of-backward callback: everything is in the hooks, which compiled autograd traces
        into its graph, where the bucketing reducer's callback would never run (:func:`~.reducer.refuse_compiled_autograd`).
        Under inductor, its pass that fuses these all-reduces into buckets of ``bucket_cap_mb`` does the bucketing, as
        torch DDP switches it on here. Nothing else of DDP's forward runs in this mode (as torch's): no buffer
        broadcast, no search for unused parameters (a parameter that gets no gradient is not reduced), no ``join()``."""
        import torch._inductor.config
        import torch.distributed._functional_collectives as fcol

        torch._inductor.config._fuse_ddp_communication = True
        torch._inductor.config._fuse_ddp_bucket_size = self.bucket_bytes_cap / MIB  # bucket_cap_mb (25 by default)
        ddp_ref = weakref.ref(self)  # as the reducer's hooks: a dropped wrapper stops reducing

        def compiled_accum_grad_hook(param: nn.Parameter) -> None:
            ddp = ddp_ref()
            if ddp is None or not ddp.require_backward_grad_sync or param.grad is None:
                return
            if ddp._comm_hooks:
                for hook, state in ddp._comm_hooks:
                    hook(state, (param.grad, param))
            else:
                # a division, as torch's Python reducer (its C++ one multiplies by 1/world_size: see the reducer)
                gradient = param.grad / ddp.process_group.size()
                param.grad.copy_(fcol.all_reduce(gradient, "sum", ddp.process_group))

        self.__dict__["_accum_grad_hooks"] = [
            param.register_post_accumulate_grad_hook(compiled_accum_grad_hook)
            for param in self._module_parameters if param.requires_grad
        ]

    def _setup_in_backward_optimizers(self) -> None:
        """If parameters DDP reduces were given optimizers by ``torch.distributed.optim._apply_optimizer_in_backward``,
        step them after their bucket's all-reduce instead of after their local gradient: their own hooks removed,
        :func:`~minidp.distributed.comm_hooks.optimizer_in_backward_hook` registered (torch DDP's same-named
        method, at the first forward)."""
        params = synced_tensors(self.module, self.parameters_to_ignore, buffers=False)
        if not any(hasattr(p, "_in_backward_optimizers") for p in params):
            return
        # Imported here, where the user has imported it already (it gave the parameters their optimizers): at the
        # package's import, torch's functional optimizers it loads warn of torch.jit.script's deprecation, which a
        # program run with warnings as errors (python -W error) would fail on at `import minidp`
        from torch.distributed.optim import apply_optimizer_in_backward

        handles = apply_optimizer_in_backward.param_to_optim_hook_handle_map
        for param in params:
            for handle in handles.get(param, []):
                handle.remove()
        self.register_comm_hook(weakref.ref(self), optimizer_in_backward_hook(self.gradient_as_bucket_view))
        self.reducer._set_optimizer_in_backward()

    def _default_broadcast_coalesced(
        self, bufs: Optional[Sequence[torch.Tensor]] = None, bucket_size: Optional[int] = None, authoritative_rank: int = 0
    ) -> None:
        """Broadcast ``bufs`` (default: ``modules_buffers``, the buffers DDP syncs as it last read them) from
        ``authoritative_rank`` to every rank: what the forward does without a buffer hook, for a hook to call (torch
        DDP's method; ``bucket_size`` is accepted and not needed: one flat tensor per dtype is sent)."""
        broadcast_from(self.modules_buffers if bufs is None else bufs, self.process_group, authoritative_rank)

    def _buffer_hook_location(self) -> Optional[_BufferCommHookLocation]:
        return None if self._buffer_hook is None else self._buffer_hook[2]

    def _register_buffer_comm_hook(
        self, state: object, hook: Callable[[object, dict[str, torch.Tensor]], Optional[list[torch.futures.Future]]],
        comm_hook_location: _BufferCommHookLocation = _BufferCommHookLocation.POST_FORWARD,
    ) -> None:
        """Let ``hook(state, {name: buffer})`` make the buffers alike across ranks instead of the broadcast from
        rank 0 (torch DDP's private API), before the forward or, by default, after it. The hook changes the
        buffers in place; futures it returns are waited for at the end of the next backward."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self._buffer_hook = (state, hook, comm_hook_location)

    def _tensors_to_sync(self) -> list[torch.Tensor]:
        """What the last rank to join copies to all (``_sync_final_model``): parameters, and buffers if synced."""
        return synced_tensors(self.module, self.parameters_to_ignore, self.forward_sync_buffers)

    def will_sync_module_buffers(self) -> bool:
        """Whether this forward starts with a broadcast of the buffers (``will_sync_module_buffers``)."""
        return self.forward_sync_buffers and self.require_forward_param_sync and len(self.modules_buffers) > 0

    # ---- uneven inputs: torch.distributed.algorithms.Join ----------------------------------

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Train on uneven inputs: wrap the training loop in ``with ddp.join():`` (torch DDP's ``join``).

        A rank that runs out of data shadows the others' collectives until every rank has, then the
        last rank to finish sends its model to all (:mod:`minidp.distributed.join`).
        ``divide_by_initial_world_size``: divide gradients by the starting world size (default), or by
        the number of ranks still training. ``enable=False``: no shadowing (inputs known to be even).
        ``throw_on_early_termination``: every rank raises as soon as one runs out of data.
        """
        return Join([self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """The hook ``Join`` runs on a rank that has joined; ``divide_by_initial_world_size`` (default True)."""
        return DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s own flags live: the parameters' device."""
        return next(iter(self.module.parameters())).device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this context accumulate gradients locally, unreduced;
        the first synchronised backward after it reduces the sum. Include the forward in the context."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket instead of the built-in all-reduce.

        ``bucket`` is a :class:`~minidp.distributed.buckets.GradBucket` (``buffer()``, ``index()``,
        ``is_last()``, ``gradients()``, ``parameters()``, ``set_buffer()``), filled with the gradients
        *not* divided by the world size; ``hook`` returns a ``torch.futures.Future`` of the reduced
        buffer: one tensor (not the list a collective's future holds), of its size or longer (the first
        elements are read), as torch's reducer requires. Stock hooks work:
        ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``' ``allreduce_hook``,
        ``fp16_compress_hook``, ``bf16_compress_hook``. Once, before the backward.
        Checked as torch DDP checks it (:func:`~minidp.distributed.comm_hooks.check_comm_hook`).
        """
        with self._errors_logged():
            check_comm_hook(hook)
            self.reducer.register_comm_hook(state, hook)
        self._comm_hooks.append((hook, state))
        self._logging.entries["comm_hook"] = getattr(hook, "__qualname__", type(hook).__qualname__)

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch DDP's built-in hooks (``dist.BuiltinCommHookType.ALLREDUCE``, ``FP16_COMPRESS``): the Python
        ``default_hooks`` with their arithmetic, on this wrapper's process group."""
        with self._errors_logged():
            self.reducer.register_comm_hook(self.process_group, builtin_hook(comm_hook_type), builtin=True)
        self._logging.entries["comm_hook"] = str(comm_hook_type)

    def _set_static_graph(self) -> None:
        """``static_graph=True`` after construction, before the first forward (torch's private API, its warnings).
        The first plan stays the one made at construction."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        with self._errors_logged():
            self.reducer.set_static_graph()
        self.static_graph = True
        self._logging.entries["static_graph"] = 1
        if self.find_unused_parameters:
            _warn_find_unused_is_not_needed(stacklevel=3)

    # ---- runtime statistics ------------------------------------------------------------------

    @contextmanager
    def _errors_logged(self) -> Iterator[None]:
        """An error raised inside is recorded in the runtime statistics before it propagates, as torch DDP's
        ``_log_and_throw`` records the errors of its checks (``has_error``, ``error``)."""
        try:
            yield
        except (RuntimeError, TypeError, ValueError) as error:
            self._logging.set_error(error)
            raise

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch DDP's construction data and sampled runtime statistics, same keys, same meanings
        (:mod:`minidp.distributed.logging_data`)."""
        return self._logging.as_dict()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Keep the runtime statistics of the first 10 iterations and then of every ``sample_rate``-th (default 100)."""
        with self._errors_logged():
            self._logging.set_sample_rate(sample_rate)

    def _check_reducer_finalized(self) -> None:
        """Raise if the last backward left gradients unreduced (call it after ``backward()`` to fail early: the
        next forward raises otherwise, as torch DDP's does)."""
        self.reducer._check_reducer_finalized()

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether the forward's outputs are cloned where torch DDP's ``_DDPSink`` clones them (with
        ``find_unused_parameters``, and until a static graph's first backward); ``True`` by default, as in torch."""
        self._ddp_sink_clone = val

    def _remove_autograd_hooks(self) -> None:
        """Stop reducing gradients in the backward (the reducer's hooks removed)."""
        self.reducer._remove_autograd_hooks()

    def bucket_plan(self) -> list[list[int]]:
        """The buckets the next backward will use, in reduction order: each a list of parameter indices
        (positions among the parameters that require grad, in registration order), as torch DDP numbers
        them; after the first backward, the rebuilt plan (``rebuilt_per_bucket_param_indices``)."""
        return self.reducer.plan()

    def timeline(self) -> list[dict]:
        """The events of the last synchronised backward on this rank (see :meth:`Reducer.timeline`);
        :func:`minidp.distributed.timeline.chrome_trace` merges several ranks' into one trace."""
        return self.reducer.timeline()


def _torchs_own(name: str) -> str:
    return (f"DistributedDataParallel.{name} is torch DDP's own (its C++ reducer and the steps of its forward), "
            f"which minidp's DistributedDataParallel derives from for isinstance() only and does not run; "
            f"docs/ddp-attributes.md lists what minidp provides. Use torch.nn.parallel.DistributedDataParallel for it")


# Methods of torch's class that minidp's does not define would run torch's code on attributes minidp lacks: each is
# refused with its name instead. (train() only calls nn.Module's.)
refuse_inherited(DistributedDataParallel, TorchDistributedDataParallel, _torchs_own, keep=["train"])


def refuse_unsupported(**arguments: Any) -> None:
    """Raise, before anything happens, if one of torch DDP's arguments that minidp does not implement is set."""
    given = [name for name, value in arguments.items() if value is not None]  # identity: a tensor has no truth value
    if given:
        raise NotImplementedError(
            f"minidp's DistributedDataParallel does not implement {', '.join(given)} (torch DDP's; the rest of its "
            f"arguments work): leave {'it' if len(given) == 1 else 'them'} unset, or use "
            f"torch.nn.parallel.DistributedDataParallel for this model"
        )


def refuse_with_python_reducer(mixed_precision: Optional[Any], bucket_cap_mb_list: Optional[list[float]]) -> None:
    """Raise for what the Python reducer cannot do: per-bucket caps (torch's refusal, its type and words), and
    ``mixed_precision``, whose casts are steps of the forward this mode skips; torch DDP then trains in full precision
    without a word, minidp says so."""
    if bucket_cap_mb_list:
        raise AssertionError("when using bucket_cap_mb_list, python reducer is not supported")
    if mixed_precision is not None:
        raise NotImplementedError(
            'mixed_precision with torch._dynamo.config.optimize_ddp="python_reducer": in that mode DDP\'s forward '
            'does nothing around the module, so nothing would be cast (torch DDP trains in full precision then). Cast '
            'the module and its inputs yourself, or use another optimize_ddp mode'
        )


def process_group_of(process_group: Optional[dist.ProcessGroup], device_mesh: Optional[Any],
                     module: nn.Module) -> dist.ProcessGroup:
    """The group DDP averages over: ``process_group``, else the one dimension of ``device_mesh``, else the default.

    A ``device_mesh`` sliced from a larger one (``mesh["data_parallel"]``, as Lightning's ``ModelParallelStrategy``
    and torchtitan hand it over) is taken as its own group. torch DDP takes it so too, and turns ``module``'s
    ``DTensor`` parameters (tensor parallelism over the other dimensions) into their local shards around each
    forward (``_pre_dp_module_transform``); minidp does not do that, and refuses a module that has them.
    """
    if device_mesh is None:
        return process_group if process_group is not None else dist.group.WORLD
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    if device_mesh._get_root_mesh() != device_mesh and any(isinstance(p, DTensor) for p in module.parameters()):
        raise NotImplementedError(
            f"device_mesh {device_mesh} is a slice of a larger mesh and the module has DTensor parameters: torch DDP "
            f"takes that for data parallelism over tensor-parallel modules; minidp does not. Use "
            f"torch.nn.parallel.DistributedDataParallel for this model"
        )
    return device_mesh.get_group(mesh_dim=0)


def _warn_find_unused_is_not_needed(stacklevel: int) -> None:
    """torch DDP's warning for ``static_graph`` with ``find_unused_parameters``: the static graph finds them itself."""
    warnings.warn(
        "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will detect "
        "unused parameters automatically, so you do not need to set find_unused_parameters=true, just be "
        "sure these unused parameters will not change during training loop while calling "
        "`_set_static_graph`.",
        stacklevel=stacklevel,
    )


def buffer_sync(broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool]) -> tuple[bool, bool]:
    """Whether buffers are broadcast before each forward, and whether at construction, from the two arguments
    that say so: ``forward_sync_buffers`` (the forward only: buffers are always synchronised at construction)
    or, where it is not given, its older name ``broadcast_buffers`` (both; default True). torch 2.13 deprecates
    ``broadcast_buffers``; minidp warns as the installed torch warns."""
    if broadcast_buffers is not None and DDP_DEPRECATES_BROADCAST_BUFFERS:
        if forward_sync_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is "
                "deprecated and its value is ignored when `forward_sync_buffers` is provided.",
                FutureWarning, stacklevel=3,
            )
        else:
            warnings.warn(
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
                "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init. If you rely on "
                "buffers NOT being synced at init (e.g. rank-local buffers), keep using `broadcast_buffers=False` "
                "until `init_sync_buffers` is available.",
                FutureWarning, stacklevel=3,
            )
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    synced = broadcast_buffers if broadcast_buffers is not None else True
    return synced, synced


def _default_group_or_none() -> Optional[dist.ProcessGroup]:
    return dist.group.WORLD if dist.is_initialized() else None
