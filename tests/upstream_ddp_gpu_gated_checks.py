"""PyTorch's DDP tests that upstream gates on GPUs, run on the CPU, rank side: each upstream test body, run
inside every rank of a 2-process Gloo job against :data:`DDP` (the cases of ``GPU_GATED_PORTED`` in
``tests/test_upstream_ddp.py``, whose docstring says what runs where; the cases it lists in ``NOT_SUPPORTED``
instead fail on minidp, by design, and stay out of its job).

Adapted from PyTorch's torch/testing/_internal/distributed/distributed_test.py (BSD 3-clause), copyright the
PyTorch contributors: torch 2.13's (it ships in the wheel), class ``DistributedTest._DistTestBase``; the cases
keep upstream's names. Upstream gates them on GPUs (``skip_if_lt_x_gpu``, ``skip_if_no_gpu``) only to have one
device per rank: it places each model on ``cuda:rank`` with ``device_ids=[rank]``. Here the models stay on the
CPU and ``device_ids`` is omitted (``None``), which is how torch DDP takes CPU modules. A case that leaves part
of upstream out (what needs CUDA, torch's CUDA-only ``SyncBatchNorm``, torchvision, a third process) or cuts
its steps for time says so in its docstring; ``NOT_PORTED`` in ``tests/test_upstream_ddp.py`` names the parts
that cannot run here.
Shared helpers and models (``Net``, ``raises``, ``verify_ddp_error_logged``, ...) come from
``tests/upstream_ddp_checks.py``, whose docstring says how the port reads.

:data:`DDP` is ``tests.upstream_ddp_checks.DDP``: minidp's wrapper, or torch's own with ``MINIDP_UPSTREAM_DDP=torch``
in the environment (``MINIDP_UPSTREAM_DDP=torch python -m pytest tests/test_upstream_ddp.py`` runs the whole port on
torch's DDP). Every case passes on torch's DDP too, except:

* the cases of :data:`TORCH_NEEDS_ACCELERATOR`: on a CPU-only build of torch, torch's own optimizer-in-backward
  and native-mixed-precision code raises before any check runs (the reason of each is in the dict). Those
  streams and events only order work on an accelerator; on the CPU everything is already in order. The bodies
  were validated on torch's DDP with both calls replaced by no-ops for the run (and nothing else);
* the cases of :data:`NEEDS_FORWARD_SYNC_BUFFERS`, on a torch older than 2.13: they pass
  ``forward_sync_buffers``, and expect the ``broadcast_buffers`` deprecation warning, both torch 2.13's.
"""

# No `from __future__ import annotations`: torch DDP checks a comm hook's annotations as objects.

import copy
import itertools
import os
import shutil
import tempfile
import unittest
import warnings
from collections import namedtuple
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as averagers
import torch.nn.functional as F
from torch import nn
from torch.autograd import DeviceType
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localSGD
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks
from torch.distributed.optim import _apply_optimizer_in_backward, post_localSGD_optimizer
from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes
from torch.nn.parallel.distributed import _BufferCommHookLocation, _MixedPrecision
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import debug_level, state_difference
from tests.upstream_ddp_checks import (
    DDP,
    LargeNet,
    Net,
    Task,
    _ddp_logging_data,
    _ddp_niter,
    _model_step,
    _prepare_dummy_data,
    _saved_and_loaded,
    _validate_net_equivalence,
    assert_close,
    assert_not_close,
    raises,
    verify_ddp_error_logged,
)

_OPTIMIZER_IN_BACKWARD_NEEDS = ("torch's optimizer-in-backward comm hook calls torch.accelerator.current_stream() at "
                                "the end of the backward: \"Cannot access accelerator device when none is available\"")
_MIXED_PRECISION_NEEDS = ("torch's native mixed precision records a torch.Event in its forward pre-hook: "
                          "\"cpu backend doesn't support events\"")

# The cases that torch's own DDP cannot run on a CPU-only torch, and why (see the module docstring).
TORCH_NEEDS_ACCELERATOR = {
    "test_ddp_apply_optim_in_backward": _OPTIMIZER_IN_BACKWARD_NEEDS,
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false": _OPTIMIZER_IN_BACKWARD_NEEDS,
    "test_ddp_apply_optim_in_backward_ignored_params": _OPTIMIZER_IN_BACKWARD_NEEDS,
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none": _MIXED_PRECISION_NEEDS,
    "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none": _MIXED_PRECISION_NEEDS,
    "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none": _MIXED_PRECISION_NEEDS,
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none": _MIXED_PRECISION_NEEDS,
}

# `forward_sync_buffers` and the deprecation of `broadcast_buffers` are torch 2.13's: torch 2.11's DDP fails these
# cases (TypeError, no warning), and test_upstream_ddp.py skips them where torch's DDP lacks the argument.
NEEDS_FORWARD_SYNC_BUFFERS = (
    "test_ddp_join_respects_forward_sync_buffers_false",
    "test_ddp_init_sync_buffers_with_forward_sync_buffers_false",
    "test_ddp_broadcast_buffers_deprecation_warning",
)


# ---- what distributed_test.py defines at module level for several sections -----------------------------------------

_EXPECTED_FIELDS = ("a", "b")
_TestNamedTupleInput_0 = namedtuple("NamedTuple", _EXPECTED_FIELDS)


class _TestNamedTupleInput_1(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class BatchNormNet(nn.Module):
    """A BatchNorm1d over 4 channels between two linear layers."""

    def __init__(self, affine: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4, affine=affine)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(torch.reshape(self.fc1(x), (-1, 4, 10)))
        return F.softmax(self.fc2(torch.reshape(x, (-1, 40))), dim=1)


class TwoLinLayerNet(nn.Module):
    """Returns both layers' outputs: ``a`` (10 -> 10) and ``b`` (10 -> 1), both bias-free."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple:
        return (self.a(x), self.b(x))


class EmbeddingNetDifferentParams(nn.Module):
    """An embedding whose width (and number of parameters) may depend on the rank."""

    def __init__(self, rank: int, diff_num_params: bool = False) -> None:
        super().__init__()
        embedding_dim = 500 if diff_num_params or rank == 0 else 50
        self.embedding = nn.Embedding(num_embeddings=10, embedding_dim=embedding_dim)
        self.lin = nn.Linear(embedding_dim, 1)
        if diff_num_params:
            self.lin2 = nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.embedding(x))


class ControlFlowToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(10, 10, bias=False)
        self.lin2 = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the second layer runs only on an all-ones input
        if torch.equal(x, torch.ones(20, 10, device=x.device)):
            return self.lin2(F.relu(self.lin1(x)))
        return F.relu(self.lin1(x))


def _with_debug_levels(levels: list, body: Callable[[], None]) -> None:
    """Upstream's ``with_dist_debug_levels``: ``body()`` once per TORCH_DISTRIBUTED_DEBUG level, a barrier after
    each; the previous level back afterwards."""
    for level in levels:
        with debug_level(level):
            body()
            dist.barrier()


# ---- end-to-end training against a single-process model, automatic mixed precision ---------------------------------


def _test_DistributedDataParallel(gradient_as_bucket_view: bool = False, static_graph: bool = False,
                                  set_static_graph_twice: bool = False) -> None:
    """Upstream's ``_test_DistributedDataParallel`` with one device per rank (``local_bs = len(gpu_subset)``, 1):
    the wrapper, pickled and loaded back before training, trains as the single-process model on the whole
    batch for 5 steps, and pickles again with the same state."""
    model = Net()
    model_base = copy.deepcopy(model)
    model_DDP = DDP(copy.deepcopy(model), gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
    if set_static_graph_twice:
        model_DDP._set_static_graph()
    model_DDP = _saved_and_loaded(model_DDP)
    local_bs = 1
    global_bs, input_cpu, target, loss = _prepare_dummy_data(local_bs)
    # upstream saves and reloads mid-training too, only under a file:// init method; its end-of-run save is here
    _ddp_niter(model_base, model_DDP, input_cpu, target, loss, local_bs, global_bs)
    dist.barrier()


def test_DistributedDataParallel() -> None:
    """For each of gradient_as_bucket_view and static_graph, off and on: plain, with ``_set_static_graph()`` called
    again after construction (upstream's output_device and device_ids variants need CUDA devices: NOT_PORTED)."""
    for use_bucket_view, static_graph in itertools.product((False, True), (False, True)):
        _test_DistributedDataParallel(gradient_as_bucket_view=use_bucket_view, static_graph=static_graph)
        _test_DistributedDataParallel(gradient_as_bucket_view=use_bucket_view, static_graph=static_graph,
                                      set_static_graph_twice=True)


def _test_DistributedDataParallel_with_amp(grad_is_view: bool = False) -> nn.Module:
    """Upstream's helper on the CPU: torch.autocast("cpu", dtype=torch.float16) and torch.amp.GradScaler("cpu")
    for CUDA's autocast() and GradScaler() (float16 both); 20 steps with finite gradients; the wrapper."""
    torch.manual_seed(31415)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03)
    scaler = torch.amp.GradScaler("cpu")
    ddp_model = DDP(model, gradient_as_bucket_view=grad_is_view)
    input = torch.randn(dist.get_world_size() * 2, 2)
    target = torch.randn(dist.get_world_size() * 2, 4)
    loss_fn = nn.MSELoss()
    for p in ddp_model.parameters():  # no gradients before training
        assert p is not None
        assert p.grad is None
    for idx in range(20):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output = ddp_model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        for p in ddp_model.parameters():
            if p.requires_grad:
                assert p.grad is not None
                assert not p.grad.isnan().any()
                assert not p.grad.isinf().any()
        scaler.step(optimizer)
        scaler.update()
        torch.manual_seed(1337 + idx)  # shuffled: each rank's input changes
        input = input[torch.randperm(dist.get_world_size() * 2)]
    return ddp_model


def test_DistributedDataParallel_with_amp_and_grad_is_view() -> None:
    """Training under float16 autocast with a GradScaler ends with the same parameters whether the gradients are
    views of the buckets or not (CPU autocast and scaler for upstream's CUDA ones)."""
    ddp_model_grad_not_view = _test_DistributedDataParallel_with_amp(grad_is_view=False)
    ddp_model_grad_is_view = _test_DistributedDataParallel_with_amp(grad_is_view=True)
    for i, j in zip(ddp_model_grad_not_view.parameters(), ddp_model_grad_is_view.parameters(), strict=True):
        assert_close(i, j)


# ---- control flow and unused parameters ----------------------------------------------------------------------------

# substrings of the C++ reducer's error on unfinished reductions (distributed_test.py's ddp_*_str)
_PREV_REDUCTION_UNFINISHED = "Expected to have finished reduction in the prior iteration"
_RECOMMEND_FIND_UNUSED_PARAMS = "passing the keyword argument `find_unused_parameters=True`"
_FIND_UNUSED_PARAMS_ENABLED = "Since `find_unused_parameters=True` is enabled"
_OUTPUTS_NOT_USED_IN_LOSS = "`forward` function outputs participate in calculating loss"
_SUGGEST_DEBUG_MODE = "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL"


def _check_unused_params_error(model, msg: str, unused_names: list, unused_index=None) -> None:
    """The reducer's error on a parameter without gradient under find_unused_parameters=False: logged,
    naming the causes, and, by debug level, the parameter's name or the advice to turn debug mode on."""
    verify_ddp_error_logged(model, msg)
    expected = [_PREV_REDUCTION_UNFINISHED, _RECOMMEND_FIND_UNUSED_PARAMS, _OUTPUTS_NOT_USED_IN_LOSS]
    if unused_index is not None:
        expected.append(f"Parameter indices which did not receive grad for rank {dist.get_rank()}: {unused_index}")
    if dist.get_debug_level() == dist.DebugLevel.OFF:
        expected.append(_SUGGEST_DEBUG_MODE)
    else:
        expected.append(f"did not receive grad for rank {dist.get_rank()}: {', '.join(unused_names)}")
    for s in expected:
        assert s in msg, f"Expected {s} to be in {msg}"
    assert _FIND_UNUSED_PARAMS_ENABLED not in msg, msg


def _second_iteration_names_unused_lin2(module: nn.Module, random_input: torch.Tensor) -> None:
    """Upstream's shared ending of both control-flow cases: without find_unused_parameters, lin2 (unused on the
    random input) leaves the first backward unreduced, and the second iteration raises the logged error."""
    model = DDP(module, find_unused_parameters=False)
    model(random_input).sum().backward()
    try:
        model(random_input).sum().backward()
    except RuntimeError as e:
        _check_unused_params_error(model, str(e), ["lin2.weight"], unused_index=1)
    else:
        raise AssertionError("DDP error not raised")
    dist.barrier()


def _control_flow_same_across_ranks() -> None:
    batch, dim = 20, 10
    world_size = dist.get_world_size()
    model = DDP(ControlFlowToyModel(), find_unused_parameters=True)
    random_input = torch.randn(batch, dim)
    ones_input = torch.ones(batch, dim)
    for i in range(6):
        model(random_input if i % 2 == 0 else ones_input).sum().backward()
        # lin2 is unused on even iterations, used on odd ones, on every rank
        used = [world_size, 0] if i % 2 == 0 else [world_size, world_size]
        assert_close(model.reducer._get_local_used_map(), torch.tensor(used, dtype=torch.int32))

    # without find_unused_parameters: the next forward raises, explaining why
    _second_iteration_names_unused_lin2(ControlFlowToyModel(), random_input)


def test_ddp_control_flow_same_across_ranks() -> None:
    """Input-dependent control flow, alike on all ranks: the used-parameter map is summed over ranks, and
    without find_unused_parameters the error names lin2 (index 1), at debug levels OFF, INFO, DETAIL."""
    _with_debug_levels(["OFF", "INFO", "DETAIL"], _control_flow_same_across_ranks)


def _control_flow_different_across_ranks() -> None:
    batch, dim = 20, 10
    rank, world_size = dist.get_rank(), dist.get_world_size()

    class ToyModel(nn.Module):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.lin1 = nn.Linear(10, 10, bias=False)
            self.lin2 = nn.Linear(10, 10, bias=False)
            self.rank = rank

        def forward(self, x):
            # only rank 1 on an all-ones input uses lin2
            if torch.equal(x, torch.ones(batch, dim, device=x.device)) and self.rank == 1:
                return self.lin2(F.relu(self.lin1(x)))
            return F.relu(self.lin1(x))

    model = DDP(ToyModel(rank), find_unused_parameters=True)
    random_input = torch.randn(batch, dim)
    ones_input = torch.ones(batch, dim)
    for i in range(6):
        model(random_input if i % 2 == 0 else ones_input).sum().backward()
        used = [world_size, 0] if i % 2 == 0 else [world_size, 1]
        assert_close(model.reducer._get_local_used_map(), torch.tensor(used, dtype=torch.int32))

    _second_iteration_names_unused_lin2(ToyModel(rank), random_input)


def test_ddp_control_flow_different_across_ranks() -> None:
    """Control flow that differs by rank: lin2's use count is 1 when only rank 1 uses it; without
    find_unused_parameters the error names lin2 (index 1), at debug levels OFF, INFO, DETAIL."""
    _with_debug_levels(["OFF", "INFO", "DETAIL"], _control_flow_different_across_ranks)


def _unused_params_rebuild_buckets_exception() -> None:
    class ToyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net1 = nn.Linear(10, 10, bias=False)
            self.net2 = nn.Linear(10, 10, bias=False)

        def forward(self, x):
            return self.net1(x)

    ddp = DDP(ToyModel())
    ddp(torch.rand(1, 10)).sum().backward()
    # the second iteration fails in rebuild_buckets; the error names the root cause, the unused net2
    try:
        ddp(torch.rand(1, 10)).sum().backward()
    except RuntimeError as e:
        _check_unused_params_error(ddp, str(e), ["net2.weight"])
    else:
        raise AssertionError("DDP unused parameters error not raised.")
    dist.barrier()


def test_ddp_unused_params_rebuild_buckets_exception() -> None:
    """An unused parameter without find_unused_parameters: the error raised when the buckets are rebuilt
    is the unused-parameter error (logged), at debug levels OFF, INFO, DETAIL."""
    _with_debug_levels(["OFF", "INFO", "DETAIL"], _unused_params_rebuild_buckets_exception)


def _multiple_nested_unused_params_error(ignore_sparse: bool) -> None:
    """Upstream's ``_test_ddp_multiple_nested_unused_params_error``."""
    debug_mode_off = dist.get_debug_level() == dist.DebugLevel.OFF

    class SubModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding_net = EmbeddingNetDifferentParams(0)
            self.lin = TwoLinLayerNet()
            self.bn = BatchNormNet()
            self.lin_layer = nn.Linear(4, 10, bias=False)

        def forward(self, x):
            # unused: lin.b, and all of embedding_net (its embedding and its lin)
            return self.lin.a(self.lin_layer(self.bn(x)))

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sub_module = SubModule()

        def forward(self, x):
            return self.sub_module(x)

    model = MyModel()
    sparse_embedding_fqns = []
    if ignore_sparse:
        for module_name, module in model.named_modules():
            if module == model.sub_module.embedding_net.embedding:
                for parameter_name, _ in module.named_parameters(recurse=False):
                    sparse_embedding_fqns.append(f"{module_name}.{parameter_name}")
        DDP._set_params_and_buffers_to_ignore_for_model(model, sparse_embedding_fqns)
        unused_modules = [model.sub_module.embedding_net.lin, model.sub_module.lin.b]
    else:
        unused_modules = list(model.sub_module.embedding_net.modules()) + [model.sub_module.lin.b]

    expected_unused_param_fqns = []
    used_param_fqns = []  # must not show up in the error
    fqn_to_param_index = {}
    index = 0
    for module_name, module in model.named_modules():
        for parameter_name, _ in module.named_parameters(recurse=False):
            fqn = f"{module_name}.{parameter_name}"
            fqn_to_param_index[fqn] = index
            if fqn not in sparse_embedding_fqns:
                index += 1
            if module in unused_modules:
                expected_unused_param_fqns.append(fqn)
            elif not ignore_sparse or module != model.sub_module.embedding_net.embedding:
                used_param_fqns.append(fqn)

    net = DDP(model)
    inp = torch.ones(10, 2)
    net(inp).sum().backward()  # first iteration: unused parameters leave the reduction unfinished
    try:
        net(inp).sum().backward()
    except RuntimeError as e:
        e = str(e)
        unused_param_substr = e[e.find("did not receive grad"):]
        # every unused parameter's name (with debug mode on) and index is there, whatever the order
        for fqn in expected_unused_param_fqns:
            assert fqn in unused_param_substr or debug_mode_off, (fqn, e)
            assert str(fqn_to_param_index[fqn]) in unused_param_substr, (
                f"Did not find index {fqn_to_param_index[fqn]} for {fqn}: {e}")
        for fqn in used_param_fqns:
            assert fqn not in unused_param_substr, (fqn, e)
        for fqn in sparse_embedding_fqns:  # ignored parameters are not tracked, so never reported as unused
            assert fqn not in unused_param_substr, (fqn, e)
    else:
        raise AssertionError("Expected error was not raised!")


def test_ddp_multiple_nested_unused_params_error() -> None:
    """Several unused parameters in nested modules: the error lists each one's index, and its name with
    debug mode on, and none of the used ones, at debug levels OFF, INFO, DETAIL."""
    _with_debug_levels(["OFF", "INFO", "DETAIL"], lambda: _multiple_nested_unused_params_error(ignore_sparse=False))


def test_ddp_multiple_nested_unused_params_err_ignore_params() -> None:
    """Under debug levels OFF, INFO and DETAIL, the unused-parameters error of the second iteration names
    (or indexes) the unused parameters of a nested model, and never the ignored embedding."""
    _with_debug_levels(["OFF", "INFO", "DETAIL"], lambda: _multiple_nested_unused_params_error(ignore_sparse=True))


def test_ddp_shared_grad_acc_unused_params() -> None:
    """find_unused_parameters=True marks unused parameters that share one gradient accumulator (two names,
    one parameter; pytorch/pytorch#41324), with and without static_graph, with an in-place loss (#61982)."""

    class ToyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # net1.weight and bias (also net1.bias: one parameter, one accumulator) go unused
            self.net1 = nn.Linear(10, 5, bias=False)
            self.bias = nn.Parameter(torch.zeros(5))
            self.net1.bias = self.bias
            self.net2 = nn.Linear(10, 5)

        def forward(self, x):
            return self.net2(x).sum()

    model = ToyModel()
    for static in [True, False]:
        ddp_model = DDP(copy.deepcopy(model), find_unused_parameters=True, static_graph=static)
        inp = torch.randn(20, 10)
        for _ in range(6):
            loss = ddp_model(inp)
            loss /= 10  # in place on DDP's output
            loss.backward()


def _test_skip_all_reduce_unused_parameters(find_unused_parameters: bool = False, static_graph: bool = False,
                                            skip_all_reduce_unused_params: bool = False) -> nn.Module:
    """Upstream's helper: a 100 -> 5000 layer used and a 100 -> 100 one unused, each in a bucket of its own
    (bucket_cap_mb=1.5), trained 10 steps from a fixed seed; the wrapper."""

    class LargeNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(100, 5000, bias=False)
            self.fc2 = nn.Linear(100, 100, bias=False)  # unused

        def forward(self, x):
            return self.fc1(x)

    torch.manual_seed(31415)
    ddp_model = DDP(LargeNet(), find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                    bucket_cap_mb=1.5, skip_all_reduce_unused_params=skip_all_reduce_unused_params)
    random_input = torch.randn(20, 100)
    for _ in range(10):
        ddp_model(random_input).sum().backward()
    return ddp_model


def test_skip_all_reduce_unused_parameters() -> None:
    """skip_all_reduce_unused_params=True reduces 1 bucket of 2 (``num_buckets_reduced`` in the logging data):
    the unused layer's is skipped; the parameters are the same as without it."""
    base_model = _test_skip_all_reduce_unused_parameters(find_unused_parameters=True, static_graph=False)
    test_model_1 = _test_skip_all_reduce_unused_parameters(find_unused_parameters=True, static_graph=False,
                                                           skip_all_reduce_unused_params=True)
    reduced = [model._get_ddp_logging_data().get("num_buckets_reduced") for model in (base_model, test_model_1)]
    assert reduced == [2, 1], f"num_buckets_reduced without and with the skip: {reduced}, not [2, 1]"
    for i, j in zip(base_model.parameters(), test_model_1.parameters(), strict=True):
        assert_close(i, j)


@dataclass
class _MyClass:
    obj: torch.Tensor


class _HasFinalizedModel(nn.Module):
    """Upstream's ``MyModel`` of ``test_ddp_has_finalized``, the rank test made an argument: ``wrap`` returns the
    second layer's output inside a dataclass (upstream's rank 0), else as a plain tensor (upstream's rank 1)."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.wrap = wrap
        self.fc1 = nn.Linear(1024, 1024)
        self.fc2 = nn.Linear(1024, 2 * 1024)

    def forward(self, inp: torch.Tensor) -> tuple:
        if self.wrap:
            return self.fc1(inp), _MyClass(self.fc2(inp))
        return self.fc1(inp), self.fc2(inp)


def test_ddp_has_finalized() -> None:
    """With find_unused_parameters and a bucket per parameter: a backward through both outputs finishes the
    reduction (``_check_reducer_finalized()`` and the next forward pass); a backward through the first output only,
    the second inside a dataclass, leaves it unfinished, and both raise "Expected to have finished reduction in the
    prior iteration".

    Upstream runs the first side on rank 1 and the second on rank 0 at once, and skips the test as failing
    (pytorch/pytorch#102751): on torch's DDP rank 1's reduction of the second layer then waits for rank 0 forever.
    Here every rank runs both sides, one after the other."""
    input = torch.rand(10, 1024, requires_grad=True)
    bucket_cap_mb = 1024 * 4 / 1024 / 1024  # one bucket per parameter
    ddp = DDP(_HasFinalizedModel(wrap=False), find_unused_parameters=True, bucket_cap_mb=bucket_cap_mb)
    out1, out2 = ddp(input)
    (out1.sum() + out2.sum()).backward()
    ddp._check_reducer_finalized()
    ddp(input)

    ddp = DDP(_HasFinalizedModel(wrap=True), find_unused_parameters=True, bucket_cap_mb=bucket_cap_mb)
    out1, _ = ddp(input)
    out1.sum().backward()
    with raises(RuntimeError, "Expected to have finished reduction in the prior iteration"):
        ddp._check_reducer_finalized()
    with raises(RuntimeError, "Expected to have finished reduction in the prior iteration"):
        ddp(input)


# ---- static graph --------------------------------------------------------------------------------------------------


def test_invalid_static_graph() -> None:
    """static_graph=True with a graph that changes: the reducer's two errors (unused then used; used then
    unused), each logged."""
    model = DDP(ControlFlowToyModel(), static_graph=True)
    random_input = torch.randn(20, 10)
    ones_input = torch.ones(20, 10)

    # a parameter unused in the first iteration is used in the second
    expected_err = "Your training graph has changed in this iteration"
    with raises(RuntimeError, expected_err):
        for i in range(2):
            model(random_input if i % 2 == 0 else ones_input).sum().backward()
    verify_ddp_error_logged(model, expected_err)

    # a parameter used in the first iteration goes unused in the second
    with raises(
        RuntimeError,
        "Expected to have finished reduction in the prior iteration "
        "before starting a new one. This error indicates that your "
        "training graph has changed in this iteration, "
        "e.g., one parameter is used in first iteration, "
        "but then got unused in the second iteration. "
        "this is not compatible with static_graph set to True.\n"
        "Parameter indices which did not receive grad for",
    ):
        for i in range(2):
            model(random_input if i % 2 != 0 else ones_input).sum().backward()
    verify_ddp_error_logged(model, "Expected to have finished reduction")


def test_ddp_static_graph_nested_types() -> None:
    """Outputs nested in tuples, lists and dicts train under static_graph=True as without it. As upstream,
    the static-graph wrapper wraps the first DDP (not the copy made for it), so both share parameters."""

    class NestedOutputModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(100, 1, bias=False)

        def forward(self, inp, output_type):
            if output_type == "tuple":
                return (self.lin(inp), (self.lin(inp), self.lin(inp)))
            if output_type == "list":
                return [self.lin(inp), [self.lin(inp), self.lin(inp)]]
            if output_type == "dict":
                return {"a": self.lin(inp), "b": {"c": self.lin(inp)}}

    def get_loss(output):
        if isinstance(output, torch.Tensor):
            return output.sum()
        values = output.values() if isinstance(output, dict) else output
        if not isinstance(output, (dict, tuple, list)):
            raise ValueError(f"Unknown model output type {type(output)}")
        loss = 0.0
        for value in values:
            loss += get_loss(value)
        return loss

    model = NestedOutputModule()
    model_static_graph = copy.deepcopy(model)  # unused afterwards, as upstream
    model = DDP(model)
    model_static_graph = DDP(model, static_graph=True)
    inp = torch.randn(10, 100)
    type_mapping = {"list": list, "tuple": tuple, "dict": dict}
    for output_type, kind in type_mapping.items():
        for _ in range(6):
            get_loss(model(inp, output_type=output_type)).backward()
            _model_step(model)
            out_static = model_static_graph(inp, output_type=output_type)
            assert isinstance(out_static, kind)
            get_loss(out_static).backward()
            _model_step(model_static_graph)
            for p, p_static in zip(model.parameters(), model_static_graph.parameters(), strict=True):
                assert_close(p_static, p)


def test_detect_ddp_is_actually_static() -> None:
    """The reducer reports the graph static when the set of unused parameters stays the same, with and
    without find_unused_parameters, and not static when it changes from one iteration to the next."""

    class ToyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net1 = nn.Linear(10, 10, bias=False)
            self.net2 = nn.Linear(10, 10)

        def forward(self, x, find_unused, dynamic):
            if find_unused and not dynamic:
                return self.net2(x)
            return self.net2(self.net1(x))

    model = ToyModel()
    for find_unused in [True, False]:
        ddp = DDP(model, find_unused_parameters=find_unused)
        inp = torch.randn(1, 10)
        for _ in range(6):
            ddp(inp, find_unused=find_unused, dynamic=False).sum().backward()
            assert ddp.reducer._ddp_graph_static()

    ddp = DDP(model, find_unused_parameters=True)
    inp = torch.randn(1, 10)
    for i in range(6):
        ddp(inp, find_unused=True, dynamic=i % 2 == 0).sum().backward()
    assert not ddp.reducer._ddp_graph_static()


def test_static_graph_multi_forward() -> None:
    """static_graph=True, two forwards then one backward: gradients equal a local model that runs
    both forwards world-size times and averages (checked on rank 0)."""

    class ToyNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 10)
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.lin(x))

    torch.manual_seed(42 << 1337 % (dist.get_rank() + 1))  # as upstream: seeds differ by rank
    model = ToyNet()
    local_model = copy.deepcopy(model)
    model = DDP(model, static_graph=True)
    inp = torch.ones(2, 10)
    for _ in range(3):
        model.zero_grad()
        local_model.zero_grad()
        (model(inp).sum() + model(inp).sum()).backward()
        if dist.get_rank() == 0:
            iters = dist.get_world_size()
            for _ in range(iters):
                (local_model(inp.clone()).sum() + local_model(inp.clone()).sum()).backward()
            for p in local_model.parameters():
                p.grad.data = p.grad / iters
            for p_ddp, p_local in zip(model.parameters(), local_model.parameters(), strict=True):
                assert torch.allclose(p_ddp.grad, p_local.grad), f"{p_ddp.grad} vs {p_local.grad}"
    dist.barrier()


def test_ddp_compile_static_graph() -> None:
    """torch.compile of the wrapper with static_graph=True and of one without: the same outputs and gradients
    for 6 steps (upstream's require_world_size(2): the job has 2 ranks). With the ``aot_eager`` backend where
    upstream uses the default one: dynamo traces the wrapper alike, and no C++ kernel is built, which on a cold
    cache took one rank past the job's 30 s collective timeout while the other waited (torch 2.11)."""
    model = torch.nn.Linear(10, 10)
    model_clone = copy.deepcopy(model)
    ddp = DDP(model)
    ddp_static = DDP(model_clone, static_graph=True)
    ddp = torch.compile(ddp, backend="aot_eager")
    ddp_static = torch.compile(ddp_static, backend="aot_eager")
    input = torch.rand(10, 10)
    for _ in range(6):
        out_ddp = ddp(input).sum()
        out_ddp_static = ddp_static(input).sum()
        assert_close(out_ddp, out_ddp_static)
        out_ddp.backward()
        out_ddp_static.backward()
        for p1, p2 in zip(ddp.parameters(), ddp_static.parameters(), strict=True):
            assert_close(p1.grad, p2.grad)


# ---- inputs, inference, module and autograd hooks, functional calls ------------------------------------------------


def test_ddp_namedtuple() -> None:
    """A namedtuple input (collections.namedtuple and typing.NamedTuple) reaches forward with its type and fields."""
    batch, dim = 5, 10
    a = torch.rand(batch, dim)
    b = torch.rand(batch, dim)

    class NamedTupleModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 1)

        def forward(self, input, expected_type):
            # a DDP that does not keep namedtuples would hand over a plain tuple
            assert isinstance(input, expected_type), f"Expected type {expected_type} but got {type(input)}"
            assert input._fields == _EXPECTED_FIELDS
            assert_close(input.a, a)
            assert_close(input.b, b)
            return self.lin(torch.mul(input.a, input.b))

    model = DDP(NamedTupleModule())
    for kind in (_TestNamedTupleInput_0, _TestNamedTupleInput_1):
        inp = kind(a, b)
        model(inp, type(inp))


def test_ddp_inference() -> None:
    """Only rank 0 runs eval-mode inference through DDP (no collective, no hang), equal to the local model.
    Upstream's second model, nn.SyncBatchNorm, is left out: torch DDP refuses it on CPU modules."""
    model = Net()
    local_model = copy.deepcopy(model)
    model = DDP(model)
    inp = torch.randn(10, 2)
    if dist.get_rank() == 0:
        model.eval()
        local_model.eval()
        for _ in range(6):
            assert_close(model(inp), local_model(inp))
    dist.barrier()


def test_ddp_forward_backward_hook() -> None:
    """Forward pre-hooks, forward hooks and (old-style) backward hooks of the wrapped module run as
    without DDP: same output, same gradients."""

    class DummyTestModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    def relu_hook(module, input):
        return nn.functional.relu(input[0])

    def gelu_hook(module, _input, output):
        return nn.functional.gelu(output)

    def celu_hook(module, _input, output):
        return (nn.functional.celu(output[0]),)

    local_model, ddp_model = DummyTestModel(), DummyTestModel()
    for model in (local_model, ddp_model):
        model.fc.register_forward_pre_hook(relu_hook)
        model.fc.register_forward_hook(gelu_hook)
        model.fc.register_backward_hook(celu_hook)
    ddp_model = DDP(ddp_model)
    input_data = torch.rand(5, 2)
    output_local, output_ddp = local_model(input_data), ddp_model(input_data)
    assert_close(output_ddp, output_local)
    output_local.sum().backward()
    output_ddp.sum().backward()
    ddp_grads = [p.grad for p in ddp_model.parameters()]
    assert_close(ddp_grads[0], local_model.fc.weight.grad)
    assert_close(ddp_grads[1], local_model.fc.bias.grad)


def test_stateless_api_with_ddp() -> None:
    """torch.func.functional_call on the wrapper uses the given tensors (keys "module.*"), leaves the
    module's own untouched, and the gradient goes to the given parameters only."""

    class MockModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(1, 1)
            self.register_buffer("buffer", torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l1(x) + self.buffer

    module = DDP(MockModule())
    x = torch.rand((1, 1))
    weight = torch.tensor([[1.0]], requires_grad=True)
    bias = torch.tensor([0.0], requires_grad=True)
    buffer = torch.tensor([0.0])
    parameters = {"module.l1.weight": weight, "module.l1.bias": bias, "module.buffer": buffer}
    prev_weight = module.module.l1.weight.clone()
    prev_buffer = module.module.buffer.clone()
    res = torch.func.functional_call(module, parameters, x)
    assert_close(res, x)
    assert_close(module.module.l1.weight, prev_weight)
    assert_close(module.module.buffer, prev_buffer)
    res.backward()
    assert weight.grad is not None
    assert bias.grad is not None
    # nothing for the buffer, nor for the module's own state
    assert buffer.grad is None
    assert module.module.l1.weight.grad is None
    assert module.module.l1.bias.grad is None
    assert module.module.buffer.grad is None


def test_ddp_remove_autograd_hooks() -> None:
    """A backward that failed midway leaves the first wrapper's hooks half-done; after
    ``_remove_autograd_hooks()`` a second wrapper on the same module trains."""

    class SimulateError(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input):
            return input

        @staticmethod
        def backward(ctx, grad_output):
            raise RuntimeError

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.error = True
            self.fc1 = nn.Linear(10, 10)

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return self.fc1(SimulateError.apply(inp)) if self.error else self.fc1(inp)

    model = MyModel()
    input = torch.rand(10, 10, requires_grad=True)
    model_ddp1 = DDP(model)
    with raises(RuntimeError, ""):
        model_ddp1(input).sum().backward()
    model_ddp1._remove_autograd_hooks()
    model.error = False
    model_ddp2 = DDP(model)
    model_ddp2(input).sum().backward()


def test_ddp_sink_noclone() -> None:
    """With _set_ddp_sink_clone(False), a forward and backward through DDP runs no aten.clone."""

    class OpPatcher(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket == torch.ops.aten.clone:
                raise RuntimeError("clone encountered!")
            return func(*args, **(kwargs or {}))

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(10, 10)

        def forward(self, input):
            return self.fc(input)

    ddp = DDP(MyModel(), find_unused_parameters=True)
    ddp._set_ddp_sink_clone(False)
    inp = torch.rand(10, 10)
    with OpPatcher():
        ddp(inp).sum().backward()


# ---- uneven inputs and Join ----------------------------------------------------------------------------------------


class _UnevenCase(NamedTuple):
    """Upstream's ``DDPUnevenTestInput``."""

    name: str
    model: nn.Module
    inp: Any
    sync_interval: int
    throw_on_early_termination: bool = False
    hook: Optional[Callable] = None
    state: Any = None


def _run_uneven_inputs_test(test_case: _UnevenCase, iteration_mapping: dict, find_unused_params: bool) -> None:
    """Rank r trains ``iteration_mapping[r]`` steps under ``join()``: no hang; with
    ``throw_on_early_termination`` every rank stops at the fewest steps with the matching error,
    otherwise all agree on the last rank as authoritative and end with the same model."""
    rank = dist.get_rank()
    dist.barrier()
    # bucket_cap_mb is low on purpose: several buckets to schedule
    net = DDP(test_case.model, bucket_cap_mb=1, find_unused_parameters=find_unused_params)
    if test_case.hook is not None:
        net.register_comm_hook(test_case.state, test_case.hook)
    num_iters = iteration_mapping[rank]
    num_iters_tensor = torch.tensor([num_iters])
    dist.all_reduce(num_iters_tensor, op=dist.ReduceOp.MIN)
    min_num_iters = num_iters_tensor.item()
    if not test_case.throw_on_early_termination:
        exception_ctx = nullcontext()
    elif min_num_iters == num_iters:  # a rank that runs out first
        exception_ctx = raises(RuntimeError, f"Rank {rank} exhausted all inputs")
    else:
        exception_ctx = raises(RuntimeError, "Detected at least one rank that exhausted inputs.")
    total_iters = 0
    with exception_ctx:
        with net.join(throw_on_early_termination=test_case.throw_on_early_termination):
            for i in range(num_iters):
                # no_sync() except every sync_interval-th step
                with net.no_sync() if i % test_case.sync_interval != 0 else nullcontext():
                    inp = test_case.inp
                    loss = net(*inp).sum() if isinstance(inp, tuple) else net(inp).sum()
                    loss.backward()
                    _model_step(net)
                total_iters += 1
    if test_case.throw_on_early_termination:
        assert total_iters == min_num_iters, (total_iters, min_num_iters)
        return
    assert total_iters >= min_num_iters, (total_iters, min_num_iters)
    # no broadcast from an authoritative rank when throwing; otherwise every rank names the last one
    assert net._authoritative_rank
    final_rank_tensor = torch.tensor([net._authoritative_rank])
    tensor_list = [torch.zeros_like(final_rank_tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensor_list, final_rank_tensor)
    assert {tensor.item() for tensor in tensor_list} == {dist.get_world_size() - 1}, tensor_list
    _validate_net_equivalence(net)
    assert net._get_ddp_logging_data().get("join_uneven_inputs")
    dist.barrier()


class _UnusedParamModule(nn.Module):
    """Two tasks; the rank ``unused_params_rank`` skips ``t0``."""

    def __init__(self, unused_params_rank: int) -> None:
        super().__init__()
        self.t0 = Task()
        self.t1 = Task()
        self.unused_params_rank = unused_params_rank

    def task_parameters(self) -> tuple:
        return (self.t0.p, self.t1.p)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.t1(self.t0(x)) if rank != self.unused_params_rank else self.t1(x)


def test_ddp_uneven_inputs() -> None:
    """Every model/config of upstream (batch norm, convolutions, linear, unused parameters on the rank
    that joins late or early, allreduce and PowerSGD hooks; plain, with no_sync every 2..8 steps, and
    throwing on early termination) under every 2-rank mapping of steps. Cut for time: linear width
    100 (upstream 1000), conv input 16x16 (1000x1000), steps of the rank joining early 0 or 2 (upstream
    0 or 5) and the other's extra steps 1 or 4 (2, 3 or 10); upstream's mappings with 2 ranks joining
    early need 3 processes; no torchvision here, hence no ResNet (as upstream without it)."""
    dim, batch, image = 100, 1, 16
    rank = dist.get_rank()
    large_model = nn.Sequential(
        nn.Conv2d(1, 20, 5), nn.ReLU(), nn.Conv2d(20, 32, 5), nn.ReLU(), nn.Conv2d(32, 256, 5), nn.ReLU()
    )
    small_model = nn.Linear(dim, dim, bias=False)
    bn_net = BatchNormNet()
    models_to_test = [
        _UnevenCase("batch_norm_net", bn_net, torch.ones(batch, 2), 1),
        _UnevenCase("large_conv_model", large_model, torch.ones(batch, batch, image, image), 1),
        _UnevenCase("small_model", small_model, torch.ones(batch, dim), 1),
        # the rank that joins late has unused parameters
        _UnevenCase("unjoined_rank_with_unused_params_model", _UnusedParamModule(1), (torch.ones(batch, 2), rank), 1),
        # the rank that joins early has unused parameters
        _UnevenCase("joined_rank_with_unused_params_model", _UnusedParamModule(0), (torch.ones(batch, 2), rank), 1),
        _UnevenCase("small_model_allreduce_hook", small_model, torch.ones(batch, dim), 1,
                    hook=default.allreduce_hook, state=None),
        _UnevenCase("small_model_power_sgd_hook", small_model, torch.ones(batch, dim), 1,
                    hook=powerSGD.powerSGD_hook,
                    # PowerSGD from the first step on, rather than allreduce
                    state=powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                 start_powerSGD_iter=1, warm_start=False,
                                                 use_error_feedback=False)),
    ]
    # as upstream: the no_sync and throwing variants are built without the hooks
    with_sync = [_UnevenCase(c.name, c.model, c.inp, sync_interval=i + 2) for i, c in enumerate(models_to_test)]
    throwing = [_UnevenCase(c.name, c.model, c.inp, c.sync_interval, throw_on_early_termination=True)
                for c in models_to_test]
    models_to_test += with_sync + throwing

    # baseline 0: one rank never trains, and must shadow the broadcasts of the bucket rebuild
    world_size = dist.get_world_size()
    iteration_mappings = []
    for num_early_join_ranks in [1] + ([2] if world_size > 2 else []):
        for baseline_iter, offset in itertools.product([0, 2], [1, 4]):
            mapping = dict.fromkeys(range(num_early_join_ranks), baseline_iter)
            for early in range(1, num_early_join_ranks):  # later early ranks run offset // 2 more
                mapping[early] += offset // 2
            mapping.update(dict.fromkeys(range(num_early_join_ranks, world_size), baseline_iter + offset))
            iteration_mappings.append(mapping)

    for test_case, iteration_mapping in itertools.product(models_to_test, iteration_mappings):
        try:
            _run_uneven_inputs_test(test_case, iteration_mapping,
                                    find_unused_params="unused_params_model" in test_case.name)
        except Exception as error:
            raise AssertionError(f"{test_case.name}, sync_interval {test_case.sync_interval}, throw "
                                 f"{test_case.throw_on_early_termination}, mapping {iteration_mapping}") from error


def test_ddp_grad_div_uneven_inputs() -> None:
    """Under join(), gradients divide by the ranks still training (divide_by_initial_world_size=False)
    or by the initial world size (default), where the joined ranks contribute zeros."""
    dim, batch, grad_scale = 5, 1, 50
    model = nn.Linear(dim, dim, bias=False)
    inp = torch.ones(batch, dim) * grad_scale
    net = DDP(model, bucket_cap_mb=1)
    n_iters = 3 + (2 if dist.get_rank() > 0 else 0)
    with net.join(divide_by_initial_world_size=False):
        for _ in range(n_iters):
            net(inp).sum().backward()
            # always the same: divided by the ranks still active, the joined ones adding zero
            assert_close(next(iter(net.parameters())).grad, torch.ones(dim, dim) * grad_scale)
            net.zero_grad()
    with net.join(divide_by_initial_world_size=True):
        for i in range(n_iters):
            net(inp).sum().backward()
            effective_ws = dist.get_world_size() - (1 if i >= 3 else 0)
            expected_grad = torch.ones(dim, dim) * grad_scale * effective_ws / dist.get_world_size()
            assert_close(next(iter(net.parameters())).grad, expected_grad)
            net.zero_grad()


def test_ddp_uneven_inputs_stop_iteration_sync_bn() -> None:
    """throw_on_early_termination with a forward that runs its own collective: every rank stops after
    the fewest steps with the matching error and the models agree. Only upstream's all_reduce model:
    its SyncBatchNorm model cannot run on the CPU (torch DDP refuses SyncBatchNorm in a CPU module,
    "SyncBatchNorm layers only work with GPU modules", and SyncBatchNorm's forward refuses CPU input)."""

    class ModelWithComm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 40, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.lin(x)
            dist.all_reduce(x)
            return x

    rank = dist.get_rank()
    model_input = torch.randn(10, 2)
    model = DDP(ModelWithComm())
    min_num_iters = 5
    if rank != 0:  # runs out first
        num_iters = min_num_iters
        exception_ctx = raises(RuntimeError, f"Rank {rank} exhausted all inputs")
    else:
        num_iters = min_num_iters * 2
        exception_ctx = raises(RuntimeError, "Detected at least one rank that exhausted inputs.")
    n = 0
    with exception_ctx:
        with model.join(throw_on_early_termination=True):
            for _ in range(num_iters):
                model(model_input).sum().backward()
                _model_step(model)
                n += 1
    assert n == min_num_iters, n
    _validate_net_equivalence(model)


# ---- comm hooks, post-localSGD, PowerSGD ---------------------------------------------------------------------------


def _test_ddp_hook_parity(state: Any, hook: Callable, num_validated_iters: int = 100, num_iters: int = 100) -> None:
    """Upstream's ``_test_ddp_hook_parity``: with the hook, the weight's gradient is the average of the
    ranks' (rank r contributes r), as with plain allreduce, for the first ``num_validated_iters`` steps.
    ``num_iters`` (upstream 100) is cut by the callers where the steps only add volume."""
    rank = dist.get_rank()
    m = nn.Linear(1, 5)
    process_group = getattr(state, "process_group", state)
    net_with_hook = DDP(copy.deepcopy(m), process_group=process_group)
    net_with_hook.register_comm_hook(state=state, hook=hook)
    net_without_hook = DDP(copy.deepcopy(m), process_group=process_group)
    expected_grad = sum(range(dist.get_world_size())) / dist.get_world_size()
    for i in range(num_iters):
        for g in (net_without_hook.module.weight.grad, net_with_hook.module.weight.grad):
            if g is not None:
                g.requires_grad_(False)
                g.zero_()
        batch = torch.tensor([rank]).float()
        net_without_hook(batch).sum().backward()
        avg = net_without_hook.module.weight.grad.clone()
        net_with_hook(batch).sum().backward()
        avg_hook = net_with_hook.module.weight.grad.clone()
        if i < num_validated_iters:
            assert avg_hook[0, 0].item() == expected_grad, f"step {i}: hook grad {avg_hook[0, 0]}, not {expected_grad}"
            assert_close(avg_hook[0, 0], avg[0, 0])


def test_ddp_hook_parity_allreduce() -> None:
    """The default allreduce hook gives plain DDP's gradients (20 steps; upstream 100)."""
    _test_ddp_hook_parity(state=None, hook=default.allreduce_hook, num_iters=20)


def test_ddp_hook_parity_allreduce_process_group() -> None:
    """The same with a process group passed to both DDP and the hook (upstream builds it from the GPU
    of each rank, i.e. the ranks themselves; 20 steps, upstream 100)."""
    process_group = dist.new_group(list(range(dist.get_world_size())))
    _test_ddp_hook_parity(state=process_group, hook=default.allreduce_hook, num_iters=20)


def test_ddp_hook_parity_powerSGD() -> None:
    """PowerSGD (rank 1, from step 2, with and without warm start) on a 1-column weight is exact
    (20 steps; upstream 100)."""
    for warm_start in (True, False):
        powersgd_state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2, warm_start=warm_start)
        _test_ddp_hook_parity(state=powersgd_state, hook=powerSGD.powerSGD_hook, num_iters=20)


@contextmanager
def _deferred(failures: list):
    """An assertion that fails in the block is kept in ``failures`` instead of raised: the rank goes on to the
    collectives that follow, which the other rank would otherwise wait in for ever; the case raises at its end."""
    try:
        yield
    except AssertionError as error:
        failures.append(error)


def _test_hook_pickling(hook: Callable, hook_state: Any) -> None:
    """Upstream's ``_test_hook_pickling``: a model trained under ``hook``, saved with its hook and the hook's state
    (logging one note on rank 0), loaded back (one note on each rank) into a second wrapper, both trained on: the
    loaded hook, its state (but the process group, the default group again) and the parameters are the same.

    The checkpoint goes to a directory of this job's own, not a fixed file of the temporary directory shared by every
    run on the machine; ``torch.load`` passes ``weights_only=False`` (the state is no tensor: torch's default refuses
    it); the checks run after the last collective (see :func:`_deferred`)."""
    import numpy as np

    failures: list = []
    logs = unittest.TestCase()  # its assertLogs, as upstream's TestCase has
    torch.manual_seed(0)
    learning_rate = 0.01
    rank = dist.get_rank()
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    chkpt_file = os.path.join(directory[0], "checkpoint.pt")

    input = torch.randn(7, 1)
    target = torch.randn(7, 5)
    net = torch.nn.Linear(1, 5)
    ddp_model = DDP(copy.deepcopy(net))
    dummy_ddp_model = DDP(copy.deepcopy(net))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=learning_rate)
    ddp_model.register_comm_hook(hook_state, hook)
    ddp_model.train()

    for _ in range(10):
        optimizer.zero_grad()
        loss = F.mse_loss(ddp_model(input), target)
        loss.backward()
        optimizer.step()

    state = {"state_dict": ddp_model.state_dict(), "comm_hook": hook, "comm_hook_state": hook_state}
    try:
        if rank == 0:
            with _deferred(failures), logs.assertLogs("torch.distributed") as captured:
                torch.save(state, chkpt_file)
            with _deferred(failures):
                # only one entry, the expected one
                assert [record.getMessage() for record in captured.records] == [
                    "NOTE: Process group is not serializable and excluded from a saved state."]
        dist.barrier()
        with _deferred(failures), logs.assertLogs("torch.distributed") as captured:
            checkpoint = torch.load(chkpt_file, weights_only=False)
        with _deferred(failures):
            assert [record.getMessage() for record in captured.records] == [
                "NOTE: Process group will be set to a default group (i.e. the world size).\
                If a different group is desired, please set `self.process_group` after PowerSGD state is loaded."]
        dist.barrier()  # both ranks have read it
    finally:
        if rank == 0:
            shutil.rmtree(directory[0], ignore_errors=True)

    dummy_ddp_model.load_state_dict(checkpoint["state_dict"])
    dummy_hook = checkpoint["comm_hook"]
    dummy_hook_state = checkpoint["comm_hook_state"]
    dummy_optimizer = torch.optim.SGD(dummy_ddp_model.parameters(), lr=learning_rate)

    with _deferred(failures):
        # the loaded function is the same
        assert dummy_hook.__qualname__ == hook.__qualname__
        # all slots' keys, and but for process_group and rng all slots' values, are restored
        assert hook_state.__slots__ == dummy_hook_state.__slots__
        for entry in dummy_hook_state.__slots__:
            if entry != "process_group" and entry != "rng":
                difference = state_difference(getattr(dummy_hook_state, entry), getattr(hook_state, entry),
                                              exact=False, where=entry)
                assert difference is None, difference
        # process_group is the default one
        assert dummy_hook_state.process_group == dist.distributed_c10d._get_default_group()
        # every entry of the random state (numpy's RandomState.get_state()) is the original's
        for entry1, entry2 in zip(hook_state.rng.get_state(), dummy_hook_state.rng.get_state(), strict=True):
            np.testing.assert_array_equal(entry1, entry2)

    dummy_ddp_model.register_comm_hook(dummy_hook_state, dummy_hook)
    dummy_ddp_model.train()

    for _ in range(10):
        optimizer.zero_grad()
        dummy_optimizer.zero_grad()
        out_origin = ddp_model(input)
        out_dummy = dummy_ddp_model(input)
        loss_origin = F.mse_loss(out_origin, target)
        loss_dummy = F.mse_loss(out_dummy, target)
        loss_origin.backward()
        loss_dummy.backward()
        optimizer.step()
        dummy_optimizer.step()

    # the models' parameters are the same after training
    for orig_param, dummy_param in zip(ddp_model.parameters(), dummy_ddp_model.parameters(), strict=True):
        with _deferred(failures):
            assert_close(orig_param, dummy_param)
    if failures:
        raise failures[0]


def test_ddp_hook_pickling_powerSGD() -> None:
    """PowerSGD's state pickles with the model (upstream skips it everywhere as flaky: see
    :func:`_test_hook_pickling` for what the port changes)."""
    hook = powerSGD.powerSGD_hook
    powersgd_state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=4)
    _test_hook_pickling(hook, powersgd_state)


def test_ddp_hook_parity_post_localSGD() -> None:
    """The post-local-SGD hook: with the world as subgroup it still averages globally; without the
    local allreduce only the warm-up steps are checked; with the per-node subgroup (here the world)
    and with a start past the last step it is plain allreduce (20 steps; upstream 100, still past
    the local-SGD start at 10)."""
    start_localSGD_iter = 10
    state = post_localSGD.PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD,
                                            start_localSGD_iter=start_localSGD_iter)
    _test_ddp_hook_parity(state=state, hook=post_localSGD.post_localSGD_hook, num_iters=20)
    state = post_localSGD.PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD,
                                            start_localSGD_iter=start_localSGD_iter,
                                            post_local_gradient_allreduce=False)
    _test_ddp_hook_parity(state=state, hook=post_localSGD.post_localSGD_hook,
                          num_validated_iters=start_localSGD_iter, num_iters=20)
    # upstream: subgroup None, for which the hook makes the per-node subgroup with dist.new_subgroups();
    # without a group size that call needs CUDA (one subgroup per GPU count), so the port makes the
    # per-node subgroup itself: on one machine, every rank
    subgroup, _ = dist.new_subgroups(group_size=dist.get_world_size())
    state = post_localSGD.PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=10)
    _test_ddp_hook_parity(state=state, hook=post_localSGD.post_localSGD_hook, num_iters=20)
    # local SGD never starts: no subgroup needed
    state = post_localSGD.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=1000)
    _test_ddp_hook_parity(state=state, hook=post_localSGD.post_localSGD_hook, num_iters=20)


def _create_periodic_model_averager() -> averagers.PeriodicModelAverager:
    return averagers.PeriodicModelAverager(period=4, warmup_steps=10)


def _create_post_localSGD_optimizer(net: nn.Module, learning_rate: float, averager: Any):
    return post_localSGD_optimizer.PostLocalSGDOptimizer(
        optim=torch.optim.SGD(net.parameters(), lr=learning_rate), averager=averager
    )


def _perform_a_train_step(optimizer, net, loss_fn, input, target) -> None:
    optimizer.zero_grad()
    loss_fn(net(input), target).backward()
    optimizer.step()


def _test_post_localSGD_optimizer_parity(create_averager: Callable, grad_is_view: bool) -> None:
    """SGD then ``averager.average_parameters`` by hand equals ``PostLocalSGDOptimizer``, step by step,
    with the same averager step count at the end."""
    learning_rate = 0.03
    ddp_net = Net()
    net = DDP(copy.deepcopy(ddp_net), gradient_as_bucket_view=grad_is_view)
    averager = create_averager()
    opt = torch.optim.SGD(net.parameters(), lr=learning_rate)
    net_using_post_localSGD_opt = DDP(copy.deepcopy(ddp_net), gradient_as_bucket_view=grad_is_view)
    averager2 = create_averager()  # not a deep copy: a process group may not pickle
    post_localSGD_opt = _create_post_localSGD_optimizer(net_using_post_localSGD_opt, learning_rate, averager2)
    input = torch.randn(dist.get_world_size() * 2, 2)
    target = torch.randn(dist.get_world_size() * 2, 4)
    loss_fn = nn.MSELoss()
    for _ in range(20):
        _perform_a_train_step(opt, net, loss_fn, input, target)
        averager.average_parameters(net.parameters())
        _perform_a_train_step(post_localSGD_opt, net_using_post_localSGD_opt, loss_fn, input, target)
        for p1, p2 in zip(net.parameters(), net_using_post_localSGD_opt.parameters(), strict=True):
            assert_close(p2.data, p1.data)
    assert averager.step == averager2.step, (averager.step, averager2.step)  # pytorch/pytorch#74737


def test_post_localSGD_optimizer_parity() -> None:
    """PostLocalSGDOptimizer over DDP equals SGD plus periodic model averaging."""
    _test_post_localSGD_optimizer_parity(_create_periodic_model_averager, grad_is_view=False)


def test_post_localSGD_optimizer_parity_grad_is_view() -> None:
    """The same with gradient_as_bucket_view=True."""
    _test_post_localSGD_optimizer_parity(_create_periodic_model_averager, grad_is_view=True)


@contextmanager
def _rank_temp_file():
    """Upstream's ``_rank_temp_file``: a file that every rank names alike, here in a directory that
    rank 0 creates and removes once every rank is done with it."""
    directory = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    names = [None if directory is None else os.path.join(directory, "checkpoint.pt")]
    dist.broadcast_object_list(names)
    try:
        yield names[0]
    finally:
        dist.barrier()
        if directory is not None:
            shutil.rmtree(directory)


def _test_post_localSGD_optimizer_step_reload(create_averager: Callable, chkpt_file: str) -> None:
    """The averager's step count is saved with the optimizer's state dict and loaded back; a state dict
    without it warns and resets the count to 0."""
    learning_rate = 0.03
    net_using_post_localSGD_opt = DDP(Net())
    averager = create_averager()
    post_localSGD_opt = _create_post_localSGD_optimizer(net_using_post_localSGD_opt, learning_rate, averager)
    averager2 = create_averager()
    dummy_post_localSGD_opt = _create_post_localSGD_optimizer(net_using_post_localSGD_opt, learning_rate, averager2)
    input = torch.randn(dist.get_world_size() * 2, 2)
    target = torch.randn(dist.get_world_size() * 2, 4)
    loss_fn = nn.MSELoss()
    for _ in range(20):
        _perform_a_train_step(post_localSGD_opt, net_using_post_localSGD_opt, loss_fn, input, target)
    if dist.get_rank() == 0:
        torch.save({"optimizer_state_dict": post_localSGD_opt.state_dict()}, chkpt_file)
    dist.barrier()
    checkpoint = torch.load(chkpt_file, map_location="cpu")
    dummy_post_localSGD_opt.load_state_dict(checkpoint["optimizer_state_dict"])
    assert averager2.step != 0  # not the trivial case
    assert averager.step == averager2.step, (averager.step, averager2.step)
    del checkpoint["optimizer_state_dict"]["step"]
    assert "step" not in checkpoint["optimizer_state_dict"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dummy_post_localSGD_opt.load_state_dict(checkpoint["optimizer_state_dict"])
    expected = "Loaded state dict does not contain a step counter for an averager. Setting step counter to 0."
    assert any(issubclass(w.category, UserWarning) and expected in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    assert averager2.step == 0


def test_post_localSGD_optimizer_step_reload() -> None:
    """The post-local-SGD optimizer's averager step survives a checkpoint (a file in a temporary directory)."""
    with _rank_temp_file() as tmp_file:
        _test_post_localSGD_optimizer_step_reload(_create_periodic_model_averager, tmp_file)


# ---- buffers and their hooks, init/forward sync, ignored parameters ------------------------------------------------


class NetWithBuffers(nn.Module):
    """Two bias-free layers and a buffer the forward increments in place (unless ``increments=False``)."""

    def __init__(self, increments: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)
        self.register_buffer("buffer", torch.randn(1, 2))
        self.increments = increments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.increments:
            self.buffer.add_(1)
        return self.b(self.a(x))


def _verify_buffers_equal(m1, m2) -> None:
    """Upstream's ``_verify_buffers_equal``: the two wrappers hold the same buffers, each the same on every rank."""
    m1_buffers_by_name = dict(m1.module.named_buffers())
    for name, buf in m2.module.named_buffers():
        assert_close(m1_buffers_by_name[name], buf)
    for buf1, buf2 in zip(list(m1.buffers()), list(m2.buffers()), strict=True):
        for buf in (buf1, buf2):
            gathered = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, buf)
            for other in gathered:
                assert_close(other, buf)


def test_ddp_broadcast_buffer() -> None:
    """A buffer that rank 0 replaces (a new tensor) before each forward reaches every rank."""
    rank = dist.get_rank()
    torch.manual_seed(rank)

    model_ddp = DDP(NetWithBuffers(increments=False))
    inp = torch.randn(2, 10)
    for _ in range(2):
        if rank == 0:
            model_ddp.module.buffer = model_ddp.module.buffer + 1
        model_ddp(inp).sum().backward()
        bufs = [torch.empty_like(model_ddp.module.buffer) for _ in range(dist.get_world_size())]
        dist.all_gather(bufs, model_ddp.module.buffer)
        for buf in bufs[1:]:
            assert_close(buf, bufs[0])


def _test_ddp_buffer_hook_allreduce(return_futures: bool) -> None:
    rank = dist.get_rank()
    torch.manual_seed(rank)

    def buffer_comm_hook(ddp, named_buffers):
        buffers = list(named_buffers.values())
        futs = [dist.all_reduce(buffer, group=ddp.process_group, async_op=True).get_future() for buffer in buffers]
        if return_futures:
            return futs
        torch.futures.collect_all(futs).wait()

    hook_pre_fwd = _BufferCommHookLocation.PRE_FORWARD
    hook_post_fwd = _BufferCommHookLocation.POST_FORWARD
    for hook_run_location in [hook_pre_fwd, hook_post_fwd]:
        model = NetWithBuffers()
        model_ddp = DDP(model)
        model_ddp._register_buffer_comm_hook(model_ddp, buffer_comm_hook, hook_run_location)
        model_ddp_no_hook = DDP(copy.deepcopy(model), broadcast_buffers=False)
        inp = torch.randn(2, 10)
        for _ in range(2):
            loss_hook = model_ddp(inp).sum()
            # the reference all-reduces its buffers by hand, before or after its forward like the hook
            if hook_run_location == hook_pre_fwd:
                for tensor in list(model_ddp_no_hook.module.buffers()):
                    dist.all_reduce(tensor)
            loss_no_hook = model_ddp_no_hook(inp).sum()
            if hook_run_location == hook_post_fwd:
                for tensor in list(model_ddp_no_hook.module.buffers()):
                    dist.all_reduce(tensor)
            # returned futures are awaited by DDP only at the end of the backward
            if not return_futures:
                _verify_buffers_equal(model_ddp, model_ddp_no_hook)
            loss_hook.backward()
            loss_no_hook.backward()
            # a pre-forward hook's async all-reduce races the forward's in-place add: compared post-forward only
            if return_futures and hook_run_location == hook_post_fwd:
                _verify_buffers_equal(model_ddp, model_ddp_no_hook)
        dist.barrier()


def test_ddp_buffer_hook_allreduce_return_future() -> None:
    """A buffer hook returning all-reduce futures (pre- and post-forward): DDP awaits them by the end of the
    backward, leaving the buffers of a hand all-reduced reference."""
    _test_ddp_buffer_hook_allreduce(return_futures=True)


def test_ddp_buffer_hook_allreduce() -> None:
    """A buffer hook that all-reduces and waits, pre- or post-forward, replaces DDP's buffer broadcast."""
    _test_ddp_buffer_hook_allreduce(return_futures=False)


def test_ddp_broadcast_buffer_via_hook() -> None:
    """A buffer hook calling ``ddp._default_broadcast_coalesced`` equals DDP's default buffer broadcast."""
    rank = dist.get_rank()
    torch.manual_seed(rank)

    def buffer_comm_hook(ddp, named_buffers):
        ddp._default_broadcast_coalesced(list(named_buffers.values()))

    model = NetWithBuffers()
    model_ddp = DDP(model)
    model_ddp._register_buffer_comm_hook(model_ddp, buffer_comm_hook)
    model_ddp_no_hook = DDP(copy.deepcopy(model))
    inp = torch.randn(2, 10)
    for _ in range(2):
        loss_hook = model_ddp(inp).sum()
        loss_no_hook = model_ddp_no_hook(inp).sum()
        _verify_buffers_equal(model_ddp, model_ddp_no_hook)
        loss_hook.backward()
        loss_no_hook.backward()


def test_ddp_join_respects_forward_sync_buffers_false() -> None:
    """forward_sync_buffers=False: the final model sync after uneven inputs under join() leaves buffers alone."""
    rank = dist.get_rank()
    torch.manual_seed(rank + 42)

    class NetWithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(10, 10, bias=False)
            self.register_buffer("rank_local", torch.randn(10))

        def forward(self, x):
            return self.fc(x) + self.rank_local

    ddp = DDP(NetWithBuffers(), forward_sync_buffers=False)
    buf_before = ddp.module.rank_local.detach().clone()
    with ddp.join():
        for _ in range(rank + 1):  # uneven inputs: rank 0 finishes first
            ddp(torch.randn(2, 10)).sum().backward()
    assert_close(ddp.module.rank_local.detach().clone(), buf_before)


def test_ddp_init_sync_buffers_with_forward_sync_buffers_false() -> None:
    """forward_sync_buffers=False still broadcasts buffers at construction, but not before each forward."""
    rank = dist.get_rank()
    torch.manual_seed(rank)

    class NetWithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(10, 10, bias=False)
            self.register_buffer("frozen_coeff", torch.randn(10))

        def forward(self, x):
            return self.a(x) + self.frozen_coeff

    model_ddp = DDP(NetWithBuffers(), forward_sync_buffers=False)
    assert not model_ddp.forward_sync_buffers

    def gathered():
        bufs = [torch.empty_like(model_ddp.module.frozen_coeff) for _ in range(dist.get_world_size())]
        dist.all_gather(bufs, model_ddp.module.frozen_coeff)
        return bufs

    bufs = gathered()
    for buf in bufs[1:]:
        assert_close(buf, bufs[0])
    if rank == 0:
        model_ddp.module.frozen_coeff += 1
    model_ddp(torch.randn(2, 10)).sum().backward()
    bufs = gathered()
    if dist.get_world_size() > 1:
        assert_not_close(bufs[1], bufs[0])


def test_ddp_broadcast_buffers_deprecation_warning() -> None:
    """Passing broadcast_buffers (alone or with forward_sync_buffers, which wins) raises a FutureWarning naming
    it; the default and forward_sync_buffers alone do not."""

    def count_broadcast_buffers_warnings(caught):
        return len([w for w in caught
                    if issubclass(w.category, FutureWarning) and "broadcast_buffers" in str(w.message)])

    for val in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DDP(nn.Linear(10, 10), broadcast_buffers=val)
        assert count_broadcast_buffers_warnings(caught) > 0, val

    for bb, fsb in ((False, True), (True, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DDP(nn.Linear(10, 10), broadcast_buffers=bb, forward_sync_buffers=fsb)
        assert count_broadcast_buffers_warnings(caught) > 0, (bb, fsb)
        assert ddp.forward_sync_buffers == fsb

    for kwargs in ({}, {"forward_sync_buffers": False}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DDP(nn.Linear(10, 10), **kwargs)
        assert count_broadcast_buffers_warnings(caught) == 0, kwargs


def test_ddp_sync_module_states() -> None:
    """``_sync_module_states`` with the wrapper's group, bucket size and ignored names makes every rank's
    (replaced, differing) module equal to rank 1's."""
    dim, rank, rank_to_broadcast = 2, dist.get_rank(), 1
    torch.manual_seed(rank)  # a different model on each rank
    net = DDP(nn.Linear(dim, dim, bias=False), bucket_cap_mb=1)
    new_model = nn.Linear(dim, dim, bias=False)
    net.module = copy.deepcopy(new_model)
    net_module_states = list(net.module.state_dict().values())
    for t in net_module_states:
        tensor_list = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(tensor_list, t)
        for i, tensor in enumerate(tensor_list):
            if i == rank:
                assert_close(tensor, t)
            else:
                assert_not_close(tensor, t)
    _sync_module_states(
        module=net.module,
        process_group=net.process_group,
        broadcast_bucket_size=net.broadcast_bucket_size,
        src=rank_to_broadcast,
        params_and_buffers_to_ignore=net.parameters_to_ignore,
    )
    _validate_net_equivalence(net)
    if rank == rank_to_broadcast:
        for t, expected in zip(net_module_states, new_model.state_dict().values(), strict=True):
            assert_close(t, expected)


def _test_ddp_ignore_params_arg(static_graph: bool = False) -> None:
    rank = dist.get_rank()

    class TestModel(nn.Module):
        def __init__(self, rank: int) -> None:
            self.rank = rank
            super().__init__()
            self.fc1 = nn.Linear(1, 1, bias=False)
            # a proxy, of a different shape on each rank, replaced after wrapping
            self.fc2 = nn.Linear(1, 10, bias=False) if self.rank == 0 else nn.Linear(10, 10, bias=False)

        def forward(self, x):
            return self.fc2(self.fc1(x))

    for find_unused, broadcast_buffers in itertools.product([False, True], [False, True]):
        model = TestModel(rank).float()
        # ignored buffers may differ in shape across ranks too
        model.fc2.register_buffer("ignore_buffer", torch.zeros(5 + rank))
        proxy_params = list(model.fc2.parameters())
        fc2_name = next(name for name, module in model.named_modules() if module is model.fc2)
        proxy_param_names = [f"{fc2_name}.{name}" for name, _ in model.fc2.named_parameters()]
        proxy_buffer_names = [f"{fc2_name}.{name}" for name, _ in model.fc2.named_buffers()]
        DDP._set_params_and_buffers_to_ignore_for_model(model, proxy_param_names + proxy_buffer_names)
        ddp = DDP(model, find_unused_parameters=find_unused, broadcast_buffers=broadcast_buffers,
                  static_graph=static_graph)
        # materialised after wrapping: no DDP hooks on these parameters
        ddp.module.fc2 = nn.Linear(1, 1, bias=False)
        local_model = copy.deepcopy(ddp.module)
        inp = torch.ones(1, dtype=torch.float) * (rank + 1)
        for _ in range(6):
            ddp(inp).sum().backward()
            local_model(inp).sum().backward()
            # DDP leaves the materialised layer alone: its grad is the local one
            for materialized_param, local_param in zip(ddp.module.fc2.parameters(), local_model.fc2.parameters(),
                                                       strict=True):
                assert_close(materialized_param.grad, local_param.grad)
            # fc1 is averaged over the ranks, so it differs from the local grad
            for synced_param, local_param in zip(ddp.module.fc1.parameters(), local_model.fc1.parameters(),
                                                 strict=True):
                assert not (synced_param.grad == local_param.grad)
            for proxy_param in proxy_params:
                assert proxy_param.grad is None
        dist.barrier()


def test_ddp_ignore_params_arg() -> None:
    """Parameters and buffers named to be ignored (shapes differing across ranks) are neither checked,
    broadcast nor reduced; a layer swapped in after wrapping keeps local grads, the rest is averaged."""
    _test_ddp_ignore_params_arg(static_graph=False)
    _test_ddp_ignore_params_arg(static_graph=True)


def test_get_data_parallel_params() -> None:
    """``_get_data_parallel_params`` yields the parameters DDP manages: all but the ignored one."""
    model = TwoLinLayerNet()
    params_to_ignore = ["a.weight"]
    DDP._set_params_and_buffers_to_ignore_for_model(model, params_to_ignore)
    DDP(model)
    for name, _ in DDP._get_data_parallel_params(model, named_params=True):
        assert name != f"module.{params_to_ignore[0]}"
    num_ddp_params = len(list(model.parameters())) - 1
    count = sum(1 for _ in DDP._get_data_parallel_params(model, named_params=False))
    assert count == num_ddp_params, (count, num_ddp_params)


# ---- logging, debug mapping --------------------------------------------------------------------------------------


def _get_profiling_event(event_name: str, profiler: Any, dedup_gpu_user_annotation: bool = False) -> list:
    """Upstream's ``get_profiling_event``: the profiled events whose name starts or ends with ``event_name``."""
    event_list = profiler.events() if isinstance(profiler, torch.profiler.profile) else profiler.function_events
    return [
        event for event in event_list
        if (event.name.endswith(event_name) or event.name.startswith(event_name))
        and (not dedup_gpu_user_annotation or event.device_type not in [DeviceType.CUDA, DeviceType.XPU])
    ]


def _test_ddp_profiling(profiler_ctx: Any, profiler_ctx2: Any = None) -> Any:
    """Upstream's ``_test_ddp_profiling``: 6 steps profiled record one ``gloo:all_reduce`` each (async) and a
    ``gloo:broadcast`` at least (the constructor's); after 3 steps unprofiled of a second wrapper with
    find_unused_parameters, one step profiled records its all-reduce and one ``search_unused_parameters``.

    The model stays on the CPU. Every check runs after both profiled runs (upstream checks the first before the second
    wrapper's constructor broadcasts): a check that fails on one rank only then cannot leave the other waiting in it."""
    batch = 3
    dim = 10
    num_iters = 6
    model = nn.Linear(dim, dim, bias=False)
    inp = torch.rand(batch, dim)
    net = DDP(model)
    if profiler_ctx2 is None:
        profiler_ctx2 = copy.deepcopy(profiler_ctx)

    with profiler_ctx as prof:
        for _ in range(num_iters):
            loss = net(inp).sum()
            loss.backward()

    # Run DDP with profiling for a few iterations, then enable profiling for a single pass, and ensure it is recorded.
    # This tests that the thread local state is correctly updated.
    net = DDP(model, find_unused_parameters=True)
    for _ in range(3):
        loss = net(inp).sum()
        loss.backward()
    with profiler_ctx2 as prof2:
        loss = net(inp).sum()
        loss.backward()

    all_reduce_event_name = f"{dist.get_backend()}:all_reduce"
    events = _get_profiling_event(all_reduce_event_name, prof, dedup_gpu_user_annotation=True)
    event_count = sum(e.count for e in events)
    assert event_count == num_iters, f"{event_count} {all_reduce_event_name} events, not {num_iters}"
    for event in events:
        assert event.is_async, event
        assert event.name == all_reduce_event_name
    broadcast_event_name = f"{dist.get_backend()}:broadcast"
    broadcast_events = _get_profiling_event(broadcast_event_name, prof, dedup_gpu_user_annotation=True)
    event_count = sum(e.count for e in broadcast_events)
    # Broadcast is called during rebuild_buckets
    assert event_count >= 1, f"no {broadcast_event_name} event"
    for event in broadcast_events:
        assert event.name == broadcast_event_name

    events = _get_profiling_event(all_reduce_event_name, prof2, dedup_gpu_user_annotation=True)
    assert len(events) >= 1, f"no {all_reduce_event_name} event in the second profile"
    assert events[0].count >= 1
    assert events[0].name == all_reduce_event_name
    for event in events:
        assert event.is_async, event
    # Ensure searching unused parameters was profiled
    events = _get_profiling_event("search_unused_parameters", prof2)
    assert len(events) == 1, f"search_unused_parameters events: {[e.name for e in events]}"
    return prof


def test_ddp_profiling_autograd_profiler() -> None:
    """DDP's collectives under ``torch.autograd.profiler.profile()``."""
    autograd_profiler_ctx = torch.autograd.profiler.profile()
    _test_ddp_profiling(profiler_ctx=autograd_profiler_ctx)


def test_ddp_profiling_torch_profiler() -> None:
    """DDP's collectives under ``torch.profiler.profile()``, the CPU's activity only (upstream adds CUDA's; its
    further checks are NCCL's)."""
    torch_profiler_ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    _test_ddp_profiling(profiler_ctx=torch_profiler_ctx)


def test_ddp_python_error_logged() -> None:
    """A Python error raised after the reducer exists (a comm hook that is not callable) is logged."""
    model = DDP(TwoLinLayerNet())
    expected_err = "must be callable"
    with raises(TypeError, expected_err):
        model.register_comm_hook({}, {})
    verify_ddp_error_logged(model, expected_err)


def test_ddp_comm_hook_logging() -> None:
    """``comm_hook`` in the logging data: absent before registration, the hook's qualified name (or the
    built-in hook's str) after, and "" after training without a hook."""
    hooks = [
        default.allreduce_hook,
        default.fp16_compress_hook,
        powerSGD.powerSGD_hook,
        powerSGD.batched_powerSGD_hook,
        quantization_hooks.quantization_pertensor_hook,
        quantization_hooks.quantization_perchannel_hook,
    ]
    for hook in hooks:
        ddp_model = DDP(nn.Linear(1, 1, bias=False))
        assert ddp_model._get_ddp_logging_data().get("comm_hook") is None
        ddp_model.register_comm_hook(None, hook)
        assert ddp_model._get_ddp_logging_data().get("comm_hook") == hook.__qualname__
    for builtin in (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS):
        ddp_model = DDP(nn.Linear(1, 1, bias=False))
        assert ddp_model._get_ddp_logging_data().get("comm_hook") is None
        ddp_model._register_builtin_comm_hook(builtin)
        assert ddp_model._get_ddp_logging_data().get("comm_hook") == str(builtin)
    ddp_model = DDP(nn.Linear(1, 1, bias=False))
    assert ddp_model._get_ddp_logging_data().get("comm_hook") is None
    for _ in range(2):
        ddp_model(torch.ones(1, 1)).sum().backward()
    assert ddp_model._get_ddp_logging_data().get("comm_hook", "") == ""


def test_ddp_logging_data_gpu() -> None:
    """The parts of upstream's GPU logging test that are not about CUDA: the gradient-ready order and
    rebuilt bucket indices, average times and host-side times in order. Left out: device_ids ==
    str(rank) and output_device == rank (a CUDA device per rank; on the CPU they are "" and -1, which
    test_ddp_logging_data_cpu checks)."""
    model_ddp = _ddp_logging_data()
    data = model_ddp._get_ddp_logging_data()
    expected_order = list(reversed([str(x) for x in range(3)]))
    assert data.get("prev_iteration_grad_ready_order_indices") == ", ".join(expected_order)
    assert data.get("rebuilt_per_bucket_param_indices") == " ".join(expected_order)
    assert data.get("avg_forward_compute_time") >= 1
    assert data.get("avg_backward_compute_comm_overlap_time") >= 1
    assert data.get("avg_backward_compute_time") >= data.get("avg_backward_compute_comm_overlap_time")
    assert data.get("avg_backward_comm_time") >= data.get("avg_backward_compute_comm_overlap_time")
    assert data.get("backward_comm_time_end") >= data.get("backward_comm_time_start")
    assert data.get("backward_comm_time_start") >= data.get("backward_compute_time_start")
    assert data.get("backward_compute_time_end") >= data.get("backward_compute_time_start")
    assert data.get("backward_compute_time_start") >= data.get("forward_compute_time_start")


def test_sync_bn_logged() -> None:
    """``has_sync_bn`` is false in the logging data of a model with plain BatchNorm. Upstream's second
    half (true after convert_sync_batchnorm) cannot run here: torch DDP refuses SyncBatchNorm in a CPU
    module at construction, which is checked instead."""
    model = BatchNormNet()
    no_sync_bn = DDP(copy.deepcopy(model))
    assert not no_sync_bn._get_ddp_logging_data().get("has_sync_bn", True)
    with raises(ValueError, "SyncBatchNorm layers only work with GPU modules"):
        DDP(nn.SyncBatchNorm.convert_sync_batchnorm(model))


def _build_debug_param_to_name_mapping() -> None:
    net = DDP(TwoLinLayerNet())
    net_params, _ = net._build_params_for_reducer()
    assert net._build_debug_param_to_name_mapping(net_params) == {0: "a.weight", 1: "b.weight"}

    # ignored parameters ({module_name}.{param_name}) are not in the mapping
    model = TwoLinLayerNet()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["a.weight"])
    net = DDP(model)
    net_params, _ = net._build_params_for_reducer()
    assert net._build_debug_param_to_name_mapping(net_params) == {0: "b.weight"}

    # DDP's parameters and the module's disagree (a DDP bug, not a user error): both directions raise
    net = DDP(TwoLinLayerNet())
    net_params, _ = net._build_params_for_reducer()
    net_params.extend([nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))])
    with raises(ValueError, "Expected param to name mapping"):
        net._build_debug_param_to_name_mapping(net_params)
    net_params = net_params[:-3]
    with raises(ValueError, "Param with name"):
        net._build_debug_param_to_name_mapping(net_params)


def test_ddp_build_debug_param_to_name_mapping() -> None:
    """Parameter index -> name mapping, without and with ignored parameters, and its two consistency errors
    (debug level INFO)."""
    _with_debug_levels(["INFO"], _build_debug_param_to_name_mapping)


def _build_debug_param_to_name_mapping_requires_grad() -> None:
    class ToyNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 10)
            self.lin.bias.requires_grad_(False)  # not tracked by DDP, so not in the mapping

        def forward(self, x):
            return self.lin(x)

    net = DDP(ToyNet())
    net_params, _ = net._build_params_for_reducer()
    assert net._build_debug_param_to_name_mapping(net_params) == {0: "lin.weight"}


def test_ddp_build_debug_param_to_name_mapping_requires_grad() -> None:
    """A parameter that does not require grad is left out of the index -> name mapping (debug level INFO)."""
    _with_debug_levels(["INFO"], _build_debug_param_to_name_mapping_requires_grad)


# ---- optimizer in backward -----------------------------------------------------------------------------------------


def _test_ddp_apply_optim_in_backward(optim_cls, optim_kwargs, init_before, gradient_as_bucket_view=True) -> None:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # inputs differ across ranks, so the all-reduce matters
    # upstream adds torchvision's resnet50 (on 1x3x1000x1000 inputs) only when torchvision is installed
    models_to_test = [
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)),
        nn.Sequential(nn.Linear(3, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 3)),  # over 1M parameters
    ]
    for model in models_to_test:
        model_optim_in_bwd = copy.deepcopy(model)
        model = DDP(model, gradient_as_bucket_view=gradient_as_bucket_view)
        optim = optim_cls(model.parameters(), **optim_kwargs)
        if init_before:
            _apply_optimizer_in_backward(optimizer_class=optim_cls, params=model_optim_in_bwd.parameters(),
                                         optimizer_kwargs=optim_kwargs)
        model_optim_in_bwd = DDP(model_optim_in_bwd, gradient_as_bucket_view=gradient_as_bucket_view)
        if not init_before:
            _apply_optimizer_in_backward(optimizer_class=optim_cls, params=model_optim_in_bwd.parameters(),
                                         optimizer_kwargs=optim_kwargs)
        for p1, p2 in zip(model.parameters(), model_optim_in_bwd.parameters(), strict=True):
            assert_close(p2, p1, msg="Parameters not initially equal!")
        for i in range(4):  # upstream: 8 (see test_ddp_apply_optim_in_backward)
            inp = torch.randn(10, 3)
            model(inp).sum().backward()
            optim.step()
            model_optim_in_bwd(inp).sum().backward()  # steps its optimizer too
            for p1, p2 in zip(model.parameters(), model_optim_in_bwd.parameters(), strict=True):
                assert_close(p2, p1, msg=f"Params not equal at iteration {i}")
                assert p2.grad is None, f"Optim in backward grad is not None at {i}"
            optim.zero_grad(set_to_none=True)  # as the in-backward side leaves its grads


def test_ddp_apply_optim_in_backward() -> None:
    """``_apply_optimizer_in_backward`` (SGD, Adam; applied before or after wrapping) steps on the averaged
    gradient and leaves ``.grad`` None: parameters equal those of DDP + a regular optimizer after every step.

    4 steps instead of upstream's 8: with SGD at lr 0.03 the 1024-wide model's weights pass 1e5 at the 5th step
    and reach inf/NaN at the 8th (equal there only through assertEqual's equal_nan=True); 4 steps keep every
    comparison finite and halve the time."""
    for optim_cls, init_before in itertools.product([torch.optim.SGD, torch.optim.Adam], [True, False]):
        _test_ddp_apply_optim_in_backward(optim_cls=optim_cls, optim_kwargs={"lr": 0.03}, init_before=init_before)


def test_ddp_apply_optim_in_backward_grad_as_bucket_view_false() -> None:
    """The same with gradient_as_bucket_view=False (SGD), 4 steps (upstream 8)."""
    for init_before in [True, False]:
        _test_ddp_apply_optim_in_backward(optim_cls=torch.optim.SGD, optim_kwargs={"lr": 0.03},
                                          init_before=init_before, gradient_as_bucket_view=False)


def test_ddp_apply_optim_in_backward_ignored_params() -> None:
    """An ignored parameter's in-backward optimizer steps on its local gradient (so it differs across ranks);
    the others step on the averaged one (equal across ranks)."""
    for init_before in [True, False]:
        torch.manual_seed(dist.get_rank())
        model = TwoLinLayerNet()
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["a.weight"])
        if init_before:
            _apply_optimizer_in_backward(optimizer_class=torch.optim.SGD, params=model.parameters(),
                                         optimizer_kwargs={"lr": 0.03})
        net = DDP(model)
        if not init_before:
            _apply_optimizer_in_backward(optimizer_class=torch.optim.SGD, params=model.parameters(),
                                         optimizer_kwargs={"lr": 0.03})
        a, b = net(torch.randn(1, 10))
        (a.transpose(0, 1) @ b).sum().backward()
        models = [None for _ in range(dist.get_world_size())]
        dist.all_gather_object(models, model)
        rank0_model, remainder = models[0], models[1:]
        for m in remainder:
            assert_not_close(m.a.weight, rank0_model.a.weight)
            assert_close(list(m.b.parameters()), list(rank0_model.b.parameters()))
            assert_close(m.a.bias, rank0_model.a.bias)  # both None: bias=False


# ---- native mixed precision ----------------------------------------------------------------------------------------


def _get_fp16_config() -> _MixedPrecision:
    return _MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)


def test_ddp_native_mixed_precision_ignored_params() -> None:
    """With mixed_precision, each managed parameter and buffer gets ``_mp_param`` (fp16) and ``_fp_param`` (fp32)
    at construction; ignored ones get neither."""
    torch.manual_seed(dist.get_rank())
    model = TwoLinLayerNet()
    model.register_buffer("buffer", torch.ones(5))
    to_ignore = ["a.weight", "buffer"]
    DDP._set_params_and_buffers_to_ignore_for_model(model, to_ignore)
    mp_config = _get_fp16_config()
    net = DDP(model, mixed_precision=mp_config, gradient_as_bucket_view=True)
    to_ignore = [f"module.{name}" for name in to_ignore]
    n_ignored = 0
    for n, p in itertools.chain(net.named_parameters(), net.named_buffers()):
        if n in to_ignore:
            n_ignored += 1
            assert not hasattr(p, "_mp_param"), n
            assert not hasattr(p, "_fp_param"), n
        else:
            assert p._mp_param.dtype == mp_config.param_dtype, n
            assert p._fp_param.dtype == torch.float32, n
    assert n_ignored == len(to_ignore), n_ignored


def _test_ddp_native_mixed_precision(gradient_as_bucket_view: bool, set_grad_to_none: bool) -> None:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    inp = torch.randn(10, 1)
    mp_config = _get_fp16_config()

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = nn.Linear(1, 5)
            self.register_buffer("buffer", torch.randn(1, 2))
            self.p = nn.Parameter(torch.randn(10, 5), requires_grad=False)

        def forward(self, x):
            # inside the forward: parameters, buffers and inputs in low precision
            for p in self.m.parameters():
                assert p.dtype == mp_config.param_dtype, p.dtype
            assert self.buffer.dtype == mp_config.buffer_dtype, self.buffer.dtype
            assert x.dtype == mp_config.param_dtype, x.dtype
            return self.m(x) + self.p

    net = DDP(MyModel(), mixed_precision=mp_config, gradient_as_bucket_view=gradient_as_bucket_view)
    assert net.module.buffer.dtype == mp_config.buffer_dtype  # buffers are cast in the constructor
    for p in net.parameters():
        assert p._mp_param.dtype == mp_config.param_dtype
        assert p._fp_param.dtype == torch.float32
    for _ in range(6):
        net(inp).sum().backward()
        # after the backward: fp32 parameters and gradients, the gradients equal on every rank
        for n, param in net.named_parameters():
            assert param.dtype == torch.float32, n
            if param.grad is None:
                assert n == "module.p", f"Expected n == 'module.p', got {n!r}"  # the one without grad
            else:
                assert param.grad.dtype == torch.float32, n
                tensor_list = [torch.zeros_like(param.grad) for _ in range(dist.get_world_size(net.process_group))]
                dist.all_gather(tensor_list, param.grad)
                g, rest = tensor_list[0], tensor_list[1:]
                assert g.dtype == torch.float32
                for g_ in rest:
                    assert g_.dtype == torch.float32
                    # upstream's assertEqual has equal_nan=True; torch's DDP left -inf/NaN (alike on every rank) in
                    # the first iteration's gradients when run on the CPU
                    assert_close(g_, g, equal_nan=True)
        net.zero_grad(set_to_none=set_grad_to_none)


def test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none() -> None:
    """fp16 mixed precision (params, reduction, buffers), gradient_as_bucket_view=False,
    zero_grad(set_to_none=False)."""
    _test_ddp_native_mixed_precision(gradient_as_bucket_view=False, set_grad_to_none=False)


def test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none() -> None:
    """fp16 mixed precision, gradient_as_bucket_view=True, zero_grad(set_to_none=False)."""
    _test_ddp_native_mixed_precision(gradient_as_bucket_view=True, set_grad_to_none=False)


def test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none() -> None:
    """fp16 mixed precision, gradient_as_bucket_view=True, zero_grad(set_to_none=True)."""
    _test_ddp_native_mixed_precision(gradient_as_bucket_view=True, set_grad_to_none=True)


def test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none() -> None:
    """fp16 mixed precision, zero_grad(set_to_none=True); despite its name upstream passes
    gradient_as_bucket_view=True here (kept as upstream wrote it)."""
    _test_ddp_native_mixed_precision(gradient_as_bucket_view=True, set_grad_to_none=True)


# ---- construction: device mesh, bucket caps, device, the model checked across ranks --------------------------------


def test_ddp_zero_output_features() -> None:
    """DDP accepts a module with a zero-sized parameter (nn.Linear(10, 0))."""

    class ToyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net1 = nn.Linear(10, 10)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(10, 0)

    DDP(ToyModel())


def test_ddp_bucket_cap_mb_list() -> None:
    """bucket_cap_mb_list=[1, 2] is kept in bytes as ``bucket_bytes_cap_list`` and trains; without it the list
    is empty."""
    bucket_cap_mb_list = [1, 2]
    ddp_with_list = DDP(LargeNet(), bucket_cap_mb_list=bucket_cap_mb_list)
    for _ in range(2):  # the second iteration is where buckets would be rebuilt
        ddp_with_list(torch.randn(10, 1000)).sum().backward()
    assert ddp_with_list.bucket_bytes_cap_list == [int(cap * 1024 * 1024) for cap in bucket_cap_mb_list]

    ddp_without_list = DDP(LargeNet(), bucket_cap_mb=25)
    for _ in range(2):
        ddp_without_list(torch.randn(10, 1000)).sum().backward()
    assert ddp_without_list.bucket_bytes_cap_list == []


def test_ddp_device_mesh_initialization() -> None:
    """A 1-D device mesh (CPU, Gloo) is accepted and kept as ``device_mesh``; with process_group too, or with
    a 2-D mesh, construction raises."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    device_mesh = init_device_mesh("cpu", (world_size,))
    pg = dist.distributed_c10d._get_default_group()
    model = TwoLinLayerNet()
    ddp_model = DDP(model, device_mesh=device_mesh)
    assert ddp_model.device_mesh == device_mesh
    with raises(RuntimeError, "Cannot specify both process_group and device_mesh arguments."):
        DDP(model, process_group=pg, device_mesh=device_mesh)
    with raises(RuntimeError, "Only 1D device mesh is supported,"):
        device_mesh = init_device_mesh("cpu", (2, world_size // 2))
        DDP(model, device_mesh=device_mesh)


def test_ddp_device() -> None:
    """Tuple, list, custom-type, namedtuple and dict inputs reach the module's forward with their type kept and
    their tensors on the module's device (upstream: moved from the CPU to cuda:rank; here the CPU)."""
    expected_len = 2
    module_device = torch.device("cpu")  # upstream: device index == rank

    class TensorWrapper:
        __slots__ = ["t", "moved_to_device"]

        def __init__(self, t):
            self.t = t
            self.moved_to_device = False

    def tuple_and_list_validator(x):
        assert len(x) == expected_len  # upstream: assertTrue(len(x), expected_len)
        assert len({t.device for t in x}) == 1
        assert x[0].device == module_device
        return x[0] + x[1]

    def namedtuple_validator(x):
        assert x._fields == _EXPECTED_FIELDS
        assert x.a.device == x.b.device
        assert x.a.device == module_device
        return x.a + x.b

    def custom_type_validator(x):
        # like scatter, DDP does not look inside custom types: the forward moves the tensor itself
        assert x.moved_to_device or str(x.t.device) == "cpu"
        x.t = x.t.to(module_device)
        x.moved_to_device = True
        return x.t

    def dict_validator(x):
        assert _EXPECTED_FIELDS[0] in x
        assert _EXPECTED_FIELDS[1] in x
        assert len({t.device for t in x.values()}) == 1
        assert x[_EXPECTED_FIELDS[0]].device == module_device
        return x[_EXPECTED_FIELDS[0]] + x[_EXPECTED_FIELDS[1]]

    validators = {
        TensorWrapper: custom_type_validator,
        tuple: tuple_and_list_validator,
        list: tuple_and_list_validator,
        _TestNamedTupleInput_0: namedtuple_validator,
        _TestNamedTupleInput_1: namedtuple_validator,
        dict: dict_validator,
    }

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(10, 10, bias=False)

        def forward(self, x, expected_type):
            assert isinstance(x, expected_type), (type(x), expected_type)
            return self.lin(validators[expected_type](x))

    model = DDP(ToyModel())

    def train_iter(inp, input_type):
        for _ in range(4):
            model(inp, input_type).sum().backward()

    train_iter(tuple(torch.randn(10, 10) for _ in range(expected_len)), tuple)
    train_iter([torch.randn(10, 10) for _ in range(expected_len)], list)
    train_iter(TensorWrapper(torch.randn(10, 10)), TensorWrapper)
    batch, dim = 5, 10
    a = torch.rand(batch, dim)
    b = torch.rand(batch, dim)
    inp = _TestNamedTupleInput_0(a, b)
    train_iter(inp, type(inp))
    inp = _TestNamedTupleInput_1(a, b)
    train_iter(inp, type(inp))
    inp = {_EXPECTED_FIELDS[0]: a, _EXPECTED_FIELDS[1]: b}
    train_iter(inp, type(inp))


def _generate_sparse_tensors_for_bucket_assignment_test() -> list:
    tensors = [
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
    ]
    return [t.to_sparse() for t in tensors]


def test_compute_bucket_assignment_by_size_sparse_error_without_logger() -> None:
    """``dist._compute_bucket_assignment_by_size`` refuses sparse tensors, next to a wrapper (upstream's
    ``_test_compute_bucket_assignment_by_size(use_logger=False)``)."""
    group_gloo = dist.new_group(timeout=timedelta(seconds=60), backend=dist.Backend.GLOO)
    # upstream sets TORCH_NCCL_BLOCKING_WAIT for this group: nothing to do on Gloo
    group_to_use = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=5))
    # upstream builds a valid model only for the logger of the with_logger case
    DDP(EmbeddingNetDifferentParams(0), process_group=group_to_use)
    with raises(RuntimeError, "No support for sparse tensors."):
        tensors_sparse = _generate_sparse_tensors_for_bucket_assignment_test()
        dist._compute_bucket_assignment_by_size(tensors_sparse, [400])
    dist.barrier(group_gloo)


def test_compute_bucket_assignment_by_size_sparse_error_with_logger() -> None:
    """The same refusal, given the wrapper's logger: the error is also in the wrapper's logging data (upstream's
    ``_test_compute_bucket_assignment_by_size(use_logger=True)``)."""
    group_gloo = dist.new_group(timeout=timedelta(seconds=60), backend=dist.Backend.GLOO)
    group_to_use = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=5))
    # the constructor initializes the logger used below; the rest of the model is never used
    net = DDP(EmbeddingNetDifferentParams(0), process_group=group_to_use)
    # read outside the check (upstream reads it inside): a wrapper without torch's logger must fail here, not pass
    # for the AttributeError
    logger = net.logger
    expected_err = "No support for sparse tensors."
    with raises(RuntimeError, expected_err):
        tensors_sparse = _generate_sparse_tensors_for_bucket_assignment_test()
        dist._compute_bucket_assignment_by_size(tensors_sparse, [400], logger=logger)
    verify_ddp_error_logged(net, expected_err)
    dist.barrier(group_gloo)


def _test_verify_model_across_rank(use_logger: bool) -> None:
    """Parameters whose shapes differ across ranks after construction: ``_verify_param_shape_across_processes``
    raises on at least one rank, with the wrapper's logger or without."""
    group_gloo = dist.new_group(timeout=timedelta(seconds=60), backend=dist.Backend.GLOO)
    group_to_use = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=5))
    net = DDP(EmbeddingNetDifferentParams(0), process_group=group_to_use)  # builds the logger
    # shapes differ from here on; in the constructor the logger would not exist yet
    net.module.lin = nn.Linear(100 if dist.get_rank() == 0 else 10, 1)
    # read outside the try (upstream reads it inside, where any exception counts as the check's): a
    # wrapper without torch's logger must fail here, not pass for the AttributeError
    logger_args = (net.logger,) if use_logger else ()
    caught = 0
    try:
        _verify_param_shape_across_processes(net.process_group, list(net.parameters()), *logger_args)
    except Exception:
        caught = 1
    t = torch.Tensor([caught])
    dist.all_reduce(t, group=group_gloo)
    assert t.item() > 0, "no rank raised"


def test_verify_model_across_rank_with_logger() -> None:
    """The shape check across ranks, given the wrapper's logger."""
    _test_verify_model_across_rank(use_logger=True)


def test_verify_model_across_rank_without_logger() -> None:
    """The shape check across ranks, without a logger."""
    _test_verify_model_across_rank(use_logger=False)


def _run_test_ddp_model_with_diff_params(net: nn.Module, ddp_group, group_gloo) -> None:
    """Upstream's helper: constructing the wrapper over ``net`` raises on at least one rank."""
    caught = 0
    try:
        DDP(net, process_group=ddp_group)
    except Exception:
        caught = 1
    t = torch.Tensor([caught])  # as long as one rank raised
    dist.all_reduce(t, group=group_gloo)
    assert t.item() > 0, "no rank raised"


def test_ddp_model_diff_shape_across_ranks() -> None:
    """An embedding table whose shape differs across ranks: the constructor raises on at least one rank."""
    group_gloo = dist.new_group(timeout=timedelta(seconds=60), backend=dist.Backend.GLOO)
    group_to_use = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=10))
    net = EmbeddingNetDifferentParams(dist.get_rank())
    _run_test_ddp_model_with_diff_params(net, group_to_use, group_gloo)


def test_ddp_model_diff_num_params_across_ranks() -> None:
    """A model with a different number of parameters on each rank: the constructor raises on at least
    one rank."""
    group_gloo = dist.new_group(timeout=timedelta(seconds=60), backend=dist.Backend.GLOO)
    group_to_use = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=10))
    net = EmbeddingNetDifferentParams(dist.get_rank(), diff_num_params=(dist.get_rank() == 1))
    _run_test_ddp_model_with_diff_params(net, group_to_use, group_gloo)
