"""PyTorch's ``DistributedDataParallelTest`` of ``test/distributed/test_c10d_nccl.py``, which upstream runs on GPUs with
NCCL, ported to the CPU and run against ``minidp.distributed.DistributedDataParallel`` in one job of 2 Gloo processes on
127.0.0.1 (bodies in ``tests/upstream_nccl_ddp_checks.py``); its cases that need several GPUs, CUDA streams or NCCL
itself are not listed (``NOT_PORTED`` names those of the rest that stay out, and why). Every case listed passes on
torch's DDP too (``MINIDP_UPSTREAM_DDP=torch python -m pytest tests/test_upstream_c10d_nccl.py``). Adapted from PyTorch
(BSD 3-clause), copyright the PyTorch contributors.
"""

from __future__ import annotations

import pytest

from . import upstream_nccl_ddp_checks as checks
from .helpers import assert_passed_on_every_rank, assert_ports_match_their_module, launch_upstream


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The checks run in processes of their own, which start with DataParallel's defaults: once, not twice."""


CASES = [
    "test_backend_single_device_module_device_ids_None",
    "test_backend_single_device_module_empty_device_ids",
    "test_ddp_complex_params_and_grads",
    "test_ddp_mixed_real_and_complex_params",
    "test_fp16",
    "test_fp16_grad_is_view",
    "test_arbitrary_forward_return_value",
    "test_arbitrary_forward_return_value_grad_is_view",
    "test_ddp_with_lazy_parameters",
    "test_multiple_outputs_multiple_backward",
    "test_multiple_outputs_multiple_backward_grad_is_view",
    "test_no_grad",
    "test_accumulate_gradients_module",
    "test_accumulate_gradients_module_with_grad_is_view",
    "test_grad_layout_1devicemodule_1replicaperprocess",
    "test_grad_layout_1devicemodule_1replicaperprocess_half",
    "test_ddp_comm_hook_allreduce_with_future",
    "test_ddp_comm_hook_allreduce_with_future_grad_is_view",
    "test_ddp_comm_hook_allreduce_with_future_static_graph",
    "test_default_ddp_comm_hooks",
    "test_default_ddp_comm_hooks_is_view",
    "test_fp16_compress_hook_wrapper",
    "test_fp16_compress_wrapper_is_view",
    "test_powerSGD_ddp_comm_hook",
    "test_powerSGD_ddp_comm_hook_grad_is_view",
    "test_builtin_ddp_comm_hooks",
    "test_builtin_ddp_comm_hooks_grad_is_view",
    "test_comm_hook_allreduce_with_then",
    "test_ddp_weight_sharing",
    "test_ddp_packed_sequence",
    "test_ddp_complex_params",
    "test_bucket_cap_mb_list_initialization",
    "test_bucket_cap_mb_list_default_behavior",
    "test_bucket_cap_mb_alone",
    "test_failure_recovery",
]

NOT_PORTED = {
    "test_default_ddp_comm_hooks_bf16": "torch's DDP refuses a bfloat16 hook without NCCL; minidp's takes it (README)",
    "test_bf16_compress_hook_wrapper": "torch's DDP refuses a bfloat16 hook without NCCL; minidp's takes it (README)",
    "test_bf16_compress_wrapper_is_view": "torch's DDP refuses a bfloat16 hook without NCCL; minidp's takes it (README)",
    "test_find_unused_parameters_kwarg": "checks torch's words for a parameter marked ready twice, which minidp words "
                                         "otherwise (tests/test_upstream_ddp.py runs upstream's other such cases)",
    "test_find_unused_parameters_kwarg_grad_is_view": "as test_find_unused_parameters_kwarg",
    "test_param_layout_mismatch_error": "over Gloo torch's ranks crash after its error; minidp raises on every rank",
}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every case, run once in one job of 2 ranks (the one that makes a new default group last); each rank's results."""
    return launch_upstream(checks.__name__, [(name, {}) for name in CASES])


def test_the_port_lists_every_case_of_its_module():
    assert_ports_match_their_module(CASES, checks, NOT_PORTED)


@pytest.mark.parametrize("name", CASES)
def test_upstream_case(ranks, name):
    assert_passed_on_every_rank(ranks, name)


@pytest.mark.parametrize("name", sorted(NOT_PORTED))
def test_upstream_case_not_ported(name):
    pytest.skip(f"{name}: {NOT_PORTED[name]}")
