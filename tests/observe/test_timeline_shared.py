"""One picture of an RL run: a timeline that several executors (and the pipeline over them)
record into, on one clock, exported as one Perfetto trace with a process per executor and drawn
as one PNG with a section per executor; concurrent calls on one rank each on a lane of their
own (never sharing a slice), and the PNG's occupancy of each server."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import asyncexec
from asyncexec._timeline._export import LANE_TIDS, lanes
from asyncexec._timeline._render import long_calls, occupancy, render_plan, work_began
from asyncexec._timeline._timeline import DRIVER, PIPELINE, Timeline

CPU = {"CPU": 0.25}


def _partly_overlapping(doc: dict[str, Any]) -> list[tuple[Any, Any]]:
    """Pairs of ``X`` slices of one thread that overlap without one holding the other (what
    Perfetto's importer cannot nest)."""
    threads: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            threads[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    bad = []
    for spans in threads.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        for i, a in enumerate(spans):
            for b in spans[i + 1 :]:
                if b[0] >= a[1] - 0.01:  # (microseconds, rounded to 3 places)
                    break
                if b[1] > a[1] + 0.01:
                    bad.append((a, b))
    return bad


# Without Ray ----------------------------------------------------------------------------------


def test_concurrent_calls_take_lanes_and_nested_phases_stay_on_theirs(tmp_path: Path) -> None:
    timeline = Timeline()
    t = timeline.origin
    for i in range(4):  # 4 calls in flight at once on rank 0, then one after them
        timeline.span(0, "Server.generate", "call", t + i * 0.1, t + 1 + i * 0.1)
    timeline.span(0, "Server.generate", "call", t + 2, t + 3)
    timeline.span(DRIVER, "restart", "restart", t, t + 2)  # holds its phases
    timeline.span(DRIVER, "place", "startup", t + 0.5, t + 1)
    timeline.span(DRIVER, "start workers", "startup", t + 1, t + 1.5)
    events = timeline.events()
    assert lanes(events) == [0, 1, 2, 3, 0, 0, 0, 0]
    timeline.export(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    assert _partly_overlapping(doc) == []
    threads = {
        e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"
    }
    assert threads[1] == "rank 0" and threads[1 + 3 * LANE_TIDS] == "rank 0 · 4"
    assert {e["tid"] for e in doc["traceEvents"] if e.get("cat") == "startup"} == {0}


def test_every_track_has_a_thread_id_of_its_own_that_perfetto_reads() -> None:
    """Defect: the pipeline's track was thread -1; Perfetto's importer reads a tid that is not
    a uint32 as none given and takes the pid for it, so the pipeline's slices and its name
    landed on rank 0's thread in the first process (tid 1) and rank 1's in the second, over
    that rank's calls."""
    timeline = Timeline(name="learner")
    servers = timeline.joined("servers")
    t = timeline.origin
    for view in (timeline, servers):
        view.span(DRIVER, "place", "startup", t, t + 1)
        for rank in range(3):
            view.span(rank, "Server.generate", "call", t + 1, t + 2)
            view.span(rank, "Server.generate", "call", t + 1.5, t + 2.5)  # a second lane
        view.span(PIPELINE, "update v1 (keep)", "update", t + 1.2, t + 1.8)
        view.span(PIPELINE, "learner waits (v1)", "wait", t + 1.6, t + 2.2)  # a second lane
        view.counter(PIPELINE, "rollouts", "pipeline", t + 1, {"in flight": 1, "buffered": 0})
    doc = timeline.trace_events()
    # What the importer keys a thread by: a tid outside uint32 is none, and then the pid.
    named: dict[tuple[int, int], set[str]] = defaultdict(set)
    for e in doc:
        if e["name"] == "thread_name":
            tid = e["tid"] if 0 <= e["tid"] < 2**32 else e["pid"]
            named[(e["pid"], tid)].add(e["args"]["name"])
    assert all(len(names) == 1 for names in named.values()), named
    for pid in (1, 2):
        threads = {next(iter(v)) for (p, _), v in named.items() if p == pid}
        assert {"pipeline", "pipeline · 2", "driver", "rank 0 · 2", "rank 2"} <= threads
    assert all(0 <= e["tid"] < 2**32 for e in doc)


def test_slices_that_meet_or_end_together_do_so_to_the_nanosecond() -> None:
    """Defect: the start and the duration were each rounded to the nanosecond, so a slice could
    end 1 ns after the next one on its thread began, or a child 1 ns after its parent (122 of
    1,000 steps with no busy time), and Perfetto drops a slice that overlaps another."""
    import random

    rng = random.Random(3)
    timeline = Timeline()
    t = timeline.origin + 0.5
    for i in range(1000):  # back to back on rank 0, each holding a child that ends with it
        end = t + rng.uniform(0.001, 0.05)
        timeline.span(0, f"s{i}", "call", t, end)
        timeline.span(0, f"c{i}", "phase", t + (end - t) * rng.random(), end)
        t = end

    def ns(microseconds: float) -> int:  # as an exact reader of the JSON's decimals takes it
        return round(microseconds * 1000)

    slices = [e for e in timeline.trace_events() if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == {1}  # one lane: none overlaps another partly
    parents, children = slices[0::2], slices[1::2]
    ends = [ns(e["ts"]) + ns(e["dur"]) for e in parents]
    assert all(end <= ns(after["ts"]) for end, after in zip(ends, parents[1:], strict=False))
    assert [ns(c["ts"]) + ns(c["dur"]) for c in children] == ends


def test_the_picture_starts_at_the_first_work_the_start_up_folded_with_its_seconds(
    tmp_path: Path,
) -> None:
    """An RL run's picture was about 60% start-up (each group's phases, the first push): its
    clock now starts at the first step, call or pipeline event; what came before is one band
    left of 0, labelled with each executor's start-up; a span across the cut begins at 0."""
    shared = Timeline()
    learner, servers = shared.joined("learner"), shared.joined("servers")
    t = shared.origin
    learner.span(DRIVER, "place", "startup", t, t + 1)
    learner.span(DRIVER, "start workers", "startup", t + 1, t + 3)
    servers.span(DRIVER, "start workers", "startup", t + 0.5, t + 4)
    servers.span(DRIVER, "push v0", "push", t + 4, t + 5.5)  # the first push: start-up too
    servers.span(0, "install v0", "push", t + 5, t + 6.25)  # across the first call's start
    for i in range(4):
        servers.span(0, "PolicyServer.generate", "call", t + 6 + i, t + 6.5 + i)
    learner.span(0, "Learner.update", "call", t + 7, t + 8)
    processes = shared.processes()
    assert work_began(processes) == t + 6
    plan = render_plan(processes, shared.origin)
    assert plan.origin == t + 6 and plan.startups == {"learner": 6.0, "servers": 5.5}
    assert plan.left < 0 and plan.right == 3.5
    kept = dict(plan.processes)
    assert [e[2] for e in kept["learner"]] == ["Learner.update"]
    assert next((e[2], e[4]) for e in kept["servers"]) == ("install v0", t + 6)  # cut at 0
    full = render_plan(processes, shared.origin, startup=True)
    assert full.origin == t and full.startups == {} and full.processes == processes
    # Nothing before the work: nothing folded.
    alone = Timeline()
    alone.span(0, "f", "call", alone.origin + 1, alone.origin + 2)
    assert render_plan(alone.processes(), alone.origin).startups == {}
    shared.render(tmp_path / "folded.png")
    shared.render(tmp_path / "full.png", startup=True)
    assert (tmp_path / "folded.png").stat().st_size > 0 < (tmp_path / "full.png").stat().st_size


def test_occupancy_counts_the_calls_in_flight_and_marks_the_long_ones() -> None:
    spans = [(0.0, 1.0), (0.5, 1.0), (0.5, 0.2), (3.0, 1.0), (4.0, 1.0), (6.0, 9.0)]
    assert occupancy(spans)[:4] == [(0.0, 1), (0.5, 3), (0.7, 2), (1.0, 1)]
    assert max(n for _, n in occupancy(spans)) == 3 and occupancy(spans)[-1] == (15.0, 0)
    assert long_calls(spans) == [(6.0, 9.0)]
    assert long_calls(spans[:4]) == []  # too few to judge


def test_a_short_runs_spans_are_drawn_at_their_length_and_its_calls_one_at_a_time(
    tmp_path: Path,
) -> None:
    """Defect: the PNG drew every span at least 100 µs wide, and counted a rank's calls in
    flight from those widths: in a run of 10 ms, rank 0's steps of 20 µs every 50 µs were one
    busy bar, and rank 1's calls of 20 µs, one after another, were drawn as "≤2 in flight"."""
    pytest.importorskip("matplotlib")
    from asyncexec._timeline import _render

    timeline = Timeline()
    t = timeline.origin
    for i in range(200):
        timeline.span(0, f"step {i}", "step", t + i * 50e-6, t + i * 50e-6 + 20e-6)
        timeline.span(1, "Server.generate", "call", t + i * 50e-6, t + i * 50e-6 + 20e-6)
    drawn: list[Any] = []
    real = _render._section

    def section(ax: Any, *args: Any) -> set[str]:
        drawn.append(ax)
        return real(ax, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_render, "_section", section)
        timeline.render(tmp_path / "short.png")
    [ax] = drawn
    widths = sorted(
        round(path.get_extents().width, 9)
        for collection in ax.collections
        for path in collection.get_paths()
    )
    assert widths and max(widths) == pytest.approx(20e-6)  # each step's and call's own width
    assert not [text for text in ax.texts if "in flight" in text.get_text()]


def test_a_short_start_up_is_labelled_by_its_length_not_zero(tmp_path: Path) -> None:
    """Defect: the folded start-up's label had one decimal of a second: a local group's
    start-up of 4.5 ms read "start-up 0.0 s"."""
    pytest.importorskip("matplotlib")
    from asyncexec._timeline import _render

    timeline = Timeline()
    t = timeline.origin
    timeline.span(DRIVER, "place", "startup", t, t + 0.0045)
    timeline.span(0, "step 0", "step", t + 0.005, t + 0.5)
    labels: list[str] = []
    real = _render._fold

    def fold(ax: Any, left: float, seconds: float | None) -> None:
        real(ax, left, seconds)
        labels.extend(text.get_text() for text in ax.texts)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_render, "_fold", fold)
        timeline.render(tmp_path / "t.png")
    assert labels == ["start-up 5 ms"]


def test_an_export_reads_the_ring_once_however_many_executors_joined_it() -> None:
    """Defect: exporting a shared timeline read its whole ring once for each process that had
    ever joined it, the ones whose events were all gone too: a service that joins an executor
    per request exported slower with each (15 s for 2,000 executors and 100,000 events)."""
    import collections

    reads = 0

    class Counted(collections.deque):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            nonlocal reads
            reads += 1
            return super().__iter__()

    timeline = Timeline(capacity=100)
    t = timeline.origin
    for i in range(200):  # the first 150 executors' events are dropped by now
        timeline.joined(f"executor {i}").span(0, "Server.generate", "call", t + i, t + i + 1)
    timeline._ring.entries = Counted(timeline._ring.entries)
    processes = timeline.processes()
    assert reads == 1
    assert [name for name, _ in processes] == [f"executor {i}" for i in range(100, 200)]
    assert all(len(events) == 1 for _, events in processes)


def test_a_shared_timeline_forgets_the_executors_that_are_gone_with_their_events() -> None:
    """Defect: a shared timeline kept the name of every executor that ever joined it, also
    once the executor was gone and its events dropped: a service that makes an executor per
    request on one timeline grew with each request."""
    import gc

    timeline = Timeline(capacity=10)
    t = timeline.origin
    kept = timeline.joined("kept")  # alive, its event dropped: its name stays
    kept.span(0, "Server.generate", "call", t, t + 1)
    for i in range(1_000):  # each executor's timeline is gone once it has recorded
        timeline.joined(f"executor {i}").span(0, "Server.generate", "call", t + i, t + i + 1)
    gc.collect()
    assert len(timeline._ring.names) < 100
    assert kept.name == "kept" and timeline.name == "asyncexec"
    names = [name for name, _ in timeline.processes()]
    assert names == [f"executor {i}" for i in range(990, 1_000)]


def test_joined_timelines_share_one_ring_and_clock_each_a_process(tmp_path: Path) -> None:
    shared = Timeline(capacity=6, name="run")
    learner, servers = shared.joined("learner"), shared.joined("servers")
    assert learner.origin == servers.origin == shared.origin
    now = shared.origin + 1
    learner.span(0, "Learner.update", "call", now, now + 1)
    servers.span(0, "Server.generate", "call", now + 0.5, now + 2)
    servers.span(1, "Server.generate", "call", now + 0.5, now + 2)
    assert [e[2] for e in learner.events()] == ["Learner.update"]
    assert [name for name, _ in shared.processes()] == ["learner", "servers"]
    shared.export(tmp_path / "run.json")
    doc = json.loads((tmp_path / "run.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "learner", 2: "servers"}
    starts = {(e["pid"], e["tid"]): e["ts"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert starts[(1, 1)] == pytest.approx(1e6) and starts[(2, 2)] == pytest.approx(1.5e6)
    servers.export(tmp_path / "servers.json")  # a joined one: its own process only
    own = json.loads((tmp_path / "servers.json").read_text())
    assert {e["pid"] for e in own["traceEvents"]} == {1}
    for i in range(6):  # one ring: its capacity is all of theirs together
        learner.instant(0, f"i{i}", "call")
    assert servers.events() == [] and shared.statistics().dropped == 3
    pytest.importorskip("matplotlib")
    shared.export(tmp_path / "run.png")
    assert (tmp_path / "run.png").stat().st_size > 0


# An RL run: a learner and its servers on one timeline (each mode) ----------------------------


class Server(asyncexec.RolloutServer):
    async def chunks(self, prompt: dict[str, Any]) -> AsyncIterator[Any]:
        for _ in range(prompt["length"]):
            await asyncio.sleep(0.003)
            yield prompt["id"]

    def load_weights(self, state: Any, version: int) -> None:
        pass


class Learner:
    def update(self, batch: list[Any]) -> int:
        return len(batch)


@pytest.mark.timeout(60)
async def test_an_rl_run_is_one_trace_a_process_per_executor(mode: str, tmp_path: Path) -> None:
    shared = asyncexec.Timeline()
    prompts = [{"id": i, "length": 3 + (i * 7) % 11} for i in range(24)]
    async with (
        asyncexec.Executor(
            1, resources_per_worker=CPU, roles=Learner, timeline=shared, name="learner"
        ) as learner,
        asyncexec.Executor(
            2, resources_per_worker=CPU, roles=Server, timeline=shared, name="servers"
        ) as servers,
        asyncexec.Pipeline(servers, prompts, batch_size=4, staleness=1) as pipe,
    ):
        async for batch in pipe:
            await learner.call(Learner.update, batch, on=asyncexec.rank(0))
            await pipe.update_weights({"v": pipe.version + 1})
    shared.export(tmp_path / "rl.json")
    doc = json.loads((tmp_path / "rl.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["learner", "servers"]
    pid = {name: p for p, name in names.items()}
    calls = [e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") == "call"]
    assert {e["name"] for e in calls if e["pid"] == pid["learner"]} == {"Learner.update"}
    assert "Server.generate" in {e["name"] for e in calls if e["pid"] == pid["servers"]}
    threads = {
        e["args"]["name"]
        for e in doc["traceEvents"]
        if e["pid"] == pid["servers"] and e["name"] == "thread_name"
    }
    assert {"driver", "pipeline", "rank 0", "rank 1"} <= threads  # the pipeline: on its servers
    assert _partly_overlapping(doc) == []
    lanes_of_servers = {
        e["tid"] for e in calls if e["pid"] == pid["servers"] and e["tid"] >= LANE_TIDS
    }
    assert lanes_of_servers, "concurrent generate calls would share a slice"
    pytest.importorskip("matplotlib")
    shared.export(tmp_path / "rl.png")
    assert (tmp_path / "rl.png").stat().st_size > 0
