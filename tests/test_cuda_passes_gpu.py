"""The passes around the CUDA backward (``jax_bindings._cuda.bwd_passes``) on a Hopper GPU: ``pytest -m gpu``.

delta against ``rowsum(dout * out)`` in float64 (0 on the padding rows) and lse2 against the
float32 ``lse * log2(e)`` bit for bit (+inf where lse is -inf and on the padding), and dq's rows
against ``bwd_source.dq_from_acc``, bit for bit, with rows that see no key zeroed over whatever
the buffer holds (NaN), at lengths that are not query-block multiples, B = 2, 3 heads, both
element types.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bindings import _registry

pytestmark = pytest.mark.gpu

if _registry.unavailable("cuda") is not None:
    pytest.skip(f"the cuda backend cannot run here: {_registry.unavailable('cuda')}", allow_module_level=True)

from jax_bindings._cuda import bwd_passes, bwd_source  # noqa: E402

B, H, D = 2, 3, bwd_source.D
DTYPES = [jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("sq", [1, 100, 128, 333])
def test_delta_is_the_rowsum_of_dout_times_out_and_lse2_the_lse_in_base_2(sq, dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(sq), 3)
    out, dout = (jax.random.normal(k, (B, sq, H, D), dtype) for k in (k1, k2))
    lse = np.asarray(jax.random.normal(k3, (B, H, sq), jnp.float32)) * 10
    lse[1, 2, sq // 2] = -np.inf  # a row that sees no key
    got, lse2 = (np.asarray(x) for x in jax.jit(bwd_passes.delta_lse2)(out, dout, lse))
    want = np.einsum("bshd,bshd->bhs", np.asarray(dout, np.float64), np.asarray(out, np.float64))
    pad = bwd_source.num_q_blocks(sq) * bwd_source.BM
    assert got.shape == lse2.shape == (B, H, pad) and got.dtype == lse2.dtype == np.float32
    np.testing.assert_allclose(got[..., :sq], want, rtol=1e-5, atol=1e-5)
    assert not got[..., sq:].any()
    want2 = np.where(np.isneginf(lse), np.inf, lse * np.float32(np.log2(np.e)))
    np.testing.assert_array_equal(lse2[..., :sq], want2)
    assert np.all(lse2[..., sq:] == np.inf)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("sq", [64, 100, 333])
def test_dq_rows_are_dq_from_acc_bit_for_bit(sq, dtype):
    rng = np.random.default_rng(sq)
    acc = rng.standard_normal(bwd_source.dq_acc_shape(B, H, sq)).astype(np.float32)
    acc[0, 1, 0] = np.nan  # a block no key block reached: its rows see no key
    nq = acc.shape[2]
    lse = rng.standard_normal((B, H, sq)).astype(np.float32)
    lse[0, 1, : min(sq, 64)] = -np.inf
    lse[1, 2, sq - 1] = -np.inf  # one row that sees nothing in a block that was written
    lse2 = np.full((B, H, nq * bwd_source.BM), np.inf, np.float32)
    lse2[..., :sq] = np.where(np.isneginf(lse), np.inf, lse * np.log2(np.e))
    scale = D**-0.5
    got = jax.jit(lambda a, l2: bwd_passes.dq_rows(a, l2, sq, scale, dtype))(acc, lse2)
    want = (bwd_source.dq_from_acc(jnp.asarray(acc), sq, jnp.asarray(lse)) * scale).astype(dtype)
    assert got.dtype == want.dtype and got.shape == (B, sq, H, D)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
