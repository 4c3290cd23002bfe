"""``minidp verify``: run :func:`minidp.verify` on every model of the zoo and print a pass/fail table.

Exit status 1 when any model fails, so the command can gate a CI job.
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from ..device_ids import DeviceLike, as_devices, default_device_ids
from ..verification import verify
from ..zoo import ZOO
from .args import parse_device_ids, seed


def replicas(text: str) -> list[DeviceLike]:
    """``--devices``: at least two, as :func:`minidp.verify` compares two or more replicas with one device."""
    ids = parse_device_ids(text)
    if len(ids) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r} names one device: verify compares at least two replicas with one device; repeat it, e.g. "
            f"cpu*2 or 0,0")
    return ids


def split_batch(text: str) -> int:
    """``--batch``: at least 2 rows, so that at least two replicas get a chunk (:func:`minidp.verify` refuses fewer)."""
    value = int(text)  # not a number: argparse says "invalid split_batch value"
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}: verify gives a row to each of at least two replicas")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=replicas, default=None,
                        help="device ids, at least two, e.g. 0,1 or cpu*4 (default: every GPU if several, else 2 replicas on the GPU or the CPU)")
    parser.add_argument("--models", nargs="+", choices=list(ZOO), default=list(ZOO), metavar="MODEL",
                        help=f"zoo models to check (default: all of {', '.join(ZOO)})")
    parser.add_argument("--batch", type=split_batch, default=7, help="batch size (default 7: uneven chunks)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random batch and weights")
    parser.add_argument("--verbose", action="store_true", help="print every model's full report")


def run(args: argparse.Namespace) -> int:
    device_ids = args.devices or default_device_ids(replicas=2)
    names = [str(d) for d in as_devices(device_ids, "--devices")]
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    reports = {}
    for name in tqdm(args.models, desc="verify", unit="model", disable=None):  # the bar only on a terminal
        entry = ZOO[name]
        inputs, kwargs = entry.batch(args.batch, generator)
        reports[name] = verify(entry.build(), inputs, device_ids, kwargs, dim=entry.dim, loss=entry.loss)
    print(f"minidp verify on {names}, batch {args.batch}, float64, rtol {next(iter(reports.values())).rtol:g}")
    print(f"{'model':<12} {'checks':>7} {'worst rel err':>14}  {'batch-dependent':<15}  result")
    for name, report in reports.items():
        worst = max((c.rel_error for c in report.checks), default=0.0)
        print(f"{name:<12} {len(report.checks):>7} {worst:>14.3g}  {'yes' if report.batch_dependent else 'no':<15}  "
              f"{'pass' if report.ok else 'FAIL'}")
    for name, report in reports.items():
        if args.verbose or not report.ok:
            print(f"\n{name}:\n{report}")
    failed = [name for name, report in reports.items() if not report.ok]
    print(f"\n{len(reports) - len(failed)}/{len(reports)} models pass" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
