"""Communication hooks: the checks torch DDP makes when one is registered, and its two built-in hooks.

A hook ``hook(state, bucket)`` replaces a bucket's all-reduce (see :mod:`minidp.distributed.reducer`).
``DistributedDataParallel.register_comm_hook`` checks it as torch 2.13 does
(``distributed.py``, ``_check_comm_hook``), with torch's messages:

* not callable: ``TypeError("Communication hook must be callable.")``;
* a parameter ``bucket`` annotated with anything but ``dist.GradBucket`` (or minidp's
  :class:`~minidp.distributed.buckets.GradBucket`, which is what minidp hands it), or a return
  annotation other than ``torch.futures.Future[torch.Tensor]``: ``ValueError``;
* a second registration, of either kind: the reducer's ``RuntimeError``.

Where torch fails obscurely, the error here says what to change: a hook without a parameter named
``bucket`` (torch: ``KeyError: 'bucket'``), a hook whose result is not a ``Future`` (torch: a pybind
cast error, in the backward). One check is left out on purpose: torch refuses hooks *named*
``bf16_compress_hook`` without NCCL; the hook's arithmetic runs on any backend, and does here.

The built-in hooks (``_register_builtin_comm_hook``, ``dist.BuiltinCommHookType``) are C++ in torch,
with the arithmetic of the Python ``default_hooks``: ``ALLREDUCE`` divides the bucket by the world
size, then all-reduces it; ``FP16_COMPRESS`` casts it to float16, divides, all-reduces, and casts back
into the bucket. They are those Python hooks here, with the process group as their state.

One more hook is DDP's own: with ``torch.distributed.optim._apply_optimizer_in_backward``, each
parameter's optimizer steps inside the backward, once its bucket is reduced
(:func:`optimizer_in_backward_hook`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .buckets import GradBucket

CommHook = Callable[[Any, GradBucket], torch.futures.Future]

ONLY_ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once."
ONLY_ONCE_BUILTIN = "register_builtin_comm_hook or register_comm_hook can only be called once."

BUILTIN_HOOKS: dict[Any, CommHook] = {
    dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
    dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
}


def check_comm_hook(hook: Any) -> None:
    """Raise unless ``hook`` can be a communication hook (torch's ``_check_comm_hook``, its messages)."""
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    signature = inspect.signature(hook)
    if "bucket" not in signature.parameters:
        raise ValueError(
            f"Communication hook: {getattr(hook, '__name__', hook)!r} has parameters {list(signature.parameters)}; "
            f"torch DDP passes the bucket by the name 'bucket': define it as hook(state, bucket)"
        )
    annotation = signature.parameters["bucket"].annotation
    if annotation not in (inspect.Parameter.empty, dist.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor].")


def builtin_hook(hook_type: Any) -> CommHook:
    """The hook of a ``dist.BuiltinCommHookType``."""
    if hook_type not in BUILTIN_HOOKS:
        raise TypeError(
            f"_register_builtin_comm_hook: comm_hook_type must be a torch.distributed.BuiltinCommHookType "
            f"({', '.join(f'dist.BuiltinCommHookType.{t.name}' for t in BUILTIN_HOOKS)}), got {hook_type!r}"
        )
    return BUILTIN_HOOKS[hook_type]


def future_result(value: Any, bucket_index: int) -> None:
    """Raise unless a hook returned a future (torch's message, in the backward, is a cast error)."""
    if not isinstance(value, torch._C.Future):  # what collectives' get_future() returns; torch.futures.Future's base
        raise RuntimeError(
            f"DDP communication hook's callback must return a torch.futures.Future object, but got "
            f"{type(value).__module__}.{type(value).__qualname__} (bucket {bucket_index})"
        )


def optimizer_in_backward_hook(gradient_is_bucket_view: bool) -> CommHook:
    """The hook DDP registers for parameters given optimizers by ``_apply_optimizer_in_backward`` (torch's
    ``optimizer_overlap_hooks._apply_optim_in_backward_hook``, without its CUDA stream, which makes torch's fail
    on a machine without an accelerator). Its state is a weak reference to the wrapper.

    Per bucket: the all-reduce, waited for at once; the sum divided by the world size; each parameter's
    ``.grad`` set to its view of the bucket (it is one already with ``gradient_is_bucket_view``) and its
    optimizers stepped. When the backward ends, those parameters' ``.grad`` is set to None, as without DDP.
    """
    pending = {"clear_queued": False}

    def hook(state, bucket):  # no annotations: under this module's postponed ones they would be strings, refused
        ddp = state()
        ddp.reducer._run_allreduce_hook(bucket).wait()
        bucket.buffer().div_(ddp.process_group.size())
        # the bucket's own views, in each parameter's layout (torch's hook takes gradients(), which read a
        # channels-last or transposed gradient row-major: scrambled)
        for param, grad in zip(bucket.parameters(), bucket._bucket.views):
            if hasattr(param, "_in_backward_optimizers"):
                if not gradient_is_bucket_view:
                    param.grad = grad
                for optimizer in param._in_backward_optimizers:
                    optimizer.step()
        if not pending["clear_queued"]:
            pending["clear_queued"] = True
            Variable._execution_engine.queue_callback(lambda: _clear_stepped_gradients(ddp, pending))
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    return hook


def _clear_stepped_gradients(ddp: Any, pending: dict) -> None:
    for param in ddp._get_data_parallel_params(ddp.module):
        if hasattr(param, "_in_backward_optimizers"):
            param.grad = None
    pending["clear_queued"] = False
