"""Every example answers ``--help`` with what it does, and starts nothing: no Ray, no workers."""

from __future__ import annotations

import json
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


#: A bad value of each kind, per example, and what the refusal names.
_BAD_VALUES = [
    ("grpo.py", ["--servers", "0"], "--servers must be at least 1, got 0"),
    ("grpo.py", ["--group-size", "1"], "--group-size must be at least 2"),
    ("grpo.py", ["--timeline", "/no/such/folder/grpo.png"], "its folder does not exist"),
    ("grpo_vllm.py", ["--staleness", "-1"], "--staleness must be at least 0"),
    ("grpo_vllm.py", ["--timeline", "/no/such/folder/g.json"], "its folder does not exist"),
    ("ppo_cartpole.py", ["--learner-workers", "0"], "--learner-workers must be at least 1"),
    ("ppo_cartpole.py", ["--rollout-workers", "1", "--envs-per-worker", "1"], "fewer environments"),
    ("ppo_cartpole.py", ["--timeline", "/no/such/folder/ppo.png"], "its folder does not exist"),
    ("rl_loop.py", ["--staleness", "0"], "--staleness must be at least 1, got 0"),
    ("rl_loop.py", ["--batch", "0"], "--batch must be at least 1, got 0"),
    ("rollout_servers.py", ["--max-in-flight", "0"], "--max-in-flight must be at least 1"),
    ("rollout_servers.py", ["--servers", "1"], "it needs --servers 2 or more"),
    ("torch_ddp.py", ["--workers", "0"], "--workers must be at least 1, got 0"),
    ("datasets_train.py", ["--rows", "0"], "--rows must be at least 1, got 0"),
    ("service.py", ["--port", "70000"], "--port must be from 0 to 65535"),
    ("service.py", ["--cpus-per-worker", "0"], "--cpus-per-worker must be positive"),
]

#: With matplotlib missing, a ``.png`` timeline is refused too.
_NO_MATPLOTLIB = [
    ("grpo.py", ["--timeline", "grpo.png"], "needs matplotlib"),
    ("grpo_vllm.py", ["--timeline", "g.json", "--timeline", "g.png"], "needs matplotlib"),
    ("ppo_cartpole.py", ["--timeline", "ppo.png"], "needs matplotlib"),
]

_RUN_ALL = """
import json, runpy, sys, ray
if sys.argv[2:] == ["no-matplotlib"]:
    sys.modules["matplotlib"] = None  # as if it were not installed
def refused(*args, **kwargs):
    raise RuntimeError("ray.init was called")
ray.init = refused
for path, argv in json.loads(sys.argv[1]):
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        print(f"== {path} {argv} exit {exit.code}", flush=True)
    except BaseException as exc:
        print(f"== {path} {argv} raised {type(exc).__name__}: {exc}", flush=True)
    else:
        print(f"== {path} {argv} ran to its end", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("matplotlib", [True, False])
def test_examples_refuse_bad_values_before_starting_anything(matplotlib: bool) -> None:
    """Defect: the examples took any number: a count of 0 or a negative staleness started Ray
    (and workers) and then failed with a traceback (``ConfigurationError`` in an exception
    group), or ran on with nan (``rl_loop.py --batch 0``); ``rollout_servers.py --servers 1`` failed
    with an IndexError after 50 answers (it kills server 1); and a ``--timeline`` in a folder that
    does not exist (or a ``.png`` without matplotlib) failed with a traceback only after the
    whole run. Now each is refused by the parser, naming the flag, before Ray starts (exit
    2)."""
    bad = _BAD_VALUES if matplotlib else _NO_MATPLOTLIB
    cases = [(str(ROOT / "examples" / name), argv) for name, argv, _ in bad]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN_ALL,
            json.dumps(cases),
            *([] if matplotlib else ["no-matplotlib"]),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for (path, argv), (_, _, message) in zip(cases, bad, strict=True):
        assert f"== {path} {argv} exit 2" in out, out[-3000:]
        assert message in out, out[-3000:]
