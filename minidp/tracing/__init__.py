"""Seeing every step: ``with minidp.trace() as step:`` records what each replica did, when, and what moved.

Built on :mod:`minidp.hooks`, above the primitives, which never import it:

* ``recorder.py``: :class:`Trace`, the listener that turns calls and autograd hooks into events;
* ``describers.py``: per stage, what a call moved to each replica (bytes, shapes);
* ``memory.py``: the memory ledger (every allocation of the step, per device and replica, by category)
  and the process's peak per device;
* ``views.py``: the table, the Chrome trace and the PNG timeline, and the files they are written to.
"""

from ..hooks import STAGES
from .memory import MemoryPeak
from .recorder import Event, Trace, trace
from .views import STAGE_COLOURS, write_trace_artifacts

__all__ = ["STAGES", "STAGE_COLOURS", "Event", "MemoryPeak", "Trace", "trace", "write_trace_artifacts"]
