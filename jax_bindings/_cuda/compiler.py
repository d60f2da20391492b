"""CUDA C++ -> cubin for the generated kernels: NVRTC (preferred) or nvcc, cached on disk.

* **NVRTC** is loaded with ctypes (no Python binding needed) from, in order: ``$SPLAT_NVRTC``
  (a path to ``libnvrtc.so*``), the ``nvidia`` wheels on ``sys.path`` (``jax[cuda12]`` and
  ``jax[cuda13]`` bring ``libnvrtc``), ``$CUDA_HOME/lib64``, ``/usr/local/cuda/lib64``, then the
  loader's search path. A kernel includes no system header, so NVRTC needs no include path; the
  headers it does include (the kernel parts of :mod:`jax_bindings._cuda.parts`) are handed to the
  compiler by name with the source (``headers``: include name -> text).
* **nvcc** on ``PATH`` is the fallback (``-cubin``, so no host compiler runs for device code).
* Cubins are kept in ``<splat cache dir>/cuda/`` (:mod:`jax_bindings._disk_cache`), keyed by
  the compiler's identity, the target and the source; a new process loads them instead of
  compiling (``SPLAT_NO_DISK_CACHE=1`` turns that off).

:func:`stats` counts compiles and disk hits; :func:`compiler` says what compiles here (or why
nothing does).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from jax_bindings._disk_cache import cached_bytes

ARCH = "sm_90a"
_FORMAT = 1  # bump when the cache entry's meaning changes
_STATS: collections.Counter = collections.Counter()
_LOCK = threading.Lock()


class CompileError(RuntimeError):
    """The CUDA compiler rejected a generated kernel (a bug in the generator); carries the log."""


def stats() -> dict[str, float]:
    """Counters since the process started: ``requests``, ``disk_hits``, ``compiled``, ``compile_s``."""
    return {k: _STATS[k] for k in ("requests", "disk_hits", "compiled", "compile_s")}


@dataclass(frozen=True)
class Compiler:
    """One way to compile here: ``kind`` ("nvrtc" or "nvcc"), its ``path`` and ``version``."""

    kind: str
    path: str
    version: str

    def compile(self, source: str, *, arch: str = ARCH, verbose: bool = False,
                headers: dict[str, str] | None = None) -> tuple[bytes, str]:
        """``(cubin, log)``; ``verbose`` puts ptxas's resource report (registers, spills) in the log;
        ``headers``: the files ``source`` includes, by include name."""
        run = _nvrtc_compile if self.kind == "nvrtc" else _nvcc
        return run(self.path, source, arch, verbose, dict(headers or {}))


# -- NVRTC through ctypes -------------------------------------------------------------


def _nvrtc_candidates() -> list[str]:
    found = []
    env = os.environ.get("SPLAT_NVRTC")
    if env:
        found.append(env)
    for root in sys.path:
        found += sorted(glob.glob(os.path.join(root, "nvidia", "**", "libnvrtc.so*"), recursive=True))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    found += ["libnvrtc.so"]
    return [p for p in found if "builtins" not in os.path.basename(p) and not p.endswith(".alt")]


@functools.cache
def _load_nvrtc(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _nvrtc_version(lib) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


def _check(lib, status: int, what: str, log: str = "") -> None:
    if status:
        msg = lib.nvrtcGetErrorString(status).decode()
        raise CompileError(f"{what}: {msg}" + (f"\n{log}" if log else ""))


def _nvrtc_compile(
    path: str, source: str, arch: str, verbose: bool, headers: dict[str, str]
) -> tuple[bytes, str]:
    lib = _load_nvrtc(path)
    prog = ctypes.c_void_p()
    names = (ctypes.c_char_p * max(len(headers), 1))(*[n.encode() for n in headers])
    texts = (ctypes.c_char_p * max(len(headers), 1))(*[t.encode() for t in headers.values()])
    status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"splat_kernel.cu", len(headers),
                                    texts, names)
    _check(lib, status, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"--device-as-default-execution-space"]
        opts += [b"--ptxas-options=-v"] if verbose else []
        arr = (ctypes.c_char_p * len(opts))(*opts)
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        _check(lib, status, "NVRTC could not compile a generated kernel", log.value.decode(errors="replace"))
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# -- nvcc -------------------------------------------------------------------------------


def _nvcc(path: str, source: str, arch: str, verbose: bool, headers: dict[str, str]) -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory(prefix="splat-nvcc-") as d:
        cu, out = os.path.join(d, "kernel.cu"), os.path.join(d, "kernel.cubin")
        with open(cu, "w") as f:
            f.write(source)
        for name, text in headers.items():  # include names are relative to the source's folder
            os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        gen = f"arch=compute_{arch[3:]},code={arch}"
        cmd = [path, "-gencode", gen, "-cubin", "-O3", *(["-Xptxas", "-v"] if verbose else []), "-o", out, cu]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise CompileError(f"nvcc could not compile a generated kernel:\n{r.stderr[-4000:]}")
        with open(out, "rb") as f:
            return f.read(), r.stderr


@functools.cache
def compiler() -> Compiler | str:
    """The compiler used here, or a sentence saying why there is none."""
    tried = []
    for path in _nvrtc_candidates():
        try:
            return Compiler("nvrtc", path, _nvrtc_version(_load_nvrtc(path)))
        except (OSError, AttributeError, CompileError) as e:
            tried.append(f"{path}: {e}")
    nvcc = shutil.which("nvcc")
    if nvcc:
        r = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
        if r.returncode == 0:
            return Compiler("nvcc", nvcc, r.stdout.strip().splitlines()[-1])
        tried.append(f"{nvcc}: exit {r.returncode}")
    why = "; ".join(tried[-3:])
    return f"no CUDA compiler: libnvrtc could not be loaded and nvcc is not on PATH ({why})"


def cubin(source: str, *, arch: str = ARCH, headers: dict[str, str] | None = None) -> bytes:
    """The cubin of ``source`` (with the ``headers`` it includes, by include name) for ``arch``:
    from the disk cache, else compiled and stored."""
    c = compiler()
    if isinstance(c, str):
        raise CompileError(c)
    _STATS["requests"] += 1

    def build() -> bytes:
        t = time.perf_counter()
        data, _log = c.compile(source, arch=arch, headers=headers)
        _STATS["compiled"] += 1
        _STATS["compile_s"] += time.perf_counter() - t
        return data

    with _LOCK:
        key = ["cuda", _FORMAT, c.kind, c.version, arch, source, sorted((headers or {}).items())]
        data, hit = cached_bytes("cuda", key, build, suffix=".cubin")
    _STATS["disk_hits"] += hit
    return data
