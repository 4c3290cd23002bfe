"""Step 4, gather: join the replicas' outputs into one output on one device.

``gather`` walks the replicas' outputs in step: tensors at the same place are concatenated along
``dim`` on ``target_device``; dicts, lists, tuples, namedtuples and dataclasses are rebuilt with their
gathered contents; ``None`` stays ``None``; a string, a number or bytes becomes the list of the
replicas' values. Any other object is gathered as stock gathers it: ``type(obj)(gathered items)``,
its items (what iterating over it gives) gathered position by position, so an object that iterates
over its contents and can be built from them comes back as one object (Hugging Face's
``DynamicCache``, say: its layers' keys and values, each concatenated). One that cannot (not
iterable, or not constructible from its items) is an error naming its type and where it sits.

What moves: every output tensor is copied to ``target_device`` (an output already there is not
copied before the concatenation). What autograd records: ``to`` and ``cat``, so the gradient of the
gathered output is split and sent back to each replica's device (a gather's backward is a scatter).

The outputs of all replicas must have the same structure; where they do not, the error names the
key or position and the replica, instead of stock's silent truncation or ``KeyError``. The walk is
a plain function, not a closure that calls itself, so a call leaves no reference cycle behind
(docs/stock-behaviour.md B36).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Sequence

import torch

from . import comm
from .device_ids import DeviceLike, as_device
from .nested import PLAIN, children, is_per_replica, items_of, rebuild
from .hooks import observed


@observed("gather")
def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Gather ``outputs`` (one per replica, in replica order) onto ``target_device``.

    ``target_device`` may be an int (``-1``: the CPU), ``"cuda:N"``, ``"cpu"`` or a ``torch.device``.
    0-dim tensors (a per-replica loss, say) are gathered into a vector with one entry per replica,
    with the same warning stock gives.
    """
    if not is_per_replica(outputs):
        raise TypeError(f"gather: outputs must be a list with one output per replica, got {type(outputs).__name__}")
    if len(outputs) == 0:
        raise ValueError("gather: 'outputs' is empty; there must be one output per replica")
    destination = as_device(target_device, "target_device")
    return _gather_map(list(outputs), "output", destination, comm.check_dim(dim))


_WHAT_WORKS = (
    "Return tensors, or dicts, lists, tuples, namedtuples or dataclasses of them, or an object that iterates over its "
    "contents and can be built from them; or pass gather_output=False to DataParallel to get the replicas' outputs as "
    "they are"
)


def _gather_map(values: list[Any], path: str, destination: torch.device, dim: int) -> Any:
    """The replicas' ``values`` at ``path`` (one each, in replica order), joined into one."""
    first = values[0]
    for replica, value in enumerate(values[1:], start=1):
        _check_same_kind(first, value, path, replica)
    if isinstance(first, torch.Tensor):
        return _gather_tensors(values, path, destination, dim)
    if first is None:
        return None
    if isinstance(first, (dict, Mapping)):  # by key: the replicas may list the keys in different orders
        return rebuild(first, [_gather_map([v[k] for v in values], f"{path}[{k!r}]", destination, dim) for k in first])
    parts = children(first)
    if parts is None:
        # A plain value is gathered into the list of the replicas' values (stock: "<map object ...>" for a string,
        # a TypeError for a number; docs/stock-behaviour.md B28).
        return list(values) if isinstance(first, PLAIN) else _gather_by_items(values, path, destination, dim)
    per_replica = [children(v) for v in values]
    gathered = [
        _gather_map([p[position][1] for p in per_replica], path + suffix, destination, dim)
        for position, (suffix, _) in enumerate(parts)
    ]
    try:
        return rebuild(first, gathered)
    except TypeError as error:  # a tuple subclass built otherwise than from one iterable (torch.Size, fields)
        kind = type(first).__qualname__
        raise TypeError(
            f"{path} is of type {kind}, which gather cannot join: {kind}(gathered items) fails ({error}). "
            f"{_WHAT_WORKS}"
        ) from error


def _gather_tensors(values: list[torch.Tensor], path: str, destination: torch.device, dim: int) -> torch.Tensor:
    if all(v.dim() == 0 for v in values):
        if dim != 0:
            raise ValueError(
                f"{path}: every replica returned a 0-dim tensor, which has no dim {dim} to join along; "
                f"gather with dim=0 (a vector, one entry per replica) or return tensors with a batch dimension"
            )
        warnings.warn(
            "Was asked to gather along dimension 0, but all input tensors were scalars; "
            "will instead unsqueeze and return a vector.",
            stacklevel=5,  # gather's caller, past the @observed wrapper (for outputs that are the tensors themselves)
        )
        values = [v.view(1) for v in values]
    try:
        return comm.gather(values, dim, destination)
    except (ValueError, IndexError) as error:  # comm numbers the tensors; say where in the output they sit
        raise type(error)(f"{path}: the replicas' tensors do not fit together ({error}; tensor i is replica i's)") from error


def _gather_by_items(values: list[Any], path: str, destination: torch.device, dim: int) -> Any:
    """Stock's rule for any other object: ``type(first)`` built from the gathered items of all replicas."""
    first = values[0]
    kind = type(first).__qualname__
    for replica, value in enumerate(values[1:], start=1):
        if type(value) is not type(first):
            raise ValueError(f"{path} is of type {kind} in replica 0 but of type {type(value).__qualname__} in replica {replica}")
    per_replica = [items_of(value) for value in values]  # the one view of such an object's items the walkers share
    if any(parts is None for parts in per_replica):
        raise TypeError(
            f"{path} is of type {kind}, which gather cannot join: it is neither a tensor nor a container, and it is "
            f"not iterable (or is its own iterator, a generator, which iterating would consume), so it cannot be "
            f"rebuilt from the replicas' items as stock does (type(obj)(gathered items)). {_WHAT_WORKS}"
        )
    items = [[item for _, item in parts] for parts in per_replica]
    for replica, replica_items in enumerate(items[1:], start=1):
        if len(replica_items) != len(items[0]):
            raise ValueError(
                f"{path} (of type {kind}) holds {len(items[0])} items in replica 0 but {len(replica_items)} in replica {replica}"
            )
    gathered = [
        _gather_map([replica_items[i] for replica_items in items], f"{path}[{i}]", destination, dim)
        for i in range(len(items[0]))
    ]
    try:
        return type(first)(iter(gathered))
    except Exception as error:  # whatever the constructor raises, say which object it was
        raise TypeError(
            f"{path} is of type {kind}, which gather cannot join: it iterates over {len(gathered)} items, but "
            f"{kind}(gathered items) fails ({type(error).__name__}: {error}). {_WHAT_WORKS}"
        ) from error


def _check_same_kind(first: Any, other: Any, path: str, replica: int) -> None:
    """Raise if replica ``replica``'s output at ``path`` is not shaped like replica 0's."""

    def kind(value: Any) -> str:
        return "a tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"

    if isinstance(first, torch.Tensor) or first is None or isinstance(other, torch.Tensor) or other is None:
        if kind(first) != kind(other):
            raise ValueError(f"{path} is {kind(first)} in replica 0 but {kind(other)} in replica {replica}")
        return
    first_parts, other_parts = children(first), children(other)
    if first_parts is None or other_parts is None:
        return
    if type(first) is not type(other):
        raise ValueError(f"{path} is {kind(first)} in replica 0 but {kind(other)} in replica {replica}")
    first_keys = [suffix for suffix, _ in first_parts]
    other_keys = [suffix for suffix, _ in other_parts]
    if isinstance(first, (dict, Mapping)):
        missing = [k for k in first if k not in other]
        extra = [k for k in other if k not in first]
        if missing or extra:
            raise ValueError(
                f"{path}: the {type(first).__name__} of replica {replica} differs from replica 0's: "
                f"missing keys {missing}, extra keys {extra}"
            )
        return
    if first_keys != other_keys:
        raise ValueError(
            f"{path} has {len(first_keys)} elements in replica 0 but {len(other_keys)} in replica {replica}"
        )
