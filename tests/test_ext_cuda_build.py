"""The extension's CUDA path compiled where there is no GPU: what a CUDA machine's first ``ext.load()`` builds.

nvcc is on the development and CI machines, a GPU is not; so the kernel is compiled as torch compiles it, and where
torch is a CUDA build (CI's run under the oldest supported torch, whose only wheel on the registry is one) the whole
extension is built, linked and loaded, as ``ext.load()`` does on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import pytest
import torch

from .helpers import fresh_python
from minidp import ext


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """Building does not depend on DataParallel's defaults: once, not under both configurations."""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_kernel_compiles_with_nvcc_under_the_flags_torch_adds(tmp_path):
    """torch's extension builds pass nvcc ``-D__CUDA_NO_HALF_CONVERSIONS__`` and its kin
    (``cpp_extension.COMMON_NVCC_FLAGS``): the kernel must not rely on what they take away."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    source = ext.CSRC / "reduce_add_cuda.cu"
    result = subprocess.run(
        ["nvcc", "-c", "-std=c++17", *COMMON_NVCC_FLAGS, "-DMINIDP_WITH_CUDA", str(source), "-o", str(tmp_path / "k.o")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def _toolkit_of_nvcc() -> Path:
    """The CUDA toolkit of the ``nvcc`` on PATH, as nvcc itself says (``TOP``): torch guesses it as the folder above
    ``nvcc``'s, which is wrong where ``nvcc`` is a wrapper script outside the toolkit."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "empty.cu"
        source.touch()
        dry_run = subprocess.run(["nvcc", "--dryrun", "-c", str(source)], capture_output=True, text=True).stderr
    return Path(re.search(r"^#\$ TOP=(.*)$", dry_run, re.MULTILINE).group(1).strip()).resolve()


def _cuda_headers() -> Optional[Path]:
    """Where the CUDA headers a CUDA build of torch includes are: its ``nvidia`` wheels' (``cusparse.h`` among them,
    which a compiler-only toolkit lacks), else ``CUDA_HOME``'s; ``None`` where neither has them."""
    from torch.utils.cpp_extension import CUDA_HOME

    wheels = importlib.util.find_spec("nvidia")
    candidates = [Path(p) / f"cu{torch.version.cuda.split('.')[0]}" / "include" for p in wheels.submodule_search_locations] if wheels else []
    candidates += [Path(CUDA_HOME) / "include"] if CUDA_HOME else []
    return next((path for path in candidates if (path / "cusparse.h").is_file()), None)


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (its CUDA headers and libraries)")
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_cuda_extension_builds_and_loads_against_a_cuda_build_of_torch_without_a_gpu(tmp_path):
    """What a CUDA machine's first call does (``ext.load()`` with ``torch.cuda.is_available()``), here where there may
    be no GPU: the CUDA sources compiled and linked with torch's own flags, for Hopper (sm_90), and the module loaded."""
    headers = _cuda_headers()
    if headers is None:
        pytest.skip("no CUDA headers with cusparse.h (torch's nvidia wheels or CUDA_HOME)")
    build_dir = tmp_path / "extensions"
    build_dir.mkdir(mode=0o700)
    environment = {
        "CUDA_HOME": os.environ.get("CUDA_HOME") or str(_toolkit_of_nvcc()),
        "CPATH": os.pathsep.join(filter(None, [str(headers), os.environ.get("CPATH")])),
        "TORCH_CUDA_ARCH_LIST": "9.0", "TORCH_EXTENSIONS_DIR": str(build_dir), "MINIDP_EXT": "1",
    }
    script = "import torch; torch.cuda.is_available = lambda: True; from minidp import ext; print(ext.load().has_cuda)"
    done = fresh_python("-c", script, timeout=900, env=environment)
    assert done.returncode == 0 and done.stdout.strip().endswith("True"), done.stderr[-3000:]
