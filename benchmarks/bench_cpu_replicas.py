"""CPU replicas against one device and against torch DDP on Gloo: one training step of the same global batch.

    python benchmarks/bench_cpu_replicas.py                  # the CNN at batch 256, 2 and 4 replicas
    python benchmarks/bench_cpu_replicas.py --rounds 5       # shorter
    python benchmarks/bench_cpu_replicas.py --threads 1      # every variant on one intra-op thread per process
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 python benchmarks/bench_cpu_replicas.py
        # glibc keeps freed memory mapped, in every process of the run: page faults all but gone

Variants, all on the same global batch (``--batch`` rows of 1x28x28 images, ``minidp.zoo.SmallCNN``,
cross-entropy, SGD), each in processes of its own, started once and idle, blocked on a pipe, while the others run:
a process keeps state that outlives a step and changes the next variant's speed (glibc's free memory, hence the
page faults; OpenMP's thread teams, and how their idle threads wait), so each variant runs in a process that only
ever ran it, as a user's training does:

* ``one device``: the model itself, with all the intra-op threads;
* ``minidp xK``: ``minidp.DataParallel`` on K CPU replicas, as configured by default: the replicas' backwards in
  parallel where their thread teams fit the cores, else one after the other (``set_parallel_backward("auto")``;
  the line says which it chose); ``minidp xK parallel backward``: in parallel always
  (``set_parallel_backward(True)``), each with the caller's intra-op threads (bitwise the serial backward);
  ``minidp xK shared threads``: in parallel with ``set_parallel_backward_threads("share")`` (each backward with its
  forward's share of the threads); ``minidp xK serial backward``: ``set_parallel_backward(False)``;
* ``torch DDP xK``: ``torch.nn.parallel.DistributedDataParallel`` in K Gloo processes on this machine,
  each with batch/K rows and cores/K intra-op threads (file rendezvous, over the loopback interface).

A step is ``zero_grad``, forward, loss, backward, ``optimizer.step``. Each round runs every variant for
``--number`` steps, in an order that rotates from round to round; a DDP variant's time is its slowest
rank's, from a barrier. Printed: each variant's median step and its ratio to one device and to torch
DDP with as many processes; and where the time goes: the CPU time of a step (user + system, every
thread of every process of the variant), the cores it kept busy (CPU time / wall time), the system time
and the page faults (minor: memory the kernel maps in and zeroes). On a machine shared with other work,
compare ratios of one run only.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minidp  # noqa: E402
from benchmarks import models  # noqa: E402
from minidp.cli.bench import training_step  # noqa: E402
from minidp.cpu_threads import cores  # noqa: E402
from minidp.distributed.launch import loopback_interface  # noqa: E402
from minidp.parallel_backward import applies  # noqa: E402
from minidp.zoo import SmallCNN  # noqa: E402


class _Variant(NamedTuple):
    """What one variant's processes run: ``"one device"``, ``"minidp"`` (K replicas, the parallel backward's two
    settings) or ``"torch DDP"`` (K ranks)."""

    kind: str
    replicas: int = 1
    parallel_backward: Union[bool, str] = "auto"
    backward_threads: str = "caller"

    @property
    def processes(self) -> int:
        return self.replicas if self.kind == "torch DDP" else 1


def _variants(replicas: list[int]) -> dict[str, _Variant]:
    variants = {"one device": _Variant("one device")}
    for k in replicas:
        variants[f"minidp x{k}"] = _Variant("minidp", k)
        variants[f"minidp x{k} parallel backward"] = _Variant("minidp", k, True)
        variants[f"minidp x{k} shared threads"] = _Variant("minidp", k, True, "share")
        variants[f"minidp x{k} serial backward"] = _Variant("minidp", k, False)
    variants.update({f"torch DDP x{k}": _Variant("torch DDP", k) for k in replicas})
    return variants


def _rank(variant: _Variant, rank: int, store_path: str, threads: int, batch: int, commands, replies) -> None:
    """One process of a variant: build its step, then time ``number`` steps for every command, until told to stop."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = models.batch("cnn", "cpu", size=batch)
    ddp = variant.kind == "torch DDP"
    if ddp:
        interface = loopback_interface()
        if interface:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        store = dist.FileStore(store_path, variant.processes)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=variant.processes,
                                timeout=timedelta(seconds=120))
        model = nn.parallel.DistributedDataParallel(model)
        x, y = x.chunk(variant.processes)[rank], y.chunk(variant.processes)[rank]
    elif variant.kind == "minidp":
        minidp.set_parallel_backward(variant.parallel_backward)
        minidp.set_parallel_backward_threads(variant.backward_threads)
        model = minidp.DataParallel(model, ["cpu"] * variant.replicas)
    step = training_step(model, x, y)
    while True:
        number = commands.recv()
        if number is None:
            break
        if ddp:
            dist.barrier()
        elapsed = _Costs.of(step, number)
        wall = torch.tensor([elapsed.wall])
        if ddp:
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        replies.send(_Costs(wall.item(), elapsed.cpu, elapsed.system, elapsed.faults))
    if ddp:
        dist.destroy_process_group()


class _Processes:
    """A variant's processes, started once, each with this process's intra-op threads divided among them;
    :meth:`time` runs ``number`` steps on all of them."""

    def __init__(self, variant: _Variant, batch: int) -> None:
        self.directory = tempfile.mkdtemp(prefix="bench-cpu-replicas-")
        context = mp.get_context("spawn")
        threads = max(1, torch.get_num_threads() // variant.processes)
        self.pipes, self.processes = [], []
        for rank in range(variant.processes):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_rank,
                args=(variant, rank, os.path.join(self.directory, "store"), threads, batch, theirs, theirs),
                daemon=True,
            )
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)

    def time(self, number: int) -> "_Costs":
        for pipe in self.pipes:
            pipe.send(number)
        return _Costs.of_ranks([pipe.recv() for pipe in self.pipes])

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--threads", type=int, help="intra-op threads of each process but DDP's (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    groups: dict[str, _Processes] = {}
    try:
        for name, variant in _variants(args.replicas).items():
            groups[name] = _Processes(variant, args.batch)
        for group in groups.values():  # warm-up, DDP's bucket rebuild included
            group.time(args.number)
            group.time(args.number)
        costs: dict[str, list[_Costs]] = {name: [] for name in groups}
        names = list(groups)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                costs[name].append(groups[name].time(args.number))
    finally:
        for group in groups.values():
            group.close()

    median = {name: _Costs.median(values, args.number) for name, values in costs.items()}
    one = median["one device"].wall
    print(f"SmallCNN, global batch {args.batch}, {torch.get_num_threads()} intra-op threads a process (DDP's divided), "
          f"{args.rounds} rounds x {args.number} steps, medians per step")
    for k in args.replicas:
        chosen = "in parallel" if applies([torch.device("cpu")] * k) else "one after the other"
        print(f"minidp x{k} (the default, 'auto'): the replicas' backwards run {chosen} on {cores()} cores")
    print(f"{'variant':<30} {'ms':>8} {'/ one device':>13} {'/ torch DDP':>12} {'CPU ms':>8} {'cores':>6} "
          f"{'sys ms':>7} {'faults':>7}")
    for name, cost in median.items():
        k = next((k for k in args.replicas if f"x{k}" in name), None)
        ddp = median[f"torch DDP x{k}"].wall if k else None
        vs_ddp = f"{cost.wall / ddp:.3f}" if ddp else "-"
        print(f"{name:<30} {cost.wall * 1e3:8.1f} {cost.wall / one:13.3f} {vs_ddp:>12} {cost.cpu * 1e3:8.1f} "
              f"{cost.cpu / cost.wall:6.2f} {cost.system * 1e3:7.1f} {cost.faults:7.0f}")


class _Costs(NamedTuple):
    """What some steps cost: wall seconds, CPU seconds (user + system) and system seconds, minor page faults."""

    wall: float
    cpu: float
    system: float
    faults: float

    @staticmethod
    def of(step, number: int) -> "_Costs":
        """``number`` calls of ``step`` in this process (every thread of it)."""
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(number):
            step()
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        system = after.ru_stime - before.ru_stime
        return _Costs(wall, after.ru_utime - before.ru_utime + system, system, after.ru_minflt - before.ru_minflt)

    @staticmethod
    def of_ranks(ranks: list["_Costs"]) -> "_Costs":
        """The processes' costs together: the slowest one's wall time, the sum of the rest."""
        return _Costs(max(r.wall for r in ranks), *(sum(values) for values in list(zip(*ranks))[1:]))

    @staticmethod
    def median(runs: list["_Costs"], number: int) -> "_Costs":
        """Per step: each field's median over the runs of ``number`` steps."""
        return _Costs(*(statistics.median(values) / number for values in zip(*runs)))


if __name__ == "__main__":
    main()
