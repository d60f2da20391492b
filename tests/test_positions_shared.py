"""splat.attention's ``kv_positions`` where keys share a position: they share its mask column.

No order of the keys puts two of them in one column, so such a call runs on the pure-JAX rows,
which evaluate the static mask at each key's position; distinct positions still move the keys
into column order for any backend. Outputs and gradients are checked against the float64 dense
attention under the mask taken at ``(q_positions[b, i], kv_positions[b, j])``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, refusal_skips, runtime_ref

import splat
from splat import _runtime_args, masks

B, SQ, SKV, H, HK, D = 2, 12, 20, 4, 2, 8

# each mask with its own predicate in numpy (rows: query positions, columns: key positions)
MASKS = {
    "causal": (masks.causal(), lambda i, j: i >= j),
    "band": (masks.sliding_window(3, 2), lambda i, j: (j >= i - 3) & (j <= i + 2)),
    "irregular": (  # no segment fits: the residual's bits
        masks.from_fn(lambda i, j: ((i * 7 + j * 3) % 5 != 0) & (j <= i + 1)),
        lambda i, j: ((i * 7 + j * 3) % 5 != 0) & (j <= i + 1),
    ),
}


def _positions(rng):
    """Query positions (one outside the mask) and key positions where several keys share one,
    two are padding, and one batch row is left distinct."""
    qp = np.stack([rng.integers(0, SKV, SQ), np.arange(SQ) + 5])
    qp[0, 3] = -1
    kp = np.stack([rng.integers(0, 8, SKV), np.arange(SKV)])  # row 0: 20 keys on 8 positions
    kp[0, 4], kp[0, 11] = -1, SKV  # padding
    return jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32)


def _mask_at(pred, qp, kp, ids=None):
    """``[B, Sq, Skv]``: the predicate at each pair of positions, both inside ``[0, Skv)``."""
    qp, kp = np.asarray(qp)[:, :, None], np.asarray(kp)[:, None, :]
    inside = (qp >= 0) & (qp < SKV) & (kp >= 0) & (kp < SKV)
    m = inside & pred(qp, kp)
    if ids is not None:
        m &= np.asarray(ids[0])[:, :, None] == np.asarray(ids[1])[:, None, :]
    return m


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("soft_cap", [None, 5.0], ids=["plain", "capped"])
def test_keys_sharing_a_position_share_its_mask_column(rng, backend, name, soft_cap):
    q = jnp.asarray(rng.standard_normal((B, SQ, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, SKV, HK, D)), jnp.float32) for _ in range(2))
    qp, kp = _positions(rng)
    mask, pred = MASKS[name]
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    scale = D**-0.5

    def f(q, k, v):
        return splat.attention(
            q, k, v, mask, q_positions=qp, kv_positions=kp, logits_soft_cap=soft_cap, backend=backend
        )

    with refusal_skips(backend):
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        grads = vjp(dout)
    ref, ref_grads = runtime_ref(q, k, v, _mask_at(pred, qp, kp), scale, dout, soft_cap)
    assert_close("out", out, ref, jnp.float32)
    for g, r, n in zip(grads, ref_grads, ("dq", "dk", "dv"), strict=True):
        assert_close(n, g, r, jnp.float32)


def test_shared_positions_with_segment_ids_and_per_head_masks(rng):
    """Ids AND the mask, and each head's mask read at the shared positions."""
    q = jnp.asarray(rng.standard_normal((B, SQ, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, SKV, HK, D)), jnp.float32) for _ in range(2))
    qp, kp = _positions(rng)
    ids = (
        jnp.asarray(rng.integers(0, 2, (B, SQ)), jnp.int32),
        jnp.asarray(rng.integers(0, 2, (B, SKV)), jnp.int32),
    )
    names = ["causal", "band", "band", "irregular"]
    out = splat.attention(
        q,
        k,
        v,
        [MASKS[n][0] for n in names],
        q_positions=qp,
        kv_positions=kp,
        segment_ids=ids[0],
        kv_segment_ids=ids[1],
        backend="jax",
    )
    dout = jnp.zeros(q.shape, jnp.float32)
    for h, n in enumerate(names):
        m = _mask_at(MASKS[n][1], qp, kp, ids)
        ref, _ = runtime_ref(
            q[:, :, h : h + 1],
            k[:, :, h // 2 : h // 2 + 1],
            v[:, :, h // 2 : h // 2 + 1],
            m,
            D**-0.5,
            dout[:, :, h : h + 1],
        )
        assert_close(f"head {h}", out[:, :, h : h + 1], ref, jnp.float32)


def test_which_positions_count_as_shared():
    """Padding (outside ``[0, Skv)``) never counts as shared, however often it repeats."""
    padded = jnp.asarray([[-1, -1, 0, 1, 7, 7], [0, 1, 2, 3, 4, 5]])
    assert bool(_runtime_args.distinct_positions(padded))
    assert not bool(_runtime_args.distinct_positions(padded.at[1, 5].set(2)))


def test_vmapped_rows_take_one_route(rng):
    """Under ``vmap`` the route is one for every mapped row (shared positions in one of them send
    all to the rows that read each key's position): exact for each, gradients included."""
    q = jnp.asarray(rng.standard_normal((3, B, SQ, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((3, B, SKV, HK, D)), jnp.float32) for _ in range(2))
    kp = jnp.asarray(np.arange(SKV)[None, None].repeat(3, 0).repeat(B, 1), jnp.int32)
    kp = kp.at[1, 0, 6].set(5)
    mask, pred = MASKS["band"]
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def f(q, k, v, kp):
        return splat.attention(q, k, v, mask, kv_positions=kp, backend="jax")

    out, vjp = jax.vjp(jax.jit(jax.vmap(f)), q, k, v, kp)
    grads = vjp(dout)[:3]
    qp = jnp.broadcast_to(jnp.arange(SQ, dtype=jnp.int32), (B, SQ))
    for r in range(3):
        ref, ref_grads = runtime_ref(q[r], k[r], v[r], _mask_at(pred, qp, kp[r]), D**-0.5, dout[r])
        assert_close(f"out {r}", out[r], ref, jnp.float32)
        for g, want, n in zip(grads, ref_grads, ("dq", "dk", "dv"), strict=True):
            assert_close(f"{n} {r}", g[r], want, jnp.float32)
    # one route for all mapped rows: the fast branch only where the flag holds in every one
    route = jax.vmap(lambda f: jax.lax.cond(_runtime_args.everywhere(f), lambda: 1, lambda: 0))
    assert route(jnp.asarray([True, False, True])).tolist() == [0, 0, 0]
    assert route(jnp.asarray([True, True, True])).tolist() == [1, 1, 1]
