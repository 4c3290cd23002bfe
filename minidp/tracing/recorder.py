"""The recorder: ``with minidp.trace() as step:`` listens to the steps and keeps one event per replica.

    with minidp.trace() as step:
        loss = loss_fn(model(batch))      # model = minidp.DataParallel(...)
        loss.backward()
    print(step.table())
    step.to_chrome("step.json")           # open in https://ui.perfetto.dev or chrome://tracing
    step.plot("step.png")                 # needs matplotlib: pip install 'minidp[plot]'

The primitives know nothing of this module: they announce their calls through :mod:`minidp.hooks`,
and a :class:`Trace` installs itself there as the listener for the length of its ``with`` block.

What each event measures (``Event.bytes`` is always "bytes written to fresh memory by this step"):

| stage     | one event per | time                                   | bytes                                          |
|-----------|---------------|----------------------------------------|------------------------------------------------|
| scatter   | replica       | the whole call, on the calling thread  | replica i's input chunks copied (a chunk on its source's device is a view: 0) |
| replicate | replica       | the whole call, on the calling thread  | parameters and buffers copied for replica i (parameters on their own device are aliased: 0; buffers of replicas 1.. are private clones) |
| forward   | replica       | replica i's call, in its thread        | -                                              |
| gather    | replica       | the whole call, on the calling thread  | replica i's outputs copied into the gathered output |
| backward  | replica       | from the first gradient reaching replica i's outputs to the last gradient of its parameters, or of its inputs where no parameter requires grad (autograd hooks), or replica i's backward call where it is one (CPU replicas in parallel); a module alone on its one device: its output's first gradient to its parameters' last (its inputs' where none requires grad) | - |
| reduce    | replica       | the whole call (run by autograd in the backward of replicate) | the sums (replica 0's event), and replica i's gradients copied to the destination's device to be added there (0 where they lie on it) |

Scatter, replicate, gather and reduce are one call on one thread that serves every replica, so
their events share one interval. Backward spans sit side by side, one track per replica, each
recorded in the thread that ran it: CPU replicas run their backwards in their own worker threads
(:mod:`minidp.parallel_backward`), replicas on different GPUs in their GPUs' autograd threads. Where
a graph keeps the serial backward, replicas on one device share its one autograd thread, and their
spans overlap, interleaving their nodes.

The backward of replica i is stitched from two ends without any shared state between the steps:
the replicate call names the replica modules it made (their parameters' gradients end the span),
and parallel_apply names the replica modules that made its outputs (their gradients start the span), and
what each was given (its inputs' gradients end the span of a replica with no parameter that requires grad).
Where :mod:`minidp.parallel_backward` runs a replica's backward as one call in its thread, parallel_apply
says so, no hook goes on the outputs, and that call, announced (``minidp.hooks.observe_replica_backward``),
is the span from start to return.

Times: ``time.perf_counter`` on the host; replicas on a GPU (forward, backward) and reductions onto
a GPU are timed with CUDA events on the stream they run on. Host-side steps on a GPU measure the
time to *issue* the copies, which run asynchronously.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import torch

from .. import hooks
from ..parallel_backward import is_entry
from ..step2_replicate import check_flag
from . import describers, views
from .memory import AllocationLedger, DeviceMemory, LedgerRow, MemoryPeak, gpus_in_use


@dataclass
class Event:
    """One step of one replica. ``start`` is seconds since the trace began."""

    stage: str
    replica: Optional[int]
    device: str
    start: float
    duration: float
    bytes: int = 0
    thread: str = ""
    detail: str = ""

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass
class _Span:
    host_start: float
    timing_device: Optional[torch.device]
    cuda_start: Optional["torch.cuda.Event"]
    thread: str


@dataclass
class _Closed:
    """A stage that has ended, its events still to be written (in ``Trace.__exit__``)."""

    span: _Span
    host_end: float
    cuda_end: Optional["torch.cuda.Event"]
    stage: str
    served: Callable[[], describers.Served]


@dataclass
class _Mark:
    """When gradients reached a replica's output or parameters: an autograd hook firing, or a replica's backward
    call returning."""

    host: float
    cuda: Optional["torch.cuda.Event"]
    device: torch.device
    thread: threading.Thread
    gradients: int  # how many gradients the mark stands for
    backward: Hashable  # which backward pass: autograd's graph task, or the replica's backward call


@dataclass
class _Backward:
    """The two ends of one replica's backward: gradients reaching its outputs and its parameters, or its call's
    start and return."""

    replica: int
    ends_on_parameters: bool  # whether gradients of the replica's parameters end it (else those of its inputs)
    start: list[_Mark] = field(default_factory=list)
    end: list[_Mark] = field(default_factory=list)


_opening = threading.Lock()  # held while a trace checks the listener slot and takes it


def _after_the_block(reader: Callable) -> Callable:
    """Decorator: ``reader`` raises while its trace is recording, instead of answering from half a record (and before
    it recorded anything, instead of answering from none).

    Inside the ``with`` block the step's duration is not known yet (0), the backward's events are written at its
    end, and the memory peaks are read there: a table would show a step of 0 ms, a negative "(other)" and no
    backward. One check for every public reader (the views read the trace through them too).
    """

    @functools.wraps(reader)
    def guarded(self: "Trace", *args: Any, **kwargs: Any) -> Any:
        if not self._entered:  # an empty record would read as a step that moved nothing
            raise RuntimeError(
                f"Trace.{reader.__name__} was read from a trace that never recorded: record the steps in its with block "
                f"(with minidp.trace() as step: ...), then read step.{reader.__name__}"
            )
        if self._recording:
            raise RuntimeError(
                f"Trace.{reader.__name__} was read while the trace is still recording, inside its "
                f"`with minidp.trace()` block, where the step's duration, its backward's events and its memory "
                f"peaks are not known yet; read it after the with block ends"
            )
        return reader(self, *args, **kwargs)

    return guarded


class Trace:
    """The record of the data-parallel steps run inside ``with minidp.trace():``.

    ``events`` lists every step of every replica; ``duration`` is the length of the ``with`` block
    (the "step" the table's shares refer to); ``memory`` the peak memory of each device; ``steps`` how many
    data-parallel steps ran in it. Run the backward inside the block too: its events are recorded by hooks
    as it runs. Read them after the block: until it ends they are incomplete (the duration is not known, the
    backward's events are written at its end), so every reader raises inside it (:func:`_after_the_block`).

    A trace records the steps of every thread of the process while it is open (the hooks have one listener
    slot, :mod:`minidp.hooks`): one trace is open at a time, whichever thread opened it.

    The block itself only notes when each call ran and what it was given; the events (bytes moved,
    details) are written from those notes when first read (``events``, the views), so that bookkeeping
    is no part of the step's time. Until then the trace holds the tensors the notes name: the inputs'
    chunks and the replicas' tensors (never the outputs, gathered or not, nor the replicas' gradients:
    those are counted at once). ``ledger=True`` also counts every allocation of the step for
    :meth:`ledger` (what it costs: BENCHMARKS.md, "Tracer overhead").
    """

    def __init__(self, ledger: bool = False) -> None:
        check_flag(ledger, "ledger")  # "no" would read as true: a ledger counting every operator, unasked
        self._events: list[Event] = []
        self._duration = 0.0
        self._memory: list[MemoryPeak] = []
        self._recording = False  # inside the with block: the readers refuse (_after_the_block)
        self._entered = False  # a trace is one block: entered again, it would add a second block's events to the first
        self._steps = 0  # steps run at the top level: replicate calls, and modules run alone (_count_step)
        self._in_replica = threading.local()  # .forward: this thread runs a replica's forward (on_replica)
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # one writer of the events at a time (any thread may read them first)
        self._sorted = 0  # how many events were in self._events when it was last sorted
        self._origin = 0.0
        self._pending: list[_Closed] = []
        self._cuda_origin: dict[int, tuple[float, "torch.cuda.Event"]] = {}
        self._event_gpu: dict[int, int] = {}  # id(event) -> index of the GPU it was recorded on
        self._backwards: list[_Backward] = []
        self._backward_of: dict[int, _Backward] = {}  # id(replica module) -> its latest backward
        self._leaf_hooks: list[Any] = []  # handles of the hooks on a module's own parameters (on_module)
        self._device_memory = DeviceMemory()
        self._allocations: Optional[AllocationLedger] = AllocationLedger() if ledger else None

    # -- the with block -----------------------------------------------------------------------------

    def __enter__(self) -> "Trace":
        with _opening:  # two threads opening traces at once: one gets the slot, the other the error
            if self._entered:
                # Its events, steps and backward spans would run on from the first block while the duration and the
                # memory peaks are the second's alone: a table of both blocks' work in one block's time.
                raise RuntimeError(
                    "minidp.trace() is not reentrant: this trace already recorded a with block. Make a new "
                    "minidp.trace() for each block (with minidp.trace() as step: ...)."
                )
            if hooks.current_listener() is not None:
                raise RuntimeError(
                    "minidp.trace(): a trace is already recording in this process (this thread's or another "
                    "thread's). A trace records the steps of every thread of the process while it is open, so one "
                    "is open at a time: read the steps from the open one, or open this one after its with block ends."
                )
            self._device_memory.start()
            if self._allocations is not None:
                self._allocations.start()
            self._origin = time.perf_counter()
            self._recording = self._entered = True
            hooks.set_listener(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        hooks.set_listener(None)
        for handle in self._leaf_hooks:
            handle.remove()
        try:
            if self._allocations is not None:
                self._allocations.stop()
            for index in gpus_in_use():
                torch.cuda.synchronize(index)
            self._duration = time.perf_counter() - self._origin
            self._backward_of.clear()
            self._finish_backward()
            self._memory = self._device_memory.peaks()
        finally:
            self._recording = False

    @property
    @_after_the_block
    def events(self) -> list[Event]:
        """Every step of every replica, by start time; written from the calls' notes when first read."""
        self._write_events()
        return self._events

    @property
    @_after_the_block
    def duration(self) -> float:
        """Seconds the ``with`` block lasted: the "step" the table's shares refer to."""
        return self._duration

    @property
    @_after_the_block
    def memory(self) -> list[MemoryPeak]:
        """The peak memory of each device during the block."""
        return self._memory

    @property
    @_after_the_block
    def steps(self) -> int:
        """How many data-parallel steps ran in the block, in any thread: the replicate calls (one per
        ``DataParallel`` call, or per step run by hand), and the forwards of a module alone on its one device (which
        nothing replicates). The replicate call of a ``data_parallel`` nested in a replica is part of the outer step;
        a loss computed on the replicas (``parallel_criterion``) replicates nothing, and adds no step."""
        return self._steps

    def _write_events(self) -> None:
        with self._writing:
            with self._lock:
                pending, self._pending = self._pending, []
            for closed in pending:
                self._record(closed)
            if len(self._events) != self._sorted:  # written now, or the backward's, added in __exit__
                self._events.sort(key=lambda e: (e.start, hooks.STAGES.index(e.stage)))
                self._sorted = len(self._events)

    # -- what minidp.hooks calls --------------------------------------------------------------------

    def on_call(self, stage: str, function: Callable, arguments: inspect.BoundArguments) -> Any:
        arguments.apply_defaults()
        named = arguments.arguments
        span = self._open(describers.timing_device(stage, named))
        if self._allocations is None:
            result = function(*arguments.args, **arguments.kwargs)
        else:
            result = self._allocations.on_call(stage, function, arguments)
        ended = self._end(span)  # before the describer: its bookkeeping is the tracer's time, not the stage's
        self._close(span, stage, describers.DESCRIBERS[stage](self, named, result), ended)
        if stage == "replicate":
            self._count_step()
        return result

    def on_replica(self, replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        span = self._open(device)
        outer, self._in_replica.forward = getattr(self._in_replica, "forward", False), True
        try:
            return call() if self._allocations is None else self._allocations.on_replica(replica, device, module, call)
        finally:
            self._in_replica.forward = outer
            self._close(span, "forward", lambda: iter([(replica, device, 0, "")]))

    def on_module(self, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        if self._allocations is not None:
            self._allocations.watch_module(module)
        output = self.on_replica(0, device, module, call)
        self._count_step()
        started = _requiring_grad(output)
        if started:  # its backward: from the first gradient reaching its output to the last of its parameters', or
            # of its inputs' where no parameter requires grad (a frozen module: on_replica_inputs, as for replicas)
            backward = self._backward_of.get(id(module))
            if backward is None:  # its first step in this trace: one hook on each parameter, for every step's pass
                ending = [p for p in module.parameters() if p.requires_grad] if isinstance(module, torch.nn.Module) else []
                backward = _Backward(0, bool(ending))
                with self._lock:
                    self._backwards.append(backward)
                    self._backward_of[id(module)] = backward
                # The module's own parameters, leaves, would keep their hooks after the trace: removed at its end.
                self._leaf_hooks.extend(self._watch(ending, backward.end))
            self._watch(started, backward.start)
        return output

    def on_replica_outputs(self, modules: Sequence[Any], outputs: Sequence[Any], one_call_each: bool) -> None:
        if one_call_each:
            return  # each replica's call marks its backward's start and end (on_replica_backward)
        for module, output in zip(modules, outputs):  # else the first gradient to reach its outputs starts the span
            backward = self._backward_of.get(id(module))
            if backward is not None:  # a replica this trace saw made
                self._watch(_requiring_grad(output), backward.start)

    def on_replica_inputs(self, modules: Sequence[Any], inputs: Sequence[Any]) -> None:
        """The backward of a replica none of whose parameters requires grad (frozen, or none at all) ends when its
        inputs' gradients are made: those that a node made (a chunk of the batch; what a module alone on its one device
        was given). Not a leaf's: a hook on a tensor the caller keeps would outlive the step (on a tensor a node made,
        the caller's too where the module runs alone, a hook outlives the trace only as one that does nothing)."""
        for module, given in zip(modules, inputs):
            backward = self._backward_of.get(id(module))
            if backward is not None and not backward.ends_on_parameters:
                self._watch([t for t in _requiring_grad(given) if t.grad_fn is not None], backward.end)

    def on_storage(self, category: str, tensors: Sequence[Any]) -> None:
        if self._allocations is not None:
            self._allocations.on_storage(category, tensors)

    def on_wait(self, wait: Callable[[], Any]) -> Any:
        return wait() if self._allocations is None else self._allocations.on_wait(wait)

    def on_replica_backward(self, replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        backward = self._backward_of.get(id(module))
        this_call = object()  # one backward pass of the replica: a span of its own
        if backward is not None:  # a replica this trace saw made
            backward.start.append(self._mark(device, 1, this_call))
        gradients: Sequence[Any] = ()  # none, where the call raises: its span still ends, as a failed forward's does
        try:
            gradients = call() if self._allocations is None else self._allocations.on_replica_backward(
                replica, device, module, call)
            return gradients
        finally:
            if backward is not None:
                backward.end.append(self._mark(device, sum(g is not None for g in gradients), this_call))

    def watch_replicas(self, replicas: Sequence[Any], parameters: Sequence[Sequence[torch.Tensor]]) -> None:
        """Replicate made ``replicas``; the last gradient of ``parameters[i]`` ends replica i's backward.

        One pre-hook per autograd node that makes some of replica i's parameters (the replica's entry of
        :mod:`minidp.parallel_backward`, or the Broadcast that makes every replica's), looking at those of its
        outputs only: it runs when the node has all its gradients, which is when a hook on each of those
        parameters would run too (autograd runs a non-leaf tensor's hooks just before its node), for one Python
        call instead of one per parameter: every such call costs the backward a turn of the interpreter's lock.
        Where a replica's backward is one call (:meth:`on_replica_backward`, which marks both ends), its entry
        nodes never run. Hooks on the tensors remain where a node may be passed over while its tensors' hooks
        still run: another replica's entry (the replicas of a ``data_parallel`` called inside a replica hold the
        outer replica's tensors, whose parallel backward takes their gradients at its entries without running
        them), and a leaf (a plain tensor the replica holds).
        """
        users: dict[int, set[int]] = {}  # id(entry node) -> the replicas whose tensors come through it
        for index, params in enumerate(parameters):
            for param in params:
                if is_entry(param.grad_fn):
                    users.setdefault(id(param.grad_fn), set()).add(index)
        for index, (module, params) in enumerate(zip(replicas, parameters)):
            backward = _Backward(index, bool(params))
            with self._lock:
                self._backwards.append(backward)
                self._backward_of[id(module)] = backward
            made: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # id(node) -> the node, the replica's tensors it makes
            for param in params:
                made.setdefault(id(param.grad_fn), (param.grad_fn, []))[1].append(param)
            for node, made_here in made.values():
                if node is None or (is_entry(node) and users[id(node)] != {index}):
                    self._watch(made_here, backward.end)
                else:
                    node.register_prehook(self._end_of(backward.end, [p.output_nr for p in made_here]))

    def _count_step(self) -> None:
        """A step's replicas were made, or a module ran alone: one more step, unless this thread runs a replica's
        forward, whose nested ``data_parallel`` calls are part of the outer step."""
        if not getattr(self._in_replica, "forward", False):
            with self._lock:
                self._steps += 1

    @_after_the_block
    def ledger(self) -> list[LedgerRow]:
        """Per device and per replica: the most memory the step held, and what it was made of, counted from
        its allocations (see :mod:`minidp.tracing.memory`); needs ``minidp.trace(ledger=True)``."""
        if self._allocations is None:
            raise RuntimeError("this trace did not count allocations: trace with minidp.trace(ledger=True) "
                               "to read its memory ledger")
        return self._allocations.rows({peak.device: peak.bytes for peak in self.memory if peak.device != "cpu"})

    # -- recording ----------------------------------------------------------------------------------

    def _cuda_event(self, device: Optional[torch.device]) -> Optional["torch.cuda.Event"]:
        if device is None or device.type != "cuda":
            return None
        with self._lock:  # replicas' threads may meet a GPU for the first time together
            if device.index not in self._cuda_origin:  # first use of this GPU in the trace: pin its clock
                torch.cuda.synchronize(device)
                origin = torch.cuda.Event(enable_timing=True)
                origin.record(torch.cuda.current_stream(device))
                torch.cuda.synchronize(device)
                self._cuda_origin[device.index] = (time.perf_counter() - self._origin, origin)
            event = torch.cuda.Event(enable_timing=True)
            self._event_gpu[id(event)] = device.index  # the trace keeps every event alive: ids stay unique
        event.record(torch.cuda.current_stream(device))
        return event

    def _cuda_time(self, event: "torch.cuda.Event") -> float:
        """Seconds since the trace began: the event's time on its GPU, from that GPU's reference event."""
        host, origin = self._cuda_origin[self._event_gpu[id(event)]]
        return host + origin.elapsed_time(event) / 1e3

    def _now(self) -> float:
        return time.perf_counter() - self._origin

    def _open(self, timing_device: Optional[torch.device]) -> _Span:
        return _Span(self._now(), timing_device, self._cuda_event(timing_device), threading.current_thread().name)

    def _end(self, span: _Span) -> tuple[float, Optional["torch.cuda.Event"]]:
        """Now, on the host and (for a stage timed on a GPU) on ``span``'s device: where ``span`` ends."""
        return self._now(), self._cuda_event(span.timing_device)

    def _close(self, span: _Span, stage: str, served: Callable[[], describers.Served],
               ended: Optional[tuple[float, Optional["torch.cuda.Event"]]] = None) -> None:
        """End ``span`` at ``ended`` (:meth:`_end`; by default now); when the events are first read, record ``stage``
        for every ``(replica, device, bytes, detail)`` that ``served()`` lists."""
        closed = _Closed(span, *(ended or self._end(span)), stage, served)
        if self._allocations is not None:
            # Count now, not at the end: served() holds the stage's tensors (a reduction's inputs and sums,
            # the replicas' outputs) and would keep them alive to the end of the step, where the ledger
            # would count them (and autograd, seeing the sums still referenced, would copy them into .grad).
            closed.served = functools.partial(iter, list(served()))
        with self._lock:
            self._pending.append(closed)

    def _record(self, closed: _Closed) -> None:
        span = closed.span
        start, duration = span.host_start, closed.host_end - span.host_start
        if span.cuda_start is not None:
            start = self._cuda_time(span.cuda_start)
            duration = span.cuda_start.elapsed_time(closed.cuda_end) / 1e3
        self._events.extend(
            Event(closed.stage, replica, str(device), start, duration, nbytes, span.thread, detail)
            for replica, device, nbytes, detail in closed.served()
        )

    # -- backward, seen through autograd hooks -------------------------------------------------------

    def _mark(self, device: torch.device, gradients: int = 1, backward: Optional[Hashable] = None) -> _Mark:
        """Now, in this thread (and on ``device``'s stream, for a GPU): the least it can, names made in __exit__.
        ``backward``: the pass it belongs to; by default the graph task of the autograd hook that marks it."""
        cuda = self._cuda_event(device) if device.type == "cuda" else None
        if backward is None:
            backward = torch._C._current_graph_task_id()
        return _Mark(time.perf_counter() - self._origin, cuda, device, threading.current_thread(), gradients, backward)

    # The hooks below reach the trace through a weak reference. A strong one would close a loop that Python's
    # garbage collector cannot see, and so never breaks: the trace holds the step's tensors until its events are
    # written (the replicas' parameters, their outputs), they hold the autograd nodes that made them, and a node
    # holds its hooks in C++. Every traced step would then stay in memory for good, tensors and all.
    def _watch(self, tensors: Sequence[torch.Tensor], marks: list[_Mark]) -> list[Any]:
        """A mark in ``marks`` whenever a gradient of one of ``tensors`` is made; the hooks' handles."""
        trace = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            listening = _still_listening(trace)
            if listening is not None:
                marks.append(listening._mark(grad.device))

        return [tensor.register_hook(hook) for tensor in tensors]

    def _end_of(self, marks: list[_Mark], outputs: Sequence[int]) -> Callable[[tuple], None]:
        """A pre-hook for a node whose ``outputs`` are a replica's parameters: marks when their gradients are all in."""
        trace = weakref.ref(self)

        def prehook(grads: tuple) -> None:
            arrived = [grads[k] for k in outputs if grads[k] is not None]
            listening = _still_listening(trace)
            if arrived and listening is not None:
                marks.append(listening._mark(arrived[0].device, len(arrived)))

        return prehook

    def _finish_backward(self) -> None:
        def when(mark: _Mark) -> float:
            return self._cuda_time(mark.cuda) if mark.cuda is not None else mark.host

        for backward in self._backwards:
            # One event per backward pass (a graph kept with retain_graph may be back-propagated twice in one trace),
            # named by the graph task, or the call, that its first gradient came in
            first_of: dict[Hashable, _Mark] = {}  # each pass's first start, in the order the passes began
            for mark in sorted(backward.start, key=when):
                first_of.setdefault(mark.backward, mark)
            ends_of: dict[Hashable, list[_Mark]] = {key: [] for key in first_of}
            for mark in backward.end:
                key = mark.backward
                if key not in first_of:  # marked in a task inside a pass (a re-entrant checkpoint's): the latest begun
                    key = next((k for k, first in reversed(first_of.items()) if when(first) <= when(mark)), None)
                if key is not None:
                    ends_of[key].append(mark)
            for key, first in first_of.items():
                ends = ends_of[key]
                if not ends:
                    continue  # the pass ended after the trace did
                start, end = when(first), max(map(when, ends))
                self._events.append(
                    Event("backward", backward.replica, str(first.device), start, max(end - start, 0.0), 0,
                          first.thread.name, f"{sum(m.gradients for m in ends)} gradients at its end")
                )

    # -- views (minidp/tracing/views.py) --------------------------------------------------------------

    @_after_the_block
    def lanes(self) -> list[tuple[str, Optional[int]]]:
        """``(device, replica)`` of every track, in device then replica order."""
        return views.lanes(self)

    @_after_the_block
    def summary(self) -> list[dict[str, Any]]:
        """One row per stage and device: wall time, busy thread time, share of the step, bytes."""
        return views.summary(self)

    @_after_the_block
    def table(self) -> str:
        """The step as text: per stage and device, wall time, its share of the step, thread time, bytes."""
        return views.table(self)

    @_after_the_block
    def ledger_table(self) -> str:
        """The memory ledger as text: per device and replica, the peak and what it was made of."""
        return views.ledger_table(self.ledger())

    @_after_the_block
    def to_chrome(self, path: Union[str, Path]) -> Path:
        """Write the Chrome trace format (JSON): one process per device, one track per replica.

        Open it in https://ui.perfetto.dev (drag the file in) or chrome://tracing (Load).
        """
        return views.write_chrome(self, path)

    @_after_the_block
    def plot(self, path: Union[str, Path]) -> Path:
        """Draw the step as a PNG timeline: one lane per device and replica, one colour per stage."""
        return views.plot(self, path)


def _requiring_grad(obj: Any) -> list[torch.Tensor]:
    return [t for _, t in describers.tensors_in(obj) if t.requires_grad]


def _still_listening(trace: "weakref.ref[Trace]") -> Optional[Trace]:
    """The trace a hook was made for, if it is alive and still the listener (a graph may outlive its trace's block)."""
    listening = trace()
    return listening if listening is not None and hooks.current_listener() is listening else None


def trace(ledger: bool = False) -> Trace:
    """A tracer for the data-parallel steps run inside ``with minidp.trace() as step:``; ``ledger=True``
    also counts the step's allocations for ``step.ledger()``."""
    return Trace(ledger)
