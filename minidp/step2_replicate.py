"""Step 2, replicate: one copy of the module per device, whose gradients flow back to the original.

A replica is a shallow copy of every sub-module (``Module._replicate_for_data_parallel``: same class,
same attributes and hooks, its own ``_parameters``, ``_buffers`` and ``_modules`` dicts), wired into
the same tree, with each parameter and buffer replaced by that device's copy.

What moves: the parameters and buffers, once to every device other than the module's own. A replica
on the module's own device copies no parameter: it reads the original storage.

What autograd records: the parameters reach the replicas through
:class:`minidp.step5_reduce.Broadcast`, one autograd node for all of them. Its backward is step 5,
the reduction: it sums the gradient each replica produced for each parameter, in replica order,
onto the module's device, and autograd adds that sum into the original parameter's ``.grad`` once. So replica parameters are not leaves (they have
no ``.grad`` of their own) and ``replica.parameters()`` is empty, as in stock. Replicas on the CPU
(two or more, while grad is recorded) receive them through one more node each, an identity,
:class:`minidp.parallel_backward.ReplicaEntry`: where each replica's graph ends, so that its
backward can run in its own thread (:mod:`minidp.parallel_backward`).

Buffers (BatchNorm's running statistics, say) are not differentiated. Replica 0 shares the
original's buffers, so its in-place updates persist; every other replica works on its own copy,
whose updates are dropped. That is stock's behaviour: running statistics come from chunk 0.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from itertools import chain
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from . import comm
from .device_ids import DeviceLike, as_devices
from .hooks import observed
from .parallel_backward import applies as parallel_backward_applies, enter, remember_entries
from .step5_reduce import Broadcast, apply_function
from .torch_versions import clone_all


# Stock's words for a lazy module (torch/nn/modules/lazy.py: LazyModuleMixin._replicate_for_data_parallel),
# kept verbatim at the start of minidp's message so that code matching them keeps working.
STOCK_LAZY_MESSAGE = "Modules with uninitialized parameters can't be used with `DataParallel`."


def check_is_module(network: Any, argument: str = "module") -> None:
    """Raise ``TypeError`` unless ``network`` is an ``nn.Module`` (a function has no parameters to replicate)."""
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"{argument} must be an nn.Module, got {network!r} of type {type(network).__name__}: replicas are copies "
            f"of a module's tree and parameters. Wrap a function in a module (an nn.Module whose forward calls it)."
        )


def check_flag(value: Any, argument: str) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False``: a string such as ``"False"`` would read as true.

    ``replicate``'s ``detach`` (a call at every step: one type test) and DataParallel's ``gather_output``."""
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {value!r}")


def check_no_call_bound_to_the_original(network: nn.Module) -> None:
    """Raise ``TypeError`` if ``network`` or a sub-module holds a call bound to the original tree that no replica can
    bind to its own copy: it is compiled (``torch.compile(m)`` or ``m.compile()``), or its ``forward`` was set on the
    instance as a function that holds a module, parameter or buffer of the tree, or a method bound to one of its
    modules, in its closure, the globals it reads or what it wraps (``orig = m.forward; m.forward = lambda x:
    orig(x)``, ``bn = m.bn; m.forward = types.MethodType(lambda self, x: bn(self.lin(x)), m)``).

    ``torch.compile(m)`` returns a wrapper (``OptimizedModule``) whose tree replicate cannot copy; the others keep the
    bound call in the module's ``__dict__``, which every replica's shallow copy shares, so every replica would run the
    original's parameters and buffers instead of its own (on GPUs: tensors on the wrong device; on CPU replicas: the
    original's buffers updated from every chunk at once, in threads). A method bound to a module of the tree
    (``m.forward = types.MethodType(f, m)``, as accelerate patches a forward for mixed precision; accelerate's hooks keep
    the old one as ``m._old_forward``) and a ``functools.partial`` passing one are no such call: each replica gets them
    bound to its own copies (:func:`rebind_calls`).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing can be compiled
    optimized = eval_frame.OptimizedModule if eval_frame is not None else ()
    compile_inside = ("Give DataParallel the original module, and compile inside it: decorate the class's forward with "
                      "@torch.compile (each replica then runs the compiled code on its own parameters).")
    tree: Optional[set[int]] = None  # ids of the tree's modules, parameters and buffers, gathered where a forward is set
    for name, module in network.named_modules():
        where = f"'{name}'" if name else "the module"
        if isinstance(module, optimized):
            how = f"{where} is a torch.compile()d module (an OptimizedModule around {type(module._orig_mod).__name__})"
            fix = compile_inside
        elif module.__dict__.get("_compiled_call_impl") is not None:
            how = f"{where} ({type(module).__name__}) was compiled in place with Module.compile()"
            fix = compile_inside
        elif "forward" in module.__dict__ and _holds_the_tree(
                module.__dict__["forward"], tree := tree or _ids_of_the_tree(network)):
            how = (f"{where} ({type(module).__name__}) has a forward set on the instance that holds a module, "
                   f"parameter or buffer of the model, or a method bound to one, in its closure, the globals it reads "
                   f"or what it wraps (orig = m.forward; m.forward = lambda *a: orig(*a))")
            fix = (f"Reach them through the module the forward is given instead: set it as a method bound to the "
                   f"module (m.forward = types.MethodType(f, m), f taking self and reading self.bn, or calling "
                   f"type(self).forward(self, ...)), which each replica binds to itself, or on the class (a subclass: "
                   f"class Patched({type(module).__name__}): forward = f, then m.__class__ = Patched).")
        else:
            continue
        raise TypeError(f"{how}: that call is bound to the original module, so every replica would run it on the "
                        f"original's parameters and buffers, not its own. {fix}")


def _ids_of_the_tree(network: nn.Module) -> set[int]:
    return {id(x) for x in chain(network.modules(), network.parameters(), network.buffers())}


def rebind_calls(originals: list[nn.Module], copies: list[nn.Module]) -> None:
    """Where a module of ``originals`` (the tree ``network.modules()``) has a ``forward`` set on the instance: in every
    copy's ``__dict__``, each method bound to a module of the tree, or ``functools.partial`` passing one, bound to that
    module's copy instead. The shallow copy shares the original's: the forward, and what it calls, such as the
    ``_old_forward`` accelerate's hooks keep, or a method of another module kept beside it. Only there: a dict lookup a
    module, where a look at every attribute of every module costs ResNet-50's replicate 0.2 ms a replica (``python -m
    timeit -s "from minidp.step2_replicate import rebind_calls; from minidp.zoo import resnet50; m =
    list(resnet50(base=8).modules()); m[0].forward = m[0].forward; c = [x._replicate_for_data_parallel() for x in m]"
    "rebind_calls(m, c)"``)."""
    if not any("forward" in original.__dict__ for original in originals):
        return
    counterpart = {id(original): copy for original, copy in zip(originals, copies)}
    for original, copy in zip(originals, copies):
        for key, call in original.__dict__.items():
            if type(call) is types.MethodType or type(call) is functools.partial:  # the rest is no call to re-bind
                rebound = _rebound(call, counterpart)
                if rebound is not None:
                    copy.__dict__[key] = rebound


def _rebound(call: Any, counterpart: dict[int, nn.Module]) -> Any:
    """``call`` with each module of the tree it is bound to, or that a ``functools.partial`` passes, swapped for its
    ``counterpart``; ``None`` where it has none."""
    if isinstance(call, types.MethodType):
        copy = counterpart.get(id(call.__self__))
        return None if copy is None else types.MethodType(call.__func__, copy)
    values = (*call.args, *call.keywords.values())
    if not any(id(v) in counterpart for v in values):
        return None
    swap = functools.partial(_swapped, counterpart)
    return functools.partial(call.func, *map(swap, call.args), **{k: swap(v) for k, v in call.keywords.items()})


def _swapped(counterpart: dict[int, nn.Module], value: Any) -> Any:
    return counterpart.get(id(value), value)


def _holds_the_tree(call: Any, tree: set[int]) -> bool:
    """Whether ``call`` reaches an object of ``tree`` (ids: the model's modules, parameters and buffers), or a method
    bound to one, through its closure, the globals it reads, or what it wraps (``__wrapped__``, a ``functools.partial``'s
    function and arguments, a method's function), or one level inside a value found there (a list, tuple, set or
    dict, an object's attributes: ``mods = [m.lin, m.bn]`` in a closure), where no replica can put its own copy. The
    ``self`` of a method bound to a module of the tree, and a partial's argument that is one, it can (:func:`rebind_calls`):
    those are not looked at. Not looked at either: deeper inside such values."""
    if isinstance(call, types.MethodType) and _a_module_of(call.__self__, tree):
        pending = [call.__func__]
    elif isinstance(call, functools.partial):
        pending = [v for v in (call.func, *call.args, *call.keywords.values()) if not _a_module_of(v, tree)]
    else:
        pending = [call]
    seen: set[int] = set()
    while pending:
        value = pending.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if any(_in_the_tree(inside, tree) for inside in (value, *_one_level_inside(value))):
            return True
        if isinstance(value, types.FunctionType) and any(  # the globals it reads: a patch made at a script's top level
                _in_the_tree(value.__globals__.get(name), tree) for name in _globals_read(value.__code__)):
            return True
        if isinstance(value, functools.partial):
            pending += [value.func, *value.args, *value.keywords.values()]
        pending += [cell.cell_contents for cell in getattr(value, "__closure__", None) or () if _filled(cell)]
        pending += [getattr(value, "__wrapped__", None), getattr(value, "__func__", None)]
    return False


def _a_module_of(value: Any, tree: set[int]) -> bool:
    return isinstance(value, nn.Module) and id(value) in tree


def _in_the_tree(value: Any, tree: set[int]) -> bool:
    return value is not None and (id(value) in tree or id(getattr(value, "__self__", None)) in tree)


def _one_level_inside(value: Any) -> Iterable[Any]:
    """The items of a list, tuple, set or dict, or an object's attributes (not a function's, a module's or a tensor's,
    whose parts the walk above reaches, or cannot hold the model's)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, dict):
        return value.values()
    if isinstance(value, (types.FunctionType, nn.Module, torch.Tensor, type, types.ModuleType)):
        return ()
    attributes = getattr(value, "__dict__", None)
    return attributes.values() if isinstance(attributes, dict) else ()


@functools.lru_cache(maxsize=1024)
def _globals_read(code: types.CodeType) -> frozenset[str]:
    """The global names ``code`` loads (``co_names`` also holds the attribute names it reads, ``self.model``); kept per
    code object: reading the instructions at every check made it 9.1 ms, against 0.80 ms kept, on a ResNet-50 whose 53
    BatchNorms accelerate's ``add_hook_to_module`` patched (``python -m timeit -s "import torch; from accelerate.hooks
    import add_hook_to_module, ModelHook; from minidp import step2_replicate as s; from minidp.zoo import resnet50; m =
    resnet50(base=8); [add_hook_to_module(b, ModelHook()) for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d)]"
    "s.check_no_call_bound_to_the_original(m)"``, and with ``s._globals_read = getattr(s._globals_read, '__wrapped__',
    s._globals_read)`` at the end of the setup for the other)."""
    return frozenset(i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return False
    return True


def check_module_device(network: nn.Module, source_device: torch.device, replicated: bool = True) -> None:
    """Raise unless every parameter and buffer of ``network`` is on ``source_device``.

    When the module is to be ``replicated`` (the default), also raise if a sub-module holds a call bound to itself
    (:func:`check_no_call_bound_to_the_original`: compiled, or a patched forward) or a parameter or buffer is not
    initialised yet (a lazy module). With ``replicated=False`` the module runs itself, on one device, as stock runs it
    there: both work.
    """
    if replicated:
        check_no_call_bound_to_the_original(network)
    for name, tensor in list(network.named_parameters()) + list(network.named_buffers()):
        # (On one device a lazy module's first forward initialises it, as it does without DataParallel.)
        if replicated and isinstance(tensor, (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)):
            raise RuntimeError(
                f"{STOCK_LAZY_MESSAGE} '{name}' is not initialized yet (a lazy module): run one forward pass on "
                f"the original module, on one device, before replicating it"
            )
        if tensor.device != source_device:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {source_device} (device_ids[0]) "
                f"but '{name}' is on {tensor.device}. Move the module first, e.g. model.to('{source_device}')."
            )


def _copy_buffers(buffers: list[torch.Tensor], devices: list[torch.device]) -> list[list[torch.Tensor]]:
    """Per device, the buffers to install: the originals for replica 0, fresh private copies for the rest.

    Fresh at every call, never refilled in place: a graph recorded by an earlier step may have saved
    an earlier copy (a buffer multiplied with an input that requires grad), and must find it unchanged.
    The copies are made outside autograd: a buffer that requires grad comes here only under ``detach``, whose copies
    stock makes detached (``broadcast_coalesced``).
    """
    if not buffers:
        return [[] for _ in devices]
    source = buffers[0].device
    # On the source device one `_foreach_clone` (a loop in C++, each clone a new tensor; `clone_all` uses it where
    # torch has it) is the cheapest copy of ResNet-50's 159 small buffers: 344 us, against 571 us for 159 `clone()`
    # calls from Python and 872 us for a packed copy and its views (`python -m timeit -s "import torch; from
    # minidp.zoo import resnet50; b = list(resnet50(base=8).buffers())" "torch._foreach_clone(b)"`, the others
    # likewise). To another device, packed buffers make few large copies.
    with torch.no_grad():
        return [list(buffers)] + [
            clone_all(buffers) if device == source else list(comm.copy_coalesced(buffers, device))
            for device in devices[1:]
        ]


@observed("replicate")
def replicate(
    network: nn.Module,
    devices: Sequence[DeviceLike],
    detach: bool = False,
    *,
    reduce_backend: Optional[str] = None,
) -> list[nn.Module]:
    """Return one replica of ``network`` per entry of ``devices`` (repeats allowed), in order.

    ``network``'s parameters and buffers must be on ``devices[0]``. With ``detach=True`` (what
    ``DataParallel`` uses under ``torch.no_grad()``) the replicas are cut from autograd.
    ``reduce_backend`` picks how the backward sums gradients (see :func:`minidp.comm.set_reduce_backend`).
    Built from three public pieces, which :class:`minidp.replica_cache.ReplicaCache` reuses:
    :func:`build_skeletons` (the module copies), :func:`replica_tensors` (what each holds) and
    :func:`bind` (put them in place).
    """
    check_is_module(network, "network")
    check_flag(detach, "detach")
    devices = as_devices(devices, "devices")
    reduce_backend = comm.check_reduce_backend(reduce_backend, "reduce_backend")  # not first in the backward
    if not devices:
        return []
    check_module_device(network, devices[0])
    modules = list(network.modules())
    params, buffers = list(network.parameters()), list(network.buffers())
    replicas = build_skeletons(modules, len(devices))
    bind(
        replicas,
        tensor_slots(modules, "_parameters", params),
        tensor_slots(modules, "_buffers", buffers),
        *replica_tensors(params, buffers, devices, detach, reduce_backend),
        entered=through_entries(devices, detach),
    )
    return [replica_modules[0] for replica_modules in replicas]


Slots = list[list[tuple[str, Optional[int]]]]
_module_setattr = nn.Module.__setattr__


def tensor_slots(modules: list[nn.Module], registry: str, tensors: list[torch.Tensor]) -> Slots:
    """For each module, ``(name, index into tensors)`` of each entry of its ``registry`` dict
    (``"_parameters"`` or ``"_buffers"``); the index is ``None`` for an entry set to ``None``."""
    index = {id(t): i for i, t in enumerate(tensors)}
    return [[(key, None if t is None else index[id(t)]) for key, t in getattr(m, registry).items()] for m in modules]


def build_skeletons(modules: list[nn.Module], count: int) -> list[list[nn.Module]]:
    """``count`` copies of the tree ``modules`` (``network.modules()``): shallow copies of every module
    (``_replicate_for_data_parallel``), wired to each other as the originals are, holding no tensors yet."""
    index = {id(m): i for i, m in enumerate(modules)}
    replicas = [[m._replicate_for_data_parallel() for m in modules] for _ in range(count)]
    for replica_modules in replicas:
        for module, replica in zip(modules, replica_modules):
            for key, child in module._modules.items():
                setattr(replica, key, None if child is None else replica_modules[index[id(child)]])
        # A forward set on the instance, bound to its module (or to another of the tree), is bound to the copies,
        # and so is what it calls beside it: each replica runs it on its own tensors.
        rebind_calls(modules, replica_modules)
    return replicas


def bind(
    replicas: list[list[nn.Module]],
    param_slots: Slots,
    buffer_slots: Slots,
    param_copies: list[list[torch.Tensor]],
    buffer_copies: list[list[torch.Tensor]],
    *,
    entered: bool = True,
) -> None:
    """Give the replica modules of each device (``replicas[device]``) that device's tensors.

    ``entered``: whether the copies came through the replicas' entries (:func:`through_entries`); only then are
    there entries to note for parallel_apply (:func:`minidp.parallel_backward.remember_entries`). Noting none where
    there are some costs only speed: parallel_apply then looks for them in the replica's modules.
    """
    for replica_modules, params, buffers in zip(replicas, param_copies, buffer_copies):
        for replica, module_params, module_buffers in zip(replica_modules, param_slots, buffer_slots):
            # A plain tensor set under a name not in `_parameters` becomes a plain attribute: what
            # `Module.__setattr__` does, done as a dict write. Classes with their own __setattr__
            # (RNN's keeps `_flat_weights` in step) get a real setattr.
            state = replica.__dict__
            direct = type(replica).__setattr__ is _module_setattr
            for key, i in module_params:
                if direct:
                    state[key] = None if i is None else params[i]
                else:
                    setattr(replica, key, None if i is None else params[i])
            registry = state["_buffers"]
            for key, i in module_buffers:
                registry[key] = None if i is None else buffers[i]
        remember_entries(replica_modules[0], (params, buffers) if entered else ())


def through_entries(devices: list[torch.device], detach: bool) -> bool:
    """Whether :func:`replica_tensors` gives every replica its tensors that require grad through an entry of its own
    (:mod:`minidp.parallel_backward`): CPU replicas whose backwards can run in parallel, while grad is recorded."""
    return not detach and parallel_backward_applies(devices)


def replica_tensors(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    devices: list[torch.device],
    detach: bool,
    reduce_backend: Optional[str],
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Per device, the parameters and the buffers its replica holds, in the order given.

    Parameters, and buffers that require grad, come through one :class:`Broadcast` each (unless
    ``detach``); other buffers are the originals on replica 0 and fresh private copies elsewhere.
    """
    param_copies = _broadcast_parameters(params, devices, detach, reduce_backend)
    differentiable = [] if detach else [i for i, b in enumerate(buffers) if b.requires_grad]
    if not differentiable:  # the usual case, taken without sorting the copies back into place
        return param_copies, _copy_buffers(buffers, devices)
    plain = [i for i, b in enumerate(buffers) if not b.requires_grad]
    buffer_copies: list[list[torch.Tensor]] = [[None] * len(buffers) for _ in devices]  # type: ignore[list-item]
    for indices, copies in (
        (differentiable, _broadcast_parameters([buffers[i] for i in differentiable], devices, detach, reduce_backend)),
        (plain, _copy_buffers([buffers[i] for i in plain], devices)),
    ):
        for row, device_copies in zip(buffer_copies, copies):
            for i, copy in zip(indices, device_copies):
                row[i] = copy
    return param_copies, buffer_copies


def _broadcast_parameters(
    tensors: list[torch.Tensor], devices: list[torch.device], detach: bool, reduce_backend: Optional[str]
) -> list[list[torch.Tensor]]:
    """Per device, a copy (or, on the source device, an alias) of each tensor; differentiable unless ``detach``."""
    if not tensors:
        return [[] for _ in devices]
    if detach:
        return [[t.detach() for t in copies] for copies in comm.broadcast_coalesced(tensors, devices)]
    flat = apply_function(Broadcast, devices, reduce_backend, *tensors)
    n = len(tensors)
    copies = [list(flat[i : i + n]) for i in range(0, len(flat), n)]
    if through_entries(devices, detach):  # each CPU replica's graph ends at an entry of its own (minidp.parallel_backward)
        copies = [enter(device_copies) for device_copies in copies]
    return copies
