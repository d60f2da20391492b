"""The ``splat`` command line: ``splat analyze`` and ``splat bench``.

``splat analyze SPEC_OR_NPY`` prints how splat stores a mask (segments, strides,
closed forms, residual, density); SPEC is an expression over the constructors in
:mod:`splat.masks`, e.g. ``"sliding_window(256, 256) | global_tokens(4)"``, or the
path of a boolean ``.npy`` file. ``splat bench`` times splat against its peers
(see :mod:`splat._bench`). Run ``splat COMMAND --help`` for the options.

Mask expressions are parsed with :mod:`ast`, never evaluated: only calls of the
public constructors of :mod:`splat.masks` with int literal arguments, ``|``,
``&`` and parentheses are accepted.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Sequence

import numpy as np

from jax_bindings import BACKENDS

__all__ = ["SpecError", "main", "mask_constructors", "parse_mask_spec"]

# Constructors that take arrays or callables cannot be written as int literals.
_NOT_IN_SPECS = {"from_array", "from_fn", "Mask"}


class SpecError(ValueError):
    """A mask expression that is not a combination of constructor calls with int literals."""


def mask_constructors() -> dict:
    """Name -> constructor for every public mask constructor a spec may call."""
    from splat import masks

    names = getattr(masks, "__all__", [n for n in dir(masks) if not n.startswith("_")])
    return {
        n: getattr(masks, n) for n in names if n not in _NOT_IN_SPECS and callable(getattr(masks, n, None))
    }


def _where(node: ast.AST) -> str:
    return f" (at column {node.col_offset + 1})" if hasattr(node, "col_offset") else ""


def parse_mask_spec(spec: str):
    """Parses a mask expression such as ``"sliding_window(256, 256) | global_tokens(4)"``.

    Args:
      spec: an expression using calls of :mod:`splat.masks` constructors (optionally
        written ``masks.NAME``) with int literal arguments (positional or keyword),
        combined with ``|``, ``&`` and parentheses.

    Returns:
      The :class:`splat.masks.Mask` the expression describes.

    Raises:
      SpecError: (a ValueError) naming the offending part of the expression.

    Example:
      >>> from splat.cli import parse_mask_spec
      >>> m = parse_mask_spec("sliding_window(2) | global_tokens(1)")
      >>> int(m.to_acsr(6, 6).nnz)
      30
    """
    if not isinstance(spec, str):
        raise SpecError(f"mask spec must be a string, got {type(spec).__name__}")
    ctors = mask_constructors()
    allowed = ", ".join(sorted(ctors))
    try:
        tree = ast.parse(spec.strip(), mode="eval")
    except SyntaxError as e:
        raise SpecError(f"mask spec {spec!r} is not a valid expression: {e.msg}") from None

    def literal(node: ast.AST, what: str) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise SpecError(
            f"{what} must be an int literal, got {ast.unparse(node)!r}{_where(node)} in mask spec {spec!r}"
        )

    def build(node: ast.AST):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitOr, ast.BitAnd)):
            left, right = build(node.left), build(node.right)
            return left | right if isinstance(node.op, ast.BitOr) else left & right
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "masks":
                name = f.attr
            elif isinstance(f, ast.Name):
                name = f.id
            else:
                raise SpecError(
                    f"only calls of mask constructors are allowed, got {ast.unparse(f)!r}{_where(f)}; "
                    f"constructors: {allowed}"
                )
            if name not in ctors:
                raise SpecError(f"unknown mask constructor {name!r}{_where(f)}; constructors: {allowed}")
            args = [literal(a, f"argument {i + 1} of {name}") for i, a in enumerate(node.args)]
            kwargs = {}
            for kw in node.keywords:
                if kw.arg is None:
                    raise SpecError(f"'**' arguments are not allowed in mask spec {spec!r}")
                kwargs[kw.arg] = literal(kw.value, f"argument {kw.arg!r} of {name}")
            try:
                return ctors[name](*args, **kwargs)
            except (TypeError, ValueError) as e:
                raise SpecError(f"{name}({ast.unparse(node)[len(ast.unparse(f)) + 1 : -1]}): {e}") from None
        raise SpecError(
            f"unsupported syntax {ast.unparse(node)!r}{_where(node)} in mask spec {spec!r}: use calls of "
            f"mask constructors with int literals, '|', '&' and parentheses; constructors: {allowed}"
        )

    return build(tree.body)


def load_mask(spec_or_npy: str, q_len: int | None, kv_len: int | None):
    """Turns the CLI's SPEC_OR_NPY into ``(mask_or_array, q_len, kv_len)``.

    A path ending in ``.npy`` (or naming an existing file) is loaded as a boolean
    ``[q_len, kv_len]`` array; anything else is parsed by :func:`parse_mask_spec`,
    with ``q_len`` defaulting to 1024 and ``kv_len`` to ``q_len``.
    """
    if spec_or_npy.endswith(".npy") or os.path.isfile(spec_or_npy):
        if not os.path.isfile(spec_or_npy):
            raise ValueError(f"mask file {spec_or_npy!r} does not exist")
        try:
            arr = np.load(spec_or_npy, allow_pickle=False)
        except Exception as e:  # corrupt file, pickled object, ...
            raise ValueError(f"cannot read {spec_or_npy!r} as a .npy array: {e}") from None
        if arr.dtype != np.bool_ or arr.ndim != 2:
            raise ValueError(
                f"mask file {spec_or_npy!r} must hold a 2-D boolean [q_len, kv_len] array, "
                f"got dtype {arr.dtype} shape {arr.shape}"
            )
        for name, given, actual in (("--q-len", q_len, arr.shape[0]), ("--kv-len", kv_len, arr.shape[1])):
            if given is not None and given != actual:
                raise ValueError(f"{name} {given} does not match the array's shape {arr.shape}")
        return arr, arr.shape[0], arr.shape[1]
    mask = parse_mask_spec(spec_or_npy)
    q_len = 1024 if q_len is None else q_len
    kv_len = q_len if kv_len is None else kv_len
    return mask, q_len, kv_len


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
    p = argparse.ArgumentParser(prog="splat", description="Sparse regular attention for JAX.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    a = sub.add_parser(
        "analyze",
        help="show how a mask is stored (segments, closed forms, residual)",
        description="Analyze a mask and print its ACSR layout. SPEC_OR_NPY is a mask expression such as "
        '"sliding_window(256, 256) | global_tokens(4)" (constructors of splat.masks, int literals, '
        "'|', '&', parentheses) or a boolean .npy file.",
    )
    a.add_argument("mask", metavar="SPEC_OR_NPY")
    a.add_argument("--q-len", type=_positive_int, default=None, help="query length (spec default 1024)")
    a.add_argument("--kv-len", type=_positive_int, default=None, help="key length (default: q-len)")
    a.add_argument("--plot", metavar="PNG", default=None, help="write a picture of the mask by segment")

    b = sub.add_parser(
        "bench",
        help="time splat against its peers",
        description="Time splat attention against dense XLA, cuDNN, tokamax, FlexAttention, torch SDPA "
        "and splat's unfused ops, in one process. Useful FLOPs = 4*B*H*nnz*D forward, 3.5x that "
        "for forward+backward.",
    )
    b.add_argument("--patterns", nargs="+", default=None, help="catalogue names or mask specs")
    b.add_argument("--lengths", nargs="+", type=_positive_int, default=None, help="sequence lengths S")
    b.add_argument("--heads", type=_positive_int, default=None, help="heads H (default 4)")
    b.add_argument("--head-dim", type=_positive_int, default=None, help="head dim D (default 64)")
    b.add_argument("--batch", type=_positive_int, default=None, help="batch B (default 1)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    b.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default=None)
    b.add_argument("--backend", choices=BACKENDS, default="auto", help="splat's backend")
    b.add_argument("--peers", nargs="+", default=None, help="peers to time (default: all that apply)")
    b.add_argument("--repeats", type=_positive_int, default=None, help="timed runs (median reported)")
    b.add_argument("--warmup", type=_nonneg_int, default=None, help="untimed runs first")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--quick", action="store_true", help="few patterns, one small length, few repeats")
    b.add_argument("--build", action="store_true", help="also time layout construction and analysis")
    b.add_argument("--build-length", type=_positive_int, default=65536, help="S for the build section")
    b.add_argument("--analyze-length", type=_positive_int, default=8192, help="S of the dense array analyzed")
    b.add_argument("--out", metavar="JSON", default=None, help="write all settings and results here")
    b.add_argument("--plot", metavar="PNG", default=None, help="write a plot of the results here")
    return p


def _cmd_analyze(args) -> int:
    import splat

    obj, q_len, kv_len = load_mask(args.mask, args.q_len, args.kv_len)
    layout = splat.analyze(obj, q_len=q_len, kv_len=kv_len)
    report = splat.report(obj, q_len=q_len, kv_len=kv_len)
    text = report if isinstance(report, str) else getattr(report, "to_string", lambda: str(report))()
    print(text)
    print(layout.to_string())
    if args.plot:
        from splat._plot import plot_mask

        plot_mask(layout, args.plot, title=args.mask if not isinstance(obj, np.ndarray) else None)
        print(f"wrote {args.plot}")
    return 0


def _cmd_bench(args) -> int:
    from splat import _bench

    config = _bench.BenchConfig.from_args(args)
    result = _bench.run_bench(config)
    if args.out:
        _bench.write_json(result, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        from splat._plot import plot_bench

        plot_bench(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``splat`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "analyze":
            return _cmd_analyze(args)
        return _cmd_bench(args)
    except (ValueError, ImportError) as e:  # bad input or a missing optional package
        print(f"splat {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
