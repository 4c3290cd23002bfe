"""PyTorch's ``DistributedDataParallelTest`` of ``test/distributed/test_c10d_gloo.py``, with what it inherits
from ``test/distributed/test_c10d_common.py`` (``CommonDistributedDataParallelTest``), run against
``minidp.distributed.DistributedDataParallel`` in one job of 2 Gloo processes on 127.0.0.1.

Every upstream test name of the class appears here once. Ported (bodies in
``tests/upstream_ddp_checks.py``): the cases upstream runs on the CPU, and the cases upstream gates on
GPUs only because it places the model on ``cuda:rank`` (activation checkpointing, dataclass outputs,
buffers synchronised over two forwards, saving and loading a checkpoint, the CPU half of the unused-
parameter cases): these run on the CPU with ``device_ids=None``. Skipped, with the reason: the cases
that need several GPUs per process, CUDA tensors, or torch's CUDA-only ``SyncBatchNorm``. Adapted
from PyTorch (BSD 3-clause), copyright the PyTorch contributors.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powerSGD

from . import upstream_ddp_checks as checks
from .helpers import assert_passed_on_every_rank, launch_upstream


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


CASES = [
    ("test_gloo_backend_cpu_module", {}),
    ("test_gloo_backend_cpu_module_grad_is_view", {}),
    ("test_global_local_unused_params_grad", {}),
    ("test_global_local_unused_params_grad_with_grad_is_view", {}),
    ("test_global_local_unused_params_grad_with_static_graph", {}),
    ("test_find_unused_parameters_when_unused_parameters_empty", {}),
    ("test_ignored_output", {}),
    ("test_ignored_output_with_unused_parameters", {}),
    ("test_save_load_checkpoint", {}),
    ("test_sparse_gradients", {}),
    ("test_sparse_gradients_grad_is_view", {}),
    ("test_ddp_comm_hook_future_passing_cpu", {}),
    ("test_ddp_invalid_comm_hook_init", {}),
    ("test_ddp_invalid_comm_hook_return_type", {}),
    ("test_ddp_comm_hook_register_just_once", {}),
    ("test_ddp_comm_hook_sparse_gradients", {}),
    ("test_ddp_checkpointing_once", {"use_reentrant": True}),
    ("test_ddp_checkpointing_once", {"use_reentrant": False}),
    ("test_ddp_checkpointing_unused_params", {"use_reentrant": True}),
    ("test_ddp_checkpointing_unused_params", {"use_reentrant": False}),
    ("test_ddp_checkpointing_twice", {"use_reentrant": True}),
    ("test_ddp_checkpointing_twice", {"use_reentrant": False}),
    ("test_ddp_checkpointing_twice_static_graph", {"use_reentrant": True}),
    ("test_ddp_checkpointing_twice_static_graph", {"use_reentrant": False}),
    ("test_ddp_checkpointing_dynamic_module", {}),
    ("test_ddp_checkpointing_dynamic_weight_sharing", {}),
    ("test_ddp_checkpointing_weight_sharing", {"use_reentrant": True}),
    ("test_ddp_checkpointing_weight_sharing", {"use_reentrant": False}),
    ("test_ddp_checkpointing_twice_weight_sharing", {}),
    ("test_ddp_buffer_sync_multi_forward_with_batchnorm", {}),
    ("test_dataclass_output", {}),
    ("test_dataclass_output_unused_param", {}),
]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every case of CASES, run once in one job of 2 ranks; each rank's results."""
    return launch_upstream(checks.__name__, CASES)


# ---- ported: each passes on every rank --------------------------------------------------------------


def test_gloo_backend_cpu_module(ranks):
    assert_passed_on_every_rank(ranks, "test_gloo_backend_cpu_module")


def test_gloo_backend_cpu_module_grad_is_view(ranks):
    assert_passed_on_every_rank(ranks, "test_gloo_backend_cpu_module_grad_is_view")


def test_global_local_unused_params_grad(ranks):
    assert_passed_on_every_rank(ranks, "test_global_local_unused_params_grad")


def test_global_local_unused_params_grad_with_grad_is_view(ranks):
    assert_passed_on_every_rank(ranks, "test_global_local_unused_params_grad_with_grad_is_view")


def test_global_local_unused_params_grad_with_static_graph(ranks):
    assert_passed_on_every_rank(ranks, "test_global_local_unused_params_grad_with_static_graph")


def test_find_unused_parameters_when_unused_parameters_empty(ranks):
    assert_passed_on_every_rank(ranks, "test_find_unused_parameters_when_unused_parameters_empty")


def test_ignored_output(ranks):
    assert_passed_on_every_rank(ranks, "test_ignored_output")


def test_ignored_output_with_unused_parameters(ranks):
    assert_passed_on_every_rank(ranks, "test_ignored_output_with_unused_parameters")


def test_save_load_checkpoint(ranks):
    assert_passed_on_every_rank(ranks, "test_save_load_checkpoint")


def test_sparse_gradients(ranks):
    assert_passed_on_every_rank(ranks, "test_sparse_gradients")


def test_sparse_gradients_grad_is_view(ranks):
    assert_passed_on_every_rank(ranks, "test_sparse_gradients_grad_is_view")


def test_ddp_comm_hook_future_passing_cpu(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_comm_hook_future_passing_cpu")


def test_ddp_invalid_comm_hook_init(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_invalid_comm_hook_init")


def test_ddp_invalid_comm_hook_return_type(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_invalid_comm_hook_return_type")


def test_ddp_comm_hook_register_just_once(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_comm_hook_register_just_once")


def test_ddp_comm_hook_sparse_gradients(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_comm_hook_sparse_gradients")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_ddp_checkpointing_once(ranks, use_reentrant):
    assert_passed_on_every_rank(ranks, f"test_ddp_checkpointing_once[{use_reentrant}]")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_ddp_checkpointing_unused_params(ranks, use_reentrant):
    assert_passed_on_every_rank(ranks, f"test_ddp_checkpointing_unused_params[{use_reentrant}]")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_ddp_checkpointing_twice(ranks, use_reentrant):
    assert_passed_on_every_rank(ranks, f"test_ddp_checkpointing_twice[{use_reentrant}]")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_ddp_checkpointing_twice_static_graph(ranks, use_reentrant):
    assert_passed_on_every_rank(ranks, f"test_ddp_checkpointing_twice_static_graph[{use_reentrant}]")


def test_ddp_checkpointing_dynamic_module(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_checkpointing_dynamic_module")


def test_ddp_checkpointing_dynamic_weight_sharing(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_checkpointing_dynamic_weight_sharing")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_ddp_checkpointing_weight_sharing(ranks, use_reentrant):
    assert_passed_on_every_rank(ranks, f"test_ddp_checkpointing_weight_sharing[{use_reentrant}]")


def test_ddp_checkpointing_twice_weight_sharing(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_checkpointing_twice_weight_sharing")


def test_ddp_buffer_sync_multi_forward_with_batchnorm(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_buffer_sync_multi_forward_with_batchnorm")


def test_dataclass_output(ranks):
    assert_passed_on_every_rank(ranks, "test_dataclass_output")


def test_dataclass_output_unused_param(ranks):
    assert_passed_on_every_rank(ranks, "test_dataclass_output_unused_param")


def test_invalid_powerSGD_state():
    # No process group needed: PowerSGD's state refuses error feedback or warm start before iteration 2.
    for start_powerSGD_iter, use_error_feedback, warm_start in product([0, 1], [True, False], [True, False]):
        if not use_error_feedback and not warm_start:
            continue
        with pytest.raises(
            ValueError,
            match="Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
            "because PowerSGD can only be applied after the first two iterations in DDP.",
        ):
            powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=start_powerSGD_iter, use_error_feedback=use_error_feedback,
                                   warm_start=warm_start)


# ---- not ported: they need CUDA ---------------------------------------------------------------------


NEEDS_CUDA = {
    "test_gloo_backend_1gpu_module_device_ids_integer_list": "a CUDA module with device_ids=[gpu] (skip_if_lt_x_gpu(2))",
    "test_gloo_backend_1gpu_module_device_ids_torch_device_list": "a CUDA module with device_ids=[gpu] (skip_if_lt_x_gpu(2))",
    "test_gloo_backend_2gpu_module": "a module spread over 2 GPUs per process (skip_if_lt_x_gpu(4))",
    "test_gloo_backend_4gpu_module": "a module spread over 4 GPUs per process (skip_if_lt_x_gpu(8))",
    "test_ignored_sharded_tensor": "a ShardedTensor placed on cuda:rank (skip_if_lt_x_gpu(2))",
    "test_ddp_comm_hook_future_passing_gpu_gloo": "the Future of a hook on CUDA gradients over Gloo (skip_if_lt_x_gpu(2))",
    "test_sync_batch_norm_only_empty_input": "torch.nn.SyncBatchNorm, which trains on CUDA tensors only (skip_if_lt_x_gpu(2))",
    "test_sync_batch_norm_empty_input": "torch.nn.SyncBatchNorm, which trains on CUDA tensors only (skip_if_lt_x_gpu(2))",
}


@pytest.mark.parametrize("name", sorted(NEEDS_CUDA))
def test_needs_cuda_upstream(name):
    pytest.skip(f"{name}: needs {NEEDS_CUDA[name]}")
