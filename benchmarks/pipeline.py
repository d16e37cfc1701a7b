"""The async RL pipeline's figures, side by side in one run.

    python benchmarks/pipeline.py            # about 80 s on 2 cores
    python benchmarks/pipeline.py --quick    # tiny sizes, one repeat: a smoke run (tests run it)

One Ray, one set of workers for every figure: 4 rollout servers (``SleepServer``, a
``RolloutServer`` whose decoding step is a sleep per token, a pause point every few tokens), a
trainer of 1 rank (an update is a sleep; its weights, 4 KB, go to the servers over a
WeightChannel), each worker ``{"CPU": 0.25}``. The repeats of every figure are interleaved (S = 0
and S = 1 alternate which goes first); the table shows the medians:

- **samples trained/s**: the same long-tailed workload (lognormal lengths, p99 / p50 about 13;
  the note prints the workload's own) through a strict pipeline with S = 0 (the synchronous
  loop: generate B, train, push) and with S = 1 (``on_update="keep"``; the default
  ``on_expire="requeue"``, and ``"wait"``), S = 1 aggregate and S = 2 strict, each batch
  trained (a fixed time) and followed by a push. The notes have, per run, the lengths trained
  (p50, p99) against the source's, the requests expired and the share of generation time they
  threw away.
- **samples beyond S**: over the S = 1 strict runs, samples whose oldest chunk is more than S
  versions behind the version the learner held when it took them (strict mode: 0; the notes
  have the most over every strict run).
- **pause to resume**: 256 long generations in flight over the servers (64 each); the time from
  ``router.pause(mode)`` to the end of ``router.resume()``, "keep" (the generations go on) and
  then "abort" (each ends at its pause point); no push in it ("the push apart"). The same
  through a pipeline (aggregate, S = 1, B = 128: 256 admitted): ``update_weights()`` with
  "abort" and then "keep", the pipeline's own figure (from the pause to the resume, the push
  apart).
- **one of 4 servers SIGKILLed**: long-tailed requests through the router, a push every tenth of
  them, the last server killed after a quarter: requests answered other than once (0); answers
  of the replacement that ran on a version older than the one every server held when they were
  sent (0);
  the replacement's first answer after the kill (a note).
- **balance**: uniform requests, half the capacity in flight: max / mean in flight per server,
  sampled every 5 ms (median of the samples; the note has the 99th percentile); **sticky
  sessions**: sessions of a few turns each, how many stayed on one server.
- **what a request in flight holds**: 256 long generations in flight through a Router, each
  awaited by a plain asyncio task: the objects the driver's collector tracks per request (what
  each collection of the older generations walks), the anyio task-group tasks (0: an attempt
  is a plain task in a cancel scope of its own) and the exceptions kept alive per request (0:
  none waits inside an ``except``); the baseline, a bare call of a plain async actor awaited
  the same way. Counted after a full collection, against the same with nothing in flight, once
  a repeat outside the heartbeat (the collections stall the loop).
- **event-loop max lag**: a 1 ms heartbeat through all of the above, against the same heartbeat
  while 4 plain actors stream reports (the batched floor of ``benchmarks/run.py``) for as long
  as the repeat's figures took; the max of each repeat (the table: their median) and the 99th
  percentile of the beats' lags. Equal durations, because the max of a heartbeat grows with
  the number of its beats (on 2 shared cores the OS deschedules the process now and then):
  one pass of the floor (``floor_steps``) streams for about 0.1 s against a repeat's 26 s, and
  its max was 1.4-1.8 ms where the same floor streaming for 26 s reached 5.6-7.4 ms. The
  notes keep the short floor's max (its first pass), the durations and the passes. The
  driver's garbage collections are recorded with them: the notes say the longest collection
  of the oldest generation and the max lag less the collections' time in it. For each beat
  more than 4 ms late the loop thread's CPU time over it (``time.thread_time()``) says
  whether the loop ran through the stall (CPU at least half the lag: the loop's own work, or
  Python's collections: what asyncexec can cut) or waited (the OS ran other processes, or
  another thread of the driver held the GIL): the notes count both and give each one's max.
  ``--gc-freeze`` freezes the driver's heap after start-up (``gc.freeze()``, as
  docs/operating.md advises).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import itertools
import math
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

import _harness
import _pipeline_phases
from _common import Collection, Heartbeat, gc_log, median, progress
from _harness import Result, Row, Table, fmt
from _pipeline_phases import (
    Sizes,
    balance,
    held_in_flight,
    kill_one,
    pause_resume,
    pipeline_pauses,
    sticky,
)
from _pipeline_workload import SleepServer, Trainer, tail_ratio, throughput
from _systems import LoopGroup

import asyncexec

RESOURCES = {"CPU": 0.25}
RAY_CPUS = 16
Mode = Literal["strict", "aggregate"]
FIGURES = ("throughput", "pause", "kill", "balance", "held", "lag")
FULL = Sizes(
    repeats=3,
    servers=4,
    batch=32,
    batches=20,
    train_s=0.05,
    token_s=0.002,
    chunk_tokens=4,
    max_in_flight=16,
    pause_in_flight=256,
    pause_chunk_s=0.02,
    kill_requests=400,
    balance_s=3.0,
    sessions=16,
    turns=5,
    floor_steps=20_000,
)
QUICK = Sizes(
    repeats=1,
    servers=4,
    batch=16,
    batches=6,
    train_s=0.05,
    token_s=0.002,
    chunk_tokens=4,
    max_in_flight=16,
    pause_in_flight=256,
    pause_chunk_s=0.02,
    kill_requests=120,
    balance_s=1.0,
    sessions=8,
    turns=3,
    floor_steps=5_000,
    floor_matched=False,
)  # (a smoke run: one pass of the floor)


def _row(
    label: str, target: str = "", check: Callable[[float, float, float], bool] | None = None
) -> Row:
    """A row of the baseline's and the pipeline's samples; ``check(baseline, pipeline, ratio)``
    on the medians decides the target."""

    def met(m: dict[str, float]) -> bool:
        assert check is not None
        b, p = m.get("baseline", math.nan), m["pipeline"]
        return check(b, p, p / b if b and not math.isnan(b) else math.nan)

    return Row(
        label,
        target=target,
        check=None if check is None else met,
        measured="pipeline",
        reference="baseline",
    )


#: The pipeline's table: no unit column (the tests read six cells a row).
TABLE = Table(
    [("baseline", "baseline"), ("pipeline", "pipeline")],
    [("baseline", "pipeline / baseline")],
    unit=False,
)


def make_rows() -> dict[str, Row]:
    return {
        "rate": _row(
            "samples trained/s, long-tailed workload (baseline: S = 0; pipeline: S = 1, "
            "strict, the default: expired samples requeued)",
            target=">= 1.8x",
            check=lambda b, p, r: r >= 1.8,
        ),
        "rate_k1": _row("the same, pipeline: S = 1, strict, max_requeues=1", target="-"),
        "rate_wait": _row('the same, pipeline: S = 1, strict, on_expire="wait"', target="-"),
        "rate_aggregate": _row("the same, pipeline: S = 1, aggregate mode", target="-"),
        "rate_s2": _row("the same, pipeline: S = 2, strict", target="-"),
        "beyond": _row(
            "samples beyond S, strict mode (baseline: S = 0; pipeline: S = 1)",
            target="0",
            check=lambda b, p, r: p == 0 and b == 0,
        ),
        "keep": _row(
            'pause to resume, "keep", 256 in flight, ms',
            target="<= 50 ms",
            check=lambda b, p, r: p <= 50,
        ),
        "abort": _row(
            'pause to resume, "abort", 256 in flight, ms',
            target="<= 50 ms",
            check=lambda b, p, r: p <= 50,
        ),
        "pipe_keep": _row(
            'update_weights() with 256 in flight, "keep", the push apart, ms',
            target="<= 50 ms",
            check=lambda b, p, r: p <= 50,
        ),
        "pipe_abort": _row(
            'update_weights() with 256 in flight, "abort", the push apart, ms',
            target="<= 50 ms",
            check=lambda b, p, r: p <= 50,
        ),
        "once": _row(
            "1 of 4 servers SIGKILLed: requests answered other than once",
            target="0",
            check=lambda b, p, r: p == 0,
        ),
        "stale": _row(
            "1 of 4 servers SIGKILLed: replacement's answers on an older version than delivered",
            target="0",
            check=lambda b, p, r: p == 0,
        ),
        "balance": _row(
            "balance: max / mean in flight per server, uniform load",
            target="<= 1.25",
            check=lambda b, p, r: p <= 1.25,
        ),
        "sticky": _row(
            "sticky sessions kept on their server (baseline: sessions)",
            target="all",
            check=lambda b, p, r: p == b,
        ),
        "held": _row(
            "objects the collector tracks per request in flight, 256 in flight (baseline: a "
            "bare actor call awaited by a task)",
            target="<= 60",
            check=lambda b, p, r: p <= 60,
        ),
        "held_tasks": _row(
            "anyio task-group tasks per request in flight (the same; its attempts are plain tasks)",
            target="0",
            check=lambda b, p, r: p == 0,
        ),
        "held_tracebacks": _row(
            "exceptions kept alive per request in flight (the same)",
            target="< 0.1",
            check=lambda b, p, r: p < 0.1,
        ),
        "lag": _row(
            "event-loop max lag through all of it, ms (baseline: the streaming floor, as long)",
            target="<= 1.5x",
            check=lambda b, p, r: r <= 1.5,
        ),
        "lag_p99": _row("event-loop lag, 99th percentile of the beats, ms (the same)", target="-"),
    }


#: A beat this late has the loop thread's CPU time over it recorded (``Watch.late``).
LATE_S = 0.004
#: A late beat whose loop thread ran for at least this share of its lag "ran" (the loop's
#: own work, or Python's: its collections); under it the thread "waited" (the OS ran other
#: processes on the 2 cores, or another thread of the driver held the GIL).
RAN_SHARE = 0.5


@dataclass
class Watch:
    """A 1 ms heartbeat's lags (seconds) with when each woke and, for each beat later than
    ``LATE_S``, ``(lag, CPU)``: the loop thread's CPU time (``time.thread_time()``) over the
    beat's span; and the driver's garbage collections meanwhile."""

    beat: Heartbeat
    collections: list[Collection]

    @property
    def lags(self) -> list[float]:
        return self.beat.lags

    def split(self) -> dict[str, float]:
        """The late beats by whether the loop thread ran through them (CPU >= ``RAN_SHARE`` of
        the lag) or waited: how many, their max lag (ms), and the CPU share over all of them."""
        late = self.beat.late
        ran = [lag for lag, cpu in late if cpu >= RAN_SHARE * lag]
        waited = [lag for lag, cpu in late if cpu < RAN_SHARE * lag]
        lag_sum = sum(lag for lag, _ in late)
        return {
            "ran": float(len(ran)),
            "waited": float(len(waited)),
            "ran_max_ms": max(ran, default=0.0) * 1e3,
            "waited_max_ms": max(waited, default=0.0) * 1e3,
            "cpu_share": sum(min(cpu, lag) for lag, cpu in late) / lag_sum if lag_sum else math.nan,
        }

    def p99(self) -> float:
        ordered = sorted(self.lags)
        return ordered[int(len(ordered) * 0.99)] if ordered else math.nan

    def longest_collection(self, generation: int) -> float:
        return max(
            (c.end - c.start for c in self.collections if c.generation == generation), default=0.0
        )

    def max_less_collections(self) -> float:
        """The max lag of the beats, each less the collections' time within its late span.

        The latest beats first, by lag, until a lag is below the best found (a beat's figure is
        at most its lag): a floor streaming for tens of seconds has tens of thousands of beats
        and of collections, which each against each took minutes."""
        spans = sorted((c.start, c.end) for c in self.collections)
        ends = list(itertools.accumulate((e for _, e in spans), max))  # sorted: bisect them
        best = 0.0
        for lag, end in sorted(zip(self.lags, self.beat.woke, strict=True), reverse=True):
            if lag <= best:
                break
            start = end - lag
            overlap = 0.0
            for s, e in spans[bisect.bisect_right(ends, start) :]:
                if s >= end:
                    break
                overlap += max(0.0, min(e, end) - max(s, start))
            best = max(best, lag - overlap)
        return best


@contextlib.asynccontextmanager
async def watched(interval_s: float = 0.001) -> AsyncIterator[Watch]:
    """A heartbeat (``_common.Heartbeat``, the CPU of beats later than ``LATE_S`` recorded) with
    the collections meanwhile."""
    with gc_log() as collections:
        async with Heartbeat(interval_s, late_s=LATE_S) as beat:
            yield Watch(beat, collections)


@dataclass
class Bench:
    """The open workers and what the repeats fill in."""

    sizes: Sizes
    servers: asyncexec.Executor
    trainer: asyncexec.Executor
    channel: asyncexec.WeightChannel
    floor: LoopGroup
    rows: dict[str, Row] = field(default_factory=lambda: make_rows())
    notes: dict[str, list[float]] = field(default_factory=dict)

    def note(self, key: str, value: float) -> None:
        self.notes.setdefault(key, []).append(value)

    async def throughput(self, i: int, lags: list[float]) -> None:
        runs: list[tuple[int, Mode, str, int, str]] = [
            (0, "strict", "requeue", 4, "rate"),
            (1, "strict", "requeue", 4, "rate"),
            (1, "strict", "requeue", 1, "rate_k1"),
            (1, "strict", "wait", 4, "rate_wait"),
            (1, "aggregate", "requeue", 4, "rate_aggregate"),
            (2, "strict", "requeue", 4, "rate_s2"),
        ]
        for staleness, mode, on_expire, requeues, key in runs if i % 2 == 0 else runs[::-1]:
            variant = {"rate_wait": ", wait", "rate_k1": ", max_requeues=1"}.get(key, "")
            name = f"S = {staleness}, {mode}{variant}"
            progress(f"repeat {i + 1}: throughput, {name}")
            got = await throughput(
                self.servers,
                self.trainer,
                self.channel,
                self.sizes,
                staleness,
                seed=i,
                mode=mode,
                on_expire=on_expire,
                max_requeues=requeues,
            )
            if staleness == 0:
                for row in ("rate", "rate_k1", "rate_wait", "rate_aggregate", "rate_s2"):
                    self.rows[row].of("baseline").append(got["rate"])
                self.rows["beyond"].of("baseline").append(got["beyond"])
            else:
                self.rows[key].of("pipeline").append(got["rate"])
            if key == "rate" and staleness == 1:
                self.rows["beyond"].of("pipeline").append(got["beyond"])
            self.note(f"trainer idle ratio, {name}", got["trainer_idle"])
            self.note(f"staleness max, {name}", got["staleness_max"])
            if mode == "aggregate":
                self.note(f"samples beyond S, {name}", got["beyond"])
            else:
                worst = "samples beyond S, every strict run, the most"
                self.notes[worst] = [max([*self.notes.get(worst, [0.0]), got["beyond"]])]
                self.note(f"requests expired, {name}", got["expired"])
                self.note(f"share of generation time expired, {name}", got["expired_share"])
            self.note(f"trained lengths p50, {name}", got["trained_p50"])
            self.note(f"trained lengths p99, {name}", got["trained_p99"])
            if staleness == 0:
                self.note("lengths the source gave, p50", got["given_p50"])
                self.note("lengths the source gave, p99", got["given_p99"])

    async def pause(self, i: int, lags: list[float]) -> None:
        progress(f"repeat {i + 1}: pause to resume")
        got = await pause_resume(self.servers, self.channel, self.sizes, lags)
        self.rows["keep"].of("pipeline").append(got["keep_ms"])
        self.rows["abort"].of("pipeline").append(got["abort_ms"])
        self.note('pause alone, "keep", ms', got["keep_pause_ms"])
        self.note('pause alone, "abort", ms', got["abort_pause_ms"])
        self.note("generations aborted", got["aborted"])
        self.note(
            '"abort": callers answered when the resume returned', got["abort_answered_at_resume"]
        )
        self.note(
            '"abort": the last caller answered, ms from the pause', got["abort_last_answer_ms"]
        )
        got_pipe = await pipeline_pauses(self.servers, self.channel, self.sizes)
        for mode in ("keep", "abort"):
            self.rows[f"pipe_{mode}"].of("pipeline").append(got_pipe[f"{mode}_ms"])
            self.note(f'the push in update_weights(), "{mode}", ms', got_pipe[f"{mode}_push_ms"])
        self.note("event-loop max lag while the 256 are sent, ms", got["sending_lag_ms"])
        for mode in ("keep", "abort"):
            self.note(f'event-loop max lag, "{mode}" pause to resume, ms', got[f"{mode}_lag_ms"])

    async def kill(self, i: int, lags: list[float]) -> None:
        progress(f"repeat {i + 1}: a server killed")
        got = await kill_one(self.servers, self.channel, self.sizes, seed=100 + i)
        self.rows["once"].of("pipeline").append(got["not_once"])
        self.rows["stale"].of("pipeline").append(got["stale_after"])
        self.note("the replacement's first answer after the kill, s", got["rejoined_s"])
        self.note("requests in the kill figure", got["requests"])
        self.note("the replacement's answers", got["replaced_answers"])
        self.note("duplicates dropped by the router", got["duplicates_dropped"])

    async def balance(self, i: int, lags: list[float]) -> None:
        progress(f"repeat {i + 1}: balance, sticky sessions")
        got = await balance(self.servers, self.sizes)
        self.rows["balance"].of("pipeline").append(got["ratio_p50"])
        self.note("balance max / mean, p99 of the samples", got["ratio_p99"])
        got = await sticky(self.servers, self.sizes)
        self.rows["sticky"].of("baseline").append(got["sessions"])
        self.rows["sticky"].of("pipeline").append(got["kept"])

    async def held(self, i: int) -> None:
        progress(f"repeat {i + 1}: what a request in flight holds")
        got = await held_in_flight(self.servers, self.floor.actors, self.sizes)
        for side, name in (("baseline", "floor"), ("pipeline", "router")):
            self.rows["held"].of(side).append(got[name]["objects"])
            self.rows["held_tasks"].of(side).append(got[name]["task_handles"])
            self.rows["held_tracebacks"].of(side).append(got[name]["tracebacks"])
        self.note("anyio cancel scopes per request in flight", got["router"]["cancel_scopes"])

    async def repeat(self, i: int, only: set[str]) -> None:
        """One repeat of the figures in ``only``, the pipeline's under one heartbeat, then the
        streaming floor under the same heartbeat, for as long as the pipeline's took (the max
        of a heartbeat grows with its beats: maxima over equal durations); the floor's first
        pass alone (``floor_steps``, a few seconds: the figure before) is a note."""
        t0 = time.perf_counter()
        async with watched(0.001) as watch:
            lags = watch.lags
            for name in FIGURES:
                if name in only and name not in ("held", "lag"):
                    mark = len(lags)
                    await getattr(self, name)(i, lags)
                    self.note(
                        f"event-loop max lag in {name}, ms", max(lags[mark:], default=0) * 1e3
                    )
        took = time.perf_counter() - t0
        if "held" in only:  # outside the heartbeat: its full collections stall the loop
            await self.held(i)
        if "lag" not in only:
            return
        progress(f"repeat {i + 1}: the streaming floor, {took:.0f} s")
        passes = 0
        async with watched(0.001) as floor:
            f0 = time.perf_counter()
            await self.floor.floor(self.sizes.floor_steps)
            first_s, first = time.perf_counter() - f0, len(floor.lags)
            passes = 1
            while self.sizes.floor_matched and time.perf_counter() - f0 < took:
                await self.floor.floor(self.sizes.floor_steps)
                passes += 1
            floor_s = time.perf_counter() - f0
        self.note("the pipeline's repeat under the heartbeat, s", took)
        self.note("the floor's first pass (the short floor), s", first_s)
        self.note("the floor streamed for, s", floor_s)
        self.note("the floor's passes", passes)
        self.note("the short floor's max lag (its first pass), ms", max(floor.lags[:first]) * 1e3)
        for label, got, side in (("", watch, "pipeline"), ("the floor: ", floor, "baseline")):
            self.rows["lag"].of(side).append(max(got.lags, default=math.nan) * 1e3)
            self.rows["lag_p99"].of(side).append(got.p99() * 1e3)
            self.note(
                f"{label}event-loop max lag less the garbage collections in it, ms",
                got.max_less_collections() * 1e3,
            )
            self.note(
                f"{label}longest collection of generation 2 (the whole heap), ms",
                got.longest_collection(2) * 1e3,
            )
            split = got.split()
            self.note(
                f"{label}beats over {LATE_S * 1e3:g} ms where the loop thread ran "
                f"(CPU >= {RAN_SHARE:.0%} of the lag)",
                split["ran"],
            )
            self.note(f"{label}the same, where it waited (CPU below that)", split["waited"])
            self.note(f"{label}the max lag of the beats it ran through, ms", split["ran_max_ms"])
            self.note(
                f"{label}the max lag of the beats it waited through, ms", split["waited_max_ms"]
            )
            self.note(f"{label}the loop thread's CPU / lag over the late beats", split["cpu_share"])


async def bench(
    sizes: Sizes, only: set[str], freeze: bool, diagnose: bool = False
) -> tuple[list[Row], list[str]]:
    floor = LoopGroup(4, RESOURCES, 1024)
    await floor.start()
    _pipeline_phases.COUNT_OBJECTS = diagnose
    role = asyncexec.Role(SleepServer, sizes.token_s, sizes.chunk_tokens)
    try:
        async with (
            asyncexec.Executor(
                sizes.servers,
                name="servers",
                resources_per_worker=RESOURCES,
                roles=role,
                restart=asyncexec.RestartPolicy(max_restarts=2 * sizes.repeats),
            ) as servers,
            asyncexec.Executor(
                1,
                name="trainer",
                resources_per_worker=RESOURCES,
                roles=asyncexec.Role(Trainer, 1024),
            ) as trainer,
            asyncexec.WeightChannel(trainer, servers) as channel,
        ):
            await channel.push()
            if freeze:  # what start-up made is never walked by a collection again
                gc.collect()
                gc.freeze()
            b = Bench(sizes, servers, trainer, channel, floor)
            for i in range(sizes.repeats):
                await b.repeat(i, only)
    finally:
        await floor.close()
        if _pipeline_phases.KINDS:
            top = (+_pipeline_phases.KINDS).most_common(25)  # (+: the kinds that grew)
            each = sizes.pause_in_flight * sizes.repeats
            print("\nobjects a request in flight holds, by kind (256 in flight less before):")
            print("\n".join(f"  {n / each:6.1f} {k}" for k, n in top))
            for title, kinds in (
                ("tracebacks", _pipeline_phases.TRACEBACKS),
                ("closures", _pipeline_phases.CELLS),
            ):
                print(f"{title} held by the 256 in flight, the commonest (over the repeats):")
                print("\n".join(f"  {n:6d} {k}" for k, n in (+kinds).most_common(10)))
    p50, p99 = tail_ratio(0)
    said = [
        f"- the workload's lengths: p50 {p50:.0f}, p99 {p99:.0f} tokens "
        f"(p99 / p50 {p99 / p50:.1f}), {sizes.token_s * 1e3:.0f} ms a token, "
        f"{sizes.chunk_tokens} tokens a chunk; B = {sizes.batch}, {sizes.batches} batches a "
        f"run, {sizes.train_s * 1e3:.0f} ms a training step"
    ]
    said += [
        f"- {k}: {fmt(median(v))}"
        + (
            f" (each repeat: {', '.join(f'{x:.1f}' for x in v)})"
            if "lag in" in k or "floor" in k or "beats" in k
            else ""
        )
        for k, v in b.notes.items()
    ]
    lag = b.rows["lag"]
    if lag.of("pipeline"):
        each = ", ".join(
            f"{p:.1f} / {f:.1f}"
            for p, f in zip(lag.of("pipeline"), lag.of("baseline"), strict=False)
        )
        said.append(f"- event-loop max lag each repeat, pipeline / floor, ms: {each}")
    return [r for r in b.rows.values() if any(r.values.values())], said


async def run(sizes: Sizes, args: argparse.Namespace) -> Result:
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.train_ms is not None:
        sizes = dataclasses.replace(sizes, train_s=args.train_ms / 1e3)
    rows, notes = await bench(sizes, args.only, args.gc_freeze, args.diagnose)
    return Result(rows, TABLE, notes)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-ms", type=float, help="the training step's time (50 ms)")
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() the driver's heap after start-up"
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="with the 'held' figure, print the commonest kinds of the objects a request in "
        "flight holds (where the loop stalls: loop_stalls.py)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        help="sys.setswitchinterval() of the driver (Python's default: 5 ms)",
    )


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec pipeline benchmark",
        full=FULL,
        quick=QUICK,
        run=run,
        ray={"num_cpus": RAY_CPUS, "fresh_workers": False},
        figures=FIGURES,
        options=_options,
        about=lambda sizes, args: (
            f"medians of {sizes.repeats} repeat(s); every worker {RESOURCES}"
            f"{'; the heap frozen after start-up' if args.gc_freeze else ''}"
            f"; switch interval {sys.getswitchinterval() * 1e3:g} ms"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
