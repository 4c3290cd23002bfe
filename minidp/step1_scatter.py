"""Step 1, scatter: cut a batch into one chunk per device.

``scatter`` walks any nesting of tensors, lists, tuples, dicts, namedtuples and dataclasses, cuts
every tensor along ``dim``, and sends chunk i to device i. Whatever is not a tensor or a container
reaches every replica *by reference* (the same object, not a copy).

How a tensor is cut: by one rule applied to its own size along ``dim``, as stock applies
``torch.chunk`` to each tensor: ``torch.chunk``'s sizes, or ``chunk_weights``' shares. So tensors of
different sizes may travel together (Hugging Face's ``Trainer`` passes ``num_items_in_batch`` with
one row per replica beside a batch of many rows), as long as every tensor cuts into the same
*number* of chunks. Where the numbers differ, stock silently drops the chunks beyond the smallest
number (the rows of a replica that never runs); minidp raises an error that names both tensors,
except where the tensors cut into more chunks hold one value per device (``num_devices`` rows of one
value each), beside a batch that cuts into fewer (``Trainer``'s last, short batch: 1 row on 2 devices):
the replicas that run take their values, as in stock, and those of the replicas that do not run are left.
Explicit ``chunk_sizes`` are one split of one size: every tensor must have that size.

What moves: each chunk is copied to its device, except the first chunk for the device the tensor is on,
which is a view (a later chunk for that device, a second CPU replica's, is a copy: each replica's chunk is its own,
so one that changes its chunk in place leaves the others' alone, as on devices of their own). What autograd records: ``split`` and ``to``, so the gradient of every chunk flows
back, concatenated, to the original tensor (a scatter's backward is a gather).

Everything is checked before the first chunk is cut, and the walks are plain functions, not
closures that call themselves: a self-referencing closure is a reference cycle that every call
would leave to the garbage collector (stock breaks its by hand, docs/stock-behaviour.md B36).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch
from torch.nn.utils.rnn import PackedSequence

from . import comm
from .device_ids import DeviceLike, as_devices
from .nested import children, rebuild, tensors_in
from .hooks import observed

# Chunk sizes by the size being cut: one rule (torch.chunk's, chunk_weights', or an explicit split)
# applied to every size met in one call.
Splits = dict[int, list[int]]


def plan_splits(
    roots: Sequence[tuple[str, Any]],
    dim: int,
    num_devices: int,
    chunk_sizes: Optional[Sequence[int]] = None,
    chunk_weights: Optional[Sequence[float]] = None,
) -> Splits:
    """How every tensor in the ``(name, object)`` roots is cut, by its size along ``dim``; ``{}`` if none holds a tensor.

    Raises, naming the tensors, unless every tensor can be cut and all cut into the same number of
    chunks, but for tensors of one value per device beside a batch cut into fewer chunks (see the module
    docstring); with explicit ``chunk_sizes``, unless all have the size they split.
    """
    splits: Splits = {}
    first_of_size: dict[int, str] = {}  # each size met, with the first tensor of that size
    one_value_a_row: dict[int, bool] = {}  # whether every tensor of that size holds one value per row
    for path, tensor in (found for name, obj in roots for found in tensors_in(obj, name)):
        # maybe a PackedSequence's field (a name is cheaper to test than every type); one device takes it whole
        if num_devices > 1 and path.endswith(".batch_sizes"):
            for name, obj in roots:
                _check_no_packed_sequence(obj, name)
        comm.check_splittable(tensor, dim, path)
        size = _rows(tensor, dim)
        one_value_a_row[size] = one_value_a_row.get(size, True) and tensor.numel() == size
        if size in splits:
            continue
        if chunk_sizes is not None and splits:
            first_size, first_path = next(iter(first_of_size.items()))
            raise ValueError(
                f"{path} has {size} rows along dim {dim} but {first_path} has {first_size}, and chunk_sizes "
                f"{list(chunk_sizes)} split {first_size} rows only: with explicit chunk_sizes every tensor must "
                f"have that size. Pass tensors that every replica needs whole inside a non-tensor object, or "
                f"leave chunk_sizes out (each tensor is then cut as torch.chunk cuts it)."
            )
        splits[size] = split_for(size, num_devices, chunk_sizes, chunk_weights)
        first_of_size[size] = path
    _check_chunk_counts(splits, first_of_size, one_value_a_row, dim, num_devices, chunk_weights)
    return splits


def _check_no_packed_sequence(obj: Any, path: str) -> None:
    """Raise, naming it, if ``obj`` is or holds a ``PackedSequence``.

    It is a namedtuple, which scatter cuts field by field (stock too, B12): its time-major ``data``, its
    ``batch_sizes`` (one per time step) and its indices, each by rows, which makes no valid ``PackedSequence`` (uneven
    lengths fail inside the RNN; equal lengths give every replica some time steps of every sequence, and a wrong result
    without an error).
    """
    if isinstance(obj, PackedSequence):
        raise TypeError(
            f"{path} is a PackedSequence, which cannot be cut into chunks: its fields (data, batch_sizes, "
            f"sorted_indices) would each be cut by rows, which makes no valid PackedSequence (stock does so: uneven "
            f"lengths fail inside the RNN, equal lengths give a wrong result silently). Pass the padded batch and its "
            f"lengths (torch.nn.utils.rnn.pad_packed_sequence gives both), and pack them in the module's forward: each "
            f"replica then packs its own rows (pack_padded_sequence(x, lengths.cpu(), batch_first=True, "
            f"enforce_sorted=False))"
        )
    for suffix, child in children(obj) or ():
        _check_no_packed_sequence(child, path + suffix)


def _check_no_key_value_cache(obj: Any, path: str, replicas: int) -> None:
    """Raise, naming it, if ``obj`` is or holds a Hugging Face key/value cache (``transformers``' ``Cache``: a
    ``DynamicCache`` given as ``past_key_values``).

    scatter gives such an object whole to every replica (stock too, B12), and each replica's attention layers append
    their rows to it: all replicas into the one cache at once, so the cache ends up with every replica's keys, in the
    order the threads ran (a shape error, or, where the chunks have as many rows as the cache, attention over another
    replica's rows and logits silently wrong). Splitting it instead would leave the caller's cache as it was, and
    Hugging Face's own generation loops read the one they passed in, updated in place. Only looked for once
    ``transformers`` is imported: nothing else makes such a cache.
    """
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None or not hasattr(cache_utils, "Cache"):
        return
    if isinstance(obj, cache_utils.Cache):
        raise ValueError(
            f"{path} is a Hugging Face {type(obj).__name__}, which every one of the {replicas} replicas would get whole "
            f"and write its rows into at once (stock DataParallel does so: a shape error, or logits silently wrong). "
            f"Run the model with a cache on one device (model.module(...), or model.module.generate(...)); with "
            f"use_cache=True and no cache given, each replica makes its own, and they come back gathered into one"
        )
    for suffix, child in children(obj) or ():
        _check_no_key_value_cache(child, path + suffix, replicas)


def _check_chunk_counts(
    splits: Splits, first_of_size: dict[int, str], one_value_a_row: dict[int, bool], dim: int, num_devices: int,
    chunk_weights: Optional[Sequence[float]],
) -> None:
    """Raise, naming two tensors, unless every size cuts into the same number of chunks, or the sizes that cut into more
    are one value per device (``num_devices`` rows of one value each, as Trainer's ``num_items_in_batch``) beside a
    batch whose sizes all cut into one smaller number."""
    if len({len(sizes) for sizes in splits.values()}) <= 1:
        return
    batch = {size: sizes for size, sizes in splits.items() if size != num_devices or not one_value_a_row[size]}
    if len({len(sizes) for sizes in batch.values()}) == 1:
        return  # one value per device beside a short batch: the replicas that run get theirs (stock's zip)
    sizes_met = list(batch or splits)
    first_size, count = sizes_met[0], len(splits[sizes_met[0]])
    size = next(s for s in sizes_met if len(splits[s]) != count)
    first_path, path, sizes = first_of_size[first_size], first_of_size[size], splits[size]
    how = "in proportion to chunk_weights" if chunk_weights is not None else "by torch.chunk"
    more = path if len(sizes) > count else first_path
    raise ValueError(
        f"{path} has {size} rows along dim {dim}, which cut {how} into {len(sizes)} chunk(s) {sizes} "
        f"for {num_devices} devices, but {first_path} has {first_size} rows, which cut into {count} "
        f"chunk(s) {splits[first_size]}: every tensor must cut into the same number of chunks (stock "
        f"DataParallel would silently keep the first {min(count, len(sizes))} chunks of each, dropping "
        f"rows of {more}). Pass tensors that every replica needs whole inside a non-tensor object, or "
        f"give them a size that cuts into as many chunks, or one value per device."
    )


def split_for(
    size: int, num_devices: int, chunk_sizes: Optional[Sequence[int]], chunk_weights: Optional[Sequence[float]]
) -> list[int]:
    """The chunk sizes ``size`` rows are cut into: ``chunk_sizes`` (checked), ``chunk_weights``' shares, or torch.chunk's."""
    if chunk_sizes is not None:
        return comm.check_chunk_sizes(chunk_sizes, size, num_devices)
    if chunk_weights is not None:
        return comm.chunk_sizes_for_weights(size, chunk_weights)
    return comm.chunk_sizes_for(size, num_devices)


def _rows(tensor: torch.Tensor, dim: int) -> int:
    """``tensor``'s size along ``dim``, an int: under ``torch.jit.trace`` a size is a tensor, a new one at each read,
    which would find no split by value (the trace keeps the int as a constant, and says so)."""
    return int(tensor.shape[dim])


def _scatter_map(obj: Any, devices: list[torch.device], splits: Splits, dim: int) -> list[Any]:
    """One piece of ``obj`` per device: its tensors cut as ``splits`` says, its containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return comm.split_to_devices(obj, devices, splits[_rows(obj, dim)], dim)
    parts = children(obj)
    if not parts:  # a leaf, or an empty container: shared by reference
        return [obj for _ in devices]
    per_child = [_scatter_map(child, devices, splits, dim) for _, child in parts]
    return [rebuild(obj, list(values), scattered=True) for values in zip(*per_child)]


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

    Each tensor is cut as ``torch.chunk`` cuts it (10 rows on 3 devices: 4, 4, 2), so fewer pieces
    than devices can come back (2 rows on 4 devices: 2 pieces, and only 2 replicas will run); or in
    proportion to ``chunk_weights``, one weight per device (rounding:
    :func:`minidp.comm.chunk_sizes_for_weights`), applied to each tensor's own size. Tensors of
    different sizes must cut into the same number of chunks (see the module docstring).
    ``chunk_sizes``: one explicit split, one size per device; every tensor must have its total size.
    """
    devices = _checked_arguments(target_devices, dim, chunk_sizes, chunk_weights)
    return _scatter(inputs, devices, dim, chunk_sizes, chunk_weights, [("inputs", inputs)])


def _checked_arguments(
    target_devices: Sequence[DeviceLike],
    dim: int,
    chunk_sizes: Optional[Sequence[int]],
    chunk_weights: Optional[Sequence[float]],
) -> list[torch.device]:
    """The devices; raises on a bad device, dim, split or weights, whatever the inputs hold (tensors or not)."""
    devices = as_devices(target_devices, "target_devices")
    comm.check_dim(dim)
    if not devices:
        raise ValueError("target_devices is empty: give at least one device")
    if chunk_sizes is not None and chunk_weights is not None:
        raise ValueError("give chunk_sizes or chunk_weights, not both: the sizes are the split, the weights ask for one")
    if chunk_weights is not None:
        comm.check_chunk_weights(chunk_weights, len(devices))
    if chunk_sizes is not None:
        comm.check_chunk_sizes(chunk_sizes, None, len(devices))  # their total against each tensor: plan_splits
    return devices


def _scatter(
    inputs: Any,
    devices: list[torch.device],
    dim: int,
    chunk_sizes: Optional[Sequence[int]],
    chunk_weights: Optional[Sequence[float]],
    roots: Sequence[tuple[str, Any]],
) -> Any:
    """:func:`scatter` on checked arguments, with ``roots`` naming the parts of ``inputs`` in error messages."""
    splits = plan_splits(roots, dim, len(devices), chunk_sizes, chunk_weights)
    # A tensor of one value per device beside a short batch: the batch's count. No tensor at all: every device, each
    # with containers of its own, as stock rebuilds them (B7, B12), so that no replica's change reaches another's.
    count = min(map(len, splits.values()), default=len(devices))
    if count > 1:
        for name, obj in roots:
            _check_no_key_value_cache(obj, name, count)
    pieces = _scatter_map(inputs, devices[:count], splits, dim)
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

    Both are cut together, as one batch: every tensor among them must cut into the same number of
    chunks (the error names two that do not), and non-tensor arguments reach as many replicas as
    the tensors were cut into. So ``model(x2, flag=True)`` on 4 devices runs 2 replicas, both
    with ``flag=True``. (Stock scatters the two sides separately and pads by comparing with the
    number of positional arguments: that call fails there, and kwargs with fewer rows than the
    inputs silently reach only the first replicas.) ``chunk_sizes`` and ``chunk_weights``: as in
    :func:`scatter`.
    """
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(
            f"scatter_kwargs: inputs must be the tuple of positional arguments, got a {type(inputs).__name__}; "
            f"pass (x,) for a single argument"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(
            f"scatter_kwargs: kwargs must be a dict of keyword arguments or None, got a {type(kwargs).__name__}; "
            f"positional arguments go in inputs"
        )
    devices = _checked_arguments(target_devices, dim, chunk_sizes, chunk_weights)
    if not inputs and not kwargs:
        return (), ()
    pieces = _scatter(
        (inputs, kwargs or {}),  # as they are: a list's pieces are lists, a namedtuple's of its type (B12)
        devices,
        dim,
        chunk_sizes,
        chunk_weights,
        [("inputs", inputs), ("kwargs", kwargs)],
    )
    return tuple(inputs_i for inputs_i, _ in pieces), tuple(kwargs_i for _, kwargs_i in pieces)
