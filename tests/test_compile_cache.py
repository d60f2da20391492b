"""The compiled-kernel disk cache (``jax_bindings._triton.cache.CompileCache``), its install
around jax-triton, and the first-call benchmark (``benchmarks/compile_time.py``, tiny, on CPU).

jax-triton does not import on a CPU-only JAX, so the cache wraps fake compile
functions here, and the installer runs against a fake ``jax_triton`` shaped like
0.3.1's ``triton_lib``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from jax_bindings._triton import cache as _cache
from jax_bindings._triton.spec import plan as _plan

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Result:  # the shape of jax_triton.triton_lib.CompilationResult
    binary: str
    name: str
    shared_mem_bytes: int
    ttgir: str | None
    llir: str | None


@dataclasses.dataclass(frozen=True)
class Options:  # the fields of triton's CUDAOptions that the key reads
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    enable_fp_fusion: bool = True
    debug: bool = False

    def hash(self) -> str:
        return f"opts-{self.num_warps}-{self.num_stages}-{self.num_ctas}-{self.enable_fp_fusion}"


class Backend:
    def hash(self) -> str:
        return "ptxas-13.0-90"


class FakeCompile:
    """Counts calls; 'compiles' a TTIR text to a PTX-like string."""

    def __init__(self):
        self.calls = 0

    def __call__(self, ttir, backend, options, compute_capability, platform):
        self.calls += 1
        text = str(ttir)
        return Result(
            f"// ptx sm_{compute_capability} w{options.num_warps}\n{text}", "kern", 4096, None, None
        )


TTIR = 'module {\n  tt.func public @kern_fwd(%arg0: !tt.ptr<bf16>) loc("/cache/fwd_ab12.py":7:0)\n}'


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLAT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPLAT_NO_DISK_CACHE", raising=False)
    return tmp_path / "triton"


def _cache_of(fake, **kw):
    return _cache.CompileCache(fake, Result, salt="triton=3.6.0;jax_triton=0.3.1", **kw)


def test_miss_compiles_and_writes_then_a_new_process_hits(folder):
    fake = FakeCompile()
    before = _cache.stats()
    r1 = _cache_of(fake)(TTIR, Backend(), Options(), 90, "cuda")
    assert fake.calls == 1
    (entry,) = folder.glob("*.json")
    data = json.loads(entry.read_text())
    assert data["result"] == dataclasses.asdict(r1) and data["key"] == entry.stem
    assert data["meta"]["compute_capability"] == 90 and data["meta"]["num_warps"] == 4
    assert not list(folder.glob("*.tmp"))  # written through a temp file, renamed

    # a fresh wrapper and a fresh compile function: what a new process has
    fake2 = FakeCompile()
    r2 = _cache_of(fake2)(TTIR, Backend(), Options(), 90, "cuda")
    assert fake2.calls == 0 and r2 == r1 and isinstance(r2, Result)
    after = _cache.stats()
    assert after["compile_calls"] - before["compile_calls"] == 2
    assert after["compiled"] - before["compiled"] == 1 and after["disk_hits"] - before["disk_hits"] == 1


@pytest.mark.parametrize(
    "change",
    [
        {"options": Options(num_warps=8)},
        {"options": Options(num_stages=2)},
        {"options": Options(enable_fp_fusion=False)},
        {"compute_capability": 100},
        {"ttir": TTIR.replace("kern_fwd", "kern_dq")},
        {"salt": "triton=3.7.0;jax_triton=0.3.1"},
    ],
    ids=["num_warps", "num_stages", "fp_fusion", "compute_capability", "ttir", "versions"],
)
def test_anything_that_changes_the_output_misses(folder, change):
    base = {"ttir": TTIR, "options": Options(), "compute_capability": 90}
    fake = FakeCompile()
    _cache_of(fake)(base["ttir"], Backend(), base["options"], base["compute_capability"], "cuda")
    args = {**base, **{k: v for k, v in change.items() if k != "salt"}}
    cache = _cache.CompileCache(fake, Result, salt=change.get("salt", "triton=3.6.0;jax_triton=0.3.1"))
    cache(args["ttir"], Backend(), args["options"], args["compute_capability"], "cuda")
    assert fake.calls == 2 and len(list(folder.glob("*.json"))) == 2


def test_key_is_stable_and_reads_the_options_hash():
    c = _cache_of(FakeCompile())
    k = c.key(TTIR, Backend(), Options(), 90, "cuda")
    assert k == _cache_of(FakeCompile()).key(TTIR, Backend(), Options(), 90, "cuda") and len(k) == 64

    @dataclasses.dataclass(frozen=True)
    class OtherHash(Options):
        def hash(self) -> str:  # e.g. another libdevice behind the same num_warps
            return "different"

    assert c.key(TTIR, Backend(), OtherHash(), 90, "cuda") != k
    assert c.key(TTIR, None, object(), 90, "cuda")  # unreadable fingerprints weaken the key, never raise


@pytest.mark.parametrize("corrupt", ["{not json", '{"format": 1}', "", "wrong-fields"])
def test_corrupt_entry_recompiles_and_overwrites(folder, corrupt):
    fake = FakeCompile()
    r1 = _cache_of(fake)(TTIR, Backend(), Options(), 90, "cuda")
    (entry,) = folder.glob("*.json")
    if corrupt == "wrong-fields":
        data = json.loads(entry.read_text())
        data["result"]["extra"] = 1
        corrupt = json.dumps(data)
    entry.write_text(corrupt)
    r2 = _cache_of(fake)(TTIR, Backend(), Options(), 90, "cuda")
    assert fake.calls == 2 and r2 == r1
    assert json.loads(entry.read_text())["result"] == dataclasses.asdict(r1)
    assert _cache_of(fake)(TTIR, Backend(), Options(), 90, "cuda") == r1 and fake.calls == 2


def test_entry_of_another_key_is_not_trusted(folder):
    fake = FakeCompile()
    c = _cache_of(fake)
    c(TTIR, Backend(), Options(), 90, "cuda")
    (entry,) = folder.glob("*.json")
    other = folder / f"{c.key(TTIR, Backend(), Options(num_warps=8), 90, 'cuda')}.json"
    other.write_text(entry.read_text())  # a copied file under the wrong name
    r = c(TTIR, Backend(), Options(num_warps=8), 90, "cuda")
    assert fake.calls == 2 and "w8" in r.binary


def test_no_disk_cache_env_debug_and_rocm_bypass(folder, monkeypatch):
    fake = FakeCompile()
    c = _cache_of(fake)
    monkeypatch.setenv("SPLAT_NO_DISK_CACHE", "1")
    c(TTIR, Backend(), Options(), 90, "cuda")
    c(TTIR, Backend(), Options(), 90, "cuda")
    assert fake.calls == 2 and not folder.exists()
    monkeypatch.setenv("SPLAT_NO_DISK_CACHE", "0")
    c(TTIR, Backend(), Options(debug=True), 90, "cuda")  # debug prints the IR: always compile
    c(TTIR, Backend(), Options(), 90, "rocm")  # ROCm's result names a temporary file
    assert fake.calls == 4 and not folder.exists()
    c(TTIR, Backend(), Options(), 90, "cuda")
    c(TTIR, Backend(), Options(), 90, "cuda")
    assert fake.calls == 5 and len(list(folder.glob("*.json"))) == 1


def test_unwritable_folder_and_odd_results_still_return(tmp_path, monkeypatch):
    monkeypatch.delenv("SPLAT_NO_DISK_CACHE", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("")
    fake = FakeCompile()
    c = _cache.CompileCache(fake, Result, folder=blocker / "triton")  # cannot mkdir under a file
    assert c(TTIR, Backend(), Options(), 90, "cuda").name == "kern"

    @dataclasses.dataclass
    class Bytes:
        binary: bytes

    c2 = _cache.CompileCache(lambda *a: Bytes(b"\x00"), Bytes, folder=tmp_path / "b")
    assert c2(TTIR, Backend(), Options(), 90, "cuda") == Bytes(b"\x00")
    assert not list((tmp_path / "b").glob("*.json"))  # not JSON: kept in memory only
    with pytest.raises(TypeError, match="dataclass"):
        _cache.CompileCache(fake, dict)


def test_rendered_counter_counts_new_modules_only(tmp_path, monkeypatch):
    import acsr

    monkeypatch.setenv("SPLAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_cache, "_MODULES", {})  # as in a new process
    i, j = np.arange(40)[:, None], np.arange(40)[None, :]
    plan = lambda: _plan(
        "softmax",
        acsr.from_dense(np.abs(i - j) <= 5),
        dtype="float32",
        head_dim=16,
        num_heads=2,
        num_kv_heads=2,
    )
    before = _cache.stats()["rendered"]
    _cache.load(plan().spec, interpret=True)
    _cache.load(plan().spec, interpret=True)  # an equal layout built again: same spec, same module
    assert _cache.stats()["rendered"] - before == 1


# -- the installer, against a fake jax_triton 0.3.1 ----------------------------------------

FAKE_TRITON_LIB = """
import dataclasses

_JAX_TRITON_DUMP_DIR = None


@dataclasses.dataclass
class CompilationResult:
    binary: str
    name: str
    shared_mem_bytes: int
    ttgir: str | None
    llir: str | None


CALLS = []


def compile_ttir_inplace(ttir, backend, options, compute_capability, platform):
    CALLS.append(str(ttir))
    return CompilationResult("ptx:" + str(ttir), "k", 0, None, None)


def get_or_create_triton_kernel(ttir, options, compute_capability):
    return compile_ttir_inplace(ttir, None, options, compute_capability, "cuda")
"""


def _fake_jax_triton(monkeypatch, source=FAKE_TRITON_LIB):
    lib = types.ModuleType("jax_triton.triton_lib")
    monkeypatch.setitem(sys.modules, "jax_triton.triton_lib", lib)
    exec(compile(textwrap.dedent(source), "<fake triton_lib>", "exec"), lib.__dict__)
    pkg = types.ModuleType("jax_triton")
    pkg.__version__ = "0.3.1"
    pkg.triton_lib = lib
    pkg.triton_call = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "jax_triton", pkg)
    return lib


def _load_triton_backend(name="_splat_test_triton_backend"):
    """A private copy of jax_bindings/_triton/backend.py (the dispatcher's own import stays untouched)."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location(name, ROOT / "jax_bindings" / "_triton" / "backend.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_installer_wraps_jax_tritons_compile_and_the_call_site_uses_it(folder, monkeypatch):
    lib = _fake_jax_triton(monkeypatch)
    original = lib.compile_ttir_inplace
    mod = _load_triton_backend()
    assert mod.COMPILE_CACHE_INSTALLED is True
    assert isinstance(lib.compile_ttir_inplace, _cache.CompileCache)
    assert lib.compile_ttir_inplace.__wrapped__ is original
    assert "triton=" in lib.compile_ttir_inplace.salt and "jax_triton=0.3.1" in lib.compile_ttir_inplace.salt
    r = lib.get_or_create_triton_kernel(TTIR, Options(), 90)
    assert isinstance(r, lib.CompilationResult) and lib.CALLS == [TTIR]
    assert len(list(folder.glob("*.json"))) == 1
    # a second install (module imported again) does not wrap twice
    _load_triton_backend("_splat_test_triton_backend_2")
    assert lib.compile_ttir_inplace.__wrapped__ is original
    # a "new process": jax-triton's in-memory cache is empty, the disk answers
    lib.compile_ttir_inplace = _cache.CompileCache(
        original, lib.CompilationResult, salt=lib.compile_ttir_inplace.salt
    )
    assert lib.get_or_create_triton_kernel(TTIR, Options(), 90) == r and lib.CALLS == [TTIR]


@pytest.mark.parametrize(
    "edit, why",
    [
        (
            ("ttir, backend, options, compute_capability, platform):", "ttir, backend, options, cc):"),
            "is not",
        ),
        (
            ('return compile_ttir_inplace(ttir, None, options, compute_capability, "cuda")', "return None"),
            "does not call",
        ),
        (("@dataclasses.dataclass\nclass", "class"), "dataclass"),
        (("_JAX_TRITON_DUMP_DIR = None", "_JAX_TRITON_DUMP_DIR = '/tmp/dump'"), "JAX_TRITON_DUMP_DIR"),
    ],
    ids=["signature", "call_site", "result_type", "dump_dir"],
)
def test_installer_leaves_an_unknown_jax_triton_alone(monkeypatch, caplog, edit, why):
    src = FAKE_TRITON_LIB.replace(*edit)
    assert src != FAKE_TRITON_LIB
    lib = _fake_jax_triton(monkeypatch, src)
    original = lib.compile_ttir_inplace
    with caplog.at_level(logging.DEBUG, logger="_splat_test_triton_backend"):
        mod = _load_triton_backend()
    assert mod.COMPILE_CACHE_INSTALLED is False and lib.compile_ttir_inplace is original
    assert any(why in r.getMessage() for r in caplog.records)


# -- the benchmark, tiny ------------------------------------------------------------------------


def _run_benchmark(tmp_path, runs: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "ct.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "compile_time.py"),
        *("--seq", "256", "--heads", "2", "--head-dim", "16", "--dtype", "float32", "--small-seq", "128"),
        *("--backend", "jax", "--runs", runs, "--out", str(out), *extra),
    ]
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "compile time:" in p.stdout and "targets:" in p.stdout
    rep = json.loads(out.read_text())
    assert [r["run"] for r in rep["runs"]] == runs.split(",")
    for r in rep["runs"]:
        assert r["backend"] == "jax" and r["platform"] == "cpu"
        assert 0 <= r["analyze_s"] <= r["fwd_ready_s"] <= r["total_s"]
        for check in ("same_mask", "from_array"):
            assert r[check]["counts"]["rendered"] == 0 and r[check]["counts"]["compile_calls"] == 0
        assert r["same_mask"]["mask_equal"] and r["from_array"]["layout_equal"]
    assert rep["targets"]["equal masks compile nothing"] and rep["ptxas"] == []
    assert rep["versions"]["jax"] and rep["config"]["seq"] == 256
    return rep, p.stdout


def test_compile_time_benchmark_runs_tiny_on_cpu(tmp_path):
    rep, _ = _run_benchmark(tmp_path, "cold", "--profile", "5")
    (cold,) = rep["runs"]
    assert cold["split"]["fwd"]["xla_compile_s"] > 0  # the forward compiled (XLA only on CPU)
    assert cold["jax_cache"] and cold["split"]["fwd"]["jax_cache_misses"] >= 1
    longest = cold["profile_fwdbwd"]  # what the first forward+backward spent its time in
    cums = [r["cum_s"] for r in longest]
    assert len(longest) == 5 and cums == sorted(cums, reverse=True)
    assert all(r["calls"] >= 1 and r["self_s"] >= 0 for r in longest)


@pytest.mark.slow
def test_compile_time_benchmark_warm_processes_reuse_the_caches(tmp_path):
    rep, _ = _run_benchmark(tmp_path, "cold,warm,warm+jax_cache")
    cold, warm, warm_jc = rep["runs"]
    assert not warm["jax_cache"] and warm["split"]["fwd"]["jax_cache_hits"] == 0
    assert (
        warm_jc["split"]["fwd"]["jax_cache_hits"] >= 1 and warm_jc["split"]["fwdbwd"]["jax_cache_hits"] >= 1
    )


# -- cubins handed to jaxlib (module images) ------------------------------------------


def _kernel_call_proto(ptx: str, *, image: bytes | None = None) -> bytes:
    """A TritonAnyKernelCall as jax-triton 0.3.1 serializes one (field numbers of triton.proto)."""
    from jax_bindings._kernel_proto import pb_bytes

    kernel = [(1, 2, b"kernel"), (2, 0, 4), (3, 0, 49152), (4, 2, ptx.encode()), (5, 2, b"ttir"), (6, 0, 90)]
    if image is not None:
        kernel.append((11, 2, pb_bytes([(1, 2, image)])))
    params = [(5, 2, pb_bytes([(1, 2, pb_bytes([(2, 0, 16)]))])), (5, 2, pb_bytes([(3, 0, 7)]))]
    call = [(1, 2, pb_bytes(kernel)), (2, 0, 128), (3, 0, 16), (4, 0, 1), *params]
    return pb_bytes([(1, 2, pb_bytes(call)), (3, 2, b"\x00meta\xff"), (4, 2, b"splat fwd")])


def test_module_image_is_attached_and_everything_else_kept():
    from jax_bindings._kernel_proto import pb_fields, with_module_image

    ptx = ".version 8.7\n.target sm_90a\n" + "x" * 300  # > 127 bytes: multi-byte lengths
    seen = []

    def image(p, cc):
        seen.append((p, cc))
        return b"\x7fELF cubin"

    old = _kernel_call_proto(ptx)
    new = with_module_image(old, image)
    assert seen == [(ptx, 90)]
    top = pb_fields(new)
    assert top[1:] == pb_fields(old)[1:]  # metadata and name untouched
    call, old_call = pb_fields(top[0][2]), pb_fields(pb_fields(old)[0][2])
    assert call[1:] == old_call[1:]  # grid and parameters untouched
    kernel, old_kernel = pb_fields(call[0][2]), pb_fields(old_call[0][2])
    assert kernel[:-1] == old_kernel  # the PTX stays: it is part of jaxlib's cache key
    num, wt, module = kernel[-1]
    assert (num, wt) == (11, 2)
    assert pb_fields(module) == [(1, 2, b"\x7fELF cubin"), (2, 2, b"kernel"), (3, 0, 49152)]


def test_module_image_left_alone_when_none_or_already_there():
    from jax_bindings._kernel_proto import with_module_image

    old = _kernel_call_proto("ptx")
    assert with_module_image(old, lambda p, cc: None) == old
    has = _kernel_call_proto("ptx", image=b"cubin")
    assert with_module_image(has, lambda p, cc: pytest.fail("must not assemble again")) == has
    autotuned = bytes([0x12, 0x00])  # field 2 (an autotuned call), empty
    assert with_module_image(autotuned, lambda p, cc: b"x") == autotuned


def test_module_image_cache_assembles_once_per_ptx(folder):
    calls = []

    def assemble(ptx):
        calls.append(ptx)
        return b"cubin:" + ptx.encode()

    before = _cache.stats()
    assert _cache.module_image("a", "sm_90a", assemble, salt="s") == b"cubin:a"
    assert _cache.module_image("a", "sm_90a", assemble, salt="s") == b"cubin:a"  # disk
    assert _cache.module_image("a", "sm_100a", assemble, salt="s") == b"cubin:a"  # other arch
    assert _cache.module_image("a", "sm_90a", assemble, salt="t") == b"cubin:a"  # other ptxas
    assert calls == ["a", "a", "a"]
    after = _cache.stats()
    assert after["images"] - before["images"] == 4 and after["image_hits"] - before["image_hits"] == 1
    files = sorted((folder.parent / "cubin").iterdir())
    assert len(files) == 3 and all(f.suffix == ".cubin" for f in files)
    files[0].write_bytes(b"")  # an empty entry is a miss, and is rewritten
    n = len(calls)
    for arch, salt in (("sm_90a", "s"), ("sm_100a", "s"), ("sm_90a", "t")):
        _cache.module_image("a", arch, assemble, salt=salt)
    assert len(calls) == n + 1 and files[0].read_bytes() == b"cubin:a"
