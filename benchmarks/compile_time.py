#!/usr/bin/env python3
"""First-call latency: a new pattern and shape in a fresh process, cold and warm.

The target (GPU issue): the first call for a new pattern and shape (analysis +
code generation + compile) under 15 s; a second process reusing the on-disk
caches under 2 s; a new mask with the same spec compiles nothing new.

Each run is a fresh ``python`` process (this script with ``--child``), all
sharing one fresh temporary cache folder (``SPLAT_CACHE_DIR``, and a private
``TRITON_CACHE_DIR``):

1. ``cold``: empty caches (JAX's persistent compilation cache on, so it fills);
2. ``warm``: splat's caches (kernel source, compiled kernels) only, JAX's off;
3. ``warm+jax_cache``: splat's caches and JAX's persistent compilation cache.

Per run: import time (``jax``, ``splat``, the backend module), then from the
start of the work: mask analysis (``splat.analyze``), first forward ready
(``jax.block_until_ready``), first forward+backward ready (a jitted
``jax.grad``, after the forward), and the total; beside them JAX's own split
(trace / lower -- where jax-triton compiles -- / XLA compile, from
``jax.monitoring``), splat's counters (kernels rendered, compile requests,
disk hits, compiles) and the steady-state time of a second call. Then, in the
same process: an equal mask built again, and at ``--small-seq`` the same mask
given as a dense array (``masks.from_array``); both should render and compile
nothing new.

On CUDA the script also times ptxas on each cached PTX: what jaxlib would spend
assembling PTX to a cubin at each kernel's first launch in every process (its
cache is in memory only) when splat does not hand it the cubin (jaxlib without
``TritonKernel.module_image``, see ``jax_bindings._triton.backend``); the ``images``
counters say whether it did. On CPU the backend is pure JAX and "compile" is
XLA only (tests run it tiny).

Usage (GPU machine, from the project root, after the usual install prefix)::

    python3 benchmarks/compile_time.py --out $OUT/compile_time.json
    python3 benchmarks/compile_time.py --seq 256 --heads 2 --head-dim 16 --dtype float32   # tiny, CPU
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the child's clock starts before jax is imported

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("cold", "warm", "warm+jax_cache")
DEFAULT_PATTERN = "sliding_window(256, 256) | global_tokens(4)"


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pattern", default=DEFAULT_PATTERN, help="an expression over splat.masks")
    p.add_argument("--seq", type=int, default=8192, help="sequence length S (q_len = kv_len)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--small-seq", type=int, default=1024, help="S of the from_array check (<= --seq)")
    p.add_argument("--backend", default="auto", choices=("auto", "jax", "triton"))  # cuda: no backward
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {RUNS}")
    p.add_argument("--cache-dir", help="use (and keep) this folder instead of a fresh temporary one")
    p.add_argument("--timeout", type=float, default=580.0, help="seconds per child process")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="per run, the N functions longest in the first forward+backward (cProfile)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--jax-cache", help=argparse.SUPPRESS)  # child: JAX compilation cache folder
    return p.parse_args(argv)


# -- child: one fresh process ------------------------------------------------------


class _Clock:
    """Totals of JAX's compile-phase events between two marks."""

    EVENTS = {
        "/jax/core/compile/jaxpr_trace_duration": "trace_s",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
        "/jax/core/compile/backend_compile_duration": "xla_compile_s",
    }

    def __init__(self, jax):
        self.totals = dict.fromkeys(self.EVENTS.values(), 0.0)
        self.counts = {"jax_cache_hits": 0, "jax_cache_misses": 0}
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event, duration, **_):
        name = self.EVENTS.get(event)
        if name:
            self.totals[name] += duration

    def _event(self, event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            self.counts["jax_cache_hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.counts["jax_cache_misses"] += 1

    def snapshot(self) -> dict:
        from jax_bindings._cuda import compiler as _cuda_compiler
        from jax_bindings._triton import cache as _cache

        cuda = {f"cuda_{k}": v for k, v in _cuda_compiler.stats().items()}
        return {**self.totals, **self.counts, **_cache.stats(), **cuda}

    @staticmethod
    def delta(after: dict, before: dict) -> dict:
        return {k: round(after[k] - before[k], 4) for k in after}


def _longest(prof, n: int) -> list[dict]:
    """The ``n`` functions of a cProfile run with the longest cumulative times."""
    import pstats

    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:n]
    return [{"fn": f"{os.path.basename(f)}:{line}:{name}", "calls": nc, "self_s": round(tt, 4),
             "cum_s": round(ct, 4)} for (f, line, name), (_, nc, tt, ct, _) in rows]


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _child(a: argparse.Namespace) -> dict:
    import jax

    t_jax = time.perf_counter()
    if a.jax_cache:
        jax.config.update("jax_compilation_cache_dir", a.jax_cache)
        for name, value in (
            ("jax_persistent_cache_min_compile_time_secs", 0.0),
            ("jax_persistent_cache_min_entry_size_bytes", 0),
        ):
            try:  # cache every program, however small or quick to compile
                jax.config.update(name, value)
            except AttributeError:
                pass
    import jax.numpy as jnp
    import numpy as np

    import splat
    from jax_bindings import _dispatch, _registry
    from splat import masks

    t_splat = time.perf_counter()
    # imports the backend modules that can run here (triton and jax-triton on a GPU): all for "auto"
    want = _registry.names() if a.backend == "auto" else (a.backend,)
    available = {name: _registry.unavailable(name) for name in want}
    t_backend = time.perf_counter()
    clock = _Clock(jax)
    dev = jax.devices()[0]
    rec = {
        "import_jax_s": t_jax - _T0,
        "import_splat_s": t_splat - t_jax,
        "import_backend_s": t_backend - t_splat,
        "backend": a.backend,  # the one running the attention: set once the layout exists
        "available": available,
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": jax.default_backend(),
        "jax_cache": bool(a.jax_cache),
    }
    if "triton" in available and available["triton"] is None:
        from jax_bindings._triton import backend as _triton

        rec["compile_cache_installed"] = _triton.COMPILE_CACHE_INSTALLED

    def inputs(S, seed):
        rng = np.random.default_rng(seed)
        shape = (a.batch, S, a.heads, a.head_dim)
        arrs = [jnp.asarray(rng.standard_normal(shape, np.float32)).astype(a.dtype) for _ in range(3)]
        return jax.block_until_ready(arrs)

    def grad_fn(mask):
        def loss(q, k, v):
            return splat.attention(q, k, v, mask=mask, backend=a.backend).astype(jnp.float32).sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def fwd(q, k, v, mask):
        return jax.block_until_ready(splat.attention(q, k, v, mask=mask, backend=a.backend))

    # inputs first: their own XLA programs (RNG casts) are not the attention's
    (q, k, v), rec["inputs_s"] = _timed(lambda: inputs(a.seq, 0))
    S = a.seq
    mask = masks.parse(a.pattern)

    # -- the first call: analysis, forward, forward+backward ------------------------------
    s0 = clock.snapshot()
    t_work = time.perf_counter()
    layout, rec["analyze_s"] = _timed(lambda: splat.analyze(mask, S, S))
    s1 = clock.snapshot()
    _, rec["fwd_first_s"] = _timed(lambda: fwd(q, k, v, mask))
    rec["fwd_ready_s"] = time.perf_counter() - t_work  # analysis + first forward
    s2 = clock.snapshot()
    g = grad_fn(mask)
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        _, rec["fwdbwd_first_s"] = _timed(lambda: prof.runcall(lambda: jax.block_until_ready(g(q, k, v))))
        rec["profile_fwdbwd"] = _longest(prof, a.profile)
    else:
        _, rec["fwdbwd_first_s"] = _timed(lambda: jax.block_until_ready(g(q, k, v)))
    rec["total_s"] = time.perf_counter() - t_work
    s3 = clock.snapshot()
    rec["split"] = {
        "analyze": clock.delta(s1, s0),
        "fwd": clock.delta(s2, s1),
        "fwdbwd": clock.delta(s3, s2),
    }
    rec["layout"] = {"nnz": int(layout.nnz), "segments": len(layout.segments)}

    # -- steady state: the same calls again ---------------------------------------------
    _, rec["fwd_again_s"] = _timed(lambda: fwd(q, k, v, mask))
    _, rec["fwdbwd_again_s"] = _timed(lambda: jax.block_until_ready(g(q, k, v)))

    # -- an equal mask built again (new object, same spec) --------------------------------
    same = {}
    s4 = clock.snapshot()
    mask2 = masks.parse(a.pattern)
    _, same["fwd_s"] = _timed(lambda: fwd(q, k, v, mask2))
    _, same["fwdbwd_s"] = _timed(lambda: jax.block_until_ready(grad_fn(mask2)(q, k, v)))
    same["counts"] = clock.delta(clock.snapshot(), s4)
    same["mask_equal"] = bool(mask2 == mask)
    rec["same_mask"] = same

    # -- the same geometry as a dense array (from_array), at a small S --------------------
    S2 = min(a.small_seq, S)
    q2, k2, v2 = inputs(S2, 1)
    arr = {"seq": S2}
    s5 = clock.snapshot()
    _, arr["constructor_fwd_s"] = _timed(lambda: fwd(q2, k2, v2, mask))  # new shape: may compile
    _, arr["constructor_fwdbwd_s"] = _timed(lambda: jax.block_until_ready(grad_fn(mask)(q2, k2, v2)))
    s6 = clock.snapshot()
    arr["constructor_counts"] = clock.delta(s6, s5)
    small = splat.analyze(mask, S2, S2)
    dense = masks.from_array(small.to_dense())
    s7 = clock.snapshot()
    lay3, arr["analyze_s"] = _timed(lambda: splat.analyze(dense, S2, S2))
    _, arr["fwd_s"] = _timed(lambda: fwd(q2, k2, v2, dense))
    _, arr["fwdbwd_s"] = _timed(lambda: jax.block_until_ready(grad_fn(dense)(q2, k2, v2)))
    arr["counts"] = clock.delta(clock.snapshot(), s7)
    arr["layout_equal"] = bool(lay3 == small)
    rec["from_array"] = arr
    # after the timings: which backend ran the attention (traced again, abstractly)
    scale = a.head_dim**-0.5
    rec["backend"] = _dispatch.selected_backend("attention", q, k, v, layout, scale, backend=a.backend)
    return rec


# -- parent: fresh processes, report ----------------------------------------------------


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "triton", "jax-triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _run_child(a: argparse.Namespace, run: str, root: str, argv: list[str]) -> dict:
    env = dict(os.environ)
    env["SPLAT_CACHE_DIR"] = os.path.join(root, "splat")
    env["TRITON_CACHE_DIR"] = os.path.join(root, "triton_home")
    env.pop("SPLAT_NO_DISK_CACHE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *argv]
    if run != "warm":
        cmd += ["--jax-cache", os.path.join(root, "jax")]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    wall = time.perf_counter() - t
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"run": run, "error": f"rc={p.returncode}", "stderr_tail": p.stderr[-3000:], "wall_s": wall}
    rec = json.loads(lines[-1])
    rec["run"], rec["process_wall_s"] = run, wall
    return rec


def _ptxas_times(root: str) -> list[dict]:
    """Times ptxas on each cached PTX (what jaxlib repeats at each first launch, per process)."""
    files = sorted(glob.glob(os.path.join(root, "splat", "triton", "*.json")))
    if not files:
        return []
    try:
        import triton.backends.nvidia.compiler as cb

        def ptxas_for(cc):
            try:
                return cb.get_ptxas(cc).path
            except TypeError:  # older triton: get_ptxas() takes no arch
                return cb.get_ptxas().path

        arch_of = cb.sm_arch_from_capability
    except Exception:
        ptxas = shutil.which("ptxas")
        if not ptxas:
            return []
        ptxas_for = lambda cc: ptxas
        arch_of = lambda cc: f"sm_{cc}{'a' if cc >= 90 else ''}"
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            entry = json.load(open(f))
            meta, res = entry.get("meta", {}), entry["result"]
            if meta.get("platform") != "cuda":
                continue
            cc = int(meta["compute_capability"])
            src = os.path.join(tmp, "k.ptx")
            open(src, "w").write(res["binary"])
            cmd = [ptxas_for(cc), "-lineinfo", f"--gpu-name={arch_of(cc)}", src, "-o", src + ".o"]
            if meta.get("enable_fp_fusion") is False:
                cmd.insert(1, "--fmad=false")
            t = time.perf_counter()
            rc = subprocess.run(cmd, capture_output=True).returncode
            out.append(
                {
                    "kernel": res["name"],
                    "ptx_kb": len(res["binary"]) // 1024,
                    "rc": rc,
                    "ptxas_s": round(time.perf_counter() - t, 3),
                }
            )
    return out


def _fmt(x) -> str:
    return "   -  " if x is None else f"{x:6.2f}"


# (header, value) columns of the summary table; "sp" sums a counter over the three phases
_COLUMNS = (
    ("import", lambda r, sp: r["import_jax_s"] + r["import_splat_s"] + r["import_backend_s"]),
    ("analyze", lambda r, sp: r["analyze_s"]),
    ("fwd_1st", lambda r, sp: r["fwd_first_s"]),
    ("fwdbwd_1st", lambda r, sp: r["fwdbwd_first_s"]),
    ("total", lambda r, sp: r["total_s"]),
    ("trace", lambda r, sp: sp["trace_s"]),
    ("lower", lambda r, sp: sp["lower_s"]),
    ("xla", lambda r, sp: sp["xla_compile_s"]),
    ("codegen", lambda r, sp: sp["render_s"]),
    ("ttir->ptx", lambda r, sp: sp["compile_s"]),
    ("rendered", lambda r, sp: int(sp["rendered"])),
    ("compiled", lambda r, sp: int(sp["compiled"])),
    ("disk_hits", lambda r, sp: int(sp["disk_hits"])),
    ("fwd_again", lambda r, sp: r["fwd_again_s"]),
)


def _summary(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"compile time: {cfg['pattern']}  S={cfg['seq']} B={cfg['batch']} H={cfg['heads']} "
        f"D={cfg['head_dim']} {cfg['dtype']}  on {report.get('device')} ({report.get('backend')}); seconds",
        f"{'run':<15}" + "".join(f"{h:>11}" for h, _ in _COLUMNS),
    ]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"{r['run']:<15} ERROR {r['error']}: {r['stderr_tail'][-300:]}")
            continue
        sp = {k: sum(r["split"][p][k] for p in r["split"]) for k in r["split"]["fwd"]}
        cells = (f(r, sp) for _, f in _COLUMNS)
        lines.append(
            f"{r['run']:<15}" + "".join(f"{c:>11}" if isinstance(c, int) else f"{c:>11.3f}" for c in cells)
        )
    for r in report["runs"]:
        if "error" in r:
            continue
        s, f = r["same_mask"], r["from_array"]
        lines.append(
            f"{r['run']:<15} equal mask again: fwd {s['fwd_s']:.3f}s fwd+bwd {s['fwdbwd_s']:.3f}s, "
            f"rendered {int(s['counts']['rendered'])} compile requests {int(s['counts']['compile_calls'])}; "
            f"from_array S={f['seq']} (layout equal: {f['layout_equal']}): fwd {f['fwd_s']:.3f}s "
            f"fwd+bwd {f['fwdbwd_s']:.3f}s, rendered {int(f['counts']['rendered'])} "
            f"compile requests {int(f['counts']['compile_calls'])}"
        )
    if any(r.get("compile_cache_installed") is False for r in report["runs"]):
        lines.append(
            "jax-triton's compiles were NOT cached on disk (an unknown jax-triton; see the debug log)"
        )
    if report.get("ptxas"):
        tot = sum(p["ptxas_s"] for p in report["ptxas"])
        ks = ", ".join(f"{p['kernel']} {p['ptxas_s']:.2f}s" for p in report["ptxas"])
        lines.append(f"ptxas per process if jaxlib assembled the PTX itself: {tot:.2f}s total: {ks}")
    lines.append(
        "targets: " + ", ".join(f"{k} {'OK' if v else 'MISSED'}" for k, v in report["targets"].items())
    )
    return "\n".join(lines)


def _targets(runs: list[dict]) -> dict:
    by = {r["run"]: r for r in runs if "error" not in r}
    out = {}
    if "cold" in by:
        out["cold total < 15 s"] = by["cold"]["total_s"] < 15
    for name in ("warm", "warm+jax_cache"):
        if name in by:
            out[f"{name} total < 2 s"] = by[name]["total_s"] < 2
    if by:
        out["equal masks compile nothing"] = all(
            r[c]["counts"][n] == 0
            for r in by.values()
            for c in ("same_mask", "from_array")
            for n in ("rendered", "compile_calls")
        )
    return out


def main(argv=None) -> int:
    a = _args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if a.child:
        print(json.dumps(_child(a)))
        return 0
    runs = [r for r in a.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        raise SystemExit(f"unknown runs {bad}; choose from {RUNS}")
    child_argv, skip = [], False
    for x in argv:  # the children get the workload flags, not --out
        if skip or x.startswith("--out="):
            skip = False
        elif x == "--out":
            skip = True
        else:
            child_argv.append(x)
    root = a.cache_dir or tempfile.mkdtemp(prefix="splat-compile-time-")
    try:
        results = [_run_child(a, run, root, child_argv) for run in runs]
        ok = [r for r in results if "error" not in r]
        report = {
            "config": {
                k: getattr(a, k)
                for k in ("pattern", "seq", "batch", "heads", "head_dim", "dtype", "small_seq", "backend")
            },
            "device": ok[0]["device"] if ok else None,
            "backend": ok[0]["backend"] if ok else None,
            "versions": _versions(),
            "runs": results,
            "ptxas": _ptxas_times(root) if ok and ok[0]["platform"] == "gpu" else [],
            "targets": _targets(results),
        }
    finally:
        if not a.cache_dir:
            shutil.rmtree(root, ignore_errors=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    print(_summary(report))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
