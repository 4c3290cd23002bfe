"""Peak memory per device during a trace: the kernel's RSS high-water mark, CUDA's allocator peak."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class MemoryPeak:
    """The most memory a device held during the trace, above what it held when the trace began."""

    device: str
    bytes: int
    measure: str  # what was measured, in words


class PeakResidentMemory:
    """The most resident memory (RSS) the process held since :meth:`start`, as the kernel counts it.

    Linux keeps a high-water mark of every process's RSS (``VmHWM`` in ``/proc/self/status``), and
    writing ``5`` to ``/proc/self/clear_refs`` resets it to the current RSS. So the peak is exact, not
    sampled, and costs nothing while the step runs. Elsewhere (or where the reset is refused) there is
    no CPU figure.
    """

    def __init__(self) -> None:
        self.start_bytes: Optional[int] = None

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status", "rb") as status:
            text = status.read()
        at = text.find(b"\n" + field.encode() + b":")
        if at < 0:
            raise ValueError(f"no {field} in /proc/self/status")
        return int(text[at:].split()[1]) * 1024  # reported in kB

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            with open("/proc/self/statm", "rb") as statm:  # RSS in pages: cheaper than /proc/self/status
                self.start_bytes = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            self.start_bytes = None

    def peak_above_start(self) -> Optional[int]:
        if self.start_bytes is None:
            return None
        return self._status("VmHWM") - self.start_bytes


class DeviceMemory:
    """Start and peak of every device's memory around a ``with minidp.trace()`` block."""

    def __init__(self) -> None:
        self.resident = PeakResidentMemory()
        self.gpu_start: dict[int, int] = {}

    def start(self) -> None:
        if torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
                torch.cuda.reset_peak_memory_stats(index)
                self.gpu_start[index] = torch.cuda.memory_allocated(index)
        self.resident.start()

    def peaks(self) -> list[MemoryPeak]:
        found = []
        peak = self.resident.peak_above_start()
        if peak is not None:
            found.append(MemoryPeak(
                "cpu", peak,
                "process resident memory (RSS): the kernel's high-water mark, reset when the trace began, above "
                "the RSS at that moment; one number for all CPU replicas, which share the process",
            ))
        for index, start in self.gpu_start.items():
            found.append(MemoryPeak(
                f"cuda:{index}", torch.cuda.max_memory_allocated(index) - start,
                "CUDA caching allocator: peak allocated bytes above the start (torch.cuda.max_memory_allocated)",
            ))
        return found


SHARES = ("parameters", "inputs", "gathered outputs")


@dataclass
class LedgerRow:
    """One device's peak memory during a traced step, and what it is made of.

    ``shares`` are exact counts of the bytes each step left on the device: the module's parameters and
    buffers with the replicas' copies of them (``parameters``), the input chunks copied to it
    (``inputs``), the outputs gathered onto it (``gathered outputs``: the whole output, or with
    :func:`minidp.parallel_criterion` only the loss terms). ``rest`` is the peak minus those: what the
    forward keeps for the backward (activations), the loss, the gradients and the allocator's slack.
    The CPU's peak is the process's (every CPU replica shares it), and its shares are summed over
    every CPU device.
    """

    device: str
    peak: int
    shares: dict[str, int]
    measure: str

    @property
    def rest(self) -> int:
        return max(self.peak - sum(self.shares.values()), 0)


def memory_ledger(peaks: list[MemoryPeak], accounted: dict[tuple[str, str], int]) -> list[LedgerRow]:
    rows = []
    for peak in peaks:
        shares = {
            share: sum(n for (device, kind), n in accounted.items() if kind == share and _same(device, peak.device))
            for share in SHARES
        }
        rows.append(LedgerRow(peak.device, peak.bytes, shares, peak.measure))
    return rows


def _same(device: str, peak_device: str) -> bool:
    """Whether bytes counted on ``device`` belong to the peak measured for ``peak_device``."""
    return device.split(":")[0] == "cpu" if peak_device == "cpu" else device == peak_device
