"""The loss on the replicas: :func:`parallel_criterion`.

Stock ``nn.DataParallel`` gathers every replica's output onto one device, where the loss is then
computed on the whole batch: that device holds the full output, the per-element losses and their
gradients on top of its own replica. With ``DataParallel(..., gather_output=False)`` each replica's output stays on its
device, and

    loss = minidp.parallel_criterion(criterion, outputs, targets)

cuts ``targets`` into the same chunks as the outputs (the sizes of the outputs along ``dim``),
computes each replica's part of the loss on that replica's device, all at once
(:func:`minidp.parallel_apply`), and gathers only what makes the full-batch loss: one or two
scalars per replica instead of its whole output.

What each replica computes, and why it is exact. ``torch``'s ``reduction="mean"`` is a ratio: the
sum of the per-element losses over a *denominator*, and for several criteria that denominator is
not the number of rows. So every replica returns its chunk's ``reduction="sum"`` loss (the sum of
its ``reduction="none"`` losses) and its chunk's share of the denominator; the loss is
``sum of numerators / sum of denominators``, which is the full batch's ratio, summed in a
different order (a float16 or bfloat16 loss's terms in float32, the mean returned in its dtype, as
``torch``'s mean accumulates it: its sum may pass float16's range where the mean does not). The
denominators, as ``torch`` defines them:

* ``nn.CrossEntropyLoss``, ``nn.NLLLoss`` with class-index targets: the total ``weight[t]`` of the
  targets ``t != ignore_index`` (without ``weight``: their count). For cross-entropy this holds
  with ``label_smoothing`` too: torch divides the smoothing term by the same total.
* ``nn.CrossEntropyLoss`` with probability targets (shaped like the input): ``input.numel() / C``,
  the number of rows of an ``(N, C)`` input; ``weight`` and ``label_smoothing`` do not enter it.
* ``nn.MSELoss``, ``nn.L1Loss``, ``nn.BCEWithLogitsLoss``: the number of per-element losses
  (``weight`` and ``pos_weight`` scale the numerator only). Their targets must be shaped like the
  gathered output: torch broadcasts MSE's and L1's targets of another shape (an ``(N, 1)`` output and
  ``(N,)`` targets: ``N x N`` losses, with its warning "likely lead to incorrect results"), which each
  replica would do against its own rows only; parallel_criterion refuses them, before anything is
  computed, naming both shapes and the reshape (torch refuses BCE's itself).

The functions behind them, ``F.cross_entropy``, ``F.nll_loss``, ``F.mse_loss``, ``F.l1_loss`` and
``F.binary_cross_entropy_with_logits``, passed as they are (called with their defaults), follow their class's rule.

``reduction="sum"``: the numerators alone. ``reduction="none"``: the per-element losses themselves,
gathered along the batch dimension. Targets that are all ``ignore_index`` give ``nan`` for
``mean``, as ``torch`` does (0 / 0), with zero gradients. A ``weight`` or ``pos_weight`` of
``nn.BCEWithLogitsLoss`` that has a batch axis (its size along ``dim``, aligned from the right as
broadcasting aligns it, is the batch size) is cut with the targets; one that broadcasts over the
batch, and the class weights of the other criteria, go whole to each replica's device.

Any other callable is called as ``criterion(output_i, targets_i)`` in replica i's thread, on its
device (tensors of its own must work there); it must return a 0-dim loss per replica, and the
result is their mean weighted by the replicas' rows, ``sum(rows_i * loss_i) / sum(rows_i)``: exact
for a loss that is a plain mean over rows, different for anything else (a sum, a mean with a
data-dependent denominator, a loss that couples rows). A warning says so, once per criterion type.

A criterion module with hooks (forward or backward, pre-hooks or not, its own or the global ones of
``torch.nn.modules.module.register_module_forward_hook`` and the like: whatever ``nn.Module.__call__`` would
run) is not computed on the replicas, rule or no rule: its hooks expect the whole batch, once, where the
replicas would show them each chunk, from several threads (or skip them: a rule calls ``F.*``). It is
called once, as torch calls it, on the outputs gathered along ``dim`` onto the output device with the
targets moved there, so loss and gradients are torch's, bitwise; a warning says so, once per criterion
type, and that removing the hooks keeps the loss on the replicas. A function (``F.mse_loss``) runs no
module hooks under torch, and none here.

What autograd records: each replica's loss on its device, the gather (``to``, ``cat``) of the
scalars, and the final sums and division, so ``loss.backward()`` sends each replica's gradient to
its output and on through its replica to the parameters. In :func:`minidp.trace`, the replicas'
loss computations show as a second ``forward`` stage and the scalars as a ``gather`` of a few bytes.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .comm import check_dim
from .hooks import registered_by_others
from .device_ids import DeviceLike, as_device
from .step1_scatter import scatter
from .step3_parallel_apply import parallel_apply
from .step4_gather import gather

REDUCTIONS = ("mean", "sum", "none")

_warned: set[str] = set()  # the keys of the warnings given


@dataclass(frozen=True)
class _Rule:
    """How one criterion type splits: its per-element loss and the denominator of its mean.

    ``per_element(criterion, output, target, tensors)`` is the criterion with ``reduction="none"``,
    ``tensors`` its weight tensors on the replica's device. ``denominator(criterion, output, target,
    tensors, per_element)`` is the chunk's share of what ``reduction="mean"`` divides by.
    ``tensors``: the names of the criterion's weight tensors; ``batched_tensors``: whether they
    broadcast against the output (so one may carry a batch axis to cut) or are indexed by class.
    ``class_targets``: the input is ``(N, C, ...)`` with the batch along dim 0. ``target_like_output``: the
    target must have the output's shape (torch broadcasts one that does not, which the chunks cannot compute).
    """

    per_element: Callable[..., torch.Tensor]
    denominator: Callable[..., Any]
    tensors: tuple[str, ...] = ()
    batched_tensors: bool = False
    class_targets: bool = False
    target_like_output: bool = False


def _is_probabilities(output: torch.Tensor, target: torch.Tensor) -> bool:
    # torch's own test (cross_entropy_loss in aten): a target shaped like the input holds probabilities.
    return target.shape == output.shape


# The denominators: (criterion, output, target, its weight tensors, per-element loss) -> the chunk's share.


def _weight_of_counted_targets(criterion, output, target: torch.Tensor, tensors: dict, per_element) -> Any:
    counted = target != criterion.ignore_index
    weight = tensors["weight"]
    return counted.sum() if weight is None else weight[target[counted]].sum()


def _cross_entropy_denominator(criterion, output: torch.Tensor, target: torch.Tensor, tensors, per_element) -> Any:
    if _is_probabilities(output, target):
        return per_element.numel()
    return _weight_of_counted_targets(criterion, output, target, tensors, per_element)


def _elements(criterion, output, target, tensors, per_element: torch.Tensor) -> int:
    return per_element.numel()


_RULES: dict[type, _Rule] = {
    nn.CrossEntropyLoss: _Rule(
        lambda c, o, t, ts: F.cross_entropy(
            o, t, weight=ts["weight"], ignore_index=c.ignore_index, reduction="none", label_smoothing=c.label_smoothing
        ),
        _cross_entropy_denominator,
        tensors=("weight",),
        class_targets=True,
    ),
    nn.NLLLoss: _Rule(
        lambda c, o, t, ts: F.nll_loss(o, t, weight=ts["weight"], ignore_index=c.ignore_index, reduction="none"),
        _weight_of_counted_targets,
        tensors=("weight",),
        class_targets=True,
    ),
    nn.MSELoss: _Rule(lambda c, o, t, ts: F.mse_loss(o, t, reduction="none"), _elements, target_like_output=True),
    nn.L1Loss: _Rule(lambda c, o, t, ts: F.l1_loss(o, t, reduction="none"), _elements, target_like_output=True),
    nn.BCEWithLogitsLoss: _Rule(
        lambda c, o, t, ts: F.binary_cross_entropy_with_logits(
            o, t, weight=ts["weight"], pos_weight=ts["pos_weight"], reduction="none"
        ),
        _elements,
        tensors=("weight", "pos_weight"),
        batched_tensors=True,
    ),
}

# The functions behind those classes, called with their defaults (``F.cross_entropy(output, target)``), are those
# classes built with theirs: the same arguments reach the same function, so the same rule holds.
_FUNCTIONAL: dict[Callable, type] = {
    F.cross_entropy: nn.CrossEntropyLoss,
    F.nll_loss: nn.NLLLoss,
    F.mse_loss: nn.MSELoss,
    F.l1_loss: nn.L1Loss,
    F.binary_cross_entropy_with_logits: nn.BCEWithLogitsLoss,
}


def _rule_for(criterion: Callable) -> Optional[_Rule]:
    """The rule for ``criterion``'s class, if it is one of them (or a subclass that keeps its ``forward``)."""
    for cls, rule in _RULES.items():
        if isinstance(criterion, cls) and type(criterion).forward is cls.forward:
            return rule
    return None


def _hooks(criterion: Callable) -> list[str]:
    """The hooks that ``nn.Module.__call__`` runs around ``criterion``'s forward, by kind: its own and the global ones,
    the dicts ``Module._call_impl`` tests before it skips to ``forward``. None for a function: torch calls it without
    module hooks."""
    if not isinstance(criterion, nn.Module):
        return []
    module = torch.nn.modules.module  # its globals read now: registering a hook changes them in place
    kinds = {
        "forward pre-hooks": criterion._forward_pre_hooks,
        "forward hooks": criterion._forward_hooks,
        "backward pre-hooks": criterion._backward_pre_hooks,
        "backward hooks": criterion._backward_hooks,
        "global forward pre-hooks (register_module_forward_pre_hook)": module._global_forward_pre_hooks,
        "global forward hooks (register_module_forward_hook)": module._global_forward_hooks,
        "global backward pre-hooks (register_module_full_backward_pre_hook)": module._global_backward_pre_hooks,
        "global backward hooks (register_module_full_backward_hook)": module._global_backward_hooks,
    }
    return [kind for kind, registered in kinds.items() if registered_by_others(registered)]


def _on_the_gathered_output(
    criterion: nn.Module, outputs: Sequence[torch.Tensor], targets: Any, dim: int, destination: torch.device
) -> torch.Tensor:
    """``criterion(gathered outputs, targets)`` on ``destination``, called as torch calls it: hooks and all."""
    (whole_targets,) = scatter(targets, [destination], dim)  # one chunk: the targets, moved, as they are
    return criterion(gather(list(outputs), destination, dim=dim), whole_targets)


def parallel_criterion(
    criterion: Callable[[Any, Any], torch.Tensor],
    outputs: Sequence[torch.Tensor],
    targets: Any,
    dim: int = 0,
    *,
    output_device: Optional[DeviceLike] = None,
) -> torch.Tensor:
    """The loss ``criterion(gathered outputs, targets)``, computed on the replicas.

    ``outputs``: one tensor per replica, in replica order, each on its replica's device (what
    ``DataParallel(..., gather_output=False)`` returns). ``targets``: the whole batch's targets, on
    any device; they are cut along ``dim`` into the outputs' sizes along ``dim`` and each chunk is
    sent to its output's device. ``output_device``: where the loss goes (default ``outputs[0]``'s
    device). The rule per criterion is in this module's docstring; a criterion module with hooks is
    called once on the gathered output instead, as torch calls it, with a warning.
    """
    if not callable(criterion):
        raise TypeError(f"criterion must be callable, e.g. nn.CrossEntropyLoss(), got {type(criterion).__name__}")
    dim, rows, devices = _check_outputs(outputs, check_dim(dim))
    destination = devices[0] if output_device is None else as_device(output_device, "output_device")
    hooks = _hooks(criterion)
    if hooks:
        _warn_once(
            f"hooks {type(criterion).__qualname__}",
            f"parallel_criterion computes {type(criterion).__qualname__} once on the gathered output, as torch does, "
            f"not on the replicas: calling it runs {', '.join(hooks)}, which torch runs once on the whole batch "
            f"(on the replicas they would see, and change, each replica's chunk). Remove the hooks to compute the "
            f"loss on the replicas.",
        )
        return _on_the_gathered_output(criterion, outputs, targets, dim, destination)
    criterion = next((cls() for function, cls in _FUNCTIONAL.items() if criterion is function), criterion)
    rule = _rule_for(criterion)
    reduction = criterion.reduction if rule is not None else "mean"  # no rule: the row-weighted mean
    if reduction not in REDUCTIONS:
        raise ValueError(f"criterion.reduction is {reduction!r}; parallel_criterion knows {REDUCTIONS}")
    if rule is not None and rule.class_targets and dim != 0:
        raise ValueError(
            f"dim={dim}: {type(criterion).__name__} takes an (N, C, ...) input whose batch is dim 0; "
            f"parallel_criterion cuts its targets along dim 0 only"
        )
    if rule is not None and rule.target_like_output:
        _check_target_like_output(criterion, outputs[0], targets, dim, rows)
    chunks = _scatter_targets(targets, devices, dim, rows)
    loss_dtypes: list[torch.dtype] = []  # each replica's loss dtype, which the mean's terms may leave for float32
    if rule is None:
        name = getattr(criterion, "__qualname__", type(criterion).__qualname__)
        _warn_once(
            f"row-weighted {name}",
            f"parallel_criterion has no rule for {name}: the loss is the mean of the replicas' losses weighted by "
            f"their rows, which equals {name} on the gathered output only if it is a plain mean over rows "
            f"(rules exist for {', '.join(cls.__name__ for cls in _RULES)} and their functions, "
            f"{', '.join('F.' + function.__name__ for function in _FUNCTIONAL)})",
        )
        per_replica = [_row_weighted_terms(criterion, i, n, loss_dtypes) for i, n in enumerate(rows)]
    else:
        tensors = _criterion_tensors(criterion, rule, outputs[0].dim(), dim, rows, devices)
        per_replica = [_rule_terms(criterion, rule, tensors_i, loss_dtypes) for tensors_i in tensors]
    terms = parallel_apply(per_replica, list(zip(outputs, chunks)), None, devices)
    if reduction == "none":
        # The batch axis of the per-element loss, counted from the right: broadcasting may add
        # leading axes to it. (Class criteria: dim 0, their class axis 1 is gone.)
        return gather(terms, destination, dim=0 if rule.class_targets else dim - outputs[0].dim())
    gathered = gather(terms, destination)
    return gathered.sum() if reduction == "sum" else _ratio(gathered).to(loss_dtypes[0])


def _check_outputs(outputs: Sequence[torch.Tensor], dim: int) -> tuple[int, list[int], list[torch.device]]:
    """``(dim made non-negative, rows per replica, device per replica)``, or an error naming the output."""
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, (list, tuple)) or not outputs:
        raise TypeError(
            "outputs must be a non-empty list of per-replica output tensors, as "
            "DataParallel(..., gather_output=False) returns; for a gathered output call the criterion directly"
        )
    for i, output in enumerate(outputs):
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"outputs[{i}] is a {type(output).__name__}, not a tensor: pass one tensor per replica "
                f"(for models that return several, e.g. [out[0] for out in outputs])"
            )
        if output.dim() != outputs[0].dim():
            raise ValueError(f"outputs[{i}] has {output.dim()} dimensions but outputs[0] has {outputs[0].dim()}")
    if not -outputs[0].dim() <= dim < outputs[0].dim():
        raise IndexError(f"dim={dim} is out of range for outputs of shape {tuple(outputs[0].shape)}")
    dim %= outputs[0].dim()
    rows = [output.shape[dim] for output in outputs]
    for i, n in enumerate(rows):
        if n == 0:
            raise ValueError(f"outputs[{i}] has no rows along dim {dim}: each replica's output holds part of the batch")
    return dim, rows, [output.device for output in outputs]


def _check_target_like_output(criterion: nn.Module, output: torch.Tensor, targets: Any, dim: int, rows: list[int]) -> None:
    """Refuse targets not shaped like the gathered output, before anything is computed. Where torch broadcasts them,
    each replica would broadcast its chunk against its own rows only (an ``(N, 1)`` output and ``(N,)`` targets:
    torch averages ``N x N`` losses, the replicas their diagonal blocks): a different loss, silently."""
    shape = (*output.shape[:dim], sum(rows), *output.shape[dim + 1 :])  # the gathered output's
    if not isinstance(targets, torch.Tensor) or _broadcast_within_rows(targets.shape, shape, dim):
        return
    try:
        broadcast: Optional[tuple[int, ...]] = tuple(torch.broadcast_shapes(targets.shape, shape))
        torch_does = (
            f"torch would broadcast them against it to {broadcast} (with its warning 'This will likely lead to "
            f"incorrect results due to broadcasting'), a loss the replicas' chunks cannot compute"
        )
    except RuntimeError:
        broadcast, torch_does = None, "torch refuses them too (they do not broadcast against it)"
    if targets.numel() == math.prod(shape):
        fix = f"Reshape them to it: targets.view{shape}"
    elif broadcast == shape:
        fix = f"If the broadcast is meant, expand them to it, as torch would: targets.expand{shape}"
    else:
        fix = f"Pass the targets of the whole batch, of shape {shape}"
    raise ValueError(
        f"targets of shape {tuple(targets.shape)} do not match the outputs: {type(criterion).__name__} needs targets "
        f"shaped like the gathered output, {shape}; {torch_does}. {fix}"
    )


def _broadcast_within_rows(target_shape: torch.Size, shape: tuple[int, ...], dim: int) -> bool:
    """Whether targets of ``target_shape`` broadcast to the output's ``shape`` row by row: as many dimensions, the whole
    batch along ``dim`` and the output's shape after broadcasting (``(N, 1)`` targets of an ``(N, 3)`` output), so
    that each replica's chunk broadcasts against its own rows as the whole does against the whole."""
    if len(target_shape) != len(shape) or target_shape[dim] != shape[dim]:
        return False
    try:
        return tuple(torch.broadcast_shapes(target_shape, shape)) == shape
    except RuntimeError:
        return False


def _scatter_targets(targets: Any, devices: list[torch.device], dim: int, rows: list[int]) -> list[Any]:
    """``targets`` cut into ``rows`` along ``dim``, chunk i on ``devices[i]``."""
    if isinstance(targets, torch.Tensor) and (targets.dim() <= dim or targets.shape[dim] != sum(rows)):
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match the outputs: they hold {sum(rows)} rows "
            f"along dim {dim} ({rows} per replica); pass the targets of the whole batch"
        )
    try:
        return list(scatter(targets, devices, dim, chunk_sizes=rows))
    except ValueError as error:
        raise ValueError(f"targets do not split into the outputs' rows {rows} along dim {dim}: {error}") from error


def _criterion_tensors(
    criterion: nn.Module, rule: _Rule, output_dims: int, dim: int, rows: list[int], devices: list[torch.device]
) -> list[dict[str, Optional[torch.Tensor]]]:
    """Per replica, the criterion's weight tensors on its device: cut where they have a batch axis."""
    per_replica: list[dict[str, Optional[torch.Tensor]]] = [{} for _ in devices]
    for name in rule.tensors:
        tensor = getattr(criterion, name)
        if tensor is None:
            pieces = [None] * len(devices)
        else:
            axis = dim - output_dims + tensor.dim()  # broadcasting aligns shapes from the right
            if rule.batched_tensors and 0 <= axis < tensor.dim() and tensor.shape[axis] != 1:
                if tensor.shape[axis] != sum(rows):
                    raise ValueError(
                        f"criterion.{name} of shape {tuple(tensor.shape)} has {tensor.shape[axis]} rows where the "
                        f"batch has {sum(rows)}: it does not broadcast against the output"
                    )
                pieces = list(scatter(tensor, devices, axis, chunk_sizes=rows))
            else:
                pieces = [tensor.to(device) for device in devices]
        for tensors_i, piece in zip(per_replica, pieces):
            tensors_i[name] = piece
    return per_replica


def _summed_in(dtype: torch.dtype) -> torch.dtype:
    """Where a mean's terms are summed: float32 for a half-precision loss, as torch's ``mean`` accumulates it. Its
    numerator may pass the dtype's range (65504 for float16) where the mean does not; summed in float16 it would
    give ``inf`` where torch's loss is finite."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _mean_terms(numerator: torch.Tensor, denominator: Any, loss_dtypes: list[torch.dtype], loss_dtype: torch.dtype) -> torch.Tensor:
    """A replica's ``[numerator, denominator]``, in the numerator's dtype; its loss's dtype noted in ``loss_dtypes``."""
    loss_dtypes.append(loss_dtype)
    dtype = numerator.dtype
    return torch.stack([numerator, torch.as_tensor(denominator, dtype=dtype, device=numerator.device)])


def _rule_terms(criterion: nn.Module, rule: _Rule, tensors: dict, loss_dtypes: list[torch.dtype]) -> Callable[..., torch.Tensor]:
    """One replica's part: its per-element losses (``none``), its numerator (``sum``), or both terms (``mean``)."""

    def terms(output: torch.Tensor, target: Any) -> torch.Tensor:
        per_element = rule.per_element(criterion, output, target, tensors)
        if criterion.reduction == "none":
            return per_element
        if criterion.reduction == "sum":
            return per_element.sum().view(1)  # in the loss's dtype, as torch sums it
        denominator = rule.denominator(criterion, output, target, tensors, per_element)
        return _mean_terms(per_element.sum(dtype=_summed_in(per_element.dtype)), denominator, loss_dtypes, per_element.dtype)

    return terms


def _row_weighted_terms(criterion: Callable, replica: int, rows: int, loss_dtypes: list[torch.dtype]) -> Callable[..., torch.Tensor]:
    """One replica's ``[rows * loss, rows]`` for a criterion without a rule."""

    def terms(output: torch.Tensor, target: Any) -> torch.Tensor:
        loss = criterion(output, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"criterion returned {shape} for replica {replica}: parallel_criterion needs a 0-dim loss "
                f"per replica from a criterion it has no rule for"
            )
        return _mean_terms(loss.to(_summed_in(loss.dtype)) * rows, rows, loss_dtypes, loss.dtype)

    return terms


def _ratio(gathered: torch.Tensor) -> torch.Tensor:
    """``[num_0, den_0, num_1, den_1, ...]`` -> ``sum(num) / sum(den)``."""
    numerator, denominator = gathered.view(-1, 2).sum(0)
    return numerator / denominator


def _warn_once(key: str, message: str) -> None:
    """``message`` as a warning at parallel_criterion's caller, the first time ``key`` comes (once per criterion type)."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=3)
