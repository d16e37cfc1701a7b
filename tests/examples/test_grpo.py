"""examples/grpo.py: fully async GRPO over asyncexec's Pipeline. The algorithm learns the toy
task in one process with stale weights; the workload's lengths are long-tailed; and the example,
run as a user runs it (a process of its own, small settings), reaches its reward threshold
through a SIGKILLed server and a SIGKILLed learner rank, with every sample consumed and trained
on exactly once and none beyond the staleness bound."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
from conftest import import_example

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_requests_are_long_tailed() -> None:
    grpo = import_example("grpo")
    tasks = grpo.make_tasks(grpo.GRPOConfig())
    lengths = [next(tasks).length for _ in range(4000)]
    assert np.percentile(lengths, 99) / np.percentile(lengths, 50) >= 10


def test_a_completion_is_rewarded_for_each_token_that_repeats_the_first_digit() -> None:
    grpo = import_example("grpo")
    tokens = np.array([[3, 3, 3, 3], [3, 1, 3, 0], [0, 0, 0, 0]])
    assert grpo.reward((3, 1, 4, 1), tokens).tolist() == [1.0, 0.5, 0.0]


@pytest.mark.timeout(60)
def test_the_algorithm_learns_in_one_process_with_stale_weights() -> None:
    grpo = import_example("grpo")
    rewards = grpo.train_local(updates=70, lag=1)
    assert np.mean(rewards[:3]) < 0.2  # a random policy scores 0.1
    assert np.mean(rewards[-3:]) >= 0.9


@pytest.mark.timeout(30)
async def test_a_checkpoint_dir_that_does_not_exist_yet_is_made_before_the_groups_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: ``grpo.py --checkpoint-dir new_folder`` started Ray and both groups, then failed
    at the first update with a FileNotFoundError from the learner's save (the folder was never
    made). Now the folder is made before anything starts."""
    grpo = import_example("grpo")

    class Started(Exception):
        pass

    def executor(*args: object, **kwargs: object) -> None:
        raise Started

    monkeypatch.setattr(grpo.asyncexec, "Executor", executor)
    folder = tmp_path / "runs" / "grpo"
    with pytest.raises(Started):
        await grpo.main(checkpoint_dir=str(folder))
    assert folder.is_dir()


def _stop_ray_of_this_process() -> None:
    """The example starts a Ray of its own: the one this pytest process may hold must be down."""
    shutdown = getattr(sys.modules.get("conftest"), "_shutdown", None)
    if callable(shutdown):
        shutdown()  # also tells ray_local to start a fresh Ray for the next test
    if ray.is_initialized():
        ray.shutdown()


def _run_example(*args: str, timeout_s: float = 110) -> subprocess.CompletedProcess[str]:
    """``python examples/grpo.py --quiet *args`` in a Ray of its own."""
    _stop_ray_of_this_process()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo.py"), "--quiet", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.timeout(120)
def test_the_example_reaches_its_threshold_through_a_killed_server_and_learner() -> None:
    proc = _run_example("--kill-server-at", "4", "--kill-learner-at", "8", "--max-updates", "150")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    assert "reached 0.9" in out, out
    assert "each exactly once" in out, out
    consumed = re.search(r"consumed (\d+) samples, trained (\d+)", out)
    assert consumed is not None and consumed[1] == consumed[2], out
    staleness = re.search(r"staleness max (\d+)", out)
    assert staleness is not None and int(staleness[1]) <= 1, out
    assert "learner restarts: 1, resumed from updates [8]" in out, out


@pytest.mark.timeout(200)
def test_the_docs_picture_and_a_driver_started_again_from_the_learners_checkpoint(
    tmp_path: Path,
) -> None:
    """docs/pipeline.md's picture of a run comes from ``--max-updates 12 --timeline
    grpo.png``: the command still writes it (a PNG, under the docs' ~200 KB), says where, and
    stops short of the threshold (exit 1, the summary printed, no traceback). Given a checkpoint
    directory too (one run of the example serves both checks: each costs a Ray's start and the
    groups'), a second driver goes on from update 12 with the pipeline's consumed ids and
    reaches the threshold."""
    picture = tmp_path / "grpo.png"
    checkpoints = tmp_path / "checkpoints"
    first = _run_example(
        "--max-updates", "12", "--timeline", str(picture), "--checkpoint-dir", str(checkpoints)
    )
    out = first.stdout
    assert "Traceback" not in first.stderr and "12 updates in" in out, first.stderr[-4000:]
    assert first.returncode == 1 and "did NOT reach" in out, out + first.stderr[-4000:]
    assert f"wrote the timeline to {picture}" in out, out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size < 200_000
    docs = (ROOT / "docs" / "pipeline.md").read_text()
    assert "python examples/grpo.py --max-updates 12 --timeline grpo.png" in docs

    second = _run_example("--checkpoint-dir", str(checkpoints), "--max-updates", "150")
    out = second.stdout
    assert second.returncode == 0, out + second.stderr[-4000:]
    assert "started from update 12" in out and "each exactly once" in out, out
