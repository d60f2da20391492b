"""Writes generated kernel source to a cache folder, imports it, caches by spec.

* folder: ``$SPLAT_CACHE_DIR`` or ``~/.cache/splat/kernels`` (never committed);
* ``SPLAT_DUMP_KERNELS=1`` prints each newly rendered module's path and source
  to stderr;
* a module is imported once per ``(spec, interpret)``; ``interpret=True``
  builds it under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, for tests);
* :class:`CompileCache` keeps what Triton compiled from those modules (PTX) in
  ``<folder>/triton/``, so a new process skips TTIR -> PTX (installed around
  jax-triton by :mod:`jax_bindings._triton.backend`; ``SPLAT_NO_DISK_CACHE=1`` turns it off);
* :func:`module_image` keeps the cubin assembled from each PTX in ``<folder>/cubin/``
  (handed to jaxlib by :mod:`jax_bindings._triton.backend`, so it does not run ptxas again);
* :func:`stats` counts renders, compile requests, disk hits and compiles.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from jax_bindings._disk_cache import cache_dir, cached_bytes
from jax_bindings._disk_cache import disabled as _disabled
from jax_bindings._disk_cache import write_atomic as _write_atomic
from jax_bindings._triton.render import render
from jax_bindings._triton.spec import KernelSpec

_MODULES: dict[tuple[KernelSpec, bool], ModuleType] = {}
_LOCK = threading.Lock()
_STATS: collections.Counter = collections.Counter()
_log = logging.getLogger(__name__)


def stats() -> dict[str, float]:
    """Counters since the process started (a snapshot; subtract two to count a step).

    * ``rendered``: kernel modules generated and imported (one per new ``(spec, interpret)``),
      ``render_s``: seconds spent on that;
    * ``compile_calls``: compile requests that reached :class:`CompileCache` (jax-triton's
      in-memory cache missed: a kernel new to this process);
    * ``disk_hits`` / ``compiled``: of those, served from disk / compiled for real;
    * ``compile_s``: seconds spent in the real compiles;
    * ``images`` / ``image_hits`` / ``image_s``: PTX -> cubin requests (:func:`module_image`),
      of those served from disk, and seconds spent assembling the rest.
    """
    names = ("rendered", "render_s", "compile_calls", "disk_hits", "compiled", "compile_s")
    return {k: _STATS[k] for k in (*names, "images", "image_hits", "image_s")}


def load(spec: KernelSpec, *, interpret: bool = False) -> ModuleType:
    """Imports (generating if needed) the module holding ``spec``'s ``kernel``."""
    key = (spec, interpret)
    mod = _MODULES.get(key)
    if mod is not None:
        return mod
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is not None:
            return mod
        t0 = time.perf_counter()
        src = render(spec)
        digest = hashlib.sha256(src.encode()).hexdigest()[:24]
        path = cache_dir() / f"{spec.op}_{digest}.py"
        if not path.exists() or path.read_text() != src:
            _write_atomic(path, src)
        if os.environ.get("SPLAT_DUMP_KERNELS", "") not in ("", "0"):
            print(f"# splat kernel {spec.op}: {path}\n{src}", file=sys.stderr)
        name = f"_splat_kernel_{spec.op}_{digest}_{'interp' if interpret else 'jit'}"
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            ispec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(ispec)
            sys.modules[name] = mod
            ispec.loader.exec_module(mod)
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
        _MODULES[key] = mod
        _STATS["rendered"] += 1
        _STATS["render_s"] += time.perf_counter() - t0
        return mod


# -- compiled kernels ------------------------------------------------------------


class CompileCache:
    """A disk cache around a Triton compile step ``f(ttir, backend, options, compute_capability, platform)``.

    jax-triton compiles each kernel (TTIR -> TTGIR -> LLVM IR -> PTX) inside JAX's
    lowering and caches it in memory only, so every new process pays that again;
    JAX's own persistent cache cannot help (its lookup comes after lowering). An
    instance stands in for jax-triton's ``compile_ttir_inplace`` (same call) and
    consults ``<cache_dir()>/triton/<key>.json`` first.

    * key: sha256 of the TTIR text (``str(ttir)`` before compiling, which mutates
      the module; it holds the kernel's name and source locations, stable because
      kernel modules are named by spec hash -- and the PTX embeds the same paths),
      ``platform``, ``compute_capability``, the options that change the output
      (``num_warps``, ``num_stages``, ``num_ctas``, ``enable_fp_fusion`` and the
      options object's own ``hash()``, Triton's cache key for them), the backend's
      ``hash()`` (ptxas version and arch) and ``salt`` (triton / jax-triton versions);
    * value: the result dataclass's fields as JSON (on CUDA: PTX, kernel name,
      shared memory bytes, and ttgir / llir when jax-triton dumps them), written
      atomically (temp file + ``os.replace``); an unreadable or mismatching file
      is a miss and is overwritten;
    * bypassed (plain call) when ``SPLAT_NO_DISK_CACHE=1``, when ``options.debug``
      is set (the compile prints its IR), and on platforms outside ``platforms``
      (ROCm's result names a temporary file).

    Args:
      compile_fn: the wrapped compile function.
      result_type: the dataclass ``compile_fn`` returns (rebuilt from JSON on a hit).
      salt: versions of the tools that produce the value.
      platforms: platforms whose results are cached.
      folder: where entries go; default ``cache_dir() / "triton"``, read per call.

    Example:
      >>> import dataclasses, tempfile
      >>> @dataclasses.dataclass
      ... class Result:
      ...     binary: str
      >>> cc = CompileCache(lambda ttir, *a: Result(str(ttir)), Result, folder=tempfile.mkdtemp())
      >>> opts = dataclasses.make_dataclass("Opts", ["num_warps"])(4)
      >>> cc("module {}", None, opts, 90, "cuda").binary, stats()["compiled"] >= 1
      ('module {}', True)
    """

    FORMAT = 1

    def __init__(
        self,
        compile_fn: Callable[..., Any],
        result_type: type,
        *,
        salt: str = "",
        platforms: tuple[str, ...] = ("cuda",),
        folder: str | os.PathLike | None = None,
    ):
        if not dataclasses.is_dataclass(result_type):
            raise TypeError(f"result_type must be a dataclass, got {result_type!r}")
        self.__wrapped__ = compile_fn
        self.result_type = result_type
        self.salt = salt
        self.platforms = tuple(platforms)
        self._folder = folder
        self._fields = tuple(f.name for f in dataclasses.fields(result_type))

    def folder(self) -> Path:
        return Path(self._folder) if self._folder is not None else cache_dir() / "triton"

    def key(self, ttir_text: str, backend, options, compute_capability, platform) -> str:
        """The entry name for one compile request (64 hex digits)."""

        def attr(obj, name):
            try:
                v = getattr(obj, name)
                return v() if callable(v) else v
            except Exception:  # a fingerprint we cannot read only weakens the key, never breaks it
                return None

        parts = {
            "format": self.FORMAT,
            "salt": self.salt,
            "platform": str(platform),
            "compute_capability": str(compute_capability),
            "options": {
                n: repr(attr(options, n))
                for n in ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "hash")
            },
            "backend": repr(attr(backend, "hash")),
            "ttir": ttir_text,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def __call__(self, ttir, backend, options, compute_capability, platform):
        _STATS["compile_calls"] += 1
        if _disabled() or platform not in self.platforms or getattr(options, "debug", False):
            return self._compile(ttir, backend, options, compute_capability, platform)
        key = self.key(str(ttir), backend, options, compute_capability, platform)
        path = self.folder() / f"{key}.json"
        hit = self._read(path, key)
        if hit is not None:
            _STATS["disk_hits"] += 1
            return hit
        result = self._compile(ttir, backend, options, compute_capability, platform)
        meta = {n: getattr(options, n, None) for n in ("num_warps", "num_stages", "enable_fp_fusion")}
        self._write(path, key, result, platform=platform, compute_capability=compute_capability, **meta)
        return result

    def _compile(self, *args):
        t = time.perf_counter()
        result = self.__wrapped__(*args)
        _STATS["compiled"] += 1
        _STATS["compile_s"] += time.perf_counter() - t
        return result

    def _read(self, path: Path, key: str):
        try:
            data = json.loads(path.read_text())
            fields = data["result"]
            if data["format"] != self.FORMAT or data["key"] != key or set(fields) != set(self._fields):
                raise ValueError("entry does not match")
            return self.result_type(**fields)
        except FileNotFoundError:
            return None
        except Exception as e:  # corrupt, truncated or foreign: compile again and overwrite
            _log.debug("splat: ignoring compiled-kernel cache entry %s (%s: %s)", path, type(e).__name__, e)
            return None

    def _write(self, path: Path, key: str, result, **meta) -> None:
        try:
            fields = {n: getattr(result, n) for n in self._fields}
            meta = json.loads(json.dumps(meta, default=repr))  # informational only (benchmarks read it)
            text = json.dumps({"format": self.FORMAT, "key": key, "meta": meta, "result": fields})
        except (AttributeError, TypeError, ValueError) as e:  # not what we expected: keep it in memory only
            _log.debug("splat: not caching compile result %r (%s)", type(result).__name__, e)
            return
        try:
            _write_atomic(path, text)
        except OSError as e:  # read-only or full disk: the compile result is still good
            _log.debug("splat: cannot write compiled-kernel cache entry %s (%s)", path, e)


# -- assembled kernels (cubin) -----------------------------------------------------


def module_image(ptx: str, arch: str, assemble: Callable[[str], bytes], *, salt: str = "") -> bytes:
    """The cubin of ``ptx`` for ``arch`` (e.g. ``"sm_90a"``): from disk, or ``assemble(ptx)`` and stored.

    Entries are ``<cache_dir()>/cubin/<sha256 of format, salt, arch, ptx>.cubin``,
    written atomically; ``salt`` names the assembler (ptxas version). A file that
    is empty or unreadable is a miss. ``SPLAT_NO_DISK_CACHE=1``: always assemble.
    """
    _STATS["images"] += 1
    t = time.perf_counter()
    data, hit = cached_bytes("cubin", ["cubin", 1, salt, arch, ptx], lambda: assemble(ptx), suffix=".cubin")
    if hit:
        _STATS["image_hits"] += 1
    else:
        _STATS["image_s"] += time.perf_counter() - t
    return data
