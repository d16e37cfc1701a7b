"""The report path made cheaper still delivers everything a step carried: each rank's metrics,
the weight versions, the arrivals, skew and durations (each duration the gap between the rank's
consecutive ``report()`` calls), and checkpoints on the step that reported them, under one rank
and several, on Ray actors and in local mode; and a batch of many steps of a few ranks makes no
object per step (their metrics travel as one list per rank)."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import time
from array import array
from pathlib import Path
from typing import Any

import pytest

import asyncexec
from asyncexec import Report, Step
from asyncexec._driver.run._steps import StepBatch
from asyncexec._driver.run._window import BATCH, Assembly
from asyncexec._wire import _checkpoint
from asyncexec._wire._protocol import Outcome, Poll, ReportTimes

STEPS = 12
CHECKPOINT_ONE = 5  # the last rank alone reports a checkpoint here
CHECKPOINT_ALL = 9  # every rank does here


def _version(rank: int, i: int) -> int | None:
    """The weight version rank ``rank`` holds at its report ``i`` (none before report 2)."""
    return None if i < 2 else rank * 100 + i // 3


def _sleep_s(rank: int, i: int) -> float:
    return 0.002 * (rank + 1) + (0.01 if i % 4 == 3 else 0.0)


def every_field(config: dict[str, Any]) -> None:
    """Reports STEPS steps; each report's metrics hold when the rank called ``report()``."""
    from asyncexec._worker._place import set_report_version

    ctx = asyncexec.get_context()
    rank, last = ctx.world_rank, ctx.world_size - 1
    for i in range(STEPS):
        time.sleep(_sleep_s(rank, i))
        set_report_version(_version(rank, i))
        checkpoint = None
        if i == CHECKPOINT_ALL or (i == CHECKPOINT_ONE and rank == last):
            folder = os.path.join(config["dir"], f"r{rank}-s{i}")
            os.makedirs(folder, exist_ok=True)
            checkpoint = asyncexec.Checkpoint.from_directory(folder)
        called = time.monotonic()
        asyncexec.report({"i": i, "rank": rank, "called": called}, checkpoint=checkpoint)
    set_report_version(None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [1, 3])
async def test_a_step_carries_every_field_of_every_rank(
    mode: str, ranks: int, tmp_path: Any
) -> None:
    async with asyncexec.Executor(
        ranks, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path / "store")
    ) as executor:
        run = executor.run(every_field, {"dir": str(tmp_path / "src")})
        steps = [step async for step in run]
    assert [s.index for s in steps] == list(range(STEPS))
    for i, step in enumerate(steps):
        assert step.attempt == 1 and step.rank is None and step.preemption is None
        assert [r.rank for r in step.reports] == list(range(ranks))
        assert [(r.metrics["i"], r.metrics["rank"]) for r in step.reports] == [
            (i, r) for r in range(ranks)
        ]
        assert step.metrics is step.reports[0].metrics
        expected = tuple(_version(r, i) for r in range(ranks))
        assert step.versions == expected
        assert tuple(r.version for r in step.reports) == expected
        # Checkpoints on the step that reported them, with the ranks that did.
        if i in (CHECKPOINT_ONE, CHECKPOINT_ALL):
            assert step.checkpoint is not None
            holders = range(ranks) if i == CHECKPOINT_ALL else [ranks - 1]
            assert [r.rank for r in step.reports if r.checkpoint is not None] == list(holders)
            assert all(r.checkpoint == step.checkpoint for r in step.reports if r.checkpoint)
        else:
            assert step.checkpoint is None
            assert all(r.checkpoint is None for r in step.reports)
        # Arrivals and skew: every rank, the first at 0, the skew the largest.
        arrivals = step.arrivals
        assert sorted(arrivals) == list(range(ranks))
        assert min(arrivals.values()) == 0.0
        assert step.skew == pytest.approx(max(arrivals.values()))
        # Durations: the gap between the rank's consecutive report() calls (its first from the
        # function's start), at least what it slept.
        durations = step.durations
        assert sorted(durations) == list(range(ranks))
        for r in range(ranks):
            assert durations[r] >= _sleep_s(r, i) * 0.9
            if i > 0:
                gap = step.reports[r].metrics["called"] - steps[i - 1].reports[r].metrics["called"]
                # Checkpoint persistence is not the function's time: the step after one is
                # timed from the end of its report() call.
                if i - 1 in (CHECKPOINT_ONE, CHECKPOINT_ALL):
                    assert durations[r] <= gap + 0.005
                else:
                    assert durations[r] == pytest.approx(gap, abs=0.005)
        # Arrivals match the times the ranks called report(), placed on one clock.
        if ranks > 1 and mode == "local":  # one process: one clock for every rank
            called = [r.metrics["called"] for r in step.reports]
            for r in range(ranks):
                assert arrivals[r] == pytest.approx(called[r] - min(called), abs=0.005)
    assert run.result.checkpoint == steps[CHECKPOINT_ALL].checkpoint


# The assembly, without workers ---------------------------------------------------------------


def _poll(first: int, n: int, rank: int, **extra: Any) -> Poll:
    reports = [{"i": first + k, "rank": rank} for k in range(n)]
    calls = array("d", [10.0 * rank + first + k for k in range(n)])
    busy = array("d", [0.001 * (rank + 1) * (k + 1) for k in range(n)])
    return Poll(reports, None, None, times=ReportTimes(calls, busy, 100.0).pack(), **extra)


def _assembled(ranks: int, steps: int, versions: bool = False) -> list[StepBatch]:
    asm = Assembly(ranks, 1, 7)
    for rank in range(ranks):
        marks = [(0, rank), (steps // 2, rank + 10)] if versions else None
        asm.add(rank, _poll(0, steps, rank, versions=marks))
        asm.add(rank, Poll([], {steps // 2: f"/ckpt/{rank}"} if rank == 0 else None, Outcome("ok")))
    batches = []
    while asm.ready:
        batches.append(asm.take(BATCH))
    return batches


@pytest.mark.parametrize(("ranks", "steps"), [(1, 300), (3, 40), (5, 2)])
def test_assembled_steps_carry_each_ranks_metrics_versions_times_and_checkpoints(
    ranks: int, steps: int
) -> None:
    """Columns (many steps of a few ranks) and rows (a few steps of many) read alike."""
    batches = _assembled(ranks, steps, versions=True)
    assert sum(map(len, batches)) == steps
    all_steps = [b.step(i) for b in batches for i in range(len(b))]
    for i, step in enumerate(all_steps):
        assert step.index == 7 + i and step.attempt == 1
        assert step.metrics == {"i": i, "rank": 0}
        assert [r.metrics for r in step.reports] == [{"i": i, "rank": r} for r in range(ranks)]
        held = tuple(r if i < steps // 2 else r + 10 for r in range(ranks))
        assert step.versions == held
        assert [r.version for r in step.reports] == list(held)
        assert step.durations == {r: pytest.approx(0.001 * (r + 1) * (i + 1)) for r in range(ranks)}
        # Every rank's clock is placed on the driver's by its own offset, so its report times
        # keep their order: rank r called report() 10 * r seconds after rank 0 (to within the
        # time between the polls' arrivals, each of which sets its rank's offset).
        assert step.arrivals == {r: pytest.approx(10.0 * r, abs=0.01) for r in range(ranks)}
        assert step.skew == pytest.approx(10.0 * (ranks - 1), abs=0.01)
        if i == steps // 2:
            assert step.checkpoint is not None and step.checkpoint.path == "/ckpt/0"
            assert step.reports[0].checkpoint == step.checkpoint
            assert all(r.checkpoint is None for r in step.reports[1:])
        else:
            assert step.checkpoint is None
    # A batch cut in parts keeps every field.
    whole = batches[0]
    parts = whole.split(7)
    again = [p.step(i) for p in parts for i in range(len(p))]
    assert [s.index for s in again] == [s.index for s in all_steps[: len(whole)]]
    assert [s.reports for s in again] == [s.reports for s in all_steps[: len(whole)]]
    assert [s.durations for s in again] == [s.durations for s in all_steps[: len(whole)]]


def test_setting_a_field_of_one_step_leaves_the_others_of_its_batch() -> None:
    (batch,) = _assembled(2, 6)
    steps = [batch.step(i) for i in range(len(batch))]
    steps[3].index = 99
    steps[2].checkpoint = asyncexec.Checkpoint("/elsewhere")
    steps[2].attempt = 5
    assert [s.index for s in steps] == [7, 8, 9, 99, 11, 12]
    assert steps[2].checkpoint.path == "/elsewhere" and steps[2].attempt == 5
    assert [s.attempt for s in steps] == [1, 1, 5, 1, 1, 1]
    assert steps[3].metrics == {"i": 3, "rank": 0} and steps[3].durations[1] > 0
    assert steps[3].checkpoint is not None  # step 3 carried rank 0's checkpoint
    assert all(s.checkpoint is None for s in steps if s.index not in (9, 99))


def test_a_step_made_by_hand_and_a_pickled_one_read_as_before() -> None:
    reports = [Report(0, {"a": 1}, None, 3), Report(1, {"a": 2}, asyncexec.Checkpoint("/c"), 4)]
    step = Step(4, 2, reports, asyncexec.Checkpoint("/c"), None)
    assert (step.index, step.attempt, step.metrics, step.versions) == (4, 2, {"a": 1}, (3, 4))
    assert step.reports is reports and step.checkpoint == asyncexec.Checkpoint("/c")
    assert (step.arrivals, step.durations, step.skew, step.rank) == ({}, {}, 0.0, None)
    one = Step(0, 1, [Report(2, {"b": 0})], rank=2)
    assert one.rank == 2 and one.arrivals == {2: 0.0}
    (batch,) = _assembled(3, 4, versions=True)
    for original in (step, one, batch.step(2)):
        copy = pickle.loads(pickle.dumps(original))
        assert (copy.index, copy.attempt, copy.reports, copy.versions, copy.checkpoint) == (
            original.index,
            original.attempt,
            original.reports,
            original.versions,
            original.checkpoint,
        )


def test_the_stage_table_names_every_stage_for_both_systems() -> None:
    """``benchmarks/report_stages.py`` (no Ray without ``--transfer``) prints a row a stage."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import report_stages
    finally:
        sys.path.pop(0)
    lines = report_stages.measure(report_stages.PER_POLL * 2, 1, False)
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    for stage in report_stages.STAGES:
        assert stage in rows, stage
    assert rows["transfer"].count("-") == 4  # not measured without Ray
    totals = [float(c.strip(" *")) for c in rows["**total**"].split("|")[2:6]]
    assert all(t > 0 for t in totals), totals
    [made] = [line for line in lines if line.startswith("Objects the collector tracks")]
    assert "asyncexec " in made and "floor " in made, made


# When a rank is polled ----------------------------------------------------------------------


#: The consumer's linger in the tests of the first poll (see ``_first_poll_room``).
LINGER_S = 1.0


async def _first_poll_room(
    monkeypatch: pytest.MonkeyPatch, window: int, freed_after_s: float | None
) -> tuple[int, float]:
    """Run ``pump`` until its first poll, with three quarters of a ``window`` free and the
    consumer freeing the rest after ``freed_after_s`` (never: None); the poll's room and when
    it was sent. The consumer's linger is :data:`LINGER_S` here, not its 0.5 ms: on a loaded
    machine a timer of 50 µs could fire after one of 0.5 ms (the test failed so, beside the
    Ray tiers), where 0.05 s against 1 s cannot."""
    import anyio

    from asyncexec._driver.run import _window

    monkeypatch.setattr(_window, "CONSUMER_LINGER_S", LINGER_S)

    consumed = anyio.Event()
    sent: list[tuple[int, float]] = []
    least = _window.min_poll(window)

    async def submit(calls: Any, ack: int, room: int) -> Poll:
        sent.append((room, time.perf_counter()))
        return Poll([], None, Outcome("ok"))

    async def take(poll: Poll) -> None:
        pass

    async def changed() -> None:
        await consumed.wait()

    monkeypatch.setattr(_window, "submit", submit)
    credit = {"room": least}

    async def free() -> None:
        assert freed_after_s is not None
        await anyio.sleep(freed_after_s)
        credit["room"] = window
        consumed.set()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        if freed_after_s is not None:
            tg.start_soon(free)
        await _window.pump(
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            lambda: credit["room"],
            lambda: 0,
            changed,
            lambda: least,
            take,
            window,
        )
        tg.cancel_scope.cancel()
    room, at = sent[0]
    return room, at - t0


@pytest.mark.timeout(10)
async def test_a_large_window_is_polled_whole_when_the_consumer_frees_it_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The consumer takes its last batch within the linger: the poll carries the whole
    window, not three quarters of it."""
    room, _ = await _first_poll_room(monkeypatch, 1024, LINGER_S / 20)
    assert room == 1024


@pytest.mark.timeout(10)
async def test_a_slow_consumer_delays_the_poll_by_the_linger_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    room, after = await _first_poll_room(monkeypatch, 1024, None)
    assert room == 768
    assert LINGER_S * 0.9 <= after < LINGER_S * 3  # (no consumer ever frees the rest)


@pytest.mark.timeout(10)
async def test_a_small_window_is_polled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window whose last quarter is less than a batch (latency counts more there) is
    polled as soon as three quarters of it is free."""
    room, after = await _first_poll_room(monkeypatch, 16, None)
    assert room == 12 and after < LINGER_S / 2


def test_the_stage_table_refuses_fewer_reports_than_a_poll(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``report_stages.py --reports N`` below one poll's reports is refused before anything is
    measured (the round trip moves whole polls: it would time none)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import report_stages
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit):
        report_stages.main(["--reports", str(report_stages.PER_POLL - 1), "--transfer"])
    assert "--reports takes" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_a_checkpoint_copy_that_fails_leaves_no_part_of_a_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The half-written ``.partial`` file of a copy that failed (a full disk) stayed in the
    persisted checkpoint's folder."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "model.bin").write_bytes(b"x" * 4096)

    def full_disk(src: Path, dst: Path) -> None:
        Path(dst).write_bytes(Path(src).read_bytes()[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copy2", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _checkpoint.persist_directory(source, tmp_path / "persisted")
    assert list((tmp_path / "persisted").iterdir()) == []
