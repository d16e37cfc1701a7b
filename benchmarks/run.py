"""asyncexec's performance, side by side with Ray Train's first executor, in one run.

    python benchmarks/run.py                   # the full run: a few minutes on 2 cores
    python benchmarks/run.py --quick           # tiny sizes, one repeat: a smoke run
    python benchmarks/run.py --only lifecycle  # only the lifecycle lag rows: about a minute
    python benchmarks/run.py --only reports    # only the reports/s rows, 1/4/16 workers
    python benchmarks/run.py --only channel,outlive  # the parts named (PARTS below)

It starts one local Ray (and shuts it down at the end) and measures, for each figure, Ray Train
v1's ``BackendExecutor`` (``RAY_TRAIN_V2_ENABLED=0``), two hand-written asyncio loops over plain
actors where they apply (lockstep: one call per worker per step; the bare batched floor: a
thread per worker fills a bounded deque, long polls drain it), and asyncexec. It prints one table
of medians over repeats with asyncexec's ratios and the issue's targets, then where the time goes.
The event-loop lag through whole lifecycles (several executors entering, streaming, losing a
worker, restarting, finishing and closing in one loop) is measured by ``_lifecycle.py``; weights
moved from one executor to another (WeightChannel, a hand-written gloo broadcast, the driver) by
``_channel.py``.

Every system runs in the same Ray instance, one measurement at a time, with the repeats of
different systems interleaved, so that the machine's noise falls on all of them alike. Ray's
pre-started worker processes are switched off, so every worker of every system is a fresh
process: no system gets one of the few warm processes that whoever comes first would get.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import Any

import _harness

# Ray Train's first executor is only reachable with V2 switched off (before Ray starts).
os.environ["RAY_TRAIN_V2_ENABLED"] = "0"

import ray
import structlog
from _channel import measure_channel, measure_version_lag
from _common import (
    Events,
    Timer,
    gc_log,
    heartbeat,
    lag_ms,
    median,
    process_memory,
    progress,
)
from _figures import (
    CHANNEL_KEYS,
    FULL,
    LIFECYCLE_KEYS,
    LOCAL_KEYS,
    OUTLIVE_KEYS,
    QUICK,
    TABLE,
    Sizes,
    make_figures,
    warm_figures,
)
from _lifecycle import measure_lifecycle
from _outlive import measure_independent, measure_resume
from _raytrain import RayTrainClient
from _service import measure_service_first_event
from _systems import AsyncexecGroup, LoopGroup, kill_actors, plain_actors_ready
from _warm import measure_warm

from asyncexec._driver._config import DEFAULT_BUFFER_SIZE

#: Every worker of every system asks for this, so that 3 groups of 16 fit in the Ray started here.
RESOURCES = {"CPU": 0.25}
#: Logical CPUs of the Ray started here (the machine may have fewer cores).
RAY_CPUS = 16
#: The batched floor's deque bound. It bounds only the reports waiting in the floor's worker: a
#: poll empties the deque, and the worker makes as many again while the answer travels and is
#: consumed, so the floor has up to twice this in flight per worker. asyncexec's window
#: (``buffer_size``, 2048 by default, not set here) bounds every report the consumer has not
#: taken, wherever it is: the two systems run with as many reports in flight.
BUFFER = 1024

#: The parts of a run, in the order they run: what each measures (``--only`` takes their names;
#: every part by default) and its rows, by key.
PARTS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "startup": (
        "start-up, worker memory and the loop's freeze while starting, 4 workers",
        lambda key: key in ("startup", "uss", "rss", "freeze_start"),
    ),
    "warm": (
        "executors leased from a WorkerPool and the service's first event",
        lambda key: key in {f.key for f in warm_figures()},
    ),
    "channel": (
        "the weight channel (a state moved between executors, version lag through SIGKILLs, "
        "loop lag during pushes)",
        lambda key: key in CHANNEL_KEYS,
    ),
    "outlive": (
        "runs that outlive failures (independent ranks, driver-death resume)",
        lambda key: key in OUTLIVE_KEYS,
    ),
    "local": (
        "local mode (start-up and reports/s beside Ray actors)",
        lambda key: key in LOCAL_KEYS,
    ),
    "reports": (
        "reports/s (1, 4 and 16 workers) and its cost with metrics on",
        lambda key: key.startswith("rate") or key == "metrics_cost",
    ),
    "runs": (
        "on the groups of 4 workers: run end, the loop's lag over whole runs, driver memory, "
        "restart after SIGKILL",
        lambda key: (
            key in ("run_end", "lag_p99", "lag_max", "driver_mem") or key.startswith("restart")
        ),
    ),
    "lifecycle": (
        "the event-loop lag through whole lifecycles (about a minute alone)",
        lambda key: key in LIFECYCLE_KEYS,
    ),
}
#: The parts with a Ray Train column.
RAY_TRAIN_PARTS = {"startup", "reports", "runs"}


class Bench:
    """One benchmark run: its sizes, figures, notes on where the time goes, and its own timer."""

    def __init__(self, sizes: Sizes, events: Events, *, parts: Collection[str] = PARTS) -> None:
        self.sizes = sizes
        self.parts = set(parts)
        self.lifecycle_notes: list[str] = []
        self.channel_notes: list[str] = []
        self.rt: RayTrainClient | None = None
        self.figures = make_figures(sizes)
        self.events = events
        self.timer = Timer()
        self.where: dict[str, list[float]] = {}
        self.storage = tempfile.mkdtemp(prefix="asyncexec-bench-")

    def note(self, key: str, value: float) -> None:
        self.where.setdefault(key, []).append(value)

    def add(self, figure: str, column: str, value: float) -> None:
        self.figures[figure].add(column, value)

    # Start-up and worker memory -----------------------------------------------------------------

    async def startup(self) -> None:
        """Start 4 workers of each system (fresh each repeat); time it, take each worker's memory
        before any function runs, and record how long the event loop froze meanwhile.

        A first round is not recorded (none in the quick run, ``Sizes.warmups``): it pays
        one-time costs (exporting each actor class to the cluster, cold file caches) that a
        long-lived application pays once, not per start.
        """
        warmups = self.sizes.warmups
        for i in range(self.sizes.startup_repeats + warmups):
            record = i >= warmups
            which = f"repeat {i - warmups + 1}" if record else "warm-up"
            progress(f"start-up and worker memory, 4 workers, {which}")
            figures: list[tuple[str, str, float]] = []
            memory: list[tuple[str, list[int]]] = []

            async with heartbeat() as lags:
                seconds, pids, actors = await plain_actors_ready(4, RESOURCES)
            figures += [("startup", "floor", seconds), ("freeze_start", "floor", lag_ms(lags)[1])]
            memory.append(("floor", pids))
            if record:
                self._memory(memory)
            await kill_actors(actors)

            if self.rt is not None:
                # Its driver calls start() on its event loop's thread and times the freeze.
                started = await self.rt.call("start", n=4)
                figures += [
                    ("startup", "raytrain", started["seconds"]),
                    ("freeze_start", "raytrain", started["freeze_ms"]),
                ]
                if record:
                    self._memory([("raytrain", started["pids"])])
                await self.rt.call("shutdown")

            ae = AsyncexecGroup(4, RESOURCES, self.storage)
            mark = self.events.mark()
            async with heartbeat() as lags:
                seconds = await ae.start()
            figures += [
                ("startup", "asyncexec", seconds),
                ("freeze_start", "asyncexec", lag_ms(lags)[1]),
            ]
            if record:
                self._memory([("asyncexec", ae.pids())])
                self._startup_phases(mark)
                for figure, column, value in figures:
                    self.add(figure, column, value)
            await ae.close()

    def _memory(self, groups: list[tuple[str, list[int]]]) -> None:
        """Each group's median worker RSS and USS."""
        for column, pids in groups:
            mems = [process_memory(pid) for pid in pids]
            self.add("rss", column, median([m[0] for m in mems]))
            self.add("uss", column, median([m[1] for m in mems]))

    def _startup_phases(self, mark: int) -> None:
        for event, key in (
            ("placement_ready", "ae_placement_ready"),
            ("workers_ready", "ae_workers_ready"),
            ("group_started", "ae_group_started"),
        ):
            for _, fields in self.events.since(mark, event):
                if "seconds" in fields:
                    self.note(key, float(fields["seconds"]))

    # Streaming and the rest, per worker count ---------------------------------------------------

    async def groups(self, n: int) -> None:
        """Start each system's group of ``n`` workers once and measure on it: the reports/s
        and, on 4 workers, the ``runs`` part."""
        sizes = self.sizes
        rt = self.rt
        loops = LoopGroup(n, RESOURCES, BUFFER)
        ae = AsyncexecGroup(n, RESOURCES, self.storage)
        try:
            progress(f"starting the groups of {n} worker(s)")
            with self.timer.section(f"start groups of {n}"):
                if rt is not None:
                    await rt.call("start", n=n)
                await loops.start()
                await ae.start()
            if "reports" in self.parts:
                progress(f"reports/s, {n} worker(s)")
                with self.timer.section(f"reports/s, {n} workers"):
                    await self.stream(n, rt, loops, ae)
            if n == 4 and "runs" in self.parts:
                progress("run end")
                with self.timer.section("run end"):
                    await self.run_end(rt, loops, ae)
                progress("event-loop lag")
                with self.timer.section("event-loop lag"):
                    await self.lag(rt, loops, ae)
                progress("driver memory")
                with self.timer.section("driver memory"):
                    samples = await ae.driver_memory(
                        sizes.memory_steps, sizes.memory_every, sizes.memory_warmup
                    )
                    self.add("driver_mem", "asyncexec", samples[-1] - samples[0])
                    self.note("driver_rss_first", samples[0])
                    self.note("driver_rss_peak_minus_first", max(samples) - samples[0])
                progress("restart after SIGKILL")
                with self.timer.section("restart"):
                    await self.restart(rt, ae)
        finally:
            progress(f"stopping the groups of {n} worker(s)")
            with self.timer.section(f"stop groups of {n}"):
                await ae.close()
                await loops.close()
                if rt is not None:
                    await rt.call("shutdown")

    async def local_mode(self) -> None:
        """Local mode beside the same executor on Ray actors: entering an executor of 4 ranks
        and the reports/s of tiny reports, interleaved repeats (the first round of each is not
        recorded: it pays imports and the actor class's export; none in the quick run)."""
        n = 4

        async def one(local: bool) -> tuple[float, float]:
            ae = AsyncexecGroup(n, RESOURCES, self.storage, local=local)
            try:
                seconds = await ae.start()
                return seconds, (await ae.stream(self.sizes.steps[n]))["rate"]
            finally:
                await ae.close()

        await _harness.repeat(
            [self.figures["local_start"], self.figures["local_rate"]],
            {"floor": lambda: one(False), "asyncexec": lambda: one(True)},
            self.sizes.repeats,
            warm=self.sizes.warmups,
            name="local mode, 4 ranks",
        )

    async def stream(
        self, n: int, rt: RayTrainClient | None, loops: LoopGroup, ae: AsyncexecGroup
    ) -> None:
        """The reports/s of each system's group of ``n``. The groups are fresh: a first,
        unrecorded run of each (a tenth of its steps; none in the quick run) pays what a first
        run pays (asyncexec's workers fetch its function, which the floor's actors have from
        their class); then the repeats, the systems' order reversed every other repeat, the
        metrics run right after asyncexec's."""
        sizes = self.sizes
        key = f"rate{n}"
        steps = {
            "raytrain": sizes.raytrain_steps[n],
            "lockstep": sizes.lockstep_steps[n],
            "floor": sizes.steps[n],
            "asyncexec": sizes.steps[n],
        }
        systems: dict[str, Callable[[int], Awaitable[dict[str, float]]]] = {}
        if rt is not None:
            systems["raytrain"] = lambda count: rt.call("stream", steps=count)
        systems |= {"lockstep": loops.lockstep, "floor": loops.floor, "asyncexec": ae.stream}
        for _ in range(sizes.warmups):
            for name, run in systems.items():
                await run(max(10, steps[name] // 10))
        for i in range(sizes.repeats):
            measured: dict[str, dict[str, float]] = {}
            for name in list(systems)[:: -1 if i % 2 else 1]:
                measured[name] = await systems[name](steps[name])
                if name == "asyncexec" and n == 4:  # the same with metrics on, right after it
                    with metrics_on():
                        metered = await ae.stream(sizes.steps[n])
                    self.add("metrics_cost", "floor", measured["asyncexec"]["rate"])
                    self.add("metrics_cost", "asyncexec", metered["rate"])
            for column, m in measured.items():
                self.add(key, column, m["rate"])
                if n == 4:
                    self.note(f"{column}_driver_cpu_us", m["driver_cpu_us"])
                    self.note(f"{column}_worker_cpu_us", m["worker_cpu_us"])

    async def run_end(
        self, rt: RayTrainClient | None, loops: LoopGroup, ae: AsyncexecGroup
    ) -> None:
        async def raytrain() -> float:
            assert rt is not None
            return float(await rt.call("run_end", steps=3)) * 1e3

        async def floor() -> float:
            return (await loops.floor(3, timed=True))["run_end"] * 1e3

        async def ours() -> float:
            return await ae.run_end(3) * 1e3

        systems = {"floor": floor, "asyncexec": ours}
        if rt is not None:
            systems["raytrain"] = raytrain
        figure = [self.figures["run_end"]]
        await _harness.repeat(figure, systems, self.sizes.run_end_repeats, warm=0)

    async def lag(self, rt: RayTrainClient | None, loops: LoopGroup, ae: AsyncexecGroup) -> None:
        """Heartbeat lag over whole runs (from the run's start to its end) at full rate. Ray
        Train's is measured in its own driver, which drives the executor from a coroutine."""
        sizes = self.sizes
        if rt is not None:
            lag = await rt.call("lag", steps=sizes.raytrain_lag_steps)
            self.add("lag_p99", "raytrain", lag["p99_ms"])
            self.add("lag_max", "raytrain", lag["max_ms"])
            self.note("raytrain_lag_samples", lag["samples"])
        runs: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("lockstep", lambda: loops.lockstep(sizes.lockstep_steps[4])),
            ("floor", lambda: loops.floor(sizes.lag_steps)),
            ("asyncexec", lambda: ae.stream(sizes.lag_steps)),
        ]
        for column, run in runs:
            with gc_log() as collections:
                async with heartbeat() as lags:
                    await run()
            full = [c.end - c.start for c in collections if c.generation == 2]
            self.note(f"{column}_gc_full", len(full))
            self.note(f"{column}_gc_full_max_ms", max(full, default=0.0) * 1e3)
            self.note(f"{column}_gc_all_ms", sum(c.end - c.start for c in collections) * 1e3)
            p99, worst = lag_ms(lags)
            self.add("lag_p99", column, p99)
            self.add("lag_max", column, worst)
            self.note(f"{column}_lag_samples", len(lags))

    async def restart(self, rt: RayTrainClient | None, ae: AsyncexecGroup) -> None:
        spared = AsyncexecGroup(4, RESOURCES, self.storage, spares=1)
        await spared.start()
        try:
            for _ in range(self.sizes.restart_repeats):
                if rt is not None:
                    r = await rt.call("restart", kill_after=5, period_s=0.01, resume_steps=5)
                    for key in ("restart", "restart_reuse", "restart_spare", "restart_default"):
                        self.add(key, "raytrain", r["first_step"])
                    self.note("rt_restart_group_restarted", r["group_restarted"])
                mark = self.events.mark()
                a = await ae.restart(5, 0.01, 5)
                self.add("restart", "asyncexec", a["first_step"])
                self._restart_phases(mark, a["t_kill"])
                b = await ae.restart(5, 0.01, 5, reuse=True)
                self.add("restart_reuse", "asyncexec", b["first_step"])
                c = await ae.restart(5, 0.01, 5, default_wait=True)
                self.add("restart_default", "asyncexec", c["first_step"])
                await spared.spares_ready()
                d = await spared.restart(5, 0.01, 5)
                self.add("restart_spare", "asyncexec", d["first_step"])
        finally:
            await spared.close()

    # Warm workers -------------------------------------------------------------------------------

    async def warm(self) -> None:
        """Executors leased from a WorkerPool: enter, first step, the loop's lag through lease
        cycles and a refill (``_warm.py``), and the service's first event (``_service.py``)."""
        sizes = self.sizes
        progress("warm workers: leases from a pool")
        await measure_warm(
            self,
            4,
            sizes.startup_repeats,
            sizes.warm_cycles,
            sizes.warm_floor_steps,
            RESOURCES,
            BUFFER,
            self.storage,
            sizes.warmups,
        )
        progress("warm workers: the service's first event")
        # The first request pays the app's one-time costs (not recorded; but in the quick run).
        warmups = sizes.warmups
        pooled = await measure_service_first_event(
            sizes.startup_repeats + warmups, 4, resources_per_worker=RESOURCES
        )
        cold = await measure_service_first_event(
            max(1, sizes.startup_repeats // 2) + warmups, None, resources_per_worker=RESOURCES
        )
        for value in pooled[warmups:]:
            self.add("service_first", "asyncexec", value * 1e3)
        for value in cold[warmups:]:
            self.note("service_first_cold_ms", value * 1e3)

    def _restart_phases(self, mark: int, t_kill: float) -> None:
        """Where asyncexec's restart time goes, from its log events."""
        for event, key in (
            ("worker_failed", "ae_restart_noticed"),
            ("group_closed", "ae_restart_old_group_gone"),
            ("group_started", "ae_restart_new_group_ready"),
        ):
            found = self.events.since(mark, event)
            if found:
                self.note(key, found[0][0] - t_kill)

    # Runs that outlive failures --------------------------------------------------------------

    async def outlive(self) -> None:
        """Independent ranks losing one (survivors restarted, their stream's gap, the replaced
        rank's next report) and a named run resumed by a new driver (see ``_outlive.py``)."""
        sizes = self.sizes
        n = sizes.outlive_workers
        progress(f"independent ranks, {n} workers, one SIGKILLed")
        await measure_independent(self, n, sizes.outlive_repeats, RESOURCES, self.storage)
        progress("a named run resumed by a new driver")
        await measure_resume(self, sizes.resume_repeats, self.storage)

    # Weights from one executor to another ------------------------------------------------------

    async def channel(self) -> None:
        """A state moved from a learner's rank 0 to a rollout executor's 4 ranks: WeightChannel
        (torch and object store transports), a hand-written gloo broadcast in the same processes,
        and the driver; the loop's lag during pushes; the version lag through SIGKILLs (see
        ``_channel.py``)."""
        sizes = self.sizes
        with self.timer.section("weight channel: the move"):
            await measure_channel(
                self,
                self.channel_notes,
                sizes.channel_bytes,
                sizes.channel_parts,
                sizes.channel_repeats,
                sizes.channel_lag_pushes,
                RESOURCES,
                self.storage,
            )
        progress("weight channel: version lag through SIGKILLs")
        with self.timer.section("weight channel: version lag"):
            await measure_version_lag(
                self,
                self.channel_notes,
                sizes.channel_kills,
                sizes.channel_staleness,
                RESOURCES,
                self.storage,
            )

    # Event-loop lag through whole lifecycles ---------------------------------------------------

    async def lifecycle(self) -> None:
        """Executors entering, streaming, losing a worker, restarting, finishing and closing in
        this loop beside a heartbeat, against the floor streaming (see ``_lifecycle.py``)."""
        sizes = self.sizes
        result = await measure_lifecycle(
            executors=sizes.lifecycle_executors,
            workers=sizes.lifecycle_workers,
            steps=sizes.lifecycle_steps,
            cycles=sizes.lifecycle_cycles,
            repeats=sizes.lifecycle_repeats,
            resources=RESOURCES,
            bound=BUFFER,
            storage=self.storage,
            # Alone, the first lifecycle would pay the driver's one-time costs.
            warm_up=self.parts == {"lifecycle"},
        )
        for row in result.per_repeat():
            for key, ours, floor in (
                ("life_p99", "life_p99", "floor_p99"),
                ("life_max", "life_max", "floor_max"),
                ("life_alone_p99", "alone_p99", "floor_p99"),
                ("life_alone_max", "alone_max", "floor_max"),
            ):
                # A round may have no sample while streaming alone (no moment when every
                # active executor was streaming): that row then has no figure from it.
                if not math.isnan(row[ours]):
                    self.add(key, "asyncexec", row[ours])
                    self.add(key, "floor", row[floor])
            self.note("lifecycle_round_s", row["seconds"])
        self.lifecycle_notes = result.notes()
        per_repeat = "; ".join(
            f"lifecycles p99 {r['life_p99']:.2f} / max {r['life_max']:.1f}, streaming alone "
            f"{r['alone_p99']:.2f} / {r['alone_max']:.1f}, floor {r['floor_p99']:.2f} / "
            f"{r['floor_max']:.1f}"
            for r in result.per_repeat()
        )
        self.lifecycle_notes.append(f"- each repeat (p99 / max, ms): {per_repeat}")

    # Output -------------------------------------------------------------------------------------

    def where_time_goes(self) -> list[str]:
        """The notes under the table, each where its part ran."""
        w = {k: median(v) for k, v in self.where.items()}

        def g(key: str) -> float:
            return w.get(key, math.nan)

        lines = ["Where the time goes (medians):"]
        cpu = [
            f"{name} {g(f'{column}_driver_cpu_us'):.1f} driver + "
            f"{g(f'{column}_worker_cpu_us'):.1f} workers"
            for column, name in (
                ("raytrain", "Ray Train"),
                ("lockstep", "lockstep"),
                ("floor", "floor"),
                ("asyncexec", "asyncexec"),
            )
            if f"{column}_driver_cpu_us" in w
        ]
        if cpu:
            lines.append("- CPU per report, 4 workers streaming (us): " + "; ".join(cpu))
        if "reports" in self.parts:
            lines.append(
                f"- reports in flight per worker, at most: floor {2 * BUFFER:,} (a deque of "
                f"{BUFFER:,} in the worker, as many on their way), asyncexec "
                f"{DEFAULT_BUFFER_SIZE:,} (its default buffer_size: the worker, the wire and the "
                "driver together)"
            )
        if "resume_ready_to_step_s" in w:
            lines.append(
                f"- a resumed named run: its new driver's executor ready to its first step "
                f"{g('resume_ready_to_step_s') * 1e3:.0f} ms (the rest of 'resume' is the process "
                "starting, importing and joining Ray)"
            )
        if "ae_placement_ready" in w:
            lines.append(
                f"- asyncexec start-up, 4 workers (s from entering): placement group ready "
                f"{g('ae_placement_ready'):.3f}, worker processes ready "
                f"{g('ae_workers_ready'):.3f}, set up and ready {g('ae_group_started'):.3f}"
            )
        if "ae_restart_noticed" in w:
            lines.append(
                f"- asyncexec restart (s from os.kill): failure noticed "
                f"{g('ae_restart_noticed'):.3f}, old group gone "
                f"{g('ae_restart_old_group_gone'):.3f}, new group ready "
                f"{g('ae_restart_new_group_ready'):.3f}, first step "
                f"{self.figures['restart'].medians().get('asyncexec', math.nan):.3f}"
            )
        if "rt_restart_group_restarted" in w:
            lines.append(
                f"- Ray Train restart (s from os.kill): group restarted inside get_next_results "
                f"{g('rt_restart_group_restarted'):.3f}, first result "
                f"{self.figures['restart'].medians().get('raytrain', math.nan):.3f}"
            )
        if "service_first_cold_ms" in w:
            lines.append(
                f"- warm workers: the service's POST /runs to the first SSE step without a pool "
                f"(fresh workers per request) {g('service_first_cold_ms'):.0f} ms; pool workers "
                f"replaced during the lease-lag rounds {g('warm_refills'):.0f}"
            )
        if "driver_rss_first" in w:
            lines.append(
                f"- driver RSS {g('driver_rss_first'):.0f} MiB after warm-up; peak above it "
                f"{g('driver_rss_peak_minus_first'):.2f} MiB"
            )
        samples = ", ".join(
            f"{c} {int(g(f'{c}_lag_samples'))}"
            for c in ("raytrain", "lockstep", "floor", "asyncexec")
            if f"{c}_lag_samples" in w
        )
        if samples:
            lines.append(f"- heartbeat wake-ups per lag run: {samples}")
        collections = "; ".join(
            f"{c} {int(g(f'{c}_gc_full'))} full, longest {g(f'{c}_gc_full_max_ms'):.1f} ms, "
            f"all collections {g(f'{c}_gc_all_ms'):.0f} ms"
            for c in ("lockstep", "floor", "asyncexec")
            if f"{c}_gc_full" in w
        )
        if collections:
            lines.append(f"- driver garbage collections during each lag run: {collections}")
        lines += self.channel_notes
        lines += self.lifecycle_notes
        own = ", ".join(f"{k} {v:.1f}" for k, v in self.timer.sections.items())
        lines.append(f"- this benchmark's own time (s): {own}")
        return lines


async def bench_main(bench: Bench) -> str | None:
    """Measure the run's parts; return why Ray Train was skipped, or None."""
    parts = bench.parts
    client = RayTrainClient()
    if parts & RAY_TRAIN_PARTS:
        progress("starting the Ray Train driver")
        with bench.timer.section("Ray Train driver start"):
            if await client.open(ray.get_runtime_context().gcs_address, RESOURCES):
                bench.rt = client
    try:
        if "startup" in parts:
            with bench.timer.section("start-up and memory"):
                await bench.startup()
        if "warm" in parts:
            with bench.timer.section("warm workers"):
                await bench.warm()
        if "channel" in parts:
            await bench.channel()
        if "outlive" in parts:
            with bench.timer.section("runs that outlive failures"):
                await bench.outlive()
        if "local" in parts:
            with bench.timer.section("local mode"):
                await bench.local_mode()
        counts = bench.sizes.worker_counts if "reports" in parts else []
        if "runs" in parts and 4 not in counts:
            counts = [*counts, 4]
        for n in counts:
            await bench.groups(n)
        if "lifecycle" in parts:
            with bench.timer.section("lifecycle lag"):
                await bench.lifecycle()
    finally:
        await client.close()
    return client.unavailable if parts & RAY_TRAIN_PARTS else None


def asyncexec_version() -> str:
    import asyncexec

    return str(asyncexec.__version__)


def asyncexec_path() -> str:
    """Where the driver's asyncexec comes from (a baseline worktree must resolve to itself)."""
    import asyncexec

    return os.path.dirname(os.path.abspath(str(asyncexec.__file__)))


#: How often the metrics row's scraper reads the registry (Prometheus' default is every 15 s).
SCRAPE_EVERY_S = 0.5


@contextlib.contextmanager
def metrics_on() -> Iterator[None]:
    """asyncexec's Prometheus metrics on, in a registry of their own, for the block, scraped
    from a thread every ``SCRAPE_EVERY_S`` (each scrape asks the workers for their backlog)."""
    import prometheus_client

    import asyncexec
    from asyncexec._driver import _metrics

    registry = prometheus_client.CollectorRegistry()
    # Every scrape asks the workers (the library's default asks at most every 5 s).
    asyncexec.enable_metrics(registry, backlog_refresh_s=0)
    done = threading.Event()

    def scrape() -> None:
        while not done.wait(SCRAPE_EVERY_S):
            prometheus_client.generate_latest(registry)

    scraper = threading.Thread(target=scrape, name="bench-scraper", daemon=True)
    scraper.start()
    try:
        yield
    finally:
        done.set()
        scraper.join()
        _metrics._metrics = None


def start_ray() -> None:
    """A fresh local Ray for this run only (never one that is already running), every worker
    process fresh for every system alike."""
    _harness.start_ray(RAY_CPUS)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="after Ray has started, move the driver's heap to the permanent generation "
        "(gc.collect(); gc.freeze()), as a latency-sensitive application may do: full "
        "collections then cost what the heap grew by, not Ray's whole heap",
    )


async def _run(sizes: Sizes, args: argparse.Namespace) -> _harness.Result:
    # The library logs through structlog and never configures it; this benchmark records its
    # events (for the start-up and restart phases) instead of printing them.
    events = Events()
    structlog.configure(processors=[events])
    logging.getLogger("ray.train").setLevel(logging.ERROR)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    parts = [name for name in PARTS if name in args.only]
    bench = Bench(sizes, events, parts=parts)
    missing = await bench_main(bench)
    figures = [f for f in bench.figures.values() if any(PARTS[p][1](f.key) for p in parts)]
    notes = [f"asyncexec {asyncexec_version()} from {asyncexec_path()}"]
    if missing is not None:
        notes.append(f"Ray Train column skipped: {missing}")
    return _harness.Result(figures, TABLE, [*notes, "", *bench.where_time_goes()])


def _about(sizes: Sizes, args: argparse.Namespace) -> str:
    parts = [name for name in PARTS if name in args.only]
    modes = [f"only {', '.join(parts)}"] if len(parts) < len(PARTS) else []
    modes += ["gc.freeze() after start-up"] if args.gc_freeze else []
    return "; ".join(
        [
            *modes,
            f"medians of {sizes.repeats} repeat(s) (start-up {sizes.startup_repeats}, restart "
            f"{sizes.restart_repeats}, run end {sizes.run_end_repeats}); every worker {RESOURCES}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec benchmarks",
        full=FULL,
        quick=QUICK,
        run=_run,
        ray={"num_cpus": RAY_CPUS},
        figures={name: text for name, (text, _) in PARTS.items()},
        options=_options,
        about=_about,
    )


if __name__ == "__main__":
    sys.exit(main())
