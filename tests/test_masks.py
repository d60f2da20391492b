"""Mask constructors and combinators: exact against their predicates, O(S) layouts, clear errors."""

import numpy as np
import pytest

from acsr import Law
from splat import catalogue, masks

SHAPES = [(97, 97), (60, 131), (131, 60), (1, 17), (33, 1)]


def _grid(q_len, kv_len):
    return np.arange(q_len)[:, None], np.arange(kv_len)[None, :]


def _reference(name, i, j):
    """Independent numpy renderings of the SMALL catalogue (not via the mask's own predicate)."""
    d = i - j
    return {
        "full": np.ones(np.broadcast_shapes(i.shape, j.shape), bool),
        "causal": j <= i,
        "sliding_window": np.abs(d) <= 9,
        "causal_window": (d >= 0) & (d <= 23),
        "dilated_window": (np.abs(d) <= 20) & (d % 3 == 0),
        "block_local": (j // 16 <= i // 16) & (j // 16 >= i // 16 - 1),
        "strided": (d >= 0) & (d % 8 == 0),
        "global_window": (np.abs(d) <= 9) | (i < 3) | (j < 3),
        "sink_causal_window": ((d >= 0) & (d <= 23)) | ((j < 2) & (j <= i)),
        "strided_local": ((d >= 0) & (d % 8 == 0)) | ((d >= 0) & (d <= 7)),
    }[name]


@pytest.mark.parametrize("name", list(catalogue.SMALL))
@pytest.mark.parametrize("shape", SHAPES)
def test_family_layout_is_exact(name, shape):
    m = catalogue.SMALL[name]
    i, j = _grid(*shape)
    want = _reference(name, i, j)
    np.testing.assert_array_equal(m(i, j), want)
    layout = m.to_acsr(*shape)
    np.testing.assert_array_equal(layout.to_dense(), want)
    layout.validate()


@pytest.mark.parametrize("name", [n for n in catalogue.SMALL if n not in ("strided_local",)])
def test_every_single_family_and_union_gets_closed_forms(name):
    layout = catalogue.SMALL[name].to_acsr(200, 200)
    assert layout.residual is None
    assert all(s.closed_form is not None for s in layout.segments)


def test_sliding_window_closed_form_is_the_clamped_affine_law():
    (seg,) = masks.sliding_window(5, 2).to_acsr(64, 64).segments
    (piece,) = seg.closed_form.pieces
    assert (piece.row_start, piece.row_stop, piece.stride) == (0, 64, 1)
    assert piece.base == Law(1, 0, -5, lo=0)
    assert piece.end == Law(1, 0, 3, hi=64)


def test_strided_closed_form_is_periodic():
    (seg,) = masks.strided(16).to_acsr(256, 256).segments
    (piece,) = seg.closed_form.pieces
    assert piece.stride == 16
    assert piece.base == Law(1, -16, 0, div=16)  # r mod 16
    assert piece.end == Law(1, 0, 1)  # last column is r itself


def test_block_local_closed_form_is_a_staircase():
    (seg,) = masks.block_local(32, 1).to_acsr(256, 256).segments
    (piece,) = seg.closed_form.pieces
    assert piece.base == Law(0, 32, -32, div=32, lo=0)


def test_union_keeps_global_columns_and_window_as_separate_segments():
    layout = (masks.global_tokens(4) | masks.sliding_window(16)).to_acsr(300, 300)
    assert len(layout.segments) == 2
    # beyond the rows where they touch, segment 0 is the 4 global columns, segment 1 the window
    assert layout.segments[0].count[200] == 4 and layout.segments[1].base[200] == 184


@pytest.mark.parametrize(
    "m",
    [
        masks.causal() & masks.dilated_window(12, 2),
        masks.sliding_window(10) & masks.strided(3),
        masks.dilated_window(20, 2) | masks.sliding_window(2),
        masks.strided(5) | masks.dilated_window(9, 3),
        masks.block_local(8) & masks.causal(),
        (masks.sink(3) | masks.strided(7)) & masks.sliding_window(40, 0),
        masks.sink(5, causal=False) | masks.strided(4),
        masks.sink(6) & masks.sliding_window(2, 3),
        masks.from_fn(lambda i, j: (i + j) % 5 == 0) | masks.causal(),
    ],
    ids=repr,
)
def test_combinators_are_exact(m):
    for shape in [(70, 70), (45, 83)]:
        i, j = _grid(*shape)
        np.testing.assert_array_equal(m.to_acsr(*shape).to_dense(), m(i, j))


def test_masks_are_values():
    assert masks.sliding_window(4) == masks.sliding_window(4, 4)
    assert hash(masks.strided(3) | masks.sink(1)) == hash(masks.strided(3) | masks.sink(1))
    assert masks.sliding_window(4).to_acsr(50) is masks.sliding_window(4).to_acsr(50, 50)
    a = np.eye(5, dtype=bool)
    assert masks.from_array(a) == masks.from_array(a.copy())


@pytest.mark.parametrize("shape", SHAPES)
def test_sinks_are_causal_unless_asked(shape):
    i, j = _grid(*shape)
    np.testing.assert_array_equal(masks.sink(4).to_acsr(*shape).to_dense(), (j < 4) & (j <= i))
    np.testing.assert_array_equal(
        masks.sink(4, causal=False).to_acsr(*shape).to_dense(), np.broadcast_to(j < 4, (shape[0], shape[1]))
    )


def test_streaming_llm_mask_never_looks_ahead():
    """The README's StreamingLLM mask: sinks + causal window, no key after the query in any row."""
    m = masks.sink(4) | masks.sliding_window(63, 0)
    i, j = _grid(200, 200)
    dense = m.to_acsr(200, 200).to_dense()
    assert not (dense & (j > i)).any()
    np.testing.assert_array_equal(dense, (j <= i) & ((j < 4) | (i - j <= 63)))
    # the bidirectional form does look ahead, in rows 0..2 only
    ahead = (masks.sink(4, causal=False) | masks.sliding_window(63, 0)).to_acsr(200, 200).to_dense() & (j > i)
    assert sorted(set(np.nonzero(ahead)[0])) == [0, 1, 2]


def test_sink_causality_is_part_of_the_value():
    assert masks.sink(3) == masks.sink(3, causal=True) == masks.sink(3, True)
    assert masks.sink(3) != masks.sink(3, causal=False)
    assert hash(masks.sink(3, causal=False)) == hash(masks.sink(3, causal=False))
    assert len({masks.sink(3), masks.sink(3, causal=False), masks.sink(3, np.True_)}) == 2
    assert masks.sink(3).to_acsr(10) != masks.sink(3, causal=False).to_acsr(10)


def test_from_fn_evaluates_in_row_chunks(monkeypatch):
    seen = []

    def f(i, j):
        seen.append(np.broadcast_shapes(i.shape, j.shape))
        return np.abs(i - j) <= 2

    monkeypatch.setattr(masks, "_CHUNK_ELEMS", 1000)
    layout = masks.from_fn(f).to_acsr(600, 300)
    assert layout.nnz == (np.abs(np.arange(600)[:, None] - np.arange(300)) <= 2).sum()
    # chunks of one residual row block (64 rows) at least, never the whole 600 x 300 grid
    assert max(r for r, _ in seen) == 64 and len(seen) == 10


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda: masks.sliding_window(-1), ValueError, "left must be >= 0"),
        (lambda: masks.sliding_window(3, -2), ValueError, "right must be >= 0"),
        (lambda: masks.sliding_window(2.5), TypeError, "left must be an int"),
        (lambda: masks.strided(0), ValueError, "stride must be >= 1"),
        (lambda: masks.dilated_window(4, 0), ValueError, "dilation must be >= 1"),
        (lambda: masks.block_local(0), ValueError, "block must be >= 1"),
        (lambda: masks.global_tokens(0), ValueError, "n must be >= 1"),
        (lambda: masks.sink(True), TypeError, "n must be an int"),
        (lambda: masks.sink(2, causal=1), TypeError, "causal must be a bool"),
        (lambda: masks.from_array(np.ones((3, 3))), TypeError, "boolean"),
        (lambda: masks.from_array(np.ones((2, 3, 3), bool)), ValueError, "2-D"),
        (lambda: masks.from_fn(3), TypeError, "callable"),
        (lambda: masks.causal() | np.ones((2, 2), bool), TypeError, "from_array"),
        (lambda: masks.causal().to_acsr(0), ValueError, "q_len must be a positive int"),
        (lambda: masks.from_array(np.eye(4, dtype=bool)).to_acsr(5, 5), ValueError, "shape"),
    ],
)
def test_bad_arguments_raise_clear_errors(make, err, match):
    with pytest.raises(err, match=match):
        make()
