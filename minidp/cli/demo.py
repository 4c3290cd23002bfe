"""``python -m minidp demo``: train a small CNN with data parallelism, on data made in code.

The model is the tutorial's kind (``minidp.zoo.SmallCNN``: 1x28x28 images, 10 classes); the data
are synthetic digits (``minidp.digits``), so nothing is downloaded. The model is wrapped in
``minidp.DataParallel``: every batch is cut into one chunk per replica, each replica runs on its
chunk in its own thread, and the backward sums their gradients. By default the replicas are two
CPU replicas (``device_ids=['cpu', 'cpu']``); with a GPU, one replica per visible GPU.
"""

from __future__ import annotations

import argparse
import time
from copy import deepcopy as copy_module
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from ..comm import chunk_sizes_for
from ..device_ids import as_device, visible_gpus
from ..digits import SyntheticDigits
from ..criterion import parallel_criterion
from ..tracing import trace, write_trace_artifacts
from ..tracing.views import ledgers_side_by_side
from ..wrapper import DataParallel
from ..zoo import SmallCNN
from .args import output_directory, positive_float, positive_int, seed

DEFAULT_CPU_REPLICAS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=positive_int, default=5, help="passes over the training set (default: 5)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="images per step, before the split (default: 64)")
    parser.add_argument(
        "--replicas", type=positive_int, default=None,
        help=f"replicas to run: on the CPU default {DEFAULT_CPU_REPLICAS}; on GPUs default one per visible GPU "
        "(more than the GPUs: ids repeat, several replicas per GPU)",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto",
        help="where the replicas run; auto: the GPUs if any, else the CPU (default: auto)",
    )
    parser.add_argument("--lr", type=positive_float, default=2e-3, help="Adam learning rate (default: 2e-3)")
    parser.add_argument("--seed", type=seed, default=0, help="seeds the data, the weights and the shuffling (default: 0)")
    parser.add_argument(
        "--samples", type=positive_int, default=6000, help="training images; a quarter as many more are held out (default: 6000)"
    )
    parser.add_argument(
        "--trace", metavar="DIR", type=output_directory, default=None,
        help="after training, trace one more training step and write its table, Chrome trace and timeline PNG to DIR",
    )
    parser.add_argument(
        "--balanced", action="store_true",
        help="compute the loss on the replicas (gather_output=False, minidp.parallel_criterion) instead of "
        "gathering every output on device_ids[0]; prints both memory ledgers side by side at the end",
    )
    parser.add_argument(
        "--processes", type=positive_int, default=1,
        help="train with minidp.distributed in this many processes (Gloo on the loopback address, or NCCL "
        "with a GPU per process), --replicas replicas in each; --batch-size is the total per step (default: 1)",
    )
    parser.add_argument(
        "--shard", action="store_true",
        help="with --processes N: shard the model with minidp.distributed.fully_shard instead of DDP (each process "
        "keeps 1/N of the parameters, gradients and optimizer state); prints the first step's events and the "
        "memory per process beside DDP's",
    )


def choose_device_ids(device: str, replicas: Optional[int]) -> list[Union[int, str]]:
    """The ``device_ids`` for ``DataParallel``, spelled as a user would write them."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return ["cpu"] * (replicas or DEFAULT_CPU_REPLICAS)
    gpus = visible_gpus()
    if gpus == 0:
        raise SystemExit("--device cuda: this process sees no GPU; use --device cpu to run replicas on the CPU")
    return [i % gpus for i in range(replicas or gpus)]


@dataclass
class EpochResult:
    epoch: int
    train_loss: float
    train_accuracy: float
    held_out_loss: float
    held_out_accuracy: float


def loss_and_correct(model: nn.Module, image: torch.Tensor, label: torch.Tensor, reduction: str = "mean"):
    """The step's loss and the number of right answers, both ways the demo can run ``model``:

    * gathered (``gather_output=True``, stock's way): every output joined on ``device_ids[0]``, the
      loss computed there;
    * balanced (``gather_output=False``): the outputs stay on the replicas; ``minidp.parallel_criterion``
      computes the loss there and gathers only its terms, and each replica counts its own right answers.
    """
    output = model(image)
    if isinstance(output, list):  # the replicas' outputs, each on its device
        loss = parallel_criterion(nn.CrossEntropyLoss(reduction=reduction), output, label)
        sizes = [o.shape[0] for o in output]
        correct = sum((o.argmax(dim=1) == part.to(o.device)).sum().item() for o, part in zip(output, label.split(sizes)))
        return loss, correct
    loss = nn.functional.cross_entropy(output, label, reduction=reduction)
    return loss, (output.argmax(dim=1) == label).sum().item()


def train_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device,
                description: str) -> tuple[float, float]:
    """One pass over ``loader``; returns the mean loss and the accuracy seen while training."""
    model.train()
    total_loss, correct, seen = 0.0, 0, 0
    # The live bar only on a terminal (disable=None: off when its stream is not a TTY); in a log or
    # CI each redraw would be one more line, and train() prints one line per epoch there anyway.
    progress = tqdm(loader, desc=description, unit="batch", leave=False, disable=None)
    for data in progress:
        image, label = data["image"], data["label"].to(device)  # DataParallel scatters the images itself
        loss, right = loss_and_correct(model, image, label)
        optimizer.zero_grad()
        loss.backward()  # the replicas' gradients are summed into model.module's parameters
        optimizer.step()

        total_loss += loss.item() * len(label)
        correct += right
        seen += len(label)
        progress.set_postfix(loss=f"{total_loss / seen:.3f}", acc=f"{correct / seen:.1%}", refresh=False)
    return total_loss / seen, correct / seen


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Mean loss and accuracy on ``loader``, without gradients (the replicas are then cut from autograd)."""
    model.eval()
    total_loss, correct, seen = 0.0, 0, 0
    for data in loader:
        label = data["label"].to(device)
        loss, right = loss_and_correct(model, data["image"], label, reduction="sum")
        total_loss += loss.item()
        correct += right
        seen += len(label)
    return total_loss / seen, correct / seen


def train(args: argparse.Namespace) -> list[EpochResult]:
    """Build the data and the model, print what runs where, train; returns one result per epoch."""
    device_ids = choose_device_ids(args.device, args.replicas)
    torch.manual_seed(args.seed)
    train_set = SyntheticDigits(args.samples, seed=args.seed)
    held_out = SyntheticDigits(max(1, args.samples // 4), seed=args.seed + 1)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(args.seed))
    held_out_loader = DataLoader(held_out, batch_size=args.batch_size)

    device = as_device(device_ids[0])  # the parameters start there, and the outputs are gathered there
    model = DataParallel(SmallCNN().to(device), device_ids=device_ids, gather_output=not args.balanced)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    print(f"minidp demo: SmallCNN on {len(train_set)} synthetic digits (1x28x28, 10 classes), "
          f"{len(held_out)} held out")
    where = "the loss on the replicas (only its terms gathered)" if args.balanced else f"output on {device}"
    print(f"device_ids={device_ids}: {len(device_ids)} replicas, {where}")
    rows = min(args.batch_size, len(train_set))  # a batch no larger than the data set
    print(f"batch size {args.batch_size} -> chunk sizes per replica {chunk_sizes_for(rows, len(device_ids))}"
          + _last_batch_note(len(train_set), args.batch_size, len(device_ids)))

    results = []
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        train_loss, train_accuracy = train_epoch(
            model, train_loader, optimizer, device, f"epoch {epoch}/{args.epochs}"
        )
        held_out_loss, held_out_accuracy = evaluate(model, held_out_loader, device)
        results.append(EpochResult(epoch, train_loss, train_accuracy, held_out_loss, held_out_accuracy))
        print(f"epoch {epoch}/{args.epochs}: train loss {train_loss:.4f} accuracy {train_accuracy:.1%} | "
              f"held-out loss {held_out_loss:.4f} accuracy {held_out_accuracy:.1%} | "
              f"{time.perf_counter() - start:.1f} s")
    if args.trace:
        trace_one_step(model, next(iter(train_loader)), optimizer, device, args.trace)
    if args.balanced:
        print(compare_ledgers(model.module, device_ids, next(iter(train_loader)), device, args.lr))
    return results


def trace_one_step(model: nn.Module, data: dict, optimizer: torch.optim.Optimizer, device: torch.device,
                   directory: Union[str, Path]) -> None:
    """One more training step under ``minidp.trace()``; prints its table and writes the artifacts."""
    model.train()
    with trace() as step:
        loss, _ = loss_and_correct(model, data["image"], data["label"].to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(step.table())
    for kind, path in write_trace_artifacts(step, directory).items():
        print(f"{kind}: {path}")


def compare_ledgers(module: nn.Module, device_ids: list, data: dict, device: torch.device, lr: float) -> str:
    """One traced training step each way (outputs gathered; loss on the replicas): both memory ledgers.

    Each way steps its own copy of ``module`` with its own Adam, one step to warm up (replica threads,
    Adam's state) and one measured, so both start from the same weights and state and the trained
    model is left as it is.
    """
    label = data["label"].to(device)
    ledgers = {}
    for gather_output, title in ((True, "outputs gathered"), (False, "loss on replicas")):
        copy = copy_module(module)
        model = DataParallel(copy, device_ids=device_ids, gather_output=gather_output)
        optimizer = torch.optim.Adam(copy.parameters(), lr=lr)

        def step() -> None:
            optimizer.zero_grad()
            loss_and_correct(model, data["image"], label)[0].backward()
            optimizer.step()

        step()
        with trace(ledger=True) as traced:
            step()
        ledgers[title] = traced.ledger()
    return "memory ledger of one training step, both ways:\n" + ledgers_side_by_side(ledgers)


def _last_batch_note(samples: int, batch_size: int, replicas: int) -> str:
    if samples < batch_size:
        return f" (the {samples} samples make one batch)"
    last = samples % batch_size
    return f" (last batch {last} -> {chunk_sizes_for(last, replicas)})" if last else ""


def distributed_device(requested: str, processes: int) -> str:
    """Where ``processes`` ranks train: NCCL wants a GPU of its own per process (it refuses two ranks on one GPU), so
    ``auto`` is ``cuda`` only where there are that many, and ``cuda`` with fewer is refused before any process starts."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "cuda" if gpus >= processes else "cpu"
    if requested == "cuda" and gpus < processes:
        raise SystemExit(
            f"--device cuda with --processes {processes}: NCCL needs one GPU per process and this machine has {gpus}; "
            f"use --processes {gpus} or fewer, or --device cpu (Gloo, CPU tensors)" if gpus else
            "--device cuda: this machine has no GPU; use --device cpu (Gloo, CPU tensors)"
        )
    return requested


def run(args: argparse.Namespace) -> int:
    if args.processes > 1:
        from ..distributed import run_demo  # torch.distributed only when asked for

        if args.balanced:
            raise SystemExit("--balanced and --processes: choose one (the distributed demo gathers in each process)")
        if args.shard and args.replicas:
            raise SystemExit("--shard and --replicas: choose one (a sharded process runs its model once)")
        device = distributed_device(args.device, args.processes)
        run_demo(args.processes, backend="nccl" if device == "cuda" else "gloo", epochs=args.epochs,
                 batch_size=args.batch_size, replicas=args.replicas or 1, lr=args.lr, seed=args.seed,
                 samples=args.samples, trace=args.trace, shard=args.shard)
        return 0
    if args.shard:
        raise SystemExit("--shard needs --processes N (N > 1): sharding splits the model across processes")
    train(args)
    return 0
