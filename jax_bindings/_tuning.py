"""The tuning store: measured tile configs and backend timings, one JSON file per device kind.

Files ship with the package as ``jax_bindings/tuning/<slug>.json``, where
``slug`` is :func:`device_slug` of ``jax.devices()[0].device_kind`` (e.g.
``"NVIDIA H100 80GB HBM3"`` -> ``nvidia-h100-80gb-hbm3.json``);
``SPLAT_TUNING_FILE=<path>`` reads that file instead. The store is read once per
process, on first use, and validated: a malformed file raises
:class:`TuningStoreError` naming the file and the field. No file means an empty
store, and every question gets the heuristic answer. ``splat tune`` writes the
files; ``jax_bindings/tuning/README.md`` documents the schema (version
:data:`SCHEMA`)::

    {"schema": 1, "device_kind": "NVIDIA H100 80GB HBM3",
     "tiles": [{"op": "fwd", "family": "causal_window", "s_bucket": 4096, "head_dim": 64,
                "dtype": "bfloat16", "config": [128, 64, 4, 3, "fused"], "time_ms": 0.41}],
     "implementations": [{"family": "causal_window", "s_bucket": 4096, "head_dim": 64,
                          "dtype": "bfloat16", "pass": "fwd_bwd",
                          "times_ms": {"triton": 1.9, "cudnn": 1.5}}]}

Entries may carry more fields (when and how they were measured); readers ignore
them. Each key (``op, family, s_bucket, head_dim, dtype`` for tiles;
``family, s_bucket, head_dim, dtype, pass`` for implementations) appears once.

**S buckets.** ``s_bucket`` is a power of two. A question about ``q_len`` is
answered from the entry, among those matching exactly in everything else,
whose bucket is nearest to ``q_len`` on a log2 scale (``|log2(s_bucket) -
log2(q_len)|``; a tie goes to the larger bucket), however far that is.

Example:
  >>> from jax_bindings import _tuning
  >>> _tuning.device_slug("NVIDIA H100 80GB HBM3")
  'nvidia-h100-80gb-hbm3'
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import jax

SCHEMA = 1
ENV_FILE = "SPLAT_TUNING_FILE"
SHIPPED_DIR = Path(__file__).resolve().parent / "tuning"
DTYPES = ("float32", "bfloat16", "float16")
PASSES = ("fwd", "fwd_bwd")

# The heuristic where the store has no timing (see rank_backends): on compute capability 9.x cuDNN
# goes first on the masks it takes. It was measured 1.3x splat's Triton kernels there (H100, causal
# window 1024: 468 vs 362 useful TFLOP/s); the generated CUDA kernels are within about 10% of it
# either way (D = 128 forward 1.01-1.19x, D = 256 forward+backward 0.81-0.93x on H100), so without
# a timing of the device at hand cuDNN stays the choice that is never far off. The shipped stores
# rank by their own timings. The families are those jax_bindings._cudnn recognises.
_PREFERRED_ON_SM9X = "cudnn"
_CUDNN_FAMILIES = frozenset({"full", "causal", "causal_window"})


class TuningStoreError(ValueError):
    """A tuning file that does not follow the schema; the message names the file and the field."""


@dataclass(frozen=True)
class TileEntry:
    """The best tiles measured for one kernel op, mask family, S bucket, head dim and dtype."""

    op: str
    family: str
    s_bucket: int
    head_dim: int
    dtype: str
    config: tuple[int, int, int, int, str]  # (block_m, block_n, num_warps, num_stages, loop)
    time_ms: float


@dataclass(frozen=True)
class ImplementationEntry:
    """Times of each backend for one family, S bucket, head dim, dtype and pass."""

    family: str
    s_bucket: int
    head_dim: int
    dtype: str
    pass_: str  # "fwd" or "fwd_bwd" (the JSON field "pass")
    times_ms: tuple[tuple[str, float], ...]  # (backend, milliseconds), as in the file


@dataclass(frozen=True)
class Store:
    """A validated tuning file (or the empty store when there is none)."""

    path: Path | None
    device_kind: str
    tiles: tuple[TileEntry, ...] = ()
    implementations: tuple[ImplementationEntry, ...] = ()


# -- reading -----------------------------------------------------------------------


def device_slug(device_kind: str) -> str:
    """File stem for a device kind: lowercased, every run of non-alphanumerics one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")


def _device_kind() -> str:
    return jax.devices()[0].device_kind


@functools.cache
def _compute_capability() -> str | None:
    """``"9.0"`` etc. on a CUDA GPU, else None."""
    return getattr(jax.devices()[0], "compute_capability", None)


def store_path() -> Path | None:
    """The file the store reads: ``$SPLAT_TUNING_FILE``, else the shipped one for this device, if any."""
    override = os.environ.get(ENV_FILE)
    if override:
        return Path(override)
    shipped = SHIPPED_DIR / f"{device_slug(_device_kind())}.json"
    return shipped if shipped.is_file() else None


@functools.cache
def store() -> Store:
    """The tuning store of this process, read and validated on first use."""
    path = store_path()
    if path is None:
        return Store(None, _device_kind())
    s = load(path)
    if os.environ.get(ENV_FILE) is None and device_slug(s.device_kind) != path.stem:
        raise TuningStoreError(f"{path}: device_kind {s.device_kind!r} does not match the file name")
    return s


def load(path) -> Store:
    """Reads and validates one tuning file; raises :class:`TuningStoreError`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise TuningStoreError(f"{path}: cannot read the tuning file ({e})") from e
    except json.JSONDecodeError as e:
        raise TuningStoreError(f"{path}: not JSON ({e})") from e
    return _parse(data, str(path))


def _parse(data, where: str) -> Store:
    f = _Fields(where)
    f.obj(data, "the file")
    schema = f.get(data, "schema", int)
    if schema != SCHEMA:
        raise TuningStoreError(f"{where}: schema {schema} is not read by this splat (it reads {SCHEMA})")
    kind = f.get(data, "device_kind", str)
    tiles = tuple(_tile(f, x, f"tiles[{i}]") for i, x in enumerate(f.get(data, "tiles", list)))
    impls = tuple(
        _impl(f, x, f"implementations[{i}]") for i, x in enumerate(f.get(data, "implementations", list))
    )
    f.unique(tiles, "tiles", lambda t: (t.op, t.family, t.s_bucket, t.head_dim, t.dtype))
    f.unique(impls, "implementations", lambda t: (t.family, t.s_bucket, t.head_dim, t.dtype, t.pass_))
    return Store(Path(where), kind, tiles, impls)


def _tile(f: _Fields, x, at: str) -> TileEntry:
    f.obj(x, at)
    cfg = f.get(x, "config", list, at)
    if len(cfg) != 5:
        raise TuningStoreError(
            f"{f.where}: {at}.config must be [block_m, block_n, num_warps, num_stages, loop], got {cfg!r}"
        )
    for i, name in enumerate(("block_m", "block_n", "num_warps", "num_stages")):
        f.positive_int(cfg[i], f"{at}.config[{i}] ({name})")
    if not isinstance(cfg[4], str) or not cfg[4]:  # its values are the Triton spec's to check
        raise TuningStoreError(f"{f.where}: {at}.config[4] (loop) must be a name, got {cfg[4]!r}")
    return TileEntry(
        op=f.name(x, "op", at),
        family=f.name(x, "family", at),
        s_bucket=f.bucket(x, at),
        head_dim=f.positive_int(f.get(x, "head_dim", int, at), f"{at}.head_dim"),
        dtype=f.choice(x, "dtype", DTYPES, at),
        config=(*cfg[:4], cfg[4]),
        time_ms=f.time(f.get(x, "time_ms", (int, float), at), f"{at}.time_ms"),
    )


def _impl(f: _Fields, x, at: str) -> ImplementationEntry:
    f.obj(x, at)
    times = f.get(x, "times_ms", dict, at)
    if not times:
        raise TuningStoreError(f"{f.where}: {at}.times_ms must name at least one backend")
    for name, t in times.items():
        if not name:
            raise TuningStoreError(f"{f.where}: {at}.times_ms has an empty backend name")
        f.time(t, f"{at}.times_ms.{name}")
    return ImplementationEntry(
        family=f.name(x, "family", at),
        s_bucket=f.bucket(x, at),
        head_dim=f.positive_int(f.get(x, "head_dim", int, at), f"{at}.head_dim"),
        dtype=f.choice(x, "dtype", DTYPES, at),
        pass_=f.choice(x, "pass", PASSES, at),
        times_ms=tuple((str(k), float(v)) for k, v in times.items()),
    )


class _Fields:
    """Typed field access with errors naming the file and the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, msg: str):
        raise TuningStoreError(f"{self.where}: {msg}")

    def obj(self, x, at: str):
        if not isinstance(x, dict):
            self.fail(f"{at} must be a JSON object, got {type(x).__name__}")

    def get(self, x: dict, key: str, types, at: str = ""):
        field = f"{at}.{key}" if at else key
        if key not in x:
            self.fail(f"{field} is missing")
        v = x[key]
        types = types if isinstance(types, tuple) else (types,)
        if isinstance(v, bool) or not isinstance(v, types):
            want = " or ".join(t.__name__ for t in types)
            self.fail(f"{field} must be {want}, got {v!r}")
        return v

    def name(self, x: dict, key: str, at: str) -> str:
        v = self.get(x, key, str, at)
        if not v:
            self.fail(f"{at}.{key} must not be empty")
        return v

    def choice(self, x: dict, key: str, allowed: tuple, at: str) -> str:
        v = self.get(x, key, str, at)
        if v not in allowed:
            self.fail(f"{at}.{key} must be one of {allowed}, got {v!r}")
        return v

    def positive_int(self, v, field: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            self.fail(f"{field} must be a positive integer, got {v!r}")
        return v

    def bucket(self, x: dict, at: str) -> int:
        v = self.positive_int(self.get(x, "s_bucket", int, at), f"{at}.s_bucket")
        if v & (v - 1):
            self.fail(f"{at}.s_bucket must be a power of two, got {v}")
        return v

    def time(self, v, field: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            self.fail(f"{field} must be a positive number of milliseconds, got {v!r}")
        return float(v)

    def unique(self, entries, field: str, key):
        seen = {}
        for i, e in enumerate(entries):
            k = key(e)
            if k in seen:
                self.fail(f"{field}[{i}] repeats the key of {field}[{seen[k]}]: {k}")
            seen[k] = i


# -- questions -----------------------------------------------------------------------


def _nearest(entries, q_len: int):
    """The entry whose s_bucket is nearest ``q_len`` in log2 (ties: the larger bucket), or None."""
    if not entries:
        return None
    target = math.log2(max(int(q_len), 1))
    return min(entries, key=lambda e: (abs(math.log2(e.s_bucket) - target), -e.s_bucket))


def lookup_tiles(op: str, family: str, q_len: int, head_dim: int, dtype: str) -> tuple | None:
    """The stored ``(block_m, block_n, num_warps, num_stages, loop)`` for a kernel, or None.

    Matches ``op``, ``family``, ``head_dim`` and ``dtype`` exactly and takes the
    nearest S bucket (module docstring); None when nothing matches, and the
    caller uses its heuristic tiles.

    Example:
      >>> from jax_bindings import _tuning
      >>> _tuning.lookup_tiles("fwd", "causal", 4096, 64, "bfloat16") is None  # nothing stored here
      True
    """
    found = [
        t
        for t in store().tiles
        if t.op == op and t.family == family and t.head_dim == head_dim and t.dtype == dtype
    ]
    best = _nearest(found, q_len)
    return None if best is None else best.config


def rank_backends(
    family: str, q_len: int, head_dim: int, dtype: str, candidates, *, mode: str = "fwd_bwd"
) -> list[str]:
    """``candidates`` (backend names) ordered fastest first for the fused attention.

    With data: the implementations entry matching ``family``, ``head_dim`` and
    ``dtype`` exactly, of pass ``mode`` (else of the other pass), at the nearest
    S bucket; candidates it times come first, fastest first, then the others in
    their given order. Without data, the heuristic: on a GPU of compute
    capability 9.x, ``"cudnn"`` goes first for the families it takes ("full",
    "causal", "causal_window": within about 10% of splat's CUDA kernels either way
    on H100, see ``_PREFERRED_ON_SM9X``); otherwise the given (registry) order.

    Example:
      >>> from jax_bindings import _tuning
      >>> _tuning.rank_backends("strided", 4096, 64, "bfloat16", ["triton", "cudnn"])
      ['triton', 'cudnn']
    """
    if mode not in PASSES:
        raise ValueError(f"mode must be one of {PASSES}, got {mode!r}")
    candidates = list(candidates)
    match = [
        e
        for e in store().implementations
        if e.family == family and e.head_dim == head_dim and e.dtype == dtype
    ]
    best = _nearest([e for e in match if e.pass_ == mode], q_len) or _nearest(match, q_len)
    if best is not None:
        times = dict(best.times_ms)
        timed = sorted((n for n in candidates if n in times), key=lambda n: times[n])
        return timed + [n for n in candidates if n not in times]
    cc = _compute_capability()
    if cc is not None and cc.split(".")[0] == "9" and family in _CUDNN_FAMILIES:
        if _PREFERRED_ON_SM9X in candidates:
            return [_PREFERRED_ON_SM9X] + [n for n in candidates if n != _PREFERRED_ON_SM9X]
    return candidates
