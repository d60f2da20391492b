"""Constant mask terms -> one :class:`splat.masks.Mask`, and the check that two masks agree.

A mask term is ``(kind, vid, negate, labels)``: a constant slice of the IR (a ``where``
predicate, a 0/-inf bias, or a value under a comparison test, see ``numeric.kept``) with the
scores' label of each of its axes. :func:`make_mask` names the AND of the terms with splat's
constructors where the symbolic pass recognises it (O(q_len + kv_len) work, see
:mod:`splat._sparsify.recognise`), else as an exact ``masks.from_fn`` predicate evaluated in row
chunks; equal terms share one Mask value. :func:`same_post_mask` tells whether a mask applied
again after the softmax (Keras's ``Softmax(mask)``) is the one applied before it: the same leaves
(shape ops and bool casts aside, constants by fingerprint), or, for constant masks, the same
values (:func:`same_mask`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from splat import masks
from splat._analyzer import analyze
from splat._sparsify.ir import IR
from splat._sparsify.numeric import NotSparsifiable, Slices, kept
from splat._sparsify.predicate import Leaf, leaf_key, split_predicate
from splat._sparsify.recognise import recognise

__all__ = ["make_mask", "mask_term", "no_labels_on_size1", "same_mask", "same_post_mask"]

_MASK_CACHE: dict[str, Any] = {}
_MAX_DENSE_COMPARE = 1 << 24  # masks compared element by element up to this many entries


def make_mask(sl: Slices, terms, t, kv, q_len: int, kv_len: int) -> masks.Mask:
    """The Mask of the constant mask ``terms`` (``t``, ``kv``: the query and key labels)."""
    ir = sl.ir
    parts = []
    for kind, vid, negate, lab in terms:
        roles = tuple("q" if x == t else "k" if x == kv else "0" for x in lab) if ir.shape(vid) else ()
        parts.append((kind, vid, negate, roles))
    key = f"{q_len}x{kv_len}|" + "|".join(f"{k}:{sl.fingerprint(v)}:{n}:{''.join(r)}" for k, v, n, r in parts)
    if key in _MASK_CACHE:
        return _MASK_CACHE[key]
    if len(_MASK_CACHE) > 256:
        _MASK_CACHE.clear()
    mask = recognise(sl, parts, q_len, kv_len)
    if mask is not None:
        _MASK_CACHE[key] = mask
        return mask

    def predicate(q_idx, kv_idx):
        q_idx, kv_idx = np.asarray(q_idx), np.asarray(kv_idx)
        memo: dict = {}
        out = np.ones(np.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=bool)
        with sl.at_grid(q_idx, kv_idx):
            for kind, vid, negate, roles in parts:
                idx = tuple(q_idx if r == "q" else kv_idx if r == "k" else 0 for r in roles)
                keep = kept(sl.value(vid, idx, memo), kind)
                out &= ~keep if negate else keep
        return out

    _MASK_CACHE[key] = mask = masks.from_fn(predicate)
    return mask


def same_mask(a: masks.Mask, b: masks.Mask, q_len: int, kv_len: int) -> bool | None:
    """True / False when masks ``a`` and ``b`` agree / differ on the grid; None when too big to tell."""
    if a == b:
        return True
    la, lb = analyze(a, q_len, kv_len), analyze(b, q_len, kv_len)
    if la == lb:
        return True
    if la.nnz != lb.nnz:
        return False
    if q_len * kv_len > _MAX_DENSE_COMPARE:
        return None
    return bool(np.array_equal(la.to_dense(), lb.to_dense()))


def mask_term(leaf: Leaf) -> tuple:
    """The mask term of a constant leaf: ``(kind, vid, negate, labels)``."""
    kind = ("test", *leaf.test) if leaf.test is not None else "where"
    return kind, leaf.vid, leaf.negate, list(leaf.labels)


def no_labels_on_size1(ir: IR, vid: int, labels) -> list:
    """``labels`` with None on the size-1 (broadcast) axes of ``vid``."""
    return [x if n != 1 else None for x, n in zip(labels, ir.shape(vid), strict=True)]


def same_post_mask(ir, sl, post, pre_leaves, mask, grid, size, others: bool) -> bool:
    """True when the masks applied to the probabilities equal the one applied before the softmax.

    ``pre_leaves``: the ``where`` leaves before it; ``others``: a bias or a mask of the
    exponentials was applied too (then only a constant mask can be compared, by value);
    ``grid``: ``(t, kv, q_len, kv_len)``.

    Raises:
      NotSparsifiable: they differ (or cannot be compared): not the attention splat computes.
    """
    post_leaves = []
    for (pred, negate, test), lab in post:
        static, dynamic = split_predicate(
            ir, sl, pred, no_labels_on_size1(ir, pred, lab), negate, size, test=test
        )
        post_leaves += static + dynamic
    keys_pre = {leaf_key(ir, sl, leaf, size) for leaf in pre_leaves}
    if not others and keys_pre == {leaf_key(ir, sl, leaf, size) for leaf in post_leaves}:
        return True
    t, kv, q_len, kv_len = grid

    def on_grid(leaf):  # a constant that varies only along the query and key axes
        dims = (
            {leaf.labels[a] for a in sl.deps(leaf.vid)}
            if len(leaf.labels) == len(ir.shape(leaf.vid))
            else set()
        )
        return sl.independent(leaf.vid) and dims <= {t, kv}

    if all(on_grid(leaf) for leaf in pre_leaves + post_leaves):
        # the same constant mask built another way (or as a bias before it): compare values
        after = make_mask(sl, [mask_term(leaf) for leaf in post_leaves], t, kv, q_len, kv_len)
        if same_mask(after, mask, q_len, kv_len):
            return True
    raise NotSparsifiable(
        "the attention probabilities are masked after the softmax with a different mask than the logits "
        "before it; splat normalises over the first mask only, so it was left dense"
    )
