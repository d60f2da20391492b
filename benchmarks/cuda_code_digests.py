"""Digests of the compiled code of every CUDA forward and backward variant, to prove a change of the
kernels' source changes no instruction (CPU only: NVRTC, and cuobjdump where there is one).

Every variant the tests and the planner build is compiled with NVRTC for sm_90a, as
:mod:`jax_bindings._cuda.compiler` compiles it, and recorded as two digests:

* ``ptx``: the PTX with the kernel's name replaced by ``KERNEL``, comments dropped, and the
  module-scope data no instruction references dropped (namespace-scope ``constexpr`` constants
  are emitted as unreferenced ``.global`` variables; where they are declared does not change
  the code);
* ``sass``: ``cuobjdump -sass`` and ``-res-usage`` of the cubin, the name replaced likewise and
  the module's data (those constants) dropped (``--sass``; needs a cuobjdump, e.g. Triton's).

Where both are digested the SASS decides (the PTX may number its virtual registers otherwise for
the same machine code); the report counts both.

The variants: ``tests/test_cuda_source.py``'s (``VARIANTS``, ``BWD_VARIANTS``,
``RUNTIME_VARIANTS``, the shifted ones), the grid forward on ``tests/test_cuda_grid_tiles.py``'s
and ``tests/cuda_cases.py``'s grids (planned and forced tile shapes), and the planner's forward
(in every schedule) and backward (in every key order, ordered or not) on ``tests/cuda_cases.py``'s
bands and runtime masks, in both dtypes; then the kernels that share their parts: decode
(``tests/test_cuda_decode_source.py``'s variants) and the passes around the backward.

    python benchmarks/cuda_code_digests.py --out /tmp/before.json --sass [--keep /tmp/before]
    # ... change the kernels' source ...
    python benchmarks/cuda_code_digests.py --check /tmp/before.json --sass [--flat]

``--flat`` compiles the planner's variants from the single text ``named_source()`` gives (what
spikes edit) instead of their program's parts; the two must agree too. ``--keep DIR`` writes each
variant's normalised PTX and SASS there (named by a digest of its id), for a diff where digests
differ; ``--rehash DIR`` digests such a folder again instead of compiling.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from jax_bindings._cuda import compiler  # noqa: E402

OPTIONS = [b"--gpu-architecture=sm_90a", b"--std=c++17", b"--device-as-default-execution-space"]


def _compile(text: str, headers: dict[str, str]) -> tuple[str, bytes]:
    """``(ptx, cubin)`` of ``text`` with its ``headers``, by NVRTC with the backend's options."""
    c = compiler.compiler()
    if isinstance(c, str) or c.kind != "nvrtc":
        raise RuntimeError(f"needs NVRTC: {c}")
    lib = compiler._load_nvrtc(c.path)
    prog = ctypes.c_void_p()
    n = max(len(headers), 1)
    names = (ctypes.c_char_p * n)(*[h.encode() for h in headers])
    texts = (ctypes.c_char_p * n)(*[t.encode() for t in headers.values()])
    compiler._check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), text.encode(), b"splat_kernel.cu", len(headers), texts, names
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
        status = lib.nvrtcCompileProgram(prog, len(OPTIONS), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        compiler._check(lib, status, "NVRTC", log.value.decode(errors="replace"))
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return ptx.value.decode(), cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def normalized_ptx(ptx: str) -> tuple[str, list[str]]:
    """``(text, dropped)``: the PTX with the entry's name ``KERNEL``, no comments or blank lines,
    and no module-scope variable that nothing else names (``dropped``: their names)."""
    entry = re.search(r"\.entry\s+(\w+)\s*\(", ptx).group(1)
    text = re.sub(rf"\b{re.escape(entry)}(?=\b|_param_)", "KERNEL", ptx)
    lines = [ln.split("//", 1)[0].rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    decl = re.compile(r"^\.(global|const)\s+[^;=]*?\b([A-Za-z_$][\w$]*)(\[[^\]]*\])?\s*(=[^;]*)?;$")
    body = "\n".join(ln for ln in lines if not decl.match(ln))
    keep, dropped = [], []
    for ln in lines:
        m = decl.match(ln)
        if m and not re.search(rf"\b{re.escape(m.group(2))}\b", body):
            dropped.append(m.group(2))
            continue
        keep.append(ln)
    return "\n".join(keep) + "\n", dropped


@functools.cache
def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in sys.path:
        for path in glob.glob(os.path.join(root, "triton", "backends", "nvidia", "bin", "cuobjdump")):
            return path
    return None


def normalized_sass(cubin: bytes, name: str) -> str:
    tool = _cuobjdump()
    if tool is None:
        raise RuntimeError("--sass needs cuobjdump (on PATH, or Triton's)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = [
            subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
            for flag in ("-sass", "-res-usage")
        ]
    text = "\n".join(out).replace(f.name, "CUBIN")
    # the module's data ("Common": its global variables and their address table) is not code: it
    # holds the unreferenced constants normalized_ptx drops
    text = re.sub(r"\n Common:\n[^\n]*", "", text)
    return re.sub(rf"\b{re.escape(name)}(?=\b|_param_)", "KERNEL", text)


def _entry(ptx: str) -> str:
    return re.search(r"\.entry\s+(\w+)\s*\(", ptx).group(1)


def digest(text: str, headers: dict[str, str], sass: bool, keep: str | None = None) -> dict:
    """The variant's digests; ``keep``: a path prefix to write the normalised PTX (and SASS) to."""
    ptx, cubin = _compile(text, headers)
    norm, dropped = normalized_ptx(ptx)
    out = {"ptx": hashlib.sha256(norm.encode()).hexdigest(), "unreferenced": len(dropped)}
    texts = {"ptx": norm}
    if sass:
        texts["sass"] = normalized_sass(cubin, _entry(ptx))
        out["sass"] = hashlib.sha256(texts["sass"].encode()).hexdigest()
    if keep:
        for ext, body in texts.items():
            with open(f"{keep}.{ext}", "w") as f:
                f.write(body)
    return out


# -- the variants -------------------------------------------------------------------------------


def _kwargs_id(kind: str, left, right, kwargs: dict) -> str:
    return f"{kind}({left},{right}," + ",".join(f"{k}={v!r}" for k, v in sorted(kwargs.items())) + ")"


def _inputs(variant, flat: bool) -> tuple[str, dict[str, str]]:
    """What compiles a planner's variant: its program (the parts), or, ``flat``, its one text."""
    if hasattr(variant, "program") and not flat:
        prog = variant.program()
        return prog.source, prog.header_map()
    return variant.named_source()[1], {}


# Fields the variants gained after digests were first recorded, with the value that means what
# their absence meant: an id leaves them out at that value, so the ids of the variants that
# existed before stay the same.
ADDED_FIELDS = {"head_dim": 128, "soft_cap": None}


def _variant_id(v) -> str:
    """A planned variant's id: its class and its fields, but :data:`ADDED_FIELDS` at their old
    meaning."""
    fields = [f"{f.name}={getattr(v, f.name)!r}" for f in dataclasses.fields(v)
              if f.name not in ADDED_FIELDS or getattr(v, f.name) != ADDED_FIELDS[f.name]]
    return f"{type(v).__name__}({', '.join(fields)})"


def variants(flat: bool = False) -> dict[str, callable]:
    """id -> a thunk giving ``(source, headers)``, for every variant (deduplicated)."""
    import numpy as np
    import test_cuda_grid_tiles as grid_tests
    import test_cuda_source as t
    from cuda_cases import CASES, GRID_SHAPE_CASES, RUNTIME_CASES, band_layout, other_key_orders

    from jax_bindings._cuda import bwd_source, grid_tiles, plan, source
    from splat import masks

    out: dict[str, callable] = {}
    for left, right, kwargs in t.VARIANTS:
        out[_kwargs_id("fwd", left, right, kwargs)] = functools.partial(
            lambda a, b, kw: (source.source(a, b, **kw), {}), left, right, kwargs
        )
    for left, right, kwargs in t.BWD_VARIANTS:
        out[_kwargs_id("bwd", left, right, kwargs)] = functools.partial(
            lambda a, b, kw: (bwd_source.bwd_source(a, b, **kw), {}), left, right, kwargs
        )
    for make, left, right, kwargs in t.RUNTIME_VARIANTS:
        kind = "fwd" if make is t.gen.source else "bwd"
        fn = source.source if kind == "fwd" else bwd_source.bwd_source
        out[_kwargs_id(kind, left, right, kwargs)] = functools.partial(
            lambda f, a, b, kw: (f(a, b, **kw), {}), fn, left, right, kwargs
        )

    planned: list = []

    def add(make):
        try:
            v = make()
        except NotImplementedError:
            return None
        planned.append(v)
        return v

    dtypes = ("bfloat16", "float16")
    for mask in t.SHIFTED_MASKS.values():
        for runtime in ("lengths", "ids"):
            layout = mask.to_acsr(4096)
            add(
                lambda layout=layout, runtime=runtime: plan.fwd_variant(
                    layout, 128, "bfloat16", runtime, shifted=True
                )
            )
            add(lambda layout=layout, runtime=runtime: plan.fwd_variant(layout, 128, "bfloat16", runtime))
    grids = [c for c in grid_tests.PLAN_CASES]
    for (g, k, kw), dtype in [(c, d) for c in grids for d in dtypes]:
        layout = masks.neighborhood(g, k, **kw).to_acsr()
        add(lambda layout=layout, dtype=dtype: plan.fwd_variant(layout, 128, dtype))
    for (g, k, kw), shape in GRID_SHAPE_CASES:
        layout = masks.neighborhood(g, k, **kw).to_acsr()
        tiles = grid_tiles.grid_plan(layout.grid, shape).tiles
        add(lambda tiles=tiles: plan.GridFwdVariant(tiles, "bfloat16"))
        add(lambda tiles=tiles: plan.GridFwdVariant(tiles, "bfloat16", section_bytes=1))
    layouts = [(c.layout(), c.q_len, c.kv_len, c.heads, c.kv_heads, "") for c in CASES]
    for _name, sq, skv, left, right, h, hk, _b, fn in RUNTIME_CASES:
        keys = fn(np.random.default_rng(0))
        kind = "ids" if "ids" in keys or "kv_ids" in keys else "lengths"
        layouts.append((band_layout(sq, skv, left, right), sq, skv, h, hk, kind))
    for layout, sq, skv, h, hk, kind in layouts:
        for dtype in dtypes:
            for runtime in {kind, "", "lengths"} if not kind else {kind}:
                fwd = add(
                    lambda layout=layout, dtype=dtype, runtime=runtime: plan.fwd_variant(
                        layout, 128, dtype, runtime
                    )
                )
                if fwd is not None and isinstance(fwd, plan.FwdVariant):
                    for schedule in source.SCHEDULES:
                        add(lambda fwd=fwd, schedule=schedule: plan.rescheduled(fwd, schedule))
                        add(lambda fwd=fwd, schedule=schedule: plan.rescheduled(fwd, schedule, 3 << 20))
                    add(lambda fwd=fwd: dataclasses.replace(fwd, schedule="queue"))
                    if fwd.shifted is False and runtime:
                        add(
                            lambda layout=layout, dtype=dtype, runtime=runtime: plan.fwd_variant(
                                layout, 128, dtype, runtime, shifted=True
                            )
                        )
                bwd = add(
                    lambda layout=layout, dtype=dtype, runtime=runtime: plan.bwd_variant(
                        layout, 128, dtype, runtime
                    )
                )
                if bwd is not None:
                    add(lambda bwd=bwd: dataclasses.replace(bwd, ordered=False))
                    for other in other_key_orders(bwd, (2, sq, h, 128), (2, skv, hk, 128)):
                        add(lambda other=other: other)
    for v in planned:
        out.setdefault(_variant_id(v), functools.partial(_inputs, v, flat))
    out.update(_others())
    return out


def _others() -> dict[str, callable]:
    """The kernels that share the forward's and backward's parts: decode (test_cuda_decode_source's
    variants) and the passes around the backward."""
    import test_cuda_decode_source as dt

    from jax_bindings._cuda import bwd_passes

    out = {}
    for args in dt.VARIANTS:
        out[f"decode{args}"] = functools.partial(lambda a: _program_inputs(dt._variant(*a).program()), args)
    for kernel in bwd_passes.KERNELS:
        for dtype in ("bfloat16", "float16"):
            out[f"pass({kernel},{dtype})"] = functools.partial(
                lambda k, d: (bwd_passes.pass_source(k, d).replace("__NAME__", "splat_pass"), {}),
                kernel,
                dtype,
            )
    return out


def _program_inputs(prog) -> tuple[str, dict[str, str]]:
    return prog.source, prog.header_map()


def run(
    sass: bool, flat: bool, only: str | None = None, jobs: int = 2, keep: str | None = None
) -> dict[str, dict]:
    todo = {k: v for k, v in variants(flat).items() if only is None or re.search(only, k)}
    t0 = time.perf_counter()
    if keep:
        os.makedirs(keep, exist_ok=True)

    def one(item):
        key, thunk = item
        text, headers = thunk()
        path = os.path.join(keep, hashlib.sha256(key.encode()).hexdigest()[:16]) if keep else None
        return key, digest(text, headers, sass, path)

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:  # NVRTC releases the GIL
        result = dict(pool.map(one, todo.items()))
    print(f"{len(result)} variants compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return result


def rehash(folder: str) -> dict[str, dict]:
    """The digests of the code a run kept in ``folder`` (its normalised texts, normalised again)."""
    out = {}
    for key in variants():
        path = os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:16])
        if not os.path.exists(path + ".ptx"):
            continue
        with open(path + ".ptx") as f:
            text = re.sub(r"\b\w+(?=_param_\d)", "KERNEL", f.read())
            out[key] = {"ptx": hashlib.sha256(text.encode()).hexdigest()}
        if os.path.exists(path + ".sass"):
            with open(path + ".sass") as f:
                text = re.sub(r"\n Common:\n[^\n]*", "", f.read())
            out[key]["sass"] = hashlib.sha256(text.encode()).hexdigest()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the digests (JSON) here")
    p.add_argument("--check", help="compare with the digests (JSON) recorded here")
    p.add_argument("--sass", action="store_true", help="also digest the SASS (cuobjdump)")
    p.add_argument("--flat", action="store_true", help="the planner's variants from named_source()")
    p.add_argument("--only", default=None, help="a regular expression on the variants' ids")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--keep", default=None, help="a folder to write each variant's normalised code to")
    p.add_argument("--rehash", default=None, help="digest the code kept in this folder (--keep) instead")
    args = p.parse_args()
    got = rehash(args.rehash) if args.rehash else run(args.sass, args.flat, args.only, args.jobs, args.keep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
    if not args.check:
        return 0
    with open(args.check) as f:
        want = json.load(f)
    if args.only:
        want = {k: v for k, v in want.items() if re.search(args.only, k)}
    bad, counts = 0, {"ptx": 0, "sass": 0}
    for key in sorted(set(got) | set(want)):
        if key not in want or key not in got:
            print(f"{'new' if key not in want else 'missing'}: {key}")
            bad += key not in got
            continue
        fields = [f for f in ("ptx", "sass") if f in got[key] and f in want[key]]
        same = {f: got[key][f] == want[key][f] for f in fields}
        for f in fields:
            counts[f] += same[f]
        # the machine code decides where both were digested: PTX may differ in the numbering of
        # virtual registers and the order of a commutative operation's operands where the SASS
        # does not
        decisive = "sass" if "sass" in fields else "ptx"
        if not same[decisive]:
            print(f"{decisive} differs: {key}")
            bad += 1
        elif not all(same.values()):
            print(f"ptx differs, sass identical: {key}")
    n = sum(1 for k in got if k in want)
    print(
        f"{n} variants compared: identical PTX {counts['ptx']}, identical SASS {counts['sass']}; "
        f"{bad} differ or missing",
        file=sys.stderr,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
