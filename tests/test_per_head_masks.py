"""Per-head static masks (``mask=`` as one mask per query head or per KV-head group) vs float64.

The reference runs each query head on its own: its static mask rendered dense, AND-ed with the runtime
arguments (tests/runtime_masks.runtime_dense), through tests/reference.runtime_ref; the KV gradients
add up over the query heads that read each KV head.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, refusal_skips, runtime_ref
from runtime_masks import packed_ids, runtime_dense

import splat
from splat import _attention, _per_head, masks

SCALE = 0.3
WINDOWS = [masks.sliding_window(3, 0), masks.sliding_window(10, 0), masks.causal(), masks.global_tokens(2)]


def _inputs(rng, b, sq, skv, h, hk, *, d=16, dtype=jnp.float32):
    shapes = ((b, sq, h, d), (b, skv, hk, d), (b, skv, hk, d), (b, sq, h, d))
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _dense(mask, rows, cols) -> np.ndarray:
    return splat.analyze(mask, rows, cols).to_dense()


def _ref(q, k, v, do, heads_dense, cap=None, **rt):
    """``(out, (dq, dk, dv), dense [B, H, Sq, Skv])`` in float64, one query head at a time."""
    b, sq, h, _ = q.shape
    skv, hk = k.shape[1], k.shape[2]
    g = h // hk
    out, dq = np.zeros(q.shape), np.zeros(q.shape)
    dk, dv = np.zeros(k.shape), np.zeros(k.shape)
    dense = []
    for i in range(h):
        m = runtime_dense(heads_dense[i], b, sq, skv, **rt)
        j = i // g
        o, (a, bk, bv) = runtime_ref(
            q[:, :, i : i + 1], k[:, :, j : j + 1], v[:, :, j : j + 1], m, SCALE, do[:, :, i : i + 1], cap
        )
        out[:, :, i : i + 1], dq[:, :, i : i + 1] = o, a
        dk[:, :, j : j + 1] += bk
        dv[:, :, j : j + 1] += bv
        dense.append(m)
    return out, (dq, dk, dv), np.stack(dense, 1)


def _run(q, k, v, do, mask, backend, cap=None, **kw):
    @jax.jit
    def run(q, k, v, do, kw):
        f = lambda q, k, v: splat.attention(
            q, k, v, mask, scale=SCALE, logits_soft_cap=cap, backend=backend, **kw
        )
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do.astype(out.dtype))

    with refusal_skips(backend):
        return run(q, k, v, do, {n: jnp.asarray(x) for n, x in kw.items()})


def _check(rng, backend, mask, heads_dense, sq, skv, h, hk, *, b=2, dtype=jnp.float32, cap=None, **rt):
    """splat.attention with per-head ``mask`` against the reference; also zero rows and zero grads."""
    q, k, v, do = _inputs(rng, b, sq, skv, h, hk, dtype=dtype)
    names = {"ids": "segment_ids", "qlen": "query_seq_lengths", "kvlen": "key_value_seq_lengths"}
    names["offset"] = "q_offset"
    out, (dq, dk, dv) = _run(q, k, v, do, mask, backend, cap, **{names[n]: x for n, x in rt.items()})
    ref, grads, dense = _ref(q, k, v, do, heads_dense, cap, **rt)
    assert_close("out", out, ref, dtype)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads, strict=True):
        assert_close(name, got, want, dtype, factor=4.0)
    empty = ~dense.any(-1).transpose(0, 2, 1)  # [B, Sq, H]: rows that see no key give 0, zero dq
    assert not np.asarray(out, np.float32)[empty].any()
    assert not np.asarray(dq, np.float32)[empty].any()
    unseen = ~dense.reshape(b, hk, h // hk, sq, skv).any((2, 3)).transpose(0, 2, 1)  # [B, Skv, Hk]
    assert not np.asarray(dk, np.float32)[unseen].any()
    assert not np.asarray(dv, np.float32)[unseen].any()
    return out


def _calls(monkeypatch) -> list[tuple[int, int, object]]:
    """Records ``(query heads, KV heads, layout)`` of every single-mask call."""
    seen, attend = [], _attention._attend

    def spy(q, k, v, layout, *a, **kw):
        seen.append((q.shape[2], k.shape[2], layout))
        return attend(q, k, v, layout, *a, **kw)

    monkeypatch.setattr(_attention, "_attend", spy)
    return seen


# -----------------------------------------------------------------------------
# correctness on every backend
# -----------------------------------------------------------------------------


def test_sequence_of_masks(rng, backend):
    """Windows of different widths, causal and global tokens, one per query head; GQA; S = 70."""
    s = 70
    _check(rng, backend, WINDOWS, [_dense(m, s, s) for m in WINDOWS], s, s, 4, 2)


def test_bool_array_with_equal_heads(rng, backend, monkeypatch):
    """``[H, S, S]`` with heads 0, 2 and 1, 3 equal: two calls, each across two KV groups."""
    s = 45
    a, c = np.tril(np.ones((s, s), bool)), _dense(masks.sliding_window(5, 2), s, s)
    arr = np.stack([a, c, a, c])
    calls = _calls(monkeypatch)
    out = _check(rng, backend, arr, arr, s, s, 4, 2)
    assert [(hq, hkv) for hq, hkv, _ in calls] == [(2, 2), (2, 2)]  # each query head its own K/V slice
    calls.clear()
    q, k, v, do = _inputs(rng, 2, s, s, 4, 2)
    lead = splat.attention(q, k, v, arr[None], scale=SCALE, backend=backend)  # [1, H, S, S]
    np.testing.assert_array_equal(lead, splat.attention(q, k, v, list(arr), scale=SCALE, backend=backend))
    assert out.shape == lead.shape


def test_per_kv_group_masks_keep_gqa(rng, backend, monkeypatch):
    """One mask per KV head (``Hk`` masks): query head h takes mask h // G, and each call keeps GQA."""
    s, h, hk = 50, 6, 2
    per_kv = [masks.sliding_window(4, 0), masks.causal()]
    calls = _calls(monkeypatch)
    _check(rng, backend, per_kv, [_dense(per_kv[i // 3], s, s) for i in range(h)], s, s, h, hk)
    assert [(hq, hkv) for hq, hkv, _ in calls] == [(3, 1), (3, 1)]


def test_runtime_arguments_and_empty_rows(rng, backend):
    """Segment ids, lengths and a soft cap; a head whose mask leaves rows empty gives 0 there."""
    s = 61
    holes = np.tril(np.ones((s, s), bool))
    holes[::7] = False  # fully masked rows on one head only
    per_head = [masks.sliding_window(6, 0), holes, masks.causal(), masks.global_tokens(3) | masks.causal()]
    dense = [_dense(m, s, s) for m in per_head]
    rt = {"ids": packed_ids(rng, 2, s, 30), "qlen": np.array([50, 61]), "kvlen": np.array([61, 40])}
    _check(rng, backend, per_head, dense, s, s, 4, 2, cap=2.0, **rt)


def test_q_offset_decode(rng, backend):
    """Chunked prefill at per-row offsets: each head's mask is taken at (Skv, Skv)."""
    if backend == "triton":
        pytest.skip("the triton backend refuses q_offset (auto runs the pure backend)")
    skv, sq = 48, 5
    per_head = [masks.sliding_window(4, 0), masks.causal()]
    dense = [_dense(m, skv, skv) for m in per_head]
    _check(rng, backend, per_head, dense, sq, skv, 2, 1, offset=np.array([3, 40], np.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_pure_backend(rng, dtype):
    s = 40
    _check(rng, "jax", WINDOWS, [_dense(m, s, s) for m in WINDOWS], s, s, 4, 4, dtype=dtype)


def test_vmap(rng):
    s = 33
    q, k, v, _ = _inputs(rng, 3, s, s, 4, 2)
    f = lambda q, k, v: splat.attention(q, k, v, WINDOWS, scale=SCALE, backend="jax")
    got = jax.vmap(f)(q[:, None], k[:, None], v[:, None])[:, 0]
    np.testing.assert_allclose(got, f(q, k, v), rtol=1e-6, atol=1e-6)


# -----------------------------------------------------------------------------
# grouping
# -----------------------------------------------------------------------------


def test_equal_heads_share_one_layout():
    s = 64
    c, w = masks.causal(), masks.sliding_window(8, 0)
    arr = np.stack([_dense(m, s, s) for m in (c, w, c, c, w, c, c, w)])
    layouts = _per_head.query_head_layouts(_per_head.head_masks(arr), s, s, 8, 8)
    groups = _per_head.groups(layouts)
    assert len(set(layouts)) == 2
    assert [hs for _, hs in groups] == [(0, 2, 3, 5, 6), (1, 4, 7)]
    # a Mask and its dense array analyse to one layout, so they group together
    mixed = _per_head.query_head_layouts((c, _dense(c, s, s), w, w), s, s, 4, 4)
    assert len(set(mixed)) == 2


def test_one_mask_for_all_heads_is_the_single_mask_call(rng, monkeypatch):
    s = 40
    q, k, v, _ = _inputs(rng, 2, s, s, 4, 2)
    calls = _calls(monkeypatch)
    one = splat.attention(q, k, v, masks.causal())
    per = splat.attention(q, k, v, [masks.causal()] * 4)
    per_kv = splat.attention(q, k, v, np.stack([_dense(masks.causal(), s, s)] * 2))
    assert [c[:2] for c in calls] == [(4, 2)] * 3 and len({c[2] for c in calls}) == 1
    np.testing.assert_array_equal(per, one)
    np.testing.assert_array_equal(per_kv, one)


def test_report_shows_the_head_groups():
    r = splat.report([masks.causal(), masks.sliding_window(8, 0), masks.causal()], q_len=64)
    assert isinstance(r, splat.HeadGroupsReport)
    assert [hs for hs, _ in r.groups] == [(0, 2), (1,)]
    text = r.to_string()
    assert "3 masks, 2 distinct" in text and "heads 0, 2" in text and "Causal()" in text


# -----------------------------------------------------------------------------
# bad input
# -----------------------------------------------------------------------------


def _bad(mask, h=4, hk=2, s=16):
    q = jnp.zeros((1, s, h, 8))
    kv = jnp.zeros((1, s, hk, 8))
    return splat.attention(q, kv, kv, mask)


@pytest.mark.parametrize(
    ("mask", "exc", "text"),
    [
        (
            [masks.causal()] * 3,
            ValueError,
            "mask has 3 per-head masks but the attention has 4 query heads or 2",
        ),
        (np.ones((3, 16, 16), bool), ValueError, "mask has 3 per-head masks"),
        (np.ones((1, 3, 16, 16), bool), ValueError, "mask has 3 per-head masks"),
        (np.ones((4, 16, 12), bool), ValueError, "mask[0]: mask array must have shape (q_len, kv_len)"),
        (
            np.ones((2, 4, 16, 16), bool),
            ValueError,
            "mask array has shape (2, 4, 16, 16): per-batch masks are not supported",
        ),
        (np.ones((4, 16, 16), np.int32), TypeError, "mask array must be boolean"),
        ([masks.causal(), "causal"], TypeError, "mask[1]: mask must be a splat.masks.Mask"),
        ([], ValueError, "mask is an empty sequence"),
    ],
)
def test_bad_masks_name_mask(mask, exc, text):
    with pytest.raises(exc, match=re.escape(text)):
        _bad(mask)


def test_sequence_axis_refuses_per_head_masks():
    x = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="per-head masks cannot be combined with sequence_axis"):
        splat.attention(x, x, x, [masks.causal()] * 2, sequence_axis="sp")
