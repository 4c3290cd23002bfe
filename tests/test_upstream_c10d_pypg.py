"""PyTorch's ``TestDDPWithWorkWrapper`` of ``test/distributed/test_c10d_pypg.py``: DDP over a process group written in
Python that ``torch.distributed`` never registered (fault-tolerant trainers build theirs so), run against
``minidp.distributed.DistributedDataParallel`` in one job of one Gloo process (bodies in
``tests/upstream_pypg_checks.py``, which says what is not ported and why). minidp asks the group itself for its rank,
size and backend, as torch's C++ reducer does (``minidp/distributed/groups.py``); it asked ``torch.distributed``'s
functions, which look a group up in the world's map, and every case failed at construction."""

from __future__ import annotations

import pytest

from . import upstream_pypg_checks as checks
from .helpers import assert_passed_on_every_rank, assert_ports_match_their_module, launch_upstream


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The checks run in a process of its own, which starts with DataParallel's defaults: once, not twice."""


CASES = ["test_ddp_invoke_work_object", "test_ddp_with_pypg", "test_ddp_with_pypg_with_grad_views", "test_ddp_no_init_sync"]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every case, run once in one job of one process; its results."""
    return launch_upstream(checks.__name__, [(name, {}) for name in CASES], processes=1)


def test_the_port_lists_every_case_of_its_module():
    assert_ports_match_their_module(CASES, checks, {})


@pytest.mark.parametrize("case", CASES)
def test_upstream_case_passes(ranks, case):
    assert_passed_on_every_rank(ranks, case)
