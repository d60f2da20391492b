"""Launch descriptions of the generated kernels, independent of the array library.

Each ``*_call`` function returns a :class:`Call`: the kernel, its grid, its
metadata operands (numpy int arrays, passed after the data operands), the
output shapes/dtypes and the constexpr keyword arguments. The JAX binding
(:mod:`jax_bindings._triton.backend`) hands a Call to ``jax_triton.triton_call``; tests
hand it to :func:`jax_bindings._triton.launch.run_numpy` (Triton's interpreter);
``benchmarks/gpu_check.py`` to :func:`jax_bindings._triton.launch.run_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from acsr import ACSR
from jax_bindings._triton.cache import load
from jax_bindings._triton.grid_plan import grid_plan
from jax_bindings._triton.spec import Plan, plan, transposed


@dataclass(frozen=True, eq=False)
class Call:
    """One kernel launch: ``kernel[grid](*data, *meta, *outputs, **constexprs)``; the outputs at
    ``zeroed`` (indices into ``out``) start at zero, the others undefined."""

    kernel: Any
    grid: tuple[int, ...]
    meta: tuple[np.ndarray, ...] = field(repr=False)
    out: tuple[tuple[tuple[int, ...], str], ...]
    constexprs: dict
    num_warps: int
    num_stages: int
    plan: Plan = field(repr=False)
    zeroed: tuple[int, ...] = ()


def _call(p: Plan, grid_b: int, out, constexprs, interpret: bool) -> Call:
    s = p.spec
    k = load(s, interpret=interpret).kernel
    cx = dict(constexprs, BLOCK_M=s.block_m, BLOCK_N=s.block_n)
    grid = (grid_b, p.row_blocks) if s.ordered else (p.row_blocks, grid_b)
    return Call(k, grid, p.meta, tuple(out), cx, s.num_warps, s.num_stages, p)


def _dims(q_shape, k_shape):
    B, Sq, H, D = q_shape
    Bk, Skv, Hkv, Dk = k_shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q_shape)} and k {tuple(k_shape)} disagree on batch or head dim")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"key/value heads ({Hkv}) must divide query heads ({H})")
    return B, Sq, H, D, Skv, Hkv


def _check_layout(layout: ACSR, Sq: int, Skv: int) -> None:
    if not isinstance(layout, ACSR):
        raise TypeError(f"layout must be an acsr.ACSR, got {type(layout).__name__}")
    if layout.shape != (Sq, Skv):
        raise ValueError(f"layout is {layout.q_len}x{layout.kv_len} but q_len x kv_len is {Sq}x{Skv}")


def _check_grid(runtime: str, tiles) -> None:
    """Grid layouts' kernels (:mod:`jax_bindings._triton.grid_plan`) choose their own tiles and
    take no runtime mask."""
    if runtime:
        raise NotImplementedError("the triton grid kernels take no runtime mask (segment ids, lengths)")
    if tiles is not None:
        raise ValueError("tiles cannot be given for a grid layout: its kernels tile the grid themselves")


def _scalars(scale: float, soft_cap: float | None) -> dict:
    """The fused kernels' constexpr scalars: SCALE, and CAPF = SCALE / soft cap (0.0: no cap)."""
    return {"SCALE": float(scale), "CAPF": 0.0 if soft_cap is None else float(scale) / float(soft_cap)}


def fwd_call(
    layout, q_shape, k_shape, dtype, scale: float, *, tiles=None, interpret=False, runtime="", soft_cap=None
) -> Call:
    """Fused forward: out ``[B, Sq, H, D]`` (dtype), lse ``[B, H, Sq]`` float32.

    ``runtime`` (:data:`~jax_bindings._triton.spec.RUNTIME_MASKS`): the kernel takes the runtime
    mask operands after ``(q, k, v)``: ``q_len, kv_len, exact`` and, for ``"ids"``, ``q_ids, kv_ids``
    (:class:`jax_bindings._runtime.RuntimeMask`). ``soft_cap``: a float or None.
    """
    B, Sq, H, D, Skv, Hkv = _dims(q_shape, k_shape)
    _check_layout(layout, Sq, Skv)
    if layout.grid is not None:
        _check_grid(runtime, tiles)
        p = grid_plan("fwd", layout.grid, dtype, D, H, Hkv)
    else:
        heads = dict(dtype=dtype, head_dim=D, num_heads=H, num_kv_heads=Hkv)
        p = plan("fwd", layout, tiles=tiles, runtime=runtime, **heads)
    out = [((B, Sq, H, D), p.spec.dtype), ((B, H, Sq), "float32")]
    return _call(p, B * H, out, _scalars(scale, soft_cap), interpret)


def bwd_calls(
    layout, q_shape, k_shape, dtype, scale: float, *, tiles=None, interpret=False, runtime="", soft_cap=None
) -> tuple[Call, Call]:
    """Fused backward: (dq call over ``layout``, dk/dv call over its transpose).

    The dq call takes ``(q, k, v, dout, out, lse)`` and returns ``(dq, delta)``
    with ``delta = sum(dout * out, -1)`` float32 ``[B, H, Sq]``; the dk/dv call,
    launched after it, takes ``(q, k, v, dout, lse, delta)`` and returns ``(dk, dv)``.
    ``tiles``: a pair (dq tiles, dk/dv tiles), either may be None. With a ``runtime`` mask the
    dq call takes ``q_len, kv_len, exact[, q_ids, kv_ids]`` after its inputs and the dk/dv call
    ``kv_len, q_len, exact[, kv_ids, q_ids]`` (its rows are keys).
    """
    B, Sq, H, D, Skv, Hkv = _dims(q_shape, k_shape)
    _check_layout(layout, Sq, Skv)
    if layout.grid is not None:
        _check_grid(runtime, tiles)
        pq = grid_plan("bwd_dq", layout.grid, dtype, D, H, Hkv)
        t = transposed(layout)  # a grid too, unless its transpose has no per-axis form
        pk = (
            grid_plan("bwd_dkdv", t.grid, dtype, D, H, Hkv)
            if t.grid is not None
            else plan("bwd_dkdv", t, dtype=dtype, head_dim=D, num_heads=H, num_kv_heads=Hkv)
        )
    else:
        t_dq, t_kv = tiles or (None, None)
        heads = dict(dtype=dtype, head_dim=D, num_heads=H, num_kv_heads=Hkv, runtime=runtime)
        pq = plan("bwd_dq", layout, tiles=t_dq, **heads)
        pk = plan("bwd_dkdv", transposed(layout), tiles=t_kv, **heads)
    scalars = _scalars(scale, soft_cap)
    cq = _call(pq, B * H, [((B, Sq, H, D), pq.spec.dtype), ((B, H, Sq), "float32")], scalars, interpret)
    ck = _call(pk, B * Hkv, [((B, Skv, Hkv, D), pk.spec.dtype)] * 2, scalars, interpret)
    return cq, ck


def sddmm_call(layout, q_shape, k_shape, dtype, *, tiles=None, interpret=False) -> Call:
    """Scores ``q . k^T`` at the mask's nonzeros: values ``[B, H, Sq, nnz_max]`` (dtype), padding 0."""
    B, Sq, H, D, Skv, Hkv = _dims(q_shape, k_shape)
    _check_layout(layout, Sq, Skv)
    p = plan("sddmm", layout, dtype=dtype, head_dim=D, num_heads=H, num_kv_heads=Hkv, tiles=tiles)
    return _call(p, B * H, [((B, H, Sq, layout.nnz_max), p.spec.dtype)], {}, interpret)


def softmax_call(layout, s_shape, dtype, scale: float, *, tiles=None, interpret=False) -> Call:
    """Row softmax of ``scale * s`` over valid slots; padding and fully masked rows 0."""
    B, H, Sq, n = s_shape
    if (Sq, n) != (layout.q_len, layout.nnz_max):
        raise ValueError(
            f"values of shape {tuple(s_shape)} do not match the layout "
            f"[B, H, {layout.q_len}, {layout.nnz_max}]"
        )
    p = plan("softmax", layout, dtype=dtype, head_dim=16, num_heads=H, num_kv_heads=H, tiles=tiles)
    return _call(p, B * H, [((B, H, Sq, n), p.spec.dtype)], {"SCALE": float(scale)}, interpret)


def spmm_call(layout, p_shape, v_shape, dtype, *, tiles=None, interpret=False) -> Call:
    """``values . v``: out ``[B, Sq, H, D]`` in v's dtype."""
    B, H, Sq, n = p_shape
    Bv, Skv, Hkv, D = v_shape
    if Bv != B or (Sq, n) != (layout.q_len, layout.nnz_max):
        raise ValueError(f"values {tuple(p_shape)} / v {tuple(v_shape)} do not match the layout")
    _check_layout(layout, Sq, Skv)
    if H % Hkv:
        raise ValueError(f"key/value heads ({Hkv}) must divide query heads ({H})")
    p = plan("spmm", layout, dtype=dtype, head_dim=D, num_heads=H, num_kv_heads=Hkv, tiles=tiles)
    return _call(p, B * H, [((B, Sq, H, D), p.spec.dtype)], {}, interpret)
