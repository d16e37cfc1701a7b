"""Every example answers ``--help`` with what it does, and starts nothing: no Ray, no workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

#: Runs each example as ``__main__`` with ``--help``, in one process (the imports are paid once),
#: with ``ray.init`` replaced by a failure: an example that starts Ray on ``--help`` says so.
_HELP_ALL = """
import runpy, sys, ray
def refused(*args, **kwargs):
    raise RuntimeError("ray.init was called")
ray.init = refused
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        print(f"== {path} exit {exit.code}", flush=True)
    else:
        print(f"== {path} ran to its end", flush=True)
"""


@pytest.mark.timeout(120)
def test_every_example_answers_help_without_starting_anything() -> None:
    """Defect: ``python examples/quickstart.py --help`` (and worker_classes.py) took no
    arguments: it started Ray and ran the whole example."""
    assert len(EXAMPLES) >= 10
    done = subprocess.run(
        [sys.executable, "-c", _HELP_ALL, *map(str, EXAMPLES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for path in EXAMPLES:
        assert f"== {path} exit 0" in out, out[-3000:]
    assert out.count("usage: ") == len(EXAMPLES), out[-3000:]
