"""The ``splat`` command (also ``python -m splat``): ``analyze``, ``bench``, ``bench-runtime``, ``tune``.

``splat analyze EXPR_OR_NPY`` prints how splat stores a mask (segments, strides,
closed forms, residual, density); EXPR is a mask expression over the constructors
in :mod:`splat.masks`, e.g. ``"sliding_window(256, 256) | global_tokens(4)"``
(parsed by :func:`splat.masks.parse`, never evaluated), or the path of a boolean
``.npy`` file. A mask on a token grid (``"neighborhood((32, 32), 7)"``) is
analyzed at its grid's S and also shown in grid form: the keys a centre, a
corner and an edge query see, pictured on the grid (:mod:`splat.tools.grid_view`).
``splat bench`` times splat against its peers (see
:mod:`splat.tools.bench`), ``splat bench-runtime`` its runtime masks on a GPU (see
:mod:`splat.tools.bench_runtime`). Run ``splat COMMAND --help`` for the options.

Errors in what the user typed (a bad expression, a backend that cannot run here,
a missing optional package, an output file in a folder that does not exist) print
one line, ``splat COMMAND: error: ...``, and exit with status 2. Output files
(``--out``, ``--plot``, ``--report``) go into folders that exist: the command
creates none, and checks them before it starts any work.

When the reader of its standard output goes away (``splat analyze ... | head -1``),
the command stops quietly with status 1, as Python's own recipe for a closed pipe
does (the ``signal`` module's documentation, "Note on SIGPIPE").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence

import numpy as np

__all__ = ["OUTPUT_FLAGS", "build_parser", "check_output_paths", "load_mask", "main", "version"]

_DEFAULT_Q_LEN = 1024

# The flags of each command that name a file it writes.
OUTPUT_FLAGS: dict[str, tuple[str, ...]] = {
    "analyze": ("--plot",),
    "bench": ("--out", "--plot"),
    "bench-runtime": ("--out", "--plot"),
    "tune": ("--out", "--report"),
}


def version() -> str:
    """The installed distribution's version (whatever its name), else ``splat.__version__``."""
    for dist in importlib.metadata.packages_distributions().get("splat", []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import splat

    return splat.__version__


def load_mask(expr_or_npy: str, q_len: int | None, kv_len: int | None):
    """Turns the CLI's EXPR_OR_NPY into ``(mask_or_array, q_len, kv_len)``.

    A path ending in ``.npy`` (or naming an existing file) is loaded as a boolean
    ``[q_len, kv_len]`` array; anything else is parsed by :func:`splat.masks.parse`,
    with ``q_len`` defaulting to 1024 (a mask on a token grid: ``prod(grid)``) and
    ``kv_len`` to ``q_len``.

    Raises:
      ValueError: a bad expression or file, naming what is wrong.
    """
    if expr_or_npy.endswith(".npy") or os.path.isfile(expr_or_npy):
        if not os.path.isfile(expr_or_npy):
            raise ValueError(f"mask file {expr_or_npy!r} does not exist")
        try:
            arr = np.load(expr_or_npy, allow_pickle=False)
        except Exception as e:  # corrupt file, pickled object, ...
            raise ValueError(f"cannot read {expr_or_npy!r} as a .npy array: {e}") from None
        if arr.dtype != np.bool_ or arr.ndim != 2:
            raise ValueError(
                f"mask file {expr_or_npy!r} must hold a 2-D boolean [q_len, kv_len] array, "
                f"got dtype {arr.dtype} shape {arr.shape}"
            )
        for name, given, actual in (("--q-len", q_len, arr.shape[0]), ("--kv-len", kv_len, arr.shape[1])):
            if given is not None and given != actual:
                raise ValueError(f"{name} {given} does not match the array's shape {arr.shape}")
        return arr, arr.shape[0], arr.shape[1]
    from splat import masks
    from splat.tools import grid_view

    mask = masks.parse(expr_or_npy)
    if q_len is None:
        q_len = grid_view.fixed_length(mask) or _DEFAULT_Q_LEN
    kv_len = q_len if kv_len is None else kv_len
    return mask, q_len, kv_len


def check_output_paths(args) -> None:
    """Each output file the parsed ``args`` name goes into a folder that exists, and is not a folder.

    Called before a command starts any work, so that a typo in a path costs nothing
    (and no folder tree is made from it).

    Raises:
      ValueError: naming the flag, the path and the missing folder.
    """
    for flag in OUTPUT_FLAGS.get(args.command, ()):
        path = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if path is None:
            continue
        if os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a folder; give the file to write, e.g. {flag} {path}/NAME")
        folder = os.path.dirname(path)
        if folder and not os.path.isdir(folder):
            raise ValueError(
                f"{flag} {path}: folder {folder} does not exist; splat creates no folders "
                f"(mkdir -p {folder} first, or pick another path)"
            )


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _nonneg_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``splat`` command."""
    from jax_bindings import BACKENDS
    from splat import catalogue
    from splat.tools.peers import PEERS

    p = argparse.ArgumentParser(prog="splat", description="Sparse regular attention for JAX.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    a = sub.add_parser(
        "analyze",
        help="show how a mask is stored (segments, closed forms, residual)",
        description="Analyze a mask and print its ACSR layout. EXPR_OR_NPY is a mask expression such as "
        '"sliding_window(256, 256) | global_tokens(4)" (constructors of splat.masks with literal '
        "arguments, '|', '&', parentheses; see splat.masks.parse) or a boolean .npy file.",
    )
    a.add_argument("mask", metavar="EXPR_OR_NPY")
    a.add_argument(
        "--q-len",
        type=_positive_int,
        default=None,
        help="query length (expression default 1024; a grid mask's: prod(grid))",
    )
    a.add_argument("--kv-len", type=_positive_int, default=None, help="key length (default: q-len)")
    a.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="write a picture of the mask by segment (a grid mask: its grid form too, in STEM_grid.png)",
    )

    b = sub.add_parser(
        "bench",
        help="time splat against its peers",
        description="Time splat attention against dense XLA, cuDNN, tokamax, FlashAttention-3, "
        "FlexAttention, torch SDPA and splat's unfused ops, in one process. Useful FLOPs = "
        "4*B*H*nnz*D forward, 3.5x that for forward+backward.",
    )
    b.add_argument(
        "--patterns",
        nargs="+",
        default=None,
        help=f"mask expressions, or names from splat.catalogue: {', '.join(catalogue.names())} "
        "(default: all but full and causal; the neighborhood_* ones exist only at their grid's S = 16384 "
        "and run there, whatever --lengths)",
    )
    b.add_argument("--lengths", nargs="+", type=_positive_int, default=None, help="sequence lengths S")
    b.add_argument("--heads", type=_positive_int, default=None, help="heads H (default 4)")
    b.add_argument("--head-dim", type=_positive_int, default=None, help="head dim D (default 64)")
    b.add_argument("--batch", type=_positive_int, default=None, help="batch B (default 1)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    b.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default=None)
    b.add_argument("--backend", choices=list(BACKENDS), default="auto", help="splat's backend")
    b.add_argument(
        "--peers",
        nargs="+",
        default=None,
        help=f"peers to time: {', '.join(PEERS)} (default: all that apply)",
    )
    b.add_argument("--repeats", type=_positive_int, default=None, help="timed runs (median reported)")
    b.add_argument("--warmup", type=_nonneg_int, default=None, help="untimed runs first")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--quick", action="store_true", help="few patterns, one small length, few repeats")
    b.add_argument("--build", action="store_true", help="also time layout construction and analysis")
    b.add_argument("--build-length", type=_positive_int, default=65536, help="S for the build section")
    b.add_argument("--analyze-length", type=_positive_int, default=8192, help="S of the dense array analyzed")
    b.add_argument("--out", metavar="JSON", default=None, help="write all settings and results here")
    b.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="write a plot of the results here (and each grid pattern's grid form beside it)",
    )

    from splat.tools.bench_runtime import RUNTIME_PEERS, WORKLOADS

    r = sub.add_parser(
        "bench-runtime",
        help="time splat's runtime masks (packed documents, Gemma 2's local layer) on a GPU",
        description="Time splat.attention with runtime masks against FlexAttention (kernel alone, and with "
        "its block mask built every call), FlashAttention-3 (varlen) and cuDNN, in one process: "
        "doc_causal (causal() & segment_ids, a new packing of documents every call) and gemma2_local "
        "(causal window with logits_soft_cap). Needs a GPU. Defaults: bf16, S=8192, H=16, D=128.",
    )
    r.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None)
    r.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default=None)
    r.add_argument("--seq-len", type=_positive_int, default=None, help="S (default 8192)")
    r.add_argument("--batch", type=_positive_int, default=None, help="B of doc_causal (default 4)")
    r.add_argument("--local-batch", type=_positive_int, default=None, help="B of gemma2_local (default 1)")
    r.add_argument("--heads", type=_positive_int, default=None, help="H (default 16)")
    r.add_argument("--head-dim", type=_positive_int, default=None, help="D (default 128)")
    r.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    r.add_argument("--doc-min", type=_positive_int, default=None, help="shortest document (default 256)")
    r.add_argument("--doc-max", type=_positive_int, default=None, help="longest document (default 4096)")
    r.add_argument("--packings", type=_positive_int, default=None, help="packings cycled (default 10)")
    r.add_argument("--window", type=_positive_int, default=None, help="gemma2_local window (default 4096)")
    r.add_argument("--soft-cap", type=float, default=None, help="gemma2_local logit cap (default 50)")
    r.add_argument("--peers", nargs="+", choices=list(RUNTIME_PEERS), default=None)
    r.add_argument("--backend", choices=list(BACKENDS), default=None, help="splat's backend")
    r.add_argument("--repeats", type=_positive_int, default=None, help="timed samples (median reported)")
    r.add_argument("--warmup", type=_nonneg_int, default=None, help="untimed samples first")
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--quick", action="store_true", help="S=2048, few packings and repeats: a set-up check")
    r.add_argument("--out", metavar="JSON", default=None, help="write all settings and results here")
    r.add_argument("--plot", metavar="PNG", default=None, help="write a plot of the results here")

    from splat.tools import tune

    t = sub.add_parser(
        "tune",
        help="measure tile configs and backends on this GPU, write the tuning store",
        description="Rank each Triton kernel's tile configs with a cost model, time the best few (and the "
        "heuristic default) per catalogue pattern, sequence length and op, and write the fastest to the "
        "tuning store this device's kernels read (jax_bindings/tuning/<device>.json unless --out). "
        "--exhaustive times every candidate and reports how the pruned choice compares.",
    )
    t.add_argument(
        "--patterns",
        nargs="+",
        default=None,
        help=f"catalogue names (default: {' '.join(tune.DEFAULT_PATTERNS)})",
    )
    t.add_argument(
        "--lengths", nargs="+", type=_positive_int, default=None, help="sequence lengths (8192 16384)"
    )
    t.add_argument("--ops", nargs="+", choices=list(tune.OPS), default=None, help="kernel ops (all three)")
    t.add_argument("--heads", type=_positive_int, default=16)
    t.add_argument("--head-dim", type=_positive_int, default=128)
    t.add_argument("--batch", type=_positive_int, default=1)
    t.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    t.add_argument(
        "--top", type=_positive_int, default=2, help="configs timed per case, best predicted first"
    )
    t.add_argument("--exhaustive", action="store_true", help="time every candidate (to judge the pruning)")
    t.add_argument("--no-backends", action="store_true", help="skip timing the backends against each other")
    t.add_argument("--no-tiles", action="store_true", help="time the backends only (no tile configs)")
    t.add_argument("--repeats", type=_positive_int, default=5)
    t.add_argument(
        "--out", metavar="JSON", default=None, help="the store file to write (merged if it exists)"
    )
    t.add_argument("--report", metavar="JSON", default=None, help="also write every measurement here")
    return p


def _cmd_analyze(args) -> int:
    import splat

    obj, q_len, kv_len = load_mask(args.mask, args.q_len, args.kv_len)
    layout = splat.analyze(obj, q_len=q_len, kv_len=kv_len)
    print(splat.report(obj, q_len=q_len, kv_len=kv_len).to_string())
    print(layout.to_string())
    from splat.tools import grid_view

    grid = None if isinstance(obj, np.ndarray) else grid_view.grid_of(obj)
    if grid is not None:
        print(f"grid form on the {'x'.join(map(str, grid))} grid: the keys a query sees")
        print(grid_view.grid_text(obj))
    if args.plot:
        from splat.tools.plot import plot_grid, plot_mask

        plot_mask(layout, args.plot, title=args.mask if not isinstance(obj, np.ndarray) else None)
        print(f"wrote {args.plot}")
        if grid is not None:
            path = f"{os.path.splitext(args.plot)[0]}_grid.png"
            plot_grid(obj, path, title=args.mask)
            print(f"wrote {path}")
    return 0


def _write_bench(result: dict, args) -> int:
    """Writes a bench result where ``--out`` / ``--plot`` ask; the command's exit code."""
    from splat.tools import bench

    if args.out:
        bench.write_json(result, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        from splat.tools.plot import plot_bench, plot_bench_grids

        plot_bench(result, args.plot)
        print(f"wrote {args.plot}")
        for path in plot_bench_grids(result, args.plot):
            print(f"wrote {path}")
    return 0


def _cmd_bench(args) -> int:
    from splat.tools import bench

    config = bench.BenchConfig.from_args(args)
    result = bench.run_bench(config)
    return _write_bench(result, args)


def _cmd_bench_runtime(args) -> int:
    import dataclasses

    from splat.tools import bench_runtime

    cls = bench_runtime.RuntimeBenchConfig
    kw = {}
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name, None)
        if v is not None:
            kw[f.name] = tuple(v) if isinstance(v, list) else v
    result = bench_runtime.run_runtime_bench(cls.quick(**kw) if args.quick else cls(**kw))
    return _write_bench(result, args)


def _cmd_tune(args) -> int:
    from jax_bindings import _registry
    from splat.tools import tune

    why = _registry.unavailable("triton")
    if why:
        raise ValueError(f"tuning needs the triton backend, which cannot run here: {why}")
    cfg = tune.TuneConfig(
        patterns=tune.parse_list(args.patterns, tune.DEFAULT_PATTERNS),
        lengths=tuple(args.lengths or (8192, 16384)),
        ops=() if args.no_tiles else tune.parse_list(args.ops, tune.OPS),
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        top=args.top,
        exhaustive=args.exhaustive,
        backends=not args.no_backends,
        repeats=args.repeats,
        out=args.out,
    )
    tune.main(cfg, report=args.report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``splat`` console script and ``python -m splat``; returns the exit status.

    A closed standard output (the reader of a pipe has gone) ends the command quietly with
    status 1; anything else the command raises is its own (see :func:`_run`).
    """
    try:
        try:
            return _run(argv)
        finally:
            # Output still buffered meets a closed pipe here, inside the handler below, rather
            # than at the interpreter's exit ("Exception ignored ... BrokenPipeError").
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe (signal module, "Note on SIGPIPE"): point stdout at devnull
        # so that the interpreter's own final flush writes nowhere instead of failing again, and
        # exit 1 ("Python exits with error code 1 on EPIPE"). Not 141 (128 + SIGPIPE), which says
        # a signal killed the process: Python ignores SIGPIPE and no signal was delivered.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is no file (replaced, or already closed)
            pass
        return 1


def _run(argv: Sequence[str] | None) -> int:
    """Parses ``argv`` and runs the command; user errors print one line and give status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_output_paths(args)
        if args.command == "analyze":
            return _cmd_analyze(args)
        if args.command == "tune":
            return _cmd_tune(args)
        if args.command == "bench-runtime":
            return _cmd_bench_runtime(args)
        return _cmd_bench(args)
    except (ValueError, ImportError) as e:  # bad input, a backend that cannot run, a missing package
        print(f"splat {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
