"""PyTorch's tests of the composable ``replicate`` API (``test/distributed/_composable/test_replicate.py``, classes
``ReplicateStateDictTest`` and ``ReplicateTest``), run against ``minidp.distributed.replicate`` in one job of 2 Gloo
processes on 127.0.0.1. Every upstream case appears here by its upstream name (bodies in
``tests/upstream_replicate_checks.py``): 8 run, and pass on torch's own ``replicate`` too
(``MINIDP_UPSTREAM_DDP=torch python -m pytest tests/test_upstream_replicate.py``); ``NOT_PORTED`` names the one
that stays out, and why. Adapted from PyTorch (BSD 3-clause), copyright the PyTorch contributors.
"""

from __future__ import annotations

import pytest

from . import upstream_replicate_checks as checks
from .helpers import assert_passed_on_every_rank, assert_ports_match_their_module, launch_upstream


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The checks run in processes of their own, which start with DataParallel's defaults: once, not under both
    configurations of tests/conftest.py."""


CASES = [
    "test_replicate_single_module_save_load",
    "test_replicate_non_root_multiple_save_load",
    "test_replicate_single_module",
    "test_replicate_ignore_module",
    "test_replicate_multi_module",
    "test_replicate_with_kwargs",
    "test_replicate_device_id",
    "test_replicate_wrong_device_id_type",
]

NOT_PORTED = {
    "test_replicate_move_args_kwargs_to_device": "skip_if_lt_x_gpu(2): CPU inputs moved to the module's GPU by DDP's "
                                                 "forward; on the CPU there is nothing to move",
}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every case, run once in one job of 2 ranks; each rank's results."""
    return launch_upstream(checks.__name__, [(name, {}) for name in CASES])


def test_every_upstream_case_is_ported_or_named_with_its_reason():
    assert_ports_match_their_module(CASES, checks, NOT_PORTED)
    assert len(CASES) + len(NOT_PORTED) == 9  # upstream's two classes: 2 state-dict cases, 7 training cases


@pytest.mark.parametrize("name", CASES)
def test_upstream_replicate_case(ranks, name):
    assert_passed_on_every_rank(ranks, name)


@pytest.mark.parametrize("name", sorted(NOT_PORTED))
def test_upstream_replicate_case_not_ported(name):
    pytest.skip(f"{name}: {NOT_PORTED[name]}")
