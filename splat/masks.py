"""Attention masks as frozen, size-free values.

A mask says which key ``j`` each query ``i`` may attend to. It does not know the
sequence lengths: ``mask.to_acsr(q_len, kv_len)`` builds the layout (cached, so
equal masks share layouts, plans and kernels), and ``mask(q_idx, kv_idx)`` is
the same rule as a vectorised numpy predicate.

The constructors compute the layout's canonical rows directly in O(q_len)
(no ``q_len x kv_len`` array); ``|`` and ``&`` combine masks, with fast paths
for interval unions and intersections and an exact O(nnz) fallback.

Example:
  >>> from splat import masks
  >>> m = masks.sliding_window(2) | masks.global_tokens(1)
  >>> m.to_acsr(6, 6).to_dense().astype(int)
  array([[1, 1, 1, 1, 1, 1],
         [1, 1, 1, 1, 0, 0],
         [1, 1, 1, 1, 1, 0],
         [1, 1, 1, 1, 1, 1],
         [1, 0, 1, 1, 1, 1],
         [1, 0, 0, 1, 1, 1]])
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import acsr
from acsr import ACSR

Runs = tuple[np.ndarray, np.ndarray, np.ndarray]  # (base, stride, count), each int64 [q_len, K]

# predicate chunks hold at most this many (row, column) pairs: small enough that a predicate's
# temporaries stay in cache (a NATTEN predicate at 128x128: 0.8 s with 2^20, 2.8 s with 2^24;
# 2^17-2^19 no faster), large enough that the per-chunk analysis stays a small part of the time
_CHUNK_ELEMS = 1 << 20


class Mask:
    """Base class of all masks: frozen values with ``|`` and ``&``."""

    def __call__(self, q_idx, kv_idx) -> np.ndarray:
        """Vectorised predicate: True where query ``q_idx`` may attend to key ``kv_idx``."""
        raise NotImplementedError

    def _runs(self, q_len: int, kv_len: int) -> Runs | None:
        """Canonical runs (see ``acsr._runs``), or None where no fast path exists."""
        return None

    def _dense_rows(self, r0: int, r1: int, kv_len: int) -> np.ndarray:
        """Boolean ``[r1 - r0, kv_len]`` rows of the mask, from the predicate."""
        return self._dense_rows_at(np.arange(r0, r1), kv_len)

    def _dense_rows_at(self, rows: np.ndarray, kv_len: int) -> np.ndarray:
        """Boolean ``[len(rows), kv_len]``: the mask's rows ``rows`` (int ``[r]``), from the predicate."""
        q = np.asarray(rows)[:, None]
        out = np.asarray(self(q, np.arange(kv_len)[None, :]), dtype=bool)
        return np.broadcast_to(out, (q.shape[0], kv_len))

    def to_acsr(self, q_len: int, kv_len: int | None = None, *, block=acsr.DEFAULT_BLOCK) -> ACSR:
        """The mask's layout for ``q_len`` queries and ``kv_len`` keys (default ``q_len``)."""
        kv_len = q_len if kv_len is None else kv_len
        for name, n in (("q_len", q_len), ("kv_len", kv_len)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        return _to_acsr(self, int(q_len), int(kv_len), tuple(block))

    def __or__(self, other: Mask) -> Mask:
        return Union(self, _check_mask(other, "|"))

    def __and__(self, other: Mask) -> Mask:
        return Intersection(self, _check_mask(other, "&"))


def _check_mask(m, op: str) -> Mask:
    if not isinstance(m, Mask):
        raise TypeError(
            f"cannot combine a Mask with {type(m).__name__} using {op!r}; wrap arrays in masks.from_array"
        )
    return m


@functools.lru_cache(maxsize=64)
def _to_acsr(mask: Mask, q_len: int, kv_len: int, block: tuple[int, int]) -> ACSR:
    runs = mask._runs(q_len, kv_len)
    if runs is not None:
        return acsr.from_runs(q_len, kv_len, *runs, block=block)
    return acsr.from_dense_chunks(
        q_len,
        kv_len,
        lambda r0, r1: mask._dense_rows(r0, r1, kv_len),
        block=block,
        chunk_rows=max(1, _CHUNK_ELEMS // kv_len),
        make_rows=lambda rows: mask._dense_rows_at(rows, kv_len),
    )


def _one_run(base, count, stride=None) -> Runs:
    count = np.maximum(np.asarray(count, np.int64), 0)
    base = np.where(count > 0, base, 0).astype(np.int64)
    stride = (
        np.ones_like(base) if stride is None else np.broadcast_to(np.asarray(stride, np.int64), base.shape)
    )
    stride = np.where(count > 1, stride, 1)
    return base[:, None], stride[:, None].copy(), count[:, None]


def _interval(lo, hi) -> Runs:
    return _one_run(lo, np.asarray(hi) - np.asarray(lo))


def _progression(lo, hi, phase, step) -> Runs:
    """Columns ``c`` in ``[lo, hi)`` with ``c = phase (mod step)``, per row (``step`` int or array)."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    base = lo + (phase - lo) % step
    last = (hi - 1) - ((hi - 1 - phase) % step)
    count = np.where(last >= base, (last - base) // step + 1, 0)
    return _one_run(base, count, step)


def _int_arg(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


# --- families -----------------------------------------------------------------


@dataclass(frozen=True)
class Full(Mask):
    """Every query attends to every key."""

    def __call__(self, q_idx, kv_idx):
        return np.ones(np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx)), bool)

    def _runs(self, q_len, kv_len):
        r = np.arange(q_len)
        return _interval(0 * r, 0 * r + kv_len)


@dataclass(frozen=True)
class Causal(Mask):
    """``j <= i`` (aligned at the top left when ``q_len != kv_len``)."""

    def __call__(self, q_idx, kv_idx):
        return np.asarray(kv_idx) <= np.asarray(q_idx)

    def _runs(self, q_len, kv_len):
        r = np.arange(q_len)
        return _interval(0 * r, np.minimum(r + 1, kv_len))


@dataclass(frozen=True)
class SlidingWindow(Mask):
    """``i - left <= j <= i + right``: ``left`` keys behind, ``right`` ahead."""

    left: int
    right: int

    def __post_init__(self):
        _int_arg("left", self.left, 0)
        _int_arg("right", self.right, 0)

    def __call__(self, q_idx, kv_idx):
        d = np.asarray(q_idx) - np.asarray(kv_idx)
        return (d <= self.left) & (-d <= self.right)

    def _runs(self, q_len, kv_len):
        r = np.arange(q_len)
        return _interval(np.maximum(r - self.left, 0), np.minimum(r + self.right + 1, kv_len))


@dataclass(frozen=True)
class DilatedWindow(Mask):
    """``|i - j| <= radius`` and ``(i - j) % dilation == 0``."""

    radius: int
    dilation: int

    def __post_init__(self):
        _int_arg("radius", self.radius, 0)
        _int_arg("dilation", self.dilation, 1)

    def __call__(self, q_idx, kv_idx):
        d = np.asarray(q_idx) - np.asarray(kv_idx)
        return (np.abs(d) <= self.radius) & (d % self.dilation == 0)

    def _runs(self, q_len, kv_len):
        r = np.arange(q_len)
        lo = np.maximum(r - self.radius, 0)
        hi = np.minimum(r + self.radius + 1, kv_len)
        return _progression(lo, hi, r, self.dilation)


@dataclass(frozen=True)
class Strided(Mask):
    """Sparse-Transformer strided: ``j <= i`` and ``(i - j) % stride == 0``."""

    stride: int

    def __post_init__(self):
        _int_arg("stride", self.stride, 1)

    def __call__(self, q_idx, kv_idx):
        d = np.asarray(q_idx) - np.asarray(kv_idx)
        return (d >= 0) & (d % self.stride == 0)

    def _runs(self, q_len, kv_len):
        r = np.arange(q_len)
        return _progression(0 * r, np.minimum(r + 1, kv_len), r, self.stride)


@dataclass(frozen=True)
class BlockLocal(Mask):
    """Query block ``i // block`` sees its own key block and the ``lookback`` before it."""

    block: int
    lookback: int = 1

    def __post_init__(self):
        _int_arg("block", self.block, 1)
        _int_arg("lookback", self.lookback, 0)

    def __call__(self, q_idx, kv_idx):
        bq = np.asarray(q_idx) // self.block
        bk = np.asarray(kv_idx) // self.block
        return (bk <= bq) & (bk >= bq - self.lookback)

    def _runs(self, q_len, kv_len):
        b = np.arange(q_len) // self.block
        return _interval(
            np.maximum((b - self.lookback) * self.block, 0), np.minimum((b + 1) * self.block, kv_len)
        )


@dataclass(frozen=True)
class GlobalTokens(Mask):
    """The first ``n`` queries attend everywhere and every query attends to the first ``n`` keys."""

    n: int

    def __post_init__(self):
        _int_arg("n", self.n, 1)

    def __call__(self, q_idx, kv_idx):
        return (np.asarray(q_idx) < self.n) | (np.asarray(kv_idx) < self.n)

    def _runs(self, q_len, kv_len):
        r = np.arange(q_len)
        return _interval(0 * r, np.where(r < self.n, kv_len, min(self.n, kv_len)))


@dataclass(frozen=True)
class Sink(Mask):
    """Attention sinks: keys ``j < n``; with ``causal`` (the default) only those with ``j <= i``.

    ``causal=False`` lets every row see all ``n`` sink keys, also rows ``i < n - 1``
    that come before some of them (for bidirectional models).
    """

    n: int
    causal: bool = True

    def __post_init__(self):
        _int_arg("n", self.n, 1)
        if not isinstance(self.causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__} {self.causal!r}")
        object.__setattr__(self, "causal", bool(self.causal))

    def __call__(self, q_idx, kv_idx):
        kv = np.asarray(kv_idx)
        keep = kv < self.n
        if self.causal:
            keep = keep & (kv <= np.asarray(q_idx))
        return np.broadcast_to(keep, np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx)))

    def _runs(self, q_len, kv_len):
        r = np.arange(q_len)
        hi = 0 * r + min(self.n, kv_len)
        return _interval(0 * r, np.minimum(hi, r + 1) if self.causal else hi)


# --- combinators -----------------------------------------------------------------


def _is_intervals(runs: Runs) -> bool:
    base, stride, count = runs
    return bool(np.all(stride[count > 1] == 1))


def _enumerate(a: Runs, b: Runs, q_len: int, kv_len: int, combine) -> Runs:
    """Exact O(nnz) combination: expand both to (row, column) keys, combine, re-run."""
    keys = []
    for base, stride, count in (a, b):
        indptr, cols = acsr.csr_from_runs(base, stride, count)
        rows = np.repeat(np.arange(q_len, dtype=np.int64), np.diff(indptr))
        keys.append(rows * kv_len + cols)
    key = combine(keys[0], keys[1])  # sorted and unique
    rows, cols = key // kv_len, key % kv_len
    indptr = np.zeros(q_len + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=q_len), out=indptr[1:])
    return acsr.runs_from_csr(indptr, cols)


@dataclass(frozen=True)
class Union(Mask):
    """Positions in ``a`` or ``b``."""

    a: Mask
    b: Mask

    def __call__(self, q_idx, kv_idx):
        return self.a(q_idx, kv_idx) | self.b(q_idx, kv_idx)

    def _runs(self, q_len, kv_len):
        ra, rb = self.a._runs(q_len, kv_len), self.b._runs(q_len, kv_len)
        if ra is None or rb is None:
            return None
        if _is_intervals(ra) and _is_intervals(rb):
            lo = np.concatenate([ra[0], rb[0]], axis=1)
            hi = lo + np.concatenate([ra[2], rb[2]], axis=1)
            merged = acsr.merge_intervals(lo, hi)
            if merged is not None:
                base, count = merged
                return base, np.ones_like(base), count
        return _enumerate(ra, rb, q_len, kv_len, np.union1d)

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"


@dataclass(frozen=True)
class Intersection(Mask):
    """Positions in both ``a`` and ``b``."""

    a: Mask
    b: Mask

    def __call__(self, q_idx, kv_idx):
        return self.a(q_idx, kv_idx) & self.b(q_idx, kv_idx)

    def _runs(self, q_len, kv_len):
        ra, rb = self.a._runs(q_len, kv_len), self.b._runs(q_len, kv_len)
        if ra is None or rb is None:
            return None
        if not _is_intervals(ra):
            ra, rb = rb, ra
        if _is_intervals(ra) and ra[0].shape[1] == 1 and rb[0].shape[1] == 1:
            # one interval per row against one progression per row: clip the progression
            base, stride, count = (x[:, 0] for x in rb)
            lo = np.maximum(ra[0][:, 0], base)
            hi = np.minimum(ra[0][:, 0] + ra[2][:, 0], base + stride * np.maximum(count - 1, 0) + 1)
            hi = np.where(count > 0, hi, lo)
            return _progression(lo, hi, base, stride)
        return _enumerate(ra, rb, q_len, kv_len, lambda x, y: np.intersect1d(x, y, assume_unique=True))

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"


# --- user-supplied masks ---------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FromArray(Mask):
    """A fixed boolean ``[q_len, kv_len]`` array; equal arrays give equal masks."""

    array: np.ndarray
    _digest: bytes = field(default=b"", repr=False)

    def __post_init__(self):
        a = np.asarray(self.array)
        if a.dtype != np.bool_:
            raise TypeError(f"mask array must be boolean, got dtype {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"mask array must be 2-D [q_len, kv_len], got shape {a.shape}")
        a = np.ascontiguousarray(a)
        a.setflags(write=False)
        h = hashlib.blake2b(np.packbits(a).tobytes(), digest_size=20)
        h.update(repr(a.shape).encode())
        object.__setattr__(self, "array", a)
        object.__setattr__(self, "_digest", h.digest())

    def __eq__(self, other):
        return isinstance(other, FromArray) and self._digest == other._digest

    def __hash__(self):
        return hash(self._digest)

    def __repr__(self):
        return f"FromArray(shape={self.array.shape}, nnz={int(self.array.sum())})"

    def __call__(self, q_idx, kv_idx):
        return self.array[np.asarray(q_idx), np.asarray(kv_idx)]

    def to_acsr(self, q_len=None, kv_len=None, *, block=acsr.DEFAULT_BLOCK) -> ACSR:
        shape = self.array.shape
        q_len = shape[0] if q_len is None else q_len
        kv_len = shape[1] if kv_len is None else kv_len
        if (q_len, kv_len) != shape:
            raise ValueError(
                f"mask array has shape {shape}, but the attention is {q_len} x {kv_len} (q_len x kv_len)"
            )
        return super().to_acsr(q_len, kv_len, block=block)

    def _dense_rows(self, r0, r1, kv_len):
        return self.array[r0:r1]

    def _dense_rows_at(self, rows, kv_len):
        return self.array[rows]


@dataclass(frozen=True)
class FromFn(Mask):
    """A vectorised mask function ``f(q_idx, kv_idx) -> bool``, evaluated in row chunks."""

    fn: Callable

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"from_fn needs a callable f(q_idx, kv_idx), got {type(self.fn).__name__}")

    def __repr__(self):
        # the function's name, not its address: reprs name masks in logs and results, and stay
        # the same from one process to the next
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"FromFn(fn={getattr(self.fn, '__module__', None) or '?'}.{name})"

    def __call__(self, q_idx, kv_idx):
        return np.asarray(self.fn(q_idx, kv_idx), dtype=bool)


# --- public constructors ------------------------------------------------------------


def full() -> Mask:
    """Dense attention: every key."""
    return Full()


def causal() -> Mask:
    """Causal attention, ``j <= i``."""
    return Causal()


def sliding_window(left: int, right: int | None = None) -> Mask:
    """Keys ``i - left <= j <= i + right``; ``right`` defaults to ``left``.

    ``sliding_window(w - 1, 0)`` is a causal window of ``w`` keys (Mistral).
    """
    return SlidingWindow(left, left if right is None else right)


def dilated_window(radius: int, dilation: int) -> Mask:
    """Keys within ``radius`` of ``i`` whose distance is a multiple of ``dilation``."""
    return DilatedWindow(radius, dilation)


def strided(stride: int) -> Mask:
    """Sparse-Transformer strided pattern: ``j <= i`` and ``(i - j) % stride == 0``."""
    return Strided(stride)


def block_local(block: int, lookback: int = 1) -> Mask:
    """Each query block of ``block`` rows sees its own key block and ``lookback`` previous ones."""
    return BlockLocal(block, lookback)


def global_tokens(n: int) -> Mask:
    """Longformer global tokens: the first ``n`` rows see all keys, all rows see the first ``n`` keys."""
    return GlobalTokens(n)


def sink(n: int, causal: bool = True) -> Mask:
    """Attention sinks (StreamingLLM): the first ``n`` keys, seen by every later row.

    Causal by default: row ``i`` sees sink key ``j < n`` only when ``j <= i``, so
    ``sink(4) | sliding_window(1023, 0)`` never looks ahead, also in rows 0-2.
    ``causal=False`` is the bidirectional form: every row sees all ``n`` keys
    (``j < n``), as in an encoder.

    Example:
      >>> from splat import masks
      >>> masks.sink(2).to_acsr(4, 4).to_dense().astype(int)
      array([[1, 0, 0, 0],
             [1, 1, 0, 0],
             [1, 1, 0, 0],
             [1, 1, 0, 0]])
      >>> int(masks.sink(2, causal=False).to_acsr(4, 4).nnz)
      8
    """
    return Sink(n, causal)


def from_array(array) -> Mask:
    """A boolean ``[q_len, kv_len]`` array (numpy, or a concrete jax array) as a mask."""
    if hasattr(array, "aval") and not hasattr(array, "__array__"):
        raise TypeError("mask array is a tracer: pass a concrete (trace-time constant) array")
    try:
        a = np.asarray(array)
    except Exception as e:  # jax tracers refuse conversion
        raise TypeError(
            "mask array must be concrete at trace time (a numpy array or a constant jax array), "
            f"got {type(array).__name__}"
        ) from e
    return FromArray(a)


def from_fn(fn: Callable) -> Mask:
    """A vectorised mask function ``fn(q_idx, kv_idx) -> bool`` on numpy int arrays.

    It is called on ``[rows, 1]`` and ``[1, kv_len]`` index arrays, a chunk of
    rows at a time, so the full ``q_len x kv_len`` grid never sits in memory
    (and, for a square mask with rows of many runs, on a few scattered rows
    first, to find a grid product such as a neighbourhood written on flat
    indices: it then gets the layout ``neighborhood`` builds).

    Example:
      >>> from splat import masks
      >>> m = masks.from_fn(lambda i, j: (i - j) % 3 == 0)
      >>> int(m.to_acsr(9, 9).nnz)
      33
    """
    return FromFn(fn)


from splat._neighborhood import neighborhood  # noqa: E402  (subclasses Mask, defined above)

__all__ = [
    "Mask",
    "block_local",
    "causal",
    "dilated_window",
    "from_array",
    "from_fn",
    "full",
    "global_tokens",
    "neighborhood",
    "parse",
    "sink",
    "sliding_window",
    "strided",
]


# --- mask expressions ---------------------------------------------------------------------

# Public names that are not constructors of literal arguments (arrays, callables, the parser).
_NOT_PARSEABLE = frozenset({"Mask", "from_array", "from_fn", "parse"})


def _constructors() -> dict[str, Callable]:
    """Name -> constructor, for every public constructor a mask expression may call."""
    return {n: globals()[n] for n in __all__ if n not in _NOT_PARSEABLE and callable(globals().get(n))}


def parse(expr: str) -> Mask:
    """The mask a string such as ``"sliding_window(256, 256) | global_tokens(4)"`` describes.

    The string is parsed with :mod:`ast`, never evaluated. It may contain only
    calls of this module's constructors (optionally written ``masks.NAME``) with
    literal arguments, positional or keyword (ints, negative ints, ``True`` /
    ``False``, and tuples or lists of those, for per-axis arguments), combined
    with ``|``, ``&`` and parentheses (``&`` binds tighter, as in Python). Each
    constructor validates its own arguments, and its message is passed on.

    Args:
      expr: the mask expression.

    Returns:
      The :class:`Mask`, equal to the one the same Python expression would build.

    Raises:
      ValueError: naming the offending part of the expression (a bad argument,
        an unknown name, unsupported syntax), with what is allowed instead.

    Example:
      >>> from splat import masks
      >>> m = masks.parse("sliding_window(2) | global_tokens(1)")
      >>> m == masks.sliding_window(2) | masks.global_tokens(1)
      True
      >>> int(m.to_acsr(6, 6).nnz)
      30
    """
    import ast
    import inspect

    if not isinstance(expr, str):
        raise ValueError(f"mask expression must be a string, got {type(expr).__name__}")
    ctors = _constructors()
    allowed = ", ".join(sorted(ctors))

    def where(node: ast.AST) -> str:
        return f" (at column {node.col_offset + 1})" if hasattr(node, "col_offset") else ""

    def call_hint(name: str) -> str:
        params = inspect.signature(ctors[name]).parameters.values()
        shown = (p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params)
        return f"{name}({', '.join(shown)})"

    def literal(node: ast.AST, what: str):
        if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            return node.value
        if (
            isinstance(node, ast.UnaryOp)
            and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) is int
        ):
            return -node.operand.value
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(literal(e, what) for e in node.elts)
        raise ValueError(
            f"{what} must be an int or bool literal (or a tuple of them), got {ast.unparse(node)!r}"
            f"{where(node)} in mask expression {expr!r}"
        )

    def build(node: ast.AST) -> Mask:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitOr, ast.BitAnd)):
            left, right = build(node.left), build(node.right)
            return left | right if isinstance(node.op, ast.BitOr) else left & right
        bare = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if isinstance(node, (ast.Name, ast.Attribute)) and bare in ctors:
            raise ValueError(f"{bare!r} is a mask constructor, not a mask: call it, as in {call_hint(bare)}")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "masks":
                name = f.attr
            elif isinstance(f, ast.Name):
                name = f.id
            else:
                raise ValueError(
                    f"only calls of mask constructors are allowed, got {ast.unparse(f)!r}{where(f)}; "
                    f"constructors: {allowed}"
                )
            if name not in ctors:
                raise ValueError(f"unknown mask constructor {name!r}{where(f)}; constructors: {allowed}")
            args = [literal(a, f"argument {i + 1} of {name}") for i, a in enumerate(node.args)]
            kwargs = {}
            for kw in node.keywords:
                if kw.arg is None:
                    raise ValueError(f"'**' arguments are not allowed in mask expression {expr!r}")
                kwargs[kw.arg] = literal(kw.value, f"argument {kw.arg!r} of {name}")
            try:
                return ctors[name](*args, **kwargs)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{ast.unparse(node)}: {e}") from None
        raise ValueError(
            f"unsupported syntax {ast.unparse(node)!r}{where(node)} in mask expression {expr!r}: use calls "
            f"of mask constructors with literal arguments, '|', '&' and parentheses; constructors: {allowed}"
        )

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"mask expression {expr!r} is not a valid expression: {e.msg}") from None
    return build(tree.body)
