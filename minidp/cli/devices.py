"""``minidp devices``: the devices this process sees, as a table.

Logical ids are what minidp and PyTorch take (``device_ids=[0, 1]``); physical ids are the GPUs'
numbers on the machine, which differ under ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

from ..device_ids import DeviceInfo, devices, visible_gpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "GPU utilisation needs the NVIDIA management library (pip install nvidia-ml-py)."


def _memory_used(info: DeviceInfo) -> Optional[int]:
    """Memory in use on the device, by every process (GPU: the driver's count; CPU: total - available)."""
    if info.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(info.device)
        return total - free
    try:
        with open("/proc/meminfo") as meminfo:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
        return fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _utilisation(info: DeviceInfo) -> str:
    if info.device.type == "cuda":
        try:
            return f"{torch.cuda.utilization(info.device)}%"
        except Exception:  # no NVML (pynvml) or a driver that does not report it
            return "n/a"
    if hasattr(os, "getloadavg"):
        return f"load {os.getloadavg()[0]:.2f} / {os.cpu_count()} cores"
    return "n/a"


def _gib(n: Optional[int]) -> str:
    return "?" if not n and n != 0 else f"{n / 2**30:.1f}"


def run(args: argparse.Namespace) -> int:
    rows = [("logical id", "physical id", "name", "memory used / total GiB", "utilisation")]
    for info in devices():
        logical = "cpu" if info.device.type == "cpu" else str(info.device.index)
        memory = f"{_gib(_memory_used(info))} / {_gib(info.total_memory or None)}"
        rows.append((logical, info.physical_id, info.name, memory, _utilisation(info)))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        print(f"CUDA_VISIBLE_DEVICES={visible!r}: logical GPU ids count from 0 over these")
    if visible_gpus() == 0:
        print("no GPU visible: run replicas on the CPU with device_ids=['cpu'] * n")
    return 0
