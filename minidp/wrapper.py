"""DataParallel and data_parallel: the five steps, composed.

    forward:   scatter the batch -> replicate the module -> parallel_apply -> gather the outputs
    backward:  autograd runs it all in reverse; replicate's backward is the fifth step, the
               reduction of every replica's gradients into the original parameters.

``DataParallel`` is a drop-in for ``torch.nn.DataParallel``, and an instance of it (libraries unwrap
``.module`` by ``isinstance``): same constructor, same ``forward``, the same attributes (``device_ids`` as
stock's ints for GPUs, ``output_device``, ``src_device_obj``, ``dim``), ``state_dict()`` keys prefixed
``module.``, and the same overridable methods ``scatter``, ``replicate``, ``parallel_apply`` and ``gather``,
called with the same arguments. Beyond stock, device ids may name the CPU and
may repeat: ``DataParallel(model, device_ids=["cpu"] * 4)`` runs four replicas in threads.
"""

from __future__ import annotations

import contextlib
import warnings
from operator import attrgetter
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from . import comm
from .device_ids import (
    DeviceLike, as_device, as_devices, check_device_list, check_meta_not_mixed, parse_device, visible_gpus,
)
from .hooks import observe_module, profiled
from .replica_cache import ReplicaCache, ReplicaCacheInfo
from .step1_scatter import scatter_kwargs
from .step2_replicate import (
    check_flag, check_is_module, check_module_device, check_no_call_bound_to_the_original, replicate,
)
from .step3_parallel_apply import check_not_tracing, compiling_several, outside_the_graph, parallel_apply
from .step4_gather import gather
from .torch_versions import clone_all

_warned_no_gpu = False


def resolve_device_ids(device_ids: Optional[Sequence[DeviceLike]]) -> list[torch.device]:
    """The devices to run replicas on; ``[]`` means "call the module directly", as stock does without a GPU.

    ``None`` means every visible GPU. Integer ids on a machine without a GPU, or none (``[]``), fall back to a
    direct call too, with a one-time warning that says how to ask for CPU replicas. With a GPU, ``[]`` is an error
    (stock's is an ``IndexError`` on ``device_ids[0]``).
    """
    global _warned_no_gpu
    if device_ids is None:
        return [torch.device("cuda", i) for i in range(visible_gpus())]
    check_device_list(device_ids, "device_ids")
    device_ids = list(device_ids)
    # `list(range(torch.cuda.device_count()))`, the usual way to name every GPU, is [] here: stock calls the module.
    if visible_gpus() == 0 and all(isinstance(d, int) and not isinstance(d, bool) for d in device_ids):
        for i, d in enumerate(device_ids):  # no GPU to check them against, but -2 is no GPU anywhere
            parse_device(d, f"device_ids[{i}]")
        if not _warned_no_gpu:
            _warned_no_gpu = True
            replicas = len(device_ids) or 2
            what = "names GPUs, but this machine has none" if device_ids else "names no device (this machine has no GPU)"
            warnings.warn(
                f"device_ids={device_ids} {what}: the module will be called directly, without replicas. To run "
                f"{replicas} replicas on the CPU, pass device_ids={['cpu'] * replicas!r}.",
                stacklevel=3,
            )
        return []
    if not device_ids:
        raise ValueError("device_ids is empty: give at least one device, e.g. [0, 1] or ['cpu'] * 2")
    devices = as_devices(device_ids, "device_ids")
    check_meta_not_mixed(devices, "device_ids")
    return devices


def _warn_if_imbalanced(devices: list[torch.device]) -> None:
    """Stock's check: warn when a GPU has less than 75% of the memory (or cores) of another."""
    gpus = sorted({d.index for d in devices if d.type == "cuda"})
    if len(gpus) < 2:
        return
    props = [torch.cuda.get_device_properties(i) for i in gpus]
    for measure in (lambda p: p.total_memory, lambda p: p.multi_processor_count):
        values = [measure(p) for p in props]
        low, high = values.index(min(values)), values.index(max(values))
        if values[low] / values[high] < 0.75:
            warnings.warn(
                f"There is an imbalance between your GPUs. You may want to exclude GPU {gpus[low]} which has "
                f"less than 75% of the memory or cores of GPU {gpus[high]}. You can do so by setting the "
                f"device_ids argument to DataParallel, or by setting the CUDA_VISIBLE_DEVICES environment variable.",
                stacklevel=3,
            )
            return


def tensors_replica_0_shares(
    module: nn.Module, replicas: Sequence[nn.Module], devices: Sequence[DeviceLike], cache: Optional[ReplicaCache]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What :func:`step_guarded` watches: the tensors several replicas share, running on the module's device
    (``devices[0]``: CPU replicas, a repeated GPU id), else none; and ``module``'s buffers, which ``replicas[0]`` shares.
    The shared ones are the parameters and, in grad mode, the buffers that require grad: those come through the
    parameters' ``Broadcast`` (so that their gradient flows back), aliases of the originals there; under no_grad every
    replica but the first gets a copy of them, as of any buffer. From ``cache`` where it bound those replicas (lists it
    holds, checked against the tree at that call), else by walking the tree (0.16 ms a walk for ResNet-50's 151
    modules), the parameters only where they are watched."""
    aliased = devices.count(devices[0]) > 1
    known = cache.originals(replicas[0]) if cache is not None else None
    if known is None:
        known = list(module.parameters()) if aliased else [], list(module.buffers())
    params, buffers = known
    if not aliased:
        return [], buffers
    # Read at every step (a buffer's requires_grad may change between steps): 8.2 us for ResNet-50's 159 buffers
    # (`python -m timeit -s "from operator import attrgetter; from minidp.zoo import resnet50; b =
    # list(resnet50(base=8).buffers()); r = attrgetter('requires_grad')" "list(filter(r, b))"`).
    differentiable = list(filter(_requires_grad, buffers)) if torch.is_grad_enabled() else []
    return params + differentiable if differentiable else params, buffers


_version, _requires_grad = attrgetter("_version"), attrgetter("requires_grad")


@contextlib.contextmanager
def step_guarded(module: nn.Module, shared: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> Iterator[None]:
    """A step that fails changes nothing it can put back; a step whose replicas changed a shared tensor in place fails.

    Buffers. Replica 0 shares the original's buffers, so its BatchNorm updates land in them during the step
    (stock's behaviour: the running statistics come from chunk 0). If another replica then fails,
    stock keeps replica 0's half of the step. Here the buffers are copied before the replicas run (a
    clone of each, all made by one ``_foreach_clone`` where torch has it), and on an exception every buffer is written
    back from the copy (all of them: BatchNorm's kernel updates its running statistics without moving
    their version counters; those that require grad too, which replica 0 holds as the original, or an alias of it).
    On success nothing more happens, and the buffers are the very tensors stock would leave.

    Shared tensors (those :func:`tensors_replica_0_shares` gives: parameters, and buffers that require grad, which
    come as the parameters do; "parameter" below speaks for both). Replicas on the module's own device hold aliases of
    its parameters (no copy), so where several run there (CPU replicas, a repeated GPU id) a forward that changes one in place
    (``self.weight.mul_(2)`` under ``torch.no_grad()``) changes the original once per replica, where stock refuses the
    change in replica 0 (a view of the original) and drops the other replicas' (copies, docs/stock-behaviour.md B42).
    Such a change moves the parameter's version counter, read before and after the replicas run (7 to 8 us a read for
    ResNet-50's 161 parameters, ``python -m timeit -s "from operator import attrgetter; from minidp.zoo import
    resnet50; ps = list(resnet50(base=8).parameters()); v = attrgetter('_version')" "list(map(v, ps))"``): a moved
    one fails the step, naming the parameter. The change itself cannot be undone (a change
    through ``.data`` moves no counter, and is not seen). With one replica on the module's device the counters are not
    read: its change lands once, as replica 0's does in stock through ``.data``, and a cuDNN RNN's
    ``flatten_parameters()`` in the forward moves them without changing a value.
    """
    versions = list(map(_version, shared))
    # The cheapest copy of many small buffers (step2_replicate._copy_buffers), outside autograd (a buffer may require grad).
    with torch.no_grad():
        saved = clone_all(buffers) if buffers else []
    try:
        yield
        if list(map(_version, shared)) != versions:
            _refuse_changed_in_place(module, shared, versions)
    except BaseException:
        if buffers:
            with torch.no_grad():
                torch._foreach_copy_(buffers, saved)
        raise


def _refuse_changed_in_place(module: nn.Module, shared: Sequence[torch.Tensor], versions: list[int]) -> None:
    """Fail the step, naming the parameters, and the buffers that require grad, that it changed in place."""
    moved = {id(t) for t, version in zip(shared, versions) if t._version != version}
    params = [(name, p) for name, p in module.named_parameters(remove_duplicate=False) if id(p) in moved]
    changed = [name for name, _ in params]
    frozen = [name for name, p in params if not p.requires_grad]
    buffers = [name for name, b in module.named_buffers(remove_duplicate=False) if id(b) in moved]
    if not changed:
        raise RuntimeError(_CHANGED_BUFFERS.format(buffers))
    raise RuntimeError(
        f"the replicas' forward changed parameter(s) {changed} in place. Replicas on the module's device share its "
        "parameters' memory (no copy), so the change landed in it once per replica there, and it now holds all of them "
        "(stock refuses the change in replica 0 of a parameter that requires grad, and drops the other replicas'). "
        "Change parameters outside the forward (under torch.no_grad(), between steps), or compute a new tensor from "
        "the parameter inside it (weight = self.weight * 2). (Seen by the parameters' version counters, read before and "
        "after the replicas run: an update another thread made meanwhile, such as its optimizer's step while this "
        "thread ran a forward of the same model, reads the same; give such a thread a copy of the model.)"
        + (f" {frozen} require(s) no grad: stock lets replica 0's change land once and the others change copies; "
           "state a forward updates (running statistics) belongs in a buffer (module.register_buffer), which every "
           "replica but the first gets a copy of, as stock gives it" if frozen else "")
        + (" " + _CHANGED_BUFFERS.format(buffers) if buffers else "")
    )


_CHANGED_BUFFERS = (
    "the replicas' forward changed buffer(s) {} in place, which require(s) grad. Replicas on the module's device share "
    "such a buffer's memory (it reaches them as the parameters do, no copy, so that its gradient flows back), so the "
    "change landed in it once per replica there; it is put back as it was before the step (stock lets replica 0's "
    "change land once, and drops the other replicas'). State a forward updates (running statistics, an average of the "
    "weights) belongs in a buffer that requires no grad, which every replica but the first gets a copy of, as stock "
    "gives it: register it detached (self.register_buffer(name, tensor.detach().clone())), or change it outside the "
    "forward, between steps."
)


def stock_device_id(device: torch.device) -> Union[int, torch.device]:
    """A device as stock's ``DataParallel`` keeps it in ``device_ids`` and ``output_device``: a GPU by its index
    (``torch.device("cuda", dp.device_ids[0])`` works), the CPU, which stock has no id for, as the device."""
    return device.index if device.type == "cuda" else device


class DataParallel(nn.DataParallel):
    """Run ``module`` on several devices at once, splitting each batch along ``dim``.

    Args:
        module: the module to parallelise; its parameters and buffers must be on ``device_ids[0]``.
        device_ids: where the replicas run: ints (CUDA ordinals), ``"cuda:N"``, ``"cpu"`` or
            ``torch.device``; repeats allowed. Default: every visible GPU (none: a direct call).
        output_device: where the gathered output goes (default ``device_ids[0]``; ``"cpu"`` works).
        dim: the batch dimension that inputs are split along and outputs joined along.
        reduce_backend: how the backward sums gradients: ``"torch"``, ``"ext"`` or ``"auto"``
            (default: the global choice of :func:`minidp.comm.set_reduce_backend`).
        cache_replicas: keep the replica modules between steps and only bind new tensors to them
            (:mod:`minidp.replica_cache`); same results, less Python per step. ``True``: a cache of
            its own; a :class:`~minidp.replica_cache.ReplicaCache`: that one; ``False``: build the
            replicas anew at every forward, as stock does. Switchable later through ``self.cache_replicas``.
        chunk_weights: split each batch in proportion to these, one positive weight per device
            (e.g. from :func:`minidp.calibrate`), instead of evenly as ``torch.chunk`` does. Rounding:
            largest remainder, ties to the lower index, every device at least one row while rows remain
            (:func:`minidp.comm.chunk_sizes_for_weights`). The results are those of an even split.
        gather_output: ``False``: ``forward`` returns the list of the replicas' outputs, each left on
            its replica's device, nothing gathered (one replica, or a direct call: a list of one);
            pass it to :func:`minidp.parallel_criterion` to compute the loss on the replicas.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[DeviceLike]] = None,
        output_device: Optional[DeviceLike] = None,
        dim: int = 0,
        *,
        reduce_backend: Optional[str] = None,
        cache_replicas: Union[bool, ReplicaCache] = True,
        chunk_weights: Optional[Sequence[float]] = None,
        gather_output: bool = True,
    ) -> None:
        # Derived from torch's class for isinstance only (accelerate's unwrap_model, ignite's Checkpoint and Lightning
        # Fabric's state dicts find the model inside a DataParallel so); its constructor, which refuses CPU ids, not run.
        nn.Module.__init__(self)
        check_is_module(module, "module")
        dim = comm.check_dim(dim, "dim")
        check_flag(gather_output, "gather_output")
        if not isinstance(cache_replicas, (bool, ReplicaCache)):
            raise TypeError(f"cache_replicas must be True, False or a ReplicaCache, got {cache_replicas!r}")
        self.module = module
        devices = resolve_device_ids(device_ids)
        self.device_ids = [stock_device_id(d) for d in devices]
        if len(devices) > 1:
            check_no_call_bound_to_the_original(module)  # and again whenever replicas are built from it
        if chunk_weights is not None:  # checked here, before a batch arrives; count only where replicas run
            chunk_weights = comm.check_chunk_weights(chunk_weights, len(devices) or None)
        self.chunk_weights = chunk_weights
        self.gather_output = gather_output
        self.dim = dim
        self.reduce_backend = comm.check_reduce_backend(reduce_backend, "reduce_backend")
        self.cache_replicas = bool(cache_replicas)
        self.replica_cache = cache_replicas if isinstance(cache_replicas, ReplicaCache) else ReplicaCache()
        if not devices:
            if output_device is not None:
                parse_device(output_device, "output_device")  # unused without replicas, but spelled right
            self.src_device_obj = self.output_device = None
            return
        self.src_device_obj = devices[0]  # stock's name: where the module lives
        self.output_device = stock_device_id(as_device(devices[0] if output_device is None else output_device, "output_device"))
        _warn_if_imbalanced(devices)
        if len(devices) == 1:
            self.module.to(self.src_device_obj)  # as stock: one device is "just run it there"

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A wrapper saved by an earlier minidp kept its devices as torch.device objects and the module's device as
        # `source_device`: loaded now, it keeps them as stock names and spells them.
        if "source_device" in state:
            state["src_device_obj"] = state.pop("source_device")
            state["device_ids"] = [stock_device_id(d) for d in state["device_ids"]]
            if state.get("output_device") is not None:
                state["output_device"] = stock_device_id(state["output_device"])
        super().__setstate__(state)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if compiling_several(len(self.device_ids)):
            return outside_the_graph(self.forward, *inputs, **kwargs)
        with profiled("minidp.DataParallel.forward"):
            if not self.device_ids:
                output = self.module(*inputs, **kwargs)
                return output if self.gather_output else [output]
            check_not_tracing(len(self.device_ids))
            inputs, kwargs = self.scatter(inputs, kwargs, self.device_ids)
            if not inputs:  # no arguments at all: one call on device_ids[0]
                inputs, kwargs = ((),), ({},)
            if len(self.device_ids) == 1:
                # One device: the module itself is the only replica, and its output is returned as it
                # is (as stock), unless it must move to another output_device (stock leaves it).
                check_module_device(self.module, self.src_device_obj, replicated=False)
                output = observe_module(self.src_device_obj, self.module, lambda: self.module(*inputs[0], **kwargs[0]),
                                        (inputs[0], kwargs[0]))
                if not self.gather_output:
                    return [output]
                moves = as_device(self.output_device, "output_device") != self.src_device_obj
                return self.gather([output], self.output_device) if moves else output
            # replicate checks where the module is (a cached replicate, only when its tree changed)
            used = self.device_ids[: len(inputs)]
            replicas = self.replicate(self.module, used)
            cache = self.replica_cache if self.cache_replicas else None
            # A replica that fails, or outputs that gather refuses, leave no half-updated statistics.
            with step_guarded(self.module, *tensors_replica_0_shares(self.module, replicas, used, cache)):
                outputs = self.parallel_apply(replicas, inputs, kwargs)
                output = self.gather(outputs, self.output_device) if self.gather_output else outputs
            if cache is not None:
                cache.finished(replicas)  # under no_grad, nothing will run them again: emptied now
            return output

    def scatter(
        self, inputs: tuple, kwargs: Optional[dict[str, Any]], device_ids: Sequence[DeviceLike]
    ) -> tuple[tuple[tuple, ...], tuple[dict[str, Any], ...]]:
        """Step 1: one chunk of the arguments per device (see :func:`minidp.scatter_kwargs`)."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim, chunk_weights=self.chunk_weights)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """Step 2: one replica per device; cut from autograd under ``torch.no_grad()``."""
        detach = not torch.is_grad_enabled()
        # A replica of this wrapper (a DataParallel inside a model another one wraps) shares the original's cache with
        # the other replicas: its entries would hold the outer replicas' modules, which the outer cache would then
        # find held and build anew at every step. It replicates anew, as stock does; the outer cache keeps its own.
        if self.cache_replicas and not getattr(self, "_is_replica", False):
            return self.replica_cache.replicate(module, device_ids, detach, self.reduce_backend)
        return replicate(module, device_ids, detach, reduce_backend=self.reduce_backend)

    def replica_cache_info(self) -> ReplicaCacheInfo:
        """How often the replicas came from the cache, how often they were built, and why last."""
        return self.replica_cache.info()

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """Step 3: run every replica on its chunk, in parallel."""
        return parallel_apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)])

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        """Step 4: join the outputs on ``output_device``. (Step 5 runs in backward: see replicate.)"""
        return gather(outputs, output_device, dim=self.dim)


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Optional[Sequence[DeviceLike]] = None,
    output_device: Optional[DeviceLike] = None,
    dim: int = 0,
    module_kwargs: Optional[dict[str, Any]] = None,
    *,
    replica_cache: Optional[ReplicaCache] = None,
    chunk_weights: Optional[Sequence[float]] = None,
) -> Any:
    """Evaluate ``module(*inputs, **module_kwargs)`` in parallel on ``device_ids``, for use inside
    another module's ``forward``: the primitives composed as ``torch.nn.parallel.data_parallel`` composes
    them, with ``DataParallel``'s checks, and no module built per call.

    ``inputs`` that is not a tuple is a single argument (a list too, as in stock). Where stock raises
    on a machine without a GPU, this runs: the module is called directly, or on CPU replicas when
    ``device_ids`` names the CPU. The replicas are built anew at every call, as stock does; pass a
    ``replica_cache`` (a :class:`~minidp.replica_cache.ReplicaCache` you keep) to reuse them between calls.
    ``chunk_weights``: split the batch in proportion to them, as in :class:`DataParallel`.
    """
    check_is_module(module, "module")
    dim = comm.check_dim(dim, "dim")
    if module_kwargs is not None and not isinstance(module_kwargs, dict):
        raise TypeError(f"module_kwargs must be a dict of keyword arguments or None, got a {type(module_kwargs).__name__}")
    if replica_cache is not None and not isinstance(replica_cache, ReplicaCache):
        raise TypeError(f"replica_cache must be a ReplicaCache you keep between calls, or None; got {replica_cache!r}")
    if not isinstance(inputs, tuple):
        inputs = () if inputs is None else (inputs,)
    devices = resolve_device_ids(device_ids)
    if compiling_several(len(devices)):
        return outside_the_graph(data_parallel, module, inputs, devices, output_device, dim, module_kwargs,
                                 replica_cache=replica_cache, chunk_weights=chunk_weights)
    if chunk_weights is not None:  # checked where no replica runs too, as DataParallel checks them
        comm.check_chunk_weights(chunk_weights, len(devices) or None)
    if not devices:  # no GPU and no CPU ids: a plain call, where stock raises
        if output_device is not None:
            parse_device(output_device, "output_device")
        return module(*inputs, **(module_kwargs or {}))
    output_device = as_device(devices[0] if output_device is None else output_device, "output_device")
    check_module_device(module, devices[0], replicated=len(devices) > 1)  # as stock (DataParallel would move a module on one device)
    check_not_tracing(len(devices))
    chunk_inputs, chunk_kwargs = scatter_kwargs(inputs, module_kwargs, devices, dim=dim, chunk_weights=chunk_weights)
    if not chunk_inputs:  # no arguments at all: one call on devices[0]
        chunk_inputs, chunk_kwargs = ((),), ({},)
    used = devices[: len(chunk_inputs)]
    if len(devices) == 1:
        output = observe_module(devices[0], module, lambda: module(*chunk_inputs[0], **chunk_kwargs[0]),
                                (chunk_inputs[0], chunk_kwargs[0]))
        return output if output_device == devices[0] else gather([output], output_device, dim=dim)
    detach = not torch.is_grad_enabled()
    replicas = replica_cache.replicate(module, used, detach) if replica_cache else replicate(module, used, detach)
    with step_guarded(module, *tensors_replica_0_shares(module, replicas, used, replica_cache)):
        outputs = parallel_apply(replicas, chunk_inputs, chunk_kwargs, used)
        output = gather(outputs, output_device, dim=dim)
    if replica_cache is not None:
        replica_cache.finished(replicas)
    return output
