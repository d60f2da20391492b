"""Trace-time mask detection (``splat.sparsify``); see :mod:`splat._sparsify.api`."""

from splat._sparsify.api import Found, SparsifyWarning, sparsify

__all__ = ["Found", "SparsifyWarning", "sparsify"]
