# ruff: noqa: E501  (lines of Triton source are kept whole, for readable generated output)
"""The Triton functions every generated kernel shares, as source text (rendered after the header).

Loads, the per-tile steps of the fused forward (``_fwd_tile``), the backward (``_dq_tile``,
``_dkdv_tile``) and the unfused ops, the runtime mask's tile test (``_runtime_keep``) and the
search of a row block's documents (``_document_bounds``). They read the header's constexprs
(``KV_LEN``, ``COLS``, ``SEARCH_*`` ...); ``input_precision=PREC`` is replaced per dtype by
:func:`jax_bindings._triton.render.render`.
"""

TILES = '''

@triton.jit
def _load_rows(base, idx, ok, ROW: tl.constexpr, IS_FULL: tl.constexpr):
    """[len(idx), BLOCK_D] rows idx of a [S, heads, D] slab; ok masks rows."""
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + idx[:, None] * ROW + offs_d[None, :]
    if IS_FULL and EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=ok[:, None] & (offs_d < D)[None, :], other=0.0)


@triton.jit
def _in_range(u, ub, ue):
    """[BLOCK_M, BLOCK_N] membership of compressed columns u in each row's [ub, ue)."""
    return (u[None, :] >= ub[:, None]) & (u[None, :] < ue[:, None])


@triton.jit
def _runtime_keep(cols, rok, cn, rid, CIb, RT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] runtime mask: real rows, columns below cn (RT == 2: of the row's segment)."""
    keep = rok[:, None] & (cols < cn)[None, :]
    if RT == 2:
        cid = tl.load(CIb + cols, mask=cols < COLS, other=0)
        keep = keep & (rid[:, None] == cid[None, :])
    return keep


@triton.jit
def _count_in_stretch(Ids, c1, x, INCLUSIVE: tl.constexpr):
    """How many of the sorted Ids[0:COLS] are < x (<= x if INCLUSIVE), given c1 = how many probes are."""
    base = tl.maximum(c1 - 1, 0) * SEARCH_STEP
    i2 = base + tl.arange(0, SEARCH_P2)
    ok = (i2 < COLS) & (i2 < base + SEARCH_STEP)
    v2 = tl.load(Ids + i2, mask=ok, other=0)
    below = ((v2 <= x) if INCLUSIVE else (v2 < x)) & ok
    return base + tl.sum(below.to(tl.int32), 0)


@triton.jit
def _document_bounds(Ids, id_lo, id_hi):
    """Over the sorted Ids[0:COLS]: (#ids < id_lo, #ids <= id_hi, #ids < id_hi, #ids <= id_lo).

    A two-level search with no loop: one gather probes every SEARCH_STEP-th id (SEARCH_P1 probes)
    and locates each answer in one stretch of SEARCH_STEP ids, a second gather counts inside it."""
    i1 = tl.arange(0, SEARCH_P1) * SEARCH_STEP
    v1 = tl.load(Ids + i1, mask=i1 < COLS, other=0)
    ok = i1 < COLS
    a = _count_in_stretch(Ids, tl.sum(((v1 < id_lo) & ok).to(tl.int32), 0), id_lo, False)
    b = _count_in_stretch(Ids, tl.sum(((v1 <= id_hi) & ok).to(tl.int32), 0), id_hi, True)
    c = _count_in_stretch(Ids, tl.sum(((v1 < id_hi) & ok).to(tl.int32), 0), id_hi, False)
    d = _count_in_stretch(Ids, tl.sum(((v1 <= id_lo) & ok).to(tl.int32), 0), id_lo, True)
    return a, b, c, d


@triton.jit
def _tanh(x):
    """tanh through exp2; saturates to +-1 for large |x|."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, Kb, Vb, QK_SCALE: tl.constexpr, cols, keep, u, ub, ue, part, MASK: tl.constexpr,
              rok, cn, rid, CIb, rtp, RT: tl.constexpr, CAPF: tl.constexpr):
    k = _load_rows(Kb, cols, cols < KV_LEN, KV_ROW, MASK == 0)
    v = _load_rows(Vb, cols, cols < KV_LEN, KV_ROW, MASK == 0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if CAPF > 0:  # soft cap: SCALE * s becomes CAP * tanh(SCALE * s / CAP); CAPF = SCALE / CAP
        s = _tanh(s * CAPF) / CAPF
    if MASK == 1:
        s = tl.where(keep, s, float("-inf"))
    if MASK == 2:
        if part:  # an edge tile: only these build and apply the mask
            s = tl.where(_in_range(u, ub, ue), s, float("-inf"))
    if RT > 0:
        if rtp:  # the tile crosses a row's runtime range
            s = tl.where(_runtime_keep(cols, rok, cn, rid, CIb, RT), s, float("-inf"))
    # scores stay unscaled: max first, then one FMA per score (QK_SCALE > 0 keeps the argmax)
    m_new = tl.maximum(m_i, tl.max(s, 1) * QK_SCALE)
    if MASK == 0 and RT == 0:  # every row has a finite score here
        m_use = m_new
    else:  # rows with nothing yet: subtract 0, exp2(-inf) = 0
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * QK_SCALE - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, Kb, Vb, QK_SCALE: tl.constexpr, cols, keep, u, ub, ue, part, MASK: tl.constexpr,
             rok, cn, rid, CIb, rtp, RT: tl.constexpr, CAPF: tl.constexpr):
    k = _load_rows(Kb, cols, cols < KV_LEN, KV_ROW, MASK == 0)
    v = _load_rows(Vb, cols, cols < KV_LEN, KV_ROW, MASK == 0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if CAPF > 0:
        t = _tanh(s * CAPF)
        s = t / CAPF
    p = tl.math.exp2(s * QK_SCALE - lse2[:, None])
    if MASK == 1:
        p = tl.where(keep, p, 0.0)
    if MASK == 2:
        if part:
            p = tl.where(_in_range(u, ub, ue), p, 0.0)
    if RT > 0:
        if rtp:
            p = tl.where(_runtime_keep(cols, rok, cn, rid, CIb, RT), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    if CAPF > 0:  # d(tanh) / d(logit)
        ds = ds * (1.0 - t * t)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _dkdv_tile(dk, dv, k, v, Qb, DOb, Lb, Db, QK_SCALE: tl.constexpr, cols, keep, u, ub, ue, part, MASK: tl.constexpr,
               rok, cn, rid, CIb, rtp, RT: tl.constexpr, CAPF: tl.constexpr):
    ok = cols < Q_LEN
    q = _load_rows(Qb, cols, ok, Q_ROW, MASK == 0)
    do = _load_rows(DOb, cols, ok, Q_ROW, MASK == 0)
    lse2 = tl.load(Lb + cols, mask=ok, other=0.0) * LOG2E
    delta = tl.load(Db + cols, mask=ok, other=0.0)
    st = tl.dot(k, tl.trans(q), input_precision=PREC)
    if CAPF > 0:
        t = _tanh(st * CAPF)
        st = t / CAPF
    pt = tl.math.exp2(st * QK_SCALE - lse2[None, :])
    if MASK == 1:
        pt = tl.where(keep, pt, 0.0)
    if MASK == 2:
        if part:
            pt = tl.where(_in_range(u, ub, ue), pt, 0.0)
    if RT > 0:
        if rtp:  # rows are keys here: their ranges and ids are over queries
            pt = tl.where(_runtime_keep(cols, rok, cn, rid, CIb, RT), pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = pt * (dpt - delta[None, :])
    if CAPF > 0:
        dst = dst * (1.0 - t * t)
    dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _sddmm_tile(q, Kb, Srow, valid, cols, keep, slot, IS_FULL: tl.constexpr, STORE_ALL: tl.constexpr):
    k = _load_rows(Kb, cols, cols < KV_LEN, KV_ROW, IS_FULL)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if STORE_ALL:  # residual blocks: every slot of the block, 0 where the bit is clear
        tl.store(Srow[:, None] + slot, tl.where(keep, s, 0.0).to(Srow.dtype.element_ty), mask=valid[:, None])
    else:
        tl.store(Srow[:, None] + slot, s.to(Srow.dtype.element_ty), mask=valid[:, None] & keep)


@triton.jit
def _spmm_tile(acc, Prow, Vb, cols, keep, slot, IS_FULL: tl.constexpr):
    v = _load_rows(Vb, cols, cols < KV_LEN, KV_ROW, IS_FULL)
    p = tl.load(Prow[:, None] + slot, mask=keep, other=0.0)
    acc += tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc
'''
