"""Step 4, gather: join the replicas' outputs into one output on one device.

``gather`` walks the replicas' outputs in step: tensors at the same place are concatenated along
``dim`` on ``target_device``; dicts, lists, tuples, namedtuples and dataclasses are rebuilt with their
gathered contents; ``None`` stays ``None``; any other value (a string, a number) becomes the list of
the replicas' values.

What moves: every output tensor is copied to ``target_device`` (an output already there is not
copied before the concatenation). What autograd records: ``to`` and ``cat``, so the gradient of the
gathered output is split and sent back to each replica's device (a gather's backward is a scatter).

The outputs of all replicas must have the same structure; where they do not, the error names the
key or position and the replica, instead of stock's silent truncation or ``KeyError``.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from . import comm
from .device_ids import DeviceLike, as_device
from .nested import children, rebuild, rebuild_dict
from .hooks import observed


@observed("gather")
def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Gather ``outputs`` (one per replica, in replica order) onto ``target_device``.

    ``target_device`` may be an int (``-1``: the CPU), ``"cuda:N"``, ``"cpu"`` or a ``torch.device``.
    0-dim tensors (a per-replica loss, say) are gathered into a vector with one entry per replica,
    with the same warning stock gives.
    """
    if len(outputs) == 0:
        raise ValueError("gather: 'outputs' is empty; there must be one output per replica")
    destination = as_device(target_device, "target_device")

    def gather_map(values: list[Any], path: str) -> Any:
        first = values[0]
        for replica, value in enumerate(values[1:], start=1):
            _check_same_kind(first, value, path, replica)
        if isinstance(first, torch.Tensor):
            if all(v.dim() == 0 for v in values):
                if dim != 0:
                    raise ValueError(
                        f"{path}: every replica returned a 0-dim tensor, which has no dim {dim} to join along; "
                        f"gather with dim=0 (a vector, one entry per replica) or return tensors with a batch dimension"
                    )
                warnings.warn(
                    "Was asked to gather along dimension 0, but all input tensors were scalars; "
                    "will instead unsqueeze and return a vector.",
                    stacklevel=3,
                )
                values = [v.view(1) for v in values]
            try:
                return comm.gather(values, dim, destination)
            except ValueError as error:  # comm numbers the tensors; say where in the output they sit
                raise ValueError(f"{path}: the replicas' tensors do not fit together ({error}; tensor i is replica i's)") from error
        if first is None:
            return None
        if isinstance(first, dict):  # by key: the replicas may list the keys in different orders
            return rebuild_dict(first, [(k, gather_map([v[k] for v in values], f"{path}[{k!r}]")) for k in first])
        parts = children(first)
        if parts is None:
            return list(values)
        per_replica = [children(v) for v in values]
        gathered = [
            gather_map([p[position][1] for p in per_replica], path + suffix) for position, (suffix, _) in enumerate(parts)
        ]
        return rebuild(first, gathered)

    return gather_map(list(outputs), "output")


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
    if isinstance(first, dict):
        missing = [k for k in first if k not in other]
        extra = [k for k in other if k not in first]
        if missing or extra:
            raise ValueError(
                f"{path}: the dict of replica {replica} differs from replica 0's: "
                f"missing keys {missing}, extra keys {extra}"
            )
        return
    if first_keys != other_keys:
        raise ValueError(
            f"{path} has {len(first_keys)} elements in replica 0 but {len(other_keys)} in replica {replica}"
        )
