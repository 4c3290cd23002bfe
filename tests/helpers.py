"""What the tests share besides fixtures: device lists, tolerances, comparisons, and planted-fault modules."""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import traceback
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from torch import nn

import minidp
from minidp import ext
from minidp.distributed.launch import loopback_interface

# float64 comparisons: data parallelism only reorders sums, so results agree to rounding.
RTOL_FLOAT64 = 1e-10

ROOT = Path(__file__).resolve().parents[1]

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


class Encoding(collections.UserDict):
    """A mapping that is not a dict, as Hugging Face's ``BatchEncoding`` (what its tokenizers return) is a UserDict."""


# What the torch the suite runs on takes, where the references the tests compare with differ between releases:
# torch 2.13's DDP takes bucket_cap_mb=0 (distributed.py, _BucketCapacityConfig), 2.11's asserts "bucket_cap_mb should
# be set by now"; 2.13's FSDP2 makes a shard a parameter that requires grad only where the original does
# (_fsdp_param.py, _init_sharded_param), 2.11's makes every shard one, which an integer parameter cannot be.
TORCH_DDP_TAKES_A_ZERO_BUCKET_CAP = hasattr(torch.nn.parallel.distributed, "_BucketCapacityConfig")
# torch 2.13's DDP takes a negative bucket_cap_mb, as no limit where its reducer plans (reducer.cpp's sizes are
# unsigned); compared only with a torch of that kind (_BucketCapacityConfig): 2.11's was not checked.
TORCH_DDP_TAKES_A_NEGATIVE_BUCKET_CAP = TORCH_DDP_TAKES_A_ZERO_BUCKET_CAP
# torch 2.13's DDP syncs buffers in the forward under torch.autograd._unsafe_preserve_version_counter (distributed.py,
# _sync_buffers), as minidp's does; 2.11's moves their version counters, so a buffer an earlier forward saved fails its
# backward there (CI's torch 2.11 job): compared only with a torch that keeps them.
TORCH_DDP_KEEPS_BUFFER_VERSIONS = "_unsafe_preserve_version_counter" in inspect.getsource(
    torch.nn.parallel.DistributedDataParallel._sync_buffers)
FSDP2_SHARDS_INTEGER_PARAMETERS = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def library(name: str) -> Any:
    """The module ``name`` of a library the install leaves out (torchvision, timm), or a skip that says why not: not
    installed, or a build whose compiled parts do not load with this torch (torchvision's wheels on the package
    registry are built for CUDA torch: with torch 2.13's CPU wheel its operators are missing; CI's torch 2.11 job,
    a CUDA build, installs the matching torchvision and timm)."""
    try:
        return importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - ImportError, or the RuntimeError of operators that do not load
        pytest.skip(f"{name} cannot be imported: {type(error).__name__}: {error}")


def torchvision_resnet18() -> nn.Module:
    """torchvision's ResNet-18 (code nobody here wrote), 10 classes: 62 parameters, 20 BatchNorm layers."""
    from torchvision.models import resnet18

    return resnet18(num_classes=10)


def timm_vit() -> nn.Module:
    """timm's ViT (code nobody here wrote), small: 32x32 images cut into 8x8 patches, 2 blocks of width 32; a class
    token and a position embedding beside the layers' parameters, no dropout. Its ``blocks`` are its layers."""
    import timm

    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                             num_classes=10)


def error_of(call: Callable[[], Any]) -> tuple[str, str]:
    """The type's name (what code that catches it matches) and the message of what ``call()`` raises, with the notes
    added to it, one a line; ``("no error", "")`` if it returns."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - any error is the answer
        return type(error).__name__, "\n".join([str(error), *getattr(error, "__notes__", ())])
    return "no error", ""


def cpu_ids(n: int) -> list[str]:
    """``n`` replicas on the CPU."""
    return ["cpu"] * n


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - e| / max(max|e|, tiny)``: one number per tensor, robust to zeros."""
    if not expected.numel():  # nothing to differ (the max of nothing is an error)
        return 0.0
    scale = expected.detach().abs().max().clamp_min(1e-300)
    return ((actual.detach() - expected.detach()).abs().max() / scale).item()


def garbage_left_by(call) -> int:
    """How many objects only the cycle collector can free after ``call()``. Automatic collection is paused,
    so everything ``call`` allocates stays in the youngest generation, which alone is collected (fast)."""
    gc.disable()
    try:
        gc.collect(0)
        call()
        return gc.collect(0)
    finally:
        gc.enable()


class HearsOutputs:
    """A listener of minidp.hooks (the methods of ``minidp.hooks.Listener``, no optional one) that runs every call and
    keeps what parallel_apply announces of its outputs: per call, how many, and whether each backward is one call."""

    def __init__(self) -> None:
        self.announced: list[tuple[int, bool]] = []

    def on_call(self, stage, function, arguments):
        return function(*arguments.args, **arguments.kwargs)

    def on_replica(self, replica, device, module, call):
        return call()

    def on_module(self, device, module, call):
        return call()

    def on_replica_backward(self, replica, device, module, call):
        return call()

    def on_replica_outputs(self, modules, outputs, one_call_each):
        self.announced.append((len(outputs), one_call_each))


class ScaledByBuffer(nn.Module):
    """Multiplies by a buffer: autograd saves the buffer for the input's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


class CountsCalls(nn.Module):
    """Counts its forward calls in a plain attribute: the kind of state data parallelism loses, since
    under DataParallel each replica counts on its own copy and the original's count stays put."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


def finishes_within(seconds: float, function: Callable[[], Any]) -> Any:
    """``function()``, run in a daemon thread: its result, or its exception re-raised here; the test
    fails if it is still running after ``seconds`` (a hang), instead of hanging the suite."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = function()
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="finishes-within", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s: it hangs")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def fresh_python(*args: str, timeout: float = 120, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python *args`` in a fresh interpreter that imports this checkout's minidp, output captured.

    For what a test process cannot do to itself (fork, Ctrl-C, exit) or must see from a clean
    start; ``timeout`` turns a hang into a failure (``subprocess.TimeoutExpired``), the process killed.
    ``env``: variables set for it on top of this process's.
    """
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(paths))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# The configurations of DataParallel's defaults that every test runs under (tests/conftest.py).
CONFIGURATIONS = {
    "cached-torch": {"cache_replicas": True, "backend": "torch", "parallel_backward": True},
    "uncached-ext": {"cache_replicas": False, "backend": "auto-with-ext", "parallel_backward": False},
}


def configure_dataparallel(monkeypatch, cache_replicas: bool, backend: str, parallel_backward: bool = True) -> None:
    """Make ``cache_replicas`` DataParallel's default, ``backend`` the global reduce backend, and
    ``parallel_backward`` whether CPU replicas run their backwards in parallel, for one test.

    ``"auto-with-ext"`` is ``"auto"`` with the extension loaded (``"torch"`` where it cannot be built).
    """
    monkeypatch.setattr(minidp.parallel_backward, "_enabled", parallel_backward)
    defaults = dict(minidp.DataParallel.__init__.__kwdefaults__)
    defaults["cache_replicas"] = cache_replicas
    monkeypatch.setattr(minidp.DataParallel.__init__, "__kwdefaults__", defaults)
    if backend == "auto-with-ext":
        backend = "auto" if ext.is_available() else "torch"
    monkeypatch.setattr(minidp.comm, "_default_reduce_backend", backend)


def torchrun(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 ARGS`` in a fresh session; the whole session is
    killed if it runs past ``timeout`` (then the test fails)."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    # CPU jobs on Gloo wherever they run: on a machine with a GPU, frameworks would put each rank on one (ignite's
    # idist sets the device of its local rank, which a one-GPU machine lacks for rank 1).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), CUDA_VISIBLE_DEVICES="")
    if loopback_interface():
        env.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # Gloo's connections stay on this machine
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: killing torchrun's group leaves them running,
        # holding the output pipe open. Every process below torchrun goes too.
        for pid in [*_descendants(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"torchrun ran past {timeout} s:\n{output}")
    return subprocess.CompletedProcess(command, process.returncode, output)


def assert_ended_well(done: subprocess.CompletedProcess, last_words: str) -> None:
    """A torchrun job ended well: exit status 0, or ranks that said ``last_words`` and then died of an abort as their
    interpreter exited, and of nothing else (SIGABRT, and torchrun's SIGTERM for the others): the job's work is done,
    and the test goes on to read it.

    That abort is torch's Gloo: "terminate called without an active exception", from a worker thread of the process
    group letting go of an all-gather's tensors while the interpreter finalizes (gdb; pytorch/pytorch#179291 describes
    it). ``examples/fsdp_train.py`` resumed from its checkpoint ended so in 2 to 4 runs of 10 under torch 2.11, with
    torch's own FSDP2 in place of minidp's too, and once in a clean CI run under torch 2.13.
    """
    if done.returncode == 0:
        return
    exit_codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", done.stdout))
    aborted_at_exit = ("terminate called without an active exception" in done.stdout and last_words in done.stdout
                       and exit_codes and exit_codes <= {"-6", "-15"})
    assert aborted_at_exit, done.stdout


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from ``/proc`` (Linux; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])  # the field after "(command) state"
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        below = children.get(stack.pop(), [])
        found += below
        stack += below
    return found


def run_job(run_checks: Callable, world_size: int, plan: Any, job_timeout: float, group_timeout: float = 60.0) -> list[dict]:
    """``run_checks(plan, seed)`` on ``world_size`` Gloo processes (``minidp.distributed.launch``, whose process
    group waits ``group_timeout`` seconds in a collective), with one fresh seed printed for replay; each rank's
    results, by check name."""
    from minidp.distributed import launch  # only the multi-process tests pay for torch.distributed's setup

    seed = int(torch.randint(0, 2**20, ()).item())
    print(f"job seed: {seed}")
    return launch(run_checks, world_size, (plan, seed), timeout=group_timeout, job_timeout=job_timeout)


def job_fixture(name: str, run_checks: Callable, world_size: int, plan: dict, job_timeout: float) -> Any:
    """A module-scoped fixture called ``name``: every check of ``plan``, run once by :func:`run_job` on
    ``world_size`` processes for all the tests of the module that read it, as each rank saw it."""

    def results() -> list[dict]:
        return run_job(run_checks, world_size, plan, job_timeout)

    results.__doc__ = f"Every check of the plan, as each of {world_size} ranks saw it."
    return pytest.fixture(scope="module", name=name)(results)


@contextlib.contextmanager
def debug_level(level: str) -> Iterator[None]:
    """``TORCH_DISTRIBUTED_DEBUG=level`` for the block, read again by torch.distributed in this process (as
    upstream's ``with_dist_debug_levels`` does); the old level after it."""
    import torch.distributed as dist

    previous = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
    dist.set_debug_level_from_env()
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_DISTRIBUTED_DEBUG"]
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = previous
        dist.set_debug_level_from_env()


# ---- PyTorch's own tests, ported: the cases of one upstream file run in one job ---------------------------------

UPSTREAM_JOB_TIMEOUT = 300.0  # seconds for a whole job
UPSTREAM_GROUP_TIMEOUT = 30.0  # a collective that waits longer for a rank that raised fails instead


def run_upstream(plan: tuple[str, list[tuple[str, dict]]], seed: int) -> dict[str, Optional[str]]:
    """Rank side: ``plan`` is a module of ported upstream bodies and its cases, ``(dotted name in that module,
    keyword arguments)``; a name ``"other.module:dotted.name"`` is looked up in that other module instead, so that
    one job can run the cases of several. Each runs in order, every rank seeded alike with ``seed``. Per case id
    (the name as given, then each keyword argument's value in brackets), None or the traceback of what it raised.
    A barrier after each case keeps a case that fails on one rank from running into the next."""
    import torch.distributed as dist

    module, cases = plan
    results: dict[str, Optional[str]] = {}
    for name, kwargs in cases:
        case_id = name + "".join(f"[{value}]" for value in kwargs.values())
        other_module, _, dotted_name = name.rpartition(":")
        bodies = importlib.import_module(other_module or module)
        torch.manual_seed(seed)
        try:
            attrgetter(dotted_name)(bodies)(**kwargs)
            results[case_id] = None
        except Exception:  # one failing check is one failing test, not a failed job
            results[case_id] = traceback.format_exc()
        dist.barrier()
    return results


def launch_upstream(module: str, cases: list[tuple[str, dict]], processes: int = 2) -> list[dict[str, Optional[str]]]:
    """Start ``processes`` Gloo processes once and run every case of ``module`` (or, named ``"module:name"``, of
    another module) in them; each rank's results."""
    return run_job(run_upstream, processes, (module, cases), UPSTREAM_JOB_TIMEOUT, UPSTREAM_GROUP_TIMEOUT)


def assert_passed_on_every_rank(results: list[dict[str, Optional[str]]], case_id: str) -> None:
    failures = [f"rank {rank}:\n{ranks[case_id]}" for rank, ranks in enumerate(results) if ranks[case_id] is not None]
    assert not failures, "\n".join(failures)


def assert_ports_match_their_module(cases: list[str], checks: Any, not_ported: dict[str, str]) -> None:
    """A port of upstream tests lists its cases in the order its checks module defines them (every ``test_`` function
    there, none else), and none of them is also listed as not ported."""
    assert cases == [name for name in vars(checks) if name.startswith("test_")]
    assert not set(cases) & set(not_ported)


def each_rank(results: list[dict], check: str) -> list:
    """What every rank reported for ``check``, in rank order."""
    return [by_name[check] for by_name in results]


def assert_no_differences(results: list[dict], check: str) -> None:
    """Every rank found no difference in ``check`` (``differences``: one ``None`` per comparison that agreed)."""
    for rank, result in enumerate(each_rank(results, check)):
        assert result["differences"] == [None] * len(result["differences"]), f"rank {rank}: {result['differences']}"


def forked_child(child_succeeds: str, what: str) -> str:
    """Lines of a script: ``os.fork()``; the child exits 0 if the expression ``child_succeeds`` holds; the parent
    waits at most 20 s for it and exits with its status, or kills it and exits naming ``what`` that hung."""
    return f"""
import os, sys, time
pid = os.fork()
if pid == 0:
    os._exit(0 if {child_succeeds} else 1)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    finished, status = os.waitpid(pid, os.WNOHANG)
    if finished:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.02)
os.kill(pid, 9)
os.waitpid(pid, 0)
sys.exit("the forked child hung in {what}")
"""


def state_difference(actual: Any, expected: Any, exact: bool = True, where: str = "the state") -> Optional[str]:
    """Where two state dicts first differ, or None: mappings by their keys (in any order) and values, sequences item by
    item, tensors bitwise (``torch.equal``), or close with ``exact=False`` (``torch.testing.assert_close``'s default
    tolerances, as PyTorch's ``TestCase.assertEqual`` compares them), a DTensor by its placements, whole shape and
    local tensor, other values by ``==``."""
    from torch.distributed.tensor import DTensor

    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            return f"{where}: keys {list(actual) if isinstance(actual, dict) else type(actual)}, not {list(expected)}"
        return next(filter(None, (state_difference(actual[k], expected[k], exact, f"{where}[{k!r}]") for k in expected)),
                    None)
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return f"{where}: {actual!r}, not {expected!r}"
        return next(filter(None, (state_difference(a, b, exact, f"{where}[{i}]")
                                  for i, (a, b) in enumerate(zip(actual, expected)))), None)
    if isinstance(expected, DTensor):
        if not isinstance(actual, DTensor) or (actual.placements, actual.shape) != (expected.placements, expected.shape):
            return f"{where}: not a DTensor laid out as {expected.placements} {tuple(expected.shape)}"
        actual, expected = actual.to_local(), expected.to_local()
    elif isinstance(actual, DTensor):
        return f"{where}: a DTensor, not a plain tensor"
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
            return f"{where}: {type(actual).__name__} {tuple(getattr(actual, 'shape', ()))}, not {tuple(expected.shape)}"
        if exact:
            return None if torch.equal(actual, expected) else f"{where}: other values"
        try:
            torch.testing.assert_close(actual, expected)
        except AssertionError as error:
            return f"{where}: {error}"
        return None
    if isinstance(actual, torch.Tensor):
        return f"{where}: a tensor, not {expected!r}"
    return None if actual == expected else f"{where}: {actual!r}, not {expected!r}"


def assert_equal_as_upstream(actual: Any, expected: Any) -> None:
    """PyTorch's ``TestCase.assertEqual`` (``torch/testing/_internal/common_utils.py``, which needs a test-only
    package to import) on state dicts, as ported upstream tests use it: :func:`state_difference` with tolerances."""
    difference = state_difference(actual, expected, exact=False)
    assert difference is None, difference


class LayerCache:
    """Shaped like Hugging Face's ``DynamicCache``: iterating gives each layer's ``(keys, values)``, and the
    class is built from an iterable of such layers (``DynamicCache(ddp_cache_data)``, the call stock's
    gather makes)."""

    def __init__(self, layers=()) -> None:
        self.layers = [tuple(layer) for layer in layers]

    def __iter__(self):
        return iter(self.layers)
