"""One import direction: ``splat -> jax_bindings -> acsr``, and acsr on numpy alone.

Every module of the three packages is parsed (``ast``, imports inside functions
included) and its imports are checked against the direction; the Triton backend
is not loaded by ``import splat`` (nor by an attention call) on CPU, and every
module imports where it should.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("acsr", "jax_bindings", "splat")
# What each package may import from this project (itself included). Tooling folders are never imported.
ALLOWED = {
    "acsr": {"acsr"},
    "jax_bindings": {"jax_bindings", "acsr"},
    "splat": {"splat", "jax_bindings", "acsr"},
}
PROJECT = {*PACKAGES, "benchmarks", "examples", "tests"}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append((".".join(parts), path))
    return out


def _imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Fully qualified names ``source`` (the text of ``module``) imports, at any depth."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module
            names.add(stem)
            names.update(f"{stem}.{a.name}" for a in node.names)  # `from pkg import module`
    return names


def test_the_import_parser_sees_every_form():
    src = (
        "import numpy as np\n"
        "from splat import masks\n"
        "def f():\n"
        "    import jax_bindings._pure\n"
        "    from . import sibling\n"
        "    from ..up import thing\n"
    )
    got = _imports(src, "acsr.sub.mod")
    assert {"numpy", "splat", "splat.masks", "jax_bindings._pure", "acsr.sub.sibling", "acsr.up"} <= got
    assert "jax_bindings._triton" in _imports("from . import _triton\n", "jax_bindings", is_package=True)


def test_every_package_module_is_found():
    mods = dict(_modules())
    want = {"acsr._plan", "jax_bindings._triton.spec", "jax_bindings._triton.backend", "splat._analyzer"}
    assert want <= set(mods)
    assert not (ROOT / "splat" / "_codegen").exists(), "the generator lives in jax_bindings/_triton"


@pytest.mark.parametrize("module, path", _modules(), ids=lambda x: x if isinstance(x, str) else "")
def test_imports_run_one_way(module, path):
    top = module.split(".")[0]
    names = _imports(path.read_text(), module, path.name == "__init__.py")
    project = {n.split(".")[0] for n in names} & PROJECT
    assert project <= ALLOWED[top], f"{module} imports {sorted(project - ALLOWED[top])} against the direction"
    if top == "acsr":  # numpy and the standard library only
        third = {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"acsr", "numpy"}
        assert not third, f"{module} imports {sorted(third)}; acsr depends on numpy only"


def test_import_splat_does_not_load_the_triton_backend_on_cpu():
    script = (
        "import json, sys\n"
        "import splat\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('jax_bindings._triton'))\n"
        "import jax.numpy as jnp\n"
        "x = jnp.ones((1, 32, 2, 16))\n"
        "splat.attention(x, x, x, mask=splat.masks.sliding_window(4))\n"
        "after = sorted(m for m in sys.modules if m.startswith('jax_bindings._triton'))\n"
        "print(json.dumps([loaded, after, 'triton' in sys.modules]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr
    loaded, after, triton = json.loads(p.stdout.splitlines()[-1])
    assert loaded == [] and after == [], (loaded, after)
    assert not triton, "import splat (and a CPU attention call) must not import triton"


@pytest.mark.parametrize("module", [m for m, _ in _modules()])
def test_every_module_imports_where_it_should(module):
    needs = {"jax_bindings._triton.backend": "triton", "jax_bindings._cuda.backend": "cuda backend"}
    if module in needs:
        jax = pytest.importorskip("jax")
        if jax.default_backend() != "gpu":
            with pytest.raises(ImportError, match=needs[module]):
                importlib.import_module(module)
            return
    importlib.import_module(module)
