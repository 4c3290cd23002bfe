"""Optional C++/CUDA extension for the gradient reduction (sources in ``csrc/``).

``reduce_add_coalesced(inputs, destination)`` computes ``out[i] = inputs[0][i] + ... +
inputs[K-1][i]`` for every tensor position i in one pass over all tensors: each element is read
once from each replica and written once, instead of the K-1 separate read-read-write passes of
the plain torch loop. It adds in replica order with the same accumulation types as that loop
(float16/bfloat16 in float32, rounded once at the end), so the results are bitwise equal, but for the sign and
payload of a NaN (which operand's NaN an addition keeps is the kernel's choice: torch's add keeps the other's).

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` and cached on
disk by torch. ``MINIDP_EXT`` controls it:

* ``MINIDP_EXT=0``: never build; ``is_available()`` is False.
* ``MINIDP_EXT=1``: the extension is required; a failed build raises.
* unset (or empty): a failed build warns once and ``is_available()`` is False, so callers fall
  back to the torch backend.

Any other value (``false``, ``off``, ``2``) raises ValueError: read as unset, it would build
what was meant to be off, or fall back where the extension was meant to be required.

The compiled library is loaded into this process, so whoever can write its build directory can
run code here: the extension is refused (an error, or a warning and the torch backend) when that
directory or one above it can be changed by another user, as ssh refuses a key file others can write.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# How many blocks of reduction outputs stay mapped between steps (see reduce_add_coalesced): one per model
# reduced each step, one more for a step whose predecessor's gradients the user still holds.
REUSED_OUTPUT_BLOCKS = 4

_lock = threading.Lock()
_module: ModuleType | None = None
_outputs = None  # the extension's OutputPool: where CPU sums are written, built with the module
_failure: str | None = None  # why the build failed; a failed build is not retried


def _mode() -> str:
    mode = os.environ.get("MINIDP_EXT", "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(
            f"MINIDP_EXT={mode!r} is not understood. It takes MINIDP_EXT=0 (never build the extension), "
            "MINIDP_EXT=1 (require it: a failed build raises), or unset or empty (build it on first use; "
            "if that fails, warn and use the torch backend)."
        )
    return mode


def is_available() -> bool:
    """Whether the extension can be used (builds it on the first call unless MINIDP_EXT=0).

    With MINIDP_EXT=1 a failed build raises instead of returning False.
    """
    if _mode() == "0":
        return False
    try:
        load()
    except RuntimeError:
        if _mode() == "1":
            raise
        return False
    return True


def is_loaded() -> bool:
    """Whether the extension is built and loaded already; never starts a build.

    The ``"auto"`` reduction backend uses the extension exactly when this is true, so a step never
    pays for a compile it did not ask for: call :func:`load` once to opt in.
    """
    return _module is not None


def load(verbose: bool = False) -> ModuleType:
    """Return the compiled extension module, building it the first time (thread-safe).

    Raises RuntimeError when it is disabled (MINIDP_EXT=0) or cannot be built. A failed build
    warns once unless MINIDP_EXT=1, where the RuntimeError is the whole report.
    """
    global _module, _outputs, _failure
    if _mode() == "0":
        raise RuntimeError("the minidp extension is disabled by MINIDP_EXT=0")
    with _lock:
        if _module is None and _failure is None:
            try:
                module = _build(verbose)
                _outputs = module.OutputPool(REUSED_OUTPUT_BLOCKS)
                _module = module
            except Exception as exc:  # compiler errors come in many types; all mean "no extension"
                # A compiler log can be long; its end says what went wrong.
                _failure = f"{type(exc).__name__}: " + "\n".join(str(exc).splitlines()[-15:])
                if _mode() != "1":
                    warnings.warn(
                        f"minidp: the C++ extension could not be built, using the torch backend "
                        f"instead ({_failure}). Set MINIDP_EXT=0 to skip the build.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        if _module is not None:
            return _module
    raise RuntimeError(f"the minidp extension could not be built: {_failure}")


def reduce_add_coalesced(
    inputs: Sequence[Sequence[torch.Tensor]], destination: torch.device
) -> list[torch.Tensor]:
    """Sum tensor i over the replicas, for every i, into fresh tensors on ``destination``.

    ``inputs[k][i]`` is tensor i of replica k (e.g. the gradient of parameter i on GPU k). All
    replicas hold the same number of tensors, and tensor i has the same shape and dtype (one of
    SUPPORTED_DTYPES) in each; errors name the tensor and replica that differ. Inputs may be
    non-contiguous or live on other devices: those are made contiguous, and copied to
    ``destination`` unless it can read them in place (a GPU with peer access). Returns one new
    contiguous tensor per position, never an alias of an input; with K = 1 these are copies.

    On the CPU the sums are written into memory kept mapped from one call to the next, as DDP's gradient
    buckets are: a fresh allocation of that size is faulted in and zero-filled page by page inside the
    reduction, about one more write of every sum. The sums of one call are tensors of their own over one
    block of memory; a block is written again only once no tensor over it is alive anywhere (the user
    dropped the gradients, e.g. with ``zero_grad(set_to_none=True)``), so nothing still held is ever
    overwritten: a kept gradient keeps its whole block, and the next call takes another.
    :func:`reduce_output_bytes` says how much is kept, :func:`release_reduce_outputs` frees it.
    """
    load()
    return _outputs.reduce_add([list(replica) for replica in inputs], torch.device(destination))


def reduce_output_bytes() -> int:
    """Bytes of CPU memory kept for the sums of :func:`reduce_add_coalesced` (in use or free); 0 before a load."""
    return _outputs.held_bytes() if _outputs is not None else 0


def reduce_output_last_block() -> tuple[int, bool]:
    """The address of the block of CPU memory the last call of :func:`reduce_add_coalesced` wrote its sums into (0
    where it wrote none: sums on a GPU, or no call since the load), and whether it kept that block from an earlier call
    (held since then, not allocated by this one)."""
    return tuple(_outputs.last_block()) if _outputs is not None else (0, False)


def forget_reduce_output_last_block() -> None:
    """:func:`reduce_output_last_block` answers ``(0, False)`` until the next call writes sums: a reduction that makes
    no call (sums the torch backend makes) then leaves no earlier call's block as its answer."""
    if _outputs is not None:
        _outputs.forget_last_block()


def release_reduce_outputs() -> None:
    """Let go of the memory kept for CPU sums; blocks whose sums are still alive go when they do."""
    if _outputs is not None:
        _outputs.clear()


def supports(tensor: torch.Tensor) -> bool:
    """Whether the kernels take ``tensor``: a dense tensor of a SUPPORTED_DTYPES dtype on the CPU or a GPU, with memory
    of its own: not a batched tensor of ``autograd.grad(..., is_grads_batched=True)`` (the vmap that autograd runs the
    backward under), which has no storage whose data pointer the kernels could read."""
    return (
        tensor.dtype in SUPPORTED_DTYPES and tensor.layout == torch.strided and tensor.device.type in ("cpu", "cuda")
        and not torch._C._functorch.is_legacy_batchedtensor(tensor)
    )


def _build(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    if not (CSRC / "bindings.cpp").is_file():
        raise FileNotFoundError(
            f"the extension's C++ sources are not at {CSRC}; it needs a source checkout of minidp"
        )
    sources = [CSRC / "bindings.cpp", CSRC / "reduce_add_cpu.cpp"]
    cflags = ["-O3", "-fopenmp", *_simd_flags()]
    cuda_cflags: list[str] = []
    if torch.version.cuda is not None and torch.cuda.is_available():
        _check_nvcc()
        sources.append(CSRC / "reduce_add_cuda.cu")
        cflags.append("-DMINIDP_WITH_CUDA")
        cuda_cflags = ["-O3", "-DMINIDP_WITH_CUDA", *_arch_flags()]

    # The name changes whenever the sources or flags do, so torch's on-disk cache never serves
    # a stale build, and unchanged sources load without recompiling.
    digest = hashlib.sha256(" ".join(cflags + cuda_cflags + [torch.__version__]).encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    name = f"minidp_ext_{digest.hexdigest()[:12]}"

    # torch's own choice of directory (TORCH_EXTENSIONS_DIR, else its per-user cache), checked
    # before anything there is loaded, then handed to load() so that it is the one used.
    build_directory = Path(cpp_extension._get_build_directory(name, verbose)).resolve()
    _check_only_you_can_write(build_directory)

    start = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        build_directory=str(build_directory),
        sources=[str(s) for s in sources],
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=["-fopenmp"],  # at::parallel_for is inline OpenMP; shares torch's libgomp
        extra_include_paths=[str(CSRC)],
        verbose=verbose,
    )
    if verbose:
        print(f"minidp extension {name}: built or loaded in {time.perf_counter() - start:.1f} s")
    return module


def _check_only_you_can_write(build_directory: Path) -> None:
    """Raise PermissionError unless no other user can change what ``build_directory`` holds.

    The directory itself must be yours (or root's) and not writable by everyone, else anyone can
    put a library there before the build does, or replace it; every directory above it must be
    yours or root's and not writable by everyone unless sticky (as /tmp is: there only an entry's
    owner may rename or remove it), else anyone can swap the whole directory for their own.
    """
    if not hasattr(os, "getuid"):  # no POSIX owners and modes to check (Windows)
        return
    me = os.getuid()
    for directory in (build_directory, *build_directory.parents):
        info = directory.stat()
        if info.st_uid not in (me, 0):
            problem, fix = f"it belongs to uid {info.st_uid}, not to you (uid {me}) or root", ""
        elif info.st_mode & stat.S_IWOTH and (directory == build_directory or not info.st_mode & stat.S_ISVTX):
            problem, fix = f"every user can write to it: {stat.filemode(info.st_mode)}", f"chmod o-w {directory}, or "
        else:
            continue
        raise PermissionError(
            f"refusing to load the minidp extension from {build_directory}: another user can change {directory} "
            f"({problem}), and so replace the library that would run in this process. Fix: {fix}set "
            f"TORCH_EXTENSIONS_DIR to a directory that only you can write."
        )


def _simd_flags() -> list[str]:
    """Compiler flags that let ATen's Vectorized use AVX2 when this CPU has it.

    ATen compiles its own kernels once per instruction set and picks one at run time; the
    extension is built on the machine that runs it, so it is compiled once for that machine.
    AVX2 is enough: the reduction is limited by memory bandwidth, not by vector width.
    """
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def _check_nvcc() -> None:
    """Fail early when the local nvcc's CUDA major version differs from torch's.

    A different major version cannot link against torch's CUDA runtime; a different minor version
    works (torch's own extension builder only warns), so that only warns here too.
    """
    from torch.utils import cpp_extension

    nvcc = Path(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
    if not nvcc.is_file():
        nvcc = Path(shutil.which("nvcc") or "nvcc")
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"torch has CUDA {torch.version.cuda} but nvcc cannot run: {exc}") from exc
    found = re.search(r"release (\d+)\.(\d+)", out.stdout)
    wanted = torch.version.cuda.split(".")[:2]
    have = ".".join(found.groups()) if found else "an unknown version"
    if found is None or found.group(1) != wanted[0]:
        raise RuntimeError(
            f"{nvcc} is CUDA {have} but torch was built with CUDA {torch.version.cuda}; "
            f"install a CUDA {wanted[0]}.x toolkit or point CUDA_HOME at one"
        )
    if list(found.groups()) != wanted:
        warnings.warn(f"minidp: building with nvcc CUDA {have} for torch built with CUDA {torch.version.cuda}", stacklevel=3)


def _arch_flags() -> list[str]:
    """nvcc flags for the visible GPUs' architectures, unless TORCH_CUDA_ARCH_LIST chooses."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return []
    capabilities = sorted({torch.cuda.get_device_capability(d) for d in range(torch.cuda.device_count())})
    return [f"-gencode=arch=compute_{ma}{mi},code=sm_{ma}{mi}" for ma, mi in capabilities]
