"""Collective copies between devices: broadcast, scatter, gather and the gradient reduction.

These are the tensor-level building blocks, with the signatures of ``torch.nn.parallel.comm``, and
they work on CPU and CUDA tensors alike. They move bytes and nothing more: the structure-aware
primitives (:mod:`minidp.scatter`, :mod:`minidp.gather`, :mod:`minidp.replicate`) call them.

Two rules hold throughout:

* A copy to the device a tensor is already on is skipped: the result *is* that tensor (broadcast)
  or a view of it (scatter's first chunk for that device; a later one is a copy, :func:`split_to_devices` says
  why). This is what makes several replicas on one device cheap.
* ``scatter`` and ``gather`` are built from ``torch.split``, ``Tensor.to`` and ``torch.cat``, which
  autograd differentiates on its own: the backward of a scatter is a gather and vice versa.
  The reductions are not recorded by autograd; they *are* the backward of a broadcast.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from itertools import chain
from operator import attrgetter
from typing import Iterable, Optional, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _take_tensors, _unflatten_dense_tensors

from .device_ids import DeviceLike, as_device, as_devices
from .hooks import observed

REDUCE_BACKENDS = ("auto", "torch", "ext")
_default_reduce_backend = "auto"


def set_reduce_backend(backend: str) -> None:
    """Choose how gradients are summed everywhere a ``backend`` is not given explicitly.

    ``"torch"``: ``Tensor.add_`` in replica order. ``"ext"``: minidp's fused C++/CUDA op
    (:mod:`minidp.ext`). ``"auto"``: the extension, once it is loaded, for every tensor it takes;
    ``"torch"`` for the rest (see :func:`reduce_backends`).
    """
    global _default_reduce_backend
    _default_reduce_backend = check_reduce_backend(_check_backend(backend))


def get_reduce_backend() -> str:
    """The backend set by :func:`set_reduce_backend` (``"auto"`` unless changed)."""
    return _default_reduce_backend


def _check_backend(backend: str, argument: str = "backend") -> str:
    if backend not in REDUCE_BACKENDS:
        raise ValueError(f"{argument} must be one of {REDUCE_BACKENDS}, got {backend!r}")
    return backend


def check_reduce_backend(backend: Optional[str], argument: str = "backend") -> Optional[str]:
    """``backend`` (``None``: the global default) if a reduction can use it; checked when it is chosen,
    before any step runs: an unknown name is a ``ValueError``, ``"ext"`` loads the extension (and raises,
    saying why, where it is disabled or cannot be built)."""
    if backend is None:
        return None
    _check_backend(backend, argument)
    if backend == "ext":
        from . import ext

        try:
            ext.load()
        except RuntimeError as error:
            raise RuntimeError(f"{argument}='ext' needs the minidp extension: {error}. Use 'auto' or 'torch'.") from error
    return backend


# --------------------------------------------------------------------------------------------------
# broadcast: one tensor (or many) -> a copy on each device
# --------------------------------------------------------------------------------------------------


def broadcast(
    tensor: torch.Tensor,
    devices: Optional[Sequence[DeviceLike]] = None,
    *,
    out: Optional[Sequence[torch.Tensor]] = None,
) -> tuple[torch.Tensor, ...]:
    """Copy ``tensor`` to each of ``devices`` (or into the tensors of ``out``).

    A device equal to ``tensor.device`` receives ``tensor`` itself, not a copy.
    """
    if (devices is None) == (out is None):
        raise ValueError("broadcast: give exactly one of 'devices' and 'out'")
    if out is not None:
        check_out(out, tensor.shape, None, "broadcast")
        for target in out:
            target.copy_(tensor)
        return tuple(out)
    return tuple(move(tensor, device) for device in as_devices(devices, "devices"))


def storage_start(tensor: torch.Tensor) -> tuple[torch.device, int]:
    """Where a strided ``tensor``'s memory starts: its device and its storage's first byte, the same for every view of
    that memory. Computed from the tensor's own pointer and offset, without making the storage's Python object
    (``untyped_storage()``), which costs more and stays alive as long as the memory does."""
    return tensor.device, tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]], counted: Optional[set] = None) -> int:
    """The bytes of the storages of ``tensors``, each storage once and whole (a view holds all of its storage), and
    none already in ``counted`` (those counted here are added to it, so that several figures share no storage). A
    sparse tensor has no storage of its own: its indices' and its values' are counted."""
    counted = set() if counted is None else counted
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.is_sparse:
            total += storage_bytes([tensor._indices(), tensor._values()], counted)
            continue
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() and key not in counted:
            counted.add(key)
            total += storage.nbytes()
    return total


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[DeviceLike], buffer_size: int = 10485760
) -> list[tuple[torch.Tensor, ...]]:
    """Copy every tensor of ``tensors`` to each of ``devices``; result ``[device][tensor]``.

    For devices other than the tensors' own, small tensors are first packed into flat buffers of at
    most ``buffer_size`` bytes, so that one copy moves many tensors; the device the tensors live on
    receives the tensors themselves.
    """
    devices = as_devices(devices, "devices")
    tensors = list(tensors)
    if not tensors:
        return [() for _ in devices]
    source_device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != source_device:
            raise ValueError(f"broadcast_coalesced: tensors[{i}] is on {t.device}, but tensors[0] is on {source_device}")
    return [tuple(tensors) if device == source_device else copy_coalesced(tensors, device, buffer_size) for device in devices]


def copy_coalesced(
    tensors: Sequence[torch.Tensor], device: DeviceLike, buffer_size: int = 10485760
) -> tuple[torch.Tensor, ...]:
    """Fresh copies of ``tensors`` on ``device`` (their own device too), moved in few large copies.

    Small tensors are packed into flat buffers of at most ``buffer_size`` bytes (one per dtype), so
    that one copy moves many; each result is a view into such a buffer with a version counter of its
    own, so an in-place update of one (a BatchNorm statistic) does not invalidate the others.
    A tensor listed twice is copied once, into both slots.
    """
    device = as_device(device, "device")
    unique = list({id(t): t for t in tensors}.values())
    copies: dict[int, torch.Tensor] = {}
    for bucket in _take_tensors(unique, buffer_size):  # buckets group tensors by type
        if bucket[0].is_sparse:
            moved = [t.to(device, copy=True) for t in bucket]
        else:
            flat = _flatten_dense_tensors(bucket)  # a fresh buffer, except for one tensor: then a view of it
            flat = flat.to(device, non_blocking=device.type == "cuda", copy=len(bucket) == 1)
            # `.data`: each copy gets a version counter of its own, not the flat buffer's.
            moved = [view.data for view in _unflatten_dense_tensors(flat, bucket)]
        for original, copy in zip(bucket, moved):
            copies[id(original)] = copy
    return tuple(copies[id(t)] for t in tensors)


# --------------------------------------------------------------------------------------------------
# reduce: one tensor from each replica -> their sum on one device
# --------------------------------------------------------------------------------------------------


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself if it is there already, else a copy.

    Copies *to* a GPU are asynchronous; copies to the CPU wait for the data, because the caller
    may read the result at once.
    """
    return tensor.to(device, non_blocking=device.type == "cuda")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Summing K half-precision values in half rounds K-1 times; float32 rounds once at the end.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _reduce_add_torch(inputs: Sequence[Sequence[torch.Tensor]], destination: torch.device) -> list[torch.Tensor]:
    """Sum ``inputs[replica][i]`` over replicas, in replica order, with plain tensor ops."""
    first = inputs[0]
    sums = [t.to(destination, accumulation_dtype(t.dtype), copy=True) for t in first]
    for replica in inputs[1:]:
        for total, grad in zip(sums, replica):
            total.add_(move(grad, destination))
    return [total.to(t.dtype) for total, t in zip(sums, first)]


def _check_reduce_inputs(inputs: Sequence[Sequence[torch.Tensor]]) -> None:
    if len(inputs) == 0:
        raise ValueError("reduce: 'inputs' holds no replicas; give one list of tensors per replica")
    expected = inputs[0]
    for r, replica in enumerate(inputs):
        if len(replica) != len(expected):
            raise ValueError(f"reduce: replica {r} has {len(replica)} tensors but replica 0 has {len(expected)}")
        for i, (t, ref) in enumerate(zip(replica, expected)):
            if t.shape != ref.shape:
                raise ValueError(
                    f"reduce: tensor {i} of replica {r} has shape {tuple(t.shape)} but replica 0's has {tuple(ref.shape)}"
                )
            if t.dtype != ref.dtype:
                raise ValueError(f"reduce: tensor {i} of replica {r} has dtype {t.dtype} but replica 0's has {ref.dtype}")


_is_sparse = attrgetter("is_sparse")


def _dense_where_layouts_differ(inputs: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """``inputs`` with the sparse tensors of every position that is not sparse in all replicas made dense: such a
    position is summed dense, as stock's ``reduce_add_coalesced`` sums it. (A replica whose chunk took another path
    past an ``nn.Embedding(sparse=True)`` hands autograd's dense zeros beside the others' sparse gradients.)"""
    mixed = {i for i, position in enumerate(zip(*inputs)) if not all(map(_is_sparse, position))}
    return [[t.to_dense() if i in mixed and t.is_sparse else t for i, t in enumerate(replica)] for replica in inputs]


def reduce_backends(tensors: Sequence[torch.Tensor], backend: Optional[str] = None) -> list[str]:
    """The concrete backend (``"torch"`` or ``"ext"``) that will sum each position of ``tensors``.

    ``"torch"`` takes everything. ``"ext"`` must take every tensor: one it cannot (a complex or
    integer dtype, a sparse layout, a device other than the CPU or a GPU) is a ``TypeError`` that names
    it. ``"auto"`` gives the extension, once it is loaded, exactly the tensors it takes, and the
    rest to ``"torch"``; both add in replica order, so the sums are bitwise the same either way.
    """
    requested = _check_backend(backend or _default_reduce_backend)
    if requested == "torch":
        return ["torch"] * len(tensors)
    from . import ext

    if requested == "ext":
        ext.load()  # raises, saying why, when the extension is disabled or cannot be built
        for i, t in enumerate(tensors):
            if not ext.supports(t):
                raise TypeError(
                    f"reduce backend 'ext' cannot sum tensor {i} ({t.dtype}, {t.layout}, on {t.device}); it takes "
                    f"dense tensors of {', '.join(map(str, ext.SUPPORTED_DTYPES))} on the CPU or a GPU, not the "
                    f"batched ones of autograd.grad(..., is_grads_batched=True). Use "
                    f"reduce_backend='auto', which hands such tensors to the torch backend, or 'torch'."
                )
        return ["ext"] * len(tensors)
    loaded = ext.is_loaded()
    return ["ext" if loaded and ext.supports(t) else "torch" for t in tensors]


@observed("reduce")
def reduce_add_coalesced(
    inputs: Sequence[Sequence[torch.Tensor]],
    destination: Optional[DeviceLike] = None,
    buffer_size: int = 10485760,
    *,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, ...]:
    """Sum tensors from several replicas: ``result[i] = inputs[0][i] + inputs[1][i] + ...``.

    ``inputs[replica]`` is one replica's list of tensors (e.g. its parameters' gradients); the sums
    are new tensors on ``destination`` (default: the device of ``inputs[0][0]``), never aliases of an
    input or of anything the caller still holds (the extension writes CPU sums into memory it reuses
    once no tensor over it is alive: :func:`minidp.ext.reduce_add_coalesced`). The sum runs in
    replica order, so every backend gives bitwise the same result; half-precision inputs are summed
    in float32 and rounded once. Each position goes to the backend :func:`reduce_backends` picks.
    ``buffer_size`` is accepted for compatibility with ``torch.nn.parallel.comm`` and unused: no
    backend packs tensors into flat buffers.
    """
    del buffer_size
    _check_reduce_inputs(inputs)
    if not inputs[0]:
        return ()
    if any(map(_is_sparse, chain.from_iterable(inputs))):
        inputs = _dense_where_layouts_differ(inputs)
    destination = as_device(destination, "destination") if destination is not None else inputs[0][0].device
    positions: dict[str, list[int]] = {}
    for i, name in enumerate(reduce_backends(inputs[0], backend)):
        positions.setdefault(name, []).append(i)
    if len(positions) == 1 and "torch" in positions:  # the common case, without re-indexing
        return tuple(_reduce_add_torch(inputs, destination))
    sums: list[Optional[torch.Tensor]] = [None] * len(inputs[0])
    for name, indices in positions.items():
        subset = [[replica[i] for i in indices] for replica in inputs]
        if name == "ext":
            from . import ext

            reduced = ext.reduce_add_coalesced(subset, destination)
        else:
            reduced = _reduce_add_torch(subset, destination)
        for i, total in zip(indices, reduced):
            sums[i] = total
    return tuple(sums)  # type: ignore[arg-type]


def reduce_add(
    inputs: Sequence[torch.Tensor], destination: Optional[DeviceLike] = None, *, backend: Optional[str] = None
) -> torch.Tensor:
    """Sum one tensor from each replica onto ``destination`` (default: ``inputs[0]``'s device)."""
    return reduce_add_coalesced([[t] for t in inputs], destination, backend=backend)[0]


# --------------------------------------------------------------------------------------------------
# scatter / gather: split one tensor across devices, and join the pieces back
# --------------------------------------------------------------------------------------------------


def chunk_sizes_for(batch_size: int, num_devices: int) -> list[int]:
    """The sizes ``torch.chunk`` would cut ``batch_size`` rows into for ``num_devices`` devices.

    Every chunk but the last has ``ceil(batch_size / num_devices)`` rows, so there can be fewer
    chunks than devices: 10 rows on 3 devices -> [4, 4, 2]; 5 on 4 -> [2, 2, 1]; 2 on 4 -> [1, 1]. An empty
    batch gives every device an empty chunk, as ``torch.chunk`` does: 0 rows on 3 devices -> [0, 0, 0].
    """
    if batch_size == 0:
        return [0] * num_devices
    step = math.ceil(batch_size / num_devices)
    sizes = [step] * (batch_size // step)
    if batch_size % step:
        sizes.append(batch_size % step)
    return sizes


def check_chunk_weights(chunk_weights: Sequence[float], num_devices: Optional[int] = None) -> list[float]:
    """Validate ``chunk_weights``: positive finite numbers, one per device (when ``num_devices`` is given)."""
    if isinstance(chunk_weights, (str, bytes)) or not isinstance(chunk_weights, Sequence):
        raise TypeError(f"chunk_weights must be a list of numbers, one per device, got {chunk_weights!r}")
    chunk_weights = list(chunk_weights)
    if not chunk_weights:
        raise ValueError("chunk_weights is empty; give one weight per device, e.g. [2, 1]: twice the rows on the first")
    for i, weight in enumerate(chunk_weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"chunk_weights[{i}] is {weight!r}: every weight must be a positive finite number; "
                f"drop a device from the device list to give it no rows"
            )
    if num_devices is not None and len(chunk_weights) != num_devices:
        raise ValueError(
            f"chunk_weights has {len(chunk_weights)} entries but there are {num_devices} devices; give one weight per device"
        )
    return [float(weight) for weight in chunk_weights]


def chunk_sizes_for_weights(batch_size: int, chunk_weights: Sequence[float]) -> list[int]:
    """Split ``batch_size`` rows over the devices in proportion to ``chunk_weights``.

    The rule, in exact rational arithmetic (``fractions.Fraction`` of each weight, so no float
    rounding decides a tie):

    1. device i's quota is ``batch_size * w_i / sum(w)``; it gets ``floor(quota)`` rows;
    2. the rows left over go one each to the largest remainders ``quota - floor(quota)``, ties to the
       lower index (Hamilton's largest-remainder method);
    3. a device left with 0 rows takes one from the device with the most rows (ties: the lower
       index), until every device has at least one.

    With fewer rows than devices, the first ``batch_size`` devices get one row each (fewer chunks
    than devices, as :func:`chunk_sizes_for` gives), and an empty batch an empty chunk each, as there.
    ``[3, 1]`` on 10 rows -> [8, 2] (quotas 7.5, 2.5: the tie goes to device 0); ``[1, 1, 1]`` on 10 -> [4, 3, 3];
    ``[100, 1]`` on 10 -> [9, 1] (step 3).
    """
    weights = [Fraction(w) for w in check_chunk_weights(chunk_weights)]
    if batch_size == 0:
        return [0] * len(weights)
    if batch_size < len(weights):
        return [1] * batch_size
    total = sum(weights)
    quotas = [batch_size * w / total for w in weights]
    sizes = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in by_remainder[: batch_size - sum(sizes)]:
        sizes[i] += 1
    for i in range(len(sizes)):
        if sizes[i] == 0:  # the device with the most rows loses the smallest share by giving one up
            largest = max(range(len(sizes)), key=lambda j: (sizes[j], -j))
            sizes[largest] -= 1
            sizes[i] = 1
    return sizes


def check_chunk_sizes(chunk_sizes: Sequence[int], batch_size: Optional[int], num_devices: int) -> list[int]:
    """Validate an explicit split of ``batch_size`` rows over ``num_devices`` devices (``None``: any number of rows)."""
    if isinstance(chunk_sizes, (str, bytes)) or not isinstance(chunk_sizes, Sequence):
        raise TypeError(f"chunk_sizes must be a list of ints, one size per device, e.g. [3, 2], got {chunk_sizes!r}")
    chunk_sizes = list(chunk_sizes)
    if len(chunk_sizes) != num_devices:
        raise ValueError(f"chunk_sizes has {len(chunk_sizes)} entries but there are {num_devices} devices; give one size per device")
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0 for s in chunk_sizes):
        raise ValueError(f"chunk_sizes must be positive ints, got {chunk_sizes}; drop a device from the device list to give it nothing")
    chunk_sizes = [int(s) for s in chunk_sizes]  # numpy's integers too, as torch.split takes them
    if batch_size is not None and sum(chunk_sizes) != batch_size:
        raise ValueError(f"chunk_sizes {chunk_sizes} add up to {sum(chunk_sizes)}, but the batch has {batch_size} rows")
    return chunk_sizes


def check_dim(dim: int, argument: str = "dim") -> int:
    """``dim`` as an int, or an error unless it is an integer (numpy's too; a dimension index, negative counts from the
    end)."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{argument} must be an int (the batch dimension, e.g. 0), got {dim!r} of type {type(dim).__name__}")
    return int(dim)


def check_splittable(tensor: torch.Tensor, dim: int, name: str = "tensor") -> None:
    """Raise unless ``tensor`` (called ``name`` in the message) can be cut along ``dim`` into views.

    ``torch.split`` cuts dense (strided) tensors only: on a sparse tensor it fails in the dispatcher
    (``aten::as_strided`` has no sparse kernel), stock's scatter included.
    """
    if tensor.layout != torch.strided:
        raise TypeError(
            f"{name} is a {tensor.layout} tensor, which cannot be cut into chunks (stock scatter fails on it too, "
            f"inside torch.chunk): pass {name}.to_dense(), or cut it yourself and give each replica its part; to "
            f"give every replica the whole tensor, pass it inside a non-tensor object (which is shared, not cut)"
        )
    if tensor.dim() == 0:
        raise ValueError(f"{name} is a 0-dim tensor and has no dim {dim} to split; give it a batch dimension")
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(
            f"dim={dim} is out of range for {name}, which has {tensor.dim()} dimension(s) {tuple(tensor.shape)}: "
            f"dim must be in {-tensor.dim()}..{tensor.dim() - 1}"
        )


def check_out(out: Sequence[torch.Tensor], shape: Sequence[int], dim: Optional[int], caller: str) -> None:
    """Raise unless every ``out[i]`` is a tensor of ``shape``; with ``dim``, pieces of it: ``shape``
    outside ``dim``, their sizes along ``dim`` adding up to its. Checked before anything is copied, so
    a bad ``out[1]`` does not leave ``out[0]`` written."""
    listed = isinstance(out, Sequence) and not isinstance(out, (str, bytes))
    if not listed or not out or not all(isinstance(o, torch.Tensor) for o in out):
        raise TypeError(f"{caller}: out must be a non-empty list of tensors, one per device, got {type(out).__name__}")
    joined = None if dim is None else dim % len(shape)
    outside = [size for d, size in enumerate(shape) if d != joined]
    for i, o in enumerate(out):
        if o.dim() != len(shape) or [size for d, size in enumerate(o.shape) if d != joined] != outside:
            where = "" if dim is None else f" outside dim {dim}"
            raise ValueError(f"{caller}: out[{i}] has shape {tuple(o.shape)}, where {tuple(shape)}{where} is needed")
    if joined is not None and sum(o.shape[joined] for o in out) != shape[joined]:
        raise ValueError(
            f"{caller}: the sizes of out along dim {dim} add up to {sum(o.shape[joined] for o in out)}, "
            f"but the tensor has {shape[joined]} rows there"
        )


def split_to_devices(
    tensor: torch.Tensor, devices: Sequence[torch.device], chunk_sizes: Sequence[int], dim: int
) -> list[torch.Tensor]:
    """Chunk i of ``tensor`` (``torch.split`` by ``chunk_sizes``) on ``devices[i]``; the caller has checked both.

    The first chunk bound for the tensor's own device is a view of it, as stock's; a later one bound there too
    (replicas sharing a device: CPU replicas, a repeated GPU id) is a copy, as it would be on a device of its own.
    Views would share one version counter: a replica that changes its chunk in place (``x /= 255`` at the top of a
    ``forward``, an ``inplace=True`` activation first) would invalidate what another replica saved for its backward.
    """
    pieces = []
    viewed = False
    for piece, device in zip(torch.split(tensor, chunk_sizes, dim), devices):
        if device == tensor.device:
            piece, viewed = (piece.clone() if viewed else piece), True
        pieces.append(move(piece, device))
    return pieces


def scatter(
    tensor: torch.Tensor,
    devices: Optional[Sequence[DeviceLike]] = None,
    chunk_sizes: Optional[Sequence[int]] = None,
    dim: int = 0,
    streams: None = None,
    *,
    out: Optional[Sequence[torch.Tensor]] = None,
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` along ``dim`` and send chunk i to ``devices[i]`` (or copy it into ``out[i]``).

    Chunks follow ``torch.chunk`` unless ``chunk_sizes`` is given. The first chunk bound for the tensor's own
    device is a view of it, not a copy; a later one bound there too is a copy (:func:`split_to_devices` says why).
    ``streams`` is accepted for compatibility and unused.
    """
    del streams
    if (devices is None) == (out is None):
        raise ValueError("scatter: give exactly one of 'devices' and 'out'")
    check_splittable(tensor, check_dim(dim), "tensor")
    if out is not None:
        if chunk_sizes is not None:
            raise ValueError("scatter: give chunk_sizes or out, not both: the sizes of out along dim are the split")
        check_out(out, tensor.shape, dim, "scatter")
        pieces = torch.split(tensor, [o.shape[dim] for o in out], dim)
        for target, piece in zip(out, pieces):
            target.copy_(piece)
        return tuple(out)
    devices = as_devices(devices, "devices")
    if not devices:
        raise ValueError("scatter: devices is empty: give at least one device to send a chunk to")
    batch_size = tensor.shape[dim]
    if chunk_sizes is None:
        chunk_sizes = chunk_sizes_for(batch_size, len(devices))
    else:
        chunk_sizes = check_chunk_sizes(chunk_sizes, batch_size, len(devices))
    return tuple(split_to_devices(tensor, devices, chunk_sizes, dim))


_JOINABLE_LAYOUTS = (torch.strided, torch.sparse_coo)


def gather(
    tensors: Sequence[torch.Tensor],
    dim: int = 0,
    destination: Optional[DeviceLike] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Concatenate ``tensors`` along ``dim`` on ``destination`` (default: ``tensors[0]``'s device).

    ``-1`` and ``"cpu"`` both mean the CPU. The result is always a new tensor, a single one too, as stock's
    (``torch._C._gather`` allocates it): a replica's output may be its parameter, or a view of its input chunk, which
    an in-place change of the gathered output must not reach.
    """
    if len(tensors) == 0:
        raise ValueError("gather: 'tensors' is empty")
    if out is not None and destination is not None:
        raise ValueError("gather: give destination or out, not both: the result goes where out is")
    destination = as_device(destination, "destination") if destination is not None else tensors[0].device
    reference = tensors[0]
    if not -reference.dim() <= check_dim(dim) < max(reference.dim(), 1):
        raise IndexError(
            f"gather: dim={dim} is out of range for tensor 0, which has {reference.dim()} dimension(s) "
            f"{tuple(reference.shape)}: dim must be in {-reference.dim()}..{reference.dim() - 1}"
        )
    # torch.cat checks this too, but its message names neither the tensor nor what to compare with.
    joined = dim % max(reference.dim(), 1)
    outside = [size for d, size in enumerate(reference.shape) if d != joined]
    for i, t in enumerate(tensors):
        if t.layout not in _JOINABLE_LAYOUTS:  # torch.cat fails on it, naming neither the tensor nor a way out
            raise TypeError(
                f"gather: tensor {i} is a {t.layout} tensor, which torch.cat cannot join; "
                f"return it dense or in COO layout (.to_sparse()) from the replicas"
            )
        if t.dim() != reference.dim() or [size for d, size in enumerate(t.shape) if d != joined] != outside:
            raise ValueError(
                f"gather: tensor {i} has shape {tuple(t.shape)}, which does not match tensor 0's "
                f"{tuple(reference.shape)} outside dim {dim}"
            )
    if out is not None:
        if reference.dim():  # (0-dim tensors cannot be concatenated: torch.cat says so)
            rows = sum(t.shape[joined] for t in tensors)
            check_out([out], (*reference.shape[:joined], rows, *reference.shape[joined + 1:]), None, "gather")
        return torch.cat([t.to(out.device) for t in tensors], dim, out=out)
    if len(tensors) == 1 and reference.dim() == 0:  # (torch.cat refuses 0-dim tensors, and says so for several)
        return reference.to(destination, copy=True)
    return torch.cat([move(t, destination) for t in tensors], dim)
