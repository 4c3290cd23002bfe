"""PyTorch's own DDP tests, rank side: each upstream test body, run inside every rank of a job against
``minidp.distributed.DistributedDataParallel``.

Sources (PyTorch is BSD-licensed, 3-clause; the cases below are adapted from these files, copyright
the PyTorch contributors):

* ``torch/testing/_internal/distributed/distributed_test.py`` of torch 2.13 (it ships in the wheel),
  class ``DistributedTest._DistTestBase``; its helpers ``Net``, ``_FC2``, ``LargeNet``,
  ``_prepare_dummy_data``, ``_test_DDP_helper``, ``_test_DDP_niter``, ``_model_step`` are ported below.
* ``test/distributed/test_c10d_gloo.py``, class ``DistributedDataParallelTest``, with what it
  inherits from ``test/distributed/test_c10d_common.py`` (``CommonDistributedDataParallelTest``, its
  models ``Net``, ``Task``, ``ModuleForDdpCommHook``, ``SparseGradientModule``), from the PyTorch
  repository (https://github.com/pytorch/pytorch).

How the port reads: upstream's ``MultiProcessTestCase`` seeds every process alike before each test
and compares a DDP model with a single-process model trained on the whole batch; here
``tests.helpers.run_upstream`` seeds every rank alike (one fresh seed per job) and calls each check in turn.
A check raises (``AssertionError`` from ``torch.testing.assert_close``, which is what upstream's
``assertEqual`` does on tensors, or the error the wrapper raised); the tests in
``test_upstream_ddp.py`` and ``test_upstream_c10d_gloo.py`` then assert that no rank raised.
``nn.parallel.DistributedDataParallel`` in the upstream bodies is :data:`DDP` here. Where upstream
places a model on ``cuda:rank`` only to have a device (``device_ids=[rank]``), the port runs it on
the CPU with ``device_ids=None``, which is how torch DDP takes CPU modules; each such case says so.
With ``MINIDP_UPSTREAM_DDP=torch`` in the environment, :data:`DDP` is torch's own wrapper: every case passes
on it too.
"""

# No `from __future__ import annotations`: torch DDP checks a hook's annotations as objects
# (dist.GradBucket, torch.futures.Future), as written upstream.

import copy
import io
import os
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import minidp.distributed as md

# minidp's wrapper; torch's own with MINIDP_UPSTREAM_DDP=torch in the environment, to check a port against torch.
DDP = (torch.nn.parallel.DistributedDataParallel if os.environ.get("MINIDP_UPSTREAM_DDP") == "torch"
       else md.DistributedDataParallel)
assert_close = torch.testing.assert_close


def assert_not_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Upstream's ``assertNotEqual`` on tensors: fails exactly where ``assertEqual`` would pass."""
    try:
        assert_close(actual, expected)
    except AssertionError:
        return
    raise AssertionError(f"expected different tensors, got equal ones: {actual}")


@contextmanager
def raises(kind: type, pattern: str):
    """Upstream's ``assertRaisesRegex``: the block raises ``kind`` with a message matching ``pattern``."""
    try:
        yield
    except kind as error:
        if not re.search(pattern, str(error)):
            raise AssertionError(f"{kind.__name__} raised, but {pattern!r} is not in its message: {error}") from error
        return
    raise AssertionError(f"{kind.__name__} matching {pattern!r} was not raised")


def verify_ddp_error_logged(model: nn.Module, message: str) -> None:
    """Upstream's ``verify_ddp_error_logged`` (common_distributed.py): the error is in the logging data."""
    data = model._get_ddp_logging_data()
    for key in ("iteration", "has_error", "error"):
        assert key in data, f"expected {key!r} in _get_ddp_logging_data(), got keys {sorted(data)}"
    assert message in data["error"], f"did not find {message!r} in the logged error {data['error']!r}"


# ==================================================================================================
# distributed_test.py
# ==================================================================================================


class _FC2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 50, bias=True)
        self.fc.bias.requires_grad = False  # a parameter DDP must leave out of its buckets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Net(nn.Module):
    """distributed_test.py's ``Net``: three layers, a frozen bias, and an integer parameter without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = _FC2()
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_param = nn.Parameter(torch.tensor([2, 2]).long(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(self.fc3(x), dim=1)


class LargeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1000, 2000, bias=False)
        self.fc2 = nn.Linear(2000, 500, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def _prepare_dummy_data(local_bs: int):
    global_bs = dist.get_world_size() * local_bs
    return global_bs, torch.randn(global_bs, 2), torch.randn(global_bs, 4), nn.MSELoss()


def _ddp_helper(model: nn.Module, input: torch.Tensor, target: torch.Tensor, loss, scale_factor: float = 1.0) -> None:
    """Upstream's ``_test_DDP_helper``: one forward and backward in training mode."""
    model.train()
    (loss(model(input), target) * scale_factor).backward()


def _model_step(model: nn.Module) -> None:
    for param in model.parameters():
        if param.grad is not None:
            with torch.no_grad():
                param += param.grad
            param.grad = None


def _model_step_with_zero_grad(model: nn.Module) -> None:
    for param in model.parameters():
        if param.grad is not None:
            with torch.no_grad():
                param += param.grad
            param.grad.requires_grad_(False)
            param.grad.zero_()


def _assert_equal_params(expected: list, actual: list) -> None:
    assert len(expected) == len(actual)
    for a, b in zip(expected, actual, strict=True):
        assert_close(b, a)


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    """``torch.save`` of the whole wrapper and ``torch.load`` back, as upstream does mid-training."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _ddp_niter(model_base, model_ddp, input, target, loss, local_bs, global_bs, zero_grad=False, n_iter=5):
    """Upstream's ``_test_DDP_niter``: the DDP model on this rank's slice equals the single-process
    model on the whole batch after every step; then the wrapper pickles and loads with the same state."""
    offset = dist.get_rank() * local_bs
    for _ in range(n_iter):
        _ddp_helper(model_base, input, target, loss)
        _ddp_helper(model_ddp, input[offset : offset + local_bs], target[offset : offset + local_bs], loss)
        step = _model_step_with_zero_grad if zero_grad else _model_step
        step(model_base)
        step(model_ddp)
        _assert_equal_params(list(model_base.parameters()), list(model_ddp.module.parameters()))
        input = input[torch.randperm(global_bs)]  # shuffled: each rank's slice changes
    saved = _saved_and_loaded(model_ddp)
    for key in model_ddp.state_dict():
        assert_close(saved.state_dict()[key], model_ddp.state_dict()[key])


def _distributed_data_parallel_cpu(gradient_as_bucket_view: bool = False) -> None:
    model_base = Net()
    model_ddp = DDP(copy.deepcopy(model_base), gradient_as_bucket_view=gradient_as_bucket_view)
    global_bs, input, target, loss = _prepare_dummy_data(local_bs=2)
    _ddp_niter(model_base, model_ddp, input, target, loss, 2, global_bs, zero_grad=True)
    dist.barrier()


def test_DistributedDataParallelCPU() -> None:
    _distributed_data_parallel_cpu()


def test_DistributedDataParallelCPU_grad_is_view() -> None:
    _distributed_data_parallel_cpu(gradient_as_bucket_view=True)


def test_DistributedDataParallel_requires_grad() -> None:
    # a module without gradients shouldn't be accepted
    with raises(RuntimeError, ""):
        DDP(nn.Module())
    dist.barrier()


def test_ddp_create_graph() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.tensor(1.0))

        def forward(self) -> torch.Tensor:
            return self.p.pow(2)

    ddp_model = DDP(Model())
    for _ in range(6):
        # torch DDP does not raise under create_graph=True (it warns; pytorch/pytorch#63929)
        ddp_model().backward(create_graph=True)
        assert all(param.requires_grad for param in ddp_model.parameters())


def _prepare_cpu_module(process_group, global_batch_size: int, gradient_as_bucket_view: bool = False):
    model = Net()
    ddp_model = DDP(copy.deepcopy(model), process_group=process_group, bucket_cap_mb=0.001,
                    gradient_as_bucket_view=gradient_as_bucket_view)
    return model, ddp_model, torch.randn(global_batch_size, 2), torch.randn(global_batch_size, 4)


def _accumulate_gradients_no_sync(num_iters: int = 2, ddp_comm_hook: Optional[Callable] = None,
                                  gradient_as_bucket_view: bool = False) -> None:
    """The recommended way to accumulate gradients; a hook, if given, must not change the gradients."""
    rank, world_size, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    global_batch_size, local_batch_size = world_size, 1
    model, ddp_model, input, target = _prepare_cpu_module(group, global_batch_size, gradient_as_bucket_view)
    if ddp_comm_hook is not None:
        ddp_model.register_comm_hook(group, ddp_comm_hook)

    def step_model(model, input, target):
        model.train()
        output = model(input)
        F.mse_loss(output, target.to(output.device)).backward()

    # no_sync under no_grad accumulates nothing
    with torch.no_grad(), ddp_model.no_sync():
        ddp_model.train()
        ddp_model(input)

    for iteration in range(num_iters):
        step_model(model, input, target)
        ddp_input = input[rank * local_batch_size : (rank + 1) * local_batch_size]
        ddp_target = target[rank * local_batch_size : (rank + 1) * local_batch_size]
        if iteration % 2 == 0:
            with ddp_model.no_sync():  # accumulate locally
                step_model(ddp_model, ddp_input, ddp_target)
        else:
            step_model(ddp_model, ddp_input, ddp_target)  # sync
        for i, j in zip(model.parameters(), ddp_model.parameters(), strict=True):
            if not i.requires_grad:
                continue
            if iteration % 2 == 0:
                assert_not_close(j.grad, i.grad)
            else:
                assert_close(j.grad, i.grad)
        torch.manual_seed(1337 + iteration)
        input = input[torch.randperm(global_batch_size)]


def test_accumulate_gradients_no_sync() -> None:
    _accumulate_gradients_no_sync()


def test_accumulate_gradients_no_sync_grad_is_view() -> None:
    _accumulate_gradients_no_sync(gradient_as_bucket_view=True)


def test_accumulate_gradients_no_sync_allreduce_hook() -> None:
    world_size = dist.get_world_size()

    def allreduce_hook(group_id: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensors = [bucket.buffer() / world_size]
        return group_id.allreduce(tensors).get_future().then(lambda fut: fut.value()[0])

    _accumulate_gradients_no_sync(num_iters=4, ddp_comm_hook=allreduce_hook)


def test_accumulate_gradients_no_sync_allreduce_with_then_hook() -> None:
    world_size = dist.get_world_size()

    def allreduce_with_then_hook(group_id: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = group_id.allreduce([bucket.buffer()]).get_future()

        def mult(fut):
            return 2 * fut.wait()[0]

        def div(fut):
            return fut.wait() / (2 * world_size)

        return fut.then(mult).then(div)

    _accumulate_gradients_no_sync(num_iters=4, ddp_comm_hook=allreduce_with_then_hook)


def _ddp_logging_data() -> nn.Module:
    """Upstream's ``_test_ddp_logging_data(is_gpu=False)``: runtime statistics sampled as configured."""
    rank = dist.get_rank()
    model_ddp = DDP(Net())
    batch_size, input, target, loss = _prepare_dummy_data(local_bs=2)
    model_ddp._set_ddp_runtime_logging_sample_rate(2)
    for idx in range(20):
        offset = rank * 2
        _ddp_helper(model_ddp, input[offset : offset + 2], target[offset : offset + 2], loss, 1)
        _model_step_with_zero_grad(model_ddp)
        # the first 10 iterations are sampled, then every 2nd: a sampled one has nonzero times
        data = model_ddp._get_ddp_logging_data()
        if idx > 0 and (idx < 10 or idx % 2 == 0):
            assert data.get("forward_compute_time") >= 1
            assert data.get("backward_compute_time") >= 1
            assert data.get("backward_comm_time") >= 1
            assert data.get("backward_compute_time") >= data.get("backward_compute_comm_overlap_time")
            assert data.get("backward_comm_time") >= data.get("backward_compute_comm_overlap_time")
            assert data.get("iteration") == idx
        elif idx > 0:
            assert data.get("iteration") != idx  # not sampled: the iteration is not updated
        input = input[torch.randperm(batch_size)]
    return model_ddp


def test_ddp_logging_data_cpu() -> None:
    def parse_env(var):
        return os.environ.get(var, "N/A")

    previous_level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        model_ddp = _ddp_logging_data()
    finally:
        dist.set_debug_level(previous_level)
    data = model_ddp._get_ddp_logging_data()
    assert data.get("world_size") == dist.get_world_size()
    assert data.get("rank") == dist.get_rank()
    assert data.get("module_name") == "Net"
    assert data.get("device_ids") == ""
    assert data.get("output_device") == -1  # CPU training: -1
    assert data.get("broadcast_buffers") == 1
    assert data.get("bucket_cap_bytes") == 25 * 1024 * 1024
    assert data.get("find_unused_parameters") == 0
    assert data.get("gradient_as_bucket_view") == 0
    assert data.get("backend_name") == dist.get_backend()
    assert data.get("iteration") == 18
    params = [p for p in model_ddp.parameters() if p.requires_grad]
    param_size = sum(p.numel() * p.element_size() for p in params)
    assert data.get("dtypes") == "float"
    assert data.get("total_parameter_size_bytes") == param_size
    assert data.get("num_parameter_tensors") == len(params)
    assert data.get("bucket_sizes") == str(param_size)
    assert data.get("master_port") == parse_env("MASTER_PORT")
    assert data.get("master_addr") == parse_env("MASTER_ADDR")
    assert data.get("torch_distributed_debug") == parse_env("TORCH_DISTRIBUTED_DEBUG")
    assert data.get("cuda_visible_devices") == parse_env("CUDA_VISIBLE_DEVICES")
    if data.get("backend_name") == "gloo":
        assert data.get("gloo_socket_ifname") == parse_env("GLOO_SOCKET_IFNAME")
        assert data.get("gloo_device_transport") == parse_env("GLOO_DEVICE_TRANSPORT")
        assert data.get("gloo_num_threads") == 2  # Gloo's default
    for key in ("nccl_socket_ifname", "nccl_blocking_wait", "nccl_async_error_handling", "nccl_debug",
                "nccl_nthreads", "nccl_ib_timeout"):
        assert data.get(key) is None, key
    # runtime fields
    assert data.get("unused_parameter_size", 0) == 0
    assert data.get("has_rebuilt_buckets") == 1
    assert data.get("rebuilt_bucket_sizes") == str(param_size)
    expected_order = ", ".join(reversed([str(x) for x in range(3)]))
    assert data.get("prev_iteration_grad_ready_order_indices") == expected_order
    assert data.get("rebuilt_per_bucket_param_indices") == expected_order.replace(",", "")
    assert data.get("avg_forward_compute_time") >= 1
    assert data.get("avg_backward_compute_time") >= 1
    assert data.get("avg_backward_comm_time") >= 1
    assert data.get("avg_backward_compute_time") >= data.get("avg_backward_compute_comm_overlap_time")
    assert data.get("avg_backward_comm_time") >= data.get("avg_backward_compute_comm_overlap_time")
    # host-side times in the order they happen
    assert data.get("backward_comm_time_end") >= data.get("backward_comm_time_start")
    assert data.get("backward_comm_time_start") >= data.get("backward_compute_time_start")
    assert data.get("backward_compute_time_end") >= data.get("backward_compute_time_start")
    assert data.get("backward_compute_time_start") >= data.get("forward_compute_time_start")

    # a larger net with mixed dtypes: several bucket sizes
    model = LargeNet()
    model.float()
    model.fc1.double()
    model_ddp = DDP(model, bucket_cap_mb=1.5)
    data = model_ddp._get_ddp_logging_data()
    params = list(model_ddp.parameters())
    assert data.get("bucket_cap_bytes") == int(1.5 * 1024 * 1024)
    bucket_sizes = [params[1].numel() * params[1].element_size(), params[0].numel() * params[0].element_size()]
    assert data.get("bucket_sizes") == ", ".join(str(x) for x in bucket_sizes)
    assert data.get("dtypes") == "double, float"


def test_static_graph_api_cpu() -> None:
    model_ddp = DDP(Net())
    expected_err = "should be called before training loop starts"
    with raises(RuntimeError, expected_err):
        _, input, target, loss = _prepare_dummy_data(local_bs=2)
        offset = dist.get_rank() * 2
        _ddp_helper(model_ddp, input[offset : offset + 2], target[offset : offset + 2], loss, 1)
        model_ddp._set_static_graph()
    verify_ddp_error_logged(model_ddp, expected_err)


def test_grads_same_across_ranks_with_no_sync() -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()

    class SimpleConditionalModel(nn.Module):
        # rank 0 uses nn1 on the first pass and nn2 on the second; other ranks nn3, then nn4
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank
            self.nn1, self.nn2, self.nn3, self.nn4 = (nn.Linear(1, 1) for _ in range(4))
            self.state = 0

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            first = self.state == 0
            self.state = 1 - self.state
            if self.rank == 0:
                return self.nn1(input) if first else self.nn2(input)
            return self.nn3(input) if first else self.nn4(input)

    model = DDP(SimpleConditionalModel(rank), find_unused_parameters=True)
    grad_accumulation = 2
    for microbatch_idx in range(grad_accumulation):
        context = model.no_sync if microbatch_idx < grad_accumulation - 1 else nullcontext
        with context():
            output = model.forward(torch.rand((1,)))
            nn.MSELoss()(output, torch.rand((1,))).backward()
    assert not any(p.grad is None for p in model.parameters()), "Gradients can't be None for any model parameter."
    grads = torch.cat([p.grad.view(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(grads) for _ in range(world_size)] if rank == 0 else []
    dist.gather(grads, gather_list=gathered, dst=0)
    if rank == 0:
        for g in gathered[1:]:
            assert torch.allclose(gathered[0], g), "Gradients are not the same for all ranks."


# ---- uneven inputs under join() (upstream on cuda:rank; device-agnostic, run here on the CPU) -----


def _validate_net_equivalence(net: nn.Module) -> None:
    """Upstream's ``validate_net_equivalence``: every tensor of the module's state dict is the same on every
    rank. Compared as upstream's ``assertEqual`` compares, NaN equal to NaN: the conv model of
    ``test_ddp_uneven_inputs`` (upstream_ddp_gpu_gated_checks.py) overflows under ``_model_step`` (parameters
    += gradients over all its runs), there as upstream."""
    for t in net.module.state_dict().values():
        tensor_list = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(tensor_list, t)
        for tensor in tensor_list:
            assert_close(tensor, t, equal_nan=True)


def test_ddp_join_model_equivalence() -> None:
    """Rank r runs 2(r+1) steps under join(); the result equals one process running all ranks' steps
    (the learning rate times the world size undoes the division by the ranks still joined)."""
    batch, dim, learning_rate = 3, 10, 0.03
    model = nn.Linear(dim, dim, bias=False)
    inp = torch.rand(batch, dim)
    local_model = copy.deepcopy(model)
    rank_to_iter_mapping = {rank: 2 * (rank + 1) for rank in range(dist.get_world_size())}
    local_optim = torch.optim.SGD(local_model.parameters(), lr=learning_rate)
    for _ in range(sum(rank_to_iter_mapping.values())):
        local_optim.zero_grad()
        local_model(inp).sum().backward()
        local_optim.step()
    net = DDP(model)
    ddp_optim = torch.optim.SGD(model.parameters(), lr=learning_rate * dist.get_world_size())
    with net.join():
        for _ in range(rank_to_iter_mapping[dist.get_rank()]):
            ddp_optim.zero_grad()
            net(inp).sum().backward()
            ddp_optim.step()
    for (_, local_tensor), (_, dist_tensor) in zip(local_model.state_dict().items(), net.module.state_dict().items(),
                                                   strict=True):
        assert_close(dist_tensor, local_tensor)


def test_ddp_uneven_input_join_disable() -> None:
    """join(enable=False) with even inputs: gradients divided by the whole world size."""
    torch.manual_seed(dist.get_rank())
    net = DDP(torch.nn.Linear(1, 1))
    inp = torch.ones(1) * dist.get_rank()
    world_size = dist.get_world_size()
    with net.join(enable=False):
        for _ in range(5):
            grad = net.module.weight.grad
            if grad is not None:
                grad.requires_grad_(False)
                grad.zero_()
            net(inp).sum().backward()
            expected_grad = sum(i for i in range(world_size)) / world_size
            assert net.module.weight.grad.item() == expected_grad
    assert not net._join_config.enable
    _validate_net_equivalence(net)


def test_ddp_uneven_input_exception() -> None:
    """An exception inside join() reaches the caller."""
    error_str = "Intentional error"

    class ExceptionModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.param = nn.Parameter(torch.ones(1, requires_grad=True))

        def forward(self, _):
            raise ValueError(error_str)

    net = DDP(ExceptionModule())
    with raises(ValueError, error_str):
        with net.join():
            net(torch.ones(1)).sum().backward()


# ---- unused outputs, undefined gradients, graphs that differ, new tensors (upstream on cuda:rank) ----


class UnusedParamTwoLinLayerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)
        self.c = nn.Linear(5, 5, bias=False)

    def forward(self, x: torch.Tensor) -> tuple:
        return (self.a(x), self.b(x))


class DictOutputModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = UnusedParamTwoLinLayerNet()

    def forward(self, x: torch.Tensor) -> dict:
        predictions = self.module(x)
        return {"predictions": predictions, "loss": (predictions[0] + predictions[1]).sum()}


def _output_unused_in_loss(module_cls: type) -> None:
    """A parameter whose output the loss ignores keeps its gradient untouched (None stays None, a
    value stays that value), as in local training, with find_unused_parameters=True."""
    model = module_cls()
    local_net = copy.deepcopy(model)
    net = DDP(copy.deepcopy(model), find_unused_parameters=True)
    inp = torch.randn(10, 10)
    dict_output = module_cls is DictOutputModule

    def outputs(module):
        out = module(inp)
        return out["predictions"] if dict_output else out

    def weight_a(module):
        return (module.module.a if dict_output else module.a).weight

    a, b = outputs(local_net)
    a_dist, b_dist = outputs(net)
    b_dist.sum().backward()
    assert weight_a(net.module).grad is None and weight_a(local_net).grad is None
    net.zero_grad()
    local_net.zero_grad()
    saved_a_local_grad = saved_a_dist_grad = None
    for i in range(6):
        a, b = outputs(local_net)
        a_dist, b_dist = outputs(net)
        if i < 2:  # both outputs in the loss; later "a" goes unused
            loss, loss_dist = (a @ b).sum(), (a_dist @ b_dist).sum()
        else:
            loss, loss_dist = b.sum(), b_dist.sum()
        loss.backward()
        loss_dist.backward()
        if i == 1:
            saved_a_local_grad, saved_a_dist_grad = weight_a(local_net).grad, weight_a(net.module).grad
            assert_close(saved_a_dist_grad, saved_a_local_grad)
        elif i >= 2:  # "a" unchanged from then on
            assert_close(weight_a(net.module).grad, saved_a_dist_grad)
            assert_close(weight_a(local_net).grad, saved_a_local_grad)
        for local_param, dist_param in zip(local_net.parameters(), net.parameters(), strict=True):
            if local_param.grad is None or dist_param.grad is None:
                assert local_param.grad is None and dist_param.grad is None
            else:
                assert_close(dist_param.grad, local_param.grad)
    dist.barrier()


def test_output_unused_in_loss_tuple_module() -> None:
    for _gradient_as_bucket_view in (True, False):  # upstream loops over it without passing it on
        _output_unused_in_loss(UnusedParamTwoLinLayerNet)


def test_output_unused_in_loss_dict_module() -> None:
    for _gradient_as_bucket_view in (True, False):
        _output_unused_in_loss(DictOutputModule)


def test_undefined_grad_parity_unused_parameters() -> None:
    """An undefined gradient flowing into the model leaves the same gradients as locally."""
    x = torch.ones(1, 2)
    net = Net()
    local_net = copy.deepcopy(net)
    net = DDP(net, find_unused_parameters=True)
    out, local_out = net(x).sum(), local_net(x).sum()
    torch._C._functions.UndefinedGrad()(out).backward()
    torch._C._functions.UndefinedGrad()(local_out).backward()
    for (name, dist_param), (_, local_param) in zip(net.named_parameters(), local_net.named_parameters(), strict=True):
        if dist_param.grad is None or local_param.grad is None:
            assert dist_param.grad is None and local_param.grad is None, name
        else:
            assert_close(dist_param.grad, local_param.grad, msg=f"DDP param {name}")


def _different_graph_across_ranks(find_unused_parameters: bool = False, static_graph: bool = False) -> nn.Module:
    rank = dist.get_rank()

    class ToyModel(nn.Module):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.lin1 = nn.Linear(10, 10, bias=False)
            self.lin2 = nn.Linear(10, 10, bias=False)
            self.rank = rank

        def forward(self, x):
            return self.lin2(F.relu(self.lin1(x))) if self.rank == 0 else F.relu(self.lin1(x))

    torch.manual_seed(31415)
    ddp_model = DDP(ToyModel(rank), find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=True,
                    static_graph=static_graph)
    random_input = torch.randn(20, 10)
    for _ in range(10):
        ddp_model(random_input).sum().backward()
    return ddp_model


def test_different_graph_across_ranks() -> None:
    """Rank 1 skips lin2: find_unused_parameters never rebuilds the buckets, static_graph does, and
    both train to the same parameters."""
    base_model = _different_graph_across_ranks(find_unused_parameters=True)
    assert not base_model._get_ddp_logging_data().get("has_rebuilt_buckets", 0)
    static_model = _different_graph_across_ranks(static_graph=True)
    assert static_model._get_ddp_logging_data().get("has_rebuilt_buckets", 0)
    for i, j in zip(base_model.parameters(), static_model.parameters(), strict=True):
        assert_close(j, i)


def test_ddp_returns_tensor_with_no_grad() -> None:
    """An output that does not require grad, in every mode; one module wrapped four times in turn."""
    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(10, 10, bias=False)
            self.fc2 = nn.Linear(10, 10, bias=False)

        def forward(self, x):
            x = self.fc2(F.relu(self.fc1(x)))
            y = x.clone()
            x = x.detach()
            assert not x.requires_grad
            return (x, y)

    model = MyModel()
    inp = torch.randn(1, 10)
    for find_unused, static_graph in product([True, False], [True, False]):
        ddp = DDP(model, find_unused_parameters=find_unused, static_graph=static_graph)
        for _ in range(6):
            out = ddp(inp)
            assert not out[0].requires_grad
            (out[0] + out[1]).sum().backward()


def _ddp_new_tensor_in_fwd(static_graph: bool) -> None:
    """Tensors created in forward, returned alone and inside a dict, have no grad_fn (pytorch/pytorch#60733)."""
    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(10, 10, bias=False)
            self.fc2 = nn.Linear(10, 10, bias=False)
            self.device = self.fc1.weight.device

        def _init_opt(self):
            return torch.randn(1, 10, device=self.device)

        def forward(self, x, opt_1, opt_2, opt_nested):
            x = self.fc2(F.relu(self.fc1(x)))
            if opt_1 is None:
                opt_1 = self._init_opt()
            if opt_2 is None:
                opt_2 = self._init_opt()
            if opt_nested is None or not torch.is_tensor(opt_nested):
                opt_nested = self._init_opt()
            return x, opt_1, opt_2, {"tensor": opt_nested}

    model = MyModel()
    for find_unused in [True, False]:
        ddp = DDP(model, broadcast_buffers=False, find_unused_parameters=find_unused, static_graph=static_graph)
        opt = [None for _ in range(3)]
        for _ in range(2):
            ddp.zero_grad()
            out, opt[0], opt[1], opt[2] = ddp(torch.randn(1, 10), opt_1=opt[0], opt_2=opt[1], opt_nested=opt[2])
            for item in opt:
                assert (item if torch.is_tensor(item) else item["tensor"]).grad_fn is None
            out.mean().backward()


def test_ddp_new_tensor_in_fwd() -> None:
    _ddp_new_tensor_in_fwd(static_graph=False)


def test_ddp_new_tensor_in_fwd_static_graph() -> None:
    _ddp_new_tensor_in_fwd(static_graph=True)


# ==================================================================================================
# test_c10d_gloo.py DistributedDataParallelTest, with test_c10d_common.py CommonDistributedDataParallelTest
# ==================================================================================================


class C10dNet(nn.Module):
    """test_c10d_common.py's ``Net`` (not distributed_test.py's): three bias-free layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(self.fc3(x), dim=1)


class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x: Any) -> torch.Tensor:
        return self.p + x


class ModuleForDdpCommHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t0 = Task()

    def forward(self, x: Any, rank: int) -> torch.Tensor:
        return self.t0(x + rank)


class SparseGradientModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(10, 10, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.embedding(x), dim=1)


def _ddp_with_process_group(process_group, gradient_as_bucket_view: bool = False, device_ids: Optional[list] = None) -> None:
    """``_test_ddp_with_process_group`` for a CPU module (devices [cpu], ``device_ids`` None or empty): two
    iterations of plain gradient descent equal the single-process model on the whole batch.
    (Upstream first calls the Gloo backend's ``create_device(interface=LOOPBACK)``: a Gloo setting,
    not DDP's; the ranks here already talk over the loopback interface.)"""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_batch_size = 1
    global_batch_size = world_size * local_batch_size
    model = C10dNet()
    ddp_model = DDP(copy.deepcopy(model), device_ids=device_ids, process_group=process_group, bucket_cap_mb=0.001,
                    gradient_as_bucket_view=gradient_as_bucket_view)
    input, target = torch.randn(global_batch_size, 2), torch.randn(global_batch_size, 4)
    assert not ddp_model._get_ddp_logging_data().get("is_multi_device_module")

    def step_model(model, input, target):
        model.train()
        output = model(input)
        F.mse_loss(output, target.to(output.device)).backward()

    def update_parameters(model):
        for param in model.parameters():
            with torch.no_grad():
                param -= param.grad
            param.grad = None

    for iteration in range(2):
        step_model(model, input, target)
        step_model(ddp_model, input[rank * local_batch_size : (rank + 1) * local_batch_size],
                   target[rank * local_batch_size : (rank + 1) * local_batch_size])
        update_parameters(model)
        update_parameters(ddp_model)
        assert len(list(model.parameters())) == len(list(ddp_model.parameters()))
        for i, j in zip(model.parameters(), ddp_model.parameters()):
            assert_close(j, i, rtol=1.3e-06, atol=5e-5)
        torch.manual_seed(1337 + iteration)
        input = input[torch.randperm(global_batch_size)]


def test_gloo_backend_cpu_module() -> None:
    _ddp_with_process_group(dist.group.WORLD)


def test_gloo_backend_cpu_module_grad_is_view() -> None:
    _ddp_with_process_group(dist.group.WORLD, gradient_as_bucket_view=True)


def _global_local_unused_params_grad(gradient_as_bucket_view: bool = False, static_graph: bool = False) -> None:
    """A multi-task model: DDP leaves the gradient of globally unused parameters None and reduces
    the gradient of locally unused ones. The CPU half of upstream's test (the GPU half repeats it
    with ``device_ids=[device_id]``)."""
    rank = dist.get_rank()

    class GlobalLocalUnusedParamModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t0, self.t1, self.task_unused = Task(), Task(), Task()

        def task_parameters(self):
            return (self.t0.p, self.t1.p, self.task_unused.p)

        def forward(self, x, rank):
            return self.t0(x) if rank == 0 else self.t1(x)

    model = DDP(GlobalLocalUnusedParamModule().cpu(), process_group=dist.group.WORLD, find_unused_parameters=True,
                gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
    output = model(8, rank)
    t0_p, t1_p, task_unused_p = model.module.task_parameters()
    assert t0_p.grad is None and t1_p.grad is None and task_unused_p.grad is None
    output.mean().backward()
    # locally unused: reduced on every rank; globally unused: still None
    assert t0_p.grad is not None and t1_p.grad is not None
    assert task_unused_p.grad is None


def test_global_local_unused_params_grad() -> None:
    _global_local_unused_params_grad()


def test_global_local_unused_params_grad_with_grad_is_view() -> None:
    _global_local_unused_params_grad(gradient_as_bucket_view=True)


def test_global_local_unused_params_grad_with_static_graph() -> None:
    _global_local_unused_params_grad(static_graph=True)


def test_find_unused_parameters_when_unused_parameters_empty() -> None:
    """An empty set of unused parameters on one rank does not turn find_unused_parameters off: rank 0
    uses every parameter, the others do not, and every rank gets every gradient (CPU half)."""
    rank = dist.get_rank()

    class FindUnusedParamModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t0, self.t1 = Task(), Task()

        def task_parameters(self):
            return (self.t0.p, self.t1.p)

        def forward(self, x, rank):
            return self.t1(self.t0(x)) if rank == 0 else self.t1(x)

    model = DDP(FindUnusedParamModule().cpu(), process_group=dist.group.WORLD, find_unused_parameters=True)
    output = model(8, rank)
    assert all(p.grad is None for p in model.module.task_parameters())
    output.mean().backward()
    assert all(p.grad is not None for p in model.module.task_parameters())


class IgnoredOutput(nn.Module):
    def __init__(self, unused_layer: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        if unused_layer:
            self.fc3 = nn.Linear(4, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(x, dim=1)


def _ignored_output(find_unused_parameters: bool) -> None:
    """The output may be dropped: no implicit requirement that backward is called."""
    model = DDP(IgnoredOutput(unused_layer=find_unused_parameters).float(), process_group=dist.group.WORLD,
                find_unused_parameters=find_unused_parameters)
    batch_size = 4
    input = torch.rand([batch_size, 2], dtype=torch.float)
    target = torch.randint(0, 4, (batch_size,))
    for _ in range(4):
        output = model(input)
        del output
    for _ in range(4):
        nn.CrossEntropyLoss()(model(input), target).backward()


def test_ignored_output() -> None:
    _ignored_output(find_unused_parameters=False)


def test_ignored_output_with_unused_parameters() -> None:
    _ignored_output(find_unused_parameters=True)


def _run_and_verify_sparse_gradients(vanilla_model: nn.Module, ddp_model: nn.Module) -> None:
    mult = 2
    batch_size = mult * dist.get_world_size()
    criterion = nn.CrossEntropyLoss()
    input = torch.randint(0, 10, [batch_size, 2])
    target = torch.randint(0, 10, [batch_size])
    criterion(vanilla_model(input), target).backward()  # whole batch, one process
    rank = dist.get_rank()
    criterion(ddp_model(input.split(mult)[rank]), target.split(mult)[rank]).backward()
    vanilla_parameter, ddp_parameter = next(vanilla_model.parameters()), next(ddp_model.parameters())
    assert ddp_parameter.grad.is_sparse, "the gradient must stay sparse"
    assert_close(ddp_parameter.grad.coalesce(), vanilla_parameter.grad.coalesce())


def _sparse_gradients(gradient_as_bucket_view: bool = False) -> None:
    torch.manual_seed(1337)
    vanilla_model = SparseGradientModule()
    ddp_model = DDP(copy.deepcopy(vanilla_model), process_group=dist.group.WORLD,
                    gradient_as_bucket_view=gradient_as_bucket_view)
    _run_and_verify_sparse_gradients(vanilla_model, ddp_model)


def test_sparse_gradients() -> None:
    _sparse_gradients()


def test_sparse_gradients_grad_is_view() -> None:
    _sparse_gradients(gradient_as_bucket_view=True)


class TwoLinearSoftmax(nn.Module):
    """The model several of upstream's tests define for themselves (test_save_load_checkpoint's and
    test_failure_recovery's ``TestModel``, test_no_grad's ``NoGradModule``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.relu(self.fc2(self.relu(self.fc1(x)))), dim=1)


def test_save_load_checkpoint() -> None:
    """A state dict saved by rank 0 mid-training, loaded into the wrapper and (prefix stripped) into
    the bare module, trains on exactly as the run without a checkpoint. Upstream runs it on
    ``cuda:rank``; here on the CPU (no ``map_location`` needed)."""
    criterion = nn.CrossEntropyLoss()
    batch_size = 4
    input = torch.rand([batch_size, 2], dtype=torch.float)
    target = torch.randint(0, 4, (batch_size,))

    def train_loop(model, optimizer, iterations):
        for _ in range(iterations):
            optimizer.zero_grad()
            criterion(model(input), target).backward()
            optimizer.step()

    model_withload, model_withoutload = TwoLinearSoftmax().float(), TwoLinearSoftmax().float()
    ddp_withload, ddp_withoutload = DDP(model_withload), DDP(model_withoutload)
    for model in (ddp_withload, model_withload, ddp_withoutload):
        for p in model.parameters():
            with torch.no_grad():
                p.zero_()
    optimizer_withload = torch.optim.SGD(ddp_withload.parameters(), lr=0.001)
    optimizer_non_ddp_withload = torch.optim.SGD(model_withload.parameters(), lr=0.001)
    optimizer_withoutload = torch.optim.SGD(ddp_withoutload.parameters(), lr=0.001)

    train_loop(ddp_withload, optimizer_withload, 3)
    checkpoint_file = [None]
    if dist.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save(ddp_withload.state_dict(), buffer)
        checkpoint_file = [buffer.getvalue()]
    dist.broadcast_object_list(checkpoint_file, src=0)  # upstream: a file in the temporary directory
    ddp_state_dict = torch.load(io.BytesIO(checkpoint_file[0]))
    for model in (ddp_withload, model_withload):
        for p in model.parameters():
            with torch.no_grad():
                p.zero_()
    ddp_withload.load_state_dict(ddp_state_dict)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(ddp_state_dict, "module.")
    model_withload.load_state_dict(ddp_state_dict)
    train_loop(ddp_withload, optimizer_withload, 3)
    train_loop(model_withload, optimizer_non_ddp_withload, 3)
    train_loop(ddp_withoutload, optimizer_withoutload, 6)
    for p_withload, p_withoutload, p_non_ddp_withload in zip(
        ddp_withload.parameters(), ddp_withoutload.parameters(), model_withload.parameters()
    ):
        assert_close(p_withload, p_withoutload)
        assert_close(p_non_ddp_withload, p_withoutload)


def _simple_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(torch.ones_like(bucket.buffer()))

    def fut_then(fut):
        t = fut.value()
        return t + torch.ones_like(t)  # ones + ones

    return fut.then(fut_then)


def _run_and_verify_hook(model: nn.Module, input: Any, expected_grad: torch.Tensor) -> None:
    model(input, dist.get_rank()).mean().backward()
    for p in model.parameters():
        assert_close(p.grad, expected_grad)


def test_ddp_comm_hook_future_passing_cpu() -> None:
    """The hook's Future (and its ``then``) reaches the gradients: 2 everywhere, where the plain
    average would give 0.25."""
    cpu_model = DDP(ModuleForDdpCommHook().cpu(), process_group=dist.group.WORLD)
    cpu_model.register_comm_hook(None, _simple_hook)
    _run_and_verify_hook(cpu_model, 8, 2 * torch.ones(2, 2))


def test_ddp_invalid_comm_hook_init() -> None:
    model = DDP(ModuleForDdpCommHook(), process_group=dist.group.WORLD)
    with raises(TypeError, "Communication hook must be callable."):
        model.register_comm_hook(state=None, hook=1)

    def comm_hook(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    with raises(ValueError, "bucket annotation should be dist.GradBucket."):
        model.register_comm_hook(state=None, hook=comm_hook)


def test_ddp_invalid_comm_hook_return_type() -> None:
    model = DDP(ModuleForDdpCommHook(), process_group=dist.group.WORLD)
    expected_err = "Communication hook: return annotation should be torch.futures.Future"

    def annotated_int(state: object, bucket: dist.GradBucket) -> int:
        return torch.futures.Future()

    with raises(ValueError, expected_err):
        model.register_comm_hook(state=None, hook=annotated_int)
    verify_ddp_error_logged(model, expected_err)

    def returns_int(state: object, bucket: dist.GradBucket):
        return 1

    with raises(RuntimeError, "callback must return a torch.futures.Future object, but got"):
        model.register_comm_hook(state=None, hook=returns_int)
        model(8, dist.get_rank()).mean().backward()


def test_ddp_comm_hook_register_just_once() -> None:
    model = DDP(ModuleForDdpCommHook(), process_group=dist.group.WORLD)

    def dummy_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result([bucket.buffer()])
        return fut

    model.register_comm_hook(None, dummy_hook)
    with raises(RuntimeError, "register_comm_hook or register_builtin_comm_hook can only be called once."):
        model.register_comm_hook(None, dummy_hook)


def test_ddp_comm_hook_sparse_gradients() -> None:
    """test_sparse_gradients with a hook that all-reduces the sparse bucket itself."""
    process_group, world_size = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(1337)
    vanilla_model = SparseGradientModule()
    ddp_model = DDP(copy.deepcopy(vanilla_model), process_group=process_group)

    def allreduce_hook_gloo(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        def div_by_world_size(fut):
            return fut.wait()[0] / world_size

        return process_group.allreduce([bucket.buffer()]).get_future().then(div_by_world_size)

    ddp_model.register_comm_hook(None, allreduce_hook_gloo)
    _run_and_verify_sparse_gradients(vanilla_model, ddp_model)


# ---- activation checkpointing (CommonDistributedDataParallelTest; upstream on cuda:rank) ----------


class CheckpointOnceModule(nn.Module):
    """Checkpoints one layer."""

    def __init__(self, use_reentrant: bool = True) -> None:
        super().__init__()
        self.l1 = nn.Linear(20, 20)
        self.l2 = nn.Linear(20, 20)
        self.use_reentrant = use_reentrant

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.l2, self.l1(inp), use_reentrant=self.use_reentrant)


class CheckpointTwiceModule(CheckpointOnceModule):
    """Checkpoints the same layer twice, as pipeline parallelism does."""

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.l1(inp)
        x = checkpoint(self.l2, x, use_reentrant=self.use_reentrant)
        return checkpoint(self.l2, x, use_reentrant=self.use_reentrant)


class CheckpointTwiceModuleWeightSharing(CheckpointTwiceModule):
    def __init__(self, use_reentrant: bool = True) -> None:
        super().__init__(use_reentrant=use_reentrant)
        self.l1.weight = self.l2.weight


class DynamicCheckpointTwiceModule(CheckpointTwiceModule):
    def __init__(self, use_reentrant: bool = True) -> None:
        super().__init__(use_reentrant=use_reentrant)
        self.count = 0

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        layer = self.l1 if self.count % 2 else self.l2
        self.count += 1
        return checkpoint(layer, inp, use_reentrant=self.use_reentrant)


class DynamicCheckpointTwiceModuleWeightSharing(DynamicCheckpointTwiceModule):
    def __init__(self, use_reentrant: bool = True) -> None:
        super().__init__(use_reentrant=use_reentrant)
        self.l1.weight = self.l2.weight


def _train_model(model, input_var, target, loss, run_checkpoint=False, use_reentrant=True) -> None:
    model.train()
    output = checkpoint(model, input_var, use_reentrant=use_reentrant) if run_checkpoint else model(input_var)
    loss(output, target).backward()


def _ddp_checkpointing(input_model: nn.Module, use_bucket_view: bool, find_unused_parameters: bool = False,
                       static_graph: bool = False, run_checkpoint: bool = False, use_reentrant: bool = True,
                       allow_none_grads: bool = False) -> None:
    """``_test_ddp_checkpointing``: five iterations, the gradients equal the single-process model's."""
    torch.manual_seed(31415)
    model = copy.deepcopy(input_model)
    ddp_model = DDP(copy.deepcopy(input_model), bucket_cap_mb=1, gradient_as_bucket_view=use_bucket_view,
                    process_group=dist.group.WORLD, find_unused_parameters=find_unused_parameters,
                    static_graph=static_graph)
    assert ddp_model._get_ddp_logging_data().get("static_graph", 0) == static_graph
    ddp_bs = 16
    offset = dist.get_rank() * ddp_bs
    input = torch.rand((ddp_bs * dist.get_world_size(), 20), requires_grad=True)
    target = torch.randn((ddp_bs * dist.get_world_size(), 20))
    ddp_input, ddp_target = input[offset : offset + ddp_bs], target[offset : offset + ddp_bs]
    loss = nn.MSELoss()
    for _ in range(5):
        model.zero_grad(set_to_none=False)
        ddp_model.zero_grad(set_to_none=False)
        _train_model(model, input, target, loss, run_checkpoint=run_checkpoint, use_reentrant=use_reentrant)
        _train_model(ddp_model, ddp_input, ddp_target, loss, run_checkpoint=run_checkpoint, use_reentrant=use_reentrant)
        for i, j in zip(model.parameters(), ddp_model.parameters()):
            if not allow_none_grads:
                assert i.grad is not None and j.grad is not None
            if i.grad is None or j.grad is None:
                assert i.grad is None and j.grad is None
            else:
                assert_close(j.grad, i.grad, rtol=1.3e-06, atol=5e-5)


# Torch's reducer says "Expected to mark a variable ready only once."; minidp's says which parameter "got its gradient
# twice in one backward", or "was counted unused, then got its gradient" (find_unused_parameters=True, whose search
# does not see into a reentrant checkpoint), and why (a clearer error, which the project allows): each passes.
MARKED_READY_TWICE = "|".join(map(re.escape, ("Expected to mark a variable ready only once.",
                                              "got its gradient twice in one backward",
                                              "was counted unused, then got its gradient")))


def test_ddp_checkpointing_once(use_reentrant: bool) -> None:
    for use_bucket_view, static_graph in product((False, True), (False, True)):
        _ddp_checkpointing(CheckpointOnceModule(use_reentrant=use_reentrant), use_bucket_view=use_bucket_view,
                           static_graph=static_graph)
        if static_graph:
            # find_unused_parameters makes no difference under static_graph
            _ddp_checkpointing(CheckpointOnceModule(), use_bucket_view=use_bucket_view, static_graph=static_graph,
                               find_unused_parameters=True)


def test_ddp_checkpointing_unused_params(use_reentrant: bool) -> None:
    """Reentrant checkpointing with find_unused_parameters fails without static_graph; non-reentrant works."""
    for use_bucket_view in (True, False):
        with raises(RuntimeError, MARKED_READY_TWICE) if use_reentrant else nullcontext():
            _ddp_checkpointing(CheckpointOnceModule(use_reentrant=use_reentrant), use_bucket_view=use_bucket_view,
                               find_unused_parameters=True)
        _ddp_checkpointing(CheckpointOnceModule(use_reentrant=use_reentrant), use_bucket_view=use_bucket_view,
                           find_unused_parameters=True, static_graph=True)


def test_ddp_checkpointing_twice(use_reentrant: bool) -> None:
    """Checkpointing one layer twice fails without static_graph under reentrant checkpointing."""
    for use_bucket_view in (True, False):
        for find_unused_parameters in (False, True):
            with raises(RuntimeError, MARKED_READY_TWICE) if use_reentrant else nullcontext():
                _ddp_checkpointing(CheckpointTwiceModule(use_reentrant=use_reentrant), use_bucket_view=use_bucket_view,
                                   static_graph=False, find_unused_parameters=find_unused_parameters)


def test_ddp_checkpointing_twice_static_graph(use_reentrant: bool) -> None:
    for use_bucket_view in (True, False):
        _ddp_checkpointing(CheckpointTwiceModule(use_reentrant=use_reentrant), use_bucket_view=use_bucket_view,
                           static_graph=True)


def test_ddp_checkpointing_dynamic_module() -> None:
    for use_bucket_view in (True, False):
        _ddp_checkpointing(DynamicCheckpointTwiceModule(use_reentrant=False), use_bucket_view=use_bucket_view,
                           static_graph=False, find_unused_parameters=True, allow_none_grads=True)


def test_ddp_checkpointing_dynamic_weight_sharing() -> None:
    for use_bucket_view in (True, False):
        _ddp_checkpointing(DynamicCheckpointTwiceModuleWeightSharing(use_reentrant=False),
                           use_bucket_view=use_bucket_view, static_graph=False, find_unused_parameters=True,
                           allow_none_grads=True)


def test_ddp_checkpointing_weight_sharing(use_reentrant: bool) -> None:
    for use_bucket_view, static_graph in product((False, True), (False, True)):
        torch.manual_seed(31415)
        l1, l2 = nn.Linear(20, 20), nn.Linear(20, 20)
        l1.weight = l2.weight
        _ddp_checkpointing(nn.Sequential(l1, l2), use_bucket_view=use_bucket_view, static_graph=static_graph,
                           run_checkpoint=True, use_reentrant=use_reentrant)


def test_ddp_checkpointing_twice_weight_sharing() -> None:
    for use_bucket_view in (True, False):
        _ddp_checkpointing(CheckpointTwiceModuleWeightSharing(), use_bucket_view=use_bucket_view, static_graph=True)


def test_ddp_buffer_sync_multi_forward_with_batchnorm() -> None:
    """Two forwards before one backward with buffers broadcast (upstream on cuda:rank)."""
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10)), process_group=dist.group.WORLD,
                broadcast_buffers=True)
    x = torch.randn(4, 10)
    model.zero_grad()
    out1, out2 = model(x), model(x)
    (out1.mean() + out2.mean()).backward()


@dataclass
class CustomOutput:
    o1: Optional[torch.Tensor]
    o2: dict


class DataclassOutputModule(nn.Module):
    def __init__(self, skip_o1: bool) -> None:
        super().__init__()
        self.seq1 = nn.Sequential(*[nn.Linear(10, 10) for _ in range(3)])
        self.relu = nn.ReLU()
        self.seq2 = nn.Sequential(*[nn.Linear(10, 10) for _ in range(3)])
        self.skip_o1 = skip_o1

    def forward(self, x: torch.Tensor) -> CustomOutput:
        o1 = None if self.skip_o1 else self.relu(self.seq1(x))
        return CustomOutput(o1=o1, o2={"a": self.seq2(x), "b": self.relu(self.seq2(x))})


def _dataclass_output(skip_o1: bool) -> None:
    """Outputs inside a dataclass reach the search for unused parameters (upstream on cuda:rank)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    net_x = torch.cat([torch.ones(4, 10) * i for i in range(world_size)])
    ddp_x = torch.ones(4, 10) * rank
    torch.manual_seed(0)
    net = DataclassOutputModule(skip_o1=skip_o1)
    ddp = DDP(copy.deepcopy(net), find_unused_parameters=True, static_graph=False, process_group=dist.group.WORLD)

    def loss_of(out):
        total = out.o2["a"] + out.o2["b"] if skip_o1 else out.o1 + out.o2["a"] + out.o2["b"]
        return F.mse_loss(total, torch.ones_like(out.o2["a"]))

    loss_of(net(net_x)).backward()
    loss_of(ddp(ddp_x)).backward()
    for p1, p2 in zip(net.parameters(), ddp.parameters()):
        if torch.is_tensor(p1.grad):
            assert p1.grad.allclose(p2.grad)
        else:
            assert p1.grad == p2.grad


def test_dataclass_output() -> None:
    _dataclass_output(skip_o1=False)


def test_dataclass_output_unused_param() -> None:
    _dataclass_output(skip_o1=True)
