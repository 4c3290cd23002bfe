"""Step 2, replicate: one copy of the module per device (docs/stock-behaviour.md B18-B21, B31)."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import minidp
from .helpers import RTOL_FLOAT64, cpu_ids, max_relative_error
from .stock_emulation import emulated_stock


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()


def test_one_replica_per_device_with_the_same_tree():
    model = bn_model()
    replicas = minidp.replicate(model, cpu_ids(3))
    assert len(replicas) == 3
    for replica in replicas:
        assert replica is not model and type(replica) is nn.Sequential
        assert [type(m) for m in replica.modules()] == [type(m) for m in model.modules()]
        assert all(r is not m for r, m in zip(replica.modules(), model.modules()))


def test_no_devices_gives_no_replicas():
    """B18: ``replicate(m, [])`` is ``[]``."""
    assert minidp.replicate(bn_model(), []) == []


def test_same_device_replicas_alias_parameter_storage():
    """On the module's own device a replica reads the original storage: no parameter is copied."""
    model = bn_model()
    for replica in minidp.replicate(model, cpu_ids(3)):
        for original, copied in zip(model.parameters(), _replica_params(replica)):
            assert copied.data_ptr() == original.data_ptr()


def _replica_params(replica: nn.Module) -> list[torch.Tensor]:
    """A replica's parameter tensors, in the original's ``parameters()`` order (they are attributes)."""
    return [getattr(m, name) for m in replica.modules() for name in ("weight", "bias") if hasattr(m, name)]


def test_replica_zero_shares_buffers_the_others_get_copies():
    """B21: replica 0's in-place buffer updates reach the original; the others' are dropped."""
    model = bn_model()
    replicas = minidp.replicate(model, cpu_ids(3))
    assert replicas[0][1].running_mean is model[1].running_mean
    for replica in replicas[1:]:
        assert replica[1].running_mean is not model[1].running_mean
        assert replica[1].running_mean.data_ptr() != model[1].running_mean.data_ptr()
        assert torch.equal(replica[1].running_mean, model[1].running_mean)


def test_batchnorm_running_stats_come_from_chunk_zero(generator):
    """B21: after a parallel forward, running statistics are those of chunk 0 alone, as in stock."""
    model = bn_model()
    alone = copy.deepcopy(model)
    x = torch.randn(10, 4, generator=generator, dtype=torch.float64)
    chunks = minidp.scatter(x, cpu_ids(3))
    minidp.parallel_apply(minidp.replicate(model, cpu_ids(3)), [(c,) for c in chunks])
    alone(chunks[0])
    # Equal up to rounding: a replica's thread may use fewer intra-op threads, which splits the sums differently.
    for name, buffer in alone.named_buffers():
        assert max_relative_error(dict(model.named_buffers())[name].double(), buffer.double()) <= RTOL_FLOAT64, name


def _doubled(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return 2 * type(self).forward(self, x)


@pytest.mark.parametrize("bind", [types.MethodType, functools.partial], ids=["MethodType", "partial"])
def test_a_forward_bound_on_the_instance_runs_on_each_replicas_own_tensors(bind, generator):
    """B38: a replica is a shallow copy, so a forward set on the instance and bound to it (``m.forward =
    types.MethodType(f, m)``, as accelerate patches one for mixed precision, or ``functools.partial(f, m)``) would be
    the original's in every replica, run on its tensors (on CPU replicas, its BatchNorm statistics updated by every
    chunk at once). Each replica's is bound to the replica: every chunk runs the patch on its own replica, as one
    device runs it chunk by chunk (statistics from chunk 0, B21; gradients the chunks' sum, B31)."""
    model = bn_model()
    alone = [copy.deepcopy(model) for _ in range(3)]
    for module in (model, *alone):
        module[1].forward = bind(_doubled, module[1])
    x = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    chunks = minidp.scatter(x, cpu_ids(3))
    outputs = minidp.parallel_apply(minidp.replicate(model, cpu_ids(3)), [(c,) for c in chunks])
    sum(output.pow(2).sum() for output in outputs).backward()
    for copy_, chunk, output in zip(alone, chunks, outputs):
        expected = copy_(chunk)
        expected.pow(2).sum().backward()
        assert max_relative_error(output, expected) <= RTOL_FLOAT64
    assert model[1].num_batches_tracked.item() == 1  # replica 0's update alone
    for name, buffer in alone[0].named_buffers():
        assert max_relative_error(dict(model.named_buffers())[name].double(), buffer.double()) <= RTOL_FLOAT64, name
    for name, param in model.named_parameters():
        expected_grad = sum(dict(copy_.named_parameters())[name].grad for copy_ in alone)
        # (the first layer's bias: zero up to rounding, which BatchNorm's mean takes out)
        torch.testing.assert_close(param.grad, expected_grad, rtol=RTOL_FLOAT64, atol=1e-12, msg=name)


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = bn_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _doubling_its_model(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return 2 * self.model(x)  # `model`: an attribute here, whatever the caller's globals name so


def _calling_a_method_kept_on_its_model(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.model.kept(x)  # a method of the model kept on the model, bound to it: `m.model.kept = m.model.forward`


@pytest.mark.parametrize("patch", ["child_forward", "attribute_named_as_a_global", "method_kept_on_a_sub_module"])
def test_a_forward_bound_to_a_module_of_the_tree_runs_its_replica_copy(patch, generator, monkeypatch):
    """``m.forward = m.model.forward`` (a method bound to a sub-module) is bound to the sub-module's copy in each
    replica, and so is a method bound to a module that another module keeps (``m.model.kept = m.model.forward``, called
    by a patched forward); a method that reads ``self.model`` is taken, where a global of the same name holds the model
    (a script's ``model = ...``): only the globals a function loads count as what it holds. Each chunk runs on its own
    replica, as one device runs the chunks one by one (statistics from chunk 0, B21)."""
    wrapper = _Wrapper()
    alone = [copy.deepcopy(wrapper) for _ in range(3)]
    for module in (wrapper, *alone):
        if patch == "child_forward":
            module.forward = module.model.forward
        elif patch == "method_kept_on_a_sub_module":
            module.model.kept = module.model.forward
            module.forward = types.MethodType(_calling_a_method_kept_on_its_model, module)
        else:
            module.forward = types.MethodType(_doubling_its_model, module)
    monkeypatch.setitem(globals(), "model", wrapper)
    x = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    chunks = minidp.scatter(x, cpu_ids(3))
    outputs = minidp.parallel_apply(minidp.replicate(wrapper, cpu_ids(3)), [(c,) for c in chunks])
    for copy_, chunk, output in zip(alone, chunks, outputs):
        assert max_relative_error(output, copy_(chunk)) <= RTOL_FLOAT64
    assert wrapper.model[1].num_batches_tracked.item() == 1


def test_replica_parameters_are_not_listed_and_not_leaves():
    """B20: ``replica.parameters()`` is empty; the copies are non-leaf outputs of Broadcast."""
    model = bn_model()
    with emulated_stock():
        stock = nn.parallel.replicate(model, [0, 1])
    for replica in minidp.replicate(model, cpu_ids(2)):
        assert list(replica.parameters()) == []
        assert all(not p.is_leaf and p.grad_fn is not None for p in _replica_params(replica))
    assert [list(r.parameters()) for r in stock] == [[], []]


def test_backward_sums_every_replicas_gradient_into_the_original(generator):
    """B31: one backward puts sum_j dL/dp_j into each original parameter's ``.grad``."""
    model = nn.Linear(3, 2).double()
    x = torch.randn(3, 4, 3, generator=generator, dtype=torch.float64)
    replicas = minidp.replicate(model, cpu_ids(3))
    sum(r(xi).pow(2).sum() for r, xi in zip(replicas, x)).backward()
    expected = copy.deepcopy(model)
    for xi in x:
        expected(xi).pow(2).sum().backward()
    for ours, theirs in zip(model.parameters(), expected.parameters()):
        assert max_relative_error(ours.grad, theirs.grad) <= RTOL_FLOAT64


def test_detach_cuts_gradients():
    """B19: ``detach=True`` (DataParallel under no_grad) gives replicas outside autograd."""
    model = bn_model()
    for replica in minidp.replicate(model, cpu_ids(2), detach=True):
        assert all(not p.requires_grad and p.grad_fn is None for p in _replica_params(replica))
        assert not replica(torch.randn(3, 4, dtype=torch.float64)).requires_grad


def test_detach_copies_a_buffer_that_requires_grad_outside_autograd():
    """B19: under ``detach`` every buffer is a plain copy (``broadcast_coalesced``): replica 0 holds the original,
    the others copies that do not require grad, through which no backward reaches the original (they were clones
    recorded by autograd, and a backward through them filled the original buffer's ``.grad``)."""
    model = nn.Linear(4, 4)
    model.register_buffer("scale", torch.ones(4).requires_grad_())
    replicas = minidp.replicate(model, cpu_ids(3), detach=True)
    assert replicas[0].scale is model.scale
    assert all(not r.scale.requires_grad and r.scale.grad_fn is None for r in replicas[1:])


def test_shared_parameters_stay_shared_in_replicas():
    """Tied weights (one Parameter under two names) are one tensor in each replica too."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    for replica in minidp.replicate(model, cpu_ids(2)):
        assert replica[0].weight is replica[1].weight


def test_the_original_module_is_left_unchanged():
    model = bn_model()
    before = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    minidp.replicate(model, cpu_ids(3))
    after = model.state_dict(keep_vars=True)
    assert all(after[k] is obj and torch.equal(obj, saved) for k, (obj, saved) in before.items())


def test_broadcast_coalesced_copies_a_tensor_listed_twice(generator):
    """``tensors`` may repeat an object (two modules sharing a parameter): each slot gets its copy."""
    t, u = torch.randn(3, generator=generator), torch.randn(2, generator=generator)
    (copies,) = minidp.comm.broadcast_coalesced([t, u, t], ["meta"])
    assert [tuple(c.shape) for c in copies] == [(3,), (2,), (3,)] and all(c.device.type == "meta" for c in copies)


def test_broadcast_coalesced_copies_have_version_counters_of_their_own(generator):
    """Copies unflattened from one buffer must not share its version counter (stock: fresh ones)."""
    a, b = torch.randn(3, generator=generator), torch.randn(2, generator=generator)
    (copies,) = minidp.comm.broadcast_coalesced([a, b], ["meta"])
    before = copies[1]._version
    copies[0].add_(1)
    assert copies[1]._version == before


class _ZerosMade(TorchDispatchMode):
    """The shapes of the tensors of zeros made while it is active (in this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default):
            self.shapes.append(tuple(result.shape))
        return result


def _frozen_backbone_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16).requires_grad_(False), nn.Tanh(), nn.Linear(16, 3)).double()


def test_the_backward_makes_no_zeros_for_a_frozen_parameters_copies(generator):
    """Stock's Broadcast marks a frozen parameter's copies non-differentiable, and autograd still hands its backward a
    tensor of zeros for each of them on every replica, which it discards: a frozen backbone's size of zeros per
    replica at every step (seen under the emulation). minidp's backward is handed nothing for them, and the head's
    gradient is the same."""
    x = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    model = _frozen_backbone_model()
    stock_model = copy.deepcopy(model)
    with emulated_stock():
        stock_output = nn.DataParallel(stock_model, [0, 1])(x).sum()
        with _ZerosMade() as stock_zeros:
            stock_output.backward()
    output = minidp.DataParallel(model, cpu_ids(2))(x).sum()
    with _ZerosMade() as zeros:
        output.backward()
    assert stock_zeros.shapes.count((16, 8)) == 2
    assert (16, 8) not in zeros.shapes and (16,) not in zeros.shapes
    assert torch.equal(model[2].weight.grad, stock_model[2].weight.grad)


def test_a_parameter_one_replica_leaves_unused_still_sums_zeros_for_it(generator):
    """B31: a trainable parameter that a replica's forward does not use gets zeros from that replica in the sum,
    as the zeros autograd made for it before (its gradient is then not None)."""

    class SkipsOnShortChunks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x)) if x.shape[0] > 2 else self.first(x)

    model = SkipsOnShortChunks()
    x = torch.randn(5, 4, generator=generator, dtype=torch.float64)  # chunks of 3 and 2 rows
    minidp.DataParallel(model, cpu_ids(2))(x).sum().backward()
    expected = copy.deepcopy(model)
    expected.zero_grad()
    expected.second(expected.first(x[:3])).sum().backward()
    expected.first(x[3:]).sum().backward()
    assert max_relative_error(model.second.weight.grad, expected.second.weight.grad) <= RTOL_FLOAT64
    assert max_relative_error(model.first.weight.grad, expected.first.weight.grad) <= RTOL_FLOAT64


def test_replicate_under_a_functorch_transform_raises_torchs_error_as_stock(generator):
    """Stock's Broadcast is an autograd Function without ``setup_context``, which ``Function.apply`` refuses to run
    under a functorch transform (``torch.func.grad``, ``vmap``), saying so. minidp's Functions skip that wrapper's
    walk over their arguments where no transform is active (``minidp.step5_reduce.apply_function``), and keep its
    error where one is: autograd's own ``apply`` would fail an internal assert instead."""
    model, x = bn_model(), torch.randn(4, 4, generator=generator, dtype=torch.float64)
    with emulated_stock():
        with pytest.raises(RuntimeError, match="must override the setup_context") as stock:
            torch.func.grad(lambda x: nn.parallel.replicate(model, [0, 1])[1](x).sum())(x)
    with pytest.raises(RuntimeError, match="must override the setup_context") as raised:
        torch.func.grad(lambda x: minidp.replicate(model, cpu_ids(2))[1](x).sum())(x)
    assert str(raised.value) == str(stock.value)
