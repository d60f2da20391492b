"""The on-disk kernel cache every code-generating backend shares: where it is, and how entries are written.

* folder: ``$SPLAT_CACHE_DIR`` or ``~/.cache/splat/kernels`` (never committed);
* ``SPLAT_NO_DISK_CACHE=1`` (any value but "" and "0") makes every lookup miss and writes nothing;
* entries are written atomically (a temp file in the same folder, then ``os.replace``), so a
  concurrent process reads the old file or the new one, never a part;
* :func:`cached_bytes` is the whole protocol for a binary artefact (a cubin): a key from a
  list of JSON-able parts, read, else build and store.

Used by :mod:`jax_bindings._triton.cache` (generated Triton modules, PTX, cubins) and
:mod:`jax_bindings._cuda.compiler` (cubins of the generated CUDA C++).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

_log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The folder generated kernels and their compiled forms are kept in."""
    d = os.environ.get("SPLAT_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "splat" / "kernels"


def disabled() -> bool:
    """Whether ``SPLAT_NO_DISK_CACHE`` turns the disk cache off."""
    return os.environ.get("SPLAT_NO_DISK_CACHE", "") not in ("", "0")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Writes ``data`` to ``path`` through a temp file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def cached_bytes(
    folder: str, key_parts: list, build: Callable[[], bytes], *, suffix: str
) -> tuple[bytes, bool]:
    """``(data, hit)``: the entry for ``key_parts`` in ``<cache_dir()>/<folder>/``, or ``build()`` stored.

    The key is the SHA-256 of ``key_parts`` as JSON (put everything that changes the result in
    it: format version, compiler version, target, source). An empty or unreadable file is a
    miss; a failed write (read-only or full disk) is logged and the built bytes still returned.
    """
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()
    path = cache_dir() / folder / f"{key}{suffix}"
    if not disabled():
        try:
            data = path.read_bytes()
            if data:
                return data, True
        except OSError:
            pass
    data = build()
    if not disabled():
        try:
            write_atomic(path, data)
        except OSError as e:
            _log.debug("splat: cannot write cache entry %s (%s)", path, e)
    return data, False
