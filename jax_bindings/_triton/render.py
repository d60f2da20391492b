# ruff: noqa: E501  (lines of generated Triton source are kept whole, for readable output)
"""Renders Triton source text from a :class:`~jax_bindings._triton.spec.KernelSpec`.

Structure (which segments, their modes, closed-form laws, residual, row
permutation, shapes) is decided here, in Python, and baked into the text;
tile sizes and flags stay ``tl.constexpr``. Every op shares one row-block
walk: per segment, per-row ranges ``[ub, ue)`` in compressed column space,
the block's key tiles in one loop (edge tiles mask under a run-time test,
interior tiles lie inside every row's range and skip masking) or in partial /
full / partial runs, then the residual's key blocks. Each op has one renderer
(``_KERNELS``: op -> its signature and body); the prologue (row block, rows,
static asserts), the tile functions and the header are shared.
"""

from __future__ import annotations

import math
import textwrap

from acsr import Law
from jax_bindings._triton import grid_render, kernel_lines
from jax_bindings._triton.grid_plan import GridSpec
from jax_bindings._triton.spec import KernelSpec, SegSpec, pow2_ceil
from jax_bindings._triton.tile_source import TILES

_BIG = 2147483647


def _law(law: Law, r: str = "rows") -> str:
    terms = []
    if law.a:
        terms.append(f"{law.a} * {r}")
    if law.b:
        inner = f"({r} + {law.e})" if law.e else r
        terms.append(f"{law.b} * ({inner} // {law.div})")
    terms.append(str(law.c))
    x = " + ".join(terms)
    if law.a == 0 and law.b == 0:
        x = f"tl.full([BLOCK_M], {law.c}, tl.int32)"
    if law.lo is not None:
        x = f"tl.maximum({x}, {law.lo})"
    if law.hi is not None:
        x = f"tl.minimum({x}, {law.hi})"
    return x


def _rowinfo(k: int, s: SegSpec) -> list[str]:
    """Lines defining b{k} (first column), n{k} (count) and, if per-row, s{k} (stride)."""
    L = []
    if s.source == "arrays":
        L.append(f"b{k} = tl.load(Base{k} + rows, mask=valid, other=0)")
        L.append(f"n{k} = tl.load(Cnt{k} + rows, mask=valid, other=0)")
        if s.stride == 0:
            L.append(f"s{k} = tl.load(Str{k} + rows, mask=valid, other=1)")
    else:
        L.append(f"b{k} = tl.zeros([BLOCK_M], dtype=tl.int32)")
        L.append(f"n{k} = tl.zeros([BLOCK_M], dtype=tl.int32)")
        if s.stride == 0:
            L.append(f"s{k} = tl.full([BLOCK_M], 1, tl.int32)")
        for p in s.pieces:
            L.append(
                f"# rows [{p.row_start}, {p.row_stop}): base = {p.base.to_string()}, end = {p.end.to_string()}"
            )
            L.append(f"inp = (rows >= {p.row_start}) & (rows < {p.row_stop})")
            L.append(f"bp = {_law(p.base)}")
            L.append(f"ep = {_law(p.end)}")
            L.append(f"b{k} = tl.where(inp, bp, b{k})")
            L.append(f"n{k} = tl.where(inp, (tl.maximum(ep - bp, 0) + {p.stride - 1}) // {p.stride}, n{k})")
            if s.stride == 0:
                L.append(f"s{k} = tl.where(inp, {p.stride}, s{k})")
    L.append(f"n{k} = tl.where(valid, n{k}, 0)")
    return L


def _stride_expr(k: int, s: SegSpec) -> str:
    return f"s{k}" if s.stride == 0 else str(s.stride)


def _ranges(k: int, s: SegSpec, loop: str) -> list[str]:
    """Lines defining ph{k}, ub{k}, ue{k} and the tile counts fa{k} <= fb{k} <= nt{k}."""
    L = []
    if s.mode == "dense":
        L += [f"ph{k} = 0", f"ub{k} = b{k}", f"ue{k} = b{k} + n{k}"]
    elif s.mode == "aligned":
        L += [
            f"ph{k} = tl.max(tl.where(n{k} > 0, b{k} % {s.stride}, 0), 0)",
            f"ub{k} = b{k} // {s.stride}",
            f"ue{k} = ub{k} + n{k}",
        ]
    else:
        L += [
            f"ph{k} = 0",
            f"ub{k} = b{k}",
            f"ue{k} = tl.where(n{k} > 0, b{k} + (n{k} - 1) * {_stride_expr(k, s)} + 1, b{k})",
        ]
    L += [
        f"hi{k} = tl.max(tl.where(n{k} > 0, ue{k}, 0), 0)",
        f"lo{k} = tl.minimum(tl.min(tl.where(n{k} > 0, ub{k}, {_BIG}), 0), hi{k})",
        f"nt{k} = (hi{k} - lo{k} + BLOCK_N - 1) // BLOCK_N",
    ]
    if loop != "single":
        L += [
            f"flo{k} = tl.max(tl.where(valid, ub{k}, 0), 0)",
            f"fhi{k} = tl.min(tl.where(valid, ue{k}, {_BIG}), 0)",
            f"fa{k} = tl.minimum((tl.maximum(flo{k} - lo{k}, 0) + BLOCK_N - 1) // BLOCK_N, nt{k})",
            f"fb{k} = tl.maximum(fa{k}, tl.minimum(tl.maximum(fhi{k} - lo{k}, 0) // BLOCK_N, nt{k}))",
        ]
    return L


def _tile_prelude(k: int, s: SegSpec, kind: str, need_slot: bool, runtime: bool = False) -> list[str]:
    """Lines defining u, cols and (``kind`` "partial", or "full" for the unfused ops) keep, slot;
    with a runtime mask also rtp, whether the tile crosses a row's runtime range."""
    ls = s.stride if s.mode == "aligned" else 1
    L = [f"u = lo{k} + i * BLOCK_N + offs_n", f"cols = ph{k} + {ls} * u" if ls != 1 else "cols = u"]
    if runtime:
        c0 = f"ph{k} + {ls} * (lo{k} + i * BLOCK_N)" if ls != 1 else f"lo{k} + i * BLOCK_N"
        c1 = (
            f"ph{k} + {ls} * (lo{k} + i * BLOCK_N + BLOCK_N - 1) + 1"
            if ls != 1
            else f"lo{k} + i * BLOCK_N + BLOCK_N"
        )
        L.append(f"rtp = ({c0} < rt_in_lo) | ({c1} > rt_in_hi)")
    rel = f"u[None, :] - ub{k}[:, None]"
    if kind == "full" and need_slot:
        L.append("keep = valid[:, None]")
    elif kind == "partial":
        cond = f"(u[None, :] >= ub{k}[:, None]) & (u[None, :] < ue{k}[:, None])"
        if s.mode == "modular":
            st = f"s{k}[:, None]" if s.stride == 0 else str(s.stride)
            cond += f" & (({rel}) % {st} == 0)"
        L.append(f"keep = {cond}")
    if need_slot:
        if s.mode == "modular":
            st = f"s{k}[:, None]" if s.stride == 0 else str(s.stride)
            L.append(f"slot = {s.slot_offset} + ({rel}) // {st}")
        else:
            L.append(f"slot = {s.slot_offset} + {rel}")
    return L


# Tile-function mask arguments (cols, keep, u, ub, ue, part, MASK) per tile kind; see _fwd_tile.
_MASK_ARGS = {
    "full": "cols, None, None, None, None, None, MASK=0",
    "partial": "cols, keep, None, None, None, None, MASK=1",
    "lazy": "cols, None, u, ub{k}, ue{k}, (i < fa{k}) | (i >= fb{k}), MASK=2",
}


def _runtime_tiles(k: int, s: SegSpec) -> list[str]:
    """Lines defining ra{k} <= i < rb{k}: segment k's tiles that reach the row block's runtime range."""
    if s.mode == "aligned":  # col = ph + stride * u: the range in compressed columns first
        st = s.stride
        return [
            f"rua = (tl.maximum(rt_lo - ph{k}, 0) + {st - 1}) // {st}",
            f"rub = (tl.maximum(rt_hi - ph{k}, 0) + {st - 1}) // {st}",
            f"ra{k} = tl.maximum(rua - lo{k}, 0) // BLOCK_N",
            f"rb{k} = (tl.maximum(rub - lo{k}, 0) + BLOCK_N - 1) // BLOCK_N",
        ]
    return [
        f"ra{k} = tl.maximum(rt_lo - lo{k}, 0) // BLOCK_N",
        f"rb{k} = (tl.maximum(rt_hi - lo{k}, 0) + BLOCK_N - 1) // BLOCK_N",
    ]


def _runtime_prologue(spec: KernelSpec) -> list[str]:
    """The row block's runtime bounds (see the glossary); needs ``b`` (batch row) defined."""
    if not spec.runtime:
        return []
    L = [
        "# -- runtime mask: the columns this block may see, [rt_lo, rt_hi), bound the tiles walked;",
        "#    tiles inside [rt_in_lo, rt_in_hi), seen by every row, skip the mask",
        "cn = tl.load(RtColLen + b)",
        "rok = valid & (rows < tl.load(RtRowLen + b))",
        "any_rok = tl.max(rok.to(tl.int32), 0) > 0",
        "rt_lo = 0",
        "rt_hi = tl.where(any_rok, cn, 0)",
        "rt_in_lo = tl.where(tl.min(tl.where(valid, rok, True).to(tl.int32), 0) > 0, 0, COLS)  # a padded row: mask all",
        "rt_in_hi = cn",
    ]
    if spec.runtime == "ids":
        L += [
            "rid = tl.load(RowIds + b * ROWS + rows, mask=valid, other=0)",
            "CIb = ColIds + b * COLS",
            "# sorted ids (RtExact): rows with ids in [id_lo, id_hi] see the columns with ids in it, and",
            "# every row sees those with ids in [id_hi, id_lo] (empty unless one document spans the block)",
            f"id_lo = tl.min(tl.where(rok, rid, {_BIG}), 0)",
            f"id_hi = tl.max(tl.where(rok, rid, -{_BIG}), 0)",
            "exact = tl.load(RtExact + b) != 0",
            "first_lo, end_hi, first_hi, end_lo = _document_bounds(CIb, id_lo, id_hi)",
            "rt_lo = tl.where(exact, first_lo, 0)",
            "rt_hi = tl.where(exact, tl.minimum(end_hi, rt_hi), rt_hi)",
            "rt_in_lo = tl.where(exact, tl.maximum(first_hi, rt_in_lo), COLS)",
            "rt_in_hi = tl.where(exact, tl.minimum(end_lo, rt_in_hi), 0)",
        ]
    else:
        L += ["rid = rok", "CIb = RtExact"]  # unused (RT == 1)
    return L


def _runtime_args(spec: KernelSpec, rtp: str = "rtp") -> str:
    """The tile functions' runtime-mask arguments."""
    if not spec.runtime:
        return "rok=None, cn=None, rid=None, CIb=None, rtp=False, RT=0, CAPF=CAPF"
    rt = 1 if spec.runtime == "ranges" else 2
    return f"rok=rok, cn=cn, rid=rid, CIb=CIb, rtp={rtp}, RT={rt}, CAPF=CAPF"


def _loop(spec: KernelSpec, s: SegSpec, fused_op: bool) -> str:
    """The tile walk of one segment: "fused", "split" or "single" (see KernelSpec.loop)."""
    if s.mode == "modular":
        return "single"
    if spec.loop == "fused" and not fused_op:
        return "split"
    return spec.loop


def _walk(spec: KernelSpec, call: str, need_slot: bool, res_call: str | None = None) -> list[str]:
    """The per-segment tile loops and the residual loop.

    ``call`` is the tile call with ``{MASK}`` (fused attention kernels: the tile
    function's mask arguments) or ``{FULL}`` (unfused ops: the IS_FULL flag).
    """
    fused_op = "{MASK}" in call
    runtime = bool(spec.runtime) and fused_op
    rt_args = ", " + _runtime_args(spec) if fused_op else ""
    L = []
    for k, s in enumerate(spec.segments):
        loop = _loop(spec, s, fused_op)
        L.append(
            f"# -- segment {k}: {s.mode}, stride {s.stride or 'per row'}, {s.source}, slots [{s.slot_offset}, +{s.width}), {loop} loop"
        )
        if loop == "split":
            runs = (("0", f"fa{k}", "partial"), (f"fa{k}", f"fb{k}", "full"), (f"fb{k}", f"nt{k}", "partial"))
        else:
            runs = (("0", f"nt{k}", "lazy" if loop == "fused" else "partial"),)
        if runtime:
            L += _runtime_tiles(k, s)
            runs = tuple((f"tl.maximum({a}, ra{k})", f"tl.minimum({b}, rb{k})", kind) for a, b, kind in runs)
        for a, b, kind in runs:
            L.append(f"for i in range({a}, {b}):")
            text = call.format(FULL=kind == "full", MASK=_MASK_ARGS[kind].format(k=k) + rt_args)
            body = _tile_prelude(k, s, kind, need_slot, runtime) + [text]
            L += ["    " + x for x in body]
    if spec.residual is not None:
        r = spec.residual
        L += [
            f"# -- residual: {r.block_q}x{r.block_kv} blocks, up to {r.max_blocks} per row block",
            f"rb = (pid_m * BLOCK_M) // {r.block_q}",
            f"a0 = (pid_m * BLOCK_M) % {r.block_q}",
            "nb = tl.load(ResNB + rb)" if res_call is None else f"nb = {r.max_blocks}",
            f"offs_r = tl.arange(0, {r.block_kv})",
            "for j in range(0, nb):",
            f"    kbj = tl.load(ResKB + rb * {r.max_blocks} + j)",
            f"    cols = tl.maximum(kbj, 0) * {r.block_kv} + offs_r",
            f"    bits = tl.load(ResBits + ((rb * {r.max_blocks} + j) * {r.block_q} + a0 + offs_m)[:, None] * {r.block_kv}"
            " + offs_r[None, :], mask=valid[:, None], other=0)",
            "    keep = (bits != 0) & valid[:, None]",
        ]
        if need_slot:
            L.append(f"    slot = {r.slot_offset} + j * {r.block_kv} + offs_r[None, :] + 0 * offs_m[:, None]")
        if runtime:
            L.append(
                f"    rtp = (tl.maximum(kbj, 0) * {r.block_kv} < rt_in_lo) | ((tl.maximum(kbj, 0) + 1) * {r.block_kv} > rt_in_hi)"
            )
        L.append("    " + (res_call or call).format(FULL=False, MASK=_MASK_ARGS["partial"] + rt_args))
    return L


def _rows_prologue(spec: KernelSpec) -> list[str]:
    if spec.ordered:  # heaviest row blocks first, all heads of one block side by side
        L = ["pid_bh = tl.program_id(0)", "pid_m = tl.load(Order + tl.program_id(1))"]
    else:
        L = ["pid_m = tl.program_id(0)", "pid_bh = tl.program_id(1)"]
    L += [
        "offs_m = tl.arange(0, BLOCK_M)",
        "offs_n = tl.arange(0, BLOCK_N)",
        "offs_d = tl.arange(0, BLOCK_D)",
        "pos = pid_m * BLOCK_M + offs_m",
    ]
    if spec.permuted:
        L += ["rows = tl.load(Perm + pos)", "valid = rows >= 0", "rows = tl.where(valid, rows, 0)"]
    else:
        L += ["valid = pos < ROWS", "rows = tl.where(valid, pos, 0)"]
    return L


def _segments_rowinfo(spec: KernelSpec, fused_op: bool) -> list[str]:
    L = []
    for k, s in enumerate(spec.segments):
        L += _rowinfo(k, s) + _ranges(k, s, _loop(spec, s, fused_op))
    return L


def _indent(lines: list[str], n: int) -> str:
    return "\n".join((" " * n + x) if x else x for x in lines)


def _asserts(spec: KernelSpec) -> list[str]:
    L = [
        "tl.static_assert(BLOCK_N >= 16, 'tl.dot needs tiles of 16 or more')",
        "tl.static_assert(BLOCK_M >= 16, 'tl.dot needs tiles of 16 or more')",
    ]
    if spec.permuted:
        L.append(
            f"tl.static_assert(BLOCK_M == {spec.block_m}, 'the row permutation pads phase groups to {spec.block_m}')"
        )
    if spec.residual is not None:
        L.append(
            f"tl.static_assert({spec.residual.block_q} % BLOCK_M == 0, 'a row block must sit inside one residual block')"
        )
    return L


def _header(spec: KernelSpec) -> str:
    q_len, kv_len = (spec.cols, spec.rows) if spec.op == "bwd_dkdv" else (spec.rows, spec.cols)
    H, HKV, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    p1 = min(256, max(16, pow2_ceil(math.isqrt(spec.cols - 1) + 1)))  # ~sqrt(COLS) probes
    step = -(-spec.cols // p1)
    p2 = max(2, pow2_ceil(step))
    segs = (
        "\n".join(
            f"#   segment {k}: mode={s.mode} stride={s.stride or 'per-row'} source={s.source} width={s.width}"
            for k, s in enumerate(spec.segments)
        )
        or "#   (no segments)"
    )
    res = "none" if spec.residual is None else repr(spec.residual)
    header = textwrap.dedent(f"""\
        # Generated by jax_bindings._triton -- do not edit, do not commit (regenerated from a KernelSpec).
        # op={spec.op} rows={spec.rows} cols={spec.cols} dtype={spec.dtype} D={D} H={H} HKV={HKV}
        {{segs}}
        #   residual: {res}; row permutation: {spec.permuted}
        #
        # Glossary
        #   ROWS, COLS   rows and columns of the ACSR layout the kernel walks (for bwd_dkdv the
        #                transposed layout: rows are keys, columns are queries)
        #   Q_LEN/KV_LEN query / key sequence lengths; q, k, v, out are [B, S, heads, D] in place
        #   GROUP        query heads per key/value head (GQA); head h reads kv head h // GROUP
        #   BLOCK_M      rows per program; BLOCK_N columns per key tile; BLOCK_D padded head dim
        #   rows, valid  original row index of each program row (after the stride-phase
        #                permutation) and whether it is a real row (False: padding)
        #   b<k>, n<k>   segment k's first column and column count per row (baked-in law or
        #                per-row arrays); s<k> its per-row stride where strides vary
        #   ph, ub, ue   column phase and per-row range [ub, ue) in compressed column space u:
        #                col = ph + stride * u for aligned segments, col = u otherwise
        #   fa, fb, nt   tiles [0, fa) and [fb, nt) are partial (masked), [fa, fb) full
        #   MASK         0: full tile, no masking; 1: mask with the given keep; 2: build the
        #                range mask from (u, ub, ue) only when the run-time flag part is set
        #   IS_FULL      (unfused ops, loads) the tile lies inside every row's range
        #   keep         [BLOCK_M, BLOCK_N] membership of (row, column) in the mask
        #   slot         value-array slot of (row, column) for the unfused ops
        #   RT           runtime mask (fused ops): 0 none; 1 lengths (rok: rows below RtRowLen[b],
        #                cn = RtColLen[b]: columns at or past it unseen); 2 also segment ids
        #                (RowIds [B, ROWS] == ColIds [B, COLS]); [rt_lo, rt_hi) bounds the tiles
        #                walked; rtp: the tile is not inside [rt_in_lo, rt_in_hi) and is masked
        #   CAPF         SCALE / logits soft cap (0: none): scores become tanh(s * CAPF) / CAPF
        #   SEARCH_*     _document_bounds' two-level search of sorted ColIds: SEARCH_P1 probes every
        #                SEARCH_STEP ids, then SEARCH_P2 (>= SEARCH_STEP) ids of one stretch
        import triton
        import triton.language as tl

        {{constants}}NNZ = tl.constexpr({spec.nnz_max})
        SEARCH_P1 = tl.constexpr({p1})
        SEARCH_STEP = tl.constexpr({step})
        SEARCH_P2 = tl.constexpr({p2})
        """)
    constants = kernel_lines.tile_constants(spec.rows, spec.cols, q_len, kv_len, spec)
    return header.replace("{segs}", segs).replace("{constants}", constants)


# The fused kernels' trailing constexpr parameters (see jax_bindings._triton.ops._scalars).
_FUSED_SCALARS = "SCALE: tl.constexpr, CAPF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr"


def _rt_sig(spec: KernelSpec) -> str:
    return "".join(f"{n}, " for n in spec.runtime_names())


def _row_block_head(kv: str, *, load_q: bool) -> list[str]:
    """Opening lines of a query-row kernel: batch/head indices, the row block's Q offset,
    base pointers of the key/value tensors named in ``kv`` ("K", "V" or "KV"), and Q's rows."""
    lines = [
        "b = pid_bh // H",
        "h = pid_bh % H",
        "hk = h // GROUP",
        "bq = b.to(tl.int64) * (Q_LEN * Q_ROW) + h * D",
    ]
    lines += [f"{t}b = {t} + b.to(tl.int64) * (KV_LEN * KV_ROW) + hk * D" for t in kv]
    if load_q:
        lines.append("q = _load_rows(Q + bq, rows, valid, Q_ROW, False)")
    return lines


def _fwd(spec: KernelSpec, meta: str) -> tuple[str, list[str]]:
    """Fused forward: ``(Q, K, V) -> (Out, Lse)``, online softmax over the row block's key tiles."""
    sig = f"Q, K, V, {_rt_sig(spec)}{meta}Out, Lse, {_FUSED_SCALARS}"
    body = (
        _row_block_head("KV", load_q=True)
        + _runtime_prologue(spec)
        + [
            "m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)",
            "l_i = tl.zeros([BLOCK_M], tl.float32)",
            "acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)",
        ]
        + _segments_rowinfo(spec, True)
        + _walk(
            spec,
            "acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, Kb, Vb, SCALE * LOG2E, {MASK})",
            False,
        )
        + kernel_lines.FWD_EPILOGUE
    )
    return sig, body


def _bwd_dq(spec: KernelSpec, meta: str) -> tuple[str, list[str]]:
    """Backward over query rows: ``dQ`` and ``Delta = rowsum(dO * O)`` (stored for the dk/dv kernel)."""
    sig = f"Q, K, V, DO, Out, Lse, {_rt_sig(spec)}{meta}DQ, Delta, {_FUSED_SCALARS}"
    body = (
        _row_block_head("KV", load_q=True)
        + _runtime_prologue(spec)
        + kernel_lines.DQ_PROLOGUE
        + _segments_rowinfo(spec, True)
        + _walk(
            spec,
            "dq = _dq_tile(dq, q, do, lse2, delta, Kb, Vb, SCALE * LOG2E, {MASK})",
            False,
        )
        + kernel_lines.DQ_EPILOGUE
    )
    return sig, body


def _bwd_dkdv(spec: KernelSpec, meta: str) -> tuple[str, list[str]]:
    """Backward over key rows (the transposed layout): ``dK``, ``dV``, summed over the GQA group."""
    sig = f"Q, K, V, DO, Lse, Delta, {_rt_sig(spec)}{meta}DK, DV, {_FUSED_SCALARS}"
    walk = _walk(
        spec,
        "dk, dv = _dkdv_tile(dk, dv, k, v, Qb, DOb, Lb, Db, SCALE * LOG2E, {MASK})",
        False,
    )
    body = (
        [
            "b = pid_bh // HKV",
            "hk = pid_bh % HKV",
            "bk = b.to(tl.int64) * (KV_LEN * KV_ROW) + hk * D",
            "k = _load_rows(K + bk, rows, valid, KV_ROW, False)",
            "v = _load_rows(V + bk, rows, valid, KV_ROW, False)",
            "dk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)",
            "dv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)",
        ]
        + _runtime_prologue(spec)
        + _segments_rowinfo(spec, True)
        + kernel_lines.DKDV_GROUP_LOOP
        + ["    " + x for x in walk]
        + kernel_lines.DKDV_EPILOGUE
    )
    return sig, body


def _sddmm(spec: KernelSpec, meta: str) -> tuple[str, list[str]]:
    """Scores ``q . k`` at the mask's value slots; padding slots written 0."""
    sig = f"Q, K, {meta}S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr"
    zero = []
    for k, s in enumerate(spec.segments):
        zero += [
            f"for t0 in range(0, {s.width}, BLOCK_N):",
            "    t = t0 + offs_n",
            f"    z = valid[:, None] & (t[None, :] >= n{k}[:, None]) & (t[None, :] < {s.width})",
            f"    tl.store(Srow[:, None] + {s.slot_offset} + t[None, :], tl.zeros([BLOCK_M, BLOCK_N], S.dtype.element_ty), mask=z)",
        ]
    body = (
        _row_block_head("K", load_q=True)
        + [
            "Srow = S + ((b * H + h).to(tl.int64) * ROWS + rows) * NNZ",
        ]
        + _segments_rowinfo(spec, False)
        + _walk(
            spec,
            "_sddmm_tile(q, Kb, Srow, valid, cols, keep, slot, IS_FULL={FULL}, STORE_ALL=False)",
            True,
            res_call="_sddmm_tile(q, Kb, Srow, valid, cols, keep, slot, IS_FULL={FULL}, STORE_ALL=True)",
        )
        + ["# -- padding slots: 0"]
        + zero
    )
    return sig, body


def _spmm(spec: KernelSpec, meta: str) -> tuple[str, list[str]]:
    """``P . V`` over the value slots: ``Out [B, Sq, H, D]``."""
    sig = f"P, V, {meta}Out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr"
    body = (
        _row_block_head("V", load_q=False)
        + [
            "Prow = P + ((b * H + h).to(tl.int64) * ROWS + rows) * NNZ",
            "acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)",
        ]
        + _segments_rowinfo(spec, False)
        + _walk(spec, "acc = _spmm_tile(acc, Prow, Vb, cols, keep, slot, IS_FULL={FULL})", True)
        + [
            "tl.store(Out + bq + rows[:, None] * Q_ROW + offs_d[None, :], acc.to(Out.dtype.element_ty),"
            " mask=valid[:, None] & (offs_d < D)[None, :])",
        ]
    )
    return sig, body


def _softmax_step(phase: int, slot: str, in_width: str) -> list[str]:
    if phase == 1:
        return [
            "    m_new = tl.maximum(m_i, tl.max(x, 1))",
            "    m_u = tl.where(m_new == float('-inf'), 0.0, m_new)",
            "    l_i = l_i * tl.math.exp2(m_i - m_u) + tl.sum(tl.math.exp2(x - m_u[:, None]), 1)",
            "    m_i = m_new",
        ]
    return [
        "    p = tl.math.exp2(x - m_use[:, None]) * l_inv[:, None]",
        "    p = tl.where(ok, p, 0.0)",
        f"    tl.store(Prow[:, None] + {slot}, p.to(P.dtype.element_ty), mask=valid[:, None] & {in_width})",
    ]


def _softmax(spec: KernelSpec, meta: str) -> tuple[str, list[str]]:
    """Row softmax over the value slots, two passes (max and sum, then normalise and store)."""
    sig = f"S, {meta}P, SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr"
    passes = []
    for phase in (1, 2):
        for k, s in enumerate(spec.segments):
            passes += [
                f"for t0 in range(0, {s.width}, BLOCK_N):",
                "    t = t0 + offs_n",
                f"    ok = valid[:, None] & (t[None, :] < n{k}[:, None])",
                f"    x = tl.load(Srow[:, None] + {s.slot_offset} + t[None, :], mask=ok, other=0.0).to(tl.float32) * (SCALE * LOG2E)",
                "    x = tl.where(ok, x, float('-inf'))",
            ]
            passes += _softmax_step(phase, f"{s.slot_offset} + t[None, :]", f"(t[None, :] < {s.width})")
        if spec.residual is not None:
            r = spec.residual
            passes += [
                f"for j in range(0, {r.max_blocks}):",
                f"    bits = tl.load(ResBits + ((rb * {r.max_blocks} + j) * {r.block_q} + a0 + offs_m)[:, None] * {r.block_kv}"
                " + offs_r[None, :], mask=valid[:, None], other=0)",
                "    ok = (bits != 0) & valid[:, None]",
                f"    x = tl.load(Srow[:, None] + {r.slot_offset} + j * {r.block_kv} + offs_r[None, :], mask=ok, other=0.0).to(tl.float32) * (SCALE * LOG2E)",
                "    x = tl.where(ok, x, float('-inf'))",
            ]
            passes += _softmax_step(
                phase, f"{r.slot_offset} + j * {r.block_kv} + offs_r[None, :]", "(offs_r[None, :] >= 0)"
            )
        if phase == 1:
            passes += [
                "m_use = tl.where(m_i == float('-inf'), 0.0, m_i)",
                "l_inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)",
            ]
    res = []
    if spec.residual is not None:
        r = spec.residual
        res = [
            f"rb = (pid_m * BLOCK_M) // {r.block_q}",
            f"a0 = (pid_m * BLOCK_M) % {r.block_q}",
            f"offs_r = tl.arange(0, {r.block_kv})",
        ]
    body = (
        [
            "b = pid_bh // H",
            "h = pid_bh % H",
            "Srow = S + ((b * H + h).to(tl.int64) * ROWS + rows) * NNZ",
            "Prow = P + ((b * H + h).to(tl.int64) * ROWS + rows) * NNZ",
            "m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)",
            "l_i = tl.zeros([BLOCK_M], tl.float32)",
        ]
        + res
        + [x for k, s in enumerate(spec.segments) for x in _rowinfo(k, s)]
        + passes
    )
    return sig, body


# One renderer per op: (spec, metadata arguments "Base0, Cnt0, ...") -> (signature, body after the
# shared prologue: row block, rows and validity, static asserts).
_KERNELS = {
    "fwd": _fwd,
    "bwd_dq": _bwd_dq,
    "bwd_dkdv": _bwd_dkdv,
    "sddmm": _sddmm,
    "spmm": _spmm,
    "softmax": _softmax,
}


def _kernel(spec: KernelSpec) -> str:
    meta = "".join(f"{m}, " for m in spec.meta_names())
    sig, body = _KERNELS[spec.op](spec, meta)
    body = _rows_prologue(spec) + _asserts(spec) + body
    return f"\n\n@triton.jit\ndef kernel({sig}):\n" + _indent(body, 4) + "\n"


def render(spec: KernelSpec | GridSpec) -> str:
    """Triton source text of ``spec``'s kernel (a module defining ``kernel``); grid specs
    are rendered by :mod:`jax_bindings._triton.grid_render`."""
    if isinstance(spec, GridSpec):
        return grid_render.render(spec)
    if spec.op not in _KERNELS:
        raise ValueError(f"spec.op must be one of {tuple(_KERNELS)}, got {spec.op!r}")
    prec = '"ieee"' if spec.dtype == "float32" else '"tf32"'
    return _header(spec) + TILES.replace("input_precision=PREC", f"input_precision={prec}") + _kernel(spec)
