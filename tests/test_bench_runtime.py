"""splat bench-runtime: packings, FLOP counts, the chained program's cycling, the JSON of a tiny CPU run."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from reference import attention_ref

from splat.tools import bench, bench_runtime, timing
from splat.tools.bench_runtime import RuntimeBenchConfig, cu_seqlens, doc_causal_nnz, pack_documents

# A tiny run: every peer but splat is skipped on a CPU, each with its reason.
TINY = dict(
    seq_len=64,
    batch=2,
    heads=2,
    head_dim=16,
    dtype="float32",
    doc_min=4,
    doc_max=24,
    packings=3,
    window=16,
    soft_cap=5.0,
    warmup=0,
    repeats=2,
)


def _dense_doc_causal(ids: np.ndarray) -> np.ndarray:
    """``[B, S, S]`` bool: ``j <= i`` and the same document."""
    s = ids.shape[1]
    return (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((s, s), bool))


def test_pack_documents_fills_rows_with_bounded_documents(rng):
    ids = pack_documents(rng, 3, 500, 20, 70)
    assert ids.shape == (3, 500) and ids.dtype == np.int32
    for row in ids:
        assert row[0] == 0 and set(np.diff(row)) <= {0, 1}  # documents numbered 0, 1, ... in order
        lens = np.bincount(row)
        assert (lens[:-1] >= 20).all() and (lens <= 70).all()  # only the last one is cut at S
    seeded = [pack_documents(np.random.default_rng(seed), 3, 500, 20, 70) for seed in (5, 5, 6)]
    assert np.array_equal(seeded[0], seeded[1]) and not np.array_equal(seeded[0], seeded[2])
    with pytest.raises(ValueError, match="min_len"):
        pack_documents(rng, 1, 10, 5, 4)


def test_doc_causal_nnz_is_the_dense_count(rng):
    for _ in range(3):
        ids = pack_documents(rng, 2, 97, 3, 40)
        assert doc_causal_nnz(ids) == int(_dense_doc_causal(ids).sum())
    with pytest.raises(ValueError, match="non-decreasing"):
        doc_causal_nnz(np.array([[0, 1, 0]]))


def test_cu_seqlens_over_concatenated_rows():
    ids = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]], np.int32)  # row 1 restarts at id 0: a new document
    assert cu_seqlens(ids).tolist() == [0, 2, 5, 6, 10]
    assert cu_seqlens(ids, 6).tolist() == [0, 2, 5, 6, 10, 10, 10]  # empty documents pad
    with pytest.raises(ValueError, match="fewer"):
        cu_seqlens(ids, 3)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mode": "sideways"}, "mode"),
        ({"workloads": ("nope",)}, "workload"),
        ({"workloads": ()}, "workload"),
        ({"doc_min": 10, "doc_max": 5}, "doc_min"),
        ({"packings": 0}, "packings"),
        ({"soft_cap": 0.0}, "soft_cap"),
        ({"peers": ("splat", "nope")}, "unknown peer"),
    ],
)
def test_config_rejects_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        RuntimeBenchConfig(**kw)


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_chained_calls_cycle_through_the_packings(mode):
    """Call c of a chain reads packing c mod N: a program adding its packing's ids to q shows which ran."""
    cfg = RuntimeBenchConfig(**{**TINY, "mode": mode, "workloads": ("doc_causal",)})
    w, _ = bench_runtime.make_workload(cfg, "doc_causal")
    n = len(w.packings)
    packs = np.arange(n, dtype=np.int32)[:, None, None] * np.ones(w.packings.shape[1:], np.int32)
    w = bench_runtime.replace(w, q=np.zeros_like(w.q), packings=packs)

    def attn(q, k, v, ids):
        return q + ids[:, :, None, None].astype(q.dtype) + 0 * (k + v)

    fn, args, feed = bench_runtime._program(attn, w, (w.packings,))
    calls = 2 * n + 1
    out, _ = jax.jit(timing.chain(fn, calls, feed))(*args)
    assert float(np.asarray(out[0]).max()) == sum(c % n for c in range(calls))
    assert int(out[-1]) == calls  # the step counter came through every call


@pytest.fixture(scope="module")
def tiny_result():
    lines = []
    return bench_runtime.run_runtime_bench(
        RuntimeBenchConfig(**TINY), log=lines.append, allow_cpu=True
    ), lines


def test_tiny_run_json(tiny_result, tmp_path):
    r, lines = tiny_result
    path = tmp_path / "r.json"
    bench.write_json(r, str(path))
    r = json.loads(path.read_text())
    assert r["environment"]["device"] == jax.devices()[0].device_kind
    assert set(r["workloads"]) == {"doc_causal", "gemma2_local"}
    assert r["settings"]["peers"][0] == "splat" and r["timing_method"] == timing.TIMING_METHOD
    cases = [
        (w, m, p)
        for w in ("doc_causal", "gemma2_local")
        for m in ("fwd", "fwdbwd")
        for p in r["settings"]["peers"]
    ]
    for w, m, p in cases:  # every peer ran or says why not
        ran = [x for x in r["results"] if (x["workload"], x["mode"], x["impl"]) == (w, m, p)]
        why = [x["reason"] for x in r["skipped"] if (x["workload"], x["mode"], x["impl"]) == (w, m, p)]
        assert len(ran) + len(why) == 1 and all(why), (w, m, p)
    splat_rows = [x for x in r["results"] if x["impl"] == "splat"]
    assert len(splat_rows) == 4  # both workloads, both modes
    for x in r["results"]:
        assert x["pattern"] == x["workload"] and x["ms"] > 0 and len(x["samples_ms"]) == 2
        assert x["tflops"] == pytest.approx(bench.useful_flops(1, 2, x["nnz"], 16, x["mode"]) / x["ms"] / 1e9)
        assert x["vs_splat"] is not None and x["agrees"] is not False
    for x in splat_rows:
        assert x["vs_splat"] == 1.0 and x["agrees"] is True and isinstance(x["splat_backend"], str)
    gemma = next(x for x in splat_rows if x["workload"] == "gemma2_local")
    assert gemma["nnz"] == sum(min(i + 1, 16) for i in range(64))  # B = 1, window of 16 keys
    md = r["metadata"]
    assert md["ms"] > 0 and set(md["fraction_of_splat"]) == {"fwd", "fwdbwd"}
    assert md["meets_target"] in (True, False)
    text = "\n".join(lines)
    assert "runtime-mask build alone" in text and "doc_causal" in text and "skipped:" in text


def test_tiny_run_nnz_is_the_mean_over_packings(tiny_result):
    r, _ = tiny_result
    cfg = RuntimeBenchConfig(**TINY)
    w, _ = bench_runtime.make_workload(cfg, "doc_causal")
    want = np.mean([_dense_doc_causal(p).sum() for p in w.packings])
    got = [x["nnz"] for x in r["results"] if x["workload"] == "doc_causal"]
    assert got and all(g == pytest.approx(want) for g in got)


def test_tiny_run_plots(tiny_result, tmp_path):
    pytest.importorskip("matplotlib")
    from splat.tools.plot import plot_bench

    plot_bench(tiny_result[0], str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").stat().st_size > 0


def _capped_ref(q, k, v, mask, scale, cap):
    """Float64 masked attention with scores ``cap * tanh(scale * q.k / cap)``; [B, S, H, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    z = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    z = np.where(mask, cap * np.tanh(z / cap), -np.inf)
    p = np.exp(z - z.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("name", ["doc_causal", "gemma2_local"])
def test_splat_peer_computes_the_workload(name):
    """One call of splat's program (packing 0) against a float64 reference of the workload's mask."""
    cfg = RuntimeBenchConfig(**TINY)
    w, _ = bench_runtime.make_workload(cfg, name)
    got = np.asarray(bench_runtime.RUNTIME_PEERS["splat"].prepare(w).outputs(), np.float64)
    s, scale = w.seq_len, w.q.shape[-1] ** -0.5
    if name == "doc_causal":
        want, _ = attention_ref(w.q, w.k, w.v, _dense_doc_causal(w.packings[0])[:, None], scale)
    else:
        band = np.subtract.outer(np.arange(s), np.arange(s))
        want = _capped_ref(w.q, w.k, w.v, (band >= 0) & (band < 16), scale, 5.0)
    assert np.max(np.abs(got - want)) < 1e-4 * max(1.0, np.max(np.abs(want)))


def test_cli_refuses_a_cpu(capsys):
    from splat.tools.cli import main

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is here: the command would run the benchmark")
    assert main(["bench-runtime", "--quick"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_cli_maps_flags_and_writes_json(monkeypatch, tmp_path, capsys):
    from splat.tools.cli import main

    seen = []

    def fake_run(config):
        seen.append(config)
        return {"results": [], "config": repr(config)}

    monkeypatch.setattr(bench_runtime, "run_runtime_bench", fake_run)
    out = tmp_path / "r.json"
    argv = [
        "bench-runtime",
        "--workloads",
        "doc_causal",
        "--packings",
        "5",
        "--soft-cap",
        "30",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert seen[0] == RuntimeBenchConfig(workloads=("doc_causal",), packings=5, soft_cap=30.0)
    assert json.loads(out.read_text())["results"] == []
    assert main(["bench-runtime", "--quick", "--seq-len", "512"]) == 0
    assert seen[1] == RuntimeBenchConfig.quick(seq_len=512) and seen[1].packings == 4
    assert f"wrote {out}" in capsys.readouterr().out
