"""The results files the docs name exist: the README's among the current files
(``benchmarks/results/``), the results index's there or, named ``archive/...``, in the archive,
and those of the benchmarks' and spikes' READMEs and of the notebook's summary in either."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# a dated results file name, as the docs write it: globs (*) and brace lists ({a,b}) allowed
_NAME = re.compile(r"`(?:benchmarks/)?(?:results/)?([^`\s<>]*20\d\d-\d\d-\d\d[^`\s<>]*\.(?:json|png))`")


def _expand(name: str) -> list[str]:
    """``a-{x,y}-b`` -> ``a-x-b``, ``a-y-b`` (every brace list, in order)."""
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _named(text: str) -> list[str]:
    return sorted({n for m in _NAME.finditer(text) for n in _expand(m.group(1))})


def _notes_summary() -> str:
    text = (ROOT / "benchmarks" / "NOTES.md").read_text()
    return text[: text.index("\n## Contents")]


def _current(name: str) -> bool:
    """``name`` (``archive/...``: in the archive) matches a file."""
    return bool(list(RESULTS.glob(name)))


def _anywhere(name: str) -> bool:
    return _current(name) or _current(f"archive/{name}")


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/results/INDEX.md"])
def test_the_readme_and_index_cite_current_files(doc):
    """The README's numbers come from current files; the index may name an archived one only as such."""
    names = _named((ROOT / doc).read_text())
    assert names, f"{doc} names no results file"
    if doc == "README.md":
        assert not [n for n in names if n.startswith("archive/")], "the README cites archived results"
    missing = [n for n in names if not _current(n)]
    assert not missing, f"{doc} names results files that are not in benchmarks/results/: {missing}"


@pytest.mark.parametrize("doc", ["benchmarks/README.md", "benchmarks/spikes/README.md", "NOTES summary"])
def test_other_docs_cite_files_that_exist(doc):
    text = _notes_summary() if doc == "NOTES summary" else (ROOT / doc).read_text()
    missing = [n for n in _named(text) if not _anywhere(n)]
    assert not missing, f"{doc} names results files in neither results/ nor results/archive/: {missing}"
