"""Band forms read back from layouts (``acsr.band_form``): blocks of rows and interleaved phases.

The oracle is the form's own definition written out densely (``_form_mask``): a form is
returned only where it gives the layout's mask exactly, and masks that are no form give None.
"""

from __future__ import annotations

import numpy as np
import pytest

import acsr
from splat import masks


def _form_mask(form: acsr.BandForm, q_len: int, kv_len: int) -> np.ndarray:
    """The mask ``form`` defines, from its docstring's rule."""
    (left, right), block, d = form
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    t, u = i // d, j // d
    a = t - t % block
    keep = (i % d == j % d) & np.ones_like(i + j, bool)
    if left is not None:
        keep &= u >= a - left
    if right is not None:
        keep &= u <= a + right
    return keep


FORMS = [
    acsr.BandForm(acsr.Band(16, 15), block=16),
    acsr.BandForm(acsr.Band(None, 15), block=16),
    acsr.BandForm(acsr.Band(32, 7), block=8),
    acsr.BandForm(acsr.Band(0, 11), block=12),
    acsr.BandForm(acsr.Band(4, 4), phases=2),
    acsr.BandForm(acsr.Band(None, 0), phases=4),
    acsr.BandForm(acsr.Band(3, 0), phases=3),
    acsr.BandForm(acsr.Band(None, None), phases=2),
    acsr.BandForm(acsr.Band(2, -1), phases=2),
]


@pytest.mark.parametrize("form", FORMS, ids=repr)
@pytest.mark.parametrize("q_len, kv_len", [(96, 96), (48, 120), (120, 72)])
def test_a_form_is_read_back_from_its_dense_mask(form, q_len, kv_len):
    if form.phases > 1 and (q_len % form.phases or kv_len % form.phases):
        pytest.skip("phases need lengths that are multiples of them")
    mask = _form_mask(form, q_len, kv_len)
    got = acsr.band_form(acsr.from_dense(mask))
    if not mask.any():
        assert got is None
        return
    assert got is not None, form
    # a bound that never binds may read back differently; the mask must be the same
    assert np.array_equal(_form_mask(got, q_len, kv_len), mask), (got, form)
    assert got.phases == form.phases or got.block == 1 == form.block


@pytest.mark.parametrize(
    "mask, want",
    [
        (masks.dilated_window(512, 2), acsr.BandForm(acsr.Band(256, 256), phases=2)),
        (masks.block_local(512, 1), acsr.BandForm(acsr.Band(512, 511), block=512)),
        (masks.strided(64), acsr.BandForm(acsr.Band(None, 0), phases=64)),
        (masks.causal(), acsr.BandForm(acsr.Band(None, 0))),
    ],
    ids=repr,
)
def test_catalogue_masks_read_as_their_forms(mask, want):
    layout = mask.to_acsr(4096, 4096)
    assert acsr.band_form(layout) == want
    assert np.array_equal(_form_mask(want, 4096, 4096), layout.to_dense())


def _ij(n):
    return np.arange(n)[:, None], np.arange(n)[None, :]


@pytest.mark.parametrize(
    "mask",
    [
        lambda i, j: (np.abs(i - j) <= 4) & ((i - j) % 2 == 1),  # keys of the other phase
        lambda i, j: (np.abs(i - j) <= 4) | (j < 2),  # global + window
        lambda i, j: (np.abs(i - j) <= 6) & ((i - j) % 2 == 0) & ((i < 20) | (i > 21)),  # a hole of rows
        lambda i, j: (np.abs(i - j) <= 6 + 2 * (i % 2)) & ((i - j) % 2 == 0),  # phases of two widths
        lambda i, j: (j // 8 <= i // 8) & (j // 8 >= i // 8 - 1) & (j != i),  # blocks with a hole
        lambda i, j: (j // 8 <= i // 8) & (j // 6 >= i // 6 - 1),  # bounds of two block heights
        lambda i, j: np.zeros_like(i + j, bool),  # empty
    ],
)
def test_masks_that_are_no_form_give_none(mask):
    i, j = _ij(48)
    assert acsr.band_form(acsr.from_dense(mask(i, j))) is None


def test_phases_need_lengths_that_are_multiples_of_them():
    assert acsr.band_form(masks.dilated_window(8, 2).to_acsr(63, 64)) is None
    assert acsr.band_form(masks.dilated_window(8, 2).to_acsr(64, 64)).phases == 2
