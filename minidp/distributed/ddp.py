"""DistributedDataParallel: one model per process, gradients averaged over the processes in the backward.

The construction, step by step (torch's ``DistributedDataParallel.__init__``):

1. the parameters to reduce: those that require grad, each once, in registration order
   (:func:`~minidp.distributed.checks.reducer_parameters`);
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
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from ..hooks import profiled
from ..wrapper import DataParallel
from .batchnorm import attach_exchange, check_torch_sync_batchnorm
from .broadcast import broadcast_from, broadcast_from_rank0
from .buckets import BucketCaps
from .checks import check_same_model, reducer_parameters, sparse_gradient_flags
from .comm_hooks import CommHook, builtin_hook, check_comm_hook
from .join import DDPJoinHook, common_rank, sync_backward_vote
from .logging_data import LoggingData
from .reducer import Reducer

DeviceLike = Union[int, str, torch.device]


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism across processes, with torch DDP's signature, defaults and arithmetic.

    Args:
        module: the model; the same on every rank (checked). Rank 0's parameters and buffers are
            copied to every rank here.
        device_ids: ``None``: run ``module`` as it is (its parameters' device). One or more devices
            (``["cpu", "cpu"]``, ``[0, 1]``): run replicas of it on them inside this process, with
            :class:`minidp.DataParallel`; ``module`` must be on ``device_ids[0]`` (with one device it
            is moved there, as ``DataParallel`` does).
        output_device: where those replicas' outputs are gathered (default ``device_ids[0]``).
        dim: the batch dimension the replicas split inputs along.
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: bucket size in MiB (default 25, with a 1 MiB first bucket; see
            :mod:`minidp.distributed.buckets`).
        find_unused_parameters: allow parameters that get no gradient in a backward: the graph is
            searched after each forward and their buckets do not wait for them.
        gradient_as_bucket_view: leave each ``.grad`` a view of its bucket instead of copying into it.
        static_graph: the graph is the same at every iteration: unused parameters are found once, in
            the first backward, which reduces everything at its end; a parameter used several times
            per backward (re-entrant checkpointing) is reduced after its last use
            (:meth:`~minidp.distributed.reducer.Reducer.set_static_graph`).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[DeviceLike]] = None,
        output_device: Optional[DeviceLike] = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)  # not in a Join context until join() or Join([...]) says so
        caps = BucketCaps.from_mb(bucket_cap_mb)
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call torch.distributed.init_process_group() first "
                "(torchrun sets the environment it reads), or start the processes with minidp.distributed.launch()"
            )
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.device_ids = None if device_ids is None else list(device_ids)
        self.output_device = output_device
        self._bucket_caps = caps
        self._attach_replicas()  # before the parameters are listed: DataParallel may move a module to its one device
        check_same_model(module, self.process_group, buffers=broadcast_buffers)
        broadcast_from_rank0(
            list(module.parameters()) + (list(module.buffers()) if broadcast_buffers else []),
            self.process_group,
        )
        self._attach_reducer()
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # whether the last forward was synchronised
        self._divide_by_initial_world_size = True  # under Join (see minidp.distributed.join)

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
        params, names = reducer_parameters(self.module)
        check_torch_sync_batchnorm(self.module, params[0].device)
        attach_exchange(self.module, self.process_group)  # minidp.SyncBatchNorm: statistics of every process
        sparse = sparse_gradient_flags(self.module, params)
        if any(sparse) and self._replicas is not None and len(self._replicas.device_ids) > 1:
            raise ValueError(
                f"'{names[sparse.index(True)]}' has sparse gradients, which several replicas per process "
                f"(device_ids={self.device_ids}) do not sum; pass one device_id (or None), or use sparse=False"
            )
        self.reducer = Reducer(params, names, self.process_group, self._bucket_caps, self.find_unused_parameters,
                               self.gradient_as_bucket_view, self.static_graph, sparse)
        self._logging = LoggingData()
        self._logging.set_construction_data(
            self.module, params, self.process_group, device_ids=self.device_ids, output_device=self.output_device,
            broadcast_buffers=self.broadcast_buffers, bucket_cap_bytes=self._bucket_caps.cap,
            find_unused_parameters=self.find_unused_parameters, gradient_as_bucket_view=self.gradient_as_bucket_view,
            bucket_sizes=[b.buffer.numel() * b.buffer.element_size() for b in self.reducer.buckets],
        )
        if self.static_graph:
            self._logging.entries["static_graph"] = 1

    # ---- pickling: torch.save, copy.deepcopy ------------------------------------------------

    def __getstate__(self) -> dict:
        """What is pickled: everything but the process group, the reducer (its hooks and buckets belong to
        these parameters) and the replicas, as torch DDP drops its process group, reducer and logger."""
        if self.process_group is not _default_group_or_none():
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process group. That "
                "is, when you have called init_process_group and have not passed process_group argument to DDP "
                "constructor"
            )
        state = dict(self.__dict__)
        for transient in ("process_group", "reducer", "_replicas"):
            state.pop(transient, None)
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled (``torch.load``, ``copy.deepcopy``): the default process group, and a fresh reducer with
        hooks on the unpickled parameters (torch DDP's ``__setstate__``). Nothing is broadcast or checked."""
        process_group = _default_group_or_none()
        if process_group is None:
            raise RuntimeError(
                "unpickling a DistributedDataParallel needs the default process group: call "
                "torch.distributed.init_process_group() first, or unpickle the wrapped .module instead"
            )
        super().__setstate__(state)
        self.process_group = process_group
        self.__dict__.setdefault("require_forward_param_sync", True)
        self.__dict__.setdefault("require_backward_grad_sync", True)
        self._attach_replicas()
        self._attach_reducer()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with profiled("minidp.DistributedDataParallel.forward"):
            recording = self._before_module()
            output = (self.module if self._replicas is None else self._replicas)(*inputs, **kwargs)
            return self._after_module(output, recording)

    # Under torch.compile, dynamo compiles the module's forward and runs the two steps around it as they are
    # (torch._disable_dynamo; torch DDP means the same, "dynamo only kicks in for the 'module_to_run' underneath",
    # distributed.py): traced, the reducer's clock readings and its search of the output would each break the graph
    # inside the wrapper. The decorator imports dynamo at its first call, as torch DDP's forward does.
    @torch._disable_dynamo
    def _before_module(self) -> bool:
        """Before the module's forward: whether this forward records a graph (and so prepares a backward)."""
        recording = torch.is_grad_enabled()
        if recording and self.require_backward_grad_sync:
            # the previous iteration's statistics, when sampled (set_runtime_stats_and_log), before a rebuild
            if self._logging.should_sample(self.reducer.iteration):
                self._logging.record(self.reducer.iteration, self.reducer.last_stamps, self.reducer.runtime_facts())
            self.reducer.prepare_for_forward()
        if recording:
            self.reducer.before_forward()
        # under Join: tell the joined ranks that this one still trains (minidp.distributed.join)
        work = Join.notify_join_context(self)
        self.reducer.set_forward_pass_work(work, self._divide_by_initial_world_size)
        if self.will_sync_module_buffers():
            # under Join rank 0 may have joined with stale buffers: the newest rank still training sends
            source = common_rank(self, candidate=True) if self._join_config.enable else 0
            broadcast_from(self._buffers_to_sync(), self.process_group, source)
        if self._join_config.enable:
            sync_backward_vote(self, joined=False)
        return recording

    @torch._disable_dynamo
    def _after_module(self, output: Any, recording: bool) -> Any:
        """After the module's forward: the next backward reduces if this forward recorded and syncs."""
        self.require_forward_param_sync = recording and self.require_backward_grad_sync
        if self.require_forward_param_sync:
            self.reducer.prepare_for_backward(output)
        return output

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        return list(self.module.buffers())  # looked up each time: a module may replace its buffers

    def will_sync_module_buffers(self) -> bool:
        """Whether this forward starts with a broadcast of the buffers (``will_sync_module_buffers``)."""
        return self.broadcast_buffers and self.require_forward_param_sync and bool(self._buffers_to_sync())

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
        buffer. Stock hooks work: ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``'
        ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``. Once, before the backward.
        Checked as torch DDP checks it (:func:`~minidp.distributed.comm_hooks.check_comm_hook`).
        """
        with self._errors_logged():
            check_comm_hook(hook)
            self.reducer.register_comm_hook(state, hook)
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
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will detect "
                "unused parameters automatically, so you do not need to set find_unused_parameters=true, just be "
                "sure these unused parameters will not change during training loop while calling "
                "`_set_static_graph`.",
                stacklevel=2,
            )

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
        """Raise if the last backward left gradients unreduced (call it after ``backward()`` to fail early)."""
        self.reducer._check_reducer_finalized()

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


def _default_group_or_none() -> Optional[dist.ProcessGroup]:
    return dist.group.WORLD if dist.is_initialized() else None
