"""The group kinds' scenarios: pools (a leased worker killed mid-run, an idle one between leases,
one while its executor closes), standby spares, two executors on a reservation, runs of
independent ranks and elastic sizes. Each runs inside the scenario's cancel scope (a third of
them are cancelled at a random moment) and records on its :class:`Outcome` what the fault's
semantics break. ``RUNNERS`` maps these kinds to their coroutines."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import tenacity

import asyncexec
import asyncexec.backends
from benchmarks._common import live_placement_groups
from benchmarks.chaos.group_invariants import (
    check_independent,
    check_pool,
    check_resizes,
    check_sized,
    independent_complete,
    sized_complete,
)
from benchmarks.chaos.harness import (
    _alive,
    _cancel_scope,
    _cancelled,
    _check_failures,
    _check_result,
    _close_under_kill,
    _config,
    _consume,
    _executor,
    _fault_at,
    _first_of_attempt_after,
    _idle_pids,
    _kill,
    _prefix,
    _recovery,
    _Seen,
    _spare_pids,
    _wait_dead,
    _wait_until,
)
from benchmarks.chaos.invariants import RECOVERY_BOUND_S
from benchmarks.chaos.scenarios import Env, Outcome, Scenario
from benchmarks.chaos.worker import counter, sized_counter, starts

__all__ = ["RUNNERS"]

#: What each pool worker holds.
POOL_CPU = {"CPU": 0.25}
#: Bound on a pool's refill: from its executors' close to every bundle holding a live idle worker.
REFILL_BOUND_S = 30.0
#: The custom resource of the elastic kind: 2 on the head node, 2 on the node it removes.
SLOT = "chaos_slot"

Runner = Callable[[Scenario, Env, Outcome, Path], Awaitable[None]]


async def _refilled(
    out: Outcome, pool: asyncexec.WorkerPool, dead: list[int], since: float | None
) -> None:
    """Wait for the pool to hold ``size`` live idle workers, none of them ``dead``; check it, and
    record the time from ``since`` (the kill) as the scenario's recovery."""

    def full() -> bool:
        stats, pids = pool.statistics(), _idle_pids(pool)
        return (
            stats.idle == pool.size
            and stats.leased == 0
            and stats.starting == 0
            and not set(pids) & set(dead)
            and all(_alive(p) for p in pids)
        )

    if await _wait_until(full, REFILL_BOUND_S) and since is not None:
        out.recovery_s.append(time.time() - since)
    stats, pids = pool.statistics(), _idle_pids(pool)
    gone = [p for p in pids if not _alive(p)]
    out.record(check_pool(pool.size, stats.idle, stats.leased, pids, [*dead, *gone]))


async def _lease_all(
    out: Outcome, sc: Scenario, env: Env, pool: asyncexec.WorkerPool, dead: list[int], d: Path
) -> None:
    """Lease every worker of the pool and run the counter on them: no dead process among them,
    and the run finishes whole on its first attempt."""
    whole = dataclasses.replace(sc, workers=pool.size)
    seen = _Seen()
    async with _executor(whole, env, pool=pool, resources_per_worker=None, name="lease-all") as ex:
        pids = [w.pid for w in ex.workers]
        bad = [p for p in pids if p in dead or not _alive(p)]
        if bad:
            out.fail("no_dead_lease", f"a lease handed out dead processes {bad}")
        await _consume(ex.run(counter, _config(whole, d, None)), seen, None, False)
        _check_result(out, whole, ex, seen, [])


# Pools ------------------------------------------------------------------------------------------


async def _pool_leased(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """SIGKILL a leased worker at step ``at``: the run restarts on live workers and finishes
    whole; the pool refills (``flag``: one more worker than the executor leases)."""
    size = sc.workers + int(sc.flag)
    seen = _Seen()
    killed: list[int] = []
    fault_time: list[float] = []
    t0 = time.time()
    with _cancel_scope(sc) as scope:
        async with asyncexec.WorkerPool(size, resources_per_worker=POOL_CPU) as pool:
            async with _executor(sc, env, pool=pool, resources_per_worker=None) as ex:

                def kill() -> None:
                    killed.append(ex.workers[sc.rank].pid)
                    _kill(killed[0])

                run = ex.run(counter, _config(sc, directory, None))
                await _consume(run, seen, _fault_at(sc.at, fault_time, kill), sc.slow)
                crashed = [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))]
                _check_result(out, sc, ex, seen, crashed)
                bad = [w.pid for w in ex.workers if w.pid in killed or not _alive(w.pid)]
                if bad:
                    out.fail("no_dead_lease", f"the restart leased dead processes {bad}")
            _recovery(out, fault_time[0] if fault_time else None, seen, 1, 1)
            await _refilled(out, pool, killed, None)
            await _lease_all(out, sc, env, pool, killed, directory)
    out.steps = len(seen.steps)
    if _cancelled(out, sc, scope, t0):
        _prefix(out, sc, seen)


async def _pool_idle(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """A run leases ``workers`` of ``workers + 1`` and finishes; SIGKILL an idle worker; then
    (at once, with ``flag``, else after the refill) a lease of every worker: none is dead, the
    run finishes whole on its first attempt, and the pool refills."""
    size = sc.workers + 1
    seen = _Seen()
    killed: list[int] = []
    t0 = time.time()
    with _cancel_scope(sc) as scope:
        async with asyncexec.WorkerPool(size, resources_per_worker=POOL_CPU) as pool:
            async with _executor(sc, env, pool=pool, resources_per_worker=None) as ex:
                await _consume(ex.run(counter, _config(sc, directory, None)), seen, None, sc.slow)
                _check_result(out, sc, ex, seen, [])
            await _wait_until(lambda: pool.statistics().idle == size, REFILL_BOUND_S)
            victim = sorted(_idle_pids(pool))[sc.rank % size]
            killed.append(victim)
            fault_time = time.time()
            _kill(victim)
            if not await _wait_dead(victim):
                out.fail("setup", f"process {victim} did not die")
            if not sc.flag:
                await _refilled(out, pool, killed, fault_time)
            await _lease_all(out, sc, env, pool, killed, directory)
            await _refilled(out, pool, killed, fault_time if sc.flag else None)
            if pool.statistics().replaced < 1:
                out.fail("pool_refills", "the dead idle worker was never replaced")
    out.steps = len(seen.steps)
    if _cancelled(out, sc, scope, t0):
        _prefix(out, sc, seen)


async def _pool_closing(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Break out of the run at step ``at`` and leave the executor; SIGKILL a leased worker
    ``delay_s`` later, while the executor gives its workers back. The exit is clean and bounded,
    the pool refills with live workers, and a lease of every worker then runs whole."""
    size = sc.workers + int(sc.flag)
    seen = _Seen()
    t0 = time.time()
    with _cancel_scope(sc) as scope:
        async with asyncexec.WorkerPool(size, resources_per_worker=POOL_CPU) as pool:
            executor = _executor(sc, env, pool=pool, resources_per_worker=None)
            _, pid, kill_time = await _close_under_kill(out, sc, seen, executor, directory)
            _prefix(out, sc, seen)
            killed = [] if pid is None else [pid]
            if pid is not None:
                await _wait_dead(pid)
            await _refilled(out, pool, killed, kill_time)
            await _lease_all(out, sc, env, pool, killed, directory)
    out.steps = len(seen.steps)
    _cancelled(out, sc, scope, t0)


# Spares and reservations --------------------------------------------------------------------------


async def _spares(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """An executor with one standby spare (leased from a pool, with ``alt``); SIGKILL rank
    ``rank`` at step ``at``: the spare takes its place, no new group starts, the run resumes and
    finishes whole. With ``flag``, once the spare has been refilled, SIGKILL rank ``rank2`` at
    attempt 2's first step: the refilled spare takes that place."""
    seen = _Seen()
    kills: list[tuple[int, int | None, float]] = []  # (rank, the spare expected, when)
    before: list[int] = []
    t0 = time.time()
    with _cancel_scope(sc) as scope:
        async with contextlib.AsyncExitStack() as stack:
            options: dict[str, Any] = {"spares": 1}
            if sc.alt:
                pool = asyncexec.WorkerPool(sc.workers + 2, resources_per_worker=POOL_CPU)
                options.update(
                    pool=await stack.enter_async_context(pool), resources_per_worker=None
                )
            ex = await stack.enter_async_context(_executor(sc, env, **options))
            before += [w.pid for w in ex.workers]

            async def kill(rank: int) -> None:
                spare = _spare_pids(ex)
                if not spare:
                    out.fail("spare_refilled", "no spare stood by when the rank was killed")
                kills.append((rank, spare[0] if spare else None, time.time()))
                _kill(ex.workers[rank].pid)

            async def on_step(step: asyncexec.Step) -> bool:
                if step.attempt == 1 and step.index == sc.at and not kills:
                    await kill(sc.rank)
                elif sc.flag and step.attempt == 2 and len(kills) == 1:
                    # The consumer holds the stream until the spare is back.
                    if not await _wait_until(lambda: len(_spare_pids(ex)) == 1, RECOVERY_BOUND_S):
                        kills.append((-1, None, time.time()))
                        out.fail("spare_refilled", "no new spare within the recovery bound")
                        return False
                    await kill(sc.rank2)
                return False

            await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
            failures = [(asyncexec.WorkerCrashedError, frozenset({r})) for r, _, _ in kills]
            _check_result(out, sc, ex, seen, failures)
            expected = list(before)
            for rank, spare, _ in kills:
                if rank >= 0 and spare is not None:
                    expected[rank] = spare
            got = [w.pid for w in ex.workers]
            if got != expected:
                out.fail("spare_used", f"the ranks' processes are {got}, expected {expected}")
            if ex.statistics().group_starts != 1:
                out.fail("no_new_group", f"{ex.statistics().group_starts} groups started")
    out.steps = len(seen.steps)
    if _cancelled(out, sc, scope, t0):
        _prefix(out, sc, seen)
        return
    for number, (_, _, when) in enumerate(kills, 1):
        _recovery(out, when, seen, number, 1)


async def _side_by_side(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Two executors in one event loop (kill_neighbour), or on one Reservation (reservation: rank
    i of each on bundle i, half a CPU each); SIGKILL a rank of one (``a``; ``b`` when a
    reservation draws ``flag``) at its step ``at``: it restarts once (in its bundles) and
    finishes whole; the other finishes whole on its first attempt, on the same processes. On a
    reservation the other's run goes on while the victim recovers, the reservation's placement
    group stays, and closing gives every claim back."""
    shared = sc.kind == "reservation"
    seen = {"a": _Seen(), "b": _Seen()}
    victim, other = ("b", "a") if shared and sc.flag else ("a", "b")
    fault_time: list[float] = []
    t0 = time.time()
    with _cancel_scope(sc) as scope:
        async with contextlib.AsyncExitStack() as stack:
            options: dict[str, Any] = {}
            if shared:
                reservation = asyncexec.Reservation(sc.workers, {"CPU": 1})
                options["reservation"] = await stack.enter_async_context(reservation)
                options["resources_per_worker"] = {"CPU": 0.5}
                ids = await _placement_groups()
            async with (
                _executor(sc, env, name=f"chaos{sc.number}a", **options) as a,
                _executor(sc, env, name=f"chaos{sc.number}b", **options) as b,
            ):
                executors = {"a": a, "b": b}
                pids_other = [w.pid for w in executors[other].workers]

                def kill() -> None:
                    _kill(executors[victim].workers[sc.rank].pid)

                on_step = _fault_at(sc.at, fault_time, kill)
                async with anyio.create_task_group() as tg:
                    for key, ex in executors.items():
                        config = _config(sc, directory / key, None)
                        await anyio.Path(directory / key).mkdir()
                        hook = on_step if key == victim else None
                        tg.start_soon(_consume, ex.run(counter, config), seen[key], hook, sc.slow)
                crashed = [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))]
                _check_result(out, sc, executors[victim], seen[victim], crashed)
                _check_result(out, sc, executors[other], seen[other], [])
                if [w.pid for w in executors[other].workers] != pids_other:
                    out.fail("isolation", "the other executor's workers changed")
                if shared:
                    _went_on(out, seen[victim], seen[other], fault_time)
                    if (now := await _placement_groups()) != ids:
                        out.fail("reservation_kept", f"placement groups {ids} became {now}")
            if shared and reservation.statistics().claims:
                out.fail("claims_returned", f"claims left: {reservation.statistics().claims}")
    out.steps = len(seen["a"].steps) + len(seen["b"].steps)
    if _cancelled(out, sc, scope, t0):
        _prefix(out, sc, seen["a"])
        _prefix(out, sc, seen["b"])
        return
    _recovery(out, fault_time[0] if fault_time else None, seen[victim], 1, 1)


async def _placement_groups() -> list[str]:
    """The ids of the cluster's live placement groups, sorted."""
    groups = await anyio.to_thread.run_sync(live_placement_groups)
    return sorted(g["placement_group_id"] for g in groups)


def _went_on(out: Outcome, victim: _Seen, other: _Seen, fault_time: list[float]) -> None:
    """The other run delivered a step between the kill and the victim's next attempt, unless it
    had delivered every step before the kill."""
    if not fault_time or not other.times or other.times[-1] <= fault_time[0]:
        return
    end = _first_of_attempt_after(victim, 1) or victim.ended
    if not any(fault_time[0] < t <= end for t in other.times):
        out.fail("other_went_on", "the other run delivered no step while this one recovered")


# Independent ranks and elastic sizes --------------------------------------------------------------


async def _independent(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """A run of independent ranks (beside a standby spare, with ``alt``); SIGKILL rank ``rank``
    when it reports its step ``at``: only that rank restarts, from its own checkpoint; every
    survivor's function started once and delivered each step once; every result is right."""
    seen = _Seen()
    fault_time: list[float] = []
    t0 = time.time()
    with _cancel_scope(sc) as scope:
        async with _executor(sc, env, spares=int(sc.alt)) as ex:
            pids = [w.pid for w in ex.workers]

            async def on_step(step: asyncexec.Step) -> bool:
                value = step.reports[0].metrics["step"]
                if step.rank == sc.rank and step.attempt == 1 and value == sc.at and not fault_time:
                    fault_time.append(time.time())
                    _kill(pids[sc.rank])
                return False

            run = ex.run(counter, _config(sc, directory, None), independent=True)
            await _consume(run, seen, on_step, sc.slow)
            if seen.error is None:
                result = ex.result
                out.record(
                    independent_complete(
                        seen.steps,
                        result.return_values,
                        workers=sc.workers,
                        total=sc.steps,
                        replaced=frozenset({sc.rank}),
                    )
                )
                out.attempts = result.attempts
                expected = [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))]
                _check_failures(out, result.failures, expected)
                if ex.statistics().restarts != 1:
                    out.fail("restarts", f"statistics().restarts is {ex.statistics().restarts}")
                _started_once(out, sc, pids, await ex.execute(starts))
    out.record(check_independent(seen.steps, workers=sc.workers, every=sc.every))
    out.steps = len(seen.steps)
    if _cancelled(out, sc, scope, t0):
        return
    if seen.error is not None:
        out.fail("finished", f"the run ended with {type(seen.error).__name__}: {seen.error}")
    _recovery(out, fault_time[0] if fault_time else None, seen, 1, 1)


def _started_once(
    out: Outcome, sc: Scenario, pids: list[int], started: list[tuple[int, int]]
) -> None:
    for rank, (pid, count) in enumerate(started):
        replaced = rank == sc.rank
        if count != 1 or (pid == pids[rank]) == replaced:
            out.fail(
                "survivor_started_once",
                f"rank {rank} ({'replaced' if replaced else 'survivor'}) is process {pid} (was "
                f"{pids[rank]}), whose function started {count} time(s)",
            )


async def _elastic(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """An elastic executor of (2, 4) workers, each needing one of 2 slots on the head and 2 on
    an added node; remove that node at step ``at``: the run goes on with 2 (with ``alt``, a
    backend, so a fresh group); at its first step, add the node back: the run grows to 4 again.
    Every step resumes from the latest checkpoint at one size per attempt."""
    cluster, node = env.cluster, env.node
    if cluster is None or node is None:
        out.fail("setup", "elastic needs the cluster (run without --no-nodes)")
        return
    seen = _Seen()
    timing: dict[str, float] = {}
    config = {**_config(sc, directory, None), "sleep": 0.05, "limit": 3000}
    config.update(until_attempt=3, after=3)
    t0 = time.time()
    try:
        with _cancel_scope(sc) as scope:
            async with asyncexec.Executor(
                (2, 4),
                resources_per_worker={"CPU": 0.25, SLOT: 1},
                restart=asyncexec.RestartPolicy(max_restarts=1, wait=tenacity.wait_none()),
                elastic_check_interval_s=0.5,
                timeouts=asyncexec.Timeouts(placement_s=20),
                storage_path=env.root / "storage",
                backend=asyncexec.backends.Backend() if sc.alt else None,
                buffer_size=sc.buffer,
                name=f"chaos{sc.number}",
            ) as ex:
                lost = frozenset(w.world_rank for w in ex.workers if w.node_id == node.node_id)

                async def on_step(step: asyncexec.Step) -> bool:
                    if step.attempt == 1 and step.index == sc.at and "removed" not in timing:
                        timing["removed"] = time.time()
                        remove = functools.partial(cluster.remove_node, allow_graceful=False)
                        await anyio.to_thread.run_sync(remove, node)
                        env.node = None
                    elif step.attempt == 2 and "added" not in timing:
                        timing["added"] = time.time()
                        with env.beat.excused():  # Ray's Node sets signal handlers: main thread
                            env.node = cluster.add_node(num_cpus=2, resources={SLOT: 2})
                    return False

                await _consume(ex.run(sized_counter, config), seen, on_step, sc.slow)
                _check_elastic(out, sc, ex, seen, lost)
    finally:
        if env.node is not None:
            await anyio.to_thread.run_sync(cluster.remove_node, env.node)
            env.node = None
    out.steps = len(seen.steps)
    out.record(check_sized(seen.steps, every=sc.every, least=2, most=4))
    if _cancelled(out, sc, scope, t0):
        return
    _recovery(out, timing.get("removed"), seen, 1, 1)


def _check_elastic(
    out: Outcome, sc: Scenario, ex: asyncexec.Executor, seen: _Seen, lost: frozenset[int]
) -> None:
    if seen.error is not None:
        out.fail("finished", f"the run ended with {type(seen.error).__name__}: {seen.error}")
        return
    if len(lost) != 2:
        out.fail("setup", f"ranks {sorted(lost)} were on the added node, expected 2")
    result, stats = ex.result, ex.statistics()
    out.attempts = result.attempts
    out.record(sized_complete(seen.steps, result.return_values, total=sc.steps))
    out.record(check_resizes(seen.steps, most=4))
    _check_failures(out, result.failures, [(asyncexec.NodeLostError, lost)])
    if (stats.restarts, stats.resizes) != (1, 2):
        out.fail("restarts", f"restarts {stats.restarts}, resizes {stats.resizes}; expected 1, 2")


RUNNERS: dict[str, Runner] = {
    "pool_leased": _pool_leased,
    "pool_idle": _pool_idle,
    "pool_closing": _pool_closing,
    "spares": _spares,
    "reservation": _side_by_side,
    "kill_neighbour": _side_by_side,
    "independent": _independent,
    "elastic": _elastic,
}
