"""Bad input to minidp.distributed, refused with a clear error before any process or process group is needed."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from minidp.distributed import DistributedDataParallel, run_demo


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """minidp.DataParallel's defaults play no part here: once, not under both configurations of tests/conftest.py."""


def test_a_negative_bucket_cap_is_refused_with_find_unused_parameters_as_torch_refuses_it():
    # torch's first plan searching unused parameters hands the cap to _compute_bucket_assignment_by_size, which takes
    # unsigned sizes and refuses it; without the search a negative cap is no limit (tests/test_distributed.py)
    with pytest.raises(ValueError, match="bucket_cap_mb must be 0 or more with find_unused_parameters=True.*got -1"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=-1, find_unused_parameters=True)


def test_a_process_group_that_is_not_one_is_refused_by_name():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup.*got 'WORLD' of type str"):
        DistributedDataParallel(nn.Linear(2, 2), process_group="WORLD")


def test_no_per_bucket_cap_may_be_negative():
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list\[1\] must be 0 or more, got -0.5"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb_list=[1, -0.5])


@pytest.mark.parametrize("argument, value", [
    ("delay_all_reduce_named_params", [("w", nn.Parameter(torch.ones(3)))]), ("param_to_hook_all_reduce", nn.Parameter(torch.ones(3))),
])
def test_torch_ddp_arguments_minidp_lacks_are_refused_by_name_not_ignored(argument, value):
    # torch/nn/parallel/distributed.py takes them (torch 2.13); minidp does not implement them, and says so
    with pytest.raises(NotImplementedError, match=f"does not implement {argument} .*torch.nn.parallel"):
        DistributedDataParallel(nn.Linear(2, 2), **{argument: value})


@pytest.mark.parametrize("name", ["_register_fused_optim", "_update_process_group", "_set_sparse_metadata", "scatter",
                                  "_pre_forward"])
def test_torch_ddps_own_methods_minidp_does_not_run_are_refused_by_name(name):
    # minidp's class derives from torch's for isinstance() only (torch.distributed.checkpoint's state dicts, frameworks):
    # a method of torch's it does not define would otherwise run torch's code on attributes minidp does not have
    with pytest.raises(NotImplementedError, match=rf"DistributedDataParallel\.{name} is torch DDP's own"):
        getattr(DistributedDataParallel, name)(None)


def _mixed_precision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16):
    from torch.nn.parallel.distributed import _MixedPrecision
    return _MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype)


@pytest.mark.parametrize("config, error", [
    (object(), "mixed_precision must have param_dtype, reduce_dtype and buffer_dtype .*object lacks param_dtype"),
    (_mixed_precision(param_dtype=None), "mixed_precision.param_dtype must be set"),
    (_mixed_precision(reduce_dtype=torch.int8), "mixed_precision.reduce_dtype must be a floating-point dtype"),
])
def test_a_mixed_precision_configuration_that_cannot_work_is_refused_by_field(config, error):
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=error):
        DistributedDataParallel(model, mixed_precision=config)
    assert model.weight.dtype == torch.float32 and not hasattr(model.weight, "_mp_param")  # nothing changed


def test_mixed_precision_with_several_replicas_per_process_is_refused_with_the_way_out():
    model = nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match=r"several replicas per process \(device_ids=\['cpu', 'cpu'\]\).*one device_id"):
        DistributedDataParallel(model, device_ids=["cpu", "cpu"], mixed_precision=_mixed_precision())
    assert not hasattr(model.weight, "_mp_param")


def test_a_module_on_two_device_types_is_refused_with_stocks_words_before_any_process_group_is_needed():
    # torch/nn/parallel/distributed.py, DistributedDataParallel.__init__: "must be on the same type of devices"
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"must be on the same type of devices.*\{'cpu', 'meta'\}.*model.to\('cpu'\)"):
        DistributedDataParallel(model)


def test_a_module_on_the_meta_device_is_refused_saying_to_materialise_it_first():
    # torch's construction fails on one by chance ("Tensor.item() cannot be called on meta tensors"); wrapped, its
    # to_empty() registered parameters no hook watched, and each rank trained on its own gradients, silently
    with pytest.raises(RuntimeError, match="parameter 'weight' is on the meta device") as caught:
        DistributedDataParallel(nn.Linear(4, 1, device="meta"))
    assert "Materialise the module first (module.to_empty(device=...)" in str(caught.value)


def test_a_lazy_module_is_refused_with_stocks_words_and_its_parameters_name():
    # torch/nn/parallel/distributed.py, DistributedDataParallel.__init__: _has_uninitialized_params
    with pytest.raises(RuntimeError) as caught:
        DistributedDataParallel(nn.LazyLinear(3))
    assert str(caught.value).startswith("Modules with uninitialized parameters can't be used with "
                                        "`DistributedDataParallel`. 'weight' is not initialized yet")


@pytest.mark.parametrize("device_ids", [[0], [1], [torch.device("cuda", 0)], ["cpu", 0]])
def test_gpu_device_ids_for_a_module_on_the_cpu_raise_stocks_value_error_before_any_process_group_is_needed(device_ids):
    # torch/nn/parallel/distributed.py, DistributedDataParallel.__init__: a CPU module takes no device_ids; without a
    # GPU minidp would otherwise run them as a direct call on the CPU, training silently where stock refuses
    with pytest.raises(ValueError, match=re.escape(
        f"DistributedDataParallel device_ids and output_device arguments only work with single-device/multiple-device "
        f"GPU modules or CPU modules, but got device_ids {device_ids}, output_device None, and module parameters "
        f"{{device(type='cpu')}}.")):
        DistributedDataParallel(nn.Linear(2, 2), device_ids=device_ids)


@pytest.mark.parametrize("device_ids", [["cpu"], ["cpu", "cpu"]])
def test_cpu_device_ids_stay_minidps_cpu_replicas_past_the_device_check(device_ids):
    # beyond stock (which refuses any device_ids for a CPU module): n CPU ids are n replicas on the CPU, one for ['cpu']
    with pytest.raises(ValueError, match="init_process_group"):
        DistributedDataParallel(nn.Linear(2, 2), device_ids=device_ids)

def test_without_a_process_group_the_error_says_how_to_make_one():
    # a ValueError, as torch's (distributed_c10d.py, _get_default_group): code that catches it keeps working
    with pytest.raises(ValueError, match="init_process_group.*minidp.distributed.launch"):
        DistributedDataParallel(nn.Linear(2, 2))
    assert torch.distributed.is_initialized() is False


def test_run_demo_rejects_an_unknown_option_before_starting_processes():
    with pytest.raises(TypeError, match="device"):
        run_demo(2, device="cpu")


@pytest.mark.parametrize("argument, value, error", [
    ("bucket_cap_mb", "25", TypeError), ("bucket_cap_mb", [25], TypeError), ("bucket_cap_mb", float("inf"), ValueError),
    ("bucket_cap_mb_list", [25, float("inf")], ValueError), ("bucket_cap_mb_list", [25, "1"], TypeError),
])
def test_a_bucket_cap_that_is_no_finite_number_is_refused_by_name(argument, value, error):
    # torch's DDP fails on them with a bare OverflowError ("cannot convert float infinity to integer") or a TypeError
    # from its arithmetic, naming no argument
    position = r"\[1\]" if argument == "bucket_cap_mb_list" else ""
    with pytest.raises(error, match=f"{argument}{position} must be (a number of MiB|finite)"):
        DistributedDataParallel(nn.Linear(2, 2), **{argument: value})


def test_a_bucket_cap_list_given_as_a_string_is_refused_not_read_digit_by_digit():
    with pytest.raises(TypeError, match="bucket_cap_mb_list must be a list of sizes in MiB.*got '25' of type str"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb_list="25")


@pytest.mark.parametrize("output_device", [3, "cpu", "gpu"])
def test_an_output_device_for_a_module_on_the_cpu_raises_stocks_value_error_before_any_process_group_is_needed(
        output_device):
    # torch/nn/parallel/distributed.py, DistributedDataParallel.__init__: a CPU module takes no (truthy) output_device;
    # minidp kept it and trained as if it were not there
    with pytest.raises(ValueError, match=re.escape(
        f"DistributedDataParallel device_ids and output_device arguments only work with single-device/multiple-device "
        f"GPU modules or CPU modules, but got device_ids None, output_device {output_device}, and module parameters "
        f"{{device(type='cpu')}}. Leave output_device unset")):
        DistributedDataParallel(nn.Linear(2, 2), output_device=output_device)


def test_device_ids_given_as_one_string_are_refused_with_the_list_to_pass():
    # minidp read "cpu" as the devices 'c', 'p', 'u'; minidp.DataParallel refuses it alike (torch's DDP refuses it for
    # its length: "device_ids can only be None or contain a single element")
    with pytest.raises(TypeError, match=r"device_ids: expected a list of devices, e\.g\. \[0, 1\] or \['cpu', 'cpu'\], got 'cpu'"):
        DistributedDataParallel(nn.Linear(2, 2), device_ids="cpu")
