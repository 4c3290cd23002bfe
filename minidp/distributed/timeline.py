"""Several ranks' timelines of a step, merged into one Chrome trace (``chrome://tracing``, Perfetto).

Each rank's :meth:`DistributedDataParallel.timeline` (or :func:`~minidp.distributed.sharded_timeline`)
lists its events with times in seconds since the Unix epoch, so the ranks of one machine share a
clock. In the trace every rank is one process row; inside it, one thread row holds the compute
(DDP's backward and write-back; a sharded module's forwards, backwards and copy-outs), one the
instants at which buckets filled, one per bucket its all-reduce, and, for a sharded module, one row
of all-gathers and one of reduce-scatters: a collective that ends before the compute around it
does was hidden behind it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Union

import torch.distributed as dist

from ..tracing.views import write_atomically

_COMPUTE, _READY = 0, 1  # thread rows; all-reduces of bucket b go on row 2 + b
_SHARDED_ROWS = {"all-gather": (2, "all-gathers"), "reduce-scatter": (3, "reduce-scatters")}  # no all-reduce there


def _row(event: dict) -> tuple[int, str]:
    if event["stage"] == "all-reduce":
        return 2 + event["bucket"], f"all-reduce bucket {event['bucket']}"
    if event["stage"] == "bucket ready":
        return _READY, "buckets ready"
    if event["stage"] in _SHARDED_ROWS:
        return _SHARDED_ROWS[event["stage"]]
    return _COMPUTE, "forward and backward" if "group" in event else "backward"  # a sharded group's, or DDP's


def chrome_trace(timelines: Sequence[Sequence[dict]]) -> dict:
    """One Chrome trace (a JSON-ready dict) of ``timelines``, one per rank; times from the earliest event."""
    events = [e for timeline in timelines for e in timeline]
    origin = min((e["start"] for e in events), default=0.0)
    trace: list[dict] = []
    for rank in sorted({e["rank"] for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
    for rank, tid, row_name in sorted({(e["rank"], *_row(e)) for e in events}):
        trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": row_name}})
    for e in events:
        name = e["stage"] if e["bucket"] is None else f"{e['stage']} {e['bucket']}"
        where = {"pid": e["rank"], "tid": _row(e)[0], "ts": (e["start"] - origin) * 1e6}
        if e["stage"] == "bucket ready":
            trace.append({"name": name, "ph": "i", "s": "t", **where})
        else:
            trace.append({"name": name, "ph": "X", "dur": (e["end"] - e["start"]) * 1e6, **where})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: Union[str, Path], timelines: Sequence[Sequence[dict]]) -> Path:
    """Write :func:`chrome_trace` of ``timelines`` to ``path`` (JSON); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(chrome_trace(timelines)).encode()
    return write_atomically(path, lambda file: file.write(text))


def plot_timelines(path: Union[str, Path], timelines: Sequence[Sequence[dict]]) -> Path:
    """Draw ``timelines`` as a PNG: per rank, the backward and each bucket's all-reduce on lanes of their
    own, so that the overlap shows: an all-reduce bar inside the backward's span was hidden behind it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("plot_timelines needs matplotlib: pip install 'minidp[plot]'") from error
    events = [e for timeline in timelines for e in timeline]
    origin = min((e["start"] for e in events), default=0.0)
    lanes = sorted({(e["rank"], *_row(e)) for e in events if e["stage"] != "bucket ready"})
    colours = {"backward": "#c44e52", "write-back": "#8172b3", "all-reduce": "#dd8452", "forward": "#4c72b0",
               "copy-out": "#8172b3", "all-gather": "#55a868", "reduce-scatter": "#dd8452"}
    figure = Figure(figsize=(9, 1.2 + 0.4 * len(lanes)), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for lane, (rank, tid, _) in enumerate(lanes):
        for e in events:
            if e["rank"] == rank and _row(e)[0] == tid and e["stage"] != "bucket ready":
                start = (e["start"] - origin) * 1e3
                axes.broken_barh([(start, (e["end"] - e["start"]) * 1e3)], (lane - 0.4, 0.8), color=colours[e["stage"]])
            elif e["rank"] == rank and e["stage"] == "bucket ready" and tid == 2 + e["bucket"]:
                axes.plot([(e["start"] - origin) * 1e3], [lane], marker="|", color="black", markersize=14)
    axes.set_yticks(range(len(lanes)), [f"rank {rank}: {name}" for rank, _, name in lanes])
    axes.invert_yaxis()
    axes.set_xlabel("ms since the first event (|: the bucket filled and its all-reduce was launched)")
    figure.tight_layout()
    return write_atomically(Path(path), lambda file: figure.savefig(file, format="png"))


def gather_timelines(timeline: list[dict], group: dist.ProcessGroup = None) -> list[list[dict]]:
    """Every rank's ``timeline``, on every rank, in rank order (a collective)."""
    everyone: list[list[dict]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, timeline, group=group)
    return everyone


def hidden_share(timeline: Sequence[dict]) -> float:
    """The share of all-reduce time that overlapped the backward, over one rank's timeline (0 to 1;
    1 when there was no all-reduce time at all)."""
    backward = [e for e in timeline if e["stage"] == "backward"]
    reduces = [e for e in timeline if e["stage"] == "all-reduce"]
    total = sum(e["end"] - e["start"] for e in reduces)
    if not backward or total <= 0:
        return 1.0
    start, end = backward[0]["start"], backward[0]["end"]
    hidden = sum(max(0.0, min(e["end"], end) - max(e["start"], start)) for e in reduces)
    return hidden / total
