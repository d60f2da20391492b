"""The cuda kernels' runtime-mask arrays (jax_bindings._cuda.runtime_tables), checked on CPU.

Against brute force from the per-batch dense mask of the ids: every key a row of a block may see
lies in the block's run, every key of its id-free run is seen by every row, and the backward's
walks cover consecutive key blocks per query block with ``rt_last`` the last of them (the
ordered dQ addition's turns depend on it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runtime_masks import packed_ids

from jax_bindings import _runtime
from jax_bindings._cuda import bwd_source, runtime_tables, source


@jax.jit
def _runtime_mask(ids, kv_ids=None):
    b, sq = ids.shape
    skv = sq if kv_ids is None else kv_ids.shape[1]
    return _runtime.build(b, sq, skv, segment_ids=ids, kv_segment_ids=kv_ids)


# jitted: one compile per shape rather than one per operation
_fwd_arrays = jax.jit(runtime_tables.fwd_arrays, static_argnums=1)
_bwd_arrays = jax.jit(runtime_tables.bwd_arrays, static_argnums=1)


def _check_runs(ranges, seen, block):
    """``seen [B, n_own, n_other]`` (own position sees other position, as far as ids go)."""
    b, n_own, n_other = seen.shape
    for r in range(b):
        for blk, (x, y, z, w) in enumerate(np.asarray(ranges[r])):
            rows = seen[r, blk * block:(blk + 1) * block]
            cols = np.flatnonzero(rows.any(0))
            assert cols.size == 0 or (x <= cols.min() and cols.max() < y), (r, blk, x, y, cols)
            if w > z:
                assert rows[:, z:w].all(), (r, blk, z, w)


CASES = {
    "packed": lambda rng: (packed_ids(rng, 3, 700, 90), None),
    "tiny_documents": lambda rng: (packed_ids(rng, 2, 300, 3), None),
    "one_document": lambda rng: (np.zeros((2, 260), np.int32), None),
    "unsorted": lambda rng: (rng.integers(0, 4, size=(2, 333)).astype(np.int32), None),
    # keys of ids no query has, between the queries' documents: key blocks that see no row
    "rectangular_gaps": lambda rng: (2 * packed_ids(rng, 2, 400, 60), packed_ids(rng, 2, 1100, 40)),
    # whole key blocks of odd ids no query has (keys 256-383 are all id 1)
    "empty_key_blocks": lambda rng: (np.tile(2 * (np.arange(300) // 60), (2, 1)).astype(np.int32),
                                     np.tile(np.arange(1100) // 200, (2, 1)).astype(np.int32)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_runs_hold_every_seen_key_and_id_free_runs_are_seen(rng, case):
    ids, kv_ids = CASES[case](rng)
    rt = _runtime_mask(ids, kv_ids)
    kv = ids if kv_ids is None else kv_ids
    seen = ids[:, :, None] == kv[:, None, :]
    lens, qi, ki, fwd = _fwd_arrays(rt, 176)
    assert fwd.shape == (ids.shape[0], -(-ids.shape[1] // source.BM), 4) and fwd.dtype == jnp.int32
    assert np.array_equal(np.asarray(qi), ids)
    assert ki.shape[1] % 176 == 0 and np.array_equal(np.asarray(ki)[:, :kv.shape[1]], kv)
    _check_runs(fwd, seen, source.BM)
    _, qi, _, bwd, _leads = _bwd_arrays(rt, bwd_source.BN)
    assert qi.shape[1] % bwd_source.BM == 0 and np.array_equal(np.asarray(qi)[:, :ids.shape[1]], ids)
    assert bwd.shape == (ids.shape[0], -(-kv.shape[1] // bwd_source.BN), 4)
    _check_runs(bwd, seen.transpose(0, 2, 1), bwd_source.BN)
    if case == "empty_key_blocks":
        x, y = np.asarray(bwd)[0, 2, :2]
        assert x == y, "key block 2 has no query of its id"
    if case == "unsorted":
        assert not np.asarray(rt.exact).any()
        assert (np.asarray(fwd)[..., 2:] == 0).all(), "unsorted ids: no tile is id-free"


@pytest.mark.parametrize("case", sorted(CASES))
def test_key_blocks_covering_a_query_block_are_consecutive(rng, case):
    ids, kv_ids = CASES[case](rng)
    rt = _runtime_mask(ids, kv_ids)
    _, _, _, ranges, leads = _bwd_arrays(rt, bwd_source.BN)
    ranges, first, last = np.asarray(ranges), np.asarray(leads)[..., 0], np.asarray(leads)[..., 1]
    bm, nq = bwd_source.BM, bwd_source.num_q_blocks(ids.shape[1])
    assert last.shape == first.shape == (ids.shape[0], nq)
    for r in range(ids.shape[0]):
        lo = ranges[r, :, 0] // bm
        hi = np.maximum(ranges[r, :, 0], ranges[r, :, 1] - 1) // bm  # as the kernel walks them
        for i in range(nq):
            walkers = np.flatnonzero((lo <= i) & (i <= hi))
            if walkers.size:
                assert np.array_equal(walkers, np.arange(walkers[0], walkers[-1] + 1)), (r, i, walkers)
                assert last[r, i] == walkers[-1] and first[r, i] == walkers[0]
            else:
                assert last[r, i] == first[r, i] == -1


def test_lengths_only_passes_lengths():
    rt = _runtime.build(2, 10, 12, query_seq_lengths=jnp.array([3, 40]),
                        key_value_seq_lengths=jnp.array([-1, 5]))
    assert runtime_tables.kind(rt) == "lengths"
    (lens,) = runtime_tables.fwd_arrays(rt, 128)
    assert lens.tolist() == [[3, 0], [10, 5]]
    assert [a.tolist() for a in runtime_tables.bwd_arrays(rt, bwd_source.BN)] == [lens.tolist()]


def test_offsets_are_taken_by_the_forward_only():
    rt = _runtime.build(1, 4, 16, q_offset=jnp.array([3]), layout_rows=16)
    with pytest.raises(NotImplementedError, match="q_offset"):
        runtime_tables.kind(rt)
    assert runtime_tables.kind(rt, positions=True) == "lengths"
    assert runtime_tables.kind(None) == ""
    given_one_by_one = rt._replace(q_start=None)
    with pytest.raises(NotImplementedError, match="one by one"):
        runtime_tables.kind(given_one_by_one, positions=True)
    with pytest.raises(ValueError, match="layout_rows"):
        runtime_tables.fwd_arrays(rt, 128)


@pytest.mark.parametrize("offsets", [[0, 5, 9], [-4, 12, 30], [-40, 3, 13]])
def test_shifted_lengths_bound_the_rows_whose_positions_see_keys(offsets):
    """``rt_lens`` of a chunk at offsets: the rows in ``[q_first, q_end)`` are exactly those
    inside ``q_len`` whose position is inside the layout (``q_pos >= 0``), and the shift is the
    offset, so that row ``i``'s position is ``i + shift`` wherever it sees keys."""
    b, sq, rows = len(offsets), 8, 16
    rt = _runtime.build(b, sq, rows, q_offset=jnp.asarray(offsets), layout_rows=rows,
                        query_seq_lengths=jnp.array([8, 6, 3]), key_value_seq_lengths=jnp.array([16, 9, 0]))
    (lens,) = runtime_tables.fwd_arrays(rt, 128, rows)
    end, kv, shift, first = np.asarray(lens).T
    i = np.arange(sq)
    live = (i >= first[:, None]) & (i < end[:, None])
    pos = np.asarray(rt.q_pos)
    assert np.array_equal(live, (pos >= 0) & (i < np.asarray(rt.q_len)[:, None]))
    assert np.array_equal(np.where(live, i + shift[:, None], -1), np.where(live, pos, -1))
    assert kv.tolist() == [16, 9, 0] and shift.tolist() == offsets
