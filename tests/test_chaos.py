"""A short, fixed-seed subset of the chaos runner (``benchmarks.chaos``) against the shared local
Ray: one scenario of every fast kind (kills at steps, in start-up, in a restart's start-up and wait,
in shutdown, between runs, beside another executor; hangs; cancellation; user errors; exhausted
restarts), each checked by the runner's invariants. Before them, the invariants themselves are
shown to catch broken streams, so a green run means something."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import asyncexec
from benchmarks import chaos

SEED = 20261130


# The invariants, on streams made by hand (no Ray) ---------------------------------------------


def _stream(
    plan: list[tuple[int, list[int]]], *, workers: int = 2, every: int = 3
) -> list[asyncexec.Step]:
    """Steps as asyncexec delivers them: ``plan`` lists (attempt, function steps) in order."""
    steps: list[asyncexec.Step] = []
    for attempt, values in plan:
        for value in values:
            reports = [
                asyncexec.Report(
                    rank,
                    {
                        "step": value,
                        "total": chaos.expected_total(rank, value),
                        "attempt": attempt,
                    },
                )
                for rank in range(workers)
            ]
            checkpoint = asyncexec.Checkpoint(f"/ckpt/{value}") if value % every == 0 else None
            steps.append(asyncexec.Step(len(steps), attempt, reports, checkpoint))
    return steps


def test_invariants_accept_a_restart_that_resumes_after_the_latest_checkpoint() -> None:
    # Attempt 1 delivered 0..7 (checkpoints at 0, 3, 6); attempt 2 resumes at 7, goes to the end.
    steps = _stream([(1, list(range(8))), (2, list(range(7, 12)))])
    assert chaos.check_stream(steps, workers=2, every=3) == []
    assert chaos.check_complete(steps, [66, 132], workers=2, total=12) == []


def _broken(kind: str) -> list[asyncexec.Step]:
    good = [(1, list(range(8))), (2, list(range(7, 12)))]
    if kind == "consecutive":  # a step lost inside an attempt
        return _stream([(1, [0, 1, 2, 4, 5]), (2, list(range(4, 12)))])
    if kind == "duplicate":  # a step delivered twice inside an attempt
        return _stream([(1, [0, 1, 2, 2, 3]), (2, list(range(4, 12)))])
    if kind == "resume":  # the restart did not resume after the latest checkpoint (6)
        return _stream([(1, list(range(8))), (2, list(range(4, 12)))])
    if kind == "step_index":
        steps = _stream(good)
        steps[3].index = 9
        return steps
    if kind == "state":
        steps = _stream(good)
        steps[9].reports[1].metrics = {"step": 8, "total": 1, "attempt": 2}
        return steps
    if kind == "checkpoint":
        steps = _stream(good)
        steps[1].checkpoint = asyncexec.Checkpoint("/ckpt/extra")
        return steps
    if kind == "attempt_number":
        steps = _stream(good)
        steps[8].attempt = 1
        return steps
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "invariant"),
    [
        ("consecutive", "consecutive"),
        ("duplicate", "consecutive"),
        ("resume", "resume"),
        ("step_index", "step_index"),
        ("state", "state"),
        ("checkpoint", "checkpoint"),
        ("attempt_number", "attempt_number"),
    ],
)
def test_invariants_catch_a_broken_stream(kind: str, invariant: str) -> None:
    problems = chaos.check_stream(_broken(kind), workers=2, every=3)
    assert invariant in {name for name, _ in problems}, problems


def test_invariants_catch_a_lost_step_and_a_wrong_final_state() -> None:
    # Attempt 2 resumes correctly, but the run stops short of the end.
    steps = _stream([(1, list(range(5))), (2, list(range(4, 9)))])
    problems = chaos.check_complete(steps, [45, 90], workers=2, total=12)
    assert {name for name, _ in problems} == {"no_step_lost", "final_state"}


def test_scenarios_are_drawn_reproducibly_and_cover_every_kind() -> None:
    drawn = chaos.draw_scenarios(7, 2 * len(chaos.KINDS))
    assert drawn == chaos.draw_scenarios(7, 2 * len(chaos.KINDS))
    assert drawn != chaos.draw_scenarios(8, 2 * len(chaos.KINDS))
    assert {s.kind for s in drawn} == set(chaos.KINDS)
    # A scenario is a function of the seed, its number and its kind alone (``--only`` replays it).
    assert drawn[5] == chaos.draw_one(7, 5, drawn[5].kind)
    for s in drawn:
        assert 0 <= s.rank < s.workers and 0 <= s.rank2 < s.workers
        assert s.rank2 != s.rank
        assert s.at <= s.steps - 5
    with pytest.raises(ValueError, match="unknown"):
        chaos.draw_scenarios(1, 3, ["kill_everything"])


def test_the_table_counts_failures_by_invariant() -> None:
    ok = chaos.Outcome(chaos.draw_one(1, 0, "kill_step"), recovery_s=[0.5])
    bad = chaos.Outcome(chaos.draw_one(1, 1, "cancel"))
    bad.fail("nothing_left", "1 worker actor(s) ['ALIVE']")
    table = chaos.render_table([ok, bad], seed=1, seconds=3.0)
    assert "seed 1, 2 scenarios" in table
    assert "nothing_left" in table and "scenarios [1]" in table
    assert "#1 cancel seed=1" in table
    total = next(line for line in table.splitlines() if line.startswith("total"))
    assert total.split()[:4] == ["total", "2", "1", "1"]


# The fixed-seed subset against the shared local Ray ------------------------------------------


def _scenario(kind: str, **overrides: object) -> chaos.Scenario:
    number = list(chaos.KINDS).index(kind)
    return dataclasses.replace(chaos.draw_one(SEED, number, kind), **overrides)  # type: ignore[arg-type]


def _assert_passed(outcome: chaos.Outcome) -> None:
    assert outcome.passed, "\n".join(
        [outcome.scenario.describe(), *(f"{i}: {d}" for i, d in outcome.problems)]
    )


_SUBSET = [k for k in chaos.FAST_KINDS if k != "kill_idle"]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("kind", _SUBSET)
async def test_chaos_scenario_keeps_every_promise(kind: str, tmp_path: Path) -> None:
    outcome = await chaos.run_scenario(_scenario(kind, slow=False), chaos.Env(tmp_path))
    _assert_passed(outcome)
    if kind != "cancel":  # a cancel may land in start-up, before any step
        assert outcome.steps > 0


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("kind", ["cancel", "kill_shutdown", "hang_step"])
async def test_chaos_scenario_with_a_slow_consumer_keeps_every_promise(
    kind: str, tmp_path: Path
) -> None:
    outcome = await chaos.run_scenario(_scenario(kind, slow=True), chaos.Env(tmp_path))
    _assert_passed(outcome)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("kind", ["kill_step", "exhaust"])
async def test_chaos_failure_with_a_slow_consumer_loses_no_step(kind: str, tmp_path: Path) -> None:
    outcome = await chaos.run_scenario(_scenario(kind, slow=True), chaos.Env(tmp_path))
    _assert_passed(outcome)


@pytest.mark.usefixtures("ray_local")
async def test_chaos_kill_between_runs_then_run_restarts_and_finishes(tmp_path: Path) -> None:
    scenario = _scenario("kill_idle", flag=False, slow=False)
    outcome = await chaos.run_scenario(scenario, chaos.Env(tmp_path))
    _assert_passed(outcome)


@pytest.mark.usefixtures("ray_local")
async def test_chaos_kill_between_runs_then_execute_works_on_a_fresh_group(
    tmp_path: Path,
) -> None:
    scenario = _scenario("kill_idle", flag=True, slow=False)
    outcome = await chaos.run_scenario(scenario, chaos.Env(tmp_path))
    _assert_passed(outcome)
