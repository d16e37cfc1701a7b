"""The timeline of a run: bounded, off by default, exported as Chrome trace events with one track
per rank and one for the driver, the spans of a run with a restart in their order, and drawn as
a PNG."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from array import array
from typing import Any

import pytest

import asyncexec
from asyncexec import Timeline
from asyncexec._driver.run._steps import StepBatch, StepTimes
from asyncexec._timeline._export import LANE_TIDS
from asyncexec._timeline._timeline import DRIVER


def count_to(config: dict[str, Any]) -> None:
    for i in range(config["steps"]):
        time.sleep(config.get("pause", 0.02) * (1 + asyncexec.get_context().world_rank))
        asyncexec.report({"i": i, "pid": os.getpid()})


def where(x: int) -> int:
    time.sleep(0.01)
    return os.getpid() + x


def _spans(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _tracks(doc: dict[str, Any]) -> dict[int, str]:
    return {
        e["tid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def _batch(first: int, steps: int, ranks: int, t0: float, attempt: int = 1) -> StepBatch:
    """A batch whose rank r reported step i at ``t0 + i + r / 10``, after running 0.5 s."""
    calls = array("d", [t0 + i + r / 10 for r in range(ranks) for i in range(steps)])
    busy = array("d", [0.5] * (ranks * steps))
    rows = [tuple({"i": i} for _ in range(ranks)) for i in range(steps)]
    return StepBatch(first, attempt, rows, {}, times=StepTimes(calls, busy, [0.0] * ranks, steps))


# Without Ray ----------------------------------------------------------------------------------


def test_ring_keeps_the_last_events_and_counts_the_dropped() -> None:
    timeline = Timeline(capacity=10)
    for i in range(100):
        timeline.span(DRIVER, f"s{i}", "call", i, i + 0.5)
    assert timeline.statistics() == asyncexec.TimelineStatistics(10, 10, 90)
    assert [e[2] for e in timeline.events()] == [f"s{i}" for i in range(90, 100)]
    with pytest.raises(ValueError, match="capacity"):
        Timeline(0)


def test_a_ranks_steps_never_overlap_when_two_batches_place_its_clock_apart() -> None:
    """Defect: each batch places a worker's report times on the driver's clock with an offset
    of its own, a millisecond or so apart on a loaded machine. A report placed before the end
    of the rank's previous step became an empty span there, and the rank's clock went back to
    it: the next step's span then overlapped the previous one partly, and the export gave the
    rank a second lane ("rank 0 · 2", seen in a command-line run beside other tests)."""
    timeline = Timeline()
    ms = 0.001
    first = StepTimes(array("d", [10.0, 11.0]), array("d", [0.5, 0.5]), [0.0], 2)
    timeline.steps(StepBatch(0, 1, [({"i": 0},), ({"i": 1},)], {}, times=first))
    # The second batch's offset places step 2's report 2 ms before step 1's, and step 3
    # started (by its own clock) before step 1 ended.
    second = StepTimes(array("d", [11.0, 11.3 + 2 * ms]), array("d", [ms / 2, 0.4]), [-2 * ms], 2)
    timeline.steps(StepBatch(2, 1, [({"i": 2},), ({"i": 3},)], {}, times=second))
    steps = [e for e in timeline.events() if e[3] == "step"]
    assert [e[2] for e in steps] == ["step 0", "step 1", "step 2", "step 3"]
    for before, after in itertools.pairwise(steps):
        assert before[5] <= after[4] <= after[5], (before, after)
    doc = timeline.trace_events()
    assert {e["tid"] for e in doc if e.get("ph") == "X"} == {1}  # rank 0, one lane


def test_memory_stays_bounded_over_a_hundred_thousand_steps() -> None:
    """The ring's size is fixed: 100,000 steps of 4 ranks keep ``capacity`` events."""
    timeline = Timeline(capacity=5_000)
    t0 = time.monotonic()
    for first in range(0, 100_000, 100):
        timeline.steps(_batch(first, 100, 4, t0 + first))
    stats = timeline.statistics()
    assert 5_000 - 400 < stats.events <= 5_000  # a batch of 400 spans goes at once
    assert stats.events + stats.dropped == 400_000
    assert len(timeline.events()) == stats.events
    assert timeline.events()[-1][2] == "step 99999"


def test_a_batch_larger_than_the_ring_keeps_its_last_steps() -> None:
    """Defect: a batch of steps with more spans than the ring's capacity (``timeline=100`` and
    64 steps of 2 ranks) was dropped whole the moment it came, being the ring's oldest entry
    then: a small timeline held no step at all, and a rank's reports of one poll likewise."""
    from asyncexec._wire._protocol import ReportTimes

    timeline = Timeline(capacity=100)
    t0 = timeline.origin + 1
    timeline.steps(_batch(0, 64, 2, t0))
    assert timeline.statistics() == asyncexec.TimelineStatistics(100, 100, 28)
    steps = [e for e in timeline.events() if e[3] == "step"]
    assert sorted({e[2] for e in steps}) == sorted(f"step {i}" for i in range(14, 64))
    now = time.monotonic()
    calls = array("d", [now - 300 + i for i in range(300)])
    timeline.reports(0, 64, ReportTimes(calls, array("d", [0.5] * 300), now).pack())
    assert timeline.statistics() == asyncexec.TimelineStatistics(100, 100, 328)
    assert [e[2] for e in timeline.events()] == [f"step {i}" for i in range(264, 364)]


def test_step_spans_run_from_the_previous_report_on_each_rank() -> None:
    timeline = Timeline()
    t0 = timeline.origin + 1
    timeline.steps(_batch(0, 3, 2, t0))
    doc = {"traceEvents": timeline.trace_events()}
    assert _tracks(doc) == {0: "driver", 1: "rank 0", 2: "rank 1"}
    rank1 = [e for e in _spans(doc) if e["tid"] == 2]
    assert [e["name"] for e in rank1] == ["step 0", "step 1", "step 2"]
    assert [e["dur"] for e in rank1] == pytest.approx([0.5e6] * 3)
    assert rank1[0]["ts"] == pytest.approx((1 + 0.1 - 0.5) * 1e6)


def test_executor_keeps_no_timeline_unless_asked() -> None:
    assert asyncexec.Executor(2).timeline is None
    assert asyncexec.Executor(2, timeline=True).timeline is not None
    assert asyncexec.Executor(2, timeline=50).timeline.capacity == 50  # type: ignore[union-attr]
    with pytest.raises(asyncexec.ConfigurationError, match="timeline"):
        asyncexec.Executor(2, timeline=-1)


@pytest.mark.timeout(30)
async def test_local_run_records_each_ranks_steps_and_calls(tmp_path: Any) -> None:
    async with asyncexec.Executor(2, local=True, timeline=True) as executor:
        async for step in executor.run(count_to, {"steps": 5, "pause": 0.005}):
            if step.index == 1:
                await executor.call(where, 1)
                await executor.call(where, 2, on=asyncexec.least_loaded())
        assert executor.timeline is not None
        executor.timeline.export(tmp_path / "local.json")
    doc = json.loads((tmp_path / "local.json").read_text())
    spans = _spans(doc)
    for rank in (0, 1):
        # A call that overlaps a step without holding it (the calls run beside the function
        # in local mode) puts one of them on a lane of the rank's own: look at every lane.
        steps = [e for e in spans if (e["tid"] - 1) % LANE_TIDS == rank and e["cat"] == "step"]
        names = [e["name"] for e in sorted(steps, key=lambda e: e["ts"])]
        assert names == [f"step {i}" for i in range(5)]
    calls = [e for e in spans if e["cat"] == "call"]
    assert sum(e["name"].endswith("where") for e in calls) == 3  # two ranks, then one chosen
    chosen = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["tid"] == 0]
    assert next(e["name"] for e in chosen if e["cat"] == "call").startswith("least loaded: rank")


def _fails_each_attempt(config: dict[str, Any]) -> None:
    if asyncexec.get_context().attempt == 1:
        asyncexec.report({"i": 0})
    raise RuntimeError("boom")


def _counts(config: dict[str, Any]) -> None:
    for i in range(4):
        asyncexec.report({"i": i})


@pytest.mark.timeout(60)
async def test_a_restart_that_never_reached_a_step_leaves_the_next_runs_alone(
    tmp_path: Any,
) -> None:
    """Defect: a run that gave up during a restart (its function started again, then failed
    before a step) left the timeline waiting for that restart's first step; a named run
    resumed later on the same executor starts at attempt 2 with no failure of its own, and
    its first step's batch then failed the timeline's assertion: the user's ``async for``
    raised AssertionError, from the timeline."""
    policy = asyncexec.RestartPolicy(max_restarts=1, restart_on_user_error=True, wait=_no_wait)
    async with asyncexec.Executor(
        1, local=True, timeline=True, storage_path=str(tmp_path), restart=policy
    ) as executor:
        with pytest.raises(asyncexec.RestartsExhaustedError):
            async for _ in executor.run(_fails_each_attempt):
                pass
        async for step in executor.run(_counts, name="resumed"):
            if step.index == 1:
                break
        steps = [(s.index, s.attempt) async for s in executor.run(_counts, name="resumed")]
        assert steps and {attempt for _, attempt in steps} == {2}
        assert executor.timeline is not None
        names = [e[2] for e in executor.timeline.events() if e[1] == DRIVER]
    assert names.count("restart") == 0  # no restart reached its first step: none is drawn
    assert names.count("start function (attempt 2)") == 2


def _fails_at_once(config: dict[str, Any]) -> None:
    raise RuntimeError("boom")


@pytest.mark.timeout(60)
async def test_a_run_stopped_during_the_policys_wait_ends_the_waits_span_there() -> None:
    """Defect: the policy's wait was recorded when it began, to its planned end: a run
    stopped 30 s before that end left a span 30 s into the future (in the trace, and the
    picture stretched to it)."""
    import anyio
    from tenacity import wait_fixed

    waiting = anyio.Event()

    async def sleep(seconds: float) -> None:
        waiting.set()
        await anyio.sleep_forever()

    policy = asyncexec.RestartPolicy(
        max_restarts=1, restart_on_user_error=True, wait=wait_fixed(30), sleep=sleep
    )
    async with asyncexec.Executor(1, local=True, timeline=True, restart=policy) as executor:
        run = executor.run(_fails_at_once)

        async def consume() -> None:
            async for _ in run:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await waiting.wait()
            tg.cancel_scope.cancel()
        await run.aclose()
        stopped = time.monotonic()
        assert executor.timeline is not None
        [wait] = [e for e in executor.timeline.events() if e[2] == "wait (policy)"]
    assert wait[4] <= wait[5] <= stopped


def _no_wait(retry_state: Any) -> float:
    return 0.0


# A run with a restart, on Ray -------------------------------------------------------------------


def _driver_phases(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(
        (e for e in _spans(doc) if e["tid"] == 0 and e["cat"] in ("restart", "startup", "attempt")),
        key=lambda e: (e["ts"], -e["dur"]),
    )


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(45)
async def test_run_with_a_restart_exports_tracks_and_phases_in_order(tmp_path: Any) -> None:
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path), timeline=True
    ) as executor:
        killed = False
        async for step in executor.run(count_to, {"steps": 12}):
            if step.index == 2:
                await executor.call(where, 1, on=asyncexec.least_loaded())
            if not killed and step.index == 4:
                killed = True
                os.kill(executor.workers[1].pid, signal.SIGKILL)
        assert executor.result.attempts == 2
        timeline = executor.timeline
        assert timeline is not None
        timeline.export(tmp_path / "run.json")
        timeline.render(tmp_path / "run.png", title="a run through a killed worker")
    doc = json.loads((tmp_path / "run.json").read_text())
    # A call that overlaps a step without holding it puts one of them on a lane of the rank's
    # own (its track "rank N · 2"): the tracks are the driver's and each rank's, lanes aside.
    tracks = _tracks(doc)
    assert {t: tracks[t] for t in tracks if t < LANE_TIDS} == {
        0: "driver",
        1: "rank 0",
        2: "rank 1",
    }
    assert all(tracks[t].startswith(tracks[t % LANE_TIDS]) for t in tracks)
    spans = _spans(doc)
    # Each rank's steps, in order, not overlapping; the stream goes on across the restart.
    for rank in (0, 1):
        steps = [e for e in spans if (e["tid"] - 1) % LANE_TIDS == rank and e["cat"] == "step"]
        steps.sort(key=lambda e: e["ts"])
        assert [int(e["name"].split()[1]) for e in steps] == list(range(len(steps)))
        assert len(steps) == executor.result.steps
        for a, b in itertools.pairwise(steps):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e3  # 1 ms: the clocks' placement
    # The restart: failed, torn down, placed, started, set up, function restored, first step.
    failure = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["cat"] == "failure"]
    assert {e["tid"] for e in failure} == {0, 2}  # the driver's and rank 1's
    [restart] = [e for e in spans if e["name"] == "restart"]
    phases = [e for e in _driver_phases(doc) if e["ts"] >= restart["ts"] and e is not restart]
    names = [e["name"] for e in phases if e["name"] != "restart"]
    expected = ["tear down", "place", "start workers", "set up (restore roles)", "backend ready"]
    expected += ["start function (attempt 2)", "first step"]
    assert [n for n in names if n in expected] == expected
    if "wait (policy)" in names:  # the policy's wait, when it waits
        assert names.index("tear down") < names.index("wait (policy)") < names.index("place")
    end = restart["ts"] + restart["dur"]
    for a, b in itertools.pairwise(phases):
        assert a["ts"] <= b["ts"]
        assert b["ts"] + b["dur"] <= end + 1
    assert failure[0]["ts"] <= restart["ts"] + 1
    [first] = [e for e in phases if e["name"] == "first step"]
    assert first["ts"] + first["dur"] == pytest.approx(end, abs=1)
    # The first start-up is there too, before the first step; the call is on one rank's track.
    first_steps = [e["ts"] for e in spans if e["cat"] == "step" and e["name"] == "step 0"]
    assert next(e["ts"] for e in spans if e["name"] == "place") < min(first_steps)
    [call] = [e for e in spans if e["cat"] == "call"]
    assert (call["tid"] - 1) % LANE_TIDS in (0, 1) and call["name"].endswith("where")
    assert (tmp_path / "run.png").stat().st_size > 10_000


# The command line -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_command_line_writes_the_runs_timeline(tmp_path: Any, capsys: Any) -> None:
    from asyncexec.__main__ import main

    path = tmp_path / "cli.json"
    config = json.dumps({"steps": 4, "pause": 0.001})
    argv = ["run", "tests.observe.test_timeline:count_to", "-n", "2", "--local", "--json"]
    assert main([*argv, "--config", config, "--timeline", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert _tracks(doc) == {0: "driver", 1: "rank 0", 2: "rank 1"}
    steps = [e["name"] for e in _spans(doc) if e["tid"] == 1 and e["cat"] == "step"]
    assert steps == ["step 0", "step 1", "step 2", "step 3"]
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 4  # the steps, as JSON lines
    assert f"timeline written to {path.resolve()}" in out.err  # it said nothing of where


# A weight push ----------------------------------------------------------------------------------


def serving(config: dict[str, Any]) -> None:
    asyncexec.serve_weights(lambda: {"w": [1.0, 2.0]})
    while True:
        asyncexec.report({"pid": os.getpid()})
        time.sleep(0.01)


def receiving(config: dict[str, Any]) -> None:
    asyncexec.receive_weights(lambda state, version: None)
    while True:
        asyncexec.report({"pid": os.getpid()})
        time.sleep(0.01)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(45)
async def test_push_is_read_on_the_source_and_installed_on_each_target_rank() -> None:
    one_cpu = {"CPU": 0.5}
    async with (
        asyncexec.Executor(1, resources_per_worker=one_cpu, timeline=True) as source,
        asyncexec.Executor(2, resources_per_worker=one_cpu, timeline=True) as target,
        asyncexec.WeightChannel(source, target) as channel,
    ):
        learn, roll = source.run(serving), target.run(receiving)
        await learn.__anext__()
        await roll.__anext__()
        for version in (1, 2):
            assert await channel.push() == version
        while channel.statistics().delivered < 2:
            await roll.__anext__()
        await learn.aclose()
        await roll.aclose()
    assert source.timeline is not None and target.timeline is not None
    read = [e for e in source.timeline.events() if e[3] == "push"]
    assert [(e[1], e[2]) for e in read] == [(DRIVER, "read v1"), (DRIVER, "read v2")]
    pushed = [e for e in target.timeline.events() if e[3] == "push"]
    for version in (1, 2):
        [deliver] = [e for e in pushed if e[2] == f"push v{version}"]
        installs = [e for e in pushed if e[2] == f"install v{version}"]
        assert sorted(e[1] for e in installs) == [0, 1]
        for install in installs:  # from the delivery's start to each rank's install, inside it
            assert deliver[4] == install[4] <= install[5] <= deliver[5]
