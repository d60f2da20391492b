"""Writes generated kernel source to a cache folder, imports it, caches by spec.

* folder: ``$SPLAT_CACHE_DIR`` or ``~/.cache/splat/kernels`` (never committed);
* ``SPLAT_DUMP_KERNELS=1`` prints each newly rendered module's path and source
  to stderr;
* a module is imported once per ``(spec, interpret)``; ``interpret=True``
  builds it under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, for tests).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from splat._codegen._render import render
from splat._codegen._spec import KernelSpec

_MODULES: dict[tuple[KernelSpec, bool], ModuleType] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """The folder generated kernels are written to."""
    d = os.environ.get("SPLAT_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "splat" / "kernels"


def source(spec: KernelSpec) -> str:
    """The generated source text for ``spec`` (see :func:`splat._codegen._render.render`)."""
    return render(spec)


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
        src = render(spec)
        digest = hashlib.sha256(src.encode()).hexdigest()[:24]
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{spec.op}_{digest}.py"
        if not path.exists() or path.read_text() != src:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(src)
            os.replace(tmp, path)
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
        return mod
