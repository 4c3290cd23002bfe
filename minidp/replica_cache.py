"""Cached replicas: keep the replica modules between steps and give them only the new tensors.

Stock ``DataParallel`` rebuilds every replica at every forward: a shallow copy of each sub-module
(``_replicate_for_data_parallel``) and one ``Module.__setattr__`` per child and per parameter, all
in Python; for a deep model that is most of a step's overhead. The module tree rarely changes
between steps, so a :class:`ReplicaCache` builds the replica modules once (the *skeletons*) and at
each later call only

1. checks that the tree is unchanged (its *signature*, below), else rebuilds;
2. resets every replica's ``__dict__`` to what a freshly built replica holds, so whatever a
   replica's ``forward`` wrote on itself in the last step is gone, as it would be with new replicas;
3. binds this call's tensors (:func:`minidp.step2_replicate.bind`): the parameters through a new
   ``Broadcast`` node (built every call: its backward is this step's gradient reduction) and
   fresh buffer copies (never refilled in place: an earlier step's graph may have saved them).

Steps 2 and 3 are the same code the uncached :func:`minidp.replicate` runs (its public pieces
``build_skeletons``, ``replica_tensors`` and ``bind``), so both give the same replicas. The cache
stands above the primitives: ``replicate`` knows nothing of it, and ``DataParallel.replicate``
chooses between the two.

What the signature checks, and why. A skeleton is a shallow copy of the original's ``__dict__``
taken when it was built, plus replica-owned ``_parameters``/``_buffers``/``_modules`` dicts.
It goes stale when, for any module of the tree:

* its class is replaced (``module.__class__ = Other``: a new ``forward``), checked by identity;
* a value in its ``__dict__`` is replaced or a key added or removed: a plain attribute set later,
  ``train()``/``eval()`` (the ``training`` flag lives there), ``_is_full_backward_hook``, the
  ``_flat_weights`` list an RNN rebuilds in ``.to()``. Checked as the keys and the identity
  (``is``) of every value, so an equal but new value counts as replaced; the cache holds references
  to those values, so a new object cannot pass for one at a freed address;
* an entry of ``_parameters``, ``_buffers`` or ``_modules`` is added, removed, replaced or set to
  ``None`` (``register_parameter``, a new sub-module, ``.to()`` replacing buffers): keys and identities.
  Walking the stored modules' ``_modules`` is enough to see a sub-module added anywhere in the tree;
* a parameter or buffer changes device or dtype in place (``.to()`` sets ``param.data``, keeping
  the object): checked as ``(device, dtype)`` per tensor, which also stands in for the per-step
  device check of the uncached path.

A tree the skeletons cannot stand for is replicated anew at every call instead (:func:`_replicated_anew`): one holding
a TorchScript module, an FX GraphModule, or a module whose class replicates itself its own way.

Not checked, because the skeleton does not depend on it: tensor values and shapes (the tensors are
bound anew each call), ``requires_grad`` (read each call), and the contents of objects the replica
shares with the original by reference: hook dicts (a hook added later is seen at once, as by a
fresh replica) and any mutable attribute changed in place.

The life of one entry (:class:`EntryState`): ``CLEAN`` (built or reset, holding no tensor) ->
``BOUND`` by a call; if that binding is recorded by autograd it is ``BACKWARD_PENDING`` until the
backward of its ``Broadcast`` node has run (a hook on the node says so; the node of an earlier binding,
in a graph kept with ``retain_graph`` and run again, does not), then ``RELEASED``, and emptied at once (``CLEAN``)
unless something outside the cache holds a replica (below), so that no step's tensors stay until the next call;
a ``BOUND`` one as soon as its forward returns (:meth:`ReplicaCache.finished`: no backward to wait for), on the
same condition; :meth:`ReplicaCache.release` releases one by hand (a forward with grad never backpropagated).
Only a ``CLEAN``, ``BOUND`` (no graph) or ``RELEASED`` entry is re-bound; while its backward is pending a call builds
new skeletons, because autograd may still run the old ones: activation checkpointing re-runs a replica's forward
during the backward. A backward that ran does not always end that: a branch of the graph not back-propagated yet,
or a graph kept with ``retain_graph``, may still recompute a replica, or hand it to a backward hook.
Whatever can do so holds the replica module, so the skeletons are also re-bound only while no replica
module has a reference the cache did not count when it bound them (:attr:`_Entry.referenced`), and
while each still has its class (a forward may replace it). The replicas returned by one call are the
objects the next call (same thread, same devices) re-binds, down to their empty registries (checked
still empty, not replaced). Each thread gets its own skeletons, so concurrent forwards never share replicas.
"""

from __future__ import annotations

import enum
import sys
import threading
import weakref
from collections import OrderedDict
from itertools import chain, repeat
from operator import attrgetter, eq, is_, is_not, itemgetter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .comm import check_reduce_backend
from .device_ids import DeviceLike, as_devices
from .hooks import observed
from .parallel_backward import first_differentiable, made_by
from .step2_replicate import (
    Slots, bind, build_skeletons, check_flag, check_is_module, check_module_device, replica_tensors, replicate,
    tensor_slots, through_entries,
)

_REGISTRIES = ("_parameters", "_buffers", "_modules")
_dict_of = attrgetter("__dict__")
_registries_of = itemgetter(*_REGISTRIES)
# Modules whose replicas the cache cannot keep: a tree holding one is replicated anew at every call (see replicate)
_REPLICATED_ANEW = (torch.jit.ScriptModule, torch.fx.GraphModule)
# The ways of replicating a module whose result a skeleton reset to its template reproduces: nn.Module's shallow copy,
# RNNBase's (which also copies the `_flat_weights` lists, containers a reset copies), and LazyModuleMixin's (it raises).
_REPRODUCED_REPLICATION = frozenset(
    {nn.Module._replicate_for_data_parallel, nn.RNNBase._replicate_for_data_parallel,
     nn.modules.lazy.LazyModuleMixin._replicate_for_data_parallel}
)


def _replicated_anew(module: nn.Module) -> bool:
    """Whether a tree holding ``module`` must be replicated anew at every call, as stock replicates it.

    A TorchScript module's registries are views of its C++ module, not the dicts a skeleton copies and the signature
    reads; an FX GraphModule's replica is code generated from its graph as it is at the call (GraphModule.__copy__),
    so an edit of the graph reaches stock's next replicas, recompiled or not, and the signature cannot see it (the graph
    is the same object). And a class with a ``_replicate_for_data_parallel`` of its own may give each replica a copy
    of what the original holds at that moment (SpikingJelly's neurons copy their membrane potentials,
    ``replica._memories = self._memories.copy()``), which a template taken once, when the skeletons were built, would
    bring back at every later step instead: a forward run on the original in between, or a reset of its state, would
    never reach the replicas.
    """
    replication = getattr(type(module), "_replicate_for_data_parallel", None)
    return (isinstance(module, _REPLICATED_ANEW) or replication not in _REPRODUCED_REPLICATION
            or "_replicate_for_data_parallel" in module.__dict__)


class _Signature:
    """The ``__dict__`` of every module and its three registries, as they were: their sizes, keys and values.

    :meth:`matches` holds when every module still has its class and that ``__dict__`` object and every one of these
    dicts still has those sizes, those keys in that order and those very values (``is``, never
    ``==``: an equal but new list, tensor or module is a change). Since a registry is itself a value
    of its module's ``__dict__``, the registries seen are then the stored ones. The stored values
    keep every object alive, so identity cannot be fooled by a new object at a freed address.

    All comparisons are C iterators over flat sequences. Once the sizes match, only the dicts that held something
    are read for their keys and values (336 of ResNet-50's 604): an empty one still empty has nothing to compare.
    Keys compare as lists (a list built from an iterator is cheaper than a tuple), values as ``not any(is_not)``:
    0.12 ms for ResNet-50's 151 modules (about 4,000 entries) on a 2-core machine, against 0.16 ms for tuples over
    every dict and 0.4 to 0.6 ms for a tuple of ``id``s (``python -m timeit -s "import torch; from minidp import
    ReplicaCache; from minidp.zoo import resnet50; m = resnet50(base=8); c = ReplicaCache(); d = [torch.device('cpu')]
    * 2; c.replicate(m, d); e = next(iter(c._entries.values())); ms = e.modules(m)" "e.signature.matches(ms)"``).
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.types = tuple(map(type, modules))
        self.states = list(map(_dict_of, modules))
        self.dicts = self.states + list(chain.from_iterable(map(_registries_of, self.states)))
        self.sizes = list(map(len, self.dicts))
        self.filled = [d for d in self.dicts if d]
        self.keys = list(chain.from_iterable(self.filled))
        self.values = tuple(chain.from_iterable(map(dict.values, self.filled)))

    def matches(self, modules: list[nn.Module]) -> bool:
        return (
            all(map(is_, map(type, modules), self.types))
            and all(map(is_, map(_dict_of, modules), self.states))
            and list(map(len, self.dicts)) == self.sizes
            and list(chain.from_iterable(self.filled)) == self.keys
            and not any(map(is_not, chain.from_iterable(map(dict.values, self.filled)), self.values))
        )


def _module_parts(module: nn.Module) -> dict[str, dict[str, int]]:
    """One module's part of the signature, by kind, to name what changed."""
    state = module.__dict__
    parts = {"class": {"__class__": id(type(module))}, "attributes": {key: id(value) for key, value in state.items()}}
    for kind, registry in zip(("parameters", "buffers", "sub-modules"), _REGISTRIES):
        parts[kind] = {key: id(value) for key, value in state[registry].items()}
    return parts


_device_of = attrgetter("device")
_dtype_of = attrgetter("dtype")
_is_cpu = attrgetter("is_cpu")


def _same_placement(tensors: list[torch.Tensor], device: torch.device, dtypes: tuple) -> bool:
    """Every tensor on ``device`` and of its dtype in ``dtypes`` (dtypes are singletons: ``is``)."""
    if not all(map(is_, map(_dtype_of, tensors), dtypes)):
        return False
    if device.type == "cpu":  # a flag read, where `.device` makes an object per tensor: 22 against 34 us (BENCHMARKS.md)
        return all(map(_is_cpu, tensors))
    return all(map(eq, map(_device_of, tensors), repeat(device)))


class EntryState(enum.Enum):
    """Where one set of skeletons is in its life (see the module docstring)."""

    CLEAN = "clean"  # built or reset: holds no tensor
    BOUND = "bound"  # holds a call's tensors, and no autograd graph was recorded through them
    BACKWARD_PENDING = "backward pending"  # holds a call's tensors that autograd may still run
    RELEASED = "released"  # the binding's backward has run (or release() said none will)


@dataclass(frozen=True)
class ReplicaCacheInfo:
    """What a :class:`ReplicaCache` has done: calls served from skeletons, builds, and why the last build."""

    hits: int
    misses: int  # builds: the first call for a module, thread and device list, and every rebuild
    last_rebuild_reason: Optional[str]
    entries: int  # skeleton sets held (one per module, thread and device list)


class _Entry:
    """The skeletons of one module tree for one device list, with what they were built from."""

    def __init__(self, network: nn.Module, devices: list[torch.device]) -> None:
        modules = list(network.modules())
        self.names = [name for name, _ in network.named_modules()]
        # The root is passed in at each call, never held: a cache keyed on its id must not keep it alive.
        self.root = weakref.ref(network)
        self.submodules = modules[1:]
        self.params, self.buffers = list(network.parameters()), list(network.buffers())
        self.param_slots: Slots = tensor_slots(modules, "_parameters", self.params)
        self.buffer_slots: Slots = tensor_slots(modules, "_buffers", self.buffers)
        self.signature = _Signature(modules)
        self.parts = [_module_parts(m) for m in modules]
        self.tensors = self.params + self.buffers
        self.device = devices[0]  # where check_module_device found them all
        self.dtypes = tuple(map(_dtype_of, self.tensors))
        self.replicas = build_skeletons(modules, len(devices))
        self.flat_replicas = list(chain.from_iterable(self.replicas))
        self.replica_types = tuple(map(type, self.flat_replicas))
        self.references: tuple[int, ...] = ()  # counted by bind
        self.weak_references: tuple[int, ...] = ()  # counted by bind too
        self.state = EntryState.BOUND  # built skeletons are not reset yet: the first bind resets them
        self._pending_nodes = 0  # Broadcast nodes of the current binding whose backward has not run
        self._binding = 0  # how many times the skeletons were bound: which binding a node's hook speaks for
        # A fresh replica's __dict__, and the containers it owns (not shared with the original: its
        # registries, an RNN's `_flat_weights`): copied at each reset, since binding and forward fill them.
        self.templates = [[dict(r.__dict__) for r in replica_modules] for replica_modules in self.replicas]
        for device_templates in self.templates:
            for template in device_templates:
                template["_buffers"] = dict.fromkeys(template["_buffers"])  # no tensor kept between steps
        owned = [
            [
                key
                for key, value in replica.__dict__.items()
                if isinstance(value, (dict, list)) and module.__dict__.get(key) is not value
            ]
            for module, replica in zip(modules, self.replicas[0])
        ]
        # Most owned containers are empty (every `_parameters`, the `_buffers` and `_modules` of most
        # modules). An empty container is as good as a new one, so those are handed to the replicas
        # as they are and only checked to be still empty at each reset (one C call for all of them);
        # the others are copied.
        self.copied = [[key for key in keys if self.templates[0][i][key]] for i, keys in enumerate(owned)]
        self.shared = [
            (template, key)
            for device_templates in self.templates
            for template, keys in zip(device_templates, owned)
            for key in keys
            if not template[key]
        ]
        self.shared_containers = [template[key] for template, key in self.shared]

    def modules(self, network: nn.Module) -> list[nn.Module]:
        return [network, *self.submodules]

    def change(self, network: nn.Module) -> Optional[str]:
        """Why these skeletons no longer fit ``network``, or ``None`` if they do."""
        modules = self.modules(network)
        if not self.signature.matches(modules):
            return self._describe(modules)
        if not _same_placement(self.tensors, self.device, self.dtypes):
            return "a parameter or buffer changed device or dtype (.to())"
        return None

    def _describe(self, modules: list[nn.Module]) -> str:
        for name, module, old in zip(self.names, modules, self.parts):
            new = _module_parts(module)
            for kind in new:
                if new[kind] != old[kind]:
                    before, after = old[kind], new[kind]
                    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
                    where = f"module '{name}'" if name else "the root module"
                    return f"{kind} {changed} of {where} changed"
        return "the module tree changed"

    @property
    def pending(self) -> bool:
        """Whether autograd has yet to run the backward of the skeletons' current binding."""
        return self.state is EntryState.BACKWARD_PENDING

    @property
    def referenced(self) -> bool:
        """Whether anything outside the cache holds a replica module: what may still run it after its backward.

        A graph that reads a replica's attributes when it runs holds the module: activation checkpointing (its
        recomputation calls the replica's code), a full backward hook (torch keeps the module to hand it over). Such a
        graph may run after the backward of its step: kept with ``retain_graph`` and run again, or a branch of it
        not back-propagated yet. Re-bound, the replicas would give it another step's tensors. So the skeletons are
        re-bound only while every replica module has the references the cache itself holds, counted when it last
        bound them (the cache's lists, each parent's ``_modules`` and its template's copy of it). Anything else
        holding one (a graph, a traceback, a user's variable) makes the next call build new replicas, as stock does.
        So does a weak reference made since (a hook's ``WeakSet`` of the modules it met, to do something once per
        module, as stock's replicas, new at every call, each meet it once).
        """
        return tuple(map(sys.getrefcount, self.flat_replicas)) != self.references or self._weakly_referenced_since

    @property
    def _weakly_referenced_since(self) -> bool:
        """Whether a weak reference to a replica module was made since :meth:`bind` counted them."""
        return tuple(map(weakref.getweakrefcount, self.flat_replicas)) != self.weak_references

    def held_only_by_the_cache_and(self, roots: list[nn.Module]) -> bool:
        """Whether nothing but the cache and ``roots``, the list of replica roots :meth:`bind` returned, holds a replica
        module: :attr:`referenced` while its caller still holds that list (one more reference to each root)."""
        if len(roots) != len(self.replicas) or not all(map(is_, roots, map(itemgetter(0), self.replicas))):
            return False
        expected = list(self.references)
        for i in range(0, len(expected), len(self.replicas[0])):  # each device's root starts its modules
            expected[i] += 1
        return list(map(sys.getrefcount, self.flat_replicas)) == expected and not self._weakly_referenced_since

    @property
    def reclassed(self) -> bool:
        """Whether a replica's forward replaced its class (``self.__class__ = Other``), which a reset does not undo."""
        return not all(map(is_, map(type, self.flat_replicas), self.replica_types))

    def bind(
        self, devices: list[torch.device], detach: bool, reduce_backend: Optional[str]
    ) -> list[nn.Module]:
        """Reset the skeletons and give them this call's tensors; the replica roots, one per device."""
        self.reset()
        param_copies, buffer_copies = replica_tensors(self.params, self.buffers, devices, detach, reduce_backend)
        bind(self.replicas, self.param_slots, self.buffer_slots, param_copies, buffer_copies,
             entered=through_entries(devices, detach))
        # Detached, replica 0 holds the originals and detached aliases, which no node of this binding made (a buffer
        # that requires grad is the original itself, its grad_fn None or its own): nothing to watch, and BOUND.
        self._watch_backward(*(() if detach else (param_copies[0], buffer_copies[0])))
        self.references = tuple(map(sys.getrefcount, self.flat_replicas))  # the cache's own, as `referenced` reads them
        self.weak_references = tuple(map(weakref.getweakrefcount, self.flat_replicas))
        return [replica_modules[0] for replica_modules in self.replicas]

    def release(self) -> None:
        """The current binding is finished (its backward ran, or the caller says none will): empty it."""
        self._pending_nodes = 0
        self.state = EntryState.RELEASED
        self.reset()

    def _watch_backward(self, *groups: list[torch.Tensor]) -> None:
        """BACKWARD_PENDING until every autograd node that made ``groups`` (one ``Broadcast`` a group) has run backward.

        A group is replica 0's parameters or its buffers, as :func:`replica_tensors` gave them: the tensors of a group
        that autograd records came out of one ``Broadcast`` (through a CPU replica's entry: minidp.parallel_backward),
        so its first such tensor names the node; the others (frozen parameters, plain buffers) were made by none.
        """
        nodes = {made_by(t) for t in map(first_differentiable, groups) if t is not None}
        self._pending_nodes = len(nodes)
        self.state = EntryState.BACKWARD_PENDING if nodes else EntryState.BOUND
        self._binding += 1
        binding = self._binding
        entry = weakref.ref(self)  # the node must not keep the skeletons alive: they hold its outputs

        def backward_done(grad_inputs: Any, grad_outputs: Any) -> None:
            live = entry()
            # Only this binding's nodes count: an earlier step's graph, kept with retain_graph and run again now,
            # says nothing of the replicas' current binding (a checkpoint may still recompute them).
            if live is not None and live._binding == binding and live.state is EntryState.BACKWARD_PENDING:
                live._pending_nodes -= 1
                if live._pending_nodes == 0:
                    live.state = EntryState.RELEASED
                    # Empty the replicas now, as stock's are freed after their step: else the step's copies (of the
                    # parameters on the other GPUs, of the buffers) would stay until the next call. Not where anything
                    # else still holds a replica: a graph that may recompute it needs its tensors.
                    if not live.referenced:
                        live.reset()

        for node in nodes:
            node.register_hook(backward_done)

    def reset(self) -> None:
        """Every replica's ``__dict__`` as freshly built: no tensors, nothing a forward wrote (-> CLEAN)."""
        if self.state is EntryState.CLEAN:
            return
        if any(map(len, self.shared_containers)):  # a forward filled one: it is no longer a fresh one
            for template, key in self.shared:
                if template[key]:
                    template[key] = type(template[key])()
            self.shared_containers = [template[key] for template, key in self.shared]
        for replica_modules, device_templates in zip(self.replicas, self.templates):
            for replica, template, copied in zip(replica_modules, device_templates, self.copied):
                state = replica.__dict__
                state.clear()
                state.update(template)
                for key in copied:
                    state[key] = template[key].copy()
        self.state = EntryState.CLEAN


class ReplicaCache:
    """Replica skeletons of a module tree, kept between steps: :meth:`replicate` is :func:`minidp.replicate`
    with the module copies reused.

    One skeleton set per (module, thread, device list), at most ``max_entries`` of them (least recently
    used dropped): one cache can serve several modules, such as the tutorial's ``features`` and ``classifier``,
    each through a ``data_parallel`` call of its own in one forward. :meth:`info` says how often the skeletons were reused and why they were last rebuilt;
    :meth:`originals` gives the parameters and buffers replica 0 shares with the original without walking the tree.
    """

    def __init__(self, max_entries: int = 4) -> None:
        # Checked here, not at the call that evicts: 0 or less would drop every entry as it is made (no replica
        # ever reused, silently), and a string would fail the comparison only once a call built skeletons.
        if isinstance(max_entries, bool) or not isinstance(max_entries, int):
            raise TypeError(f"max_entries must be a positive int (skeleton sets kept), got {max_entries!r}")
        if max_entries < 1:
            raise ValueError(
                f"max_entries must be at least 1, got {max_entries}: it is how many skeleton sets the cache keeps; "
                f"to build replicas anew at every step, pass cache_replicas=False to DataParallel instead"
            )
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self._last_rebuild_reason: Optional[str] = None

    @observed("replicate")
    def replicate(
        self, network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False, reduce_backend: Optional[str] = None
    ) -> list[nn.Module]:
        """:func:`minidp.replicate` of ``network`` on ``devices``, from kept skeletons where they still fit."""
        check_is_module(network, "network")
        check_flag(detach, "detach")
        devices = as_devices(devices, "devices")
        reduce_backend = check_reduce_backend(reduce_backend, "reduce_backend")
        if not devices:
            return []
        # The module's id: its entry checks it is the same object (a freed module's id given to a new one fails the
        # signature, whose stored dicts are the old module's, kept alive).
        key = (id(network), threading.get_ident(), tuple(devices))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            reason: Optional[str] = "first call for this module and these devices in this thread"
        elif entry.pending:
            reason = (
                "the last replicas' backward has not run yet, and autograd may still run them (checkpointing); "
                "run forwards you do not backpropagate under torch.no_grad() to keep the cache"
            )
        elif entry.referenced:
            reason = (
                "the last replicas are held outside the cache (by a graph that may run them again: checkpointing, "
                "a full backward hook, a replica's outputs not back-propagated yet; by a variable or a traceback; or "
                "by a weak reference made since, as a hook's WeakSet): they are left to it"
            )
        elif entry.reclassed:
            reason = "a replica's forward replaced its class"
        else:
            reason = entry.change(network)
        if reason is not None:
            check_module_device(network, devices[0])
            if any(map(_replicated_anew, network.modules())):
                # Replicated anew at every call (replicate's own body, observed once, as this call).
                with self._lock:
                    self._misses += 1
                    self._last_rebuild_reason = (
                        "the tree holds a TorchScript module, an FX GraphModule or a module whose class replicates "
                        "itself its own way (_replicate_for_data_parallel): replicated anew at every call")
                return replicate.__wrapped__(network, devices, detach, reduce_backend=reduce_backend)
            entry = _Entry(network, devices)
            with self._lock:
                self._misses += 1
                self._last_rebuild_reason = reason
                # An entry whose module is gone serves nothing, and holds that module's parameters: drop it.
                for gone in [k for k, e in self._entries.items() if e.root() is None]:
                    del self._entries[gone]
                self._entries[key] = entry
                self._entries.move_to_end(key)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        else:
            with self._lock:
                self._hits += 1
        return entry.bind(devices, detach, reduce_backend)

    def release(self, devices: Sequence[DeviceLike]) -> None:
        """Declare the replicas this thread was last given for ``devices`` (of every module) finished: no backward or
        checkpoint will run them again. They are emptied now and re-bound by the next call, as after a backward."""
        where = (threading.get_ident(), tuple(as_devices(devices, "devices")))
        with self._lock:
            entries = [entry for key, entry in self._entries.items() if key[1:] == where]
        for entry in entries:
            entry.release()

    def finished(self, roots: list[nn.Module]) -> None:
        """The forward that ran ``roots`` (the list :meth:`replicate` returned, still held by the caller) is over.

        Replicas bound with no graph (``BOUND``: under ``torch.no_grad()``, or no parameter requiring grad) have no
        backward to wait for: they are emptied now, as stock's are freed with the step, so that their copies (of the
        buffers; on GPUs, of the parameters) do not stay until the next call. Outputs that alias a replica's tensor
        keep it: an emptied replica only drops its dicts' references. Not where anything but the cache and ``roots``
        holds a replica (an output, a hook's list, a graph that may recompute it): that holder keeps it whole, and the
        next call builds new replicas, as it would anyway (:attr:`_Entry.referenced`).
        """
        with self._lock:
            entries = list(self._entries.values())
        for entry in entries:
            if entry.replicas[0][0] is roots[0]:
                if entry.state is EntryState.BOUND and entry.held_only_by_the_cache_and(roots):
                    entry.reset()
                return

    def originals(self, replica: nn.Module) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The original's parameters and buffers (``network.parameters()``, ``network.buffers()``, in order) if
        ``replica`` is the root of replicas this cache bound and has not emptied since: the lists their tree was checked
        against at that call, no walk of the tree. ``None`` for any other module (replicas built elsewhere, or these
        replicas released)."""
        with self._lock:
            entries = list(self._entries.values())
        for entry in entries:
            if entry.replicas[0][0] is replica:
                bound = entry.state in (EntryState.BOUND, EntryState.BACKWARD_PENDING)
                return (entry.params, entry.buffers) if bound else None
        return None

    def info(self) -> ReplicaCacheInfo:
        return ReplicaCacheInfo(self._hits, self._misses, self._last_rebuild_reason, len(self._entries))

    def __getstate__(self) -> dict[str, Any]:
        # Skeletons and the lock are not saved with a pickled DataParallel; the copy starts empty.
        return {"max_entries": self.max_entries}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_entries"])
