"""Gradient reduction: the csrc extension against the plain torch loop and stock's algorithm.

    python -m pytest benchmarks/bench_reduce.py                        # pytest-benchmark
    MINIDP_BENCH_QUICK=1 python -m pytest benchmarks/bench_reduce.py   # CI-sized, well under a minute
    python benchmarks/bench_reduce.py --summary                        # table of ratios

Each group is one case and replica count K; its members, measured in the same run:

* ``comm``: ``minidp.comm.reduce_add_coalesced(..., backend="ext")``, the reduction as a step uses it
  (its checks in Python, then the extension); the sums are dropped before the next call, as
  ``zero_grad(set_to_none=True)`` drops gradients, so their memory is reused;
* ``ext``: ``minidp.ext.reduce_add_coalesced`` alone, its sums dropped the same way;
* ``ext_into``: the extension writing into outputs allocated once beforehand, i.e. the kernel alone;
* ``torch``: the core's torch backend, ``minidp.comm.reduce_add_coalesced(..., backend="torch")``;
* ``stock``: on a GPU, ``torch.nn.parallel.comm.reduce_add_coalesced`` itself. It asserts on CPU
  tensors, so on the CPU this is its algorithm rebuilt from the same torch helpers: per replica
  the tensors are flattened into buckets of at most 10 MiB, bucket j is summed across replicas
  with sequential adds, and the sums are unflattened;
* ``copy``: ``dst.copy_(src)`` over as many elements as the case holds, the memory bandwidth
  the floor is computed from: a reduction must move at least (K + 1) * P * bytes (read K
  replicas, write one result), which takes (K + 1) / 2 copy times. Counting the read each
  store does first (read for ownership), a copy moves 3 streams and the reduction K + 2, so the
  table also gives that stricter floor, (K + 2) / 3 copy times ("%rfo").

Cases: ``big``, one float32 tensor of 32M elements; ``resnet50``, the 161 float32 gradients of
ResNet-50 (25.6M values). MINIDP_BENCH_DEVICE=cpu|cuda picks the device (default: cuda when
available); on a single GPU all replicas share it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch._utils import _flatten_dense_tensors, _take_tensors, _unflatten_dense_tensors

from minidp import comm, ext

QUICK = os.environ.get("MINIDP_BENCH_QUICK") == "1"
DEVICE = torch.device(os.environ.get("MINIDP_BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
REPLICAS = (4,) if QUICK else (2, 4, 8)
ROUNDS = 3 if QUICK else 7
STOCK_BUCKET_BYTES = 10 * 2**20  # stock's buffer_size


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's resnet50 in parameters() order: 161 tensors, 25,557,032 values."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]  # conv1, bn1
    inplanes = 64
    for planes, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for block in range(blocks):
            out = planes * 4
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,)]  # conv1, bn1
            shapes += [(planes, planes, 3, 3), (planes,), (planes,)]  # conv2, bn2
            shapes += [(out, planes, 1, 1), (out,), (out,)]  # conv3, bn3
            if block == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]  # downsample conv, bn
            inplanes = out
    return shapes + [(1000, 2048), (1000,)]  # fc


CASES = {"big": [((8 if QUICK else 32) * 2**20,)], "resnet50": resnet50_shapes()}


def replica_devices(num_replicas: int) -> list[torch.device]:
    """Replica k's device: its own GPU when there are enough, else the destination's."""
    if DEVICE.type == "cuda" and torch.cuda.device_count() >= num_replicas:
        return [torch.device("cuda", k) for k in range(num_replicas)]
    return [DEVICE] * num_replicas


def make_inputs(case: str, num_replicas: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(num_replicas)
    return [
        [torch.randn(shape, generator=gen).to(device) for shape in CASES[case]]
        for device in replica_devices(num_replicas)
    ]


def stock_cpu(inputs: list[list[torch.Tensor]], destination: torch.device) -> list[torch.Tensor]:
    """Stock reduce_add_coalesced's dense path with plain adds, runnable on CPU tensors."""
    buckets = [list(_take_tensors(replica, STOCK_BUCKET_BYTES)) for replica in inputs]
    outputs: list[torch.Tensor] = []
    for chunks in zip(*buckets):
        flat = [_flatten_dense_tensors(chunk).to(destination) for chunk in chunks]
        total = flat[0].clone() if len(flat) == 1 else flat[0] + flat[1]
        for other in flat[2:]:
            total.add_(other)
        outputs += _unflatten_dense_tensors(total, chunks[0])
    return outputs


def stock(inputs: list[list[torch.Tensor]], destination: torch.device) -> list[torch.Tensor]:
    if destination.type == "cuda":
        return list(torch.nn.parallel.comm.reduce_add_coalesced(inputs, destination))
    return stock_cpu(inputs, destination)


def members(inputs: list[list[torch.Tensor]]) -> dict[str, Callable[[], object]]:
    """What each group measures, as no-argument callables over the same inputs."""
    flat = torch.cat([t.flatten() for t in inputs[0]])
    copy_dst = torch.empty_like(flat).fill_(0)  # touched once, as a gradient buffer in use is
    outputs = [torch.empty_like(t).fill_(0) for t in inputs[0]]
    op = ext.load()
    return {
        "comm": lambda: comm.reduce_add_coalesced(inputs, DEVICE, backend="ext"),
        "ext": lambda: ext.reduce_add_coalesced(inputs, DEVICE),
        "ext_into": lambda: op.reduce_add_into(inputs, outputs),
        "torch": lambda: comm.reduce_add_coalesced(inputs, DEVICE, backend="torch"),
        "stock": lambda: stock(inputs, DEVICE),
        "copy": lambda: copy_dst.copy_(flat),
    }


def synchronized(fn: Callable[[], object]) -> Callable[[], object]:
    """fn, waiting for the GPU to finish, so the wall time covers the work."""
    if DEVICE.type != "cuda":
        return fn

    def run() -> object:
        result = fn()
        torch.cuda.synchronize()
        return result

    return run


# --- pytest-benchmark ---------------------------------------------------------------------

MEMBERS = ("comm", "ext", "ext_into", "torch", "stock", "copy")
_inputs_cache: dict[tuple[str, int], list[list[torch.Tensor]]] = {}


def _inputs(case: str, num_replicas: int) -> list[list[torch.Tensor]]:
    # One set of inputs per group at a time, so K = 8 on the big case fits next to nothing else.
    if (case, num_replicas) not in _inputs_cache:
        _inputs_cache.clear()
        _inputs_cache[(case, num_replicas)] = make_inputs(case, num_replicas)
    return _inputs_cache[(case, num_replicas)]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", list(CASES))
        metafunc.parametrize("num_replicas", REPLICAS, ids=lambda k: f"K{k}")
        metafunc.parametrize("member", MEMBERS)


def bench_reduce(benchmark, case, num_replicas, member):
    import pytest

    if not ext.is_available():
        pytest.skip("the minidp extension is not available")
    inputs = _inputs(case, num_replicas)
    fn = synchronized(members(inputs)[member])
    benchmark.group = f"{case} K={num_replicas} {DEVICE.type}"
    benchmark.extra_info.update(case=case, replicas=num_replicas, device=str(DEVICE),
                                elements=sum(t.numel() for t in inputs[0]))
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=1)


# --- summary table ------------------------------------------------------------------------


def median_ms(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median wall time of each callable, in ms. Rounds go round-robin over the members, so a
    change in machine load during the run hits all of them alike and the ratios stay fair."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(ROUNDS + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_:  # round 0 warms up: first-call costs (allocator, caches) are not compared
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def summary() -> list[dict]:
    """Median times of every member for every case and K, measured in this one run."""
    rows = []
    for case in CASES:
        for num_replicas in REPLICAS:
            inputs = make_inputs(case, num_replicas)
            ms = median_ms({name: synchronized(fn) for name, fn in members(inputs).items()})
            elements = sum(t.numel() for t in inputs[0])
            floor_ms = ms["copy"] * (num_replicas + 1) / 2
            rows.append({
                "case": case, "K": num_replicas, "elements": elements, **{f"{k}_ms": v for k, v in ms.items()},
                "copy_GBps": 2 * elements * inputs[0][0].element_size() / ms["copy"] / 1e6,
                "floor_ms": floor_ms,
                "ext/torch": ms["ext"] / ms["torch"], "ext/stock": ms["ext"] / ms["stock"],
                "comm/torch": ms["comm"] / ms["torch"], "comm_floor_pct": 100 * floor_ms / ms["comm"],
                "ext_floor_pct": 100 * floor_ms / ms["ext"], "ext_into_floor_pct": 100 * floor_ms / ms["ext_into"],
                # A store first reads its cache line (read for ownership): a copy moves 3 streams,
                # not 2, and the reduction K + 2. The same floor counted that way:
                "ext_rfo_floor_pct": 100 * ms["copy"] * (num_replicas + 2) / 3 / ms["ext"],
            })
            del inputs
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"device {DEVICE}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"median of {ROUNDS}, quick={QUICK}, load average {os.getloadavg()[0]:.1f}")
    head = ("case", "K", "comm ms", "ext ms", "into ms", "torch ms", "stock ms", "copy GB/s", "floor ms",
            "comm/torch", "ext/stock", "comm %floor", "ext %floor", "into %floor", "ext %rfo")
    print("  ".join(f"{h:>11}" for h in head))
    for r in rows:
        cells = (r["case"], r["K"], r["comm_ms"], r["ext_ms"], r["ext_into_ms"], r["torch_ms"], r["stock_ms"],
                 r["copy_GBps"], r["floor_ms"], r["comm/torch"], r["ext/stock"], r["comm_floor_pct"], r["ext_floor_pct"],
                 r["ext_into_floor_pct"], r["ext_rfo_floor_pct"])
        print("  ".join(f"{c:>11.2f}" if isinstance(c, float) else f"{c:>11}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", action="store_true", help="print the table of ratios")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    if not args.summary:
        parser.error("run under pytest for pytest-benchmark, or pass --summary")
    ext.load(verbose=True)
    rows = summary()
    print_table(rows)
    if args.json:
        import json

        args.json.write_text(json.dumps({"device": str(DEVICE), "quick": QUICK, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
