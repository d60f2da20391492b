"""The CUDA kernels kept as source files: ``kernels/`` (package data), composed by ``#include``.

A kernel is one ``.cu`` file under ``kernels/`` that includes its parts (``.cuh``, by their path
under ``kernels/``) and one generated header of constants, the variant's specialisation (tile
sizes, the mask's form, flags): everything else is plain CUDA C++ a CUDA editor reads. NVRTC
gets no include path, so :func:`program` hands every part to the compiler by name, with the
generated header among them.

``kernels/common/``: parts any kernel may use (types, warp-level tensor-core tiles and cp.async);
``kernels/decode/``: the decode kernel and its parts (the key walk over an ACSR row, the
contiguous and paged KV addressing).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from dataclasses import dataclass
from importlib import resources

_ROOT = resources.files("jax_bindings._cuda") / "kernels"


@dataclass(frozen=True)
class Program:
    """A kernel's translation unit: ``source`` (the ``.cu`` text) and the ``headers`` it includes,
    by include name; ``name``: the kernel's ``extern "C"`` name, unique to this program."""

    name: str
    source: str
    headers: tuple[tuple[str, str], ...]

    def header_map(self) -> dict[str, str]:
        return dict(self.headers)

    def dump(self) -> str:
        """The whole program as one text (generated header, parts, kernel), for reading."""
        parts = [f"// ===== {n} =====\n{t}" for n, t in self.headers]
        return "\n".join([*parts, f"// ===== kernel =====\n{self.source}"])


@functools.cache
def _files() -> tuple[tuple[str, str], ...]:
    """Every ``.cu`` / ``.cuh`` under ``kernels/``: (path relative to it, text)."""
    out = []

    def walk(node, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            rel = f"{prefix}{child.name}"
            if child.is_dir():
                walk(child, rel + "/")
            elif child.name.endswith((".cu", ".cuh")):
                out.append((rel, child.read_text()))

    walk(_ROOT, "")
    return tuple(out)


def read(path: str) -> str:
    """The text of ``kernels/<path>``."""
    for rel, text in _files():
        if rel == path:
            return text
    raise FileNotFoundError(f"no kernel file {path!r} under {_ROOT}")


def constants_header(
    namespace: str, values: dict[str, object], *, types: dict[str, str] | None = None
) -> str:
    """A generated header: ``constexpr`` constants (ints, bools, floats) and type aliases
    (``types``: alias -> type) in ``namespace``."""
    lines = ["// generated: one variant's constants", "#pragma once", f"namespace {namespace} {{"]
    for alias, target in (types or {}).items():
        lines.append(f"using {alias} = {target};")
    for name, v in values.items():
        if isinstance(v, bool):
            lines.append(f"constexpr bool {name} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            lines.append(f"constexpr int {name} = {v};")
        elif isinstance(v, float):
            lines.append(f"constexpr float {name} = {v!r}f;")
        else:
            raise TypeError(f"constant {name} must be an int, bool or float, got {type(v).__name__}")
    lines.append(f"}}  // namespace {namespace}")
    return "\n".join(lines) + "\n"


def program(kernel: str, generated: dict[str, str], prefix: str) -> Program:
    """The program of ``kernels/<kernel>`` with the ``generated`` headers (include name -> text);
    its kernel is named ``<prefix>_<digest of the whole text>`` (macro ``SPLAT_KERNEL_NAME``), so
    two variants loaded in one process never share a name."""
    headers = [(n, t) for n, t in _files() if n.endswith(".cuh")] + sorted(generated.items())
    source = read(kernel)
    h = hashlib.blake2b(digest_size=8)
    for n, t in [*headers, (kernel, source)]:
        h.update(n.encode() + b"\0" + t.encode() + b"\0")
    name = f"{prefix}_{h.hexdigest()}"
    source = f"#define SPLAT_KERNEL_NAME {name}\n{source}"
    prog = Program(name, source, tuple(headers))
    if os.environ.get("SPLAT_DUMP_KERNELS", "") not in ("", "0"):  # as the Triton target does
        print(f"# splat kernel {name}\n{prog.dump()}", file=sys.stderr)
    return prog
