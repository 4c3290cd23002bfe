"""The replica group (minidp.replica_group): who runs which replica, and meetings that never hang.

Every test that meets runs under ``finishes_within``, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import minidp
from minidp.replica_group import ReplicaGroup, ReplicaGroupError, current

from .helpers import finishes_within

BOUND_S = 10.0


class Records(nn.Module):
    """Returns its input, and keeps the membership its forward ran under."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = current()
        return x


class Meets(nn.Module):
    """Meets the other replicas at each of ``keys`` in turn, depositing ``(its index, the key)``."""

    def __init__(self, *keys: Any) -> None:
        super().__init__()
        self.keys = keys

    def forward(self, x: torch.Tensor) -> list:
        index, _, group = current()
        return [group.meet(index, key, (index, key)) for key in self.keys]


def test_no_membership_outside_parallel_apply():
    assert current() is None


def test_each_replica_runs_as_its_index_in_one_group_of_all_replicas():
    modules = [Records() for _ in range(3)]
    minidp.parallel_apply(modules, [torch.zeros(1)] * 3)
    assert [m.seen.index for m in modules] == [0, 1, 2]
    assert {m.seen.count for m in modules} == {3}
    assert len({id(m.seen.group) for m in modules}) == 1
    assert current() is None  # replica 0 ran in this thread: its membership ended with the call


def test_a_meeting_gives_every_replica_every_value_in_replica_order():
    outputs = finishes_within(BOUND_S, lambda: minidp.parallel_apply([Meets("k")] * 3, [torch.zeros(1)] * 3))
    assert outputs == [[[(0, "k"), (1, "k"), (2, "k")]]] * 3


def test_meeting_at_one_key_again_is_the_next_meeting_at_that_key():
    """``(key, call number)`` names a meeting: the second call at "k" meets the others' second call."""
    module = Meets("k", "other", "k")
    outputs = finishes_within(BOUND_S, lambda: minidp.parallel_apply([module] * 2, [torch.zeros(1)] * 2))
    assert outputs[0] == outputs[1] == [[(0, key), (1, key)] for key in ("k", "other", "k")]


def test_a_parallel_apply_inside_a_replica_has_its_own_group_and_hands_the_outer_one_back():
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = [Records(), Records()]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            minidp.parallel_apply(self.inner, [x, x])
            self.after = current()
            return x

    outer = [Nested(), Nested()]
    finishes_within(BOUND_S, lambda: minidp.parallel_apply(outer, [torch.zeros(1)] * 2))
    for index, module in enumerate(outer):
        assert module.after.index == index and module.after.count == 2
        assert [m.seen.count for m in module.inner] == [2, 2]
        assert module.inner[0].seen.group is not module.after.group


def test_replicas_meeting_at_different_keys_are_released_naming_where_each_waits():
    modules = [Meets("a"), Meets("b")]
    with pytest.raises(ReplicaGroupError, match="replicas wait at different meetings") as caught:
        finishes_within(BOUND_S, lambda: minidp.parallel_apply(modules, [torch.zeros(1)] * 2))
    assert "replica 0 at 'a' (call 1" in str(caught.value) and "replica 1 at 'b' (call 1" in str(caught.value)


def test_a_replica_that_neither_arrives_nor_ends_releases_the_waiter_after_the_timeout():
    """The last resort: replica 1 is stuck elsewhere; replica 0 waits ``timeout`` seconds, then is told why.
    When replica 1 comes later, replica 0 has ended, so it is released at once."""
    group = ReplicaGroup(2, timeout=0.2)
    unblock = threading.Event()
    errors: dict[int, BaseException] = {}

    def replica(index: int) -> None:
        with group.member(index):
            if index == 1:
                unblock.wait(BOUND_S)
            try:
                group.meet(index, "k", index)
            except ReplicaGroupError as error:
                errors[index] = error

    late = threading.Thread(target=replica, args=(1,))
    late.start()
    finishes_within(BOUND_S, lambda: replica(0))
    unblock.set()
    late.join(BOUND_S)
    assert not late.is_alive()
    assert "replica 0 waited 0.2 s at 'k' (call 1 in this forward) for replica 1" in str(errors[0])
    assert "replica 0 stopped waiting at 'k' (call 1 in this forward) before replica 1 came" in str(errors[1])


class RaisesBeforeMeeting(nn.Module):
    """Replica ``failing`` raises a ValueError where the others meet at "k" (a bad sample before SyncBatchNorm)."""

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing = failing

    def forward(self, x: torch.Tensor) -> Any:
        index, _, group = current()
        if index == self.failing:
            raise ValueError("bad sample")
        return group.meet(index, "k", index)


def test_the_error_raised_is_the_failing_replicas_own_not_the_meeting_it_ended_in_the_others():
    # Stock re-raises the first replica's error of its own type (parallel_apply.py, ExceptionWrapper.reraise), which
    # with BatchNorm is the bad sample's; the replicas waiting for replica 2 at SyncBatchNorm's meeting are released
    # with a ReplicaGroupError, which would hide it (and `except ValueError`) if replica 0's came first
    with pytest.raises(ValueError, match="Caught ValueError in replica 2 on device cpu") as caught:
        finishes_within(BOUND_S, lambda: minidp.parallel_apply([RaisesBeforeMeeting(2)] * 3, [torch.zeros(1)] * 3))
    assert "bad sample" in str(caught.value)
