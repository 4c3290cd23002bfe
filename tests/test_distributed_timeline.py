"""Per-rank timelines merged into one Chrome trace, and the hidden share of all-reduce time (no processes)."""

from __future__ import annotations

import pytest

from minidp.distributed import chrome_trace, hidden_share


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """minidp.DataParallel's defaults play no part here: once, not under both configurations of tests/conftest.py."""


def event(rank: int, stage: str, bucket, start: float, end: float) -> dict:
    return {"rank": rank, "stage": stage, "bucket": bucket, "start": start, "end": end}


def test_hidden_share_is_the_all_reduce_time_inside_the_backward():
    timeline = [
        event(0, "backward", None, 10.0, 20.0),
        event(0, "all-reduce", 0, 12.0, 16.0),  # 4 s, all inside
        event(0, "all-reduce", 1, 18.0, 24.0),  # 6 s, 2 inside
    ]
    assert hidden_share(timeline) == pytest.approx(6 / 10)
    assert hidden_share([event(0, "backward", None, 0.0, 1.0)]) == 1.0  # nothing to hide


def test_chrome_trace_has_one_process_row_per_rank_and_microseconds_from_the_first_event():
    timelines = [
        [event(0, "backward", None, 100.0, 100.5), event(0, "bucket ready", 0, 100.2, 100.2),
         event(0, "all-reduce", 0, 100.2, 100.7)],
        [event(1, "backward", None, 100.1, 100.6), event(1, "all-reduce", 0, 100.3, 100.8)],
    ]
    events = chrome_trace(timelines)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = {(e["pid"], e["name"]): e for e in events if e["ph"] == "X"}
    assert spans[(0, "backward")]["ts"] == 0.0 and spans[(0, "backward")]["dur"] == pytest.approx(5e5)
    assert spans[(1, "all-reduce 0")]["ts"] == pytest.approx(3e5)
    assert spans[(0, "all-reduce 0")]["tid"] != spans[(0, "backward")]["tid"]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["bucket ready 0"]
