"""benchmarks/bench_decode.py: the decode benchmark's counting, its paged inputs, and the JSON of a tiny run.

The run is the CPU smoke path (``--quick`` at the tiny sizes: B=2, cache 256, H=4, Hk=2, D=32,
float32), in-process, on a subset of the cases; splat's output must agree with dense XLA's.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from splat.tools import timing

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
CASES = ("causal", "window", "sink_window", "documents", "paged16", "spec4", "chunk")


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def tiny(mod, tmp_path_factory):
    folder = tmp_path_factory.mktemp("decode")
    out, png = folder / "r.json", folder / "r.png"
    argv = ["--quick", "--profile", "tiny", "--cases", *CASES, "--out", str(out)]
    argv += ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    rc = mod.main(argv)
    return rc, json.loads(out.read_text()), png


def _case(mod, name):
    return next(c for c in mod.make_cases(mod.TINY) if c.name == name)


def test_bytes_and_flops_are_counted_from_the_mask(mod):
    p = mod.TINY
    item = 4 * p.kv_heads * p.head_dim * 2  # float32, K and V
    sink = _case(mod, "sink_window")  # the last position sees its window of 64 keys and 4 sinks
    assert sink.keys_needed.tolist() == [p.window + p.sinks] * p.batch
    assert sink.kv_bytes == p.batch * (p.window + p.sinks) * item
    dilated = _case(mod, "dilated")  # radius 32, dilation 2, causal: keys pos, pos-2, ..., pos-32
    assert dilated.keys_needed.tolist() == [p.dilated[0] // 2 + 1] * p.batch
    docs = _case(mod, "documents")  # the query's document, from its start to the end of the cache
    assert (docs.keys_needed == p.cache_len - docs.doc_starts).all()
    assert (docs.cache_len - docs.doc_starts >= p.docs[0]).all()
    chunk = _case(mod, "chunk")  # query i at 192 + i sees keys 0..192 + i
    off = p.cache_len - p.chunk
    assert chunk.pairs == sum(off + i + 1 for i in range(p.chunk))
    assert chunk.flops == 4.0 * p.heads * p.head_dim * chunk.pairs
    assert chunk.keys_needed.tolist() == [p.cache_len]
    spec = _case(mod, "spec4")
    assert spec.positions.tolist() == [list(range(p.cache_len - 4, p.cache_len))] * p.batch


def test_paged_cache_holds_the_contiguous_one(mod, rng):
    import jax.numpy as jnp

    cache = jnp.asarray(rng.standard_normal((3, 64, 2, 4), dtype=np.float32))
    pool, table = mod.paged_cache(cache, 16, rng)
    assert pool.shape == (12, 16, 2, 4) and table.shape == (3, 4) and table.dtype == jnp.int32
    assert sorted(np.asarray(table).ravel().tolist()) == list(range(12))
    assert np.array_equal(np.asarray(pool[table].reshape(cache.shape)), np.asarray(cache))
    with pytest.raises(ValueError, match="multiple"):
        mod.paged_cache(cache, 48, rng)


def test_pack_documents_keeps_the_last_document_long(mod, rng):
    ids = mod.pack_documents(rng, 4, 1000, 100, 400)
    for row in ids:
        lens = np.bincount(row)
        assert row[0] == 0 and set(np.diff(row)) <= {0, 1}
        assert (lens >= 100).all() and (lens <= 400).all()


def test_hbm_peak_by_device_name(mod):
    assert mod.hbm_peak("NVIDIA H200")[0] == 4.8
    assert mod.hbm_peak("NVIDIA H100 80GB HBM3")[0] == 3.35
    assert mod.hbm_peak("NVIDIA GH200 480GB")[0] is None
    assert mod.hbm_peak("cpu")[0] is None and "--hbm-tbps" in mod.hbm_peak("cpu")[1]
    assert mod.hbm_peak("cpu", 1.5) == (1.5, "--hbm-tbps")


def test_fa3_splits_reads_the_default(mod):
    def fa3(q, k, v, cache_seqlens=None, num_splits=1):
        return q

    def heuristic(q, k, v, cache_seqlens=None, num_splits=0):
        return q

    assert mod.fa3_splits(fa3, (1, 4, 16)) == [(1, True), (4, False), (16, False)]
    assert mod.fa3_splits(heuristic, (1, 4)) == [(0, True), (1, False), (4, False)]
    assert mod.fa3_splits(lambda q, k, v: q, (1, 4)) == [(None, True)]


def test_tiny_run_json(mod, tiny):
    rc, r, png = tiny
    assert rc == 0
    assert r["schema"] == mod.SCHEMA and r["environment"]["device"] == jax.devices()[0].device_kind
    assert r["complete"] is True
    assert r["timing_method"] == timing.TIMING_METHOD and r["interleaving"] == timing.INTERLEAVING
    assert r["settings"]["profile"]["name"] == "tiny" and r["settings"]["peers"][0] == "splat"
    assert list(r["cases"]) == list(CASES)
    assert "signature" in r["environment"]["flash_attn3"] or "unavailable" in r["environment"]["flash_attn3"]
    for case in CASES:  # every peer ran or says why not
        for peer in r["settings"]["peers"]:
            ran = [x for x in r["results"] if (x["case"], x["impl"]) == (case, peer)]
            why = [x["reason"] for x in r["skipped"] if (x["case"], x["impl"]) == (case, peer)]
            assert (ran or why) and all(why), (case, peer)
    for x in r["results"]:
        c = r["cases"][x["case"]]
        assert x["ms"] > 0 and len(x["samples_ms"]) == r["settings"]["repeats"]
        if x["same_work"]:
            assert x["kv_bytes"] == c["kv_bytes"] and x["flops"] == c["flops"]
        assert x["gbps"] == pytest.approx(x["kv_bytes"] / x["ms"] / 1e6)
        assert x["tflops"] == pytest.approx(x["flops"] / x["ms"] / 1e9)
    assert {t["case"] for t in r["targets"]} <= set(CASES) and r["targets"]
    if png.exists():
        assert png.stat().st_size > 0


def test_tiny_run_splat_agrees_with_dense_xla(tiny):
    _, r, _ = tiny
    rows = {(x["case"], x["impl"]): x for x in r["results"]}
    assert not r["disagreements"]
    for case in CASES:
        splat, dense = rows[(case, "splat")], rows[(case, "dense_xla")]
        assert splat["vs_splat"] == 1.0 and splat["check"] == "vs splat" and splat["max_abs_diff"] == 0.0
        assert isinstance(splat["splat_backend"], str)
        assert dense["agrees"] is True and dense["check"] == "vs splat", case
        assert dense["max_abs_diff"] <= 1e-4 and dense["vs_splat"] > 0
    assert rows[("paged16", "splat_contiguous")]["agrees"] is True
    prefill = rows[("chunk", "splat_prefill")]
    assert prefill["same_work"] is False and prefill["vs_splat"] is None and prefill["agrees"] is None


def test_assert_fails_on_targets_it_cannot_judge(mod, capsys):
    rc = mod.main(["--quick", "--profile", "tiny", "--cases", "causal", "--peers", "dense_xla", "--assert"])
    assert rc == 1  # no FA3 or cuDNN row at float32 and D = 32: the causal target cannot be judged
    assert "target cannot judge: causal" in capsys.readouterr().err


def test_refuses_bad_cases_and_full_sizes_on_a_cpu(mod, capsys):
    assert mod.main(["--quick", "--cases", "no_such_case"]) == 2
    assert "no case matches" in capsys.readouterr().err
    if jax.default_backend() != "gpu":
        assert mod.main([]) == 2
        assert "need a GPU" in capsys.readouterr().err
