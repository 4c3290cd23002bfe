"""SyncBatchNorm: BatchNorm whose batch statistics are those of the whole batch, across replicas.

Under data parallelism each replica of ``nn.BatchNorm*`` normalises its chunk by the chunk's own
mean and variance, and only replica 0's running statistics survive the step. ``SyncBatchNorm``
makes the replicas of one :func:`minidp.parallel_apply` call (one ``DataParallel`` step) compute
what ``nn.BatchNorm`` computes on the full batch:

1. each replica reduces its chunk to per-channel ``(count, mean, biased variance)``;
2. the replicas meet (:mod:`minidp.replica_group`) and each receives every replica's statistics;
3. each combines them, in replica order, into the global mean and variance (Chan et al.'s
   pairwise formula: counts may differ) and normalises its chunk with them;
4. replica 0, which holds the original module's buffers, updates the running statistics once,
   with the global mean and unbiased variance, and counts the batch once.

What moves: per replica and layer, two vectors of ``num_features`` values to every other replica
(``.to(device)``; nothing on the CPU), in float64 whatever the input's dtype, as BatchNorm's CPU kernel
sums in float64. What autograd records: per replica, one node for its chunk's statistics
(:class:`_ChunkMoments`) and one for the normalisation (:class:`_Normalise`), each computed and
differentiated as BatchNorm's CPU kernel does (deviations from the mean first, so that float32 keeps
BatchNorm's accuracy where the mean is large against the spread); the moves and the combination are
ordinary differentiable ops, so each replica's output depends on every replica's input through the
global statistics. The backward needs no meeting of its own: autograd
follows those edges across replicas and sums, for each input, the gradients reaching it through
its own output and through the statistics of all the others, which is the backward of BatchNorm
on the whole batch. (It could not meet anyway: on the CPU, autograd runs the backward of every
replica in one thread.)

Across processes (``minidp.distributed.DistributedDataParallel``, with or without several replicas per
process): the wrapper gives each layer an *exchange* (``across_processes``), a differentiable collective
that turns this process's list of replica statistics into every process's, in rank order. Replica 0 of
each process calls it once per layer and step, and hands the result to its replicas at a second
meeting; every replica then combines the statistics of every replica of every process, in (rank,
replica) order: the statistics of the global batch. The core never imports ``torch.distributed``: the
exchange is a callable it is given.

Inside a nested call (a ``data_parallel`` in the forward of a replica of another call), the inner call's replica 0
takes its group's statistics one level up the same way: it meets the outer call's replicas (their group is the inner
group's ``outer``), and hands what comes back to its own replicas, so that every chunk of every level counts, in the
batch's order. (:meth:`SyncBatchNorm._everyone` walks the levels, processes last.)

When nothing is synchronised, a call is exactly ``nn.BatchNorm``'s: outside parallel_apply, with
one replica, and whenever ``F.batch_norm`` would use the running statistics rather than the batch's
(eval mode with running statistics). A layer that met other replicas is refused when activation checkpointing
recomputes it in the backward: it would run alone there. Eval mode without running statistics normalises by batch
statistics, so there the replicas of one process do meet, and the result is that process's full batch's;
processes exchange statistics in training only, as ``torch.nn.SyncBatchNorm`` synchronises in training
only.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from . import replica_group
from .replica_group import Membership
from .torch_versions import BATCHNORM_TAKES_BIAS


# Set in a layer's __dict__ when it met other replicas in a forward. Recomputed in the backward (activation
# checkpointing), such a layer runs outside parallel_apply, alone: it would normalise its chunk by the chunk's
# statistics, and its gradients would miss the other replicas' (the edges a recomputation makes stay inside the
# replica). Refused there. A mark on the layer, not a weak set of layers: a weak reference to a replica module tells
# the replica cache that something outside it keeps the replica (minidp.replica_cache), and a replica's __dict__ is
# what the cache resets at each call.
_MET_REPLICAS = "_minidp_met_replicas"


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm1d/2d/3d`` for inputs of any rank ``>= 2`` (``(N, C, *)``), synchronised across the
    replicas of a DataParallel step. Arguments as ``torch.nn.SyncBatchNorm``'s (``momentum=None``: a
    cumulative average). ``process_group``: the processes whose statistics this layer combines inside
    ``minidp.distributed.DistributedDataParallel`` (None: the wrapper's group); a process outside it normalises
    by its own batch, as torch's layer does there.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        *,
        bias: bool = True,
    ) -> None:
        if BATCHNORM_TAKES_BIAS:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        elif not bias:
            raise TypeError(
                f"SyncBatchNorm(bias=False) needs torch 2.12 or newer, where nn.BatchNorm takes `bias`; this is torch "
                f"{torch.__version__}. Upgrade torch, or keep the bias (bias=True) and freeze it (requires_grad_(False))"
            )
        else:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        # What this layer's replicas meet at: a plain attribute, so every replica (a shallow copy of
        # this module) shares this very object, while a deepcopy or another layer gets its own.
        self._meeting_key = object()
        self.process_group = process_group
        # Set by minidp.distributed's wrapper: this process's replicas' statistics -> every process's
        # (a collective). Not pickled: it holds a process group; the wrapper sets it again.
        self.across_processes: Optional[Callable[[list[_Statistics]], list[_Statistics]]] = None
        self.exchange_attached = False  # whether a wrapper decided across_processes (None: nothing to exchange)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["across_processes"], state["exchange_attached"] = None, False  # a copy (an EMA teacher) is no wrapper's
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("exchange_attached", False)  # pickled before the attribute was

    def _check_input_dim(self, input: torch.Tensor) -> None:
        """torch.nn.SyncBatchNorm's checks, in its words: at least 2D, and at least one channel (a 0-channel input
        would otherwise run as an empty BatchNorm and count a batch)."""
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        membership = replica_group.current()
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        alone = membership is None or (membership.count == 1 and membership.group.outer is None)
        # Processes exchange statistics in training only, as torch.nn.SyncBatchNorm does: in eval mode a rank
        # may run batches the others do not run (inference on rank 0 alone), and would wait for them forever.
        exchange = self.across_processes if self.training else None
        if (exchange is None and self.training and membership is None and not self.exchange_attached
                and lone_exchange is not None):
            # No wrapper gave this layer an exchange (a copy of a wrapped model, an EMA teacher; a model never
            # wrapped): torch's SyncBatchNorm synchronises whenever it trains in a job, whatever wraps it. Not in a
            # replica (a DataParallel in each process): one whose batch made a single chunk would exchange where
            # the other processes' replicas, meeting each other, do not.
            exchange = lone_exchange(self.process_group)
        if alone and batch_statistics and torch._C._current_graph_task_id() == -1:
            self.__dict__.pop(_MET_REPLICAS, None)  # a forward of its own: what a backward recomputes now ran alone
        elif alone and batch_statistics and _MET_REPLICAS in self.__dict__:
            raise RuntimeError(
                "SyncBatchNorm: a layer that met other replicas in the forward is run again in the backward, alone "
                "(activation checkpointing recomputes it): it would normalise its chunk by the chunk's own statistics "
                "and give wrong gradients. Leave the SyncBatchNorm out of the checkpointed function (checkpoint the "
                "layers around it), or put an nn.BatchNorm there"
            )
        if (alone and exchange is None) or not batch_statistics:
            return super().forward(input)
        if not alone:
            self.__dict__[_MET_REPLICAS] = True
        return self._synchronised_forward(input, None if alone else membership, exchange)

    def _synchronised_forward(
        self, input: torch.Tensor, membership: Optional[Membership],
        exchange: Optional[Callable[[list[_Statistics]], list[_Statistics]]],
    ) -> torch.Tensor:
        """Normalise ``input`` (this replica's chunk) by the statistics of every replica's chunk (of
        every process's, through ``exchange``); ``membership`` None: this process's only replica."""
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm(num_features={self.num_features}) got an input with {input.size(1)} channels "
                f"(dim 1 of shape {tuple(input.shape)}); give it {self.num_features} channels"
            )
        index = 0 if membership is None else membership.index
        mean, variance, total = _combine(self._everyone([_chunk_statistics(input)], membership, exchange), input.device)

        if index == 0 and self.training and self.track_running_stats:
            self._update_running_statistics(mean, variance, total)
        output = _Normalise.apply(input, mean, torch.rsqrt(variance + self.eps), self.weight, self.bias)
        # Laid out as BatchNorm lays out its output: the elementwise ops keep a transposed input's strides, where
        # BatchNorm's output is contiguous (or channels-last, for a channels-last input), and a model that views it
        # (y.view(n, -1)) would work on one device and fail on the replicas.
        layout = _batch_norm_layout(input)
        return output if output.is_contiguous(memory_format=layout) else output.contiguous(memory_format=layout)

    def _everyone(
        self, statistics: list[_Statistics], membership: Optional[Membership],
        exchange: Optional[Callable[[list[_Statistics]], list[_Statistics]]], depth: int = 0,
    ) -> list[_Statistics]:
        """The statistics of every chunk of the batch, in order, from ``statistics`` (this replica's): its group's
        replicas meet; where the group runs inside a replica of another call (a nested data_parallel) or beside other
        processes (``exchange``), its replica 0 takes the group's statistics there, one level up at a time, and hands
        back what comes back: one meeting a level, one collective a process."""
        if membership is None:
            return statistics if exchange is None else exchange(statistics)
        index, _, group = membership
        key = self._meeting_key if depth == 0 else (self._meeting_key, "nested", depth)
        everyone = [chunk for part in group.meet(index, key, statistics, where=self) for chunk in part]
        if group.outer is None and exchange is None:
            return everyone
        wider = self._everyone(everyone, group.outer, exchange, depth + 1) if index == 0 else None
        return group.meet(index, (key, "wider"), wider, where=self)[0]

    @torch.no_grad()
    def _update_running_statistics(self, mean: torch.Tensor, variance: torch.Tensor, total: int) -> None:
        """What ``nn.BatchNorm`` does to its buffers in training, with the whole batch's statistics."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        if total == 0:  # BatchNorm counts an empty batch and leaves its statistics (its kernel returns at once)
            return
        if self.running_mean is not None:
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        if self.running_var is not None:  # the unbiased variance, as BatchNorm keeps
            unbiased = variance * (total / (total - 1))
            self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """Replace every ``nn.BatchNorm*`` in ``module`` (itself included) by a ``SyncBatchNorm`` over ``process_group``.

        As ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: the new layers take the old ones'
        parameter objects (so their ``requires_grad``, and an optimizer holding them, carry over),
        buffers and ``training`` flag. Returns the converted module; sub-modules are replaced in place.
        """
        converted = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            # A SyncBatchNorm (torch's, or this class's) is converted again, as torch's converter does: the new layer
            # takes the new process_group. Their forwards only normalise: nothing of theirs is lost.
            if type(module).forward not in (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward, cls.forward):
                # torch's converter replaces such a layer as silently: timm's BatchNormAct2d (normalisation, then its
                # `act` and `drop` children) keeps its children but never calls them, and a ReLU net goes negative.
                warnings.warn(
                    f"convert_sync_batchnorm: {type(module).__name__} is a BatchNorm with a forward of its own; the "
                    f"SyncBatchNorm that replaces it only normalises (its children "
                    f"{[name for name, _ in module.named_children()]} stay but are not called, as with "
                    f"torch.nn.SyncBatchNorm.convert_sync_batchnorm). Convert such a model with its library's own "
                    f"converter if it has one (timm: timm.layers.convert_sync_batchnorm), or leave the layer as it is.",
                    UserWarning, stacklevel=2,
                )
            # Without affine there is no bias either way: bias=True then, which every torch takes (2.11 has no option).
            converted = cls(
                module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                process_group, bias=module.bias is not None or not module.affine,
            )
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


class _Statistics(NamedTuple):
    """One chunk's per-channel statistics, as a replica deposits them at the meeting."""

    count: int
    mean: torch.Tensor
    variance: torch.Tensor  # biased
    ready: Optional["torch.cuda.Event"]  # on a GPU: recorded once mean and variance are computed


# Set by minidp.distributed when it is imported, as the package imports it: the exchange of a layer no wrapper attached
# one to, running alone in its process (over its process_group, else the job's default group; None outside a job of
# several processes). The layer's own module never imports torch.distributed.
lone_exchange: Optional[Callable[[Any], Optional[Callable[[list[_Statistics]], list[_Statistics]]]]] = None


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    """The shape that broadcasts a per-channel vector over ``x`` (N, C, *): (1, C, 1, ...)."""
    return (1, -1) + (1,) * (x.dim() - 2)


def _batch_norm_layout(x: torch.Tensor) -> torch.memory_format:
    """The memory format of BatchNorm's output for input ``x``: channels-last where ``x`` is (and not plainly
    contiguous), else contiguous."""
    if not x.is_contiguous():
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
    return torch.contiguous_format


def _other_dims(x: torch.Tensor) -> list[int]:
    """Every dimension of ``x`` but the channels: what the per-channel statistics reduce over."""
    return [0, *range(2, x.dim())]


def _working_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the per-element arithmetic over ``x`` runs in: float32 at least (half inputs), as BatchNorm's."""
    return torch.promote_types(x.dtype, torch.float32)


class _ChunkMoments(torch.autograd.Function):
    """Per channel of ``x``: its mean and biased variance, in float64.

    Two passes, the mean and then the mean squared deviation from it, which stays exact where
    E[x^2] - E[x]^2 would cancel; both in the working dtype (float64 only for float64 inputs: a float32
    sum in float64 would cast the whole chunk). The results, per-channel vectors, are float64, as the
    sums of BatchNorm's CPU kernel are: combined across chunks (whose means carry in the squared
    distance between them, :func:`_combine`), statistics rounded to float32 would be hundreds of times
    less exact than BatchNorm's where the mean is large against the spread.

    The backward is one multiply-add over ``x - mean``: d mean/dx = 1/n and d var/dx = 2 (x - mean)/n,
    so grad_x = (x - mean) * (2 g_var/n) + g_mean/n (the deviation first, as BatchNorm's kernel computes
    it: x * slope - mean * slope would cancel where the mean is large against the spread). Written in
    differentiable ops of ``x`` and the ``mean`` output, so double backward works too.

    Why a Function of its own: autograd's backward of the same two passes in plain ops takes
    several passes and temporaries, and ``torch.var_mean`` over the non-channel dimensions is
    slower still on the CPU (``python benchmarks/bench_syncbn.py`` times all three).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dims = _other_dims(x)
        first_mean = x.mean(dims, dtype=_working_dtype(x))
        deviation = x - first_mean.view(_channel_shape(x))
        # The corrected two-pass algorithm (Chan, Golub and LeVeque): the deviations' own mean is first_mean's
        # rounding error, to the deviations' far finer rounding; added back in float64, it leaves the mean as exact
        # as BatchNorm's float64 sum, and comes off the variance squared.
        correction = deviation.mean(dims).double()
        mean = first_mean.double() + correction
        variance = deviation.square_().mean(dims).double() - correction.square()
        ctx.save_for_backward(x, mean)
        return mean, variance

    @staticmethod
    def backward(ctx, grad_mean: torch.Tensor, grad_variance: torch.Tensor) -> torch.Tensor:
        x, mean = ctx.saved_tensors
        n, shape, working = x.numel() // x.size(1), _channel_shape(x), _working_dtype(x)
        slope = (grad_variance * (2 / n)).to(working)
        deviation = x - mean.to(working).view(shape)
        grad = torch.addcmul((grad_mean / n).to(working).view(shape), deviation, slope.view(shape))
        return grad.to(x.dtype)


class _Normalise(torch.autograd.Function):
    """``(x - mean) * inverse_std * weight + bias``, per channel of ``x``, computed and differentiated as
    BatchNorm's CPU kernel does it (``mean`` and ``inverse_std`` in float64, :class:`_ChunkMoments`).

    Forward: one multiply-add over ``x``, ``x * scale + shift`` with scale = weight * inverse_std and
    shift = bias - mean * scale, each rounded once to the working dtype. Backward: the per-channel sums of ``dy``
    and of ``dy * (x - mean)`` (the deviation first), from which the gradients of the statistics, the weight and
    the bias follow: autograd's backward of the multiply-add would take ``sum(dy * x)`` and ``mean * sum(dy)``
    apart, which cancel where the mean is large against the spread (float32 gradients 5 to 10 times BatchNorm's
    error at a mean 1000 times the spread). The gradients of ``mean`` and ``inverse_std`` flow on to every
    replica's statistics. Written in differentiable ops, so double backward works too.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, mean: torch.Tensor, inverse_std: torch.Tensor,
                weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, mean, inverse_std, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        # Each multiply-add rounded once, as BatchNorm's kernel computes them (fused multiply-adds): scale and shift
        # in float64, the output through addcmul. A multiply and an add, each rounded, were 2 to 3 times
        # BatchNorm's float32 error where the mean is large against the spread.
        scale = inverse_std if weight is None else weight * inverse_std
        shift = -mean * scale if bias is None else bias - mean * scale
        shape, working = _channel_shape(x), _working_dtype(x)
        # In float32 for half inputs, rounded once to their dtype, as BatchNorm's kernel computes it. Rounded to the
        # input's dtype first, scale and shift (large, of opposite signs where the mean is) would cancel: up to 19
        # units of rounding off, where BatchNorm's error stays at 1 or 2.
        output = torch.addcmul(shift.to(working).view(shape), x, scale.to(working).view(shape))
        return output.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, mean, inverse_std, weight = ctx.saved_tensors
        needs_x, needs_mean, needs_inverse_std, needs_weight, needs_bias = ctx.needs_input_grad
        shape, dims, working = _channel_shape(x), _other_dims(x), _working_dtype(x)
        scale = inverse_std if weight is None else weight * inverse_std
        grad_x = grad_mean = grad_inverse_std = grad_weight = grad_bias = None
        if needs_x:
            grad_x = (grad_output * scale.to(working).view(shape)).to(x.dtype)
        if needs_mean or needs_bias:
            sum_dy = grad_output.sum(dims, dtype=working).double()
            grad_mean = -sum_dy * scale if needs_mean else None
            grad_bias = sum_dy.to(ctx.bias_dtype) if needs_bias else None
        if needs_inverse_std or needs_weight:
            dot = (grad_output * (x - mean.to(working).view(shape))).sum(dims, dtype=working).double()
            grad_inverse_std = (dot if weight is None else dot * weight) if needs_inverse_std else None
            grad_weight = (dot * inverse_std).to(weight.dtype) if needs_weight else None
        return grad_x, grad_mean, grad_inverse_std, grad_weight, grad_bias


def _chunk_statistics(input: torch.Tensor) -> _Statistics:
    """This chunk's per-channel statistics, in float64 (:class:`_ChunkMoments`)."""
    count = input.numel() // input.size(1)
    if count == 0:  # no rows: it weighs nothing in the combination (the mean of nothing would be NaN)
        mean = variance = input.new_zeros(input.size(1), dtype=torch.float64)
    else:
        mean, variance = _ChunkMoments.apply(input)
    ready = None
    if input.is_cuda:  # the others read these on their own streams: tell them when they are written
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(input.device))
    return _Statistics(count, mean, variance, ready)


def _fetch(tensor: torch.Tensor, ready: Optional["torch.cuda.Event"], device: torch.device) -> torch.Tensor:
    """Another replica's ``tensor`` on ``device``, read on this thread's streams once it is written."""
    if ready is not None:
        stream = torch.cuda.current_stream(tensor.device)  # where this thread reads (or copies) it
        stream.wait_event(ready)
        tensor.record_stream(stream)  # its memory is not reused before that read is done
    return tensor.to(device)


def _combine(everyone: list[_Statistics], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The whole batch's per-channel mean, biased variance and count, on ``device``.

    Chan et al.'s combination of chunks: mean = sum(n_j mean_j) / N, variance =
    sum(n_j (var_j + (mean_j - mean)^2)) / N, in float64 (the chunks' statistics are). Every replica runs it
    on the same values in the same order, so they all get the same statistics.
    """
    total = sum(chunk.count for chunk in everyone)
    if total == 1:
        raise ValueError("Expected more than 1 value per channel when training, got 1 across all replicas")
    if total == 0:  # no rows anywhere: an empty output, as BatchNorm gives; the chunks' zeros stand for the statistics
        return everyone[0].mean.to(device), everyone[0].variance.to(device), 0
    means = torch.stack([_fetch(chunk.mean, chunk.ready, device) for chunk in everyone])
    variances = torch.stack([_fetch(chunk.variance, chunk.ready, device) for chunk in everyone])
    weights = torch.tensor([chunk.count / total for chunk in everyone], dtype=means.dtype, device=device)[:, None]
    mean = (weights * means).sum(0)
    variance = (weights * (variances + (means - mean) ** 2)).sum(0)
    return mean, variance, total
