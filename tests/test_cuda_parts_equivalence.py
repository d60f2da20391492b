"""The CUDA kernels as parts (``jax_bindings._cuda.parts``): what the backend compiles is what is read.

The forward and backward kernels are ``.cu`` files under ``jax_bindings/_cuda/kernels/``, composed
by ``#include`` with one generated header of a variant's constants. The backend compiles a
variant's program, its parts handed to NVRTC by name (``plan.compiled``); tests, spikes and
``SPLAT_DUMP_KERNELS`` read it as one text (``Program.flat``, ``source.source``). Here, on CPU:
every part is included once and every include resolves; the program and its one text compile to
the same cubin, byte for byte; the backend compiles the program.

That the move of the kernels from string templates into these parts changed no instruction is
shown by ``benchmarks/cuda_code_digests.py``: it compiles every variant the tests and the planner
build and compares the digests of their PTX and SASS with a run recorded before a change.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path, PurePosixPath

import pytest

from jax_bindings._cuda import bwd_source, compiler, parts, plan, source
from splat import masks

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _programs() -> dict[str, parts.Program]:
    causal = masks.causal().to_acsr(1024)
    window = masks.sliding_window(255, 0).to_acsr(1024)
    grid = masks.neighborhood((16, 20), (7, 5)).to_acsr()
    return {
        "fwd-causal-ids": plan.fwd_variant(causal, 128, "bfloat16", "ids").program(),
        "fwd-window-shifted": plan.fwd_variant(window, 128, "float16", "lengths", shifted=True).program(),
        "fwd-queue-sections": source.program(None, 0, schedule="queue", section_bytes=16 << 20),
        "fwd-grid": plan.fwd_variant(grid, 128, "bfloat16").program(),
        "bwd-causal-ids": plan.bwd_variant(causal, 128, "bfloat16", "ids").program(),
        "bwd-block-local": bwd_source.program(192, 95, band_block=96, key_order="first_first", ordered=False),
    }


PROGRAMS = _programs()


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_every_include_resolves_to_a_part_included_once(name):
    prog = PROGRAMS[name]
    headers = prog.header_map()
    kernel = name.split("-")[0]
    config = f"{kernel}_config.cuh"
    assert config in headers and f'#include "{config}"' in prog.source
    # the parts the kernel includes, directly or through others: each resolves, and is #pragma once
    used, todo = set(), INCLUDE.findall(prog.source)
    while todo:
        part = todo.pop()
        assert part in headers, f"{part!r} is included, and no part or generated header is"
        if part not in used:
            used.add(part)
            assert "#pragma once" in headers[part], part
            todo += INCLUDE.findall(headers[part])
    assert {n.split("/")[0] for n in used} == {"common", kernel, config}  # not the other kernels' parts
    assert set(headers) == used  # the program holds what it includes, and the dump shows no more
    flat = prog.flat()
    assert not INCLUDE.search(flat) and "#pragma once" not in flat
    assert flat.startswith(f"#define SPLAT_KERNEL_NAME {prog.name}\n")
    assert not set(re.findall(r"__[A-Z][A-Z_0-9]*__", flat)) - {"__CUDACC_RTC__"}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_program_and_its_one_text_compile_to_the_same_cubin(cuda_compiler, name):
    prog = PROGRAMS[name]
    from_parts, log = cuda_compiler.compile(prog.source, headers=prog.header_map())
    assert "warning" not in log.lower(), log
    assert cuda_compiler.compile(prog.flat())[0] == from_parts


def test_the_backend_compiles_the_program(monkeypatch):
    calls = []
    monkeypatch.setattr(compiler, "cubin", lambda text, headers=None: calls.append((text, headers)) or b"")
    variant = plan.rescheduled(
        plan.fwd_variant(masks.full().to_acsr(512), 128, "float16"), "strided", 5 << 20
    )
    name, _ = plan.compiled.__wrapped__(variant)
    ((text, headers),) = calls
    prog = variant.program()
    assert (name, text, headers) == (prog.name, prog.source, prog.header_map())
    assert "constexpr int SECTION_BYTES = 5242880;" in headers["fwd_config.cuh"]


def test_a_dump_prints_the_parts(monkeypatch, capsys):
    monkeypatch.setenv("SPLAT_DUMP_KERNELS", "1")
    prog = bwd_source.program(None, 0)
    err = capsys.readouterr().err
    assert f"# splat kernel {prog.name}" in err
    assert "// ===== bwd_config.cuh =====" in err and "// ===== bwd/mainloop.cuh =====" in err


def test_every_kernel_file_ships_as_package_data():
    """NVRTC reads the parts from the installed package: each .cu and .cuh is package data."""
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    kernels = sorted((root / "jax_bindings" / "_cuda" / "kernels").rglob("*.cu*"))
    assert {p.parent.name for p in kernels} >= {"common", "fwd", "bwd", "decode"}
    for path in kernels:
        rel = PurePosixPath(path.relative_to(root / "jax_bindings").as_posix())
        assert any(rel.match(g) for g in globs["jax_bindings"]), f"{rel} is not package data"
