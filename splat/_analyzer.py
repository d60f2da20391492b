"""The just-in-time analyzer: anything a user passes as ``mask=`` -> an ACSR layout + report."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import acsr
import jax_bindings
from acsr import ACSR
from splat import _per_head
from splat import masks as _masks

# tile shape the report rates layouts against (the fused kernels' usual row x key tile)
_REPORT_TILE = (128, 64)


def _as_mask(mask) -> _masks.Mask | None:
    """Mask value for ``mask``, or None when it is already a layout."""
    if mask is None:
        return _masks.full()
    if isinstance(mask, _masks.Mask):
        return mask
    if isinstance(mask, ACSR):
        return None
    if callable(mask) and not hasattr(mask, "shape"):
        return _masks.from_fn(mask)
    if hasattr(mask, "shape"):
        a = mask
        if hasattr(a, "aval") and type(a).__name__.endswith("Tracer"):
            raise TypeError(
                "mask is a traced jax value; splat needs the mask at trace time. Build it from "
                "splat.masks, a numpy array, or a jnp array computed outside jit"
            )
        a = np.asarray(a)
        while a.ndim > 2 and a.shape[0] == 1:
            a = a[0]
        if a.ndim != 2:
            raise ValueError(
                "mask array must be [q_len, kv_len] (leading axes of size 1 allowed), "
                f"got shape {np.shape(mask)}"
            )
        return _masks.from_array(a)
    raise TypeError(
        f"mask must be a splat.masks.Mask, a boolean array, a function f(q_idx, kv_idx), an acsr.ACSR "
        f"or None; got {type(mask).__name__}"
    )


def analyze(mask, q_len: int | None = None, kv_len: int | None = None, *, block=acsr.DEFAULT_BLOCK) -> ACSR:
    """The ACSR layout of ``mask`` for ``q_len`` queries and ``kv_len`` keys.

    Args:
      mask: a :class:`splat.masks.Mask`, a boolean ``[q_len, kv_len]`` array
        (numpy or concrete jax), a vectorised function ``f(q_idx, kv_idx)``,
        an :class:`acsr.ACSR` (checked and returned), or None (full attention).
      q_len, kv_len: sizes; taken from the array or layout when omitted;
        ``kv_len`` defaults to ``q_len``.
      block: ``(block_q, block_kv)`` of the residual, for masks that need one.

    Returns:
      The layout; equal masks give equal (and cached) layouts.

    Example:
      >>> import splat
      >>> layout = splat.analyze(splat.masks.sliding_window(1), q_len=5)
      >>> layout.nnz
      13
    """
    m = _as_mask(mask)
    if m is None:
        for name, want, got in (("q_len", q_len, mask.q_len), ("kv_len", kv_len, mask.kv_len)):
            if want is not None and want != got:
                raise ValueError(f"layout is {mask.q_len} x {mask.kv_len} but {name}={want} was asked for")
        return mask
    if isinstance(m, _masks.FromArray):
        return m.to_acsr(q_len, kv_len, block=block)
    if q_len is None:
        raise ValueError("q_len is required for masks without a fixed size (constructors and functions)")
    return m.to_acsr(q_len, kv_len, block=block)


@dataclass(frozen=True)
class SegmentReport:
    stride: int | None
    width: int
    nnz: int
    closed_form: str | None


@dataclass(frozen=True)
class Report:
    """What the analyzer found in a mask."""

    family: str
    q_len: int
    kv_len: int
    nnz: int
    density: float
    empty_rows: int
    segments: tuple[SegmentReport, ...]
    residual_blocks: int
    tile_efficiency: float
    backend: str = "auto: depends on head dim and dtype (pass head_dim= and dtype= to splat.report)"

    def to_string(self) -> str:
        lines = [
            f"mask        {self.family}",
            f"shape       {self.q_len} x {self.kv_len}",
            f"nonzeros    {self.nnz} (density {self.density:.4%}), {self.empty_rows} empty rows",
            f"tile use    {self.tile_efficiency:.1%} of the work in {_REPORT_TILE[0]}x{_REPORT_TILE[1]} "
            "(row x compressed key) tiles is useful",
        ]
        for k, s in enumerate(self.segments):
            stride = "varies" if s.stride is None else s.stride
            law = s.closed_form or "none (per-row arrays)"
            lines.append(
                f"segment {k}   stride {stride}, width {s.width}, {s.nnz} nonzeros; closed form: {law}"
            )
        if self.residual_blocks:
            lines.append(f"residual    {self.residual_blocks} blocks (block-sparse, irregular part)")
        lines.append(f"backend     {self.backend}")
        return "\n".join(lines)

    def __str__(self):
        return self.to_string()


@dataclass(frozen=True)
class HeadGroupsReport:
    """What the analyzer found in per-head masks: the heads that share a layout, one report per group.

    ``groups[i] = (heads, report)``: ``heads`` index the mask sequence (query heads, or KV heads for
    one mask per KV-head group); each group is one attention call (the kernels take one layout per
    launch).
    """

    heads: int
    groups: tuple[tuple[tuple[int, ...], Report], ...]

    def to_string(self) -> str:
        n = len(self.groups)
        lines = [f"heads       {self.heads} masks, {n} distinct (one call per group)"]
        for i, (heads, r) in enumerate(self.groups):
            lines.append(f"group {i}     heads {_ranges(heads)}")
            lines.extend("  " + line for line in r.to_string().splitlines())
        return "\n".join(lines)

    def __str__(self):
        return self.to_string()


def _ranges(heads: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``."""
    parts, start = [], None
    for i, h in enumerate(heads):
        start = h if start is None else start
        if i + 1 == len(heads) or heads[i + 1] != h + 1:
            parts.append(str(h) if start == h else f"{start}-{h}")
            start = None
    return ", ".join(parts)


def _tile_efficiency(layout: ACSR) -> float:
    """Useful fraction of the work over row-block x key-span tiles, segments in compressed key space."""
    bm, bn = _REPORT_TILE
    rows = acsr.block_rows(layout.q_len, bm)
    work = 0
    for s in layout.segments:
        span = acsr.key_spans(s, rows)[1]
        work += int((-(-span // bn) * bn * bm).sum())
    if layout.residual is not None:
        r = layout.residual
        work += int(r.num_blocks.sum()) * r.block_q * r.block_kv
    return layout.nnz / work if work else 1.0


def report(
    mask, q_len: int | None = None, kv_len: int | None = None, *, head_dim: int | None = None, dtype=None
) -> Report | HeadGroupsReport:
    """A :class:`Report` of the layout splat builds for ``mask`` (arguments as :func:`analyze`).

    With ``head_dim`` and ``dtype`` (e.g. ``"bfloat16"``), the report also names
    the backend ``backend="auto"`` would pick for the fused attention on this
    machine (:func:`jax_bindings.selected_backend`). Per-head masks (a list or
    tuple of masks, or a boolean ``[H, q_len, kv_len]`` array, as
    :func:`splat.attention` takes them) give a :class:`HeadGroupsReport`: the
    heads that share a layout, and a report per group.

    Example:
      >>> import splat
      >>> splat.report(splat.masks.causal(), q_len=64, head_dim=32, dtype="float32").backend  # on a CPU
      'auto picks "jax" for the fused attention here (head dim 32, float32)'
    """
    per_head = _per_head.head_masks(mask)
    if per_head is not None:
        return _head_groups(per_head, q_len, kv_len, head_dim, dtype)
    layout = analyze(mask, q_len, kv_len)
    backend = {}
    if head_dim is not None or dtype is not None:
        backend["backend"] = _auto_backend(layout, head_dim, dtype)
    m = _as_mask(mask)
    found_in = "array" if isinstance(m, _masks.FromArray) else "function" if m is not None else "layout"
    if m is not None and not isinstance(m, (_masks.FromArray, _masks.FromFn)):
        family = repr(m)
    elif layout.grid is not None:
        grid = "x".join(map(str, layout.grid.grid))
        family = f"grid product {grid} (per-axis windows, found in {found_in})"
    elif layout.residual is not None:
        family = "irregular (block-sparse residual)"
    else:
        strides = {s.uniform_stride for s in layout.segments}
        kind = "strided/dilated" if strides - {1} else "contiguous"
        family = f"{kind}, {len(layout.segments)} segment(s) (found in {found_in})"
    rc = layout.row_counts()
    segs = tuple(
        SegmentReport(
            s.uniform_stride,
            s.width,
            int(s.count.sum()),
            s.closed_form.to_string() if s.closed_form is not None else None,
        )
        for s in layout.segments
    )
    return Report(
        family=family,
        q_len=layout.q_len,
        kv_len=layout.kv_len,
        nnz=int(rc.sum()),
        density=layout.density(),
        empty_rows=int((rc == 0).sum()),
        segments=segs,
        residual_blocks=0 if layout.residual is None else int(layout.residual.num_blocks.sum()),
        tile_efficiency=_tile_efficiency(layout),
        **backend,
    )


def _head_groups(entries: tuple, q_len, kv_len, head_dim, dtype) -> HeadGroupsReport:
    """:func:`report` of per-head masks: entries grouped by their layout, in order of first head."""
    found: dict[ACSR, list[int]] = {}
    for i, m in enumerate(entries):
        if isinstance(m, (list, tuple)):
            raise TypeError(f"mask[{i}] is a {type(m).__name__}: per-head masks do not nest")
        try:
            found.setdefault(analyze(m, q_len, kv_len), []).append(i)
        except (TypeError, ValueError) as e:
            raise type(e)(f"mask[{i}]: {e}") from e
    groups = tuple(
        (tuple(hs), report(entries[hs[0]], q_len, kv_len, head_dim=head_dim, dtype=dtype))
        for hs in found.values()
    )
    return HeadGroupsReport(heads=len(entries), groups=groups)


def _auto_backend(layout: ACSR, head_dim, dtype) -> str:
    """What ``backend="auto"`` runs the fused attention on, for one head of ``head_dim`` in ``dtype``."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int when dtype is given, got {head_dim!r}")
    if dtype is None:
        raise ValueError("dtype must be given with head_dim (e.g. dtype='bfloat16')")
    dt = jnp.dtype(dtype)
    q = jax.ShapeDtypeStruct((1, layout.q_len, 1, head_dim), dt)
    kv = jax.ShapeDtypeStruct((1, layout.kv_len, 1, head_dim), dt)
    name = jax_bindings.selected_backend("attention", q, kv, kv, layout, head_dim**-0.5)
    return f'auto picks "{name}" for the fused attention here (head dim {head_dim}, {dt.name})'
