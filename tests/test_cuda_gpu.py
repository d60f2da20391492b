"""The CUDA backend (generated CUDA C++, sm_90a) on a real Hopper GPU: ``pytest -m gpu``.

Skipped where the backend cannot run (no GPU, not compute capability 9.0, no compiler). Every
variant the backend generates -- dense (176-key tiles), causal top-left and bottom-right,
causal windows, sliding windows, bands off the diagonal with fully masked rows, bands measured
from blocks of rows (block-local) -- in bfloat16
and float16, the forward also in its queue schedule (and every schedule bit-identical, on few
CTAs too), GQA, lengths that are not tile multiples, ``q_len != kv_len``, against the float64
dense reference, forward and the generated backward (fully masked rows and unseen keys get
zero gradients); bands in phases (dilated, strided) folded into heads, forward and backward;
reruns bit-identical; the calls it must refuse, refused by name; training with
``backend="cuda"`` on dense, causal and causal-window masks; and, under ``backend="auto"``, a
narrow window's forward paired with another backend's backward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_cases import CASES, other_key_orders
from cuda_cases import band_layout as _band_layout
from reference import assert_close, attention_dense, attention_grads_ref, attention_ref

import acsr
import jax_bindings
from jax_bindings import _dispatch, _registry
from splat import masks

pytestmark = pytest.mark.gpu

if _registry.unavailable("cuda") is not None:
    pytest.skip(f"the cuda backend cannot run here: {_registry.unavailable('cuda')}", allow_module_level=True)

from jax_bindings._cuda import backend as cb  # noqa: E402
from jax_bindings._cuda import bwd_source, plan, source  # noqa: E402


def _inputs(seed, sq, skv, h, hk, dtype, d=128, b=2):
    rng = np.random.default_rng(seed)
    q, do = (jnp.asarray(rng.standard_normal((b, sq, h, d)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, skv, hk, d)), dtype) for _ in range(2))
    return q, k, v, do


def _forward(layout, scale, schedule=None, ctas=None, section=0, q_stages=None, o_store=None):
    """The jitted forward ``(q, k, v) -> (out, lse)``: the backend's, or its variant in another
    ``schedule`` launched on one CTA per SM or at most ``ctas``; the queue's heads
    interleaved in sections of ``section`` (batch, head)s (0: one after another); ``q_stages``
    Q tiles and the epilogue's ``o_store`` (None: the plan's; see ``plan.rescheduled``)."""
    if schedule is None:
        return jax.jit(lambda q, k, v: cb.attention_fwd(q, k, v, None, layout, scale))

    def fn(q, k, v):
        variant = plan.rescheduled(plan.fwd_variant(layout, q.shape[-1], jnp.dtype(q.dtype).name), schedule,
                                   source.section_bytes_of(section, k.shape[1]), q_stages, o_store)
        name, image = plan.compiled(variant)
        grid = plan.grid(q.shape, schedule, ctas or cb._sm_count())
        maps = plan.tensor_maps(variant.block_n, q.shape, k.shape, v.shape)
        return cb.run_forward(name, image, grid, variant.smem, maps, q, k, v, scale)

    return jax.jit(fn)


@pytest.mark.parametrize("schedule", [None, "queue"], ids=["planned", "queue"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forward_matches_the_float64_reference(case, dtype, schedule):
    sq, skv, h, hk = case.q_len, case.kv_len, case.heads, case.kv_heads
    layout = case.layout()
    assert plan.fwd_variant(layout, 128, jnp.dtype(dtype).name).band is not None
    q, k, v, _ = _inputs(sq + skv, sq, skv, h, hk, dtype)
    scale = 128**-0.5
    out, lse = _forward(layout, scale, schedule, ctas=3)(q, k, v)  # the queue: 3 CTAs, many tiles each
    ref_out, ref_lse = attention_ref(q, k, v, layout, scale)
    same = attention_dense(q, k, v, layout, scale)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (2, h, sq)
    assert_close("out", out, ref_out, dtype, same)
    lse = np.asarray(lse, np.float64)
    empty = ~layout.to_dense().any(1)
    assert np.all(np.isneginf(lse[:, :, empty])), "a fully masked row must have lse -inf"
    assert np.all(np.asarray(out, np.float32)[:, empty] == 0), "a fully masked row must output 0"
    assert np.abs(lse[:, :, ~empty] - ref_lse[:, :, ~empty]).max() < 2e-2


@pytest.mark.parametrize("schedule", [None, "queue"], ids=["planned", "queue"])
def test_reruns_are_bit_identical(schedule):
    layout = _band_layout(1000, 1000, 300, 0)
    q, k, v, _ = _inputs(7, 1000, 1000, 4, 2, jnp.bfloat16)
    f = _forward(layout, 0.1, schedule, ctas=5)
    first = [np.asarray(x) for x in f(q, k, v)]
    for _ in range(3):
        again = [np.asarray(x) for x in f(q, k, v)]
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("ctas", [None, 3], ids=["per-sm", "3-ctas"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forward_schedules_are_bit_identical(case, ctas):
    """Every schedule computes a work tile alike, whichever CTA takes it: on 3 CTAs each one takes
    many tiles (the queue's two ticket slots reused, row blocks that see no key among them); the
    queue also in sections of 3 (batch, head)s, the last one short; one Q tile and two; out
    stored by TMA (the plan's) and from registers; all against the strided schedule on one CTA
    per SM with one Q tile and register stores."""
    sq, skv, h, hk = case.q_len, case.kv_len, case.heads, case.kv_heads
    layout = case.layout()
    q, k, v, _ = _inputs(sq + skv, sq, skv, h, hk, jnp.bfloat16)
    scale = 128**-0.5
    want = [np.asarray(x) for x in _forward(layout, scale, "strided", None, 0, 1, "registers")(q, k, v)]
    assert (2 * h) % 3, "the last section must be short"
    for schedule, section, q_stages, o_store in (("strided", 0, 1, None), ("strided", 0, 2, None),
                                                 ("queue", 0, 1, None), ("queue", 0, 2, None),
                                                 ("queue", 3, 2, None), ("queue", 0, 2, "registers")):
        run = _forward(layout, scale, schedule, ctas, section, q_stages, o_store)
        got = [np.asarray(x) for x in run(q, k, v)]
        same = all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        assert same, (schedule, section, q_stages, o_store)


@pytest.mark.parametrize(
    "args, why",
    [
        (dict(d=80), "head dim"),
        (dict(dtype=jnp.float32), "dtypes"),
        (dict(layout=acsr.from_dense(np.eye(64, dtype=bool) | (np.arange(64)[None] % 8 == 0))), "one-band"),
    ],
)
def test_refusals_name_why(args, why):
    d, dtype = args.get("d", 128), args.get("dtype", jnp.bfloat16)
    layout = args.get("layout", _band_layout(64, 64, None, 0))
    q, k, v, do = _inputs(0, 64, 64, 2, 2, dtype, d=d)
    with pytest.raises(NotImplementedError, match=why):
        cb.attention_fwd(q, k, v, None, layout, 0.1)


def test_the_narrow_windows_backward_and_other_heads_backward_are_refused():
    q, k, v, do = _inputs(0, 64, 64, 2, 2, jnp.bfloat16)
    odd = _inputs(0, 64, 64, 2, 2, jnp.bfloat16, d=80)
    with pytest.raises(NotImplementedError, match="head dims"):
        cb.attention_bwd(*odd[:3], None, odd[0], None, odd[3], _band_layout(64, 64, None, 0), 0.1)
    with pytest.raises(NotImplementedError, match="narrower windows"):
        cb.attention_bwd(q, k, v, None, q, None, do, _band_layout(64, 64, 16, 0), 0.1)


def _assert_cuda_trains(layout, sq, skv):
    """``backend="cuda"`` (no fallback) on ``layout``: forward and gradients, both from the generated
    kernels, match the float64 reference."""
    q, k, v, do = _inputs(sq + skv, sq, skv, 4, 2, jnp.bfloat16)
    scale = 128**-0.5
    fn = jax.jit(lambda a, b, c: _dispatch.attention(a, b, c, layout, scale, "cuda"))
    out, vjp = jax.vjp(fn, q, k, v)
    assert_close("out", out, attention_ref(q, k, v, layout, scale)[0], jnp.bfloat16)
    for name, g, r in zip(("dq", "dk", "dv"), vjp(do), attention_grads_ref(q, k, v, layout, scale, do),
                          strict=True):
        assert_close(name, g, r, jnp.bfloat16)


@pytest.mark.parametrize("sq, skv, left, right", [(1000, 1000, None, None), (777, 1300, None, 1300 - 777),
                                                  (1300, 777, None, -100), (1500, 1500, 1023, 0)],
                         ids=["dense", "causal-bottom-right", "causal-rows-see-nothing", "causal-window"])
def test_backend_cuda_trains_by_itself(sq, skv, left, right):
    _assert_cuda_trains(_band_layout(sq, skv, left, right), sq, skv)


@pytest.mark.parametrize("mask, sq", [(masks.block_local(256, 1), 1100), (masks.dilated_window(520, 2), 1200),
                                      (masks.strided(4), 1000)], ids=repr)
def test_backend_cuda_trains_the_folded_forms_by_itself(mask, sq):
    """Bands from blocks of rows and bands in phases (folded into heads)."""
    _assert_cuda_trains(mask.to_acsr(sq, sq), sq, sq)


PHASE_CASES = [  # (mask, q_len, kv_len, H, Hkv): bands in phases, run as bands folded into heads
    (masks.dilated_window(520, 2), 1200, 1200, 4, 2),  # (260, 260) over 600 rows: the backward offered
    (masks.strided(4), 1000, 1000, 6, 3),  # causal over 250 rows
    (masks.dilated_window(300, 3), 600, 900, 2, 1),  # (100, 100): the backward goes elsewhere
    (masks.dilated_window(64, 2), 256, 256, 2, 2),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("mask, sq, skv, h, hk", PHASE_CASES,
                         ids=lambda x: repr(x) if isinstance(x, masks.Mask) else "")
def test_bands_in_phases_match_the_float64_reference(mask, sq, skv, h, hk, dtype):
    layout = mask.to_acsr(sq, skv)
    assert plan.band_form(layout, 128, jnp.dtype(dtype).name).phases > 1
    q, k, v, do = _inputs(sq + 3 * skv, sq, skv, h, hk, dtype)
    scale = 128**-0.5
    out, lse = jax.jit(lambda a, b, c: cb.attention_fwd(a, b, c, None, layout, scale))(q, k, v)
    ref_out, ref_lse = attention_ref(q, k, v, layout, scale)
    assert out.shape == q.shape and lse.shape == (2, h, sq)
    assert_close("out", out, ref_out, dtype, attention_dense(q, k, v, layout, scale))
    assert np.abs(np.asarray(lse, np.float64) - ref_lse).max() < 2e-2
    try:
        plan.offered_bwd_variant(layout, 128, jnp.dtype(dtype).name)
    except NotImplementedError:
        return
    grads = jax.jit(lambda a, b, c, o, s, d: cb.attention_bwd(a, b, c, None, o, s, d, layout, scale))(
        q, k, v, out, lse, do)
    for gname, g, r, x in zip(("dq", "dk", "dv"), grads, attention_grads_ref(q, k, v, layout, scale, do),
                              (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, gname
        assert_close(gname, g, r, dtype)


def _grads(q, k, v, do, layout, scale, variant=None):
    """``(dq, dk, dv)`` of the cuda forward then the generated backward (``variant``: the plan's)."""
    variant = variant or plan.bwd_variant(layout, q.shape[-1], jnp.dtype(q.dtype).name)
    name, image = plan.compiled(variant)
    maps = plan.bwd_tensor_maps(q.shape, k.shape)

    def fn(q, k, v, do):
        out, lse = cb.attention_fwd(q, k, v, None, layout, scale)
        return cb.run_backward(name, image, variant.smem, maps, q, k, v, out, lse, do, scale,
                               ordered=variant.ordered)

    return jax.jit(fn)(q, k, v, do)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_backward_matches_the_float64_reference(case, dtype):
    sq, skv, h, hk = case.q_len, case.kv_len, case.heads, case.kv_heads
    layout = case.layout()
    q, k, v, do = _inputs(sq * skv, sq, skv, h, hk, dtype)
    scale = 128**-0.5
    grads = _grads(q, k, v, do, layout, scale)
    dense = layout.to_dense()
    for gname, g, r, x in zip(("dq", "dk", "dv"), grads, attention_grads_ref(q, k, v, layout, scale, do),
                              (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, gname
        assert_close(gname, g, r, dtype)
    blind = ~dense.any(1)  # rows that see no key: dq 0; keys no row sees: dk, dv 0
    unseen = ~dense.any(0)
    assert np.all(np.asarray(grads[0], np.float32)[:, blind] == 0)
    assert np.all(np.asarray(grads[1], np.float32)[:, unseen] == 0)
    assert np.all(np.asarray(grads[2], np.float32)[:, unseen] == 0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_backward_in_the_other_key_orders_matches_the_float64_reference(case):
    """The key orders the planner did not pick, on every band (so every order runs on each), in
    sections of one KV head's group (first-first at the end then takes both orders)."""
    sq, skv, h, hk = case.q_len, case.kv_len, case.heads, case.kv_heads
    layout = case.layout()
    q, k, v, do = _inputs(sq * skv + 1, sq, skv, h, hk, jnp.bfloat16)
    ref = attention_grads_ref(q, k, v, layout, 128**-0.5, do)
    planned = plan.bwd_variant(layout, 128, "bfloat16")
    for variant in other_key_orders(planned, q.shape, k.shape):
        grads = _grads(q, k, v, do, layout, 128**-0.5, variant)
        for gname, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
            assert_close(f"{variant.key_order} {gname}", g, r, jnp.bfloat16)
        assert np.all(np.asarray(grads[0], np.float32)[:, ~layout.to_dense().any(1)] == 0)


def test_backward_reruns_are_bit_identical():
    """dQ is summed over key blocks through global memory, in a fixed order by default."""
    layout = _band_layout(1500, 1500, None, 0)
    q, k, v, do = _inputs(11, 1500, 1500, 4, 2, jnp.bfloat16)
    first = [np.asarray(x) for x in _grads(q, k, v, do, layout, 0.1)]
    for _ in range(3):
        again = [np.asarray(x) for x in _grads(q, k, v, do, layout, 0.1)]
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_backward_sections_do_not_change_the_gradients():
    """Whatever the heads' sections (one head at a time, two, all), each query block's dQ parts are
    added in the key blocks' order: in either key order the gradients are bit-identical. (Not with
    ``first_first_at_end``, whose last section's heads take the other order.) GQA: a section
    counts KV heads."""
    layout = _band_layout(1100, 1100, None, 0)
    q, k, v, do = _inputs(13, 1100, 1100, 6, 3, jnp.bfloat16)
    group_bytes = bwd_source.section_bytes_of(1, 2, 1100)  # a KV head's two query heads' Q and dO
    for order in ("last_first", "first_first"):
        planned = dataclasses.replace(plan.bwd_variant(layout, 128, "bfloat16"), key_order=order)
        want = [np.asarray(x) for x in _grads(q, k, v, do, layout, 0.1, planned)]
        for section in (0, 2 * group_bytes, 1 << 30):
            variant = dataclasses.replace(planned, section_bytes=section)
            got = [np.asarray(x) for x in _grads(q, k, v, do, layout, 0.1, variant)]
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), (order, section)


def test_backward_in_arrival_order_is_close():
    """``ordered=False`` (dQ added as it comes: not bit-reproducible) gives the same gradients."""
    layout = _band_layout(700, 700, 300, 0)
    q, k, v, do = _inputs(12, 700, 700, 4, 2, jnp.bfloat16)
    variant = dataclasses.replace(plan.bwd_variant(layout, 128, "bfloat16"), ordered=False)
    got = _grads(q, k, v, do, layout, 0.1, variant)
    ref = attention_grads_ref(q, k, v, layout, 0.1, do)
    for gname, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert_close(gname, g, r, jnp.bfloat16)


def assert_auto_forward_here_and_exact(layout, q, k, v, do, scale):
    """Under ``backend="auto"`` the forward of ``layout`` runs on the cuda backend, and the output
    and the gradients (from whichever backend takes the backward) match the float64 reference."""
    assert jax_bindings.selected_backend("attention_with_lse", q, k, v, layout, scale) == "cuda"
    out, vjp = jax.vjp(jax.jit(lambda a, b, c: _dispatch.attention(a, b, c, layout, scale, "auto")), q, k, v)
    assert_close("out", out, attention_ref(q, k, v, layout, scale)[0], q.dtype)
    for name, g, r in zip(("dq", "dk", "dv"), vjp(do), attention_grads_ref(q, k, v, layout, scale, do),
                          strict=True):
        assert_close(name, g, r, q.dtype)


def test_auto_runs_the_forward_here_and_the_backward_elsewhere():
    """A sliding window (no cuDNN) goes to the cuda forward; its gradients come from the next backend."""
    q, k, v, do = _inputs(3, 400, 400, 4, 2, jnp.bfloat16)
    assert_auto_forward_here_and_exact(masks.sliding_window(64, 64).to_acsr(400), q, k, v, do, 128**-0.5)


def test_the_public_api_reaches_the_kernel():
    import splat

    q, k, v, _ = _inputs(5, 512, 512, 4, 4, jnp.bfloat16)
    mask = masks.sliding_window(127, 0)
    got = splat.attention(q, k, v, mask, backend="cuda")
    ref = splat.attention(q, k, v, mask, backend="triton")
    assert np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32)).max() < 3e-2
