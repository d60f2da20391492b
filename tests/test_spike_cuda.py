"""The CUDA C++ forward spike's generator (``benchmarks/cuda_fwd_source.py``).

The kernel's numerics are checked on the GPU by the spike itself (``spike_cuda_fwd.py``: every
build against a float32 reference before it is timed). Here: bad arguments are refused by name,
and, where ``nvcc`` is on PATH (this development machine; not CI), every variant the spike builds
compiles for sm_90a with no spills and no warnings, within the 168 registers a thread that
``setmaxnreg`` redistributes (the kernel hangs if the consumers ask for more than exists).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen():
    path = ROOT / "benchmarks" / "cuda_fwd_source.py"
    spec = importlib.util.spec_from_file_location("_cuda_fwd_source", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(feed="bulk"), "feed"),
        (dict(block_n=100), "block_n"),
        (dict(block_n=272), "block_n"),
        (dict(stages=0), "stages"),
    ],
)
def test_bad_arguments_are_named(gen, kwargs, name):
    with pytest.raises(ValueError, match=name):
        gen.source(None, None, **kwargs)


@pytest.mark.parametrize("left, right, name", [(-1, 0, "left"), (None, -2, "right")])
def test_negative_bounds_are_named(gen, left, right, name):
    with pytest.raises(ValueError, match=name):
        gen.source(left, right)


def test_mask_bounds_and_tile_are_baked_in(gen):
    src = gen.source(1023, 0, block_n=176, stages=3)
    assert "LEFT = 1023, RIGHT = 0" in src
    assert "BN = 176" in src and "STAGES = 3" in src
    assert "wgmma_ss_176" in src and "m64n176k16" in src
    dense = gen.source(None, None)
    assert f"LEFT = {gen.bound(None)}, RIGHT = {gen.bound(None)}" in dense


def test_shared_memory_fits_the_variants_the_spike_builds(gen):
    limit = 232448  # bytes a block may opt into on sm_90
    assert gen.smem_bytes(3, 128) <= limit
    assert gen.smem_bytes(2, 176) <= limit
    assert gen.smem_bytes(3, 176) > limit  # the spike skips it


VARIANTS = [
    {},
    dict(overlap=False, pingpong=False),
    dict(feed="cp.async"),
    dict(feed="none"),
    dict(block_n=176),
    dict(stages=3),
]


def _variant_id(kwargs: dict) -> str:
    return ",".join(f"{a}={v}" for a, v in kwargs.items()) or "tma"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) on PATH")
@pytest.mark.parametrize("kwargs", VARIANTS, ids=_variant_id)
def test_variant_compiles_for_sm90a_without_spills(gen, kwargs, tmp_path):
    cu = tmp_path / "k.cu"
    cu.write_text(gen.source(255, 0, **kwargs))
    cmd = ["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-Xptxas", "-v"]
    proc = subprocess.run([*cmd, "-o", str(tmp_path / "k.cubin"), str(cu)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", proc.stderr), proc.stderr
    regs = int(re.search(r"Used (\d+) registers", proc.stderr).group(1))
    assert regs <= 168, proc.stderr
