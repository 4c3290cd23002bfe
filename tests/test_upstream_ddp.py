"""PyTorch's CPU/Gloo DDP tests of ``torch/testing/_internal/distributed/distributed_test.py`` (torch
2.13, class ``DistributedTest._DistTestBase``), run against ``minidp.distributed.DistributedDataParallel``.

Every upstream test that constructs DDP appears here once by its upstream name: the ones upstream
runs on the Gloo backend without a GPU are ported (bodies in ``tests/upstream_ddp_checks.py``) and
run in one job of 2 Gloo processes on 127.0.0.1, with ten that upstream gates on GPUs only to have
a device per rank (uneven inputs under ``join()``, unused outputs, undefined gradients, graphs that
differ between ranks, tensors created in forward); the other GPU-gated ones skip with upstream's
decorator as the reason. Adapted from PyTorch (BSD 3-clause), copyright the PyTorch
contributors.
"""

from __future__ import annotations

import pytest

from . import upstream_ddp_checks as checks
from .helpers import assert_passed_on_every_rank, launch_upstream


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


CPU_GLOO = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_ddp_logging_data_cpu",
    "test_static_graph_api_cpu",
    "test_grads_same_across_ranks_with_no_sync",
]

# Upstream gates these on 2 GPUs, but only to place the model on cuda:rank: they run here on the CPU.
PORTED_TO_CPU = [
    "test_ddp_join_model_equivalence",
    "test_ddp_uneven_input_join_disable",
    "test_ddp_uneven_input_exception",
    "test_output_unused_in_loss_tuple_module",
    "test_output_unused_in_loss_dict_module",
    "test_undefined_grad_parity_unused_parameters",
    "test_different_graph_across_ranks",
    "test_ddp_returns_tensor_with_no_grad",
    "test_ddp_new_tensor_in_fwd",
    "test_ddp_new_tensor_in_fwd_static_graph",
]

# Upstream gates these on GPUs (the decorator quoted); on the CPU they skip, as upstream's do.
GPU_ONLY = {
    "test_ddp_zero_output_features": "skip_if_lt_x_gpu(WORLD_SIZE)",
    "test_DistributedDataParallel_non_default_stream": "skip_if_lt_x_gpu(WORLD_SIZE); also skipped on Linux",
    "test_ddp_comm_hook_logging": "skip_if_lt_x_gpu(WORLD_SIZE)",
    "test_get_data_parallel_params": "skip_if_lt_x_gpu(2)",
    "test_ddp_apply_optim_in_backward": "skip_if_lt_x_gpu(2)",
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false": "skip_if_lt_x_gpu(2)",
    "test_ddp_apply_optim_in_backward_ignored_params": "skip_if_lt_x_gpu(2)",
    "test_ddp_native_mixed_precision_ignored_params": "skip_if_lt_x_gpu(2)",
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none": "skip_if_lt_x_gpu(2)",
    "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none": "skip_if_lt_x_gpu(2)",
    "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none": "skip_if_lt_x_gpu(2)",
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none": "skip_if_lt_x_gpu(2)",
    "test_ddp_hook_parity_allreduce": "skip_if_lt_x_gpu(WORLD_SIZE)",
    "test_ddp_hook_parity_allreduce_process_group": "skip_if_lt_x_gpu(WORLD_SIZE)",
    "test_ddp_hook_parity_powerSGD": "skip_if_lt_x_gpu(WORLD_SIZE)",
    "test_ddp_hook_parity_post_localSGD": "skip_if_lt_x_gpu(WORLD_SIZE)",
    "test_DistributedDataParallel": "skip_if_no_gpu; also skipped on Linux",
    "test_DistributedDataParallel_with_amp_and_grad_is_view": "skip_if_no_gpu",
    "test_post_localSGD_optimizer_parity": "skip_if_lt_x_gpu(2)",
    "test_post_localSGD_optimizer_parity_grad_is_view": "skip_if_lt_x_gpu(2)",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd": "skip_if_lt_x_gpu(4)",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view": "skip_if_lt_x_gpu(4)",
    "test_post_localSGD_optimizer_step_reload": "skip_if_lt_x_gpu(2)",
    "test_DistributedDataParallel_SyncBatchNorm_Channels_Last": "skip_if_no_gpu",
    "test_DistributedDataParallel_SyncBatchNorm": "skip_if_no_gpu",
    "test_DistributedDataParallel_SyncBatchNorm_No_Affine": "skip_if_no_gpu",
    "test_DistributedDataParallel_SyncBatchNorm_2D_Input": "skip_if_no_gpu",
    "test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process": "skip_if_no_gpu",
    "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value": "skip_if_no_gpu",
    "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient": "skip_if_no_gpu",
    "test_DistributedDataParallel_SyncBatchNorm_half": "skip_if_no_gpu",
    "test_ddp_logging_data_gpu": "skip_if_no_gpu",
    "test_ddp_bucket_cap_mb_list": "skip_if_lt_x_gpu(2)",
    "test_ddp_sync_module_states": "skip_if_lt_x_gpu(2)",
    "test_ddp_grad_div_uneven_inputs": "skip_if_lt_x_gpu(2)",
    "test_ddp_profiling_autograd_profiler": "skip_if_lt_x_gpu(2); also skipped on Linux, also skipped everywhere",
    "test_ddp_profiling_torch_profiler": "skip_if_lt_x_gpu(2)",
    "test_ddp_profiling_execution_trace": "skip_if_lt_x_gpu(2); also skipped everywhere",
    "test_ddp_uneven_inputs_stop_iteration_sync_bn": "skip_if_lt_x_gpu(2)",
    "test_ddp_uneven_inputs": "skip_if_lt_x_gpu(2)",
    "test_ddp_ignore_params_arg": "skip_if_lt_x_gpu(2)",
    "test_ddp_unused_params_rebuild_buckets_exception": "skip_if_lt_x_gpu(2)",
    "test_ddp_shared_grad_acc_unused_params": "skip_if_lt_x_gpu(2)",
    "test_ddp_device": "skip_if_lt_x_gpu(2)",
    "test_ddp_namedtuple": "skip_if_lt_x_gpu(2)",
    "test_ddp_control_flow_same_across_ranks": "skip_if_lt_x_gpu(2)",
    "test_invalid_static_graph": "skip_if_lt_x_gpu(2)",
    "test_ddp_control_flow_different_across_ranks": "skip_if_lt_x_gpu(2)",
    "test_compute_bucket_assignment_by_size_sparse_error_without_logger": "skip_if_lt_x_gpu(2)",
    "test_compute_bucket_assignment_by_size_sparse_error_with_logger": "skip_if_lt_x_gpu(2); also skipped on Linux",
    "test_verify_model_across_rank_with_logger": "skip_if_lt_x_gpu(2)",
    "test_verify_model_across_rank_without_logger": "skip_if_lt_x_gpu(2)",
    "test_ddp_model_diff_shape_across_ranks": "skip_if_lt_x_gpu(2); also skipped on Linux",
    "test_ddp_model_diff_num_params_across_ranks": "skip_if_lt_x_gpu(2)",
    "test_ddp_build_debug_param_to_name_mapping": "skip_if_lt_x_gpu(2)",
    "test_ddp_build_debug_param_to_name_mapping_requires_grad": "skip_if_lt_x_gpu(2)",
    "test_ddp_multiple_nested_unused_params_error": "skip_if_lt_x_gpu(2)",
    "test_ddp_multiple_nested_unused_params_err_ignore_params": "skip_if_lt_x_gpu(2)",
    "test_ddp_inference": "skip_if_lt_x_gpu(2)",
    "test_ddp_sync_bn_training_vs_eval": "skip_if_lt_x_gpu(2); also skipped everywhere",
    "test_ddp_python_error_logged": "skip_if_lt_x_gpu(2)",
    "test_ddp_static_graph_nested_types": "skip_if_lt_x_gpu(2)",
    "test_detect_ddp_is_actually_static": "skip_if_lt_x_gpu(2)",
    "test_ddp_buffer_hook_allreduce_return_future": "skip_if_lt_x_gpu(2)",
    "test_ddp_buffer_hook_allreduce": "skip_if_lt_x_gpu(2)",
    "test_ddp_broadcast_buffer_via_hook": "skip_if_lt_x_gpu(2)",
    "test_ddp_remove_autograd_hooks": "skip_if_lt_x_gpu(2)",
    "test_ddp_has_finalized": "skip_if_lt_x_gpu(2); also skipped on Linux, also skipped everywhere",
    "test_ddp_broadcast_buffer": "skip_if_lt_x_gpu(2)",
    "test_ddp_join_respects_forward_sync_buffers_false": "skip_if_lt_x_gpu(2)",
    "test_ddp_init_sync_buffers_with_forward_sync_buffers_false": "skip_if_lt_x_gpu(2)",
    "test_ddp_broadcast_buffers_deprecation_warning": "skip_if_lt_x_gpu(2)",
    "test_static_graph_multi_forward": "skip_if_lt_x_gpu(2)",
    "test_sync_bn_logged": "skip_if_lt_x_gpu(2)",
    "test_stateless_api_with_ddp": "skip_if_lt_x_gpu(2)",
    "test_ddp_forward_backward_hook": "skip_if_lt_x_gpu(2)",
    "test_ddp_hook_pickling_powerSGD": "skip_if_lt_x_gpu(WORLD_SIZE); also skipped everywhere",
    "test_ddp_device_mesh_initialization": "skip_if_lt_x_gpu(2)",
    "test_ddp_compile_static_graph": "skip_if_lt_x_gpu(2)",
    "test_ddp_sink_noclone": "skip_if_lt_x_gpu(2)",
    "test_skip_all_reduce_unused_parameters": "skip_if_lt_x_gpu(2)",
}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every case of CPU_GLOO and PORTED_TO_CPU, run once in one job of 2 ranks; each rank's results."""
    return launch_upstream(checks.__name__, [(name, {}) for name in CPU_GLOO + PORTED_TO_CPU])


# ---- ported: each passes on every rank --------------------------------------------------------------


def test_DistributedDataParallelCPU(ranks):
    assert_passed_on_every_rank(ranks, "test_DistributedDataParallelCPU")


def test_DistributedDataParallelCPU_grad_is_view(ranks):
    assert_passed_on_every_rank(ranks, "test_DistributedDataParallelCPU_grad_is_view")


def test_DistributedDataParallel_requires_grad(ranks):
    assert_passed_on_every_rank(ranks, "test_DistributedDataParallel_requires_grad")


def test_ddp_create_graph(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_create_graph")


def test_accumulate_gradients_no_sync(ranks):
    assert_passed_on_every_rank(ranks, "test_accumulate_gradients_no_sync")


def test_accumulate_gradients_no_sync_grad_is_view(ranks):
    assert_passed_on_every_rank(ranks, "test_accumulate_gradients_no_sync_grad_is_view")


def test_accumulate_gradients_no_sync_allreduce_hook(ranks):
    assert_passed_on_every_rank(ranks, "test_accumulate_gradients_no_sync_allreduce_hook")


def test_accumulate_gradients_no_sync_allreduce_with_then_hook(ranks):
    assert_passed_on_every_rank(ranks, "test_accumulate_gradients_no_sync_allreduce_with_then_hook")


def test_ddp_logging_data_cpu(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_logging_data_cpu")


def test_static_graph_api_cpu(ranks):
    assert_passed_on_every_rank(ranks, "test_static_graph_api_cpu")


def test_grads_same_across_ranks_with_no_sync(ranks):
    assert_passed_on_every_rank(ranks, "test_grads_same_across_ranks_with_no_sync")



def test_ddp_join_model_equivalence(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_join_model_equivalence")


def test_ddp_uneven_input_join_disable(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_uneven_input_join_disable")


def test_ddp_uneven_input_exception(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_uneven_input_exception")



def test_output_unused_in_loss_tuple_module(ranks):
    assert_passed_on_every_rank(ranks, "test_output_unused_in_loss_tuple_module")


def test_output_unused_in_loss_dict_module(ranks):
    assert_passed_on_every_rank(ranks, "test_output_unused_in_loss_dict_module")


def test_undefined_grad_parity_unused_parameters(ranks):
    assert_passed_on_every_rank(ranks, "test_undefined_grad_parity_unused_parameters")


def test_different_graph_across_ranks(ranks):
    assert_passed_on_every_rank(ranks, "test_different_graph_across_ranks")


def test_ddp_returns_tensor_with_no_grad(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_returns_tensor_with_no_grad")


def test_ddp_new_tensor_in_fwd(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_new_tensor_in_fwd")


def test_ddp_new_tensor_in_fwd_static_graph(ranks):
    assert_passed_on_every_rank(ranks, "test_ddp_new_tensor_in_fwd_static_graph")


# ---- not ported ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GPU_ONLY))
def test_gpu_only_upstream(name):
    pytest.skip(f"{name}: upstream runs it on GPUs only ({GPU_ONLY[name]}); this port covers the CPU/Gloo cases")


def test_dump_DDP_relevant_env_vars():
    pytest.skip("tests torch.distributed's own _dump_DDP_relevant_env_vars, a function of torch, not the wrapper")
