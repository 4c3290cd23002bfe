"""What each step moved: one describer per stage, reading the primitive's bound arguments and result.

A describer runs when its primitive returns, with ``arguments`` (the call's arguments by parameter
name, defaults filled in, as ``inspect.Signature.bind`` and ``apply_defaults`` give them) and the
result. It does at once only what needs the live call (registering the backward's hooks, walking the
replica modules that a replica cache re-binds on its next call) and returns the rest as a function,
``served()``, that the recorder calls when the trace's events are first read: counting bytes and writing
details is pure bookkeeping, kept out of the step and out of the stage's own time. Except where holding the
tensors to count costs the step more than counting them: the gather describer counts at once. ``served()`` lists
``(replica, device, bytes, detail)`` for every replica the call served; ``bytes`` is always "bytes
written to fresh memory by this step".
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from ..comm import accumulation_dtype, reduce_backends, storage_start
from ..device_ids import as_device, as_devices
from ..nested import tensors_in

Served = Iterator[tuple[int, Any, int, str]]  # (replica, device, bytes, detail)


class Recorder(Protocol):
    """What a describer may ask of the recorder: to watch the backward of the replicas a call made."""

    def watch_replicas(self, replicas: Sequence[Any], parameters: Sequence[Sequence[torch.Tensor]]) -> None: ...


Describer = Callable[[Recorder, dict, Any], Callable[[], Served]]


def _tensors(obj: Any, by_items: bool = False) -> list[torch.Tensor]:
    """The tensors inside ``obj``; ``by_items``: those inside objects gather rebuilds from their items too (a
    ``DynamicCache``'s keys and values, which gather concatenates: :func:`minidp.nested.items_of`)."""
    return [t for _, t in tensors_in(obj, by_items=by_items)]


# The compressed sparse layouts, and how to read their two index tensors.
_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices"),
}
SPARSE_LAYOUTS = frozenset({torch.sparse_coo, *_COMPRESSED})


def _parts(tensors: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The strided tensors that hold the memory of ``tensors``: a sparse tensor has no storage, data pointer or
    ``nbytes`` of its own, and its memory is its indices' and its values' (COO: ``_indices()``, coalesced or not; CSR,
    CSC and their blocked forms: the compressed and the plain indices); any other tensor is its own. Every count of a
    tensor's bytes or storage in the tracer goes through here."""
    for tensor in tensors:
        layout = tensor.layout  # one read, the dense case first: faster than is_sparse (47 ns against 77)
        if layout is torch.strided:
            yield tensor
        elif layout is torch.sparse_coo:
            yield tensor._indices()
            yield tensor._values()
        elif layout in _COMPRESSED:
            compressed, plain = _COMPRESSED[layout]
            yield getattr(tensor, compressed)()
            yield getattr(tensor, plain)()
            yield tensor.values()
        else:
            yield tensor


def _storages(tensors: Sequence[torch.Tensor]) -> set[tuple[torch.device, int]]:
    return set(map(storage_start, _parts(tensors)))


def _bytes_outside(tensors: Sequence[torch.Tensor], owned: set[tuple[torch.device, int]]) -> int:
    """Bytes of ``tensors`` that live in memory none of ``owned`` is (so they were copied), each place once: scatter,
    gather and replicate copy each tensor they are given, so a tensor in two places of an output (or a view of it in
    another) is two copies. (A buffer two modules hold, or a tied weight, is one place: the replica walk lists it once.)"""
    return sum(t.nbytes for t in _parts(tensors) if storage_start(t) not in owned)


def _device_of(tensors: Sequence[torch.Tensor], default: Any) -> str:
    return str(tensors[0].device) if tensors else str(default)


def scatter(tracer: Recorder, arguments: dict, result: Any) -> Callable[[], Served]:
    def served() -> Served:
        if "kwargs" in arguments:  # scatter_kwargs: (inputs per replica, kwargs per replica)
            sources = _storages(_tensors((arguments["inputs"], arguments["kwargs"])))
            pieces = list(zip(*result))
        else:
            sources = _storages(_tensors(arguments["inputs"]))
            pieces = list(result)
        devices = as_devices(arguments["target_devices"])
        for replica, piece in enumerate(pieces):
            chunk = _tensors(piece)
            shapes = ", ".join(str(tuple(t.shape)) for t in chunk)
            copied = _bytes_outside(chunk, sources)
            yield replica, str(devices[replica]), copied, f"chunks {shapes}"

    return served


def _replica_tensors(
    network: torch.nn.Module, replica: torch.nn.Module
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``(originals, replica's parameters, replica's buffers)``: walks both module trees in step, each
    module once and each tensor once (as ``modules()`` and ``parameters()`` do, without their generators: a weight
    tied between two modules is one parameter, with one gradient). A replica keeps its parameters as plain
    attributes, under the names the original's ``_parameters`` holds them."""
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
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                originals.append(param)
                params.append(getattr(copy, key))
        copy_buffers = copy._buffers
        for key, buf in original._buffers.items():
            if buf is not None and id(buf) not in seen:
                seen.add(id(buf))
                originals.append(buf)
                buffers.append(copy_buffers[key])
        copy_children = copy._modules
        stack.extend((child, copy_children[key]) for key, child in original._modules.items() if child is not None)
    return originals, params, buffers


def _ending_backward(
    network: torch.nn.Module, replica: torch.nn.Module, params: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The tensors whose last gradient ends ``replica``'s backward: its parameters that require grad. A replica of a
    replica (``data_parallel`` called in a replica's forward) has none: it holds the outer replica's, which are plain
    attributes there (stock's replicate finds no parameter in a replica either), so those, in its modules' dicts."""
    ending = [p for p in params if p.requires_grad]
    if ending or not getattr(network, "_is_replica", False):
        return ending
    found = {id(t): t for module in replica.modules() for t in module.__dict__.values()
             if isinstance(t, torch.Tensor) and t.requires_grad}
    return list(found.values())


def replicate(tracer: Recorder, arguments: dict, result: list) -> Callable[[], Served]:
    network = arguments["network"]
    walked = [_replica_tensors(network, module) for module in result]  # now: a cache re-binds these modules
    ending = [_ending_backward(network, module, params) for module, (_, params, _) in zip(result, walked)]
    tracer.watch_replicas(result, ending)

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


def gather(tracer: Recorder, arguments: dict, result: Any) -> Callable[[], Served]:
    # Counted now, a few tensors per replica: held until the events were read, the replicas' outputs cost the traced
    # step 1.6 to 3.9 points more than no gather describer at all, in four runs of `python benchmarks/trace_overhead.py
    # --steps 300 --replicas 2 --batch 64 --parts` (BENCHMARKS.md, "The targets in one afternoon").
    gathered = _storages(_tensors(result, by_items=True))
    target = arguments["target_device"]
    rows = [
        (replica, _device_of(tensors, target), _bytes_outside(tensors, gathered), f"into {target}")
        for replica, tensors in enumerate(_tensors(output, by_items=True) for output in arguments["outputs"])
    ]
    return functools.partial(iter, rows)


def reduce(tracer: Recorder, arguments: dict, result: Any) -> Callable[[], Served]:
    inputs = arguments["inputs"]  # which backend summed what is decided now: the default is a setting
    chosen = reduce_backends(inputs[0], arguments["backend"]) if inputs and inputs[0] else []
    backend = ", ".join(f"{name} ({chosen.count(name)})" for name in sorted(set(chosen))) or "-"
    destination = _device_of(list(result), arguments["destination"])
    # Counted now: held until the events are read, the replicas' gradients would stay alive (K copies). Fresh memory:
    # the sums (replica 0's event: the torch backend starts each from a copy of replica 0's gradient), and the
    # gradients of a replica on another device, copied to the destination to be added there; a replica on the
    # destination's device is added where it lies.
    sums = sum(t.nbytes for t in _parts(list(result)))
    # The torch backend sums half-precision gradients in a float32 copy of replica 0's, rounded into the result once:
    # fresh memory too (the extension sums them in its registers).
    sums += sum(t.numel() * accumulation_dtype(t.dtype).itemsize for t, name in zip(inputs[0] if inputs else [], chosen)
                if name == "torch" and t.layout is torch.strided and accumulation_dtype(t.dtype) != t.dtype)
    counted = []
    for replica, replica_grads in enumerate(inputs):
        device = _device_of(replica_grads, destination)
        copied = sum(t.nbytes for t in _parts(replica_grads)) if device != destination else 0
        counted.append((device, copied + (sums if replica == 0 else 0), len(replica_grads)))

    def served() -> Served:
        for replica, (device, nbytes, count) in enumerate(counted):
            yield replica, device, nbytes, f"{count} gradients summed onto {destination}, backends: {backend}"

    return served


DESCRIBERS: dict[str, Describer] = {"scatter": scatter, "replicate": replicate, "gather": gather, "reduce": reduce}


def timing_device(stage: str, arguments: dict) -> "torch.device | None":
    """Where a stage is timed by CUDA events rather than the host clock: the reduction, on its destination."""
    if stage != "reduce":
        return None
    if arguments["destination"] is not None:
        return as_device(arguments["destination"], "destination")
    inputs = arguments["inputs"]
    return inputs[0][0].device if inputs and inputs[0] else None
