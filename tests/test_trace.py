"""minidp.trace (minidp/tracing/): every step of every replica, with the bytes it moved, in a table, a Chrome trace and a PNG."""

from __future__ import annotations

import gc
import json
import mmap
import re
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import minidp
from minidp.tracing import STAGE_COLOURS, STAGES, describers, write_trace_artifacts
from minidp.tracing.memory import PeakResidentMemory
from minidp.zoo import ZOO, ResNetBlockBN

from .helpers import HearsOutputs, LayerCache, cpu_ids, fresh_python

REPLICAS = 3


def traced_step(model: nn.Module, inputs: tuple, replicas: int = REPLICAS) -> minidp.Trace:
    wrapped = minidp.DataParallel(model, cpu_ids(replicas))
    with minidp.trace() as step:
        wrapped(*inputs).pow(2).mean().backward()
    return step


@pytest.fixture
def cnn_step(generator) -> minidp.Trace:
    inputs, _ = ZOO["cnn"].batch(6, generator)
    return traced_step(ZOO["cnn"].build().double(), tuple(x.double() for x in inputs))


def events(step: minidp.Trace, stage: str) -> list[minidp.tracing.Event]:
    return [e for e in step.events if e.stage == stage]


def test_every_replica_has_a_forward_and_a_backward_event(cnn_step):
    for stage in ("forward", "backward"):
        assert sorted(e.replica for e in events(cnn_step, stage)) == list(range(REPLICAS))


def test_every_stage_is_recorded_once_per_replica(cnn_step):
    for stage in STAGES:
        assert sorted(e.replica for e in events(cnn_step, stage)) == list(range(REPLICAS)), stage


def test_replicas_run_forward_in_their_own_threads(cnn_step):
    threads = [e.thread for e in sorted(events(cnn_step, "forward"), key=lambda e: e.replica)]
    assert len(set(threads)) == REPLICAS


def test_the_replicas_threads_are_named_as_the_workers_they_are_not_as_replicas(cnn_step):
    # a call hands out whichever workers are idle: worker N may serve any replica, which the event names itself
    threads = {e.replica: e.thread for e in events(cnn_step, "forward")}
    assert threads[0] == threading.current_thread().name
    assert all(re.fullmatch(r"minidp-worker-\d+", threads[replica]) for replica in range(1, REPLICAS)), threads


def test_events_nest_inside_the_step(cnn_step):
    for e in cnn_step.events:
        assert 0 <= e.start and e.duration >= 0 and e.end <= cnn_step.duration, e


def test_stages_follow_the_order_of_a_step(cnn_step):
    for replica in range(REPLICAS):
        mine = {e.stage: e for e in cnn_step.events if e.replica == replica}
        assert mine["scatter"].end <= mine["forward"].start
        assert mine["forward"].end <= mine["gather"].end
        assert mine["gather"].end <= mine["backward"].start
        assert mine["backward"].end <= mine["reduce"].end


def test_scatter_copies_the_chunks_of_all_but_the_first_replica_on_the_inputs_device_and_reports_chunk_shapes(cnn_step):
    # 6 rows on 3 CPU replicas: replica 0's chunk is a view of the batch, the others' copies of their own (a chunk
    # shared by replicas on one device would let one replica's in-place change reach another's).
    chunk_bytes = 2 * 1 * 28 * 28 * 8
    assert {e.replica: e.bytes for e in events(cnn_step, "scatter")} == {0: 0, **dict.fromkeys(range(1, REPLICAS), chunk_bytes)}
    for e in events(cnn_step, "scatter"):
        assert "(2, 1, 28, 28)" in e.detail


def test_gather_bytes_are_each_replicas_output(cnn_step):
    classes = 10
    for e in events(cnn_step, "gather"):
        assert e.bytes == 2 * classes * 8  # two rows of float64 logits, copied by the concatenation


def test_reduce_bytes_are_the_sums_on_replica_0_and_nothing_for_gradients_added_where_they_lie(cnn_step):
    # Fresh memory, as every stage counts it: the sums (the torch backend starts each from a copy of replica 0's
    # gradient); replicas on the destination's device are added where they lie (on another GPU: copied there first)
    model_bytes = sum(p.numel() * 8 for p in ZOO["cnn"].build().parameters())
    assert {e.replica: e.bytes for e in events(cnn_step, "reduce")} == {0: model_bytes, **dict.fromkeys(range(1, REPLICAS), 0)}
    for e in events(cnn_step, "reduce"):
        assert re.search(r"summed onto cpu, backends: (ext|torch) \(6\)$", e.detail), e.detail


def test_an_output_returned_in_two_places_is_two_copies_in_the_gather_bytes(generator):
    # gather joins each place of the output on its own (torch.cat each): the tensor returned twice, and a view of it,
    # are three copies of this replica's rows, as the gathered tuple holds three new tensors
    class Twice(nn.Module):
        def forward(self, x):
            y = x * 2
            return y, y, y[:, 1:]

    with minidp.trace() as step:
        gathered = minidp.DataParallel(Twice(), cpu_ids(2))(torch.randn(6, 4, generator=generator))
    assert len({t.data_ptr() for t in gathered}) == 3
    assert [e.bytes for e in events(step, "gather")] == [2 * (3 * 4 * 4) + 3 * 3 * 4] * 2  # 3 rows each, float32


def test_a_weight_tied_between_two_modules_is_one_gradient_at_the_end_of_each_backward(generator):
    # one parameter (parameters() lists it once, and reduce sums one gradient), whichever way the backwards ran
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            self.second.weight = self.first.weight

        def forward(self, x):
            return self.second(torch.tanh(self.first(x)))

    step = traced_step(Tied(), (torch.randn(6, 4, generator=generator),))
    assert [e.detail for e in events(step, "backward")] == ["1 gradients at its end"] * REPLICAS
    assert all(e.detail.startswith("1 gradients summed") for e in events(step, "reduce"))


def test_replicate_aliases_parameters_and_clones_buffers_for_replicas_after_the_first(generator):
    # Stock: replica 0 shares the original's buffers, later replicas get private copies.
    model = ResNetBlockBN().double()
    inputs, _ = ZOO["resnet_bn"].batch(6, generator)
    step = traced_step(model, tuple(x.double() for x in inputs))
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    copied = {e.replica: e.bytes for e in events(step, "replicate")}
    assert copied == {0: 0, **{r: buffer_bytes for r in range(1, REPLICAS)}}


def test_replicate_counts_a_buffer_two_modules_share_once(generator):
    """One buffer registered in two modules is one tensor, cloned once for replica 1 (as the memory ledger counts it);
    the replicate event summed it once per module."""
    shared = torch.randn(256, generator=generator)
    model = nn.Sequential(nn.Identity(), nn.Identity())
    for module in model:
        module.register_buffer("scale", shared)
    with minidp.trace() as step:
        minidp.replicate(model, cpu_ids(2))
    assert {e.replica: e.bytes for e in step.events if e.stage == "replicate"} == {0: 0, 1: shared.nbytes}


def test_reduce_bytes_of_a_sparse_gradient_are_its_indices_and_values(generator):
    # A sparse tensor has no nbytes, storage or data pointer of its own: counting it as a dense one raised.
    model = minidp.DataParallel(nn.Embedding(100, 4, sparse=True), cpu_ids(2))
    with minidp.trace() as step:
        model(torch.randint(0, 100, (4, 3), generator=generator)).sum().backward()
    # each replica looks up 2 rows of 3 indices: its gradient keeps one int64 index and 4 float32 values per lookup,
    # and their sum (replica 0's event) all 12 lookups
    assert [e.bytes for e in events(step, "reduce")] == [12 * 8 + 12 * 4 * 4, 0]


def test_gather_bytes_count_the_tensors_inside_an_object_gather_rebuilds_from_its_items(generator):
    # a Hugging Face DynamicCache (here its shape, LayerCache): gather concatenates each layer's keys and values into
    # fresh memory, as it does the logits; the trace counted the logits only
    class Caching(nn.Module):
        def forward(self, x):
            return {"logits": x * 2, "cache": LayerCache([(x + 1, x - 1)])}

    with minidp.trace(ledger=True) as step:
        minidp.DataParallel(Caching(), cpu_ids(2))(torch.randn(6, 4, generator=generator))
    assert [e.bytes for e in events(step, "gather")] == [3 * (3 * 4 * 4)] * 2  # 3 rows each, 3 tensors, float32
    device_row = next(row for row in step.ledger() if row.device == "cpu" and row.replica is None)
    assert device_row.held["gathered outputs"] == 3 * 6 * 4 * 4  # the ledger's gathered outputs, the cache's too


def test_gather_bytes_of_sparse_outputs_are_their_indices_and_values(generator):
    class Sparse(nn.Module):
        def forward(self, x):
            return x.to_sparse()

    with minidp.trace() as step:
        minidp.DataParallel(Sparse(), cpu_ids(2))(torch.rand(4, 3, generator=generator) + 1)  # no zero: 6 values each
    assert [e.bytes for e in events(step, "gather")] == [2 * 6 * 8 + 6 * 4] * 2  # 2 x 6 int64 indices, 6 floats


def test_replicate_clones_a_sparse_buffer_for_replicas_after_the_first():
    model = nn.Module()
    model.register_buffer("table", torch.eye(3).to_sparse())  # 3 values: 2 x 3 int64 indices and 3 floats
    with minidp.trace() as step:
        minidp.replicate(model, cpu_ids(2))
    assert {e.replica: e.bytes for e in events(step, "replicate")} == {0: 0, 1: 2 * 3 * 8 + 3 * 4}


def test_nothing_is_recorded_after_the_trace_ends(generator):
    model = ZOO["mlp"].build()
    step = traced_step(model, (torch.randn(4, 16, generator=generator),))
    count = len(step.events)
    minidp.DataParallel(model, cpu_ids(2))(torch.randn(4, 16, generator=generator)).sum().backward()
    assert len(step.events) == count


def test_a_trace_whose_events_are_not_read_yet_keeps_no_replica_output_alive(generator):
    # Held for counting until the events were read, the replicas' outputs cost the traced step 1.6 to 3.9 points
    # (BENCHMARKS.md, "The targets in one afternoon"); the gather describer counts them at once instead.
    network = ZOO["mlp"].build()
    outputs = []
    network.register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))  # every replica's
    model = minidp.DataParallel(network, cpu_ids(2))
    # (Without grad: with it, where the backward runs in parallel, gather gets the joining node's aliases of them.)
    with minidp.trace() as step, torch.no_grad():
        model(torch.randn(4, 16, generator=generator))
    assert len(outputs) == 2
    assert [output() for output in outputs] == [None, None]
    assert [e.bytes for e in events(step, "gather")] == [2 * 4 * 4] * 2  # and still counted: two rows of 4 floats


def test_a_trace_of_a_training_loop_is_freed_once_the_caller_lets_go_of_it(generator):
    # Each traced step holds its tensors until its events are read; a trace that outlived its last reference
    # (a loop of hooks through autograd's nodes, which the garbage collector cannot see) kept them for good.
    model = minidp.DataParallel(ZOO["cnn"].build(), cpu_ids(2))
    inputs, _ = ZOO["cnn"].batch(8, generator)
    traces = []
    for _ in range(3):
        with minidp.trace() as step:
            model(*inputs).sum().backward()
        assert step.events
        traces.append(weakref.ref(step))
        del step
    gc.collect()
    assert [trace() for trace in traces] == [None] * 3


def test_the_replicas_of_a_data_parallel_inside_a_replica_have_their_backward_spans_too(generator):
    # Their parameters are the outer replica's, plain attributes there (replicate finds none, as stock's does in a
    # replica): the gradients of those end their spans.
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        def forward(self, x):
            return minidp.data_parallel(self.inner, x, cpu_ids(2))

    model = minidp.DataParallel(Nested(), cpu_ids(2))
    with minidp.trace() as step:
        model(torch.randn(8, 4, generator=generator)).sum().backward()
    backwards = events(step, "backward")
    assert sorted(e.replica for e in backwards) == [0, 0, 0, 1, 1, 1]  # 2 outer replicas, 2 inner in each
    last_forward_end = max(e.end for e in events(step, "forward"))
    assert all(last_forward_end <= e.start <= e.end <= step.duration for e in backwards)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-backward", "serial-backward"])
def test_each_backward_of_a_kept_graph_is_a_backward_event_of_its_own(generator, parallel):
    """Two backwards of one graph (the first with ``retain_graph``) in one trace: as there are two reduce events per
    replica, there are two backward events, neither covering what ran between them (one event, first start to last
    end, counted the pause as backward)."""
    wrapper = minidp.DataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), cpu_ids(2))
    previous = minidp.set_parallel_backward(parallel)
    try:
        with minidp.trace() as step:
            loss = wrapper(torch.randn(8, 4, generator=generator)).sum()
            loss.backward(retain_graph=True)
            loss.backward()
    finally:
        minidp.set_parallel_backward(previous)
    for replica in (0, 1):
        backwards = [e for e in step.events if e.stage == "backward" and e.replica == replica]
        reduces = [e for e in step.events if e.stage == "reduce" and e.replica == replica]
        assert len(backwards) == len(reduces) == 2
        assert backwards[0].end <= reduces[0].end <= backwards[1].start  # the first backward's reduction ends it


class _CheckpointedInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.layers, x, use_reentrant=True)


def test_a_replica_whose_layers_are_recomputed_by_a_reentrant_checkpoint_has_its_backward_event(generator):
    """The checkpoint's own backward (a graph task inside the step's) delivers the parameters' gradients: their marks
    belong to the pass that began before them (grouped by graph task alone, the event was lost)."""
    with minidp.trace() as step:
        x = torch.randn(8, 4, generator=generator, requires_grad=True)  # a re-entrant checkpoint needs an input that does
        minidp.DataParallel(_CheckpointedInside(), cpu_ids(2))(x).sum().backward()
    assert sorted(e.replica for e in step.events if e.stage == "backward") == [0, 1]


def test_traces_do_not_nest():
    with minidp.trace():
        with pytest.raises(RuntimeError, match="a trace is already recording in this process"):
            with minidp.trace():
                pass


def test_a_trace_entered_a_second_time_is_refused_as_not_reentrant(generator):
    """As torch's profiler: a second block would add its steps to the first's record, timed by the second alone."""
    step = minidp.trace()
    with step:
        minidp.DataParallel(nn.Linear(4, 2), cpu_ids(2))(torch.randn(4, 4, generator=generator)).sum().backward()
    events = step.events
    with pytest.raises(RuntimeError, match=r"minidp\.trace\(\) is not reentrant.*new minidp\.trace\(\) for each block"):
        with step:
            pass
    assert step.steps == 1 and step.events == events
    with minidp.trace():  # the refused entry left the process's one trace slot free
        pass


def test_a_trace_opened_in_another_thread_while_one_records_says_a_trace_records_every_thread():
    # Nothing nests here: the open trace is the process's, and records the other thread's steps too.
    errors = []

    def open_a_trace():
        try:
            with minidp.trace():
                pass
        except RuntimeError as error:
            errors.append(str(error))

    with minidp.trace():
        other = threading.Thread(target=open_a_trace)
        other.start()
        other.join()
    assert len(errors) == 1
    assert "already recording in this process (this thread's or another thread's)" in errors[0]
    assert "records the steps of every thread" in errors[0]


READERS = {
    "events": lambda step, folder: step.events,
    "duration": lambda step, folder: step.duration,
    "table": lambda step, folder: step.table(),
    "summary": lambda step, folder: step.summary(),
    "to_chrome": lambda step, folder: step.to_chrome(folder / "step.json"),
    "ledger": lambda step, folder: step.ledger(),
    "write_trace_artifacts": lambda step, folder: write_trace_artifacts(step, folder / "out"),
}


@pytest.mark.parametrize("reader", READERS.values(), ids=READERS.keys())
def test_reading_a_trace_inside_its_with_block_raises_and_says_to_read_it_after(reader, generator, tmp_path):
    # Inside the block the duration is still 0 and the backward's events unwritten: the table showed a step of
    # 0.00 ms, a negative "(other)" and no backward row.
    model = minidp.DataParallel(ZOO["mlp"].build(), cpu_ids(2))
    with minidp.trace(ledger=True) as step:
        model(torch.randn(4, 16, generator=generator)).sum().backward()
        with pytest.raises(RuntimeError, match="still recording.*read it after the with block"):
            reader(step, tmp_path)
        assert not (tmp_path / "out").exists()  # refused before any folder was made
    reader(step, tmp_path)  # and answers once the block has ended


@pytest.mark.parametrize("reader", READERS.values(), ids=READERS.keys())
def test_reading_a_trace_that_never_recorded_raises_and_says_how_to_record(reader, tmp_path):
    # minidp.trace() not entered: the table said "0 traced steps", to_chrome and plot wrote empty files
    with pytest.raises(RuntimeError, match=r"never recorded.*with minidp.trace\(\) as step"):
        reader(minidp.trace(ledger=True), tmp_path)
    assert not (tmp_path / "out").exists()


def test_stages_show_in_torch_profiler_without_the_tracer(generator):
    model = minidp.DataParallel(ZOO["mlp"].build(), cpu_ids(2))
    with torch.profiler.profile() as profile:
        model(torch.randn(4, 16, generator=generator)).sum().backward()
    names = {item.key for item in profile.key_averages()}
    assert {f"minidp::{s}" for s in ("scatter", "replicate", "forward", "gather", "reduce")} <= names


def test_table_has_a_row_for_every_stage_and_the_memory_peak(cnn_step):
    table = cnn_step.table()
    for stage in STAGES:
        assert any(line.startswith(stage) for line in table.splitlines()), stage
    assert "peak memory cpu" in table
    shares = [row["share"] for row in cnn_step.summary()]
    assert all(0 <= s <= 1 for s in shares)


def test_table_heading_says_how_many_steps_the_trace_covers(generator):
    model = minidp.DataParallel(ZOO["mlp"].build(), cpu_ids(2))
    with minidp.trace() as step:
        for _ in range(3):
            model(torch.randn(4, 16, generator=generator)).sum().backward()
    assert step.table().startswith("3 traced steps: ")


def _hold_fresh_memory(nbytes: int) -> None:
    """Make ``nbytes`` resident, then free them: a mapping of their own, every page written, then unmapped. (Not a
    tensor: malloc may serve one from memory an earlier test freed that is still resident, so the process's RSS does
    not move; that happened after torchvision's models, in one run of three.)"""
    block = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        block[offset] = 1
    block.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU peak is the kernel's RSS high-water mark")
def test_cpu_memory_peak_sees_memory_held_only_inside_the_step():
    with minidp.trace() as step:
        _hold_fresh_memory(64 * 2**20)
    (cpu,) = [peak for peak in step.memory if peak.device == "cpu"]
    assert cpu.bytes >= 60 * 2**20


# The trace reads its end through getrusage, whose ru_maxrss also keeps what the process's previous program held
# before exec-ing this one (minidp/tracing/memory.py, PeakResidentMemory): that figure must not pass for the step's.
# 64 MiB, above glibc's largest threshold for serving an allocation from its heap (32 MiB): a mapping of its own,
# every page written and resident. (16 MiB were served in part from memory the imports freed and left resident: 14.6
# MiB of RSS, once `import minidp` imported minidp.distributed.)
_TRACED_AFTER_EXEC = """
import torch, minidp
with minidp.trace() as step:
    block = torch.ones(64 * 2**20 // 4)
    del block
print([peak.bytes for peak in step.memory if peak.device == "cpu"][0])
"""
_EXEC_FROM_A_LARGER_PROGRAM = f"""
import os, sys
block = b"1" * 2**30  # 1 GiB written, so resident, in the program that exec-s the traced one
os.execv(sys.executable, [sys.executable, "-c", {_TRACED_AFTER_EXEC!r}])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU peak is the kernel's RSS high-water mark")
@pytest.mark.fresh_interpreter
def test_cpu_memory_peak_is_not_the_peak_of_the_program_that_exec_ed_this_one():
    done = fresh_python("-c", _EXEC_FROM_A_LARGER_PROGRAM)
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split()[-1])
    assert 60 * 2**20 <= peak < 128 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU peak is the kernel's RSS high-water mark")
def test_cpu_memory_peak_read_through_getrusage_alone_sees_memory_held_only_inside_the_step(monkeypatch):
    def no_status_file(field):
        raise AssertionError("the status file was read")

    # As in a process whose earlier ru_maxrss readings show its previous program held less than it holds now.
    monkeypatch.setattr(PeakResidentMemory, "_least_max_resident", 0)
    monkeypatch.setattr(PeakResidentMemory, "_status", staticmethod(no_status_file))
    with minidp.trace() as step:
        _hold_fresh_memory(64 * 2**20)
    (cpu,) = [peak for peak in step.memory if peak.device == "cpu"]
    assert 60 * 2**20 <= cpu.bytes < 2**40


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU peak is the kernel's RSS high-water mark")
def test_cpu_memory_peak_falls_back_to_the_status_file_where_getrusage_cannot_serve(monkeypatch):
    # As in a process exec-ed from a giant: every ru_maxrss read is the giant's figure.
    monkeypatch.setattr(PeakResidentMemory, "_least_max_resident", None)
    monkeypatch.setattr(PeakResidentMemory, "_max_resident", staticmethod(lambda: 2**50))
    with minidp.trace() as step:
        _hold_fresh_memory(64 * 2**20)
    (cpu,) = [peak for peak in step.memory if peak.device == "cpu"]
    assert 60 * 2**20 <= cpu.bytes < 2**40


def test_chrome_trace_loads_and_has_complete_events_on_one_track_per_replica(cnn_step, tmp_path):
    data = json.loads(cnn_step.to_chrome(tmp_path / "trace.json").read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in complete} == set(STAGES) | {"step"}
    assert all({"ts", "dur", "pid", "tid"} <= set(e) for e in complete)
    tracks = {(e["pid"], e["tid"]) for e in complete if e["name"] == "forward"}
    assert len(tracks) == REPLICAS
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {f"replica {r}" for r in range(REPLICAS)}


def test_plot_draws_one_lane_per_replica_in_the_stage_colours(cnn_step, generator, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    from matplotlib.colors import to_rgb

    pixels = image.imread(cnn_step.plot(tmp_path / "step.png"))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    rgb = pixels[..., :3]
    for stage in ("forward", "backward"):  # the long stages are wide enough to have plain pixels
        colour = torch.tensor(to_rgb(STAGE_COLOURS[stage]), dtype=torch.float32)
        assert (torch.from_numpy(rgb.copy()) - colour).abs().amax(-1).lt(0.01).any(), stage
    inputs, _ = ZOO["mlp"].batch(4, generator)
    fewer = traced_step(ZOO["mlp"].build(), inputs, replicas=2)
    assert image.imread(fewer.plot(tmp_path / "two.png")).shape[0] < pixels.shape[0]  # one lane per replica


def test_write_trace_artifacts_writes_table_chrome_trace_and_timeline(cnn_step, tmp_path):
    pytest.importorskip("matplotlib")
    written = write_trace_artifacts(cnn_step, tmp_path / "out")
    assert sorted(p.name for p in written.values()) == ["table.txt", "timeline.png", "trace.json"]
    assert written["timeline"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert written["table"].read_text().startswith("one traced step")


def test_plot_without_matplotlib_says_how_to_install_it(cnn_step, tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'minidp\[plot\]'"):
        cnn_step.plot(tmp_path / "step.png")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1_048_575, "1.0 MiB"),
                                     (5 * 2**30, "5.0 GiB"), (3 * 2**40, "3072.0 GiB")])
def test_byte_counts_are_printed_in_the_largest_unit_that_fits(n, text):
    # the tables' sizes: 5 GiB was "5120.0 MiB" and 1,048,575 B "1024.0 KiB"
    assert minidp.tracing.views.bytes_text(n) == text


@pytest.mark.parametrize("stage", ["replicate", "gather"])
def test_a_stages_time_leaves_out_the_tracers_own_bookkeeping(monkeypatch, stage, generator):
    """minidp/tracing/describers.py: the describers' bookkeeping is kept out of the stage's own time. A describer that
    takes 50 ms (a walk of a large tree, thousands of outputs counted) left the stage's event 50 ms longer."""
    slow = describers.DESCRIBERS[stage]

    def taking_its_time(tracer, arguments, result):
        time.sleep(0.05)
        return slow(tracer, arguments, result)

    monkeypatch.setitem(describers.DESCRIBERS, stage, taking_its_time)
    model = minidp.DataParallel(nn.Linear(4, 3), cpu_ids(2))
    with minidp.trace() as step:
        model(torch.randn(6, 4, generator=generator))
    durations = [e.duration for e in step.events if e.stage == stage]
    assert len(durations) == 2 and max(durations) < 0.05


def test_reduce_bytes_of_half_precision_gradients_count_the_torch_backends_float32_sums(generator):
    # minidp/comm.py: the torch backend sums bfloat16 gradients in a float32 copy of replica 0's, then rounds it into
    # the result, both fresh memory; the event counted the result alone (a third of it)
    model = minidp.DataParallel(nn.Linear(16, 8, bias=False).to(torch.bfloat16), cpu_ids(2), reduce_backend="torch")
    with minidp.trace() as step:
        model(torch.randn(6, 16, generator=generator).to(torch.bfloat16)).float().sum().backward()
    assert [e.bytes for e in events(step, "reduce")] == [16 * 8 * (2 + 4), 0]


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_replicas_without_a_trainable_parameter_have_their_backward_recorded_too(generator, parallel, replicas):
    # A frozen backbone fed by a trainable layer outside it (or a gradient taken for the input): the span ended on the
    # replica's parameters' gradients, which never come, and the serial backward's events were dropped; it ends on
    # its inputs' gradients now, as a backward run as one call ends on its return; so does the backward of the module
    # alone on its one device (docs/stock-behaviour.md B9), which had no event either
    body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).requires_grad_(False)
    embed = nn.Linear(8, 8)
    previous = minidp.set_parallel_backward(parallel)
    try:
        model = minidp.DataParallel(body, cpu_ids(replicas))
        with minidp.trace() as step:
            model(embed(torch.randn(6, 8, generator=generator))).sum().backward()
    finally:
        minidp.set_parallel_backward(previous)
    assert sorted(e.replica for e in step.events if e.stage == "backward") == list(range(replicas))


def test_a_module_on_one_device_has_its_backward_recorded_and_its_parameters_keep_no_hook(generator):
    # docs/stock-behaviour.md B9: with one device id nothing is replicated and the module itself runs; its backward was
    # not watched, and the table put it in "(other)". Hooks on its own parameters (leaves) would outlive the trace.
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model = minidp.DataParallel(module, ["cpu"])
    for _ in range(2):
        with minidp.trace() as step:
            model(torch.randn(6, 4, generator=generator)).sum().backward()
        assert [e.replica for e in step.events if e.stage == "backward"] == [0]
    assert all(not p._backward_hooks for p in module.parameters())


def test_tracks_and_rows_follow_the_devices_index_as_a_number():
    # sorted as strings, cuda:10 came before cuda:2 (a machine with more than ten GPUs)
    from minidp.tracing import views
    from minidp.tracing.recorder import Event

    class Recorded:
        events = [Event(stage, replica, device, 0.0, 1.0) for replica, device in enumerate(["cuda:10", "cuda:2", "cpu"])
                  for stage in ("forward", "backward")]
        duration = 1.0

    assert views.lanes(Recorded()) == [("cpu", 2), ("cuda:2", 1), ("cuda:10", 0)]
    assert [row["device"] for row in views.summary(Recorded())][:3] == ["cpu", "cuda:2", "cuda:10"]


def test_several_steps_of_a_module_on_one_device_in_one_trace_each_have_their_own_backward(generator):
    # Each step's forward put another hook on every parameter, kept to the trace's end: every later backward fired all
    # of them, the first steps' spans stretched to the last (207, 155, 103, 52 ms for 0.2 ms backwards), and a loop of
    # 200 steps in one trace ran 20 times slower
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model = minidp.DataParallel(module, ["cpu"])
    with minidp.trace() as step:
        for _ in range(4):
            model(torch.randn(6, 4, generator=generator)).sum().backward()
            time.sleep(0.02)
    backwards = [e for e in step.events if e.stage == "backward"]
    assert len(backwards) == 4
    assert all(e.duration < 0.02 and e.detail == "4 gradients at its end" for e in backwards)
    assert all(not p._backward_hooks for p in module.parameters())


def test_leaf_inputs_of_frozen_replicas_keep_no_hook_after_the_trace(generator):
    # A hook on a tensor the caller keeps (a leaf given to parallel_apply) would outlive the step, one more per trace
    replicas = minidp.replicate(nn.Linear(4, 3).requires_grad_(False), cpu_ids(2))
    leaves = [torch.randn(3, 4, generator=generator, requires_grad=True) for _ in range(2)]
    for _ in range(3):
        with minidp.trace():
            outputs = minidp.parallel_apply(replicas, [(x,) for x in leaves])
            sum(o.sum() for o in outputs).backward()
    assert all(not x._backward_hooks for x in leaves)


def test_a_listener_without_the_inputs_method_still_hears_every_replicas_outputs(generator):
    # minidp/hooks.py: on_replica_inputs is optional, as on_storage and on_wait are
    listener = HearsOutputs()
    previous = minidp.hooks.set_listener(listener)
    try:
        minidp.DataParallel(nn.Linear(4, 3), cpu_ids(2))(torch.randn(6, 4, generator=generator)).sum().backward()
    finally:
        minidp.hooks.set_listener(previous)
    assert [count for count, _ in listener.announced] == [2]
