"""Devices: turning what users write (``0``, ``"cuda:1"``, ``"cpu"``, ``torch.device``) into ``torch.device``.

Every primitive accepts device ids in any of these spellings and calls :func:`as_device` once, so the
rest of the runtime only ever sees ``torch.device`` objects. Ids may repeat: ``["cpu"] * 4`` asks for
four replicas on the CPU, ``[0, 0]`` for two replicas on GPU 0.

GPU ids are *logical*: under ``CUDA_VISIBLE_DEVICES="0,4"`` this process sees two GPUs, called 0 and 1,
which are the machine's GPUs 0 and 4. :func:`devices` shows both numbers side by side.

Each device has one random number generator, which everything running on it draws from (:func:`generator_state`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, Union

import torch

DeviceLike = Union[int, str, torch.device]


WHAT_WORKS = (
    "a device is an int (a CUDA ordinal 0, 1, ...; -1 means the CPU), a string such as 'cpu', 'cuda' or "
    "'cuda:1', or a torch.device"
)


def parse_device(device: DeviceLike, argument: str = "device") -> torch.device:
    """``device`` spelled as a ``torch.device``, without asking whether this process sees it.

    Every misspelling (``"gpu"``, ``-2``, ``"cuda:x"``, ``True``) is an error that names ``argument``
    and says what works, where torch's own would name neither.
    """
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"{argument}: {device!r} of type {type(device).__name__} is not a device: {WHAT_WORKS}")
    if isinstance(device, int):
        if device < -1:
            raise ValueError(f"{argument}: {device} is not a device: {WHAT_WORKS}")
        return torch.device("cpu") if device == -1 else torch.device("cuda", device)
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as error:  # torch's text lists every device type it knows; keep it as the cause
            raise ValueError(f"{argument}: {device!r} is not a device: {WHAT_WORKS}") from error
    return device


def visible_gpus() -> int:
    """How many GPUs this process sees: ``torch.cuda.device_count()``, asked only where CUDA is available.

    Before CUDA is initialised, ``device_count()`` asks NVML, which a CUDA build of torch on a machine without a GPU
    loads through ``ctypes`` at every call: 39 us and a reference cycle each time, where ``is_available()`` takes
    1.5 us and leaves none (torch 2.11+cu130, ``python -m timeit -s "import torch" "torch.cuda.device_count()"``).
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device_ids(replicas: int) -> list[DeviceLike]:
    """Every visible GPU where there are several; else ``replicas`` replicas on the one GPU, or on the CPU.

    (With the one GPU alone there would be one replica, and nothing data-parallel to see or check.)
    """
    count = visible_gpus()
    if count > 1:
        return list(range(count))
    return [0] * replicas if count else ["cpu"] * replicas


def as_device(device: DeviceLike, argument: str = "device") -> torch.device:
    """Return ``device`` as a ``torch.device``, checking that a GPU id names a GPU this process sees.

    An int is a CUDA ordinal (``-1`` means the CPU, as in stock ``gather``); strings and
    ``torch.device`` are taken as they are, ``"cuda"`` without an index means the current GPU, and ``"cpu:0"``
    (any CPU index) the CPU, ``device("cpu")``, where torch keeps every CPU tensor.
    ``argument`` names the caller's argument in error messages.
    """
    if type(device) is torch.device and device.type != "cuda" and device.index is None:
        return device  # already parsed, nothing to check: the hot path passes these every step
    device = parse_device(device, argument)
    if device.type == "cpu":
        # "cpu:0" is the CPU: torch keeps every CPU tensor on device("cpu"), which does not equal device("cpu:0")
        return torch.device("cpu")
    if device.type == "cuda":
        visible = visible_gpus()
        if device.index is None:
            if visible == 0:
                raise RuntimeError(f"{argument}: {device} was asked for, but this process sees no GPU")
            device = torch.device("cuda", torch.cuda.current_device())
        if not 0 <= device.index < visible:
            seen = f"{visible} GPU(s), so valid ids are 0..{visible - 1}" if visible else "no GPU"
            raise ValueError(
                f"{argument}: GPU id {device.index} is out of range: this process sees {seen}. Ids are logical: under "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r} the visible GPUs "
                f"are numbered from 0. Use device_ids=['cpu'] * n to run n replicas on the CPU."
            )
    return device


def as_devices(devices: Sequence[DeviceLike], argument: str = "device_ids") -> list[torch.device]:
    """:func:`as_device` for each element; repeats are kept, in order."""
    check_device_list(devices, argument)
    return [as_device(d, f"{argument}[{i}]") for i, d in enumerate(devices)]


def check_meta_not_mixed(devices: Sequence[torch.device], argument: str = "device_ids") -> None:
    """Raise ``ValueError`` if ``devices`` puts the meta device beside one that holds data, naming the first meta one.

    Meta tensors have shapes and no values: a step copies the module's tensors out to its replicas and the
    replicas' outputs and gradients back to the first device, and torch can copy nothing out of a meta tensor
    (its bare ``NotImplementedError`` would come in the middle of the step, naming neither device).
    """
    kinds = [d.type == "meta" for d in devices]
    if all(kinds) or not any(kinds):
        return
    meta = kinds.index(True)
    other = kinds.index(False)
    raise ValueError(
        f"{argument}[{meta}]: the meta device cannot run a replica beside {devices[other]} ({argument}[{other}]): "
        f"meta tensors hold no data, so nothing can be copied between it and a real device. Give devices that hold "
        f"data, e.g. ['cpu'] * {len(devices)}, or the meta device for every replica (shapes only)."
    )


def check_device_list(devices: Sequence[DeviceLike], argument: str = "device_ids") -> None:
    """Raise if ``devices`` is one device rather than a list of them (``"cpu"`` would read as 'c', 'p', 'u')."""
    if isinstance(devices, (str, int, torch.device)):
        raise TypeError(f"{argument}: expected a list of devices, e.g. [0, 1] or ['cpu', 'cpu'], got {devices!r}")


@dataclass(frozen=True)
class DeviceInfo:
    """One device this process sees. ``physical_id`` is the GPU's number on the machine."""

    device: torch.device
    physical_id: str
    name: str
    total_memory: int  # bytes; 0 where unknown
    used_memory: int  # bytes this process's allocator holds; 0 where unknown


def generator_state(device: torch.device) -> bytes:
    """The state of the random number generator that everything on ``device`` (the CPU, or one GPU) draws from.

    Bytes, read with dispatch modes off: a memory ledger (minidp.tracing.memory) is such a mode, and would
    count the state, once an operator took it (``.numpy()``'s detach, ``torch.equal``), as one of the step's tensors.
    """
    with torch._C._DisableTorchDispatch():
        state = torch.default_generator.get_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
        return state.numpy().tobytes()


def set_generator_state(device: torch.device, state: bytes) -> None:
    """Put the generator of ``device`` back to ``state``, as :func:`generator_state` read it."""
    with torch._C._DisableTorchDispatch():
        tensor = torch.frombuffer(bytearray(state), dtype=torch.uint8)
        if device.type == "cpu":
            torch.default_generator.set_state(tensor)
        else:
            torch.cuda.set_rng_state(tensor, device)


def device_order(device: str) -> tuple[str, int]:
    """A device's name as a sort key: its type, then its index as a number (``cuda:2`` before ``cuda:10``)."""
    kind, _, index = device.partition(":")
    return kind, int(index) if index.isdigit() else -1


def _physical_gpu_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = visible_gpus()
    if visible is None or not visible.strip():
        return [str(i) for i in range(count)]
    return [v.strip() for v in visible.split(",")][:count]


def devices() -> list[DeviceInfo]:
    """The devices this process sees: the CPU, then each GPU with its logical and physical id.

    >>> [str(d.device) for d in minidp.devices()]   # on a laptop
    ['cpu']
    """
    import platform

    found = [
        DeviceInfo(torch.device("cpu"), "-", platform.processor() or platform.machine(), _cpu_total_memory(), 0)
    ]
    for index, physical in enumerate(_physical_gpu_ids()):
        props = torch.cuda.get_device_properties(index)
        found.append(
            DeviceInfo(
                torch.device("cuda", index),
                physical,
                props.name,
                props.total_memory,
                torch.cuda.memory_reserved(index),
            )
        )
    return found


def _cpu_total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
