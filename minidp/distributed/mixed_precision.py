"""DDP's native mixed precision: the forward and backward in low precision, the optimizer in full precision.

torch DDP takes ``mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` (a private class of
``torch/nn/parallel/distributed.py``; any object with those three attributes does here) and runs, per iteration:

1. **at construction**: every parameter DDP manages (not ignored) gets ``_fp_param``, its full-precision data, and
   ``_mp_param``, a ``param_dtype`` tensor whose storage is freed until a forward needs it
   (``_setup_mixed_precision_params``); every buffer DDP manages is cast to ``buffer_dtype`` for good (``_cast_buffers``);
2. **before each forward** (:meth:`MixedPrecision.to_low_precision`, torch's ``_root_copy_hook``): each parameter's
   data copied into its ``_mp_param`` (the copy casts), a ``.grad`` it already has cast down too (accumulation goes
   on in ``param_dtype``), and the parameter made to hold ``_mp_param``; the floating-point inputs cast to
   ``param_dtype`` (:meth:`MixedPrecision.cast_inputs`). Autograd then records the forward in low precision;
3. **the backward** computes the gradients in ``param_dtype``; the reducer's buckets are of that dtype;
4. **each bucket's reduction** (:func:`allreduce_and_upcast`, torch's ``_reducer_allreduce_and_upcast_hook``, a
   communication hook): the bucket cast to ``reduce_dtype``, summed over the ranks, divided by the world size in
   ``reduce_dtype``; then each of its parameters gets its full-precision data back (the low-precision storage freed)
   and its ``.grad`` is cast up; the reducer writes the mean into that full-precision ``.grad`` at the end;
5. **at the end of the backward**, the parameters that require no gradient (in no bucket) get their full-precision
   data back.

So the optimizer sees ``float32`` parameters and gradients, as before; what was reduced is the mean of the
``param_dtype`` gradients, computed in ``reduce_dtype``. As in torch, a backward under ``no_sync`` leaves the
parameters and their accumulating gradients in ``param_dtype`` until the next reducing backward (the full-precision
data stays safe in ``_fp_param``), and no other communication hook can be registered. A forward under
``torch.no_grad()`` puts the full-precision data back as it ends (:meth:`MixedPrecision.after_unrecorded_forward`).
Unlike torch's, which runs the copies on a side stream and waits on events, everything here runs in order on the
current stream; and with ``gradient_as_bucket_view=True`` a ``.grad`` is a full-precision tensor of its own, since a
``param_dtype`` bucket cannot be viewed as one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.utils import _apply_to_tensors

from .groups import size_of

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_mixed_precision(config: Any) -> None:
    """Raise before anything changes when ``config`` is not a mixed precision configuration DDP can use."""
    names = ("param_dtype", "reduce_dtype", "buffer_dtype")
    missing = [name for name in names if not hasattr(config, name)]
    if missing:
        raise TypeError(
            f"mixed_precision must have param_dtype, reduce_dtype and buffer_dtype (as "
            f"torch.nn.parallel.distributed._MixedPrecision has); {type(config).__name__} lacks {', '.join(missing)}"
        )
    for name in names:
        dtype = getattr(config, name)
        if dtype is not None and dtype not in _FLOATING:
            raise TypeError(f"mixed_precision.{name} must be a floating-point dtype or None, got {dtype!r}")
    if config.param_dtype is None:
        raise TypeError("mixed_precision.param_dtype must be set: it is the dtype the forward and backward run in")


def _free(tensor: torch.Tensor) -> None:
    """Give back ``tensor``'s memory and keep the tensor (torch.distributed.utils' ``_free_storage``)."""
    tensor.untyped_storage().resize_(0)


def _allocate(tensor: torch.Tensor) -> None:
    """Memory for ``tensor`` again, if it was freed (``_alloc_storage``)."""
    if tensor.untyped_storage().size() == 0:
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


class MixedPrecision:
    """One DistributedDataParallel's mixed precision: its configuration and the parameters it casts.

    ``module``'s parameters and buffers not named in ``ignored`` are managed: here the parameters get
    ``_mp_param`` and ``_fp_param`` (once: a second wrapper of the same module reuses them) and the buffers are cast.
    ``group`` is the process group the gradients are averaged over.
    """

    def __init__(self, config: Any, module: nn.Module, ignored: frozenset[str], group: dist.ProcessGroup) -> None:
        self.config = config
        self.group = group
        self.reduce_dtype: torch.dtype = config.reduce_dtype or config.param_dtype
        self.params = [p for name, p in module.named_parameters() if name not in ignored]
        with torch.no_grad():
            for param in self.params:
                if not hasattr(param, "_mp_param"):
                    param._mp_param = torch.zeros_like(param, dtype=config.param_dtype, requires_grad=param.requires_grad)
                    _free(param._mp_param)
                    param._fp_param = param.data
            if config.buffer_dtype is not None:
                for name, buffer in module.named_buffers():
                    if name not in ignored:
                        buffer.data = buffer.to(config.buffer_dtype)
        self._restore_queued = False

    def to_low_precision(self, recording: bool) -> None:
        """Step 2: every managed parameter holds a fresh ``param_dtype`` copy of its data; where the forward records
        a graph, a ``.grad`` is cast down too (the backward accumulates into it)."""
        self._restore_queued = False  # a backward that failed midway never ran its callback
        with torch.no_grad():
            for param in self.params:
                low = param._mp_param
                if param.is_set_to(low):  # still low precision, after a backward under no_sync: nothing to copy
                    continue
                _allocate(low)
                low.copy_(param.data)
                if recording and param.grad is not None:
                    param.grad.data = param.grad.to(low.dtype)
                param.data = low

    def after_unrecorded_forward(self) -> None:
        """A forward under ``torch.no_grad()`` has no backward to restore the parameters: restored now, so that an
        evaluation leaves the model as it found it (torch's pre-hook raises there instead). The low-precision copies
        keep their memory until the next forward: an output may be a view of one."""
        for param in self.params:
            param.data = param._fp_param

    def cast_inputs(self, inputs: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """Step 2: the floating-point tensors of the forward's arguments in ``param_dtype`` (:func:`cast_floating`,
        the walk of torch's ``_cast_forward_inputs``; not that function itself, whose first parameter is named
        ``dtype``: a forward's keyword argument of that name collides with it there, and torch's DDP raises)."""
        return cast_floating(inputs, self.config.param_dtype), cast_floating(kwargs, self.config.param_dtype)

    def to_full_precision(self, param: torch.Tensor) -> None:
        """Step 4, for one reduced parameter: its full-precision data back, its low-precision copy freed, its
        ``.grad`` cast up."""
        param.data = param._fp_param
        _free(param._mp_param)
        if param.grad is not None:
            param.grad.data = param.grad.to(param.dtype)

    def queue_restore_after_backward(self) -> None:
        """Have :meth:`restore_after_backward` run once the running backward ends (once per backward), or now where
        no backward runs: a rank that ran out of data under ``join()`` runs the hook to shadow its peers' all-reduces
        (:mod:`minidp.distributed.join`), outside any backward, where autograd refuses a callback."""
        if torch._C._current_graph_task_id() == -1:
            self.restore_after_backward()
        elif not self._restore_queued:
            self._restore_queued = True
            Variable._execution_engine.queue_callback(self.restore_after_backward)

    def restore_after_backward(self) -> None:
        """Step 5, at the end of a backward that reduced: the parameters that take no gradient hold their
        full-precision data again."""
        self._restore_queued = False
        for param in self.params:
            if not param.requires_grad:
                param.data = param._fp_param


def allreduce_and_upcast(mixed, bucket):
    """Step 4, the communication hook every mixed-precision DDP registers: the bucket's mean in ``reduce_dtype``,
    then its parameters and gradients in full precision. ``mixed`` is the :class:`MixedPrecision`, ``bucket`` a
    :class:`~minidp.distributed.buckets.GradBucket`; returns a completed ``torch.futures.Future`` of the mean. (No
    annotations: under this module's postponed ones they would be strings, which ``register_comm_hook`` refuses, as
    torch DDP's does.)"""
    buffer = bucket.buffer()
    if buffer.dtype != mixed.reduce_dtype:
        buffer = buffer.to(mixed.reduce_dtype)
        bucket.set_buffer(buffer)
    dist.all_reduce(buffer, group=mixed.group)  # torch's hook waits for it too, before dividing
    buffer.div_(size_of(mixed.group))
    for param in bucket.parameters():
        mixed.to_full_precision(param)
    mixed.queue_restore_after_backward()
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with its floating-point tensors in ``dtype``, the others as they are, found by the walk torch's DDP and
    FSDP2 cast with, ``_apply_to_tensors``: into dataclasses, dicts (a dict subclass comes back a plain dict, an
    ``OrderedDict`` keeps its class), namedtuples, lists, tuples and sets; not into other mappings (a ``UserDict``) nor
    a ``PackedSequence``, which come back as they are."""
    return _apply_to_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, obj)
