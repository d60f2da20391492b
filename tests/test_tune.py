"""The tuner's CPU parts: candidate pruning, the cost model's ranking, store merging, the CLI."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from jax_bindings._triton import cost  # noqa: E402
from jax_bindings._triton.spec import Tiles, default_tiles  # noqa: E402
from splat import masks  # noqa: E402
from splat.tools import tune  # noqa: E402
from splat.tools.cli import main  # noqa: E402


@pytest.mark.parametrize("op", cost.OP_MATMULS)
def test_candidates_fit_and_keep_the_defaults(op):
    cands = cost.candidates(op, 128)
    assert 6 <= len(cands) < 36  # something was pruned, something is left
    for t in cands:
        r = cost.resources(op, t, 128)
        assert r.smem <= cost.SMEM_BYTES and r.regs <= cost.MAX_REGS_PER_THREAD
    for rows in (512.0, 4096.0):  # the heuristic defaults (short and long rows) survive pruning
        d = default_tiles(op, 128, "bfloat16", rows)
        assert Tiles(*tuple(d)[:4]) in cands


def test_candidates_refuse_unknown_ops():
    with pytest.raises(ValueError, match="op must be one of"):
        cost.candidates("softmax", 128)


def test_pruning_drops_register_spills():
    # 128 x 128 tiles with one warp group hold 128*128*1.5 + 128*128 fp32 in 128 threads: > 255 regs
    assert Tiles(128, 128, 4, 3) not in cost.candidates("fwd", 128)
    assert Tiles(128, 128, 8, 3) in cost.candidates("fwd", 128)


def test_pruning_counts_dqs_resident_q_and_do():
    # on an H100 at D = 256 these dq configs asked for 256 KiB of shared memory and did not launch
    for t in (Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 3)):
        assert cost.resources("bwd_dq", t, 256).smem == 262144
        assert t not in cost.candidates("bwd_dq", 256)
    # the D = 256 defaults fit (they ran: NOTES.md session 16)
    for op in cost.OP_MATMULS:
        d = default_tiles(op, 256, "bfloat16")
        assert cost.resources(op, d, 256).smem <= cost.SMEM_BYTES


def test_model_prefers_tight_tiles_on_a_narrow_window():
    # a 64-key causal window: 128x128 tiles walk ~4x the pairs that 64x32 ones do
    layout = masks.sliding_window(63, 0).to_acsr(4096)
    kw = dict(batch=1, heads=16, head_dim=128)
    assert cost.predict_ms("fwd", layout, Tiles(64, 32, 4, 3), **kw) < cost.predict_ms(
        "fwd", layout, Tiles(128, 128, 8, 3), **kw
    )


def test_model_prefers_big_tiles_on_a_full_mask():
    layout = masks.full().to_acsr(4096)
    kw = dict(batch=1, heads=16, head_dim=128)
    assert cost.predict_ms("fwd", layout, Tiles(128, 128, 8, 3), **kw) < cost.predict_ms(
        "fwd", layout, Tiles(64, 32, 4, 3), **kw
    )


def test_rank_error():
    pred = {"a": 1.0, "b": 2.0, "c": 3.0}
    assert cost.rank_error(pred, {"a": 1.0, "b": 2.0, "c": 3.0}) == {
        "n": 3,
        "spearman": 1.0,
        "best_measured_predicted_rank": 1,
    }
    r = cost.rank_error(pred, {"a": 3.0, "b": 2.0, "c": 1.0})
    assert r["spearman"] == -1.0 and r["best_measured_predicted_rank"] == 3


def _entry(op, family, s, ms, cfg=(64, 64, 4, 3, "fused")):
    return {
        "op": op,
        "family": family,
        "s_bucket": s,
        "head_dim": 128,
        "dtype": "bfloat16",
        "config": list(cfg),
        "time_ms": ms,
    }


def test_merge_store_replaces_same_keys_and_keeps_others():
    old = {
        "schema": 1,
        "device_kind": "X",
        "tiles": [_entry("fwd", "window", 8192, 1.0), _entry("fwd", "causal", 8192, 2.0)],
        "implementations": [],
    }
    new = [
        _entry("fwd", "window", 8192, 0.5, (128, 64, 8, 3, "fused")),
        _entry("fwd", "window", 8192, 0.1, (64, 32, 4, 3, "fused")),
    ]  # same key again: first kept
    s = tune.merge_store(old, "X", new, [], 1)
    by = {(e["op"], e["family"]): e for e in s["tiles"]}
    assert len(s["tiles"]) == 2
    assert by[("fwd", "window")]["config"] == [128, 64, 8, 3, "fused"]
    assert by[("fwd", "causal")]["time_ms"] == 2.0


def test_merged_store_is_readable_by_the_store_reader(tmp_path, monkeypatch):
    from jax_bindings import _tuning

    s = tune.merge_store(
        None,
        "NVIDIA Test",
        [_entry("fwd", "window", 8192, 0.5)],
        [
            {
                "family": "causal_window",
                "s_bucket": 8192,
                "head_dim": 128,
                "dtype": "bfloat16",
                "pass": "fwd",
                "times_ms": {"triton": 2.0, "cudnn": 1.0},
            }
        ],
        _tuning.SCHEMA,
    )
    import json

    p = tmp_path / "s.json"
    p.write_text(json.dumps(s))
    monkeypatch.setenv(_tuning.ENV_FILE, str(p))
    _tuning.store.cache_clear()
    try:
        assert _tuning.lookup_tiles("fwd", "window", 8000, 128, "bfloat16") == (64, 64, 4, 3, "fused")
        assert (
            _tuning.rank_backends("causal_window", 8192, 128, "bfloat16", ("triton", "cudnn"), mode="fwd")[0]
            == "cudnn"
        )
    finally:
        _tuning.store.cache_clear()


def test_summarize_reports_the_pruned_choice():
    recs = [
        {
            "exhaustive_best_ms": 1.0,
            "pruned_vs_exhaustive": 0.98,
            "pruned_seconds": 2.0,
            "exhaustive_seconds": 20.0,
            "rank_error": {"spearman": 0.8, "best_measured_predicted_rank": 2},
        },
        {
            "exhaustive_best_ms": 1.0,
            "pruned_vs_exhaustive": 1.0,
            "pruned_seconds": 1.0,
            "exhaustive_seconds": 10.0,
            "rank_error": {"spearman": 0.6, "best_measured_predicted_rank": 1},
        },
    ]
    s = tune.summarize(recs)
    assert s["time_share"] == pytest.approx(0.1) and s["within_3pct"] == 2
    assert s["pruned_speed_vs_best_min"] == 0.98 and s["spearman_mean"] == pytest.approx(0.7)
    assert tune.summarize([{"op": "fwd"}]) == {"exhaustive": False}


def test_cli_tune_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", "--help"])
    assert e.value.code == 0
    assert "--exhaustive" in capsys.readouterr().out


def test_cli_tune_without_gpu_exits_2(capsys):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    assert main(["tune", "--patterns", "causal", "--lengths", "256"]) == 2
    assert "triton" in capsys.readouterr().err


def test_run_tune_flow_with_a_fake_clock(monkeypatch, tmp_path):
    """The whole tuner minus the GPU: timings come from the model plus a config-dependent wobble."""
    from jax_bindings._triton import cost as c

    def fake_time(op, layout, cfg, tiles, key):
        walked = tune.walked_layout(op, layout)
        base = c.predict_ms(op, walked, tiles, batch=cfg.batch, heads=cfg.heads, head_dim=cfg.head_dim)
        return base * (1.0 + 0.01 * (tiles.block_n // 32))

    monkeypatch.setattr(tune, "time_tiles", fake_time)
    out = tmp_path / "store.json"
    cfg = tune.TuneConfig(
        patterns=("causal_window", "dilated_window"),
        lengths=(2048,),
        heads=2,
        head_dim=64,
        exhaustive=True,
        backends=False,
        out=str(out),
    )
    result = tune.main(cfg, report=str(tmp_path / "report.json"), log=lambda *a: None)
    store = result["store"]
    assert {e["op"] for e in store["tiles"]} == set(tune.OPS)
    assert len(store["tiles"]) == 6 and out.exists() and (tmp_path / "report.json").exists()
    s = result["summary"]
    assert s["exhaustive"] and s["cases"] == 6 and 0 < s["time_share"] < 1
    assert 0 < s["pruned_speed_vs_best_min"] <= 1
    # the store it wrote is what the reader takes
    from jax_bindings import _tuning

    loaded = _tuning.load(out)
    assert loaded is not None
