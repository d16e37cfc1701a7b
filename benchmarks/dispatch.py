"""Dispatch (``Executor.call``) beside the same calls on plain Ray actors, in one run.

    python benchmarks/dispatch.py            # about 2 minutes on 2 cores
    python benchmarks/dispatch.py --quick    # tiny sizes, one repeat: a smoke run (tests run it)
    python benchmarks/dispatch.py --only small --profile   # and where the driver's time goes

Three figures, each measured for asyncexec and for the hand-written Ray equivalent, with the
repeats of the two interleaved (the order alternates each repeat) so that the machine's noise
falls on both alike; the table shows the medians over repeats and asyncexec's ratio:

- **small call**: ``await ex.call(Echo.small, x)`` on an executor of 1 and of 4 ranks (the
  method returns ``x + 1``) against ``await asyncio.gather(*[a.small.remote(x) for a in
  actors])`` on as many plain async actors; per repeat the median latency of a block of
  sequential calls. The same with a plain ``def`` method of a role that has plain methods
  only (its workers are threaded sync actors; the method runs on its role's concurrency
  group) against a plain sync actor; and, as notes, the same method on a bare async actor's
  concurrency group by hand (what the row costs on an async worker: Ray's own floor there)
  and on a threaded sync actor by hand.
- **tasks a call makes**: the asyncio tasks one small call of 1 and of 4 ranks makes on the
  driver's loop (a task factory counts them): asyncexec waits for the ranks' futures together
  (0), where ``asyncio.gather`` wraps each rank's ``ObjectRef`` in a task.
- **scatter**: a numpy array (256 MB) over 4 ranks, ``ex.call(Echo.take,
  asyncexec.scatter(arr))`` against ``np.array_split``, one ``ray.put`` per part in a thread
  (off the loop, as a careful user does) and one actor call per part with its reference. Each
  rank reports the bytes and the first and last items of what it received; the run checks that
  every rank got exactly its own part, in both.
- **least-loaded calls per second**: many concurrent callers, each calling
  ``ex.call(Echo.serve, 1, on=least_loaded(max_in_flight=cap))`` in a loop, against the same
  callers choosing the plain actor with the fewest calls in flight by hand (lowest on ties,
  waiting while every actor is at the cap). 8 ranks of ``{"CPU": 0.25}`` on a 2-core machine
  are oversubscribed: the figure is the driver's dispatch, not the workers' speed.

``--profile`` runs cProfile over asyncexec's side of the chosen figures and prints the driver's
top functions (by own time and by cumulative time).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import _harness
import numpy as np
import ray
from _common import median, progress
from _dispatch_workload import (
    Echo,
    EchoPlain,
    RawEcho,
    RawEchoPlainGroup,
    RawEchoSync,
    RawEchoThreaded,
)
from _harness import Pair, Profiler, Result, alternate

import asyncexec

#: Every worker of both systems asks for this (8 ranks of each fit in the Ray started here).
RESOURCES = {"CPU": 0.25}
RAY_CPUS = 16
OBJECT_STORE_BYTES = 2 << 30
FIGURES = ("small", "scatter", "load")


@dataclass(frozen=True)
class Sizes:
    repeats: int
    small_calls: int  # sequential calls per repeat (each system)
    warm_calls: int
    scatter_bytes: int
    scatter_repeats: int
    scatter_warm: int
    load_ranks: int
    load_callers: int
    load_cap: int
    load_calls: int  # calls per repeat (each system)


FULL = Sizes(
    repeats=9,
    small_calls=200,
    warm_calls=100,
    scatter_bytes=256 << 20,
    scatter_repeats=9,
    scatter_warm=4,
    load_ranks=8,
    load_callers=64,
    load_cap=4,
    load_calls=4000,
)
QUICK = Sizes(
    repeats=1,
    small_calls=20,
    warm_calls=5,
    scatter_bytes=4 << 20,
    scatter_repeats=1,
    scatter_warm=1,
    load_ranks=2,
    load_callers=4,
    load_cap=2,
    load_calls=40,
)


async def raw_actors(cls: Any, n: int) -> list[Any]:
    actors = [cls.options(num_cpus=RESOURCES["CPU"]).remote() for _ in range(n)]
    await asyncio.gather(*(a.ping.remote() for a in actors))
    return actors


def kill(actors: list[Any]) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)


# Small calls ------------------------------------------------------------------------------------


async def measure_small(n: int, sizes: Sizes, prof: Profiler) -> tuple[list[Pair], list[str]]:
    """Small calls on ``n`` ranks: an async method and a plain one (of a role with plain
    methods only: a threaded worker), against plain actors; and, as notes, the plain method on
    an async actor's concurrency group by hand (where an async worker runs it) and on a
    threaded sync actor by hand."""
    ranks = f"{n} rank{'s' if n > 1 else ''}"
    rows = {
        kind: (
            Pair(f"small call, {ranks}, {what}: median latency", "us", limit=limit),
            Pair(f"the same: the event loop's CPU per call, {ranks}", "us"),
            Pair(f"the same: the driver's CPU per call (all threads), {ranks}", "us"),
        )
        for kind, what, limit in (
            ("async", "async def method", 1.2),
            ("plain", "plain def method (a sync actor by hand)", 1.2),
        )
    }
    tasks = Pair(f"the same: asyncio tasks a call makes, {ranks}", "tasks", most=0)
    progress(f"small calls, {ranks}: two executors and {n} plain actors of each kind")
    raw = await raw_actors(RawEcho, n)
    raw_sync = await raw_actors(RawEchoSync, n)
    raw_group = await raw_actors(RawEchoPlainGroup, n)
    raw_threaded = await raw_actors(RawEchoThreaded, n)
    for actor in raw_threaded:  # a long poll pending, as a worker's would be
        actor.hold.remote(3600.0)
    floor: list[float] = []
    threaded: dict[str, list[float]] = {"plain": [], "async": []}
    try:
        async with (
            asyncexec.Executor(n, resources_per_worker=RESOURCES, roles=asyncexec.Role(Echo)) as ex,
            asyncexec.Executor(
                n, resources_per_worker=RESOURCES, roles=asyncexec.Role(EchoPlain)
            ) as ex_plain,
        ):

            async def ae_async(x: int) -> Any:
                return await ex.call(Echo.small, x)

            async def ae_plain(x: int) -> Any:
                return await ex_plain.call(EchoPlain.small_sync, x)

            async def raw_async(x: int) -> Any:
                return await asyncio.gather(*[a.small.remote(x) for a in raw])

            async def raw_plain(x: int) -> Any:
                return await asyncio.gather(*[a.small_sync.remote(x) for a in raw_sync])

            async def raw_group_plain(x: int) -> Any:
                return await asyncio.gather(*[a.small_sync.remote(x) for a in raw_group])

            async def threaded_plain(x: int) -> Any:
                return await asyncio.gather(*[a.small_sync.remote(x) for a in raw_threaded])

            async def threaded_async(x: int) -> Any:
                return await asyncio.gather(*[a.small.remote(x) for a in raw_threaded])

            by_hand = (raw_async, raw_plain, raw_group_plain, threaded_plain, threaded_async)
            for one in (ae_async, ae_plain, *by_hand):
                assert await one(1) == [2] * n
                await _harness.latency(sizes.warm_calls, one)
            for i in range(sizes.repeats):
                progress(f"small calls, {ranks}, repeat {i + 1}/{sizes.repeats}")
                for kind, base, ours in (
                    ("async", raw_async, ae_async),
                    ("plain", raw_plain, ae_plain),
                ):
                    b, o = await alternate(
                        i,
                        lambda base=base: _harness.latency(sizes.small_calls, base),
                        lambda ours=ours: _harness.latency(sizes.small_calls, ours),
                        prof,
                    )
                    for row, base_value, our_value in zip(rows[kind], b, o, strict=True):
                        row.base.append(base_value)
                        row.ours.append(our_value)
                tasks.base.append(await tasks_made(raw_async))
                tasks.ours.append(await tasks_made(ae_async))
                floor.append((await _harness.latency(sizes.small_calls, raw_group_plain))[0])
                for kind, one in (("plain", threaded_plain), ("async", threaded_async)):
                    threaded[kind].append((await _harness.latency(sizes.small_calls, one))[0])
    finally:
        kill(raw)
        kill(raw_sync)
        kill(raw_group)
        kill(raw_threaded)
    plain, coro = median(rows["plain"][0].base), median(rows["async"][0].base)
    ours_plain, ours_async = median(rows["plain"][0].ours), median(rows["async"][0].ours)
    notes = [
        f"- small call, {ranks}: a plain def method on a bare async Ray actor (a concurrency "
        f"group of one, by hand: where an async worker runs it) {median(floor):,.0f} us, "
        f"{median(floor) / plain:.2f}x the sync actor (asyncexec's threaded worker: "
        f"{ours_plain / median(floor):.2f}x that)",
        f"- small call, {ranks}, a threaded sync Ray actor by hand (its asyncio loop in a "
        f"thread of its own, as asyncexec's threaded worker): a plain method "
        f"{median(threaded['plain']):,.0f} us, {median(threaded['plain']) / plain:.2f}x the "
        f"sync actor (asyncexec's {ours_plain / median(threaded['plain']):.2f}x that); an "
        f"async def run on its loop from a concurrency group's thread "
        f"{median(threaded['async']):,.0f} us, {median(threaded['async']) / coro:.2f}x the "
        f"async actor (asyncexec's async row: {ours_async / coro:.2f}x)",
    ]
    return [*rows["async"], tasks, *rows["plain"]], notes


async def tasks_made(call: Callable[[int], Awaitable[Any]]) -> float:
    """The asyncio tasks one ``call`` makes on this loop (counted by a task factory): by hand,
    ``asyncio.gather`` wraps each rank's ``ObjectRef`` in a task; asyncexec waits for the
    calls' futures together."""
    loop = asyncio.get_running_loop()
    made = 0
    factory = loop.get_task_factory()

    def counted(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> Any:
        nonlocal made
        made += 1
        if factory is not None:
            return factory(loop, coro, **options)
        return asyncio.Task(coro, loop=loop, **options)

    loop.set_task_factory(counted)
    try:
        await call(1)
    finally:
        loop.set_task_factory(factory)
    return float(made)


# Scatter ----------------------------------------------------------------------------------------


def check_parts(parts: list[Any], received: list[dict[str, Any]], who: str) -> list[int]:
    """Each rank's received bytes; raises unless every rank got exactly its own part."""
    for r, (part, got) in enumerate(zip(parts, received, strict=True)):
        want = (int(part.nbytes), float(part[0]), float(part[-1]))
        if (got["nbytes"], got["first"], got["last"]) != want:
            raise AssertionError(f"{who}: rank {r} received {got}, not its part {want}")
    return [int(got["nbytes"]) for got in received]


async def measure_scatter(sizes: Sizes, prof: Profiler) -> tuple[list[Pair], list[str]]:
    """A numpy array scattered over 4 ranks, against ray.put per part and one call each."""
    n = 4
    mb = sizes.scatter_bytes >> 20
    row = Pair(f"scatter {mb} MB (numpy) over {n} ranks: call to results", "ms", limit=1.1)
    arr = np.arange(sizes.scatter_bytes // 8, dtype=np.float64)
    parts = np.array_split(arr, n)
    notes: list[str] = []
    progress(f"scatter, {mb} MB over {n} ranks: an executor and {n} plain actors")
    raw = await raw_actors(RawEcho, n)
    try:
        async with asyncexec.Executor(
            n, resources_per_worker=RESOURCES, roles=asyncexec.Role(Echo)
        ) as ex:

            async def ours() -> list[Any]:
                out: list[Any] = await ex.call(Echo.take, asyncexec.scatter(arr))
                return out

            async def base() -> list[Any]:
                pieces = np.array_split(arr, n)
                refs = await asyncio.to_thread(lambda: [ray.put(p) for p in pieces])
                return list(
                    await asyncio.gather(
                        *(a.take.remote(r) for a, r in zip(raw, refs, strict=True))
                    )
                )

            async def timed(fn: Callable[[], Awaitable[list[Any]]]) -> tuple[float, list[Any]]:
                t0 = time.perf_counter()
                out = await fn()
                return (time.perf_counter() - t0) * 1e3, out

            for _ in range(sizes.scatter_warm):  # fresh object store pages fault on first touch
                for fn in (base, ours):
                    await fn()
            for i in range(sizes.scatter_repeats):
                progress(f"scatter, repeat {i + 1}/{sizes.scatter_repeats}")
                (b, got_b), (o, got_o) = await alternate(
                    i, lambda: timed(base), lambda: timed(ours), prof
                )
                row.base.append(b)
                row.ours.append(o)
                bytes_b = check_parts(parts, got_b, "ray.put by hand")
                bytes_o = check_parts(parts, got_o, "asyncexec")
            notes.append(
                f"- scatter: bytes each rank received, ray.put by hand {bytes_b}, asyncexec "
                f"{bytes_o} (of {arr.nbytes} in all; each rank's first and last items checked "
                "against its own part)"
            )
            notes.append(
                "- scatter, each repeat (ms): by hand "
                + ", ".join(f"{v:.0f}" for v in row.base)
                + "; asyncexec "
                + ", ".join(f"{v:.0f}" for v in row.ours)
            )
    finally:
        kill(raw)
    return [row], notes


# Least-loaded calls per second ------------------------------------------------------------------


async def ae_load(ex: asyncexec.Executor, calls: int, callers: int, cap: int) -> float:
    """Calls per second of ``callers`` tasks calling one least-loaded rank each time."""
    target = asyncexec.least_loaded(max_in_flight=cap)
    left = calls

    async def caller() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await ex.call(Echo.serve, 1, on=target)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return calls / (time.perf_counter() - t0)


async def raw_load(actors: list[Any], calls: int, callers: int, cap: int) -> float:
    """The same by hand: each caller picks the actor with the fewest calls in flight (lowest on
    ties), waits while every actor is at ``cap``, and awaits the actor's call."""
    counts = [0] * len(actors)
    freed = asyncio.Event()
    left = calls

    def choose() -> int | None:
        best: int | None = None
        for r, count in enumerate(counts):
            if count < cap and (best is None or count < counts[best]):
                best = r
        return best

    async def caller() -> None:
        nonlocal left, freed
        while left > 0:
            r = choose()
            if r is None:
                await freed.wait()
                continue
            left -= 1
            counts[r] += 1
            try:
                await actors[r].serve.remote(1)
            finally:
                counts[r] -= 1
                woken, freed = freed, asyncio.Event()
                woken.set()

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return calls / (time.perf_counter() - t0)


async def measure_load(sizes: Sizes, prof: Profiler) -> tuple[list[Pair], list[str]]:
    n, callers, cap = sizes.load_ranks, sizes.load_callers, sizes.load_cap
    rate = Pair(
        f"least_loaded(max_in_flight={cap}) calls/s, {n} ranks, {callers} callers",
        "calls/s",
        higher_is_better=True,
        limit=1.0,
    )
    loop = Pair("the same: the event loop's CPU per call", "us")
    cpu = Pair("the same: the driver's CPU per call (all threads)", "us")
    progress(f"least-loaded calls, {n} ranks: an executor and {n} plain actors")
    raw = await raw_actors(RawEcho, n)
    try:
        async with asyncexec.Executor(
            n, resources_per_worker=RESOURCES, roles=asyncexec.Role(Echo)
        ) as ex:

            async def with_cpu(fn: Callable[[], Awaitable[float]]) -> tuple[float, ...]:
                loop0, cpu0 = time.thread_time(), time.process_time()
                calls_per_s = await fn()
                used = time.thread_time() - loop0, time.process_time() - cpu0
                return calls_per_s, *(seconds / sizes.load_calls * 1e6 for seconds in used)

            def base() -> Awaitable[tuple[float, ...]]:
                return with_cpu(lambda: raw_load(raw, sizes.load_calls, callers, cap))

            def ours() -> Awaitable[tuple[float, ...]]:
                return with_cpu(lambda: ae_load(ex, sizes.load_calls, callers, cap))

            await _harness.repeat(
                (rate, loop, cpu),
                {"base": base, "ours": lambda: prof.timed(ours)},
                sizes.repeats,
                name="least-loaded calls",
            )
            served = await ex.call(Echo.served)
    finally:
        kill(raw)
    return [rate, loop, cpu], [f"- least-loaded: calls each rank served (asyncexec): {served}"]


async def bench(sizes: Sizes, args: argparse.Namespace) -> Result:
    prof = Profiler(args.profile)
    rows: list[Pair] = []
    notes: list[str] = []
    if "small" in args.only:
        for n in (1, 4):
            more, said = await measure_small(n, sizes, prof)
            rows += more
            notes += said
    if "scatter" in args.only:
        more, said = await measure_scatter(sizes, prof)
        rows += more
        notes += said
    if "load" in args.only:
        more, said = await measure_load(sizes, prof)
        rows += more
        notes += said
    if args.profile:
        notes.append(f"\n{prof.report()}")
    return Result(rows, _harness.pairs("plain Ray", "asyncexec"), notes)


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec dispatch benchmarks",
        full=FULL,
        quick=QUICK,
        run=bench,
        # The object store small and allocated up front; the scatter's warm-up rounds touch
        # its pages (a put into untouched pages pays their faults, on whichever system's turn
        # it is).
        ray={
            "num_cpus": RAY_CPUS,
            "object_store_bytes": OBJECT_STORE_BYTES,
            "preallocate_store": True,
        },
        figures=FIGURES,
        options=lambda parser: parser.add_argument(
            "--profile", action="store_true", help="cProfile asyncexec's side; print the top"
        ),
        about=lambda sizes, args: (
            f"medians of {sizes.repeats} interleaved repeat(s) (scatter "
            f"{sizes.scatter_repeats}); every worker {RESOURCES}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
