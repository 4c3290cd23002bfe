"""The replicas of one parallel_apply call, as a group that code inside a replica can meet in.

:func:`minidp.parallel_apply` makes a :class:`ReplicaGroup` for each call and runs replica ``i``
as its member ``i``. Code running inside a replica (a layer's ``forward``) asks :func:`current`
which replica it is, and can hand a value to the others at a meeting point:

    membership = minidp.replica_group.current()       # None outside parallel_apply
    if membership is not None:
        index, count, group = membership
        values = group.meet(index, key, my_value)       # every replica's value, in replica order

A meeting is named by ``(key, call number)``: the n-th time a replica meets at ``key`` it joins
the n-th meeting at ``key``, so a layer called twice in one forward meets twice. ``key`` is any
hashable value that the replicas share; :class:`minidp.SyncBatchNorm` uses a token stored on the
layer, which every replica of the layer shares because replicas are shallow copies.

What moves: nothing is copied. ``meet`` returns the very objects the replicas deposited; tensors
stay on the device of the replica that made them, and autograd sees whatever ops the caller then
applies to them (a ``.to(device)`` is one node per move).

Why a meeting cannot hang. Each waiting replica is released, with a :class:`ReplicaGroupError`
that names the replica at fault and the meeting, as soon as the meeting can no longer complete:

* a replica that has not deposited raised (the error says which exception; it is attached as
  the cause), or finished its forward without reaching the meeting (it took another path);
* every replica still running waits at some meeting and none of those meetings is complete
  (replicas reached layers in different orders);
* as a last resort, ``timeout`` seconds passed (a replica stuck in something else).

The group lives for one call, so the next call starts clean.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Hashable, NamedTuple, Optional, Sequence

from torch import nn

DEFAULT_TIMEOUT_S = 300.0
"""How long a meeting waits for a replica that neither arrives nor ends (read when a group is made)."""


class ReplicaGroupError(RuntimeError):
    """A meeting that could not complete: the message names the replica at fault and the meeting."""


class Membership(NamedTuple):
    """Which replica the calling thread runs: its index, how many replicas run, their group."""

    index: int
    count: int
    group: "ReplicaGroup"


_local = threading.local()


def current() -> Optional[Membership]:
    """The calling thread's membership, or ``None`` when it runs no replica of a parallel_apply call."""
    return getattr(_local, "membership", None)


class _Member:
    """Context manager: the calling thread runs replica ``index`` of ``group`` until the block ends.

    The previous membership is restored on exit, so a parallel_apply nested inside a replica makes
    a group of its own and hands the outer one back afterwards.
    """

    __slots__ = ("group", "index", "previous")

    def __init__(self, group: "ReplicaGroup", index: int) -> None:
        self.group, self.index = group, index

    def __enter__(self) -> Membership:
        self.previous = current()
        _local.membership = membership = Membership(self.index, self.group.count, self.group)
        return membership

    def __exit__(self, kind, error, traceback) -> None:
        _local.membership = self.previous
        self.group._end(self.index, error)


class _Meeting:
    """The values deposited so far at one ``(key, call number)``, how many replicas took the result,
    and the replicas released from it (whose values were withdrawn: it can no longer complete)."""

    __slots__ = ("values", "taken", "abandoned")

    def __init__(self) -> None:
        self.values: dict[int, Any] = {}
        self.taken = 0
        self.abandoned: dict[int, BaseException] = {}


class ReplicaGroup:
    """The ``count`` replicas of one parallel_apply call (``replicas``: their modules, to name layers).

    ``outer``: the membership of the thread that made the group, where a parallel_apply runs inside a replica of
    another (a nested ``data_parallel``): the replica this group's replicas together stand for, in that call's group.
    """

    def __init__(
        self, count: int, replicas: Optional[Sequence[nn.Module]] = None, timeout: Optional[float] = None
    ) -> None:
        self.count = count
        self.outer = current()
        self.replicas = replicas
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        self._changed = threading.Condition()  # guards everything below; notified on every deposit and end
        self._calls: list[dict[Hashable, int]] = [{} for _ in range(count)]
        self._meetings: dict[tuple[Hashable, int], _Meeting] = {}
        self._waiting: dict[int, tuple[tuple[Hashable, int], Optional[nn.Module]]] = {}
        self._ended: dict[int, Optional[BaseException]] = {}  # replica -> what it raised (None: it returned)
        self._released: dict[int, ReplicaGroupError] = {}  # replica -> the error this group released it with

    def member(self, index: int) -> _Member:
        """Run the block as replica ``index``; when it ends (returns or raises), the others are told."""
        return _Member(self, index)

    def meet(
        self, index: int, key: Hashable, value: Any, *, where: Optional[nn.Module] = None
    ) -> list[Any]:
        """Deposit ``value`` as replica ``index`` and wait for the others; every replica's value, in order.

        ``where``: the module meeting (a layer of replica ``index``), to name it in errors.
        Raises :class:`ReplicaGroupError` when the meeting can no longer complete (see the module).
        """
        with self._changed:
            call = self._calls[index].get(key, 0)
            self._calls[index][key] = call + 1
            name = (key, call)
            meeting = self._meetings.setdefault(name, _Meeting())
            meeting.values[index] = value
            self._changed.notify_all()
            self._waiting[index] = (name, where)
            deadline = time.monotonic() + self.timeout
            try:
                while len(meeting.values) < self.count:
                    self._raise_if_stuck(index, meeting, deadline)
                    self._changed.wait(max(0.0, deadline - time.monotonic()))
            except BaseException as error:  # released, or interrupted: withdraw, so the meeting cannot complete
                del meeting.values[index]
                meeting.abandoned[index] = error
                raise
            finally:
                del self._waiting[index]
            meeting.taken += 1
            if meeting.taken == self.count:  # the last reader frees it: the group holds no values past a meeting
                del self._meetings[name]
            return [meeting.values[i] for i in range(self.count)]

    def _raise_if_stuck(self, index: int, meeting: _Meeting, deadline: float) -> None:
        """Release replica ``index`` with an error if its ``meeting`` can no longer complete."""
        for i, error in meeting.abandoned.items():
            self._release(
                index, f"replica {i} stopped waiting at {self._place(index)} before replica {index} came: {error}",
                error.__cause__,
            )
        absent = [i for i in range(self.count) if i not in meeting.values]
        for i in absent:
            if i in self._ended:
                self._release(index, *self._why_ended(i, self._place(index)))
        running = [i for i in range(self.count) if i not in self._ended]
        if all(i in self._waiting and len(self._meetings[self._waiting[i][0]].values) < self.count for i in running):
            places = "; ".join(f"replica {i} at {self._place(i)}" for i in running)
            self._release(
                index,
                f"replicas wait at different meetings and none can complete: {places}. Every replica must "
                f"reach the synchronised layers in the same order.",
            )
        if time.monotonic() >= deadline:
            late = ", ".join(map(str, absent))
            self._release(
                index,
                f"replica {index} waited {self.timeout:g} s at {self._place(index)} for replica"
                f"{'s' if len(absent) > 1 else ''} {late}, which neither reached it nor finished its forward. "
                f"If a replica is only slow, raise minidp.replica_group.DEFAULT_TIMEOUT_S.",
            )

    def _why_ended(self, i: int, place: str) -> tuple[str, Optional[BaseException]]:
        """Why replica ``i``'s end releases a meeting at ``place``: the message and the root cause."""
        error = self._ended[i]
        if error is None:
            return (
                f"replica {i} finished its forward without reaching {place}: every replica must call each "
                f"synchronised layer the same number of times in one forward (a branch that skips the "
                f"layer in some replicas cannot be synchronised).",
                None,
            )
        if error is self._released.get(i):  # released itself: pass its reason (and root cause) on
            return str(error), error.__cause__
        return (
            f"replica {i} raised {type(error).__name__}: {error} before reaching {place}; the other "
            f"replicas stopped waiting there. Its traceback is attached as the cause.",
            error,
        )

    def _release(self, index: int, message: str, cause: Optional[BaseException] = None) -> None:
        """Raise, for replica ``index``, the error that releases it from its meeting."""
        error = ReplicaGroupError(message)
        self._released[index] = error
        raise error from cause

    def _place(self, index: int) -> str:
        """Where replica ``index`` waits, as messages name it: the module's name in that replica, the call number."""
        (key, call), where = self._waiting[index]
        what = repr(key)
        if where is not None:
            root = self.replicas[index] if self.replicas is not None else None
            named = root.named_modules() if isinstance(root, nn.Module) else ()
            path = next((name for name, module in named if module is where), "")
            what = f"{type(where).__name__} '{path}'" if path else type(where).__name__
        return f"{what} (call {call + 1} in this forward)"

    def _end(self, index: int, error: Optional[BaseException]) -> None:
        with self._changed:
            self._ended[index] = error
            self._changed.notify_all()
