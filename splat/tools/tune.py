"""``splat tune``: measure Triton tile configs (and backends) on this GPU, write the tuning store.

For every (pattern, S, op) it ranks the candidate tile configs with the cost model
(:mod:`jax_bindings._triton.cost`), times the best ``top`` of them (and the heuristic default) as
JAX programs of chained kernel calls, and keeps the fastest. ``--exhaustive`` times every candidate
instead, and the result then also records how the pruned choice compares: the tuner's time against
the sweep's, the pruned best's speed against the exhaustive best, and the model's rank error.
``--backends`` adds, per pattern and S, the forward and forward+backward time of each backend that
takes the mask (``cuda``, ``triton``, ``cudnn``; a backend's forward+backward is timed as auto runs it
after that forward, e.g. the cuda forward with the triton backward): the store's
``implementations`` that ``backend="auto"`` reads. ``--no-tiles`` times the backends only.

The store file (one per device kind, schema in ``jax_bindings/tuning/README.md``) is written to
``--out``, by default the package's own file for this device; entries for keys measured again are
replaced, others kept.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splat.tools import timing

OPS = ("fwd", "bwd_dq", "bwd_dkdv")
DEFAULT_PATTERNS = (
    "full",
    "causal",
    "causal_window",
    "sliding_window",
    "dilated_window",
    "block_local",
    "strided",
    "global_window",
)


@dataclass(frozen=True)
class TuneConfig:
    """What ``splat tune`` measures (CLI flags of the same names)."""

    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    lengths: tuple[int, ...] = (8192, 16384)
    ops: tuple[str, ...] = OPS
    batch: int = 1
    heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    top: int = 2
    exhaustive: bool = False
    backends: bool = True
    repeats: int = 5
    out: str | None = None


def _inputs(op: str, layout, cfg: TuneConfig, key):
    """Arrays of the kernel's data operands over the forward ``layout``, and which output feeds which
    input when chained."""
    import jax
    import jax.numpy as jnp

    B, H, D = cfg.batch, cfg.heads, cfg.head_dim
    dt = jnp.dtype(cfg.dtype)
    ks = jax.random.split(key, 6)
    Sq, Skv = layout.q_len, layout.kv_len
    q = jax.random.normal(ks[0], (B, Sq, H, D), dt)
    k = jax.random.normal(ks[1], (B, Skv, H, D), dt)
    v = jax.random.normal(ks[2], (B, Skv, H, D), dt)
    if op == "fwd":
        return (q, k, v), {0: 0}
    do = jax.random.normal(ks[3], (B, Sq, H, D), dt)
    lse = jnp.full((B, H, Sq), float(math.log(max(layout.nnz / max(Sq, 1), 1.0))), jnp.float32)
    if op == "bwd_dq":
        out = jax.random.normal(ks[4], (B, Sq, H, D), dt)
        return (q, k, v, do, out, lse), {0: 0}
    delta = jnp.zeros((B, H, Sq), jnp.float32)
    return (q, k, v, do, lse, delta), {1: 0}


def _call_for(op: str, layout, cfg: TuneConfig, tiles):
    """The launch of ``op`` over the forward ``layout`` (dk/dv walks its transpose) with ``tiles``."""
    from jax_bindings._triton import ops

    shape_q = (cfg.batch, layout.q_len, cfg.heads, cfg.head_dim)
    shape_k = (cfg.batch, layout.kv_len, cfg.heads, cfg.head_dim)
    scale = cfg.head_dim**-0.5
    if op == "fwd":
        return ops.fwd_call(layout, shape_q, shape_k, cfg.dtype, scale, tiles=tiles)
    pair = (tiles, None) if op == "bwd_dq" else (None, tiles)
    return ops.bwd_calls(layout, shape_q, shape_k, cfg.dtype, scale, tiles=pair)[op == "bwd_dkdv"]


def walked_layout(op: str, layout):
    """The layout ``op``'s kernel walks: the forward one, or its transpose for dk/dv."""
    from jax_bindings._triton.spec import transposed

    return transposed(layout) if op == "bwd_dkdv" else layout


def time_tiles(op: str, layout, cfg: TuneConfig, tiles, key) -> float:
    """Milliseconds per call of ``op`` with ``tiles`` (median; n calls chained in one program)."""
    from jax_bindings._triton.backend import run_call

    call = _call_for(op, layout, cfg, tiles)
    args, feed = _inputs(op, layout, cfg, key)
    return timing.chained_ms(lambda *a: run_call(call, *a), *args, feed=feed, warmup=1, repeats=cfg.repeats)


def _key(t) -> str:
    return "x".join(str(x) for x in tuple(t)[:4]) + f":{t.loop}"


def tune_op(op: str, layout, cfg: TuneConfig, key, log=print) -> dict:
    """Ranks, times and picks the tiles of one op over the forward ``layout``; returns the record."""
    from jax_bindings._triton import cost
    from jax_bindings._triton.spec import tiles_for

    walked = walked_layout(op, layout)
    cands = cost.candidates(op, cfg.head_dim, cfg.dtype)
    ranked = cost.rank(op, walked, cands, batch=cfg.batch, heads=cfg.heads, head_dim=cfg.head_dim)
    predicted = {_key(t): ms for ms, t in ranked}
    default = tiles_for(op, walked, cfg.head_dim, cfg.dtype)
    pruned = [t for _, t in ranked[: cfg.top]]
    if _key(default) not in {_key(t) for t in pruned}:
        pruned.append(default)
    todo = [t for _, t in ranked] if cfg.exhaustive else pruned
    if cfg.exhaustive and _key(default) not in predicted:
        todo.append(default)
    measured, errors, seconds = {}, {}, {}
    for t in todo:
        t0 = time.perf_counter()
        try:
            measured[_key(t)] = time_tiles(op, layout, cfg, t, key)
        except Exception as e:  # a config that fails to compile or launch is recorded, not fatal
            errors[_key(t)] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        seconds[_key(t)] = time.perf_counter() - t0
        log(f"  {op} {_key(t)}: {measured.get(_key(t), errors.get(_key(t)))}")
    by_key = {_key(t): t for t in todo}
    pruned_keys = [_key(t) for t in pruned if _key(t) in measured]
    if not pruned_keys:
        raise RuntimeError(f"no tile config of {op} ran: {errors}")
    best_pruned = min(pruned_keys, key=measured.get)
    rec = {
        "op": op,
        "default": list(default),
        "default_ms": measured.get(_key(default)),
        "candidates": len(cands),
        "pruned": [_key(t) for t in pruned],
        "pruned_best": list(by_key[best_pruned]),
        "pruned_best_ms": measured[best_pruned],
        "pruned_seconds": sum(seconds[k] for k in (_key(t) for t in pruned)),
        "predicted_ms": predicted,
        "measured_ms": measured,
        "errors": errors,
    }
    if cfg.exhaustive:
        best = min(measured, key=measured.get)
        rec.update(
            exhaustive_best=list(by_key[best]),
            exhaustive_best_ms=measured[best],
            exhaustive_seconds=sum(seconds.values()),
            pruned_vs_exhaustive=measured[best] / measured[best_pruned],
            rank_error=cost.rank_error(predicted, measured),
        )
    # what the store keeps: the best config measured (the sweep's when there is one)
    chosen = rec.get("exhaustive_best", rec["pruned_best"])
    rec["config"] = chosen
    rec["time_ms"] = rec.get("exhaustive_best_ms", rec["pruned_best_ms"])
    return rec


def time_backends(layout, cfg: TuneConfig, key, log=print) -> dict:
    """Forward and forward+backward ms of each backend that takes ``layout`` (chained, one program)."""
    import jax
    import jax.numpy as jnp

    import jax_bindings
    from jax_bindings import _dispatch, _registry

    B, H, D, dt = cfg.batch, cfg.heads, cfg.head_dim, jnp.dtype(cfg.dtype)
    ks = jax.random.split(key, 4)
    q, k, v, do = (jax.random.normal(x, (B, layout.q_len, H, D), dt) for x in ks)
    scale = D**-0.5
    out = {"fwd": {}, "fwd_bwd": {}}
    for name in (n for n in _registry.names() if n != _registry.FALLBACK):
        if _registry.unavailable(name):
            continue

        def fwd(q, k, v, name=name):
            return jax_bindings.attention(q, k, v, layout, scale, name)

        def fwd_bwd(q, k, v, do, name=name):  # the backward where auto would run it after this forward
            led = lambda q, k, v: _dispatch.attention_led_by(name, q, k, v, layout, scale)  # noqa: E731
            o, pull = jax.vjp(led, q, k, v)
            return pull(do)

        for mode, fn, args, feed in (
            ("fwd", fwd, (q, k, v), {0: 0}),
            ("fwd_bwd", fwd_bwd, (q, k, v, do), {0: 0}),
        ):
            try:
                ms = timing.chained_ms(fn, *args, feed=feed, warmup=1, repeats=cfg.repeats)
            except (NotImplementedError, jax_bindings.BackendUnavailableError) as e:
                log(f"  {name} {mode}: refused ({str(e)[:120]})")
                break
            out[mode][name] = ms
            log(f"  {name} {mode}: {ms:.3f} ms")
    return out


def run_tune(cfg: TuneConfig, log=print) -> dict:
    """Measures everything ``cfg`` names; returns ``{"store": ..., "records": [...], "summary": ...}``."""
    import jax

    import acsr
    from jax_bindings import _tuning
    from splat import catalogue

    key = jax.random.key(0)
    device_kind = jax.devices()[0].device_kind
    t_start = time.perf_counter()
    records, tiles_entries, impl_entries = [], [], []
    for name in cfg.patterns:
        mask = catalogue.named(name)
        for S in cfg.lengths:
            layout = mask.to_acsr(S, S)
            family = acsr.pattern_family(layout)
            log(f"{name} S={S} ({family})")
            for op in cfg.ops:
                rec = tune_op(op, layout, cfg, key, log)
                rec.update(pattern=name, S=S, family=acsr.pattern_family(walked_layout(op, layout)))
                records.append(rec)
                tiles_entries.append(
                    {
                        "op": op,
                        "family": rec["family"],
                        "s_bucket": S,
                        "head_dim": cfg.head_dim,
                        "dtype": cfg.dtype,
                        "config": rec["config"],
                        "time_ms": rec["time_ms"],
                        "pattern": name,
                    }
                )
            if cfg.backends:
                times = time_backends(layout, cfg, key, log)
                for mode, t in times.items():
                    if len(t) >= 1:
                        impl_entries.append(
                            {
                                "family": family,
                                "s_bucket": S,
                                "head_dim": cfg.head_dim,
                                "dtype": cfg.dtype,
                                "pass": mode,
                                "times_ms": t,
                                "pattern": name,
                            }
                        )
    store = merge_store(
        _existing(cfg.out) if cfg.out else None, device_kind, tiles_entries, impl_entries, _tuning.SCHEMA
    )
    return {
        "store": store,
        "records": records,
        "summary": summarize(records),
        "seconds": time.perf_counter() - t_start,
        "device_kind": device_kind,
    }


def _existing(path: str) -> dict | None:
    if path and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return None


def merge_store(old: dict | None, device_kind: str, tiles: list, impls: list, schema: int) -> dict:
    """The store after this run: new entries replace old ones with the same key; one entry per key.

    Several patterns of a run can share a key (two patterns of one family at one S): the first
    one measured is kept, so the pattern list names each family's reference pattern first.
    """
    tkey = lambda e: (e["op"], e["family"], e["s_bucket"], e["head_dim"], e["dtype"])
    ikey = lambda e: (e["family"], e["s_bucket"], e["head_dim"], e["dtype"], e["pass"])
    out_t, out_i = {}, {}
    for e in (old or {}).get("tiles", []):
        out_t[tkey(e)] = e
    for e in (old or {}).get("implementations", []):
        out_i[ikey(e)] = e
    fresh_t, fresh_i = {}, {}
    for e in tiles:
        fresh_t.setdefault(tkey(e), e)
    for e in impls:
        fresh_i.setdefault(ikey(e), e)
    out_t.update(fresh_t)
    out_i.update(fresh_i)
    return {
        "schema": schema,
        "device_kind": device_kind,
        "tiles": sorted(out_t.values(), key=lambda e: tuple(map(str, tkey(e)))),
        "implementations": sorted(out_i.values(), key=lambda e: tuple(map(str, ikey(e)))),
    }


def summarize(records: list) -> dict:
    """Pruned tuner vs the exhaustive sweep (where one ran): time share, speed ratio, rank error."""
    ex = [r for r in records if "exhaustive_best_ms" in r]
    if not ex:
        return {"exhaustive": False}
    ratios = [r["pruned_vs_exhaustive"] for r in ex]
    rhos = [r["rank_error"]["spearman"] for r in ex if r["rank_error"]["spearman"] is not None]
    ranks = [r["rank_error"]["best_measured_predicted_rank"] for r in ex]
    return {
        "exhaustive": True,
        "cases": len(ex),
        "tuning_seconds_pruned": sum(r["pruned_seconds"] for r in ex),
        "tuning_seconds_exhaustive": sum(r["exhaustive_seconds"] for r in ex),
        "time_share": sum(r["pruned_seconds"] for r in ex)
        / max(sum(r["exhaustive_seconds"] for r in ex), 1e-9),
        "pruned_speed_vs_best_min": min(ratios),
        "pruned_speed_vs_best_mean": float(np.mean(ratios)),
        "within_3pct": sum(x >= 0.97 for x in ratios),
        "spearman_mean": float(np.mean(rhos)) if rhos else None,
        "best_predicted_rank_median": float(np.median(ranks)),
        "best_predicted_rank_max": max(ranks),
    }


def default_out() -> str:
    """The package's store file for this device (``jax_bindings/tuning/<slug>.json``)."""
    import jax

    from jax_bindings import _tuning

    return str(_tuning.SHIPPED_DIR / f"{_tuning.device_slug(jax.devices()[0].device_kind)}.json")


def main(cfg: TuneConfig, report: str | None = None, log=print) -> dict:
    """Runs :func:`run_tune`, writes the store (and the full report when asked); returns the result."""
    from splat.tools.bench import write_json

    out = cfg.out or default_out()
    cfg = TuneConfig(**{**cfg.__dict__, "out": out})
    result = run_tune(cfg, log)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result["store"], f, indent=1)
        f.write("\n")
    log(f"wrote {out} ({len(result['store']['tiles'])} tile entries)")
    if report:
        write_json(result, report)
        log(f"wrote {report}")
    log(json.dumps(result["summary"]))
    return result


def parse_list(values: Sequence[str] | None, default: tuple) -> tuple:
    return tuple(values) if values else default
