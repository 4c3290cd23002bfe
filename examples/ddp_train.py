"""Train the demo's CNN with minidp.distributed, one process per rank, started by torchrun.

One machine, two processes on the CPU (Gloo)::

    torchrun --nproc_per_node=2 examples/ddp_train.py --epochs 2

Two machines, four processes each: run on both, ``--node_rank=0`` on the machine at HOST and
``--node_rank=1`` on the other (static rendezvous, ranks 0-3 on node 0)::

    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --master_addr=HOST --master_port=29500 examples/ddp_train.py

or let the machines find each other through HOST's store, ranks in the order they join (the same
command on both; ``--rdzv_id`` names the job)::

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=digits \\
        examples/ddp_train.py

Gloo picks the network interface from the host name; if that is the wrong one, name it:
``GLOO_SOCKET_IFNAME=eth0`` (``NCCL_SOCKET_IFNAME`` for NCCL).

With GPUs, pass ``--backend nccl``: each process then trains on the GPU numbered by its local rank.

torchrun starts the processes and gives each its place in the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); ``init_process_group`` reads it. If a rank raises,
torchrun stops the others and reports that rank's error (``@record`` writes its traceback).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from minidp.distributed import demo


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="gloo: CPU tensors; nccl: one GPU per process")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective waits for a missing rank (default: 60)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="images per step, over all processes (default: 64)")
    parser.add_argument("--replicas", type=int, default=None, help="CPU replicas inside each process (default: 1)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--trace", metavar="DIR", default=None, help="time one more step; rank 0 writes a Chrome trace to DIR")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("start this script with torchrun, e.g. torchrun --nproc_per_node=2 examples/ddp_train.py")

    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    try:
        demo.train(epochs=args.epochs, batch_size=args.batch_size, replicas=args.replicas, lr=args.lr,
                   seed=args.seed, samples=args.samples, trace=args.trace)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
