"""splat: sparse regular attention for JAX.

Masks are analyzed just in time into ACSR layouts (affine-compressed sparse
row); on CUDA, generated Triton kernels run them, elsewhere a pure-JAX backend.

Example:
  >>> import jax, jax.numpy as jnp, splat
  >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 2, 16))
  >>> out = splat.attention(q, k, v, mask=splat.masks.sliding_window(8))
  >>> out.shape
  (1, 64, 2, 16)
"""

from splat import (
    flax,  # noqa: E402  (imports flax itself only when used)
    masks,
)
from splat._analyzer import HeadGroupsReport, Report, analyze, report
from splat._attention import attention, sddmm, softmax, spmm
from splat._buckets import bucket_length, pad_to_bucket
from splat._call_log import CallRecord, call_counts, call_log, guard_log
from splat._decorator import SparseAttentionFallbackWarning, sparse_attention
from splat._kvcache import attention_with_kvcache, update_kvcache
from splat._neighborhood_attention import neighborhood_attention
from splat._sharded import SequenceAxis, sharded_attention, unzigzag, zigzag, zigzag_positions
from splat._sparsify import SparsifyWarning, sparsify

__version__ = "0.1.0"

__all__ = [
    "CallRecord",
    "HeadGroupsReport",
    "Report",
    "SequenceAxis",
    "SparseAttentionFallbackWarning",
    "SparsifyWarning",
    "analyze",
    "attention",
    "attention_with_kvcache",
    "bucket_length",
    "call_counts",
    "call_log",
    "guard_log",
    "flax",
    "masks",
    "neighborhood_attention",
    "pad_to_bucket",
    "report",
    "sddmm",
    "sharded_attention",
    "softmax",
    "sparse_attention",
    "sparsify",
    "spmm",
    "unzigzag",
    "update_kvcache",
    "zigzag",
    "zigzag_positions",
    "__version__",
]
