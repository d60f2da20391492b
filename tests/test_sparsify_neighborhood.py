"""splat.sparsify on neighborhood attention written on flat token indices with ``//`` and ``%``.

The symbolic pass does not follow ``//`` and ``%`` (grid coordinates of a flat index), so such
a mask becomes an exact predicate evaluated in row chunks; the analyzer then finds the grid
product in its rows (``acsr._grid_detect``) and gives it the layout ``masks.neighborhood``
builds. Outputs are checked against float64 dense attention with the mask computed here in
numpy, independently of both.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, attention_ref

import splat
from splat import masks

B, HEADS, D = 2, 2, 8


def _qkv(rng, size, heads=HEADS):
    return [jnp.asarray(rng.standard_normal((B, size, heads, D)), jnp.float32) for _ in range(3)]


def natten_mask_jnp(grid, k, style: str = "div_mod"):
    """NATTEN windows (shifted inside at the borders) on flat token indices, as models write them:
    ``//`` and ``%`` of the flat index, ``jnp.unravel_index``, or a ``[rows, cols, rows, cols]``
    product of per-axis masks reshaped to ``[S, S]``."""
    rows, cols = grid
    i = jnp.arange(rows * cols)
    if style == "reshape":
        r, c = jnp.arange(rows), jnp.arange(cols)
        r0, c0 = jnp.clip(r - k[0] // 2, 0, rows - k[0]), jnp.clip(c - k[1] // 2, 0, cols - k[1])
        in_r = (r[None, :] >= r0[:, None]) & (r[None, :] < r0[:, None] + k[0])
        in_c = (c[None, :] >= c0[:, None]) & (c[None, :] < c0[:, None] + k[1])
        return (in_r[:, None, :, None] & in_c[None, :, None, :]).reshape(rows * cols, rows * cols)
    if style == "unravel":
        (qr, qc), (kr, kc) = jnp.unravel_index(i[:, None], grid), jnp.unravel_index(i[None, :], grid)
    else:
        qr, qc = i[:, None] // cols, i[:, None] % cols
        kr, kc = i[None, :] // cols, i[None, :] % cols
    r0 = jnp.clip(qr - k[0] // 2, 0, rows - k[0])
    c0 = jnp.clip(qc - k[1] // 2, 0, cols - k[1])
    return (kr >= r0) & (kr < r0 + k[0]) & (kc >= c0) & (kc < c0 + k[1])


def reference_natten(grid, k) -> np.ndarray:
    """The same mask from grid coordinates, in numpy loops."""
    rows, cols = grid
    out = np.zeros((rows * cols,) * 2, bool)
    for qr in range(rows):
        for qc in range(cols):
            r0, c0 = min(max(qr - k[0] // 2, 0), rows - k[0]), min(max(qc - k[1] // 2, 0), cols - k[1])
            for kr in range(r0, r0 + k[0]):
                out[qr * cols + qc, kr * cols + c0 : kr * cols + c0 + k[1]] = True
    return out


def _run(fn, q, k, v):
    sf = splat.sparsify(fn, backend="jax")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left dense, nothing to warn about
        out = sf(q, k, v)
    (found,) = sf.inspect(q, k, v)
    assert sf.problems(q, k, v) == []
    return out, found, splat.analyze(found.mask, found.q_len, found.kv_len)


@pytest.mark.parametrize(
    ("grid", "kernel", "style"),
    [
        ((6, 7), (5, 3), "div_mod"),
        ((8, 8), (7, 5), "div_mod"),
        ((5, 9), (5, 4), "unravel"),
        ((7, 6), (6, 3), "reshape"),
    ],
)
def test_natten_mask_on_flat_indices_gets_the_neighborhood_layout(rng, grid, kernel, style):
    size = grid[0] * grid[1]
    q, k, v = _qkv(rng, size)

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=natten_mask_jnp(grid, kernel, style)[None, None])

    out, found, layout = _run(attn, q, k, v)
    assert layout == masks.neighborhood(grid, kernel).to_acsr()
    assert layout.grid is not None and layout.grid.grid == grid
    assert f"grid product {grid[0]}x{grid[1]}" in splat.report(found.mask, size).family
    ref, _ = attention_ref(q, k, v, reference_natten(grid, kernel), D**-0.5)
    assert_close("out", out, ref, jnp.float32)


def test_clipped_window_with_abs_is_a_grid(rng):
    # |row - row'| <= 2 and |col - col'| <= 1: windows cut (not shifted) at the borders
    rows, cols = 7, 6
    size = rows * cols
    q, k, v = _qkv(rng, size)
    scale = 0.2

    def attn(q, k, v):
        i = jnp.arange(size)
        near = (jnp.abs(i[:, None] // cols - i[None, :] // cols) <= 2) & (
            jnp.abs(i[:, None] % cols - i[None, :] % cols) <= 1
        )
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        s = jnp.where(near[None, None], s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    out, found, layout = _run(attn, q, k, v)
    r, c = np.divmod(np.arange(size), cols)
    want = (np.abs(r[:, None] - r[None, :]) <= 2) & (np.abs(c[:, None] - c[None, :]) <= 1)
    assert layout.grid is not None and layout.grid.grid == (rows, cols)
    np.testing.assert_array_equal(layout.to_dense(), want)
    ref, _ = attention_ref(q, k, v, want, scale)
    assert_close("out", out, ref, jnp.float32)


def test_three_axes_and_gradients(rng):
    grid, kernel = (3, 4, 5), (3, 3, 2)
    size = int(np.prod(grid))
    q, k, v = _qkv(rng, size)

    def attn(q, k, v):
        i = jnp.arange(size)
        ok = True
        for a, (n, kk) in enumerate(zip(grid, kernel, strict=True)):
            step = int(np.prod(grid[a + 1 :]))
            xq, xk = i[:, None] // step % n, i[None, :] // step % n
            lo = jnp.clip(xq - kk // 2, 0, n - kk)
            ok = ok & (xk >= lo) & (xk < lo + kk)
        return jax.nn.dot_product_attention(q, k, v, mask=ok[None, None])

    out, found, layout = _run(attn, q, k, v)
    want = masks.neighborhood(grid, kernel).to_acsr()
    assert layout == want and layout.grid is not None
    ref, _ = attention_ref(q, k, v, want.to_dense(), D**-0.5)
    assert_close("out", out, ref, jnp.float32)
    sf = splat.sparsify(attn, backend="jax")
    w = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    got = jax.grad(lambda *a: (sf(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    dense = jax.grad(lambda *a: (attn(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, dense, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)


def test_neighborhood_with_register_tokens_is_exact_but_not_a_grid(rng):
    grid, kernel = (6, 7), (5, 3)
    size = 42
    q, k, v = _qkv(rng, size)

    def attn(q, k, v):
        i = jnp.arange(size)
        mask = natten_mask_jnp(grid, kernel) | (i[:, None] < 2) | (i[None, :] < 2)
        return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])

    out, found, layout = _run(attn, q, k, v)
    i = np.arange(size)
    want = reference_natten(grid, kernel) | (i[:, None] < 2) | (i[None, :] < 2)
    assert layout.grid is None  # a grid product with register tokens is not one: residual
    np.testing.assert_array_equal(layout.to_dense(), want)
    ref, _ = attention_ref(q, k, v, want, D**-0.5)
    assert_close("out", out, ref, jnp.float32)
