"""The fault scenarios, one coroutine per kind (kills from the driver, in start-up, in a restart,
in shutdown, between runs and beside another executor; hangs; exhausted restarts; cancellation;
user errors; node loss), each recording on its :class:`Outcome` what the fault's semantics break.
``_RUNNERS`` maps every kind to its coroutine."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import tenacity

import asyncexec
from benchmarks.chaos.harness import (
    Gate,
    _check_failures,
    _check_result,
    _close_under_kill,
    _config,
    _consume,
    _executor,
    _fault_at,
    _kill,
    _prefix,
    _recovery,
    _Seen,
    _worker_faults,
    leftovers,
    wait_no_leftovers,
)
from benchmarks.chaos.invariants import RECOVERY_BOUND_S, STOP_BOUND_S, _ranges, check_stream
from benchmarks.chaos.scenarios import Env, Outcome, Scenario
from benchmarks.chaos.worker import counter


async def _kill_from_driver(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """kill_step, kill_two and kill_end: SIGKILL when the consumer sees step ``at`` (the last
    step for kill_end, after which the run may finish without a restart) of attempt 1."""
    targets = (sc.rank, sc.rank2) if sc.kind == "kill_two" else (sc.rank,)
    at = sc.steps - 1 if sc.kind == "kill_end" else sc.at
    fault_time: list[float] = []
    seen = _Seen()
    async with _executor(sc, env) as ex:

        def kill() -> None:
            for pid in [ex.workers[r].pid for r in targets]:
                _kill(pid)

        on_step = _fault_at(at, fault_time, kill)
        await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
        if not fault_time and seen.error is None:
            # The step was never seen (the run is shorter than the draw): nothing to check.
            out.fail("fault_injected", f"step {at} was never delivered")
        _check_result(
            out,
            sc,
            ex,
            seen,
            [(asyncexec.WorkerCrashedError, frozenset(targets))],
            optional=sc.kind == "kill_end",
        )
    out.steps = len(seen.steps)
    if out.attempts != 1 or sc.kind != "kill_end":
        _recovery(out, fault_time[0] if fault_time else None, seen, 1, 1)


async def _kill_complete(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """A rank kills itself before step ``at`` once every rank reported ``at - 1``: attempt 1
    delivers exactly steps 0..at-1 (every complete step, no partial one)."""
    fault = {"kind": "die", "rank": sc.rank, "at": sc.at, "barrier": True}
    seen = _Seen()
    async with _executor(sc, env) as ex:
        await _consume(ex.run(counter, _config(sc, directory, fault)), seen, None, sc.slow)
        _check_result(out, sc, ex, seen, [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))])
    _complete_steps(out, sc, seen)
    await _worker_recovery(out, seen, directory)


def _complete_steps(out: Outcome, sc: Scenario, seen: _Seen) -> None:
    """A fault a rank injects once every rank reported step ``at - 1``: attempt 1 delivered
    exactly steps 0..at-1 (every complete step, no partial one)."""
    first = [s.reports[0].metrics["step"] for s in seen.steps if s.attempt == 1]
    if first != list(range(sc.at)):
        out.fail(
            "complete_steps_delivered",
            f"attempt 1 delivered steps {_ranges(first)}, "
            f"expected 0-{sc.at - 1} (every rank reported them before the fault)",
        )
    out.steps = len(seen.steps)


async def _worker_recovery(out: Outcome, seen: _Seen, directory: Path) -> None:
    """The recovery from a fault a worker injected (the time it wrote) to attempt 2."""
    faults = await anyio.to_thread.run_sync(_worker_faults, directory)
    _recovery(out, faults[0] if faults else None, seen, 1, 1)


async def _kill_startup(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """SIGKILL a rank in the first start-up's init hook: entering fails with a StartupError and
    leaves nothing; a second executor then runs the whole function."""
    gate = Gate(directory)
    gate.arm(sc.rank)
    seen = _Seen()
    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.serve)
        try:
            async with _executor(sc, env, init_hook=gate.hook()):
                out.fail("startup_error", "the executor started although a worker was killed")
        except asyncexec.StartupError as exc:
            if not str(exc):
                out.fail("clear_error", "the StartupError has no message")
        except Exception as exc:
            out.fail("startup_error", f"entering raised {type(exc).__name__}: {exc}")
        found = await wait_no_leftovers()
        if found:
            out.fail("nothing_left", f"after the failed start-up: {found}")
        async with _executor(sc, env, init_hook=gate.hook()) as ex:
            await _consume(ex.run(counter, _config(sc, directory, None)), seen, None, sc.slow)
            _check_result(out, sc, ex, seen, [])
        tg.cancel_scope.cancel()
    out.steps = len(seen.steps)
    if gate.kills and seen.times:
        took = seen.times[0] - gate.kills[0]
        out.recovery_s.append(took)
        if took > RECOVERY_BOUND_S:
            out.fail(
                "recovery_time", f"{took:.1f} s from the kill to the new executor's first step"
            )
    elif not gate.kills:
        out.fail("fault_injected", "the init hook was never reached")


async def _kill_restart(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """SIGKILL a rank at step ``at``; while the policy waits, check the failed group is gone and
    arm the gate, which kills a rank in the restart's start-up (hang_startup: holds its init hook
    past the start-up deadline): three attempts in all."""
    hold = sc.kind == "hang_startup"
    second: type[BaseException] = asyncexec.StartupTimeoutError if hold else asyncexec.StartupError
    # The deadline covers the worker processes' start too, which on a loaded machine takes
    # seconds; every start-up (the held restart's too) is bounded at 15 s, well past that and
    # still short of the scenario's timeout.
    options: dict[str, Any] = {"start_s": 15.0} if hold else {}
    gate = Gate(directory)
    fault_time: list[float] = []
    seen = _Seen()
    waits: list[str] = []

    async def sleep(seconds: float) -> None:
        waits.append(await anyio.to_thread.run_sync(leftovers))
        if len(waits) == 1:
            gate.arm(sc.rank2, hold=hold)

    policy = asyncexec.RestartPolicy(max_restarts=3, wait=tenacity.wait_none(), sleep=sleep)
    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.serve)
        async with _executor(sc, env, init_hook=gate.hook(), restart=policy, **options) as ex:
            on_step = _fault_at(sc.at, fault_time, lambda: _kill(ex.workers[sc.rank].pid))
            await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
            _check_result(
                out,
                sc,
                ex,
                seen,
                [
                    (asyncexec.WorkerCrashedError, frozenset({sc.rank})),
                    (second, None),
                ],
            )
        tg.cancel_scope.cancel()
    if waits and waits[0]:
        out.fail("group_gone_in_wait", f"while the policy waited: {waits[0]}")
    out.steps = len(seen.steps)
    _recovery(out, fault_time[0] if fault_time else None, seen, 1, 2)


async def _kill_shutdown(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Break out of the run at step ``at`` and leave the executor; SIGKILL a rank ``delay_s``
    later, while the shutdown is under way. The exit must be clean and bounded."""
    seen = _Seen()
    ex, _, _ = await _close_under_kill(out, sc, seen, _executor(sc, env), directory)
    if ex is None:
        return
    _prefix(out, sc, seen)
    if ex.state is not asyncexec.ExecutorState.CLOSED:
        out.fail("clean_exit", f"the executor is {ex.state.value} after leaving it")
    out.steps = len(seen.steps)


async def _exhaust(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """A rank dies at step >= ``at`` on every attempt: ``max_restarts`` restarts, then
    RestartsExhaustedError(attempts=max_restarts + 1) with every failure."""
    fault = {"kind": "die_always", "rank": sc.rank, "at": sc.at}
    seen = _Seen()
    policy = asyncexec.RestartPolicy(max_restarts=sc.max_restarts, wait=tenacity.wait_none())
    async with _executor(sc, env, restart=policy) as ex:
        await _consume(ex.run(counter, _config(sc, directory, fault)), seen, None, sc.slow)
        restarts = ex.statistics().restarts
    out.record(check_stream(seen.steps, workers=sc.workers, every=sc.every))
    attempts = sc.max_restarts + 1
    error = seen.error
    if not isinstance(error, asyncexec.RestartsExhaustedError):
        out.fail(
            "gives_up",
            f"the run ended with {type(error).__name__}, expected RestartsExhaustedError",
        )
        return
    out.attempts = error.attempts
    if error.attempts != attempts:
        out.fail(
            "restarts", f"RestartsExhaustedError.attempts is {error.attempts}, expected {attempts}"
        )
    if restarts != sc.max_restarts:
        out.fail("restarts", f"statistics().restarts is {restarts}, expected {sc.max_restarts}")
    _check_failures(
        out, error.failures, [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))] * attempts
    )
    if error.failures and error.__cause__ is not error.failures[-1]:
        out.fail("clear_error", "the last failure is not the error's __cause__")
    if any(s.reports[0].metrics["step"] >= sc.at for s in seen.steps):
        out.fail("no_partial_step", f"a step at or past {sc.at} was delivered")
    out.steps = len(seen.steps)


async def _hang(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """A rank stops (sleeps, or holds the GIL) at step ``at``: WorkerHungError, one restart."""
    if sc.kind == "hang_step":
        fault = {"kind": "hang", "rank": sc.rank, "at": sc.at}
        options: dict[str, Any] = {"health": asyncexec.HealthChecks(step_timeout_s=1.0)}
        needle = "step deadline"
    else:
        fault = {"kind": "gil", "rank": sc.rank, "at": sc.at}
        options = {"health": asyncexec.HealthChecks(interval_s=0.5, timeout_s=2.0)}
        needle = "health check"
    seen = _Seen()
    async with _executor(sc, env, **options) as ex:
        await _consume(ex.run(counter, _config(sc, directory, fault)), seen, None, sc.slow)
        _check_result(out, sc, ex, seen, [(asyncexec.WorkerHungError, frozenset({sc.rank}))])
        failures = ex.result.failures if seen.error is None else []
    if failures and needle not in str(failures[0]):
        out.fail("clear_error", f"the hang is reported as {str(failures[0])!r}, without {needle!r}")
    out.steps = len(seen.steps)
    await _worker_recovery(out, seen, directory)


async def _cancel(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Cancel the task that holds the executor and reads the run ``delay_s`` after it starts
    (after a SIGKILL at step ``at``, when drawn): it returns within a bound, what it saw is a
    valid prefix, and nothing is left."""
    seen = _Seen()
    holder: list[asyncexec.Executor] = []
    t0 = time.time()
    with anyio.move_on_after(sc.delay_s) as scope:
        async with _executor(sc, env) as ex:
            holder.append(ex)
            at = sc.at if sc.flag else -1  # -1: no step has it, nothing killed
            on_step = _fault_at(at, [], lambda: _kill(ex.workers[sc.rank].pid))
            await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
    took = time.time() - (t0 + sc.delay_s)
    _prefix(out, sc, seen)
    if scope.cancelled_caught:
        out.note = f"cancelled after {len(seen.steps)} step(s)"
        if took > STOP_BOUND_S:
            out.fail("stop_time", f"the cancelled task returned {took:.1f} s after the cancel")
    else:
        out.note = "finished before the cancel"
        expected = [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))] if sc.flag else []
        _check_result(out, sc, holder[0], seen, expected)
    if holder and holder[0].state is not asyncexec.ExecutorState.CLOSED:
        out.fail("clean_exit", f"the executor is {holder[0].state.value} after the cancel")
    out.steps = len(seen.steps)


async def _user_error(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """The function raises on a rank at step ``at`` (after every rank reported ``at - 1``): not
    retried, the run ends with WorkerRaisedError naming the rank, after exactly steps 0..at-1;
    retried (``restart_on_user_error``), the run finishes after one restart."""
    fault = {"kind": "raise", "rank": sc.rank, "at": sc.at, "barrier": True}
    policy = asyncexec.RestartPolicy(
        max_restarts=3, restart_on_user_error=sc.flag, wait=tenacity.wait_none()
    )
    seen = _Seen()
    async with _executor(sc, env, restart=policy) as ex:
        await _consume(ex.run(counter, _config(sc, directory, fault)), seen, None, sc.slow)
        if sc.flag:
            _check_result(out, sc, ex, seen, [(asyncexec.WorkerRaisedError, frozenset({sc.rank}))])
    _complete_steps(out, sc, seen)
    if sc.flag:
        await _worker_recovery(out, seen, directory)
        return
    out.record(check_stream(seen.steps, workers=sc.workers, every=sc.every))
    error = seen.error
    if not isinstance(error, asyncexec.WorkerRaisedError):
        out.fail(
            "clear_error", f"the run ended with {type(error).__name__}, expected WorkerRaisedError"
        )
        return
    if error.rank != sc.rank or error.attempt != 1:
        out.fail("failure_rank", f"the error names rank {error.rank}, attempt {error.attempt}")
    if not isinstance(error.__cause__, ValueError) or "chaos: bad batch" not in str(error):
        out.fail("clear_error", f"the error does not carry the ValueError: {error!r}")
    if "counter" not in error.remote_traceback:
        out.fail("clear_error", "the remote traceback does not show the function")


async def _node_lost(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Add a node, spread two workers over it and the head, remove the node at step ``at`` (the
    consumer waits for the removal, so the workers, held by backpressure, cannot finish first):
    NodeLostError for the rank on it, one restart on what is left, the whole result."""
    cluster, node = env.cluster, env.node
    if cluster is None or node is None:
        out.fail("setup", "node_lost needs the cluster (run without --no-nodes)")
        return
    fault_time: list[float] = []
    seen = _Seen()
    try:
        async with _executor(sc, env, placement_strategy="SPREAD") as ex:
            victims = [w.world_rank for w in ex.workers if w.node_id == node.node_id]
            if not victims:
                out.fail("setup", "SPREAD placed no worker on the added node")
                return

            remove = functools.partial(cluster.remove_node, node, allow_graceful=False)
            on_step = _fault_at(sc.at, fault_time, lambda: anyio.to_thread.run_sync(remove))
            await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
            _check_result(out, sc, ex, seen, [(asyncexec.NodeLostError, frozenset(victims))])
    finally:
        env.node = None
        if not fault_time:
            await anyio.to_thread.run_sync(cluster.remove_node, node)
    out.steps = len(seen.steps)
    _recovery(out, fault_time[0] if fault_time else None, seen, 1, 1)


async def _kill_idle(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """SIGKILL a rank while no run is in progress. With ``flag``, ``execute()`` first: it fails
    with WorkerCrashedError naming the rank, and the next ``execute()`` works on a fresh group.
    Then a run finishes whole (restarting once when nothing replaced the dead group yet)."""
    seen = _Seen()
    async with _executor(sc, env) as ex:
        fault_time = time.time()
        _kill(ex.workers[sc.rank].pid)
        replaced = False
        if sc.flag:
            try:
                await ex.execute(os.getpid)
                out.fail("execute_sees_crash", "execute() on a group with a dead rank succeeded")
            except asyncexec.WorkerCrashedError as exc:
                if exc.rank != sc.rank:
                    out.fail("failure_rank", f"execute() blames rank {exc.rank}, not {sc.rank}")
            except Exception as exc:
                out.fail("execute_sees_crash", f"execute() raised {type(exc).__name__}: {exc}")
            try:
                pids = await ex.execute(os.getpid)
                replaced = len(pids) == sc.workers
            except Exception as exc:
                out.fail(
                    "replaced_after_crash",
                    f"execute() after the crash was reported still fails: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                )
        await _consume(ex.run(counter, _config(sc, directory, None)), seen, None, sc.slow)
        expected = [] if replaced else [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))]
        _check_result(out, sc, ex, seen, expected, optional=not sc.flag)
    out.steps = len(seen.steps)
    if seen.times:
        out.recovery_s.append(seen.times[0] - fault_time)


_RUNNERS: dict[str, Callable[[Scenario, Env, Outcome, Path], Awaitable[None]]] = {
    "kill_step": _kill_from_driver,
    "kill_two": _kill_from_driver,
    "kill_complete": _kill_complete,
    "kill_startup": _kill_startup,
    "kill_restart": _kill_restart,
    "kill_shutdown": _kill_shutdown,
    "kill_end": _kill_from_driver,
    "kill_idle": _kill_idle,
    "hang_startup": _kill_restart,
    "exhaust": _exhaust,
    "hang_step": _hang,
    "hang_gil": _hang,
    "cancel": _cancel,
    "user_error": _user_error,
    "node_lost": _node_lost,
}
