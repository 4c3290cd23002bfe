"""Step 1, scatter: cut a batch into one chunk per device.

``scatter`` walks any nesting of tensors, lists, tuples, dicts, namedtuples and dataclasses, splits
every tensor along ``dim`` into the same chunk sizes, and sends chunk i to device i. Whatever is not
a tensor or a container reaches every replica *by reference* (the same object, not a copy).

What moves: each chunk is copied to its device, except chunks for the device the tensor is on,
which are views. What autograd records: ``split`` and ``to``, so the gradient of every chunk flows
back, concatenated, to the original tensor (a scatter's backward is a gather).

Where stock ``torch.nn.parallel.scatter`` silently truncates inputs whose tensors have different
batch sizes, minidp raises an error that names both tensors.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from . import comm
from .device_ids import DeviceLike, as_devices
from .nested import children, rebuild, tensors_in
from .hooks import observed


def batch_size_of(roots: Sequence[tuple[str, Any]], dim: int) -> Optional[int]:
    """The common size along ``dim`` of all tensors in the ``(name, object)`` roots; ``None`` if none holds a tensor."""
    first_path, batch_size = None, None
    for path, tensor in (found for name, obj in roots for found in tensors_in(obj, name)):
        if tensor.dim() == 0:
            raise ValueError(f"{path} is a 0-dim tensor and has no dim {dim} to split; give it a batch dimension")
        if not -tensor.dim() <= dim < tensor.dim():
            raise IndexError(f"dim={dim} is out of range for {path}, which has {tensor.dim()} dimension(s) {tuple(tensor.shape)}")
        size = tensor.shape[dim]
        if batch_size is None:
            first_path, batch_size = path, size
            if size == 0:
                raise ValueError(f"{path} is an empty batch (size 0 along dim {dim}): there is nothing to scatter")
        elif size != batch_size:
            raise ValueError(
                f"{path} has {size} rows along dim {dim} but {first_path} has {batch_size}: every tensor that is "
                f"scattered must share the batch size (stock DataParallel would silently drop rows here). "
                f"Pass tensors that every replica needs whole inside a non-tensor object, or split them yourself."
            )
    return batch_size


@observed("scatter")
def scatter(
    inputs: Any,
    target_devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Optional[Sequence[int]] = None,
    *,
    chunk_weights: Optional[Sequence[float]] = None,
) -> Any:
    """Split ``inputs`` into one piece per device; returns a list (a tuple for a bare tensor).

    The batch is cut as ``torch.chunk`` cuts it (10 rows on 3 devices: 4, 4, 2), so fewer pieces than
    devices can come back (2 rows on 4 devices: 2 pieces, and only 2 replicas will run); or as
    ``chunk_sizes`` says, one size per device; or in proportion to ``chunk_weights``, one weight per
    device (rounding: :func:`minidp.comm.chunk_sizes_for_weights`).
    """
    return _scatter(inputs, target_devices, dim, chunk_sizes, chunk_weights, [("inputs", inputs)])


def _scatter(
    inputs: Any,
    target_devices: Sequence[DeviceLike],
    dim: int,
    chunk_sizes: Optional[Sequence[int]],
    chunk_weights: Optional[Sequence[float]],
    roots: Sequence[tuple[str, Any]],
) -> Any:
    """:func:`scatter`, with ``roots`` naming the parts of ``inputs`` in error messages."""
    devices = as_devices(target_devices, "target_devices")
    if not devices:
        raise ValueError("target_devices is empty: give at least one device")
    if chunk_sizes is not None and chunk_weights is not None:
        raise ValueError("give chunk_sizes or chunk_weights, not both: the sizes are the split, the weights ask for one")
    if chunk_weights is not None:
        comm.check_chunk_weights(chunk_weights, len(devices))
    batch_size = batch_size_of(roots, dim)
    if batch_size is None:
        return [inputs for _ in devices]
    if chunk_weights is not None:
        chunk_sizes = comm.chunk_sizes_for_weights(batch_size, chunk_weights)
    elif chunk_sizes is None:
        chunk_sizes = comm.chunk_sizes_for(batch_size, len(devices))
    else:
        chunk_sizes = comm.check_chunk_sizes(chunk_sizes, batch_size, len(devices))
    devices = devices[: len(chunk_sizes)]

    def scatter_map(obj: Any) -> list[Any]:
        if isinstance(obj, torch.Tensor):
            return list(comm.scatter(obj, devices, chunk_sizes, dim))
        parts = children(obj)
        if not parts:  # a leaf, or an empty container: shared by reference
            return [obj for _ in devices]
        per_child = [scatter_map(child) for _, child in parts]
        return [rebuild(obj, list(values)) for values in zip(*per_child)]

    pieces = scatter_map(inputs)
    return tuple(pieces) if isinstance(inputs, torch.Tensor) else pieces


@observed("scatter")
def scatter_kwargs(
    inputs: tuple,
    kwargs: Optional[dict[str, Any]],
    target_devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Optional[Sequence[int]] = None,
    *,
    chunk_weights: Optional[Sequence[float]] = None,
) -> tuple[tuple[tuple, ...], tuple[dict[str, Any], ...]]:
    """Scatter positional and keyword arguments; returns ``(inputs per replica, kwargs per replica)``.

    Both are cut together, as one batch: every tensor among them must have the same size along
    ``dim`` (the error names the two that differ), and non-tensor arguments reach as many replicas
    as the tensors were cut into. So ``model(x2, flag=True)`` on 4 devices runs 2 replicas, both
    with ``flag=True``. (Stock scatters the two sides separately and pads by comparing with the
    number of positional arguments: that call fails there, and kwargs with fewer rows than the
    inputs silently reach only the first replicas.) ``chunk_sizes`` and ``chunk_weights``: as in
    :func:`scatter`.
    """
    if not inputs and not kwargs:
        return (), ()
    pieces = _scatter(
        (tuple(inputs), kwargs or {}),
        target_devices,
        dim,
        chunk_sizes,
        chunk_weights,
        [("inputs", inputs), ("kwargs", kwargs)],
    )
    return tuple(inputs_i for inputs_i, _ in pieces), tuple(kwargs_i for _, kwargs_i in pieces)
