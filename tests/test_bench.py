"""The benchmark building blocks: side-by-side timing, and the ResNet trees the benchmarks name."""

from __future__ import annotations

import pytest
import torch

import minidp
from minidp.cli import bench
from minidp.zoo import resnet18, resnet50

from .helpers import ROOT, fresh_python


def test_side_by_side_takes_turns_and_reports_every_variant():
    calls: list[str] = []
    times = bench.side_by_side({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, number=2)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3  # one warm-up call each, then blocks in turn


@pytest.mark.parametrize(
    "build, params, buffers, modules", [(resnet18, 62, 60, 68), (resnet50, 161, 159, 151)], ids=["resnet18", "resnet50"]
)
def test_resnet_trees_have_torchvisions_counts(build, params, buffers, modules):
    network = build(base=8)
    counts = (len(list(network.parameters())), len(list(network.buffers())), len(list(network.modules())))
    assert counts == (params, buffers, modules)


def test_the_table_prints_each_row_with_its_ratios():
    rows = [bench.Row("step cnn b256 minidp x2", 0.01, 1.1, 1.05, "stock: direct call (no GPU)")]
    table = bench.format_rows(rows)
    assert "step cnn b256 minidp x2" in table and "1.100" in table and "1.050" in table


def test_only_names_row_groups_and_refuses_unknown_ones():
    import argparse

    assert bench._groups("replicate, forward") == ("replicate", "forward")
    with pytest.raises(argparse.ArgumentTypeError, match="choose from step, replicate, forward"):
        bench._groups("replicate,steps")


def test_the_deep_cheap_model_is_deep_and_holds_buffers():
    network = bench.deep_cheap()
    assert len(list(network.modules())) == 1 + 48 * 4 and len(list(network.buffers())) == 48 * 3


def test_the_forward_rows_floor_reuses_its_replicas_where_the_others_replicate_at_every_call(monkeypatch):
    """The deep model's forward row: uncached, cached and the other backward's way replicate at every call; the floor
    of their ratio ("bound once") runs DataParallel's forward on replicas made once, when the variants are set up."""
    variants = bench.forward_variants(torch.device("cpu"), 2)
    other_way = [name for name in variants if name.startswith("cached with the")]
    assert set(variants) == {"uncached", "cached", "direct", "bound once", *other_way} and len(other_way) == 1
    replicated: list[str] = []
    real = minidp.DataParallel.replicate
    monkeypatch.setattr(minidp.DataParallel, "replicate", lambda self, *a: replicated.append("x") or real(self, *a))
    for _ in range(3):
        variants["bound once"]()
    assert replicated == []
    for name in ("uncached", "cached", *other_way):
        variants[name]()
    assert len(replicated) == 3


@pytest.mark.fresh_interpreter
def test_the_cpu_replicas_benchmark_runs_every_variant_and_says_where_the_time_goes():
    """benchmarks/bench_cpu_replicas.py end to end, shortest run: one device, minidp (the default, which says the
    way it took; parallel backward with the caller's threads and with shared ones; serial backward) and torch DDP
    on 2 Gloo processes, each variant in processes of its own, each row with its CPU time, cores, system time and
    page faults."""
    done = fresh_python(str(ROOT / "benchmarks" / "bench_cpu_replicas.py"), "--rounds", "1", "--number", "1",
                        "--replicas", "2", "--batch", "16", timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("variant"))
    assert header.split()[-6:] == ["CPU", "ms", "cores", "sys", "ms", "faults"]
    rows = {line[:30].strip(): line[30:].split() for line in lines[lines.index(header) + 1:] if line.strip()}
    assert set(rows) == {"one device", "minidp x2", "minidp x2 parallel backward", "minidp x2 shared threads",
                         "minidp x2 serial backward", "torch DDP x2"}
    assert any(line.startswith("minidp x2 (the default, 'auto'): the replicas' backwards run ") for line in lines)
    assert all(len(values) == 7 for values in rows.values())  # ms, two ratios, CPU ms, cores, sys ms, faults


@pytest.mark.fresh_interpreter
def test_the_idle_team_benchmark_times_both_ways_and_their_ratio():
    """benchmarks/idle_team.py end to end, shortest run: the step with the caller's idle OpenMP team let go and left
    spinning, alternating, and the rounds' median ratio."""
    done = fresh_python(str(ROOT / "benchmarks" / "idle_team.py"), "--rounds", "2", "--number", "1", "--batch", "16",
                        timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("SmallCNN, batch 16, 2 CPU replicas")
    assert [line.split()[0] for line in lines[1:3]] == ["let", "left"]
    assert lines[3].startswith("let go / left spinning, round by round: median ")


@pytest.mark.parametrize("model", ["cnn", "deep"])
@pytest.mark.fresh_interpreter
def test_the_tracer_overhead_benchmark_runs_on_either_model(model):
    """benchmarks/trace_overhead.py end to end, shortest run: traced and untraced steps, their ratio, for each model."""
    done = fresh_python(str(ROOT / "benchmarks" / "trace_overhead.py"), "--steps", "2", "--replicas", "2",
                        "--batch", "8", "--model", model, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"{model}, batch 8, 2 CPU replicas, 2 steps each")
    assert "wall time per step: tracing off" in done.stdout


@pytest.mark.fresh_interpreter
def test_the_tracer_overhead_benchmark_times_where_the_cost_lies():
    """``--parts``: a listener that records nothing, the traced step without each stage's describer, and without
    the backward's hooks, each timed against the untraced step like the traced one."""
    done = fresh_python(str(ROOT / "benchmarks" / "trace_overhead.py"), "--steps", "2", "--replicas", "2",
                        "--batch", "8", "--parts", timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = ["tracing on", "a listener that records nothing",
             *(f"tracing on, no {stage} describer" for stage in ("scatter", "replicate", "gather", "reduce")),
             "tracing on, no backward hooks"]
    walls = [line for line in done.stdout.splitlines() if line.startswith("wall time per step: tracing off ")]
    assert [kind for kind in kinds if any(f" ms, {kind} " in line for line in walls)] == kinds


def test_a_step_traced_without_a_stage_s_describer_records_no_event_of_that_stage():
    """What ``--parts`` times is the trace less one stage's bookkeeping: that stage leaves no event, the others do,
    and the describer is back in place afterwards."""
    from benchmarks.trace_overhead import without_describer
    from minidp.tracing import describers

    kept = describers.DESCRIBERS["reduce"]
    model = minidp.DataParallel(torch.nn.Linear(3, 2), ["cpu", "cpu"])
    traces = []

    def traced() -> None:
        with minidp.trace() as step:
            model(torch.randn(4, 3)).sum().backward()
        traces.append(step)

    without_describer("reduce", traced)
    stages = {event.stage for event in traces[0].events}
    assert "reduce" not in stages and {"scatter", "replicate", "forward", "gather", "backward"} <= stages
    assert describers.DESCRIBERS["reduce"] is kept


@pytest.mark.parametrize("kind", ["untraced", "traced"])
@pytest.mark.fresh_interpreter
def test_the_tracer_overhead_benchmark_runs_one_kind_untimed_for_an_instruction_counter(kind):
    """``--one-kind``: the steps of one kind and nothing else (no timing, no other kind's rounds), so that an
    instruction counter around the process sees one kind's work."""
    done = fresh_python(str(ROOT / "benchmarks" / "trace_overhead.py"), "--steps", "2", "--replicas", "2",
                        "--batch", "8", "--one-kind", kind, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""
