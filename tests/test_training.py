"""Training: many steps of data-parallel SGD end where single-device (chunk-by-chunk) SGD ends.

Small per-step differences (summation order) would compound over steps if anything were off;
after 20 steps of momentum SGD every parameter and buffer still agrees to float64 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

import minidp
from .helpers import cpu_ids
from .reference import assert_tensors_close, make_case
from minidp.reference import chunked_reference

STEPS = 20
REPLICAS = 3
ROWS = 10  # uneven on 3 replicas: chunks of 4, 4, 2


@pytest.mark.parametrize("name", ["cnn", "resnet_bn", "kwargs_dict"])
def test_sgd_with_3_replicas_ends_where_single_device_sgd_ends(name, generator):
    batches = [make_case(name, ROWS, generator) for _ in range(STEPS)]
    parallel_model = batches[0].fresh_model()
    reference_model = copy.deepcopy(parallel_model)
    wrapped = minidp.DataParallel(parallel_model, cpu_ids(REPLICAS), dim=batches[0].dim)

    def train(model, forward):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for case in batches:
            optimizer.zero_grad()
            case.loss(forward(case)).backward()
            optimizer.step()

    train(parallel_model, lambda case: wrapped(*case.args, **case.kwargs))
    train(reference_model, lambda case: chunked_reference(reference_model, case.args, case.kwargs, REPLICAS, case.dim))

    assert_tensors_close(dict(parallel_model.named_parameters()), dict(reference_model.named_parameters()), "parameter")
    assert_tensors_close(dict(parallel_model.named_buffers()), dict(reference_model.named_buffers()), "buffer")
    first = dict(batches[0].prototype.named_parameters())
    assert any(not torch.equal(p, first[n]) for n, p in parallel_model.named_parameters()), "training moved nothing"
