"""The backward of CPU replicas in parallel: each replica's part of the graph in its own worker thread.

On a GPU every device has an autograd thread of its own, so replicas on different GPUs run their
backwards at once. The CPU has one: autograd runs all the backward work of the CPU in the thread
that called ``backward()``, so CPU replicas, whose forwards ran side by side in parallel_apply's
threads, would run their backwards one after the other. This module cuts the graph so that they do not.

What autograd records, for replicas whose backward can run on its own (see "When" below):

    original params -> Broadcast -> ReplicaEntry_i -> replica i's forward -> o_i
    input chunk i   ------------->  ReplicaEntry_i ---^
    all outer tensors (Broadcast outputs, chunks) -> ParallelBackward -> aliases of o_0 .. o_{K-1} -> gather

* :class:`ReplicaEntry`, one node per replica (per call of :func:`enter`): its outputs are aliases of
  the tensors that enter the replica (its parameters, as replicate binds them; its input chunks, as
  parallel_apply passes them). Replica ``i``'s graph ends there. Its backward is the identity.
* :class:`ParallelBackward`, one node for the whole replicated region: its inputs are the tensors
  the entries alias (so autograd's edges lead from it to the Broadcast and to the scatter), its
  outputs are aliases of the replicas' outputs (so the gather's backward, a scatter, hands it each
  replica's share of the gradient). Its backward runs, for every replica in its worker thread,
  ``torch.autograd.grad(o_i, the entry's outputs, the gradient of o_i)``: on the CPU, autograd runs a
  backward in the thread that calls it, reentrantly, as re-entrant checkpointing does. The gradients
  of the entries come back as the gradients of the region's inputs, replica by replica, and autograd
  goes on: the Broadcast's backward receives every replica's gradients at once and sums them in
  replica order (step 5), exactly as it does when the replicas' backwards run one after the other.

Each replica's part of the graph is the same graph either way, run by the same engine in the same
order, so the gradients are the same, bit for bit, provided each kernel runs with the same number
of intra-op threads (a kernel splits its sums by thread): every worker runs its replica's backward
with the caller's count, as the serial backward runs it (not the share of a forward). The price: K
teams of the caller's threads share the cores. :func:`set_parallel_backward_threads` (``"share"``)
runs each with its forward's share instead (the caller's count divided among them): 4 to 14% faster
steps at 2 CPU replicas on 2 cores, 3 to 8% at 4 in five runs (`python benchmarks/bench_cpu_replicas.py
--rounds 10`, BENCHMARKS.md), the gradients then equal to the serial ones only up to float rounding.

Hooks fire once, where the gradient is made: a hook on a replica's parameter or input (the entry's
outputs) fires in the replica's thread when its gradient is captured (the entry node itself never
runs); a hook on an original parameter fires when autograd accumulates the sum. ``retain_graph``
reaches each replica's backward; a second backward without it through a replica raises autograd's error, and so
does one that reaches outputs of that replica the first did not (a forward's two heads back-propagated by two
``backward()`` calls: the first lets go of the outputs of every replica it ran, as autograd frees a node's saved
tensors; keep the graph with ``retain_graph=True``, sum the losses, or ``set_parallel_backward(False)``, where the
second is taken). A replica whose backward raises is named by its index, once every replica is done, and autograd
stops before the reduction: the original parameters' gradients are untouched. A backward asked for some tensors only
(``backward(inputs=...)``, ``torch.autograd.grad``) runs in each replica only the nodes that lead to them, as autograd
runs them. Hooks and the backward of a replica's own Functions run in its worker, at the same time as the other
replicas' (as on several GPUs): code there that changes state the replicas share (a counter, a scratch tensor the
module keeps) needs a lock, or the serial backward. So does code that depends on a thread's floating-point settings
(``torch.set_flush_denormal``), which the workers do not take from the caller.

When. parallel_apply cuts the graph only if every replica's graph, walked from its outputs, ends at
its own entries: nothing else requiring grad is reached (a tensor the replica captured from outside,
another replica's tensors as :class:`minidp.SyncBatchNorm` exchanges them, a parameter that did not
come through an entry, an input that is a leaf or a view of one: :func:`enter_inputs`), no re-entrant checkpoint is
met, nor a node whose backward runs one of its own (:func:`_recomputes_reentrantly`), no output holds an object the
walk cannot look inside (one that gather rebuilds from its items may hold tensors of the graph), and no two outputs
share memory (:func:`join`). Otherwise it leaves the outputs as they
are and autograd runs the replicas' backwards one after the other, as before (the entries are then identity nodes
on the way). Second-order gradients (``create_graph=True``) run the replicas' backwards one after the other in
the calling thread, inside the node: the gradients it returns are differentiable, as the serial path's, and their
graph reaches the replicas' nodes through a node of its own (:class:`MadeGradients`), so that a later backward never
runs them in the user's graph task beside the cut's. So does a
backward under a ``TorchDispatchMode`` or a ``TorchFunctionMode`` (``torch.utils.flop_counter.FlopCounterMode``
counting it, a mode that rounds every result): a mode belongs to the thread that entered it, and autograd runs
every replica's nodes under it, which the workers would not (:func:`modes_the_workers_lack`).

What the cut changes. Each replica's backward is a graph task of its own, so the backward the user started sees
the replicated region as one node. A backward that reaches a replica's graph by another way than its outputs (a
tensor the forward kept in a list the module holds, such as an auxiliary loss, used in the loss) would run the
replica's nodes twice: it is refused before any replica runs, saying how to go on (:func:`_check_no_other_way_in`).
A gradient with respect to a tensor made inside a replica is out of its reach
(``torch.autograd.grad(loss, activation)`` raises autograd's "not have been used in the graph";
``loss.backward(inputs=[activation])`` leaves its ``.grad`` as it was); a hook on a replica's tensor fires in
every backward that reaches the replica, whatever that backward's ``inputs``; a
``torch.autograd.graph.register_multi_grad_hook`` over tensors of several replicas fires once per replica; a
callback queued from a hook (``Variable._execution_engine.queue_callback``) runs when its replica's backward
ends, before the reduction. And replicas that one graph runs more than once (replicate once, parallel_apply
twice) get each run's gradients summed apart, then added: the serial path's up to rounding. So are the gradients of a tensor that enters the region by several routes
(passed as two arguments, or used outside it too): autograd adds its routes' gradients in the order it meets them,
and the cut hands back every replica's input gradients at once, where the serial backward hands them back as each
replica's graph (whose nodes' sequence numbers were counted in the worker threads) reaches them. Draws from the
random number generator in the replicas' backwards happen at once, in threads, in an order no seed repeats
(parallel_apply warns, as for the forward's). A non-reentrant checkpoint's recomputation sets the generator to its
forward's state and back, which in threads at once can leave it at the forward's state: where the forward drew nothing,
it is put back to its state before the backward, where the serial backward leaves it. Hooks on the
tensors themselves see every gradient, in the replica's thread; for code that needs the rest,
``set_parallel_backward(False)``.

On by default for CPU replicas wherever their intra-op thread teams fit the cores (``"auto"``, see
:func:`applies`); :func:`set_parallel_backward` asks for it always (``True``) or never (``False``: the
replicas' backwards then run one after the other, as autograd runs them).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from operator import attrgetter
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch.autograd import forward_ad
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge
from torch.overrides import _get_current_function_mode_stack
from torch.utils import checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .comm import storage_start
from .cpu_threads import share, teams_fit
from .nested import holds_opaque, tensors_in
from .step5_reduce import apply_function, note_replicas_reach

_enabled: Union[bool, str] = "auto"
_threads = "caller"
_THREAD_COUNTS = ("caller", "share")
_grad_fn, _requires_grad = attrgetter("grad_fn"), attrgetter("requires_grad")
_detach = torch.Tensor.detach


def _recomputes_reentrantly(node: Any) -> bool:
    """Whether ``node`` is re-entrant checkpointing's, or another node that hides the parameters its function used and
    whose backward recomputes and runs a backward of its own, on past the replica's entries into the reduction.

    Re-entrant checkpointing: a worker's backward (a ``torch.autograd.grad``) does not allow it (torch's raises
    "incompatible with .grad()"). torch's own ``CheckpointFunction`` and its subclasses, and the copies of it libraries
    keep under the same name (Megatron-LM's and fairscale's, among others, are each a ``CheckpointFunction``; Megatron's
    refuses to run unless ``torch.autograd._is_checkpoint_valid()``, which a ``grad`` is not). Others, such as the
    reversible layers of RevNet and Reformer, whose ``backward`` recomputes the block and calls
    ``torch.autograd.backward`` on it: that backward accumulates into the original parameters from every worker at
    once, in an order no run repeats (the serial backward's order is fixed). Those are told by their ``backward``'s
    code, which names a ``backward`` (``torch.autograd.backward(y, g)``, ``y.backward(g)``), :func:`_calls_a_backward`;
    one that calls it through a helper whose name says nothing of it is not seen. Only a node written in Python (a
    ``BackwardCFunction``) has a Function class to ask: the one ``isinstance`` skips the built-in nodes."""
    if not isinstance(node, BackwardCFunction):
        return False
    function = type(node)._forward_cls
    return (issubclass(function, checkpoint.CheckpointFunction) or function.__name__ == "CheckpointFunction"
            or _calls_a_backward(function))


# The names under which a Function's backward runs a backward of its own: torch's (``torch.autograd.backward``,
# ``y.backward``), and the reversible layers' (Hugging Face Reformer's ``layer.backward_pass``, RevTorch's). Not any
# name with "backward" in it: AOTAutograd's compiled Function (a ``@torch.compile``d forward) names ``_backward_impl``,
# every ``torch.library.custom_op`` with a registered autograd ``_backward_fn``, and those run none.
_RUNS_A_BACKWARD = frozenset({"backward", "backward_pass"})


def _calls_a_backward(function: type) -> bool:
    """Whether the code of ``function.backward``, under its decorators (``once_differentiable``, ``custom_bwd``: what
    ``__wrapped__`` leads to), names one of :data:`_RUNS_A_BACKWARD`, an attribute or a global: it may run a backward of
    its own. Named by mistake (``super().backward(...)``, an extension's kernel called ``backward``), the replicas'
    backwards stay serial, which is only slower."""
    code = getattr(inspect.unwrap(function.backward), "__code__", None)
    return code is not None and not _RUNS_A_BACKWARD.isdisjoint(code.co_names)


def set_parallel_backward(enabled: Union[bool, str]) -> Union[bool, str]:
    """Run the backwards of CPU replicas in parallel where they fit the cores (``"auto"``, the default), always
    (``True``) or never (``False``: one after the other, as autograd runs them); returns the previous setting.

    Every setting gives the same gradients, bit for bit (with the default thread count,
    :func:`set_parallel_backward_threads`), where the replicas' terms meet in ``replicate``'s reduction, in replica
    order: the settings only decide which threads run the replicas' graphs. What autograd itself adds up over three
    replicas or more (the gradient of a tensor every replica reaches, ``minidp.SyncBatchNorm``'s statistics, re-entrant
    checkpoints adding into ``.grad``) it adds in the order of its nodes' sequence numbers, which the entries this
    module gives each replica move: equal up to rounding between the settings, and each the same from run to run.
    (Nor the second-order ones: a backward through gradients made with ``create_graph=True`` meets this module's
    nodes in their graph, and can sum some gradients in another order than the serial path: they agree up to
    rounding.) A backward that reaches none of the replicas' parameters (the loss uses only outputs that no parameter
    made) leaves them without gradients either way; the hooks on the original parameters are what differs: the
    parallel backward, whose one node leads to ``replicate``'s whatever the loss used, runs them, with ``None`` for
    the gradient, where the serial one never reaches them.
    """
    global _enabled
    # A bool, not 1 or 0 (which equal True and False); "auto" by value: a string read from a config or a pickle
    # is another object than the literal.
    if not (isinstance(enabled, bool) or (isinstance(enabled, str) and enabled == "auto")):
        raise TypeError(f"set_parallel_backward: enabled must be 'auto', True or False, got {enabled!r}")
    previous, _enabled = _enabled, "auto" if isinstance(enabled, str) else enabled
    return previous


def get_parallel_backward() -> Union[bool, str]:
    """``"auto"``, ``True`` or ``False``: see :func:`set_parallel_backward` (and :func:`applies` for what ``"auto"`` does)."""
    return _enabled


def set_parallel_backward_threads(threads: str) -> str:
    """How many intra-op threads each CPU replica's backward runs with, in parallel; returns the previous setting.

    ``"caller"`` (the default): the calling thread's whole count, as autograd's serial backward runs every
    replica's kernels, so the gradients are bit for bit the serial ones. ``"share"``: the count its forward
    ran with (the caller's divided among the CPU replicas), so that K replicas' backwards do not start K
    full teams of threads on the same cores; faster, but a kernel that splits its sums by thread rounds them
    differently: the gradients then equal the serial ones up to float rounding, not bit for bit.
    """
    global _threads
    if threads not in _THREAD_COUNTS:
        raise ValueError(
            f"set_parallel_backward_threads: threads must be 'caller' (bitwise the serial backward) or 'share' "
            f"(each replica's forward share of the threads), got {threads!r}"
        )
    previous, _threads = _threads, threads
    return previous


def get_parallel_backward_threads() -> str:
    """``"caller"`` or ``"share"``: see :func:`set_parallel_backward_threads`."""
    return _threads


@contextlib.contextmanager
def parallel_backward_settings(enabled: Union[bool, str, None] = None, threads: Optional[str] = None) -> Iterator[None]:
    """:func:`set_parallel_backward` (``enabled``) and :func:`set_parallel_backward_threads` (``threads``) for the
    block, each left as it is where ``None``; both set back when the block ends, however it ends."""
    previous_enabled = set_parallel_backward(enabled) if enabled is not None else None
    try:
        previous_threads = set_parallel_backward_threads(threads) if threads is not None else None
        try:
            yield
        finally:
            if previous_threads is not None:
                set_parallel_backward_threads(previous_threads)
    finally:
        if previous_enabled is not None:
            set_parallel_backward(previous_enabled)


def threads_divided_among(replicas: int) -> int:
    """Among how many of ``replicas`` CPU replicas the caller's intra-op threads are divided for their backwards:
    1 with ``"caller"`` (each backward gets the whole count), all of them with ``"share"``."""
    return 1 if _threads == "caller" else replicas


def applies(devices: Sequence[torch.device]) -> bool:
    """Whether replicas on ``devices`` get entries: two or more, all on the CPU, grad recorded, anomaly detection
    (``torch.autograd.set_detect_anomaly``) off, and switched on.

    (GPUs have an autograd thread each already.) Switched on: ``True``, or ``"auto"`` where the replicas'
    backwards, each with the intra-op threads it runs with (:func:`set_parallel_backward_threads`), fit the
    cores (:func:`minidp.cpu_threads.teams_fit`). Why not always: K teams of T threads on fewer than K x T
    cores wait at every kernel's end for a member the scheduler put aside. On 2 cores, with the caller's 2
    threads each, 2 replicas' backwards in parallel made the step 5% and 13% slower than one after the other in
    two runs (4 replicas: 7% and 12%), where with one thread each they made it 11% and 16% faster (4 replicas:
    10% and 11%): `python benchmarks/bench_cpu_replicas.py --rounds 10 [--threads 1]`, BENCHMARKS.md, "Where the
    parallel backward pays".
    """
    if len(devices) < 2 or not torch.is_grad_enabled() or any(d.type != "cpu" for d in devices):
        return False
    if torch.is_anomaly_enabled():
        # Anomaly detection names the node whose backward failed, with the forward's traceback that made it: serially
        # that is the user's own node and line; the cut would add its own node, made in minidp, to every report.
        return False
    if _enabled != "auto":
        return _enabled
    return teams_fit(len(devices), share(torch.get_num_threads(), threads_divided_among(len(devices))))


class ReplicaEntry(torch.autograd.Function):
    """Forward: aliases of ``tensors`` (the same memory). Backward: the identity.

    An alias is a detached tensor, which autograd lets be changed in place; for the tensors at the positions
    ``guarded`` it is a view, which autograd refuses to see changed in place inside the replica: those whose own
    change autograd would refuse (:func:`enter_inputs`).

    Where a replica's graph ends. The node keeps the tensors it aliases (``outer``), which
    :class:`ParallelBackward` takes as its inputs.

    Why a node per replica, when each replica's graph could end at its own outputs of the shared ``Broadcast``
    (``torch.autograd.grad`` takes ``GradientEdge``s, and an entry costs about 3 us a tensor at every step: 482 and
    531 us for ResNet-50's 161 parameters, ``python -m timeit -s "import torch; from minidp.parallel_backward import
    enter; from minidp.zoo import resnet50; from minidp.step5_reduce import Broadcast; ps = list(resnet50(base=8)
    .parameters()); out = Broadcast.apply([torch.device('cpu')] * 2, None, *ps)[:len(ps)]" "enter(out)"``): a
    ``grad`` that captures at a node runs all the tensor hooks of that node's outputs, so a hook
    on one replica's parameter would fire in every replica's backward, with ``None`` in all but its own (torch
    2.11 and 2.13; ``tests/test_parallel_backward.py`` checks it). An entry's outputs are its replica's alone.
    """

    @staticmethod
    def forward(ctx, guarded: frozenset[int], *tensors: torch.Tensor):
        ctx.outer = tensors
        if not guarded:
            return tuple(map(_detach, tensors))
        return tuple(t.view_as(t) if i in guarded else t.detach() for i, t in enumerate(tensors))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *grads)

    @staticmethod
    def jvp(ctx, _guarded: None, *tangents: Optional[torch.Tensor]):
        # Forward-mode AD (torch.autograd.forward_ad) through an input that also requires grad: the identity too.
        return tangents


def is_entry(node: Any) -> bool:
    return type(node) is ReplicaEntry._backward_cls


def enter(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as one replica receives them: those that require grad through one :class:`ReplicaEntry`."""
    return _enter_at(tensors, [i for i, flag in enumerate(map(_requires_grad, tensors)) if flag])


def enter_inputs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A replica's arguments as it receives them: as :func:`enter` gives them, but where autograd refuses an in-place
    change of a tensor, the replica's alias must refuse it too (an alias that takes it would change the caller's
    tensor, and the step would fail later, or not at all):

    * a leaf that requires grad, or a view of one, is passed as it is, so that autograd raises its own words ("a leaf
      Variable that requires grad is being used in an in-place operation"); the replica's graph then reaches that
      leaf, and the replicas' backwards stay serial (:func:`region`);
    * a view made by a function that returns several (``split``: the first chunk of a batch that requires grad), or
      under ``no_grad``, comes through the entry as a view of it, whose change autograd refuses inside the replica."""
    entered = [i for i, t in enumerate(tensors) if t.requires_grad and not _leaf_or_view_of_one(t)]
    guarded = frozenset(position for position, i in enumerate(entered) if _refuses_in_place_as_a_view(tensors[i]))
    return _enter_at(tensors, entered, guarded)


def _leaf_or_view_of_one(tensor: torch.Tensor) -> bool:
    return tensor.is_leaf or (tensor._is_view() and tensor._base.is_leaf)


def _refuses_in_place_as_a_view(tensor: torch.Tensor) -> bool:
    return tensor._is_view() and torch._C._autograd._get_creation_meta(tensor) != _DEFAULT_VIEW


_DEFAULT_VIEW = torch._C._autograd.CreationMeta.DEFAULT  # a view autograd lets change in place (it rebases its base)


def _enter_at(
    tensors: Sequence[torch.Tensor], entered: list[int], guarded: frozenset[int] = frozenset()
) -> list[torch.Tensor]:
    """``tensors``, those at the indices ``entered`` through one :class:`ReplicaEntry` (``guarded``: the positions
    among them whose alias is a view)."""
    if not entered:
        return list(tensors)
    aliases = list(tensors)
    for i, alias in zip(entered, apply_function(ReplicaEntry, guarded, *[tensors[i] for i in entered])):
        aliases[i] = alias
    return aliases


def made_by(tensor: torch.Tensor) -> Optional[Any]:
    """The autograd node that made ``tensor``, looking through an entry (a Broadcast, for a replica's parameter)."""
    node = tensor.grad_fn
    return node.outer[tensor.output_nr].grad_fn if is_entry(node) else node


class Region:
    """One replica's part of the graph: where it starts (its outputs) and where it ends (its entries)."""

    __slots__ = ("entries", "outputs")

    def __init__(self, entries: list[Any], outputs: list[torch.Tensor]) -> None:
        self.entries, self.outputs = entries, outputs


def region(entries: Sequence[Any], output: Any) -> Optional[Region]:
    """Replica's region, if its graph walked from ``output`` ends at ``entries`` (its own entry nodes) only; else ``None``.

    Each node is visited once; the walk stops at the first end that is not one of ``entries``. Another
    entry is walked through: it is an identity node, and either lies inside this replica (the entries
    of a nested ``data_parallel`` whose replicas stayed serial) or leads outside to a leaf, as the
    entries of another replica do, whose outputs a replica may receive (SyncBatchNorm's statistics).
    """
    if holds_opaque(output):
        # An object that gather rebuilds from its items (docs/stock-behaviour.md B28) may hold tensors of this
        # graph that the cut would not reroute: autograd would reach the replica's nodes from them as well.
        return None
    own = {id(node) for node in entries}
    outputs = [t for _, t in tensors_in(output) if t.requires_grad]
    stack = [t.grad_fn for t in outputs]
    # The nodes visited, by id, held: a built-in node's Python object may be made anew at each `next_functions`
    # read and freed after it (torch 2.11 does), and a new one may then take a freed one's id.
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None:
            return None  # an output that is a leaf: not made in the replica
        if id(node) in own or id(node) in seen:
            continue
        seen[id(node)] = node
        if _recomputes_reentrantly(node):
            return None  # its backward runs one of its own, through the parameters into the Broadcast
        nexts = [fn for fn, _ in node.next_functions if fn is not None]
        if not nexts:
            return None  # a leaf (its AccumulateGrad), reached from outside the replica
        stack.extend(nexts)
    return Region(list(entries), outputs)



# The entries each replica's tensors came through, as replicate bound them (minidp.step2_replicate.bind),
# so that a forward finds them at once instead of walking the replica's tree (on a deep model the walk was
# the largest part of a cached forward: `python -m cProfile -s tottime -m minidp bench --only forward`).
# A stale list is safe: an entry missing from it makes the region's walk end outside the replica (the
# replicas' backwards then stay serial), an extra one receives no gradient.
_bound_entries: "weakref.WeakKeyDictionary[torch.nn.Module, list[Any]]" = weakref.WeakKeyDictionary()


def _entries_among(tensors: Any) -> dict[int, Any]:
    # The distinct nodes first, in C (a replica's tensors come through one or two entries), then a check per node:
    # 73 us for ResNet-50's 320 tensors against 94 us for a check per tensor (`python -m timeit -s "from minidp.zoo
    # import resnet50; from minidp.parallel_backward import enter, _entries_among; m = resnet50(base=8);
    # t = enter(list(m.parameters())) + list(m.buffers())" "_entries_among(t)"`).
    return {id(node): node for node in dict.fromkeys(map(_grad_fn, tensors)) if node is not None and is_entry(node)}


def first_differentiable(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The first of ``tensors`` that requires grad, or ``None``."""
    return next(filter(_requires_grad, tensors), None)


def remember_entries(replica: torch.nn.Module, groups: Sequence[Sequence[torch.Tensor]]) -> None:
    """Note the entries that ``groups``, just bound to the replica tree rooted at ``replica``, came through.

    Each group is one :func:`enter`'s result (a replica's parameters, or its buffers), whose tensors that require grad
    all come through one entry: the group's first such tensor names it. Reading one ``grad_fn`` a group, not each
    tensor's, saves 28 to 35 us a replica on ResNet-50's 320 tensors (``python -m timeit -s "import torch; from
    minidp.zoo import resnet50; from minidp.step2_replicate import replica_tensors; from minidp.parallel_backward import
    _entries_among; m = resnet50(base=8); p, b = replica_tensors(list(m.parameters()), list(m.buffers()),
    [torch.device('cpu')] * 2, False, None); t = p[0] + b[0]" "_entries_among(t)"``).
    """
    found = _entries_among([t for t in map(first_differentiable, groups) if t is not None])
    if found:
        _bound_entries[replica] = list(found.values())
    else:
        _bound_entries.pop(replica, None)


def entries_of(module: Any, inputs: Sequence[torch.Tensor]) -> list[Any]:
    """The entry nodes that a replica's tensors (its modules' and ``inputs``) come through, each once, in order found.

    ``module`` may be any callable (parallel_apply takes functions too): only a module's tree is searched,
    unless replicate noted its entries (:func:`remember_entries`).
    """
    found = _entries_among(inputs)
    bound = _bound_entries.get(module) if isinstance(module, torch.nn.Module) else None
    if bound is not None:
        for node in bound:
            found.setdefault(id(node), node)
        return list(found.values())
    for submodule in module.modules() if isinstance(module, torch.nn.Module) else ():
        found.update(_entries_among(v for v in submodule.__dict__.values() if isinstance(v, torch.Tensor)))
        found.update(_entries_among(v for v in submodule._buffers.values() if v is not None))
    return list(found.values())


Runner = Callable[[Sequence[Optional[Callable[[], Any]]], bool], list[Any]]
"""Runs one call per replica, replica i's in its worker thread (or, told ``True``, all in this thread, one after
the other); the results in order, ``None`` for a replica whose call is ``None``; an error names the replica."""


class _Spec:
    """What :class:`ParallelBackward`'s forward needs besides its tensor inputs (a plain object: not seen by autograd)."""

    def __init__(self, regions: Sequence[Region], run: Runner) -> None:
        self.regions, self.run = regions, run


class ParallelBackward(torch.autograd.Function):
    """Forward: aliases of every replica's outputs. Backward: each replica's graph, in its worker thread."""

    @staticmethod
    def forward(ctx, spec: _Spec, *outer: torch.Tensor):
        ctx.set_materialize_grads(False)  # an output without a gradient needs no backward of its own
        ctx.run = spec.run
        # Per replica, the entries' outputs as edges: where its backward ends, and what its gradients are for.
        ctx.edges = [[GradientEdge(n, k) for n in r.entries for k in range(len(n.outer))] for r in spec.regions]
        # Per replica, held, not saved (save_for_backward): each alias returned shares its output's version counter, so
        # an in-place change of an alias, which autograd takes where no node saved that output (a linear layer's), would
        # fail a saved tensor's version check. A replica's are let go of by a backward through them without
        # retain_graph, as autograd frees the saved tensors of the nodes it ran.
        ctx.outputs = [list(r.outputs) for r in spec.regions]
        ctx.outputs_per_replica = [len(r.outputs) for r in spec.regions]
        ctx.outer_nodes = [t.grad_fn for t in outer]  # where each input's gradient goes: replicate's node, for parameters
        return tuple(t.detach() for r in spec.regions for t in r.outputs)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        keep_graph = torch._C._autograd._get_current_graph_task_keep_graph()
        create_graph = torch.is_grad_enabled()  # autograd runs a backward in grad mode only for create_graph=True
        # After a create_graph=True backward, the gradients it made lead back into the replicas' graphs (their
        # double backward reads what those graphs saved), so a later backward may reach a replica's nodes by two
        # ways: through this node, whose separate backward below would free them, and through those gradients.
        # Autograd frees a node's buffers once its single graph task is done with it; here they are kept, and
        # freed with the graph.
        made_before = getattr(ctx, "graph_of_gradients_made", False)
        ctx.graph_of_gradients_made = made_before or create_graph
        keep_graph = keep_graph or ctx.graph_of_gradients_made
        needed = _needed_inputs(ctx)
        calls, asked_per_replica, root_grads_per_replica, start, first_edge = [], [], [], 0, 0
        roots: list[torch.Tensor] = []  # the outputs given gradients, every replica's
        for replica, (outputs, edges) in enumerate(zip(ctx.outputs, ctx.edges)):
            count = ctx.outputs_per_replica[replica]
            pairs = [(k, g) for k, g in enumerate(grads[start : start + count]) if g is not None]
            start += count
            # Only the entries' outputs whose gradients this backward needs (backward(inputs=...), autograd.grad of
            # some tensors): autograd runs no node that leads to none of them, so neither does the replica's backward.
            asked = [e for e, need in zip(edges, needed[first_edge : first_edge + len(edges)]) if need]
            first_edge += len(edges)
            asked_per_replica.append(asked)
            root_grads_per_replica.append([g for _, g in pairs])
            # A replica none of whose outputs got a gradient has no backward to run, as autograd would run none of
            # its nodes: no call, so that no listener sees a backward of it.
            if not pairs or not asked:
                calls.append(None)
                continue
            if outputs is None:  # let go of by an earlier backward: autograd's error, in its words (code matches them)
                raise RuntimeError(
                    "Trying to backward through the graph a second time: the replicas' outputs were let go of by the "
                    "first backward. Specify retain_graph=True if you need to backward through the graph a second time."
                )
            if not ctx.graph_of_gradients_made:  # else its gradients are such a way in, and keep the graph (above)
                _check_no_other_way_in(edges, replica)
            roots += [outputs[k] for k, _ in pairs]

            def call(roots=[outputs[k] for k, _ in pairs], root_grads=root_grads_per_replica[-1], asked=asked) -> tuple:
                return torch.autograd.grad(
                    roots, asked, root_grads, retain_graph=keep_graph, create_graph=create_graph, allow_unused=True
                )

            calls.append(call)
        if ctx.run is None:  # every replica's outputs let go of by earlier backwards, and only None gradients now
            raise RuntimeError(
                "Trying to backward through the graph a second time: the replicas' outputs were let go of by the "
                "first backward. Specify retain_graph=True if you need to backward through the graph a second time."
            )
        # create_graph: one after the other here, in grad mode, so that what they record joins this backward's graph;
        # and under a mode of this thread's, which the workers do not have.
        results = ctx.run(calls, create_graph or modes_the_workers_lack())
        # The first create_graph backward's gradients only: a later one's root gradients can carry a graph back into
        # the replica's entries (through the double backward of the first's), which MadeGradients, asked for both,
        # would count twice (third-order gradients came out wrong); past the first, the node's gradients stay as
        # autograd made them.
        if create_graph and not made_before:
            results = [
                None if result is None else _behind_a_node_of_their_own(result, edges, root_grads)
                for result, edges, root_grads in zip(results, ctx.edges, root_grads_per_replica)
            ]
        if not keep_graph:  # the replicas that ran cannot run again: let go of their outputs, and, once no replica
            for replica, call in enumerate(calls):  # may run again, of the replica modules the runner holds, as a
                if call is not None:  # finished graph holds no module (a cache of replicas re-binds them; while a
                    ctx.outputs[replica] = None  # replica's outputs wait for a backward, it builds new ones)
            if all(outputs is None for outputs in ctx.outputs):
                ctx.run = None
        gradients = list(_per_input(ctx.edges, asked_per_replica, results))
        _tell_the_nodes_what_the_replicas_reached(ctx.outer_nodes, ctx.edges, gradients, roots)
        return (None, *gradients)


class MadeGradients(torch.autograd.Function):
    """Forward: aliases of the gradients a ``create_graph=True`` backward made in one replica. Backward: the backward
    of those gradients' graph, as a backward of its own that keeps the graph.

    Their graph (the double backward) reads what the replica's forward saved, so it leads into the replica's nodes. A
    later backward of a loss that uses them (a gradient penalty) and the replica's outputs would reach those nodes by
    two ways: through that graph, in the user's own backward, which frees each node it runs (no ``retain_graph``), and
    through :class:`ParallelBackward`, in a backward of its own. Whichever came second would find the node freed, by
    an order the threads' sequence numbers decide (a worker that counted more nodes than the caller, a wrapper called
    from another thread, two wrappers in a row). Behind this node, only minidp's own backwards run the replica's
    nodes, and both keep the graph (:class:`ParallelBackward` does, once a ``create_graph`` backward went through it).
    Its inputs are where that graph leaves the replica: the tensors its entries alias, and the gradients of its
    outputs the double backward read (which carry a graph of their own).
    """

    @staticmethod
    def forward(ctx, spec: tuple, *stops: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.made, ctx.ends = spec  # held, not saved: the made gradients are this node's way into their graph
        return tuple(t.detach() for t in ctx.made)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        pairs = [(made, grad) for made, grad in zip(ctx.made, grads) if grad is not None]
        if not pairs:
            return (None,) * (1 + len(ctx.ends))
        found = torch.autograd.grad(
            [made for made, _ in pairs], ctx.ends, [grad for _, grad in pairs],
            retain_graph=True, create_graph=torch.is_grad_enabled(), allow_unused=True,
        )
        return (None, *found)


def _behind_a_node_of_their_own(result: tuple, edges: Sequence[GradientEdge], root_grads: Sequence[torch.Tensor]) -> tuple:
    """One replica's gradients from a ``create_graph=True`` backward, those with a graph behind a
    :class:`MadeGradients` node. Its inputs: the tensors that every one of the replica's entries aliases (``edges``;
    not only those the backward asked for: the double backward reads the replica's parameters where a gradient with
    respect to its inputs was made, and so leads to their entries too), then the ``root_grads`` with a graph (the
    edges of the one, the tensors themselves of the other, ask autograd for the same)."""
    made = [t for t in result if t is not None and t.requires_grad]
    if not made:
        return result
    differentiable_roots = [g for g in root_grads if g.requires_grad]
    stops = [edge.node.outer[edge.output_nr] for edge in edges] + differentiable_roots
    aliases = iter(apply_function(MadeGradients, (made, [*edges, *differentiable_roots]), *stops))
    return tuple(next(aliases) if t is not None and t.requires_grad else t for t in result)


def _needed_inputs(ctx: Any) -> list[bool]:
    """Whether the running backward needs the gradient of each of the node ``ctx``'s inputs: autograd's word for the
    node each input leads to (``torch._C._will_engine_execute_node``), asked once per node (the Broadcast that made
    every replica's parameters, the scatter's nodes). All are needed by a plain ``backward()``."""
    verdicts: dict[int, bool] = {}
    needed = []
    for node, _ in ctx.next_functions:
        if node is None:
            needed.append(False)
            continue
        verdict = verdicts.get(id(node))
        if verdict is None:
            try:
                verdict = torch._C._will_engine_execute_node(node)
            except RuntimeError:  # a leaf's node that autograd.grad captures, which it will not say about: needed
                verdict = True
            verdicts[id(node)] = verdict
        needed.append(verdict)
    return needed


def _check_no_other_way_in(edges: Sequence[GradientEdge], replica: int) -> None:
    """Refuse a backward that reaches replica ``replica``'s graph by a way other than its outputs: a tensor its forward
    made and kept where the caller could read it (appended to a list the module holds, as auxiliary losses are), then
    used in the loss. Autograd would run the replica's nodes on that way too, in this backward, beside the replica's
    own backward: each would free what the other needs, or, with retain_graph, fire their hooks twice and add the two
    parts of their gradients in another order. Told by its entries, which the running backward would then run itself
    (their only way in is the replica's graph). Before any replica runs: nothing is accumulated.

    A term of the replica's parameters alone kept so (a weight decay the forward appends to a list) runs no node of the
    replica's but its entry, and is refused too: a hook on a replica's parameter (one the forward registers, to clip
    its gradient) would fire twice, each time with a part of the gradient, which no check here can see."""
    for node in {id(edge.node): edge.node for edge in edges}.values():
        if torch._C._will_engine_execute_node(node):
            raise RuntimeError(
                f"minidp's parallel backward: this backward reaches the graph of replica {replica} by a way other than "
                f"its outputs: a tensor its forward made was kept (in a list or an attribute of the module, as an "
                f"auxiliary loss) and used outside it. Return that tensor from forward (the gathered output then "
                f"carries it), or run the replicas' backwards one after the other: "
                f"minidp.set_parallel_backward(False)"
            )


def _tell_the_nodes_what_the_replicas_reached(outer_nodes: Sequence[Any], edges: Sequence[Sequence[GradientEdge]],
                                              gradients: Sequence[Optional[torch.Tensor]],
                                              roots: Sequence[torch.Tensor]) -> None:
    """A node behind :class:`ParallelBackward` that no replica's graph reached runs all the same (autograd runs every
    node an edge leads to), handed None for each of its outputs: ``replicate``'s is told whether they reached it
    (:func:`minidp.step5_reduce.note_replicas_reach`), and, told by none that they did, sums nothing, as the serial
    backward, which never reaches it then, leaves the parameters. None is also what a replica's graph gives an entry it
    reaches with no gradient (a custom Function's backward that returns None for a parameter): the serial backward
    reaches ``replicate``'s node then, and autograd gives it zeros, so it is told it was reached. The two are told apart
    by a walk of the replicas' graphs from the ``roots`` (the outputs given gradients), which only a backward that
    leaves a node without any gradient pays for.
    """
    reached = {node for node, gradient in zip(outer_nodes, gradients) if gradient is not None}
    if any(node is not None and node not in reached for node in outer_nodes):
        entries_reached = _entries_reached([root.grad_fn for root in roots])
        entries = [edge.node for replica_edges in edges for edge in replica_edges]  # in the order of the node's inputs
        reached |= {node for node, entry in zip(outer_nodes, entries) if id(entry) in entries_reached}
    for node in {node for node in outer_nodes if node is not None}:
        note_replicas_reach(node, node in reached)


def _entries_reached(starts: Sequence[Any]) -> set[int]:
    """The ids of the entries (:class:`ReplicaEntry`'s nodes) that edges lead to from ``starts``: where a walk of the
    replicas' graphs stops."""
    seen = {id(node): node for node in starts if node is not None}  # the nodes held, so that no id is reused meanwhile
    pending = list(seen.values())
    reached = set()
    while pending:
        node = pending.pop()
        if is_entry(node):
            reached.add(id(node))
            continue
        for following, _ in node.next_functions:
            if following is not None and id(following) not in seen:
                seen[id(following)] = following
                pending.append(following)
    return reached


def _per_input(edges: Sequence[Sequence[GradientEdge]], asked: Sequence[Sequence[GradientEdge]],
               results: Sequence[Optional[tuple]]) -> Iterator[Optional[torch.Tensor]]:
    """The gradient of each of the node's inputs, in order: each replica's ``edges``, the result for those ``asked``
    (a subsequence of them), ``None`` for the others."""
    for replica_edges, replica_asked, result in zip(edges, asked, results):
        if result is None:
            yield from (None,) * len(replica_edges)
            continue
        by_edge = iter(zip(replica_asked, result))
        pending = next(by_edge, None)
        for edge in replica_edges:
            if pending is not None and pending[0] is edge:
                yield pending[1]
                pending = next(by_edge, None)
            else:
                yield None


def modes_the_workers_lack() -> bool:
    """Whether this thread runs under a ``TorchDispatchMode`` or ``TorchFunctionMode`` that the replicas' worker
    threads would not run under: a mode is the state of the thread that entered it (autograd carries it to the
    threads that run a backward it started, so the serial backward runs every replica's nodes under it). A mode
    that enters itself in every replica's thread too says so by a true ``entered_in_replica_threads`` attribute
    (the memory ledger's, :mod:`minidp.tracing.memory`).
    """
    if not (torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack()):
        return False  # the common case: two C calls
    modes = [*_get_current_dispatch_mode_stack(), *_get_current_function_mode_stack()]
    return not all(getattr(mode, "entered_in_replica_threads", False) for mode in modes)


def join(regions: Sequence[Region], run: Runner) -> Optional[list[torch.Tensor]]:
    """One :class:`ParallelBackward` node for the replicas' regions; the aliases of their outputs, in order.

    ``None``, the replicas' backwards then left as autograd runs them, where

    * two replicas share a tensor they enter with: autograd would sum its gradients in an order of its own;
    * two outputs share memory (a tensor returned twice, or with a view of it): the node would return each as an
      alias of its own, so an in-place change of one would not reach the other's gradient, as autograd makes it
      reach a view's; and a tensor's gradients from its several places would be summed in another order;
    * an output carries a forward-mode tangent (``torch.autograd.forward_ad``): the node's aliases would carry none.
    """
    outer = [t for r in regions for node in r.entries for t in node.outer]
    if len({id(t) for t in outer}) != len(outer):
        return None
    outputs = [t for r in regions for t in r.outputs]
    if any(forward_ad.unpack_dual(t).tangent is not None for t in outputs):
        return None
    if len({storage_start(t) if t.layout == torch.strided else id(t) for t in outputs}) != len(outputs):
        return None
    return list(apply_function(ParallelBackward, _Spec(regions, run), *outer))
