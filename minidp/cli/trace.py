"""``minidp trace``: one traced training step of a zoo model, written to a directory.

The step is forward, loss, backward and an SGD update, after ``--warmup`` untraced steps (the
first step also pays for starting the replica threads). Writes ``table.txt``, ``trace.json``
(open it in https://ui.perfetto.dev or chrome://tracing) and ``timeline.png``.
"""

from __future__ import annotations

import argparse

import torch

from ..device_ids import default_device_ids
from ..parallel_backward import parallel_backward_settings
from ..tracing import trace, write_trace_artifacts
from ..wrapper import DataParallel
from ..zoo import ZOO
from .args import non_negative_int, output_directory, parse_device_ids, positive_int, seed


_PARALLEL_BACKWARD = {"auto": "auto", "on": True, "off": False}  # --parallel-backward: set_parallel_backward's settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=list(ZOO), default="cnn", help="zoo model to train (default cnn)")
    parser.add_argument("--devices", type=parse_device_ids, default=None,
                        help="device ids, e.g. 0,1 or cpu*4 (default: every GPU if several, else 4 replicas on the GPU or the CPU)")
    parser.add_argument("--batch", type=positive_int, default=256, help="batch size (default 256)")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untraced steps before the traced one (default 2)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random batch and weights")
    parser.add_argument("--parallel-backward", choices=list(_PARALLEL_BACKWARD), default="auto",
                        help="CPU replicas' backwards in parallel where their threads fit the cores (auto, the "
                             "default), always (on) or never (off): minidp.set_parallel_backward")
    parser.add_argument("--out", type=output_directory, default="minidp-trace",  # a string: argparse checks it too
                        help="directory for the artifacts (default minidp-trace)")


def run(args: argparse.Namespace) -> int:
    device_ids = args.devices or default_device_ids(replicas=4)
    torch.manual_seed(args.seed)
    entry = ZOO[args.model]
    model = DataParallel(entry.build().to(_first_device(device_ids)), device_ids, dim=entry.dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, kwargs = entry.batch(args.batch, torch.Generator().manual_seed(args.seed))

    def train_step() -> None:
        optimizer.zero_grad()
        entry.loss(model(*inputs, **kwargs)).backward()
        optimizer.step()

    with parallel_backward_settings(_PARALLEL_BACKWARD[args.parallel_backward]):
        for _ in range(args.warmup):
            train_step()
        with trace() as step:
            train_step()
    written = write_trace_artifacts(step, args.out)
    print(f"{args.model}, batch {args.batch}, device_ids={device_ids}")
    print(step.table())
    for kind, path in written.items():
        print(f"{kind:>8}: {path}")
    if "timeline" not in written:
        print("timeline: not drawn, matplotlib is missing: pip install 'minidp[plot]'")
    return 0


def _first_device(device_ids) -> torch.device:
    from ..device_ids import as_device

    return as_device(device_ids[0], "--devices[0]")
