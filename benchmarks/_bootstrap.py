"""What every benchmark script does before it imports Ray or asyncexec: ``setup()``.

Ray's workers inherit the environment of the Ray that ``ray.init`` starts in the script, so the
environment is set first; the workers import the benchmark's functions and actors by module name
(this folder) and the driver imports the asyncexec its workers import (the tree this folder is
in: a baseline worktree's, when a script runs from one).
"""

from __future__ import annotations

import os
import sys

__all__ = ["HERE", "ROOT", "setup"]

#: This folder (the benchmarks' modules) and the tree it is in (its asyncexec).
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def setup() -> tuple[str, str]:
    """Set the environment Ray's workers inherit (no token authentication, every worker's log
    line, this folder and tree on their ``PYTHONPATH``) and put both first on ``sys.path``.

    Returns:
        ``(HERE, ROOT)``.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (HERE, ROOT, os.environ.get("PYTHONPATH")) if p
    )
    for index, path in enumerate((HERE, ROOT)):
        if path not in sys.path:
            sys.path.insert(index, path)
    return HERE, ROOT
