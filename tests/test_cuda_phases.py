"""Bands in phases folded into heads (``jax_bindings._cuda.phases``), on the CPU.

The cuda backend runs a dilated or strided mask as the band of its phases over ``S / d`` rows
and ``d`` times the heads. Here the float64 reference of the folded problem, unfolded, must be
the reference of the mask itself (GQA, ``q_len != kv_len``, fully masked rows), forward and
gradients, so that only the band kernel (tested on a GPU) remains.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from cuda_cases import band_layout
from reference import attention_grads_ref, attention_ref

import acsr
from jax_bindings._cuda import phases
from splat import masks


@pytest.mark.parametrize(
    "mask, sq, skv, h, hk",
    [
        (masks.dilated_window(12, 2), 40, 40, 4, 2),
        (masks.dilated_window(9, 3), 24, 36, 2, 1),
        (masks.strided(4), 32, 32, 6, 3),
        (masks.strided(3), 30, 18, 2, 2),  # rows past the keys' phases' end: bottom rows see fewer
    ],
    ids=repr,
)
def test_the_folded_band_is_the_mask(mask, sq, skv, h, hk):
    layout = mask.to_acsr(sq, skv)
    form = acsr.band_form(layout)
    d = form.phases
    assert d > 1 and form.block == 1
    rng = np.random.default_rng(sq * skv)
    # numpy float64 through the folds (they only reshape and transpose), so nothing is rounded
    q, do = (rng.standard_normal((2, sq, h, 16)) for _ in range(2))
    k, v = (rng.standard_normal((2, skv, hk, 16)) for _ in range(2))
    folded = band_layout(sq // d, skv // d, *form.band)
    fq, fk, fv, fdo = (phases.fold(x, d) for x in (q, k, v, do))
    assert fq.shape == (2, sq // d, d * h, 16) and fk.shape == (2, skv // d, d * hk, 16)
    out, lse = attention_ref(fq, fk, fv, folded, 0.3)
    want_out, want_lse = attention_ref(q, k, v, layout, 0.3)
    np.testing.assert_allclose(phases.unfold(out, d), want_out, rtol=0, atol=1e-12)
    got_lse = phases.unfold_rows(lse, d)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=0, atol=1e-12)
    grads = attention_grads_ref(fq, fk, fv, folded, 0.3, fdo)
    for got, want in zip(grads, attention_grads_ref(q, k, v, layout, 0.3, do), strict=True):
        np.testing.assert_allclose(phases.unfold(got, d), want, rtol=0, atol=1e-12)


def test_fold_rows_inverts_unfold_rows():
    x = jnp.arange(2 * 3 * 12).reshape(2, 3, 12)
    assert np.array_equal(phases.unfold_rows(phases.fold_rows(x, 4), 4), x)
    # row t * d + p of head h is row t of head p * H + h
    assert int(phases.fold_rows(x, 4)[1, 2 * 3 + 1, 2]) == int(x[1, 1, 2 * 4 + 2])
