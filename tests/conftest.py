"""Shared fixtures and markers.

* ``gpu`` tests run only where ``jax.default_backend() == "gpu"`` (skipped, and
  counted in the ``-rs`` summary, elsewhere).
* ``slow`` tests are deselected unless ``--runslow`` is given or ``-m`` names them.
* ``rng``: a fresh ``np.random.default_rng`` seeded from the test's id, so every
  test draws its own inputs and a failure reproduces.
* ``backend``: the backends the shared test bases run on ("jax" everywhere,
  "triton" on a GPU).
"""

from __future__ import annotations

import zlib

import jax
import numpy as np
import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers", "slow: long sweep; deselected by default (run with --runslow or -m slow)"
    )


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if not (config.getoption("--runslow") or "slow" in (config.getoption("-m") or "")):
        keep, drop = [], []
        for item in items:
            (drop if "slow" in item.keywords else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.default_backend() != 'gpu')")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=["jax", pytest.param("triton", marks=pytest.mark.gpu)])
def backend(request) -> str:
    return request.param
