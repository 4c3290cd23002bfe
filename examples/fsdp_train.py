"""Train a model sharded with minidp.distributed.fully_shard, one process per rank, started by torchrun.

One machine, two processes on the CPU (Gloo)::

    torchrun --nproc_per_node=2 examples/fsdp_train.py --epochs 2

With GPUs, pass ``--backend nccl``: each process then trains on the GPU numbered by its local rank.
Several machines: the torchrun commands of examples/ddp_train.py.

The pattern is FSDP2's: build the same model on every rank (the same seed: nothing is broadcast),
``fully_shard`` each block, then the root; build the optimizer on the shards; train as usual. At
the end every rank gathers the full state dict (a collective) and rank 0 saves it; loading it back
into the sharded model gives each rank its rows again.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from minidp.digits import SyntheticDigits
from minidp.distributed import format_ledgers, full_state_dict, fully_shard, memory_ledger


def build_model(width: int) -> nn.Sequential:
    """An MLP of blocks on 28x28 digits: the blocks are what fully_shard gathers one at a time."""
    blocks = [nn.Sequential(nn.Linear(28 * 28 if i == 0 else width, width), nn.ReLU()) for i in range(4)]
    return nn.Sequential(nn.Flatten(), *blocks, nn.Linear(width, 10))


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="gloo: CPU tensors; nccl: one GPU per process")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="images per step, over all processes (default: 64)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--save", metavar="PATH", default=None, help="rank 0 saves the full state dict here")
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
        for epoch in range(1, args.epochs + 1):
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
            say(f"epoch {epoch}/{args.epochs}: train loss {(totals[0] / totals[1]).item():.4f}")
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
