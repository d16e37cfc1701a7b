"""The timeline beyond runs and dispatched calls: the RL pipeline's track (each weight update's
pause, push and resume in each mode, the batches handed, the counters of requests in flight and
samples buffered), ``execute()`` calls, and the steps of independent ranks."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import asyncexec
from asyncexec._timeline._export import thread_id
from asyncexec._timeline._timeline import PIPELINE

CPU = {"CPU": 0.25}


class Toy(asyncexec.RolloutServer):
    """``prompt["length"]`` chunks of 2 ms, each the weights it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: Any = None

    async def chunks(self, prompt: dict[str, Any]) -> AsyncIterator[Any]:
        for _ in range(prompt["length"]):
            await asyncio.sleep(0.002)
            yield self.weights

    def load_weights(self, state: Any, version: int) -> None:
        self.weights = state


def _on(events: list[Any], track: int, ph: str) -> list[Any]:
    return [e for e in events if e[1] == track and e[0] == ph]


@pytest.mark.timeout(60)
async def test_pipeline_updates_batches_and_counters_are_on_its_track_in_order(
    mode: str, tmp_path: Path
) -> None:
    prompts = [{"id": i, "length": 4 + (i * 5) % 9} for i in range(16)]
    modes = ["keep", "wait", "abort"]
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=asyncexec.Role(Toy), timeline=True
    ) as servers:
        async with asyncexec.Pipeline(servers, prompts, batch_size=4, staleness=1) as pipe:
            async for _ in pipe:
                if pipe.version < len(modes):
                    mode_now = modes[pipe.version]
                    await pipe.update_weights({"w": pipe.version + 1}, on_update=mode_now)
        timeline = servers.timeline  # read once the pipeline closed: its last count is in
        assert timeline is not None
        events = timeline.events()
        timeline.export(tmp_path / "pipeline.json")
    stats = pipe.statistics()
    spans = _on(events, PIPELINE, "X")
    updates = [e for e in spans if e[3] == "update"]
    assert [(e[2], e[6]) for e in updates] == [
        (f"update v{v} ({m})", {"mode": m, "version": v}) for v, m in enumerate(modes, 1)
    ]
    for version, (update, m) in enumerate(zip(updates, modes, strict=True), 1):
        inside = [e for e in spans if update[4] <= e[4] and e[5] <= update[5] and e is not update]
        [pause] = [e for e in inside if e[2].startswith(f"pause ({m}, ")]
        [push] = [e for e in inside if e[2] == f"push v{version}"]
        assert pause[4] == update[4] and pause[5] == push[4] <= push[5] <= update[5]
        assert pause[6]["mode"] == m and pause[6]["in_flight"] >= 0
        assert [e[2] for e in inside if e[2] == "resume"] in ([], ["resume"])
    assert [u[4] for u in updates] == sorted(u[4] for u in updates)
    # A batch before each update (the learner's loop), all of them in order.
    batches = [e for e in _on(events, PIPELINE, "i") if e[3] == "batch"]
    assert [e[6]["version"] for e in batches] == list(range(len(batches)))
    assert sum(e[6]["size"] for e in batches) == 16
    for version, update in enumerate(updates):
        assert batches[version][4] <= update[4]
    # Counters: at most one at each admission and at each return or expiry (one a window of
    # COUNTER_S, the window's last kept); never above the budget; the last at the close.
    counters = _on(events, PIPELINE, "C")
    assert 1 <= len(counters) <= 2 * stats.admitted
    assert all(0 <= c[6]["in flight"] <= 2 * 4 and c[6]["buffered"] >= 0 for c in counters)
    assert max(c[6]["in flight"] for c in counters) > 0
    assert counters[-1][6]["in flight"] == 0
    assert [c[4] for c in counters] == sorted(c[4] for c in counters)
    # The servers' calls, named by what ran (not "call").
    calls = {e[2] for e in events if e[0] == "X" and e[3] == "call"}
    assert all(c.startswith("Toy.") for c in calls), calls
    assert "Toy.generate" in calls
    doc = json.loads((tmp_path / "pipeline.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names[thread_id(PIPELINE, 0)] == "pipeline"
    exported = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert len(exported) == len(counters)
    assert all("dur" not in e and set(e["args"]) == {"in flight", "buffered"} for e in exported)


@pytest.mark.timeout(30)
async def test_no_pipeline_track_without_a_timeline(mode: str) -> None:
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, roles=asyncexec.Role(Toy)) as servers,
        asyncexec.Pipeline(servers, [{"id": 0, "length": 1}], batch_size=1) as pipe,
    ):
        sinks = [type(sink).__name__ for sink in pipe._observer.sinks]
        assert sinks == ["Meter", "PipelineMetrics", "PipelineLog", "PipelineSpans"]  # no timeline
        assert [len(b) async for b in pipe] == [1]


def slow_add(x: int) -> int:
    time.sleep(0.02)
    return x + 1


@pytest.mark.timeout(30)
async def test_execute_calls_are_spans_on_their_ranks_tracks(mode: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, timeline=True) as ex:
        began = time.monotonic()
        assert await ex.execute(slow_add, 1) == [2, 2]
        assert await ex.execute_single(1, slow_add, 2) == 3
        ended = time.monotonic()
        assert ex.timeline is not None
        events = ex.timeline.events()
    calls = [e for e in events if e[0] == "X" and e[3] == "call"]
    assert sorted((e[1], e[2]) for e in calls[:2]) == [(0, "slow_add"), (1, "slow_add")]
    assert (calls[2][1], calls[2][2]) == (1, "slow_add")  # execute_single's, the last to end
    for _, _, _, _, start, end, _ in calls:
        assert began <= start and start + 0.02 <= end <= ended
    assert calls[2][4] >= max(calls[0][5], calls[1][5])  # the second execute after the first


def independent(config: dict[str, Any]) -> None:
    """4 reports a rank, rank 1 slower; rank 1's first attempt fails after its second."""
    ctx = asyncexec.get_context()
    start = 2 if ctx.attempt > 1 else 0
    for n in range(start, 4):
        time.sleep(0.01 * (1 + ctx.world_rank))
        asyncexec.report({"n": n})
        if ctx.world_rank == 1 and ctx.attempt == 1 and n == 1:
            raise ValueError("rank 1 fails once")


@pytest.mark.timeout(60)
async def test_independent_ranks_steps_and_a_renewed_rank_on_their_tracks(mode: str) -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, restart_on_user_error=True)
    async with asyncexec.Executor(2, resources_per_worker=CPU, restart=policy, timeline=True) as ex:
        seen = [(s.rank, s.index) async for s in ex.run(independent, independent=True)]
        assert ex.timeline is not None
        events = ex.timeline.events()
    assert sorted(r for r, _ in seen) == [0] * 4 + [1] * 4
    for rank in (0, 1):
        steps = [e for e in events if e[0] == "X" and e[1] == rank and e[3] == "step"]
        assert [e[2] for e in steps] == [f"step {i}" for r, i in seen if r == rank]
        for before, after in itertools.pairwise(steps):
            assert before[4] <= before[5] <= after[4] <= after[5]
    [failed] = [e for e in events if e[3] == "failure"]
    assert failed[:3] == ("i", 1, "failed: WorkerRaisedError")
    [renewal] = [e for e in events if e[2] == "replace rank"]
    assert renewal[1] == 1 and renewal[3] == "restart" and failed[4] <= renewal[4]
    second = [e for e in events if e[1] == 1 and e[3] == "step"][2]  # the second attempt's
    assert renewal[5] <= second[5]


def test_counters_and_one_ranks_reports_export_draw_and_leave_the_ring_whole(
    tmp_path: Path,
) -> None:
    from array import array

    from asyncexec._wire._protocol import ReportTimes

    timeline = asyncexec.Timeline(capacity=8)
    now = time.monotonic()
    # A worker's clock 100 s behind the driver's: 3 reports, each after 0.1 s of work.
    calls = array("d", [now - 100.3, now - 100.2, now - 100.1])
    busy = array("d", [0.1, 0.1, 0.1])
    timeline.reports(1, 5, ReportTimes(calls, busy, now - 100.0).pack())
    timeline.counter(PIPELINE, "rollouts", "pipeline", now, {"in flight": 2, "buffered": 0})
    timeline.span(PIPELINE, "update v1 (keep)", "update", now, now + 0.1)
    steps = [e for e in timeline.events() if e[3] == "step"]
    assert [(e[1], e[2]) for e in steps] == [(1, "step 5"), (1, "step 6"), (1, "step 7")]
    for e, at in zip(steps, (0.3, 0.2, 0.1), strict=True):
        assert e[5] == pytest.approx(now - at, abs=0.05) and e[5] - e[4] == pytest.approx(0.1)
    timeline.export(tmp_path / "t.json")
    timeline.render(tmp_path / "t.png", "counters are not drawn")
    assert (tmp_path / "t.png").stat().st_size > 0
    for i in range(6):  # the oldest entry (3 reports) leaves whole
        timeline.instant(PIPELINE, f"batch v{i} (1)", "batch")
    assert timeline.statistics() == asyncexec.TimelineStatistics(8, 8, 3)


def test_the_pipeline_draws_the_learners_wait_each_batchs_staleness_and_lost_requests(
    tmp_path: Path,
) -> None:
    """A batch says its staleness and the learner's wait for it is a span; an expired and an
    aborted request are marked (they were only counted)."""
    from asyncexec._driver.pipeline._events import BatchHanded, RequestExpired, SampleReturned
    from asyncexec._driver.pipeline._sinks import PipelineTimeline
    from asyncexec._timeline._pipeline import PipelineTrack
    from asyncexec._timeline._timeline import Timeline

    timeline = Timeline()
    sink = PipelineTimeline(PipelineTrack(timeline))
    emit = sink.handlers()
    emit[BatchHanded](BatchHanded(2, (0, 1, 1, 0), 1, 0.25, 3, 1))
    emit[RequestExpired](RequestExpired(2, 0.5, 3, 0))
    emit[SampleReturned](SampleReturned("aborted", 2, 0))
    emit[SampleReturned](SampleReturned("finished", 1, 1))
    events = timeline.events()
    [wait] = [e for e in events if e[3] == "wait"]
    assert wait[2] == "learner waits (v2)" and wait[5] - wait[4] == pytest.approx(0.25)
    [batch] = [e for e in events if e[3] == "batch"]
    assert batch[2] == "batch v2 (4, staleness ≤1)"
    assert batch[6]["staleness_max"] == 1 and batch[6]["staleness_mean"] == 0.5
    assert wait[5] <= batch[4]
    marked = [(e[0], e[2], e[6]["version"]) for e in events if e[3] in ("expired", "aborted")]
    assert marked == [("i", "expired", 2), ("i", "aborted", 2)]
    assert [e[6]["in flight"] for e in events if e[0] == "C"] == [3, 2, 1]
    pytest.importorskip("matplotlib")
    timeline.render(tmp_path / "p.png")


async def test_the_counters_keep_one_value_a_window_the_last_at_its_own_time() -> None:
    """A fast pipeline's counters change at every admission and return: within a window only
    the first value is recorded at once, and the window's last at its own time when the window
    ends (or the pipeline closes), so that the ring holds spans, not thousands of counts."""
    from asyncexec._timeline._pipeline import PipelineTrack, counted, counts_flushed

    def counts(timeline: asyncexec.Timeline) -> list[tuple[float, int]]:
        return [(e[4], e[6]["in flight"]) for e in timeline.events() if e[0] == "C"]

    timeline = asyncexec.Timeline()
    track = PipelineTrack(timeline, resolution_s=60.0)
    counted(track, 1, 0)  # recorded: a window of 60 s begins
    counted(track, 2, 0)
    kept = time.monotonic()
    counted(track, 3, 1)  # replaces the 2
    assert [n for _, n in counts(timeline)] == [1]
    counts_flushed(track)  # the pipeline closed
    [(first, _), (last, n)] = counts(timeline)
    assert n == 3 and first <= last and last >= kept
    counts_flushed(track)  # nothing kept: nothing more
    assert len(counts(timeline)) == 2

    timeline = asyncexec.Timeline()
    recorded = asyncio.Event()
    record = timeline.counter

    def counter(*args: Any) -> None:
        record(*args)
        recorded.set()

    timeline.counter = counter  # type: ignore[method-assign]
    track = PipelineTrack(timeline, resolution_s=0.05)
    counted(track, 1, 0)
    recorded.clear()
    counted(track, 0, 1)  # kept until the window ends: no other count comes
    assert [n for _, n in counts(timeline)] == [1]
    await asyncio.wait_for(recorded.wait(), 10)
    assert [n for _, n in counts(timeline)] == [1, 0]
    counted(track, 5, 0)  # after the window: recorded at once
    assert [n for _, n in counts(timeline)] == [1, 0, 5]
