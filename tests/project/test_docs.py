"""The documentation site: every public name is in the API reference, and the site builds with
``mkdocs build --strict`` (any warning fails it: broken links and anchors, docstrings griffe
cannot parse, reference targets it cannot resolve). No Ray is started here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import asyncexec
import asyncexec.testing

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference.md"
#: ``asyncexec.testing``'s reference is on its own page.
TESTING = ROOT / "docs" / "testing.md"

# `::: asyncexec.Executor`, and the lines of an indented options block under one (members lists).
_DIRECTIVE = re.compile(r"^:::\s+(\S+)\s*$")
_MEMBER = re.compile(r"^\s+-\s+([A-Za-z_][A-Za-z0-9_]*)\s*$")


def _referenced() -> tuple[set[str], list[str]]:
    """Names the reference documents: each directive's last component and its listed members;
    and the directives' paths."""
    names: set[str] = set()
    paths: list[str] = []
    in_directive = False
    for line in REFERENCE.read_text().splitlines():
        if match := _DIRECTIVE.match(line):
            paths.append(match.group(1))
            names.add(match.group(1).rsplit(".", 1)[-1])
            in_directive = True
        elif in_directive and line.startswith((" ", "\t")):
            if member := _MEMBER.match(line):
                names.add(member.group(1))
        else:
            in_directive = False
    return names, paths


def test_every_public_name_is_in_the_reference() -> None:
    names, paths = _referenced()
    missing = sorted(set(asyncexec.__all__) - names)
    assert not missing, f"docs/reference.md lacks a ::: directive for {missing}"
    for extra in ("Backend", "TorchBackend"):
        assert f"asyncexec.backends.{extra}" in paths
    # Every directive names a public path, not a private module.
    private = [p for p in paths if any(part.startswith("_") for part in p.split("."))]
    assert not private, private


def test_every_name_of_asyncexec_testing_is_on_its_page() -> None:
    page = TESTING.read_text()
    missing = [n for n in asyncexec.testing.__all__ if f"::: asyncexec.testing.{n}\n" not in page]
    assert not missing, f"docs/testing.md lacks a ::: directive for {missing}"


@pytest.mark.timeout(300)
def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    page = (site / "reference" / "index.html").read_text()
    # Each public name was resolved by griffe and rendered under its public path.
    unresolved = [n for n in asyncexec.__all__ if f'id="asyncexec.{n}"' not in page]
    assert not unresolved, f"not rendered in the reference: {unresolved}"
    assert 'id="asyncexec.backends.TorchBackend"' in page
    testing = (site / "testing" / "index.html").read_text()
    unresolved = [
        n for n in asyncexec.testing.__all__ if f'id="asyncexec.testing.{n}"' not in testing
    ]
    assert not unresolved, f"not rendered on the testing page: {unresolved}"
    # The docstrings' reStructuredText roles were rewritten (the griffe extension in docs/).
    assert ":class:" not in page and ":func:" not in page and ":meth:" not in page
    for name in (
        "index",
        "getting-started",
        "async-apps",
        "rl-loops",
        "services",
        "semantics",
        "benchmarks",
        "testing",
    ):
        where = site / "index.html" if name == "index" else site / name / "index.html"
        assert where.is_file(), where
