"""The distribution: its name is not the index's unrelated ``splat``, and every reference to it agrees."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DIST = "splat-attention"


def test_distribution_name_is_not_the_taken_one():
    # "splat" on the package index is an unrelated astronomy package: `pip install splat` gets that
    assert PYPROJECT["project"]["name"] == DIST


def test_extras_that_name_the_project_name_this_distribution():
    """A stale ``splat[...]`` here would make pip fetch the unrelated package from the index."""
    project = PYPROJECT["project"]["name"]
    for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items():
        for req in reqs:
            name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
            if name.lower().replace("_", "-").startswith("splat"):
                assert name == project, f"extra {extra!r} requires {req!r}, not {project}[...]"


def test_import_packages_keep_their_names():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {"splat", "acsr", "jax_bindings"} <= set(include)


def test_readme_installs_this_distribution():
    """Every install line takes this clone (``.``, ``".[extra]"``) or names this distribution."""
    text = (ROOT / "README.md").read_text()
    lines = [ln for ln in text.splitlines() if ln.lstrip().startswith("pip install")]
    from_clone = re.compile(r"pip install (-e )?(\.|\"\.\[[a-z0-9,]+\]\")(\s|$)")
    assert lines and all(from_clone.match(ln.lstrip()) or f'"{DIST}' in ln for ln in lines), lines
    assert not re.search(r"pip install [\"']?splat[\[\" ]", text)
