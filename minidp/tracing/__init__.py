"""Seeing every step: the tracer, built on the hooks of :mod:`minidp.hooks`."""

from .recorder import *  # noqa: F401,F403  (split into recorder, describers, memory and views next)
from .recorder import Trace, trace, traced, stage, write_trace_artifacts, STAGES, STAGE_COLOURS  # noqa: F401
