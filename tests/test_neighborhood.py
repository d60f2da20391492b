"""N-D neighborhood masks (NATTEN semantics) and grid-shaped neighborhood attention.

The reference mask here is written from the definition alone, with plain Python
loops over each query's coordinates and each axis's phase sub-grid; it shares
no code with ``splat._neighborhood``.
"""

from __future__ import annotations

import doctest
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import assert_close, attention_dense_grads, attention_grads_ref, attention_ref, refusal_skips

import acsr
import splat
from splat import _neighborhood, _neighborhood_attention, masks

# -----------------------------------------------------------------------------
# reference, from the definition
# -----------------------------------------------------------------------------


def reference_axis_keys(x: int, n: int, k: int, s: int, d: int, causal: bool) -> set[int]:
    """Key coordinates a query at ``x`` sees along one axis of length ``n``."""
    sub = [y for y in range(n) if y % d == x % d]  # the query's phase sub-grid
    pos = sub.index(x)
    group = list(range(pos - pos % s, min(pos - pos % s + s, len(sub))))
    if causal:
        nominal = group[0] + s - 1  # the group's last query
        leader = nominal if nominal < len(sub) else len(sub) - 1
        return {sub[j] for j in range(len(sub)) if j <= pos and leader - k < j}
    nominal = group[0] + s // 2  # the group's centre (right-hand one for even s)
    leader = nominal if nominal < len(sub) else len(sub) - 1
    lo, hi = leader - k // 2, leader + (k - 1) // 2
    while lo < 0:  # shift the window inside the sub-grid
        lo, hi = lo + 1, hi + 1
    while hi > len(sub) - 1:
        lo, hi = lo - 1, hi - 1
    return {sub[j] for j in range(lo, hi + 1)}


def _per_axis(v, m):
    return tuple(v) if isinstance(v, tuple | list) else (v,) * m


def reference_mask(grid, kernel_size, stride=1, dilation=1, is_causal=False) -> np.ndarray:
    """Boolean ``[S, S]`` over the row-major tokens of ``grid``."""
    m = len(grid)
    k, s, d, c = (_per_axis(v, m) for v in (kernel_size, stride, dilation, is_causal))
    size = int(np.prod(grid))
    out = np.zeros((size, size), bool)
    for i, x in enumerate(itertools.product(*(range(n) for n in grid))):
        per_axis = [reference_axis_keys(x[a], grid[a], k[a], s[a], d[a], c[a]) for a in range(m)]
        for y in itertools.product(*per_axis):
            out[i, np.ravel_multi_index(y, grid)] = True
    return out


def check_mask(grid, kernel_size, stride=1, dilation=1, is_causal=False):
    want = reference_mask(grid, kernel_size, stride, dilation, is_causal)
    m = masks.neighborhood(grid, kernel_size, stride=stride, dilation=dilation, is_causal=is_causal)
    size = want.shape[0]
    np.testing.assert_array_equal(m(np.arange(size)[:, None], np.arange(size)[None, :]), want)
    layout = m.to_acsr()
    np.testing.assert_array_equal(layout.to_dense(), want)
    layout.validate()
    assert layout == acsr.from_dense(want), "not the canonical layout of the mask"


# -----------------------------------------------------------------------------
# the constructor against the reference
# -----------------------------------------------------------------------------

CASES = [
    # 1-D
    ((13,), 5, 1, 1, False),
    ((13,), 4, 1, 1, False),  # even kernel
    ((13,), 13, 1, 1, False),  # kernel == axis
    ((14,), 3, 1, 4, False),  # dilation not dividing the axis
    ((11,), 5, 3, 1, False),  # partial last stride group
    ((12,), 6, 4, 1, False),  # even stride
    ((13,), 5, 2, 2, False),
    ((13,), 4, 1, 1, True),
    ((13,), 5, 3, 1, True),  # causal, partial last group
    ((17,), 3, 2, 5, True),
    ((9,), 1, 1, 1, False),
    # 2-D
    ((7, 9), 3, 1, 1, False),
    ((7, 9), (4, 2), 1, 1, False),
    ((8, 10), (3, 5), (2, 3), 1, False),
    ((9, 10), 3, 1, (2, 3), False),  # dilations that do not divide
    ((7, 9), (7, 9), 1, 1, False),  # kernel == grid
    ((7, 9), (7, 3), 1, 1, False),  # kernel == outer axis
    ((7, 9), (3, 9), 1, 1, False),  # kernel == last axis: rows of the window merge
    ((7, 9), 3, 1, 1, True),
    ((7, 9), 3, 1, 1, (True, False)),
    ((7, 9), (4, 5), (3, 2), 1, (False, True)),
    ((10, 11), (3, 4), (2, 4), (3, 2), (True, False)),
    ((6, 8), (1, 2), 1, (1, 4), False),
    ((5, 12), (2, 3), 1, (1, 4), False),  # dilated last axis, window covers its phase
    # 3-D
    ((3, 4, 5), 3, 1, 1, False),
    ((4, 5, 6), (2, 3, 4), (1, 2, 3), 1, (False, True, False)),
    ((5, 4, 7), (2, 2, 3), 1, (2, 1, 2), (True, False, True)),
    ((4, 4, 4), 4, (2, 3, 4), 1, False),
    ((3, 5, 4), (3, 2, 2), (3, 1, 2), (1, 2, 1), True),
]


@pytest.mark.parametrize(("grid", "kernel_size", "stride", "dilation", "is_causal"), CASES)
def test_constructor_matches_reference(grid, kernel_size, stride, dilation, is_causal):
    check_mask(grid, kernel_size, stride, dilation, is_causal)


@st.composite
def geometries(draw):
    rank = draw(st.integers(1, 3))
    top = {1: 16, 2: 9, 3: 5}[rank]
    grid, k, s, d, c = [], [], [], [], []
    for _ in range(rank):
        n = draw(st.integers(1, top))
        dil = draw(st.integers(1, max(1, n // 2)))
        ker = draw(st.integers(1, n // dil))
        grid.append(n), d.append(dil), k.append(ker)
        s.append(draw(st.integers(1, ker))), c.append(draw(st.booleans()))
    return tuple(grid), tuple(k), tuple(s), tuple(d), tuple(c)


@settings(max_examples=40, deadline=None)
@given(geometries())
def test_constructor_matches_reference_random(geometry):
    check_mask(*geometry)


def test_short_last_stride_group_leader_is_clamped():
    # 1-D, 7 tokens, kernel 3, stride 3: groups {0,1,2} {3,4,5} {6}; leaders 1, 4 and
    # min(6 + 1, 6) = 6, whose window is shifted inside to keys 4..6
    want = {0: [0, 1, 2], 3: [3, 4, 5], 6: [4, 5, 6]}
    dense = masks.neighborhood(7, 3, stride=3).to_acsr().to_dense()
    for q, keys in want.items():
        assert np.flatnonzero(dense[q]).tolist() == keys
    # even stride 4, 6 tokens, kernel 4: groups {0..3} (leader 2, the right-hand centre) and
    # {4, 5} (nominal leader 6 is past the end: leader 5)
    dense = masks.neighborhood(6, 4, stride=4).to_acsr().to_dense()
    assert np.flatnonzero(dense[1]).tolist() == [0, 1, 2, 3]
    assert np.flatnonzero(dense[4]).tolist() == [2, 3, 4, 5]
    # causal: leader is the group's last query; a short last group's is the axis's last query
    dense = masks.neighborhood(7, 3, stride=3, is_causal=True).to_acsr().to_dense()
    assert [np.flatnonzero(dense[q]).tolist() for q in range(7)] == [
        [0],
        [0, 1],
        [0, 1, 2],
        [3],
        [3, 4],
        [3, 4, 5],
        [4, 5, 6],
    ]


def test_dilation_phase_subgrids_differ_in_length():
    # 10 tokens, dilation 3: phases {0,3,6,9} (4 long) and {1,4,7}, {2,5,8} (3 long)
    dense = masks.neighborhood(10, 3, dilation=3).to_acsr().to_dense()
    assert np.flatnonzero(dense[9]).tolist() == [3, 6, 9]
    assert np.flatnonzero(dense[7]).tolist() == [1, 4, 7]
    assert np.flatnonzero(dense[0]).tolist() == [0, 3, 6]


def test_small_kernels_get_segments_not_the_residual():
    # one contiguous run per key row of the window; 1-D laws in the flat row index cannot
    # describe their edges (clamped in two grid coordinates), so they keep per-row arrays
    layout = masks.neighborhood((16, 20), (3, 5)).to_acsr()
    assert layout.residual is None and len(layout.segments) == 3
    assert [s.uniform_stride for s in layout.segments] == [1, 1, 1]
    assert masks.neighborhood(50, 7).to_acsr().segments[0].closed_form is not None  # 1-D: a law


@pytest.mark.parametrize(
    ("grid", "kernel_size", "kw"),
    [((24, 20), (7, 5), {}), ((20, 18), (3, 4), {"stride": 2}), ((16, 18), 5, {"is_causal": (True, False)})],
)
def test_from_fn_natten_predicate_gives_the_same_layout(grid, kernel_size, kw):
    stride = kw.get("stride", 1)
    causal = kw.get("is_causal", False)
    k, s, c = (_per_axis(v, 2) for v in (kernel_size, stride, causal))

    def natten(q_idx, kv_idx):  # a user's vectorised NATTEN predicate (dilation 1)
        ok = True
        for a, (xq, xk) in enumerate(
            zip(np.unravel_index(q_idx, grid), np.unravel_index(kv_idx, grid), strict=True)
        ):
            if c[a]:
                leader = np.minimum(xq // s[a] * s[a] + s[a] - 1, grid[a] - 1)
                ok = ok & (xk <= xq) & (leader - xk < k[a])
            else:
                leader = np.minimum(xq // s[a] * s[a] + s[a] // 2, grid[a] - 1)
                start = np.clip(leader - k[a] // 2, 0, grid[a] - k[a])
                ok = ok & (xk >= start) & (xk < start + k[a])
        return ok

    size = grid[0] * grid[1]
    got = splat.analyze(masks.from_fn(natten), size, size)
    want = masks.neighborhood(grid, kernel_size, **kw).to_acsr()
    assert got == want


@pytest.mark.parametrize(
    ("grid", "kernel_size", "kw"),
    [
        ((10, 12), (5, 7), {}),
        ((6, 8, 7), (3, 5, 3), {"dilation": (2, 1, 2)}),
        ((12, 9), 5, {"is_causal": True}),
    ],
)
def test_arrays_give_the_constructors_layout(grid, kernel_size, kw):
    want_dense = reference_mask(
        grid, kernel_size, kw.get("stride", 1), kw.get("dilation", 1), kw.get("is_causal", False)
    )
    want = masks.neighborhood(grid, kernel_size, **kw).to_acsr()
    assert want.grid is not None
    assert splat.analyze(want_dense) == want
    assert splat.analyze(jnp.asarray(want_dense)[None]) == want
    assert masks.from_array(want_dense).to_acsr() == want
    assert "grid product" in splat.report(want_dense).family


# -----------------------------------------------------------------------------
# a Mask like the others: values, hashing, combinators
# -----------------------------------------------------------------------------


def test_equal_by_value_and_hashable():
    a = masks.neighborhood((8, 8), 3, stride=1, is_causal=False)
    b = masks.neighborhood([8, 8], (3, 3), stride=(1, 1), dilation=np.array([1, 1]), is_causal=(False, False))
    assert a == b and hash(a) == hash(b)
    assert a != masks.neighborhood((8, 8), 3, is_causal=(True, False))
    assert a.to_acsr() is b.to_acsr()  # one cached layout
    assert isinstance(a, masks.Mask) and a.size == 64
    assert a.axes[1] == _neighborhood.AxisWindow(8, 3, 1, 1, False)


def test_combines_with_register_tokens_and_causal():
    grid, size = (6, 7), 42
    nb = masks.neighborhood(grid, (3, 4), stride=(1, 2))
    ref = reference_mask(grid, (3, 4), (1, 2))
    i, j = np.arange(size)[:, None], np.arange(size)[None, :]
    for combined, want in (
        (nb | masks.global_tokens(2), ref | (i < 2) | (j < 2)),
        (masks.sink(3) | nb, ref | (j < 3)),
        (nb & masks.causal(), ref & (j <= i)),
        (nb | masks.from_fn(lambda q, k: k == size - 1), ref | (j == size - 1)),
    ):
        layout = combined.to_acsr(size, size)
        np.testing.assert_array_equal(layout.to_dense(), want)
        assert layout == acsr.from_dense(want)


def test_docstring_examples_run():
    for module in (_neighborhood, _neighborhood_attention):
        result = doctest.testmod(module, extraglobs={}, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# -----------------------------------------------------------------------------
# bad input
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kw", "error", "match"),
    [
        (((8, 8), 3), {"stride": 4}, ValueError, "stride must be <= kernel_size"),
        (((8, 8), (3, 9)), {}, ValueError, "kernel_size \\* dilation"),
        (((8, 8), 3), {"dilation": (1, 3)}, ValueError, "kernel_size \\* dilation"),
        (((8, 8), 0), {}, ValueError, "kernel_size must be positive"),
        (((8, 0), 1), {}, ValueError, "grid must be positive"),
        (((), 1), {}, TypeError, "grid must be"),
        (((8, 8), (3, 3, 3)), {}, ValueError, "kernel_size has 3 values but the grid has 2 axes"),
        (((8, 8), 3), {"stride": (1,)}, ValueError, "stride has 1 values"),
        (((8, 8), 3), {"dilation": -1}, ValueError, "dilation must be positive"),
        (((8, 8), 3), {"is_causal": (True,)}, ValueError, "is_causal has 1 values"),
        (((8, 8), 3), {"is_causal": 1}, TypeError, "is_causal must hold bools"),
        (((8, 8), 2.0), {}, TypeError, "kernel_size must hold ints"),
        (((8, True), 1), {}, TypeError, "grid must hold ints"),
        (("88", 1), {}, TypeError, "grid must be"),
    ],
)
def test_bad_arguments_are_named(args, kw, error, match):
    with pytest.raises(error, match=match):
        masks.neighborhood(*args, **kw)


def test_sequence_length_must_be_the_grid_size():
    m = masks.neighborhood((4, 6), 3)
    for q_len, kv_len in ((25, 25), (24, 23), (23, 24)):
        with pytest.raises(ValueError, match=r"grid \(4, 6\) has 24 tokens"):
            m.to_acsr(q_len, kv_len)
    with pytest.raises(ValueError, match=r"grid \(4, 6\) has 24 tokens"):
        (m | masks.global_tokens(1)).to_acsr(30, 30)
    with pytest.raises(ValueError, match=r"grid \(4, 6\) has 24 tokens"):
        splat.analyze(m, 30, 30)
    with pytest.raises(ValueError, match="kv_idx has indices outside the neighborhood grid"):
        m(np.arange(3), np.arange(30))


# -----------------------------------------------------------------------------
# speed (reported numbers; run with --runslow)
# -----------------------------------------------------------------------------


@pytest.mark.slow
def test_large_grid_builds_fast():
    _neighborhood._layout.cache_clear()
    t = time.process_time()  # CPU time: other processes on the machine do not count
    layout = masks.neighborhood((128, 128), 15).to_acsr()
    took = time.process_time() - t
    assert layout.nnz == 128 * 128 * 225
    assert took < 1.0, f"128x128 grid, kernel 15x15: {took:.2f} s"


@pytest.mark.slow
def test_large_grid_from_fn_finds_the_grid_fast():
    grid, k = (128, 128), 15

    def natten(q_idx, kv_idx):  # a user's own predicate on flat token indices
        (qr, qc), (kr, kc) = np.unravel_index(q_idx, grid), np.unravel_index(kv_idx, grid)
        r0, c0 = np.clip(qr - k // 2, 0, grid[0] - k), np.clip(qc - k // 2, 0, grid[1] - k)
        return (kr >= r0) & (kr < r0 + k) & (kc >= c0) & (kc < c0 + k)

    t = time.process_time()
    layout = masks.from_fn(natten).to_acsr(128 * 128)
    took = time.process_time() - t
    assert layout == masks.neighborhood(grid, k).to_acsr()
    # ~1.3 s on a 2-core CPU, of which ~1.2 s is the predicate on all 16384^2 pairs
    assert took < 6.0, f"from_fn, 128x128 grid, kernel 15x15: {took:.2f} s"


# -----------------------------------------------------------------------------
# splat.neighborhood_attention against the float64 dense reference
# -----------------------------------------------------------------------------

F32, BF16 = jnp.float32, jnp.bfloat16
ATTENTION_CASES = [
    ((24,), {"kernel_size": 5, "stride": 2}, F32),
    ((13,), {"kernel_size": 4, "dilation": 3, "is_causal": True}, F32),
    ((6, 7), {"kernel_size": (3, 4), "stride": (1, 2)}, F32),
    ((6, 7), {"kernel_size": (3, 4), "stride": (1, 2)}, BF16),
    ((6, 7), {"kernel_size": 3, "dilation": (2, 1), "is_causal": (True, False)}, F32),
    ((3, 4, 5), {"kernel_size": (2, 3, 3), "stride": (1, 2, 3), "is_causal": (False, False, True)}, F32),
    ((3, 4, 5), {"kernel_size": (2, 3, 3), "stride": (1, 2, 3), "is_causal": (False, False, True)}, BF16),
]


@pytest.mark.parametrize(("grid", "geometry", "dtype"), ATTENTION_CASES)
def test_attention_matches_dense_reference(rng, backend, grid, geometry, dtype):
    b, h, hk, d = 2, 4, 2, 16  # GQA: two query heads per KV head
    size = int(np.prod(grid))
    q, do = (jnp.asarray(rng.standard_normal((b, *grid, h, d)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, *grid, hk, d)), dtype) for _ in range(2))
    scale = 0.3

    @jax.jit
    def run(q, k, v, do):
        def f(q, k, v):
            return splat.neighborhood_attention(q, k, v, scale=scale, backend=backend, **geometry)

        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do)

    with refusal_skips(backend):
        out, grads = run(q, k, v, do)
    assert out.shape == q.shape and out.dtype == dtype
    flat = [x.reshape(b, size, *x.shape[-2:]) for x in (q, k, v, do)]
    want = reference_mask(grid, **geometry)
    ref_out, _ = attention_ref(*flat[:3], want, scale)
    ref_grads = attention_grads_ref(*flat[:3], want, scale, flat[3])
    same_out, same_grads = None, (None,) * 3
    if dtype != jnp.float32:
        same_out, same_grads = attention_dense_grads(*flat[:3], want, scale, flat[3])
    assert_close("out", out.reshape(b, size, h, d), ref_out, dtype, same_out)
    for name, g, x, r, same in zip("qkv", grads, (q, k, v), ref_grads, same_grads, strict=True):
        assert g.shape == x.shape
        assert_close(f"d{name}", g.reshape(b, size, *g.shape[-2:]), r, dtype, same)


def test_attention_equals_flat_attention_with_the_mask(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((1, 5, 6, 2, 8)), jnp.float32) for _ in range(3))
    got = splat.neighborhood_attention(q, k, v, (3, 2), dilation=(1, 2), backend="jax")
    m = masks.neighborhood((5, 6), (3, 2), dilation=(1, 2))
    flat = splat.attention(*(x.reshape(1, 30, 2, 8) for x in (q, k, v)), mask=m, backend="jax")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(flat).reshape(q.shape))


def test_attention_bad_input_is_named():
    x = jnp.zeros((1, 4, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="query must be \\[B, \\*grid, H, D\\] with 1 to 3 grid axes"):
        splat.neighborhood_attention(jnp.zeros((4, 2, 8)), x, x, 3)
    with pytest.raises(ValueError, match="query must be"):
        splat.neighborhood_attention(jnp.zeros((1, 2, 2, 2, 2, 2, 8)), x, x, 1)
    with pytest.raises(ValueError, match=r"key grid \(4, 5\) != query grid \(4, 4\)"):
        splat.neighborhood_attention(x, jnp.zeros((1, 4, 5, 2, 8)), x, 3)
    with pytest.raises(ValueError, match="kernel_size has 3 values but the grid has 2 axes"):
        splat.neighborhood_attention(x, x, x, (3, 3, 3))
    with pytest.raises(ValueError, match="kernel_size \\* dilation"):
        splat.neighborhood_attention(x, x, x, 5)
    with pytest.raises(TypeError, match="value must be a jax or numpy array"):
        splat.neighborhood_attention(x, x, [1.0], 3)
    with pytest.raises(ValueError, match="head dim"):
        splat.neighborhood_attention(x, jnp.zeros((1, 4, 4, 2, 4)), jnp.zeros((1, 4, 4, 2, 4)), 3)
