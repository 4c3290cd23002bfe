"""The demo's training, one process per rank: ``minidp.zoo.SmallCNN`` on synthetic digits, with DDP.

What each process does, once its process group is up (``torchrun`` or
:func:`minidp.distributed.launch` sets it up):

1. build the same data (``minidp.digits``, from the seed) and the same model as every other rank;
2. wrap the model in :class:`minidp.distributed.DistributedDataParallel`, which broadcasts rank 0's
   weights, so the ranks start equal;
3. read its own share of each epoch (``DistributedSampler``: rank r takes every world-size-th image
   of the epoch's shuffled order) in batches of ``batch_size // world_size``: one step of all ranks
   together sees ``batch_size`` images, as one step of the single-process demo does;
4. after each backward, every rank holds the same averaged gradients, so the optimizers take the
   same step and the models stay equal without ever being copied again.

Rank 0 prints the progress; the losses and accuracies are summed over all ranks.

With ``shard=True`` step 2 is :func:`minidp.distributed.fully_shard` instead (each conv and linear
layer a group, then the root): every rank keeps 1/W of each parameter and of the optimizer's state,
gathers a layer's parameters just before the layer runs and frees them after, and reduce-scatters
the gradients so that each rank receives the average of its own rows only. Rank 0 prints the first
step's events one by one, and, at the end, its memory ledger beside DDP's for the same model.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from minidp.digits import SyntheticDigits
from minidp.zoo import SmallCNN

from .ddp import DistributedDataParallel
from .fully_shard import fully_shard, sharded_timeline
from .memory import format_ledgers, memory_ledger
from .timeline import gather_timelines, plot_timelines, write_chrome_trace


def _device() -> torch.device:
    """This process's GPU under NCCL (its local rank, modulo the visible GPUs), made current; else the CPU."""
    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def train(
    epochs: int = 5,
    batch_size: int = 64,
    replicas: Optional[int] = None,
    lr: float = 2e-3,
    seed: int = 0,
    samples: int = 6000,
    trace: Optional[Union[str, Path]] = None,
    shard: bool = False,
) -> list[dict]:
    """Train in this process as one rank of the current process group; returns one dict per epoch.

    ``batch_size`` is the images per step over all ranks; ``replicas`` > 1 runs that many CPU
    replicas inside each process (``device_ids=["cpu"] * replicas``). With ``trace`` a directory,
    one more step is timed and rank 0 writes every rank's timeline there as one Chrome trace.
    ``shard``: :func:`fully_shard` instead of DDP (``replicas`` is then ignored).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if batch_size < world:
        raise ValueError(f"batch_size={batch_size} is smaller than the {world} processes: give each at least one image")
    device = _device()
    torch.manual_seed(seed)
    train_set = SyntheticDigits(samples, seed=seed)
    held_out = SyntheticDigits(max(1, samples // 4), seed=seed + 1)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(train_set, batch_size=batch_size // world, sampler=sampler)
    if replicas and replicas > 1 and device.type != "cpu":
        raise ValueError(f"replicas={replicas} runs CPU replicas in each process, but this process trains on {device} "
                         f"(NCCL): a process's GPU is its one replica; train with replicas=1, or on the CPU (Gloo)")
    device_ids = ["cpu"] * replicas if replicas and replicas > 1 and not shard else None
    say = print if rank == 0 else (lambda *_: None)
    say(f"minidp.distributed demo: SmallCNN on {len(train_set)} synthetic digits, {world} processes "
        f"({dist.get_backend()}, {device.type}), {len(held_out)} held out")
    if shard:
        model = _sharded_cnn(device, say)
    else:
        model = DistributedDataParallel(SmallCNN().to(device), device_ids=device_ids)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    say(f"batch size {batch_size} -> {batch_size // world} per process"
        + (f", {replicas} replicas in each" if device_ids else "")
        + ("" if shard else f"; buckets {model.bucket_plan()} before the first backward"))

    results = []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        sampler.set_epoch(epoch)
        model.train()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, seen
        for data in loader:
            image, label = data["image"].to(device), data["label"].to(device)
            output = model(image)
            loss = nn.functional.cross_entropy(output, label)
            optimizer.zero_grad()
            loss.backward()  # the gradients are averaged over the ranks during this call
            optimizer.step()
            if shard and epoch == 1 and totals[2] == 0:
                _say_step(model, say)
            totals += torch.tensor([loss.item() * len(label), (output.argmax(1) == label).sum().item(), len(label)],
                                   dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        held_out_loss, held_out_accuracy = _evaluate(model if shard else model.module, held_out, device)
        result = {"epoch": epoch, "train_loss": (totals[0] / totals[2]).item(), "train_accuracy": (totals[1] / totals[2]).item(),
                  "held_out_loss": held_out_loss, "held_out_accuracy": held_out_accuracy}
        results.append(result)
        say(f"epoch {epoch}/{epochs}: train loss {result['train_loss']:.4f} accuracy {result['train_accuracy']:.1%} | "
            f"held-out loss {held_out_loss:.4f} accuracy {held_out_accuracy:.1%} | {time.perf_counter() - start:.1f} s")
        if epoch == 1 and not shard:
            say(f"buckets rebuilt after the first backward, in the order gradients arrived: {model.bucket_plan()}")
    if shard:
        say(_ledgers_beside_ddp(model, optimizer, next(iter(loader)), device, lr))
    if trace:
        data = next(iter(loader))
        nn.functional.cross_entropy(model(data["image"].to(device)), data["label"].to(device)).backward()
        timelines = gather_timelines(sharded_timeline(model) if shard else model.timeline())
        name = "fsdp_timeline" if shard else "ddp_timeline"
        if rank == 0:
            say(f"timeline: {write_chrome_trace(Path(trace) / f'{name}.json', timelines)}")
            try:
                say(f"picture: {plot_timelines(Path(trace) / f'{name}.png', timelines)}")
            except ImportError as error:
                say(f"picture: not drawn ({error})")
    return results


def _sharded_cnn(device: torch.device, say) -> nn.Module:
    """SmallCNN with each conv and linear layer sharded as one group, then the root; says what each rank keeps."""
    model = SmallCNN().to(device)
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for layer in [model.features[0], model.features[3], model.classifier[1]]:
        fully_shard(layer)
    fully_shard(model)
    world = dist.get_world_size()
    say(f"step 1, shard: each parameter cut along dim 0 with torch.chunk(param, {world}), every chunk padded to "
        f"chunk 0's rows; rank 0 keeps:")
    for name, p in model.named_parameters():
        say(f"    {name:<22} {str(full_shapes[name]):<16} -> {tuple(p.shape)}")
    return model


def _say_step(model: nn.Module, say) -> None:
    """Rank 0's last training step, event by event, from its timeline."""
    events = sharded_timeline(model)
    origin = events[0]["start"]
    say("steps 2-5 in the first training step, as rank 0 ran them (ms from the first event; a collective "
        "spans its launch to when rank 0 saw it complete):")
    meaning = {"all-gather": "all-gather its shards (in the backward, launched while the group after it computes)",
               "copy-out": "copy each parameter out of the gathered buffer; the module now holds it whole",
               "forward": "forward with the whole parameters, then free them (reshard_after_forward)",
               "backward": "backward of its layers, then free the parameters again",
               "reduce-scatter": "reduce-scatter the gradients: this rank receives the average of its rows"}
    for e in events:
        say(f"    {(e['start'] - origin) * 1e3:8.2f} .. {(e['end'] - origin) * 1e3:8.2f}  "
            f"{e['group'] or '(root)':<14} {e['stage']:<15} {meaning[e['stage']]}")
    say("step 6: the optimizer steps each rank's shards, with its own shard of Adam's state")


def _ledgers_beside_ddp(model: nn.Module, optimizer: torch.optim.Optimizer, data: dict, device: torch.device,
                        lr: float) -> str:
    """The sharded model's ledger after one more step, beside DDP's for the same model and step."""
    ddp = DistributedDataParallel(SmallCNN().to(device))
    ddp_optimizer = torch.optim.Adam(ddp.parameters(), lr=lr)
    image, label = data["image"].to(device), data["label"].to(device)
    for module, opt in ((model, optimizer), (ddp, ddp_optimizer)):
        opt.zero_grad()
        nn.functional.cross_entropy(module(image), label).backward()
        opt.step()
    ledgers = {"DDP": memory_ledger(ddp, ddp_optimizer), "fully_shard": memory_ledger(model, optimizer)}
    return f"memory per rank, after a step ({dist.get_world_size()} ranks):\n" + format_ledgers(ledgers)


@torch.no_grad()
def _evaluate(model: nn.Module, data: SyntheticDigits, device: torch.device) -> tuple[float, float]:
    """Mean loss and accuracy on all of ``data``; every rank holds the same model (a sharded one is
    gathered layer by layer, by every rank), so the same numbers."""
    model.eval()
    output = model(data.images.to(device))
    labels = data.labels.to(device)
    return nn.functional.cross_entropy(output, labels).item(), (output.argmax(1) == labels).float().mean().item()
