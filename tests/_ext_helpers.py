"""Reference arithmetic and inputs for the extension tests (and the reduction benchmark)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minidp import comm

# Same-size integer type per float type, to compare results bit for bit.
_BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def torch_reduce(inputs: Sequence[Sequence[torch.Tensor]], destination: torch.device) -> list[torch.Tensor]:
    """The core's "torch" backend, the arithmetic the extension must equal bitwise: add replica by
    replica, float16/bfloat16 accumulated in float32 and rounded once at the end."""
    return list(comm.reduce_add_coalesced(inputs, destination, backend="torch"))


def random_replicas(
    shapes: Sequence[tuple[int, ...]],
    num_replicas: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> list[list[torch.Tensor]]:
    """inputs[k][i]: replica k's random tensor of shapes[i]."""
    return [
        [torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes]
        for _ in range(num_replicas)
    ]


def assert_bitwise_equal(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    """Same count, and per position the same shape, dtype, device and bits."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a.shape, a.dtype, a.device) == (e.shape, e.dtype, e.device), f"tensor {i}"
        bits = _BITS[e.dtype]
        assert torch.equal(a.contiguous().view(bits), e.contiguous().view(bits)), f"tensor {i} differs"
