"""splat.sparsify on masks taken at positions computed from the inputs (issue 39, cause 4).

Minimal reproductions of the forms model code writes, with no library imported: penzai passes
query and key positions as side inputs (``q_pos >= kv_pos`` and ``kv_pos >= 0``, a KV cache
decoding at a position known only at run time); Keras's cache mask is ``arange(n, dtype=float)
+ cache_index >= arange(S)``; Gemma ANDs a causal mask on indices with a window on positions
``cumsum(valid) - 1``; keras-hub's Gemma slices a constant band's rows at the cache index
(``dynamic_slice(band, (cache_index, 0))``). Each becomes a constant mask (recognised by its
constructor) taken at the positions, which reach ``splat.attention`` as ``q_positions`` /
``kv_positions``; outputs and gradients equal the unmodified function's (float32, 1e-5), decode
steps included.

Where a side is read both by index and by position (Gemma's decode: a causal mask on cache
indices AND a window on the positions the cache stores, 0 in slots not yet written), that side
goes at its indices and its positions are checked at run time only where the other terms let a
pair be seen (``splat._sparsify.guard``). Positions passed are checked to lie inside the mask
(splat's mask has no entry outside; the original's may see there), keys hidden by padding or a
term on key positions alone excepted. The ``guard_results`` fixture records which branch ran.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
from splat import masks
from splat._sparsify import call as call_module
from splat._sparsify import guard, sparsify

B, H, HK, D, S, WIN = 2, 4, 2, 8, 32, 6
TOL = {"rtol": 1e-5, "atol": 1e-5}
FILL = -2.3819763e38


def _qkv(rng, t=S, s=S):
    q = jnp.asarray(rng.standard_normal((B, t, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, s, HK, D)), jnp.float32) for _ in range(2))
    return q, k, v


def _gqa(q, k, v, mask):
    """Gemma's grouped 5-D einsums; ``mask [B, T, S]`` (True = attend)."""
    b, t, h, d = q.shape
    qg = q.reshape(b, t, HK, h // HK, d)
    s = jnp.einsum("BTKGH,BSKH->BTKGS", qg, k) * d**-0.5
    s = jnp.where(mask[:, :, None, None, :], s, FILL)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("BTKGS,BSKH->BTKGH", p, v).reshape(b, t, h, d)


def _substituted(fn, args, mask, runtime, decode):
    """One attention found, with ``mask`` and ``runtime``; output and gradients equal ``fn``'s; the
    call record says splat ran (a decode step when ``decode``)."""
    sf = sparsify(fn, backend="jax")
    assert sf.problems(*args) == []
    (found,) = sf.inspect(*args)
    assert found.mask == mask and found.runtime == runtime, found
    with warnings.catch_warnings(), splat.call_log() as log:
        warnings.simplefilter("error")
        out = jax.jit(sf)(*args)
    assert [(r.outcome, r.decode, r.replaced) for r in log] == [("splat", decode, 1)]
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(*args)), **TOL)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)
    ga = jax.grad(lambda *a: (sf(*a) * w).sum(), argnums=(0, 1, 2))(*args)
    gb = jax.grad(lambda *a: (fn(*a) * w).sum(), argnums=(0, 1, 2))(*args)
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


def side_input_positions(q, k, v, q_pos, kv_pos):
    """penzai: the mask compares the positions it is given; a negative key position is padding."""
    keep = (q_pos[:, :, None] >= kv_pos[:, None, :]) & (q_pos[:, :, None] - kv_pos[:, None, :] < WIN)
    return _gqa(q, k, v, keep & (kv_pos[:, None, :] >= 0))


@pytest.mark.parametrize("t", [8, 1], ids=["chunk", "one_token"])
def test_side_input_positions_decode_at_run_time_rows(rng, guard_results, t):
    """A cache of S slots filled up to ``end``; the new queries sit at ``end + [0, t)``. The slots
    not yet written sit at -1, outside the mask: ``kv_pos >= 0`` hides them, so splat runs."""
    q, k, v = _qkv(rng, t=t)
    end = 13
    kv_pos = jnp.where(jnp.arange(S) < end + t, jnp.arange(S), -1)[None].repeat(B, 0)
    q_pos = (end + jnp.arange(t))[None].repeat(B, 0)
    _substituted(
        side_input_positions, (q, k, v, q_pos, kv_pos), masks.sliding_window(WIN - 1, 0), ("positions",), True
    )
    assert guard_results and all(guard_results)


def test_left_padded_positions_move_the_keys(rng, guard_results):
    """Left padding: positions start after the padding, keys are gathered to their positions."""
    q, k, v = _qkv(rng)
    pad = jnp.asarray([[3], [0]])
    pos = jnp.arange(S)[None] - pad
    kv_pos = jnp.where(pos >= 0, pos, -1)
    q_pos = jnp.maximum(pos, 0)
    _substituted(
        side_input_positions, (q, k, v, q_pos, kv_pos), masks.sliding_window(WIN - 1, 0), ("positions",), True
    )
    assert guard_results and all(guard_results)


def window_without_padding(q, k, v, q_pos, kv_pos):
    """penzai's window with no ``kv_pos >= 0`` term: a key at a negative position is seen wherever
    the window reaches it."""
    keep = (q_pos[:, :, None] >= kv_pos[:, None, :]) & (q_pos[:, :, None] - kv_pos[:, None, :] < WIN)
    return _gqa(q, k, v, keep)


@pytest.mark.parametrize("pad", [0, 3], ids=["inside", "negative"])
def test_keys_outside_the_mask_run_the_original(rng, guard_results, pad):
    """splat's mask has no column for a negative position (such a key is padding there); without
    a term that hides it, the original's window sees it: the check sends that call to the original
    attention, and keeps splat where every key is inside."""
    q, k, v = _qkv(rng)
    pos = jnp.arange(S)[None] - jnp.asarray([[pad], [0]])
    args = (q, k, v, jnp.maximum(pos, 0), pos)
    _substituted(window_without_padding, args, masks.sliding_window(WIN - 1, 0), ("positions",), True)
    assert guard_results and set(guard_results) == {pad == 0}


def test_positions_past_the_mask_run_the_original(rng, guard_results):
    """Positions shifted past the mask's rows and columns (a ring buffer's, a long sequence's) have
    no entry in splat's mask, though the window on them sees keys: the original runs, exact."""
    q, k, v = _qkv(rng)
    pos = jnp.arange(S)[None] + jnp.asarray([[0], [10]])
    args = (q, k, v, pos, pos)
    _substituted(side_input_positions, args, masks.sliding_window(WIN - 1, 0), ("positions",), True)
    assert guard_results and not any(guard_results)


def test_keys_sharing_a_position_are_each_seen(rng, guard_results):
    """Two keys at one position (a token written twice) both sit in that position's column, as in
    the original mask: splat runs, exact."""
    q, k, v = _qkv(rng)
    pos = jnp.arange(S)[None].repeat(B, 0)
    kv_pos = pos.at[0, 5].set(4).at[1, 9].set(7).at[1, 10].set(7)
    args = (q, k, v, pos, kv_pos)
    _substituted(side_input_positions, args, masks.sliding_window(WIN - 1, 0), ("positions",), True)
    assert guard_results and all(guard_results)


def keras_cache(q, k, v, cache_index):
    """Keras's compute_causal_mask: float aranges, the query's shifted by the cache index."""
    i = jnp.arange(q.shape[1], dtype=jnp.float32) + cache_index.astype(jnp.float32)
    j = jnp.arange(k.shape[1], dtype=jnp.float32)
    mask = (i[:, None] >= j[None, :])[None].repeat(q.shape[0], 0)
    return _gqa(q, k, v, mask)


@pytest.mark.parametrize("t", [4, 1])
def test_cache_index_is_a_query_position(rng, guard_results, t):
    q, k, v = _qkv(rng, t=t)
    _substituted(keras_cache, (q, k, v, jnp.asarray(9, jnp.int32)), masks.causal(), ("positions",), True)
    assert guard_results and all(guard_results)


def test_queries_past_the_cache_run_the_original(rng, guard_results):
    """Four queries from cache index 30 of a 32-slot cache: the last two sit past the mask's rows,
    where splat's mask has no row, while Keras's ``i >= j`` lets them see the whole cache."""
    q, k, v = _qkv(rng, t=4)
    _substituted(keras_cache, (q, k, v, jnp.asarray(30, jnp.int32)), masks.causal(), ("positions",), True)
    assert guard_results and not any(guard_results)


def positions_window(q, k, v, tokens):
    """Gemma's local layers: causal on indices AND a window on positions cumsum(valid) - 1."""
    valid = tokens != 0
    pos = jnp.cumsum(valid, axis=-1) - 1
    window = (pos[:, None, :] > pos[:, :, None] - WIN) & (pos[:, None, :] < pos[:, :, None] + WIN)
    i = jnp.arange(q.shape[1])
    mask = valid[:, None, :] & (i[:, None] >= i[None, :])[None] & window
    return _gqa(q, k, v, mask)


@pytest.mark.parametrize("padded", [False, True])
def test_positions_meeting_indices_are_checked_at_run_time(rng, padded):
    """Positions and indices in one mask agree only where they are equal: splat runs where they
    are (no padding), the original attention where they are not (a padded row), both exact."""
    q, k, v = _qkv(rng)
    tok = np.random.default_rng(4).integers(1, 50, (B, S))
    if padded:
        tok[1, 21:] = 0
    _substituted(
        positions_window,
        (q, k, v, jnp.asarray(tok, jnp.int32)),
        masks.sliding_window(WIN - 1, 0),  # causal AND the two-sided window
        ("kv_padding", "positions=indices"),
        False,
    )


def test_values_of_the_inputs_are_no_positions(rng):
    """Comparing float values of q and k is not a mask on positions: it stays dense."""
    q, k, v = _qkv(rng)

    def from_values(q, k, v):
        return _gqa(q, k, v, q[:, :, None, 0, 0] > k[:, None, :, 0, 0])

    sf = sparsify(from_values)
    assert sf.inspect(q, k, v) == []
    assert "depends on the function's inputs" in sf.problems(q, k, v)[0]


def test_attention_positions_argument_matches_dense(rng):
    """splat.attention's q_positions / kv_positions against the dense mask taken at them; two keys
    at one position share its column (``tests/test_positions_shared.py`` checks more)."""
    q, k, v = _qkv(rng, t=3, s=16)
    qp = jnp.asarray([[7, 8, 9], [3, 4, -1]])
    kp = jnp.stack([jnp.where(jnp.arange(16) >= 3, jnp.arange(16) - 3, -1), jnp.arange(16)])
    kr, vr = (jnp.repeat(x, H // HK, axis=2) for x in (k, v))
    for kv_pos in (kp, kp.at[0, 5].set(4)):
        got = splat.attention(
            q, k, v, masks.sliding_window(3, 0), q_positions=qp, kv_positions=kv_pos, backend="jax"
        )
        m = (qp[:, :, None] >= kv_pos[:, None, :]) & (qp[:, :, None] - kv_pos[:, None, :] < 4)
        m &= (kv_pos[:, None, :] >= 0) & (qp[:, :, None] >= 0)
        s = jnp.where(m[:, None], jnp.einsum("bqhd,bkhd->bhqk", q, kr) * D**-0.5, -jnp.inf)
        p = jnp.nan_to_num(jax.nn.softmax(s, -1))
        want = jnp.einsum("bhqk,bkhd->bqhd", p, vr)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def _band(s: int):
    """keras-hub Gemma's sliding band over the whole cache: ``triu(-WIN + 1) & tril(WIN - 1)``."""
    i, j = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    return (j >= i - WIN + 1) & (j <= i + WIN - 1)


def sliced_band(q, k, v, cache_index):
    """The band's rows from the cache index (``ops.slice``: a negative start counts from the end,
    and ``dynamic_slice`` clamps), alone: the queries' positions are the slice's rows."""
    start = jnp.where(cache_index < 0, cache_index + k.shape[1], cache_index)
    rows = jax.lax.dynamic_slice(_band(k.shape[1]), (start, 0), (q.shape[1], k.shape[1]))
    return _gqa(q, k, v, rows[None].repeat(q.shape[0], 0))


def sliced_band_and_cache(q, k, v, cache_index):
    """keras-hub Gemma in decode: Keras's cache mask (a query position array) AND the band sliced
    at the same index."""
    i = jnp.arange(q.shape[1], dtype=jnp.float32) + cache_index.astype(jnp.float32)
    j = jnp.arange(k.shape[1], dtype=jnp.float32)
    start = jnp.where(cache_index < 0, cache_index + k.shape[1], cache_index)
    rows = jax.lax.dynamic_slice(_band(k.shape[1]), (start, 0), (q.shape[1], k.shape[1]))
    return _gqa(q, k, v, ((i[:, None] >= j[None, :]) & rows)[None].repeat(q.shape[0], 0))


@pytest.mark.parametrize("t, index", [(8, 9), (1, 20), (8, 30)], ids=["chunk", "one_token", "clamped"])
def test_a_constant_sliced_at_the_cache_index_is_the_mask_at_query_positions(rng, t, index):
    """The slice's rows are the queries' positions, clamped as ``dynamic_slice`` clamps (index 30
    with 8 queries in 32 rows reads rows 24..31)."""
    q, k, v = _qkv(rng, t=t)
    args = (q, k, v, jnp.asarray(index, jnp.int32))
    _substituted(sliced_band, args, masks.sliding_window(WIN - 1, WIN - 1), ("positions",), True)


@pytest.mark.parametrize("t, index", [(8, 9), (1, 20), (8, 30)], ids=["chunk", "one_token", "disagree"])
def test_a_sliced_constant_and_a_position_array_are_checked_to_agree(rng, t, index):
    """With a query position array as well, splat runs where the slice's rows equal it; where
    ``dynamic_slice`` clamps a start past the rows (30 + 8 > 32) they differ and the original
    attention runs: exact either way."""
    q, k, v = _qkv(rng, t=t)
    args = (q, k, v, jnp.asarray(index, jnp.int32))
    _substituted(sliced_band_and_cache, args, masks.sliding_window(WIN - 1, 0), ("positions",), True)


def test_two_slice_starts_stay_dense(rng):
    q, k, v = _qkv(rng, t=4)

    def two_starts(q, k, v, a, b):
        band = _band(S)
        rows = jax.lax.dynamic_slice(band, (a, 0), (4, S)) & jax.lax.dynamic_slice(band, (b, 0), (4, S))
        return _gqa(q, k, v, rows[None].repeat(B, 0))

    args = (q, k, v, jnp.asarray(3, jnp.int32), jnp.asarray(5, jnp.int32))
    sf = sparsify(two_starts)
    assert sf.inspect(*args) == []
    assert "two different query starts" in sf.problems(*args)[0]


def two_position_arrays(q, k, v, cache_index, other):
    """keras-hub Mistral: Keras's float cache mask AND a window on an integer ``arange + index``;
    ``other`` is the second array's index (the same value, or not)."""
    i = jnp.arange(q.shape[1], dtype=jnp.float32) + cache_index.astype(jnp.float32)
    j = jnp.arange(k.shape[1], dtype=jnp.float32)
    ii = jnp.arange(q.shape[1], dtype=jnp.int32)[:, None] + other
    window = ii < jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] + WIN
    return _gqa(q, k, v, ((i[:, None] >= j[None, :]) & window)[None].repeat(q.shape[0], 0))


def test_two_position_arrays_of_one_cache_index_are_one(rng):
    q, k, v = _qkv(rng, t=8)
    index = jnp.asarray(13, jnp.int32)
    _substituted(lambda q, k, v, c: two_position_arrays(q, k, v, c, c), (q, k, v, index),
                 masks.sliding_window(WIN - 1, 0), ("positions",), True)


def test_position_arrays_of_two_values_stay_dense(rng):
    q, k, v = _qkv(rng, t=4)
    args = (q, k, v, jnp.asarray(13, jnp.int32), jnp.asarray(12, jnp.int32))
    sf = sparsify(two_position_arrays)
    assert sf.inspect(*args) == []
    assert "2 different arrays" in sf.problems(*args)[0]


@pytest.fixture
def guard_results(monkeypatch):
    """The run-time outcomes of the position checks (True: splat's attention ran), in call order."""
    results: list[bool] = []
    real = call_module.positions_hold

    def recorded(*args):
        ok = real(*args)
        jax.debug.callback(lambda x: results.append(bool(x)), ok)
        return ok

    monkeypatch.setattr(call_module, "positions_hold", recorded)
    return results


def cache_window(q, k, v, kv_pos, end):
    """Gemma's local layer in decode: a causal mask on the cache's *indices* (the slots up to the
    query's position) AND a window on the *positions* the cache stores in them."""
    q_pos = end + jnp.arange(q.shape[1])[None].repeat(q.shape[0], 0)
    causal = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]
    window = (kv_pos[:, None, :] > q_pos[:, :, None] - WIN) & (kv_pos[:, None, :] < q_pos[:, :, None] + WIN)
    return _gqa(q, k, v, causal & window)


def _cache_positions(end: int, t: int):
    """The positions a left-aligned cache stores after writing ``end + t`` tokens: each written
    slot its index, the others 0 (as initialised)."""
    j = jnp.arange(S)
    return jnp.where(j < end + t, j, 0)[None].repeat(B, 0).astype(jnp.int32)


@pytest.mark.parametrize(
    "t, end", [(8, 0), (1, 3), (1, 20), (4, 27)], ids=["prefill", "early", "late", "full"]
)
def test_unwritten_cache_slots_outside_the_causal_extent_do_not_matter(rng, guard_results, t, end):
    """The slots not yet written hold position 0, inside the window of an early query but past
    every query's causal extent: splat runs (queries at their positions, keys at their indices)
    and equals the original, gradients included."""
    q, k, v = _qkv(rng, t=t)
    args = (q, k, v, _cache_positions(end, t), jnp.asarray(end, jnp.int32))
    _substituted(
        cache_window, args, masks.sliding_window(WIN - 1, 0), ("positions", "positions=indices"), True
    )
    assert guard_results and all(guard_results)


@pytest.mark.parametrize("slot", [0, 12, 13], ids=["first", "inside_window", "last_seen"])
def test_a_moved_key_the_causal_mask_lets_be_seen_runs_the_original(rng, guard_results, slot):
    """A slot that the causal mask lets the query see holds another position (a stale entry, a
    ring buffer): the two masks may differ there, so the original attention runs, exact."""
    q, k, v = _qkv(rng, t=1)
    end = 13
    kv_pos = _cache_positions(end, 1).at[1, slot].set(slot + 40)
    args = (q, k, v, kv_pos, jnp.asarray(end, jnp.int32))
    _substituted(
        cache_window, args, masks.sliding_window(WIN - 1, 0), ("positions", "positions=indices"), True
    )
    assert guard_results and not any(guard_results)


def test_a_moved_key_past_the_causal_extent_still_runs_splat(rng, guard_results):
    """The same stale entry one slot past the query's causal extent: hidden either way."""
    q, k, v = _qkv(rng, t=1)
    end = 13
    kv_pos = _cache_positions(end, 1).at[1, end + 1].set(end)  # would be inside the window as a position
    args = (q, k, v, kv_pos, jnp.asarray(end, jnp.int32))
    _substituted(
        cache_window, args, masks.sliding_window(WIN - 1, 0), ("positions", "positions=indices"), True
    )
    assert guard_results and all(guard_results)


def test_a_query_past_the_mask_runs_the_original(rng, guard_results):
    """A query position past the cache sees no key in splat; the original sees the window of a full
    cache: the check sends it to the original attention."""
    q, k, v = _qkv(rng, t=1)
    args = (q, k, v, _cache_positions(S, 0), jnp.asarray(S + 2, jnp.int32))  # every key at its index
    _substituted(
        cache_window, args, masks.sliding_window(WIN - 1, 0), ("positions", "positions=indices"), True
    )
    assert guard_results and not any(guard_results)


def index_rows_window(q, k, v, q_pos, kv_pos):
    """Queries compared by index with the keys' positions (``i >= kv_pos``) and by position in a
    window: the queries go at their indices, the keys at their positions."""
    i = jnp.arange(q.shape[1])[None, :, None]
    window = q_pos[:, :, None] - kv_pos[:, None, :] < WIN
    return _gqa(q, k, v, (i >= kv_pos[:, None, :]) & window & (kv_pos[:, None, :] >= 0))


@pytest.mark.parametrize("aligned", [True, False])
def test_query_positions_meeting_query_indices_are_checked(rng, guard_results, aligned):
    q, k, v = _qkv(rng)
    pos = np.arange(S)[None].repeat(B, 0)
    q_pos = pos.copy()
    if not aligned:
        q_pos[0, 5] = 9
    kv_pos = np.where(pos >= 3, pos - 3, -1)  # left padding moves the keys
    args = (q, k, v, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32))
    _substituted(
        index_rows_window, args, masks.sliding_window(WIN - 1, 0), ("positions", "positions=indices"), True
    )
    assert guard_results and set(guard_results) == {aligned}


@pytest.mark.parametrize(
    "mask",
    [
        masks.causal(),
        masks.sliding_window(3, 2),
        masks.from_fn(lambda i, j: ((i * 7 + j * 3) % 5 == 0) & (i != 9)),  # irregular: a residual
    ],
    ids=["causal", "band", "irregular"],
)
def test_row_extents_are_each_rows_first_and_last_column(mask):
    dense = splat.analyze(mask, 40, 24).to_dense()
    first, last = guard.row_extents(splat.analyze(mask, 40, 24))
    any_col = dense.any(axis=1)
    np.testing.assert_array_equal(np.where(any_col, dense.argmax(axis=1), 24), first)
    np.testing.assert_array_equal(np.where(any_col, 23 - dense[:, ::-1].argmax(axis=1), -1), last)


def test_guard_log_reports_which_attention_each_execution_ran():
    """``splat.guard_log`` sees the run-time choice: positions inside the mask run splat (True);
    positions past it run the original (False); both exact."""

    def attn(q, k, v, pos):
        s = jnp.einsum("qd,kd->qk", q, k)
        near = (pos[None, :] > pos[:, None] - 3) & (pos[None, :] < pos[:, None] + 3)
        return jax.nn.softmax(jnp.where(near, s, -1e30)) @ v

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)
    with warnings.catch_warnings(), splat.guard_log() as chose:
        warnings.simplefilter("error", splat.SparsifyWarning)
        fn = jax.jit(splat.sparsify(attn, backend="jax"))
        inside, past = fn(x, x, x, jnp.arange(8)), fn(x, x, x, jnp.arange(8) + 100)
        jax.effects_barrier()
    assert chose == [True, False]
    for got, pos in ((inside, jnp.arange(8)), (past, jnp.arange(8) + 100)):
        np.testing.assert_allclose(got, attn(x, x, x, pos), **TOL)
