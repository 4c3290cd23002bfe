"""Train a model sharded with minidp.distributed.fully_shard, one process per rank, started by torchrun.

One machine, two processes on the CPU (Gloo)::

    torchrun --nproc_per_node=2 examples/fsdp_train.py --epochs 2

With GPUs, pass ``--backend nccl``: each process then trains on the GPU numbered by its local rank.
Several machines: the torchrun commands of examples/ddp_train.py.

The pattern is FSDP2's: build the same model on every rank (the same seed: nothing is broadcast),
``fully_shard`` each block, then the root; build the optimizer on the shards; train as usual. At
the end every rank gathers the full state dict (a collective) and rank 0 saves it; loading it back
into the sharded model gives each rank its rows again.

With ``--checkpoint DIR`` the job saves the model and the optimizer after every epoch with
``torch.distributed.checkpoint`` (each rank writes its own rows, as under FSDP2), and a job started
again with the same directory resumes after the last saved epoch, as if it had never stopped::

    torchrun --nproc_per_node=2 examples/fsdp_train.py --epochs 1 --checkpoint ckpt
    torchrun --nproc_per_node=2 examples/fsdp_train.py --epochs 2 --checkpoint ckpt   # resumes at epoch 2
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from minidp.digits import SyntheticDigits
from minidp.distributed import format_ledgers, full_state_dict, fully_shard, memory_ledger


def build_model(width: int) -> nn.Sequential:
    """An MLP of blocks on 28x28 digits: the blocks are what fully_shard gathers one at a time."""
    blocks = [nn.Sequential(nn.Linear(28 * 28 if i == 0 else width, width), nn.ReLU()) for i in range(4)]
    return nn.Sequential(nn.Flatten(), *blocks, nn.Linear(width, 10))


def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> None:
    """Every rank writes its rows: the model's and the optimizer's state dicts hold the shards as DTensors (FSDP2's
    layout), which torch.distributed.checkpoint saves part by part. A collective: every rank calls it."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state, "epoch": epoch}, checkpoint_id=directory)


def load_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Each rank reads its rows into the model's and the optimizer's own state (the state dicts are the templates
    dcp.load fills), then loads them; returns the epoch saved. A collective: every rank calls it."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "epoch": 0}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["epoch"]


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="gloo: CPU tensors; nccl: one GPU per process")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="images per step, over all processes (default: 64)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--save", metavar="PATH", default=None, help="rank 0 saves the full state dict here")
    parser.add_argument("--checkpoint", metavar="DIR", default=None,
                        help="save model and optimizer here after every epoch (torch.distributed.checkpoint); resume from it")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("start this script with torchrun, e.g. torchrun --nproc_per_node=2 examples/fsdp_train.py")

    dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    say = print if rank == 0 else (lambda *_: None)
    try:
        torch.manual_seed(0)  # the same weights on every rank
        model = build_model(args.width).to(device)
        for block in model[1:-1]:
            fully_shard(block)  # each block: one group, gathered before its forward, freed after
        fully_shard(model)  # the root: the last layer's parameters, and the end of each backward
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # on this rank's shards
        say(f"{world} processes ({args.backend}); rank 0's shards: {[tuple(p.shape) for p in model.parameters()]}")

        data = SyntheticDigits(args.samples, seed=0)
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler)
        first_epoch = 1
        if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, ".metadata")):
            first_epoch = load_checkpoint(args.checkpoint, model, optimizer) + 1
            say(f"resumed from {args.checkpoint} after epoch {first_epoch - 1}")
        for epoch in range(first_epoch, args.epochs + 1):
            sampler.set_epoch(epoch)
            totals = torch.zeros(2, dtype=torch.float64, device=device)
            for batch in loader:
                image, label = batch["image"].to(device), batch["label"].to(device)
                loss = nn.functional.cross_entropy(model(image), label)
                optimizer.zero_grad()
                loss.backward()  # all-gathers again, then reduce-scatters each block's gradients
                optimizer.step()
                totals += torch.tensor([loss.item() * len(label), len(label)], dtype=torch.float64, device=device)
            dist.all_reduce(totals)
            say(f"epoch {epoch}/{args.epochs}: train loss {(totals[0] / totals[1]).item():.6f}")
            if args.checkpoint:
                save_checkpoint(args.checkpoint, model, optimizer, epoch)
        say("memory per rank:\n" + format_ledgers({"fully_shard": memory_ledger(model, optimizer)}))

        state = full_state_dict(model)  # every rank takes part; every rank gets the whole
        if args.save and rank == 0:
            torch.save(state, args.save)
            say(f"saved the full state dict to {args.save}")
        model.load_state_dict(state)  # each rank keeps its rows of each full tensor
        say("loaded the full state dict back into the shards")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
