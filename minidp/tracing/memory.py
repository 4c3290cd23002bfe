"""Memory of a step: the ledger of what every device (and every replica on it) held, counted from allocations.

Two measurements live here.

**The ledger** (:class:`AllocationLedger`, :func:`measure_step`, and ``Trace.ledger()`` on top of them) counts
the storages the step's tensors live in: every storage an operator returns is an allocation of exactly
``storage.nbytes()`` bytes (a sparse tensor has none of its own: its indices' and its values' are counted), and it is
freed when its last user lets go of it. Four of torch's mechanisms
see them, in every thread, on the CPU as on a GPU:

* a ``TorchDispatchMode`` sees every operator and the tensors it takes and returns: a storage met for the
  first time as an operator's *result* was allocated then; one met first as an *argument* was already
  held when the measurement began (parameters, the batch, optimizer state), and counts from the start;
* ``weakref.finalize`` on the storage's Python object (torch keeps that object alive exactly as long as
  the storage) says when it is freed, in whichever thread lets go of it;
* ``torch.optim``'s global step hooks say when an optimizer steps, and which tensors are its state (a closure it is
  given, ``step(closure)``, runs the model: what it makes is named as outside the step);
* global module forward hooks say which module the calling thread runs itself, outside minidp's stages (the layers of
  a model that calls ``data_parallel`` in its forward, as the tutorial's does): its parameters, and what it keeps.

Every allocation and free gets a number from one counter, so the events of all threads fall in one order
and the peak is exact: the most bytes held at once, per device, and per replica. Which *category* a storage
belongs to is decided when the step is over, from what minidp knows (see :data:`CATEGORIES`):

| category | a storage ... |
|---|---|
| parameters | of the module's parameters and buffers (``replicate``'s ``network``, an optimizer's parameters, a module the calling thread runs itself), of the replicas' copies that ``replicate`` returns, or of the whole parameters ``fully_shard`` gathers |
| inputs | of the chunks ``scatter`` returns (on the batch's own device a chunk is a view and adds nothing), held before the step began and none of the others (the batch, the targets), or made by the calling thread's own code, outside any module's forward, by an operator autograd did not record, taken by an operator before the backward and kept for it (targets made in the step) |
| activations | made by a replica's forward (or by the forward of a module the calling thread runs itself) and still held when the next backward begins: kept for the backward (or by the caller, as the outputs that ``gather_output=False`` leaves on the replicas) |
| gradients | of each replica's gradients handed to ``reduce``, of the sums it returns, of the parameters' ``.grad``, and of DDP's gradient buckets |
| gathered outputs | of what ``gather`` returns: the whole output, or with :func:`minidp.parallel_criterion` only the loss terms |
| loss | made by the criterion (a loss module of ``torch.nn``, the caller's code outside any module's forward where autograd recorded the operator or where a backward first took it, or on the replicas) and held when the next backward begins, with the gradient ``backward()`` starts from (``torch.ones_like(loss)``) |
| optimizer state | of ``optimizer.state`` when an optimizer steps |
| temporaries | anything else the step made: freed before the next backward began, or made by a backward or the optimizer and none of the above |

Where a storage was made is known from the thread it was made in: each replica's forward runs in a thread
(``minidp.hooks`` tells the recorder which replica), and each stage's call is one call on one thread; the
backward is whatever runs inside autograd's graph task (``torch._C._current_graph_task_id``), and begins with the
task's first allocation or free (a node may first let go of what its forward kept). The next backward is
the first to begin after a storage was made: a step may hold several forwards and backwards (gradient accumulation),
each forward's storages kept for the backward that follows it. Code that knows more names it with
:meth:`AllocationLedger.mark`, and a category not in :data:`CATEGORIES` gets a line of its own after them. The
parallel code, which does not import this module, names its own buffers through
:func:`minidp.hooks.observe_storage` (:meth:`AllocationLedger.on_storage`): ``fully_shard``'s gathered whole
parameters are parameters (else, met first as a storage resized to 0 before the step, they would be inputs), DDP's
bucket buffers gradients (else loss, activations or inputs, by the phase that made or first met them); and it waits for
its collectives through :func:`minidp.hooks.observe_wait` (:meth:`AllocationLedger.on_wait`): a storage first met in
a wait was made then by the backend's own thread (Gloo's reduce-scatter buffer), not held before the step.

What this counts and what it does not: the bytes are the sizes the allocator is asked for. On the CPU,
torch's allocator allocates exactly that (aligned to 64 bytes; the heap's own bookkeeping is not torch's);
on a GPU the caching allocator rounds every block up to a multiple of 512 bytes and reuses a freed block
only once the streams that used it are done, and its own figure is shown beside the ledger
(``torch.cuda.max_memory_allocated`` above the start, as in the trace's table). Scratch
memory that an operator allocates and frees inside its own kernel is not a tensor any operator returns and
is not counted (an LSTM's on the CPU: 21% above the ledger's peak in one search's case); nor are tensors made and used
by no operator: the generator's state that activation checkpointing keeps for each checkpointed segment
(``torch.get_rng_state()``, 5,056 bytes on the CPU, made in C++ and read back by ``torch.set_rng_state``), and the
copies of it minidp reads, with dispatch off, to see whether replicas drew from a generator they share
(:func:`minidp.device_ids.generator_state`, held for a moment, which can fall at the peak); nor a nested tensor's sizes
and strides, which torch keeps as tensors of its own. A tensor that meets its first operator later than it was made
counts from then (one that numpy made, ``torch.from_numpy``, counts from ``aten.lift_fresh``, the operator that takes
it in).

What it changes: code compiled with ``torch.compile`` runs as eager code while the ledger watches, as torch's compiler
steps aside while a ``TorchDispatchMode`` is active (its frames are neither compiled nor run as compiled): the ledger
counts the eager program's storages, and the step computes the eager program's results, which may differ from the
compiled program's in the last bits.

Where it is not exact, known and left as it is: the threads watched are the one that started the measurement and
the replicas' (forwards, and backwards run in parallel): another thread's own work during the trace goes uncounted or
uncategorised; an allocation is numbered when its operator returns, so where threads overlap, a free in one during
another's operator can fall before that operator's output, and the peak read lower than it was (by up to a third
where four replicas' forwards overlap, in a search's case); two storages over one
block of memory (``torch.from_dlpack``, ``torch.from_numpy(t.numpy())``) count twice; a tensor over memory that no
operator made and ``aten.lift_fresh`` does not take in (``torch.frombuffer``) is first met as an operator's argument,
and counts as held from the start; a tensor subclass that wraps
others counts as the storage it shows (its nominal size), not the inner tensors; an MKL-DNN tensor, which has no
storage, is not counted, nor is a tensor on the ``meta`` device, which holds no memory; and a helper thread's tensor
first met in the step counts as held from its start. One effect on the step itself: with a sparse gradient, autograd
keeps the incoming gradient as ``.grad`` only when nothing else holds its indices and values, which the watch's own
reference to them defeats, so under the ledger it stores a copy (the values equal, the memory twice).

Why not ``torch.profiler.profile(profile_memory=True)`` and its memory profile (``export_memory_timeline``,
``torch.profiler._memory_profiler.MemoryProfile``), which attribute every allocation to the same kinds of
category? In torch 2.13 the profiler records allocations only in the thread that started it: the forwards
of replicas 1, 2, ... run in minidp's worker threads and are invisible to it, and with
``experimental_config=_ExperimentalConfig(profile_all_threads=True)`` it records the other threads' operators
but no allocation at all. Its categories are also inferred afterwards, by a data-flow analysis over every
recorded operator, which with the profiler adds most of a step's time again (``python
benchmarks/trace_overhead.py --ledger``, BENCHMARKS.md); here they come from the stages minidp ran, and the
ledger adds a Python call per operator.

**The process's peak** (:class:`DeviceMemory`) is what the trace's table prints: on a GPU the caching
allocator's peak above the start; on the CPU the kernel's high-water mark of the process's resident memory
(RSS), which does not move when the allocator reuses memory it already holds.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib
import inspect
import itertools
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from .. import ext, hooks
from ..device_ids import device_order
from ..nested import tensors_in
from .describers import SPARSE_LAYOUTS, _parts, _replica_tensors, _tensors

_OPTIMIZER = ("optimizer", None)  # the phase of an optimizer's step, in the thread that steps it
_MODULE = ("module", None)  # the forward of a module the calling thread runs itself, outside minidp's stages
_LOSS = ("loss", None)  # the same for a loss module (torch.nn's losses), or a module a loss module runs
CATEGORIES = (
    "parameters", "inputs", "activations", "gradients", "gathered outputs", "loss", "optimizer state", "temporaries",
)


# -- the process's peak, for the trace's table -----------------------------------------------------------


@dataclass
class MemoryPeak:
    """The most memory a device held during the trace, above what it held when the trace began."""

    device: str
    bytes: int
    measure: str  # what was measured, in words


class PeakResidentMemory:
    """The most resident memory (RSS) the process held since :meth:`start`, as the kernel counts it.

    Linux keeps a high-water mark of every process's RSS (``VmHWM`` in ``/proc/self/status``), and
    writing ``5`` to ``/proc/self/clear_refs`` resets it to the current RSS. So the peak is exact, not
    sampled, and costs nothing while the step runs. Elsewhere (or where the reset is refused) there is
    no CPU figure.

    Both ends read the same mark through ``getrusage`` (``ru_maxrss``), a system call, where they can: the
    first read of ``/proc/self/status`` after a step costs hundreds of microseconds, ``getrusage`` 20 to 30
    (`python benchmarks/trace_overhead.py --rss-reads`). ``ru_maxrss`` is the larger of the mark and what
    the process's previous program held before it ``exec``-ed this one (the kernel keeps that figure in the
    process's signal state, untouched by the reset, and changes it only at an ``exec``). So every
    ``ru_maxrss`` ever read bounds the previous program's figure from above, and a start that reads more
    than the least of them read the mark itself: the trace then uses ``getrusage`` at both ends. Otherwise
    (a process's first trace, or a start below every earlier reading) both ends read the status file.
    """

    # The least ru_maxrss read in this process: the previous program's figure is at most this.
    _least_max_resident: Optional[int] = None

    def __init__(self) -> None:
        self.start_bytes: Optional[int] = None
        self._getrusage_serves = False

    # Both files through bare file descriptors: a traced step opens them up to three times, and Python's buffered
    # file objects cost more than the kernel's answer: status 33 us against 18 us (`python -m timeit
    # "open('/proc/self/status', 'rb').read()"` against `python -m timeit -s "import os" "f =
    # os.open('/proc/self/status', os.O_RDONLY); os.read(f, 1 << 16); os.close(f)"`), clear_refs 25 us against 7 us
    # (the same with a write of 5).
    @staticmethod
    def _status(field: str) -> int:
        status = os.open("/proc/self/status", os.O_RDONLY)
        try:
            text = os.read(status, 1 << 16)  # the whole file, about 1.5 KB
        finally:
            os.close(status)
        at = text.find(b"\n" + field.encode() + b":")
        if at < 0:
            raise ValueError(f"no {field} in /proc/self/status")
        return int(text[at:].split()[1]) * 1024  # reported in kB

    @staticmethod
    def _max_resident() -> int:
        import resource  # Unix only; reached only where /proc/self/clear_refs was written

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux

    @staticmethod
    def _noted(max_resident: int) -> int:
        """``max_resident``, kept if it is the least ``ru_maxrss`` read so far."""
        least = PeakResidentMemory._least_max_resident
        if least is None or max_resident < least:
            PeakResidentMemory._least_max_resident = max_resident
        return max_resident

    def start(self) -> None:
        try:
            clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
            try:
                os.write(clear_refs, b"5")
            finally:
                os.close(clear_refs)
            max_resident = self._noted(self._max_resident())
            # More than the previous program held: the mark itself. Else the mark the reset left, read back from
            # the same counter as the peak: the RSS read elsewhere (statm) can run ahead of the mark the kernel
            # keeps, and the peak then read below it.
            self._getrusage_serves = max_resident > PeakResidentMemory._least_max_resident
            self.start_bytes = max_resident if self._getrusage_serves else self._status("VmHWM")
        except (OSError, ValueError):
            self.start_bytes = None

    def peak_above_start(self) -> Optional[int]:
        if self.start_bytes is None:
            return None
        end = self._noted(self._max_resident()) if self._getrusage_serves else self._status("VmHWM")
        return max(end - self.start_bytes, 0)


def gpus_in_use() -> list[int]:
    """The GPUs this process holds memory on (its caching allocator's reserve, read without touching the GPU).

    The trace synchronizes and measures these only: a ``torch.cuda.synchronize`` on any other would create a CUDA
    context there, hundreds of MB on a GPU the job never uses (another user's, where the machine is shared)."""
    if not torch.cuda.is_initialized():
        return []
    return [index for index in range(torch.cuda.device_count()) if torch.cuda.memory_reserved(index) > 0]


class DeviceMemory:
    """Start and peak of every device's memory around a ``with minidp.trace()`` block."""

    def __init__(self) -> None:
        self.resident = PeakResidentMemory()
        self.gpu_start: dict[int, int] = {}

    def start(self) -> None:
        in_use = gpus_in_use()
        for index in in_use:
            torch.cuda.synchronize(index)
        for index in range(torch.cuda.device_count()) if torch.cuda.is_initialized() else ():  # counters, no GPU touched
            torch.cuda.reset_peak_memory_stats(index)
        self.gpu_start = {index: torch.cuda.memory_allocated(index) for index in in_use}
        self.resident.start()

    def peaks(self) -> list[MemoryPeak]:
        found = []
        peak = self.resident.peak_above_start()
        if peak is not None:
            found.append(MemoryPeak(
                "cpu", peak,
                "process resident memory (RSS): the kernel's high-water mark, reset when the trace began, above "
                "the RSS at that moment; one number for all CPU replicas, which share the process",
            ))
        # A GPU first used inside the trace held nothing at its start (its peak counter was reset all the same).
        for index, start in {**dict.fromkeys(gpus_in_use(), 0), **self.gpu_start}.items():
            found.append(MemoryPeak(
                f"cuda:{index}", torch.cuda.max_memory_allocated(index) - start,
                "CUDA caching allocator: peak allocated bytes above the start (torch.cuda.max_memory_allocated)",
            ))
        return found


# -- the ledger ---------------------------------------------------------------------------------------------


@dataclass
class LedgerRow:
    """What one device (``replica`` None), or one replica on it, held during a step.

    ``peak``: the most bytes held at once. ``held[category]``: the most bytes that category held at
    once (categories peak at different moments, so these do not add up to ``peak``). ``at_peak[category]``:
    what the bytes held at the moment of ``peak`` were made of (they add up to ``peak``).
    ``allocator_peak``: on a GPU, the caching allocator's own peak above the start (rounded blocks, and
    memory no tensor holds: kernels' scratch, cuBLAS workspaces); None on the CPU.
    """

    device: str
    replica: Optional[int]
    peak: int
    held: dict[str, int]
    at_peak: dict[str, int]
    allocator_peak: Optional[int] = None

    @property
    def label(self) -> str:
        return self.device if self.replica is None else f"{self.device} replica {self.replica}"


@dataclass
class _Storage:
    """One allocation: where and when it was made, and what it turned out to be."""

    device: str
    nbytes: int
    born: int  # the counter's value when it was made; 0: held before the measurement began
    phase: str  # what was running: a stage, "forward", "loss", "module", "backward", "optimizer", "host", "found"
    replica: Optional[int]
    died: Optional[int] = None
    category: Optional[str] = None  # named by what minidp knows of it (see AllocationLedger.mark)
    named_replica: Optional[int] = None
    resized: list[tuple[int, int]] = field(default_factory=list)  # (when, change in bytes)
    # Made by the calling thread's own code (AllocationLedger._kept_by_host): by an operator autograd records; or not,
    # and no operator has taken it since (the next one to will say whether a backward is its first user)
    graphed: bool = False
    awaiting_first_use: bool = False
    first_used_in_backward: bool = False


class _Watch(TorchDispatchMode):
    """Shows the ledger every operator's tensors: arguments first (held already), then results (made now)."""

    # The ledger enters a watch of its own in every replica's thread (AllocationLedger.watching): the parallel
    # backward need not run the replicas' backwards in the calling thread to keep them under it.
    entered_in_replica_threads = True

    def __init__(self, ledger: "AllocationLedger") -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.aten.lift_fresh.default:  # torch.tensor(...): its argument is new, not held
            self.ledger.see(_operator_tensors(args), made_now=False)
            self.ledger.see(_operator_tensors(kwargs.values()), made_now=False)
        result = func(*args, **kwargs)
        thread = self.ledger._thread
        thread.arguments = args  # for a result the calling thread's own code makes: AllocationLedger._kept_by_host
        try:
            self.ledger.see(_operator_tensors((result,)), made_now=True)
        finally:
            thread.arguments = ()  # not kept past the operator: the ledger must hold none of the step's tensors
        return result


def _operator_tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among an operator's arguments or results. An operator's schema allows a tensor, a list of
    tensors or a tuple of them, nothing deeper, so this is one level of lists, not ``minidp.nested``'s walk
    (which would cost the ledger as much again per operator)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _records_a_graph(arguments: tuple) -> bool:
    """Whether autograd records an operator given ``arguments`` (with grad enabled): one of them requires grad, as far as
    can be told below autograd (an operator without a gradient, ``argmax``, records nothing but reads as recorded)."""
    for value in arguments:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in value):
            return True
    return False


class AllocationLedger:
    """Counts every storage the step's operators use, per device and replica (see the module docstring).

    ``start()`` on the thread that runs the step, ``stop()`` there when it is over, ``rows()`` after.
    Other threads that run part of the step are watched inside :meth:`watching`; what runs is named with
    :meth:`phase`; what minidp knows a tensor to be is told with :meth:`mark`. It is a :class:`minidp.hooks.Listener`:
    installed (alone, by :func:`measure_step`, or by the trace that times the calls) it watches each replica's thread
    and names what minidp's stages take and make.
    """

    def __init__(self, kept_by_host: Optional[str] = None) -> None:
        """``kept_by_host``: what the calling thread's own code (outside every stage and every module's forward)
        keeps for the backward is. By default it is decided when the step is over: where minidp ran the model (a
        replica's forward, or the module running alone under ``DataParallel``) it is the loss, or an input (targets:
        :meth:`_kept_by_host` says which); a step without
        minidp's stages runs its model there, so it is "activations". What the forward of a module that thread runs
        keeps is activations (the layers of a model that calls ``data_parallel`` inside its forward, as the tutorial's
        does, which run outside it), and a loss module's (``torch.nn``'s losses) loss: :meth:`_module_begins`."""
        self.kept_by_host = kept_by_host
        self._lock = threading.RLock()  # a free may run inside see(), from a garbage collection
        self._clock = itertools.count(1)
        self._live: dict[int, _Storage] = {}  # the storage's address -> its record, while it lives
        self._storages: list[_Storage] = []
        self._device_names: dict[torch.device, str] = {}
        self._finalizers: list[weakref.finalize] = []
        self._thread = threading.local()  # .phases: a stack of (phase, replica); .watched: this thread is
        self._models: set[int] = set()  # ids of the modules whose forward is the model's: replicate's replicas, or
        # the module itself where it runs alone (one device)
        self._parameters: dict[int, torch.Tensor] = {}  # by id: whose .grad are gradients when the step ends
        self._grad_hooks: list[Any] = []  # the handles of the hooks that name each parameter's .grad as it is made
        self._hooks: list[Any] = []
        self._stop_observing_modules: Callable[[], None] = lambda: None
        self._mode: Optional[_Watch] = None
        self._resize_patched = False  # whether start() wrapped UntypedStorage.resize_
        self._backward_tasks: set[int] = set()  # autograd's graph tasks met so far
        self._extension_blocks: dict[int, _Storage] = {}  # address -> the record of a block the extension wrote sums in
        self._backward_begins: list[int] = []  # when each began (its first allocation or free), in order

    # -- the measurement --------------------------------------------------------------------------------

    def start(self) -> None:
        # The first operator run under any TorchDispatchMode in a process imports torch._dynamo (torch/_compile.py,
        # the wrapper that keeps dynamo off the mode's code): a second or more, which would fall inside the step's
        # first stage and be timed as its. Imported here, before the trace's events begin.
        importlib.import_module("torch._dynamo")

        self._hooks = [register_optimizer_step_pre_hook(self._optimizer_begins),
                       register_optimizer_step_post_hook(self._optimizer_ends)]
        self._stop_observing_modules = hooks.observe_module_calls(self._module_begins, self._module_ends)
        self._watch_storage_resizes()
        self._mode = _Watch(self)
        self._mode.__enter__()
        self._thread.watched = True

    def stop(self) -> None:
        self._thread.watched = False
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._resize_patched:
            del torch.UntypedStorage.resize_  # torch's own, from its C base class, again
            self._resize_patched = False
        for hook in self._hooks:
            hook.remove()
        self._stop_observing_modules()
        for handle in self._grad_hooks:  # hooks on the caller's parameters: none outlives the step
            handle.remove()
        self._grad_hooks.clear()
        self.mark([p.grad for p in self._parameters.values() if p.grad is not None], "gradients")
        self._parameters.clear()
        with self._lock:
            for finalizer in self._finalizers:  # frees after the step are not the step's
                finalizer.detach()
            self._finalizers.clear()
            self._live.clear()

    def _watch_storage_resizes(self) -> None:
        """See ``UntypedStorage.resize_`` as it runs, in the watched threads: no operator shows it. A gathered
        parameter is released so (``untyped_storage().resize_(0)``: minidp's fully_shard and its mixed precision, as
        FSDP2) and refilled so; seen only at the next operator that takes it, its memory would count as held until then,
        or, first met refilled, as held from the start at that size. torch offers no hook there, so the method is
        wrapped on torch's Python class (the call goes on to the C one it inherits) from start() to stop()."""
        if "resize_" in vars(torch.UntypedStorage):  # wrapped by someone else already: leave it as it is
            return
        ledger, resize = self, torch.UntypedStorage.resize_

        def watched_resize(storage: torch.UntypedStorage, size: int) -> Any:
            if not getattr(ledger._thread, "watched", False):
                return resize(storage, size)
            ledger._see_storage(storage, made_now=False)  # at its size before: held already, if first met here
            resized = resize(storage, size)
            ledger._see_storage(storage, made_now=False)  # the change, at this moment
            return resized

        torch.UntypedStorage.resize_ = watched_resize
        self._resize_patched = True

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Watch this thread too (a replica's worker) while inside; nothing more if it is watched already."""
        if getattr(self._thread, "watched", False):
            yield
            return
        self._thread.watched = True
        try:
            with _Watch(self):
                yield
        finally:
            self._thread.watched = False

    @contextlib.contextmanager
    def phase(self, name: str, replica: Optional[int] = None) -> Iterator[None]:
        """What this thread runs while inside: a stage's name, "forward" or "loss" of ``replica``, "optimizer"."""
        phases = self._phases()
        phases.append((name, replica))
        try:
            yield
        finally:
            phases.pop()

    def watch_parameters(self, parameters: Iterable[torch.Tensor]) -> None:
        """``parameters`` are the model's: counted as parameters, and their ``.grad`` as gradients, those they hold now
        (the last step's, which count until a ``zero_grad`` lets go of them, an operator or not), each one autograd
        makes (a hook after it accumulates: a step's ``.grad`` may be let go of by the next step's ``zero_grad`` before
        anything else names it, as where no optimizer steps in the block), and those they hold at the end."""
        parameters = list(parameters)
        self.mark(parameters, "parameters")
        self.mark([p.grad for p in parameters if p.grad is not None], "gradients")
        for parameter in parameters:
            if id(parameter) in self._parameters:  # once each, however many forwards name it
                continue
            self._parameters[id(parameter)] = parameter
            if parameter.requires_grad and parameter.is_leaf:
                self._grad_hooks.append(parameter.register_post_accumulate_grad_hook(self._grad_made))

    def _grad_made(self, parameter: torch.Tensor) -> None:
        if parameter.grad is not None:  # an earlier hook may have stepped and let go of it (an optimizer in backward)
            self.mark([parameter.grad], "gradients", made_now=True)

    def watch_module(self, module: torch.nn.Module) -> None:
        """``module`` runs itself as the only replica (one device, nothing replicated): its parameters and buffers
        are parameters, their ``.grad`` gradients, and what its forward keeps for the backward activations."""
        self._watch_network(module)
        self._models.add(id(module))

    def _watch_network(self, network: torch.nn.Module) -> None:
        self.watch_parameters(network.parameters())
        self.mark(network.buffers(), "parameters")

    def mark(self, tensors: Iterable[Any], category: str, replica: Optional[int] = None,
             made_now: bool = False, unless_made_in: Optional[str] = None) -> None:
        """The storages of ``tensors`` are ``category`` (of ``replica``); the first name a storage is given stands.

        ``made_now``: a storage not met before was made just now (a stage's result, made by code no
        operator shows, such as the extension's reduction); otherwise it was held from the start.
        ``unless_made_in``: a storage made in a phase of that name keeps the name its phase gives it.
        """
        for tensor in _parts(tensors):
            record = self._see_one(tensor, made_now)
            if record is not None and record.category is None and record.phase != unless_made_in:
                record.category, record.named_replica = category, replica

    # -- what the step's threads call -------------------------------------------------------------------

    def see(self, tensors: Iterable[torch.Tensor], made_now: bool) -> None:
        for tensor in tensors:
            self._see_one(tensor, made_now)

    def _see_one(self, tensor: torch.Tensor, made_now: bool) -> Optional[_Storage]:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):  # sparse, nested, no storage
            # A sparse tensor's memory is the storages of its indices and values: looked for here, off the path of
            # every dense tensor of every operator (through _parts in see(), it cost each operator 0.5 us more).
            if tensor.layout in SPARSE_LAYOUTS:
                self.see(_parts((tensor,)), made_now)
            return None
        record = self._live.get(storage._cdata)  # met before: the common case, read without the lock (one dict read)
        if record is not None and record.nbytes == storage.nbytes():
            if record.awaiting_first_use and not made_now:
                record.awaiting_first_use = False
                record.first_used_in_backward = torch._C._current_graph_task_id() != -1
            return record
        if storage.device.type == "meta":  # a shape without memory
            return None
        return self._see_storage(storage, made_now)

    def _see_storage(self, storage: torch.UntypedStorage, made_now: bool) -> _Storage:
        """A storage first met, or met at another size (resized), under the lock; ``_see_one`` reads the common case,
        a storage met before at its size, before calling here: a Python call less for each tensor of each operator, where
        the lookup takes about 150 ns and the call added a tenth to it (``python -m timeit -s "import torch; from minidp.tracing.memory import AllocationLedger;
        ledger = AllocationLedger(); t = torch.ones(10); ledger._see_one(t, False)" "ledger._see_one(t, False)"``)."""
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            record = self._live.get(key)
            if record is None:
                made_now = made_now or getattr(self._thread, "waiting", False)
                phase, replica = self._where() if made_now else ("found", None)
                device = self._device_names.get(storage.device)
                if device is None:  # str(device) costs as much as the rest of a lookup: named once per device
                    device = self._device_names[storage.device] = str(storage.device)
                if phase == "backward":
                    self._a_backward_may_begin()
                record = _Storage(device, nbytes, next(self._clock) if made_now else 0, phase, replica)
                if phase == "host":
                    record.graphed = torch.is_grad_enabled() and _records_a_graph(getattr(self._thread, "arguments", ()))
                    record.awaiting_first_use = not record.graphed
                self._live[key] = record
                self._storages.append(record)
                self._finalizers.append(weakref.finalize(storage, self._freed, key, record))
            elif record.nbytes != nbytes:  # resized in place (resize_, out= arguments)
                if record.nbytes and nbytes:
                    # The allocator gives the storage a block of the new size, copies the old one into it, then frees
                    # the old one (resize_bytes_cpu, and its CUDA twin): for a moment the storage holds both.
                    record.resized.append((next(self._clock), nbytes))
                    record.resized.append((next(self._clock), -record.nbytes))
                else:  # made from nothing (a gathered parameter refilled), or let go of (resize_(0))
                    record.resized.append((next(self._clock), nbytes - record.nbytes))
                record.nbytes = nbytes
            return record

    def _freed(self, key: int, record: _Storage) -> None:
        with self._lock:
            # a node that lets go of what its forward kept, before any allocation (the graph task read first: a free
            # outside every backward, the common case, costs one C call here)
            if torch._C._current_graph_task_id() != -1 and self._where()[0] == "backward":
                self._a_backward_may_begin()
            record.died = next(self._clock)
            if self._live.get(key) is record:
                del self._live[key]

    def _a_backward_may_begin(self) -> None:
        """An allocation or a free inside autograd's graph task: the first of a task met begins that backward (or one
        nested in it: a replica's, a checkpoint's recomputation; those begin after every storage made before their
        pass). Called under the lock, before the event takes its number."""
        task = torch._C._current_graph_task_id()
        if task not in self._backward_tasks:
            self._backward_tasks.add(task)
            self._backward_begins.append(next(self._clock))

    def _phases(self) -> list[tuple[str, Optional[int]]]:
        phases = getattr(self._thread, "phases", None)
        if phases is None:
            phases = self._thread.phases = []
        return phases

    def _where(self) -> tuple[str, Optional[int]]:
        phases = self._phases()
        if phases:
            return phases[-1]
        if torch._C._current_graph_task_id() != -1:  # inside autograd's backward, in any of its threads
            return "backward", None
        return "host", None

    def _module_begins(self, module: torch.nn.Module, args: Any) -> None:
        """A module's forward begins. Where the watched thread runs it itself, outside minidp's stages and replicas (a
        layer of a model that calls ``data_parallel`` in its forward, or the model of a step without minidp), what its
        forward makes is named by the phase pushed here (activations; a loss module's: loss), until
        :meth:`_module_ends`, which runs even where the forward raises, and names its parameters and buffers (then:
        a lazy module makes its parameters in a pre-hook of its own, which runs after this global one)."""
        calls = getattr(self._thread, "module_calls", None)
        if calls is None:
            calls = self._thread.module_calls = []
        phases = self._phases()
        if getattr(self._thread, "watched", False):
            self._leave_a_failed_optimizer_step()  # the phase of a step that raised ends; one still running keeps it
        runs_it = getattr(self._thread, "watched", False) and (not phases or phases[-1] in (_MODULE, _LOSS))
        if runs_it:
            phases.append(_LOSS if phases[-1:] == [_LOSS] or isinstance(module, torch.nn.modules.loss._Loss)
                          else _MODULE)
        calls.append(runs_it)

    def _module_ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The forward :meth:`_module_begins` saw begin has ended: its parameters (and their ``.grad``, known without an
        optimizer in the step) and buffers are named, read from the module's own registries (not through
        ``parameters()``, which a module may define otherwise), and its phase ends."""
        calls = getattr(self._thread, "module_calls", None)
        if calls and calls.pop():  # none where the forward began before the measurement did
            self.watch_parameters([p for p in module._parameters.values() if p is not None])
            self.mark([b for b in module._buffers.values() if b is not None], "parameters")
            phases = self._phases()
            if phases and phases[-1] in (_MODULE, _LOSS):
                phases.pop()

    def _optimizer_begins(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Optional[tuple]:
        """An optimizer steps: its parameters, their ``.grad`` and its state are named, and what this thread makes
        until it ends is the optimizer's. Except in a closure it is given (``step(closure)``: LBFGS, or any
        optimizer so called), which runs the model's forward and backward: the closure is handed on wrapped, so that
        what it makes is named as the step outside the optimizer would be (:meth:`_outside_the_optimizer`)."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.mark(parameters, "parameters")
        self.mark([p.grad for p in parameters if p.grad is not None], "gradients")
        self.mark([t for _, t in tensors_in(list(optimizer.state.values()))], "optimizer state")
        self._phases().append(_OPTIMIZER)
        # The frame that runs the step (torch's hook wrapper, which calls this hook): on this thread's stack while the
        # step runs, gone once it returned or raised (_leave_a_failed_optimizer_step)
        self._step_frames().append(id(sys._getframe(1)))
        # torch hands a pre-hook the step's arguments with the optimizer first: step(self, closure=None, ...)
        if len(args) > 1 and _takes_a_closure_first(type(optimizer).step):
            closure, given = args[1], "position"
        else:
            closure, given = kwargs.get("closure"), "keyword"
        if not callable(closure):
            return None
        outside = functools.update_wrapper(functools.partial(self._outside_the_optimizer, closure), closure)
        return ((args[0], outside, *args[2:]), kwargs) if given == "position" else (args, {**kwargs, "closure": outside})

    def _step_frames(self) -> list[int]:
        frames = getattr(self._thread, "step_frames", None)
        if frames is None:
            frames = self._thread.step_frames = []
        return frames

    def _outside_the_optimizer(self, closure: Callable[[], Any]) -> Any:
        phases = self._phases()
        inside = [phases.pop()] if phases and phases[-1] == _OPTIMIZER else []
        try:
            return closure()
        finally:
            phases.extend(inside)

    def _leave_a_failed_optimizer_step(self) -> None:
        """An optimizer step that raised never reached its post-hook, which ends its phase: a stage of the model, or a
        module's forward, run on this thread later ends it, once the frame that ran the step is off the thread's stack
        (a module the step itself runs, a learned optimizer's, leaves it on)."""
        phases, frames = self._phases(), self._step_frames()
        while phases and phases[-1] == _OPTIMIZER and frames and not _on_the_stack(frames[-1]):
            phases.pop()
            frames.pop()

    def _optimizer_ends(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.mark([t for _, t in tensors_in(list(optimizer.state.values()))], "optimizer state", made_now=True)
        phases, frames = self._phases(), self._step_frames()
        if phases and phases[-1] == _OPTIMIZER:
            phases.pop()
            frames.pop()

    # -- what minidp's stages know ----------------------------------------------------------------------

    def on_call(self, stage: str, function: Callable, arguments: inspect.BoundArguments) -> Any:
        """Run a stage's ``function`` on ``arguments`` and name what it takes and makes."""
        arguments.apply_defaults()
        named = arguments.arguments
        self._leave_a_failed_optimizer_step()
        if stage == "scatter":  # an activation a module made and gives to scatter stays one (the tutorial's)
            # The keyword arguments too (scatter_kwargs'): else replica 0's chunk of one, a view of the whole tensor on
            # the batch's own device, would name the whole tensor that replica's (an attention mask, model(**batch))
            self.mark(_tensors((named["inputs"], named.get("kwargs"))), "inputs", unless_made_in="module")
        elif stage == "replicate":
            self._watch_network(named["network"])
        elif stage == "reduce":
            for replica, gradients in enumerate(named["inputs"]):
                self.mark(gradients, "gradients", replica)
            met = len(self._storages)
            ext.forget_reduce_output_last_block()  # an earlier reduction's block is not this one's
        with self.phase(stage):
            result = function(*arguments.args, **arguments.kwargs)
        if stage == "scatter":
            pieces = zip(*result) if "kwargs" in named else result
            for replica, piece in enumerate(pieces):  # a chunk that is a view of such an activation too
                self.mark(_tensors(piece), "inputs", replica, made_now=True, unless_made_in="module")
        elif stage == "replicate":
            for replica, module in enumerate(result):
                self._models.add(id(module))
                _, parameters, buffers = _replica_tensors(named["network"], module)
                self.mark(parameters + buffers, "parameters", replica, made_now=True)
        elif stage == "gather":
            self.mark(_tensors(result, by_items=True), "gathered outputs", made_now=True)
        elif stage == "reduce":
            self.mark(_tensors(result), "gradients", made_now=True)
            self._kept_by_the_extension(_tensors(result), self._storages[met:])
        return result

    def _kept_by_the_extension(self, sums: Iterable[torch.Tensor], first_met: list[_Storage]) -> None:
        """The extension writes CPU ``sums`` into a block of memory it keeps from step to step (see
        :func:`minidp.ext.reduce_add_coalesced`), held while no tensor is over it too. A block it took again was held
        all along: one it made earlier in the measurement is the same allocation still (its tensors, not its memory,
        were let go of meanwhile), one it made before counts from the start."""
        address, taken_again = ext.reduce_output_last_block()
        tensor = next((t for t in _parts(sums) if t.device.type == "cpu" and t.untyped_storage().data_ptr() == address),
                      None) if address else None
        if tensor is None:
            return
        storage = tensor.untyped_storage()
        with self._lock:
            record = self._live.get(storage._cdata)
            earlier = self._extension_blocks.get(address)
            if taken_again and record is not None and any(record is met for met in first_met):
                if earlier is not None and earlier.died is not None:  # the same allocation, from when it was made
                    self._storages.remove(record)
                    earlier.died = None
                    self._live[storage._cdata] = record = earlier
                    self._finalizers.append(weakref.finalize(storage, self._freed, storage._cdata, earlier))
                elif earlier is None:  # made before the measurement began
                    record.born = 0
            if record is not None:
                self._extension_blocks[address] = record

    def on_replica(self, replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        """Run replica ``replica``'s ``call()`` in its thread: the model's forward if ``module`` is a replica
        that replicate made (or the module running alone, :meth:`watch_module`), else the loss on the replica
        (:func:`minidp.parallel_criterion`'s terms)."""
        name = "forward" if id(module) in self._models else "loss"
        with self.watching(), self.phase(name, replica):
            return call()

    def on_module(self, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        """Run ``module``'s ``call()``, the module running itself as the only replica (:meth:`watch_module`)."""
        self._leave_a_failed_optimizer_step()
        self.watch_module(module)
        return self.on_replica(0, device, module, call)

    def on_replica_backward(self, replica: int, device: torch.device, module: Any, call: Callable[[], Any]) -> Any:
        """Run a replica's backward ``call()`` in its thread (:mod:`minidp.parallel_backward`), watched there as the
        serial backward is in the calling thread: what it allocates is the backward's, and, made in the replica's own
        thread, that replica's (the serial backward interleaves the replicas' nodes in one thread: the device's there)."""
        with self.watching(), self.phase("backward", replica):
            return call()

    def on_replica_outputs(self, modules: Sequence[Any], outputs: Sequence[Any], one_call_each: bool) -> None:
        """Nothing to do: the replicas' outputs were seen as their forwards made them."""

    def on_wait(self, wait: Callable[[], Any]) -> Any:
        """Run ``wait()``, a collective's end (:func:`minidp.hooks.observe_wait`). A storage first met inside it was
        made during the step by the backend's own threads, which no watch sees (Gloo's reduce-scatter works in a
        buffer of its own, read in the wait), not held before the step: it counts from here, as made now."""
        self._thread.waiting = True
        try:
            return wait()
        finally:
            self._thread.waiting = False

    def on_storage(self, category: str, tensors: Sequence[torch.Tensor]) -> None:
        """The parallel code names its buffers (:func:`minidp.hooks.observe_storage`): a sharded module's gathered
        whole parameters are parameters, a DDP bucket's buffer gradients, whichever phase made or first met them."""
        self.mark(tensors, category)

    # -- the rows -------------------------------------------------------------------------------------------

    def category(self, record: _Storage) -> str:
        if record.category is not None:
            return record.category
        if record.phase == "found":
            return "inputs"
        after = bisect.bisect_right(self._backward_begins, record.born)  # the next backward: the one it is kept for
        began = self._backward_begins[after] if after < len(self._backward_begins) else None
        kept = began is not None and (record.died is None or record.died > began)
        if kept and record.phase in ("forward", "module", "loss", "host"):
            host = self.kept_by_host or self._kept_by_host(record)
            return {"forward": "activations", "module": "activations", "loss": "loss", "host": host}[record.phase]
        return "temporaries"

    def _kept_by_host(self, record: _Storage) -> str:
        """What the calling thread's own code made and kept for the backward: with minidp running the model, the loss
        where autograd recorded the operator that made it (a criterion's terms, a penalty on the weights) or where a
        backward is its first user (the gradient ``backward()`` starts from, given or made by it; a copy a
        ``saved_tensors_hooks`` pack hook keeps), else an input (targets made in the step, before the forward or after
        it). Without minidp's stages the model runs there, and it is an activation."""
        if not self._models:
            return "activations"
        return "loss" if record.graphed or record.first_used_in_backward else "inputs"

    def rows(self, allocator_peaks: Optional[dict[str, int]] = None) -> list[LedgerRow]:
        """One row per device (all it held), then one per replica on it (what that replica's own storages held)."""
        allocator_peaks = allocator_peaks or {}
        with self._lock:
            storages = list(self._storages)
        named = [(record, self.category(record),
                  record.named_replica if record.category is not None else record.replica) for record in storages]
        rows = []
        for device in sorted({record.device for record in storages}, key=device_order):
            on_device = [(r, c, k) for r, c, k in named if r.device == device]
            rows.append(_row(device, None, [(r, c) for r, c, _ in on_device], allocator_peaks.get(device)))
            for replica in sorted({k for _, _, k in on_device if k is not None}):
                rows.append(_row(device, replica, [(r, c) for r, c, k in on_device if k == replica], None))
        return rows


@functools.cache
def _takes_a_closure_first(step: Callable) -> bool:
    """Whether an optimizer's ``step`` takes a closure as its first argument after ``self``, as torch's optimizers do
    (``step(self, closure=None)``); a step of another signature gets its first argument as it was given."""
    try:
        parameters = list(inspect.signature(step).parameters)
    except (TypeError, ValueError):
        return False
    return parameters[1:2] == ["closure"]


def _on_the_stack(frame_id: int) -> bool:
    """Whether a frame of that id is on the calling thread's stack (a walk of a few dozen frames)."""
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame) == frame_id:
            return True
        frame = frame.f_back
    return False


def _row(device: str, replica: Optional[int], storages: list[tuple[_Storage, str]],
         allocator_peak: Optional[int]) -> LedgerRow:
    """Replay the allocations and frees of ``storages`` in order: the peak, each category's peak, the peak's make-up."""
    events: list[tuple[int, int, str]] = []  # (when, bytes, category)
    for record, category in storages:
        size = record.nbytes - sum(change for _, change in record.resized)  # as it was made
        events.append((record.born, size, category))
        events.extend((when, change, category) for when, change in record.resized)
        if record.died is not None:
            events.append((record.died, -record.nbytes, category))
    categories = list(CATEGORIES) + sorted({c for _, c in storages} - set(CATEGORIES))
    now = dict.fromkeys(categories, 0)
    held = dict.fromkeys(categories, 0)
    total = peak = 0
    at_peak = dict(now)
    for _, nbytes, category in sorted(events, key=lambda event: (event[0], event[1] < 0)):
        now[category] += nbytes
        total += nbytes
        held[category] = max(held[category], now[category])
        if total > peak:
            peak, at_peak = total, dict(now)
    return LedgerRow(device, replica, peak, held, at_peak, allocator_peak)


def measure_step(step: Callable[[], Any], parameters: Iterable[torch.Tensor] = (),
                 kept_by_host: Optional[str] = None) -> tuple[Any, list[LedgerRow]]:
    """Run ``step()`` once and return its result and its ledger: one row per device (and per replica).

    ``parameters``: the model's parameters (counted as parameters, their ``.grad`` as gradients; an
    optimizer that steps inside ``step`` names its own). ``kept_by_host``: what code outside minidp's
    stages keeps for the backward is (see :class:`AllocationLedger`). The ledger listens to minidp's stages as
    ``minidp.trace(ledger=True)`` does, so a data-parallel step is counted in every replica's thread, with
    the same categories; inside a trace, read the trace's own ledger (``Trace.ledger()``) instead.
    """
    if hooks.current_listener() is not None:  # one listener at a time: this one would blind the other
        raise RuntimeError("measure_step inside minidp.trace(): steps there are the trace's to count; trace with "
                           "minidp.trace(ledger=True) and read step.ledger()")
    device_memory = DeviceMemory()
    device_memory.start()
    ledger = AllocationLedger(kept_by_host)
    ledger.start()
    hooks.set_listener(ledger)  # so every replica's thread is watched, and every stage named
    try:
        ledger.watch_parameters(parameters)
        result = step()
    finally:
        hooks.set_listener(None)
        ledger.stop()
    allocator = {peak.device: peak.bytes for peak in device_memory.peaks() if peak.device != "cpu"}
    return result, ledger.rows(allocator)
