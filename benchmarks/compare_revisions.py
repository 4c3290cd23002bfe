"""Speed of this checkout against an earlier commit, measured in one run, as ratios.

    python benchmarks/compare_revisions.py --old 62e36ea --rounds 6

The earlier commit is checked out into a temporary git worktree. Then the two take turns: each
round runs the same workloads once with the old code and once with the new one, each in a fresh
interpreter (``PYTHONPATH`` points it at one tree or the other), so both see the same machine.
Every workload reports the median of its steps; the table gives, per workload, the median over the
rounds for old and new and their ratio (new / old: below 1 is faster). Workloads, on CPU replicas:

* ``step <model> xK``: forward, cross-entropy, backward and SGD of a zoo model through
  ``minidp.DataParallel`` on ``["cpu"] * K`` (the replica cache on, as by default);
* ``step cnn x2 traced``: the demo's step inside ``with minidp.trace():``;
* ``cached replicate resnet50 x4``: replicating a ResNet-50-shaped tree from the replica cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = r'''
import inspect, json, statistics, sys, time
import torch
import minidp
from minidp.zoo import SmallCNN, MLP, ResNetBlockBN, resnet50

torch.manual_seed(0)
torch.set_flush_denormal(True)
steps = int(sys.argv[1])
results = {}

def timed(name, step, warmup=3):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    results[name] = statistics.median(times)

def training(model, x, y, replicas, traced=False):
    wrapper = minidp.DataParallel(model, ["cpu"] * replicas)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    def step():
        optimizer.zero_grad(set_to_none=True)
        if traced:
            with minidp.trace():
                torch.nn.functional.cross_entropy(wrapper(x), y).backward()
        else:
            torch.nn.functional.cross_entropy(wrapper(x), y).backward()
        optimizer.step()
    return step

images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
timed("step cnn x2", training(SmallCNN(), images, labels, 2))
timed("step cnn x2 traced", training(SmallCNN(), images, labels, 2, traced=True))
timed("step mlp x4", training(MLP(), torch.randn(64, 16), torch.randint(0, 4, (64,)), 4))
block_in = torch.randn(32, 3, 16, 16)
block = ResNetBlockBN()
timed("step resnet_bn x2", training(block, block_in, torch.randint(0, block(block_in[:1]).shape[1], (32,)), 2))

network, devices = resnet50(base=8), ["cpu"] * 4
cache = minidp.replica_cache.ReplicaCache()
if "cache" in inspect.signature(minidp.replicate).parameters:  # before the cache became a layer of its own
    replicate = lambda: minidp.replicate(network, devices, cache=cache)
else:
    replicate = lambda: cache.replicate(network, devices)
def cached():
    replicate()
    cache.release(devices)
timed("cached replicate resnet50 x4", cached)
print(json.dumps(results))
'''


def run_workloads(tree: Path, steps: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", WORKLOADS, str(steps)], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per workload and round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        old_tree = Path(directory) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), args.old], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            old, new = [], []
            for _ in range(args.rounds):
                old.append(run_workloads(old_tree, args.steps))
                new.append(run_workloads(ROOT, args.steps))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=True)
    print(f"new ({ROOT.name}) against {args.old}: {args.rounds} alternating rounds of {args.steps} steps each")
    print(f"{'workload':<30} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for name in old[0]:
        o = statistics.median(r[name] for r in old) * 1e3
        n = statistics.median(r[name] for r in new) * 1e3
        print(f"{name:<30} {o:>9.3f} {n:>9.3f} {n / o:>8.3f}")


if __name__ == "__main__":
    main()
