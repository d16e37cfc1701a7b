"""The driver's cost as ranks grow: real Ray actors at 1, 4, 16 and 64 ranks (fractional CPUs)
and simulated ranks at 4 to 4,096, in one table of medians.

    python benchmarks/scale.py                  # the full table: about 6 minutes on 2 cores
    python benchmarks/scale.py --quick          # small sizes, one repeat (the tests run it)
    python benchmarks/scale.py --sim-only       # only the simulated ranks (no Ray)
    python benchmarks/scale.py --dispatch-only  # only the dispatch figures (no Ray)
    python benchmarks/scale.py --profile 4096   # cProfile of the driver through a paced run

Simulated ranks are the cluster seam's third implementation (``asyncexec._driver.cluster``'s
``SimCluster``, handed to the executors as ``cluster=``): objects on the driver's own event loop
that answer the worker protocol and report at a fixed rate, each answer crossing a pickle round trip
as an actor's does. What they cost is timed apart and subtracted: the figures are the driver's.

What is measured, per size (health checks off: they cost one small call per rank and interval):

- **paced**: every rank reports at a fixed rate, its reports spread over the period (as real
  ranks' are), each poll carrying one report or two: the costliest shape per report. The rate is
  1,000 reports/s per rank, or 20,000/s in total above 20 ranks, so that the driver is never
  busy enough to batch. Over the steady middle of a run (the first and last fifth of its steps
  left out), the event loop thread's CPU (``time.thread_time``), less the simulated workers',
  per rank-report and per step; the time from the last rank's ``report()`` of a step to the
  consumer holding it (median over steps); and what the run costs once per rank (its start and
  its end: the whole run's CPU less its reports').
- **assembly**: the assembly alone (pure, timed apart): adding one answer from each of N
  ranks, then taking the step (with the straggler watch).
- **memory**: the Python heap (tracemalloc) the driver holds per idle rank of an entered
  executor, the simulated workers' own objects left out. For Ray actors, Ray's per-actor state
  in C++ is not in it.
- **start-up**: planning (rank order, ranks, device sets: pure functions over N workers on nodes
  of 8, each with a GPU), and the group's whole start (the driver's CPU per rank).
- **saturated**: every rank reports as fast as credit allows (polls of hundreds of reports): the
  reports per second of driver CPU, the rate at which one driver core saturates.
- **dispatch** (simulated ranks, at 1,024 and 4,096): an executor with a worker class, whose
  instances the simulated ranks hold; the driver's CPU (less the simulated workers') and the
  wall time of one ``call()`` to every rank with the same arguments and with a numpy array
  scattered over them (64 floats a rank), and of one ``least_loaded()`` call: with every rank
  idle, and with every rank but one holding a call under a cap of one (the choice then scans a
  full load table); beside one call to ``rank(i)``, which makes no choice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import os
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import _harness
import anyio
import psutil
from _common import median, progress
from _harness import Result
from _scale_workload import HELD, WAITING, Shard, flat_out, paced

import asyncexec
from asyncexec._driver._devices import DEVICE_KINDS, shared_device_env
from asyncexec._driver.cluster import GcClock, SimCluster, SimLoad
from asyncexec._driver.group._ranks import assign_ranks, order_workers
from asyncexec._driver.run._stragglers import StragglerWatch
from asyncexec._driver.run._window import BATCH, Assembly
from asyncexec._wire._protocol import Poll, ReportTimes, WorkerMetadata

#: Paced runs: this many reports a second in total, each rank's share of it (Ray actors: at
#: most RAY_RATE_PER_RANK each, as a sleeping function keeps a faster pace badly).
RATE_TOTAL, RAY_RATE_PER_RANK = 16_000.0, 2_000.0
#: A paced run lasts about this long (at least 20 steps); a saturated one has this window.
PACED_S, SATURATED_BUFFER = 3.0, 256
#: Ray actors' CPU each (64 of them fit in the Ray started here).
RAY_CPUS, RAY_RESOURCES = 8, {"CPU": 0.1}
NO_HEALTH = asyncexec.HealthChecks(interval_s=None)
#: The tuned collector's first threshold: this many allocations a rank (see ``tuned_gc``).
GC_PER_RANK = 20


@dataclass
class Sizes:
    sim: list[int]
    ray: list[int]
    repeats: int
    paced_reports: int  # in a paced run, over every rank (at least 30 steps)
    saturated_reports: int  # in a saturated run, over every rank
    dispatch: list[int] = field(default_factory=list)  # simulated sizes with dispatch rows


#: ``SCALE_REPEATS=1`` for a shorter full run.
_REPEATS = int(os.environ.get("SCALE_REPEATS", "3"))
FULL = Sizes([4, 16, 64, 256, 1024, 4096], [1, 4, 16, 64], _REPEATS, 48_000, 400_000, [1024, 4096])
#: Quick: no dispatch figures beside the others (``--dispatch-only --quick``: at 256 ranks).
QUICK = Sizes([4, 64, 256], [1, 4], 1, 4_000, 20_000)
QUICK_DISPATCH = [256]
#: Dispatch: calls timed one after the other, per figure and repeat; floats a rank scattered.
DISPATCH_CALLS, LEAST_CALLS, SCATTER_FLOATS = 10, 100, 64


@dataclass
class Row:
    kind: str
    ranks: int
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.values.setdefault(key, []).append(value)

    def get(self, key: str) -> float:
        return median(self.values.get(key, []))


def noop(config: Any = None) -> None:
    """The simulated ranks' function (they do not call it)."""


class Clock:
    """The driver's CPU (the event loop thread's), less the simulated workers' time; and the time
    spent in garbage collections (the whole process's, counted as the driver's)."""

    def __init__(self, sim: SimCluster | None) -> None:
        self.sim = sim
        self.process = psutil.Process()
        self.gc = GcClock()

    def read(self) -> tuple[float, float, float, float]:
        """(the driver's loop CPU, the whole process's CPU, garbage collections, the simulated
        workers' time), in seconds."""
        spent = self.sim.spent if self.sim is not None else 0.0
        t = self.process.cpu_times()
        return time.thread_time() - spent, t.user + t.system - spent, self.gc.total, spent


@contextlib.contextmanager
def tuned_gc(n: int) -> Iterator[None]:
    """What the docs advise a driver of many ranks: everything made so far out of the
    collector's way (``gc.freeze()``), and its first threshold raised with the ranks."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(old[0], GC_PER_RANK * n), old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def _last_report(step: asyncexec.Step) -> float:
    """When the last rank made its report of ``step``, on this node's monotonic clock (the
    workers' clock: simulated ranks and actors on this node share it)."""
    batch = step._batch  # the benchmark reads the raw times the step was built from
    assert batch is not None and batch.times is not None
    i = step.index - batch.first
    times = batch.times
    return max(times.calls[i :: times.steps])


# Pure parts -------------------------------------------------------------------------------------


def metadata(n: int) -> list[WorkerMetadata]:
    """N workers on nodes of 8, each with one GPU of its node (as the simulated ranks are)."""
    return [
        WorkerMetadata(f"node-{i // 8}", "10.0.0.1", f"node-{i // 8}", i, {"GPU": (str(i % 8),)})
        for i in range(n)
    ]


def planning_ms(n: int, repeats: int) -> float:
    """Rank order, ranks and device sets of N workers, median ms."""
    metas = metadata(n)
    nodes = [m.node_id for m in metas]
    ids = [m.accelerator_ids for m in metas]
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        order = order_workers(nodes, ids, nodes[0])
        ordered = [nodes[i] for i in order]
        assign_ranks(ordered)
        shared_device_env(ordered, [ids[i] for i in order], DEVICE_KINDS)
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


async def assembly_ms(n: int, repeats: int) -> tuple[float, float]:
    """Adding one answer from each of N ranks, and taking the step: median ms each."""
    now = time.monotonic()
    packed = ReportTimes(array("d", [now]), array("d", [0.01]), now).pack()
    poll = Poll([{}], None, None, None, packed)
    adds, takes = [], []
    for _ in range(max(5, repeats)):
        asm = Assembly(n, 1, 0)
        watch = StragglerWatch(n, 2.0, 10)
        t0 = time.perf_counter()
        for rank in range(n):
            asm.add(rank, poll)
        t1 = time.perf_counter()
        batch = asm.take(BATCH)
        assert batch.times is not None
        watch.observe(batch.first, batch.times)
        batch.step(0)
        t2 = time.perf_counter()
        adds.append(t1 - t0)
        takes.append(t2 - t1)
    return median(adds) * 1e3, median(takes) * 1e3


# Runs -------------------------------------------------------------------------------------------


def paced_rate(n: int, ray: bool) -> float:
    return min(RAY_RATE_PER_RANK, RATE_TOTAL / n) if ray else RATE_TOTAL / n


async def paced_run(
    executor: asyncexec.Executor, clock: Clock, n: int, total: int, row: Row, tuned: bool
) -> None:
    """One paced run (see the module's docstring), its figures added to ``row`` (``tuned``:
    with the garbage collector as the docs advise, the figures' keys end in ``_tuned``)."""
    sim = clock.sim
    rate = paced_rate(n, ray=sim is None)
    reports = max(20, min(total // n, int(rate * PACED_S)))
    if sim is not None:
        sim.load = SimLoad(reports=reports, rate=rate, tagged=False)
    first, last = reports // 5, reports - reports // 5
    gc.collect()
    marks: dict[int, tuple[float, float, float, float]] = {}
    latencies = []
    with tuned_gc(n) if tuned else contextlib.nullcontext():
        start = clock.read()
        async for step in executor.run(paced, {"rate": rate, "reports": reports}):
            if first <= step.index < last:
                latencies.append(time.monotonic() - _last_report(step))
            if step.index in (0, first, last, reports - 1):
                marks[step.index] = clock.read()
        end = clock.read()
    (loop0, proc0, gc0, sim0), (loop1, proc1, gc1, sim1) = marks[first], marks[last]
    reported = n * (last - first)
    per_report = (loop1 - loop0) / reported
    suffix = "_tuned" if tuned else ""
    row.add("report_us" + suffix, per_report * 1e6)
    row.add("gc_us" + suffix, (gc1 - gc0) / reported * 1e6)
    row.add("step_ms" + suffix, per_report * n * 1e3)
    row.add("latency_ms" + suffix, median(latencies) * 1e3)
    if sim is not None:
        row.add("sim_us" + suffix, (sim1 - sim0) / reported * 1e6)
    if not tuned:
        row.add("process_report_us", (proc1 - proc0) / reported * 1e6)
        # A run's start (to its first step) and end (from its last step), per rank.
        ends = marks[0][0] - start[0] + end[0] - marks[reports - 1][0]
        row.add("run_rank_us", ends / n * 1e6)


async def saturated_run(
    executor: asyncexec.Executor, clock: Clock, n: int, total: int, row: Row
) -> None:
    """One run of ranks reporting as fast as credit allows: reports per driver CPU second."""
    reports = max(4 * SATURATED_BUFFER, total // n)
    sim = clock.sim
    if sim is not None:
        sim.load = SimLoad(reports=reports, rate=1e9, tagged=False, spread=False)
    first, last = reports // 5, reports - reports // 5
    gc.collect()
    marks: dict[int, tuple[float, float, float, float]] = {}
    run = executor.run(flat_out, {"reports": reports}, buffer_size=SATURATED_BUFFER)
    async for step in run:
        if step.index in (first, last):
            marks[step.index] = clock.read()
    loop0, loop1 = marks[first][0], marks[last][0]
    row.add("saturated_per_s", n * (last - first) / (loop1 - loop0))


async def entered(
    make: Callable[[], asyncexec.Executor], clock: Clock, n: int, row: Row
) -> asyncexec.Executor:
    """Enter an executor of N ranks, measuring its start-up and the heap it holds per rank."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    t0, c0 = time.perf_counter(), clock.read()[0]
    executor = make()
    await executor.__aenter__()
    wall, cpu = time.perf_counter() - t0, clock.read()[0] - c0
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    # The simulated workers' modules (_sim, _sim_answers, _sim_roles) are not the driver's.
    keep = [
        tracemalloc.Filter(False, "*/_sim*.py"),
        tracemalloc.Filter(False, tracemalloc.__file__),
    ]
    grown = sum(
        d.size_diff
        for d in after.filter_traces(keep).compare_to(before.filter_traces(keep), "filename")
    )
    row.add("heap_rank_kib", grown / n / 1024)
    row.add("start_ms", wall * 1e3)
    row.add("start_rank_us", cpu / n * 1e6)
    return executor


async def _timed_calls(clock: Clock, calls: int, call: Callable[[], Any]) -> tuple[float, float]:
    """``calls`` awaits of ``call()``, one after the other: the driver's CPU and the wall time
    of one, in ms."""
    gc.collect()
    c0, t0 = clock.read()[0], time.perf_counter()
    for _ in range(calls):
        await call()
    return (clock.read()[0] - c0) / calls * 1e3, (time.perf_counter() - t0) / calls * 1e3


async def dispatch_figures(clock: Clock, n: int, repeats: int, row: Row) -> None:
    """The dispatch figures of N simulated ranks (see the module's docstring) into ``row``."""
    import numpy as np

    data = np.arange(n * SCATTER_FLOATS, dtype=np.float32)
    role = asyncexec.Role(Shard)
    executor = asyncexec.Executor(n, roles=role, health=NO_HEALTH, name="scale", cluster=clock.sim)
    async with executor as ex:
        least, last = asyncexec.least_loaded(), asyncexec.rank(n - 1)
        figures: dict[str, Callable[[], Any]] = {
            "all": lambda: ex.call(Shard.take, None),
            "scatter": lambda: ex.call(Shard.take, asyncexec.scatter(data)),
            "least": lambda: ex.call(Shard.take, None, on=least),
            "rank": lambda: ex.call(Shard.take, None, on=last),
        }
        for _ in range(repeats):
            for key, call in figures.items():
                many = DISPATCH_CALLS if key in ("all", "scatter") else LEAST_CALLS
                cpu, wall = await _timed_calls(clock, many, call)
                row.add(f"{key}_cpu_ms", cpu)
                row.add(f"{key}_ms", wall)
            # Every rank but the last holds a call under a cap of one: each choice scans them.
            HELD.update({"busy": asyncio.Event(), "busy all in": asyncio.Event()})
            WAITING["busy"] = 0
            cap = asyncexec.least_loaded(max_in_flight=1)
            async with anyio.create_task_group() as tg:
                for _ in range(n - 1):
                    tg.start_soon(functools.partial(ex.call, Shard.hold, "busy", n - 1, on=cap))
                await HELD["busy all in"].wait()
                capped = functools.partial(ex.call, Shard.take, None, on=cap)
                cpu, wall = await _timed_calls(clock, LEAST_CALLS, capped)
                row.add("least_busy_cpu_ms", cpu)
                row.add("least_busy_ms", wall)
                HELD["busy"].set()


async def measure(kind: str, n: int, sizes: Sizes) -> Row:
    row = Row(kind, n)
    row.add("planning_ms", planning_ms(n, sizes.repeats))
    add, take = await assembly_ms(n, sizes.repeats)
    row.add("add_ms", add)
    row.add("take_ms", take)
    sim = SimCluster() if kind == "simulated" else None
    clock = Clock(sim)

    def make() -> asyncexec.Executor:
        if sim is not None:
            return asyncexec.Executor(n, health=NO_HEALTH, name="scale", cluster=sim)
        return asyncexec.Executor(
            n, resources_per_worker=RAY_RESOURCES, health=NO_HEALTH, name="scale"
        )

    gc.callbacks.append(clock.gc)
    try:
        executor = await entered(make, clock, n, row)
        try:
            for repeat in range(sizes.repeats):
                progress(f"{kind} {n}: paced runs {repeat + 1}")
                await paced_run(executor, clock, n, sizes.paced_reports, row, tuned=False)
                await paced_run(executor, clock, n, sizes.paced_reports, row, tuned=True)
                progress(f"{kind} {n}: saturated run {repeat + 1}")
                await saturated_run(executor, clock, n, sizes.saturated_reports, row)
        finally:
            await executor.aclose()
        if sim is not None and n in sizes.dispatch:
            progress(f"{kind} {n}: dispatch")
            await dispatch_figures(clock, n, sizes.repeats, row)
    finally:
        gc.callbacks.remove(clock.gc)
    return row


async def dispatch_only(n: int, sizes: Sizes) -> Row:
    """The dispatch figures alone, of N simulated ranks."""
    row, sim = Row("simulated", n), SimCluster()
    clock = Clock(sim)
    gc.callbacks.append(clock.gc)
    try:
        await dispatch_figures(clock, n, sizes.repeats, row)
    finally:
        gc.callbacks.remove(clock.gc)
    return row


# The table --------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 1) -> str:
    if value != value:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


class Tables:
    """The driver's cost by ranks, its start-up and memory, and dispatch where measured."""

    def render(self, rows: list[Row]) -> str:
        dispatched = [r for r in rows if "scatter_ms" in r.values]
        rows = [r for r in rows if "planning_ms" in r.values]  # not the dispatch figures alone
        head = (
            "| ranks | driver CPU per report, us (of it GC) | per step, ms | last report to "
            "consumer, ms | the same, GC tuned: us / ms / ms | control: simulated workers' own, "
            "us a report | assembly: add N / take, ms | run start + end, us a rank |"
        )
        lines = [head, "|---|--:|--:|--:|--:|--:|--:|--:|"]
        for r in rows:
            lines.append(
                f"| {r.kind} {r.ranks} | {_fmt(r.get('report_us'), 2)} ({_fmt(r.get('gc_us'), 2)}) "
                f"| {_fmt(r.get('step_ms'), 3)} | {_fmt(r.get('latency_ms'), 2)} "
                f"| {_fmt(r.get('report_us_tuned'), 2)} / {_fmt(r.get('step_ms_tuned'), 3)} / "
                f"{_fmt(r.get('latency_ms_tuned'), 2)} | {_fmt(r.get('sim_us_tuned'), 2)} "
                f"| {_fmt(r.get('add_ms'), 3)} / {_fmt(r.get('take_ms'), 3)} "
                f"| {_fmt(r.get('run_rank_us'))} |"
            )
        head = (
            "| ranks | heap per idle rank, KiB | planning, ms | group start, ms (driver CPU, us a "
            "rank) | saturated: reports/s per driver core | whole driver process, us a report |"
        )
        lines += ["", head, "|---|--:|--:|--:|--:|--:|"]
        for r in rows:
            lines.append(
                f"| {r.kind} {r.ranks} | {_fmt(r.get('heap_rank_kib'), 2)} "
                f"| {_fmt(r.get('planning_ms'), 3)} "
                f"| {_fmt(r.get('start_ms'))} ({_fmt(r.get('start_rank_us'))}) "
                f"| {_fmt(r.get('saturated_per_s'))} | {_fmt(r.get('process_report_us'), 2)} |"
            )
        if not rows:  # the dispatch figures alone
            lines = []
        if dispatched:
            head = (
                "| ranks | call, same arguments: ms (driver CPU) | scatter, 64 floats a rank: ms "
                "(driver CPU) | least_loaded, idle ranks: ms (CPU) | least_loaded, all but one "
                "busy, cap 1: ms (CPU) | rank(i): ms (CPU) |"
            )
            lines += ["", head, "|---|--:|--:|--:|--:|--:|"]
            for r in dispatched:
                cells = [
                    f"{_fmt(r.get(k + '_ms'), 3)} ({_fmt(r.get(k + '_cpu_ms'), 3)})"
                    for k in ("all", "scatter", "least", "least_busy", "rank")
                ]
                lines.append(f"| {r.kind} {r.ranks} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


TABLES = Tables()


def verdicts(rows: list[Row]) -> list[str]:
    sim = {r.ranks: r for r in rows if r.kind == "simulated"}
    out = []
    for key, what in (
        ("report_us", "default GC"),
        ("report_us_tuned", "GC tuned"),
        ("sim_us_tuned", "the control (constant work)"),
    ):
        costs = {n: r.get(key) for n, r in sim.items() if key in r.values}
        if len(costs) >= 2:
            low, high = min(costs.values()), max(costs.values())
            out.append(
                f"cost per rank-report over {min(costs)}..{max(costs)} simulated ranks, {what}: "
                f"{_fmt(low, 2)}..{_fmt(high, 2)} us, max/min {high / low:.2f} (target <= 1.5)"
            )
    if 1024 in sim and "step_ms" in sim[1024].values:
        r = sim[1024]
        out.append(
            f"a 1,024-rank step: {_fmt(r.get('step_ms'), 2)} ms of driver CPU "
            f"({_fmt(r.get('step_ms_tuned'), 2)} GC tuned), "
            f"{_fmt(r.get('latency_ms'), 2)} ms from its last report to the consumer, "
            f"{_fmt(r.get('take_ms'), 2)} ms to take it from the assembly (target <= 10 ms)"
        )
    for n, r in sorted(sim.items()):
        if "scatter_ms" in r.values:
            out.append(
                f"dispatch to {n:,} simulated ranks: a call to every rank "
                f"{_fmt(r.get('all_cpu_ms'), 2)} ms of driver CPU, a scatter "
                f"{_fmt(r.get('scatter_cpu_ms'), 2)} ms; a least-loaded choice (the call less "
                f"rank(i)'s) {_fmt((r.get('least_cpu_ms') - r.get('rank_cpu_ms')) * 1e3, 0)} us "
                f"idle, {_fmt((r.get('least_busy_cpu_ms') - r.get('rank_cpu_ms')) * 1e3, 0)} us "
                f"with all but one rank busy"
            )
    heaps = [h for r in sim.values() if (h := r.get("heap_rank_kib")) == h]  # nan: not measured
    if heaps:
        out.append(f"heap per idle rank: at most {_fmt(max(heaps), 2)} KiB (target < 50 KiB)")
    return out


async def profile(n: int) -> None:
    """cProfile the driver through one paced run of N simulated ranks."""
    sim = SimCluster()
    async with asyncexec.Executor(n, health=NO_HEALTH, cluster=sim) as executor:
        rate = paced_rate(n, ray=False)
        reports = max(30, 30_000 // n)
        sim.load = SimLoad(reports=reports, rate=rate, tagged=False)
        profiler = _harness.Profiler()
        with profiler.on():
            async for _ in executor.run(noop):
                pass
    print(profiler.report())


async def bench(sizes: Sizes, sim_only: bool, dispatch: bool = False) -> list[Row]:
    rows = []
    if dispatch:
        for n in sizes.dispatch or QUICK_DISPATCH:
            progress(f"simulated {n}: dispatch")
            rows.append(await dispatch_only(n, sizes))
        return rows
    for n in sizes.sim:
        progress(f"simulated {n}")
        rows.append(await measure("simulated", n, sizes))
    if not sim_only:
        with _harness.ray_session(num_cpus=RAY_CPUS):
            for n in sizes.ray:
                progress(f"Ray actors {n}")
                rows.append(await measure("Ray actors", n, sizes))
    return rows


async def run(sizes: Sizes, args: argparse.Namespace) -> Result:
    if args.profile:
        await profile(args.profile)
        return Result([], TABLES)
    rows = await bench(sizes, args.sim_only, args.dispatch_only)
    return Result(rows, TABLES, [f"- {line}" for line in verdicts(rows)])


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sim-only", action="store_true", help="only the simulated ranks")
    parser.add_argument(
        "--dispatch-only", action="store_true", help="only the dispatch figures (simulated)"
    )
    parser.add_argument("--profile", type=int, metavar="N", help="cProfile N simulated ranks")


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec: the driver's cost as ranks grow",
        full=FULL,
        quick=QUICK,
        run=run,
        options=_options,
        about=lambda sizes, args: f"medians of {sizes.repeats}",
    )


if __name__ == "__main__":
    sys.exit(main())
