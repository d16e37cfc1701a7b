"""A short, fixed-seed subset of the chaos runner (``benchmarks.chaos``) against the shared local
Ray: one scenario of every fast kind (kills at steps, in start-up, in a restart's start-up and wait,
in shutdown, between runs, beside another executor; hangs; cancellation; user errors; exhausted
restarts), and of every group kind (pools, spares, reservations, weight channels, independent
ranks, a named run's driver killed; an elastic group losing a node, on a Cluster of its own) with
its fault and cancelled at drawn moments, each checked by the runner's invariants. Before them,
the invariants themselves are shown to catch broken streams and records, so a green run means
something."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import asyncexec
from benchmarks import chaos
from benchmarks.chaos.groups import SLOT

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


# The group kinds' invariants, on records made by hand (no Ray) --------------------------------


def _unaligned(plan: list[tuple[int, int, list[int]]], *, every: int = 3) -> list[asyncexec.Step]:
    """An independent run's steps: ``plan`` lists (rank, attempt, function steps) chunks in
    arrival order; each step is one report of its rank."""
    steps: list[asyncexec.Step] = []
    for rank, attempt, values in plan:
        for value in values:
            metrics = {
                "step": value,
                "total": chaos.expected_total(rank, value),
                "attempt": attempt,
            }
            checkpoint = (
                asyncexec.Checkpoint(f"/ckpt/{rank}/{value}") if value % every == 0 else None
            )
            report = asyncexec.Report(rank, metrics, checkpoint)
            steps.append(asyncexec.Step(len(steps), attempt, [report], checkpoint, rank))
    return steps


def _sized(plan: list[tuple[int, int, list[int]]], *, every: int = 2) -> list[asyncexec.Step]:
    """An elastic run's steps: ``plan`` lists (attempt, world size, function steps)."""
    steps: list[asyncexec.Step] = []
    for attempt, world, values in plan:
        for value in values:
            metrics = {
                "step": value,
                "total": value * (value + 1) // 2,
                "attempt": attempt,
                "world": world,
            }
            reports = [asyncexec.Report(rank, dict(metrics)) for rank in range(world)]
            checkpoint = asyncexec.Checkpoint(f"/ckpt/{value}") if value % every == 0 else None
            steps.append(asyncexec.Step(len(steps), attempt, reports, checkpoint))
    return steps


def _target(rows: list[tuple[int, dict[str, Any], int | None]]) -> list[asyncexec.Step]:
    """A weight channel target's steps, one rank: (step, what the function saw, Report.version);
    the report's time is its step number, in seconds."""
    steps: list[asyncexec.Step] = []
    for value, seen, version in rows:
        metrics = {
            "step": value,
            "attempt": 1,
            "held": version,
            "after_prev": version,
            "tag_version": version,
            "tag": version,
            "source_pid": 100,
            "t": float(value),
            **seen,
        }
        report = asyncexec.Report(0, metrics, None, version)
        steps.append(asyncexec.Step(len(steps), 1, [report]))
    return steps


_PUSHES = [chaos.Push(1, 100, 1, 1.5), chaos.Push(2, 100, 2, 3.5)]
_CHANNEL_OK = _target([(0, {}, None), (1, {}, None), (2, {}, 1), (3, {}, 1), (4, {}, 2)])
_INSTALLED = {7: [(1, 1, 100, True), (2, 2, 100, True)]}
#: A first driver's steps 0..11 (checkpoints at indices 2, 5, 8: every 3), SIGKILLed there.
_FIRST = [(i, i, 1) for i in range(12)]


def test_group_invariants_accept_what_the_semantics_allow() -> None:
    # Rank 1 replaced after its step 4: its attempt 2 resumes right after its checkpoint (3).
    steps = _unaligned(
        [(0, 1, [0, 1, 2]), (1, 1, [0, 1, 2, 3, 4]), (0, 1, [3, 4, 5]), (1, 2, [4, 5])]
    )
    assert chaos.check_independent(steps, workers=2, every=3) == []
    assert (
        chaos.independent_complete(steps, [15, 30], workers=2, total=6, replaced=frozenset({1}))
        == []
    )
    # Elastic: 4 workers, 2 after the loss (from checkpoint 4), 4 again (from checkpoint 6).
    sized = _sized([(1, 4, [0, 1, 2, 3, 4, 5]), (2, 2, [5, 6, 7]), (3, 4, [7, 8, 9])])
    assert chaos.check_sized(sized, every=2, least=2, most=4) == []
    assert chaos.check_resizes(sized, most=4) == []
    assert chaos.sized_complete(sized, [45] * 4, total=10) == []
    assert chaos.check_channel(_CHANNEL_OK, _PUSHES, _INSTALLED) == []
    # A replaced rank of an unaligned stream counts from 0 again (no checkpoints).
    ticks = _unaligned([(0, 1, [0, 1]), (1, 1, [0]), (1, 2, [0, 1]), (0, 1, [2])])
    assert chaos.check_ticks(ticks, workers=2, unaligned=True) == []
    second = [(9, 9, 2), (10, 10, 2), (11, 11, 2), (12, 12, 2), (13, 13, 2)]
    assert (
        chaos.check_resumed(_FIRST, second, checkpoint_index=8, recorded_attempt=1, total=14) == []
    )
    assert chaos.check_pool(3, 3, 0, [11, 12, 13], [9]) == []


def _bad_channel(kind: str) -> list[tuple[str, str]]:
    steps, pushes, installed = list(_CHANNEL_OK), list(_PUSHES), dict(_INSTALLED)
    if kind == "raised":
        pushes.append(chaos.Push(3, 100, None, 5.0, "TimeoutError"))
    elif kind == "versions":
        pushes = [pushes[1], pushes[0]]
    elif kind == "version_low":  # Report.version older than what the function saw before
        steps = _target([(0, {}, None), (2, {"held": 1}, None)])
    elif kind == "version_high":  # newer than what the function saw after report() returned
        steps = _target([(2, {}, 2), (3, {"after_prev": 1}, 2)])
    elif kind == "backwards":
        steps = _target([(2, {}, 1), (3, {"held": None, "after_prev": None}, None)])
    elif kind == "not_delivered":  # made 0.5 s after push 2 returned, holding version 1
        steps = _target([(2, {}, 1), (4, {}, 1)])
    elif kind == "two_states":
        installed = {**installed, 8: [(2, 5, 100, True)]}
    elif kind == "wrong_tag":
        pushes = [chaos.Push(1, 100, 1, 1.5), chaos.Push(3, 100, 2, 3.5)]
    elif kind == "install_order":
        installed = {7: [(2, 2, 100, True), (1, 1, 100, True)]}
    elif kind == "torn":
        installed = {7: [(1, 1, 100, True), (2, 2, 100, False)]}
    return chaos.check_channel(steps, pushes, installed)


def _bad_resume(kind: str) -> list[tuple[str, str]]:
    tail = [(i, i, 2) for i in range(9, 14)]
    if kind == "index_off":  # the index goes on from the steps counted (11), not the checkpoint
        tail = [(11 + i, 9 + i, 2) for i in range(5)]
    elif kind == "resume_step":
        tail = [(9, 6, 2), *[(i, i - 3, 2) for i in range(10, 17)]]
    elif kind == "gap":
        tail = [(9, 9, 2), (10, 11, 2), (11, 12, 2), (12, 13, 2)]
    elif kind == "short":
        tail = tail[:3]
    elif kind == "attempt":
        tail = [(i, i, 1) for i in range(9, 14)]
    return chaos.check_resumed(_FIRST, tail, checkpoint_index=8, recorded_attempt=1, total=14)


_GROUP_BROKEN: dict[str, tuple[Callable[[], list[tuple[str, str]]], str]] = {
    # Independent ranks.
    "rank resumes before its checkpoint": (
        lambda: chaos.check_independent(
            _unaligned([(0, 1, [0, 1, 2]), (1, 1, [0, 1, 2, 3, 4]), (1, 2, [1, 2, 3])]),
            workers=2,
            every=3,
        ),
        "resume",
    ),
    "rank skips a step": (
        lambda: chaos.check_independent(
            _unaligned([(0, 1, [0, 1, 3]), (1, 1, [0, 1])]), workers=2, every=3
        ),
        "consecutive",
    ),
    "survivor restarted": (
        lambda: chaos.independent_complete(
            _unaligned([(0, 1, [0, 1, 2]), (0, 2, [3]), (1, 1, [0, 1, 2, 3])]),
            [6, 12],
            workers=2,
            total=4,
            replaced=frozenset({1}),
        ),
        "survivor_untouched",
    ),
    "rank's step lost": (
        lambda: chaos.independent_complete(
            _unaligned([(0, 1, [0, 1, 2, 3]), (1, 1, [0, 1, 3])]),
            [6, 12],
            workers=2,
            total=4,
            replaced=frozenset({1}),
        ),
        "no_step_lost",
    ),
    # Elastic sizes.
    "step narrower than its world": (
        lambda: chaos.check_sized(
            [_sized([(1, 4, [0])])[0], _narrow(_sized([(1, 4, [0, 1])])[1])],
            every=2,
            least=2,
            most=4,
        ),
        "world_size",
    ),
    "attempt at two sizes": (
        lambda: chaos.check_sized(
            _reindex(_sized([(1, 4, [0, 1])]) + _sized([(1, 2, [2, 3])])),
            every=2,
            least=2,
            most=4,
        ),
        "world_size",
    ),
    "resized attempt resumes early": (
        lambda: chaos.check_sized(
            _sized([(1, 4, [0, 1, 2, 3, 4, 5]), (2, 2, [3, 4])]), every=2, least=2, most=4
        ),
        "resume",
    ),
    "never smaller": (
        lambda: chaos.check_resizes(_sized([(1, 4, [0, 1]), (2, 4, [1, 2])]), most=4),
        "went_on_smaller",
    ),
    "never grew back": (
        lambda: chaos.check_resizes(_sized([(1, 4, [0, 1]), (2, 2, [1, 2])]), most=4),
        "grew_back",
    ),
    "wrong final total": (
        lambda: chaos.sized_complete(_sized([(1, 2, [0, 1, 2])]), [3, 4], total=3),
        "final_state",
    ),
    # Weight channels.
    "learner's stream skips a step": (
        lambda: chaos.check_ticks(_sized([(1, 1, [0, 1, 3])]), workers=1),
        "consecutive",
    ),
    "replaced rank's stream skips a step": (
        lambda: chaos.check_ticks(
            _unaligned([(0, 1, [0, 1]), (1, 1, [0]), (1, 2, [0, 2])]), workers=2, unaligned=True
        ),
        "consecutive",
    ),
    "push raised something else": (lambda: _bad_channel("raised"), "push_outcome"),
    "push versions out of order": (lambda: _bad_channel("versions"), "push_versions"),
    "report older than its rank held": (lambda: _bad_channel("version_low"), "report_version"),
    "report newer than its rank held": (lambda: _bad_channel("version_high"), "report_version"),
    "rank's version goes back": (lambda: _bad_channel("backwards"), "version_monotone"),
    "push returned before delivery": (lambda: _bad_channel("not_delivered"), "push_delivered"),
    "a version with two states": (lambda: _bad_channel("two_states"), "state_matches_version"),
    "a version with another tag": (lambda: _bad_channel("wrong_tag"), "state_matches_version"),
    "installs out of order": (lambda: _bad_channel("install_order"), "install_order"),
    "torn state": (lambda: _bad_channel("torn"), "state_intact"),
    # Pools.
    "pool short of its size": (lambda: chaos.check_pool(3, 2, 0, [11, 12], []), "pool_refills"),
    "worker still leased": (lambda: chaos.check_pool(3, 3, 1, [11, 12, 13], []), "pool_refills"),
    "dead idle worker": (lambda: chaos.check_pool(3, 3, 0, [11, 12, 13], [12]), "no_dead_lease"),
    # Named runs.
    "index goes on from the count": (lambda: _bad_resume("index_off"), "resume_index"),
    "index means other work": (lambda: _bad_resume("index_off"), "index_matches_work"),
    "resumed from an older step": (lambda: _bad_resume("resume_step"), "resume"),
    "resumed stream skips": (lambda: _bad_resume("gap"), "consecutive"),
    "resumed stream stops short": (lambda: _bad_resume("short"), "no_step_lost"),
    "resumed in the old attempt": (lambda: _bad_resume("attempt"), "attempt_number"),
}


def _reindex(steps: list[asyncexec.Step]) -> list[asyncexec.Step]:
    for index, step in enumerate(steps):
        step.index = index
    return steps


def _narrow(step: asyncexec.Step) -> asyncexec.Step:
    """The step with its last rank's report missing (the others still say the world's size)."""
    return asyncexec.Step(step.index, step.attempt, list(step.reports)[:-1], step.checkpoint)


@pytest.mark.parametrize("case", list(_GROUP_BROKEN))
def test_invariants_catch_a_broken_group_record(case: str) -> None:
    check, invariant = _GROUP_BROKEN[case]
    problems = check()
    assert invariant in {name for name, _ in problems}, problems


# The fixed-seed subset against the shared local Ray ------------------------------------------


def _scenario(kind: str, **overrides: object) -> chaos.Scenario:
    number = list(chaos.KINDS).index(kind)
    return dataclasses.replace(chaos.draw_one(SEED, number, kind), **overrides)  # type: ignore[arg-type]


def _assert_passed(outcome: chaos.Outcome) -> None:
    assert outcome.passed, "\n".join(
        [outcome.scenario.describe(), *(f"{i}: {d}" for i, d in outcome.problems)]
    )


_SUBSET = [k for k in chaos.FAST_KINDS if k != "kill_idle" and k not in chaos.GROUP_KINDS]


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


# The group kinds, against the shared local Ray -----------------------------------------------

#: Each group kind twice with its fault (scenarios 1 and 5 of SEED: no cancel drawn; 5 with its
#: drawn slow consumer), and cancelled at its drawn moments in two scenarios: 2 (in start-up:
#: 0.06-0.11 s; 0.02 s into the first driver's run) and 18 (in the run: 0.86-1.44 s; 0.29 s into
#: the first driver's run); with 2 workers and the object-store transport.
_FAULTED, _FAULTED_SLOW, _EARLY, _CANCELLED = 1, 5, 2, 18


def _group_scenario(kind: str, number: int) -> chaos.Scenario:
    drawn = chaos.draw_one(SEED, number, kind)
    two = {"workers": 2, "rank": drawn.rank % 2, "rank2": 1 - drawn.rank % 2}
    two["slow"] = drawn.slow and number == _FAULTED_SLOW
    if kind.startswith("channel_"):
        two["alt"] = False  # the torch transport imports torch in every worker: by hand
    return dataclasses.replace(drawn, **two)  # type: ignore[arg-type]


_NAMES = {
    _FAULTED: "fault",
    _FAULTED_SLOW: "fault-slow",
    _EARLY: "cancelled-early",
    _CANCELLED: "cancelled",
}
#: Each kind with one fault and one cancel; the kinds take turns at the slow consumer and at
#: the cancel's moment, so that each of the four cases runs for half of them (the whole matrix,
#: every kind in every case, and many more seeds: ``python -m benchmarks.chaos``).
_GROUP_SUBSET = [
    pytest.param(kind, number, id=f"{kind}-{_NAMES[number]}")
    for i, kind in enumerate(k for k in chaos.GROUP_KINDS if k not in chaos.NODE_KINDS)
    for number in ((_FAULTED, _EARLY), (_FAULTED_SLOW, _CANCELLED))[i % 2]
]


def test_the_group_subset_draws_a_fault_and_a_cancel_of_every_kind() -> None:
    for kind in chaos.GROUP_KINDS:
        assert _group_scenario(kind, _FAULTED).cancel_s is None
        assert _group_scenario(kind, _FAULTED_SLOW).cancel_s is None
        for number in (_EARLY, _CANCELLED):
            cancel_s = _group_scenario(kind, number).cancel_s
            assert cancel_s is not None and 0 < cancel_s < chaos.CANCEL_WINDOW_S[kind]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(("kind", "number"), _GROUP_SUBSET)
async def test_group_scenario_keeps_every_promise(kind: str, number: int, tmp_path: Path) -> None:
    outcome = await chaos.run_scenario(_group_scenario(kind, number), chaos.Env(tmp_path))
    _assert_passed(outcome)
    if number in (_FAULTED, _FAULTED_SLOW):  # a cancel may land in start-up, before any step
        assert outcome.steps > 0


@pytest.mark.multinode
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_elastic_group_goes_on_smaller_and_grows_back(
    make_cluster: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    """The elastic kind on a Cluster of its own (each scenario adds the node it removes): a
    fresh group after the loss (scenario 1), the survivors kept (6), cancelled at 2.9 s (18)."""
    cluster = make_cluster([{"num_cpus": 4, "resources": {SLOT: 2}}])
    for number in (1, 6, 18):
        outcome = await chaos.run_scenario(
            _group_scenario("elastic", number), chaos.Env(tmp_path, cluster)
        )
        _assert_passed(outcome)
