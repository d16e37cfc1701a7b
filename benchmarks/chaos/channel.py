"""The weight channel's scenarios: a source executor (one rank, ``learner``) and a target
executor (``rollout``, its ranks independent when ``flag`` is drawn) joined by a
:class:`asyncexec.WeightChannel`, both runs going on while the driver tags the source's state and
pushes it; the source's rank or a target rank is SIGKILLed during one push. ``RUNNERS`` maps
these kinds to their coroutine."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import anyio
import tenacity

import asyncexec
from benchmarks.chaos.group_invariants import Install, Push, check_channel, check_ticks
from benchmarks.chaos.harness import (
    _cancel_scope,
    _cancelled,
    _consume,
    _executor,
    _kill,
    _Seen,
    _wait_until,
)
from benchmarks.chaos.invariants import RECOVERY_BOUND_S
from benchmarks.chaos.scenarios import Env, Outcome, Scenario
from benchmarks.chaos.worker import installs, learner, rollout, set_tag

__all__ = ["RUNNERS"]

#: The seconds a source's read and a target's install take: a kill drawn within 0.45 s after
#: a push's start lands during it most of the time, and one drawn a second or so before it
#: meets the push with the killed side's new group starting.
READ_S = 0.25
INSTALL_S = 0.1
#: Pushes after the one the kill lands in (the first of them after both sides are back).
PUSHES_AFTER = 2


class _Pushes:
    """The driver's side of the scenario: tag the source's state, push it, record each push."""

    def __init__(
        self, source: asyncexec.Executor, channel: asyncexec.WeightChannel, pushes: list[Push]
    ) -> None:
        self.source = source
        self.channel = channel
        self.pushes = pushes
        self.tag = 0

    async def push(self) -> Push:
        self.tag += 1
        pid: int | None = None
        # When the source is down, the push below must fail with a ChannelError.
        with contextlib.suppress(asyncexec.AsyncExecError):
            pid = (await self.source.execute(set_tag, self.tag))[0]
        try:
            version = await self.channel.push()
            record = Push(self.tag, pid, version, time.time())
        except Exception as exc:
            record = Push(self.tag, pid, None, time.time(), type(exc).__name__)
        self.pushes.append(record)
        return record


async def _channel(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """One source rank, ``workers`` target ranks; pushes 1..k-1 go through; ``delay_s`` after
    push k starts (before it, when negative), SIGKILL the source's rank (channel_source) or
    target rank ``rank``: that push returns or raises ChannelError; once the killed side's run is
    back, the next push must go through, and then every promise of the channel holds (see
    ``check_channel``)."""
    kill_at = 1 + sc.at % 3
    config = {
        "sleep": 0.02,
        "read_sleep": READ_S,
        "install_sleep": INSTALL_S,
        "transport": sc.transport,
    }
    policy = asyncexec.RestartPolicy(max_restarts=2, wait=tenacity.wait_none())
    seen = {"source": _Seen(), "target": _Seen()}
    victim = "source" if sc.kind == "channel_source" else "target"
    fault_time: list[float] = []
    runs: dict[str, asyncexec.Run] = {}
    installed: dict[int, list[Install]] = {}
    pushes: list[Push] = []
    stop = anyio.Event()
    t0 = time.time()
    one = dataclasses.replace(sc, workers=1)
    with _cancel_scope(sc) as scope:
        async with (
            _executor(one, env, name=f"chaos{sc.number}src", restart=policy) as source,
            _executor(sc, env, name=f"chaos{sc.number}dst", restart=policy) as target,
            asyncexec.WeightChannel(
                source,
                target,
                transport=sc.transport,
                timeout_s=30,
            ) as channel,
        ):
            driver = _Pushes(source, channel, pushes)
            runs = {
                "source": source.run(learner, config),
                "target": target.run(rollout, config, independent=sc.flag),
            }

            async def until_stop(step: asyncexec.Step) -> bool:
                return stop.is_set()

            async with anyio.create_task_group() as tg:
                for side, run in runs.items():
                    slow = sc.slow and side == "target"
                    tg.start_soon(_consume, run, seen[side], until_stop, slow)
                await _push_and_kill(out, sc, driver, seen, victim, fault_time, kill_at)
                stop.set()
            for pid, rows in await target.execute(installs):
                installed[pid] = rows
            for run in runs.values():
                await run.aclose()
            out.note = f"{channel.statistics()}"
    out.steps = len(seen["target"].steps)
    cancelled = _cancelled(out, sc, scope, t0)
    for side, workers in (("source", 1), ("target", sc.workers)):
        unaligned = side == "target" and sc.flag
        out.record(check_ticks(seen[side].steps, workers=workers, unaligned=unaligned))
        if seen[side].error is not None:
            out.fail("finished", f"the {side}'s run ended with {seen[side].error!r}")
    out.record(check_channel(seen["target"].steps, pushes, installed))
    if cancelled:
        return
    _check_attempts(out, sc, runs, victim)
    back = next(
        (t for s, t in zip(seen[victim].steps, seen[victim].times, strict=True) if s.attempt > 1),
        None,
    )
    if fault_time and back is not None:
        out.recovery_s.append(back - fault_time[0])


async def _push_and_kill(
    out: Outcome,
    sc: Scenario,
    driver: _Pushes,
    seen: dict[str, _Seen],
    victim: str,
    fault_time: list[float],
    kill_at: int,
) -> None:
    """Push ``kill_at + PUSHES_AFTER`` times, killing the victim during push ``kill_at``."""
    executors = {"source": driver.source, "target": driver.channel.target}
    if not await _wait_until(lambda: bool(seen["source"].steps and seen["target"].steps), 60):
        out.fail("setup", "the runs delivered no step")
        return
    for number in range(1, kill_at + PUSHES_AFTER + 1):
        if number == kill_at + 1:
            back = await _wait_until(
                lambda: any(s.attempt > 1 for s in seen[victim].steps), RECOVERY_BOUND_S
            )
            if not back:
                out.fail("recovery_time", f"the {victim}'s run was not back within the bound")
                return
        if number != kill_at:
            record = await driver.push()
        else:
            rank = 0 if victim == "source" else sc.rank
            pid = executors[victim].workers[rank].pid
            if sc.delay_s < 0:  # the push starts while the killed side goes down
                fault_time.append(time.time())
                _kill(pid)
                await anyio.sleep(-sc.delay_s)
            async with anyio.create_task_group() as tg:

                async def kill(pid: int) -> None:
                    await anyio.sleep(sc.delay_s)
                    fault_time.append(time.time())
                    _kill(pid)

                if sc.delay_s >= 0:
                    tg.start_soon(kill, pid)
                record = await driver.push()
        if number == kill_at + 1 and record.version is None:
            out.fail("push_after_recovery", f"the first push after recovery raised {record.error}")
    # Reports made after the last push returned: what it delivered shows in the stream.
    last = driver.pushes[-1].returned
    await _wait_until(
        lambda: any(r.metrics["t"] > last for s in seen["target"].steps for r in s.reports), 10
    )


def _check_attempts(
    out: Outcome, sc: Scenario, runs: dict[str, asyncexec.Run], victim: str
) -> None:
    """The killed side restarted once, for its killed rank; the other side never restarted."""
    for side, run in runs.items():
        failures = list(run.failures)
        if side == victim:
            rank = 0 if side == "source" else sc.rank
            ok = (
                run.attempt == 2
                and len(failures) == 1
                and isinstance(failures[0], asyncexec.WorkerCrashedError)
                and failures[0].rank == rank
            )
        else:
            ok = run.attempt == 1 and not failures
        if not ok:
            out.fail(
                "restarts",
                f"the {side}'s run is on attempt {run.attempt} after failures "
                f"{[type(f).__name__ for f in failures]}",
            )


RUNNERS = {"channel_source": _channel, "channel_target": _channel}
