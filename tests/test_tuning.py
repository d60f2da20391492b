"""The tuning store reader: schema validation, S buckets, backend ranking and its heuristic."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from jax_bindings import _tuning

ROOT = Path(__file__).resolve().parents[1]


def _tile(**kw):
    return {
        "op": "fwd",
        "family": "causal_window",
        "s_bucket": 4096,
        "head_dim": 64,
        "dtype": "bfloat16",
        "config": [128, 64, 4, 3, "fused"],
        "time_ms": 0.5,
    } | kw


def _impl(**kw):
    return {
        "family": "causal_window",
        "s_bucket": 4096,
        "head_dim": 64,
        "dtype": "bfloat16",
        "pass": "fwd_bwd",
        "times_ms": {"triton": 2.0, "cudnn": 1.5},
    } | kw


def _doc(tiles=(), impls=(), **kw):
    doc = {"schema": 1, "device_kind": "NVIDIA H100 80GB HBM3"}
    return doc | {"tiles": list(tiles), "implementations": list(impls)} | kw


@pytest.fixture
def use_store(tmp_path, monkeypatch):
    """Writes a document to a file, points SPLAT_TUNING_FILE at it, and resets the store."""

    def use(doc) -> Path:
        path = tmp_path / "store.json"
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        monkeypatch.setenv(_tuning.ENV_FILE, str(path))
        _tuning.store.cache_clear()
        return path

    yield use
    _tuning.store.cache_clear()


@pytest.fixture
def no_store(monkeypatch):
    monkeypatch.delenv(_tuning.ENV_FILE, raising=False)
    _tuning.store.cache_clear()
    yield
    _tuning.store.cache_clear()


def test_device_slug():
    assert _tuning.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert _tuning.device_slug("NVIDIA H200") == "nvidia-h200"
    assert _tuning.device_slug("  TPU v5 lite ") == "tpu-v5-lite"
    assert _tuning.device_slug("cpu") == "cpu"


def test_no_file_is_an_empty_store(no_store, monkeypatch):
    monkeypatch.setattr(_tuning, "_device_kind", lambda: "Imaginary GPU 9000")
    s = _tuning.store()
    assert s.path is None and not s.tiles and not s.implementations
    assert _tuning.lookup_tiles("fwd", "causal", 1024, 64, "bfloat16") is None


def test_shipped_file_for_the_device_kind(no_store, monkeypatch, tmp_path):
    monkeypatch.setattr(_tuning, "SHIPPED_DIR", tmp_path)
    monkeypatch.setattr(_tuning, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    (tmp_path / "nvidia-h100-80gb-hbm3.json").write_text(json.dumps(_doc([_tile()])))
    assert _tuning.store_path() == tmp_path / "nvidia-h100-80gb-hbm3.json"
    assert _tuning.lookup_tiles("fwd", "causal_window", 4096, 64, "bfloat16") == (128, 64, 4, 3, "fused")
    # a shipped file must be the device's own
    (tmp_path / "nvidia-h100-80gb-hbm3.json").write_text(json.dumps(_doc(device_kind="NVIDIA H200")))
    _tuning.store.cache_clear()
    with pytest.raises(_tuning.TuningStoreError, match="device_kind 'NVIDIA H200' does not match the file"):
        _tuning.store()


def test_read_once_per_process(use_store, monkeypatch):
    use_store(_doc([_tile()]))
    first = _tuning.store()
    monkeypatch.setattr(_tuning, "load", lambda path: pytest.fail("read twice"))
    assert _tuning.store() is first
    assert _tuning.lookup_tiles("fwd", "causal_window", 4096, 64, "bfloat16") is not None


def test_lookup_tiles_exact_keys_and_nearest_bucket(use_store):
    use_store(
        _doc(
            [
                _tile(s_bucket=1024, config=[64, 64, 4, 2, "fused"]),
                _tile(s_bucket=4096, config=[128, 64, 4, 3, "split"]),
                _tile(s_bucket=4096, op="bwd_dq", config=[64, 32, 4, 3, "fused"]),
                _tile(s_bucket=4096, dtype="float16", config=[64, 128, 8, 3, "single"]),
            ]
        )
    )
    look = _tuning.lookup_tiles
    assert look("fwd", "causal_window", 4096, 64, "bfloat16") == (128, 64, 4, 3, "split")
    assert look("fwd", "causal_window", 1000, 64, "bfloat16") == (64, 64, 4, 2, "fused")
    assert look("fwd", "causal_window", 3000, 64, "bfloat16")[4] == "split"  # log2: 11.55, nearer 12
    assert look("fwd", "causal_window", 2048, 64, "bfloat16")[4] == "split"  # tie 1024/4096: larger
    assert look("fwd", "causal_window", 2**20, 64, "bfloat16")[4] == "split"  # however far
    assert look("fwd", "causal_window", 1, 64, "bfloat16")[4] == "fused"
    assert look("bwd_dq", "causal_window", 512, 64, "bfloat16") == (64, 32, 4, 3, "fused")
    assert look("fwd", "causal_window", 4096, 64, "float16")[4] == "single"
    for miss in (
        ("fwd", "causal", 4096, 64, "bfloat16"),
        ("fwd", "causal_window", 4096, 128, "bfloat16"),
        ("fwd", "causal_window", 4096, 64, "float32"),
        ("bwd_dkdv", "causal_window", 4096, 64, "bfloat16"),
    ):
        assert look(*miss) is None, miss


def test_rank_backends_by_times(use_store):
    use_store(
        _doc(
            impls=[
                _impl(s_bucket=1024, times_ms={"triton": 1.0, "cudnn": 3.0}),
                _impl(s_bucket=8192, times_ms={"triton": 9.0, "cudnn": 4.0}),
                _impl(s_bucket=8192, **{"pass": "fwd"}, times_ms={"triton": 1.0, "cudnn": 2.0}),
                _impl(family="causal", times_ms={"cudnn": 1.0}),
            ]
        )
    )
    rank = _tuning.rank_backends
    cands = ["triton", "cudnn", "toy"]
    assert rank("causal_window", 1024, 64, "bfloat16", cands) == ["triton", "cudnn", "toy"]
    assert rank("causal_window", 16384, 64, "bfloat16", cands) == ["cudnn", "triton", "toy"]
    assert rank("causal_window", 16384, 64, "bfloat16", cands, mode="fwd") == ["triton", "cudnn", "toy"]
    # no fwd entry at 1024: the nearest fwd one (8192) still answers for pass fwd
    assert rank("causal_window", 1024, 64, "bfloat16", cands, mode="fwd") == ["triton", "cudnn", "toy"]
    # untimed candidates keep their order after the timed ones; unknown names in the store are ignored
    assert rank("causal", 4096, 64, "bfloat16", ["toy", "triton", "cudnn"]) == ["cudnn", "toy", "triton"]
    assert rank("causal", 4096, 64, "bfloat16", ["toy"]) == ["toy"]
    with pytest.raises(ValueError, match="mode must be one of"):
        rank("causal", 4096, 64, "bfloat16", cands, mode="bwd")


def test_rank_backends_falls_back_to_the_other_pass(use_store):
    use_store(_doc(impls=[_impl(**{"pass": "fwd"}, times_ms={"triton": 2.0, "cudnn": 1.0})]))
    ranked = _tuning.rank_backends("causal_window", 4096, 64, "bfloat16", ["triton", "cudnn"])
    assert ranked == ["cudnn", "triton"]


@pytest.mark.parametrize(
    "cc, family, want",
    [
        ("9.0", "causal_window", ["cudnn", "triton"]),
        ("9.0", "full", ["cudnn", "triton"]),
        ("9.0", "causal", ["cudnn", "triton"]),
        ("9.0", "strided", ["triton", "cudnn"]),
        ("9.0", "other", ["triton", "cudnn"]),
        ("8.0", "causal", ["triton", "cudnn"]),
        ("10.0", "causal", ["triton", "cudnn"]),
        (None, "causal", ["triton", "cudnn"]),
    ],
)
def test_rank_backends_heuristic_without_data(no_store, monkeypatch, cc, family, want):
    monkeypatch.setattr(_tuning, "_compute_capability", lambda: cc)
    assert _tuning.rank_backends(family, 4096, 64, "bfloat16", ["triton", "cudnn"]) == want
    assert _tuning.rank_backends(family, 4096, 64, "bfloat16", ["triton"]) == ["triton"]


# -----------------------------------------------------------------------------
# malformed files: the error names the file and the field
# -----------------------------------------------------------------------------

BAD = {
    "not json": ("{schema: 1", "not JSON"),
    "not an object": ("[1, 2]", "the file must be a JSON object"),
    "schema missing": ({"device_kind": "x", "tiles": [], "implementations": []}, "schema is missing"),
    "schema 2": (_doc(schema=2), "schema 2 is not read by this splat"),
    "schema str": (_doc(schema="1"), "schema must be int"),
    "device_kind": (_doc(device_kind=3), "device_kind must be str"),
    "tiles not list": (_doc() | {"tiles": {}}, "tiles must be list"),
    "tile not object": (_doc(["x"]), r"tiles\[0\] must be a JSON object"),
    "tile op missing": (_doc([{k: v for k, v in _tile().items() if k != "op"}]), r"tiles\[0\].op is missing"),
    "tile family empty": (_doc([_tile(family="")]), r"tiles\[0\].family must not be empty"),
    "tile dtype": (_doc([_tile(dtype="fp8")]), r"tiles\[0\].dtype must be one of"),
    "tile head_dim": (_doc([_tile(head_dim=0)]), r"tiles\[0\].head_dim must be a positive integer"),
    "tile head_dim bool": (_doc([_tile(head_dim=True)]), r"tiles\[0\].head_dim must be int"),
    "tile bucket": (_doc([_tile(s_bucket=3000)]), r"tiles\[0\].s_bucket must be a power of two, got 3000"),
    "tile config length": (_doc([_tile(config=[128, 64, 4, 3])]), r"tiles\[0\].config must be \[block_m"),
    "tile config value": (_doc([_tile(config=[128, 0, 4, 3, "fused"])]), r"tiles\[0\].config\[1\] \(block_n"),
    "tile config loop": (_doc([_tile(config=[128, 64, 4, 3, 1])]), r"tiles\[0\].config\[4\] \(loop\)"),
    "tile time": (_doc([_tile(time_ms=-1)]), r"tiles\[0\].time_ms must be a positive number"),
    "tile duplicate": (_doc([_tile(), _tile(time_ms=0.1)]), r"tiles\[1\] repeats the key of tiles\[0\]"),
    "impl pass": (_doc(impls=[_impl(**{"pass": "bwd"})]), r"implementations\[0\].pass must be one of"),
    "impl times empty": (_doc(impls=[_impl(times_ms={})]), r"implementations\[0\].times_ms must name"),
    "impl time": (_doc(impls=[_impl(times_ms={"triton": "fast"})]), r"implementations\[0\].times_ms.triton"),
    "impl duplicate": (_doc(impls=[_impl(), _impl()]), r"implementations\[1\] repeats the key"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_files_raise_naming_file_and_field(use_store, case):
    doc, msg = BAD[case]
    path = use_store(doc)
    with pytest.raises(_tuning.TuningStoreError, match=msg) as info:
        _tuning.store()
    assert str(info.value).startswith(str(path))


def test_missing_override_file_is_an_error(no_store, monkeypatch, tmp_path):
    monkeypatch.setenv(_tuning.ENV_FILE, str(tmp_path / "nope.json"))
    with pytest.raises(_tuning.TuningStoreError, match="nope.json: cannot read the tuning file"):
        _tuning.lookup_tiles("fwd", "causal", 1024, 64, "bfloat16")


def test_extra_fields_are_ignored(use_store):
    use_store(_doc([_tile(measured="2026-11-01", jax="0.10.2")], note="written by splat tune"))
    assert _tuning.lookup_tiles("fwd", "causal_window", 4096, 64, "bfloat16") == (128, 64, 4, 3, "fused")


# -----------------------------------------------------------------------------
# shipped data
# -----------------------------------------------------------------------------


def test_shipped_files_are_valid_and_named_by_device():
    assert (_tuning.SHIPPED_DIR / "README.md").is_file()
    for path in _tuning.SHIPPED_DIR.glob("*.json"):
        s = _tuning.load(path)
        assert _tuning.device_slug(s.device_kind) == path.stem, path


def test_tuning_files_are_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = cfg["tool"]["setuptools"]["package-data"]["jax_bindings"]
    assert "tuning/*.json" in data and "tuning/README.md" in data
