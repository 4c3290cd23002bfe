"""Step 5, the reduction: the replicas' gradients summed into the original parameters.

It is not called by hand: autograd runs it in the backward of step 2. Replicate sends the
parameters to the replicas through :class:`Broadcast`, and the backward of a broadcast is a
reduction, :class:`ReduceAddCoalesced`; its backward, in turn, is a broadcast. The two autograd
Functions are each other's derivative, as in ``torch/nn/parallel/_functions.py``, so gradients of
any order flow through data parallelism: ``torch.autograd.grad(loss, params, create_graph=True)``
records a ``ReduceAddCoalesced`` node, and a gradient penalty built on its result backpropagates
through it as a broadcast.

What moves: in the forward of :class:`Broadcast`, the parameters, once to every device other than
their own (the device they live on receives aliases). In the backward, every replica's gradient
for every parameter is summed onto the parameters' device, in replica order
(:func:`minidp.comm.reduce_add_coalesced`, with the backend chosen there, per tensor).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Optional

import torch

from . import comm

_detach = torch.Tensor.detach
_requires_grad = attrgetter("requires_grad")


def apply_function(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, for the autograd Functions that take every parameter of a model as an argument.

    ``Function.apply`` is a Python wrapper around autograd's own ``apply`` (in C++) that walks its arguments
    first, unwrapping any tensor a finished functorch transform left behind (a "dead" wrapper: torch's
    NOTE [functorch vjp and autograd interaction]). minidp's Functions define no ``setup_context``, so they never
    run under a transform, and their tensors are a module's parameters or the gradients autograd hands a
    backward: no dead wrapper reaches them. The walk, 161 tensors for ResNet-50, costs 40 of the 320 us a
    ``Broadcast`` to 2 CPU replicas takes (``python -m timeit -s "import torch; from minidp.zoo import resnet50;
    from minidp.step5_reduce import Broadcast, apply_function; ps = list(resnet50(base=8).parameters()); d =
    [torch.device('cpu')] * 2" "apply_function(Broadcast, d, None, *ps)"``, against ``"Broadcast.apply(d, None,
    *ps)"``). It is skipped where no transform is active; where one is, ``Function.apply`` runs (and raises, saying
    a ``setup_context`` is needed).
    """
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)


class Broadcast(torch.autograd.Function):
    """Forward: ``tensors`` onto each device. Backward: the replicas' gradients summed onto the source.

    Outputs are device-major: ``[device 0: t0, t1, ..., device 1: t0, t1, ...]``.
    """

    @staticmethod
    def forward(ctx, devices: list[torch.device], reduce_backend: Optional[str], *tensors: torch.Tensor):
        source = ctx.source_device = tensors[0].device
        ctx.num_tensors = len(tensors)
        ctx.reduce_backend = reduce_backend
        # A frozen parameter's copies get no gradient, and would get a tensor of zeros each from autograd, for a
        # backward that discards them: a frozen backbone's size of zeros per replica at every step (stock's Broadcast
        # makes them). Not materialised, a gradient that did not arrive is None; the backward makes zeros only where
        # a parameter needs its sum and a replica gave it none (an unused parameter), as autograd made them: like its
        # output (the input's layout, on the replica's device).
        ctx.set_materialize_grads(False)
        ctx.inputs, ctx.devices = tensors, devices  # held for their metadata: the inputs live while the module does
        ctx.unreached_in = {}  # autograd's graph task -> whether no replica reached an output (note_replicas_reach)
        # On the source device broadcast returns the tensors themselves. Returned as they are, autograd
        # would turn each into a view of its input; a detached alias is the same storage (no copy, and
        # the same version counter, so in-place changes stay visible), takes this node as its grad_fn
        # just the same, and costs a third of the time to create.
        others = [device for device in devices if device != source]  # none for CPU replicas, or GPU ids [0, 0]
        copies = iter(comm.broadcast_coalesced(tensors, others) if others else ())
        outputs: list[torch.Tensor] = []
        for device in devices:
            outputs += map(_detach, tensors) if device == source else next(copies)
        if not all(map(_requires_grad, tensors)):  # frozen parameters: no gradient flows back to them
            ctx.mark_non_differentiable(*[o for o, t in zip(outputs, tensors * len(devices)) if not t.requires_grad])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        n = ctx.num_tensors
        if ctx.unreached_in.pop(torch._C._current_graph_task_id(), False) and all(grad is None for grad in grads):
            return (None,) * (2 + n)  # see note_replicas_reach
        needed = [i for i in range(n) if ctx.needs_input_grad[2 + i]]  # frozen parameters need no sum
        per_replica = [
            grads[start + i] if grads[start + i] is not None else torch.zeros_like(ctx.inputs[i], device=device)
            for start, device in zip(range(0, len(grads), n), ctx.devices) for i in needed
        ]
        sums = (apply_function(ReduceAddCoalesced, ctx.source_device, len(needed), ctx.reduce_backend, *per_replica)
                if needed else ())
        result: list[Optional[torch.Tensor]] = [None] * n
        for i, total in zip(needed, sums):
            result[i] = total
        return (None, None, *result)


def note_replicas_reach(node: Any, reached: bool) -> None:
    """Tell ``node``, if it is a :class:`Broadcast`'s, whether the replicas' graphs behind one parallel backward
    reached any of its outputs, in the backward about to run it. Where none of those that lead to it did, it sums
    nothing and the parameters keep no gradient (None), as where the replicas' graphs are run one by one, which never
    reach it then (the loss used no replica's parameters).

    minidp's parallel backward (:mod:`minidp.parallel_backward`) runs every replica's graph behind one node, which
    leads to this one whatever the loss used, and tells it (each of them, where the same replicas ran twice). A backward
    that reached it with no gradient (a custom Function's backward that returns None for a parameter it was given) still
    gets the sums of zeros autograd would give it, as stock's does. Kept per backward (autograd's graph task): a graph
    kept with retain_graph may be back-propagated again, or by two threads at once, and this node not run by one."""
    # A backward that will not run the node (autograd.grad of the batch alone) leaves no record, which it would never
    # take back: a graph kept and back-propagated so again and again would hold one for each.
    if type(node) is Broadcast._backward_cls and torch._C._will_engine_execute_node(node):
        task = torch._C._current_graph_task_id()
        node.unreached_in[task] = node.unreached_in.get(task, True) and not reached


class ReduceAddCoalesced(torch.autograd.Function):
    """Forward: ``grads`` (replica-major, ``num_tensors`` per replica) summed over the replicas onto
    ``destination``. Backward: the gradient of each sum broadcast back to every replica's device."""

    @staticmethod
    def forward(ctx, destination: torch.device, num_tensors: int, reduce_backend: Optional[str], *grads: torch.Tensor):
        per_replica = [grads[start : start + num_tensors] for start in range(0, len(grads), num_tensors)]
        ctx.replica_devices = [replica[0].device for replica in per_replica]
        ctx.reduce_backend = reduce_backend
        return comm.reduce_add_coalesced(per_replica, destination, backend=reduce_backend)

    @staticmethod
    def backward(ctx, *grad_sums: torch.Tensor):
        return (None, None, None, *apply_function(Broadcast, ctx.replica_devices, ctx.reduce_backend, *grad_sums))
