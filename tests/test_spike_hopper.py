"""The Hopper forward spike's kernels (``benchmarks/spike_hopper_fwd.py``) under Triton's interpreter.

The script times on a GPU; here its ``--check-only --interpret`` mode checks the
numerics of every variant's code path (split / fused / masked key loops, tensor
descriptors, the warp-specialised loop, the persistent tile loop, lazy
rescaling) in fp16 against a float64 dense reference, at sizes where tiles
divide S and where they do not. The interpreter ignores ``warp_specialize`` and
``num_stages`` (it checks the kernel's logic, not the compiler's schedule).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "spike_hopper_fwd.py"


@pytest.fixture(scope="module")
def spike():
    """The script as a module, for the tests that run no kernel (bookkeeping, arguments).

    Imported as a GPU run would import it (no TRITON_INTERPRET): the tests that run its kernels
    under the interpreter do it in a fresh interpreter (:func:`_fresh_python`), so this process's
    Triton state is left as the other test files expect it."""
    spec = importlib.util.spec_from_file_location("_spike_hopper_fwd", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through it
    spec.loader.exec_module(mod)
    return mod


def _fresh_python(code: str) -> None:
    """Runs ``code`` (with ``spike`` bound to the script as a module) in a new interpreter started
    under TRITON_INTERPRET=1. Kernels that call other jitted functions run under the interpreter
    only when triton was first imported with the variable set, which this process cannot promise
    once another test has imported triton."""
    prelude = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_spike_hopper_fwd', {str(SCRIPT)!r})\n"
        "spike = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = spike\n"
        "spec.loader.exec_module(spike)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    proc = subprocess.run(
        [sys.executable, "-c", prelude + code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_every_variant_matches_reference_with_partial_tiles():
    # S = 136: partial row and key tiles; a window of 96 keys: edge and interior tiles
    # (the slow CLI test below adds S = 256 and 200, the defaults). About 8 s of CPU.
    _fresh_python(
        "args = spike.parse_args(['--check-only', '--interpret', '--check-lengths', '136'])\n"
        "report = spike.check_interpreted(args)\n"
        "bad = [c for c in report['checks'] if not c['ok']]\n"
        "assert not bad, bad\n"
        "ran = {c['variant'] for c in report['checks']}\n"
        "# base, persistent and lazy use only plain loads and loops: they must run here\n"
        "assert {'base', 'persistent', 'lazy'} <= ran, report['skipped']\n"
        "assert all(s['skipped'] for s in report['skipped'])  # every skip says why\n"
        "assert len(report['checks']) + len(report['skipped']) == 2 * len(spike.INTERPRET_CONFIGS)\n"
    )


def test_check_detects_a_wrong_window():
    # the tolerance separates a correct kernel from one off by a single key per row
    _fresh_python(
        "import numpy as np\n"
        "rng = np.random.default_rng(0)\n"
        "q, k, v = spike._test_inputs(rng, (1, 160, 2, 32), np.float16)\n"
        "cfg = spike.Config(32, 32, 4, 2)\n"
        "out, lse = spike.run_interpreted(cfg, q, k, v, 48, 32**-0.5)\n"
        "ro, rl = spike.reference_numpy(q, k, v, 48, 32**-0.5)\n"
        "wo, wl = spike.reference_numpy(q, k, v, 49, 32**-0.5)\n"
        "assert np.abs(out - ro).max() < spike.TOLERANCE and np.abs(lse - rl).max() < spike.TOLERANCE\n"
        "assert max(np.abs(out - wo).max(), np.abs(lse - wl).max()) > spike.TOLERANCE\n"
    )


def test_nnz_counts_the_mask(spike):
    S = 300
    r, c = np.arange(S)[:, None], np.arange(S)[None, :]
    for w in (1, 7, 64, 299, 300, 1024):
        assert spike.nnz(S, w) == int(((c <= r) & (c > r - w)).sum())
    assert spike.nnz(S, 0) == S * S
    assert spike.useful_flops(1, 16, 8192, 128, 0) == 4 * 16 * 8192**2 * 128


def test_bad_input_names_the_argument(spike):
    cfg = spike.Config(32, 32, 4, 2)
    with pytest.raises(ValueError, match="k must have a contiguous head dim"):
        strides = ((4096, 64, 32, 1), (4096, 64, 1, 2), (4096, 64, 32, 1), (4096, 64, 32, 1))
        spike._launch_args(cfg, (1, 64, 2, 32), strides, 0, 1.0, 1)
    with pytest.raises(ValueError, match="head dim D"):
        spike._launch_args(cfg, (1, 64, 2, 24), ((1, 1, 1, 1),) * 4, 0, 1.0, 1)
    with pytest.raises(SystemExit, match="--variants"):
        spike.parse_args(["--variants", "base,nope"])
    with pytest.raises(SystemExit, match="--windows"):
        spike.parse_args(["--windows", "0,-1"])


def test_summary_picks_the_fastest_config_and_ratios(spike):
    rows = [
        {"kind": "triton", "name": "base", "config": "a", "mask": "dense", "S": 8, "ms": 2.0, "tflops": 1.0},
        {"kind": "triton", "name": "base", "config": "b", "mask": "dense", "S": 8, "ms": 1.0, "tflops": 2.0},
        {"kind": "triton", "name": "tma", "config": "c", "mask": "dense", "S": 8, "error": "no"},
        {"kind": "peer", "name": "fa3", "mask": "dense", "S": 8, "ms": 0.5, "tflops": 4.0},
    ]
    table = spike.summary(rows, ["fa3", "cudnn"])
    base = next(r for r in table if r["variant"] == "base")
    assert base["config"] == "b" and base["x_fa3"] == 0.5 and base["x_cudnn"] is None
    assert not any(r["variant"] == "tma" for r in table)
    assert "peer:fa3" in spike.format_table(table, ["fa3", "cudnn"])


def test_derived_variants_take_the_fastest_config(spike):
    bench = spike.Bench.__new__(spike.Bench)  # no GPU: only the bookkeeping
    bench.args = spike.parse_args([])
    slow, fast = spike.Config(128, 128, 8, 2), spike.Config(128, 64, 8, 3, tma=True)
    win, dense = "causal_window_1024", "dense"
    bench.doc = {
        "rows": [
            {"kind": "triton", "name": "base", "cfg": asdict(slow), "mask": win, "S": 8192, "tflops": 300.0},
            {"kind": "triton", "name": "tma", "cfg": asdict(fast), "mask": win, "S": 8192, "tflops": 350.0},
            {"kind": "triton", "name": "base", "cfg": asdict(slow), "mask": dense, "S": 8192, "tflops": 9e2},
            {"kind": "peer", "name": "fa3", "mask": win, "S": 8192, "ms": 0.1, "tflops": 999.0},
            {"kind": "triton", "name": "ws", "cfg": asdict(slow), "mask": win, "S": 8192, "error": "no"},
        ]
    }
    assert bench.configs("persistent", 1024, 8192) == [replace(fast, persistent=True)]
    assert bench.configs("lazy", 1024, 8192) == [replace(fast, lazy=True)]
    assert bench.configs("persistent", 1024, 16384) == []
    assert bench.configs("tma", 0, 8192) == spike.VARIANTS["tma"]
    bench.args.quick = True
    assert bench.configs("tma", 0, 8192) == spike.VARIANTS["tma"][:1]
    # a warp-specialised winner: lazy is also built on the fastest build without ws
    ws = spike.Config(128, 128, 4, 2, tma=True, ws=True, loop="masked")
    row = {"kind": "triton", "name": "ws", "cfg": asdict(ws), "mask": win, "S": 8192, "tflops": 400.0}
    bench.doc["rows"].append(row)
    assert bench.configs("lazy", 1024, 8192) == [replace(ws, lazy=True), replace(fast, lazy=True)]
    assert bench.configs("persistent", 1024, 8192) == [replace(ws, persistent=True)]
    with pytest.raises(ValueError, match="loop must be one of"):
        spike.Config(128, 64, 8, 3, loop="diagonal")


@pytest.mark.slow
def test_cli_check_only_interpret(tmp_path):
    # the documented command, both lengths (tiles dividing S and not), JSON report and exit code
    out = tmp_path / "check.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--check-only", "--interpret", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["checks"]
    assert {c["S"] for c in report["checks"]} == {256, 200}
    assert "interpreter check:" in p.stdout
