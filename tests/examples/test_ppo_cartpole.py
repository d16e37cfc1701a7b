"""examples/ppo_cartpole.py in a short configuration: PPO on CartPole-v1 with a rollout group
(``Rollout`` instances, a run of ``Rollout.collect``) and a DDP learner group (``Learner``
instances, ``call(Learner.update, scatter(batch))``) on one reservation, weights over a
WeightChannel. The return rises, no batch is older than the staleness bound, and the run goes on
through a killed rollout worker and a killed learner rank (which resumes from its checkpoint).
The algorithm alone is checked without Ray first."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import import_example, reset_logging

pytest.importorskip("torch")
pytest.importorskip("gymnasium")


def test_gae_matches_a_direct_sum() -> None:
    ppo = import_example("ppo_cartpole")
    rng = np.random.default_rng(0)
    t_, n_, gamma, lam = 6, 3, 0.9, 0.8
    values = rng.standard_normal((t_, n_)).astype(np.float32)
    last = rng.standard_normal(n_).astype(np.float32)
    rewards = rng.standard_normal((t_, n_)).astype(np.float32)
    dones = np.zeros((t_, n_), np.float32)
    dones[2, 0] = dones[5, 1] = 1.0
    adv = ppo.gae(values, last, rewards, dones, gamma, lam)
    for i in range(n_):
        for t in range(t_):
            total, discount = 0.0, 1.0
            for k in range(t, t_):
                alive = 1.0 - dones[k, i]
                nxt = values[k + 1, i] if k + 1 < t_ else last[i]
                total += discount * (rewards[k, i] + gamma * nxt * alive - values[k, i])
                if not alive:
                    break
                discount *= gamma * lam
            assert adv[t, i] == pytest.approx(total, rel=1e-4, abs=1e-4)


@pytest.mark.timeout(60)
def test_the_algorithm_learns_in_one_process_with_stale_actors() -> None:
    ppo = import_example("ppo_cartpole")
    updates, returns = ppo.train_local(max_updates=15, lag=2)
    assert updates == 15
    assert len(returns) >= 100
    first, last = float(np.mean(returns[:100])), float(np.mean(returns[-100:]))
    assert first < 40  # a random policy lasts about 22 steps
    assert last > first + 30


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(240)
async def test_the_return_rises_within_the_bound_through_killed_workers(tmp_path: Path) -> None:
    ppo = import_example("ppo_cartpole")
    seen: list[tuple[int, float]] = []
    try:
        summary = await ppo.main(
            max_updates=25,
            staleness=2,
            kill_rollout_at=6,
            kill_learner_at=12,
            checkpoint_every=5,
            storage_path=tmp_path,
            on_update=lambda update, average: seen.append((update, average)),
        )
    finally:
        gc.unfreeze()  # main() froze the heap, as a program does: not the test session's
    assert summary.updates == 25
    assert [u for u, _ in seen] == list(range(1, 26))
    # Clearly better than where it started (a random policy averages about 22).
    assert summary.initial_average_return < 40
    assert summary.final_average_return > summary.initial_average_return + 40
    # The staleness bound held, by the version each batch was made with and by Report.version.
    assert summary.max_lag <= 2
    assert summary.max_report_lag <= summary.max_lag
    assert summary.dropped == 0
    # Both groups restarted once; the learner resumed from its checkpoint of update 10.
    assert summary.restarts == {"rollout": 1, "learner": 1}
    assert summary.learner_resumed_from == [10]
    assert set(summary.back_after_s) == {"rollout", "learner"}
    assert summary.pushes >= 25
    # The driver's loop stayed free: the probe ran all along.
    p50, p99, worst = summary.loop_lag_ms
    assert 0.0 <= p50 <= p99 <= worst


@pytest.mark.timeout(30)
async def test_a_storage_path_that_does_not_exist_yet_is_made_before_the_groups_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: ``ppo_cartpole.py --storage-path new_folder`` started Ray, then failed with a
    FileNotFoundError traceback (the learner's checkpoint folder is made inside it, which was
    never made). Now the folder is made, as the executors make their storage path."""
    ppo = import_example("ppo_cartpole")

    class Started(Exception):
        pass

    def reservation(*args: object, **kwargs: object) -> None:
        raise Started

    monkeypatch.setattr(ppo.asyncexec, "Reservation", reservation)
    folder = tmp_path / "runs" / "ppo"
    with pytest.raises(Started):
        await ppo.main(storage_path=folder)
    assert folder.is_dir()


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(150)
def test_command_line_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ppo = import_example("ppo_cartpole")
    gc.unfreeze()
    try:
        timeline = ["--timeline", str(tmp_path / "ppo.json")]
        rc = ppo.cli(
            [
                "--max-updates",
                "8",
                "--no-stop",
                "--quiet",
                "--storage-path",
                str(tmp_path),
                *timeline,
            ]
        )
        frozen = gc.get_freeze_count()  # main() froze the heap once both groups were up
    finally:
        gc.unfreeze()
        reset_logging()  # cli() configured logging for the process
    assert frozen > 0
    out = capsys.readouterr().out
    assert "8 updates" in out
    assert "0 steps dropped" in out
    assert "loop lag p50" in out
    assert rc == 0  # the return rose (--no-stop) and no batch was over the bound
    # --timeline: the rollout group's steps and the learner's calls, each group's file.
    for name, kind in (("ppo.json", "step"), ("ppo-learner.json", "call")):
        events = json.loads((tmp_path / name).read_text())["traceEvents"]
        ranks = {e["tid"] - 1 for e in events if e.get("cat") == kind}
        assert ranks == {0, 1}, name
