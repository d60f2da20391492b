"""The CUDA kernels kept as source files: ``kernels/`` (package data), composed by ``#include``.

A kernel is one ``.cu`` file under ``kernels/`` that includes its parts (``.cuh``, by their path
under ``kernels/``) and one generated header of constants, the variant's specialisation (tile
sizes, the mask's form, flags): everything else is plain CUDA C++ a CUDA editor reads. NVRTC
gets no include path, so :func:`program` hands every part to the compiler by name, with the
generated header among them.

``kernels/common/``: parts any kernel may use: types and conversions, cp.async, mbarriers and
named barriers, TMA and bulk copies, wgmma and its shared-memory layout, work tickets and
sections, the band; warp-level tensor-core tiles (``mma_sm80.cuh``).
``kernels/fwd/``: the attention forward (``fwd.cu``) by concern: tile scheduler, work tiles and
their walks, band/runtime and grid masks, producer, consumer main loop, online softmax, epilogue.
``kernels/bwd/``: the attention backward (``bwd.cu``) likewise.
``kernels/decode/``: the decode kernel and its parts (the key walk over an ACSR row, the
contiguous and paged KV addressing).

:meth:`Program.flat` gives a program as one self-contained text (its includes resolved), for
callers that edit or compile a kernel as a single source.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
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

    def flat(self) -> str:
        """The program as one text that compiles alone: each ``#include "name"`` of a header the
        program holds replaced by that header's text, once (every part is ``#pragma once``)."""
        headers, done = self.header_map(), set()

        def expand(text: str) -> list[str]:
            out = []
            for line in text.splitlines():
                m = _INCLUDE.match(line)
                if m and m.group(1) in headers:
                    if m.group(1) not in done:
                        done.add(m.group(1))
                        out += expand(headers[m.group(1)])
                elif line.strip() != "#pragma once":
                    out.append(line)
            return out

        return "\n".join(expand(self.source)) + "\n"


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


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
    namespace: str,
    values: dict[str, object],
    *,
    types: dict[str, str] | None = None,
    includes: tuple[str, ...] = (),
    macros: dict[str, str] | None = None,
    after: str = "",
) -> str:
    """A generated header: ``constexpr`` constants (ints, as ``long long`` beyond 32 bits; bools;
    floats) and type aliases (``types``: alias -> type) in ``namespace``, after the parts it
    ``includes``; then ``macros`` (name -> replacement, for what a constant cannot be, such as a
    kernel's parameters) and the text ``after`` (generated code, which may use the constants)."""
    lines = ["// generated: one variant's constants", "#pragma once"]
    lines += [f'#include "{name}"' for name in includes]
    lines.append(f"namespace {namespace} {{")
    for alias, target in (types or {}).items():
        lines.append(f"using {alias} = {target};")
    for name, v in values.items():
        if isinstance(v, bool):
            lines.append(f"constexpr bool {name} = {'true' if v else 'false'};")
        elif isinstance(v, int) and -(2**31) <= v < 2**31:
            lines.append(f"constexpr int {name} = {v};")
        elif isinstance(v, int):
            lines.append(f"constexpr long long {name} = {v}LL;")
        elif isinstance(v, float):
            lines.append(f"constexpr float {name} = {v!r}f;")
        else:
            raise TypeError(f"constant {name} must be an int, bool or float, got {type(v).__name__}")
    lines.append(f"}}  // namespace {namespace}")
    lines += [f"#define {name} {text}" for name, text in (macros or {}).items()]
    return "\n".join(lines) + "\n" + after


def _included(source: str, available: dict[str, str]) -> set[str]:
    """The headers among ``available`` that ``source`` includes, directly or through others."""
    found, todo = set(), [source]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop(), re.M):
            if name in available and name not in found:
                found.add(name)
                todo.append(available[name])
    return found


def program(kernel: str, generated: dict[str, str], prefix: str) -> Program:
    """The program of ``kernels/<kernel>`` with the ``generated`` headers (include name -> text) and
    the parts it includes; its kernel is named ``<prefix>_<digest of the whole text>`` (macro
    ``SPLAT_KERNEL_NAME``), so that two variants loaded in one process never share a name."""
    source = read(kernel)
    available = {n: t for n, t in _files() if n.endswith(".cuh")} | dict(generated)
    used = _included(source, available)
    headers = [(n, t) for n, t in _files() if n in used] + sorted(generated.items())
    h = hashlib.blake2b(digest_size=8)
    for n, t in [*headers, (kernel, source)]:
        h.update(n.encode() + b"\0" + t.encode() + b"\0")
    name = f"{prefix}_{h.hexdigest()}"
    source = f"#define SPLAT_KERNEL_NAME {name}\n{source}"
    prog = Program(name, source, tuple(headers))
    if os.environ.get("SPLAT_DUMP_KERNELS", "") not in ("", "0"):  # as the Triton target does
        print(f"# splat kernel {name}\n{prog.dump()}", file=sys.stderr)
    return prog
