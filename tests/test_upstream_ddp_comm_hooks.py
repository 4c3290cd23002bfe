"""PyTorch's tests of DDP's communication hooks (``test/distributed/algorithms/ddp_comm_hooks/test_ddp_hooks.py``,
class ``DistributedDataParallelCommHookTest``), run against ``minidp.distributed.DistributedDataParallel`` in one job
of 2 Gloo processes on 127.0.0.1. Every upstream case appears here by its upstream name (bodies, and why they run on
the CPU, in ``tests/upstream_ddp_hooks_checks.py``): 4 run, and pass on torch's DDP too
(``MINIDP_UPSTREAM_DDP=torch python -m pytest tests/test_upstream_ddp_comm_hooks.py``); ``GLOO_CANNOT_RUN`` names the
2 that stay out, and why. Adapted from PyTorch (BSD 3-clause), copyright the PyTorch contributors.
"""

from __future__ import annotations

import pytest

from . import upstream_ddp_hooks_checks as checks
from .helpers import assert_passed_on_every_rank, launch_upstream


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The checks run in processes of their own, which start with DataParallel's defaults: once, not under both
    configurations of tests/conftest.py."""


# Upstream's cases that no wrapper can pass over Gloo, and why (each fails alike on torch's DDP).
_QUANTIZATION_HOOKS_READ_NCCL = (
    "torch's quantization hook reads its all_gather's future as NCCL fills it (a list holding the list of outputs) and "
    "indexes it so; Gloo's future holds the outputs themselves, and the hook's own indexing raises (IndexError: invalid "
    "index of a 0-dim tensor)"
)
GLOO_CANNOT_RUN = {
    "test_ddp_comm_hook_quantize_per_tensor_hook": _QUANTIZATION_HOOKS_READ_NCCL,
    "test_ddp_comm_hook_quantize_per_channel_hook": _QUANTIZATION_HOOKS_READ_NCCL,
}
UPSTREAM_CASES = [name for name in vars(checks) if name.startswith("test_")]
CASES = [name for name in UPSTREAM_CASES if name not in GLOO_CANNOT_RUN]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every case, run once in one job of 2 ranks; each rank's results."""
    return launch_upstream(checks.__name__, [(name, {}) for name in CASES])


def test_every_upstream_case_is_here_in_upstreams_order():
    assert UPSTREAM_CASES == [
        "test_ddp_comm_hook_allreduce_hook", "test_ddp_comm_hook_fp16compress_hook",
        "test_ddp_comm_hook_quantize_per_tensor_hook", "test_ddp_comm_hook_quantize_per_channel_hook",
        "test_ddp_comm_hook_noop_hook", "test_is_last_hook",
    ]


@pytest.mark.parametrize("name", CASES)
def test_upstream_comm_hook_case_on_the_cpu(ranks, name):
    assert_passed_on_every_rank(ranks, name)


@pytest.mark.parametrize("name", sorted(GLOO_CANNOT_RUN))
def test_upstream_comm_hook_case_gloo_cannot_run(name):
    pytest.skip(f"{name}: {GLOO_CANNOT_RUN[name]}")
