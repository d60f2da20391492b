"""Spike: the CUDA decode kernel against FA3's ``flash_mha_with_kvcache`` and cuDNN, one process.

Times ``jax_bindings._cuda.decode.forward`` directly (no public API in between) on the decode
cases of the inference issue (bf16, Hq=32, Hk=8, D=128, one token a row at the cache's last
position), with the split count the planner picks and, with ``--sweep``, others; every peer's
output checked against splat's. GB/s = bytes of K and V the mask needs / time. Prints a table,
writes ``--out`` JSON. ``python -m benchmarks.spikes.spike_decode_cuda [--sweep] [--out f.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import splat
from jax_bindings._runtime import RuntimeMask
from splat.catalogue import DECODE
from splat.tools.timing import chain

H, HK, D = 32, 8, 128
CASES = [
    ("causal B=8 32K", 8, 32768, DECODE["causal"], None),
    ("causal B=1 128K", 1, 131072, DECODE["causal"], None),
    ("causal B=64 8K", 64, 8192, DECODE["causal"], None),
    ("window4096 B=8 32K", 8, 32768, DECODE["causal_window_4096"], 4095),
    ("sinks+window B=8 32K", 8, 32768, DECODE["sink_window_4096"], None),
    ("dilated B=8 32K", 8, 32768, DECODE["dilated_causal"], None),
]
CALLS = 10
# (block_n, warps_n, stages) for --tiles
TILES = [(64, 4, 3), (64, 4, 4), (64, 4, 6), (128, 8, 3), (32, 2, 6)]
# --variants: edits of the kernel's text (and its launch grid) timed against it as it is
_SPLIT_Y = (
    "  const int split = blockIdx.x, splits = gridDim.x;\n"
    "  const int b = blockIdx.y / Hk, hk = blockIdx.y % Hk,",
    "  const int split = blockIdx.y, splits = gridDim.y;\n"
    "  const int b = blockIdx.x / Hk, hk = blockIdx.x % Hk,",
)
_PREFETCH = (
    "cp.async.cg.shared.global [%0], [%1], 16, %2;",
    "cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;",
)
VARIANTS = {
    "as is": [],
    "heads adjacent": [_SPLIT_Y],
    "L2 256B prefetch": [_PREFETCH],
    "heads adjacent + prefetch": [_SPLIT_Y, _PREFETCH],
}


_READ = None


def _apply(variant: str, decode) -> None:
    """Kernel text with ``VARIANTS[variant]``'s edits (each must apply), its grid to match."""
    global _READ
    from jax_bindings._cuda import parts

    if _READ is None:
        _READ = parts.read
    edits = VARIANTS[variant]

    def read(path, edits=edits):
        text = _READ(path)
        for old, new in edits:
            if old in text:
                text = text.replace(old, new)
        return text

    for old, _ in edits:
        assert any(old in t for _, t in parts._files()), old
    parts.read = read
    parts._files_edited = edits
    swap = _SPLIT_Y in edits
    decode.launch_grid = (lambda s, h, r: (h, s, r)) if swap else (lambda s, h, r: (s, h, r))
    decode.compiled.cache_clear()


def _time(fn, args, reps=15):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t) * 1e3 / CALLS)
    return statistics.median(ts), min(ts)


def main(argv=None):
    from jax_bindings._cuda import backend as cb
    from jax_bindings._cuda import decode

    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out")
    p.add_argument(
        "--tiles", action="store_true", help="sweep tile shapes (block_n, warps_n, stages) instead"
    )
    p.add_argument("--variants", action="store_true", help="time the source variants of VARIANTS instead")
    a = p.parse_args(argv)
    rows = []
    try:
        import flash_attn3_jax as fa3
    except Exception as e:  # noqa: BLE001
        fa3, why = None, repr(e)
    sms = cb._sm_count()
    for name, b, L, mask, window in CASES:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((b, 1, H, D)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((b, L, HK, D)), jnp.bfloat16) for _ in range(2))
        lens = jnp.full((b,), L, jnp.int32)
        layout = splat.analyze(mask, L, L)
        keys = int(layout.row_counts()[L - 1])
        gb = b * HK * keys * D * 2 * 2 / 1e9
        rt = RuntimeMask(
            jnp.ones((b,), jnp.int32),
            lens,
            jnp.ones((b,), jnp.int32),
            None,
            None,
            jnp.full((b, 1), L - 1, jnp.int32),
        )
        planned = decode.plan(q.shape, HK, "bfloat16", layout, 0, False, None, sms)[1]
        split_list = sorted({planned, 1, 2, 4, 8, 16, 32}) if a.sweep else [planned]
        tiles = [None]
        if a.tiles:
            split_list = [planned]
            tiles = [decode.DecodeTile(16, bn, 1, wn, st) for bn, wn, st in TILES]
        variants = list(VARIANTS) if a.variants else ["as is"]
        ref = None
        for variant, tile in [(x, t) for x in variants for t in tiles]:
            _apply(variant, decode)
            for s in split_list:
                f = lambda q, k, v, s=s, tile=tile, rt=rt, layout=layout: decode.forward(  # noqa: E731
                    q, k, v, rt, layout, D**-0.5, None, sms, splits=s, tile=tile
                )[0]
                fn = jax.jit(chain(f, CALLS, {0: 0}))
                ms, ms_min = _time(fn, (q, k, v))
                out = jax.jit(f)(q, k, v)
                ref = out if ref is None else ref
                diff = float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max())
                what = f"splits={s}{' (planned)' if s == planned else ''}"
                if tile is not None:
                    what = f"bn={tile.block_n} w={tile.warps_n} st={tile.stages}"
                if a.variants:
                    what = variant
                rows.append(
                    dict(case=name, peer=f"splat {what}", ms=ms, ms_min=ms_min, gbps=gb / ms * 1e3, diff=diff)
                )
        _apply("as is", decode)
        if fa3 is not None:
            for ns in (0, 1, 4, 16, 32):
                kw = dict(cache_seqlens=lens, is_causal=True, num_splits=ns)
                if window is not None:
                    kw["window_size"] = (window, 0)
                if name.startswith(("sinks", "dilated")):
                    break
                f = lambda q, k, v, kw=kw: fa3.flash_mha_with_kvcache(q, k, v, **kw)  # noqa: E731
                try:
                    fn = jax.jit(chain(f, CALLS, {0: 0}))
                    ms, ms_min = _time(fn, (q, k, v))
                    diff = float(
                        jnp.abs(jax.jit(f)(q, k, v).astype(jnp.float32) - ref.astype(jnp.float32)).max()
                    )
                    rows.append(
                        dict(
                            case=name,
                            peer=f"fa3 splits={ns}",
                            ms=ms,
                            ms_min=ms_min,
                            gbps=gb / ms * 1e3,
                            diff=diff,
                        )
                    )
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(case=name, peer=f"fa3 splits={ns}", error=repr(e)[:200]))
        if window is None and not name.startswith(("sinks", "dilated")):
            f = lambda q, k, v, lens=lens: jax.nn.dot_product_attention(  # noqa: E731
                q, k, v, key_value_seq_lengths=lens, implementation="cudnn"
            )
            try:
                fn = jax.jit(chain(f, CALLS, {0: 0}))
                ms, ms_min = _time(fn, (q, k, v))
                diff = float(jnp.abs(jax.jit(f)(q, k, v).astype(jnp.float32) - ref.astype(jnp.float32)).max())
                rows.append(
                    dict(case=name, peer="cudnn", ms=ms, ms_min=ms_min, gbps=gb / ms * 1e3, diff=diff)
                )
            except Exception as e:  # noqa: BLE001
                rows.append(dict(case=name, peer="cudnn", error=repr(e)[:200]))
    if fa3 is None:
        rows.append(dict(case="-", peer="fa3", error=why))
    dev = jax.devices()[0].device_kind
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=dev, rows=rows), f, indent=1)
    print(f"device: {dev}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:24s} {r['peer']:28s} error {r['error'][:90]}")
        else:
            print(
                f"{r['case']:24s} {r['peer']:28s} {r['ms'] * 1e3:8.1f} us  {r['gbps']:7.0f} GB/s"
                f"  min {r['ms_min'] * 1e3:8.1f} us  diff {r.get('diff', 0):.3g}"
            )


if __name__ == "__main__":
    main()
