"""calibrate: chunk weights that follow the devices.

    weights = minidp.calibrate(model, sample_inputs, device_ids)
    wrapper = minidp.DataParallel(model, device_ids, chunk_weights=weights)

On devices that differ (two GPU models, a GPU that also drives a display, a GPU with less free
memory because it holds the optimizer state), an even split makes every step wait for the slowest
replica, or run out of memory on the fullest device first. :func:`calibrate` measures each device
and returns one weight per replica, for ``chunk_weights``.

How the weights are made:

* **Speed.** For each distinct device in ``device_ids``, a deep copy of ``model`` is moved there and
  runs one untimed forward and backward pass on the whole sample batch (lazy initialisation,
  cuDNN's autotuning and the allocator's growth happen there), then ``steps`` timed ones; the
  device's speed is ``1 / median step time``. A device that hosts ``k`` replicas (``["cpu"] * 4``,
  ``[0, 0, 1]``) shares its speed among them: ``speed / k`` each. The *speed shares* are those
  numbers normalised to sum to 1.
* **Memory, on GPUs.** ``torch.cuda.mem_get_info`` reads each GPU's free memory before anything of
  the calibration is put there, and a GPU's free memory is shared among its replicas likewise;
  the *memory shares* are those numbers normalised over the GPU replicas.
* **Combined.** A GPU replica's weight is ``min(speed share, memory share)``: the rows its speed
  earns, but never a larger share of the batch than its share of the free memory, so the GPU
  with the least room is not the first to run out. CPU replicas keep their speed share (the
  host's memory is one pool for all of them). The weights are normalised to sum to 1.

Timings vary from run to run; replicas on one device get identical weights by construction.
Nothing of ``model`` changes: the passes run on copies (their gradients and BatchNorm statistics
are discarded with them).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .device_ids import DeviceLike, as_devices
from .nested import map_tensors
from .step1_scatter import scatter_kwargs
from .step2_replicate import check_is_module


def calibrate(
    model: nn.Module,
    sample_inputs: Any,
    device_ids: Sequence[DeviceLike],
    steps: int = 3,
    *,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> list[float]:
    """One weight per entry of ``device_ids``, summing to 1, to pass as ``chunk_weights``.

    ``sample_inputs``: a batch as ``model`` takes it (a tuple is the positional arguments, anything
    else one argument), on any device. ``loss_fn(output)``: the scalar to run the backward from
    (default: the sum of the output, which must then be a tensor). ``steps``: timed passes per device.
    """
    check_is_module(model, "model")
    devices = as_devices(device_ids, "device_ids")
    if not devices:
        raise ValueError("device_ids is empty: give the devices the replicas will run on, e.g. ['cpu'] * 2")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function from the model's output to a scalar, got {type(loss_fn).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(sample_inputs, tuple):
        sample_inputs = (sample_inputs,)
    if not sample_inputs:
        raise ValueError("sample_inputs is empty: give a batch as the model takes it")
    # Timed on copies cut from autograd: a backward must not reach the caller's tensors (an input that requires grad
    # would collect a gradient, one made by another module would back-propagate into it, and again at every pass).
    sample_inputs = map_tensors(torch.Tensor.detach, sample_inputs)
    distinct = list(dict.fromkeys(devices))
    free = {device: torch.cuda.mem_get_info(device)[0] for device in distinct if device.type == "cuda"}
    seconds = {device: _median_step_seconds(model, sample_inputs, device, steps, loss_fn) for device in distinct}
    return weights_from_measurements(devices, seconds, free)


def weights_from_measurements(
    devices: Sequence[torch.device], step_seconds: dict[torch.device, float], free_bytes: dict[torch.device, int]
) -> list[float]:
    """The weights of this module's docstring, from a step time per device and free bytes per GPU.

    ``devices`` lists one device per replica (repeats: replicas sharing a device); ``step_seconds``
    and ``free_bytes`` hold one entry per distinct device (``free_bytes``: every CUDA device).
    """
    replicas_on = {device: devices.count(device) for device in devices}
    speed = _normalised([1 / (step_seconds[d] * replicas_on[d]) for d in devices])
    room = iter(_normalised([free_bytes[d] / replicas_on[d] for d in devices if d.type == "cuda"]))
    return _normalised([min(share, next(room)) if d.type == "cuda" else share for share, d in zip(speed, devices)])


def _median_step_seconds(
    model: nn.Module, sample_inputs: tuple, device: torch.device, steps: int, loss_fn: Optional[Callable]
) -> float:
    """The median time of a forward and backward pass of a copy of ``model`` on ``device``."""
    replica = copy.deepcopy(model).to(device)
    ((inputs,), (kwargs,)) = scatter_kwargs(sample_inputs, {}, [device])  # the whole batch, moved

    def step() -> None:
        output = replica(*inputs, **kwargs)
        loss = loss_fn(output) if loss_fn is not None else _sum_of(output)
        if loss.requires_grad:
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step ends when its kernels do

    step()  # warm-up, untimed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sum_of(output: Any) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"the model returned a {type(output).__name__}: pass loss_fn=..., a function from the output "
            f"to the scalar to run the backward from"
        )
    return output.sum()


def _normalised(values: list[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values]
