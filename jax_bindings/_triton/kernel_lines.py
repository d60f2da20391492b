"""Lines of Triton source that the 1-D kernels (:mod:`jax_bindings._triton.render`) and the grid
kernels (:mod:`jax_bindings._triton.grid_render`) share around their key walks.

They read the names both walks define: ``b``, ``h`` / ``hk``, ``bq`` / ``bk`` (the row slab's
offset), ``rows`` and ``valid`` (the program's rows), ``offs_d`` and the walk's accumulators.
"""

def tile_constants(rows: int, cols: int, q_len: int, kv_len: int, spec) -> str:
    """The module constants the shared tile functions (:mod:`jax_bindings._triton.tile_source`)
    read, for a spec with ``num_heads``, ``num_kv_heads``, ``head_dim``, ``group``, ``block_d``."""
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    values = [
        ("ROWS", rows),
        ("COLS", cols),
        ("Q_LEN", q_len),
        ("KV_LEN", kv_len),
        ("H", h),
        ("HKV", hkv),
        ("GROUP", spec.group),
        ("D", d),
        ("BLOCK_D", spec.block_d),
        ("EVEN_D", spec.block_d == d),
        ("Q_ROW", h * d),
        ("KV_ROW", hkv * d),
        ("LOG2E", 1.4426950408889634),
        ("LN2", 0.6931471805599453),
    ]
    return "".join(f"{name} = tl.constexpr({value})\n" for name, value in values)


# forward: normalise; fully masked rows give 0 and lse -inf
FWD_EPILOGUE = [
    "# -- epilogue: normalise; fully masked rows give 0 and lse -inf",
    "l_use = tl.where(l_i > 0, l_i, 1.0)",
    "out = acc / l_use[:, None]",
    "lse = tl.where(l_i > 0, (m_i + tl.math.log2(l_use)) * LN2, float('-inf'))",
    "o_ptrs = Out + bq + rows[:, None] * Q_ROW + offs_d[None, :]",
    "tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=valid[:, None] & (offs_d < D)[None, :])",
    "tl.store(Lse + (b * H + h).to(tl.int64) * Q_LEN + rows, lse, mask=valid)",
]

# dq: the rows' dO, lse and delta = rowsum(dO * O), stored for the dk/dv kernel; dq zeroed
DQ_PROLOGUE = [
    "do = _load_rows(DO + bq, rows, valid, Q_ROW, False)",
    "lrow = (b * H + h).to(tl.int64) * Q_LEN + rows",
    "lse2 = tl.load(Lse + lrow, mask=valid, other=0.0) * LOG2E",
    "# delta = rowsum(dO * O), computed once here and stored for the dk/dv kernel",
    "o = _load_rows(Out + bq, rows, valid, Q_ROW, False)",
    "delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)",
    "tl.store(Delta + lrow, delta, mask=valid)",
    "dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)",
]

DQ_EPILOGUE = [
    "dq = dq * SCALE",
    "tl.store(DQ + bq + rows[:, None] * Q_ROW + offs_d[None, :], dq.to(DQ.dtype.element_ty),"
    " mask=valid[:, None] & (offs_d < D)[None, :])",
]

# dk/dv: the query head g of the key head's group, whose slabs the walk reads
DKDV_GROUP_LOOP = [
    "for g in range(0, GROUP):",
    "    h = hk * GROUP + g",
    "    Qb = Q + b.to(tl.int64) * (Q_LEN * Q_ROW) + h * D",
    "    DOb = DO + b.to(tl.int64) * (Q_LEN * Q_ROW) + h * D",
    "    Lb = Lse + (b * H + h).to(tl.int64) * Q_LEN",
    "    Db = Delta + (b * H + h).to(tl.int64) * Q_LEN",
]

DKDV_EPILOGUE = [
    "dk = dk * SCALE",
    "omask = valid[:, None] & (offs_d < D)[None, :]",
    "tl.store(DK + bk + rows[:, None] * KV_ROW + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=omask)",
    "tl.store(DV + bk + rows[:, None] * KV_ROW + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=omask)",
]
