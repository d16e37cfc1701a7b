"""Weights from one executor to another: ``WeightChannel`` against a hand-written broadcast in
the same processes and against the way without a channel, through the driver; the weight version
lag seen by rollout reports through SIGKILLs; the driver's event-loop lag during pushes.

Measured in the caller's Ray (``run.py`` starts it), on the caller's event loop, with a learner
executor of 2 workers and a rollout executor of 4 on one ``asyncexec.Reservation`` (rank i of
both on bundle i):

- **The move** of a state of ``nbytes`` (a dict of ``parts`` float32 tensors, built on the
  learner's rank 0) to the 4 rollout ranks, each repeat in turn:

  - *floor*: a hand-written gloo group over the same 5 processes (learner rank 0 and the 4
    rollout ranks), made with ``execute()`` (a ``TCPStore`` on the source, a
    ``ProcessGroupGloo`` on each), broadcasting one flat float32 tensor of ``nbytes`` from the
    source (the state flattened once beforehand; the receivers' buffers allocated beforehand).
    Its figure is the slowest rank's time from a barrier to the end of ``broadcast``;
  - *torch*: ``await channel.push()`` on a ``WeightChannel(transport="torch")``;
  - *object store*: the same on a ``WeightChannel(transport="object_store")``;
  - *through the driver* (today's way): ``state = await learner.execute_single(0, read_state)``
    then ``await rollout.execute(install_state, state)``.

  Both runs (the learner's function serving the state, the rollout's receiving it) are in
  progress throughout, as in an RL loop; the pushes use ``max_staleness=1`` (a push returns once
  its version is installed everywhere). The first of each is a warm-up, after which every rollout
  rank's copy is checked against the source's checksums.
- **Event-loop lag**: a 1 ms heartbeat (``_common.heartbeat``) while pushing the state
  repeatedly through each transport; the floor column is the same heartbeat while the
  hand-written broadcast runs (the driver then only awaits ``execute()``), and the driver path's
  lag is printed as a contrast.
- **Version lag through SIGKILLs**: the learner's function serves a small state, the rollout's
  reports continuously (``buffer_size=1``); the driver, as an RL loop does, takes each rollout
  step, records ``channel.version - min(step.versions)`` and pushes (``max_staleness=K``),
  while another task SIGKILLs a rank of the rollout and of the learner in turn (pids from
  ``executor.workers``), each time waiting for the restart (the killed executor's restart
  counted, and then for rollout a step of the new attempt, for the learner a successful push)
  before the next kill.

The worker side (the functions that ``run()`` and ``execute()`` send) is at the top of this
module: workers import it by name (the benchmark puts its folder on ``PYTHONPATH``), so its
top-level imports stay light and torch is imported inside the functions.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import random
import signal
import threading
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import asyncexec

if TYPE_CHECKING:
    from _common import Rows

__all__ = ["measure_channel", "measure_version_lag"]

# Worker side ------------------------------------------------------------------------------------

#: The source's state (learner rank 0), built by ``make_state``.
_SOURCE: dict[str, Any] = {}
#: What each way of moving the state installed in this worker: name -> (version, state).
_HELD: dict[str, tuple[int | None, Mapping[str, Any]]] = {}
_HELD_LOCK = threading.Lock()
#: The hand-written gloo group of the floor: store, group, buffer.
_FLOOR: dict[str, Any] = {}
#: The learner's training step, in the version-lag scenario.
_TRAINING = {"step": 0}


def make_state(nbytes: int, parts: int, seed: int = 0) -> list[float]:
    """Build the source's state: ``parts`` float32 tensors of ``nbytes`` in all; return their
    checksums."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    numel = nbytes // 4 // parts
    state = {f"layer{i}.weight": torch.rand(numel, generator=gen) for i in range(parts)}
    _SOURCE["state"] = state
    _SOURCE["flat"] = None
    return checksums(state)


def checksums(state: Mapping[str, Any]) -> list[float]:
    import torch

    return [float(state[k].sum(dtype=torch.float64)) for k in sorted(state)]


def read_state() -> dict[str, Any]:
    """The source's state as it is (it never changes while the benchmark runs)."""
    return dict(_SOURCE["state"])


def _slot(name: str) -> str:
    """Where a way of moving the state keeps it: one slot per transport (the benchmark opens a
    channel of a fresh name per repeat, and must not hold every repeat's 256 MB)."""
    return name.rsplit("-", 1)[0] if name.startswith("bench-") else name


def install(name: str, state: Mapping[str, Any], version: int | None) -> None:
    """Install a received state (as a rollout worker's load_state_dict would hold it), in place
    of the one this way installed before."""
    with _HELD_LOCK:
        _HELD[_slot(name)] = (version, state)


def install_state(state: Mapping[str, Any], name: str = "driver") -> int:
    """``execute()``'s install on the rollout ranks (the driver path); returns the bytes held."""
    install(name, state, None)
    return sum(t.numel() * t.element_size() for t in state.values())


def held_checksums(name: str) -> tuple[int | None, list[float]]:
    with _HELD_LOCK:
        version, state = _HELD[_slot(name)]
    return version, checksums(state)


def forget_held() -> None:
    """Drop every installed state (before the next scenario)."""
    with _HELD_LOCK:
        _HELD.clear()
    _FLOOR.clear()


def floor_store() -> tuple[str, int]:
    """On the source: start the floor's TCPStore; return its address."""
    import torch.distributed as dist

    store = dist.TCPStore("0.0.0.0", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    _FLOOR["store"] = store
    return asyncexec.get_context().node_ip, int(store.port)


def floor_join(host: str, port: int, offset: int, world: int, numel: int, tag: str) -> int:
    """Join the floor's gloo group as rank ``offset + world_rank``; the source (rank 0) flattens
    its state into the buffer it broadcasts, the others allocate theirs."""
    import torch
    import torch.distributed as dist

    rank = offset + asyncexec.get_context().world_rank
    if rank == 0:
        store = _FLOOR["store"]
        flat = torch.cat([t.reshape(-1) for t in _SOURCE["state"].values()])
        assert flat.numel() == numel, (flat.numel(), numel)
    else:
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=60))
        _FLOOR["store"] = store
        flat = torch.empty(numel, dtype=torch.float32)
    group = dist.ProcessGroupGloo(dist.PrefixStore(tag, store), rank, world, timedelta(seconds=120))
    _FLOOR.update(group=group, flat=flat, rank=rank)
    return rank


def floor_broadcast(parts: int = 0) -> float:
    """One broadcast of the flat buffer from rank 0, after a barrier; its seconds on this rank.

    With ``parts``: the state broadcast as that many tensors into receive buffers allocated
    afresh (as the torch channel allocates each version), which this rank then holds in place
    of the previous ones (as an install does): the cost of fresh memory per move."""
    import torch
    import torch.distributed as dist

    group = _FLOOR["group"]
    flat = _FLOOR["flat"]
    if parts and _FLOOR["rank"] == 0:
        buffers = list(flat.chunk(parts))
    elif parts:
        buffers = [torch.empty(flat.numel() // parts, dtype=flat.dtype) for _ in range(parts)]
    else:
        buffers = [flat]
    group.barrier().wait()
    t0 = time.perf_counter()
    for buffer in buffers:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        group.broadcast([buffer], opts).wait()
    elapsed = time.perf_counter() - t0
    if parts and _FLOOR["rank"] != 0:
        _FLOOR["fresh"] = buffers
    return elapsed


def floor_checksum() -> float:
    import torch

    return float(_FLOOR["flat"].sum(dtype=torch.float64))


async def serve_fn(config: dict[str, Any]) -> None:
    """The learner's function of the move: serves the state on every channel, reports once
    (so the driver knows it is served), then idles until the run is stopped."""
    for name in config["channels"]:
        asyncexec.serve_weights(read_state, channel=name)
    asyncexec.report({"ready": 1})
    await asyncio.Event().wait()


async def receive_fn(config: dict[str, Any]) -> None:
    """The rollout's function of the move: installs what every channel delivers."""
    for name in config["channels"]:
        asyncexec.receive_weights(functools.partial(install, name), channel=name)
    asyncexec.report({"ready": 1})
    await asyncio.Event().wait()


def _small_state() -> dict[str, Any]:
    import torch

    return {"w": torch.full((256,), float(_TRAINING["step"]))}


async def learner_fn(config: dict[str, Any]) -> None:
    """The learner of the version-lag scenario: trains (a counter) and serves a small state."""
    asyncexec.serve_weights(_small_state, channel=config["channel"])
    while True:
        await asyncio.sleep(config["period_s"])
        _TRAINING["step"] += 1


def rollout_fn(config: dict[str, Any]) -> None:
    """The rollout of the version-lag scenario: installs each version, reports continuously."""
    name = config["channel"]
    asyncexec.receive_weights(functools.partial(install, name), channel=name)
    i = 0
    while True:
        time.sleep(config["period_s"])
        asyncexec.report({"i": i, "held": asyncexec.weights_version(channel=name)})
        i += 1


# Driver side ------------------------------------------------------------------------------------


async def _enter_pair(
    stack: AsyncExitStack,
    resources: dict[str, float],
    storage: str,
    *,
    learners: int,
    rollouts: int,
    restart: Any = None,
) -> tuple[Any, Any]:
    """A learner and a rollout executor on one Reservation."""
    kwargs: dict[str, Any] = {"resources_per_worker": resources, "storage_path": storage}
    if restart is not None:
        kwargs["restart"] = restart
    bundle = {k: 2 * v for k, v in resources.items()}
    kwargs["reservation"] = await stack.enter_async_context(
        asyncexec.Reservation(max(learners, rollouts), bundle, name="bench-rl")
    )
    learner = await stack.enter_async_context(
        asyncexec.Executor(learners, name="bench-learner", **kwargs)
    )
    rollout = await stack.enter_async_context(
        asyncexec.Executor(rollouts, name="bench-rollout", **kwargs)
    )
    return learner, rollout


class _Consumer:
    """Consumes a run in a task of its own; ``ready`` is set at its first step."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.ready = asyncio.Event()
        self.steps = 0
        self.error: BaseException | None = None
        self.task = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        try:
            async for _ in self.run:
                self.steps += 1
                self.ready.set()
        except Exception as exc:  # shown by the caller
            self.error = exc
            self.ready.set()

    async def wait_ready(self, timeout_s: float) -> None:
        await asyncio.wait_for(self.ready.wait(), timeout_s)
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        await self.run.aclose()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


TRANSPORTS = ("torch", "object_store")


def _channel_name(transport: str, label: int | str) -> str:
    return f"bench-{transport}-{label}"


async def measure_channel(
    rows: Rows,
    notes: list[str],
    nbytes: int,
    parts: int,
    repeats: int,
    lag_pushes: int,
    resources: dict[str, float],
    storage: str,
) -> None:
    """The move of an ``nbytes`` state from the learner's rank 0 to the 4 rollout ranks, every
    way in turn ``repeats`` times after a warm-up (seconds); then the loop's lag during pushes
    (ms); each filed in ``rows``, with what the table cannot show in ``notes``.

    An executor receives from one open channel at a time, so each repeat opens a channel per
    transport in turn (a fresh name each: a worker never installs a version older than the one
    it holds of a name), pushes twice untimed (the torch transport builds its process group,
    then fills its two receive buffers per tensor) and times the third push."""
    import ray
    from _common import gc_log, heartbeat, lag_ms, progress

    #: Each way's seconds per repeat: floor (timed in the workers, in the driver, into receive
    #: buffers allocated afresh), torch, object_store, driver, driver_put (one ray.put for 4).
    moved: dict[str, list[float]] = {}
    #: Each way's event-loop lag (p99, max ms); each transport's garbage collections (count,
    #: longest ms).
    lag: dict[str, tuple[float, float]] = {}
    gcs: dict[str, tuple[int, float]] = {}
    numel = nbytes // 4 // parts * parts
    labels: list[int | str] = [*range(repeats + 1), "lag"]
    async with AsyncExitStack() as stack:
        learner, rollout = await _enter_pair(stack, resources, storage, learners=2, rollouts=4)
        source_sums = await learner.execute_single(0, make_state, nbytes, parts)

        # The floor's gloo group: learner rank 0 and the 4 rollout ranks.
        host, port = await learner.execute_single(0, floor_store)
        world = 1 + rollout.config.num_workers
        await asyncio.gather(
            learner.execute_single(0, floor_join, host, port, 0, world, numel, "floor"),
            rollout.execute(floor_join, host, port, 1, world, numel, "floor"),
        )

        consumers: list[_Consumer] = []
        try:
            config = {"channels": [_channel_name(t, label) for t in TRANSPORTS for label in labels]}
            consumers = [
                _Consumer(learner.run(serve_fn, config)),
                _Consumer(rollout.run(receive_fn, config)),
            ]
            for consumer in consumers:
                await consumer.wait_ready(120)

            def open_channel(transport: str, label: int | str) -> Any:
                return asyncexec.WeightChannel(
                    learner,
                    rollout,
                    name=_channel_name(transport, label),
                    transport=transport,
                    max_staleness=1,
                )

            async def floor(fresh: int = 0) -> tuple[float, float]:
                t0 = time.perf_counter()
                first, rest = await asyncio.gather(
                    learner.execute_single(0, floor_broadcast, fresh),
                    rollout.execute(floor_broadcast, fresh),
                )
                return max([first, *rest]), time.perf_counter() - t0

            async def push(channel: Any) -> float:
                t0 = time.perf_counter()
                await channel.push()
                return time.perf_counter() - t0

            async def channel_move(transport: str, label: int) -> float:
                async with open_channel(transport, label) as channel:
                    # A channel in its steady state, as a long-lived one is: the first push
                    # builds the torch transport's group, the first two fill its two receive
                    # buffers per tensor (used in turn from then on).
                    await push(channel)
                    await push(channel)
                    return await push(channel)

            async def driver() -> float:
                t0 = time.perf_counter()
                state = await learner.execute_single(0, read_state)
                await rollout.execute(install_state, state)
                return time.perf_counter() - t0

            async def driver_put() -> float:
                t0 = time.perf_counter()
                state = await learner.execute_single(0, read_state)
                ref = await asyncio.to_thread(ray.put, state)
                del state
                await rollout.execute(install_state, ref, "driver_put")
                return time.perf_counter() - t0

            for i in range(repeats + 1):
                which = f"repeat {i}" if i else "warm-up"
                progress(f"weight channel: {nbytes >> 20} MB move, {which}")
                f, f_driver = await floor()
                samples = {"floor": f, "floor_driver": f_driver}
                samples["floor_fresh"] = (await floor(parts))[0]
                samples |= {"driver": await driver(), "driver_put": await driver_put()}
                for transport in TRANSPORTS:
                    samples[transport] = await channel_move(transport, i)
                if i == 0:
                    notes += await _verify(rollout, source_sums)
                    continue
                for way, value in samples.items():
                    moved.setdefault(way, []).append(value)

            progress(f"weight channel: event-loop lag during {nbytes >> 20} MB pushes")
            async with heartbeat() as lags:
                for _ in range(lag_pushes):
                    await floor()
            lag["floor"] = lag_ms(lags)
            for transport in TRANSPORTS:
                async with open_channel(transport, "lag") as channel:
                    await push(channel)
                    await push(channel)
                    with gc_log() as collections:
                        async with heartbeat() as lags:
                            for _ in range(lag_pushes):
                                await push(channel)
                    lag[transport] = lag_ms(lags)
                    gcs[transport] = (
                        len(collections),
                        max((c.end - c.start for c in collections), default=0.0) * 1e3,
                    )
                    stats = channel.statistics()
                notes.append(f"- weight channel {transport}: {stats}")
            async with heartbeat() as lags:
                await driver()
            lag["driver"] = lag_ms(lags)
        finally:
            for consumer in consumers:
                await consumer.close()
            await asyncio.gather(
                learner.execute(forget_held), rollout.execute(forget_held), return_exceptions=True
            )
    _file_moves(rows, notes, moved, lag, gcs, nbytes >> 20, parts)


def _file_moves(
    rows: Rows,
    notes: list[str],
    moved: dict[str, list[float]],
    lag: dict[str, tuple[float, float]],
    collections: dict[str, tuple[int, float]],
    mb: int,
    parts: int,
) -> None:
    """The moves' rows (each channel against the floor's broadcast; the store channel and the
    driver against the driver's way) and the notes of every way and ratio."""
    from _common import median

    for figure, column, way in (
        ("channel_torch", "floor", "floor"),
        ("channel_driver", "floor", "floor"),
        ("channel_torch", "asyncexec", "torch"),
        ("channel_torch", "driver", "driver"),  # for the check; not a column
        ("channel_store", "floor", "driver"),
        ("channel_driver", "asyncexec", "driver"),
        ("channel_store", "asyncexec", "object_store"),
    ):
        for value in moved[way]:
            rows.add(figure, column, value)
    for way, key in (("torch", "torch"), ("object_store", "store")):
        for column, found in (("asyncexec", way), ("floor", "floor")):
            if found in lag:
                rows.add(f"channel_lag_p99_{key}", column, lag[found][0])
                rows.add(f"channel_lag_max_{key}", column, lag[found][1])

    def speed(way: str) -> str:
        value = median(moved[way])
        return f"{value:.3f} s ({mb / value:,.0f} MB/s to each rank)"

    torch, store, driver = (median(moved[w]) for w in ("torch", "object_store", "driver"))
    repeats = len(moved["floor"])
    notes.append(
        f"- weight channel, {mb} MB in {parts} tensors to 4 ranks (medians of {repeats}): floor "
        f"broadcast {speed('floor')}, the same timed in the driver around execute() "
        f"{median(moved['floor_driver']):.3f} s, the same as {parts} tensors into receive "
        f"buffers allocated afresh each move (what reuse_buffers=False costs) "
        f"{speed('floor_fresh')}; torch channel in its steady state (third push) "
        f"{speed('torch')}; object store channel {speed('object_store')}; through the driver "
        f"{speed('driver')}; through the driver with one ray.put for the 4 ranks "
        f"{speed('driver_put')}"
    )
    notes.append(
        f"- weight channel ratios: floor / torch channel {median(moved['floor']) / torch:.2f}x "
        f"(target >= 0.8x), through the driver / torch channel {driver / torch:.2f}x, through "
        f"the driver / object store channel {driver / store:.2f}x"
    )
    lags = ", ".join(f"{way} {p99:.2f} / {worst:.1f}" for way, (p99, worst) in lag.items())
    gcs = ", ".join(
        f"{way} {count}, longest {longest:.1f} ms" for way, (count, longest) in collections.items()
    )
    notes.append(
        f"- event-loop lag during {mb} MB moves (p99 / max, ms): {lags}; the driver's "
        f"garbage collections meanwhile: {gcs or '-'}"
    )


async def _verify(rollout: Any, source_sums: list[float]) -> list[str]:
    """Check every rollout rank's copy (each way) against the source's checksums."""
    notes = []
    total = sum(source_sums)
    wrong = [
        rank
        for rank, value in enumerate(await rollout.execute(floor_checksum))
        if not math.isclose(value, total, rel_tol=1e-6)
    ]
    notes.append(f"floor {'ok' if not wrong else f'WRONG on ranks {wrong}'}")
    ways = [("driver", "driver"), ("driver_put", "driver_put")]
    ways += [(t, _channel_name(t, 0)) for t in TRANSPORTS]
    for way, name in ways:
        held = await rollout.execute(held_checksums, name)
        bad = [rank for rank, (_, sums) in enumerate(held) if sums != source_sums]
        versions = sorted({v for v, _ in held}, key=str)
        notes.append(
            f"{way} {'ok' if not bad else f'WRONG on ranks {bad}'}"
            + (f" (versions held {versions})" if way in TRANSPORTS else "")
        )
    return ["- the state each rollout rank holds, checked against the source: " + ", ".join(notes)]


@dataclass
class LagFigures:
    """The version lag scenario's outcome."""

    staleness: int
    transport: str
    max_lag: int = -1
    steps: int = 0
    steps_none: int = 0  # steps after the first push with a rank that held no version
    none_at: list[str] = field(default_factory=list)  # the first few of them
    over: int = 0  # steps whose lag exceeded the bound
    pushes: int = 0
    push_errors: dict[str, int] = field(default_factory=dict)
    kills: list[str] = field(default_factory=list)  # which rank, how long to the restart
    recovery_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lag_histogram: dict[int, int] = field(default_factory=dict)
    statistics: str = ""


async def measure_version_lag(
    rows: Rows,
    notes: list[str],
    kills: int,
    staleness: int,
    resources: dict[str, float],
    storage: str,
    *,
    transport: str = "torch",
    period_s: float = 0.01,
    settle_steps: int = 20,
    kill_timeout_s: float = 90.0,
) -> None:
    """The RL loop with a staleness bound through ``kills`` SIGKILLs (rollout, learner, ...):
    the largest version lag filed in ``rows``, what the loop saw in ``notes``."""
    import tenacity
    from _common import median, progress

    figures = LagFigures(staleness, transport)
    restart = asyncexec.RestartPolicy(max_restarts=None, wait=tenacity.wait_none())
    name = "bench-lag"
    rng = random.Random(14)
    async with AsyncExitStack() as stack:
        learner, rollout = await _enter_pair(
            stack, resources, storage, learners=2, rollouts=4, restart=restart
        )
        channel = await stack.enter_async_context(
            asyncexec.WeightChannel(
                learner,
                rollout,
                name=name,
                transport=transport,
                max_staleness=staleness,
                timeout_s=30.0,
            )
        )
        learner_consumer = _Consumer(
            learner.run(learner_fn, {"channel": name, "period_s": period_s})
        )
        state = {"attempt": 0, "last_push_ok": 0.0, "steps_at": 0}
        step_seen = asyncio.Event()
        stopping = asyncio.Event()

        async def loop() -> None:
            async for step in rollout.run(
                rollout_fn, {"channel": name, "period_s": period_s}, buffer_size=1
            ):
                state["attempt"] = step.attempt
                figures.steps += 1
                step_seen.set()
                if channel.version > 0:
                    versions = list(step.versions)
                    if any(v is None for v in versions):
                        figures.steps_none += 1
                        if len(figures.none_at) < 3:
                            figures.none_at.append(
                                f"step {step.index} attempt {step.attempt} version "
                                f"{channel.version} versions {versions}"
                            )
                    lag = channel.version - min(v or 0 for v in versions)
                    figures.lag_histogram[lag] = figures.lag_histogram.get(lag, 0) + 1
                    figures.max_lag = max(figures.max_lag, lag)
                    if lag > staleness:
                        figures.over += 1
                try:
                    await channel.push()
                    figures.pushes += 1
                    state["last_push_ok"] = time.perf_counter()
                except Exception as exc:  # counted: ChannelError while the learner restarts
                    if stopping.is_set() or isinstance(exc.__cause__, asyncio.CancelledError):
                        # push() turns a cancellation into a ChannelError: do not loop on.
                        raise asyncio.CancelledError from exc
                    kind = type(exc).__name__
                    figures.push_errors[kind] = figures.push_errors.get(kind, 0) + 1

        async def wait_for(predicate: Any, timeout_s: float) -> None:
            deadline = time.perf_counter() + timeout_s
            while not predicate():
                if time.perf_counter() > deadline:
                    raise TimeoutError
                step_seen.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(step_seen.wait(), 0.05)

        loop_task = asyncio.create_task(loop())

        async def report_progress() -> None:
            while True:
                await asyncio.sleep(10)
                progress(
                    f"weight channel: version lag: {figures.steps} steps, {figures.pushes} "
                    f"pushes, version {channel.version}, max lag {figures.max_lag}, failed "
                    f"pushes {figures.push_errors}"
                )

        reporter = asyncio.create_task(report_progress())
        try:
            await wait_for(lambda: figures.pushes >= 5 and figures.steps >= settle_steps, 120)
            for i in range(kills):
                executor, who = (rollout, "rollout") if i % 2 == 0 else (learner, "learner")
                workers = executor.workers
                rank = rng.randrange(len(workers))
                pid = workers[rank].pid
                restarts = executor.statistics().restarts
                steps0, attempt0 = figures.steps, state["attempt"]
                progress(f"weight channel: version lag, SIGKILL {i + 1}/{kills} ({who} {rank})")
                t_kill = time.perf_counter()
                os.kill(pid, signal.SIGKILL)

                def restarted(
                    executor: Any = executor,
                    restarts: int = restarts,
                    who: str = who,
                    t_kill: float = t_kill,
                    steps0: int = steps0,
                    attempt0: int = attempt0,
                ) -> bool:
                    if executor.statistics().restarts <= restarts:
                        return False
                    if who == "rollout":
                        return bool(state["attempt"] > attempt0)
                    return bool(state["last_push_ok"] > t_kill and figures.steps > steps0)

                try:
                    await wait_for(restarted, kill_timeout_s)
                except TimeoutError:
                    figures.failures.append(
                        f"kill {i + 1} ({who} rank {rank}): no restart within "
                        f"{kill_timeout_s:.0f} s (restarts {executor.statistics().restarts}, "
                        f"steps {figures.steps})"
                    )
                    if loop_task.done():
                        break
                    continue
                recovery = time.perf_counter() - t_kill
                figures.recovery_s.append(recovery)
                figures.kills.append(f"{who} rank {rank} {recovery:.2f} s")
                settled = figures.steps + settle_steps
                pushes = figures.pushes + 2
                await wait_for(
                    lambda settled=settled, pushes=pushes: (
                        figures.steps >= settled and figures.pushes >= pushes
                    ),
                    kill_timeout_s,
                )
                if loop_task.done():
                    break
        finally:
            reporter.cancel()
            stopping.set()
            loop_task.cancel()
            results = await asyncio.gather(loop_task, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(
                    result, asyncio.CancelledError
                ):
                    figures.failures.append(f"the rollout loop ended: {result!r}")
            await learner_consumer.close()
            if learner_consumer.error is not None:
                figures.failures.append(f"the learner's run ended: {learner_consumer.error!r}")
            figures.statistics = str(channel.statistics())
            await asyncio.gather(
                learner.execute(forget_held), rollout.execute(forget_held), return_exceptions=True
            )
    if figures.max_lag >= 0:
        rows.add("channel_version_lag", "asyncexec", figures.max_lag)
    histogram = ", ".join(f"{k}: {v}" for k, v in sorted(figures.lag_histogram.items()))
    notes.append(
        f"- version lag ({transport} transport, K={staleness}): {figures.steps} rollout steps, "
        f"lags {{{histogram}}}, {figures.over} over K, {figures.steps_none} with a rank holding "
        f"no version ({'; '.join(figures.none_at) or '-'}); {figures.pushes} pushes, failed "
        f"pushes {figures.push_errors or 0}"
    )
    notes.append(
        f"- version lag: {len(figures.recovery_s)} of {kills} SIGKILLs restarted, median "
        f"{median(figures.recovery_s):.2f} s from the kill (rollout: a step of the new attempt; "
        f"learner: a push after the restart); " + "; ".join(figures.kills)
    )
    notes += [f"- version lag FAILURE: {failure}" for failure in figures.failures]
    notes.append(f"- version lag channel statistics: {figures.statistics}")
