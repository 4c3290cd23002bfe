"""parallel_criterion and DataParallel(gather_output=False): the loss on the replicas equals the
criterion on the gathered output, loss and gradients (torch's documented reductions; float64)."""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minidp
from .helpers import RTOL_FLOAT64, cpu_ids, max_relative_error


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """parallel_criterion's warnings come once per criterion type and process: once per test here."""
    monkeypatch.setattr(minidp.criterion, "_warned", set())

FEATURES, CLASSES = 6, 5
# (replicas, batch): every split uneven (torch.chunk: 9 -> 5, 4; 11 -> 4, 4, 3; 7 -> 2, 2, 2, 1)
SPLITS = [pytest.param(2, 9, id="2x(5,4)"), pytest.param(3, 11, id="3x(4,4,3)"), pytest.param(4, 7, id="4x(2,2,2,1)")]
REDUCTIONS = ["mean", "sum", "none"]


def model(generator: torch.Generator, outputs: int = CLASSES) -> nn.Module:
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, outputs)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return net


def class_targets(generator: torch.Generator, batch: int, ignore: int = -100, ignored: float = 0.0) -> torch.Tensor:
    targets = torch.randint(0, CLASSES, (batch,), generator=generator)
    targets[torch.rand(batch, generator=generator) < ignored] = ignore
    if bool((targets == ignore).all()):  # a mean over no target is NaN on both sides, which compares nothing: keep one
        targets[0] = 1 if ignore == 0 else 0
    return targets


def class_weight(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(CLASSES, generator=generator, dtype=torch.float64) + 0.1


def probabilities(generator: torch.Generator, batch: int) -> torch.Tensor:
    return torch.randn(batch, CLASSES, generator=generator, dtype=torch.float64).softmax(1)


def values(generator: torch.Generator, batch: int) -> torch.Tensor:
    return torch.randn(batch, CLASSES, generator=generator, dtype=torch.float64)


def bits(generator: torch.Generator, batch: int) -> torch.Tensor:
    return torch.rand(batch, CLASSES, generator=generator, dtype=torch.float64).round()


# name -> (criterion for a reduction, targets for a batch), drawn from one generator
CASES: dict[str, Callable] = {
    "CE": lambda g, r, n: (nn.CrossEntropyLoss(reduction=r), class_targets(g, n)),
    "CE weight": lambda g, r, n: (nn.CrossEntropyLoss(class_weight(g), reduction=r), class_targets(g, n)),
    "CE ignore_index": lambda g, r, n: (nn.CrossEntropyLoss(reduction=r), class_targets(g, n, ignored=0.3)),
    "CE label_smoothing": lambda g, r, n: (nn.CrossEntropyLoss(reduction=r, label_smoothing=0.15), class_targets(g, n)),
    "CE weight+ignore_index+label_smoothing": lambda g, r, n: (
        nn.CrossEntropyLoss(class_weight(g), ignore_index=2, reduction=r, label_smoothing=0.15),
        class_targets(g, n, ignore=2, ignored=0.3),
    ),
    "CE probabilities": lambda g, r, n: (nn.CrossEntropyLoss(reduction=r), probabilities(g, n)),
    "CE probabilities weight+label_smoothing": lambda g, r, n: (
        nn.CrossEntropyLoss(class_weight(g), reduction=r, label_smoothing=0.2),
        probabilities(g, n),
    ),
    "NLL": lambda g, r, n: (nn.NLLLoss(reduction=r), class_targets(g, n)),
    "NLL weight+ignore_index": lambda g, r, n: (
        nn.NLLLoss(class_weight(g), ignore_index=1, reduction=r),
        class_targets(g, n, ignore=1, ignored=0.3),
    ),
    "MSE": lambda g, r, n: (nn.MSELoss(reduction=r), values(g, n)),
    "L1": lambda g, r, n: (nn.L1Loss(reduction=r), values(g, n)),
    "BCEWithLogits": lambda g, r, n: (nn.BCEWithLogitsLoss(reduction=r), bits(g, n)),
    "BCEWithLogits weight+pos_weight": lambda g, r, n: (
        nn.BCEWithLogitsLoss(
            weight=torch.rand(CLASSES, generator=g, dtype=torch.float64),
            pos_weight=torch.rand(CLASSES, generator=g, dtype=torch.float64) * 3,
            reduction=r,
        ),
        bits(g, n),
    ),
    "BCEWithLogits per-row weight": lambda g, r, n: (
        nn.BCEWithLogitsLoss(weight=torch.rand(n, 1, generator=g, dtype=torch.float64), reduction=r),
        bits(g, n),
    ),
}


def full_batch_reference(net: nn.Module, criterion, x: torch.Tensor, targets, generator: torch.Generator):
    """The criterion on a plain single-device run of the whole batch: ``((loss, parameter gradients),
    the gradient its backward started from)``: none for a scalar, random for per-element losses."""
    net.zero_grad()
    loss = criterion(net(x), targets)
    grad = None if loss.dim() == 0 else torch.randn(loss.shape, generator=generator, dtype=loss.dtype)
    loss.backward(grad)
    return (loss.detach(), [p.grad.clone() for p in net.parameters()]), grad


def on_the_replicas(net: nn.Module, criterion, x: torch.Tensor, targets, replicas: int, grad, **options):
    """The same with DataParallel(gather_output=False) and parallel_criterion, backward from ``grad``."""
    net.zero_grad()
    outputs = minidp.DataParallel(net, cpu_ids(replicas), gather_output=False, **options)(x)
    loss = minidp.parallel_criterion(criterion, outputs, targets)
    loss.backward(grad)
    return loss.detach(), [p.grad.clone() for p in net.parameters()]


def assert_same(actual, expected) -> None:
    (loss, grads), (ref_loss, ref_grads) = actual, expected
    assert loss.shape == ref_loss.shape
    assert max_relative_error(loss, ref_loss) < RTOL_FLOAT64
    for grad, ref in zip(grads, ref_grads):
        assert max_relative_error(grad, ref) < RTOL_FLOAT64


# --------------------------------------------------------------------------------------------------
# the known criteria: exact, loss and gradients
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas,batch", SPLITS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_the_criterion_on_the_gathered_output(case, reduction, replicas, batch, generator):
    criterion, targets = CASES[case](generator, reduction, batch)
    net, x = model(generator), torch.randn(batch, FEATURES, generator=generator, dtype=torch.float64)
    expected, grad = full_batch_reference(net, criterion, x, targets, generator)
    assert_same(on_the_replicas(net, criterion, x, targets, replicas, grad), expected)


POSITIONS = 3  # a third dimension: (N, C, d) outputs, a class (or a distribution over the classes) per position


@pytest.mark.parametrize("replicas,batch", SPLITS)
@pytest.mark.parametrize("targets", ["classes", "probabilities"])
def test_cross_entropy_over_positions_equals_the_criterion_on_the_gathered_output(targets, replicas, batch, generator):
    # torch's cross_entropy on (N, C, d): the mean over the N*d positions, with probabilities as with classes
    criterion = nn.CrossEntropyLoss(class_weight(generator), label_smoothing=0.1)
    net = nn.Sequential(model(generator, CLASSES * POSITIONS), nn.Unflatten(1, (CLASSES, POSITIONS)))
    x = torch.randn(batch, FEATURES, generator=generator, dtype=torch.float64)
    if targets == "classes":
        target = torch.randint(0, CLASSES, (batch, POSITIONS), generator=generator)
    else:
        target = torch.randn(batch, CLASSES, POSITIONS, generator=generator, dtype=torch.float64).softmax(1)
    expected, grad = full_batch_reference(net, criterion, x, target, generator)
    assert_same(on_the_replicas(net, criterion, x, target, replicas, grad), expected)


@pytest.mark.parametrize("chunk_weights", [[5, 1, 1], [1, 1, 6]], ids=str)
@pytest.mark.parametrize("case", ["CE weight+ignore_index+label_smoothing", "NLL weight+ignore_index", "MSE"])
def test_very_uneven_chunks_from_chunk_weights_give_the_full_batch_loss(case, chunk_weights, generator):
    criterion, targets = CASES[case](generator, "mean", 13)
    net, x = model(generator), torch.randn(13, FEATURES, generator=generator, dtype=torch.float64)
    expected, grad = full_batch_reference(net, criterion, x, targets, generator)
    actual = on_the_replicas(net, criterion, x, targets, 3, grad, chunk_weights=chunk_weights)
    assert_same(actual, expected)


def test_a_replica_whose_targets_are_all_ignored_still_counts_the_others_only(generator):
    # torch's mean divides by the weight of the targets that count; the unweighted mean of the
    # replicas' means (a replica of ignored targets contributes nan, or 0 if skipped) would not.
    criterion = nn.CrossEntropyLoss(class_weight(generator), label_smoothing=0.1)
    targets = class_targets(generator, 8)
    targets[4:] = -100  # replica 1 of 2: nothing counts
    net, x = model(generator), torch.randn(8, FEATURES, generator=generator, dtype=torch.float64)
    expected, grad = full_batch_reference(net, criterion, x, targets, generator)
    assert_same(on_the_replicas(net, criterion, x, targets, 2, grad), expected)


@pytest.mark.parametrize("criterion", [nn.CrossEntropyLoss(label_smoothing=0.1), nn.NLLLoss()], ids=["CE", "NLL"])
def test_all_targets_ignored_gives_nan_and_zero_gradients_as_torch(criterion, generator):
    net, x = model(generator), torch.randn(7, FEATURES, generator=generator, dtype=torch.float64)
    targets = torch.full((7,), -100)
    (ref_loss, ref_grads), grad = full_batch_reference(net, criterion, x, targets, generator)
    loss, grads = on_the_replicas(net, criterion, x, targets, 3, grad)
    assert ref_loss.isnan() and loss.isnan()
    for grad, ref in zip(grads, ref_grads):
        assert torch.equal(grad, ref) and not grad.any()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_elementwise_losses_split_along_dim(reduction, generator):
    # The batch along dim 1, as for DataParallel(dim=1): the per-element losses gather along it too.
    full = torch.randn(3, 10, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randn(3, 10, 4, generator=generator, dtype=torch.float64)
    criterion = nn.MSELoss(reduction=reduction)
    grad = torch.randn(criterion(full, targets).shape, generator=generator, dtype=torch.float64)
    expected = criterion(full, targets)
    (expected_grad,) = torch.autograd.grad(expected, full, grad)
    loss = minidp.parallel_criterion(criterion, list(torch.split(full, [4, 3, 3], dim=1)), targets, dim=1)
    (actual_grad,) = torch.autograd.grad(loss, full, grad)
    assert max_relative_error(loss, expected) < RTOL_FLOAT64
    assert max_relative_error(actual_grad, expected_grad) < RTOL_FLOAT64


def test_a_subclass_that_keeps_forward_uses_its_base_classes_rule(generator):
    class Labelled(nn.CrossEntropyLoss):
        pass

    criterion = Labelled(ignore_index=0)
    net, x, targets = model(generator), torch.randn(9, FEATURES, generator=generator, dtype=torch.float64), class_targets(generator, 9)
    expected, grad = full_batch_reference(net, criterion, x, targets, generator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no rule" warning
        actual = on_the_replicas(net, criterion, x, targets, 2, grad)
    assert_same(actual, expected)


FUNCTIONS = {
    "cross_entropy": (F.cross_entropy, nn.CrossEntropyLoss(), class_targets),
    "nll_loss": (F.nll_loss, nn.NLLLoss(), class_targets),
    "mse_loss": (F.mse_loss, nn.MSELoss(), values),
    "l1_loss": (F.l1_loss, nn.L1Loss(), values),
    "binary_cross_entropy_with_logits": (F.binary_cross_entropy_with_logits, nn.BCEWithLogitsLoss(), bits),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_the_function_behind_a_criterion_class_follows_that_classs_rule_bitwise(name, generator):
    # F.cross_entropy(output, target) is nn.CrossEntropyLoss()(output, target) (torch.nn.modules.loss: the class's
    # forward calls the function with the class's arguments, whose defaults are the function's).
    function, criterion, draw_targets = FUNCTIONS[name]
    net, x, targets = model(generator), torch.randn(11, FEATURES, generator=generator, dtype=torch.float64), draw_targets(generator, 11)
    expected, grad = full_batch_reference(net, function, x, targets, generator)
    by_class = on_the_replicas(net, criterion, x, targets, 3, grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no rule" warning
        by_function = on_the_replicas(net, function, x, targets, 3, grad)
    assert torch.equal(by_function[0], by_class[0])
    assert all(torch.equal(a, b) for a, b in zip(by_function[1], by_class[1]))
    assert_same(by_function, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("criterion", [nn.MSELoss(), nn.L1Loss(), nn.BCEWithLogitsLoss()], ids=lambda c: type(c).__name__)
def test_a_half_precision_mean_whose_sum_passes_the_dtype_range_is_torchs_finite_loss(criterion, dtype):
    # torch's mean sums a half-precision loss in float32 and returns the mean in the loss's dtype: here 4.0 (2.0 for
    # L1, 2.13 for BCE), where the sum of 40000 per-element losses (80000 and more) is past float16's largest value
    # (65504); bfloat16's range is float32's, its sum rounds alike.
    outputs = torch.full((40000, 1), 2.0, dtype=dtype)
    targets = torch.zeros(40000, 1, dtype=dtype)
    loss = minidp.parallel_criterion(criterion, list(outputs.chunk(2)), targets)
    assert loss.dtype == dtype
    assert torch.equal(loss, criterion(outputs, targets))


def test_a_half_precision_row_weighted_mean_past_the_dtype_range_is_finite():
    def mean_squared_error(output, target):
        return ((output - target) ** 2).mean()

    outputs, targets = torch.full((20000, 1), 2.0, dtype=torch.float16), torch.zeros(20000, 1, dtype=torch.float16)
    with pytest.warns(UserWarning, match="no rule for"):
        loss = minidp.parallel_criterion(mean_squared_error, list(outputs.chunk(2)), targets)
    assert loss.dtype == torch.float16 and torch.equal(loss, mean_squared_error(outputs, targets))


# --------------------------------------------------------------------------------------------------
# any other callable: the row-weighted mean, with a warning
# --------------------------------------------------------------------------------------------------


def test_other_callables_get_the_row_weighted_mean_of_the_replicas_losses(generator):
    # The rule, spelled out: sum(rows_i * loss_i) / sum(rows_i); here a sum, where it is not the full batch's.
    criterion = nn.SmoothL1Loss(reduction="sum")
    full = torch.randn(11, 3, generator=generator, dtype=torch.float64)
    targets = torch.randn(11, 3, generator=generator, dtype=torch.float64)
    sizes = [4, 4, 3]
    expected = sum(n * criterion(o, t) for n, o, t in zip(sizes, full.split(sizes), targets.split(sizes))) / 11
    with pytest.warns(UserWarning, match="row"):
        loss = minidp.parallel_criterion(criterion, list(full.split(sizes)), targets)
    assert max_relative_error(loss, expected) < RTOL_FLOAT64


def test_the_row_weighted_mean_is_exact_for_a_plain_mean_over_rows(generator):
    def mean_squared_error(output, target):
        return ((output - target) ** 2).mean()

    net, x = model(generator), torch.randn(11, FEATURES, generator=generator, dtype=torch.float64)
    targets = values(generator, 11)
    expected, grad = full_batch_reference(net, mean_squared_error, x, targets, generator)
    with pytest.warns(UserWarning, match="no rule for"):
        actual = on_the_replicas(net, mean_squared_error, x, targets, 3, grad)
    assert_same(actual, expected)


def test_a_callable_that_cannot_be_hashed_is_taken_as_any_callable(generator):
    class Unhashable:  # defines __eq__, so Python sets __hash__ to None, as a dataclass(eq=True) does
        def __eq__(self, other):
            return self is other

        def __call__(self, output, target):
            return F.mse_loss(output, target)

    full = torch.randn(6, 3, generator=generator, dtype=torch.float64)
    targets = torch.randn(6, 3, generator=generator, dtype=torch.float64)
    with pytest.warns(UserWarning, match="row"):
        loss = minidp.parallel_criterion(Unhashable(), list(full.split([3, 3])), targets)
    assert max_relative_error(loss, F.mse_loss(full, targets)) < RTOL_FLOAT64


def test_the_warning_for_a_callable_without_rule_comes_once(generator):
    def once_only(output, target):
        return F.mse_loss(output, target)

    outputs, targets = [torch.randn(2, 3, generator=generator)] * 2, torch.randn(4, 3, generator=generator)
    with pytest.warns(UserWarning, match="once_only"):
        minidp.parallel_criterion(once_only, outputs, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minidp.parallel_criterion(once_only, outputs, targets)


def test_a_subclass_that_overrides_forward_is_treated_as_any_callable(generator):
    class Doubled(nn.MSELoss):
        def forward(self, output, target):
            return 2 * super().forward(output, target)

    with pytest.warns(UserWarning, match="Doubled"):
        minidp.parallel_criterion(Doubled(), [torch.randn(2, 3, generator=generator)] * 2, torch.randn(4, 3, generator=generator))


# --------------------------------------------------------------------------------------------------
# a criterion with hooks: called once on the gathered output, as torch calls it, with a warning
# --------------------------------------------------------------------------------------------------


def split_leaf(generator: torch.Generator, shape: tuple[int, ...], sizes: list[int], dim: int = 0):
    """A float64 leaf standing for the gathered output, and its chunks standing for the replicas' outputs."""
    full = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    return full, list(full.split(sizes, dim))


def test_a_criterion_with_forward_hooks_gives_torchs_loss_and_gradients_bitwise(generator):
    criterion = nn.CrossEntropyLoss()
    criterion.register_forward_pre_hook(lambda module, args: (args[0] / 2, args[1]))  # a temperature on the logits
    criterion.register_forward_hook(lambda module, args, loss: loss * 3)  # a loss scale
    full, outputs = split_leaf(generator, (10, CLASSES), [4, 4, 2])
    targets = class_targets(generator, 10)
    expected = criterion(full, targets)
    (expected_grad,) = torch.autograd.grad(expected, full)
    with pytest.warns(UserWarning, match="CrossEntropyLoss once on the gathered output.*forward pre-hooks, forward hooks"):
        loss = minidp.parallel_criterion(criterion, outputs, targets)
    (grad,) = torch.autograd.grad(loss, full)
    assert torch.equal(loss, expected) and torch.equal(grad, expected_grad)


def test_the_warning_for_a_criterion_with_hooks_says_how_to_keep_the_loss_on_the_replicas(generator):
    criterion = nn.MSELoss()
    criterion.register_forward_hook(lambda module, args, loss: None)
    full, outputs = split_leaf(generator, (6, 3), [3, 3])
    with pytest.warns(UserWarning, match="Remove the hooks to compute the loss on the replicas"):
        minidp.parallel_criterion(criterion, outputs, torch.zeros(6, 3, dtype=torch.float64))


def record_shape(seen: list):
    """A hook for any of the kinds below: records the shape of the first tensor it is shown (input or gradient)."""
    return lambda module, shown, *rest: seen.append(tuple(shown[0].shape))


module_hooks = torch.nn.modules.module
HOOKS: dict[str, Callable] = {
    "forward pre-hook": lambda c, seen: c.register_forward_pre_hook(record_shape(seen)),
    "forward pre-hook with kwargs": lambda c, seen: c.register_forward_pre_hook(record_shape(seen), with_kwargs=True),
    "forward hook": lambda c, seen: c.register_forward_hook(record_shape(seen)),
    "forward hook always called": lambda c, seen: c.register_forward_hook(record_shape(seen), always_call=True),
    "full backward pre-hook": lambda c, seen: c.register_full_backward_pre_hook(record_shape(seen)),
    "full backward hook": lambda c, seen: c.register_full_backward_hook(record_shape(seen)),
    "global forward pre-hook": lambda c, seen: module_hooks.register_module_forward_pre_hook(record_shape(seen)),
    "global forward hook": lambda c, seen: module_hooks.register_module_forward_hook(record_shape(seen)),
    "global full backward pre-hook": lambda c, seen: module_hooks.register_module_full_backward_pre_hook(record_shape(seen)),
    "global full backward hook": lambda c, seen: module_hooks.register_module_full_backward_hook(record_shape(seen)),
}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_every_kind_of_hook_sees_the_whole_batch_once_as_under_torch(hook, generator):
    criterion, seen = nn.MSELoss(), []
    full, outputs = split_leaf(generator, (9, 4), [5, 4])
    targets = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    handle = HOOKS[hook](criterion, seen)
    try:
        torch.autograd.grad(criterion(full, targets), full)
        under_torch, seen[:] = list(seen), []
        with pytest.warns(UserWarning, match="Remove the hooks"):
            torch.autograd.grad(minidp.parallel_criterion(criterion, outputs, targets), full)
    finally:
        handle.remove()
    assert under_torch and seen == under_torch


def test_a_criterion_without_rule_with_a_hook_is_called_once_on_the_gathered_output(generator):
    # Without hooks it would be called once per replica, on each chunk, with the row-weighted mean (not a sum's).
    criterion, calls = nn.SmoothL1Loss(reduction="sum"), []
    full, outputs = split_leaf(generator, (11, 3), [4, 4, 3])
    targets = torch.randn(11, 3, generator=generator, dtype=torch.float64)
    expected = criterion(full, targets)
    criterion.register_forward_hook(lambda module, args, loss: calls.append(tuple(args[0].shape)))
    with pytest.warns(UserWarning, match="SmoothL1Loss once on the gathered output"):
        loss = minidp.parallel_criterion(criterion, outputs, targets)
    assert calls == [(11, 3)] and torch.equal(loss, expected)


def test_a_criterion_with_hooks_gets_the_outputs_gathered_along_dim(generator):
    criterion = nn.MSELoss(reduction="none")
    criterion.register_forward_hook(lambda module, args, loss: loss * 2)
    full, outputs = split_leaf(generator, (3, 10, 4), [4, 3, 3], dim=1)
    targets = torch.randn(3, 10, 4, generator=generator, dtype=torch.float64)
    grad = torch.randn(3, 10, 4, generator=generator, dtype=torch.float64)
    expected = criterion(full, targets)
    (expected_grad,) = torch.autograd.grad(expected, full, grad)
    with pytest.warns(UserWarning, match="Remove the hooks"):
        loss = minidp.parallel_criterion(criterion, outputs, targets, dim=1)
    (actual_grad,) = torch.autograd.grad(loss, full, grad)
    assert torch.equal(loss, expected) and torch.equal(actual_grad, expected_grad)


def test_a_criterion_with_hooks_gets_torchs_broadcast_of_targets_not_an_error(generator):
    # Called as torch calls it, it computes what torch computes, broadcast (and torch's warning) included.
    criterion = nn.MSELoss()
    criterion.register_forward_hook(lambda module, args, loss: None)
    full, outputs = split_leaf(generator, (10, 1), [4, 4, 2])
    targets = torch.randn(10, generator=generator, dtype=torch.float64)
    with pytest.warns(UserWarning, match="incorrect results due to broadcasting"):
        expected = criterion(full, targets)
    with pytest.warns(UserWarning, match="Remove the hooks"):
        assert torch.equal(minidp.parallel_criterion(criterion, outputs, targets), expected)


def test_a_function_runs_no_module_hooks_as_under_torch(generator):
    # F.mse_loss is not a module: torch calls it without the global module hooks, so it stays on the replicas.
    seen: list = []
    full, outputs = split_leaf(generator, (9, 4), [5, 4])
    targets = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    handle = module_hooks.register_module_forward_hook(record_shape(seen))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # neither "hooks" nor "no rule"
            loss = minidp.parallel_criterion(F.mse_loss, outputs, targets)
    finally:
        handle.remove()
    assert seen == [] and max_relative_error(loss, F.mse_loss(full, targets)) < RTOL_FLOAT64


# --------------------------------------------------------------------------------------------------
# what moves: only scalars reach the output device
# --------------------------------------------------------------------------------------------------


def test_only_two_scalars_per_replica_are_gathered_where_stock_gathers_the_output(generator):
    net, x = model(generator), torch.randn(12, FEATURES, generator=generator, dtype=torch.float64)
    targets, criterion = class_targets(generator, 12), nn.CrossEntropyLoss()

    def gathered_bytes(gather_output: bool) -> list[int]:
        wrapper = minidp.DataParallel(net, cpu_ids(3), gather_output=gather_output)
        with minidp.trace() as step:
            output = wrapper(x)
            loss = minidp.parallel_criterion(criterion, output, targets) if not gather_output else criterion(output, targets)
            loss.backward()
        return [e.bytes for e in step.events if e.stage == "gather"]

    assert gathered_bytes(True) == [4 * CLASSES * 8] * 3  # each replica's (4, 5) float64 output
    assert gathered_bytes(False) == [2 * 8] * 3  # numerator and denominator


# --------------------------------------------------------------------------------------------------
# DataParallel(gather_output=False)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_gather_output_false_returns_each_replicas_output_on_its_device(replicas, generator):
    net, x = model(generator), torch.randn(10, FEATURES, generator=generator, dtype=torch.float64)
    outputs = minidp.DataParallel(net, cpu_ids(replicas), gather_output=False)(x)
    expected = net(x).split(torch.chunk(x, replicas)[0].shape[0])
    assert isinstance(outputs, list) and len(outputs) == replicas
    for output, chunk in zip(outputs, expected):
        assert output.device == torch.device("cpu")
        assert max_relative_error(output, chunk) < RTOL_FLOAT64


# --------------------------------------------------------------------------------------------------
# bad input: errors that name the argument
# --------------------------------------------------------------------------------------------------


def test_targets_with_other_rows_than_the_outputs_are_refused(generator):
    outputs = [torch.randn(3, CLASSES, generator=generator), torch.randn(2, CLASSES, generator=generator)]
    with pytest.raises(ValueError, match=r"targets of shape \(6,\).*5 rows.*\[3, 2\]"):
        minidp.parallel_criterion(nn.CrossEntropyLoss(), outputs, torch.zeros(6, dtype=torch.long))


# (output shape, target shape): shapes torch broadcasts against each other, with its warning
BROADCAST_TARGETS = [
    pytest.param((10, 1), (10,), id="(10,1)-(10,)"),
    pytest.param((10,), (10, 1), id="(10,)-(10,1)"),
    pytest.param((10, CLASSES), (1, CLASSES), id="(10,C)-(1,C)"),
    pytest.param((10, CLASSES), (CLASSES,), id="(10,C)-(C,)"),
]


@pytest.mark.parametrize("output_shape,target_shape", BROADCAST_TARGETS)
@pytest.mark.parametrize("criterion", [nn.MSELoss(), nn.L1Loss(), F.mse_loss, F.l1_loss], ids=["MSE", "L1", "mse_loss", "l1_loss"])
def test_elementwise_targets_that_torch_would_broadcast_are_refused_before_anything_is_computed(
    criterion, output_shape, target_shape, generator
):
    # torch broadcasts them (averaging 10 x 10 losses for (10, 1) and (10,)); each replica would broadcast its chunk
    # against its own rows only, a different loss.
    outputs = list(torch.randn(output_shape, generator=generator, dtype=torch.float64).split([4, 4, 2]))
    targets = torch.randn(target_shape, generator=generator, dtype=torch.float64)
    with minidp.trace() as step, pytest.raises(ValueError, match=r"targets of shape .* do not match the outputs"):
        minidp.parallel_criterion(criterion, outputs, targets)
    assert step.events == []


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("criterion_class", [nn.MSELoss, nn.L1Loss], ids=["MSE", "L1"])
def test_elementwise_targets_that_broadcast_within_each_row_equal_the_criterion_on_the_gathered_output(
    criterion_class, reduction, generator
):
    # (N, 1) targets of an (N, C) output: each replica's chunk broadcasts against its own rows as the whole does
    net, x = model(generator), torch.randn(9, FEATURES, generator=generator, dtype=torch.float64)
    criterion, targets = criterion_class(reduction=reduction), torch.randn(9, 1, generator=generator, dtype=torch.float64)
    expected, grad = full_batch_reference(net, criterion, x, targets, generator)
    assert_same(on_the_replicas(net, criterion, x, targets, 2, grad), expected)


def test_the_error_for_a_broadcast_target_names_both_shapes_torchs_broadcast_and_the_reshape():
    with pytest.raises(ValueError) as error:
        minidp.parallel_criterion(nn.MSELoss(), [torch.zeros(4, 1), torch.zeros(4, 1)], torch.zeros(8))
    message = str(error.value)
    assert message.startswith("targets of shape (8,) do not match the outputs: MSELoss needs targets shaped like the gathered output, (8, 1)")
    assert "torch would broadcast them against it to (8, 8)" in message and "likely lead to incorrect results" in message
    assert message.endswith("Reshape them to it: targets.view(8, 1)")


def test_the_error_for_a_target_broadcast_over_the_batch_says_how_to_expand_it():
    with pytest.raises(ValueError, match=r"targets of shape \(1, 3\) do not match the outputs.*targets.expand\(8, 3\)$"):
        minidp.parallel_criterion(nn.L1Loss(), [torch.zeros(4, 3), torch.zeros(4, 3)], torch.zeros(1, 3))


def test_elementwise_targets_torch_refuses_are_refused_before_anything_is_computed():
    with minidp.trace() as step, pytest.raises(ValueError, match=r"targets of shape \(8, 2\).*torch refuses them too"):
        minidp.parallel_criterion(nn.MSELoss(), [torch.zeros(4, 3), torch.zeros(4, 3)], torch.zeros(8, 2))
    assert step.events == []


def test_a_gathered_output_is_refused_with_a_pointer_to_gather_output(generator):
    with pytest.raises(TypeError, match="gather_output=False"):
        minidp.parallel_criterion(nn.MSELoss(), torch.randn(4, 2, generator=generator), torch.zeros(4, 2))


def test_an_output_that_is_not_a_tensor_is_named(generator):
    outputs = [torch.randn(2, 3, generator=generator), (torch.randn(2, 3, generator=generator),)]
    with pytest.raises(TypeError, match=r"outputs\[1\] is a tuple"):
        minidp.parallel_criterion(nn.MSELoss(), outputs, torch.zeros(4, 3))


def test_class_criteria_refuse_a_split_other_than_the_batch_dim(generator):
    outputs = [torch.randn(2, CLASSES, 3, generator=generator)] * 2
    with pytest.raises(ValueError, match="dim=2.*CrossEntropyLoss.*dim 0"):
        minidp.parallel_criterion(nn.CrossEntropyLoss(), outputs, torch.zeros(2, 6, dtype=torch.long), dim=2)


def test_a_per_row_weight_that_does_not_match_the_batch_is_named(generator):
    criterion = nn.BCEWithLogitsLoss(weight=torch.ones(5, 1))
    with pytest.raises(ValueError, match=r"criterion.weight of shape \(5, 1\) has 5 rows where the batch has 4"):
        minidp.parallel_criterion(criterion, [torch.randn(2, 3, generator=generator)] * 2, torch.zeros(4, 3))


def test_a_callable_without_rule_must_return_a_scalar_per_replica(generator):
    def per_row(output, target):
        return (output - target).pow(2).sum(1)

    with pytest.warns(UserWarning), pytest.raises(ValueError, match="replica 0.*0-dim loss"):
        minidp.parallel_criterion(per_row, [torch.randn(2, 3, generator=generator)] * 2, torch.zeros(4, 3))


def test_an_unknown_reduction_is_named():
    with pytest.raises(ValueError, match="criterion.reduction is 'average'"):
        minidp.parallel_criterion(nn.L1Loss(reduction="average"), [torch.zeros(2, 3)] * 2, torch.zeros(4, 3))


def test_an_output_device_that_does_not_exist_is_named():
    with pytest.raises((ValueError, RuntimeError), match="output_device"):
        minidp.parallel_criterion(nn.L1Loss(), [torch.zeros(2, 3)] * 2, torch.zeros(4, 3), output_device="cuda:99")
