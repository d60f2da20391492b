"""The Triton decode kernel (``jax_bindings._triton.decode``) under Triton's interpreter, on CPU.

Every case of ``decode_cases`` the kernel takes (runs of consecutive keys: causal, windows, sinks +
window; head dims 64, 128, 256; 1, 4 and 16 tokens a row; GQA groups 1, 4 and 32; contiguous
caches and shuffled page pools with NaN in the pages nobody maps; one split and several) against
the float64 dense reference taken at the tokens' positions, with a token outside the cache and a
padded token (both 0, lse -inf), key lengths that are no tile multiple, and a soft cap. float16
and float32 (the interpreter mishandles bfloat16 dots; bfloat16 runs in the GPU tests). Also what
it refuses, by name.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import decode_cases as dc
import jax.numpy as jnp
import numpy as np
import prefill_cases as pc
import pytest

import splat
from jax_bindings import _id_runs
from jax_bindings._runtime import RuntimeMask
from splat import masks

decode = pytest.importorskip("jax_bindings._triton.decode", reason="needs triton (the test extra)")
from jax_bindings._triton.launch import run_numpy  # noqa: E402

TAKEN = [c for c in dc.CASES if c[1] in (64, 128, 256)]


def _run(x: dc.Inputs, layout, scale, dtype, *, page=0, splits=None, soft_cap=None, rng=None):
    q, k, v = (a.astype(dtype) for a in (x.q, x.k, x.v))
    hk = k.shape[2]
    table = none = np.zeros(1, np.int32)
    if page:
        k, v, table = dc.paged(rng, k, v, page)
        k, v = k.astype(dtype), v.astype(dtype)
    ids = x.q_ids is not None
    id_args = (none, none, none)
    if ids:
        exact = (np.diff(x.q_ids, axis=1) >= 0).all(1) & (np.diff(x.kv_ids, axis=1) >= 0).all(1)
        rt = RuntimeMask(jnp.asarray(x.q_len), jnp.asarray(x.kv_len), jnp.asarray(exact.astype(np.int32)),
                         jnp.asarray(x.q_ids), jnp.asarray(x.kv_ids), jnp.asarray(x.q_pos))
        id_args = (x.q_ids, x.kv_ids, np.asarray(_id_runs.document_keys(rt, dc.L)))
    name = np.dtype(dtype).name
    assert decode.refusal(layout, q.shape, hk, name) is None
    p = decode.plan(q.shape, hk, name, layout, scale, soft_cap, 132, page_size=page,
                    max_pages=table.shape[1] if page else 0, n_pages=k.shape[0] if page else 0, ids=ids,
                    splits=splits)
    out, lse, *_scratch = run_numpy(decode.call(p, interpret=True), q, k, v, x.q_pos, x.q_len, x.kv_len,
                                    decode.segment_table(layout), table, *id_args)
    return np.asarray(out, np.float64), np.asarray(lse, np.float64), (q, k, v)


def _check(out, lse, ref_out, ref_lse, dtype):
    tol = 3e-3 if dtype == np.float16 else 1e-5
    assert np.isfinite(out).all()
    assert np.abs(out - ref_out).max() <= tol * max(1.0, np.abs(ref_out).max())
    empty = ~np.isfinite(ref_lse)
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all()  # out [B, T, H, D], lse [B, H, T]
    assert (np.isneginf(lse) == empty).all()
    assert np.abs(lse[~empty] - ref_lse[~empty]).max() <= 10 * tol


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("case", TAKEN, ids=["-".join(map(str, c)) for c in TAKEN])
def test_decode_matches_the_float64_reference(case, dtype, rng):
    name, d, t, h, hk, page, splits = case
    x = dc.inputs(rng, 3, t, h, hk, d, dc.MASKS[name])
    layout = splat.analyze(dc.MASKS[name], dc.L, dc.L)
    out, lse, (q, k, v) = _run(x, layout, d**-0.5, dtype, page=page, splits=splits, rng=rng)
    ref_out, ref_lse = dc.reference(
        x.q.astype(dtype), x.k.astype(dtype), x.v.astype(dtype), x.visible, d**-0.5
    )
    _check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("splits", [1, 5])
def test_soft_cap(splits, rng):
    x = dc.inputs(rng, 2, 2, 8, 2, 64, masks.causal())
    layout = splat.analyze(masks.causal(), dc.L, dc.L)
    out, lse, _ = _run(x, layout, 0.5, np.float32, splits=splits, soft_cap=3.0)
    ref_out, ref_lse = dc.reference(x.q, x.k, x.v, x.visible, 0.5, soft_cap=3.0)
    _check(out, lse, ref_out, ref_lse, np.float32)


@pytest.mark.parametrize("page", [24, 1000])
def test_pages_of_any_size(page, rng):
    """Pages that are no power of two, and one page as long as the cache."""
    x = dc.inputs(rng, 2, 3, 8, 2, 64, masks.sink(4) | masks.sliding_window(99, 0))
    layout = splat.analyze(masks.sink(4) | masks.sliding_window(99, 0), dc.L, dc.L)
    out, lse, _ = _run(x, layout, 0.125, np.float32, page=page, splits=3, rng=rng)
    _check(out, lse, *dc.reference(x.q, x.k, x.v, x.visible, 0.125), np.float32)


# (case, page size): a spread of tests/prefill_cases (the interpreter takes ~10 s a case)
CHUNKS = [
    (pc.CASES[0], 0),
    (pc.CASES[4], 16),
    (("sinks+window", [-50, 437, 900], [1000, 637, 1000], [200, 160, 200], True, 8, 2), 16),
    (("dilated", [0, 613], None, None, False, 8, 2), 16),
]


@pytest.mark.parametrize(("case", "page"), CHUNKS, ids=[f"{pc.case_id(c)}-page{p}" for c, p in CHUNKS])
def test_a_chunk_at_an_offset_runs_on_blocks_of_rows(case, page, rng):
    """Chunked prefill: 200 tokens at offsets per batch row (rows before and past the cache see
    nothing), with lengths, documents and pages, in blocks of 128 (token, head) rows; a dilated
    mask's tokens step from different residues, so its walk goes key by key."""
    x = pc.inputs(case)
    b = len(x.offsets)
    pos = x.offsets[:, None] + np.arange(pc.SQ)
    d = dc.Inputs(x.q, x.k, x.v, x.runtime.get("qlen", np.full(b, pc.SQ, np.int32)),
                  x.runtime.get("kvlen", np.full(b, pc.L, np.int32)),
                  np.where((pos >= 0) & (pos < pc.L), pos, -1).astype(np.int32),
                  x.runtime.get("ids"), x.runtime.get("kv_ids"), x.dense)
    layout = splat.analyze(pc.MASKS[case[0]], pc.L, pc.L)
    out, lse, _ = _run(d, layout, 128**-0.5, np.float32, page=page, rng=rng)
    _check(out, lse, *dc.reference(x.q, x.k, x.v, x.dense, 128**-0.5), np.float32)


@pytest.mark.parametrize("mask", [masks.sink(4) | masks.sliding_window(15, 0),
                                  masks.sink(2) | (masks.dilated_window(9, 3) & masks.causal())],
                         ids=["runs", "progressions"])
def test_segment_table_holds_each_rows_keys(mask):
    layout = splat.analyze(mask, 64, 64)
    table = decode.segment_table(layout)
    assert table.shape == (64, len(layout.segments), 3)
    dense = layout.to_dense()
    for r in range(64):
        keys = set()
        for base, count, step in table[r]:
            keys |= set(range(base, base + count * step, step))
        assert keys == set(np.flatnonzero(dense[r]))


@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("name", ["documents", "dilated", "uneven"])
def test_walks_of_any_length_split_and_merged_in_the_kernel(name, splits, rng):
    """Walks of very different lengths in one call (documents; rows whose caches hold 30 to 1000
    keys, so some rows need fewer splits than planned); a dilated mask's progressions besides."""
    mask = masks.dilated_window(96, 2) & masks.causal() if name == "dilated" else masks.causal()
    x = dc.inputs(rng, 5, 1, 8, 2, 64, mask, ids="documents" if name == "documents" else None)
    if name == "uneven":
        kv_len = np.array([1000, 30, 700, 64, 129], np.int32)
        pos = (kv_len - 1)[:, None]
        vis = np.arange(dc.L)[None, None, :] <= pos[:, :, None]
        x = x._replace(kv_len=kv_len, q_pos=pos.astype(np.int32), q_len=np.ones(5, np.int32), visible=vis)
    layout = splat.analyze(mask, dc.L, dc.L)
    out, lse, _ = _run(x, layout, 0.125, np.float32, splits=splits)
    _check(out, lse, *dc.reference(x.q, x.k, x.v, x.visible, 0.125), np.float32)


@pytest.mark.parametrize("page", [0, 16])
@pytest.mark.parametrize("ids", ["documents", "any"])
@pytest.mark.parametrize("splits", [1, 4])
def test_segment_ids(splits, ids, page, rng):
    """Sorted ids (packed documents: each token walks its document's keys) and any ids (every key,
    compared one by one); with a window that a document can cut."""
    mask = masks.sink(4) | masks.sliding_window(299, 0)
    x = dc.inputs(rng, 3, 2, 8, 2, 64, mask, ids=ids)
    layout = splat.analyze(mask, dc.L, dc.L)
    out, lse, _ = _run(x, layout, 0.125, np.float32, page=page, splits=splits, rng=rng)
    _check(out, lse, *dc.reference(x.q, x.k, x.v, x.visible, 0.125), np.float32)


@pytest.mark.parametrize(
    ("mask", "shape", "match"),
    [
        (masks.causal(), (1, 1, 8, 96), "head dims"),
        (masks.causal(), (1, 1, 8, 512), "head dims"),
        (masks.from_array(np.random.default_rng(0).random((256, 256)) < 0.05), (1, 1, 8, 128),
         "segments only"),
    ],
    ids=["head_dim_96", "head_dim_512", "scattered"],
)
def test_what_it_refuses_is_named(mask, shape, match):
    layout = splat.analyze(mask, 256, 256)
    assert match in decode.refusal(layout, shape, 2, "bfloat16")
    assert decode.refusal(splat.analyze(masks.causal(), 256, 256), (1, 300, 8, 128), 2, "bfloat16") is None


# The constexpr space's corners: (q shape, kv heads, dtype, mask expression, page size, splits, soft cap
# or "ids"); the fifth is a chunk (blocks of rows, 8 warps)
COMPILED = [
    ((3, 1, 32, 128), 8, "bfloat16", "sink(4) | sliding_window(255, 0)", 0, 4, None),
    ((2, 4, 8, 64), 2, "float16", "causal()", 16, 1, 30.0),
    ((2, 16, 8, 256), 8, "bfloat16", "causal()", 64, 3, None),
    ((2, 2, 8, 128), 2, "float16", "causal()", 0, 2, "ids"),
    ((1, 300, 8, 128), 2, "bfloat16", "sink(4) | sliding_window(255, 0)", 16, 1, "ids"),
    ((5, 1, 32, 128), 8, "bfloat16", "dilated_window(96, 2) & causal()", 0, None, None),
    ((2, 3, 8, 64), 2, "float16", "causal() & strided(8)", 16, 4, "ids"),
]

_COMPILE = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
import splat
from jax_bindings._triton import decode
for shape, hk, dt, mask, page, splits, cap in json.loads(sys.argv[1]):
    layout = splat.analyze(splat.masks.parse(mask), 1000, 1000)
    ids = cap == "ids"
    cap = None if ids else cap
    p = decode.plan(tuple(shape), hk, dt, layout, 0.1, cap, 132, page_size=page, max_pages=63 if page else 0,
                    n_pages=200 if page else 0, ids=ids, splits=splits)
    ptr = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32"}
    names = ["Q", "K", "V", "QPOS", "QLEN", "KVLEN", "SEG", "TABLE", "QIDS", "KVIDS", "DOC", "OUT", "LSE",
             "PART_O", "PART_L", "TICKETS"]
    types = [ptr[dt]] * 3 + ["*i32"] * 8 + [ptr[o[1]] for o in p.out]
    cx = dict(p.constexprs)
    sig = {**dict(zip(names, types)), **dict.fromkeys(cx, "constexpr")}
    options = {"num_warps": p.num_warps, "num_stages": p.num_stages}
    done = compile(ASTSource(fn=decode.kernel(False), signature=sig, constexprs=cx),
                   target=GPUTarget("cuda", 90, 32), options=options)
    assert done.asm["cubin"][:4] == b"\\x7fELF", (shape, mask)
print("compiled", len(json.loads(sys.argv[1])))
"""


def test_the_kernel_compiles_for_sm90():
    """Triton's compiler to a cubin for sm_90 on the CPU, for the corners of the constexpr space:
    what the interpreter lets through (module globals that are not constexprs, say) but a GPU
    compile rejects shows here. In a fresh process: the interpreter the rest of the suite runs
    leaves Triton's language patched."""
    pytest.importorskip("triton.compiler")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(COMPILED)],
        capture_output=True,
        text=True,
        env=env,
        cwd=pathlib.Path(__file__).resolve().parents[1],
        timeout=300,
    )
    assert done.returncode == 0 and f"compiled {len(COMPILED)}" in done.stdout, done.stderr[-3000:]
