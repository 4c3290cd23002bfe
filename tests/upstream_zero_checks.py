"""PyTorch's own ZeroRedundancyOptimizer tests, rank side: each upstream case, run inside every rank of a job
against ``minidp.distributed.ZeroRedundancyOptimizer`` (and, where a case trains under DDP, minidp's
``DistributedDataParallel``).

Source: ``test/distributed/optim/test_zero_redundancy_optimizer.py`` in the PyTorch repository
(https://github.com/pytorch/pytorch), classes ``TestZeroRedundancyOptimizerSingleRank`` (one process) and
``TestZeroRedundancyOptimizerDistributed`` (two processes on a CPU-only machine, as upstream runs it there; four
for ``test_nondefault_process_group``, which upstream passes without checking anything below four). PyTorch is
BSD-licensed (3-clause); the cases below follow those tests, copyright the PyTorch contributors: the same models,
values, steps and comparisons, written again for minidp. :class:`SingleRank` and :class:`Distributed` hold them
under upstream's names; ``tests.helpers.run_upstream`` seeds every rank alike (one fresh seed per job) before each.

Upstream's ``assertEqual`` on tensors is ``torch.testing.assert_close`` here; its ``self.device`` is the CPU,
and the cases that upstream gates on a GPU only to have one (``skip_if_no_gpu``) run on the CPU. Upstream reads
torch's private ``_broadcast_object`` and ``ZeroRedundancyOptimizer._all_params``; the port uses
``dist.broadcast_object_list`` and the optimizer's ``param_groups``.

The port is checked against the original too: ``MINIDP_UPSTREAM_ZERO=torch python -m pytest -q
tests/test_upstream_zero.py`` runs every case on torch's ZeroRedundancyOptimizer and DistributedDataParallel.
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import SGD, AdamW

import minidp.distributed as md
from .upstream_ddp_checks import assert_not_close, raises

if os.environ.get("MINIDP_UPSTREAM_ZERO") == "torch":
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
else:
    ZeroRedundancyOptimizer = md.ZeroRedundancyOptimizer
    DistributedDataParallel = md.DistributedDataParallel

assert_close = torch.testing.assert_close


def _linear_stack(*widths: int) -> nn.Sequential:
    """``Linear(widths[0], widths[1])``, ``Linear(widths[1], widths[2])``, ...: upstream's models."""
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def _all_reduce_mean_of_gradients(model: nn.Module) -> None:
    """What DDP would do, by hand: every gradient summed over the ranks and divided by their number."""
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()


def _from_rank(obj: Any, source: int) -> Any:
    """``obj`` as rank ``source`` holds it, on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=source)
    return box[0]


class SingleRank:
    """``TestZeroRedundancyOptimizerSingleRank``: one process, every parameter in its share."""

    @staticmethod
    def test_state_dict() -> None:
        """The state dict has a plain optimizer's keys and settings; loading it brings back the state and the lr."""
        x = torch.tensor([1.0], requires_grad=True)
        o = ZeroRedundancyOptimizer([x], optimizer_class=SGD, lr=0.1, momentum=0.9)
        x.backward()
        o.step()
        assert_close(x, torch.tensor([0.9]))
        assert_close(o.optim.state[x]["momentum_buffer"], torch.tensor([1.0]))

        o.zero_grad()
        o.consolidate_state_dict(to=0)
        state_dict = o.state_dict()
        assert {"param_groups", "state"} <= set(state_dict)
        group = state_dict["param_groups"][0]
        assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"], group["dampening"]) == \
            (0.1, 0.9, False, 0.0, 0.0)
        for key, value in group.items():
            if key != "params":
                assert value == o.param_groups[0][key], key

        o = ZeroRedundancyOptimizer([x], optimizer_class=SGD, lr=0.01)
        o.load_state_dict(state_dict)
        assert_close(o.optim.state[x]["momentum_buffer"], torch.tensor([1.0]))
        assert o.param_groups[0]["lr"] == 0.1  # the loaded lr, not the constructor's
        x.backward()
        o.step()
        assert_close(x, torch.tensor([0.71]))
        assert_close(o.optim.state[x]["momentum_buffer"], torch.tensor([1.9]))
        assert o.param_groups[0]["params"][0].device == x.device

    @staticmethod
    def test_lr_scheduler() -> None:
        """A stock ``lr_scheduler`` drives ZeRO as it drives the plain optimizer."""
        _lr_scheduler_parity()

    @staticmethod
    def test_step_with_kwargs() -> None:
        """Keyword arguments of ``step`` reach the local optimizer's ``step``."""

        class SGDWithStepKWArg(SGD):
            def step(self, closure=None, kwarg=None):
                super().step()
                kwarg.append(5)

        kwarg: list[int] = []
        x = torch.tensor([1.0], requires_grad=True)
        o = ZeroRedundancyOptimizer([x], optimizer_class=SGDWithStepKWArg, lr=0.1)
        x.backward()
        o.step(0, kwarg=kwarg)
        assert kwarg == [5]
        assert_close(x, torch.tensor([0.9]))

    @staticmethod
    def test_step_with_extra_inner_key() -> None:
        """A key the local optimizer adds to its groups shows in ZeRO's ``param_groups``."""

        class SGDWithNewKey(SGD):
            def step(self, closure=None):
                super().step()
                self.param_groups[0]["new_key"] = 0.1

        x = torch.tensor([1.0], requires_grad=True)
        o = ZeroRedundancyOptimizer([x], optimizer_class=SGDWithNewKey, lr=0.1)
        x.backward()
        o.step()
        assert o.param_groups[0]["new_key"] == 0.1
        assert_close(x, torch.tensor([0.9]))

    @staticmethod
    def test_step_without_closure() -> None:
        """A local optimizer whose ``step`` takes no closure is called without one."""

        class SGDWithoutClosure(SGD):
            def step(self):
                return super().step()

        x = torch.tensor([1.0], requires_grad=True)
        o = ZeroRedundancyOptimizer([x], optimizer_class=SGDWithoutClosure, lr=0.1)
        x.backward()
        o.step()
        assert_close(x, torch.tensor([0.9]))

    @staticmethod
    def test_zero_grad() -> None:
        """``zero_grad`` sets every parameter's gradient to None."""
        # Upstream draws x = torch.rand(1) under its one fixed seed; under the suite's fresh seeds x may come out below
        # 0.003, whose gradient x * x then reads as zero within assert_not_close's tolerance: x is kept from zero here.
        x = torch.rand(1) + 0.5
        m = nn.Linear(1, 1)
        o = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=SGD, lr=0.01)
        m(x).backward(x)
        assert_not_close(m.weight.grad, torch.zeros_like(m.weight))
        o.zero_grad()
        assert m.weight.grad is None and m.bias.grad is None

    @staticmethod
    def test_constructor() -> None:
        """``params``: an empty list, a tensor, a float or a foreign item is refused; groups, a generator and a list
        are taken; two groups give two groups, in ZeRO and in the local optimizer."""
        m = _linear_stack(5, 10, 10, 10)
        accepted_or_refused = [
            ([], ValueError),
            (torch.randn(1), TypeError),
            (1.2, TypeError),
            ([{"params": [l.weight for l in m]}, {"params": [l.bias for l in m]}], None),
            (list(m.parameters()) + [42], TypeError),
            (m.parameters(), None),
            (list(m.parameters()), None),
        ]
        for params, error in accepted_or_refused:
            with raises(error, "") if error else nullcontext():
                ZeroRedundancyOptimizer(params, optimizer_class=SGD, lr=0.01)

        o = ZeroRedundancyOptimizer(
            [{"params": [l.weight for l in m], "weight_decay": 0.0}, {"params": [l.bias for l in m], "weight_decay": 0.01}],
            optimizer_class=AdamW, lr=0.01, betas=(0.9, 0.999), eps=1e-8,
        )
        assert len(o.param_groups) == 2 and len(o.optim.param_groups) == 2

    @staticmethod
    def test_same_dense_param_type() -> None:
        """Sparse parameters, or dense ones of two types, are refused with ValueError."""
        for params in (
            [torch.sparse_coo_tensor(size=(2, 3))],
            [torch.FloatTensor(1), torch.DoubleTensor(1)],
            [torch.FloatTensor(1), torch.FloatTensor(1), torch.sparse_coo_tensor(size=(2, 3))],
        ):
            with raises(ValueError, ""):
                ZeroRedundancyOptimizer(params, optimizer_class=SGD, lr=0.01)


def _lr_scheduler_parity(steps: int = 5) -> None:
    """Upstream's ``test_lr_scheduler`` (both classes): ``StepLR`` on ZeRO and on a plain SGD, the same values."""
    x, x2 = torch.tensor([1.0], requires_grad=True), torch.tensor([1.0], requires_grad=True)
    o, o2 = ZeroRedundancyOptimizer([x], optimizer_class=SGD, lr=0.01), SGD([x2], lr=0.01)
    s, s2 = torch.optim.lr_scheduler.StepLR(o, 1), torch.optim.lr_scheduler.StepLR(o2, 1)
    for _ in range(steps):
        for tensor, optimizer, scheduler in ((x, o, s), (x2, o2, s2)):
            tensor.backward()
            optimizer.zero_grad()
            optimizer.step()
            scheduler.step()
        assert_close(x, x2)


class Distributed:
    """``TestZeroRedundancyOptimizerDistributed``: every rank holds a share."""

    @staticmethod
    def _same_model_params(a: nn.Module, b: nn.Module, message: str) -> None:
        for p, q in zip(a.parameters(), b.parameters()):
            assert_close(p, q, atol=1e-3, rtol=1e-5, msg=f"model parameters differ: {message}")
        for p, q in zip(a.buffers(), b.buffers()):
            assert_close(p, q, msg=f"model buffers differ: {message}")

    @staticmethod
    def test_step() -> None:
        """Gradients averaged by hand, then one step: ZeRO's parameters are the plain SGD's."""
        x = torch.tensor([float(dist.get_rank() + 1)])
        m = nn.Linear(1, 1)
        m.weight.data, m.bias.data = torch.tensor([[1.0]]), torch.tensor([2.0])
        m_zero = copy.deepcopy(m)
        o, o_zero = SGD(m.parameters(), lr=0.01), ZeroRedundancyOptimizer(m_zero.parameters(), optimizer_class=SGD, lr=0.01)
        for model, optimizer in ((m, o), (m_zero, o_zero)):
            model(x).backward(x)
            _all_reduce_mean_of_gradients(model)
            optimizer.step()
        assert_close(m.weight, m_zero.weight)
        assert_close(m.bias, m_zero.bias)

    @staticmethod
    def test_step_with_closure() -> None:
        """``step(closure)`` returns the closure's loss and applies the gradients the closure made, with and without
        ``parameters_as_bucket_view``: with the sorted-greedy split, rank 0 updates the weight from its own gradient
        (x = 1), rank 1 the bias."""
        for bucket_view in (False, True):
            x_value, weight, bias, error = dist.get_rank() + 1, 1.0, 2.0, 1.0
            target = torch.tensor([x_value * weight + bias + error])
            x = torch.tensor([float(x_value)])
            m = nn.Linear(1, 1)
            m.weight.data, m.bias.data = torch.tensor([[weight]]), torch.tensor([bias])
            o = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=SGD, parameters_as_bucket_view=bucket_view, lr=0.1)
            m(x).backward(x)
            _all_reduce_mean_of_gradients(m)

            def closure():
                o.zero_grad()
                loss = nn.L1Loss()(m(x), target)
                loss.backward()
                return loss

            loss = o.step(closure=closure)
            assert_close(loss, torch.tensor(error))
            assert_close(m.weight, torch.tensor([[1.1]]))
            assert_close(m.bias, torch.tensor([2.1]))

    @staticmethod
    def test_lr_scheduler() -> None:
        _lr_scheduler_parity()

    @staticmethod
    def test_sharding() -> None:
        """Sizes 9, 7, 5 and 3 once per rank: the sorted-greedy split gives every rank 24 elements."""
        sizes = [9, 7, 5, 3]
        params = [torch.rand(size, 1) for size in sizes * dist.get_world_size()]
        o = ZeroRedundancyOptimizer(params, optimizer_class=SGD, lr=0.01)
        assert sum(p.numel() for p in o.optim.param_groups[0]["params"]) == sum(sizes)

    @staticmethod
    def test_add_param_group() -> None:
        """A group added later is dealt out too: with one parameter of size 3 missing from the first group, adding
        it evens the shares; a large frozen first parameter changes nothing of the groups' count."""
        sizes = [9, 7, 5, 3]
        params = [torch.rand(size, 1, requires_grad=True) for size in (sizes * dist.get_world_size())[:-1]]
        o = ZeroRedundancyOptimizer(params, optimizer_class=SGD, lr=0.01)
        assert len(o.param_groups) == 1
        o.add_param_group({"params": [torch.rand(3, 1)]})
        assert len(o.param_groups) == 2 and len(o.optim.param_groups) == 2
        assert sum(p.numel() for g in o.optim.param_groups for p in g["params"]) == sum(sizes)

        params = [torch.rand(size, 1) for size in (100, 3, 5, 2, 6, 4)]
        for p in params[1:]:
            p.requires_grad = True
        o = ZeroRedundancyOptimizer(params, optimizer_class=SGD, lr=0.01)
        assert len(o.param_groups) == 1
        o.add_param_group({"params": [torch.rand(3, 1)]})
        assert len(o.param_groups) == 2 and len(o.optim.param_groups) == 2

    @staticmethod
    def test_multiple_param_groups() -> None:
        """Two groups given at construction, or the second added later, or a plain AdamW: the same training."""
        model1 = _linear_stack(5, 10, 10, 5)
        model2, model3 = copy.deepcopy(model1), copy.deepcopy(model1)
        inputs = [torch.randn(8, 5) for _ in range(3)]
        optim1 = ZeroRedundancyOptimizer(
            [{"params": [l.weight for l in model1], "weight_decay": 0.0}, {"params": [l.bias for l in model1], "weight_decay": 0.01}],
            optimizer_class=AdamW, lr=0.01,
        )
        optim2 = ZeroRedundancyOptimizer([l.weight for l in model2], optimizer_class=AdamW, lr=0.01, weight_decay=0.0)
        optim2.add_param_group({"params": [l.bias for l in model2], "weight_decay": 0.01})
        optim3 = AdamW(
            [{"params": [l.weight for l in model3], "weight_decay": 0.0}, {"params": [l.bias for l in model3], "weight_decay": 0.01}],
            lr=0.01,
        )
        for input in inputs:
            for model, optim in ((model1, optim1), (model2, optim2), (model3, optim3)):
                optim.zero_grad()
                model(input).sum().backward()
                optim.step()
            for layer1, layer2, layer3 in zip(model1, model2, model3):
                for other in (layer2, layer3):
                    assert_close(layer1.weight, other.weight)
                    assert_close(layer1.bias, other.bias)

    @staticmethod
    def test_collect_shards() -> None:
        """After a step, the consolidated state dict on rank 0 has a state per parameter, and every rank loads it."""
        target, inputs = torch.rand(3, 5), torch.rand(3, 20)
        model = _linear_stack(20, 10, 5)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=SGD, lr=1e-3, momentum=0.99)

        def closure():
            optimizer.zero_grad()
            loss = nn.L1Loss()(model(inputs), target)
            loss.backward()
            return loss

        optimizer.step(closure=closure)
        optimizer.consolidate_state_dict(to=0)
        state_dict = {}
        if dist.get_rank() == 0:
            state_dict = optimizer.state_dict()
            assert len(state_dict["state"]) == len(list(model.parameters()))
        optimizer.load_state_dict(_from_rank(state_dict, 0))

    @staticmethod
    def test_nondefault_process_group() -> None:
        """On a group of the even ranks only (global and group ranks differ), the ranks' models stay equal while each
        trains on data of its own."""
        world_size = dist.get_world_size()
        if world_size < 4:
            raise AssertionError(f"needs 4 ranks or more to check anything, as upstream says; this job has {world_size}")
        members = [r for r in range(world_size) if r % 2 == 0]
        group = dist.new_group(ranks=members, backend="gloo")
        if dist.get_rank() not in members:
            return
        torch.manual_seed(dist.get_rank())
        model = _linear_stack(20, 10, 5)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=SGD, lr=1e-3, momentum=0.99, process_group=group)
        for _ in range(5):
            target, inputs = torch.rand(3, 5), torch.rand(3, 20)

            def closure():
                optimizer.zero_grad()
                loss = nn.L1Loss()(model(inputs), target) / world_size
                loss.backward()
                dist.all_reduce(loss, group=group)
                return loss

            optimizer.step(closure=closure)
            for p in (p for g in optimizer.param_groups for p in g["params"]):
                gathered = [p.clone() for _ in members] if dist.get_rank() == 0 else []
                dist.gather(p, gathered, dst=0, group=group)
                for other in gathered[1:]:
                    assert_close(gathered[0], other, msg="models differ between ranks")

    @staticmethod
    def test_local_optimizer_parity(optimizer_class_str: str, maximize: bool) -> None:
        """Under DDP (``find_unused_parameters``, a buffer that differs by rank), ZeRO trains as the local optimizer
        does, also while the first parameter is frozen and thawed in turn; the two optimizers' state dicts load into
        each other."""
        optimizer_class = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": SGD}[optimizer_class_str]
        rank = dist.get_rank()
        torch.manual_seed(rank)
        model = _linear_stack(2, 3, 3, 3)
        model.test_buffer = nn.Buffer(torch.ones(1) * rank)
        defaults = {"maximize": True} if maximize else {}
        sharded_optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=1e-3, **defaults)
        sharded_ddp_model = DistributedDataParallel(model, broadcast_buffers=True, find_unused_parameters=True)
        local_model = copy.deepcopy(model)
        ddp_optimizer = optimizer_class(local_model.parameters(), lr=1e-3, **defaults)
        ddp_model = DistributedDataParallel(local_model, broadcast_buffers=True, find_unused_parameters=True)
        Distributed._same_model_params(sharded_ddp_model, ddp_model, "from the start")

        def check_step() -> None:
            input_tensor = torch.rand(64, 2)

            def closure_of(optimizer, ddp):
                def closure():
                    optimizer.zero_grad()
                    loss = ddp(input_tensor).abs().sum()
                    loss.backward()
                    return loss
                return closure

            loss_ddp = ddp_optimizer.step(closure=closure_of(ddp_optimizer, ddp_model))
            loss_sharded = sharded_optimizer.step(closure=closure_of(sharded_optimizer, sharded_ddp_model))
            assert_close(loss_ddp, loss_sharded, msg="losses differ between the local optimizer and ZeRO")
            Distributed._same_model_params(sharded_ddp_model, ddp_model, "after a step")

        batches = 20
        for i in range(batches):
            check_step()
            if i > batches // 2:  # the second half: the first parameter frozen and thawed in turn
                next(ddp_model.parameters()).requires_grad = bool(i % 2)
                next(sharded_ddp_model.parameters()).requires_grad = bool(i % 2)

        ddp_state_dict = ddp_optimizer.state_dict()
        sharded_optimizer.consolidate_state_dict(to=0)
        sharded_state_dict = _from_rank(sharded_optimizer.state_dict() if rank == 0 else {}, 0)
        ddp_state_dict_kept = copy.deepcopy(ddp_state_dict)
        ddp_optimizer.load_state_dict(sharded_state_dict)  # each loads the other's
        sharded_optimizer.load_state_dict(ddp_state_dict)
        check_step()
        ddp_optimizer.load_state_dict(ddp_state_dict_kept)  # and its own again
        sharded_optimizer.load_state_dict(sharded_state_dict)
        check_step()

    @staticmethod
    def test_zero_join_cpu() -> None:
        """Uneven inputs (rank i has 3 + i batches): DDP under ``join()`` with a local Adam gives the reference; then
        ZeRO under ``Join`` with a Joinable that sets the gradients a joined rank needs reproduces its parameters."""
        epochs, lr = 2, 0.01
        torch.manual_seed(0)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        model = _linear_stack(2, 3, 3, 3)
        ddp_model = DistributedDataParallel(model)
        local_optim = torch.optim.Adam(ddp_model.parameters(), lr=lr)
        zero_model = copy.deepcopy(model)
        zero_optim = ZeroRedundancyOptimizer(zero_model.parameters(), torch.optim.Adam, lr=lr)
        inputs = [torch.randn(20, 2) for _ in range(3 + rank)]
        labels = torch.randn(20, 3)

        # the last rank to join sees every iteration: its gradients and parameters are the reference
        grads_at_each_iter, params_at_each_iter = [], []
        with ddp_model.join():
            for _ in range(epochs):
                for input in inputs:
                    nn.MSELoss()(ddp_model(input), labels).backward()
                    if rank == world_size - 1:
                        grads_at_each_iter.append([p.grad.detach().clone() for p in ddp_model.parameters()])
                    local_optim.step()
                    if rank == world_size - 1:
                        params_at_each_iter.append([p.detach().clone() for p in ddp_model.parameters()])
        grads_at_each_iter, params_at_each_iter = _from_rank([grads_at_each_iter, params_at_each_iter], world_size - 1)

        zero_params = [p for group in zero_optim.param_groups for p in group["params"]]

        class SetGradsJoinHook(JoinHook):
            """On a joined rank, before ZeRO's hook steps: the gradients of the next iteration it missed."""

            def __init__(self, grads: list[list[torch.Tensor]]) -> None:
                self.grads = iter(grads)

            def main_hook(self) -> None:
                for p, grad in zip(zero_params, next(self.grads)):
                    p.grad = grad.detach().clone()

        class GradientSetter(Joinable):
            def __init__(self) -> None:
                super().__init__()

            def join_hook(self, **kwargs) -> JoinHook:
                assert "zero_optim" in kwargs and "grads" in kwargs, f"Join's keyword arguments: {sorted(kwargs)}"
                return SetGradsJoinHook(kwargs["grads"])

            @property
            def join_device(self) -> torch.device:
                return torch.device("cpu")

            @property
            def join_process_group(self) -> dist.ProcessGroup:
                return dist.group.WORLD

        missed = epochs * (world_size - rank - 1)
        gradient_setter = GradientSetter()
        iteration = 0
        with Join([gradient_setter, zero_optim], zero_optim=zero_optim, grads=grads_at_each_iter[len(grads_at_each_iter) - missed:]):
            for _ in range(epochs):
                for _ in inputs:
                    Join.notify_join_context(gradient_setter)
                    for p, grad in zip(zero_model.parameters(), grads_at_each_iter[iteration]):
                        p.grad = grad.detach().clone()
                    zero_optim.step()
                    for p, reference in zip(zero_model.parameters(), params_at_each_iter[iteration]):
                        assert_close(p, reference, msg="parameters differ between ZeRO and the local optimizer")
                    iteration += 1
