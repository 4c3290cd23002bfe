"""Step 3, parallel_apply: run each replica on its chunk, all at once, one thread per replica.

Threads are enough for parallelism here because PyTorch releases the GIL inside its kernels: while
one thread waits for a matrix product, the others run. Replica 0 runs in the calling thread; the
others run in a pool of threads kept across steps: starting and joining a thread costs ~90 us here
(`python -m timeit -s "import threading" "t=threading.Thread(target=lambda: None); t.start(); t.join()"`),
as much as the whole forward of a small replica.

Per-thread state does not cross into a new thread by itself: grad mode and autocast are
thread-local, so each worker re-enters the caller's (autocast's dtype too, which stock drops).
On a GPU each worker makes its replica's device current, and replicas that share one GPU each get
their own CUDA stream so that their kernels can overlap.

Random numbers, unlike grad mode, are not per thread: every device has one generator, and replicas
that share a device (CPU replicas, repeated GPU ids) draw from it at once, in an order that changes
between runs. That is warned about when it happens (docs/stock-behaviour.md B40).

An exception in any replica's forward is re-raised in the caller, with its type, the replica's index and
device in the message, and the replica's traceback attached as the cause (stock's ``ExceptionWrapper``), once
every replica has finished: no thread is left running.

The backward. CPU replicas receive their tensors that require grad through an entry node of their
own, and, when every replica's graph ends at its entries, their outputs come back through one
:class:`minidp.parallel_backward.ParallelBackward` node, whose backward runs each replica's backward
in the same worker threads, the same way (Ctrl-C held until all are done); an error there is raised as itself,
as autograd raises it, with a note naming the replica.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import threading
import traceback
import warnings
from collections import Counter
from itertools import chain
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import cpu_threads, parallel_backward
from .device_ids import DeviceLike, as_devices, generator_state, set_generator_state
from .hooks import observe_replica, observe_replica_backward, observe_replica_outputs
from .nested import is_per_replica, map_tensors, tensors_in
from .replica_group import ReplicaGroup, ReplicaGroupError


class _ReplicaThreads:
    """Worker threads kept across steps; each replica of a call gets a thread of its own.

    A thread is handed out only while idle and comes back when its replica is done, so replicas of
    one call never queue behind each other (a replica may wait on another, e.g. a nested
    ``data_parallel``), and a step reuses the threads of the previous one instead of starting new ones.

    The idle workers are handed out in the order they were started, replica 1 the first: the same replica runs on
    the same worker at every step, whichever finished first the step before. Autograd needs that to add up a
    tensor's gradients in the same order every run: the CPU engine runs the ready nodes newest first, by a
    sequence number that each thread counts for the nodes it creates, so the order of three or more replicas'
    terms (a tensor every replica reaches, ``minidp.SyncBatchNorm``'s statistics, a re-entrant checkpoint)
    follows the counters of the threads that made them (stock starts fresh threads, counters at 0, at every call).
    """

    def __init__(self) -> None:
        self._forget_threads()
        # Before any worker exists: replicas that run a library's first call at once can get a wrong
        # result (cpu_threads.finish_vector_math_setup). A forked child inherits the finished setup.
        cpu_threads.finish_vector_math_setup()
        # Unlike stock's threads, joined before its parallel_apply returns, a worker here still runs
        # after reporting its result: it lets go of its task, and freeing the task's tensors runs
        # torch's C++ destructors outside the GIL. A child forked meanwhile would get that work frozen
        # midway (the thread that did it does not exist there), so a fork first waits for every
        # worker to let go of its task. And as a forked child has only the thread that forked, the
        # parent's idle inboxes would take tasks that nobody runs: the child forgets them.
        os.register_at_fork(before=self._wait_until_let_go, after_in_child=self._forget_threads)
        # The end of the program has the same window: once the interpreter finalizes, a thread that
        # takes the GIL back is ended by pthread_exit, whose unwinding through torch's C++ frames aborts
        # the process ("terminate called without an active exception"). So at exit, before finalizing,
        # every worker is told to stop and is waited for.
        atexit.register(self._stop_threads)

    def _forget_threads(self) -> None:
        self._idle: list[int] = []  # indices into _workers
        self._workers: list[tuple[threading.Thread, queue.SimpleQueue]] = []
        self._lock = threading.Lock()
        self._letting_go = 0  # workers that reported a result and have not yet let go of its task
        self._all_let_go = threading.Condition(self._lock)

    def _wait_until_let_go(self) -> None:
        with self._all_let_go:
            self._all_let_go.wait_for(lambda: self._letting_go == 0)

    def _stop_threads(self) -> None:
        for _, inbox in self._workers:
            inbox.put(None)  # after any task already there: a busy worker finishes it first
        for thread, _ in self._workers:
            thread.join()
        self._forget_threads()

    def run_all(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """``[fn() for fn in fns]``, all at once: ``fns[0]`` in the calling thread, each other on a thread of its own.

        Returns only when every call has returned. Ctrl-C raises KeyboardInterrupt in the main
        thread, here: it is held until the workers are done and re-raised then, so that no worker is
        left running (one still inside a kernel when the interpreter exits aborts the process).
        """
        with self._lock:  # reserve all threads first: none can come back mid-call and take a second fn
            self._idle.sort(reverse=True)  # the first started last, popped first
            inboxes = [self._workers[self._idle.pop()][1] if self._idle else self._start_thread() for _ in fns[1:]]
        futures = [Future() for _ in inboxes]
        for inbox, fn, future in zip(inboxes, fns[1:], futures):
            inbox.put((fn, future))
        try:
            first = fns[0]()
        finally:
            rest = self._wait_for(futures)
        results = [first, *rest]
        del first, rest, futures  # a replica's error kept here would be kept by this frame, which its traceback holds
        return results

    @staticmethod
    def _wait_for(futures: Sequence[Future]) -> list[Any]:
        """Every future's result, in order; a KeyboardInterrupt meanwhile is re-raised after the last."""
        results, interrupt = [], None
        for future in futures:
            while True:
                try:
                    results.append(future.result())
                    break
                except KeyboardInterrupt as error:  # keep waiting: the worker cannot be stopped midway
                    interrupt = error
        if interrupt is not None:
            raise interrupt
        return results

    def _start_thread(self) -> queue.SimpleQueue:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Named as a worker, not a replica: a call hands out the idle workers, first started first, so worker N serves
        # replica N unless a nested call holds it (the trace's events name the replica they ran for, and the thread).
        name = f"minidp-worker-{len(self._workers) + 1}"
        thread = threading.Thread(target=self._serve, args=(inbox, len(self._workers)), name=name, daemon=True)
        thread.start()
        self._workers.append((thread, inbox))
        return inbox

    def _serve(self, inbox: queue.SimpleQueue, index: int) -> None:
        while (task := inbox.get()) is not None:
            fn, future = task
            result = fn()  # fn reports its own errors in its result
            # Idle again before the result wakes the caller, whose next call (or nested call) may
            # need a thread at once: it finds this one instead of starting another.
            with self._lock:
                self._idle.append(index)
                self._letting_go += 1
            future.set_result(result)
            # Waiting for the next task must not keep this one's replica, outputs and graph alive.
            del task, fn, future, result
            with self._lock:
                self._letting_go -= 1
                self._all_let_go.notify_all()


_threads = _ReplicaThreads()


_side_streams: dict[tuple[int, int, int], "torch.cuda.Stream"] = {}


def _replica_stream(device: torch.device, occurrence: int) -> Optional["torch.cuda.Stream"]:
    """The stream replica number ``occurrence`` on ``device`` runs on: the current one for the first.

    Side streams are kept per current stream too, so that a parallel_apply nested in a replica
    that already runs on a side stream gets side streams of its own, not that same one again.
    """
    if device.type != "cuda":
        return None
    current = torch.cuda.current_stream(device)
    if occurrence == 0:
        return current
    key = (device.index, current.stream_id, occurrence)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device)
    return _side_streams[key]


def _module_device(module: Callable, inputs: Any) -> torch.device:
    """Where a module runs when ``devices`` is not given: where its tensors are, else its inputs (a plain function's).

    A replica's parameters are plain attributes (``parameters()`` is empty), so the attributes of
    its sub-modules are searched too.
    """
    for submodule in module.modules() if isinstance(module, nn.Module) else ():
        for tensor in chain(submodule._parameters.values(), submodule._buffers.values(), submodule.__dict__.values()):
            if isinstance(tensor, torch.Tensor):
                return tensor.device
    for _, tensor in tensors_in(inputs, "inputs"):
        return tensor.device
    return torch.device("cpu")


class CallerState:
    """The thread-local state of the calling thread that every worker re-enters.

    ``cpu_replicas`` CPU replicas share the caller's intra-op threads: each runs with
    ``caller's threads // cpu_replicas`` (at least 1), so that K replicas do not start K full
    OpenMP teams on the same cores. The count is per thread (measured: ``torch.set_num_threads``
    in one thread leaves the others' as they are), but every call also stores its value
    process-wide, as the count that each thread started later begins with (a thread reads it at
    its first parallel op, ``torch.get_num_threads()`` included). So each replica sets its share
    and keeps it (worker threads get it set again for every replica), and the caller sets its
    own count back with :meth:`restore` once every replica is done: the last value stored is then
    the caller's, and threads started after the step begin with the caller's count, as before it.
    (Were each replica to restore its thread's count, the value stored last would be whatever the
    replica that finished last restored: a worker's share, or a count its thread first read while
    replica 0 had its share set.)
    """

    def __init__(self, cpu_replicas: int) -> None:
        self.caller_threads = torch.get_num_threads()
        split = cpu_replicas > 0 and cpu_threads.PER_THREAD_INTRA_OP
        self.replica_threads = cpu_threads.share(self.caller_threads, cpu_replicas) if split else None
        self.grad_enabled = torch.is_grad_enabled()
        self.inference_mode = torch.is_inference_mode_enabled()  # stock leaves it behind (docs/stock-behaviour.md B27)
        self.autocast = {
            device_type: (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            for device_type in ("cpu", "cuda")
        }

    @contextlib.contextmanager
    def enter(self, device: torch.device, stream: Optional["torch.cuda.Stream"]):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            if self.inference_mode:  # else a replica's in-place update of a buffer copied under it (BatchNorm's) raises
                stack.enter_context(torch.inference_mode())
            for device_type, (enabled, dtype) in self.autocast.items():
                if enabled:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if device.type == "cpu" and self.replica_threads is not None:
                if self.replica_threads < self.caller_threads:  # this thread's team, idle now, would spin meanwhile
                    cpu_threads.let_idle_team_go()  # first: ending a team may reset the thread's OpenMP settings
                torch.set_num_threads(self.replica_threads)
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(stream))
            yield

    def restore(self) -> None:
        """The caller's own intra-op count again, stored last; call once every replica is done."""
        if self.replica_threads is not None:
            torch.set_num_threads(self.caller_threads)


class _Message(str):
    """A message that ``KeyError`` prints as it is, not quoted by ``repr``."""

    def __repr__(self) -> str:
        return str(self)


class _ReplicaFailure:
    """An exception raised inside a replica (its traceback, the replica's frames, formatted only if it is re-raised
    wrapped: a forward's)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def reraise(self, replica: int, device: torch.device, stage: str) -> None:
        if not isinstance(self.error, Exception):  # KeyboardInterrupt and friends pass through
            raise self.error
        if stage == "backward":
            # Autograd raises the very error a backward raised (stock's backward too, where nothing wraps it), so
            # `except` clauses and the error's attributes work: the error itself, the replica named in a note (Python
            # 3.11's PEP 678, which tracebacks print; on 3.10 the error goes as it is).
            error, self.error = self.error, None  # raised through the frames that hold this failure: it lets go
            if hasattr(error, "add_note"):
                error.add_note(f"Raised in the backward of replica {replica} on device {device}.")
            try:
                raise error
            finally:
                del error, self  # as below: no loop through this frame
        message = _Message(f"Caught {type(self.error).__name__} in replica {replica} on device {device}.\n"
                           f"Original {''.join(traceback.format_exception(self.error))}")
        try:
            wrapped = type(self.error)(message)
        except Exception:
            wrapped = RuntimeError(message)
        try:
            raise wrapped from self.error
        finally:
            # The error's traceback holds this frame: without these names, which hold the error and the replica's own
            # error (its frames, the replica and its graph), no loop is left for the garbage collector to find later.
            del wrapped, self


def check_not_tracing(replicas: int) -> None:
    """Refuse to run several replicas under ``torch.jit.trace``, which records only the thread that calls it.

    The replicas run in threads of their own, so a trace would hold none of their work (and the scatter before them
    sees sizes as tensors). Checked by ``parallel_apply`` and, before they scatter, by ``DataParallel`` and
    ``data_parallel``. One replica is the module called in the caller's thread: it traces as the module does.
    """
    if replicas > 1 and torch.jit.is_tracing():
        raise RuntimeError(
            f"torch.jit.trace cannot record {replicas} replicas: it records only the calling thread, and each replica "
            "runs in a thread of its own. Trace the module itself (torch.jit.trace(dp.module, example_inputs)) and "
            "give the traced module to DataParallel, or trace with a single device id."
        )


def compiling_several(replicas: int) -> bool:
    """Whether ``torch.compile`` is tracing a call that runs several replicas, which must then run
    :func:`outside_the_graph`.

    The compiler records the calling thread's work only, as ``torch.jit.trace`` does (:func:`check_not_tracing`), and
    replicate's autograd Function, applied to a list of devices, is no operation it can record: traced, a
    ``torch.compile(DataParallel(model))`` failed inside the compiler. One replica is the module called in the
    caller's thread: it compiles as the module does.
    """
    return replicas > 1 and torch.compiler.is_compiling()


@torch.compiler.disable(reason="minidp runs several replicas in threads of their own, which a graph cannot record")
def outside_the_graph(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, run as Python runs it where ``torch.compile`` was tracing it: the compiled code
    calls it there (a graph break), so a compiled model that holds a ``DataParallel`` or calls ``data_parallel`` runs its
    data-parallel steps as they run uncompiled. A replica's forward compiles where its class's ``forward`` is
    decorated with ``@torch.compile``."""
    return function(*args, **kwargs)


def check_no_shared_parametrization_cache(modules: Sequence[Any]) -> None:
    """Refuse parametrized replicas inside ``torch.nn.utils.parametrize.cached()``.

    Its cache is one dict for the process, keyed by the original module a parametrization was registered on
    (``get_cached_parametrization``): every replica would read the tensor the first one to get there computed, and a
    parametrization that updates state as it computes (``spectral_norm``'s power iteration) would update it in that
    replica only, whichever it is from run to run. Read at every call: one flag, and the walk only while it is set.
    """
    if not parametrize._cache_enabled or len(modules) < 2:
        return
    for i, module in enumerate(modules):
        named = module.named_modules() if isinstance(module, nn.Module) else ()
        found = next((name for name, m in named if parametrize.is_parametrized(m)), None)
        if found is not None:
            where = f"'{found}'" if found else "the module"
            raise RuntimeError(
                f"parallel_apply: {where} of replica {i} is parametrized (torch.nn.utils.parametrize) and runs inside "
                f"parametrize.cached(), whose cache all replicas share (keyed by the original module): each replica "
                f"would read the parametrized tensor the first one computed. Run the data-parallel step outside "
                f"parametrize.cached(); each replica then computes its own."
            )


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Optional[Sequence[dict[str, Any]]] = None,
    devices: Optional[Sequence[Optional[DeviceLike]]] = None,
) -> list[Any]:
    """Call ``modules[i](*inputs[i], **kwargs_tup[i])`` for every i in parallel; outputs in order.

    ``inputs[i]`` is a tuple or list of positional arguments (anything else is one argument).
    ``devices[i]`` is where replica i runs (its current GPU and stream); by default the device of
    its parameters, or of its inputs for a module without parameters.
    Inside, replica i is member i of a :class:`minidp.replica_group.ReplicaGroup` of the n replicas.
    """
    for name, values in (("modules", modules), ("inputs", inputs), ("kwargs_tup", kwargs_tup), ("devices", devices)):
        if values is not None and not is_per_replica(values):
            raise TypeError(
                f"parallel_apply: {name} must be a list with one entry per module (replica), got {type(values).__name__}"
            )
    n = len(modules)
    if n == 0:
        raise ValueError("parallel_apply: 'modules' is empty; give at least one module")
    for name, values in (("inputs", inputs), ("kwargs_tup", kwargs_tup), ("devices", devices)):
        if values is not None and len(values) != n:
            raise ValueError(
                f"parallel_apply: {n} modules but {len(values)} {name}; give one entry per module (replica)"
            )
    # Checked here, not where each replica calls: by then the others may have run and changed their state.
    for i, module in enumerate(modules):
        if not callable(module):
            raise TypeError(
                f"parallel_apply: modules[{i}] (of type {type(module).__name__}) cannot be called; give modules (replicas)"
            )
    for i, kwargs in enumerate(kwargs_tup or ()):
        if type(kwargs) is not dict and not isinstance(kwargs, Mapping):
            raise TypeError(
                f"parallel_apply: kwargs_tup[{i}] is of type {type(kwargs).__name__}; give a dict of keyword arguments per module"
            )
    check_not_tracing(n)
    check_no_shared_parametrization_cache(modules)
    kwargs_tup = kwargs_tup if kwargs_tup is not None else [{}] * n
    if devices is None or any(d is None for d in devices):
        devices = [
            _module_device(m, x) if devices is None or devices[i] is None else devices[i]
            for i, (m, x) in enumerate(zip(modules, inputs))
        ]
    devices = as_devices(devices, "devices")
    occurrences = [devices[:i].count(d) for i, d in enumerate(devices)]
    streams = [_replica_stream(d, k) for d, k in zip(devices, occurrences)]
    for i, (device, stream) in enumerate(zip(devices, streams)):
        if stream is not None and stream != torch.cuda.current_stream(device):
            # The replica's inputs were produced on the current stream: wait for them.
            stream.wait_stream(torch.cuda.current_stream(device))
            # And what it reads that the current stream allocated (its chunk, its private buffer copies) goes back to
            # the allocator only once the side stream is done with it: the caching allocator reuses a freed block
            # for the stream that allocated it at once, while kernels queued on this one may still read it.
            buffers = modules[i].buffers() if isinstance(modules[i], nn.Module) else ()
            for tensor in chain((t for _, t in tensors_in((inputs[i], kwargs_tup[i]))), buffers):
                if tensor.device == device and tensor.layout == torch.strided:
                    tensor.record_stream(stream)
    caller = CallerState(sum(d.type == "cpu" for d in devices))
    group = ReplicaGroup(n, modules)  # what the replicas meet in (minidp.replica_group)
    # The devices on which replicas share a random number generator (a meta device has none). Their states are read
    # before and after the replicas run: 5 to 7 us a read (`python -m timeit -s "import torch; from minidp.device_ids
    # import generator_state; d = torch.device('cpu')" "generator_state(d)"`), against 342 us for the whole call on
    # two nn.Identity replicas and tens of ms for a CNN's step.
    generator_states = _shared_generator_states(devices)

    cut = parallel_backward.applies(devices)  # CPU replicas: each one's backward in its thread, if it can
    regions: list[Optional[parallel_backward.Region]] = [None] * n

    def run(i: int) -> Any:
        args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
        kwargs = kwargs_tup[i]
        with group.member(i), caller.enter(devices[i], streams[i]):
            if cut:
                args, kwargs, entries = _enter_replica(modules[i], args, kwargs)
            output = observe_replica(i, devices[i], modules[i], lambda: modules[i](*args, **kwargs))
            if cut:  # walked here, in the replica's thread, while the others run
                regions[i] = parallel_backward.region(entries, output)
            return output

    results = _in_workers([functools.partial(run, i) for i in range(n)], caller)
    # Done with: the group keeps what each replica raised, whose traceback holds `run`'s frame, whose closure holds the
    # group. Let go of, it leaves no loop behind (a loop that only the garbage collector frees, replicas and all).
    group = None
    _back_on_current_streams(devices, streams, results)
    _reraise_first_failure(results, devices, "forward")
    undrawn = _warn_if_drawn(generator_states, "forward")
    aliases = None
    if cut and all(r is not None for r in regions):
        aliases = parallel_backward.join(regions, functools.partial(_run_backwards, modules, devices, undrawn))
    observe_replica_outputs(modules, results, aliases is not None, inputs, kwargs_tup)
    if aliases is not None:
        replaced = iter(aliases)
        results = [map_tensors(lambda t: next(replaced) if t.requires_grad else t, r) for r in results]
    return results


def _back_on_current_streams(
    devices: Sequence[torch.device], streams: Sequence[Optional["torch.cuda.Stream"]], results: Sequence[Any]
) -> None:
    """Make each device's current stream wait for the side stream a replica ran on, and hand it that replica's outputs.

    (A function of its own, not a loop in parallel_apply: its loop variable would keep a failed replica's error in
    parallel_apply's frame, which that error's traceback holds.)
    """
    for device, stream, result in zip(devices, streams, results):
        if stream is not None and stream != torch.cuda.current_stream(device):
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            # The output was allocated on the side stream and is used next on the current one: tell
            # the allocator, or it could hand the memory to the side stream's next work too early.
            for _, tensor in tensors_in(result, "output"):
                if tensor.device == device:
                    tensor.record_stream(current)


def _shared_generator_states(devices: Sequence[torch.device]) -> dict[torch.device, tuple[int, Any]]:
    """For each device whose random number generator several replicas share (a meta device has none): how many, and
    its state now."""
    return {d: (k, generator_state(d)) for d, k in Counter(devices).items() if k > 1 and d.type in ("cpu", "cuda")}


# Per stage: what may draw there, and what then goes wrong.
_DRAWS = {
    "forward": ("Dropout?", "a layer that recomputes its forward in the backward from the random state it saved "
                "(torch.utils.checkpoint) gets other numbers than its forward did, so its gradients are wrong. For "
                "such a model, give each replica a device of its own, or a process of its own (minidp.distributed)."),
    "backward": ("a custom autograd Function?, or activation checkpointing setting the generator to the state it "
                 "saved and back", "the gradients, and the numbers drawn after the backward, differ from run to run: "
                 "minidp.set_parallel_backward(False) runs the replicas' backwards one after the other, as autograd "
                 "does, in a fixed order."),
}


def _warn_if_drawn(states: dict[torch.device, tuple[int, Any]], stage: str) -> dict[torch.device, Any]:
    """Warn for each device of :func:`_shared_generator_states` whose generator moved since: its replicas drew from it
    in their ``stage``, all at once (in threads), so in an order no seed repeats. Returns the states of the others."""
    what, consequence = _DRAWS[stage]
    unmoved = {}
    for device, (replicas, state) in states.items():
        if state == generator_state(device):
            unmoved[device] = state
        else:
            warnings.warn(
                f"parallel_apply: the {replicas} replicas on {device} drew random numbers in their {stage} ({what}) "
                f"from the one generator of {device}, all at once: which replica gets which numbers changes from run "
                f"to run, so a seeded run cannot be repeated exactly, and {consequence} (Read as a draw: the "
                f"generator moved while they ran. If they draw nothing, another thread of this process drew from it "
                f"meanwhile, as a data pipeline's may, and none of this applies.)",
                stacklevel=3,
            )
    return unmoved


def _enter_replica(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
    """The replica's arguments through an entry of their own, and every entry its tensors come through."""
    entered = parallel_backward.enter_inputs([t for _, t in tensors_in((args, kwargs))])
    aliases = iter(entered)
    args, kwargs = map_tensors(lambda _: next(aliases), (args, kwargs))
    return args, kwargs, parallel_backward.entries_of(module, entered)


def _run_backwards(
    modules: Sequence[Any], devices: Sequence[torch.device], undrawn: dict[torch.device, Any],
    calls: Sequence[Optional[Callable[[], Any]]], in_this_thread: bool,
) -> list[Any]:
    """Replica i's backward ``calls[i]()`` in its worker thread, in the caller's state (``None`` where replica i has
    none to run); an error re-raised naming the replica, once every replica is done. ``in_this_thread``: one after the other in this thread
    (the gradients of a ``create_graph=True`` backward must be recorded in its graph). Each call is seen by a
    listener of :mod:`minidp.hooks` as that replica's backward.

    By default each backward runs with the caller's whole intra-op thread count, unlike a forward: the
    count that autograd's serial backward runs every replica's kernels with, so that they split their
    work, and round their sums, as there (gradients bit for bit the same). The cost: K teams of intra-op
    threads share the cores. With ``set_parallel_backward_threads("share")``, each runs with its forward's share.
    """
    if in_this_thread:
        return [None if call is None else observe_replica_backward(i, devices[i], modules[i], call)
                for i, call in enumerate(calls)]
    # The caller's whole count, set in every worker, or each its forward's share.
    caller = CallerState(parallel_backward.threads_divided_among(len(calls)))

    def run(i: int) -> Any:
        if calls[i] is None:
            return None
        with caller.enter(devices[i], None):
            return observe_replica_backward(i, devices[i], modules[i], calls[i])

    generator_states = _shared_generator_states(devices)  # as the forward's: draws in threads are in no fixed order
    results = _in_workers([functools.partial(run, i) for i in range(len(calls))], caller)
    _undo_crossed_recomputations(generator_states, undrawn)
    _warn_if_drawn(generator_states, "backward")
    _reraise_first_failure(results, devices, "backward")
    return results


def _undo_crossed_recomputations(before: dict[torch.device, tuple[int, Any]], undrawn: dict[torch.device, Any]) -> None:
    """Put back a generator that the replicas' backwards left at the state of their forward, ``undrawn`` (where the
    forward drew nothing), after it had moved on by the backward's start (``before``).

    A non-reentrant checkpoint's recomputation sets the generator to the state its forward saw, then back to the one
    it found (``torch.random.fork_rng``). In workers at once, one puts back what another had just set, and the
    generator ends at the forward's state: the numbers drawn between the forward and the backward would come again.
    Serially it ends where the backward began; a backward that drew numbers (a Function) leaves it elsewhere, and
    there it stays."""
    for device, (_, state) in before.items():
        forward = undrawn.get(device)
        if forward is not None and forward != state and generator_state(device) == forward:
            set_generator_state(device, state)


def _in_workers(calls: Sequence[Callable[[], Any]], caller: CallerState) -> list[Any]:
    """``calls[i]()`` in replica i's worker thread (replica 0's in this one); the results in order.

    A call that raises returns its error (a ``_ReplicaFailure``), so that every replica finishes before
    any error is re-raised (:func:`_reraise_first_failure`); then the caller's intra-op count is restored.
    """

    def captured(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except BaseException as error:
            return _ReplicaFailure(error)

    try:
        return _threads.run_all([functools.partial(captured, call) for call in calls])
    finally:
        caller.restore()


def _reraise_first_failure(results: list[Any], devices: Sequence[torch.device], stage: str) -> None:
    """Re-raise the error of the first replica whose ``stage`` failed of its own (not at a meeting another replica's
    failure ended), naming it and its device; ``results`` emptied then.

    Emptied because the caller's frame holds the list, and the error raised holds that frame through its traceback
    (a failed replica 0 ran in it): a loop, which only the garbage collector would free, with every replica and
    graph the errors' frames hold. So the replicas go at once, as after a step that failed without minidp.
    """
    failed = [i for i, result in enumerate(results) if isinstance(result, _ReplicaFailure)]
    if failed:
        # A replica whose meeting could not complete (ReplicaGroupError: SyncBatchNorm's statistics) because another
        # replica raised first is not the cause: that replica's error is raised, of its own type, as without a meeting.
        index = next((i for i in failed if not isinstance(results[i].error, ReplicaGroupError)), failed[0])
        failure = results[index]
        results.clear()
        failure.reraise(index, devices[index], stage)
