"""Every decode variant the gpu tests build, launched once for compute-sanitizer.

The cases of ``tests/decode_cases.py`` (head dims 64-256, 1-16 tokens a row, GQA groups 1-32, one to
three segments, contiguous caches and page pools with NaN pages nobody maps, one split and many, a
token outside the cache and a padded token), plus segment ids (sorted: the walk cut to each token's
document; and any) with a soft cap, in bfloat16 and
float16; each compiled as the backend compiles it (``jax_bindings._cuda.decode``) and launched with
CuPy (JAX stays on the CPU, so no XLA kernel runs under the sanitizer). The plan, the documents'
key ranges and the merge of the splits are the backend's own (``decode.plan``,
``_id_runs.document_keys``, ``_split_merge.merge_splits``, run by JAX on the CPU), and every output is
checked against the float64
reference; rows that see no key must give 0 and ``-inf``.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_decode.py
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, "tests")
import decode_cases as dc  # noqa: E402

import splat  # noqa: E402
from jax_bindings import _id_runs, _runtime  # noqa: E402
from jax_bindings._cuda import decode  # noqa: E402
from jax_bindings._split_merge import merge_splits  # noqa: E402
from splat import masks  # noqa: E402

NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SMS = 132


def _kernel(variant):
    name, image = decode.compiled(variant)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(image)
        f.flush()
        fn = cp.RawModule(path=f.name).get_function(name)
    fn.max_dynamic_shared_size_bytes = variant.smem
    return fn


def launch(x: dc.Inputs, layout, dtype: str, page: int, splits: int | None, soft_cap=None, rng=None):
    """``(out [B, T, H, D] float32, lse [B, H, T])`` of the decode kernel on ``x``."""
    b, t, h, d = x.q.shape
    hk = x.k.shape[2]
    q, k, v = (a.astype(NP[dtype]) for a in (x.q, x.k, x.v))
    table = np.zeros(1, np.int32)
    if page:
        k, v, table = dc.paged(rng, k.astype(np.float32), v.astype(np.float32), page)
        k, v = k.astype(NP[dtype]), v.astype(NP[dtype])
    ids = x.q_ids is not None
    variant, splits, row_blocks = decode.plan(x.q.shape, hk, dtype, layout, page, ids, soft_cap, SMS, splits)
    q_pos = np.where(np.arange(t)[None, :] < x.q_len[:, None], x.q_pos, -1).astype(np.int32)
    if splits > 1:
        out = cp.full((b, t, h, splits, d), np.nan, np.float32)
        lse = cp.full((b, t, h, splits), np.nan, np.float32)
    else:
        out = cp.full((b, t, h, d), np.nan, NP[dtype])
        lse = cp.full((b, h, t), np.nan, np.float32)
    placeholder = np.zeros(1, np.int32)
    id_keys = placeholder
    if ids:  # as the backend builds them, with JAX on the CPU
        rt = _runtime.build(b, t, dc.L, segment_ids=x.q_ids, kv_segment_ids=x.kv_ids)
        id_keys = np.asarray(_id_runs.document_keys(rt, dc.L))
    args = [
        cp.asarray(a)
        for a in (
            q,
            k,
            v,
            q_pos,
            x.kv_len,
            decode.segment_rows(layout),
            table,
            x.q_ids if ids else placeholder,
            x.kv_ids if ids else placeholder,
            id_keys,
        )
    ]
    args += [
        np.int32(dc.L),
        np.int32(h),
        np.int32(hk),
        np.int32(table.shape[1] if page else 0),
        np.int32(k.shape[0] if page else 0),
        np.float32(d**-0.5 * math.log2(math.e)),
        np.float32(d**-0.5),
        out,
        lse,
    ]
    _kernel(variant)(
        decode.launch_grid(splits, b * hk, row_blocks),
        (variant.threads,),
        tuple(args),
        shared_mem=variant.smem,
    )
    cp.cuda.runtime.deviceSynchronize()
    out, lse = cp.asnumpy(out).astype(np.float32), cp.asnumpy(lse)
    if splits == 1:
        return out, lse
    merged, lse = merge_splits(out, lse, np.float32)  # as the backend merges them, on the CPU
    return np.asarray(merged), np.asarray(lse)


def check(name, out, lse, ref_out, ref_lse):
    empty = ~np.isfinite(ref_lse)
    assert np.isfinite(out).all(), f"{name}: non-finite out"
    err = np.abs(out - ref_out).max() / np.abs(ref_out).max()
    assert err < 4e-2, f"{name}: out differs from the reference by {err:.3g}"
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all() and np.isneginf(lse[empty]).all(), (
        f"{name}: empty rows"
    )
    lerr = np.abs(lse[~empty] - ref_lse[~empty]).max()
    assert lerr < 2e-2, f"{name}: lse differs by {lerr:.3g}"
    print(f"{name:48s} ok (out {err:.1e}, lse {lerr:.1e})")


def main() -> int:
    launched = 0
    for dtype in NP:
        for case in dc.CASES:
            mname, d, t, h, hk, page, splits = case
            rng = np.random.default_rng(d + t + h)
            x = dc.inputs(rng, 3, t, h, hk, d, dc.MASKS[mname])
            x = x._replace(
                q=x.q.astype(NP[dtype]).astype(np.float32),
                k=x.k.astype(NP[dtype]).astype(np.float32),
                v=x.v.astype(NP[dtype]).astype(np.float32),
            )
            layout = splat.analyze(dc.MASKS[mname], dc.L, dc.L)
            out, lse = launch(x, layout, dtype, page, splits, rng=rng)
            check(
                f"{'-'.join(map(str, case))} {dtype}",
                out,
                lse,
                *dc.reference(x.q, x.k, x.v, x.visible, d**-0.5),
            )
            launched += 1
    rng = np.random.default_rng(0)
    layout = splat.analyze(masks.causal(), dc.L, dc.L)
    for ids in ("documents", "any"):
        x = dc.inputs(rng, 4, 2, 8, 2, 128, masks.causal(), ids=ids)
        x = x._replace(
            **{n: getattr(x, n).astype(ml_dtypes.bfloat16).astype(np.float32) for n in ("q", "k", "v")}
        )
        for splits in (1, 4):
            out, lse = launch(x, layout, "bfloat16", 0, splits, soft_cap=30.0)
            check(
                f"ids ({ids}) + soft cap, splits {splits}",
                out,
                lse,
                *dc.reference(x.q, x.k, x.v, x.visible, 128**-0.5, soft_cap=30.0),
            )
            launched += 1
    print(f"{launched} launches of decode kernel variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
