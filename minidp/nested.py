"""Walking nested structures: the tensors inside tuples, lists, dicts (and other mappings), namedtuples and dataclasses.

Every step that takes "a batch" or returns "an output" meets arbitrary nesting: scatter cuts every
tensor inside its inputs, gather joins the replicas' outputs position by position, parallel_apply
finds the tensors a side stream produced, the tracer counts the bytes each step moved, and the
reference and verify compare outputs leaf by leaf. They all walk with the two functions below:

* :func:`children` says what a container holds, as ``(path suffix, child)`` pairs, or ``None``
  for a leaf (a tensor, a number, a string, any other object);
* :func:`rebuild` makes a container of the same kind and type from new children, in that order.

Everything else here is built from those two, and :func:`tensors_in` and :func:`leaves` take
``by_items=True`` to also go inside the objects that gather rebuilds from their items (see
:func:`items_of`): Hugging Face's ``DynamicCache``, say, whose tensors a step does move and
concatenate, but which :func:`children` leaves closed, as scatter, parallel_apply and the parallel
backward need it to.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Sequence

import torch


PLAIN = (str, bytes, numbers.Number)  # leaves that are values, never a place for a tensor


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def is_per_replica(obj: Any) -> bool:
    """Whether ``obj`` can be the list of one entry per replica that parallel_apply and gather take:
    it has a length and is indexed by position. Not a tensor (its length is its rows, which would
    pass for replicas), a string or a mapping."""
    if type(obj) in (list, tuple):
        return True
    return not isinstance(obj, (torch.Tensor, str, bytes, Mapping)) and hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def rebuild_dict(like: dict, items) -> dict:
    """A dict of ``like``'s type (OrderedDict, defaultdict, ...) holding ``items``."""
    if hasattr(like, "default_factory"):
        return type(like)(like.default_factory, items)
    return type(like)(items)


def children(obj: Any) -> Optional[list[tuple[str, Any]]]:
    """``(path suffix, child)`` for a container the walkers look inside, ``None`` for a leaf."""
    # A mapping that is not a dict (a UserDict: Hugging Face's BatchEncoding, BatchFeature) is walked as one: stock
    # treats it as an opaque object, each replica running the whole batch (docs/stock-behaviour.md B12). dict is named
    # first: the common case, matched before the abstract class's slower check.
    if isinstance(obj, (dict, Mapping)):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if is_namedtuple(obj):
        return [(f".{name}", v) for name, v in zip(obj._fields, obj)]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if is_dataclass_instance(obj):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def rebuild(like: Any, values: Sequence[Any], *, scattered: bool = False) -> Any:
    """A container of ``like``'s kind and type holding ``values`` in ``children(like)``'s order.

    A namedtuple is made with ``_make``, which runs no constructor of the user's (as stock's gather makes it);
    ``scattered``: a piece of a scattered input, made as stock's scatter makes it: a namedtuple by calling its type, and
    any other tuple or list as a plain one (a ``torch.Size``, or a tuple subclass whose constructor takes other
    arguments, reaches the replicas as a tuple)."""
    if isinstance(like, dict):
        return rebuild_dict(like, zip(like.keys(), values))
    if isinstance(like, Mapping):
        return _rebuild_mapping(like, dict(zip(like.keys(), values)))
    if is_namedtuple(like):
        return type(like)(*values) if scattered else type(like)._make(values)
    if isinstance(like, (list, tuple)):
        kind = (list if isinstance(like, list) else tuple) if scattered else type(like)
        return kind(values)
    new = copy.copy(like)  # a dataclass: a shallow copy with its fields replaced (frozen ones too)
    for field, value in zip(dataclasses.fields(like), values):
        object.__setattr__(new, field.name, value)
    return new


def _rebuild_mapping(like: Mapping, items: dict) -> Mapping:
    """A mapping of ``like``'s type holding ``items``, built as a UserDict is, from a dict."""
    try:
        return type(like)(items)
    except TypeError as error:
        raise TypeError(
            f"a {type(like).__qualname__} (a mapping) cannot be rebuilt from a dict of its items ({error}): pass a dict "
            f"instead (dict(obj), or its items as keyword arguments)") from error


def items_of(obj: Any) -> Optional[list[tuple[str, Any]]]:
    """``(path suffix, item)`` for an object that gather rebuilds from its items, ``None`` for anything else.

    Such an object is neither a tensor, nor ``None``, nor a plain value (:data:`PLAIN`), nor a
    container :func:`children` looks inside, but it is iterable: gather takes the replicas' items from
    here, joins them position by position and builds ``type(obj)(gathered items)`` (``minidp/step4_gather.py``,
    as stock does), so its items are where its tensors are, Hugging Face's ``DynamicCache`` (one
    ``(keys, values, ...)`` tuple per layer) for one. They are listed in iteration order, with the
    suffixes ``[0]``, ``[1]``, ... that gather's error messages use.

    An object that is its own iterator (a generator, a file) is ``None``: iterating over it would
    consume it, and the caller's object would come back empty.
    """
    if obj is None or isinstance(obj, (torch.Tensor, PLAIN)) or children(obj) is not None:
        return None
    try:
        iterator = iter(obj)
    except TypeError:  # not iterable: an opaque object
        return None
    if iterator is obj:
        return None
    return [(f"[{i}]", item) for i, item in enumerate(iterator)]


def _parts(obj: Any, by_items: bool) -> Optional[list[tuple[str, Any]]]:
    """What the walkers below look inside: :func:`children`, and with ``by_items`` :func:`items_of` too."""
    parts = children(obj)
    return items_of(obj) if parts is None and by_items else parts


def tensors_in(obj: Any, path: str = "", *, by_items: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``obj``, with its path (``inputs[0]['image']``) for error messages.

    ``by_items``: also the tensors inside objects that gather rebuilds from their items (:func:`items_of`),
    as the tensors a gather joins: ``output['cache'][0][1]`` is layer 0's values in a ``DynamicCache``.
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    for suffix, child in _parts(obj, by_items) or ():
        yield from tensors_in(child, path + suffix, by_items=by_items)


def holds_opaque(obj: Any) -> bool:
    """Whether some leaf inside ``obj`` is an object the walkers do not look inside (neither a tensor, nor a
    plain value, nor ``None``): it may hold tensors that :func:`tensors_in` does not list."""
    if isinstance(obj, torch.Tensor):
        return False
    parts = children(obj)
    if parts is None:
        return not (obj is None or isinstance(obj, PLAIN))
    if is_dataclass_instance(obj) and getattr(obj, "__dict__", {}).keys() - {f.name for f in dataclasses.fields(obj)}:
        return True  # an attribute beside its fields (set in __post_init__): rebuild copies it, the walkers skip it
    return any(holds_opaque(child) for _, child in parts)


def leaves(obj: Any, path: str = "", *, by_items: bool = False) -> dict[str, Any]:
    """Every leaf inside ``obj`` (tensors and plain values), by path.

    ``by_items``: the items of objects that gather rebuilds from them (:func:`items_of`) too, instead of
    the object as one leaf; verify compares outputs so, a ``DynamicCache`` tensor by tensor.
    """
    parts = None if isinstance(obj, torch.Tensor) else _parts(obj, by_items)
    if parts is None:
        return {path: obj}
    found: dict[str, Any] = {}
    for suffix, child in parts:
        found.update(leaves(child, path + suffix, by_items=by_items))
    return found


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` rebuilt with ``fn(tensor)`` in place of every tensor; other leaves kept as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    parts = children(obj)
    if not parts:
        return obj
    return rebuild(obj, [map_tensors(fn, child) for _, child in parts])
