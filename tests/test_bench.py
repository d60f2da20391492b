"""splat bench: timing helpers, peers (checked against a float64 reference), JSON, plot, build section."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import splat
from splat import _bench, _peers, catalogue, masks
from splat._peers import PEERS, PeerUnavailable, Problem

# A tiny catalogue, both entry kinds (a mask value and a callable S -> mask).
TINY = {
    "window": masks.sliding_window(5, 3),
    "global_window": lambda s: masks.global_tokens(2) | masks.sliding_window(s // 16),
    "dilated": masks.dilated_window(12, 3),
}


def _problem(mask, s=48, b=1, h=2, d=8, mode="fwd", seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(4))
    return Problem(q, k, v, do, mask, splat.analyze(mask, q_len=s, kv_len=s), dtype, mode, "jax")


def _reference(p: Problem):
    """Dense masked attention and its VJP in float64 numpy; fully masked rows give 0."""
    q, k, v, do = (a.astype(np.float64).transpose(0, 2, 1, 3) for a in (p.q, p.k, p.v, p.do))  # [B,H,S,D]
    mask = p.layout.to_dense()
    scale = q.shape[-1] ** -0.5
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(mask, np.exp(s - m), 0.0)
    z = e.sum(-1, keepdims=True)
    prob = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
    out = prob @ v
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = prob * (dp - (dp * prob).sum(-1, keepdims=True))
    dq, dk, dv = ds @ k * scale, ds.transpose(0, 1, 3, 2) @ q * scale, prob.transpose(0, 1, 3, 2) @ do
    back = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731
    return back(out), (back(dq), back(dk), back(dv))


def _close(got, want, tol=2e-5):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    err = np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))
    assert err < tol, err


# --- formula and timing -------------------------------------------------------------------


def test_useful_flops_formula():
    assert _bench.useful_flops(2, 3, 1000, 64, "fwd") == 4 * 2 * 3 * 1000 * 64
    assert _bench.useful_flops(2, 3, 1000, 64, "fwdbwd") == 3.5 * 4 * 2 * 3 * 1000 * 64
    assert "4*B*H*nnz*D" in _bench.FLOP_FORMULA and "3.5" in _bench.FLOP_FORMULA


def test_time_call_counts_and_median():
    calls = []
    t = _bench.time_call(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7
    assert len(t["samples_ms"]) == 5
    assert t["ms"] == float(np.median(t["samples_ms"])) and t["ms_min"] == min(t["samples_ms"])


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mode": "sideways"}, "mode"),
        ({"dtype": "int8"}, "dtype"),
        ({"heads": 0}, "heads"),
        ({"lengths": ()}, "lengths"),
        ({"peers": ("dense_xla", "nope")}, "unknown peer"),
    ],
)
def test_config_rejects_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        _bench.BenchConfig(**kw)


def test_quick_defaults_and_explicit_flags():
    from splat.cli import build_parser

    quick = _bench.BenchConfig.from_args(build_parser().parse_args(["bench", "--quick"]))
    assert quick.quick and quick.repeats == 3 and len(quick.lengths) == 1
    assert quick.lengths == ((4096,) if jax.default_backend() == "gpu" else (1024,))
    args = build_parser().parse_args(
        ["bench", "--quick", "--lengths", "64", "96", "--heads", "2", "--mode", "both"]
    )
    cfg = _bench.BenchConfig.from_args(args)
    assert cfg.lengths == (64, 96) and cfg.heads == 2 and cfg.modes == ("fwd", "fwdbwd") and cfg.repeats == 3


def test_resolve_patterns_names_specs_and_errors():
    pats = dict(_bench.resolve_patterns(["window", "global_window", "causal() & strided(4)"], TINY))
    assert pats["window"](100) == masks.sliding_window(5, 3)
    assert pats["global_window"](64) == masks.global_tokens(2) | masks.sliding_window(4)
    assert pats["causal() & strided(4)"](8) == masks.causal() & masks.strided(4)
    assert [n for n, _ in _bench.resolve_patterns(None, TINY, quick=True)] == list(TINY)[:3]
    with pytest.raises(ValueError, match="neither a catalogue name"):
        _bench.resolve_patterns(["no_such_pattern"], TINY)


def test_default_catalogue_is_the_bench_catalogue():
    names = [n for n, _ in _bench.resolve_patterns(None)]
    assert names == list(catalogue.BENCH)


# --- peers compute the right thing ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("name", ["sliding_window", "dilated_window", "global_window"])
def test_dense_xla_peer_matches_reference(name, mode):
    p = _problem(catalogue.SMALL[name], mode=mode, seed=len(name) + len(mode))
    got = PEERS["dense_xla"].prepare(p).outputs()
    out, grads = _reference(p)
    if mode == "fwd":
        _close(got, out)
    else:
        _close(got[0], out)
        for g, w in zip(got[1], grads, strict=True):
            _close(g, w, 1e-4)


def test_dense_xla_peer_fully_masked_rows_are_zero():
    m = catalogue.random_mask(40, 40, density=0.2, seed=3, empty_rows=5)
    p = _problem(m, s=40)
    got = np.asarray(PEERS["dense_xla"].prepare(p).outputs())
    _close(got, _reference(p)[0])
    assert np.all(got[:, -5:] == 0)


@pytest.mark.parametrize("peer", ["splat", "splat_unfused"])
@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_splat_peers_match_reference(peer, mode):
    if not all(hasattr(splat, n) for n in ("attention", "sddmm", "softmax", "spmm")):
        pytest.skip("splat.attention / sddmm / softmax / spmm have not landed in splat/__init__.py yet")
    p = _problem(catalogue.SMALL["global_window"], s=40, mode=mode, seed=7)
    got = PEERS[peer].prepare(p).outputs()
    out, grads = _reference(p)
    if mode == "fwd":
        _close(got, out, 1e-4)
    else:
        _close(got[0], out, 1e-4)
        for g, w in zip(got[1], grads, strict=True):
            _close(g, w, 1e-3)


def test_gpu_peers_say_why_they_skip_on_cpu():
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU skip path")
    p = _problem(masks.causal(), s=32)
    for name in ("cudnn", "tokamax", "flex", "torch_sdpa"):
        with pytest.raises(PeerUnavailable) as e:
            PEERS[name].prepare(p)
        assert str(e.value)


def test_band_of_recognises_windows_only():
    s = 64
    lay = lambda m: m.to_acsr(s, s)  # noqa: E731
    assert _peers.band_of(lay(masks.sliding_window(5, 3))) == (5, 3)
    assert _peers.band_of(lay(masks.sliding_window(7, 0))) == (7, 0)
    assert _peers.band_of(lay(masks.causal())) == (s - 1, 0)
    assert _peers.band_of(lay(masks.full())) == (s - 1, s - 1)
    assert _peers.band_of(lay(masks.causal() & masks.sliding_window(9))) == (9, 0)
    for m in (
        masks.dilated_window(8, 2),
        masks.global_tokens(2) | masks.sliding_window(4),
        masks.block_local(8),
    ):
        assert _peers.band_of(lay(m)) is None


@pytest.mark.parametrize("name", sorted(catalogue.SMALL))
def test_mask_expression_matches_predicate(name):
    """The operator-only form FlexAttention gets equals the mask's own predicate."""
    m = catalogue.SMALL[name]
    f = _peers.mask_expression(m)
    assert f is not None
    q, kv = np.arange(150)[:, None], np.arange(170)[None, :]
    want = np.broadcast_to(m(q, kv), (150, 170))
    np.testing.assert_array_equal(np.broadcast_to(f(q, kv), (150, 170)), want)


def test_mask_expression_none_for_arrays():
    assert _peers.mask_expression(catalogue.random_mask(8, 8)) is None
    assert _peers.mask_expression(masks.causal() | catalogue.random_mask(8, 8)) is None


# --- the whole run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_result():
    cfg = _bench.BenchConfig(
        patterns=("window", "dilated"),
        lengths=(64,),
        heads=2,
        head_dim=16,
        mode="both",
        peers=("splat", "dense_xla", "splat_unfused", "cudnn", "flex"),
        warmup=0,
        repeats=2,
        seed=1,
        build=True,
        build_length=4096,
        analyze_length=256,
    )
    lines = []
    return _bench.run_bench(cfg, TINY, log=lines.append), "\n".join(lines)


def test_bench_json_fields(bench_result, tmp_path):
    result, printed = bench_result
    path = tmp_path / "out" / "r.json"
    _bench.write_json(result, str(path))
    r = json.loads(path.read_text())
    env = r["environment"]
    assert env["device"] == jax.devices()[0].device_kind and env["platform"] == jax.devices()[0].platform
    for key in ("jax", "jaxlib", "python", "numpy", "triton", "torch"):
        assert key in env["versions"]
    assert env["versions"]["jax"] == jax.__version__
    s = r["settings"]
    assert (s["heads"], s["head_dim"], s["batch"], s["lengths"], s["mode"]) == (2, 16, 1, [64], "both")
    assert s["patterns"] == ["window", "dilated"]
    assert r["flop_formula"] == _bench.FLOP_FORMULA
    dense = [x for x in r["results"] if x["impl"] == "dense_xla"]
    assert {(x["pattern"], x["mode"]) for x in dense} == {
        (p, m) for p in ("window", "dilated") for m in ("fwd", "fwdbwd")
    }
    for x in r["results"]:
        assert x["ms"] > 0 and len(x["samples_ms"]) == 2
        want_nnz = int(
            np.broadcast_to(TINY[x["pattern"]](np.arange(64)[:, None], np.arange(64)[None]), (64, 64)).sum()
        )
        assert x["nnz"] == want_nnz
        flops = _bench.useful_flops(1, 2, want_nnz, 16, x["mode"])
        assert x["tflops"] == pytest.approx(flops / (x["ms"] * 1e-3) / 1e12)
        assert x["temp_bytes"] is None or x["temp_bytes"] >= 0
    # every requested peer either ran or was skipped with a reason
    for pattern in ("window", "dilated"):
        for mode in ("fwd", "fwdbwd"):
            for peer in s["peers"]:
                ran = any((x["pattern"], x["mode"], x["impl"]) == (pattern, mode, peer) for x in r["results"])
                why = [
                    x["reason"]
                    for x in r["skipped"]
                    if (x["pattern"], x["mode"], x["impl"]) == (pattern, mode, peer)
                ]
                assert ran != bool(why), (pattern, mode, peer)
    assert "4*B*H*nnz*D" in printed and "x splat" in printed and "dense_xla" in printed


def test_bench_ratios_and_memory(bench_result):
    result, _ = bench_result
    splat_rows = {(x["pattern"], x["mode"]): x for x in result["results"] if x["impl"] == "splat"}
    if not splat_rows:
        pytest.skip("splat.attention has not landed yet: no splat rows to take ratios against")
    for x in result["results"]:
        sp = splat_rows[(x["pattern"], x["mode"])]
        assert x["vs_splat"] == pytest.approx(x["ms"] / sp["ms"])
    assert result["memory"], "memory section missing although splat and dense_xla both ran"
    for m in result["memory"]:
        assert m["dense_temp_bytes"] >= 0 and m["splat_temp_bytes"] >= 0


def test_build_section(bench_result):
    result, printed = bench_result
    b = result["build"]
    assert b["length"] == 4096 and b["analyze_length"] == 256 and b["cache_cleared"] is True
    by = {x["pattern"]: x for x in b["patterns"]}
    assert set(by) == {"window", "dilated"}
    for name, x in by.items():
        assert x["build_ms"] > 0 and x["analyze_ms"] > 0
        assert x["nnz"] == TINY[name].to_acsr(4096, 4096).nnz
        # analysing the dense rendering finds the same mask at the smaller size
        assert x["analyze_nnz"] == TINY[name].to_acsr(256, 256).nnz
    assert "layout construction" in printed


def test_plot_bench_writes_png(bench_result, tmp_path):
    pytest.importorskip("matplotlib")
    from splat._plot import plot_bench

    path = tmp_path / "b.png"
    plot_bench(bench_result[0], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from splat.cli import main

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            "bench",
            "--patterns",
            "sliding_window(6) | sink(2)",
            "--lengths",
            "48",
            "--heads",
            "1",
            "--head-dim",
            "8",
            "--peers",
            "dense_xla",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert [x["impl"] for x in r["results"]] == ["dense_xla"] and r["results"][0]["S"] == 48
    assert png.stat().st_size > 0
    assert "useful FLOPs" in capsys.readouterr().out


def test_cli_bench_bad_pattern_is_a_clear_error(capsys):
    from splat.cli import main

    assert main(["bench", "--patterns", "no_such_thing", "--lengths", "32"]) == 2
    assert "neither a catalogue name" in capsys.readouterr().err


def test_benchmark_scripts_smoke(tmp_path, capsys):
    """benchmarks/run_cpu.py --quick: the acceptance JSON has its fields (tiny sizes)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "run_cpu.py"
    spec = importlib.util.spec_from_file_location("run_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "cpu.json"
    mod.main(["--quick", "--out", str(out)])
    r = json.loads(out.read_text())
    acc = r["acceptance"]
    assert acc["pattern"] == "sliding_window(256,256)" and acc["fwd"]["dense_ms"] > 0
    assert {x["pattern"] for x in r["build"]["patterns"]} == set(catalogue.BENCH)
    if hasattr(splat, "attention"):
        assert acc["fwd"]["speed_ratio_dense_over_splat"] > 0
        assert acc["fwd"]["memory_ratio_dense_over_splat"] > 0


def test_time_call_batches_launches_and_syncs_once_per_sample():
    events = []
    t = _bench.time_call(
        lambda: events.append("run"),
        warmup=1,
        repeats=3,
        launch=lambda: events.append("launch"),
        sync=lambda: events.append("sync"),
        per_sample=4,
    )
    assert events == ["run"] + (["launch"] * 4 + ["sync"]) * 3
    assert t["per_sample"] == 4 and len(t["samples_ms"]) == 3
