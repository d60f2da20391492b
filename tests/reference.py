"""Dense oracle for every test file: masked attention in float64 (numpy), and error bounds.

Error rule (FlexAttention's): the error of splat's result, in its dtype, against
the float64 reference must be at most ``factor`` times the error of the same
dense computation done in that dtype, and never needs to beat a per-dtype floor
(float32: relative error 1e-5). Errors are relative to the reference's largest
magnitude: ``max|x - ref| / max|ref|``.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from splat import catalogue

# Errors below these never fail a check (relative to max |ref|).
FLOORS = {
    np.dtype(np.float32): 1e-5,
    np.dtype(jnp.bfloat16): 1e-2,
    np.dtype(np.float16): 1e-3,
}
FACTOR = 2.0


def dense_mask(mask) -> np.ndarray:
    """Boolean ``[Sq, Skv]`` of a numpy array or an ACSR layout."""
    return mask.to_dense() if hasattr(mask, "to_dense") else np.asarray(mask, bool)


def _f64(*xs):
    return [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in xs]


def _expand_kv(x: np.ndarray, h: int) -> np.ndarray:
    """``[B, S, Hk, D] -> [B, S, H, D]`` (query head ``i`` reads KV head ``i // (H // Hk)``)."""
    return np.repeat(x, h // x.shape[2], axis=2)


def _reduce_kv(x: np.ndarray, hk: int) -> np.ndarray:
    """Sum of the ``[B, S, H, D]`` gradient over each KV head's query heads."""
    b, s, h, d = x.shape
    return x.reshape(b, s, hk, h // hk, d).sum(axis=3)


def probs_ref(q, k, mask, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``(P [B, H, Sq, Skv], lse [B, H, Sq])`` in float64; empty rows: P = 0, lse = -inf."""
    q, k = _f64(q, k)
    m = dense_mask(mask)
    k = _expand_kv(k, q.shape[2])
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = np.where(m, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(m, np.exp(s - mx), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    p = e / np.where(tot > 0, tot, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(tot > 0, mx + np.log(tot), -np.inf)[..., 0]
    return p, lse


def attention_ref(q, k, v, mask, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``(out [B, Sq, H, D], lse [B, H, Sq])`` of masked attention in float64."""
    p, lse = probs_ref(q, k, mask, scale)
    (v,) = _f64(v)
    return np.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, p.shape[1])), lse


def attention_grads_ref(q, k, v, mask, scale: float, dout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` of ``sum(attention(q, k, v) * dout)`` in float64 (analytic)."""
    p, _ = probs_ref(q, k, mask, scale)
    q64, k64, v64, do = _f64(q, k, v, dout)
    h, hk = q64.shape[2], k64.shape[2]
    ke, ve = _expand_kv(k64, h), _expand_kv(v64, h)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, ve)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q64) * scale
    return dq, _reduce_kv(dk, hk), _reduce_kv(dv, hk)


def attention_dense(q, k, v, mask, scale: float):
    """The same dense masked attention in the inputs' own dtype (jax), for the error bound."""
    return _attention_dense(q, k, v, jnp.asarray(dense_mask(mask)), float(scale))


@functools.partial(jax.jit, static_argnums=4)
def _attention_dense(q, k, v, m, scale: float):
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, q.dtype)
    s = jnp.where(m, s, -jnp.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = jax.lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0))
    e = jnp.where(m, jnp.exp(s - mx), 0)
    tot = e.sum(axis=-1, keepdims=True)
    p = e / jnp.where(tot > 0, tot, 1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def attention_dense_grads(q, k, v, mask, scale: float, dout):
    """``(out, (dq, dk, dv))`` of :func:`attention_dense` in the inputs' dtype."""
    return _attention_dense_grads(q, k, v, jnp.asarray(dense_mask(mask)), float(scale), dout)


@functools.partial(jax.jit, static_argnums=4)
def _attention_dense_grads(q, k, v, m, scale: float, dout):
    out, vjp = jax.vjp(lambda a, b, c: _attention_dense(a, b, c, m, scale), q, k, v)
    return out, vjp(dout.astype(out.dtype))


def rel_error(x, ref) -> float:
    """``max|x - ref| / max|ref|`` (absolute error when ref is all zero)."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {x.shape} != reference shape {ref.shape}")
    scale = np.abs(ref).max(initial=0.0)
    err = np.abs(x - ref).max(initial=0.0)
    return float(err / scale) if scale > 0 else float(err)


def error_bound(dtype, same_dtype=None, ref=None, factor: float = FACTOR) -> float:
    """``max(floor[dtype], factor * rel_error(same_dtype, ref))``."""
    floor = FLOORS[np.dtype(dtype)]
    if same_dtype is None:
        return floor
    return max(floor, factor * rel_error(same_dtype, ref))


def assert_close(name: str, got, ref, dtype, same_dtype=None, factor: float = FACTOR) -> None:
    """Fails when ``got`` is further from the float64 ``ref`` than the error rule allows."""
    got_np = np.asarray(jnp.asarray(got, jnp.float32))
    if not np.isfinite(got_np).all():
        raise AssertionError(f"{name}: non-finite values")
    err = rel_error(got, ref)
    bound = error_bound(dtype, same_dtype, ref, factor)
    if not err <= bound:
        raise AssertionError(
            f"{name}: relative error {err:.3g} exceeds bound {bound:.3g} ({np.dtype(dtype)})"
        )


# -----------------------------------------------------------------------------
# test masks: splat.catalogue.ODD (small and odd sizes) rendered from each mask's own predicate
# -----------------------------------------------------------------------------

MASKS = catalogue.ODD  # name -> Shaped(q_len, kv_len, mask); tests/test_masks.py checks each against numpy


def mask_array(name: str) -> np.ndarray:
    """Boolean ``[q_len, kv_len]`` rendering of catalogue mask ``name`` (``splat.catalogue.ODD``)."""
    sq, skv, mask = MASKS[name]
    i, j = np.arange(sq)[:, None], np.arange(skv)[None, :]
    return np.ascontiguousarray(np.broadcast_to(mask(i, j), (sq, skv)))


# Backends that must take every call of the base; a refusal by another one skips the test.
TAKES_EVERY_CALL = ("jax", "triton")


@contextlib.contextmanager
def refusal_skips(backend: str):
    """A partial backend's NotImplementedError skips the test with its reason; others' fail it."""
    try:
        yield
    except NotImplementedError as e:
        if backend in TAKES_EVERY_CALL:
            raise
        pytest.skip(f"{backend} refuses this call: {e}")


# -----------------------------------------------------------------------------
# per-batch masks and soft-capped scores (runtime mask arguments)
# -----------------------------------------------------------------------------


def runtime_ref(q, k, v, mask_b, scale: float, dout, soft_cap: float | None = None):
    """``(out, (dq, dk, dv))`` in float64 for a per-batch mask ``[B, Sq, Skv]`` and an optional soft cap.

    Scores ``z = scale * q . k`` become ``soft_cap * tanh(z / soft_cap)``; empty rows give 0.
    """
    q64, k64, v64, do = _f64(q, k, v, dout)
    h, hk = q64.shape[2], k64.shape[2]
    ke, ve = _expand_kv(k64, h), _expand_kv(v64, h)
    m = np.asarray(mask_b, bool)[:, None]  # [B, 1, Sq, Skv]
    z = np.einsum("bqhd,bkhd->bhqk", q64, ke) * scale
    t = np.tanh(z / soft_cap) if soft_cap is not None else None
    s = np.where(m, soft_cap * t if t is not None else z, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(m, np.exp(s - mx), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    p = e / np.where(tot > 0, tot, 1.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, ve)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, ve)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    if t is not None:
        ds = ds * (1.0 - t * t)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q64) * scale
    return out, (dq, _reduce_kv(dk, hk), _reduce_kv(dv, hk))
