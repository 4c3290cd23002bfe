"""parallel_apply's worker threads across fork, Ctrl-C, idle time and nesting.

Stock ``parallel_apply`` starts and joins fresh threads every call, so none of this can go wrong
there; minidp keeps its threads across steps (starting them costs as much as a small replica's
forward) and must behave as if it did not. What a test process cannot do to itself (fork, Ctrl-C,
a clean start) runs in a fresh interpreter, with a timeout that turns a hang into a failure.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref

import pytest
import torch
from torch import nn

import minidp
from .helpers import cpu_ids, forked_child, fresh_python

STEP = """
import torch, minidp
from torch import nn
model = minidp.DataParallel(nn.Linear(4, 3), ["cpu"] * 2)
def step(_=None):
    return model(torch.ones(4, 4)).sum().item()
expected = step()  # the parent's worker threads exist from here on
"""


def after_each_report(action: str) -> str:
    """Lines of a script: every worker started from here on runs the statements ``action`` (one line, ``;``
    between them) just after reporting a result, as a busy machine may run a thread late; the rest of its
    task (letting go of the task's tensors) comes after."""
    return f"""
import threading
from concurrent.futures import Future

def after_reporting(frame, event, arg):
    if event == "return" and frame.f_code is Future.set_result.__code__:
        {action}

threading.setprofile(after_reporting)  # for every thread started from here on: the workers
"""


@pytest.mark.fresh_interpreter
def test_a_forked_child_runs_data_parallel():
    """A child of ``os.fork()`` has none of its parent's worker threads; its first step must not wait for them."""
    script = STEP + forked_child("step() == expected", "its first DataParallel call")
    done = fresh_python("-c", script, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.fresh_interpreter
def test_a_fork_waits_for_every_worker_to_let_go_of_its_last_task():
    """A worker lets go of its task (frees its tensors, partly outside the GIL) after reporting the result, so
    the caller may fork meanwhile: the child would get memory half freed. Stock's threads are joined before
    ``parallel_apply`` returns (docs/stock-behaviour.md, B25); minidp's fork waits for its workers to let go."""
    # The worker lets go 0.3 s after the caller has its result.
    script = after_each_report('time.sleep(0.3); print("the worker let go of its task", flush=True)') + """
import os, time, torch, minidp
from torch import nn
with torch.no_grad():
    minidp.data_parallel(nn.Linear(4, 4), torch.randn(8, 4), ["cpu"] * 2)
print("forking", flush=True)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("forked", flush=True)
"""
    done = fresh_python("-c", script, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["forking", "the worker let go of its task", "forked"]


@pytest.mark.fresh_interpreter
def test_a_fork_started_multiprocessing_pool_runs_data_parallel():
    script = STEP + """
import multiprocessing
with multiprocessing.get_context("fork").Pool(1) as pool:  # leaving the block terminates the child
    assert pool.map_async(step, [0]).get(timeout=20) == [expected]  # TimeoutError if the child hangs
"""
    done = fresh_python("-c", script, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.fresh_interpreter
def test_ctrl_c_waits_for_every_replica_then_reraises():
    """Ctrl-C while replica 1 computes: KeyboardInterrupt comes once it is done, and the process exits
    cleanly (a worker left inside a kernel at exit aborts it: "terminate called without an active exception")."""
    script = """
import signal, threading, time, torch, minidp
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where a background launch left SIGINT ignored
from torch import nn

class Computes(nn.Module):
    finished = False
    def forward(self, x):
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            x = x @ torch.eye(x.shape[1])
        Computes.finished = True
        return x

threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
x = torch.randn(300, 300)
try:
    minidp.parallel_apply([nn.Identity(), Computes()], [x, x], devices=["cpu"] * 2)
except KeyboardInterrupt:
    print("KeyboardInterrupt; replica 1 finished:", Computes.finished)
"""
    done = fresh_python("-c", script, timeout=60)
    assert "KeyboardInterrupt; replica 1 finished: True" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr


def test_an_idle_worker_keeps_no_replica_output_or_graph():
    modules = [nn.Linear(3, 3), nn.Linear(3, 3)]
    outputs = minidp.parallel_apply(modules, [torch.randn(2, 3), torch.randn(2, 3)], devices=cpu_ids(2))
    replica, output = weakref.ref(modules[1]), weakref.ref(outputs[1])  # replica 1 ran on a worker
    assert outputs[1].grad_fn is not None  # the output holds the replica's graph
    del modules, outputs
    deadline = time.monotonic() + 5  # the worker lets go just after the caller has its result
    while (replica() is not None or output() is not None) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert replica() is None and output() is None


@pytest.mark.fresh_interpreter
def test_nested_data_parallel_does_not_grow_the_pool():
    """Two replicas that each run ``data_parallel`` on two replicas need three worker threads at most,
    however late a worker runs again after reporting its result: by then it is idle already."""
    script = after_each_report("time.sleep(0.02)") + """
import threading, time, torch, minidp
from torch import nn

class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
    def forward(self, x):
        return minidp.data_parallel(self.inner, x, ["cpu"] * 2)

model = Outer()
with torch.no_grad():
    for _ in range(5):
        minidp.data_parallel(model, torch.randn(8, 4), ["cpu"] * 2)
print("worker threads:", threading.active_count() - 1)
"""
    done = fresh_python("-c", script, timeout=60)
    assert done.returncode == 0, done.stderr
    label, count = done.stdout.rsplit(":", 1)
    assert label.strip() == "worker threads"
    # 3 when the two inner calls overlap; 2 when one inner call's worker is idle again before the other asks
    assert 2 <= int(count) <= 3, done.stdout


@pytest.mark.fresh_interpreter
def test_a_program_that_ends_while_a_worker_is_busy_waits_for_it_and_exits_cleanly():
    """A worker may still be inside torch after reporting its result (freeing its task's tensors) when the
    main thread ends. Stock's threads are joined before ``parallel_apply`` returns (docs/stock-behaviour.md, B25);
    minidp's are joined at exit, before the interpreter finalizes: a thread that comes back to Python after that is ended by
    ``pthread_exit``, which aborts the process when it unwinds through torch's C++ frames."""
    # The worker computes matrix products (outside the GIL) after reporting; the main thread ends meanwhile.
    busy = "torch.ones(2500, 2500) @ torch.ones(2500, 2500)"
    script = after_each_report(busy + '; print("the worker finished", flush=True)') + """
import torch, minidp
from torch import nn
with torch.no_grad():
    minidp.data_parallel(nn.Linear(4, 4), torch.randn(8, 4), ["cpu"] * 2)
print("the main thread ended", flush=True)
"""
    done = fresh_python("-c", script, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["the main thread ended", "the worker finished"]


class SlowedAtRandom(nn.Module):
    """Notes the thread it runs in, after a random pause: replicas finish in a different order at every call."""

    def __init__(self, pauses: "random.Random", seen: list) -> None:
        super().__init__()
        self.pauses, self.seen = pauses, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.pauses.uniform(0, 0.005))
        self.seen.append(threading.current_thread().name)
        return x


def test_each_replica_runs_on_the_same_worker_at_every_step_whichever_finished_first(generator):
    # Stock starts a fresh thread per replica at every call (docs/stock-behaviour.md, B25); minidp keeps its
    # workers and hands them out in the order they were started, so what a thread carries from step to step (its
    # autograd sequence numbers, below) goes with the same replica
    pauses = random.Random(int(torch.randint(1 << 30, (), generator=generator)))
    seen: list[list[str]] = [[] for _ in range(4)]
    replicas = [SlowedAtRandom(pauses, names) for names in seen]
    for _ in range(12):
        minidp.parallel_apply(replicas, [(torch.ones(1),)] * 4, devices=["cpu"] * 4)
    assert seen[0] == [threading.current_thread().name] * 12
    assert [len(set(names)) for names in seen[1:]] == [1, 1, 1]
    assert len({names[0] for names in seen[1:]}) == 3


SUMMED_OVER_REPLICAS = """
import hashlib, random, sys, time, torch, minidp
from torch import nn
minidp.set_parallel_backward(sys.argv[1] == "parallel")
pauses = random.Random()  # seeded by the OS: the replicas finish in another order in every process
torch.manual_seed(0)
shared = torch.randn(16, 16, requires_grad=True)  # a tensor every replica's forward reaches whole

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 16)
    def forward(self, x):
        time.sleep(pauses.uniform(0, 0.003))
        h = x @ shared
        for _ in range(3):
            h = torch.tanh(self.layer(h))
        return h

model = minidp.DataParallel(Model(), device_ids=["cpu"] * 4)
# another model on 3 replicas, every third step: 2 of the 4 workers make more nodes than the others
other = minidp.DataParallel(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), device_ids=["cpu"] * 3)
x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
digest = hashlib.sha1()
for step in range(20):
    if step % 3 == 0:
        other(torch.randn(6, 16)).sum().backward()
    shared.grad = None
    model(x).pow(2).sum().backward()
    digest.update(shared.grad.numpy().tobytes())
print(digest.hexdigest())
"""


@pytest.mark.fresh_interpreter
@pytest.mark.parametrize("backward", ["serial", "parallel"])
def test_a_gradient_autograd_sums_over_four_replicas_repeats_bit_for_bit_from_run_to_run(backward):
    # Autograd adds a tensor's terms in the order it runs their nodes, newest first by per-thread sequence
    # numbers: with three or more terms the order shows in the last bits, so it must not follow which worker
    # thread a replica happened to get. Stock: one fresh thread per replica, every run alike (B25).
    digests = {fresh_python("-c", SUMMED_OVER_REPLICAS, backward, timeout=120).stdout for _ in range(3)}
    assert len(digests) == 1 and all(len(d.strip()) == 40 for d in digests), digests
