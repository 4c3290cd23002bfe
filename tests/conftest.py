"""Shared fixtures: the random generator, the extension, and the configurations the whole suite runs under.

Every test runs twice, under two configurations of :class:`minidp.DataParallel`'s defaults:

* ``cached-torch``: what a user gets by default: the replica cache on, the ``"torch"`` backend (what
  ``"auto"`` is until the extension is loaded; pinned, since an earlier test may have loaded it), and the
  backwards of CPU replicas in parallel, each in its replica's thread (:mod:`minidp.parallel_backward`;
  pinned to ``True``: the default, ``"auto"``, takes that way only where the replicas' thread teams fit the
  cores, and otherwise the other configuration's);
* ``uncached-ext``: the three features the other way: replicas built anew at every step, as stock does,
  ``"auto"`` with the extension loaded, so the extension sums every gradient it takes (``"torch"`` alone
  where it cannot be built), and the replicas' backwards one after the other, as autograd runs them.

Features that are on by default must be exactly as safe as the stock path: both must pass. A test
module about one of the features pins it with :func:`configure_dataparallel`. A test whose work runs in
a fresh interpreter (a script, a forked or spawned process), which the configuration does not reach, is
marked ``fresh_interpreter`` and runs once, under the first configuration chosen.
"""

from __future__ import annotations

import os
import random
from typing import Iterator

import pytest
import torch

from minidp import ext

from .helpers import CONFIGURATIONS, configure_dataparallel

SEED_VARIABLE = "MINIDP_TEST_SEED"


@pytest.fixture
def generator(request) -> torch.Generator:
    """A generator with a fresh random seed per test, or the seed in ``MINIDP_TEST_SEED`` to replay one.

    The seed is printed, so a failing test's report shows it: rerun with
    ``MINIDP_TEST_SEED=<seed> python -m pytest -q '<test id>'`` to draw the same inputs. torch's global
    generator is seeded with it too, so that the modules a test builds (their initial weights) replay as well.
    """
    seed = int(os.environ[SEED_VARIABLE]) if os.environ.get(SEED_VARIABLE) else random.SystemRandom().randrange(2**31)
    print(f"generator seed: {seed} (replay: {SEED_VARIABLE}={seed} python -m pytest -q '{request.node.nodeid}')")
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def extension():
    """The compiled extension; skips the test where it cannot be built (it must build wherever CI runs)."""
    try:
        return ext.load()
    except RuntimeError as exc:
        pytest.skip(f"the minidp extension cannot be built here: {exc}")


# MINIDP_TEST_CONFIGURATIONS=cached-torch (a comma list) runs only those: CI's second run, under the oldest torch,
# takes the default configuration alone, to stay within CI's time.
_CHOSEN = [c.strip() for c in os.environ.get("MINIDP_TEST_CONFIGURATIONS", "").split(",") if c.strip()] or list(CONFIGURATIONS)
if not set(_CHOSEN) <= set(CONFIGURATIONS):
    raise ValueError(f"MINIDP_TEST_CONFIGURATIONS={','.join(_CHOSEN)}: each must be one of {', '.join(CONFIGURATIONS)}")


@pytest.fixture(autouse=True, params=_CHOSEN)
def dataparallel_configuration(request, monkeypatch):
    """Run the test under one configuration of DataParallel's defaults (see the module docstring)."""
    configuration = CONFIGURATIONS[request.param]
    configure_dataparallel(
        monkeypatch, configuration["cache_replicas"], configuration["backend"], configuration["parallel_backward"]
    )
    return request.param


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "fresh_interpreter: the test's work runs where the configuration does not reach; it runs once"
    )


def pytest_collection_modifyitems(config, items) -> None:
    """Deselect a ``fresh_interpreter`` test's runs under every configuration but the first chosen."""
    repeats = [
        item
        for item in items
        if item.get_closest_marker("fresh_interpreter")
        and getattr(item, "callspec", None) is not None
        and item.callspec.params.get("dataparallel_configuration", _CHOSEN[0]) != _CHOSEN[0]
    ]
    if repeats:
        config.hook.pytest_deselected(items=repeats)
        deselected = set(repeats)
        items[:] = [item for item in items if item not in deselected]


def _intra_op_threads(count: int) -> Iterator[None]:
    """The caller runs ``count`` intra-op threads for the test; its own count again after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """Where README's row of ``parallel_apply`` says CPU replicas equal stock bit for bit (with more, each replica's
    share of them splits a kernel's sums otherwise)."""
    yield from _intra_op_threads(1)


@pytest.fixture
def two_intra_op_threads() -> Iterator[None]:
    """This machine's default: two intra-op threads in the caller, one per CPU replica of two."""
    yield from _intra_op_threads(2)
