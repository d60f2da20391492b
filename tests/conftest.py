"""Shared fixtures and markers.

* ``gpu`` tests run only where ``jax.default_backend() == "gpu"`` (skipped, and
  counted in the ``-rs`` summary, elsewhere).
* ``slow`` tests are deselected unless ``--runslow`` is given or ``-m`` names them.
* ``gemma`` tests need the optional gemma library; their module skips itself, with the
  reason, where gemma cannot be imported (it is no requirement of the default suite).
* ``models`` tests (tests/test_models_*.py) run model libraries under ``splat.sparsify``; they
  are deselected unless ``-m`` names them (``make test-models``), and skip, with the reason,
  where their library cannot be imported.
* ``rng``: a fresh ``np.random.default_rng`` seeded from the test's id, so every
  test draws its own inputs and a failure reproduces.
* ``backend``: every registered backend (``jax_bindings._registry``), in
  registry order; one that cannot run here is skipped with the registry's
  reason, so the skip summary says why ("jax" runs everywhere, "triton" and
  "cudnn" on a CUDA GPU).
* ``cuda_compiler``: the CUDA compiler (NVRTC or nvcc) of ``jax_bindings._cuda.compiler``;
  tests that compile generated CUDA C++ skip, with the reason, where there is none.
* Without a GPU, ``TRITON_INTERPRET=1`` is set here, before any test imports
  triton: every Triton kernel in the tests then runs under the interpreter, and
  Triton (3.9) runs a kernel's calls to other jitted functions there only when
  the variable was set as triton was first imported.
"""

from __future__ import annotations

import os
import zlib

import jax
import numpy as np
import pytest

from jax_bindings import _registry

# Keras reads its backend once, at its first import, which any model library may do first (gemma
# imports it): the keras-hub tests need JAX's, unless the caller chose another.
os.environ.setdefault("KERAS_BACKEND", "jax")

# Under pytest-xdist (``make test``) several processes share the machine, and a GPU: none takes
# most of its memory up front, as XLA otherwise does at its first use.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


if not _has_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers", "slow: long sweep; deselected by default (run with --runslow or -m slow)"
    )
    config.addinivalue_line("markers", "gemma: needs the optional gemma library (skipped where missing)")
    config.addinivalue_line("markers", "models: a model library's integration test (skipped where missing)")


def pytest_collection_modifyitems(config, items):
    if "models" not in (config.getoption("-m") or ""):  # `make test-models` runs them
        keep = [item for item in items if "models" not in item.keywords]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if "models" in item.keywords])
            items[:] = keep
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


def _backend_param(name: str):
    """Backends that need a GPU are marked ``gpu`` too, so ``pytest -m gpu`` runs their tests."""
    platforms = _registry.entry(name).platforms
    marks = [pytest.mark.gpu] if platforms is not None and "gpu" in platforms else []
    return pytest.param(name, marks=marks)


@pytest.fixture(params=[_backend_param(n) for n in _registry.names()])
def backend(request) -> str:
    why = _registry.unavailable(request.param)
    if why is not None:
        pytest.skip(f'backend "{request.param}" cannot run here: {why}')
    return request.param


@pytest.fixture
def fresh_registry(monkeypatch):
    """Backend imports, families, fallback warnings, the tuning store and jit caches forgotten
    before and after the test (for tests that swap backends or platforms); no SPLAT_TUNING_FILE."""
    from jax_bindings import _dispatch, _tuning

    def clear():
        _registry._load.cache_clear()
        _registry.family.cache_clear()
        _dispatch._warn_once.cache_clear()
        _tuning.store.cache_clear()
        jax.clear_caches()  # traces of the old backend modules

    monkeypatch.delenv(_tuning.ENV_FILE, raising=False)
    clear()
    yield
    clear()


@pytest.fixture(scope="session")
def cuda_compiler():
    from jax_bindings._cuda import compiler

    c = compiler.compiler()
    if isinstance(c, str):
        pytest.skip(c)
    return c
