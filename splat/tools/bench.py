"""``splat bench``: splat against its peers, pattern x length x mode, in one process.

Every implementation (see :mod:`splat._peers`) gets the same random inputs; each
is compiled and run once, then sampled ``warmup`` times untimed and ``repeats``
times timed; the median is reported. A sample makes calls back to back and waits
for the device once: on a GPU at least 10 calls and at least 20 ms, a JAX peer's
calls chained 10 to an executable; one call on the CPU (see :data:`TIMING_METHOD`).

Useful FLOPs count only the mask's nonzeros::

    forward           4 * B * H * nnz * D        (QK^T and PV, 2 FLOPs per multiply-add)
    forward+backward  3.5 * 4 * B * H * nnz * D  (backward = 2.5x forward: QK^T recomputed, dP, dV, dQ, dK)

so a dense peer that computes all S x S scores is credited with the same useful
work as splat. ``x splat`` in the table is ``peer ms / splat ms``: above 1 means
splat is faster.

Every peer's forward output is checked against splat's on the same inputs,
once per (pattern, S, dtype); fwd+bwd rows reuse the forward check. A row
records ``max_abs_err_vs_splat`` (max ``|peer - splat|`` over the output, both
cast to float32), ``agrees`` (see :data:`CHECK_RULE`) and ``check`` (what was
compared, or why not: ``torch_sdpa`` runs with no mask by design). Splat itself
is tested against a float64 reference in ``tests/``; a peer that disagrees is
still timed, printed with a loud warning and listed under ``disagreements``,
since a speed ratio against a peer computing another mask means nothing.

Optional sections: ``build`` (time to construct each pattern's ACSR at S = 65536
with caches cleared, and to analyze a dense 8192 x 8192 bool rendering) and
``memory`` (XLA's temp bytes, ``compiled.memory_analysis().temp_size_in_bytes``,
of splat and of dense XLA for each problem).
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

__all__ = [
    "CHECK_RTOL",
    "CHECK_RULE",
    "BenchConfig",
    "FLOP_FORMULA",
    "TIMING_METHOD",
    "sampling",
    "build_section",
    "compare_outputs",
    "environment",
    "format_table",
    "resolve_patterns",
    "run_bench",
    "time_call",
    "useful_flops",
    "write_json",
]

FLOP_FORMULA = (
    "useful FLOPs = 4*B*H*nnz*D (forward); forward+backward counts 3.5x that (backward = 2.5x forward)"
)
RATIO_DEFINITION = "x splat = peer median ms / splat median ms (> 1: splat is faster)"
TIMING_METHOD = (
    "ms per call = wall clock of one sample / the calls it made (the row's per_sample). A sample is "
    "launches back to back, then one wait for the device; on a GPU it makes at least 10 calls and, "
    "counted after the warmup, lasts at least min_sample_ms (settings), so its one-off costs (first "
    "dispatch, the wait) stay small. JAX peers: one launch runs 10 calls chained inside ONE jitted "
    "executable (Python-unrolled; each call's q is the previous call's out, in fwd+bwd its do the "
    "previous dq, and all inputs pass through lax.optimization_barrier with the previous outputs, so "
    "XLA neither merges, hoists nor drops calls), as attention inside a jitted training step: no host "
    "dispatch between calls. Torch peers: one launch is one call. Each row's 'timing' says which."
)
SCHEMA = "splat-bench/1"

# Output check tolerance, relative to max|splat out|, per input dtype. Two correct kernels differ
# by summation order and by where they round (scores, P before the PV matmul, the output): unit
# roundoff 2^-8 for bfloat16, 2^-11 for float16 and for float32 run as TF32 (the default of XLA
# and Triton float32 matmuls on NVIDIA GPUs), so one output ulp alone can be 2^-7 (bf16) or 2^-10
# of max|out|. Measured on CPU at D=128 (catalogue.BENCH, S=2048): splat_unfused and dense XLA
# are within 0.8% (bf16) and 0.15% (fp16) of splat. The tolerances sit 3-4x above that (~4 output
# ulps); a wrong mask moves outputs by a sizeable fraction of their magnitude.
CHECK_RTOL = {"float32": 5e-3, "float16": 5e-3, "bfloat16": 3e-2}
CHECK_RULE = (
    "agrees: max|peer out - splat out| <= rtol * max|splat out|, forward output on the same inputs, "
    "both cast to float32; rtol = " + ", ".join(f"{v:g} ({k})" for k, v in CHECK_RTOL.items())
)

_MODES = ("fwd", "fwdbwd", "both")
_DTYPES = ("float32", "bfloat16", "float16")


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def sampling() -> tuple[int, float]:
    """``(per_sample, min_sample_ms)`` for :func:`time_call` here: on a GPU at least 10
    calls (a JAX launch chains 10) and 20 ms per sample; on a CPU one call (TIMING_METHOD)."""
    return (10, 20.0) if _on_gpu() else (1, 0.0)


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one ``splat bench`` run (every field lands in the JSON).

    Attributes:
      patterns: catalogue names or mask specs (``splat.cli.parse_mask_spec``); None = all.
      lengths: sequence lengths S (q_len = kv_len = S).
      heads, head_dim, batch: H, D, B of ``q, k, v: [B, S, H, D]``.
      dtype: "float32", "bfloat16" or "float16".
      mode: "fwd", "fwdbwd" or "both".
      backend: splat's backend ("auto", "jax", "triton").
      peers: implementations to time (names in ``splat._peers.PEERS``); None = all.
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
        for name in ("heads", "head_dim", "batch", "repeats", "build_length", "analyze_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.lengths or any(not isinstance(s, int) or s <= 0 for s in self.lengths):
            raise ValueError(f"lengths must be positive ints, got {self.lengths!r}")
        if self.peers is not None:
            from splat._peers import PEERS

            bad = [p for p in self.peers if p not in PEERS]
            if bad:
                raise ValueError(f"unknown peer(s) {bad}; known: {', '.join(PEERS)}")

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwd", "fwdbwd") if self.mode == "both" else (self.mode,)

    @classmethod
    def defaults(cls, quick: bool = False) -> dict:
        """Default settings for this machine (quick: a few patterns, one small length)."""
        gpu = _on_gpu()
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


def _default_catalogue() -> Mapping:
    cat = importlib.import_module("splat.catalogue")
    for name in ("BENCH", "CATALOGUE", "PATTERNS"):
        m = getattr(cat, name, None)
        if isinstance(m, Mapping):
            return m
    raise ImportError("splat.catalogue has no BENCH mapping of name -> mask")


def resolve_patterns(
    names: Sequence[str] | None, catalogue: Mapping | None = None, quick: bool = False
) -> list[tuple[str, Callable[[int], object]]]:
    """``[(name, factory(S) -> Mask)]`` for catalogue names or mask specs.

    Args:
      names: catalogue names, or mask expressions such as ``"sliding_window(64) | sink(4)"``;
        None = the whole catalogue (its first three entries when ``quick``).
      catalogue: name -> Mask, or name -> callable(S) -> Mask; default ``splat.catalogue.BENCH``.
      quick: take only three patterns when ``names`` is None.
    """
    from splat import masks
    from splat.cli import parse_mask_spec

    if catalogue is None:
        catalogue = _default_catalogue()

    def factory(entry):
        if isinstance(entry, masks.Mask):
            return lambda s: entry
        if callable(entry):
            return entry
        raise TypeError(f"catalogue entries must be masks or callables S -> mask, got {type(entry).__name__}")

    if names is None:
        names = list(catalogue)[:3] if quick else list(catalogue)
    out = []
    for name in names:
        if name in catalogue:
            out.append((name, factory(catalogue[name])))
            continue
        try:
            m = parse_mask_spec(name)
        except ValueError as e:
            raise ValueError(
                f"pattern {name!r} is neither a catalogue name ({', '.join(catalogue)}) nor a mask spec: {e}"
            ) from None
        out.append((name, factory(m)))
    return out


# --- timing ----------------------------------------------------------------------------------


def time_call(
    run: Callable[[], None] | None,
    warmup: int,
    repeats: int,
    *,
    launch: Callable[[], None] | None = None,
    sync: Callable[[], None] | None = None,
    per_sample: int = 1,
    calls_per_launch: int = 1,
    min_sample_ms: float = 0.0,
) -> dict:
    """Milliseconds per call: median, min and all samples, and how they were taken.

    Without ``launch``, each sample times one ``run()`` (which must block). With
    ``launch``/``sync``, a sample is launches back to back, each enqueuing
    ``calls_per_launch`` calls (a JAX peer's chain compiled into one executable),
    then one ``sync()``, divided by the calls made: ``per_sample / calls_per_launch``
    launches, or more where ``min_sample_ms`` asks (counted from one sample taken
    after the warmup), so that what a sample pays once (the first dispatch, the
    sync) is a small part of it. Warmup samples are taken the same way, untimed.

    Returns:
      ``{"ms", "ms_min", "samples_ms", "per_sample", "calls_per_launch", "timing"}``;
      ``per_sample`` is the calls a timed sample made, ``timing`` says how in words.
    """
    blocking = launch is None or sync is None
    if blocking:
        launch, sync, per_sample, calls_per_launch, min_sample_ms = run, (lambda: None), 1, 1, 0.0
    elif per_sample % calls_per_launch:
        raise ValueError(f"per_sample {per_sample} is not a multiple of calls_per_launch {calls_per_launch}")
    launches = per_sample // calls_per_launch

    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(launches):
            launch()
        sync()
        return (time.perf_counter() - t0) * 1e3 / (launches * calls_per_launch)

    for _ in range(warmup):
        sample()
    if min_sample_ms > 0:
        sample_ms = sample() * launches * calls_per_launch
        launches = max(launches, math.ceil(launches * min_sample_ms / max(sample_ms, 1e-6)))
    times = [sample() for _ in range(repeats)]
    if blocking:
        timing = "one blocking call"
    elif calls_per_launch > 1:
        timing = f"{launches} x {calls_per_launch} calls chained in one executable, one sync"
    else:
        timing = f"{launches} launch{'es' if launches > 1 else ''}, one sync"
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "samples_ms": times,
        "per_sample": launches * calls_per_launch,
        "calls_per_launch": calls_per_launch,
        "timing": timing,
    }


def useful_flops(batch: int, heads: int, nnz: int, head_dim: int, mode: str) -> float:
    """``4*B*H*nnz*D`` forward; ``fwdbwd`` counts 3.5x that (FlashAttention convention)."""
    f = 4.0 * batch * heads * nnz * head_dim
    return 3.5 * f if mode == "fwdbwd" else f


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200]}" if msg else type(e).__name__


# --- the benchmark -------------------------------------------------------------------------------


def run_bench(
    config: BenchConfig, catalogue: Mapping | None = None, log: Callable[[str], None] = print
) -> dict:
    """Runs the benchmark described by ``config``; returns the JSON-ready result.

    Args:
      config: the settings.
      catalogue: name -> Mask (or callable S -> Mask); default ``splat.catalogue.BENCH``.
      log: where progress and the final table go (``print``; pass ``lambda s: None`` to silence).

    Returns:
      ``{"schema", "created", "environment", "settings", "flop_formula", "ratio_definition",
      "timing_method", "check_rule", "results": [...], "skipped": [...], "memory": [...],
      "disagreements": [...], "build": {...} (when asked)}``. Each result row carries its
      output check (``max_abs_err_vs_splat``, ``rel_err_vs_splat``, ``check_tolerance``,
      ``agrees``, ``check``) and how it was timed (``per_sample``, ``calls_per_launch``,
      ``timing``); ``disagreements`` lists each (pattern, S, dtype, peer) whose output is
      not within tolerance of splat's.
    """
    import splat
    from splat._peers import PEERS, PeerUnavailable, Problem

    env = environment()
    pats = resolve_patterns(config.patterns, catalogue, quick=config.quick)
    peer_names = list(config.peers) if config.peers is not None else list(PEERS)
    if "splat" in peer_names:  # splat first: the ratios need its time
        peer_names.remove("splat")
        peer_names.insert(0, "splat")
    log(f"splat bench on {env['device']} ({env['platform']}); {FLOP_FORMULA}; {RATIO_DEFINITION}")
    # calls one JAX launch chains, and the least time a sample lasts (TIMING_METHOD)
    per_sample, min_sample_ms = sampling()

    results, skipped, memory, disagreements = [], [], [], []
    told = set()

    def skip(base: dict, peer: str, reason: str, check: _OutputCheck) -> None:
        if peer == "splat":
            check.no_reference(f"splat skipped: {reason}")
        skipped.append({**base, "impl": peer, "reason": reason})
        if (peer, reason) not in told:  # print each distinct reason once
            told.add((peer, reason))
            log(f"  skip {peer}: {reason} ({base['pattern']}, S={base['S']}, {base['mode']})")

    b, h, d = config.batch, config.heads, config.head_dim
    for name, make in pats:
        for s in config.lengths:
            mask = make(s)
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
            where = {"pattern": name, "mask": repr(mask), "S": s, "dtype": config.dtype}
            check = _OutputCheck(where, make_problem, disagreements, log)
            for mode in config.modes:
                problem = make_problem(mode)
                flops = useful_flops(b, h, layout.nnz, d, mode)
                base = {
                    "pattern": name,
                    "mask": repr(mask),
                    "S": s,
                    "mode": mode,
                    "nnz": int(layout.nnz),
                    "density": float(layout.density()),
                }
                rows = {}
                for peer in peer_names:
                    try:
                        prepared = PEERS[peer].prepare(problem)
                        verdict = check.verdict(peer, prepared, problem)
                        t = time_call(
                            prepared.run,
                            config.warmup,
                            config.repeats,
                            launch=prepared.launch,
                            sync=prepared.sync,
                            per_sample=per_sample,
                            calls_per_launch=prepared.calls_per_launch,
                            min_sample_ms=min_sample_ms,
                        )
                    except PeerUnavailable as e:
                        skip(base, peer, str(e), check)
                        continue
                    except Exception as e:  # a peer that crashes must not end the run; record why
                        skip(base, peer, f"error: {_short(e)}", check)
                        continue
                    row = {
                        **base,
                        "impl": peer,
                        **t,
                        "tflops": flops / (t["ms"] * 1e-3) / 1e12,
                        "temp_bytes": prepared.temp_bytes,
                        "note": prepared.note,
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
            "per_sample": per_sample,
            "min_sample_ms": min_sample_ms,
        },
        "flop_formula": FLOP_FORMULA,
        "ratio_definition": RATIO_DEFINITION,
        "timing_method": TIMING_METHOD,
        "check_rule": CHECK_RULE,
        "results": results,
        "skipped": skipped,
        "memory": memory,
        "disagreements": disagreements,
    }
    if config.build:
        out["build"] = build_section(pats, config.build_length, config.analyze_length, log=log)
    log(format_table(out))
    return out


# --- output check --------------------------------------------------------------------------------


def _unchecked(reason: str) -> dict:
    return {
        "max_abs_err_vs_splat": None,
        "rel_err_vs_splat": None,
        "check_tolerance": None,
        "agrees": None,
        "check": reason,
    }


def compare_outputs(got: np.ndarray, ref: np.ndarray, dtype: str) -> dict:
    """A peer's forward output against splat's (see :data:`CHECK_RULE`).

    Args:
      got, ref: ``[B, S, H, D]`` outputs, any float dtype (compared in float32).
      dtype: the inputs' dtype name, which sets the tolerance.

    Returns:
      ``{"max_abs_err_vs_splat", "rel_err_vs_splat", "check_tolerance", "agrees", "check"}``;
      a shape mismatch or a non-finite value in ``got`` does not agree.
    """
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    tol = CHECK_RTOL[dtype] * scale
    if got.shape != ref.shape:
        return {**_unchecked(f"output shape {got.shape} != splat's {ref.shape}"), "agrees": False}
    if not np.isfinite(got).all():
        return {**_unchecked("non-finite values in the output"), "agrees": False}
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    return {
        "max_abs_err_vs_splat": err,
        "rel_err_vs_splat": err / scale if scale > 0 else None,
        "check_tolerance": tol,
        "agrees": bool(err <= tol),
        "check": "forward output vs splat's",
    }


class _OutputCheck:
    """Checks each peer's forward output against splat's for one (pattern, S, dtype).

    Each peer is checked once (its first mode; fwd+bwd reuses the forward check)
    at the cost of one extra run of what it already compiled. The reference is
    splat's own row when splat ran; when splat is not among the peers, splat's
    forward is computed once for the check alone.
    """

    def __init__(self, where: dict, make_problem: Callable, disagreements: list, log: Callable):
        self.where, self.make_problem = where, make_problem
        self.disagreements, self.log = disagreements, log
        self.ref: np.ndarray | None = None
        self.ref_missing = ""  # why there is no reference, once known
        self.done: dict[str, dict] = {}

    def no_reference(self, reason: str) -> None:
        if self.ref is None and not self.ref_missing:
            self.ref_missing = reason

    def _reference(self) -> np.ndarray | None:
        if self.ref is None and not self.ref_missing:
            from splat._peers import PEERS

            try:  # splat was not asked for: compute its forward for the check alone (untimed: no chain)
                prepared = PEERS["splat"].prepare(self.make_problem("fwd", per_sample=1))
                self._set_reference(_forward_output(prepared, "fwd"))
            except Exception as e:
                self.no_reference(f"splat failed: {_short(e)}")
        return self.ref

    def _set_reference(self, out: np.ndarray) -> None:
        if np.isfinite(out).all():
            self.ref = out
        else:
            self.no_reference("splat's output has non-finite values")

    def verdict(self, peer: str, prepared, problem) -> dict:
        """The check fields of ``peer``'s rows (computed on its first call, then reused)."""
        from splat._peers import PEERS

        if peer in self.done:
            return self.done[peer]
        if PEERS[peer].no_check:
            v = _unchecked(PEERS[peer].no_check)
        else:
            try:
                out = _forward_output(prepared, problem.mode)
            except Exception as e:  # the check must not cost the timing
                v = _unchecked(f"could not read the output: {_short(e)}")
                self.log(f"  warning: {peer} output not checked ({v['check']})")
            else:
                if peer == "splat":
                    self._set_reference(out)
                ref = self._reference()
                if ref is None and peer == "splat":  # splat vs nothing: its output is broken
                    v = {**_unchecked(self.ref_missing), "agrees": False}
                elif ref is None:
                    v = _unchecked(f"no splat output to compare with ({self.ref_missing})")
                else:
                    v = compare_outputs(out, ref, problem.dtype)
                del out
        if v["agrees"] is False:
            self.disagreements.append({**self.where, "impl": peer, **v})
            w = self.where
            err = v["max_abs_err_vs_splat"]
            self.log(
                f"  !!! WARNING: {peer} DISAGREES WITH SPLAT on {w['pattern']} S={w['S']} {w['dtype']}: "
                + (
                    f"max|{peer} - splat| = {err:.4g} > tolerance {v['check_tolerance']:.4g}"
                    if err is not None
                    else v["check"]
                )
                + "; its timings are not comparable"
            )
        self.done[peer] = v
        return v


def _forward_output(prepared, mode: str) -> np.ndarray:
    """The attention output of one run of ``prepared``, float32 numpy ``[B, S, H, D]``."""
    if prepared.outputs is None:
        raise ValueError("this peer's Prepared has no outputs()")
    got = prepared.outputs()
    if mode == "fwdbwd":
        got = got[0]
    return np.asarray(got, np.float32)


# --- build section ---------------------------------------------------------------------------------


def _clear_layout_caches() -> bool:
    """Empties the mask -> layout cache so construction is timed from scratch."""
    from splat import masks

    fn = getattr(masks, "_to_acsr", None)
    if fn is not None and hasattr(fn, "cache_clear"):
        fn.cache_clear()
        return True
    return False


def build_section(
    patterns: Sequence[tuple[str, Callable[[int], object]]],
    length: int = 65536,
    analyze_length: int = 8192,
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> dict:
    """Times ``mask.to_acsr(S, S)`` at ``length`` and ``splat.analyze(dense array)`` at ``analyze_length``.

    Args:
      patterns: ``[(name, factory(S) -> Mask)]`` as from :func:`resolve_patterns`.
      length: S for constructing layouts from the mask values (O(S) paths).
      analyze_length: S of the dense ``[S, S]`` bool rendering given to ``splat.analyze``.
      repeats: timed runs (median reported); caches are cleared before each.

    Returns:
      ``{"length", "analyze_length", "cache_cleared", "patterns": [{name, build_ms, analyze_ms, nnz, ...}]}``.
    """
    import splat

    rows, cleared = [], True
    for name, make in patterns:
        mask = make(length)
        times = []
        for _ in range(repeats):
            cleared &= _clear_layout_caches()
            t0 = time.perf_counter()
            layout = mask.to_acsr(length, length)
            times.append((time.perf_counter() - t0) * 1e3)
        dense = make(analyze_length).to_acsr(analyze_length, analyze_length).to_dense()
        a_times = []
        for _ in range(repeats):
            cleared &= _clear_layout_caches()
            t0 = time.perf_counter()
            found = splat.analyze(dense)
            a_times.append((time.perf_counter() - t0) * 1e3)
        row = {
            "pattern": name,
            "mask": repr(mask),
            "build_ms": statistics.median(times),
            "build_samples_ms": times,
            "nnz": int(layout.nnz),
            "segments": len(layout.segments),
            "closed_forms": sum(sg.closed_form is not None for sg in layout.segments),
            "residual_blocks": 0 if layout.residual is None else int(layout.residual.num_blocks.sum()),
            "analyze_ms": statistics.median(a_times),
            "analyze_samples_ms": a_times,
            "analyze_nnz": int(found.nnz),
            "analyze_segments": len(found.segments),
            "analyze_residual_blocks": 0 if found.residual is None else int(found.residual.num_blocks.sum()),
        }
        rows.append(row)
        log(
            f"  build {name}: to_acsr({length}) {row['build_ms']:.1f} ms; "
            f"analyze(dense {analyze_length}^2) {row['analyze_ms']:.1f} ms"
        )
    return {"length": length, "analyze_length": analyze_length, "cache_cleared": cleared, "patterns": rows}


# --- output ---------------------------------------------------------------------------------------


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def format_table(result: dict) -> str:
    """The results as a text table (plus skips, memory and build sections when present)."""
    lines = [FLOP_FORMULA, RATIO_DEFINITION, TIMING_METHOD, ""]
    hdr = (
        f"{'pattern':24s} {'S':>7s} {'mode':6s} {'impl':13s} {'ms':>10s} {'TFLOP/s':>9s} {'x splat':>8s} "
        f"{'temp MiB':>9s} {'check':>5s}  note"
    )
    lines += [hdr, "-" * len(hdr)]
    for r in result["results"]:
        ratio = "-" if r.get("vs_splat") is None else f"{r['vs_splat']:.2f}"
        chk = {True: "ok", False: "DIFF"}.get(r.get("agrees"), "-")
        lines.append(
            f"{r['pattern'][:24]:24s} {r['S']:7d} {r['mode']:6s} {r['impl']:13s} {r['ms']:10.3f} "
            f"{r['tflops']:9.4f} {ratio:>8s} {_fmt_bytes(r['temp_bytes']):>9s} {chk:>5s}  {r.get('note', '')}"
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
    if result.get("build"):
        b = result["build"]
        lines += [
            "",
            f"layout construction at S={b['length']}, analysis of a dense {b['analyze_length']}^2 array:",
        ]
        for r in b["patterns"]:
            lines.append(
                f"  {r['pattern'][:24]:24s} to_acsr {r['build_ms']:9.1f} ms   "
                f"analyze {r['analyze_ms']:9.1f} ms   segments {r['segments']} "
                f"(closed {r['closed_forms']}), residual blocks {r['residual_blocks']}"
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
