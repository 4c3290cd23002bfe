"""Where the steps can be watched: the stage names and one listener slot.

The primitives import this module and nothing above them: each public step is wrapped by
``@observed("scatter")`` (or replicate, gather, reduce), and :func:`minidp.parallel_apply` runs every
replica's call through :func:`observe_replica` (and, once they all returned, announces their outputs with
:func:`observe_replica_outputs`). When nothing listens, that is one check of two flags
and a direct call: no ``record_function``, no NVTX range, no argument binding.

Something listens when

* a listener is installed with :func:`set_listener` (``minidp.trace()`` installs its recorder), or
* ``torch.profiler`` is recording: every stage then shows in its trace as ``minidp::<stage>``, and,
  once CUDA is in use, as an NVTX range of the same name for Nsight Systems.

A listener is any object with the methods of :class:`Listener`. It receives the primitive's own
arguments as Python binds them (``inspect.Signature.bind``), runs the call itself (so it can time it)
and returns its result unchanged.

The parallel code (``minidp.distributed``) names what its own buffers hold through :func:`observe_storage`: the
whole parameters a sharded module gathers are parameters, a DDP bucket's flat buffer holds gradients; and waits for
its collectives through :func:`observe_wait`. A listener with an ``on_storage`` (``on_wait``) method, the memory
ledger's, hears it; one without is not called. So with ``on_replica_inputs``: what :func:`minidp.parallel_apply` gave
each replica (:func:`observe_replica_outputs`), which the recorder's backward spans need.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch
from torch.autograd import profiler as _profiler

STAGES = ("scatter", "replicate", "forward", "gather", "backward", "reduce")


class Listener(Protocol):
    def on_call(self, stage: str, function: Callable, arguments: inspect.BoundArguments) -> Any:
        """Run ``function(*arguments.args, **arguments.kwargs)`` for ``stage`` and return its result."""

    def on_replica(self, replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        """Run ``call()``, replica ``replica``'s forward on ``device``, and return its result."""

    def on_module(self, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        """Run ``call()``, ``module`` itself running on ``device`` as the only replica (nothing was replicated),
        and return its result."""

    def on_replica_backward(self, replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        """Run ``call()``, the backward of replica ``replica`` (``module``) as one call, and return its result."""

    def on_replica_outputs(self, modules: Sequence[Any], outputs: Sequence[Any], one_call_each: bool) -> None:
        """Every replica's forward returned: ``modules[i]`` made ``outputs[i]``. ``one_call_each``: each replica's
        backward will run as one call (:meth:`on_replica_backward`); else autograd runs them node by node."""


_listener: Optional[Listener] = None


def set_listener(listener: Optional[Listener]) -> Optional[Listener]:
    """Install ``listener`` (``None``: remove it); returns the one it replaces.

    The slot is the process's, not a thread's: the listener hears the calls of every thread (a replica's forward
    runs in a worker thread, its backward in autograd's), so there is one listener at a time for them all.
    """
    global _listener
    previous, _listener = _listener, listener
    return previous


def current_listener() -> Optional[Listener]:
    return _listener


_NO_RANGES = contextlib.nullcontext()


def _ranges(stage: str) -> contextlib.AbstractContextManager:
    """``record_function`` while a profiler records, and an NVTX range once CUDA is in use; else nothing.

    Nothing is the common case of a listener alone (``minidp.trace()`` on CPU replicas): a shared ``nullcontext``,
    not a generator and an ``ExitStack`` for each of a step's eight observed calls (BENCHMARKS.md, "The tracer step
    by step", says what they cost).
    """
    cuda = torch.cuda.is_initialized()
    if not cuda and not _profiler._is_profiler_enabled:
        return _NO_RANGES
    return _entered_ranges(stage, cuda)


@contextlib.contextmanager
def _entered_ranges(stage: str, cuda: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if cuda:
            stack.enter_context(torch.cuda.nvtx.range(f"minidp::{stage}"))
        if _profiler._is_profiler_enabled:
            stack.enter_context(torch.profiler.record_function(f"minidp::{stage}"))
        yield


def profiled(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while ``torch.profiler`` records, else nothing: entering one costs 6 us, a
    ``nullcontext`` 0.24 us (``python -m timeit -s "import torch" "with torch.profiler.record_function('x'): pass"``)."""
    return torch.profiler.record_function(name) if _profiler._is_profiler_enabled else contextlib.nullcontext()


def _binder(signature: inspect.Signature) -> Callable[..., inspect.BoundArguments]:
    """``signature.bind``, done in a few dict operations for the calls a primitive gets.

    ``Signature.bind`` walks every parameter in Python: 5.8 us for ``gather(outputs, "cpu")``, 2.4 us here
    (``python -m timeit -s "import inspect, torch; from minidp.step4_gather import gather; s =
    inspect.signature(gather.__wrapped__); o = [torch.ones(1)]" "s.bind(o, 'cpu')"``, and the same through
    ``minidp.hooks._binder(s)``). A call that passes only
    known parameter names, none twice, and every parameter without a default, is bound here as a dict of
    name -> value; anything else (a bad call, ``*args``, positional-only parameters) goes to
    ``signature.bind``, which binds it or raises its ``TypeError``.
    """
    parameters = signature.parameters.values()
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters):
        return signature.bind
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    names = frozenset(signature.parameters)
    required = frozenset(p.name for p in parameters if p.default is p.empty)

    def bind(*args: Any, **kwargs: Any) -> inspect.BoundArguments:
        arguments = dict(zip(positional, args))
        if len(args) > len(positional) or not kwargs.keys() <= names - arguments.keys():
            return signature.bind(*args, **kwargs)
        arguments.update(kwargs)
        if not required <= arguments.keys():
            return signature.bind(*args, **kwargs)
        return inspect.BoundArguments(signature, arguments)

    return bind


def observed(stage: str) -> Callable[[Callable], Callable]:
    """Decorator: calls of the decorated primitive are ``stage`` for a listener or a profiler."""
    if stage not in STAGES:
        raise ValueError(f"observed: unknown stage {stage!r}; the stages are {STAGES}")

    def decorate(function: Callable) -> Callable:
        bind = _binder(inspect.signature(function))

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            listener = _listener
            if listener is None and not _profiler._is_profiler_enabled:
                return function(*args, **kwargs)
            with _ranges(stage):
                if listener is None:
                    return function(*args, **kwargs)
                return listener.on_call(stage, function, bind(*args, **kwargs))

        return wrapper

    return decorate


def observe_replica(replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
    """``call()``, replica ``replica``'s forward on ``device``, seen as the ``forward`` stage."""
    return _observe_replica("forward", replica, device, module, call)


def observe_module(device: torch.device, module: Any, call: Callable[[], Any], given: Any = ((), {})) -> Any:
    """``call()``, ``module`` itself running on ``device``, its only device (with one device id nothing is replicated,
    docs/stock-behaviour.md B9), seen as replica 0's ``forward`` stage; then, to a listener with an
    ``on_replica_inputs`` method, what the module was given (``given``: its positional and keyword arguments), whose
    gradients end the backward of a module without a parameter that requires grad."""
    listener = _listener
    if listener is None and not _profiler._is_profiler_enabled:
        return call()
    with _ranges("forward"):
        if listener is None:
            return call()
        output = listener.on_module(device, module, call)
    on_replica_inputs = getattr(listener, "on_replica_inputs", None)
    if on_replica_inputs is not None:
        on_replica_inputs([module], [given])
    return output


def observe_replica_backward(replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
    """``call()``, the whole backward of replica ``replica`` (``module``) on ``device``, seen as the ``backward``
    stage: where one call runs it (:mod:`minidp.parallel_backward`); elsewhere autograd runs a replica's backward
    node by node, and a listener sees it through autograd's hooks."""
    return _observe_replica("backward", replica, device, module, call)


def observe_replica_outputs(
    modules: Sequence[Any], outputs: Sequence[Any], one_call_each: bool, inputs: Sequence[Any], kwargs: Sequence[Any]
) -> None:
    """Announce what :func:`minidp.parallel_apply` returns, and whether each replica's backward will be one call; and,
    to a listener with an ``on_replica_inputs(modules, inputs)`` method (one without is not called), what each replica
    was given (its ``(inputs[i], kwargs[i])``), whose gradients end the backward of a replica without a parameter that
    requires grad.

    A listener that marks when gradients reach a replica's outputs needs a hook there only where autograd runs the
    replica's backward node by node: a Python hook on the first node of a backward run as one call would make it
    wait for the interpreter's lock while the other replicas' threads start theirs.
    """
    listener = _listener
    if listener is not None:
        if not one_call_each and hasattr(listener, "on_replica_inputs"):
            listener.on_replica_inputs(modules, list(zip(inputs, kwargs)))
        listener.on_replica_outputs(modules, outputs, one_call_each)


def _observe_replica(stage: str, replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
    listener = _listener
    if listener is None and not _profiler._is_profiler_enabled:
        return call()
    with _ranges(stage):
        if listener is None:
            return call()
        on_stage = listener.on_replica if stage == "forward" else listener.on_replica_backward
        return on_stage(replica, device, module, call)


def observe_wait(work: Any) -> Any:
    """``work.wait()``, a collective's end (``torch.distributed``'s ``Work``), for a listener with an ``on_wait(call)``
    method (the memory ledger's), which runs it: a backend may make the buffers it works in on threads of its own
    (Gloo's reduce-scatter does) and hand them to an operator only in the wait, where a listener that sees operators
    meets them for the first time. Nothing listening: one read of the slot."""
    on_wait = _optional_method("on_wait")
    return work.wait() if on_wait is None else on_wait(work.wait)


def observe_storage(category: str, tensors: Sequence[torch.Tensor]) -> None:
    """Announce that the storages of ``tensors`` hold ``category`` (one of the memory ledger's categories:
    ``"parameters"`` for the whole parameters ``fully_shard`` gathers, ``"gradients"`` for a DDP bucket's buffer), to a
    listener that has ``on_storage(category, tensors)``. Nothing listening: one read of the slot."""
    on_storage = _optional_method("on_storage")
    if on_storage is not None:
        on_storage(category, tensors)


_observing: set[int] = set()  # keys of the global module hooks that minidp's observers registered


def observe_module_calls(pre_hook: Callable[[Any, Any], None], hook: Callable[[Any, Any, Any], None]) -> Callable[[], None]:
    """Register ``pre_hook`` and ``hook`` as global module forward hooks (``hook`` called even where a forward
    raises) for an observer that changes nothing (the memory ledger's); returns the call that removes them.

    Registered so, minidp's own look at the global hooks a module would run (:func:`registered_by_others`, which
    decides where :func:`minidp.parallel_criterion` computes a criterion) passes over them: the step runs as it
    would unobserved.
    """
    handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
               torch.nn.modules.module.register_module_forward_hook(hook, always_call=True)]
    keys = {handle.id for handle in handles}
    _observing.update(keys)

    def remove() -> None:
        for handle in handles:
            handle.remove()
        _observing.difference_update(keys)

    return remove


def registered_by_others(global_hooks: dict) -> bool:
    """Whether one of torch's global module hook dicts holds a hook that no observer of minidp's registered."""
    return any(key not in _observing for key in global_hooks)


def _optional_method(name: str) -> Optional[Callable]:
    """The installed listener's method ``name``, which a listener need not have (the memory ledger's ``on_storage`` and
    ``on_wait``); ``None`` when nothing listens or it has none."""
    listener = _listener
    return None if listener is None else getattr(listener, name, None)
