"""Three views of a trace: a text table, the Chrome trace format, a PNG timeline; and the files they go to."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union

from ..device_ids import device_order
from ..hooks import STAGES
from .memory import LedgerRow, MemoryPeak


class Recorded(Protocol):
    """What the views read of a :class:`~minidp.tracing.Trace`."""

    events: list  # of minidp.tracing.Event
    duration: float
    memory: list[MemoryPeak]
    steps: int  # data-parallel steps (forwards) run while it recorded

STAGE_COLOURS = {
    "scatter": "#4c72b0", "replicate": "#8172b3", "forward": "#55a868",
    "gather": "#ccb974", "backward": "#c44e52", "reduce": "#dd8452",
}


def _lane_order(lane: tuple[str, Optional[int]]) -> tuple[tuple[str, int], int]:
    """A ``(device, replica)`` track as a sort key: device order, then the replica (none first: the device's own)."""
    return device_order(lane[0]), -1 if lane[1] is None else lane[1]


def lanes(step: Recorded) -> list[tuple[str, Optional[int]]]:
    """``(device, replica)`` of every track, in device then replica order."""
    return sorted({(e.device, e.replica) for e in step.events}, key=_lane_order)


def summary(step: Recorded) -> list[dict[str, Any]]:
    """One row per stage and device: wall time, busy thread time, share of the step, bytes."""
    rows = []
    for name in STAGES:
        for device in sorted({e.device for e in step.events if e.stage == name}, key=device_order):
            events = [e for e in step.events if e.stage == name and e.device == device]
            wall = union_length([(e.start, e.end) for e in events])
            busy = sum(
                union_length([(e.start, e.end) for e in events if e.thread == thread])
                for thread in {e.thread for e in events}
            )
            rows.append({
                "stage": name, "device": device,
                "replicas": sorted({e.replica for e in events if e.replica is not None}),
                "wall_s": wall, "busy_s": busy,
                "share": wall / step.duration if step.duration else 0.0,
                "bytes": sum(e.bytes for e in events),
            })
    return rows


def table(step: Recorded) -> str:
    """The step as text: per stage and device, wall time, its share of the step, thread time, bytes."""
    lines = [
        f"{steps_text(step.steps)}: {step.duration * 1e3:.2f} ms, {len(step.events)} events",
        f"{'stage':<10} {'device':<8} {'replicas':<9} {'wall ms':>9} {'share':>7} {'busy ms':>9} {'bytes':>12}",
    ]
    for row in summary(step):
        lines.append(
            f"{row['stage']:<10} {row['device']:<8} {_ranges_text(row['replicas']):<9} {row['wall_s'] * 1e3:>9.3f} "
            f"{row['share']:>6.1%} {row['busy_s'] * 1e3:>9.3f} {bytes_text(row['bytes']):>12}"
        )
    covered = union_length([(e.start, e.end) for e in step.events])
    lines.append(
        f"{'(other)':<10} {'':<8} {'':<9} {(step.duration - covered) * 1e3:>9.3f} "
        f"{(1 - covered / step.duration if step.duration else 0):>6.1%}   outside every stage (loss, optimizer, Python)"
    )
    lines.append(
        "wall: time the stage was running on the device; busy: summed over threads (parallel replicas add up); "
        "bytes: copied to fresh memory"
    )
    for peak in step.memory:
        lines.append(f"peak memory {peak.device}: {bytes_text(peak.bytes)} ({peak.measure})")
    return "\n".join(lines)


def steps_text(steps: int) -> str:
    """The table's heading: how many steps the trace covers ("one traced step", "3 traced steps"), so that the
    times of a traced loop are not read as one step's."""
    return "one traced step" if steps == 1 else f"{steps} traced steps"


LEDGER_NOTE = (
    "counted from the step's allocations (minidp/tracing/memory.py); a category's figure is the most it held "
    "at once, so they need not add up to the peak"
)


def ledger_table(rows: list[LedgerRow], title: str = "") -> str:
    """The memory ledger: per device and replica, the peak; per category, the most it held and its part of the peak."""
    lines = [title] if title else []
    lines.append(f"{'':<20} {'most held':>12} {'at the peak':>12}")
    for row in rows:
        allocator = "" if row.allocator_peak is None else f"   (allocator's peak {bytes_text(row.allocator_peak)})"
        lines.append(f"{row.label:<20} {bytes_text(row.peak):>12} {bytes_text(row.peak):>12}   peak{allocator}")
        for category in row.held:
            lines.append(f"{'  ' + category:<20} {bytes_text(row.held[category]):>12} "
                         f"{bytes_text(row.at_peak[category]):>12}")
    lines.append(LEDGER_NOTE)
    return "\n".join(lines)


def ledgers_side_by_side(ledgers: dict[str, list[LedgerRow]]) -> str:
    """Several runs' ledgers in one table (``ledgers``: title -> rows): per device and replica, the peak and
    the most each category held, a column per run."""
    titles = list(ledgers)
    keyed = {title: {(row.device, row.replica): row for row in rows} for title, rows in ledgers.items()}
    keys = sorted({key for rows in keyed.values() for key in rows}, key=_lane_order)
    width = max(18, *map(len, titles))
    lines = [f"{'':<20} " + " ".join(f"{title:>{width}}" for title in titles)]
    for key in keys:
        rows = {title: keyed[title].get(key) for title in titles}
        shown = next(row for row in rows.values() if row is not None)
        labels = ["peak", *dict.fromkeys(c for row in rows.values() if row is not None for c in row.held)]
        for label in labels:
            cells = []
            for title in titles:
                row = rows[title]
                value = None if row is None else row.peak if label == "peak" else row.held.get(label)
                cells.append(f"{'-' if value is None else bytes_text(value):>{width}}")
            name = shown.label if label == "peak" else "  " + label
            lines.append(f"{name:<20} " + " ".join(cells))
        allocator = [rows[t].allocator_peak if rows[t] is not None else None for t in titles]
        if any(value is not None for value in allocator):
            lines.append(f"{'  allocator peak':<20} " + " ".join(
                f"{'-' if value is None else bytes_text(value):>{width}}" for value in allocator))
    lines.append(LEDGER_NOTE)
    return "\n".join(lines)


def chrome_trace(step: Recorded) -> dict[str, Any]:
    """The Chrome trace format: one process per device, one track per replica."""
    devices = sorted({e.device for e in step.events}, key=device_order)
    pid = {device: number + 1 for number, device in enumerate(devices)}
    events: list[dict[str, Any]] = []
    for device in devices:
        events.append({"ph": "M", "name": "process_name", "pid": pid[device], "tid": 0, "args": {"name": device}})
    for device, replica in lanes(step):
        events.append({"ph": "M", "name": "thread_name", "pid": pid[device], "tid": _tid(replica),
                       "args": {"name": "host" if replica is None else f"replica {replica}"}})
    first = devices[0] if devices else "cpu"
    events.append({"ph": "X", "name": "step", "cat": "minidp", "pid": pid.get(first, 1), "tid": 0,
                   "ts": 0.0, "dur": step.duration * 1e6, "args": {}})
    for e in step.events:
        events.append({
            "ph": "X", "name": e.stage, "cat": "minidp", "pid": pid[e.device], "tid": _tid(e.replica),
            "ts": e.start * 1e6, "dur": e.duration * 1e6,
            "args": {"bytes": e.bytes, "replica": e.replica, "thread": e.thread, "detail": e.detail},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome(step: Recorded, path: Union[str, Path]) -> Path:
    """Write :func:`chrome_trace` as JSON; open it in https://ui.perfetto.dev or chrome://tracing."""
    return write_atomically(Path(path), lambda file: file.write(json.dumps(chrome_trace(step), indent=1).encode()))


def plot(step: Recorded, path: Union[str, Path]) -> Path:
    """Draw the step as a PNG timeline: one lane per device and replica, one colour per stage."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError("Trace.plot needs matplotlib: pip install 'minidp[plot]'") from error
    tracks = lanes(step)
    figure = Figure(figsize=(9, 1.2 + 0.45 * len(tracks)), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for lane, (device, replica) in enumerate(tracks):
        for e in step.events:
            if (e.device, e.replica) == (device, replica):
                axes.broken_barh([(e.start * 1e3, e.duration * 1e3)], (lane - 0.4, 0.8), color=STAGE_COLOURS[e.stage])
    axes.set_yticks(range(len(tracks)), [f"{d} replica {r}" if r is not None else d for d, r in tracks])
    axes.invert_yaxis()
    axes.set_xlim(0, step.duration * 1e3)
    axes.set_xlabel("ms since the step began")
    axes.legend(handles=[Patch(color=STAGE_COLOURS[s], label=s) for s in STAGES], ncols=len(STAGES),
                loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False, fontsize="small")
    figure.tight_layout()
    return write_atomically(Path(path), lambda file: figure.savefig(file, format="png"))


def write_atomically(path: Path, write: Callable[[Any], Any]) -> Path:
    """Write ``path`` through a fresh temporary file in the same directory, then ``os.replace`` it.

    A symlink (or any file) planted at ``path`` is replaced, never followed, and a reader never sees
    a half-written file.
    """
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def write_trace_artifacts(step: Recorded, directory: Union[str, Path]) -> dict[str, Path]:
    """Write ``table.txt``, ``trace.json`` (Chrome/Perfetto) and ``timeline.png`` into ``directory``.

    The PNG is skipped (and left out of the result) when matplotlib is not installed.
    """
    text = (table(step) + "\n").encode()  # first: a trace still recording refuses to be read, before any folder is made
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = {
        "table": write_atomically(directory / "table.txt", lambda file: file.write(text)),
        "chrome": write_chrome(step, directory / "trace.json"),
    }
    try:
        written["timeline"] = plot(step, directory / "timeline.png")
    except ImportError:
        pass
    return written


def _tid(replica: Optional[int]) -> int:
    return 0 if replica is None else replica + 1


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _ranges_text(replicas: list[int]) -> str:
    if not replicas:
        return "-"
    if replicas == list(range(replicas[0], replicas[-1] + 1)) and len(replicas) > 1:
        return f"{replicas[0]}-{replicas[-1]}"
    return ",".join(map(str, replicas))


def bytes_text(n: float) -> str:
    """``n`` bytes in the largest unit, up to GiB, that leaves fewer than 1024 of it once rounded to one decimal
    (1,048,575 B is "1.0 MiB", not "1024.0 KiB")."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if abs(round(n, 1)) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
