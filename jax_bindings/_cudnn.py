"""The cuDNN backend: cuDNN's fused flash attention, for the masks it computes exactly.

Runs ``jax.nn.dot_product_attention(..., implementation=IMPLEMENTATION)`` for
three mask families, recognised from the ACSR layout by an O(Sq) numpy check of
the row intervals (one stride-1 segment, no residual, row ``r`` attending
exactly ``[lo_r, hi_r)``):

=================  ==========================  ==================================================
family             row ``r`` attends           ``jax.nn.dot_product_attention`` arguments
=================  ==========================  ==================================================
full               ``[0, kv_len)``             none (any ``q_len``, ``kv_len``)
causal             ``[0, r + 1)``              ``is_causal=True``; ``q_len == kv_len``
causal window w    ``[max(0, r - w), r + 1)``  ``is_causal=True, local_window_size=(w, 0)``;
                                               ``q_len == kv_len``
=================  ==========================  ==================================================

Everything else raises ``NotImplementedError`` (``"auto"`` then moves on to the
next backend). Not taken on purpose:

* windows reaching right of the diagonal: jax hands cuDNN a left window only
  and raises for a right window without ``is_causal`` (jax 0.10,
  ``jax/_src/nn/functions.py``, the ``'cudnn'`` case);
* causal masks with ``q_len != kv_len``: whether the diagonal is aligned to the
  top-left or the bottom-right corner is cuDNN's choice, not documented by jax;
* float32 inputs (cuDNN's flash attention takes bfloat16 and float16 only),
  head dims that are not multiples of 8 or exceed 256 (128 before compute
  capability 9.0), GPUs before compute capability 8.0.

GQA/MQA are jax's: ``[B, T, N, H]`` queries with ``N / K`` query heads per KV
head, query head ``n`` reading KV head ``n // (N / K)``, as in splat.

The cuDNN call returns no float32 logsumexp (jax offers it only cast to the
output dtype), so the fused ``attention_fwd -> (out, lse)`` contract does not
fit: this backend declares a differentiable :func:`attention` instead, which
JAX differentiates and batches itself, and refuses ``attention_fwd``,
``attention_bwd``, ``attention_paged`` (it takes no paged KV cache) and the
unfused ops so the next backend takes them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from acsr import ACSR

# The jax.nn.dot_product_attention implementation this backend calls; a CPU test sets "xla" to check
# the mask translation against a dense reference (the platform check below is cuDNN's only).
IMPLEMENTATION = "cudnn"
DTYPES = ("bfloat16", "float16")
_REFUSAL = "cudnn takes full, causal and causal-window masks only: "


@dataclass(frozen=True)
class CudnnMask:
    """A mask as ``jax.nn.dot_product_attention`` arguments.

    ``family`` is "full", "causal" or "causal_window"; ``local_window_size`` is
    ``(w, 0)`` for a causal window of ``w`` keys left of the diagonal.
    """

    family: str
    is_causal: bool
    local_window_size: tuple[int, int] | None = None


@functools.lru_cache(maxsize=256)
def recognise(layout: ACSR) -> CudnnMask:
    """The :class:`CudnnMask` equal to ``layout``; NotImplementedError saying what was found otherwise."""
    if layout.residual is not None:
        raise NotImplementedError(_REFUSAL + f"a block-sparse residual ({layout!r})")
    if len(layout.segments) != 1:
        raise NotImplementedError(_REFUSAL + f"{len(layout.segments)} segments per row ({layout!r})")
    (seg,) = layout.segments
    count = seg.count.astype(np.int64)
    if (count == 0).any():
        # Every row of these families sees at least itself, so a fully masked row cannot occur here.
        r = int(np.argmax(count == 0))
        raise NotImplementedError(_REFUSAL + f"{int((count == 0).sum())} fully masked rows (row {r} first)")
    strided = (seg.stride != 1) & (count > 1)
    if strided.any():
        r = int(np.argmax(strided))
        raise NotImplementedError(_REFUSAL + f"a stride-{int(seg.stride[r])} segment (row {r})")
    lo = seg.base.astype(np.int64)
    hi = lo + count
    sq, skv = layout.q_len, layout.kv_len
    if (lo == 0).all() and (hi == skv).all():
        return CudnnMask("full", is_causal=False)
    if sq != skv:
        raise NotImplementedError(
            _REFUSAL + f"a {sq} x {skv} mask that is not full (causal masks need q_len == kv_len)"
        )
    r = np.arange(sq)
    bad = hi != r + 1
    if bad.any():
        i = int(np.argmax(bad))
        raise NotImplementedError(
            _REFUSAL + f"row {i} attends [{lo[i]}, {hi[i]}), not a causal row ending at {i + 1} "
            "(cuDNN windows have no right side)"
        )
    if (lo == 0).all():
        return CudnnMask("causal", is_causal=True)
    w = int(r[-1] - lo[-1])
    bad = lo != np.maximum(r - w, 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise NotImplementedError(
            _REFUSAL + f"row {i} attends [{lo[i]}, {hi[i]}), not [{max(i - w, 0)}, {i + 1}) of the causal "
            f"window of {w} that the last row has"
        )
    return CudnnMask("causal_window", is_causal=True, local_window_size=(w, 0))


def _check_call(q, k) -> None:
    """Refuses (NotImplementedError) what cuDNN's flash attention cannot run here."""
    if IMPLEMENTATION == "cudnn":
        platform = jax.default_backend()
        if platform != "gpu":
            raise NotImplementedError(f"cudnn needs a CUDA GPU; jax.default_backend() is {platform!r}")
        cc = _compute_capability()
        if cc is not None and cc < (8, 0):
            raise NotImplementedError(
                f"cudnn flash attention needs compute capability 8.0 or newer, this GPU has {cc[0]}.{cc[1]}"
            )
    dtype = jnp.dtype(q.dtype).name
    if dtype not in DTYPES:
        raise NotImplementedError(f"cudnn takes bfloat16 and float16 inputs only, got {dtype}")
    d, dmax = q.shape[-1], _max_head_dim()
    if d % 8 or d > dmax:
        raise NotImplementedError(f"cudnn takes head dims that are multiples of 8 up to {dmax}, got {d}")


@functools.cache
def _compute_capability() -> tuple[int, int] | None:
    cc = getattr(jax.devices()[0], "compute_capability", None)
    return None if cc is None else tuple(int(x) for x in cc.split(".")[:2])


def _max_head_dim() -> int:
    cc = _compute_capability() if IMPLEMENTATION == "cudnn" else None
    return 128 if cc is not None and cc < (9, 0) else 256


def attention(q, k, v, runtime, layout: ACSR, scale: float, soft_cap=None):
    """Differentiable fused attention ``[B, Sq, H, D]`` through cuDNN (see the module docstring).

    ``q: [B, Sq, H, D]``, ``k, v: [B, Skv, Hk, D]`` in bfloat16 or float16;
    returns ``softmax(scale * q k^T | mask) v`` in ``q.dtype``. Refuses, with
    NotImplementedError, every mask, dtype, head dim and platform cuDNN cannot
    take exactly, runtime masks (segment ids, lengths, offsets) and soft caps.
    """
    if runtime is not None:
        raise NotImplementedError("cudnn takes no runtime mask (segment ids, sequence lengths, q_offset)")
    if soft_cap is not None:
        raise NotImplementedError("cudnn takes no logits soft cap")
    _check_call(q, k)
    m = recognise(layout)
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=float(scale),
        is_causal=m.is_causal,
        local_window_size=m.local_window_size,
        implementation=IMPLEMENTATION,
    )


def _refuses(op: str, why: str):
    def refuse(*args):
        raise NotImplementedError(f"cudnn has no {op}: {why}")

    refuse.__name__ = refuse.__qualname__ = op
    refuse.__doc__ = f"Always refuses: {why}."
    return refuse


_NO_LSE = "cuDNN's call returns no float32 logsumexp (the backend offers the differentiable attention)"
_NO_UNFUSED = "cuDNN has no unfused sparse ops"

attention_fwd = _refuses("attention_fwd", _NO_LSE)
attention_bwd = _refuses("attention_bwd", _NO_LSE)
sddmm = _refuses("sddmm", _NO_UNFUSED)
sddmm_bwd = _refuses("sddmm_bwd", _NO_UNFUSED)
softmax = _refuses("softmax", _NO_UNFUSED)
softmax_bwd = _refuses("softmax_bwd", _NO_UNFUSED)
spmm = _refuses("spmm", _NO_UNFUSED)
spmm_bwd = _refuses("spmm_bwd", _NO_UNFUSED)
attention_paged = _refuses("attention_paged", "it takes no paged KV cache")
