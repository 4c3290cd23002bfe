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
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from minidp.digits import SyntheticDigits
from minidp.zoo import SmallCNN

from .ddp import DistributedDataParallel
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
    trace: Optional[str] = None,
) -> list[dict]:
    """Train in this process as one rank of the current process group; returns one dict per epoch.

    ``batch_size`` is the images per step over all ranks; ``replicas`` > 1 runs that many CPU
    replicas inside each process (``device_ids=["cpu"] * replicas``). With ``trace`` a directory,
    one more step is timed and rank 0 writes every rank's timeline there as one Chrome trace.
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
    device_ids = ["cpu"] * replicas if replicas and replicas > 1 and device.type == "cpu" else None
    model = DistributedDataParallel(SmallCNN().to(device), device_ids=device_ids)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    say = print if rank == 0 else (lambda *_: None)
    say(f"minidp.distributed demo: SmallCNN on {len(train_set)} synthetic digits, {world} processes "
        f"({dist.get_backend()}, {device.type}), {len(held_out)} held out")
    say(f"batch size {batch_size} -> {batch_size // world} per process"
        + (f", {replicas} replicas in each" if device_ids else "")
        + f"; buckets {model.bucket_plan()} before the first backward")

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
            totals += torch.tensor([loss.item() * len(label), (output.argmax(1) == label).sum().item(), len(label)],
                                   dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        held_out_loss, held_out_accuracy = _evaluate(model.module, held_out, device)
        result = {"epoch": epoch, "train_loss": (totals[0] / totals[2]).item(), "train_accuracy": (totals[1] / totals[2]).item(),
                  "held_out_loss": held_out_loss, "held_out_accuracy": held_out_accuracy}
        results.append(result)
        say(f"epoch {epoch}/{epochs}: train loss {result['train_loss']:.4f} accuracy {result['train_accuracy']:.1%} | "
            f"held-out loss {held_out_loss:.4f} accuracy {held_out_accuracy:.1%} | {time.perf_counter() - start:.1f} s")
        if epoch == 1:
            say(f"buckets rebuilt after the first backward, in the order gradients arrived: {model.bucket_plan()}")
    if trace:
        data = next(iter(loader))
        nn.functional.cross_entropy(model(data["image"].to(device)), data["label"].to(device)).backward()
        timelines = gather_timelines(model.timeline())
        if rank == 0:
            say(f"timeline: {write_chrome_trace(Path(trace) / 'ddp_timeline.json', timelines)}")
            try:
                say(f"picture: {plot_timelines(Path(trace) / 'ddp_timeline.png', timelines)}")
            except ImportError as error:
                say(f"picture: not drawn ({error})")
    return results


@torch.no_grad()
def _evaluate(model: nn.Module, data: SyntheticDigits, device: torch.device) -> tuple[float, float]:
    """Mean loss and accuracy on all of ``data``; every rank holds the same model, so the same numbers."""
    model.eval()
    output = model(data.images.to(device))
    labels = data.labels.to(device)
    return nn.functional.cross_entropy(output, labels).item(), (output.argmax(1) == labels).float().mean().item()
