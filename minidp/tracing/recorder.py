"""Seeing every step: a tracer for the five steps of data parallelism.

    with minidp.trace() as step:
        loss = loss_fn(model(batch))      # model = minidp.DataParallel(...)
        loss.backward()
    print(step.table())
    step.to_chrome("step.json")           # open in https://ui.perfetto.dev or chrome://tracing
    step.plot("step.png")                 # needs matplotlib: pip install 'minidp[plot]'

Each primitive is instrumented by one line: ``@traced("scatter")`` on :func:`minidp.scatter`,
:func:`minidp.scatter_kwargs`, :func:`minidp.replicate`, :func:`minidp.gather` and
:func:`minidp.comm.reduce_add_coalesced`, and ``with stage("forward", i, device):`` around each
replica's call in :func:`minidp.parallel_apply`. With no tracer and no profiler active, that line
costs a check of two flags (plus, on a GPU, an NVTX range, so that Nsight Systems sees the stages).
When ``torch.profiler`` is recording, every stage shows in its trace as ``minidp::<stage>``.

What each event measures (``Event.bytes`` is always "bytes written to fresh memory by this step"):

| stage     | one event per | time                                   | bytes                                          |
|-----------|---------------|----------------------------------------|------------------------------------------------|
| scatter   | replica       | the whole call, on the calling thread  | replica i's input chunks copied (a chunk on its source's device is a view: 0) |
| replicate | replica       | the whole call, on the calling thread  | parameters and buffers copied for replica i (parameters on their own device are aliased: 0; buffers of replicas 1.. are private clones) |
| forward   | replica       | replica i's call, in its thread        | -                                              |
| gather    | replica       | the whole call, on the calling thread  | replica i's outputs copied into the gathered output |
| backward  | replica       | from the first gradient reaching replica i's outputs to the last gradient of its parameters (autograd hooks) | - |
| reduce    | replica       | the whole call (run by autograd in the backward of replicate) | replica i's gradients summed into the original parameters |

Scatter, replicate, gather and reduce are one call on one thread that serves every replica, so
their events share one interval. Backward spans can overlap: autograd runs the backward of all
replicas on one device in that device's single autograd thread, interleaving their nodes.

Times: ``time.perf_counter`` on the host; replicas on a GPU (forward, backward) and reductions onto
a GPU are timed with CUDA events on the stream they run on. Host-side steps on a GPU measure the
time to *issue* the copies, which run asynchronously.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch.autograd import profiler as _profiler

from ..nested import tensors_in

STAGES = ("scatter", "replicate", "forward", "gather", "backward", "reduce")

# The one flag every instrumented line checks. Set by ``Trace.__enter__``, cleared by ``__exit__``.
_active_tracer: Optional["Trace"] = None


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


# --------------------------------------------------------------------------------------------------
# The instrumentation: what the core modules call
# --------------------------------------------------------------------------------------------------


def _observed() -> bool:
    return _active_tracer is not None or _profiler._is_profiler_enabled


@contextlib.contextmanager
def _ranges(stage_name: str, cuda: bool) -> Iterator[None]:
    """``record_function`` (seen by ``torch.profiler``) and, on a GPU, an NVTX range (seen by Nsight)."""
    with contextlib.ExitStack() as stack:
        if cuda:
            stack.enter_context(torch.cuda.nvtx.range(f"minidp::{stage_name}"))
        if _profiler._is_profiler_enabled:  # costs real time when no profiler listens: skip it then
            stack.enter_context(torch.profiler.record_function(f"minidp::{stage_name}"))
        yield


def _uses_cuda() -> bool:
    return torch.cuda.is_initialized()


@contextlib.contextmanager
def stage(stage_name: str, replica: int, device: torch.device) -> Iterator[None]:
    """Mark the body as ``stage_name`` of ``replica`` on ``device`` (used for each replica's forward)."""
    if not _observed() and device.type != "cuda":
        yield
        return
    tracer = _active_tracer
    with _ranges(stage_name, device.type == "cuda"):
        if tracer is None:
            yield
            return
        span = tracer._open(device)
        try:
            yield
        finally:
            tracer._close(span, stage_name, lambda: [(replica, device, 0, "")])


def traced(stage_name: str) -> Callable[[Callable], Callable]:
    """Decorator: calls of the decorated primitive are ``stage_name`` events when a tracer is active.

    The tracer reads the call's arguments and result to say what moved to each replica (see
    ``_DESCRIBE``); with no tracer active the primitive runs untouched.
    """

    def decorate(function: Callable) -> Callable:
        arguments_of = _binder(function)
        describe = _DESCRIBE[stage_name]
        timing_device_of = _TIMING_DEVICE.get(stage_name, lambda arguments: None)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tracer = _active_tracer
            cuda = _uses_cuda()
            if tracer is None and not cuda and not _profiler._is_profiler_enabled:
                return function(*args, **kwargs)
            with _ranges(stage_name, cuda) if cuda or _profiler._is_profiler_enabled else contextlib.nullcontext():
                if tracer is None:
                    return function(*args, **kwargs)
                arguments = arguments_of(args, kwargs)
                span = tracer._open(timing_device_of(arguments))
                result = function(*args, **kwargs)
                tracer._close(span, stage_name, describe(tracer, arguments, result))
                return result

        return wrapper

    return decorate


def _binder(function: Callable) -> Callable[[tuple, dict], dict[str, Any]]:
    """``(args, kwargs) -> {parameter name: value}``, defaults filled in: what ``inspect.Signature.bind``
    and ``apply_defaults`` give for a valid call, at a fraction of their cost per call. (An invalid
    call is left to the function itself to reject.)"""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        raise TypeError(f"traced: {function.__name__} takes *args or **kwargs; name its parameters")
    names = [p.name for p in parameters if p.kind != p.KEYWORD_ONLY]
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}

    def arguments_of(args: tuple, kwargs: dict) -> dict[str, Any]:
        arguments = dict(defaults)
        arguments.update(zip(names, args))
        arguments.update(kwargs)
        return arguments

    return arguments_of


# --------------------------------------------------------------------------------------------------
# What each stage moved: (replica, device, bytes, detail) for every replica it served
# --------------------------------------------------------------------------------------------------


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for _, t in tensors_in(obj, "")]


def _storage(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _storages(tensors: Sequence[torch.Tensor]) -> set[tuple[torch.device, int]]:
    return {_storage(t) for t in tensors}


def _copied_bytes(tensors: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors`` that live in memory none of ``sources`` owns (so they were copied)."""
    return _bytes_outside(tensors, _storages(sources))


def _bytes_outside(tensors: Sequence[torch.Tensor], owned: set[tuple[torch.device, int]]) -> int:
    return sum(t.nbytes for t in tensors if _storage(t) not in owned)


def _device_of(tensors: Sequence[torch.Tensor], default: Any) -> str:
    return str(tensors[0].device) if tensors else str(default)


# Each describer runs when its primitive returns: it does there what needs the live call (registering
# the backward's hooks, reading modules the replica cache re-binds on its next call) and returns the
# rest as a function the tracer calls in ``__exit__``: counting bytes and writing details is pure
# bookkeeping, kept out of the step and out of the stage's own time. Until then the trace holds the
# call's arguments and results (inputs, chunks, replicas' tensors, gradients): the ``with`` block is
# the step, and they are released with the trace's record at its end.
Served = Iterator[tuple[int, Any, int, str]]  # (replica, device, bytes, detail)


def _describe_scatter(tracer: "Trace", arguments: dict, result: Any) -> Callable[[], Served]:
    def served() -> Served:
        if "kwargs" in arguments:  # scatter_kwargs: (inputs per replica, kwargs per replica)
            sources = _tensors((arguments["inputs"], arguments["kwargs"]))
            pieces = list(zip(*result))
        else:
            sources = _tensors(arguments["inputs"])
            pieces = list(result)
        from ..device_ids import as_devices

        devices = as_devices(arguments["target_devices"])
        for replica, piece in enumerate(pieces):
            chunk = _tensors(piece)
            shapes = ", ".join(str(tuple(t.shape)) for t in chunk)
            yield replica, str(devices[replica]), _copied_bytes(chunk, sources), f"chunks {shapes}"

    return served


def _replica_tensors(
    network: torch.nn.Module, replica: torch.nn.Module
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``(originals, replica's parameters, replica's buffers)``: walks both module trees in step, each
    module once (as ``modules()`` does, without its generators). A replica keeps its parameters as
    plain attributes, under the names the original's ``_parameters`` holds them."""
    originals: list[torch.Tensor] = []
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [(network, replica)]
    while stack:
        original, copy = stack.pop()
        if id(original) in seen:
            continue
        seen.add(id(original))
        for key, param in original._parameters.items():
            if param is not None:
                originals.append(param)
                params.append(getattr(copy, key))
        copy_buffers = copy._buffers
        for key, buf in original._buffers.items():
            if buf is not None:
                originals.append(buf)
                buffers.append(copy_buffers[key])
        copy_children = copy._modules
        stack.extend((child, copy_children[key]) for key, child in original._modules.items() if child is not None)
    return originals, params, buffers


def _describe_replicate(tracer: "Trace", arguments: dict, result: list) -> Callable[[], Served]:
    network = arguments["network"]
    group = tracer._new_backward_group()
    walked = [_replica_tensors(network, module) for module in result]  # now: a cache re-binds these modules
    for replica, (_, params, _) in enumerate(walked):
        tracer._watch_backward_end(group, replica, [p for p in params if p.requires_grad])

    def served() -> Served:
        originals = _storages(walked[0][0]) if walked else set()
        for replica, (_, params, buffers) in enumerate(walked):
            copied = {"parameter": _bytes_outside(params, originals), "buffer": _bytes_outside(buffers, originals)}
            device = _device_of(params + buffers, arguments["devices"][replica])
            yield replica, device, copied["parameter"] + copied["buffer"], (
                f"parameters {copied['parameter']} B copied, buffers {copied['buffer']} B copied"
                + (" (parameters alias the original's storage)" if params and copied["parameter"] == 0 else "")
            )

    return served


def _describe_gather(tracer: "Trace", arguments: dict, result: Any) -> Callable[[], Served]:
    group = tracer._current_backward_group()
    outputs = [_tensors(output) for output in arguments["outputs"]]
    if group is not None:
        for replica, tensors in enumerate(outputs):
            tracer._watch_backward_start(group, replica, [t for t in tensors if t.requires_grad])

    def served() -> Served:
        gathered = _tensors(result)
        for replica, tensors in enumerate(outputs):
            yield replica, _device_of(tensors, arguments["target_device"]), _copied_bytes(tensors, gathered), (
                f"into {arguments['target_device']}"
            )

    return served


def _describe_reduce(tracer: "Trace", arguments: dict, result: Any) -> Callable[[], Served]:
    from ..comm import resolve_reduce_backend

    backend = resolve_reduce_backend(arguments["backend"])  # now: the default backend is a setting

    def served() -> Served:
        destination = _device_of(list(result), arguments["destination"])
        for replica, grads in enumerate(arguments["inputs"]):
            grads = list(grads)
            yield replica, _device_of(grads, destination), sum(g.nbytes for g in grads), (
                f"{len(grads)} gradients summed onto {destination}, backend={backend}"
            )

    return served


_DESCRIBE: dict[str, Callable] = {
    "scatter": _describe_scatter,
    "replicate": _describe_replicate,
    "gather": _describe_gather,
    "reduce": _describe_reduce,
}


def _reduce_timing_device(arguments: dict) -> Optional[torch.device]:
    from ..device_ids import as_device

    if arguments["destination"] is not None:
        return as_device(arguments["destination"], "destination")
    inputs = arguments["inputs"]
    return inputs[0][0].device if inputs and inputs[0] else None


# Stages timed on a device's stream rather than by the host clock: the reduction (onto its destination).
_TIMING_DEVICE: dict[str, Callable[[dict], Optional[torch.device]]] = {"reduce": _reduce_timing_device}


# --------------------------------------------------------------------------------------------------
# The tracer
# --------------------------------------------------------------------------------------------------


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
    served: Callable[[], Served]


@dataclass
class _Mark:
    """One autograd hook firing: when a gradient reached a replica's output or parameter."""

    host: float
    cuda: Optional["torch.cuda.Event"]
    device: torch.device
    thread: threading.Thread


@dataclass
class MemoryPeak:
    """The most memory a device held during the trace, above what it held when the trace began."""

    device: str
    bytes: int
    measure: str  # what was measured, in words


class _PeakResidentMemory:
    """The most resident memory (RSS) the process held since :meth:`start`, as the kernel counts it.

    Linux keeps a high-water mark of every process's RSS (``VmHWM`` in ``/proc/self/status``), and
    writing ``5`` to ``/proc/self/clear_refs`` resets it to the current RSS. So the peak is exact, not
    sampled, and costs nothing while the step runs. Elsewhere (or where the reset is refused) there is
    no CPU figure.
    """

    def __init__(self) -> None:
        self.start_bytes: Optional[int] = None

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status", "rb") as status:
            text = status.read()
        at = text.find(b"\n" + field.encode() + b":")
        if at < 0:
            raise ValueError(f"no {field} in /proc/self/status")
        return int(text[at:].split()[1]) * 1024  # reported in kB

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            with open("/proc/self/statm", "rb") as statm:  # RSS in pages: cheaper than /proc/self/status
                self.start_bytes = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            self.start_bytes = None

    def peak_above_start(self) -> Optional[int]:
        if self.start_bytes is None:
            return None
        return self._status("VmHWM") - self.start_bytes


class Trace:
    """The record of the data-parallel steps run inside ``with minidp.trace():``.

    ``events`` lists every step of every replica; ``duration`` is the length of the ``with`` block
    (the "step" the table's shares refer to); ``memory`` the peak memory of each device.
    Run the backward inside the block too: its events are recorded by hooks as it runs.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.duration = 0.0
        self.memory: list[MemoryPeak] = []
        self._lock = threading.Lock()
        self._origin = 0.0
        self._pending: list[_Closed] = []
        self._cuda_origin: dict[int, tuple[float, "torch.cuda.Event"]] = {}
        self._event_gpu: dict[int, int] = {}  # id(event) -> index of the GPU it was recorded on
        self._groups: list[dict[int, dict[str, list[_Mark]]]] = []
        self._last_group = threading.local()
        self._resident = _PeakResidentMemory()
        self._gpu_start: dict[int, int] = {}

    # -- the with block -----------------------------------------------------------------------------

    def __enter__(self) -> "Trace":
        global _active_tracer
        if _active_tracer is not None:
            raise RuntimeError("minidp.trace() is already active; traces do not nest. Use the outer one.")
        if _uses_cuda():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
                torch.cuda.reset_peak_memory_stats(index)
                self._gpu_start[index] = torch.cuda.memory_allocated(index)
        self._resident.start()
        self._origin = time.perf_counter()
        _active_tracer = self
        return self

    def __exit__(self, *exc_info: Any) -> None:
        global _active_tracer
        _active_tracer = None
        if _uses_cuda():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
        self.duration = time.perf_counter() - self._origin
        for closed in self._pending:
            self._record(closed)
        self._pending.clear()  # let go of the step's tensors
        self._finish_backward()
        self.events.sort(key=lambda e: (e.start, STAGES.index(e.stage) if e.stage in STAGES else -1))
        self._measure_memory()

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

    def _close(self, span: _Span, stage_name: str, served: Callable[[], "Served"]) -> None:
        """End ``span`` now; in ``__exit__``, record ``stage_name`` for every ``(replica, device, bytes,
        detail)`` that ``served()`` lists."""
        closed = _Closed(span, self._now(), self._cuda_event(span.timing_device), stage_name, served)
        with self._lock:
            self._pending.append(closed)

    def _record(self, closed: "_Closed") -> None:
        span = closed.span
        start, duration = span.host_start, closed.host_end - span.host_start
        if span.cuda_start is not None:
            start = self._cuda_time(span.cuda_start)
            duration = span.cuda_start.elapsed_time(closed.cuda_end) / 1e3
        self.events.extend(
            Event(closed.stage, replica, str(device), start, duration, nbytes, span.thread, detail)
            for replica, device, nbytes, detail in closed.served()
        )

    # -- backward, seen through autograd hooks -------------------------------------------------------

    def _new_backward_group(self) -> int:
        """One group per replicate call: the replicas whose backward the next gather starts."""
        with self._lock:
            self._groups.append({})
            self._last_group.value = len(self._groups) - 1
        return self._last_group.value

    def _current_backward_group(self) -> Optional[int]:
        return getattr(self._last_group, "value", None)

    def _watch(self, group: int, replica: int, tensors: Sequence[torch.Tensor], end: str) -> None:
        marks = self._groups[group].setdefault(replica, {"start": [], "end": []})[end]

        def hook(grad: torch.Tensor) -> None:  # runs in the backward: the least it can, names made in __exit__
            if _active_tracer is self:
                cuda = self._cuda_event(grad.device) if grad.is_cuda else None
                marks.append(_Mark(time.perf_counter() - self._origin, cuda, grad.device, threading.current_thread()))

        for tensor in tensors:
            tensor.register_hook(hook)

    def _watch_backward_start(self, group: int, replica: int, outputs: Sequence[torch.Tensor]) -> None:
        self._watch(group, replica, outputs, "start")

    def _watch_backward_end(self, group: int, replica: int, parameters: Sequence[torch.Tensor]) -> None:
        self._watch(group, replica, parameters, "end")

    def _finish_backward(self) -> None:
        def when(mark: _Mark) -> float:
            return self._cuda_time(mark.cuda) if mark.cuda is not None else mark.host

        for group in self._groups:
            for replica, marks in group.items():
                if not marks["start"] or not marks["end"]:
                    continue  # no backward ran (inference), or it ran after the trace ended
                first = min(marks["start"], key=when)
                start, end = when(first), max(when(m) for m in marks["end"])
                self.events.append(
                    Event("backward", replica, str(first.device), start, max(end - start, 0.0), 0, first.thread.name,
                          f"{len(marks['end'])} parameter gradients")
                )

    def _measure_memory(self) -> None:
        peak = self._resident.peak_above_start()
        if peak is not None:
            self.memory.append(MemoryPeak(
                "cpu", peak,
                "process resident memory (RSS): the kernel's high-water mark, reset when the trace began, above "
                "the RSS at that moment; one number for all CPU replicas, which share the process",
            ))
        for index, start in self._gpu_start.items():
            self.memory.append(MemoryPeak(
                f"cuda:{index}", torch.cuda.max_memory_allocated(index) - start,
                "CUDA caching allocator: peak allocated bytes above the start (torch.cuda.max_memory_allocated)",
            ))

    # -- views ----------------------------------------------------------------------------------------

    def lanes(self) -> list[tuple[str, Optional[int]]]:
        """``(device, replica)`` of every track, in device then replica order."""
        return sorted({(e.device, e.replica) for e in self.events}, key=lambda k: (k[0], -1 if k[1] is None else k[1]))

    def summary(self) -> list[dict[str, Any]]:
        """One row per stage and device: wall time, busy thread time, share of the step, bytes."""
        rows = []
        for name in STAGES:
            for device in sorted({e.device for e in self.events if e.stage == name}):
                events = [e for e in self.events if e.stage == name and e.device == device]
                wall = _union_length([(e.start, e.end) for e in events])
                busy = sum(
                    _union_length([(e.start, e.end) for e in events if e.thread == thread])
                    for thread in {e.thread for e in events}
                )
                rows.append({
                    "stage": name, "device": device,
                    "replicas": sorted({e.replica for e in events if e.replica is not None}),
                    "wall_s": wall, "busy_s": busy,
                    "share": wall / self.duration if self.duration else 0.0,
                    "bytes": sum(e.bytes for e in events),
                })
        return rows

    def table(self) -> str:
        """The step as text: per stage and device, wall time, its share of the step, thread time, bytes."""
        lines = [
            f"one traced step: {self.duration * 1e3:.2f} ms, {len(self.events)} events",
            f"{'stage':<10} {'device':<8} {'replicas':<9} {'wall ms':>9} {'share':>7} {'busy ms':>9} {'bytes':>12}",
        ]
        for row in self.summary():
            lines.append(
                f"{row['stage']:<10} {row['device']:<8} {_ranges_text(row['replicas']):<9} {row['wall_s'] * 1e3:>9.3f} "
                f"{row['share']:>6.1%} {row['busy_s'] * 1e3:>9.3f} {_bytes_text(row['bytes']):>12}"
            )
        covered = _union_length([(e.start, e.end) for e in self.events])
        lines.append(
            f"{'(other)':<10} {'':<8} {'':<9} {(self.duration - covered) * 1e3:>9.3f} "
            f"{(1 - covered / self.duration if self.duration else 0):>6.1%}   outside every stage (loss, optimizer, Python)"
        )
        lines.append(
            "wall: time the stage was running on the device; busy: summed over threads (parallel replicas add up); "
            "bytes: copied to fresh memory"
        )
        for peak in self.memory:
            lines.append(f"peak memory {peak.device}: {_bytes_text(peak.bytes)} ({peak.measure})")
        return "\n".join(lines)

    def to_chrome(self, path: Union[str, Path]) -> Path:
        """Write the Chrome trace format (JSON): one process per device, one track per replica.

        Open it in https://ui.perfetto.dev (drag the file in) or chrome://tracing (Load).
        """
        devices = sorted({e.device for e in self.events})
        pid = {device: number + 1 for number, device in enumerate(devices)}
        events: list[dict[str, Any]] = []
        for device in devices:
            events.append({"ph": "M", "name": "process_name", "pid": pid[device], "tid": 0, "args": {"name": device}})
        for device, replica in self.lanes():
            events.append({"ph": "M", "name": "thread_name", "pid": pid[device], "tid": _tid(replica),
                           "args": {"name": "host" if replica is None else f"replica {replica}"}})
        first = devices[0] if devices else "cpu"
        events.append({"ph": "X", "name": "step", "cat": "minidp", "pid": pid.get(first, 1), "tid": 0,
                       "ts": 0.0, "dur": self.duration * 1e6, "args": {}})
        for e in self.events:
            events.append({
                "ph": "X", "name": e.stage, "cat": "minidp", "pid": pid[e.device], "tid": _tid(e.replica),
                "ts": e.start * 1e6, "dur": e.duration * 1e6,
                "args": {"bytes": e.bytes, "replica": e.replica, "thread": e.thread, "detail": e.detail},
            })
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1))
        return path

    def plot(self, path: Union[str, Path]) -> Path:
        """Draw the step as a PNG timeline: one lane per device and replica, one colour per stage."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as error:
            raise ImportError("Trace.plot needs matplotlib: pip install 'minidp[plot]'") from error
        lanes = self.lanes()
        figure = Figure(figsize=(9, 1.2 + 0.45 * len(lanes)), dpi=100)
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        for lane, (device, replica) in enumerate(lanes):
            for e in self.events:
                if (e.device, e.replica) == (device, replica):
                    axes.broken_barh([(e.start * 1e3, e.duration * 1e3)], (lane - 0.4, 0.8),
                                     color=STAGE_COLOURS[e.stage])
        axes.set_yticks(range(len(lanes)), [f"{d} replica {r}" if r is not None else d for d, r in lanes])
        axes.invert_yaxis()
        axes.set_xlim(0, self.duration * 1e3)
        axes.set_xlabel("ms since the step began")
        axes.legend(handles=[Patch(color=STAGE_COLOURS[s], label=s) for s in STAGES], ncols=len(STAGES),
                    loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False, fontsize="small")
        figure.tight_layout()
        path = Path(path)
        figure.savefig(path)
        return path


STAGE_COLOURS = {
    "scatter": "#4c72b0", "replicate": "#8172b3", "forward": "#55a868",
    "gather": "#ccb974", "backward": "#c44e52", "reduce": "#dd8452",
}


def _tid(replica: Optional[int]) -> int:
    return 0 if replica is None else replica + 1


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _ranges_text(replicas: list[int]) -> str:
    if not replicas:
        return "-"
    if replicas == list(range(replicas[0], replicas[-1] + 1)) and len(replicas) > 1:
        return f"{replicas[0]}-{replicas[-1]}"
    return ",".join(map(str, replicas))


def _bytes_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def trace() -> Trace:
    """A tracer for the data-parallel steps run inside ``with minidp.trace() as step:``."""
    return Trace()


def write_trace_artifacts(step: Trace, directory: Union[str, Path]) -> dict[str, Path]:
    """Write ``table.txt``, ``trace.json`` (Chrome/Perfetto) and ``timeline.png`` into ``directory``.

    The PNG is skipped (and left out of the result) when matplotlib is not installed.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = {"table": directory / "table.txt", "chrome": step.to_chrome(directory / "trace.json")}
    written["table"].write_text(step.table() + "\n")
    try:
        written["timeline"] = step.plot(directory / "timeline.png")
    except ImportError:
        pass
    return written
