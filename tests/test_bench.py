"""splat bench: timing helpers, peers (checked against a float64 reference), JSON, plot, build section."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import jax
import numpy as np
import pytest

import splat
from splat import catalogue, masks
from splat.tools import bench, check, mask_forms, peers, timing
from splat.tools.peers import PEERS, Peer, PeerUnavailable, Problem

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
    assert bench.useful_flops(2, 3, 1000, 64, "fwd") == 4 * 2 * 3 * 1000 * 64
    assert bench.useful_flops(2, 3, 1000, 64, "fwdbwd") == 3.5 * 4 * 2 * 3 * 1000 * 64
    assert "4*B*H*nnz*D" in bench.FLOP_FORMULA and "3.5" in bench.FLOP_FORMULA


def test_time_call_counts_and_median():
    calls = []
    t = timing.time_call(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7
    assert len(t["samples_ms"]) == 5
    assert t["ms"] == float(np.median(t["samples_ms"])) and t["ms_min"] == min(t["samples_ms"])


def test_interleaved_rounds_rotate_and_drop_a_failing_sampler():
    """Warmups first, then one sample of each sampler a round, round r starting at the r-th; a
    sampler that raises leaves the rounds and is reported, the others keep all their samples."""
    order = []

    def run(name):
        def call():
            order.append(name)
            if name == "c" and order.count("c") == 3:  # c's warmup, its first sample, then it fails
                raise RuntimeError("device lost")

        return call

    samplers = {n: timing.Sampler(run(n)) for n in "abc"}
    results, errors = timing.time_interleaved(samplers, warmup=1, repeats=3)
    assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "a", "b"]
    assert set(results) == {"a", "b"} and list(errors) == ["c"] and "device lost" in str(errors["c"])
    assert all(len(r["samples_ms"]) == 3 and r["timing"] == "one blocking call" for r in results.values())


def test_a_sampler_alone_is_time_call():
    calls = []
    t = timing.Sampler(lambda: calls.append(1)).alone(warmup=1, repeats=4)
    assert len(calls) == 5 and len(t["samples_ms"]) == 4 and t["per_sample"] == 1


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
        bench.BenchConfig(**kw)


def test_quick_defaults_and_explicit_flags():
    from splat.tools.cli import build_parser

    quick = bench.BenchConfig.from_args(build_parser().parse_args(["bench", "--quick"]))
    assert quick.quick and quick.repeats == 3 and len(quick.lengths) == 1
    assert quick.lengths == ((4096,) if jax.default_backend() == "gpu" else (1024,))
    args = build_parser().parse_args(
        ["bench", "--quick", "--lengths", "64", "96", "--heads", "2", "--mode", "both"]
    )
    cfg = bench.BenchConfig.from_args(args)
    assert cfg.lengths == (64, 96) and cfg.heads == 2 and cfg.modes == ("fwd", "fwdbwd") and cfg.repeats == 3


def test_resolve_patterns_names_specs_and_errors():
    pats = dict(bench.resolve_patterns(["window", "global_window", "causal() & strided(4)"], TINY))
    assert pats["window"](100) == masks.sliding_window(5, 3)
    assert pats["global_window"](64) == masks.global_tokens(2) | masks.sliding_window(4)
    assert pats["causal() & strided(4)"](8) == masks.causal() & masks.strided(4)
    assert [n for n, _ in bench.resolve_patterns(None, TINY, quick=True)] == list(TINY)[:3]
    with pytest.raises(ValueError, match="neither a catalogue name"):
        bench.resolve_patterns(["no_such_pattern"], TINY)


def test_default_catalogue_is_the_bench_catalogue():
    names = [n for n, _ in bench.resolve_patterns(None)]
    assert names == list(catalogue.BENCH) + list(catalogue.GRID) == catalogue.suite()


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
    for name in ("cudnn", "cudnn_dense", "tokamax", "flex", "torch_sdpa"):
        with pytest.raises(PeerUnavailable) as e:
            PEERS[name].prepare(p)
        assert str(e.value)


def test_band_of_recognises_windows_only():
    s = 64
    lay = lambda m: m.to_acsr(s, s)  # noqa: E731
    assert mask_forms.band_of(lay(masks.sliding_window(5, 3))) == (5, 3)
    assert mask_forms.band_of(lay(masks.sliding_window(7, 0))) == (7, 0)
    assert mask_forms.band_of(lay(masks.causal())) == (s - 1, 0)
    assert mask_forms.band_of(lay(masks.full())) == (s - 1, s - 1)
    assert mask_forms.band_of(lay(masks.causal() & masks.sliding_window(9))) == (9, 0)
    for m in (
        masks.dilated_window(8, 2),
        masks.global_tokens(2) | masks.sliding_window(4),
        masks.block_local(8),
    ):
        assert mask_forms.band_of(lay(m)) is None


@pytest.mark.parametrize("name", sorted(catalogue.SMALL))
def test_mask_expression_matches_predicate(name):
    """The operator-only form FlexAttention gets equals the mask's own predicate."""
    m = catalogue.SMALL[name]
    f = mask_forms.mask_expression(m)
    assert f is not None
    q, kv = np.arange(150)[:, None], np.arange(170)[None, :]
    want = np.broadcast_to(m(q, kv), (150, 170))
    np.testing.assert_array_equal(np.broadcast_to(f(q, kv), (150, 170)), want)


@pytest.mark.parametrize("causal", [True, False])
def test_mask_expression_of_sinks_keeps_their_causality(causal):
    m = masks.sink(3, causal=causal) | masks.sliding_window(5, 0)
    q, kv = np.arange(40)[:, None], np.arange(40)[None, :]
    got = np.broadcast_to(mask_forms.mask_expression(m)(q, kv), (40, 40))
    np.testing.assert_array_equal(got, np.broadcast_to(m(q, kv), (40, 40)))
    assert got[0, 2] != causal  # row 0 sees sink key 2 only in the bidirectional form


def test_mask_expression_none_for_arrays():
    assert mask_forms.mask_expression(catalogue.random_mask(8, 8)) is None
    assert mask_forms.mask_expression(masks.causal() | catalogue.random_mask(8, 8)) is None


# --- the whole run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_result():
    cfg = bench.BenchConfig(
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
    return bench.run_bench(cfg, TINY, log=lines.append), "\n".join(lines)


def test_bench_json_fields(bench_result, tmp_path):
    result, printed = bench_result
    path = tmp_path / "out" / "r.json"
    bench.write_json(result, str(path))
    r = json.loads(path.read_text())
    env = r["environment"]
    assert env["device"] == jax.devices()[0].device_kind and env["platform"] == jax.devices()[0].platform
    for key in ("jax", "jaxlib", "python", "numpy", "triton", "torch"):
        assert key in env["versions"]
    assert env["versions"]["jax"] == jax.__version__
    s = r["settings"]
    assert (s["heads"], s["head_dim"], s["batch"], s["lengths"], s["mode"]) == (2, 16, 1, [64], "both")
    assert s["patterns"] == ["window", "dilated"]
    assert r["flop_formula"] == bench.FLOP_FORMULA
    assert r["timing_method"] == f"{timing.TIMING_METHOD} {timing.INTERLEAVING}"
    assert s["per_sample"] == (10 if jax.default_backend() == "gpu" else 1)
    dense = [x for x in r["results"] if x["impl"] == "dense_xla"]
    assert {(x["pattern"], x["mode"]) for x in dense} == {
        (p, m) for p in ("window", "dilated") for m in ("fwd", "fwdbwd")
    }
    for x in r["results"]:
        assert x["ms"] > 0 and len(x["samples_ms"]) == 2
        assert x["per_sample"] >= s["per_sample"] and x["timing"]  # more where min_sample_ms asks
        if x["impl"] != "flex" and s["per_sample"] > 1:  # JAX peers chain their calls
            assert x["calls_per_launch"] == s["per_sample"] and "chained" in x["timing"]
        want_nnz = int(
            np.broadcast_to(TINY[x["pattern"]](np.arange(64)[:, None], np.arange(64)[None]), (64, 64)).sum()
        )
        assert x["nnz"] == want_nnz
        flops = bench.useful_flops(1, 2, want_nnz, 16, x["mode"])
        assert x["tflops"] == pytest.approx(flops / (x["ms"] * 1e-3) / 1e12)
        assert x["temp_bytes"] is None or x["temp_bytes"] >= 0
        # splat's own rows say which backend ran ("unknown" where jax_bindings cannot say)
        if x["impl"].startswith("splat"):
            assert isinstance(x["splat_backend"], str)
        else:
            assert x["splat_backend"] is None
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
    from splat.tools.plot import plot_bench

    path = tmp_path / "b.png"
    plot_bench(bench_result[0], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from splat.tools.cli import main

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
    from splat.tools.cli import main

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
    t = timing.time_call(
        lambda: events.append("run"),
        warmup=1,
        repeats=3,
        launch=lambda: events.append("launch"),
        sync=lambda: events.append("sync"),
        per_sample=4,
    )
    assert events == (["launch"] * 4 + ["sync"]) * 4  # warmup samples are taken the same way
    assert t["per_sample"] == 4 and t["calls_per_launch"] == 1 and len(t["samples_ms"]) == 3
    assert t["timing"] == "4 launches, one sync"


def test_time_call_divides_by_the_calls_each_launch_makes():
    events = []
    t = timing.time_call(
        None,
        warmup=0,
        repeats=2,
        launch=lambda: (events.append("launch"), time.sleep(0.01)),
        sync=lambda: events.append("sync"),
        per_sample=6,
        calls_per_launch=3,
    )
    assert events == ["launch", "launch", "sync"] * 2  # 6 calls a sample: 2 launches of 3
    assert 0.02 / 6 * 1e3 <= t["ms_min"] < 0.02 / 6 * 1e3 * 3  # 20 ms per sample, over 6 calls
    assert t["timing"] == "2 x 3 calls chained in one executable, one sync"
    with pytest.raises(ValueError, match="multiple"):
        timing.time_call(None, 0, 1, launch=lambda: None, sync=lambda: None, per_sample=4, calls_per_launch=3)


def test_time_call_adds_launches_until_a_sample_lasts_min_sample_ms():
    launches = []
    t = timing.time_call(
        None,
        warmup=1,
        repeats=2,
        launch=lambda: (launches.append(1), time.sleep(0.002)),
        sync=lambda: None,
        per_sample=4,
        calls_per_launch=2,
        min_sample_ms=20,
    )
    per_launch = t["per_sample"] // 2
    assert 6 <= per_launch <= 10  # 2 ms launches: about 10 to reach 20 ms, never fewer than asked
    assert len(launches) == 2 + 2 + 2 * per_launch  # warmup and probe with 2 launches, then the samples
    assert t["timing"] == f"{per_launch} x 2 calls chained in one executable, one sync"
    assert 0.002 / 2 * 1e3 <= t["ms_min"] < 0.002 / 2 * 1e3 * 3  # ms per call, 2 calls a launch


# --- timing chains: n calls in one executable, none merged by XLA ----------------------------------


def _dots(fn, args) -> list[str]:
    """Result shapes of the dot ops in the optimised HLO of ``jax.jit(fn)`` for ``args``."""
    txt = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r"= (\S+) dot\(", txt)


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("peer", ["dense_xla", "splat"])
def test_chain_keeps_every_call_in_the_compiled_hlo(peer, mode):
    """XLA (here the CPU's, which drops optimization barriers before CSE) keeps all n calls."""
    p = _problem(catalogue.SMALL["global_window"], mode=mode)
    if peer == "dense_xla":
        fn, args, feed = peers._jax_program(peers._dense_attention, p, (p.dense_mask(),))
    else:
        if not hasattr(splat, "attention"):
            pytest.skip("splat.attention has not landed yet")
        attn = lambda q, k, v: splat.attention(q, k, v, mask=p.mask, backend="jax")  # noqa: E731
        fn, args, feed = peers._jax_program(attn, p)
    one = _dots(fn, args)
    assert one, "no dot ops to count"
    for n in (2, 4):
        many = _dots(timing.chain(fn, n, feed), args)
        # n times every dot at full size: none merged (CSE), dropped (DCE) or shrunk to the slice kept
        assert sorted(many) == sorted(one * n), (n, one, many)
    # without the chain's dependencies XLA merges the calls: the count above can fail
    naive = lambda *a: [fn(*a) for _ in range(4)][-1]  # noqa: E731
    assert len(_dots(naive, args)) == len(one)


def test_chain_example_and_feed_check():
    import jax.numpy as jnp

    chained = jax.jit(timing.chain(lambda x: jnp.tanh(x @ x), 3, {0: 0}))
    out, _ = chained(jnp.eye(4) * 0.5)
    want = np.eye(4) * 0.5
    for _ in range(3):
        want = np.tanh(want @ want)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    with pytest.raises(ValueError, match="feed"):
        jax.jit(timing.chain(lambda x: x.sum(0), 2, {0: 0}))(jnp.ones((3, 4)))
    with pytest.raises(ValueError, match="n >= 1"):
        timing.chain(lambda x: x, 0, {})


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_jax_peer_launch_makes_per_sample_calls_and_outputs_one(mode):
    p = dataclasses.replace(_problem(catalogue.SMALL["sliding_window"], mode=mode), per_sample=3)
    prepared = PEERS["dense_xla"].prepare(p)
    assert prepared.calls_per_launch == 3
    prepared.launch()
    prepared.sync()
    out, grads = _reference(p)  # outputs() is still one call on the problem's inputs
    got = prepared.outputs()
    _close(got if mode == "fwd" else got[0], out)
    t = timing.time_call(
        prepared.run, 1, 2, launch=prepared.launch, sync=prepared.sync, per_sample=3, calls_per_launch=3
    )
    assert t["ms"] > 0 and t["per_sample"] == 3 and t["timing"].startswith("1 x 3 calls chained")


# --- every peer's output is checked against splat's ------------------------------------------------


def _other_mask_peer(wrong):
    """A peer that is fast and wrong: dense XLA attention with another mask."""

    def prepare(problem):
        s = problem.seq_len
        lay = wrong.to_acsr(s, s)
        return PEERS["dense_xla"].prepare(dataclasses.replace(problem, mask=wrong, layout=lay, _dense=[]))

    return Peer("other_mask", "dense XLA with the wrong mask", prepare)


def _unavailable(problem):
    raise PeerUnavailable("not here")


@pytest.fixture(scope="module")
def checked_result():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PEERS, "other_mask", _other_mask_peer(masks.sliding_window(2, 2)))
        unchecked = Peer(
            "unchecked", "dense XLA, unchecked", PEERS["dense_xla"].prepare, no_check="by design"
        )
        mp.setitem(PEERS, "unchecked", unchecked)
        mp.setitem(PEERS, "unavailable", Peer("unavailable", "never runs", _unavailable))
        cfg = bench.BenchConfig(
            patterns=("window", "dilated"),
            lengths=(48,),
            heads=2,
            head_dim=8,
            peers=("splat", "dense_xla", "other_mask", "unchecked", "unavailable", "flex"),
            warmup=0,
            repeats=1,
        )
        lines = []
        return bench.run_bench(cfg, TINY, log=lines.append), "\n".join(lines)


def test_check_flags_a_peer_with_another_mask(checked_result, tmp_path):
    result, printed = checked_result
    bad = [x for x in result["results"] if x["impl"] == "other_mask"]
    assert len(bad) == 2  # timed all the same
    for x in bad:
        assert x["agrees"] is False and x["ms"] > 0
        assert x["max_abs_err_vs_splat"] > x["check_tolerance"] > 0
    assert sorted((d["pattern"], d["impl"], d["S"], d["dtype"]) for d in result["disagreements"]) == [
        ("dilated", "other_mask", 48, "float32"),
        ("window", "other_mask", 48, "float32"),
    ]
    assert "DISAGREES WITH SPLAT" in printed and "DISAGREEMENTS" in printed
    path = tmp_path / "r.json"
    bench.write_json(result, str(path))
    r = json.loads(path.read_text())
    assert r["check_rule"] == check.CHECK_RULE and len(r["disagreements"]) == 2


def test_check_unchecked_and_skipped_peers(checked_result):
    result, _ = checked_result
    rows = {(x["pattern"], x["impl"]): x for x in result["results"]}
    for pattern in ("window", "dilated"):
        assert rows[(pattern, "splat")]["max_abs_err_vs_splat"] == 0.0
        assert rows[(pattern, "dense_xla")]["agrees"] is True
        # an unchecked peer says why; skipped peers neither break the check nor get rows
        un = rows[(pattern, "unchecked")]
        assert un["agrees"] is None and un["check"] == "by design" and un["max_abs_err_vs_splat"] is None
    assert {x["impl"] for x in result["results"]} == {"splat", "dense_xla", "other_mask", "unchecked"}
    assert {s["impl"] for s in result["skipped"]} == {"unavailable", "flex"}
    assert PEERS["torch_sdpa"].no_check == "no mask (dense ceiling)"
    assert all(not p.no_check for n, p in PEERS.items() if n != "torch_sdpa")


def test_check_real_peers_agree_and_fwdbwd_reuses_the_fwd_check(bench_result):
    result, _ = bench_result
    assert result["disagreements"] == [] and result["check_rule"] == check.CHECK_RULE
    rows = {(x["pattern"], x["mode"], x["impl"]): x for x in result["results"]}
    keys = ("max_abs_err_vs_splat", "rel_err_vs_splat", "check_tolerance", "agrees", "check")
    for pattern in ("window", "dilated"):
        for peer in ("splat", "splat_unfused", "dense_xla"):
            fwd, both = rows[(pattern, "fwd", peer)], rows[(pattern, "fwdbwd", peer)]
            assert fwd["agrees"] is True, fwd
            assert fwd["rel_err_vs_splat"] <= 1e-5  # float32 on the CPU: agreement to rounding
            assert {k: both[k] for k in keys} == {k: fwd[k] for k in keys}


def test_check_without_splat_among_the_peers_computes_splat_once(monkeypatch):
    monkeypatch.setitem(PEERS, "other_mask", _other_mask_peer(masks.sliding_window(1, 0)))
    cfg = bench.BenchConfig(
        patterns=("dilated",),
        lengths=(40,),
        heads=1,
        head_dim=8,
        mode="both",
        peers=("dense_xla", "other_mask"),
        repeats=1,
    )
    result = bench.run_bench(cfg, TINY, log=lambda s: None)
    agrees = {(x["impl"], x["mode"]): x["agrees"] for x in result["results"]}
    assert agrees == {
        ("dense_xla", "fwd"): True,
        ("dense_xla", "fwdbwd"): True,
        ("other_mask", "fwd"): False,
        ("other_mask", "fwdbwd"): False,
    }
    # listed once per (pattern, S, dtype, peer), not once per mode
    assert [d["impl"] for d in result["disagreements"]] == ["other_mask"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_check_real_peers_agree_in_half_precision(dtype):
    cfg = bench.BenchConfig(
        patterns=("global_window",),
        lengths=(64,),
        heads=2,
        head_dim=32,
        dtype=dtype,
        peers=("splat", "splat_unfused", "dense_xla"),
        repeats=1,
    )
    result = bench.run_bench(cfg, TINY, log=lambda s: None)
    assert len(result["results"]) == 3 and not result["disagreements"]
    for x in result["results"]:
        assert x["agrees"] is True and x["check_tolerance"] > 0


def test_compare_outputs_rules():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 8, 2, 4)).astype(np.float32)
    scale = float(np.abs(ref).max())
    ok = check.compare_outputs(ref + 0.5 * check.CHECK_RTOL["bfloat16"] * scale, ref, "bfloat16")
    assert ok["agrees"] is True
    assert ok["rel_err_vs_splat"] == pytest.approx(0.5 * check.CHECK_RTOL["bfloat16"], rel=1e-4)
    far = check.compare_outputs(ref + 2 * check.CHECK_RTOL["float32"] * scale, ref, "float32")
    assert far["agrees"] is False
    nan = ref.copy()
    nan[0, 0, 0, 0] = np.nan
    assert check.compare_outputs(nan, ref, "float32")["agrees"] is False
    assert check.compare_outputs(ref[:, :4], ref, "float32")["agrees"] is False
    zero = np.zeros_like(ref)
    assert check.compare_outputs(zero, zero, "float16")["agrees"] is True  # all rows fully masked


def test_torch_outputs_come_back_as_bshd_float32():
    class FakeTensor:  # what _torch_to_host touches of a torch tensor
        def __init__(self, a):
            self.a = a

        def detach(self):
            return self

        def float(self):
            return FakeTensor(self.a.astype(np.float32))

        def cpu(self):
            return self

        def numpy(self):
            return self.a

    bhsd = np.arange(2 * 3 * 5 * 4, dtype=np.float16).reshape(2, 3, 5, 4)
    got = peers._torch_to_host(FakeTensor(bhsd))
    assert got.dtype == np.float32 and got.shape == (2, 5, 3, 4)
    np.testing.assert_array_equal(got, bhsd.transpose(0, 2, 1, 3))


# --- benchmarks/unfused_bw.py ------------------------------------------------------------------------


def _load_script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_unfused_bw_tiny(tmp_path, capsys):
    mod = _load_script("unfused_bw")
    out = tmp_path / "bw.json"
    argv = ["--patterns", "sliding_window(16, 16)", "--lengths", "256", "--heads", "2", "--head-dim", "16"]
    argv += ["--dtype", "float32", "--copy-mib", "1", "--matmul-n", "64", "--warmup", "0", "--repeats", "2"]
    mod.main([*argv, "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["schema"] == mod.SCHEMA and r["environment"]["device"] == jax.devices()[0].device_kind
    assert r["timing_method"] == timing.TIMING_METHOD and r["per_sample"] >= 1
    assert r["copy"]["gbps"] > 0 and r["copy"]["bytes"] == 2 * 2**20
    assert r["matmul"]["tflops"] > 0 and r["matmul"]["flops"] == 2 * 64**3
    assert r["backend"] == ("triton" if jax.default_backend() == "gpu" else "jax")
    rows = {x["op"]: x for x in r["rows"]}
    assert set(rows) == {"sddmm", "softmax", "spmm"} and not r["skipped"]
    # the window's geometry, counted by hand: rows hold min(r+16, 255) - max(r-16, 0) + 1 columns
    s, h, d, e, w = 256, 2, 16, 4, 33
    nnz = sum(min(i + 16, s - 1) - max(i - 16, 0) + 1 for i in range(s))
    assert rows["sddmm"]["nnz"] == nnz and rows["sddmm"]["nnz_max"] == w
    qkv = s * h * d * e  # one [B, S, H, D] array, B = 1
    assert rows["sddmm"]["bytes"] == 2 * qkv + h * s * w * e
    assert rows["softmax"]["bytes"] == h * nnz * e + h * s * w * e
    assert rows["softmax"]["bytes_all_slots"] == 2 * h * s * w * e
    assert rows["spmm"]["bytes"] == h * nnz * e + 2 * qkv
    assert (
        rows["sddmm"]["flops"] == rows["spmm"]["flops"] == 2 * h * nnz * d and rows["softmax"]["flops"] == 0
    )
    for x in r["rows"]:
        assert x["ms"] > 0 and len(x["samples_ms"]) == 2
        assert x["calls_per_launch"] == r["per_sample"] and x["per_sample"] % r["per_sample"] == 0
        assert x["gbps"] == pytest.approx(x["bytes"] / (x["ms"] * 1e-3) / 1e9)
        assert x["frac_copy_bw"] == pytest.approx(x["gbps"] / r["copy"]["gbps"])
        assert x["frac_matmul"] == pytest.approx(x["tflops"] / r["matmul"]["tflops"])
        assert x["frac_of_bound"] == pytest.approx(max(x["frac_copy_bw"], x["frac_matmul"]))
        assert x["bound"] == ("memory" if x["frac_copy_bw"] >= x["frac_matmul"] else "matrix")
        assert x["meets_half"] == (x["frac_of_bound"] >= 0.5)
    assert rows["softmax"]["bound"] == "memory"
    assert isinstance(r["all_meet_half"], bool)
    assert "sddmm" in capsys.readouterr().out


# --- which splat backend ran -------------------------------------------------------------------------


def test_splat_rows_record_the_backend_that_ran(monkeypatch):
    import jax_bindings

    monkeypatch.delattr(jax_bindings, "selected_backend", raising=False)
    assert peers.splat_backend("attention") == "unknown"  # jax_bindings that cannot say
    seen = []

    def selected_backend(op, *args, backend="auto"):
        seen.append((op, args, backend))
        return "jax"

    monkeypatch.setattr(jax_bindings, "selected_backend", selected_backend, raising=False)
    p = _problem(masks.sliding_window(3), s=24)
    assert PEERS["splat"].prepare(p).splat_backend == "jax"
    op, args, backend = seen[-1]
    assert (op, backend) == ("attention", "jax") and args[3] is p.layout
    assert [(a.shape, a.dtype) for a in args[:3]] == [((1, 24, 2, 8), jax.numpy.float32)] * 3
    assert PEERS["dense_xla"].prepare(p).splat_backend is None

    def broken(*a, **k):
        raise RuntimeError("cannot tell\nmore")

    monkeypatch.setattr(jax_bindings, "selected_backend", broken)
    assert peers.splat_backend("attention") == "unknown (RuntimeError: cannot tell)"


def test_backend_must_be_registered():
    with pytest.raises(ValueError, match="backend must be one of"):
        bench.BenchConfig(backend="tpu-magic")


# --- benchmarks/ncu_stalls.py ------------------------------------------------------------------------


def test_ncu_stalls_splits_the_consumers_step_by_reason(tmp_path):
    """A source page in ncu's CSV form: the consumer code between the two USETMAXREGs, its per-step
    instructions (8 warps x steps executions) by stall reason, scaled to microseconds a step."""
    mod = _load_script("ncu_stalls")
    steps, kernel_us = 264, 40.0  # 2 steps a CTA on 132 SMs
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
            "stall_long_sb", "stall_no_inst", "stall_long_sb (Not Issued)"]
    rows = [  # (source, samples, executed, long_sb, no_inst)
        ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 0, 1056, 0, 0),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R3", 10, 8 * 16, 10, 0),  # once an item
        ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ", 34, 8 * steps, 20, 10),  # 4 with no reason
        ("@!P1 BRA 0x10", 10, 8 * steps, 10, 0),
        ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 0, 528, 0, 0),
        ("BRA 0x20", 50, 1000, 50, 0),  # the producer's: not the consumers'
    ]
    lines = ['"Kernel Name","splat_bwd_0123456789abcdef0123",', ",".join(f'"{h}"' for h in head)]
    for i, (src, smp, ex, lsb, ni) in enumerate(rows):
        lines.append(",".join(f'"{x}"' for x in (hex(16 * i), src, smp, ex, lsb, ni, 0)))
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(lines) + "\n")
    got = mod.summary(str(path), steps, kernel_us)
    us_a_sample = kernel_us / (steps / 132) / 54  # 54 consumer samples
    want = {"long_sb": round(30 * us_a_sample, 4), "no_inst": round(10 * us_a_sample, 4),
            "unlisted": round(4 * us_a_sample, 4)}
    assert got["us_per_step"] == want
    assert got["us_per_step_total"] == round(44 * us_a_sample, 4)
    assert got["item_share"] == round(10 / 54, 4) and got["branches"] == 1
    assert got["no_inst_samples_in_steps"] == 10
    out = tmp_path / "stalls.json"
    mod.main([f"k={path}:{steps}:{kernel_us}", "--device", "H", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["kernels"]["k"] == got and written["device"] == "H"


# --- benchmarks/profile_timeline.py ------------------------------------------------------------------


def test_profile_timeline_sums_each_kernel_and_gap_per_call(monkeypatch):
    """Kernels named with their digest count as one kernel; the idle time between two launches is
    charged to the pair; everything per call, over the calls between the first and the last (a
    call starting at the first kernel launched once a call: not the memset launched twice)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    mod = _load_script("profile_timeline")
    fwd, bwd = "splat_fwd_0123456789abcdef0123", "splat_bwd_abcdefabcdefabcdefab"
    events = [  # four calls: (name, start us, duration us); the program starts 50 us late
        ("Memset 3", 0, 1), ("Memset 3", 50, 1), (fwd, 52, 10), ("Memset 3", 63, 1), (bwd, 65, 30),
        ("Memset 3", 96, 1), (fwd, 98, 10), ("Memset 3", 109, 2), (bwd, 113, 30),
        ("Memset 3", 143, 1), (fwd, 145, 10), ("Memset 3", 156, 1), (bwd, 158, 30),
        ("Memset 3", 189, 1), (fwd, 191, 10), ("Memset 3", 202, 1), (bwd, 204, 30),
    ]
    got = mod.round_summary([{"name": n, "ts": t, "dur": d} for n, t, d in events], calls=4)
    assert got["us_per_call"] == (191 - 98) / 2 and got["launches_per_call"] == 4
    assert got["kernels_us"] == {"splat_fwd": 10, "splat_bwd": 30, "Memset 3": 2.5}
    assert got["gaps_us"] == {"splat_fwd -> Memset 3": 1, "Memset 3 -> splat_bwd": 1.5,
                              "splat_bwd -> Memset 3": 0.5, "Memset 3 -> splat_fwd": 1}
    with pytest.raises(ValueError, match="3 or more calls"):
        mod.round_summary([{"name": n, "ts": t, "dur": d} for n, t, d in events[:9]], calls=2)


# --- what a run says: skips, the FLOP formula, the mask expression, the plot -------------------------


def _crashes(problem):
    raise RuntimeError("boom")


@pytest.fixture(scope="module")
def skipping_result():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PEERS, "crashes", Peer("crashes", "raises", _crashes))
        mp.setitem(PEERS, "unavailable", Peer("unavailable", "never runs", _unavailable))
        cfg = bench.BenchConfig(
            patterns=("window", "dilated"),
            lengths=(32,),
            heads=1,
            head_dim=8,
            mode="both",
            peers=("splat", "splat_triton", "crashes", "unavailable"),
            warmup=0,
            repeats=1,
        )
        lines = []
        return bench.run_bench(cfg, TINY, log=lines.append), "\n".join(lines)


@pytest.mark.skipif(bench.backend_unavailable("triton") is None, reason="the triton backend runs here")
def test_a_splat_backend_this_machine_lacks_is_a_skip_said_once(skipping_result):
    """On a CPU, ``splat_triton`` is skipped with the backend's reason, not as an error, and the
    output says so once (the report's ``skipped`` list), not once as it happens and again there."""
    result, printed = skipping_result
    reason = f"splat backend 'triton' cannot run here: {bench.backend_unavailable('triton')}"
    assert {s["reason"] for s in result["skipped"] if s["impl"] == "splat_triton"} == {reason}
    assert len([s for s in result["skipped"] if s["impl"] == "splat_triton"]) == 4  # 2 patterns x 2 modes
    assert printed.count(reason) == 1 and "BackendUnavailableError" not in printed
    assert printed.count("not here") == 1  # any peer that cannot run here: once


def test_a_crashing_peer_is_said_as_it_happens_and_listed(skipping_result):
    result, printed = skipping_result
    assert {s["reason"] for s in result["skipped"] if s["impl"] == "crashes"} == {"error: RuntimeError: boom"}
    assert "crashes failed, skipped: error: RuntimeError: boom (window, S=32, fwd)" in printed
    assert printed.count("error: RuntimeError: boom") == 2  # when it happened, and in the skipped list
    assert [x["impl"] for x in result["results"]] == ["splat"] * 4


def test_flop_formula_says_only_what_ran(skipping_result):
    assert bench.flop_formula(("fwd", "fwdbwd")) == bench.FLOP_FORMULA == skipping_result[0]["flop_formula"]
    fwd = bench.flop_formula(("fwd",))
    assert "4*B*H*nnz*D" in fwd and "backward" not in fwd
    assert "3.5" in bench.flop_formula(("fwdbwd",)) and "forward+backward" in bench.flop_formula(("fwdbwd",))
    cfg = bench.BenchConfig(
        patterns=("window",), lengths=(32,), heads=1, head_dim=8, peers=("splat",), warmup=0, repeats=1
    )
    lines = []
    result = bench.run_bench(cfg, TINY, log=lines.append)
    assert result["flop_formula"] == fwd and "backward" not in "\n".join(lines).split("x splat")[0]


@pytest.mark.parametrize(
    "name,mask",
    [(n, catalogue.named(n)) for n in catalogue.names()]
    + [(n, m) for n, m in {**catalogue.SMALL, **catalogue.DECODE, **catalogue.GRID_SMALL}.items()],
)
def test_to_expression_reads_back_as_the_same_mask(name, mask):
    expr = bench.to_expression(mask)
    assert expr is not None and masks.parse(expr) == mask, (name, expr)


def test_to_expression_examples():
    assert bench.to_expression(catalogue.named("causal_window")) == "sliding_window(1023, 0)"
    assert bench.to_expression(masks.block_local(8)) == "block_local(8)"  # defaults left out
    mixed = masks.causal() & (masks.strided(4) | masks.sink(2, causal=False))
    assert bench.to_expression(mixed) == "causal() & (strided(4) | sink(2, causal=False))"
    assert bench.to_expression(masks.from_fn(lambda i, j: i >= j)) is None
    assert bench.to_expression(masks.from_array(np.eye(4, dtype=bool))) is None


def test_rows_carry_the_mask_expression(bench_result):
    result, _ = bench_result
    want = {"window": "sliding_window(5, 3)", "dilated": "dilated_window(12, 3)"}
    assert {x["pattern"]: x["expression"] for x in result["results"]} == want
    assert all(s["expression"] == want[s["pattern"]] for s in result["skipped"])


def _plot_rows(modes, names=("causal_window", "sink_causal_window", "strided")):
    rows = []
    for mode in modes:
        for n in names:
            expr = bench.to_expression(catalogue.named(n))
            for impl, ms in (("splat", 1.0), ("dense_xla", 3.0), ("flex", 2.0)):
                row = {"pattern": n, "expression": expr, "S": 4096, "mode": mode, "impl": impl}
                rows.append({**row, "ms": ms, "tflops": 1 / ms, "vs_splat": ms})
    return {"results": rows, "environment": {"device": "cpu"}, "flop_formula": bench.flop_formula(modes)}


@pytest.mark.parametrize(
    "modes,ran",
    [
        (("fwd",), "forward on cpu"),
        (("fwdbwd",), "forward+backward on cpu"),
        (("fwd", "fwdbwd"), "forward and forward+backward on cpu"),
    ],
)
def test_bench_plot_title_says_what_ran(modes, ran):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from splat.tools.plot import bench_figure

    fig = bench_figure(_plot_rows(modes))
    title = fig._suptitle.get_text()
    assert title.startswith(ran)
    assert ("backward" in title) == ("fwdbwd" in modes)  # a forward-only run says nothing of it
    names = {"fwd": "forward:", "fwdbwd": "forward+backward:"}
    assert [ax.get_title().split(" ")[0] for ax in fig.axes] == [names[m] for m in modes for _ in (0, 1)]
    plt.close(fig)


def test_bench_plot_labels_name_the_mask_expression():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from splat.tools.plot import bench_figure, bench_label

    fig = bench_figure(_plot_rows(("fwd",)))
    fig.canvas.draw()
    ticks = fig.axes[0].get_xticklabels()
    labels = [" ".join(t.get_text().split("\n")) for t in ticks]
    assert labels == [
        "causal_window: sliding_window(1023, 0) S=4096",
        "sink_causal_window: sink(4) | sliding_window(1023, 0) S=4096",
        "strided: strided(64) S=4096",
    ]
    boxes = [t.get_window_extent() for t in ticks]  # side by side, none over its neighbour
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:], strict=False))
    plt.close(fig)
    # the expression alone where both do not fit; a typed expression as typed; no expression: the name
    long = "neighborhood((128, 128), (15, 15), stride=(1, 1), dilation=(1, 1), is_causal=(False, False))"
    assert not bench_label("neighborhood_2d", long, 24).startswith("neighborhood_2d:")
    assert bench_label("causal() & strided(4)", "causal() & strided(4)", 40) == "causal() & strided(4)"
    assert bench_label("random", None, 40) == "random"
