"""The cuda kernels with runtime masks (lengths, segment ids) on a real Hopper GPU: ``pytest -m gpu``.

Each case ANDs a band with a runtime mask -- packed documents (sorted ids, down to documents of
a few tokens, many to a tile), unsorted ids, rectangular ids with key blocks no query sees,
padding with fully padded rows and zero lengths, clipped lengths, all together with GQA -- and
checks the generated forward and backward against the float64 reference of the per-batch
dense mask: out, lse (-inf and out = 0 on rows that see nothing), dq, dk, dv (0 where nothing
is seen); the backward also on narrow windows the plan does not offer it for, and bit-identical
from run to run; and ``splat.attention(..., backend="cuda")`` end to end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_cases import RUNTIME_CASES as CASES
from cuda_cases import band_layout, other_key_orders
from reference import assert_close, runtime_ref
from runtime_masks import build_arguments, packed_ids, runtime_dense

from jax_bindings import _registry, _runtime

pytestmark = pytest.mark.gpu

if _registry.unavailable("cuda") is not None:
    pytest.skip(f"the cuda backend cannot run here: {_registry.unavailable('cuda')}", allow_module_level=True)

from jax_bindings._cuda import backend as cb  # noqa: E402
from jax_bindings._cuda import plan, runtime_tables  # noqa: E402


def _setup(case, dtype, seed=0):
    name, sq, skv, left, right, h, hk, b, make = case
    rng = np.random.default_rng(seed)
    rt_args = make(rng)
    layout = band_layout(sq, skv, left, right)
    dense = runtime_dense(layout.to_dense(), b, sq, skv, **rt_args)
    q, do = (jnp.asarray(rng.standard_normal((b, sq, h, 128)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, skv, hk, 128)), dtype) for _ in range(2))
    return layout, dense, _runtime.build(b, sq, skv, **build_arguments(rt_args)), (q, k, v, do)


def _run(layout, runtime, q, k, v, do, scale, variant=None):
    """``(out, lse, (dq, dk, dv))``: the cuda forward, then the generated backward (``variant``,
    by default the plan's for the band, offered or not)."""
    rt = runtime_tables.kind(runtime)
    variant = variant or plan.bwd_variant(layout, 128, jnp.dtype(q.dtype).name, rt)
    name, image = plan.compiled(variant)
    maps = plan.bwd_tensor_maps(q.shape, k.shape)

    @jax.jit
    def fn(q, k, v, do, runtime):
        out, lse = cb.attention_fwd(q, k, v, runtime, layout, scale)
        arrays = runtime_tables.bwd_arrays(runtime, variant.block_n)
        grads = cb.run_backward(name, image, variant.smem, maps, q, k, v, out, lse, do, scale, arrays,
                                ordered=variant.ordered)
        return out, lse, grads

    return fn(q, k, v, do, runtime)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_runtime_masks_match_the_float64_reference(case, dtype):
    layout, dense, runtime, (q, k, v, do) = _setup(case, dtype)
    scale = 128**-0.5
    out, lse, grads = _run(layout, runtime, q, k, v, do, scale)
    ref_out, ref_grads = runtime_ref(q, k, v, dense, scale, do)
    assert_close("out", out, ref_out, dtype)
    empty = ~dense.any(-1)  # [B, Sq]
    lse = np.asarray(lse).transpose(0, 2, 1)  # [B, Sq, H]
    assert np.all(np.isneginf(lse[empty])), "a row that sees nothing has lse -inf"
    assert np.all(np.isfinite(lse[~empty]))
    assert not np.asarray(out, np.float32)[empty].any(), "a row that sees nothing outputs 0"
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(gname, g, r, dtype, factor=4.0)
    unseen = ~dense.any(1)  # [B, Skv]
    assert not np.asarray(grads[0], np.float32)[empty].any()
    assert not np.asarray(grads[1], np.float32)[unseen].any()
    assert not np.asarray(grads[2], np.float32)[unseen].any()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_runtime_backward_in_the_other_key_orders_matches_the_float64_reference(case):
    """Every key order on every runtime case (the first adder from ``rt_leads``' first or last key
    block), in sections of one KV head's group."""
    layout, dense, runtime, (q, k, v, do) = _setup(case, jnp.bfloat16)
    _, ref_grads = runtime_ref(q, k, v, dense, 128**-0.5, do)
    planned = plan.bwd_variant(layout, 128, "bfloat16", runtime_tables.kind(runtime))
    for variant in other_key_orders(planned, q.shape, k.shape):
        _, _, grads = _run(layout, runtime, q, k, v, do, 128**-0.5, variant)
        for gname, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
            assert_close(f"{variant.key_order} {gname}", g, r, jnp.bfloat16, factor=4.0)
        assert not np.asarray(grads[0], np.float32)[~dense.any(-1)].any()


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=[CASES[0][0], CASES[4][0]])
def test_runtime_reruns_are_bit_identical(case):
    layout, _, runtime, arrays = _setup(case, jnp.bfloat16, seed=3)
    first = jax.tree.map(np.asarray, _run(layout, runtime, *arrays, 0.1))
    for _ in range(2):
        again = jax.tree.map(np.asarray, _run(layout, runtime, *arrays, 0.1))
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again),
                                                         strict=True))


def test_splat_attention_with_segment_ids_runs_here():
    import splat
    from splat import masks

    rng = np.random.default_rng(5)
    ids = jnp.asarray(packed_ids(rng, 2, 1000, 400))
    lens = jnp.array([1000, 640])
    q, k, v, do = (jnp.asarray(rng.standard_normal((2, 1000, 4, 128)), jnp.bfloat16) for _ in range(4))

    def attn(q, k, v, backend):
        return splat.attention(q, k, v, masks.causal(), segment_ids=ids, query_seq_lengths=lens,
                               backend=backend)

    got, vjp = jax.vjp(jax.jit(lambda a, b, c: attn(a, b, c, "cuda")), q, k, v)
    want, vjp_ref = jax.vjp(jax.jit(lambda a, b, c: attn(a, b, c, "triton")), q, k, v)
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() < 3e-2
    for g, r in zip(vjp(do), vjp_ref(do), strict=True):
        assert np.abs(np.asarray(g, np.float32) - np.asarray(r, np.float32)).max() < 6e-2
