"""The extras of pyproject.toml and the table of them in docs/getting-started.md agree, and the
``state`` extra gives Ray's state API (``ray list actors``, ``ray.util.state``)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras: dict[str, list[str]] = tomllib.load(f)["project"]["optional-dependencies"]
    return extras


def test_state_extra_installs_ray_default_at_the_ray_version_asyncexec_needs() -> None:
    """Defect: ``ray list actors`` and ``ray.util.state`` need ``ray[default]``, which no extra
    installed."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    [ray] = [d for d in dependencies if d.startswith("ray")]
    assert _extras()["state"] == [ray.replace("ray", "ray[default]", 1)]


def test_every_extra_has_a_row_in_the_getting_started_table() -> None:
    text = (ROOT / "docs" / "getting-started.md").read_text()
    rows = set(re.findall(r"^\| `([a-z-]+)` \|", text, re.MULTILINE))
    assert rows == set(_extras())
