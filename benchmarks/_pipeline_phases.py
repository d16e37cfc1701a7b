"""The pipeline benchmark's measurements, one coroutine per figure, each on open executors (the
servers, a trainer and the weight channel between them) and a Router of its own.

All of them run on the caller's event loop and never block it; none asserts a time (the table
shows the figures), but each checks what must hold whatever the times (every request answered
once, no sample beyond the bound in strict mode), and reports a failure of it as a figure.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FunctionType, TracebackType
from typing import Any

import anyio
from _pipeline_workload import Job, long_tailed

import asyncexec

__all__ = [
    "Held",
    "Sizes",
    "balance",
    "held_in_flight",
    "kill_one",
    "pause_resume",
    "pipeline_pauses",
    "sticky",
]


#: List what a request in flight holds by kind (``--diagnose``): the objects tracked with the
#: 256 in flight of :func:`held_in_flight`, less those before.
COUNT_OBJECTS = False
#: Their kinds, over the repeats.
KINDS: Counter[str] = Counter()
TRACEBACKS: Counter[str] = Counter()  # where the tracebacks held in flight were raised
CELLS: Counter[str] = Counter()  # the closures held in flight


def _where(tb: Any) -> str:
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename.rsplit('/', 2)[-1]}:{tb.tb_lineno} {code.co_qualname}"


def _cell(fn: Any) -> str:
    return f"{fn.__qualname__} ({len(fn.__closure__ or ())} cells)"


def _kind(o: object) -> str:
    kind = type(o)
    if kind.__name__ == "coroutine":
        return f"coroutine {getattr(o, '__qualname__', '?')}"
    return f"{kind.__module__}.{kind.__qualname__}"


@dataclass(frozen=True)
class Sizes:
    repeats: int
    servers: int  # rollout servers (4)
    batch: int  # samples per batch (B)
    batches: int  # per throughput run
    train_s: float  # the trainer's simulated update
    token_s: float  # the servers' simulated time per token
    chunk_tokens: int  # tokens per chunk: the pause points' spacing
    max_in_flight: int  # per server, for the throughput runs
    pause_in_flight: int  # in flight when pausing (256)
    pause_chunk_s: float  # one chunk's time in the pause figure
    kill_requests: int
    balance_s: float  # how long the uniform load runs
    sessions: int
    turns: int
    floor_steps: int  # reports per worker of the streaming floor (a pass)
    #: The floor streams (pass after pass) for as long as the pipeline's repeat took.
    floor_matched: bool = True


async def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll ``condition`` every 5 ms (the router's counters change on this loop)."""
    with anyio.fail_after(timeout_s):
        while not condition():  # noqa: ASYNC110 (the counters have no event to wait on)
            await anyio.sleep(0.005)


# Pause to resume ------------------------------------------------------------------------------


async def pause_resume(
    servers: asyncexec.Executor,
    channel: asyncexec.WeightChannel,
    sizes: Sizes,
    lags: list[float],
) -> dict[str, float]:
    """With ``sizes.pause_in_flight`` long generations in flight over the servers: the time
    from ``router.pause("keep")`` to the end of ``router.resume()`` (the generations go on),
    then the same with ``"abort"`` (each ends at its pause point, its sample aborted); ms. And
    the event loop's max lag while the 256 are sent, and from the pause to the resume (by the
    heartbeat's ``lags``)."""
    cap = math.ceil(sizes.pause_in_flight / sizes.servers)
    router = asyncexec.Router(servers, max_in_flight=cap, channel=channel)
    chunk = max(1, round(sizes.pause_chunk_s / sizes.token_s))
    job = Job(int(60.0 / sizes.token_s), chunk)  # a minute long: far longer than the figure
    out: dict[str, float] = {}
    aborted = 0
    last_answer = 0.0

    async def one(i: int) -> None:
        nonlocal aborted, last_answer
        sample = await router.generate(asyncexec.RolloutRequest(("pause", i), job), retry=False)
        aborted += sample.aborted
        last_answer = time.perf_counter()

    async with router, anyio.create_task_group() as tg:
        for i in range(sizes.pause_in_flight):
            tg.start_soon(one, i)
        mark = len(lags)
        await wait_until(lambda: sum(router.in_flight.values()) == sizes.pause_in_flight)
        await anyio.sleep(0.5)  # every generation past its first chunk
        out["sending_lag_ms"] = max(lags[mark:], default=0.0) * 1e3
        for mode in ("keep", "abort"):
            mark = len(lags)
            t0 = time.perf_counter()
            await router.pause(mode)  # type: ignore[arg-type]
            paused = time.perf_counter()
            await router.resume()
            out[f"{mode}_ms"] = (time.perf_counter() - t0) * 1e3
            out[f"{mode}_pause_ms"] = (paused - t0) * 1e3
            if mode == "abort":
                out["abort_answered_at_resume"] = float(aborted)
            await anyio.sleep(0.2)
            out[f"{mode}_lag_ms"] = max(lags[mark:], default=0.0) * 1e3
            if mode == "abort":
                out["abort_last_answer_ms"] = (last_answer - t0) * 1e3
    out["aborted"] = float(aborted)
    return out


# What a request in flight holds ----------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """What the collector tracks in the driver: every object, and three kinds of them."""

    objects: int
    task_handles: int  # anyio task-group tasks
    cancel_scopes: int  # anyio cancel scopes
    tracebacks: int  # exceptions kept alive (their tracebacks)

    @classmethod
    def now(cls, diagnose: int = 0) -> Held:
        """Counted after a full collection; with ``diagnose`` (+1 or -1, ``--diagnose``), the
        kinds, the tracebacks' and the closures' also added to (taken from) :data:`KINDS`,
        :data:`TRACEBACKS` and :data:`CELLS`."""
        import anyio._backends._asyncio as anyio_asyncio
        from anyio._core._tasks import TaskHandle

        gc.collect()
        tracked = gc.get_objects()
        kinds = Counter(type(o) for o in tracked)
        if diagnose:
            for counter, found in (
                (KINDS, Counter(_kind(o) for o in tracked)),
                (TRACEBACKS, Counter(_where(o) for o in tracked if type(o) is TracebackType)),
                (CELLS, Counter(_cell(o) for o in tracked if type(o) is FunctionType)),
            ):
                counter.update({k: diagnose * v for k, v in found.items()})
        return cls(
            len(tracked),
            kinds[TaskHandle],
            kinds[anyio_asyncio.CancelScope],
            kinds[TracebackType],
        )

    def per(self, before: Held, n: int) -> dict[str, float]:
        """What each of ``n`` things in flight now held, against ``before`` they were."""
        return {
            f: (getattr(self, f) - getattr(before, f)) / n
            for f in ("objects", "task_handles", "cancel_scopes", "tracebacks")
        }


async def held_in_flight(
    servers: asyncexec.Executor, floor_actors: list[Any], sizes: Sizes
) -> dict[str, dict[str, float]]:
    """What a request in flight holds in the driver, counted by the collector (what each
    collection of the older generations walks), with ``sizes.pause_in_flight`` in flight:
    through a Router over the servers (long generations, each awaited by a plain asyncio task,
    so that the callers add no anyio task or scope), and, the floor, a bare call of a plain
    async actor awaited the same way. Counted against the same with nothing in flight, after a
    full collection; run outside the heartbeat (the collections stall the loop)."""
    n = sizes.pause_in_flight
    cap = math.ceil(n / sizes.servers)
    job = Job(int(60.0 / sizes.token_s), max(1, round(sizes.pause_chunk_s / sizes.token_s)))
    out: dict[str, dict[str, float]] = {}
    async with asyncexec.Router(servers, max_in_flight=cap) as router:
        before = Held.now(-COUNT_OBJECTS)
        callers = [
            asyncio.ensure_future(
                router.generate(asyncexec.RolloutRequest(("held", i), job), retry=False)
            )
            for i in range(n)
        ]
        await wait_until(lambda: sum(router.in_flight.values()) == n)
        await anyio.sleep(0.5)  # every generation past its first chunk
        out["router"] = Held.now(+COUNT_OBJECTS).per(before, n)
        await router.pause("abort")
        await router.resume()
        await asyncio.gather(*callers)
    before = Held.now()
    calls = [
        asyncio.ensure_future(_awaited(floor_actors[i % len(floor_actors)].sleep.remote(1.0)))
        for i in range(n)
    ]
    await anyio.sleep(0.5)
    out["floor"] = Held.now().per(before, n)
    await asyncio.gather(*calls)
    return out


async def _awaited(ref: Any) -> Any:
    return await ref


async def pipeline_pauses(
    servers: asyncexec.Executor, channel: asyncexec.WeightChannel, sizes: Sizes
) -> dict[str, float]:
    """The same through a pipeline (aggregate mode, S = 1, B = 128: 256 admitted, each a
    minute long): ``update_weights(on_update="abort")``, then ``"keep"`` once 256 are in
    flight again; the pipeline's own figure of each (pause to resume, the push apart) and the
    push's time, in ms. A last ``router.pause("abort")`` ends the generations left."""
    cap = math.ceil(sizes.pause_in_flight / sizes.servers)
    router = asyncexec.Router(servers, max_in_flight=cap, channel=channel)
    chunk = max(1, round(sizes.pause_chunk_s / sizes.token_s))
    job = Job(int(60.0 / sizes.token_s), chunk)
    out: dict[str, float] = {}
    async with router:
        async with asyncexec.Pipeline(
            router,
            itertools.repeat(job),
            batch_size=sizes.pause_in_flight // 2,
            staleness=1,
            mode="aggregate",
            channel=channel,
        ) as pipe:
            for mode in ("abort", "keep"):
                await wait_until(lambda: sum(router.in_flight.values()) == sizes.pause_in_flight)
                await anyio.sleep(0.5)  # every generation past its first chunk
                await pipe.update_weights(on_update=mode)
                figures = pipe.statistics().pauses[mode]
                out[f"{mode}_ms"] = figures.max_s * 1e3
                out[f"{mode}_push_ms"] = figures.push_s * 1e3
        await router.pause("abort")  # the requests the pipeline left end on their servers
        await router.resume()
    return out


# One server killed ----------------------------------------------------------------------------


async def kill_one(
    servers: asyncexec.Executor, channel: asyncexec.WeightChannel, sizes: Sizes, seed: int
) -> dict[str, float]:
    """Callers keep 32 long-tailed requests in flight over the servers, with a push every 0.5 s;
    after ``sizes.kill_requests`` answers the last server is SIGKILLed, and the load goes on
    until its replacement has answered 10 requests sent after the kill (or 60 s). How many
    requests were answered other than once (0), the router's dropped duplicates, how long until
    the replacement answered, and how many of its answers ran on a version older than the one
    delivered to every server when they were sent (0). Not the channel's latest version: a
    request sent while a push is on its way may run, on any server, on the version before."""
    router = asyncexec.Router(servers, max_in_flight=8, channel=channel)
    jobs = long_tailed(seed)
    sent: list[int] = []
    answers: Counter[int] = Counter()
    victim = max(w.world_rank for w in servers.workers)
    killed_at = math.inf
    rejoined_at = math.nan
    stale_after = replaced = 0
    enough = anyio.Event()

    async def caller() -> None:
        nonlocal rejoined_at, stale_after, replaced
        while not enough.is_set():
            i, at, version = len(sent), time.perf_counter(), channel.statistics().delivered
            sent.append(i)
            sample = await router.generate(asyncexec.RolloutRequest(i, next(jobs)))
            answers[sample.id] += 1
            if sample.rank == victim and at > killed_at:
                replaced += 1
                stale_after += sample.version is None or sample.version < version
                if math.isnan(rejoined_at):
                    rejoined_at = time.perf_counter() - killed_at
                if replaced >= 10:
                    enough.set()

    async def pusher() -> None:
        while not enough.is_set():
            await anyio.sleep(0.5)
            await channel.push()

    async with router, anyio.create_task_group() as tg:
        for _ in range(32):
            tg.start_soon(caller)
        tg.start_soon(pusher)
        await wait_until(lambda: sum(answers.values()) >= sizes.kill_requests)
        pid = next(w.pid for w in servers.workers if w.world_rank == victim)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.perf_counter()
        with anyio.move_on_after(60):
            await enough.wait()
        enough.set()
        stats = router.statistics()
    return {
        "not_once": float(sum(1 for i in sent if answers[i] != 1)),
        "requests": float(len(sent)),
        "duplicates_dropped": float(stats.duplicates_dropped),
        "rejoined_s": rejoined_at,
        "replaced_answers": float(replaced),
        "stale_after": float(stale_after),
    }


# Balance and sticky sessions ------------------------------------------------------------------


async def balance(servers: asyncexec.Executor, sizes: Sizes) -> dict[str, float]:
    """Uniform requests, half the servers' capacity kept in flight for ``sizes.balance_s``:
    max / mean in flight per server, sampled every 5 ms (the median and the 99th percentile
    of the samples)."""
    cap = 16
    router = asyncexec.Router(servers, max_in_flight=cap)
    callers = sizes.servers * cap // 2
    ratios: list[float] = []
    stop = anyio.Event()
    ids = iter(range(10**9))

    async def caller() -> None:
        while not stop.is_set():
            await router.generate(asyncexec.RolloutRequest(("b", next(ids)), Job(40)))

    async with router, anyio.create_task_group() as tg:
        for _ in range(callers):
            tg.start_soon(caller)
        await anyio.sleep(0.5)  # all callers in
        end = time.perf_counter() + sizes.balance_s
        while time.perf_counter() < end:
            counts = list(router.in_flight.values())
            mean = sum(counts) / len(counts)
            if mean > 0:
                ratios.append(max(counts) / mean)
            await anyio.sleep(0.005)
        stop.set()
    ratios.sort()
    return {
        "ratio_p50": ratios[len(ratios) // 2] if ratios else math.nan,
        "ratio_p99": ratios[int(len(ratios) * 0.99)] if ratios else math.nan,
        "samples": float(len(ratios)),
    }


async def sticky(servers: asyncexec.Executor, sizes: Sizes) -> dict[str, float]:
    """``sizes.sessions`` sessions at once, each ``sizes.turns`` requests in turn with its key:
    how many sessions stayed on one server."""
    router = asyncexec.Router(servers, max_in_flight=8)
    ranks: dict[int, set[int]] = {}

    async def session(k: int) -> None:
        for turn in range(sizes.turns):
            request = asyncexec.RolloutRequest(("s", k, turn), Job(8), key=f"session-{k}")
            ranks.setdefault(k, set()).add((await router.generate(request)).rank)

    async with router, anyio.create_task_group() as tg:
        for k in range(sizes.sessions):
            tg.start_soon(session, k)
    return {"kept": float(sum(len(r) == 1 for r in ranks.values())), "sessions": len(ranks)}
