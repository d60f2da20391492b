"""The ACSR sparse format (affine-compressed sparse row) for regular attention masks.

Depends on numpy only (no other package of this project). See :mod:`acsr._format`
for the documented arrays and :mod:`acsr._plan` for the backend-neutral walk plans
(row order, key spans, segment modes, tile cover, block order, pattern family)
and :mod:`acsr._bands` for the diagonal bands the band kernels take.
"""

from acsr._bands import Band, BandForm, band, band_form
from acsr._build import (
    DEFAULT_BLOCK,
    from_csr,
    from_dense,
    from_dense_chunks,
    from_grid,
    from_row_chunks,
    from_runs,
    residual_from_csr,
    to_csr,
    transpose,
    validate,
)
from acsr._format import ACSR, MAX_SEGMENTS, BlockResidual, LayoutError, Segment
from acsr._grid import GridAxis, GridWindows, canonical_axis
from acsr._law import MAX_PIECES, ClosedForm, Law, Piece, fit_closed_form, fit_law
from acsr._plan import (
    FAMILIES,
    MODES,
    SegmentMode,
    WalkPlan,
    block_order,
    block_rows,
    block_work,
    key_spans,
    pattern_family,
    row_permutation,
    segment_modes,
    tile_cover,
    walk_plan,
)
from acsr._runs import (
    csr_from_runs,
    dense_from_runs,
    merge_intervals,
    runs_are_canonical,
    runs_from_csr,
    runs_from_dense,
)

__all__ = [
    "ACSR",
    "Band",
    "BandForm",
    "BlockResidual",
    "ClosedForm",
    "DEFAULT_BLOCK",
    "FAMILIES",
    "GridAxis",
    "GridWindows",
    "Law",
    "LayoutError",
    "MAX_PIECES",
    "MAX_SEGMENTS",
    "MODES",
    "Piece",
    "Segment",
    "SegmentMode",
    "WalkPlan",
    "band",
    "band_form",
    "block_order",
    "block_rows",
    "block_work",
    "canonical_axis",
    "csr_from_runs",
    "dense_from_runs",
    "fit_closed_form",
    "fit_law",
    "from_csr",
    "from_dense",
    "from_dense_chunks",
    "from_grid",
    "from_row_chunks",
    "from_runs",
    "key_spans",
    "merge_intervals",
    "pattern_family",
    "residual_from_csr",
    "row_permutation",
    "runs_are_canonical",
    "runs_from_csr",
    "runs_from_dense",
    "segment_modes",
    "tile_cover",
    "to_csr",
    "transpose",
    "validate",
    "walk_plan",
]
