"""Swap minidp in for torch.nn.DataParallel: the same training, the same numbers.

Two copies of one model train side by side on the same batches, one wrapped in
``torch.nn.DataParallel``, the other in ``minidp.DataParallel``; everything else is the same code.
They run in float64, so the only differences left are the rounding of sums done in another order.

On GPUs both wrappers use every visible GPU. Without a GPU, stock DataParallel calls the module
directly; minidp then runs ``--replicas`` replicas on the CPU, so this compares a real split,
replicate, gather and gradient reduction against a single-device step.

    python examples/swap_in.py [--steps 10] [--batch-size 30] [--replicas 3]
"""

import argparse
import copy

import torch
from torch import nn
from torch.utils.data import DataLoader

import minidp
from minidp.digits import SyntheticDigits
from minidp.zoo import SmallCNN


def train(model: nn.Module, loader: DataLoader, steps: int, device: torch.device) -> list[float]:
    """``steps`` Adam steps on ``loader``'s batches; returns the losses. The same code for both wrappers."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _, data in zip(range(steps), loader):
        output = model(data["image"].to(device, torch.float64))
        loss = nn.functional.cross_entropy(output, data["label"].to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=30)
    parser.add_argument("--replicas", type=int, default=3, help="CPU replicas for minidp when there is no GPU")
    args = parser.parse_args()

    gpus = torch.cuda.device_count()
    device = torch.device("cuda:0" if gpus else "cpu")
    minidp_ids = list(range(gpus)) if gpus else ["cpu"] * args.replicas

    torch.manual_seed(0)
    model = SmallCNN().double().to(device)
    stock = torch.nn.DataParallel(copy.deepcopy(model))  # every visible GPU; none: a direct call
    ours = minidp.DataParallel(copy.deepcopy(model), device_ids=minidp_ids)
    print(f"torch.nn.DataParallel: device_ids={stock.device_ids or 'none (no GPU: calls the module directly)'}")
    print(f"minidp.DataParallel:   device_ids={minidp_ids}")
    assert stock.state_dict().keys() == ours.state_dict().keys()  # both 'module.'-prefixed

    # The same batches for both: two loaders over one data set, shuffled by equally seeded generators.
    data = SyntheticDigits(args.steps * args.batch_size, seed=0)
    loaders = [DataLoader(data, args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1))
               for _ in range(2)]
    stock_losses = train(stock, loaders[0], args.steps, device)
    our_losses = train(ours, loaders[1], args.steps, device)

    print(f"{'step':>4}  {'torch.nn.DataParallel':>22}  {'minidp.DataParallel':>22}")
    for step, (a, b) in enumerate(zip(stock_losses, our_losses), 1):
        print(f"{step:>4}  {a:>22.15f}  {b:>22.15f}")

    worst = max(
        ((p - q).abs().max() / q.abs().max().clamp_min(1e-300)).item()
        for p, q in zip(ours.state_dict().values(), stock.state_dict().values())
    )
    print(f"after {args.steps} steps, the largest relative difference in any parameter or buffer: {worst:.1e}")
    if worst > 1e-10:
        raise SystemExit("minidp and torch.nn.DataParallel disagree beyond float64 rounding")


if __name__ == "__main__":
    main()
