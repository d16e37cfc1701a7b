"""The driver's tools for a scenario: an executor and a config for the counter, a consumer that
records what it sees, the init-hook :class:`Gate`, kills, cluster leftovers, an event-loop
heartbeat, the cancellation of a group kind, and the checks of a run against what its fault
allows (recorded on an :class:`Outcome`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import tenacity

import asyncexec
from benchmarks._common import live_placement_groups, live_workers
from benchmarks.chaos.invariants import (
    RECOVERY_BOUND_S,
    STOP_BOUND_S,
    check_complete,
    check_stream,
)
from benchmarks.chaos.scenarios import Env, Outcome, Scenario
from benchmarks.chaos.worker import counter, gate_hook

__all__ = ["Gate", "leftovers", "wait_no_leftovers"]

#: The seconds each step of the counter sleeps.
STEP_SLEEP_S = 0.02
#: The seconds a slow consumer spends on each step.
SLOW_CONSUMER_S = 0.1
#: The seconds each step sleeps in node-loss scenarios.
NODE_STEP_SLEEP_S = 0.25


def leftovers() -> str:
    """Live ``_Worker`` actors and placement groups not removed, described; empty when none.
    Blocking (it asks the GCS): call it off the event loop."""
    actors, groups = live_workers(), live_placement_groups()
    if not actors and not groups:
        return ""
    return (
        f"{len(actors)} worker actor(s) {[a['State'] for a in actors]}, "
        f"{len(groups)} placement group(s) {[g['state'] for g in groups]}"
    )


async def wait_no_leftovers(timeout_s: float = 15.0) -> str:
    """Wait until nothing is left in the cluster; return what is still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await anyio.to_thread.run_sync(leftovers)
        if not found or time.monotonic() > deadline:
            return found
        await anyio.sleep(0.1)


class Gate:
    """The driver's side of :func:`gate_hook`: releases every worker's init hook, except that of
    the armed rank, which it kills with SIGKILL (or, with ``hold``, never releases), once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.armed: int | None = None
        self.hold = False
        self.kills: list[float] = []
        self._seen: set[str] = set()

    def arm(self, rank: int, *, hold: bool = False) -> None:
        self.armed, self.hold = rank, hold

    def hook(self) -> Callable[[], None]:
        return functools.partial(gate_hook, str(self.directory))

    def _scan(self) -> None:
        for name in sorted(os.listdir(self.directory)):
            if not (name.startswith("hook-") and name.endswith(".json")) or name in self._seen:
                continue
            self._seen.add(name)
            info = json.loads((self.directory / name).read_text())
            if self.armed is not None and info["rank"] == self.armed:
                self.armed = None
                if not self.hold:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(info["pid"], signal.SIGKILL)
                self.kills.append(time.time())
            else:
                (self.directory / f"go-{info['pid']}").touch()

    async def serve(self) -> None:
        """Release or kill hooks as they appear; runs until cancelled."""
        while True:
            await anyio.to_thread.run_sync(self._scan)
            await anyio.sleep(0.01)


@dataclass
class _Seen:
    """What the consumer saw: the steps, when each arrived, and how the stream ended."""

    steps: list[asyncexec.Step] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: BaseException | None = None
    ended: float = 0.0


async def _consume(
    run: asyncexec.Run,
    seen: _Seen,
    on_step: Callable[[asyncexec.Step], Awaitable[bool]] | None = None,
    slow: bool = False,
) -> None:
    """Read ``run`` into ``seen``; ``on_step`` returning True breaks out of the loop; a ``slow``
    consumer spends SLOW_CONSUMER_S on each step (so that the driver waits on it with steps in
    hand). An error that ends the stream is recorded, not raised."""
    try:
        async for step in run:
            seen.steps.append(step)
            seen.times.append(time.time())
            if on_step is not None and await on_step(step):
                break
            if slow:
                await anyio.sleep(SLOW_CONSUMER_S)
    except Exception as exc:
        seen.error = exc
    finally:
        seen.ended = time.time()


def _fault_at(
    at: int, fault_time: list[float], act: Callable[[], object]
) -> Callable[[asyncexec.Step], Awaitable[bool]]:
    """An ``on_step`` that injects the fault once, when the consumer sees step ``at`` of attempt
    1: it records the time in ``fault_time`` and calls ``act`` (awaiting what it returns, if
    anything awaitable). It never breaks out of the loop."""

    async def on_step(step: asyncexec.Step) -> bool:
        if step.attempt == 1 and step.index == at and not fault_time:
            fault_time.append(time.time())
            done = act()
            if inspect.isawaitable(done):
                await done
        return False

    return on_step


def _prefix(out: Outcome, sc: Scenario, seen: _Seen) -> None:
    """What a consumer that stopped early (cancelled, or broke out) saw: a valid prefix of the
    stream, and no error."""
    out.record(check_stream(seen.steps, workers=sc.workers, every=sc.every))
    if seen.error is not None:
        out.fail("finished", f"the stream ended with {type(seen.error).__name__}: {seen.error}")


async def _close_under_kill(
    out: Outcome, sc: Scenario, seen: _Seen, executor: asyncexec.Executor, directory: Path
) -> tuple[asyncexec.Executor | None, int | None, float | None]:
    """Enter ``executor``, break out of its run at step ``at`` and leave it; SIGKILL rank
    ``rank`` ``delay_s`` after the break, while the executor closes. Leaving must be clean and
    bounded. Returns the executor (None when entering it failed), the killed pid and when the
    kill landed."""
    broke = anyio.Event()
    entered: list[asyncexec.Executor] = []
    pids: list[int] = []
    timing: dict[str, float] = {}

    async def killer() -> None:
        await broke.wait()
        if not pids or "break" not in timing:
            return  # the executor never ran: nothing to kill
        await anyio.sleep(sc.delay_s)
        timing["kill"] = time.time()
        if not _kill(pids[0]):
            out.note = "the kill came after the worker had exited"

    async def on_step(step: asyncexec.Step) -> bool:
        return step.index >= sc.at

    async with anyio.create_task_group() as tg:
        tg.start_soon(killer)
        try:
            async with executor as ex:
                entered.append(ex)
                pids.append(ex.workers[sc.rank].pid)
                await _consume(
                    ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow
                )
                timing["break"] = time.time()
                broke.set()
        except Exception as exc:
            out.fail("clean_exit", f"leaving the executor raised {type(exc).__name__}: {exc}")
        finally:
            broke.set()
        timing["closed"] = time.time()
    took = timing["closed"] - timing.get("break", timing["closed"])
    if took > STOP_BOUND_S:
        out.fail("stop_time", f"closing the executor took {took:.1f} s")
    return (entered[0] if entered else None), (pids[0] if pids else None), timing.get("kill")


def _config(sc: Scenario, directory: Path, fault: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "steps": sc.steps,
        "every": sc.every,
        # A removed node's workers outlive its raylet for a moment and keep reporting until the
        # cluster declares the node dead (about a second): slow steps keep the run going past it.
        "sleep": NODE_STEP_SLEEP_S if sc.kind == "node_lost" else STEP_SLEEP_S,
        "dir": str(directory),
        "fault": fault,
    }


def _executor(
    sc: Scenario, env: Env, *, start_s: float = asyncexec.Timeouts.start_s, **options: Any
) -> asyncexec.Executor:
    defaults: dict[str, Any] = {
        "resources_per_worker": {"CPU": 0.5},
        "storage_path": env.root / "storage",
        "buffer_size": sc.buffer,
        "restart": asyncexec.RestartPolicy(max_restarts=3, wait=tenacity.wait_none()),
        "timeouts": asyncexec.Timeouts(
            start_s=start_s, stop_s=5.0, shutdown_s=10.0, graceful_patience_s=2.0
        ),
        "name": f"chaos{sc.number}",
    }
    defaults.update(options)
    return asyncexec.Executor(sc.workers, **defaults)


def _worker_faults(directory: Path) -> list[float]:
    return sorted(float(p.read_text()) for p in directory.glob("fault-a*.time"))


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _first_of_attempt_after(seen: _Seen, attempt: int) -> float | None:
    """When the first step of an attempt later than ``attempt`` arrived (or the stream ended)."""
    for step, t in zip(seen.steps, seen.times, strict=True):
        if step.attempt > attempt:
            return t
    return seen.ended if seen.ended else None


def _check_failures(
    out: Outcome,
    failures: Sequence[BaseException],
    expected: Sequence[tuple[type[BaseException], frozenset[int] | None]],
) -> None:
    """Each failure of the expected kind, naming an expected rank, with attempts 1, 2, ..."""
    got = [type(f).__name__ for f in failures]
    want = [t.__name__ for t, _ in expected]
    if len(failures) != len(expected):
        out.fail("restarts", f"failures {got}, expected {want}")
        return
    for number, (failure, (kind, ranks)) in enumerate(zip(failures, expected, strict=True), 1):
        if not isinstance(failure, kind):
            detail = str(failure).splitlines()[0] if str(failure) else ""
            out.fail(
                "failure_kind",
                f"failure {number} is {type(failure).__name__} ({detail}), "
                f"expected {kind.__name__}",
            )
            continue
        if isinstance(failure, asyncexec.WorkerError):
            if ranks is not None and failure.rank not in ranks:
                out.fail(
                    "failure_rank",
                    f"failure {number} names rank {failure.rank}, expected {sorted(ranks)}",
                )
            if failure.attempt != number:
                out.fail("failure_attempt", f"failure {number} says attempt {failure.attempt}")


def _check_result(
    out: Outcome,
    sc: Scenario,
    ex: asyncexec.Executor,
    seen: _Seen,
    expected: Sequence[tuple[type[BaseException], frozenset[int] | None]],
    *,
    optional: bool = False,
) -> None:
    """A run that must finish: no error, the stream and result whole, the failures expected
    (or, with ``optional``, none at all: the fault may have come too late to matter)."""
    out.record(check_stream(seen.steps, workers=sc.workers, every=sc.every))
    if seen.error is not None:
        out.fail(
            "finished",
            f"the run ended with {type(seen.error).__name__}: "
            f"{str(seen.error).splitlines()[0] if str(seen.error) else ''}",
        )
        return
    result = ex.result
    out.attempts = result.attempts
    if optional and result.attempts == 1:
        expected = []
    out.record(check_complete(seen.steps, result.return_values, workers=sc.workers, total=sc.steps))
    if result.attempts != len(expected) + 1:
        out.fail("restarts", f"{result.attempts} attempts, expected {len(expected) + 1}")
    _check_failures(out, result.failures, expected)
    if ex.statistics().restarts != len(expected):
        out.fail(
            "restarts",
            f"statistics().restarts is {ex.statistics().restarts}, expected {len(expected)}",
        )
    if result.steps != len(seen.steps):
        out.fail("step_count", f"result.steps is {result.steps}, {len(seen.steps)} delivered")


def _recovery(
    out: Outcome, fault_time: float | None, seen: _Seen, attempt: int, faults: int
) -> None:
    if fault_time is None:
        out.fail("fault_injected", "the fault was never injected")
        return
    back = _first_of_attempt_after(seen, attempt)
    if back is None:
        return
    took = max(0.0, back - fault_time)
    out.recovery_s.append(took)
    if took > RECOVERY_BOUND_S * faults:
        out.fail("recovery_time", f"{took:.1f} s from the fault to the next attempt's first step")


# The group kinds' tools --------------------------------------------------------------------------


def _cancel_scope(sc: Scenario) -> anyio.CancelScope:
    """The scope a group kind runs in: cancelled ``sc.cancel_s`` after it is entered, if drawn."""
    return anyio.move_on_after(math.inf if sc.cancel_s is None else sc.cancel_s)


def _cancelled(out: Outcome, sc: Scenario, scope: anyio.CancelScope, t0: float) -> bool:
    """Whether the scenario's cancel struck; if it did, the task must have returned within the
    bound of the cancel."""
    if not scope.cancelled_caught or sc.cancel_s is None:
        if sc.cancel_s is not None:
            _add_note(out, "finished before the cancel")
        return False
    took = time.time() - (t0 + sc.cancel_s)
    _add_note(out, f"cancelled, returned {took:.2f} s later")
    if took > STOP_BOUND_S:
        out.fail("stop_time", f"the cancelled task returned {took:.1f} s after the cancel")
    return True


def _add_note(out: Outcome, note: str) -> None:
    out.note = f"{note}; {out.note}" if out.note else note


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


async def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``predicate`` (what it watches changes in the library's background tasks, which
    offer no event) until it holds or ``timeout_s`` passes; return whether it held."""
    with anyio.move_on_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on but the state itself
            await anyio.sleep(0.02)
        return True
    return False


async def _wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    return await _wait_until(lambda: not _alive(pid), timeout_s)


def _idle_pids(pool: asyncexec.WorkerPool) -> list[int]:
    """The pids of a pool's idle workers (the pool shows only their count)."""
    return [w.metadata.pid for w in pool._stock.idle]


def _spare_pids(ex: asyncexec.Executor) -> list[int]:
    """The pids of an executor's standby spares (the executor does not show them)."""
    group = ex._slot.group
    return [] if group is None else [s.metadata.pid for s in group.spares]
