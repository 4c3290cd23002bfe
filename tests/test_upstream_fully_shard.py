"""PyTorch's own FSDP2 tests (``test/distributed/_composable/fsdp/`` of the PyTorch repository, as of torch 2.13), run
against ``minidp.distributed.fully_shard`` on the CPU, in one job of 2 Gloo processes on 127.0.0.1 (the ``ranks``
fixture, every process ended by the harness within ``JOB_TIMEOUT``).

Ported (bodies in ``tests/upstream_fsdp_checks.py``, each under its upstream name), :data:`PORTED`, from
``test_fully_shard_training.py`` (training parity with a DDP reference, one and several groups, explicit prefetching,
gradient accumulation and 1F1B micro-batching, activation checkpointing, shared parameters, which parameters are
registered after forward and backward, shards along another dimension, HSDP, CPU offload),
``test_fully_shard_mixed_precision.py`` (compute and reduce dtypes, their casts, accumulation in the reduce dtype),
``test_fully_shard_ignore_params.py``, ``test_fully_shard_frozen.py`` (frozen and trainable parameters in one group
and across groups, modules run several times, in part under ``no_grad``), ``test_fully_shard_autograd.py`` (outputs
and modules the loss does not use, activations inside containers, post-accumulate-grad hooks and an optimizer stepped
from them), ``test_fully_shard_state_dict.py`` (DTensor state dicts over the shards' storage, on 1-D and HSDP
meshes, loaded in place, gathered whole on rank 0), ``test_fully_shard_grad_scaler.py`` (a loss scaler that sees
an inf in another rank's shard), ``test_fully_shard_comm.py`` (the collectives a step issues, by count),
``test_fully_shard_clip_grad_norm_.py``
(clipping through :func:`minidp.distributed.clip_grad_norm_`), ``test/distributed/checkpoint/fsdp/test_fsdp_dsd.py``
(``torch.distributed.checkpoint``'s state dicts of a sharded model and its optimizer, a checkpoint of FSDP1's loaded),
``test_fully_shard_init.py`` (21 of its 44 cases: what ``fully_shard`` takes and refuses, the shards it makes, a
model built on the meta device and materialised, or loaded from rank 0's whole weights with ``assign=True``, meshes made
from process groups, HSDP by hand with an all-reduce hook, shards along the largest or the last dimension) and
``test_fully_shard_state.py`` (``fully_shard.state``, the class a sharded module gets and a slice of it, what is refused
in FSDP2's words: a second call, a container without ``forward``, ``deepcopy``). Upstream
gates most of them on GPUs only to have a device per rank, and runs them on 2 to 8 ranks; here the CPU and 2 ranks. What the port adapts
(DTensor parameters read as plain shards, collectives seen through a dispatch mode, fewer iterations, the int
``reshard_after_forward=2`` of 2 ranks as True) is in that module's docstring and in each case's. Examined but not
ported, with the reason: :data:`NOT_PORTED`, which also holds every case of ``test_fully_shard_extensions.py``
(FSDP2's all-gather extensions), ``test_fully_shard_logging.py``, ``test_fully_shard_memory.py`` and
``test_fully_shard_overlap.py`` (FSDP2's debug log, an accelerator's allocator and streams) and ``test_fully_shard_dtensor.py``
(``dp_mesh_dims``). Among the other files of that folder, not ported and not listed case by case: those that test what
torch 2.13's FSDP2 does not have (``test_fully_shard_conversion.py``, ``_pending_grad.py``, ``_grad.py``,
``_grad_dtype.py``, ``_unsharded_views.py``, ``_block_shard.py``, ``_chunk_cat.py``, ``_prefix_copy.py``: gradient
dtypes, pending gradients, ``BlockShard``, FSDP2's private copy operators), those of an early layout
(``torch.distributed._composable.fsdp``) that torch 2.13's tree no longer has (``test_fully_shard_collectives.py``,
``_debug.py``, ``_fuse.py``, ``_grad_acc.py``, ``_compose.py``), and ``test_fully_shard_compile.py``
(``torch.compile`` of FSDP2 with inductor).

Adapted from PyTorch (BSD 3-clause), copyright the PyTorch contributors.

The port is checked against the original: ``MINIDP_UPSTREAM_FSDP=torch python -m pytest -q
tests/test_upstream_fully_shard.py`` runs every case on torch's own ``torch.distributed.fsdp.fully_shard``, but for
the one it cannot run over Gloo (:data:`TORCH_FSDP2_NEEDS_NCCL`).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch.torch_version import TorchVersion

from . import upstream_fsdp_checks as checks
from .helpers import (
    UPSTREAM_GROUP_TIMEOUT, assert_passed_on_every_rank, assert_ports_match_their_module, run_job, run_upstream,
)


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """The checks run in processes of their own, which start with DataParallel's defaults: the two
    configurations of tests/conftest.py would run them twice alike, so they run once."""


JOB_TIMEOUT = 180.0  # seconds for the whole job

PORTED = {
    "test_fully_shard_training.py": [
        "test_root_move_forward_input_to_device",
        "test_root_no_forward_inputs",
        "test_param_registration_after_forward",
        "test_param_registration_after_backward",
        "test_to_float64_after_init",
        "test_train_parity_single_group_shard_dim0",
        "test_train_parity_single_group_shard_largest_dim",
        "test_train_parity_multi_group",
        "test_train_parity_multi_group_cpu_offload_eager",
        "test_non_root_forward_backward",
        "test_multi_forward_module",
        "test_explicit_prefetching",
        "test_train_parity_with_activation_checkpointing",
        "test_train_parity_shard_placement_fn_shard_largest_dim",
        "test_shard_placement_fn_contiguous_params_grads",
        "test_train_parity_with_shared_params",
        "test_train_shared_params_uneven_shard",
        "test_layer_by_layer_shard_no_false_positive",
        "test_gradient_accumulation",
        "test_1f1b_microbatching",
        "test_partial_group_forward_then_standalone",
        "test_grouped_module_cast_forward_inputs",
        "test_partial_group_forward_grad_accum_chunked",
        "test_partial_group_reshard_toggle",
        "test_reset_iter_state_after_exception",
        "test_double_forward_with_nested_fsdp_and_checkpoint",
        "test_double_partial_forward_then_backward",
        "test_train_parity_hsdp",
        "test_register_fsdp_forward_method",
    ],
    "test_fully_shard_mixed_precision.py": [
        "test_compute_dtype",
        "test_reduce_dtype",
        "test_grad_acc_with_reduce_dtype",
        "test_structured_input_output",
        "test_float16_on_one_submodule",
        "test_submodules_with_external_inputs",
        "test_checkpoint_recompute_casts_forward_inputs",
        "test_checkpoint_recompute_casts_outputs",
        "test_norm_modules_bf16",
        "test_norm_modules_fp16",
        "test_clamp_reduce_dtype",
    ],
    "test_fully_shard_ignore_params.py": [
        "test_ddp_A_fsdp_B_ddp_C",
    ],
    "test_fully_shard_frozen.py": [
        "test_train_mixed_requires_grad_per_group",
        "test_train_mixed_requires_grad_across_groups",
        "test_multi_forward_mixed_requires_grad",
    ],
    "test_fully_shard_autograd.py": [
        "test_unused_forward_output",
        "test_unused_forward_module",
        "test_nontensor_activations",
        "test_post_acc_grad_hook_runs",
        "test_post_acc_grad_hook_optim_parity",
    ],
    "test_fully_shard_state_dict.py": [
        "test_dp_state_dict_save_load",
        "test_cached_state_dict",
        "test_rank0_offload_full_state_dict",
    ],
    "test_fully_shard_grad_scaler.py": [
        "test_gradient_scaler",
    ],
    "test_fully_shard_comm.py": [
        "test_fully_shard_communication_count",
        "test_manual_reshard_with_reshard_after_forward_false",
        "test_set_reshard_after_forward",
        "test_set_reduce_scatter_divide_factor",
    ],
    "test_fully_shard_clip_grad_norm_.py": [
        "test_clip_grad_norm_1d",
    ],
    # (in test/distributed/checkpoint/fsdp/: distributed state dicts of sharded models and their optimizers)
    "test_fsdp_dsd.py": [
        "test_1d_fsdp_get_model_state_dict",
        "test_1d_fsdp_cpu_offload_full_model_state_dict",
        "test_save_with_fsdp1_and_load_with_fsdp2",
    ],
    "test_fully_shard_init.py": [
        "test_moduledict_subclass_with_forward",
        "test_modulelist_subclass_with_forward",
        "test_invalid_mesh_ndim",
        "test_2d_mesh_without_mesh_dim_names",
        "test_shard_tensor_parameters",
        "test_raise_scalar_parameter",
        "test_raise_noncontiguous_parameter",
        "test_reset_sharded_param_in_lazy_init",
        "test_meta_device_1d_init",
        "test_invalid_meta_device_init",
        "test_rank0_broadcast_meta_device_init",
        "test_1d_process_group_init",
        "test_2d_process_group_init",
        "test_hsdp_broadcast_across_replicas",
        "test_custom_hsdp_all_reduce_hook",
        "test_init_1d_transformer_shard_largest_dim",
        "test_init_1d_transformer_shard_dim_neg1",
        "test_init_1d_uneven_shard_largest_dim",
        "test_invalid_shard_dim",
        "test_old_import_training",
        "test_mixed_dtypes_no_grad_param",
    ],
    "test_fully_shard_state.py": [
        "test_fully_shard_state",
        "test_fully_shard_reapply",
        "test_fully_shard_cls",
        "test_fully_shard_unsupported_module_cls",
        "test_fully_shard_deepcopy",
    ],
}
CASES = [name for names in PORTED.values() for name in names]

# With MINIDP_UPSTREAM_FSDP=torch, cases that an older torch's own FSDP2 fails (checked on torch 2.11): out of the job,
# skipped with the reason. minidp runs them under any torch.
OLD_TORCH_FSDP2_FAILS = {
    "test_structured_input_output": "torch's FSDP2 before 2.13 fails on dataclass activations between sharded "
                                    "modules (a parameter's storage freed when the backward needs it)",
    **dict.fromkeys(
        ["test_partial_group_forward_then_standalone", "test_partial_group_forward_grad_accum_chunked",
         "test_partial_group_reshard_toggle", "test_reset_iter_state_after_exception",
         "test_double_partial_forward_then_backward"],
        "torch's FSDP2 before 2.13 leaves a fully_shard([a, b]) group that a forward ran in part gathered, and "
        "reduces wrong gradients (2.13 completes it at the root's post-forward, as minidp does)"),
    "test_grouped_module_cast_forward_inputs": "torch's FSDP2 before 2.13 casts the inputs of the first module of a "
                                               "fully_shard([a, b]) group only",
    "test_checkpoint_recompute_casts_forward_inputs": "torch's FSDP2 before 2.13 does not cast the inputs again when "
                                                      "activation checkpointing recomputes the module (a float32 input "
                                                      "meets bfloat16 weights: 'mat1 and mat2 must have the same "
                                                      "dtype')",
    **dict.fromkeys(["test_moduledict_subclass_with_forward", "test_modulelist_subclass_with_forward"],
                    "torch's FSDP2 before 2.13 refuses every ModuleDict or ModuleList, a subclass that implements "
                    "forward too ('fully_shard does not support containers that do not implement forward')"),
    "test_checkpoint_recompute_casts_outputs": "torch's FSDP2 before 2.13 does not cast the outputs to output_dtype "
                                               "again when activation checkpointing recomputes the module",
}
TORCH_BEFORE_2_13 = TorchVersion(torch.__version__) < "2.13"


# With MINIDP_UPSTREAM_FSDP=torch, cases torch's own FSDP2 cannot run over Gloo (upstream runs them on NCCL): out of the
# job, skipped with the reason. Their bodies are upstream's; minidp runs them.
TORCH_FSDP2_NEEDS_NCCL = {
    "test_set_reduce_scatter_divide_factor": "torch's FSDP2 reduce-scatters with ReduceOp.PREMUL_SUM once a divide "
                                             "factor is set, which only NCCL has (\"Cannot use ReduceOp.PREMUL_SUM "
                                             "with Gloo\")",
}


def _why_skipped_here(name: str) -> Optional[str]:
    if checks.ON_TORCH and TORCH_BEFORE_2_13 and name in OLD_TORCH_FSDP2_FAILS:
        return f"{name} on torch {torch.__version__}'s own FSDP2: {OLD_TORCH_FSDP2_FAILS[name]}"
    if checks.ON_TORCH and name in TORCH_FSDP2_NEEDS_NCCL:
        return f"{name} on torch's own FSDP2 over Gloo: {TORCH_FSDP2_NEEDS_NCCL[name]}"
    return None


def _skipped_here(name: str) -> bool:
    return _why_skipped_here(name) is not None


IN_THE_JOB = [name for name in CASES if not _skipped_here(name)]

_MESH = "needs a device mesh of 3 dimensions or more (TP, EP, PP) on 4 to 8 ranks"
NOT_PORTED = {
    # test_fully_shard_training.py
    "test_modules_to_run_forward_empty_for_single_module": "reads FSDP2's private state (_modules_to_run_forward)",
    "test_train_parity_multi_group_unshard_async_op": "FSDP2's private _set_unshard_async_op, which minidp lacks",
    "test_post_optim_event": "set_post_optim_event takes a CUDA event (stream ordering; nothing to order on the CPU)",
    "test_shared_params_separate_fsdp_groups_error": "checks FSDP2's message at the first forward ('already managed "
                                                     "by another'); minidp refuses at the second fully_shard call, "
                                                     "with its own message (tests/test_fully_shard.py covers it)",
    "test_2d_mlp_with_nd_mesh": _MESH,
    "test_shard_placement_fn_tp_ep": _MESH,
    "test_3d_mlp_with_nd_mesh": _MESH,
    "test_share_comm_context": "share_comm_ctx and FSDP2's CUDA streams (private _comm_ctx)",
    "test_train_parity_single_worldsize1": "one rank: the job has 2 (and it counts FSDP2's collectives with "
                                           "CommDebugMode on a mesh of 1)",
    "test_two_layer_fully_shard_cudagraph": "CUDA graphs",
    # test_fully_shard_mixed_precision.py
    "test_no_warmup_jvp_reshard_after_forward_false": "meta-device init with to_empty() after fully_shard, and "
                                                      "forward-mode AD (torch.func.jvp) through the gathered "
                                                      "parameters: a mesh argument and torch's meta-init path",
    "test_reduce_dtype_after_frozen_first_forward": "fails on torch 2.13's own FSDP2 on the CPU (a bfloat16 "
                                                     "gradient assigned to the float32 shard: the reduce dtype it "
                                                     "checks is fixed after 2.13), so the port cannot be validated",
    # test_fully_shard_state_dict.py
    "test_dp_state_dict_cpu_offload": "builds its state dict from the parameters' own device_mesh and placements "
                                      "(FSDP2's DTensor parameters, on the meta device), loads it with assign=True, "
                                      "and expects an error for a state dict on a CUDA device; its CPU subtest with "
                                      "pinned memory needs an accelerator",
    "test_2d_state_dict_correctness": "tensor parallelism (parallelize_module) on a 2-D mesh of 4 ranks",
    "test_dp_tp_state_dict_save_load": _MESH,
    "test_hsdp_tp_state_dict_save_load": _MESH,
    # test_fsdp_dsd.py
    **dict.fromkeys(["test_save_with_fsdp1_and_load_with_fsdp2_tp", "test_save_with_tp_and_load_with_fsdp2_tp",
                     "test_save_with_fsdp2_tp_and_load_with_tp"],
                    "tensor parallelism (parallelize_module) on a 2-D mesh of 4 ranks"),
    # test_fully_shard_comm.py
    **dict.fromkeys(["test_all_gather_fp32", "test_reduce_scatter_fp32", "test_reduce_scatter_fp16"],
                    "drives FSDP2's private FSDPParamGroup and its foreach collectives on 128 threads"),
    **dict.fromkeys(["test_fully_shard_backward_prefetch", "test_set_modules_to_forward_prefetch",
                     "test_set_modules_to_backward_prefetch"],
                    "records the order of FSDP2's private FSDPParamGroup.unshard, reshard and post_backward calls "
                    "(tests/test_fully_shard.py checks minidp's prefetching: -k prefetch)"),
    # test_fully_shard_init.py
    **dict.fromkeys(["test_move_states_to_device_tensor", "test_move_states_to_device_ignored_param_device"],
                    "checks that fully_shard moves a CPU module's parameters and buffers (but not ignored ones) to the "
                    "accelerator, FSDP2's default device; on the CPU there is nowhere to move them"),
    "test_move_states_to_device_dtensor_valid": "tensor parallelism (parallelize_module) on a 2-D mesh of 4 ranks, "
                                                "whose DTensors fully_shard moves to the accelerator",
    "test_move_states_to_device_dtensor_invalid": "tensor parallelism (parallelize_module) on a CPU mesh of 4 ranks "
                                                  "beside an accelerator mesh: needs an accelerator",
    **dict.fromkeys(["test_managed_modules_single", "test_managed_modules_nested",
                     "test_managed_modules_nested_fully_shard_and_replicate", "test_managed_modules_duplicate",
                     "test_managed_modules_list_of_mlps", "test_managed_states_shared_params_and_buffers",
                     "test_managed_states_nested_fully_shard", "test_managed_states_list_of_mlps"],
                    "calls FSDP2's private _get_managed_modules and _get_managed_states directly (no fully_shard call "
                    "whose effect it checks); which parameters a call takes is checked through fully_shard by "
                    "test_shard_tensor_parameters and tests/test_fully_shard.py"),
    **dict.fromkeys(["test_get_param_module_infos_shared_params", "test_get_param_module_infos_duplicates",
                     "test_get_param_module_infos_list_of_mlps"],
                    "calls FSDP2's private _get_param_module_infos and compares its ParamModuleInfo records"),
    "test_shard_dtensor_parameters": "tensor parallelism (parallelize_module) on a 2-D mesh of 4 ranks",
    **dict.fromkeys(["test_fully_shard_is_root", "test_fully_shard_module_and_param_fqns",
                     "test_fully_shard_double_lazy_init", "test_fully_shard_multi_module_root"],
                    "calls FSDP2's private lazy initialisation (fully_shard.state(module)._lazy_init()) and reads its "
                    "private state (_is_root, _state_ctx, _fsdp_param_group, _param_fqn)"),
    "test_meta_device_2d_init": "tensor parallelism (parallelize_module) on a 2-D mesh of 4 ranks",
    "test_custom_hook_custom_stream": "an all-reduce hook run on a CUDA stream of its own (set_all_reduce_hook's "
                                      "stream=); minidp runs it on the current stream and refuses stream=",
    "test_init_2d_transformer_shard_diff_dim": "tensor parallelism (Transformer.parallelize) on a 2-D mesh of 8 ranks",
    # test_fully_shard_extensions.py
    **dict.fromkeys(["test_all_gather_extensions_train_parity", "test_all_gather_extensions_end_to_end",
                     "test_all_gather_extensions_monkey_patch", "test_all_gather_extension_outer_size_stride",
                     "test_all_gather_extension_hsdp_mesh"],
                    "FSDP2's all-gather extensions: fsdp_pre_all_gather and fsdp_post_all_gather of a parameter's "
                    "tensor subclass (TwoTensor, a bfloat16 wrapper) or of its DTensor's local tensor, which FSDP2 "
                    "calls around its all-gather; minidp gathers the shards' own values and calls neither"),
    # test_fully_shard_logging.py
    "test_fsdp_logging": "FSDP2's debug log (TORCH_LOGS=fsdp: torch's private logger records 'FSDP::pre_forward' and "
                         "the like), read from a child process on one GPU; minidp writes no such records",
    # test_fully_shard_memory.py
    **dict.fromkeys(["test_fully_shard_training_memory", "test_fully_shard_del_memory"],
                    "measures the accelerator's allocator (memory_stats' active bytes, peak and current) against "
                    "budgets for a GPU; the CPU has no such count"),
    # test_fully_shard_overlap.py
    **dict.fromkeys(["test_fully_shard_training_overlap", "test_fully_shard_post_optim_event_overlap"],
                    "times CUDA sleeps on CUDA streams to see collectives overlap compute (and a CUDA event given to "
                    "set_post_optim_event); on the CPU FSDP2 and minidp wait for each collective where it is issued"),
    # test_fully_shard_dtensor.py
    **dict.fromkeys(["test_dtensor_train_parity", "test_sharded_param_correctness_1d",
                     "test_fsdp_tp_dtensor_sharded_params", "test_reduce_scatter_unused_dtensor_param",
                     "test_validation_non_replicate_dp_placement", "test_validation_invalid_dim_names",
                     "test_validation_mesh_mismatch", "test_validation_spmd_mesh_non_dtensor_params",
                     "test_validation_reshard_after_forward_int_spmd"],
                    "fully_shard's dp_mesh_dims (parameters already DTensors on an SPMD mesh, with tensor or expert "
                    "parallelism on 4 ranks in part), which minidp's fully_shard refuses; upstream runs the "
                    "file on accelerators only"),
    "test_validation_at_least_one_required": "checks torch's own DataParallelMeshDims() constructor, with no "
                                             "fully_shard call (minidp refuses any dp_mesh_dims but None)",
}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every case of IN_THE_JOB, run once in one job of 2 ranks; each rank's results."""
    return run_job(run_upstream, 2, (checks.__name__, [(name, {}) for name in IN_THE_JOB]), JOB_TIMEOUT,
                   UPSTREAM_GROUP_TIMEOUT)


@pytest.mark.parametrize("name", CASES)
def test_upstream_fully_shard_case(ranks, name):
    if _skipped_here(name):
        pytest.skip(_why_skipped_here(name))
    assert_passed_on_every_rank(ranks, name)


def test_every_case_is_in_the_checks_module():
    assert_ports_match_their_module(CASES, checks, NOT_PORTED)


@pytest.mark.parametrize("name", sorted(NOT_PORTED))
def test_not_ported(name):
    pytest.skip(f"{name}: {NOT_PORTED[name]}")
