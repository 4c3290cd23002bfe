"""Checks that run inside every rank of a job started by ``minidp.distributed.launch``.

Each check trains or inspects both ``minidp.distributed.DistributedDataParallel`` and a reference
(stock ``torch.nn.parallel.DistributedDataParallel``, or one process on the full batch) in the same
process, on the same data, and returns plain facts (booleans, numbers, strings) that the tests in
``test_distributed*.py`` assert on. A job (:func:`run_checks`) runs several checks, so that the
processes are started once for many tests.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import minidp.distributed as md
from minidp.zoo import MLP, ResNetBlockBN

from .helpers import debug_level, error_of, max_relative_error, timm_vit, torchvision_resnet18

TorchDDP = nn.parallel.DistributedDataParallel


def wide_mlp() -> nn.Module:
    """3 MiB of float32 parameters: two buckets at the default caps once rebuilt (1 MiB first bucket)."""
    return MLP(features=256, hidden=1024, classes=512)


class PartlyUsed(nn.Module):
    """Parameters used on some ranks only (``branch``: rank 0), on none (``never``), and through an
    output the loss ignores (``side``): the cases ``find_unused_parameters=True`` exists for."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)
        self.head = nn.Linear(16, 4)
        self.side = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        if dist.get_rank() == 0:
            out = out + self.branch(h)
        return out, self.side(h)


class SomeUnused(nn.Module):
    """Layers unused on every rank (``never``, registered first, so reduced last, and ``branch``), as
    ``skip_all_reduce_unused_params`` requires, between used ones."""

    def __init__(self) -> None:
        super().__init__()
        self.never = nn.Linear(16, 4)
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.side = nn.Linear(16, 2)
        self.branch = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.head(h), self.side(h)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], torch.Tensor], Callable[[Any], torch.Tensor]]] = {
    # name: (build, batch of n, loss of the output)
    "wide_mlp": (wide_mlp, lambda n, g: torch.randn(n, 256, generator=g), lambda out: out.pow(2).mean()),
    "resnet_bn": (ResNetBlockBN, lambda n, g: torch.randn(n, 3, 8, 8, generator=g), lambda out: out.pow(2).mean()),
    "partly_used": (PartlyUsed, lambda n, g: torch.randn(n, 8, generator=g), lambda out: out[0].pow(2).mean()),
    "some_unused": (SomeUnused, lambda n, g: torch.randn(n, 8, generator=g), lambda out: out[0].pow(2).mean()),
    # models nobody here wrote (tests/test_model_libraries.py runs them where the libraries import)
    "torchvision_resnet18": (torchvision_resnet18, lambda n, g: torch.randn(n, 3, 32, 32, generator=g),
                             lambda out: out.pow(2).mean()),
    "timm_vit": (timm_vit, lambda n, g: torch.randn(n, 3, 32, 32, generator=g), lambda out: out.pow(2).mean()),
}


def _bf16_hook(state, bucket):  # no annotations: stock checks them (a string is not dist.GradBucket)
    # torch DDP refuses a hook *named* bf16_compress_hook without NCCL; the same arithmetic under
    # another name runs on Gloo, so that stock can be compared with minidp running the stock hook.
    return default_hooks.bf16_compress_hook(state, bucket)


def _bf16_wrapped_allreduce(state, bucket):
    # The same for the wrapper: torch refuses the hook it returns, named bf16_compress_wrapper_hook, without NCCL.
    return default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)(state, bucket)


HOOKS = {
    "allreduce": (default_hooks.allreduce_hook, default_hooks.allreduce_hook),
    "fp16_compress": (default_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
    "bf16_compress": (_bf16_hook, default_hooks.bf16_compress_hook),
    "bf16_compress_wrapper": (_bf16_wrapped_allreduce, default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)),
}


def _batch(model: str, seed: int, step: int, rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s batch at ``step``: the same on every call, different for every rank and step."""
    return MODELS[model][1](n, torch.Generator().manual_seed(seed + 1000 * step + rank)).to(dtype)


def _difference(ours: nn.Module, theirs: nn.Module) -> Optional[str]:
    """The first parameter, gradient or buffer that is not bitwise equal, or None."""
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        if not torch.equal(a, b):
            return f"parameter {name}: max |difference| {(a - b).abs().max().item():.3g}"
        if (a.grad is None) != (b.grad is None):
            return f"gradient of {name}: {'None' if a.grad is None else 'set'} here, {'None' if b.grad is None else 'set'} in stock"
        if a.grad is not None and not torch.equal(a.grad, b.grad):
            return f"gradient of {name}: max |difference| {(a.grad - b.grad).abs().max().item():.3g}"
    for (name, a), b in zip(ours.named_buffers(), theirs.buffers()):
        if not torch.equal(a, b):
            return f"buffer {name} differs"
    return None


def _bucket_groups(module: nn.Module) -> list[list[int]]:
    """Parameter indices grouped by the storage their ``.grad`` lives in: the buckets, when gradients are bucket views."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(module.parameters()):
        groups.setdefault(p.grad.untyped_storage().data_ptr(), []).append(i)
    return sorted(groups.values())


def against_torch(
    seed: int,
    model: str = "wide_mlp",
    dtype: torch.dtype = torch.float32,
    steps: int = 4,
    micro_batches: int = 1,
    hook: Optional[str] = None,
    set_to_none: bool = True,
    ignored: Sequence[str] = (),
    mesh: bool = False,
    **ddp_options: Any,
) -> dict:
    """Train stock DDP and minidp's side by side from different initial weights on each rank (SGD
    with momentum); after every step, the first difference in parameters, gradients or buffers.

    ``micro_batches`` > 1: the first ones under ``no_sync()``. ``hook``: a name in :data:`HOOKS`.
    ``ignored``: names both leave alone (``_set_params_and_buffers_to_ignore_for_model``). ``mesh``: both
    average over a 1-D ``DeviceMesh`` of every rank (``device_mesh=``) instead of a process group; ``"slice"``: over
    the first dimension of a (ranks x 1) mesh.
    """
    rank = dist.get_rank()
    build, _, loss_of = MODELS[model]
    torch.manual_seed(seed + rank)  # different weights on every rank: the constructors must broadcast rank 0's
    theirs_module = build().to(dtype)
    ours_module = copy.deepcopy(theirs_module)
    if ignored:
        TorchDDP._set_params_and_buffers_to_ignore_for_model(theirs_module, list(ignored))
        md.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ours_module, list(ignored))
    if mesh == "slice":  # the data-parallel dimension of a 2-D mesh, as Lightning and torchtitan hand it over
        whole = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
        ddp_options["device_mesh"] = whole["dp"]
    elif mesh:
        ddp_options["device_mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    with warnings.catch_warnings():  # torch 2.13 deprecates the name broadcast_buffers (same meaning); both warn
        warnings.simplefilter("ignore", FutureWarning)
        theirs = TorchDDP(theirs_module, **ddp_options)
        ours = md.DistributedDataParallel(ours_module, **ddp_options)
    if hook is not None:
        theirs.register_comm_hook(None, HOOKS[hook][0])
        ours.register_comm_hook(None, HOOKS[hook][1])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (theirs, ours)]
    differences, bucket_views = [], []
    for step in range(steps):
        for ddp, optimizer in zip((theirs, ours), optimizers):
            optimizer.zero_grad(set_to_none=set_to_none)
            for micro in range(micro_batches):
                last = micro == micro_batches - 1
                with ddp.no_sync() if not last else contextlib.nullcontext():
                    loss_of(ddp(_batch(model, seed, step * micro_batches + micro, rank, 6, dtype))).backward()
            if ddp_options.get("gradient_as_bucket_view"):
                bucket_views.append(_bucket_groups(ddp.module))
            optimizer.step()
        differences.append(_difference(ours_module, theirs_module))
    return {
        "differences": differences,
        "plan": ours.bucket_plan(),
        "stock_plan": theirs._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices"),
        "bucket_views": bucket_views,
    }


def hook_calls(seed: int, model: str = "wide_mlp", steps: int = 3, **ddp_options: Any) -> dict:
    """Per backward, the buckets handed to a recording communication hook (index, is_last, parameter
    indices), in stock and in minidp, and minidp's ``bucket_plan()`` before each backward."""
    build, _, loss_of = MODELS[model]
    calls: dict[str, list] = {"stock": [], "minidp": []}
    plans = []
    for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
        torch.manual_seed(seed)
        module = build()
        index_of = {id(p): i for i, p in enumerate(module.parameters())}
        ddp = wrapper(module, **ddp_options)

        def record_bucket(state, bucket, seen=calls[name]):  # no annotations: stock checks them
            seen[-1].append((bucket.index(), bucket.is_last(), [index_of[id(p)] for p in bucket.parameters()]))
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, record_bucket)
        for step in range(steps):
            if name == "minidp":
                plans.append(ddp.bucket_plan())
            calls[name].append([])
            loss_of(ddp(_batch(model, seed, step, dist.get_rank(), 4))).backward()
    return {**calls, "plans": plans}


def matches_full_batch(seed: int, device_ids: Optional[list] = None, steps: int = 3, per_rank: int = 4) -> float:
    """Train minidp's DDP (each rank ``per_rank`` samples, ``device_ids`` replicas in each process)
    and one process on all ranks' samples at once, float64; the largest relative difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)
    module = MLP().double()
    ddp = md.DistributedDataParallel(module, device_ids=device_ids)
    single = copy.deepcopy(module)  # rank 0's weights, broadcast by the constructor
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, single)]
    worst = 0.0
    for step in range(steps):
        inputs = [torch.randn(per_rank, 16, generator=torch.Generator().manual_seed(seed + 100 * step + r),
                              dtype=torch.float64) for r in range(world)]
        for model, optimizer, x in ((ddp, optimizers[0], inputs[rank]), (single, optimizers[1], torch.cat(inputs))):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        worst = max([worst, *(max_relative_error(a, b) for a, b in zip(module.parameters(), single.parameters()))])
    return worst


def mismatched_model(seed: int) -> str:
    """Rank 1's model has a wider hidden layer; the error each rank raises, as its type and message."""
    return error_of_ddp(MLP(hidden=32 if dist.get_rank() == 0 else 33))


class TwoLayers(nn.Module):
    """``a`` then ``b`` in the forward, two layers of one shape; registered ``a, b`` or, ``swapped``, ``b, a``."""

    def __init__(self, swapped: bool) -> None:
        super().__init__()
        first, second = nn.Linear(4, 4), nn.Linear(4, 4)
        if swapped:
            self.b, self.a = second, first
        else:
            self.a, self.b = first, second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def error_of_ddp(module: nn.Module, **options: Any) -> str:
    """The error DDP's construction raises on this rank, as its type and message, or "no error"."""
    try:
        md.DistributedDataParallel(module, **options)
    except Exception as error:  # noqa: BLE001 - the type is what is checked
        return f"{type(error).__name__}: {error}"
    return "no error"


def parameters_in_another_order(seed: int) -> str:
    """Rank 1 registers the same-shaped layers in the other order."""
    return error_of_ddp(TwoLayers(swapped=dist.get_rank() == 1))


def argument_on_one_rank(seed: int, name: str, values: Sequence[Any], model: str = "mlp") -> str:
    """DDP built with ``name=values[rank]`` (a model with buffers for ``model="resnet_bn"``)."""
    module = ResNetBlockBN() if model == "resnet_bn" else MLP()
    return error_of_ddp(module, **{name: values[dist.get_rank()]})


def unused_without_find_unused(seed: int) -> dict[str, list]:
    """A parameter that gets no gradient while ``find_unused_parameters=False``, in stock and in minidp, at debug
    levels OFF and INFO: per wrapper, ``[level, the call that raised, its message, the logged error]`` each."""
    found: dict[str, list] = {"stock": [], "minidp": []}
    for level in ("OFF", "INFO"):
        with debug_level(level):
            for name, wrapper in (("stock", TorchDDP), ("minidp", md.DistributedDataParallel)):
                torch.manual_seed(seed)
                ddp = wrapper(PartlyUsed())
                call = "first backward"
                try:
                    ddp(torch.randn(4, 8))[0].sum().backward()
                    call = "second forward"
                    ddp(torch.randn(4, 8))
                    call, message = "none", ""
                except RuntimeError as error:
                    message = str(error)
                found[name].append([level, call, message, ddp._get_ddp_logging_data().get("error", "")])
    return found


def sharded_module(seed: int, where: str) -> dict[str, Any]:
    """DDP of an MLP that ``fully_shard`` sharded (``where="root"``: the whole of it; ``"child"``: its first layer
    only), minidp's DDP of minidp's fully_shard and torch's of torch's: each error, and whether minidp's left this
    rank's shards as they were."""
    outcome: dict[str, Any] = {}
    for name, ddp, fully_shard in (("minidp", md.DistributedDataParallel, md.fully_shard),
                                   ("torch", TorchDDP, torch_fully_shard)):
        torch.manual_seed(seed)
        module = MLP()
        fully_shard(module if where == "root" else module.net[0])
        before = [p.detach().clone() for p in module.parameters()]
        outcome[name] = error_of(lambda: ddp(module))
        outcome[f"{name} untouched"] = all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    return outcome


def _too_short_for_bucket_1(state, bucket):  # no annotations: stock checks them
    """torch's allreduce_hook, whose future holds one element for bucket 1: a wrong result."""
    future = default_hooks.allreduce_hook(state, bucket)
    return future.then(lambda f: f.value()[:1].clone()) if bucket.index() == 1 else future


def bad_hook_result_on_one_bucket(seed: int) -> dict[str, Any]:
    """A hook that returns a wrong-sized result for bucket 1 of the rebuilt plan (the second backward), the batch
    differing between ranks: the error, and the parameters whose .grad differs from this rank's own gradient of that
    backward (computed on a copy) after it, which were written back."""
    torch.manual_seed(seed)
    module = wide_mlp()
    ddp = md.DistributedDataParallel(module)
    local = copy.deepcopy(module)  # rank 0's weights, broadcast by the constructor
    ddp.register_comm_hook(None, _too_short_for_bucket_1)
    _, _, loss_of = MODELS["wide_mlp"]
    loss_of(ddp(_batch("wide_mlp", seed, 0, dist.get_rank(), 4))).backward()  # one bucket (the first plan): fine
    assert len(ddp.bucket_plan()) > 1, "the rebuilt plan must have a bucket 1"
    module.zero_grad()
    x = _batch("wide_mlp", seed, 1, dist.get_rank(), 4)
    error = error_of(lambda: loss_of(ddp(x)).backward())
    loss_of(local(x)).backward()
    written = [name for (name, p), q in zip(module.named_parameters(), local.parameters())
               if p.grad is not None and not torch.equal(p.grad, q.grad)]
    return {"error": error, "written back": written}


def timeline_of_a_step(seed: int) -> list[list[dict]]:
    """Every rank's timeline of the third step (buckets rebuilt), gathered."""
    ddp = md.DistributedDataParallel(wide_mlp())
    for step in range(3):
        ddp(_batch("wide_mlp", seed, step, dist.get_rank(), 4)).pow(2).mean().backward()
    return md.gather_timelines(ddp.timeline())


def raise_in_step_2(failing_rank: int) -> None:
    """Train; rank ``failing_rank`` raises in step 2 while the others go on into the all-reduce."""
    ddp = md.DistributedDataParallel(MLP())
    for step in range(1, 4):
        if step == 2 and dist.get_rank() == failing_rank:
            raise RuntimeError(f"planted failure in step 2 on rank {failing_rank}")
        ddp(torch.randn(4, 16)).sum().backward()


def data_loader_with_workers() -> list[list[float]]:
    """The batches a DataLoader with two worker processes of its own gives this rank (its DistributedSampler's half)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dataset = TensorDataset(torch.arange(8.0))
    loader = DataLoader(dataset, batch_size=2, num_workers=2, sampler=DistributedSampler(dataset, shuffle=False))
    return [batch.tolist() for (batch,) in loader]


def exit_in_step_2(failing_rank: int, code: int) -> None:
    """Train; rank ``failing_rank`` ends in step 2 with exit status ``code``, without raising (``os._exit``, as a
    signal would end it), while the others go on into the all-reduce."""
    ddp = md.DistributedDataParallel(MLP())
    for step in range(1, 4):
        if step == 2 and dist.get_rank() == failing_rank:
            os._exit(code)
        ddp(torch.randn(4, 16)).sum().backward()


def raise_then_the_other_aborts(code: int) -> None:
    """Rank 0 raises; rank 1, waiting in a collective that rank 0's end breaks, ends without raising (``os._exit``, as
    a native abort after a broken collective ends it)."""
    if dist.get_rank() == 0:
        time.sleep(0.5)  # rank 1 is in its barrier
        raise ValueError("planted failure on rank 0")
    try:
        dist.barrier()
    except RuntimeError:
        os._exit(code)


def train_as_a_torchrun_script(how_it_ends: str) -> dict[str, Any]:
    """A step of training written for torchrun: its place read from the environment torchrun sets, ended by
    ``destroy_process_group()`` (``how_it_ends="destroy"``) or by ``sys.exit(0)`` (``"exit"``) on rank 1 (rank 0
    returns what it read)."""
    place = {name: os.environ[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    ddp = md.DistributedDataParallel(MLP())
    ddp(torch.randn(4, 16)).sum().backward()
    if how_it_ends == "destroy":
        dist.destroy_process_group()
    elif dist.get_rank() == 1:
        sys.exit(0)
    return place


def run_checks(checks: dict[str, tuple[Callable[..., Any], dict]], seed: int) -> dict[str, Any]:
    """Run ``checks`` (name: (function, keyword arguments)) in order, each given ``seed``; their results by name."""
    return {name: function(seed=seed, **kwargs) for name, (function, kwargs) in checks.items()}



@record
def _main() -> None:
    dist.init_process_group("gloo")
    raise_in_step_2(int(sys.argv[1]))
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun: torchrun --nproc_per_node=2 -m tests.ddp_checks FAILING_RANK
    _main()
