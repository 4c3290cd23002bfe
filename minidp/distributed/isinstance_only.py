"""Deriving from torch's class for ``isinstance`` only, and refusing the methods that come with it.

Frameworks find torch's wrappers by ``isinstance``: Lightning and accelerate test for torch's
``DistributedDataParallel`` before they call ``no_sync``; Lightning Fabric's ``no_backward_sync`` switches the
gradient sync off on each module that ``isinstance(module, FSDPModule)``, and leaves any other alone (it would
reduce every micro-batch's gradients instead). So minidp's ``DistributedDataParallel`` derives from torch's, and the
modules minidp's ``fully_shard`` shards from ``FSDPModule``, without running their constructors. A method of
torch's class that minidp's does not define would then run torch's code on state minidp does not keep (a C++
reducer, FSDP2's param groups) and fail somewhere inside it: :func:`refuse_inherited` replaces each such method
with one that raises, naming it and the way out.

The composable APIs (``fully_shard``, ``replicate``) keep the module itself and swap its class instead, as torch's
do: :func:`give_methods` makes the module an instance of ``<Prefix><its class>``, a subclass of (the methods' class,
its class), so that ``isinstance`` to its own class still holds.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn


def _refusal(name: str, message: Callable[[str], str]) -> Callable[..., Any]:
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(message(name))

    refused.__name__ = name
    return refused


def refuse_inherited(ours: type, theirs: type, message: Callable[[str], str], keep: Iterable[str] = ()) -> None:
    """Give ``ours`` (a subclass of ``theirs``) a refusal for each method of ``theirs`` it does not define itself.

    ``message(name)``: the error's text. Dunder methods and those in ``keep`` are left as they are, as are
    properties and class methods (not callable as found in the class's ``__dict__``).
    """
    kept = set(keep)
    for name, member in vars(theirs).items():
        if callable(member) and not name.startswith("__") and name not in kept and name not in vars(ours):
            setattr(ours, name, _refusal(name, message))


# One class per (methods, original class), made once, as FSDP2 caches its FSDP<cls> classes (_fsdp_init.py).
_CLASSES: dict[tuple[type, type], type] = {}


def give_methods(module: nn.Module, methods: type, prefix: str) -> None:
    """Swap ``module``'s class for ``<prefix><its class>``, a subclass of (``methods``, its class): ``methods``' come
    first, then the class's own; the module keeps its attributes, its forward and ``isinstance`` to its class.
    ``original_class`` on the new class is the module's class before the swap."""
    cls = type(module)
    if (methods, cls) not in _CLASSES:
        # (named in the methods' module: minidp.distributed.fully_shard.FSDPNet, as FSDP2's live in its own)
        _CLASSES[methods, cls] = type(f"{prefix}{cls.__name__}", (methods, cls),
                                      {"original_class": cls, "__module__": methods.__module__})
    module.__class__ = _CLASSES[methods, cls]
