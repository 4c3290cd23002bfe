"""The bucket plan: which gradients share one all-reduce, decided exactly as torch DDP decides it.

DDP does not all-reduce gradients one by one. It copies them into a few flat *buckets* and
all-reduces a bucket as soon as the last gradient in it has arrived, so communication overlaps the
rest of the backward. Which parameters share a bucket is the *plan*: a list of buckets, each a list
of parameter indices (positions among the parameters that require grad, in registration order).
The rules, with the torch 2.13 source they follow:

1. **Assignment** (``reducer.cpp``, ``compute_bucket_assignment_by_size``): walk the tensors in
   the given order, keeping one open bucket per (dtype, device). Add the tensor's index and bytes
   to its bucket; once the bucket's bytes *reach* its limit (``size >= limit``), close it (so a
   bucket may overshoot its limit by most of one tensor) and move that (dtype, device) on to the
   next limit in the list, staying on the last one. Open buckets are closed at the end. When the
   order is the registration order, buckets are sorted by their smallest index.
2. **Limits** (``distributed.py``, ``_BucketCapacityConfig``): ``bucket_cap_mb=None`` means a cap
   of 25 MiB with a first bucket of ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB); an explicit
   ``bucket_cap_mb`` gives ``int(bucket_cap_mb * 2**20)`` bytes for every bucket, the first too;
   ``bucket_cap_mb_list`` (torch 2.13) gives bucket k its own limit, in the first plan and the rebuilt one. A
   negative ``bucket_cap_mb`` (``-1``) is kept as given (DDP's ``bucket_bytes_cap``, its logging data) and is no limit
   where the reducer plans (reducer.cpp casts it to an unsigned size): one bucket per dtype. The first plan with
   ``find_unused_parameters`` hands it to ``_compute_bucket_assignment_by_size``, which refuses a negative size: so
   does :meth:`BucketCaps.check_first_plan`.
3. **The first backward's plan** (``_BucketCapacityConfig.compute_bucket_size_limits`` and
   ``_ddp_init_helper``): with ``find_unused_parameters=False`` (or ``static_graph``) the only limit
   is ``sys.maxsize``, so every parameter shares one bucket, in registration order: the registration
   order need not be the order gradients arrive in, so DDP does not guess. With
   ``find_unused_parameters=True`` the limits are ``[first, cap]`` (``[cap]`` when they are equal);
   with ``bucket_cap_mb_list``, that list whatever the other arguments.
   Then the list of buckets is reversed (``list(reversed(bucket_indices))``): the parameters
   registered last, whose gradients come first, are in bucket 0.
4. **The rebuild** (``reducer.cpp``, ``rebuild_buckets``): after the first backward that reduced
   gradients, and only when ``find_unused_parameters=False``, the plan is made again from the
   order the gradients actually arrived in, with limits ``[first, cap]``, not sorted; rank 0's plan
   is the one every rank uses (``sync_bucket_indices``). It is never rebuilt again.

One detail torch leaves to its C++ library: when parameters of several dtypes are rebuilt, the order of
the buckets still open at the end follows a hash map (an ``unordered_map``), which lists the last (dtype, device)
first met first; so does :func:`assign_buckets`.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # torch/nn/parallel/distributed.py: _DEFAULT_BUCKET_CAP_MB
NO_LIMIT = sys.maxsize


@dataclass(frozen=True)
class BucketCaps:
    """The byte limits of a plan: ``first`` for bucket 0 of a rebuilt plan, ``cap`` for the rest; or, when the
    user gave one per bucket (``bucket_cap_mb_list``), ``per_bucket``: bucket k's limit, the last one repeated."""

    first: int
    cap: int
    per_bucket: tuple[int, ...] = ()

    @classmethod
    def from_mb(cls, bucket_cap_mb: Optional[float], bucket_cap_mb_list: Optional[Sequence[float]] = None) -> "BucketCaps":
        """From DDP's arguments (``_BucketCapacityConfig.create``); ``bucket_cap_mb_list`` overrides ``bucket_cap_mb``."""
        if bucket_cap_mb_list:
            if not isinstance(bucket_cap_mb_list, (list, tuple)):  # a string would be read digit by digit
                raise TypeError(f"bucket_cap_mb_list must be a list of sizes in MiB, one per bucket (e.g. [1, 25]), "
                                f"got {bucket_cap_mb_list!r} of type {type(bucket_cap_mb_list).__name__}")
            for position, mb in enumerate(bucket_cap_mb_list):
                _check_mb(mb, f"bucket_cap_mb_list[{position}]")
            per_bucket = tuple(int(mb * MIB) for mb in bucket_cap_mb_list)
            cap = int(max(bucket_cap_mb_list) * MIB)
            return cls(first=cap, cap=cap, per_bucket=per_bucket)
        if bucket_cap_mb is None:
            return cls(first=dist._DEFAULT_FIRST_BUCKET_BYTES, cap=DEFAULT_BUCKET_CAP_MB * MIB)
        _check_mb(bucket_cap_mb, "bucket_cap_mb", negative_is_no_limit=True)
        cap = int(bucket_cap_mb * MIB)
        return cls(first=cap, cap=cap)

    def limits(self) -> list[int]:
        """The limits of a rebuilt plan: ``per_bucket`` if given, else ``[first, cap]`` (``[cap]`` when the first
        bucket is not smaller); a negative cap is no limit, as reducer.cpp reads it (an unsigned size)."""
        if self.per_bucket:
            return list(self.per_bucket)
        return [self.first, self.cap] if self.first < self.cap else [NO_LIMIT if self.cap < 0 else self.cap]

    def check_first_plan(self, find_unused_parameters: bool) -> None:
        """Raise where the first plan would be made with a negative cap (``find_unused_parameters`` without a static
        graph), which torch's DDP refuses at construction: its ``_compute_bucket_assignment_by_size`` takes sizes."""
        if find_unused_parameters and self.cap < 0:
            raise ValueError(
                f"bucket_cap_mb must be 0 or more with find_unused_parameters=True (torch's DDP refuses a negative "
                f"one there too), got {self.cap / MIB:g}: give a size in MiB (a model's size or more makes one bucket)")


def _check_mb(mb: object, argument: str, negative_is_no_limit: bool = False) -> None:
    """Raise unless ``mb`` is a size in MiB a plan can use: a real number (``TypeError``), finite and 0 or more
    (``ValueError``), or, with ``negative_is_no_limit``, negative too (``bucket_cap_mb=-1``, which torch's DDP takes
    as no limit: rule 2). 0 is torch's too: every bucket closes at its first parameter. A negative size in a list,
    which torch's plan refuses (``TypeError``), is refused here; so is an infinite one, which torch fails to convert to
    bytes (``OverflowError``)."""
    if isinstance(mb, bool) or not isinstance(mb, numbers.Real):
        raise TypeError(f"{argument} must be a number of MiB (an int or a float, e.g. 25), got {mb!r} of type "
                        f"{type(mb).__name__}")
    if math.isnan(mb) or (mb < 0 and not negative_is_no_limit):
        raise ValueError(f"{argument} must be 0 or more, got {mb}")
    if not math.isfinite(mb):
        raise ValueError(f"{argument} must be finite, got {mb}: give a size in MiB (a model's size or more makes one "
                         f"bucket)")


def assign_buckets(
    tensors: Sequence[torch.Tensor], limits: Sequence[int], indices: Optional[Sequence[int]] = None,
    sparse: Optional[Sequence[bool]] = None,
) -> list[list[int]]:
    """Rule 1: group ``tensors`` into buckets of at least ``limits[k]`` bytes (k: that dtype's k-th bucket).

    ``indices[i]`` is the index recorded for ``tensors[i]`` (default ``i``). Without ``indices`` the
    buckets are sorted by their smallest index; with them (a rebuild, tensors in arrival order) they
    keep the order in which they closed. ``sparse[i]``: ``tensors[i]`` gets sparse gradients, so a
    bucket of its own, closed at once (sparse gradients are not flattened together).
    """
    in_registration_order = indices is None
    indices = list(range(len(tensors))) if indices is None else list(indices)
    sparse = [False] * len(tensors) if sparse is None else list(sparse)
    closed: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}  # key -> (indices, bytes)
    next_limit: dict[tuple[torch.dtype, torch.device], int] = {}  # key -> position in limits
    for index, tensor, alone in zip(indices, tensors, sparse):
        if alone:
            closed.append([index])
            continue
        key = (tensor.dtype, tensor.device)
        members, size = open_buckets.get(key, ([], 0))
        members.append(index)
        size += tensor.numel() * tensor.element_size()
        position = next_limit.setdefault(key, 0)
        if size >= limits[position]:
            closed.append(members)
            members, size = [], 0
            next_limit[key] = min(position + 1, len(limits) - 1)
        open_buckets[key] = (members, size)
    # The buckets still open come last, as torch's plan takes them from its hash table of them (an unordered_map in
    # reducer.cpp): the last dtype first met, first. Sorted below where the tensors come in registration order.
    closed.extend(members for members, _ in reversed(open_buckets.values()) if members)
    if in_registration_order:
        closed.sort(key=min)
    return closed


def initial_plan(
    params: Sequence[torch.Tensor], caps: BucketCaps, find_unused_parameters: bool, sparse: Optional[Sequence[bool]] = None
) -> list[list[int]]:
    """Rule 3: the plan of the first backward, buckets in the order they are reduced."""
    limits = caps.limits() if find_unused_parameters or caps.per_bucket else [NO_LIMIT]
    return list(reversed(assign_buckets(params, limits, sparse=sparse)))


def rebuilt_plan(
    params: Sequence[torch.Tensor], arrival_order: Sequence[int], caps: BucketCaps, sparse: Optional[Sequence[bool]] = None
) -> list[list[int]]:
    """Rule 4: the plan made from the order the gradients of ``params`` arrived in."""
    in_order = None if sparse is None else [sparse[i] for i in arrival_order]
    return assign_buckets([params[i] for i in arrival_order], caps.limits(), arrival_order, in_order)


def _dense_strides(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill its storage span without gaps or overlaps (any dimension order)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@dataclass(eq=False)
class Bucket:
    """One flat gradient buffer and, for each of its parameters, a view of it shaped like the parameter.

    A view has the parameter's strides when the parameter is dense (so a channels-last weight's
    gradient copies in without a transpose), else it is row-major: the layout autograd gives gradients
    (reducer.cpp, ``initialize_bucket_views``). ``pending`` counts the gradients still to arrive in
    this backward; ``future`` is the all-reduce in flight. A ``sparse`` bucket holds one parameter and
    no flat buffer: its ``buffer`` is the parameter's sparse gradient once it arrives.
    """

    index: int
    indices: list[int]
    params: list[torch.Tensor]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    pending: int = 0
    future: Optional[torch.futures.Future] = None
    sparse: bool = False

    @classmethod
    def allocate(
        cls, index: int, indices: list[int], params: Sequence[torch.Tensor], sparse: bool = False,
        dtype: Optional[torch.dtype] = None,
    ) -> "Bucket":
        """The bucket of ``params[i]`` for ``i`` in ``indices``; its buffer in their dtype, or ``dtype`` (DDP's mixed
        precision: the gradients arrive in a lower precision than the parameters have between iterations)."""
        members = [params[i] for i in indices]
        if sparse:
            return cls(index, list(indices), members, torch.empty(0, dtype=members[0].dtype), [], sparse=True)
        first = members[0]
        for i, p in zip(indices, members):
            if (p.dtype, p.device) != (first.dtype, first.device):
                raise ValueError(
                    f"bucket {index} mixes parameter {indices[0]} ({first.dtype} on {first.device}) with "
                    f"parameter {i} ({p.dtype} on {p.device}): a bucket holds one dtype on one device"
                )
        buffer = torch.empty(sum(p.numel() for p in members), dtype=dtype or first.dtype, device=first.device)
        return cls(index, list(indices), members, buffer, views_of(buffer, members))


def views_of(flat: torch.Tensor, params: Sequence[torch.Tensor], own_strides: bool = True) -> list[torch.Tensor]:
    """One view of ``flat`` per parameter, laid end to end in order: with the parameter's strides where it is dense
    (see :class:`Bucket`), or, without ``own_strides``, row-major (:meth:`GradBucket.gradients`)."""
    views, offset = [], 0
    for p in params:
        if own_strides and _dense_strides(p):
            views.append(flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset))
        else:
            views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def as_real(flat: torch.Tensor) -> torch.Tensor:
    """A bucket's flat buffer as its all-reduce and a communication hook see it: torch's reducer keeps a complex
    bucket complex (its views shaped like the parameters) and communicates it viewed as real, twice the elements
    (``view_as_real``, sharing the storage); any other buffer as it is."""
    return torch.view_as_real(flat).flatten() if flat.is_complex() else flat


class GradBucket:
    """What a communication hook receives: the Python face of ``torch.distributed.GradBucket``.

    ``buffer()`` is the bucket's flat gradient tensor (not divided by the world size when a hook is
    registered), real for complex parameters as torch gives it (:func:`as_real`); the hook returns a
    ``torch.futures.Future`` whose value is the reduced tensor, the same size or longer (its first elements are
    read). The methods are the ones stock hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
    PowerSGD) call.
    """

    def __init__(self, bucket: Bucket, bucket_count: int, index: Optional[int] = None) -> None:
        """``index``: the index the hook is told, where it is not the bucket's own (a static graph's first backward)."""
        self._bucket = bucket
        self._buffer = as_real(bucket.buffer)
        self._index = bucket.index if index is None else index
        self._is_last = self._index == bucket_count - 1

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """Row-major views of ``buffer()``, one per parameter at its offset, shaped like it (a sparse bucket: its one
        gradient), as torch's ``GradBucket::getGradients`` gives them (``buffer.slice(offset, offset + numel).view(
        sizes)``). Not the bucket's own views: a channels-last or transposed parameter's gradient lies in the bucket
        in the parameter's memory order, which these read row-major, as torch's do; hooks rely on the layout (PowerSGD
        views each as a matrix with ``view``). For complex parameters these are real views of the real buffer at the
        parameters' offsets and shapes, as torch gives them (not the parameters' gradients viewed as real)."""
        return [self._buffer] if self._bucket.sparse else views_of(self._buffer, self._bucket.params, own_strides=False)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last
