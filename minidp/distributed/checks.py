"""What DDP checks and learns about the model at construction: the same model on every rank (an error on
one rank raised on all), the parameters to reduce, which of them have sparse gradients.

torch DDP checks the parameters' count, shapes and strides against rank 0's
(``_verify_param_shape_across_processes``), and only the rank that differs learns why: the others
see their next collective fail ("Connection closed by peer"); it compares no names (same-shaped parameters
registered in another order train silently wrong, rank 0's values broadcast by position) and no settings (a
``find_unused_parameters`` or ``static_graph`` on one rank only hangs or crashes the backward). Here every rank
describes its parameters (name, shape, stride, dtype, whether it is reduced) and buffers, and the settings its
reducer must share with the others, every rank receives every description (``all_gather_object``, one
collective), and every rank raises the same error, naming the first difference.

An error that only some ranks meet (a bad argument on one rank, an optimizer step that fails on
one rank) would leave the others waiting in their next collective for a rank that has left it:
:func:`raise_on_every_rank` is a meeting point where every rank learns whether any failed.
"""

from __future__ import annotations

import builtins
import contextlib
import sys
from typing import Any, Callable, Iterable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..device_ids import check_device_list, parse_device
from .groups import backend_of, rank_in, size_of


class TensorSpec(NamedTuple):
    kind: str  # "parameter" or "buffer"
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    reduced: bool = True  # a parameter the reducer reduces (it requires grad): every rank's reducer needs the same


# Where torch DDP finds the names of what it leaves alone (``_set_params_and_buffers_to_ignore_for_model`` sets it).
IGNORED_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


def ignored_names(module: nn.Module) -> frozenset[str]:
    """The names of the parameters and buffers DDP leaves alone, read once, when DDP wraps the module, as torch
    reads it. Broadcasts and checks match them against ``named_parameters()``/``named_buffers()`` names; the reducer
    matches them as torch's does (:func:`reducer_candidates`), so that a root parameter or a tied one's second name
    escapes them."""
    return frozenset(getattr(module, IGNORED_ATTRIBUTE, ()))


def synced_tensors(module: nn.Module, ignored: frozenset[str], buffers: bool) -> list[torch.Tensor]:
    """The parameters, then (if ``buffers``) the buffers, that DDP copies from one rank to all: those not ignored.
    Looked up at each call: a module may replace its buffers between forwards."""
    tensors = [p for n, p in module.named_parameters() if n not in ignored]
    if buffers:
        tensors += [b for n, b in module.named_buffers() if n not in ignored]
    return tensors


def describe(
    module: nn.Module, buffers: bool, ignored: frozenset[str] = frozenset(), reduced: Iterable[torch.Tensor] = ()
) -> list[TensorSpec]:
    """What must match across ranks: every parameter not ignored or ``reduced`` (torch checks those the reducer
    gets), whether it is ``reduced`` (a parameter frozen on one rank only would leave the others waiting for its
    gradient in every backward), and every buffer not ignored when they are broadcast."""
    reduced_ids = {id(p) for p in reduced}
    specs = [
        TensorSpec("parameter", n, tuple(p.shape), p.stride(), str(p.dtype), id(p) in reduced_ids)
        for n, p in module.named_parameters() if n not in ignored or id(p) in reduced_ids
    ]
    if buffers:
        specs += [
            TensorSpec("buffer", n, tuple(b.shape), b.stride(), str(b.dtype))
            for n, b in module.named_buffers() if n not in ignored
        ]
    return specs


def first_difference(specs: list[list[TensorSpec]]) -> Optional[str]:
    """A phrase naming the first way a rank's parameters (then buffers) differ from rank 0's, or None."""
    for rank in range(1, len(specs)):
        for kind in ("parameter", "buffer"):
            ours = [s for s in specs[0] if s.kind == kind]
            theirs = [s for s in specs[rank] if s.kind == kind]
            for position, (a, b) in enumerate(zip(ours, theirs)):
                for field in ("shape", "stride", "dtype"):
                    if getattr(a, field) != getattr(b, field):
                        elsewhere = "" if a.name == b.name else f" (where it is '{a.name}')"
                        return (
                            f"{kind} {position} ('{b.name}') has {field} {getattr(b, field)} on rank {rank} and "
                            f"{getattr(a, field)} on rank 0{elsewhere}"
                        )
                if a.name != b.name:
                    return (
                        f"{kind} {position} is '{b.name}' on rank {rank} and '{a.name}' on rank 0 (the same shape, "
                        f"so the {kind}s are registered in a different order or under other names, and values matched "
                        f"by position would land in the wrong {kind}): register them in the same order, under the "
                        f"same names, on every rank"
                    )
                if a.reduced != b.reduced:
                    counts = [sum(s.reduced for s in specs[r] if s.kind == kind) for r in (0, rank)]
                    return (
                        f"{kind} {position} ('{b.name}') requires grad on rank {rank if b.reduced else 0} and not "
                        f"on rank {0 if b.reduced else rank}, so their reducers would wait for different gradients "
                        f"(torch: \"DDP expects same model across all ranks, but Rank 0 has {counts[0]} params, while rank "
                        f"{rank} has inconsistent {counts[1]} params\")"
                    )
            if len(ours) != len(theirs):
                longer, shorter, extra = (rank, 0, theirs) if len(theirs) > len(ours) else (0, rank, ours)
                first_extra = extra[min(len(ours), len(theirs))]
                return (
                    f"rank {longer} has {len(extra)} {kind}s and rank {shorter} {min(len(ours), len(theirs))}: "
                    f"rank {shorter} lacks {kind} {min(len(ours), len(theirs))} ('{first_extra.name}')"
                )
    return None


def first_setting_difference(settings: list[dict[str, Any]]) -> Optional[str]:
    """A phrase naming the first setting whose value on a rank differs from rank 0's, or None. ``settings``: every
    rank's ``{name: value}``, values that pickle and compare by ``==`` (bools, numbers, strings, tuples of them).
    A setting only some ranks name is not compared (one that matters only where the model has something, buffers
    say: a model that differs there is the model check's to name)."""
    for rank in range(1, len(settings)):
        for name, ours in settings[0].items():
            if name in settings[rank] and settings[rank][name] != ours:
                return f"{name} is {settings[rank][name]!r} on rank {rank} and {ours!r} on rank 0"
    return None


def collectives_on(tensors: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager:
    """While inside, the current GPU is that of the first of ``tensors`` (nothing changes for CPU tensors or none).

    The checks and votes here send Python objects and one number, which NCCL puts on ``torch.cuda.current_device()``.
    torch's DDP needs no ``torch.cuda.set_device`` before it (its own checks send tensors of the parameters' device);
    without this, two ranks that never set it would both send from GPU 0, which NCCL refuses ("Duplicate GPU
    detected")."""
    first = next(iter(tensors), None)
    return torch.cuda.device(first.device) if first is not None and first.is_cuda else contextlib.nullcontext()


def check_same_everywhere(
    mine: Any, group: dist.ProcessGroup, difference: Callable[[list], Optional[str]], needs: str, advice: str,
    error: type[Exception] = ValueError,
) -> None:
    """Gather every rank's ``mine`` (a collective) and raise the same ``error`` on every rank where
    ``difference(everyone)`` names one: "``needs`` on every rank, but <difference>. ``advice``"."""
    found = difference(gather_from_every_rank(mine, group))
    if found is not None:
        raise error(f"{needs} on every rank, but {found}. {advice}")


def gather_from_every_rank(mine: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``mine``, in rank order (``all_gather_object``: a collective)."""
    everyone: list[Any] = [None] * size_of(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def check_same_model(
    module: nn.Module, group: dist.ProcessGroup, buffers: bool, ignored: frozenset[str] = frozenset(),
    reduced: Iterable[torch.Tensor] = (), settings: Optional[dict[str, Any]] = None,
) -> None:
    """Raise on every rank of ``group`` unless all ranks' ``module`` match rank 0's, and their reducers' ``settings``
    too (one collective): a ``RuntimeError``, as torch's ``_verify_param_shape_across_processes`` raises (code
    written for torch catches it). torch compares neither names nor settings: a model whose same-shaped parameters
    are registered in another order trains silently wrong there, and ranks whose reducers differ
    (``find_unused_parameters``, ``static_graph``, buffer syncing, bucket caps) hang or crash in the backward."""
    everyone = gather_from_every_rank((describe(module, buffers, ignored, reduced), dict(settings or {})), group)
    found = first_setting_difference([s for _, s in everyone])
    if found is not None:
        raise RuntimeError(
            f"DistributedDataParallel needs the same settings on every rank, but {found}. Pass the same value on every "
            f"rank: every rank's reducer must make the same buckets and the same exchanges in each forward and "
            f"backward, or the ranks wait for each other in vain (torch DDP hangs or crashes there)."
        )
    found = first_difference([specs for specs, _ in everyone])
    if found is not None:
        raise RuntimeError(
            f"DistributedDataParallel needs the same model on every rank, but {found}. Build the model the same way "
            f"on every rank (rank 0's values are then broadcast to all)."
        )


def sparse_gradient_flags(module: nn.Module, params: list[nn.Parameter]) -> list[bool]:
    """For each of ``params``, whether its gradient will be sparse: the weight of an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` with ``sparse=True`` (``_build_params_for_reducer``'s ``produces_sparse_gradient``).
    Such a gradient gets a bucket of its own and its own all-reduce of indices and values."""
    sparse = {
        id(p) for sub in module.modules() if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
        for p in sub.parameters(recurse=False)
    }
    return [id(p) in sparse for p in params]


def check_one_device_type(module: nn.Module, ignored: frozenset[str] = frozenset()) -> None:
    """Raise torch DDP's ``ValueError`` unless the parameters it handles (those not ``ignored``) share a device type:
    one reducer's buckets hold one device's gradients (a module half on ``meta`` would fail in the backward)."""
    types = sorted({p.device.type for name, p in module.named_parameters() if name not in ignored})
    if len(types) > 1:
        locations = "{" + ", ".join(map(repr, types)) + "}"
        raise ValueError(
            f"DistributedDataParallel's input module must be on the same type of devices, but input module "
            f"parameters locate in {locations}. Move the module first, e.g. model.to('{types[0]}')."
        )



def check_no_distributed_autograd() -> None:
    """Raise a ``RuntimeError`` where this thread runs inside a ``torch.distributed.autograd`` context: its
    ``dist_autograd.backward`` keeps the gradients in the context, where minidp's reducer, which reduces what autograd
    accumulates into ``.grad``, would never see them, and each rank would step on its own (torch's reducer reads and
    writes the context's). Nothing where RPC was never imported, two C calls where it is not running; where it runs, a
    recording forward outside any context pays for the exception that says so (tens of microseconds)."""
    rpc = sys.modules.get("torch.distributed.rpc")
    if rpc is None or not rpc.is_available() or not rpc.api._is_current_rpc_agent_set():
        return
    try:
        torch.distributed.autograd._current_context()
    except RuntimeError:  # no context in this thread
        return
    raise RuntimeError(
        "minidp's DistributedDataParallel cannot reduce gradients that torch.distributed.autograd computes: this "
        "forward runs inside a dist_autograd.context(), whose backward keeps the gradients in the context, not in "
        ".grad, where minidp reduces them. Use torch.nn.parallel.DistributedDataParallel with distributed autograd, "
        "or run this model's forward and loss.backward() outside the context"
    )


def check_materialised(module: nn.Module, ignored: frozenset[str] = frozenset()) -> None:
    """Raise a ``RuntimeError`` where a parameter DDP handles holds no data yet: a lazy module's (torch's words), or a
    module on the ``meta`` device. DDP broadcasts rank 0's values and hooks the parameters as they are when it is
    built; a meta module's ``to_empty()`` would register new parameters that no hook of the reducer watches, and every
    rank would train on its own gradients, silently (torch's construction fails on a meta module by chance:
    "Tensor.item() cannot be called on meta tensors")."""
    for name, p in module.named_parameters():
        if name in ignored:
            continue
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                f"Modules with uninitialized parameters can't be used with `DistributedDataParallel`. '{name}' is not "
                f"initialized yet (a lazy module): run one forward pass before wrapping it")
        if p.is_meta:
            raise RuntimeError(
                f"DistributedDataParallel: parameter '{name}' is on the meta device (a shape, no data). Materialise the "
                f"module first (module.to_empty(device=...), then initialise it or load a state dict), then wrap it")


def managed_by_fully_shard(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (minidp's or torch's FSDP2: both classes derive from ``FSDPModule``) sharded ``module``:
    its parameters are then this rank's shards, not a replica that DDP or ``replicate`` may broadcast and reduce."""
    return isinstance(module, FSDPModule)


def check_not_sharded(module: nn.Module, ignored: frozenset[str] = frozenset()) -> None:
    """Raise ``NotImplementedError`` (torch DDP's type for an FSDP2 module, raised by its construction's broadcast)
    where a sub-module ``fully_shard`` sharded holds a parameter DDP would handle: DDP's broadcast would overwrite
    every rank's shards with rank 0's, and its reducer average shards of different rows."""
    for name, sub in module.named_modules():
        if managed_by_fully_shard(sub) and any(n not in ignored for n, _ in sub.named_parameters(prefix=name)):
            where = f"its sub-module '{name}'" if name else "the module"
            raise NotImplementedError(
                f"DistributedDataParallel cannot wrap a module already managed by `fully_shard` ({where}, a "
                f"{type(sub).__name__}): its parameters are this rank's shards, which DDP's broadcast would overwrite "
                f"with rank 0's. Let fully_shard reduce the gradients (no DDP), or shard over one mesh dimension and "
                f"replicate over another with fully_shard(module, mesh=<2-D mesh>) (HSDP)."
            )


def check_device_ids(
    module: nn.Module, device_ids: Any, output_device: Any, ignored: frozenset[str] = frozenset()
) -> None:
    """Raise torch DDP's ``ValueError`` where ``device_ids`` name a GPU for a module whose parameters (those not
    ``ignored``) are all on the CPU. torch refuses any ``device_ids`` there; minidp takes CPU ones (``["cpu"] * n``, n
    replicas on the CPU, one of them for ``["cpu"]``), but GPU ids would run as a direct call on the CPU where there is
    no GPU (:class:`minidp.DataParallel`), training silently on what torch refuses. The same for an ``output_device``
    there: torch refuses it (as it refuses any truthy one); minidp's CPU replicas may gather on the CPU only, and
    without replicas there is nothing to gather. ``device_ids`` given as one device (``"cpu"``) rather than a list of
    them is a ``TypeError`` (:func:`minidp.device_ids.check_device_list`): it would be read character by character."""
    if device_ids is not None:
        check_device_list(device_ids, "device_ids")
    devices = {p.device for name, p in module.named_parameters() if name not in ignored}
    if {d.type for d in devices} != {"cpu"}:
        return
    if device_ids and any(map(_names_a_gpu, device_ids)):
        advice = ("Move the module to its GPU first (module.to(device_ids[0])), or pass device_ids=['cpu'] * n for n "
                  "replicas on the CPU (minidp's own).")
    elif output_device and (not device_ids or _names_a_gpu(output_device)):
        advice = ("Leave output_device unset (None) for a module on the CPU" + (
            "." if not device_ids else ", or pass output_device='cpu' to gather its CPU replicas' outputs there."))
    else:
        return
    raise ValueError(
        f"DistributedDataParallel device_ids and output_device arguments only work with "
        f"single-device/multiple-device GPU modules or CPU modules, but got device_ids {device_ids}, output_device "
        f"{output_device}, and module parameters {devices}. {advice}"
    )


def _names_a_gpu(device: Any) -> bool:
    try:
        return parse_device(device, "device_ids").type != "cpu"
    except (TypeError, ValueError):  # misspelled: DataParallel's checks name it
        return False


def reducer_candidates(module: nn.Module, ignored: frozenset[str] = frozenset()) -> list[tuple[str, nn.Parameter]]:
    """Every (name, parameter) pair torch's ``_build_params_for_reducer`` keeps before it drops repeats: each
    module's own parameters (``named_modules()``, ``named_parameters(recurse=False)``) that require grad, named
    ``f"{module_name}.{param_name}"`` and kept unless that name is ``ignored``. So a root parameter is named
    ``".w"`` and escapes ``"w"``, and a tied parameter ignored under one of its names comes back under another."""
    return [
        (f"{module_name}.{param_name}", param)
        for module_name, sub in module.named_modules()
        for param_name, param in sub.named_parameters(recurse=False)
        if param.requires_grad and f"{module_name}.{param_name}" not in ignored
    ]


def reducer_parameters(
    module: nn.Module, ignored: frozenset[str] = frozenset()
) -> tuple[list[nn.Parameter], list[str]]:
    """The parameters DDP reduces and their names, as torch's reducer gets them: :func:`reducer_candidates`, each
    parameter once at its first place (``_build_params_for_reducer``), named by its last candidate's name
    (``_build_debug_param_to_name_mapping``, whose names torch's reducer reports). Their positions are the plan's
    indices."""
    candidates = reducer_candidates(module, ignored)
    # a dict keeps a key where it was first inserted and the value last assigned: each parameter at its first
    # place, with its last name (torch's mapping overwrites the name at each repeat)
    unique = {id(p): (n, p) for n, p in candidates}
    named = list(unique.values())
    if not named:
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient."
        )
    return [p for _, p in named], [n for n, _ in named]


def start_failure_vote(error: Optional[Exception], group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Each rank says whether it failed: an asynchronous all-reduce of one number (a collective), which
    :func:`raise_on_every_rank` waits for; other collectives may be issued in between."""
    device = torch.device("cuda", torch.cuda.current_device()) if backend_of(group) == "nccl" else torch.device("cpu")
    failed = torch.tensor([0 if error is None else 1], device=device)
    return failed, dist.all_reduce(failed, group=group, async_op=True)


def raise_on_every_rank(
    error: Optional[Exception],
    group: dist.ProcessGroup,
    doing: str,
    advice: str = "",
    vote: Optional[tuple[torch.Tensor, dist.Work]] = None,
) -> None:
    """If ``error`` is not None on any rank of ``group``, raise on every rank (a collective).

    The ranks vote (:func:`start_failure_vote`, unless ``vote`` was started earlier): one all-reduce
    of one number, the whole cost when none failed. If one did, every rank receives every rank's
    error (``all_gather_object``). A rank that failed raises its own ``error``, the object it caught
    (its type, traceback and attributes kept, as a caller of torch's would see it), with a note naming
    the rank and ``doing``; the others raise the first failing rank's, naming the rank and ``doing``,
    with the same exception type where it is a built-in one (``ValueError``, ``TypeError``, ...) and
    ``RuntimeError`` otherwise. ``advice``, if given, ends the message or the note.
    """
    failed, work = vote if vote is not None else start_failure_vote(error, group)
    work.wait()
    if failed.item() == 0:
        return
    errors: list[Optional[tuple[str, str]]] = [None] * size_of(group)
    dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)), group=group)
    ending = f"; {advice}" if advice else ""
    if error is not None:
        error.add_note(f"{doing} failed on rank {rank_in(group)} (this rank), and raises on every rank{ending}")
        raise error
    rank, (kind, message) = next((rank, e) for rank, e in enumerate(errors) if e is not None)
    text = f"{doing} failed on rank {rank}: {message}{ending}"
    exception_type = getattr(builtins, kind, None)
    try:
        same_kind = exception_type(text) if isinstance(exception_type, type) and issubclass(exception_type, Exception) else None
    except TypeError:  # a built-in exception that takes more than a message
        same_kind = None
    raise same_kind or RuntimeError(text)
