"""``splat bench``: splat against its peers, pattern x length x mode, in one process.

Every implementation (see :mod:`splat.tools.peers`) gets the same random
inputs; each is compiled and run once, then sampled ``warmup`` times untimed and
``repeats`` times timed, the peers of a (pattern, S, mode) in rounds of one
sample each (:data:`splat.tools.timing.INTERLEAVING`); the median is reported. A sample makes calls back to
back and waits for the device once: on a GPU at least 10 calls and at least
20 ms, a JAX peer's calls chained 10 to an executable; one call on the CPU (see
:mod:`splat.tools.timing`).

Useful FLOPs count only the mask's nonzeros::

    forward           4 * B * H * nnz * D        (QK^T and PV, 2 FLOPs per multiply-add)
    forward+backward  3.5 * 4 * B * H * nnz * D  (backward = 2.5x forward: QK^T recomputed, dP, dV, dQ, dK)

so a dense peer that computes all S x S scores is credited with the same useful
work as splat. ``x splat`` in the table is ``peer ms / splat ms``: above 1 means
splat is faster.

Each row names its mask three ways: ``pattern`` (the catalogue name, or the expression
as typed), ``mask`` (its repr) and ``expression`` (:func:`to_expression`: what
:func:`splat.masks.parse` reads back into the same mask; None for arrays and functions).

A peer that cannot run here (a GPU-only peer on a CPU, a package not installed, a
splat backend this machine lacks) is skipped: the run goes on, ``skipped`` records
the reason, and the text report lists each (peer, reason) once, under ``skipped``.
A peer that crashes is recorded the same way, its reason starting ``error:``, and
the log says so as it happens.

Every peer's forward output is checked against splat's on the same inputs,
once per (pattern, S, dtype); fwd+bwd rows reuse the forward check. A row
records ``max_abs_err_vs_splat`` (max ``|peer - splat|`` over the output, both
cast to float32), ``agrees`` (see :mod:`splat.tools.check`) and ``check`` (what was
compared, or why not: ``torch_sdpa`` runs with no mask by design). Splat itself
is tested against a float64 reference in ``tests/``; a peer that disagrees is
still timed, printed with a loud warning and listed under ``disagreements``,
since a speed ratio against a peer computing another mask means nothing. Rows
of splat's own peers record ``splat_backend``: the backend that ran
(``jax_bindings.selected_backend`` where it exists, else ``"unknown"``).

Sequence lengths: a pattern runs at every ``lengths`` S, except a mask on a
token grid (a neighborhood, ``splat.catalogue.GRID``), which exists only at its
grid's ``S = prod(grid)``: it runs there, once, whatever ``lengths`` says
(:func:`pattern_lengths`; ``settings.fixed_lengths`` records it and the log says
so). Such a pattern's grid form -- for a centre, a corner and an edge query, the
keys it sees pictured on the grid (:mod:`splat.tools.grid_view`) -- lands in
``grid_masks`` and in the text report.

Optional sections: ``build`` (time to construct each pattern's ACSR at S = 65536
-- a grid pattern at its own S -- with caches cleared, and to analyze a dense
8192 x 8192 bool rendering) and ``memory`` (XLA's temp bytes,
``compiled.memory_analysis().temp_size_in_bytes``, of splat and of dense XLA for
each problem).
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata
import inspect
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass

import numpy as np

from splat.tools import grid_view
from splat.tools.check import CHECK_RULE, OutputCheck, short_error
from splat.tools.peers import PEERS, PeerUnavailable, Problem
from splat.tools.timing import INTERLEAVING, TIMING_METHOD, on_gpu, sampling, time_interleaved

__all__ = [
    "BenchConfig",
    "FLOP_FORMULA",
    "build_section",
    "environment",
    "flop_formula",
    "format_table",
    "pattern_lengths",
    "resolve_patterns",
    "backend_unavailable",
    "run_bench",
    "to_expression",
    "useful_flops",
    "write_json",
]

FLOP_FORMULA = (
    "useful FLOPs = 4*B*H*nnz*D (forward); forward+backward counts 3.5x that (backward = 2.5x forward)"
)
# The same convention, for a run of one mode only (see flop_formula).
_MODE_FLOP_FORMULA = {
    "fwd": "useful FLOPs = 4*B*H*nnz*D (forward)",
    "fwdbwd": "useful FLOPs = 3.5 * 4*B*H*nnz*D (forward+backward; backward = 2.5x forward)",
}
RATIO_DEFINITION = "x splat = peer median ms / splat median ms (> 1: splat is faster)"
SCHEMA = "splat-bench/1"

_MODES = ("fwd", "fwdbwd", "both")
_DTYPES = ("float32", "bfloat16", "float16")


def check_positive_ints(config, names) -> None:
    """Each field ``names`` of ``config`` is a positive int; ValueError naming the first that is not."""
    for name in names:
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def check_peers(peers, known) -> None:
    """``peers`` (None: every one) are all in ``known``; ValueError listing the unknown ones."""
    if peers is not None:
        bad = [p for p in peers if p not in known]
        if bad:
            raise ValueError(f"unknown peer(s) {bad}; known: {', '.join(known)}")


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one ``splat bench`` run (every field lands in the JSON).

    Attributes:
      patterns: catalogue names (``splat.catalogue.named``) or mask expressions
        (``splat.masks.parse``); None = the suite, ``splat.catalogue.suite()``.
      lengths: sequence lengths S (q_len = kv_len = S); a grid pattern runs at its
        own S instead (:func:`pattern_lengths`).
      heads, head_dim, batch: H, D, B of ``q, k, v: [B, S, H, D]``.
      dtype: "float32", "bfloat16" or "float16".
      mode: "fwd", "fwdbwd" or "both".
      backend: splat's backend, one of ``jax_bindings.BACKENDS``.
      peers: implementations to time (names in ``splat.tools.peers.PEERS``); None = all.
      warmup, repeats: untimed and timed runs after the first (compiling) one.
      seed: seed of the random inputs.
      quick: whether the quick defaults were used.
      build: also run the build section, at ``build_length`` / ``analyze_length``.
    """

    patterns: tuple[str, ...] | None = None
    lengths: tuple[int, ...] = (1024, 4096)
    heads: int = 4
    head_dim: int = 64
    batch: int = 1
    dtype: str = "float32"
    mode: str = "fwd"
    backend: str = "auto"
    peers: tuple[str, ...] | None = None
    warmup: int = 2
    repeats: int = 10
    seed: int = 0
    quick: bool = False
    build: bool = False
    build_length: int = 65536
    analyze_length: int = 8192

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check_positive_ints(self, ("heads", "head_dim", "batch", "repeats", "build_length", "analyze_length"))
        if not self.lengths or any(not isinstance(s, int) or s <= 0 for s in self.lengths):
            raise ValueError(f"lengths must be positive ints, got {self.lengths!r}")
        from jax_bindings import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        check_peers(self.peers, PEERS)

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwd", "fwdbwd") if self.mode == "both" else (self.mode,)

    @classmethod
    def defaults(cls, quick: bool = False) -> dict:
        """Default settings for this machine (quick: a few patterns, one small length)."""
        gpu = on_gpu()
        if quick:
            return {"lengths": (4096,) if gpu else (1024,), "warmup": 1, "repeats": 3, "quick": True}
        return {"lengths": (4096, 8192, 16384, 32768) if gpu else (1024, 4096)}

    @classmethod
    def from_args(cls, args) -> BenchConfig:
        """Builds a config from ``splat bench``'s parsed arguments; explicit flags beat defaults."""
        kw = cls.defaults(quick=getattr(args, "quick", False))
        for f in fields(cls):
            v = getattr(args, f.name, None)
            if v is None or f.name == "quick":
                continue
            kw[f.name] = tuple(v) if isinstance(v, list) else v
        return cls(**kw)


# --- environment ------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Device and versions, for the JSON (torch etc. only reported when installed)."""
    import jax

    dev = jax.devices()[0]
    versions = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "numpy", "triton", "jax-triton", "tokamax", "torch", "flax"):
        versions[dist] = _version(dist)
    return {
        "device": dev.device_kind,
        "platform": dev.platform,
        "jax_backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "versions": versions,
    }


# --- patterns -------------------------------------------------------------------------------


def resolve_patterns(
    names: Sequence[str] | None, catalogue: Mapping | None = None, quick: bool = False
) -> list[tuple[str, Callable[[int], object]]]:
    """``[(name, factory(S) -> Mask)]`` for catalogue names or mask expressions.

    Args:
      names: catalogue names, or mask expressions such as ``"sliding_window(64) | sink(4)"``
        (:func:`splat.masks.parse`); None = the whole suite (its first three entries when ``quick``).
      catalogue: name -> Mask, or name -> callable(S) -> Mask; default: the names of
        :func:`splat.catalogue.named`, with ``splat.catalogue.suite()`` as the suite.
      quick: take only three patterns when ``names`` is None.
    """
    from splat import masks

    if catalogue is None:
        from splat import catalogue as cat

        table, suite = {n: cat.named(n) for n in cat.names()}, cat.suite()
    else:
        table, suite = catalogue, list(catalogue)

    def factory(entry):
        if isinstance(entry, masks.Mask):
            return lambda s: entry
        if callable(entry):
            return entry
        raise TypeError(f"catalogue entries must be masks or callables S -> mask, got {type(entry).__name__}")

    if names is None:
        names = suite[:3] if quick else suite
    out = []
    for name in names:
        if name in table:
            out.append((name, factory(table[name])))
            continue
        try:
            m = masks.parse(name)
        except ValueError as e:
            raise ValueError(
                f"pattern {name!r} is neither a catalogue name ({', '.join(table)}) "
                f"nor a mask expression: {e}"
            ) from None
        out.append((name, factory(m)))
    return out


# Without a GPU, grid patterns of the default suite run only up to this many tokens (or the
# largest --lengths): each exists at one S only, 16384 for the catalogue's GRID.
CPU_GRID_TOKENS = 4096


def pattern_lengths(
    name: str, make: Callable[[int], object], lengths: Sequence[int]
) -> list[tuple[int, object]]:
    """``[(S, mask)]``: where pattern ``name`` runs.

    A size-free mask runs at every S of ``lengths`` (``make(S)`` each). A mask on
    a token grid (:func:`splat.tools.grid_view.fixed_length`: a neighborhood, or a
    combination holding one) exists only at ``S = prod(grid)``: it runs there once,
    whatever ``lengths`` says.

    Raises:
      ValueError: a mask that exists at no S (neighborhoods on grids of different sizes).
    """
    first = make(lengths[0])
    try:
        fixed = grid_view.fixed_length(first)
    except ValueError as e:
        raise ValueError(f"pattern {name!r}: {e}") from None
    if fixed is not None:
        return [(fixed, first)]
    return [(lengths[0], first)] + [(s, make(s)) for s in lengths[1:]]


def backend_unavailable(backend: str) -> str | None:
    """Why splat's ``backend`` cannot run here, in one line; None when it can (``"auto"`` always can)."""
    import jax_bindings

    if backend == "auto":
        return None
    available = getattr(jax_bindings, "available_backends", None)
    if available is not None:
        reason = available().get(backend)
    else:  # jax_bindings without a backend registry: resolve() raises for a backend that cannot run
        try:
            jax_bindings.resolve(backend)
            reason = None
        except jax_bindings.BackendUnavailableError as e:
            reason = str(e)
    return None if reason is None else " ".join(str(reason).split())


def flop_formula(modes: Sequence[str]) -> str:
    """How useful FLOPs are counted, for a run of ``modes`` ("fwd", "fwdbwd"): :data:`FLOP_FORMULA`
    when both ran, else the one mode's formula (a forward-only run says nothing of the backward)."""
    modes = tuple(dict.fromkeys(modes))
    return _MODE_FLOP_FORMULA[modes[0]] if len(modes) == 1 else FLOP_FORMULA


def useful_flops(batch: int, heads: int, nnz: int, head_dim: int, mode: str) -> float:
    """``4*B*H*nnz*D`` forward; ``fwdbwd`` counts 3.5x that (FlashAttention convention)."""
    f = 4.0 * batch * heads * nnz * head_dim
    return 3.5 * f if mode == "fwdbwd" else f


def to_expression(mask) -> str | None:
    """The :func:`splat.masks.parse` expression of ``mask`` (its inverse), or None where it has none.

    Built from the mask's value (constructor calls joined by ``|`` and ``&``, arguments
    at their defaults left out) and read back: the result parses to a mask equal to
    ``mask``, else None. Masks from arrays or functions have no expression. (Not
    :func:`splat.tools.mask_forms.mask_expression`, the predicate FlexAttention runs.)

    Example:
      >>> from splat import masks
      >>> to_expression(masks.sink(4) | masks.sliding_window(1023, 0))
      'sink(4) | sliding_window(1023, 0)'
    """
    from splat import masks

    expr = _expression(mask)
    if expr is None:
        return None
    try:
        return expr if masks.parse(expr) == mask else None
    except (ValueError, TypeError):
        return None


def _expression(mask) -> str | None:
    """:func:`to_expression` before the check: None for a part with no constructor."""
    from splat import masks

    if isinstance(mask, (masks.Union, masks.Intersection)):
        a, b = _expression(mask.a), _expression(mask.b)
        if a is None or b is None:
            return None
        # "&" binds tighter than "|" and both group to the left: bracket what would regroup
        if isinstance(mask, masks.Union):
            b = f"({b})" if isinstance(mask.b, masks.Union) else b
            return f"{a} | {b}"
        a = f"({a})" if isinstance(mask.a, masks.Union) else a
        b = f"({b})" if isinstance(mask.b, (masks.Union, masks.Intersection)) else b
        return f"{a} & {b}"
    neighborhood = grid_view.expression(mask)
    if neighborhood is not None:
        return neighborhood
    name = re.sub(r"(?<!^)(?=[A-Z])", "_", type(mask).__name__).lower()  # SlidingWindow -> sliding_window
    if name not in masks.__all__ or not is_dataclass(mask):
        return None
    values = [getattr(mask, f.name) for f in fields(mask) if f.repr]
    params = list(inspect.signature(getattr(masks, name)).parameters.values())
    if len(values) > len(params):
        return None
    while values and params[len(values) - 1].default is not inspect.Parameter.empty:
        if values[-1] != params[len(values) - 1].default:
            break
        values.pop()  # a trailing argument at its default
    # a flag reads better by name: sink(4, causal=False)
    args = (
        f"{p.name}={v!r}" if isinstance(v, bool) else repr(v) for p, v in zip(params, values, strict=False)
    )
    return f"{name}({', '.join(args)})"


def _skip_reason(e: Exception) -> tuple[str, bool]:
    """``(reason, crashed)`` for a peer that raised ``e`` while being prepared or timed.

    A splat backend this machine cannot run (``jax_bindings.BackendUnavailableError``)
    is a skip like a missing package, said in one line: ``splat backend 'triton' cannot
    run here: runs on gpu only; ...``. Anything else but :class:`PeerUnavailable` is a crash.
    """
    import jax_bindings

    if isinstance(e, PeerUnavailable):
        return str(e), False
    if isinstance(e, jax_bindings.BackendUnavailableError):
        named = re.search(r'backend="([^"]+)"', str(e))
        why = backend_unavailable(named.group(1)) if named else None
        if why is None:  # a message of another shape: say it whole
            return " ".join(str(e).split()), False
        return f"splat backend {named.group(1)!r} cannot run here: {why}", False
    return f"error: {short_error(e)}", True


# --- the benchmark -------------------------------------------------------------------------------


def run_bench(
    config: BenchConfig, catalogue: Mapping | None = None, log: Callable[[str], None] = print
) -> dict:
    """Runs the benchmark described by ``config``; returns the JSON-ready result.

    Args:
      config: the settings.
      catalogue: name -> Mask (or callable S -> Mask); default ``splat.catalogue`` (see
        :func:`resolve_patterns`).
      log: where progress and the final table go (``print``; pass ``lambda s: None`` to silence).

    Returns:
      ``{"schema", "created", "environment", "settings", "flop_formula", "ratio_definition",
      "timing_method", "check_rule", "results": [...], "skipped": [...], "memory": [...],
      "disagreements": [...], "grid_masks": [...], "build": {...} (when asked)}``. Each result
      row carries its mask's ``expression`` (:func:`to_expression`), its output check
      (``max_abs_err_vs_splat``, ``rel_err_vs_splat``, ``check_tolerance``, ``agrees``, ``check``),
      how it was timed (``per_sample``, ``calls_per_launch``, ``timing``) and, for splat's own
      peers, ``splat_backend`` (else None); ``disagreements`` lists each (pattern, S, dtype, peer)
      whose output is not within tolerance of splat's. ``settings.fixed_lengths`` maps each grid
      pattern to the one S it ran at; ``grid_masks`` holds its grid form (``{"pattern", "mask"}``
      and the fields of :func:`splat.tools.grid_view.grid_section`).

    Raises:
      ValueError: a pattern that is neither a catalogue name nor a mask expression, or a
        splat backend (``config.backend``) that cannot run here, with the reason.
    """
    import splat

    reason = backend_unavailable(config.backend)
    if reason is not None:
        raise ValueError(f"splat backend {config.backend!r} cannot run here: {reason}")
    env = environment()
    pats = resolve_patterns(config.patterns, catalogue, quick=config.quick)
    peer_names = list(config.peers) if config.peers is not None else list(PEERS)
    if "splat" in peer_names:  # splat first: the ratios need its time
        peer_names.remove("splat")
        peer_names.insert(0, "splat")
    formula = flop_formula(config.modes)
    log(f"splat bench on {env['device']} ({env['platform']}); {formula}; {RATIO_DEFINITION}")
    # calls one JAX launch chains, and the least time a sample lasts (TIMING_METHOD)
    per_sample, min_sample_ms = sampling()

    results, skipped, memory, disagreements, grids = [], [], [], [], []
    fixed_lengths = {}
    told = set()

    def skip(base: dict, peer: str, e: Exception, check: OutputCheck) -> None:
        reason, crashed = _skip_reason(e)
        if peer == "splat":
            check.no_reference(f"splat skipped: {reason}")
        skipped.append({**base, "impl": peer, "reason": reason})
        # A peer that cannot run here is news only once, in the report's "skipped" list; a crash
        # is said as it happens too (each distinct one once).
        if crashed and (peer, reason) not in told:
            told.add((peer, reason))
            log(f"  {peer} failed, skipped: {reason} ({base['pattern']}, S={base['S']}, {base['mode']})")

    b, h, d = config.batch, config.heads, config.head_dim
    for name, make in pats:
        runs = pattern_lengths(name, make, config.lengths)
        grid = grid_view.grid_of(runs[0][1])
        too_big = max(CPU_GRID_TOKENS, *config.lengths)
        if grid is not None and config.patterns is None and not on_gpu() and runs[0][0] > too_big:
            # the default suite's grids have 16384 tokens: its dense peers alone need GBs on a CPU
            log(
                f"  {name}: grid pattern of the default suite skipped without a GPU: "
                f"S={runs[0][0]} > {too_big} (name it with --patterns to run it)"
            )
            continue
        if grid is not None:
            s, mask = runs[0]
            fixed_lengths[name] = s
            grids.append({"pattern": name, "mask": repr(mask), **grid_view.grid_section(mask)})
            shape = "x".join(map(str, grid))
            log(f"  {name}: a mask on a {shape} grid exists only at S={s}; run there, not at --lengths")
        for s, mask in runs:
            layout = splat.analyze(mask, q_len=s, kv_len=s)
            rng = np.random.default_rng(config.seed)
            q, k, v, do = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(4))
            # make_problem(mode): the same inputs (and one dense-mask cache) for every peer and mode
            make_problem = functools.partial(
                Problem,
                q,
                k,
                v,
                do,
                mask,
                layout,
                config.dtype,
                backend=config.backend,
                per_sample=per_sample,
                _dense=[],
            )
            expression = to_expression(mask)
            where = {"pattern": name, "mask": repr(mask), "S": s, "dtype": config.dtype}
            check = OutputCheck(where, make_problem, disagreements, log)
            for mode in config.modes:
                problem = make_problem(mode)
                flops = useful_flops(b, h, layout.nnz, d, mode)
                base = {
                    "pattern": name,
                    "mask": repr(mask),
                    "expression": expression,
                    "S": s,
                    "mode": mode,
                    "nnz": int(layout.nnz),
                    "density": float(layout.density()),
                }
                rows, ready = {}, {}  # ready: peer -> (prepared, verdict)
                for peer in peer_names:
                    try:
                        prepared = PEERS[peer].prepare(problem)
                        ready[peer] = prepared, check.verdict(peer, prepared, problem)
                    except Exception as e:  # unavailable, or crashed: the run goes on, the reason recorded
                        skip(base, peer, e, check)
                # every peer ready is timed in the same rounds (INTERLEAVING)
                samplers = {peer: ready[peer][0].sampler(per_sample, min_sample_ms) for peer in ready}
                timed, failed = time_interleaved(samplers, config.warmup, config.repeats)
                for peer, e in failed.items():
                    skip(base, peer, e, check)
                for peer, t in timed.items():
                    prepared, verdict = ready[peer]
                    row = {
                        **base,
                        "impl": peer,
                        **t,
                        "tflops": flops / (t["ms"] * 1e-3) / 1e12,
                        "temp_bytes": prepared.temp_bytes,
                        "note": prepared.note,
                        "splat_backend": prepared.splat_backend,
                        **verdict,
                    }
                    rows[peer] = row
                    results.append(row)
                    flag = "  DISAGREES WITH SPLAT" if verdict["agrees"] is False else ""
                    log(f"  {peer:13s} {name} S={s} {mode}: {t['ms']:.3f} ms{flag}")
                splat_ms = rows["splat"]["ms"] if "splat" in rows else None
                for row in rows.values():
                    row["vs_splat"] = None if splat_ms is None else row["ms"] / splat_ms
                sp, dn = rows.get("splat"), rows.get("dense_xla")
                if sp and dn and sp["temp_bytes"] is not None and dn["temp_bytes"] is not None:
                    memory.append(
                        {
                            **base,
                            "splat_temp_bytes": sp["temp_bytes"],
                            "dense_temp_bytes": dn["temp_bytes"],
                            "dense_over_splat": dn["temp_bytes"] / max(sp["temp_bytes"], 1),
                        }
                    )
    out = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "environment": env,
        "settings": {
            **asdict(config),
            "peers": peer_names,
            "patterns": [n for n, _ in pats],
            "fixed_lengths": fixed_lengths,
            "per_sample": per_sample,
            "min_sample_ms": min_sample_ms,
        },
        "flop_formula": formula,
        "ratio_definition": RATIO_DEFINITION,
        "timing_method": f"{TIMING_METHOD} {INTERLEAVING}",
        "check_rule": CHECK_RULE,
        "results": results,
        "skipped": skipped,
        "memory": memory,
        "disagreements": disagreements,
        "grid_masks": grids,
    }
    if config.build:
        out["build"] = build_section(pats, config.build_length, config.analyze_length, log=log)
    log(format_table(out))
    return out


# --- build section ---------------------------------------------------------------------------------


def _clear_layout_caches() -> bool:
    """Empties the mask -> layout caches (``masks._to_acsr``, neighborhoods' ``_layout``) so
    construction is timed from scratch; False where one of them cannot be found."""
    from splat import _neighborhood, masks

    cleared = True
    for fn in (getattr(masks, "_to_acsr", None), getattr(_neighborhood, "_layout", None)):
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()
        else:
            cleared = False
    return cleared


def build_section(
    patterns: Sequence[tuple[str, Callable[[int], object]]],
    length: int = 65536,
    analyze_length: int = 8192,
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> dict:
    """Times ``mask.to_acsr(S, S)`` at ``length`` and ``splat.analyze(dense array)`` at ``analyze_length``.

    A grid pattern (:func:`pattern_lengths`) is built at its own S instead, and
    analyzed there where that S is at most ``analyze_length`` (else its analyze
    fields are None, with the reason under ``analyze_skipped``).

    Args:
      patterns: ``[(name, factory(S) -> Mask)]`` as from :func:`resolve_patterns`.
      length: S for constructing layouts from the mask values (O(S) paths).
      analyze_length: S of the dense ``[S, S]`` bool rendering given to ``splat.analyze``.
      repeats: timed runs (median reported); caches are cleared before each.

    Returns:
      ``{"length", "analyze_length", "cache_cleared", "patterns": [{name, length, build_ms,
      analyze_length, analyze_ms, nnz, ...}]}``.
    """
    import splat

    rows, cleared = [], True
    for name, make in patterns:
        ((s, mask),) = pattern_lengths(name, make, (length,))
        times = []
        for _ in range(repeats):
            cleared &= _clear_layout_caches()
            t0 = time.perf_counter()
            layout = mask.to_acsr(s, s)
            times.append((time.perf_counter() - t0) * 1e3)
        row = {
            "pattern": name,
            "mask": repr(mask),
            "length": s,
            "build_ms": statistics.median(times),
            "build_samples_ms": times,
            "nnz": int(layout.nnz),
            "grid": None if layout.grid is None else list(layout.grid.grid),
            "segments": len(layout.segments),
            "closed_forms": sum(sg.closed_form is not None for sg in layout.segments),
            "residual_blocks": 0 if layout.residual is None else int(layout.residual.num_blocks.sum()),
        }
        ((a_len, a_mask),) = pattern_lengths(name, make, (analyze_length,))
        if a_len > analyze_length:
            row.update(dict.fromkeys(("analyze_length", "analyze_ms", "analyze_samples_ms", "analyze_nnz")))
            row.update(dict.fromkeys(("analyze_segments", "analyze_residual_blocks")))
            row["analyze_skipped"] = f"exists only at S={a_len} > analyze_length {analyze_length}"
        else:
            dense = a_mask.to_acsr(a_len, a_len).to_dense()
            a_times = []
            for _ in range(repeats):
                cleared &= _clear_layout_caches()
                t0 = time.perf_counter()
                found = splat.analyze(dense)
                a_times.append((time.perf_counter() - t0) * 1e3)
            row.update(
                analyze_length=a_len,
                analyze_ms=statistics.median(a_times),
                analyze_samples_ms=a_times,
                analyze_nnz=int(found.nnz),
                analyze_segments=len(found.segments),
                analyze_residual_blocks=0 if found.residual is None else int(found.residual.num_blocks.sum()),
            )
        rows.append(row)
        analyzed = (
            f"analyze(dense {a_len}^2) {row['analyze_ms']:.1f} ms"
            if row["analyze_ms"] is not None
            else f"analyze skipped: {row['analyze_skipped']}"
        )
        log(f"  build {name}: to_acsr({s}) {row['build_ms']:.1f} ms; {analyzed}")
    return {"length": length, "analyze_length": analyze_length, "cache_cleared": cleared, "patterns": rows}


# --- output ---------------------------------------------------------------------------------------


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def format_table(result: dict) -> str:
    """The results as a text table (plus skips, memory and build sections when present)."""
    formula = result.get("flop_formula", FLOP_FORMULA)
    lines = [formula, RATIO_DEFINITION, result.get("timing_method", TIMING_METHOD), ""]
    hdr = (
        f"{'pattern':24s} {'S':>7s} {'mode':6s} {'impl':13s} {'ms':>10s} {'TFLOP/s':>9s} {'x splat':>8s} "
        f"{'temp MiB':>9s} {'check':>5s}  note"
    )
    lines += [hdr, "-" * len(hdr)]
    for r in result["results"]:
        ratio = "-" if r.get("vs_splat") is None else f"{r['vs_splat']:.2f}"
        chk = {True: "ok", False: "DIFF"}.get(r.get("agrees"), "-")
        backend = r.get("splat_backend") and f"backend {r['splat_backend']}"
        note = "; ".join(x for x in (backend, r.get("note")) if x)
        lines.append(
            f"{r['pattern'][:24]:24s} {r['S']:7d} {r['mode']:6s} {r['impl']:13s} {r['ms']:10.3f} "
            f"{r['tflops']:9.4f} {ratio:>8s} {_fmt_bytes(r['temp_bytes']):>9s} {chk:>5s}  {note}"
        )
    lines += ["", CHECK_RULE]
    if result.get("disagreements"):
        lines += ["DISAGREEMENTS: these peers' outputs differ from splat's (their timings mean nothing):"]
        for d in result["disagreements"]:
            err, tol = d["max_abs_err_vs_splat"], d["check_tolerance"]
            what = d["check"] if err is None else f"max|diff| {err:.4g} > tolerance {tol:.4g}"
            lines.append(f"  {d['impl']:13s} {d['pattern'][:24]:24s} S={d['S']:<7d} {d['dtype']:9s} {what}")
    if result.get("skipped"):
        lines += ["", "skipped:"]
        seen = set()
        for s in result["skipped"]:
            key = (s["impl"], s["reason"])
            if key not in seen:
                seen.add(key)
                lines.append(f"  {s['impl']:13s} {s['reason']}")
    if result.get("memory"):
        lines += ["", "XLA temp memory (MiB): splat vs dense XLA"]
        for m in result["memory"]:
            lines.append(
                f"  {m['pattern'][:24]:24s} S={m['S']:<7d} {m['mode']:6s} "
                f"splat {_fmt_bytes(m['splat_temp_bytes'])}  dense {_fmt_bytes(m['dense_temp_bytes'])}  "
                f"dense/splat {m['dense_over_splat']:.1f}x"
            )
    if result.get("grid_masks"):
        lines += ["", "grid masks (run at their grid's S): the keys a query sees, on the grid"]
        for g in result["grid_masks"]:
            lines += [f"{g['pattern']}: {g['mask']}, S={g['S']}", *("  " + t for t in g["text"].splitlines())]
    if result.get("build"):
        b = result["build"]
        lines += [
            "",
            f"layout construction at S={b['length']}, analysis of a dense {b['analyze_length']}^2 array "
            "(grid patterns at their own S):",
        ]
        for r in b["patterns"]:
            at = "" if r.get("length", b["length"]) == b["length"] else f" (S={r['length']})"
            analyzed = "skipped" if r["analyze_ms"] is None else f"{r['analyze_ms']:9.1f} ms"
            stored = (
                f"grid {'x'.join(map(str, r['grid']))}"
                if r.get("grid")
                else f"segments {r['segments']} (closed {r['closed_forms']}), "
                f"residual blocks {r['residual_blocks']}"
            )
            lines.append(
                f"  {r['pattern'][:24]:24s} to_acsr {r['build_ms']:9.1f} ms{at}   "
                f"analyze {analyzed:>12s}   {stored}"
            )
    return "\n".join(lines)


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def write_json(result: dict, path: str) -> None:
    """Writes ``result`` as indented JSON, creating the folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=_jsonable)
        f.write("\n")
