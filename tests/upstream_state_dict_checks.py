"""PyTorch's tests of ``torch.distributed.checkpoint``'s state dict API on DDP and FSDP2, rank side: each upstream case
run inside every rank of a job of 2 Gloo processes, with minidp's ``DistributedDataParallel`` and ``fully_shard`` in
place of torch's.

Sources (PyTorch is BSD-licensed, 3-clause; the cases below are adapted from them, copyright the PyTorch
contributors), of https://github.com/pytorch/pytorch: ``test/distributed/checkpoint/test_state_dict.py``
(``TestStateDict``) and ``test/distributed/checkpoint/e2e/test_e2e_save_and_load.py`` (``TestE2ESaveAndLoad``), with
its helpers imported from torch's own ``torch/testing/_internal``: ``common_dist_composable`` (``CompositeParamModel``,
``UnitModule``) and ``distributed/common_state_dict`` (``VerifyStateDictMixin``, which compares a model's and an
optimizer's state dicts with the distributed ones, and loads one into a fresh optimizer).

How the port reads. Each function is one upstream test under its upstream name; ``run_subtests`` is a plain loop over
the same values. Upstream runs them on one GPU per rank (``skip_if_lt_x_gpu``); here on the CPU, 2 ranks, every rank
seeded alike before each case (``tests.helpers.run_upstream``), as upstream's processes are. The mixin's assertions run
on :class:`Verify`, a ``unittest.TestCase`` whose ``assertEqual`` is upstream's on state dicts
(``tests.helpers.assert_equal_as_upstream``: torch's ``TestCase`` needs a test-only package to import). Subtests of
wrappers minidp does not provide (torch's composable ``replicate``, FSDP1) stay out, named in each docstring.

With ``MINIDP_UPSTREAM_DDP=torch`` the DDP cases run on torch's ``DistributedDataParallel``, with
``MINIDP_UPSTREAM_FSDP=torch`` the FSDP2 cases on torch's ``fully_shard``: that is how each port was validated.
"""

from __future__ import annotations

import copy
import functools
import io
import os
import unittest
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.checkpoint import state_dict as ptd_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, _patch_model_state_dict, _patch_optimizer_state_dict, get_model_state_dict,
    get_optimizer_state_dict, get_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.testing._internal.common_dist_composable import CompositeParamModel, UnitModule
from torch.testing._internal.distributed.common_state_dict import VerifyStateDictMixin

import minidp.distributed as md

from .helpers import assert_equal_as_upstream

if os.environ.get("MINIDP_UPSTREAM_DDP") == "torch":
    from torch.nn.parallel import DistributedDataParallel as DDP
else:
    DDP = md.DistributedDataParallel

if os.environ.get("MINIDP_UPSTREAM_FSDP") == "torch":
    from torch.distributed.fsdp import fully_shard as FSDP2
else:
    FSDP2 = md.fully_shard
fully_shard = FSDP2

DEVICE = torch.device("cpu")


class Verify(VerifyStateDictMixin, unittest.TestCase):
    """Upstream's test case, for its assertions: the mixin's comparisons, and ``assertEqual`` as upstream's."""

    def runTest(self) -> None:  # (a TestCase needs a test method to be made)
        pass

    def assertEqual(self, first: Any, second: Any, msg: Any = None) -> None:
        assert_equal_as_upstream(first, second)


def _test_save_load(init_model_optim: Callable, test_frozen: bool = False) -> None:
    """Upstream's ``TestStateDict._test_save_load``: ten steps of the plain model and the distributed one side by side;
    ``get_state_dict`` of the distributed one equal to the plain one's state dicts (and its optimizer state loaded
    into a fresh plain optimizer equal to the trained one's); loaded with ``set_model_state_dict`` and
    ``set_optimizer_state_dict`` into a new distributed model and optimizer, equal again; then the same through
    ``_patch_model_state_dict`` and ``_patch_optimizer_state_dict``."""
    self = Verify()
    options = StateDictOptions(ignore_frozen_params=test_frozen)
    # Initialize original model and distributed model.
    model, optim, copy_optim, dist_model, dist_optim = init_model_optim()

    # Train 10 steps.
    for i in range(10):
        batch = torch.rand(8, 100, device=DEVICE)
        model(batch).sum().backward()
        optim.step()
        dist_model(batch).sum().backward()
        if not isinstance(dist_optim, list):
            dist_optim.step()
            dist_optim.zero_grad()
        else:
            for _dist_optim in dist_optim:
                _dist_optim.zero_grad()
        optim.zero_grad()

    # Get the state_dict, and compare the result
    msd = model.state_dict()
    osd = optim.state_dict()
    dist_msd, dist_osd = get_state_dict(dist_model, optimizers=dist_optim, options=options)
    self._verify_msd(msd, dist_msd, options)
    self._verify_osd_by_load(model, optim, copy_optim, dist_osd)
    self._verify_osd(model, optim, osd, dist_osd)

    # Initialize a completely new model to simulate checkpoint load.
    _, _, _, dist_model, dist_optim = init_model_optim()

    # Simulate DCP distributed load. We need to first get the state_dict and
    # pass them to DCP to load the saved state_dict from the storage.
    # Then finally we can call set_state_dict().
    if not isinstance(dist_optim, list):
        dist_optim = [dist_optim]
    if test_frozen:
        # We won't be able to load the partial state_dict back.
        return
    # Since we already have the state_dict saved before, no need to call DCP.
    # We can directly load them back. This asser is to ensure that optimizer
    # state storage are initialized.
    set_model_state_dict(dist_model, model_state_dict=dist_msd, options=options)
    set_optimizer_state_dict(dist_model, optimizers=dist_optim, optim_state_dict=dist_osd, options=options)

    # Check if the new state_dict are the same
    dist_msd, dist_osd = get_state_dict(dist_model, optimizers=dist_optim, options=options)
    self._verify_msd(msd, dist_msd, options)
    self._verify_osd(model, optim, osd, dist_osd)

    # Test _patch_model_state_dict, and _patch_optimizer_state_dict
    _patch_model_state_dict(dist_model, options=options)
    _patch_optimizer_state_dict(dist_model, optimizers=dist_optim, options=options)
    dist_msd = dist_model.state_dict()
    dist_osd = dist_optim[0].state_dict()
    self._verify_msd(msd, dist_msd, options)
    self._verify_osd_by_load(model, optim, copy_optim, dist_osd)
    self._verify_osd(model, optim, osd, dist_osd)


def _test_fsdp2(*, reshard_after_forward: bool, optimizer_class: type[Optimizer], foreach: bool = True) -> None:
    def init_model_optim():
        orig_model = CompositeParamModel(device=DEVICE)
        orig_optim = optimizer_class(orig_model.parameters(), lr=1e-3, foreach=foreach)
        copy_optim = optimizer_class(orig_model.parameters(), lr=1e-3, foreach=foreach)
        dist_model = FSDP2(copy.deepcopy(orig_model), reshard_after_forward=reshard_after_forward)
        dist_optim = optimizer_class(dist_model.parameters(), lr=1e-3, foreach=foreach)
        return orig_model, orig_optim, copy_optim, dist_model, dist_optim

    _test_save_load(init_model_optim)


def test_fsdp2() -> None:
    """The model sharded by ``fully_shard``, kept gathered after the forward or not, Adam and AdamW. Adapted: not
    under ``torch.compile`` (upstream's ``compile_model=True`` subtests: minutes of compiling on the CPU)."""
    for reshard_after_forward in (True, False):
        for optimizer_class in (torch.optim.Adam, torch.optim.AdamW):
            _test_fsdp2(reshard_after_forward=reshard_after_forward, optimizer_class=optimizer_class)


def _test_ddp(optimizer_class: type[Optimizer]) -> None:
    def init_model_optim():
        orig_model = CompositeParamModel(device=DEVICE)
        orig_optim = optimizer_class(orig_model.parameters(), lr=1e-3)
        copy_optim = optimizer_class(orig_model.parameters(), lr=1e-3)
        dist_model = DDP(copy.deepcopy(orig_model))
        dist_optim = optimizer_class(dist_model.parameters(), lr=1e-3)
        return orig_model, orig_optim, copy_optim, dist_model, dist_optim

    _test_save_load(init_model_optim)


def test_ddp() -> None:
    """The model wrapped by ``DistributedDataParallel``, Adam and AdamW. Adapted: not upstream's ``use_composable=True``
    subtests, which run torch's composable ``replicate`` instead of a wrapper."""
    for optimizer_class in (torch.optim.Adam, torch.optim.AdamW):
        _test_ddp(optimizer_class)


def test_activation_ckpt_fqns_ddp() -> None:
    """Tests that activation checkpointing prefixes are removed from module names"""
    model = CompositeParamModel(device=DEVICE)
    original_keys = get_model_state_dict(model).keys()

    apply_activation_checkpointing(model)
    model = DDP(model)
    new_keys = get_model_state_dict(model).keys()

    assert original_keys == new_keys, (original_keys, new_keys)


def test_extra_state() -> None:
    """A module's extra state through the wrapper. Adapted: ``UnitModule``'s extra-state methods, which upstream sets
    on the class in a process of the test's own, are taken off again afterwards (the job runs more cases)."""
    self = Verify()
    model = CompositeParamModel(device=DEVICE)

    def get_extra_state(self):
        return "MyState"

    def set_extra_state(self, state):
        return

    UnitModule.get_extra_state = get_extra_state
    UnitModule.set_extra_state = set_extra_state
    try:
        ddp_model = DDP(copy.deepcopy(model))
        set_model_state_dict(ddp_model, get_model_state_dict(ddp_model))
        self.assertEqual(model.state_dict()["u1._extra_state"], "MyState")
        self.assertEqual(model.state_dict(), get_model_state_dict(ddp_model))
    finally:
        del UnitModule.get_extra_state, UnitModule.set_extra_state


def test_non_persistent_buffers() -> None:
    self = Verify()
    model = CompositeParamModel(device=DEVICE)
    model.register_buffer("dont_save_me", torch.rand(100, device=DEVICE), persistent=False)
    ddp_model = DDP(copy.deepcopy(model))
    set_model_state_dict(ddp_model, get_model_state_dict(ddp_model))
    self.assertEqual(model.state_dict(), get_model_state_dict(ddp_model))


def _test_broadcast_from_rank0(wrapper: Callable[[nn.Module], nn.Module]) -> None:
    self = Verify()
    model = CompositeParamModel(device=DEVICE)
    optim = torch.optim.Adam(model.parameters())
    fsdp_model = wrapper(copy.deepcopy(model))
    fsdp_optim = torch.optim.Adam(fsdp_model.parameters())

    batch = torch.rand(8, 100, device=DEVICE)
    model(batch).sum().backward()
    optim.step()
    states, optim_states = get_state_dict(model, optim)

    fsdp_model(batch).sum().backward()
    fsdp_optim.step()

    def check(equal):
        fsdp_states = get_model_state_dict(fsdp_model, options=StateDictOptions(full_state_dict=True))
        fsdp_optim_states = get_optimizer_state_dict(fsdp_model, fsdp_optim,
                                                     options=StateDictOptions(full_state_dict=True))
        if equal:
            self.assertEqual(states, fsdp_states)
            self.assertEqual(optim_states, fsdp_optim_states)
        else:
            for expected, actual in ((states, fsdp_states), (optim_states, fsdp_optim_states)):
                try:
                    self.assertEqual(expected, actual)
                except AssertionError:
                    continue
                raise AssertionError("expected the state dicts to differ")

    check(equal=True)
    fsdp_model(batch).sum().backward()
    fsdp_optim.step()
    check(equal=False)

    # Drop the states to simulate loading from rank0
    if dist.get_rank() > 0:
        load_states = {}
        load_states2 = {}
        load_optim_states = {}
    else:
        load_states = copy.deepcopy(states)
        load_states2 = copy.deepcopy(states)
        load_optim_states = copy.deepcopy(optim_states)

    set_model_state_dict(fsdp_model, model_state_dict=load_states,
                         options=StateDictOptions(broadcast_from_rank0=True, full_state_dict=True))
    set_optimizer_state_dict(fsdp_model, fsdp_optim, optim_state_dict=load_optim_states,
                             options=StateDictOptions(broadcast_from_rank0=True, full_state_dict=True))

    check(equal=True)
    # Verify the `strict` flag.
    load_states = load_states2
    if load_states:
        key = next(iter(load_states.keys()))
        load_states.pop(key)
    with self.assertRaisesRegex(RuntimeError, "Missing key"):
        set_model_state_dict(fsdp_model, model_state_dict=load_states,
                             options=StateDictOptions(broadcast_from_rank0=True, full_state_dict=True))


def test_broadcast_from_rank0() -> None:
    """A whole state dict held by rank 0 alone, broadcast into the sharded model and its optimizer. Adapted: the
    ``fully_shard`` subtest (upstream's other runs FSDP1)."""
    device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _test_broadcast_from_rank0(functools.partial(FSDP2, mesh=device_mesh))


def _two_sharded_layers() -> nn.Module:
    """The model of upstream's two optimizer-matching tests: two linear layers, each sharded, and the root."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, device=DEVICE, bias=False) for _ in range(2)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def test_optim_state_dict_param_matching() -> None:
    # This test verifies parameters between optim and optim_state_dict
    # "initial_lr" is added to optim_state_dict, but not to the new optim
    # We test whether "initial_lr" appear in optim after
    # set_optimizer_state_dict.
    model = _two_sharded_layers()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda=[lambda epoch: 0.95**epoch])
    opt_state_dict = ptd_state_dict.get_optimizer_state_dict(
        model, optim, options=ptd_state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        assert "initial_lr" in opt_state_dict["param_groups"][0]

    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert "initial_lr" not in optim.param_groups[0]

    ptd_state_dict.set_optimizer_state_dict(
        model, optim, optim_state_dict=opt_state_dict,
        options=ptd_state_dict.StateDictOptions(broadcast_from_rank0=True, full_state_dict=True))
    if dist.get_rank() == 0:
        assert "initial_lr" in optim.param_groups[0]


def _is_sharded_state(state: torch.Tensor, param: torch.Tensor) -> bool:
    """Upstream's ``isinstance(state, DTensor)`` for an optimizer's live state: FSDP2's is a DTensor; minidp's
    optimizer steps plain rows, the shape of its shard (a DTensor only in its state dict)."""
    if isinstance(param, DTensor):
        return isinstance(state, DTensor)
    return not isinstance(state, DTensor) and state.shape == param.shape


def test_optim_state_dict_tensor_matching() -> None:
    """A whole optimizer state dict loaded back gives the optimizer its state as it was, sharded. Adapted: "a DTensor"
    is :func:`_is_sharded_state`."""
    model = _two_sharded_layers()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn((4, 4), device=DEVICE)
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()
    param, state = next(iter(optim.state.items()))
    assert _is_sharded_state(state["exp_avg"], param), type(state["exp_avg"])
    opt_state_dict = ptd_state_dict.get_optimizer_state_dict(
        model, optim, options=ptd_state_dict.StateDictOptions(full_state_dict=True))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ptd_state_dict.set_optimizer_state_dict(
        model, optim, optim_state_dict=opt_state_dict, options=ptd_state_dict.StateDictOptions(full_state_dict=True))
    param, state = next(iter(optim.state.items()))
    assert _is_sharded_state(state["exp_avg"], param), type(state["exp_avg"])


def test_flattened_osd() -> None:
    self = Verify()
    device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = CompositeParamModel(device=DEVICE)
    fsdp_model = FSDP2(copy.deepcopy(model), mesh=device_mesh)
    fsdp_optim = torch.optim.AdamW(fsdp_model.parameters())
    batch = torch.rand(8, 100, device=DEVICE)
    fsdp_model(batch).sum().backward()
    fsdp_optim.step()
    fsdp_optim.zero_grad()
    osd1 = get_optimizer_state_dict(fsdp_model, fsdp_optim)
    osd2 = get_optimizer_state_dict(fsdp_model, fsdp_optim,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    fsdp_optim2 = torch.optim.AdamW(fsdp_model.parameters())
    set_optimizer_state_dict(fsdp_model, optimizers=fsdp_optim2, optim_state_dict=osd2)
    self.assertEqual(fsdp_optim.state_dict(), fsdp_optim2.state_dict())
    set_optimizer_state_dict(fsdp_model, optimizers=fsdp_optim2, optim_state_dict=osd1)
    self.assertEqual(fsdp_optim.state_dict(), fsdp_optim2.state_dict())


# ==================================================================================================
# test/distributed/checkpoint/e2e/test_e2e_save_and_load.py (TestE2ESaveAndLoad)
# ==================================================================================================


class TestDummyModel(torch.nn.Module):
    """Upstream's "simple and boring model"."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Linear(8, 16)
        self.net2 = nn.Linear(16, 32)
        self.net3 = nn.Linear(32, 64)
        self.net4 = nn.Linear(64, 8)

    def forward(self, x):
        x = torch.relu(self.net1(x))
        x = torch.relu(self.net2(x))
        x = torch.relu(self.net3(x))
        x = torch.relu(self.net4(x))
        return x

    def get_input(self):
        return torch.rand(8, 8, device=DEVICE)


class TestStatefulObj:
    def __init__(self) -> None:
        self.data = torch.rand(10, 10, device=DEVICE)

    def state_dict(self):
        return {"data": self.data}

    def load_state_dict(self, state_dict):
        self.data = state_dict["data"]

    def __eq__(self, other):
        return torch.equal(self.data, other.data)


class TestTrainState:
    """Upstream's dataclass of the training loop's own state (its step, last loss and losses)."""

    def __init__(self) -> None:
        self.step, self.current_loss, self.losses = 0, -1.0, []

    def state_dict(self) -> dict[str, Any]:
        loss_bytes = io.BytesIO()
        torch.save(self.losses, loss_bytes)
        return {
            "step": torch.tensor(self.step, dtype=torch.int32),
            "current_loss": torch.tensor(self.current_loss, dtype=torch.float32),
            "losses": loss_bytes,
        }

    def load_state_dict(self, state_dict) -> None:
        self.step = state_dict["step"].item()
        self.current_loss = state_dict["current_loss"].item()
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"])

    def __eq__(self, other):
        return (self.step == other.step and self.current_loss == other.current_loss
                and self.losses == other.losses)


def _train(model, optim, train_steps=1):
    torch.manual_seed(0)
    loss = None

    train_state = TestTrainState()

    for _ in range(train_steps):
        loss = model(model.get_input()).sum()
        loss.backward()

        # We usually sync the loss across dp ranks in real training.
        # This is just simulating for testing purpose.
        train_state.step += 1
        train_state.current_loss = torch.rand(1).item()
        train_state.losses.append(train_state.current_loss)

        optim.step()
        optim.zero_grad()

    return loss, train_state


def _create_model(compile: bool, model_type: str) -> tuple[nn.Module, Optimizer]:
    dummy_model = TestDummyModel()
    if model_type == "DDP":
        model = DDP(dummy_model)
        model.get_input = functools.partial(TestDummyModel.get_input, model)
    elif model_type == "FSDP2":
        model = fully_shard(dummy_model)
    else:
        model = dummy_model
    if compile:
        model = torch.compile(model, dynamic=False)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    if model_type != "NONE":
        _patch_model_state_dict(model)
        _patch_optimizer_state_dict(model, optimizers=optim)
    return model, optim


def test_e2e(compile: bool, model_type: str) -> None:
    """A model, its optimizer and two stateful objects saved by ``torch.distributed.checkpoint`` (passed as they are,
    their state dicts patched to the DCP API's), loaded into new ones; one more step equals the plain model's.
    Adapted: ``model_type`` DDP as upstream, and ``"FSDP2"``, ``fully_shard`` in place of upstream's FSDP1 (its other
    types, FSDP1 and HSDP on FSDP1, are not minidp's); a directory made by rank 0 and shared (``with_temp_dir``)."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as DCP

    self = Verify()
    temp_dir = [tempfile.mkdtemp(prefix="minidp-e2e-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(temp_dir, src=0)
    try:
        model, optim = _create_model(compile, "NONE")
        _train(model, optim, train_steps=2)

        dist_model, dist_optim = _create_model(compile, model_type)
        _, original_train_state = _train(dist_model, dist_optim, train_steps=2)

        original_stateful_obj = TestStatefulObj()  # tests arbitrary saving/loading
        sd = {"model": dist_model, "optimizer": dist_optim, "s": original_stateful_obj,
              "train_state": original_train_state}
        DCP.save(sd, checkpoint_id=temp_dir[0])

        loaded_stateful_obj = TestStatefulObj()
        loaded_train_state = TestTrainState()
        dist_model, dist_optim = _create_model(compile, model_type)

        DCP.load(state_dict={"model": dist_model, "optimizer": dist_optim, "s": loaded_stateful_obj,
                             "train_state": loaded_train_state}, checkpoint_id=temp_dir[0])

        assert original_stateful_obj == loaded_stateful_obj
        assert original_train_state == loaded_train_state

        # train one more step on both models
        loss, _ = _train(model, optim, train_steps=1)
        dist_loss, _ = _train(dist_model, dist_optim, train_steps=1)
        self.assertEqual(loss, dist_loss)

        dist_msd, dist_osd = get_state_dict(dist_model, optimizers=dist_optim)
        model_sd, optim_sd = get_state_dict(model, optimizers=optim)

        self._verify_msd(model_sd, dist_msd)
        self._verify_osd_by_load(model, optim, torch.optim.Adam(model.parameters(), lr=0.1), dist_osd)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(temp_dir[0])
