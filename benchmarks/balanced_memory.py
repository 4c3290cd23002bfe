"""Bytes gathered to the output device: the loss there (stock's way) against the loss on the replicas.

    python -m benchmarks.balanced_memory [--batch 64] [--replicas 2] [--device cpu|cuda]

One training step of the demo CNN (minidp.zoo.SmallCNN, cross-entropy on 10 classes) run two ways:

* gathered: ``DataParallel(model, ids)`` gathers every replica's output onto the output device and
  ``nn.CrossEntropyLoss`` runs there on the whole batch;
* on the replicas: ``DataParallel(model, ids, gather_output=False)`` and
  ``minidp.parallel_criterion``, which gathers a numerator and a denominator per replica.

The bytes are what :func:`minidp.trace` records for its ``gather`` events (bytes copied into the
gathered tensors, summed over the replicas). The backward moves the same amount back (the
gradient of the gathered output, or of the scalars). The two losses and gradients are compared,
to show that both ways compute the same step.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import minidp
from minidp.zoo import SmallCNN


def gathered_bytes(model: nn.Module, ids: list, x: torch.Tensor, y: torch.Tensor, on_replicas: bool):
    """One step; returns (bytes gathered, loss, parameter gradients)."""
    criterion = nn.CrossEntropyLoss()
    wrapper = minidp.DataParallel(model, ids, gather_output=not on_replicas)
    model.zero_grad()
    with minidp.trace() as step:
        output = wrapper(x)
        loss = minidp.parallel_criterion(criterion, output, y) if on_replicas else criterion(output, y)
        loss.backward()
    moved = sum(event.bytes for event in step.events if event.stage == "gather")
    return moved, loss.item(), [p.grad.clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    ids = ["cpu"] * args.replicas if device.type == "cpu" else [device.index or 0] * args.replicas  # on the one GPU
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    x = torch.randn(args.batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)

    full, full_loss, full_grads = gathered_bytes(model, ids, x, y, on_replicas=False)
    scalars, loss, grads = gathered_bytes(model, ids, x, y, on_replicas=True)
    grad_error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, full_grads))
    print(f"SmallCNN, batch {args.batch}, {args.replicas} replicas on {args.device}, float32")
    print(f"gathered output, loss on {ids[0]}:   {full:8d} bytes gathered   loss {full_loss:.6f}")
    print(f"loss on the replicas:               {scalars:8d} bytes gathered   loss {loss:.6f}")
    print(f"ratio {full / scalars:.0f}x; largest relative gradient difference {grad_error:.1e} (float32 rounding)")


if __name__ == "__main__":
    main()
