"""Argument types shared by the ``python -m minidp`` commands.

An argparse ``type`` turns one word of the command line into a value or raises
``ArgumentTypeError``, which argparse prints as a usage error naming the option (exit status 2).
Checking here, while the command line is parsed, is what turns ``--devices gpu`` or ``--batch 0``
into that one line instead of a traceback from deep inside the run.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from ..device_ids import DeviceLike, as_device

MAX_REPEAT = 1024  # replicas one --devices entry may name: more is a typo, and would fill memory with the list


def positive_int(text: str) -> int:
    """A count of at least 1 (``--batch``, ``--epochs``)."""
    value = int(text)  # not a number: argparse says "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A count that may be 0 (``--warmup``)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (``--lr``)."""
    value = float(text)  # not a number: argparse says "invalid positive_float value"
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def output_directory(text: str) -> Path:
    """A directory to write into (``--out``, ``--trace``), made now if it is not there yet, and checked by writing
    a file into it: a folder that cannot be made or written (below a file, under ``/proc``, read-only) is a usage
    error before anything runs, not a traceback once the run is done."""
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists())  # the last parent ("." or "/") exists
    if not existing.is_dir():
        what = "is a file" if existing == path else f"cannot be made: {str(existing)!r} is a file"
        raise argparse.ArgumentTypeError(f"{text!r} {what}; give a directory, existing or to be made")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be made ({error.strerror or error}); give a directory that can be made and written"
        ) from None
    try:
        with tempfile.NamedTemporaryFile(dir=path):  # what the artifacts need: a new file in it
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be written ({error.strerror or error}); give a directory that can be made and written"
        ) from None
    return path


def seed(text: str) -> int:
    """A seed for ``torch.manual_seed``: a signed 64-bit integer (torch overflows beyond)."""
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be between -2**63 and 2**63 - 1, got {value}")
    return value


def parse_device_ids(text: str) -> list[DeviceLike]:
    """``"0,1"`` -> ``[0, 1]``; ``"cpu*4"`` -> ``["cpu"] * 4``; ``"cuda:0,cuda:0"`` as written.

    Each device must be one this process can use, as :func:`minidp.devices.as_device` checks.
    """
    ids: list[DeviceLike] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, star, repeat = item.partition("*")
        if star and not (repeat.isdigit() and 1 <= int(repeat) <= MAX_REPEAT):
            raise argparse.ArgumentTypeError(
                f"{item!r}: the repeat after '*' must be a number from 1 to {MAX_REPEAT}, e.g. cpu*4"
            )
        try:
            ids += [parse_device(name)] * (int(repeat) if star else 1)
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{error}; a list: e.g. 0,1 or cpu*4") from None
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r} names no device; e.g. 0,1 or cpu*4")
    return ids


def parse_device(name: str) -> DeviceLike:
    """One device as written: a GPU number (-1: the CPU) or a name such as cpu, cuda or cuda:1.

    Checked by the core's own :func:`minidp.device_ids.as_device` (spelling, and a GPU this process sees), and of a
    type the commands run on (the CPU or a CUDA GPU); an error becomes the usage error, with the command line's
    spelling of what works.
    """
    device: DeviceLike = int(name) if name.lstrip("-").isdigit() else name
    try:
        parsed = as_device(device, repr(name))
    except (TypeError, ValueError, RuntimeError) as error:
        if "is not a device" in str(error):
            raise argparse.ArgumentTypeError(f"{name!r} is not a device: use cpu, cuda, cuda:N or a GPU number N") from None
        # a GPU this process does not see: the core's message says which it does
        raise argparse.ArgumentTypeError(f"{str(error).rstrip('.')}; on the command line: cpu") from None
    if parsed.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(
            f"{name!r}: the commands run on the CPU or CUDA GPUs, not on {parsed.type}; use cpu, cuda, cuda:N or a GPU number N"
        )
    # -1 is the CPU to as_device (stock's gather takes it so), but a number in device_ids names a GPU to DataParallel,
    # as in stock: the CPU goes on by name.
    return "cpu" if device == -1 else device
