"""The fused Triton kernels with a runtime mask and a soft cap, run by Triton's CPU interpreter.

Every tile walk (fused, split, single; aligned and permuted rows; per-row arrays; the residual)
with per-row ranges from lengths, sorted segment ids (ranges exact) and unsorted ids (compared in
every tile), against the float64 reference with a per-batch mask.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from reference import runtime_ref
from test_triton_kernels import TILES, _close, _inputs, _layout

from jax_bindings import _runtime
from jax_bindings._triton import ops
from jax_bindings._triton.launch import run_numpy

B = 2


def _runtime_case(kind: str, sq: int, skv: int, rng):
    """``(RuntimeMask, dense [B, sq, skv])`` of one kind of runtime mask."""
    if kind == "lengths":
        qlen, kvlen = np.array([sq, sq - 9]), np.array([skv - 20, skv])
        rt = _runtime.build(
            B, sq, skv, query_seq_lengths=jnp.asarray(qlen), key_value_seq_lengths=jnp.asarray(kvlen)
        )
        m = (np.arange(sq)[None, :, None] < qlen[:, None, None]) & (
            np.arange(skv)[None, None, :] < kvlen[:, None, None]
        )
        return rt, m
    if kind == "sorted_ids":
        ids = np.sort(rng.integers(0, 5, size=(B, sq)), axis=1).astype(np.int32)
        kv_ids = ids if sq == skv else np.sort(rng.integers(0, 5, size=(B, skv)), axis=1).astype(np.int32)
    else:
        ids = rng.integers(0, 3, size=(B, sq)).astype(np.int32)
        kv_ids = ids if sq == skv else rng.integers(0, 3, size=(B, skv)).astype(np.int32)
    rt = _runtime.build(B, sq, skv, segment_ids=jnp.asarray(ids), kv_segment_ids=jnp.asarray(kv_ids))
    assert bool(np.asarray(rt.exact).all()) == (kind == "sorted_ids")
    return rt, ids[:, :, None] == kv_ids[:, None, :]


def _operands(rt, *, keys: bool):
    lens = (rt.kv_len, rt.q_len) if keys else (rt.q_len, rt.kv_len)
    ids = () if rt.q_ids is None else ((rt.kv_ids, rt.q_ids) if keys else (rt.q_ids, rt.kv_ids))
    return [np.asarray(x) for x in (*lens, rt.exact, *ids)]


def _run(layout, rt, q, k, v, do, scale, cap, loop):
    kind = "ranges" if rt.q_ids is None else "ids"
    tiles = (*TILES, loop)
    kw = dict(interpret=True, runtime=kind, soft_cap=cap)
    fwd = ops.fwd_call(layout, q.shape, k.shape, q.dtype.name, scale, tiles=tiles, **kw)
    out, lse = run_numpy(fwd, q, k, v, *_operands(rt, keys=False))
    cq, ck = ops.bwd_calls(layout, q.shape, k.shape, q.dtype.name, scale, tiles=(tiles, tiles), **kw)
    dq, delta = run_numpy(cq, q, k, v, do, out, lse, *_operands(rt, keys=False))
    dk, dv = run_numpy(ck, q, k, v, do, lse, delta, *_operands(rt, keys=True))
    return out, lse, dq, dk, dv


@pytest.mark.parametrize(
    ("name", "kind", "loop", "cap"),
    [
        ("causal_window", "sorted_ids", "fused", None),
        ("causal_window", "sorted_ids", "split", 0.8),
        ("window", "lengths", "fused", None),
        ("window", "unsorted_ids", "single", None),
        ("strided", "sorted_ids", "fused", None),  # aligned walk, permuted rows
        ("global_window", "lengths", "split", 2.0),
        ("window_arrays", "sorted_ids", "fused", None),
        ("varying_stride", "unsorted_ids", "fused", None),  # modular walk
        ("strided_residual", "sorted_ids", "fused", 1.0),  # residual blocks
        ("masked_rows", "unsorted_ids", "split", None),
    ],
)
def test_runtime_mask_kernels(name, kind, loop, cap):
    layout = _layout(name)
    rng = np.random.default_rng(len(name) * 7 + len(kind))
    q, k, v, do = _inputs(layout, seed=3, B=B, H=4, Hkv=2)
    rt, rt_dense = _runtime_case(kind, layout.q_len, layout.kv_len, rng)
    mask = layout.to_dense()[None] & rt_dense
    scale = 0.3
    out, lse, dq, dk, dv = _run(layout, rt, q, k, v, do, scale, cap, loop)
    r_out, (r_dq, r_dk, r_dv) = runtime_ref(q, k, v, mask, scale, do, cap)
    _close(out, r_out, 1e-5, "out")
    empty = ~mask.any(-1)  # [B, Sq]
    assert np.all(np.isneginf(lse.transpose(0, 2, 1)[empty])), "rows with no key need lse = -inf"
    assert not out[empty].any(), "rows with no key output 0"
    _close(dq, r_dq, 1e-5, "dq")
    _close(dk, r_dk, 1e-5, "dk")
    _close(dv, r_dv, 1e-5, "dv")


def test_soft_cap_alone_fp16():
    layout = _layout("causal_window")
    q, k, v, do = _inputs(layout, seed=9, B=1, H=2, Hkv=1, dtype=np.float16)
    mask = layout.to_dense()
    dt = "float16"
    fwd = ops.fwd_call(layout, q.shape, k.shape, dt, 0.25, tiles=TILES, interpret=True, soft_cap=0.5)
    out, lse = run_numpy(fwd, q, k, v)
    cq, ck = ops.bwd_calls(
        layout, q.shape, k.shape, dt, 0.25, tiles=(TILES, TILES), interpret=True, soft_cap=0.5
    )
    dq, delta = run_numpy(cq, q, k, v, do, out, lse)
    dk, dv = run_numpy(ck, q, k, v, do, lse, delta)
    r_out, grads = runtime_ref(q, k, v, mask[None], 0.25, do, 0.5)
    _close(out, r_out, 2e-2, "out")
    for got, want, what in zip((dq, dk, dv), grads, ("dq", "dk", "dv"), strict=True):
        _close(got, want, 8e-2, what)


def test_only_fused_ops_take_a_runtime_mask():
    from jax_bindings._triton.spec import plan

    layout = _layout("window")
    with pytest.raises(ValueError, match="only the fused ops"):
        plan("sddmm", layout, dtype="float32", head_dim=16, num_heads=2, num_kv_heads=1, runtime="ids")
    with pytest.raises(ValueError, match="runtime must be one of"):
        plan("fwd", layout, dtype="float32", head_dim=16, num_heads=2, num_kv_heads=1, runtime="segments")


def test_document_forward_takes_its_own_tiles():
    from jax_bindings._triton.spec import plan

    layout = _layout("causal_window")
    p = plan("fwd", layout, dtype="bfloat16", head_dim=128, num_heads=2, num_kv_heads=1, runtime="ids")
    assert (p.spec.block_m, p.spec.block_n, p.spec.num_warps) == (64, 64, 4)
