"""examples/rl_loop.py in a short configuration: the learner improves the policy with weights
pushed to live workers, staleness stays within the report buffer's bound, and the event loop
stays free for another coroutine."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import import_example, reset_logging

pytestmark = pytest.mark.usefixtures("ray_local")


async def test_learner_improves_the_policy_within_the_staleness_bound(tmp_path: Path) -> None:
    rl_loop = import_example("rl_loop")
    summary = await rl_loop.main(workers=2, steps=60, staleness=1, storage_path=tmp_path)
    assert summary.steps == 60
    assert summary.learner_version == 60
    assert summary.violations == 0
    assert summary.max_staleness <= 1
    # The live workers acted with pushed weights, not only the initial ones.
    assert all(v >= 60 - 1 - 1 for v in summary.worker_versions)
    assert summary.initial_expected_reward < -1.8
    assert summary.final_expected_reward > summary.initial_expected_reward + 1.0
    assert summary.last_batch_reward > summary.first_batch_reward
    # The other coroutine ran the whole time and its lag was measured.
    assert summary.ticks > 0
    assert 0.0 <= summary.lag_p50_ms <= summary.lag_p99_ms <= summary.lag_max_ms


async def test_workers_run_ahead_only_as_far_as_the_bound_allows(tmp_path: Path) -> None:
    """With a looser bound the (fast) workers do run ahead of the learner, up to the bound and no
    further: the bound, not the timing, is what holds staleness down."""
    rl_loop = import_example("rl_loop")
    summary = await rl_loop.main(workers=2, steps=40, staleness=4, storage_path=tmp_path)
    assert summary.violations == 0
    assert 1 < summary.max_staleness <= 4


def test_command_line_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rl_loop = import_example("rl_loop")
    try:
        rc = rl_loop.cli(["--steps", "20", "--quiet", "--storage-path", str(tmp_path)])
    finally:
        reset_logging()  # cli() configured logging for the process
    out = capsys.readouterr().out
    assert rc == 0
    assert "20 steps on 2 workers" in out
    assert "loop lag p50" in out
    assert "0 steps over the bound" in out
