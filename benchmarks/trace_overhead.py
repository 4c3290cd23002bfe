"""What tracing costs: one training step of the demo CNN with and without ``minidp.trace()``.

    python benchmarks/trace_overhead.py [--steps 30] [--batch 256] [--replicas 4] [--model cnn|deep] [--ledger] [--rss-reads] [--parts]
    python benchmarks/trace_overhead.py --steps 10 --one-kind untraced|traced    # untimed, for an instruction counter

``--model deep``: instead of the CNN, ``minidp.cli.bench.deep_cheap`` (48 blocks of ``Linear``, ``BatchNorm1d``
and ``ReLU``: 192 parameters, cheap operations), where what the tracer does per module or parameter weighs most.

Traced and untraced steps alternate, so both see the same machine; the medians are compared as a
ratio, and so is each traced step with the untraced one of its round (a slow drift of the machine's speed moves
both steps of a round alike), whose median is printed with a 95% confidence interval. Also measured: what an
instrumented primitive costs with no tracer active (the flag check).

``--ledger`` adds two more kinds of step to the rotation: ``minidp.trace(ledger=True)`` (the memory ledger
counts every allocation), and, for comparison, the step under ``torch.profiler.profile(profile_memory=True,
record_shapes=True, with_stack=True)`` followed by the analysis behind its memory timeline
(``torch.profiler._memory_profiler.MemoryProfile``), which sees only the calling thread's allocations; and
what the ledger costs per operator, on a small ``torch.add`` watched and not, alternating.

``--parts`` adds, to the rotation, where the tracer's cost lies: the step with a listener installed that records
nothing and passes every call on (what the hooks cost once something listens), and the traced step once per stage
with that stage's describer (:mod:`minidp.tracing.describers`, the bookkeeping the recorder does while the step
runs: the replicate describer walks the replicas and has the recorder put hooks on their backward) replaced by one
that records nothing, and the traced step with the describers in place but no hook put on the backward
(``Trace.watch_replicas`` a no-op). Each such step's events are incomplete: they are timed, not read.

``--rss-reads`` times the two ways the trace can read the process's peak resident memory at its end, each right
after an untraced step, alternating: the ``VmHWM`` line of ``/proc/self/status`` and ``getrusage``.

``--one-kind untraced|traced`` times nothing: after three steps of each kind it runs ``--steps`` steps of that kind
and exits, for a counter of instructions, which the machine's other work does not move (valgrind's callgrind runs
the threads one at a time; ``OMP_WAIT_POLICY=passive`` keeps idle OpenMP threads from spinning, which it would count):

    py=$(python -c "import sys; print(sys.executable)")   # the interpreter itself, not a launcher script
    for steps in 0 10; do for kind in untraced traced; do
        OMP_WAIT_POLICY=passive valgrind --tool=callgrind --callgrind-out-file=/dev/null \
            "$py" benchmarks/trace_overhead.py --replicas 2 --batch 64 --steps $steps --one-kind $kind 2>&1 | grep Collected
    done; done

A step's instructions are (untraced at 10 - untraced at 0) / 10, the tracer's (traced at 10 - untraced at 10) / 10.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import statistics
import time
import timeit
from typing import Callable

import torch
from torch.profiler._memory_profiler import MemoryProfile

import minidp
from minidp import hooks
from minidp.cli.bench import deep_cheap
from minidp.hooks import observed
from minidp.tracing import describers
from minidp.tracing.memory import AllocationLedger, PeakResidentMemory
from minidp.tracing.recorder import Trace
from minidp.zoo import ZOO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--model", choices=["cnn", "deep"], default="cnn")
    parser.add_argument("--ledger", action="store_true",
                        help="also time minidp.trace(ledger=True) and torch's memory profile")
    parser.add_argument("--parts", action="store_true",
                        help="also time a listener that records nothing, and the traced step without each stage's "
                             "describer, and without the backward's hooks")
    parser.add_argument("--rss-reads", action="store_true",
                        help="also time the two reads of the peak resident memory, right after a step")
    parser.add_argument("--one-kind", choices=["untraced", "traced"],
                        help="time nothing: run --steps steps of this kind only, for an instruction counter")
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.model == "cnn":
        entry = ZOO["cnn"]
        network, loss = entry.build(), entry.loss
        inputs, _ = entry.batch(args.batch, torch.Generator().manual_seed(0))
    else:
        network, loss = deep_cheap(), lambda output: output.square().mean()
        inputs = (torch.randn(args.batch, 32, generator=torch.Generator().manual_seed(0)),)
    model = minidp.DataParallel(network, ["cpu"] * args.replicas)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        loss(model(*inputs)).backward()
        optimizer.step()

    def traced() -> None:
        with minidp.trace():
            step()

    def ledger() -> None:
        with minidp.trace(ledger=True) as recorded:
            step()
        recorded.ledger()

    def torch_memory_profile() -> None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as profile:
            step()
        MemoryProfile(profile.profiler.kineto_results).timeline

    kinds = {"tracing off": step, "tracing on": traced}
    if args.ledger:
        kinds.update({"ledger on": ledger, "torch memory profile": torch_memory_profile})
    if args.parts:
        kinds["a listener that records nothing"] = functools.partial(listened, step)
        kinds.update({f"tracing on, no {stage} describer": functools.partial(without_describer, stage, traced)
                      for stage in describers.DESCRIBERS})
        kinds["tracing on, no backward hooks"] = functools.partial(without_backward_hooks, traced)

    def timed(run: Callable[[], None]) -> tuple[float, float]:
        """Wall time and CPU time (all threads of the process) of one step."""
        start, cpu_start = time.perf_counter(), time.process_time()
        run()
        return time.perf_counter() - start, time.process_time() - cpu_start

    if args.one_kind is not None:
        for _ in range(3):  # each kind's first-call costs, in both counts alike
            step()
            traced()
        run = traced if args.one_kind == "traced" else step
        for _ in range(args.steps):
            run()
        return

    for _ in range(3):
        step()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in kinds}
    for _ in range(args.steps):
        for name, run in kinds.items():
            times[name].append(timed(run))
    print(f"{args.model}, batch {args.batch}, {args.replicas} CPU replicas, {args.steps} steps each, alternating")
    for clock, index in (("wall", 0), ("CPU", 1)):
        plain = statistics.median(t[index] for t in times["tracing off"])
        for name in list(kinds)[1:]:
            other = statistics.median(t[index] for t in times[name])
            paired = [on[index] / off[index] - 1 for on, off in zip(times[name], times["tracing off"])]
            middle, low, high = median_with_interval(paired)
            print(f"{clock:>4} time per step: tracing off {plain * 1e3:.2f} ms, {name} {other * 1e3:.2f} ms (median): "
                  f"overhead {(other / plain - 1) * 100:+.1f}%; step by step (each against the untraced step of its "
                  f"round): median {middle * 100:+.1f}%, 95% interval {low * 100:+.1f}% to {high * 100:+.1f}%")

    if args.rss_reads:
        reads = {"/proc/self/status": functools.partial(PeakResidentMemory._status, "VmHWM"),
                 "getrusage": PeakResidentMemory._max_resident}
        spent: dict[str, list[tuple[float, float]]] = {name: [] for name in reads}
        for _ in range(args.steps):
            for name, read in reads.items():
                step()
                start, cpu_start = time.perf_counter(), time.thread_time()
                read()
                spent[name].append((time.perf_counter() - start, time.thread_time() - cpu_start))
        for name, values in spent.items():
            wall, cpu = (statistics.median(v) for v in zip(*values))
            print(f"reading the peak resident memory through {name} right after a step: {wall * 1e6:.0f} us wall, "
                  f"{cpu * 1e6:.0f} us CPU of the reading thread (median)")

    if args.ledger:  # the ledger's cost per operator, away from the step's noise: a small add, watched or not
        print(f"the ledger's cost per operator: {ledger_cost_per_operator() * 1e6:.1f} us (torch.add on 4 floats)")

    # The flag check alone: an instrumented no-op against the bare no-op.
    def bare() -> None:
        return None

    instrumented = observed("scatter")(bare)
    n = 200000
    off = min(timeit.repeat(instrumented, number=n, repeat=7)) / n
    plain_call = min(timeit.repeat(bare, number=n, repeat=7)) / n
    print(f"an instrumented call with no tracer active: {(off - plain_call) * 1e9:.0f} ns more than the bare call")


class PassingListener:
    """A listener that records nothing: every call it hears of, it runs and returns."""

    def on_call(self, stage: str, function: Callable, arguments: inspect.BoundArguments) -> object:
        return function(*arguments.args, **arguments.kwargs)

    def on_replica(self, replica: int, device: torch.device, module: object, call: Callable[[], object]) -> object:
        return call()

    def on_module(self, device: torch.device, module: object, call: Callable[[], object]) -> object:
        return call()

    def on_replica_backward(self, replica: int, device: torch.device, module: object, call: Callable[[], object]) -> object:
        return call()

    def on_replica_outputs(self, modules: object, outputs: object, one_call_each: bool) -> None:
        pass


def listened(step: Callable[[], None]) -> None:
    """``step()`` with a :class:`PassingListener` installed."""
    previous = hooks.set_listener(PassingListener())
    try:
        step()
    finally:
        hooks.set_listener(previous)


def without_describer(stage: str, traced: Callable[[], None]) -> None:
    """``traced()`` with the describer of ``stage`` replaced by one that records nothing."""
    kept = describers.DESCRIBERS[stage]
    describers.DESCRIBERS[stage] = lambda tracer, arguments, result: functools.partial(iter, ())
    try:
        traced()
    finally:
        describers.DESCRIBERS[stage] = kept


def without_backward_hooks(traced: Callable[[], None]) -> None:
    """``traced()`` with the recorder putting no hook on the replicas' backward (so it records no backward span)."""
    kept = Trace.watch_replicas
    Trace.watch_replicas = lambda self, replicas, parameters: None
    try:
        traced()
    finally:
        Trace.watch_replicas = kept


def median_with_interval(values: list[float]) -> tuple[float, float, float]:
    """The median of ``values`` and a 95% confidence interval for it, whatever their distribution: the k-th smallest
    and the k-th largest value, where k is how far below n/2 the count of heads in n tosses of a fair coin falls
    with 2.5% chance (n/2 - 1.96 sqrt(n)/2, the normal approximation of that count)."""
    ordered = sorted(values)
    n = len(ordered)
    spread = 0.98 * math.sqrt(n)
    low, high = max(math.floor(n / 2 - spread), 0), min(math.ceil(n / 2 + spread), n - 1)
    return statistics.median(ordered), ordered[low], ordered[high]


def ledger_cost_per_operator(operators: int = 2000, rounds: int = 7) -> float:
    """Seconds one operator costs more while an AllocationLedger watches: best of ``rounds`` alternating rounds."""
    a = torch.ones(4)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(operators):
            torch.add(a, a)
        return time.perf_counter() - start

    plain, watched = [], []
    for _ in range(rounds):
        plain.append(run())
        ledger = AllocationLedger()
        ledger.start()
        try:
            watched.append(run())
        finally:
            ledger.stop()
    return (min(watched) - min(plain)) / operators


if __name__ == "__main__":
    main()
