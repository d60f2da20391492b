"""The ACSR sparse format (affine-compressed sparse row) for regular attention masks.

Depends on numpy only. See :mod:`acsr._format` for the documented arrays.
"""

from acsr._build import (
    DEFAULT_BLOCK,
    from_csr,
    from_dense,
    from_dense_chunks,
    from_row_chunks,
    from_runs,
    residual_from_csr,
    to_csr,
    transpose,
    validate,
)
from acsr._format import ACSR, MAX_SEGMENTS, BlockResidual, LayoutError, Segment
from acsr._law import MAX_PIECES, ClosedForm, Law, Piece, fit_closed_form, fit_law
from acsr._runs import csr_from_runs, dense_from_runs, merge_intervals, runs_from_csr, runs_from_dense

__all__ = [
    "ACSR",
    "BlockResidual",
    "ClosedForm",
    "DEFAULT_BLOCK",
    "Law",
    "LayoutError",
    "MAX_PIECES",
    "MAX_SEGMENTS",
    "Piece",
    "Segment",
    "csr_from_runs",
    "dense_from_runs",
    "fit_closed_form",
    "fit_law",
    "from_csr",
    "from_dense",
    "from_dense_chunks",
    "from_row_chunks",
    "from_runs",
    "merge_intervals",
    "residual_from_csr",
    "runs_from_csr",
    "runs_from_dense",
    "to_csr",
    "transpose",
    "validate",
]
