"""Stragglers: each step knows when each rank made its report (``Step.arrivals``, ``Step.skew``)
and how long each rank's own work took (``Step.durations``, credit waits left out); a rank made
slow on purpose is named in one ``straggler`` event with its stack, and counted; a balanced run
fires nothing. On Ray actors and in local mode, and with simulated ranks for larger groups."""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

import asyncexec
from asyncexec._driver._config import ExecutorConfig
from asyncexec._driver.cluster import NOT_TAKEN
from asyncexec._driver.run._steps import StepTimes
from asyncexec._driver.run._stragglers import MIN_LAG_S, StragglerWatch
from asyncexec.testing import SimCluster, SimLoad, metrics_enabled

pytestmark = pytest.mark.timeout(120)

FAST_S, SLOW_S = 0.005, 0.03
SLOW_RANK = 2


def steps_with_a_slow_rank(config: dict[str, Any]) -> None:
    """Every rank sleeps FAST_S a step, except SLOW_RANK, which sleeps SLOW_S."""
    slow = asyncexec.get_context().world_rank == config.get("slow", -1)
    for i in range(config["steps"]):
        time.sleep(SLOW_S if slow else FAST_S)
        asyncexec.report({"i": i})


def _stragglers(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "straggler"]


async def _collect(executor: asyncexec.Executor, config: dict[str, Any]) -> list[asyncexec.Step]:
    return [step async for step in executor.run(steps_with_a_slow_rank, config)]


# On Ray actors and in local mode --------------------------------------------------------------


async def test_rank_made_slow_is_named_once_with_its_stack(mode: str) -> None:
    with capture_logs() as logs:
        async with asyncexec.Executor(4, resources_per_worker={"CPU": 0.5}) as executor:
            steps = await _collect(executor, {"steps": 40, "slow": SLOW_RANK})
    events = _stragglers(logs)
    assert [e["rank"] for e in events] == [SLOW_RANK], events
    event = events[0]
    # The first window of 10 steps (the default) shows it: its shortest step against the
    # typical rank's, each at least the time the function slept.
    assert event["step"] == 9
    assert event["step_s"] >= SLOW_S > event["typical_s"] >= FAST_S
    assert event["factor"] > 2.0
    if mode == "local" or (event["stack"] is not None and not event["stack"].startswith(NOT_TAKEN)):
        assert "steps_with_a_slow_rank" in event["stack"]  # its function's frame
    # Each step says when each rank reported, relative to the first, and how long each ran.
    assert len(steps) == 40
    for step in steps:
        assert set(step.arrivals) == set(step.durations) == {0, 1, 2, 3}
        assert min(step.arrivals.values()) == 0.0
        assert step.skew == max(step.arrivals.values())
        assert step.durations[SLOW_RANK] >= SLOW_S
        assert all(step.durations[r] >= FAST_S for r in (0, 1, 3))
    # Nothing holds the slow rank back: it falls behind the others step by step (by about
    # 39 x 25 ms over the run). Its lag is taken against the other ranks at each step, so that
    # when the ranks' functions started (up to 0.6 s apart on a loaded machine) cancels out.
    last = steps[-1]
    assert max(last.arrivals, key=last.arrivals.__getitem__) == SLOW_RANK

    def lag(step: asyncexec.Step) -> float:
        return step.arrivals[SLOW_RANK] - min(step.arrivals[r] for r in (0, 1, 3))

    assert lag(last) - lag(steps[0]) > 10 * (SLOW_S - FAST_S)


async def test_balanced_run_fires_nothing(mode: str) -> None:
    with capture_logs() as logs:
        async with asyncexec.Executor(4, resources_per_worker={"CPU": 0.5}) as executor:
            steps = await _collect(executor, {"steps": 40})
    assert _stragglers(logs) == []
    assert len(steps) == 40
    assert all(set(step.durations) == {0, 1, 2, 3} for step in steps)


async def test_durations_leave_out_the_wait_for_credit(mode: str) -> None:
    """A consumer that takes a step every 50 ms holds ranks that report every 5 ms back (one
    report of credit): their reports wait, their durations do not."""
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}) as executor:
        durations = []
        async for step in executor.run(steps_with_a_slow_rank, {"steps": 8}, buffer_size=1):
            durations.extend(step.durations.values())
            await anyio.sleep(0.05)
    assert len(durations) == 16
    assert all(FAST_S <= d < 0.04 for d in durations), durations


# With simulated ranks: larger groups, no Ray --------------------------------------------------


async def test_simulated_stragglers_among_256_ranks_are_each_named() -> None:
    load = SimLoad(reports=40, rate=400.0, slow={17: 3.0, 200: 2.5})
    with capture_logs() as logs:
        async with asyncexec.Executor(256, cluster=SimCluster(load)) as executor:
            steps = [step async for step in executor.run(steps_with_a_slow_rank)]
    assert [e["rank"] for e in _stragglers(logs)] == [17, 200]
    assert len(steps) == 40
    assert steps[-1].durations[17] == pytest.approx(3.0 / 400.0)


async def test_simulated_balanced_ranks_fire_nothing() -> None:
    cluster = SimCluster(SimLoad(reports=40, rate=400.0))
    with capture_logs() as logs:
        async with asyncexec.Executor(256, cluster=cluster) as executor:
            steps = [step async for step in executor.run(steps_with_a_slow_rank)]
    assert _stragglers(logs) == []
    assert len(steps) == 40


async def test_the_health_checks_straggler_settings_reach_the_executor() -> None:
    """``health=HealthChecks(straggler_factor=None)`` turns the watch off, and its
    ``straggler_steps`` sets the window (the step at which a slow rank is named)."""
    load = SimLoad(reports=30, rate=400.0, slow={3: 4.0})
    off = asyncexec.HealthChecks(straggler_factor=None)
    window = asyncexec.HealthChecks(straggler_factor=3.0, straggler_steps=4)
    with capture_logs() as logs:
        async with asyncexec.Executor(8, cluster=SimCluster(load), health=off) as executor:
            steps = [step async for step in executor.run(steps_with_a_slow_rank)]
    assert len(steps) == 30
    assert _stragglers(logs) == []
    with capture_logs() as logs:
        async with asyncexec.Executor(8, cluster=SimCluster(load), health=window) as executor:
            steps = [step async for step in executor.run(steps_with_a_slow_rank)]
    assert [(e["rank"], e["step"]) for e in _stragglers(logs)] == [(3, 3)]


@pytest.fixture
def registry() -> Iterator[Any]:
    pytest.importorskip("prometheus_client")
    with metrics_enabled() as registry:
        yield registry


async def test_straggler_counted_and_skew_sampled_by_executor(registry: Any) -> None:
    load = SimLoad(reports=30, rate=400.0, slow={3: 4.0})
    async with asyncexec.Executor(8, name="lagging", cluster=SimCluster(load)) as executor:
        steps = [step async for step in executor.run(steps_with_a_slow_rank)]
    assert len(steps) == 30
    labels = {"executor": "lagging"}
    assert registry.get_sample_value("asyncexec_stragglers_total", labels) == 1
    assert registry.get_sample_value("asyncexec_step_skew_seconds_count", labels) >= 1
    # The slowest step waited for rank 3: the last one's skew lies in a bucket above 0.05 s.
    bucket = {**labels, "le": "0.05"}
    below = registry.get_sample_value("asyncexec_step_skew_seconds_bucket", bucket)
    total = registry.get_sample_value("asyncexec_step_skew_seconds_count", labels)
    assert below < total


# The watch itself -------------------------------------------------------------------------------


def _times(rows: list[list[float]]) -> StepTimes:
    """The busy times of ``rows`` (one row a step, one column a rank), as a batch holds them."""
    busy = array("d", [t for column in zip(*rows, strict=True) for t in column])
    ranks = len(rows[0])
    return StepTimes(array("d", [0.0]) * len(busy), busy, [0.0] * ranks, len(rows))


async def test_watch_needs_every_step_of_the_window_slow() -> None:
    watch = StragglerWatch(4, factor=2.0, steps=5)
    # Rank 1 is 3x slower in 4 steps of 5, then in all 5 of the next window.
    once_fast = [[0.01, 0.03, 0.01, 0.01]] * 4 + [[0.01, 0.01, 0.01, 0.01]]
    watch.observe(0, _times(once_fast))
    assert watch._found == []
    watch.observe(5, _times([[0.01, 0.03, 0.01, 0.01]] * 5))
    assert [(s.rank, s.step, s.factor) for s in watch._found] == [(1, 9, pytest.approx(3.0))]


async def test_watch_reports_a_straggler_again_only_after_a_window_without_it() -> None:
    watch = StragglerWatch(3, factor=2.0, steps=2)
    slow, even = [[0.01, 0.01, 0.05]], [[0.01, 0.01, 0.01]]
    # Steps arrive in batches that cut across windows.
    watch.observe(0, _times(slow * 3))
    watch.observe(3, _times(slow * 1 + even * 2))
    watch.observe(6, _times(slow * 2))
    assert [(s.rank, s.step) for s in watch._found] == [(2, 1), (2, 7)]


async def test_watch_ignores_differences_below_the_floor_and_unknown_times() -> None:
    watch = StragglerWatch(3, factor=2.0, steps=2)
    tiny = MIN_LAG_S / 4  # 4x slower, but by less than the floor
    watch.observe(0, _times([[MIN_LAG_S / 16, MIN_LAG_S / 16, tiny]] * 2))
    nan = math.nan
    watch.observe(2, _times([[0.01, 0.01, nan]] * 2))  # a rank whose times are not known
    assert watch._found == []


async def test_two_ranks_one_slow() -> None:
    watch = StragglerWatch(2, factor=2.0, steps=3)
    watch.observe(0, _times([[0.01, 0.05]] * 3))
    assert [s.rank for s in watch._found] == [1]


def test_watch_is_off_without_a_factor_and_for_one_rank() -> None:
    off = ExecutorConfig.build(4, straggler_factor=None)
    assert StragglerWatch.of(off, 4) is None
    assert StragglerWatch.of(ExecutorConfig.build(1), 1) is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"straggler_factor": 1.0}, "straggler_factor"),
        ({"straggler_factor": "2"}, "straggler_factor"),
        ({"straggler_factor": math.nan}, "straggler_factor"),
        ({"straggler_steps": 0}, "straggler_steps"),
        ({"straggler_steps": 2.5}, "straggler_steps"),
    ],
)
def test_bad_straggler_settings_are_refused(options: dict[str, Any], named: str) -> None:
    with pytest.raises(asyncexec.ConfigurationError, match=f"HealthChecks.{named}"):
        asyncexec.HealthChecks(**options)
    with pytest.raises(asyncexec.ConfigurationError, match=named):
        ExecutorConfig.build(2, **options)


def test_step_made_by_hand_has_no_times() -> None:
    report = asyncexec.Report(0, {"loss": 1.0})
    step = asyncexec.Step(0, 1, [report])
    assert (step.arrivals, step.skew, step.durations) == ({}, 0.0, {})
    one = asyncexec.Step(0, 1, [report], rank=3)
    assert (one.arrivals, one.skew) == ({3: 0.0}, 0.0)


def test_a_batch_of_many_steps_split_for_the_iterator_keeps_each_steps_times() -> None:
    """After a failure the assembly hands over every complete step at once (more than a batch
    of BATCH), cut into parts: each part's steps keep their own ranks' times (the last, short
    part was read beyond the batch's end)."""
    from asyncexec._driver.run._window import BATCH, Assembly
    from asyncexec._wire._protocol import Poll, ReportTimes

    ranks, steps = 3, 2 * BATCH + 37
    asm = Assembly(ranks, 1, 0)
    for rank in range(ranks):
        busy = array("d", [rank + i / 10_000 for i in range(steps)])
        calls = array("d", [100.0 + i + rank / 10 for i in range(steps)])
        times = ReportTimes(calls, busy, 1_000.0).pack()
        asm.add(rank, Poll([{"i": i} for i in range(steps)], None, None, None, times))
    parts = asm.take(asm.ready).split(BATCH)
    assert [len(p) for p in parts] == [BATCH, BATCH, 37]
    seen = [p.step(i) for p in parts for i in range(len(p))]
    assert [s.index for s in seen] == list(range(steps))
    for i, step in enumerate(seen):
        assert step.durations == {r: pytest.approx(r + i / 10_000) for r in range(ranks)}
        # Every step's reports were made 0.1 s apart rank by rank (placed on the driver's
        # clock by each rank's own offset): the same arrivals in every step.
        first = seen[0].arrivals
        assert step.arrivals == {r: pytest.approx(first[r], abs=1e-6) for r in range(ranks)}


async def test_watch_judges_the_last_whole_window_of_a_long_batch() -> None:
    """A batch of 25 steps with windows of 10: a rank slow throughout is named once, at the end
    of the batch's last whole window (step 19); the 5 steps left open the next window."""
    watch = StragglerWatch(3, factor=2.0, steps=10)
    watch.observe(0, _times([[0.01, 0.01, 0.05]] * 25))
    assert [(s.rank, s.step) for s in watch._found] == [(2, 19)]
    # The open window is completed by the next batch and judged: still slow, not named again.
    watch.observe(25, _times([[0.01, 0.01, 0.05]] * 5))
    assert len(watch._found) == 1
    assert watch._slow == {2}
