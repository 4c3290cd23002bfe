"""Bad input to minidp.distributed, refused with a clear error before any process or process group is needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minidp.distributed import DistributedDataParallel, run_demo


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """minidp.DataParallel's defaults play no part here: once, not under both configurations of tests/conftest.py."""


def test_a_bucket_cap_must_be_positive():
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive, got -1"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=-1)


def test_each_per_bucket_cap_must_be_positive():
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list\[1\] must be positive, got 0"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb_list=[1, 0])


@pytest.mark.parametrize("argument, value", [
    ("mixed_precision", object()),
    ("delay_all_reduce_named_params", [("w", nn.Parameter(torch.ones(3)))]), ("param_to_hook_all_reduce", nn.Parameter(torch.ones(3))),
])
def test_torch_ddp_arguments_minidp_lacks_are_refused_by_name_not_ignored(argument, value):
    # torch/nn/parallel/distributed.py takes them (torch 2.13); minidp does not implement them, and says so
    with pytest.raises(NotImplementedError, match=f"does not implement {argument} .*torch.nn.parallel"):
        DistributedDataParallel(nn.Linear(2, 2), **{argument: value})


def test_without_a_process_group_the_error_says_how_to_make_one():
    with pytest.raises(RuntimeError, match="init_process_group.*minidp.distributed.launch"):
        DistributedDataParallel(nn.Linear(2, 2))
    assert torch.distributed.is_initialized() is False


def test_run_demo_rejects_an_unknown_option_before_starting_processes():
    with pytest.raises(TypeError, match="device"):
        run_demo(2, device="cpu")
