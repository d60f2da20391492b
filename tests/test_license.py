"""The declared license ships: LICENSE holds the full Apache-2.0 text, and setuptools puts it in the dists."""

import fnmatch
import hashlib
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# SHA-256 of https://www.apache.org/licenses/LICENSE-2.0.txt, the official text, byte for byte
# (its MD5, 3b83ef96387f14655fc854ddc3c6bd57, is the one license checkers list for Apache-2.0).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
# What setuptools (>= 77, PEP 639) ships when pyproject.toml names no license-files.
SETUPTOOLS_DEFAULT_LICENSE_FILES = ("LICEN[CS]E*", "COPYING*", "NOTICE*", "AUTHORS*")


def test_license_file_is_the_official_apache_2_0_text():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    first, rest = (ROOT / "LICENSE").read_bytes().split(b"\n", 1)
    assert first == b"Copyright 2026 The splat authors"
    assert hashlib.sha256(rest).hexdigest() == APACHE_2_0_SHA256


def test_setuptools_ships_the_license_file():
    requires = " ".join(PYPROJECT["build-system"]["requires"])
    assert re.search(r"setuptools>=(7[7-9]|[89]\d|\d{3,})", requires), requires  # license-files: PEP 639
    patterns = PYPROJECT["project"].get("license-files", SETUPTOOLS_DEFAULT_LICENSE_FILES)
    assert any(fnmatch.fnmatchcase("LICENSE", p) for p in patterns), patterns


def test_readme_install_needs_no_repository_address():
    text = (ROOT / "README.md").read_text()
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "<org>" not in text and "git+https" not in install
    assert "pip install ." in install and 'pip install -e ".[' in install
    assert "`splat-attention` is not published on the package index yet" in " ".join(install.split())
