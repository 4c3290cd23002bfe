"""Start N processes on this machine, joined in one process group over the loopback address.

``launch(target, processes)`` is what ``torchrun --nproc_per_node=N`` does for one machine, in a
function: it spawns the processes (``torch.multiprocessing``, start method "spawn"), and in each one
joins the group, calls ``target(*args)``, and sends the result (or the traceback) back. The
processes meet through a file in a temporary directory (``torch.distributed.FileStore``), so no port
is chosen or opened for the rendezvous; Gloo then connects them over the loopback interface. Each process
gets the environment torchrun gives its own (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), and a
target that ends the group itself (``destroy_process_group()``) or exits with status 0 ends well, as under torchrun.

A rank that raises ends the job: the others are killed at once (they may be waiting for it in a
collective) and :class:`RankFailed` carries that rank's traceback. ``timeout`` is the process
group's: how long a collective waits for a missing rank before failing. ``job_timeout`` bounds the
whole job.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import queue
import shutil
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank of a :func:`launch` job raised, died, or the job ran out of time."""

    def __init__(self, rank: Optional[int], message: str) -> None:
        super().__init__(message)
        self.rank = rank


def loopback_interface() -> Optional[str]:
    """The name of this machine's loopback network interface ("lo" on Linux, "lo0" on macOS), if any."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), None))


def _run_rank(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    timeout: float,
    threads: Optional[int],
    target: Callable[..., Any],
    args: Sequence[Any],
    results: "mp.Queue",
) -> None:
    """The body of one process: join the group, run ``target``, report back."""
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)  # Gloo's connections stay on this machine
    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "nccl" and torch.cuda.device_count():  # a GPU of its own per process, as a torchrun script sets it
        torch.cuda.set_device(rank % torch.cuda.device_count())  # (NCCL refuses two ranks on one; none: NCCL says)
    # What torchrun tells each process of its place (code reads LOCAL_RANK to pick its device); every rank is local here.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            result = target(*args)
        except SystemExit as ended:
            if ended.code not in (None, 0):
                raise
            result = None  # sys.exit() or sys.exit(0): the process ended well, as torchrun counts it
        if dist.is_initialized():  # a target may end with destroy_process_group(), as scripts for torchrun do
            dist.barrier()  # no rank closes its connections while another still talks to it
            dist.destroy_process_group()
        results.put(("result", rank, pickle.dumps(result)))
    except BaseException:
        # The traceback goes out before this process exits and the others see their connections close.
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        results.close()
        results.join_thread()


def launch(
    target: Callable[..., Any],
    processes: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout: float = 60.0,
    job_timeout: Optional[float] = None,
    threads: Optional[int] = 1,
) -> list[Any]:
    """Run ``target(*args)`` in ``processes`` new processes joined in one process group; return their results.

    Args:
        target: a function importable by name (a module-level function), called in every process
            once the group is up; ``torch.distributed.get_rank()`` tells it which rank it is.
        processes: how many processes (the world size).
        args: passed to ``target``; must be picklable, as must its return value.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (one GPU per process).
        timeout: the process group's timeout in seconds (``init_process_group(timeout=...)``).
        job_timeout: seconds for the whole job, after which every process is killed (default: none).
        threads: ``torch.set_num_threads`` in each process (default 1: N processes share the cores);
            ``None`` leaves torch's default.

    Returns the results in rank order. Raises :class:`RankFailed` with the first failing rank's
    traceback if a rank raises or dies, and kills the rest.
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    context = mp.get_context("spawn")
    results = context.Queue()
    directory = tempfile.mkdtemp(prefix="minidp-launch-")
    workers = [
        context.Process(
            target=_run_rank,
            args=(rank, processes, os.path.join(directory, "store"), backend, timeout, threads, target, tuple(args), results),
            name=f"minidp-rank-{rank}",
            # Not daemonic, as torch.multiprocessing.spawn's and torchrun's workers are not: a daemonic process may not
            # start processes of its own, and a rank's DataLoader with num_workers > 0 does. The finally below ends
            # every worker still alive whichever way the job ends.
            daemon=False,
        )
        for rank in range(processes)
    ]
    try:
        for worker in workers:
            worker.start()
        return _collect(workers, results, None if job_timeout is None else time.monotonic() + job_timeout)
    finally:
        for worker in workers:
            if worker.pid is None:  # never started
                continue
            if worker.is_alive():
                worker.kill()
            worker.join()
        shutil.rmtree(directory, ignore_errors=True)


def _collect(workers: list, results: "mp.Queue", deadline: Optional[float]) -> list[Any]:
    """Wait for every rank's message; the first error ends the wait."""
    done: dict[int, Any] = {}
    grace: Optional[float] = None  # a dead rank's last message may still be on its way
    while len(done) < len(workers):
        try:
            kind, rank, payload = results.get(timeout=0.05)
        except queue.Empty:
            dead = [rank for rank, worker in enumerate(workers) if rank not in done and worker.exitcode is not None]
            if dead:
                grace = grace or time.monotonic() + 1.0
                if time.monotonic() > grace:
                    raise RankFailed(dead[0], f"rank {dead[0]} exited with code {workers[dead[0]].exitcode} without a result (see its output above)")
            if deadline is not None and time.monotonic() > deadline:
                waiting = [rank for rank in range(len(workers)) if rank not in done]
                raise RankFailed(None, f"the job ran past its job_timeout; ranks {waiting} had not finished")
            continue
        if kind == "error":
            raise _first_failure(workers, results, done, rank, payload)
        done[rank] = pickle.loads(payload)
    return [done[rank] for rank in range(len(workers))]


# Words of an error that a collective raised because its peer was gone: Gloo's, and minidp's reducer's.
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "another rank stopped taking part")


def _first_failure(workers: list, results: "mp.Queue", done: dict[int, Any], rank: int, payload: str) -> RankFailed:
    """What to report when rank ``rank`` raised: its error, unless another rank ended without sending anything. A rank
    that a signal or ``os._exit`` ended (the out-of-memory killer, a crash in native code) sends nothing, and the others
    then fail in a collective that lost it: that rank is the first failure, and named first. A rank that ended after
    sending its message (an error, which came after this one; a result) is not."""
    others = {k for k in range(len(workers)) if k != rank and k not in done}
    ended = {k for k in others if workers[k].exitcode is not None}
    # An error of a collective that lost its peer is the consequence of another rank's end, which may not show yet: a
    # rank that os._exit ends closes its sockets before its process is gone. Then every rank that ends within the
    # second counts; else only those ended already (a rank that the error itself brought down ends after it).
    lost_peer = any(words in payload for words in _LOST_PEER)
    wait_until = time.monotonic() + 1.0  # an ended rank's message may still be on its way
    while (ended or lost_peer) and time.monotonic() < wait_until:
        try:
            _, other, _ = results.get(timeout=0.05)
        except queue.Empty:
            continue
        others.discard(other)
        ended.discard(other)
    if lost_peer:
        ended = {k for k in others if workers[k].exitcode is not None}
    if not ended:
        return RankFailed(rank, f"rank {rank} raised:\n{payload}")
    first = min(ended)
    return RankFailed(first, f"rank {first} exited with code {workers[first].exitcode} without a result (see its "
                             f"output above); then rank {rank} raised:\n{payload}")


def run_demo(processes: int, *, backend: str = "gloo", timeout: float = 60.0, **demo_options: Any) -> list[dict]:
    """``python -m minidp demo --processes N``: the demo's training in ``processes`` processes on this machine.

    ``demo_options`` are :func:`minidp.distributed.demo.train`'s keyword arguments (``epochs``,
    ``batch_size``, ``replicas``, ``lr``, ``seed``, ``samples``, ``trace``), checked here before any
    process starts. ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per process); ``timeout``:
    the process group's, in seconds. Rank 0 prints the progress; returns its per-epoch results.
    """
    from . import demo

    inspect.signature(demo.train).bind(**demo_options)  # an unknown option fails here, not in every rank
    return launch(functools.partial(demo.train, **demo_options), processes, backend=backend, timeout=timeout,
                  threads=None if backend == "nccl" else 1)[0]
