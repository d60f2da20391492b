"""The cuda forward at every head dim it takes, and its soft cap, on a real Hopper GPU: ``pytest -m gpu``.

Head dims 64, 96 (tiles of 128 columns, the last 32 zeros), 192 and 256 on the planned variants of
:mod:`cuda_cases`' bands (dense's wide tiles, causal's queue, the windows' strided schedule, a
band with fully masked rows, block-local), a grid layout, runtime lengths and segment ids, and a
chunk at an offset (shifted); the soft cap at every head dim, 128 included; against the float64
reference: out, lse (-inf and out = 0 on rows that see nothing), reruns bit-identical. The
backward at every head dim it takes (256 on the wide kernel), with the cap and the runtime masks,
gradients against float64 and reruns bit-identical. Training under ``backend="auto"``: this
forward, and the next backend's backward where the cuda backward does not take the head dim or
is not offered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import prefill_cases as pc
import pytest
from cuda_cases import CASES, GRID_CASES, RUNTIME_CASES, band_layout
from reference import assert_close, attention_dense, attention_grads_ref, attention_ref, runtime_ref
from runtime_masks import build_arguments, runtime_dense

from jax_bindings import _dispatch, _registry, _runtime, _tuning
from splat import masks

pytestmark = pytest.mark.gpu

if _registry.unavailable("cuda") is not None:
    pytest.skip(f"the cuda backend cannot run here: {_registry.unavailable('cuda')}", allow_module_level=True)

from jax_bindings._cuda import backend as cb  # noqa: E402
from jax_bindings._cuda import plan, runtime_tables, tile_shapes  # noqa: E402

OTHER_DIMS = [d for d in tile_shapes.HEAD_DIMS if d != 128]
BAND_NAMES = ("dense", "causal", "causal_window", "sliding_window", "off_diagonal")
BAND_CASES = [c for c in CASES if c.name in BAND_NAMES]
BAND_CASES += [c for c in CASES if c.block > 1][:1]


def _inputs(seed, b, sq, skv, h, hk, d, dtype):
    rng = np.random.default_rng(seed)
    q, do = (jnp.asarray(rng.standard_normal((b, sq, h, d)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, skv, hk, d)), dtype) for _ in range(2))
    return q, k, v, do


def _check_empty_rows(out, lse, empty_rows):
    """``empty_rows [Sq]`` or ``[B, Sq]``: rows that see nothing have out 0 and lse -inf."""
    out, lse = np.asarray(out, np.float32), np.asarray(lse)  # [B, Sq, H, D], [B, H, Sq]
    empty = np.broadcast_to(empty_rows, out.shape[:2])
    assert np.all(np.isneginf(lse.transpose(0, 2, 1)[empty])), "a row that sees nothing has lse -inf"
    assert not out[empty].any(), "a row that sees nothing outputs 0"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("head_dim", OTHER_DIMS)
@pytest.mark.parametrize("case", BAND_CASES, ids=[c.name for c in BAND_CASES])
def test_the_planned_forward_matches_the_float64_reference(case, head_dim, dtype):
    if dtype == jnp.float16 and case.name not in ("causal", "sliding_window"):
        pytest.skip("float16 on two bands a head dim")
    layout = case.layout()
    variant = plan.fwd_variant(layout, head_dim, jnp.dtype(dtype).name)
    assert variant.head_dim == head_dim and variant.smem <= 232448
    q, k, v, _ = _inputs(head_dim, 2, case.q_len, case.kv_len, case.heads, case.kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    fwd = jax.jit(lambda q, k, v: cb.attention_fwd(q, k, v, None, layout, scale))
    out, lse = fwd(q, k, v)
    ref_out, ref_lse = attention_ref(q, k, v, layout, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close("out", out, ref_out, dtype, attention_dense(q, k, v, layout, scale))
    empty = ~layout.to_dense().any(1)
    _check_empty_rows(out, lse, empty)
    seen = np.asarray(lse, np.float64)[:, :, ~empty]
    assert np.abs(seen - ref_lse[:, :, ~empty]).max() < 2e-2
    again = fwd(q, k, v)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip((out, lse), again, strict=True))


@pytest.mark.parametrize("head_dim", tile_shapes.HEAD_DIMS)
@pytest.mark.parametrize("name", ["dense", "causal_window", "sliding_window"])
def test_the_soft_cap_matches_the_float64_reference(name, head_dim):
    case = next(c for c in CASES if c.name == name)
    layout = case.layout()
    q, k, v, do = _inputs(7, 2, case.q_len, case.kv_len, case.heads, case.kv_heads, head_dim, jnp.bfloat16)
    q = q * 3  # scores large enough that the cap bends them
    scale, cap = head_dim**-0.5, 5.0
    out, lse = jax.jit(lambda q, k, v: cb.attention_fwd(q, k, v, None, layout, scale, cap))(q, k, v)
    dense = np.broadcast_to(layout.to_dense(), (2, case.q_len, case.kv_len))
    ref, _ = runtime_ref(q, k, v, dense, scale, do, soft_cap=cap)
    assert_close("out", out, ref, jnp.bfloat16)
    uncapped, _ = runtime_ref(q, k, v, dense, scale, do)
    assert np.abs(ref - uncapped).max() > 0.1, "the case must exercise the cap"
    _check_empty_rows(out, lse, ~layout.to_dense().any(1))


@pytest.mark.parametrize("head_dim", OTHER_DIMS)
@pytest.mark.parametrize("case", [c for c in RUNTIME_CASES if c[0] in ("document_causal", "padding_causal",
                                                                        "everything_window")],
                         ids=lambda c: c[0])
def test_runtime_masks_match_the_float64_reference(case, head_dim):
    name, sq, skv, left, right, h, hk, b, make = case
    rng = np.random.default_rng(3)
    rt_args = make(rng)
    layout = band_layout(sq, skv, left, right)
    dense = runtime_dense(layout.to_dense(), b, sq, skv, **rt_args)
    runtime = _runtime.build(b, sq, skv, **build_arguments(rt_args))
    q, k, v, do = _inputs(5, b, sq, skv, h, hk, head_dim, jnp.bfloat16)
    scale = head_dim**-0.5
    out, lse = jax.jit(lambda q, k, v, rt: cb.attention_fwd(q, k, v, rt, layout, scale))(q, k, v, runtime)
    ref, ref_grads = runtime_ref(q, k, v, dense, scale, do)
    assert_close("out", out, ref, jnp.bfloat16)
    _check_empty_rows(out, lse, ~dense.any(-1))
    if head_dim not in tile_shapes.BWD_HEAD_DIMS:
        return
    # the planned backward (offered or not: these bands are narrow) with the runtime mask
    variant = plan.bwd_variant(layout, head_dim, "bfloat16", runtime_tables.kind(runtime))
    name, image = plan.compiled(variant)
    maps = plan.bwd_tensor_maps(q.shape, k.shape)

    @jax.jit
    def grads(q, k, v, out, lse, do, runtime):
        arrays = runtime_tables.bwd_arrays(runtime, variant.block_n)
        return cb.run_backward(name, image, variant.smem, maps, q, k, v, out, lse, do, scale, arrays,
                               ordered=variant.ordered, threads=variant.threads)

    got = grads(q, k, v, out, lse, do, runtime)
    for gname, g, r in zip(("dq", "dk", "dv"), got, ref_grads, strict=True):
        assert_close(gname, g, r, jnp.bfloat16, factor=4.0)
    assert not np.asarray(got[0], np.float32)[~dense.any(-1)].any(), "a row that sees nothing gets dq 0"
    again = grads(q, k, v, out, lse, do, runtime)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, again, strict=True))


@pytest.mark.parametrize("head_dim", OTHER_DIMS)
def test_a_chunk_at_an_offset_matches_the_float64_reference(head_dim):
    case = pc.CASES[0]
    x = pc.inputs(case, 1, head_dim=head_dim)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (x.q, x.k, x.v))
    kwargs = {pc.BUILD_NAMES[n]: jnp.asarray(a) for n, a in x.runtime.items()}
    runtime = _runtime.build(len(x.offsets), pc.SQ, pc.L, q_offset=jnp.asarray(x.offsets), layout_rows=pc.L,
                             **kwargs)
    layout = pc.MASKS[case[0]].to_acsr(pc.L)
    scale = head_dim**-0.5
    out, lse = jax.jit(lambda q, k, v, rt: cb.attention_fwd(q, k, v, rt, layout, scale))(q, k, v, runtime)
    ref, _ = runtime_ref(q, k, v, x.dense, scale, np.zeros(q.shape))
    assert_close("out", out, ref, jnp.bfloat16)
    _check_empty_rows(out, lse, ~x.dense.any(-1))


@pytest.mark.parametrize("head_dim", OTHER_DIMS)
def test_a_grid_layout_runs_where_its_tile_fits_and_is_refused_by_name_elsewhere(head_dim):
    grid, kernel, kw, h, hk = GRID_CASES[0]
    layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
    s = int(np.prod(grid))
    q, k, v, _ = _inputs(11, 2, s, s, h, hk, head_dim, jnp.bfloat16)
    scale = head_dim**-0.5
    try:
        variant = plan.grid_fwd_variant(layout, head_dim, "bfloat16")
    except NotImplementedError as e:
        assert "shared memory" in str(e)
        with pytest.raises(NotImplementedError, match="shared memory"):
            cb.attention_fwd(q, k, v, None, layout, scale)
        return
    assert variant.head_dim == head_dim
    out, lse = jax.jit(lambda q, k, v: cb.attention_fwd(q, k, v, None, layout, scale))(q, k, v)
    assert_close("out", out, attention_ref(q, k, v, layout, scale)[0], jnp.bfloat16)


@pytest.mark.parametrize("head_dim, soft_cap", [(192, None), (64, 20.0), (256, 20.0)])
def test_auto_trains_with_this_forward_and_another_backward(head_dim, soft_cap, monkeypatch):
    """Where the cuda backward is not offered (a window narrower than it was measured faster on),
    ``auto`` pairs this forward with the next backend's backward (the
    backends in the registry's order: the tuning store's ranking aside)."""
    monkeypatch.setattr(_tuning, "rank_backends", lambda family, q_len, d, dtype, names, **kw: list(names))
    layout = masks.sliding_window(200, 200).to_acsr(600)
    q, k, v, do = _inputs(2, 2, 600, 600, 4, 2, head_dim, jnp.bfloat16)
    scale = head_dim**-0.5
    fn = jax.jit(lambda a, b, c: _dispatch.attention(a, b, c, layout, scale, "auto", soft_cap=soft_cap))
    assert _dispatch.selected_backend("attention", q, k, v, layout, scale, soft_cap=soft_cap) == "cuda"
    with pytest.raises(NotImplementedError, match="narrower windows"):
        plan.offered_bwd_variant(layout, head_dim, "bfloat16", soft_cap=soft_cap)
    out, vjp = jax.vjp(fn, q, k, v)
    dense = np.broadcast_to(layout.to_dense(), (2, 600, 600))
    ref, ref_grads = runtime_ref(q, k, v, dense, scale, do, soft_cap=soft_cap)
    assert_close("out", out, ref, jnp.bfloat16)
    for gname, g, r in zip(("dq", "dk", "dv"), vjp(do), ref_grads, strict=True):
        assert_close(gname, g, r, jnp.bfloat16, factor=4.0)
    if soft_cap is None:
        for gname, g, r in zip(("dq", "dk", "dv"), vjp(do),
                               attention_grads_ref(q, k, v, layout, scale, do), strict=True):
            assert_close(gname, g, r, jnp.bfloat16, factor=4.0)


@pytest.mark.parametrize("head_dim, soft_cap", [(64, None), (96, None), (192, None), (256, None), (64, 5.0),
                                                 (128, 5.0), (96, 5.0), (192, 5.0), (256, 5.0)])
@pytest.mark.parametrize("mask, sq, hk", [(masks.causal(), 385, 2), (masks.sliding_window(300, 300), 700, 4)],
                         ids=["causal", "window"])
def test_cuda_trains_by_itself(mask, sq, hk, head_dim, soft_cap):
    """``backend="cuda"`` (no fallback): the forward and the generated backward at the head dim,
    with the cap's derivative in dS."""
    layout = mask.to_acsr(sq)
    q, k, v, do = _inputs(head_dim, 2, sq, sq, 4, hk, head_dim, jnp.bfloat16)
    q = q * (2 if soft_cap else 1)
    scale = head_dim**-0.5
    plan.offered_bwd_variant(layout, head_dim, "bfloat16", soft_cap=soft_cap)  # offered, not refused
    fn = jax.jit(lambda a, b, c: _dispatch.attention(a, b, c, layout, scale, "cuda", soft_cap=soft_cap))
    out, vjp = jax.vjp(fn, q, k, v)
    dense = np.broadcast_to(layout.to_dense(), (2, sq, sq))
    ref, ref_grads = runtime_ref(q, k, v, dense, scale, do, soft_cap=soft_cap)
    assert_close("out", out, ref, jnp.bfloat16)
    grads = vjp(do)
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.shape == r.shape
        assert_close(gname, g, r, jnp.bfloat16, factor=4.0)
    again = jax.vjp(fn, q, k, v)[1](do)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(grads, again, strict=True))
