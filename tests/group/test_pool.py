"""WorkerPool and standby spares, against a real Ray: leases, returns, refills, isolation between
leases, a pool too small, a pool closed under an executor, spares taking a failed rank's place."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Any

import anyio
import pytest
from conftest import live_placement_groups, live_workers, wait_no_leaks
from structlog.testing import capture_logs

import asyncexec

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(120)]

CPU = {"CPU": 0.25}


def few(config: Any = None) -> int:
    for i in range(2):
        asyncexec.report({"i": i, "pid": os.getpid()})
    return os.getpid()


def forever() -> None:
    i = 0
    while True:
        asyncexec.report({"i": i})
        i += 1
        time.sleep(0.01)


def idle_pids(pool: asyncexec.WorkerPool) -> set[int]:
    return {w.metadata.pid for w in pool._stock.idle}


async def _wait_until(predicate: Any, timeout_s: float = 30.0) -> None:
    """Wait for the pool's background refill (no public event to wait on), bounded."""
    with anyio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - the refill runs in the pool's own tasks
            await anyio.sleep(0.02)


@pytest.mark.smoke
async def test_executors_lease_warm_workers_and_give_them_back() -> None:
    async with asyncexec.WorkerPool(3, resources_per_worker=CPU) as pool:
        warm = idle_pids(pool)
        assert len(warm) == 3 and pool.statistics().idle == 3
        seen = []
        for _ in range(3):
            async with asyncexec.Executor(2, pool=pool) as ex:
                stats = pool.statistics()
                assert (stats.idle, stats.leased) == (1, 2)
                pids = {w.pid for w in ex.workers}
                assert pids <= warm  # no process started
                steps = [s async for s in ex.run(few)]
                assert len(steps) == 2
                assert set(ex.result.return_values) == pids
                seen.append(pids)
            stats = pool.statistics()
            assert (stats.idle, stats.leased, stats.replaced) == (3, 0, 0)
        assert idle_pids(pool) == warm  # the same processes, lease after lease
    assert live_workers() == []


def leave_traces(config: Any = None) -> dict[str, Any]:
    """Set what a lease must not pass on (environment, context) next to what it does pass on
    (the user's module-level state, here an attribute of a module every worker imports)."""
    os.environ["ASYNCEXEC_TEST_SET_BY_FUNCTION"] = "1"
    json._asyncexec_test_counter = getattr(json, "_asyncexec_test_counter", 0) + 1  # type: ignore[attr-defined]
    return look()


def look() -> dict[str, Any]:
    ctx = asyncexec.get_context()
    return {
        "pid": os.getpid(),
        "executor": ctx.executor_name,
        "run_id": ctx.run_id,
        "checkpoint": asyncexec.get_checkpoint(),
        "hook_env": os.environ.get("ASYNCEXEC_TEST_HOOK"),
        "fn_env": os.environ.get("ASYNCEXEC_TEST_SET_BY_FUNCTION"),
        "counter": getattr(json, "_asyncexec_test_counter", None),
    }


def set_hook_env() -> None:
    os.environ["ASYNCEXEC_TEST_HOOK"] = "set"


def outside_a_run() -> str:
    try:
        asyncexec.get_context()
    except asyncexec.ExecutorStateError:
        return "no context"
    return "context"


def clear_counter() -> None:
    if hasattr(json, "_asyncexec_test_counter"):
        del json._asyncexec_test_counter  # type: ignore[attr-defined]


@pytest.mark.parametrize("reset_hook", [None, clear_counter])
async def test_a_lease_sees_nothing_of_the_previous_one_but_user_module_state(
    reset_hook: Any,
) -> None:
    async with asyncexec.WorkerPool(1, resources_per_worker=CPU, reset_hook=reset_hook) as pool:
        async with asyncexec.Executor(1, pool=pool, init_hook=set_hook_env, name="first") as ex:
            async for _ in ex.run(leave_traces):
                pass
            [first] = ex.result.return_values
        assert first["hook_env"] == "set" and first["counter"] == 1
        async with asyncexec.Executor(1, pool=pool, name="second") as ex:
            assert await ex.execute(outside_a_run) == ["context"]
            async for _ in ex.run(look):
                pass
            [second] = ex.result.return_values
    assert second["pid"] == first["pid"]  # the same process, leased twice
    assert second["executor"] == "second" and second["run_id"] != first["run_id"]
    assert second["checkpoint"] is None
    assert second["hook_env"] is None and second["fn_env"] is None  # the environment is reset
    # The user's module-level state carries over, as in Ray's reused workers, unless reset.
    assert second["counter"] == (1 if reset_hook is None else None)


async def test_an_idle_worker_that_dies_is_replaced_in_the_background() -> None:
    async with asyncexec.WorkerPool(2, resources_per_worker=CPU) as pool:
        victim = sorted(idle_pids(pool))[0]
        os.kill(victim, signal.SIGKILL)
        await _wait_until(lambda: pool.statistics().replaced == 1 and pool.statistics().idle == 2)
        assert victim not in idle_pids(pool)
        async with asyncexec.Executor(2, pool=pool) as ex:
            assert victim not in {w.pid for w in ex.workers}
            assert len([s async for s in ex.run(few)]) == 2


async def test_a_lease_that_finds_a_dead_worker_takes_a_live_one() -> None:
    async with asyncexec.WorkerPool(3, resources_per_worker=CPU) as pool:
        victim = sorted(idle_pids(pool))[0]
        os.kill(victim, signal.SIGKILL)
        # Leased at once: the lease's ping (or the idle watch) finds the dead one.
        async with asyncexec.Executor(2, pool=pool) as ex:
            assert victim not in {w.pid for w in ex.workers}
            assert len([s async for s in ex.run(few)]) == 2
        await _wait_until(lambda: pool.statistics().idle == 3)
        assert victim not in idle_pids(pool)


def dies_on_first_attempt(config: Any = None) -> None:
    ctx = asyncexec.get_context()
    asyncexec.report({"attempt": ctx.attempt})
    if ctx.attempt == 1 and ctx.world_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    asyncexec.report({"attempt": ctx.attempt})


async def test_a_leased_worker_killed_mid_run_is_replaced_and_the_run_restarts() -> None:
    policy = asyncexec.RestartPolicy(max_restarts=2)
    async with asyncexec.WorkerPool(3, resources_per_worker=CPU) as pool:
        warm = idle_pids(pool)
        async with asyncexec.Executor(2, pool=pool, restart=policy) as ex:
            steps = [s async for s in ex.run(dies_on_first_attempt)]
            assert steps[-1].attempt == 2
            assert {w.pid for w in ex.workers} <= warm  # the restart leased warm workers
        await _wait_until(lambda: pool.statistics().idle == 3)
        stats = pool.statistics()
        assert stats.replaced == 1 and stats.leased == 0 and len(idle_pids(pool) - warm) == 1


async def test_two_executors_lease_from_one_pool_at_once() -> None:
    async with asyncexec.WorkerPool(4, resources_per_worker=CPU) as pool:
        pids: list[set[int]] = []

        async def one() -> None:
            async with asyncexec.Executor(2, pool=pool) as ex:
                pids.append({w.pid for w in ex.workers})
                assert len([s async for s in ex.run(few)]) == 2

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
        assert len(pids) == 2 and not pids[0] & pids[1]
        assert pool.statistics().idle == 4


async def test_an_executor_asking_for_more_than_the_pool_holds() -> None:
    async with asyncexec.WorkerPool(2, resources_per_worker=CPU) as pool:
        warm = idle_pids(pool)
        async with asyncexec.Executor(3, pool=pool) as ex:
            pids = {w.pid for w in ex.workers}
            assert len(pids) == 3 and len(pids & warm) == 2  # one fresh worker for the rest
            assert len([s async for s in ex.run(few)]) == 2
        stats = pool.statistics()
        assert stats.fresh_for_leases == 1 and stats.idle == 2 and stats.leased == 0
        assert idle_pids(pool) == warm  # the fresh one was not kept
        assert len(live_workers()) == 2

    async with asyncexec.WorkerPool(2, resources_per_worker=CPU, when_short="wait") as pool:
        with pytest.raises(asyncexec.ConfigurationError, match="wait forever"):
            asyncexec.Executor(3, pool=pool)
        order: list[str] = []
        async with asyncexec.Executor(2, pool=pool) as first:
            leased = anyio.Event()
            first_pids = {w.pid for w in first.workers}

            async def second() -> None:
                async with asyncexec.Executor(2, pool=pool) as ex:
                    order.append("second leased")
                    assert {w.pid for w in ex.workers} == first_pids
                    leased.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(second)
                await anyio.wait_all_tasks_blocked()
                order.append("first closing")
                await first.aclose()
                await leased.wait()
        assert order == ["first closing", "second leased"]


async def test_a_pool_closed_under_an_executor_fails_its_run_clearly() -> None:
    pool = asyncexec.WorkerPool(2, resources_per_worker=CPU)
    async with pool, asyncexec.Executor(2, pool=pool) as ex:
        run = ex.run(forever)
        with pytest.raises(asyncexec.ExecutorStateError, match=r"pool .* is closed"):
            async for step in run:
                if step.index == 2:
                    await pool.aclose()
    assert live_workers() == []
    with pytest.raises(asyncexec.ExecutorStateError, match=r"pool .* is closed"):
        async with asyncexec.Executor(1, pool=pool):
            pass


def ignores_stop() -> None:
    asyncexec.report({"i": 0})
    time.sleep(30)  # neither reports nor returns: the stop cannot reach it


async def test_a_worker_whose_function_does_not_stop_is_never_given_back() -> None:
    async with asyncexec.WorkerPool(2, resources_per_worker=CPU) as pool:
        warm = idle_pids(pool)
        async with asyncexec.Executor(2, pool=pool, timeouts=asyncexec.Timeouts(stop_s=0.5)) as ex:
            async for _ in ex.run(ignores_stop):
                break
            stuck = {w.pid for w in ex.workers}
        await _wait_until(lambda: pool.statistics().idle == 2)
        assert not idle_pids(pool) & stuck and pool.statistics().replaced == 2
        assert stuck == warm


async def test_max_leases_replaces_a_worker_after_that_many_leases() -> None:
    async with asyncexec.WorkerPool(1, resources_per_worker=CPU, max_leases=2) as pool:
        pids = []
        for _ in range(3):
            await _wait_until(lambda: pool.statistics().idle == 1)
            async with asyncexec.Executor(1, pool=pool) as ex:
                pids.append(ex.workers[0].pid)
        assert pids[0] == pids[1] != pids[2]


async def test_an_executor_of_another_shape_is_refused_before_anything_starts() -> None:
    pool = asyncexec.WorkerPool(1, resources_per_worker=CPU)
    with pytest.raises(asyncexec.ConfigurationError, match="resources_per_worker"):
        asyncexec.Executor(1, pool=pool, resources_per_worker={"CPU": 1})
    with pytest.raises(asyncexec.ConfigurationError, match="pool"):
        asyncexec.Executor(1, pool="warm")  # type: ignore[arg-type]
    with pytest.raises(asyncexec.ConfigurationError, match="spares"):
        asyncexec.Executor(1, spares=-1)
    with pytest.raises(asyncexec.ConfigurationError, match="when_short"):
        asyncexec.WorkerPool(1, when_short="later")  # type: ignore[arg-type]
    with pytest.raises(asyncexec.ExecutorStateError, match="not entered"):
        async with asyncexec.Executor(1, pool=pool):
            pass


def checkpoints_then_dies(config: dict[str, Any]) -> None:
    """Counts from the checkpoint it resumed from; rank 1 dies once, after step 2 was taken."""
    import tempfile

    ctx = asyncexec.get_context()
    start = 0
    ckpt = asyncexec.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "n")) as f:
            start = int(f.read()) + 1
    for n in range(start, 5):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "n"), "w") as f:
                f.write(str(n))
            asyncexec.report(
                {"n": n, "pid": os.getpid()},
                checkpoint=asyncexec.Checkpoint(d) if ctx.world_rank == 0 else None,
            )
        # buffer_size=1: report(n=3) returned once step 2 (checkpoint 2) had been taken.
        if n == 3 and ctx.attempt == 1 and ctx.world_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("pooled", [False, True])
async def test_a_spare_takes_the_place_of_a_killed_rank_and_the_run_resumes(
    pooled: bool, tmp_path: Any
) -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1)
    options: dict[str, Any] = {"spares": 1, "restart": policy, "storage_path": str(tmp_path)}
    async with contextlib.AsyncExitStack() as stack:
        if pooled:
            pool = await stack.enter_async_context(
                asyncexec.WorkerPool(4, resources_per_worker=CPU)
            )
            options["pool"] = pool
        else:
            options["resources_per_worker"] = CPU
        ex = await stack.enter_async_context(asyncexec.Executor(2, **options))
        before = [w.pid for w in ex.workers]
        spare = ex._slot.group.spares[0].metadata.pid  # type: ignore[union-attr]
        with capture_logs() as logs:
            steps = [s async for s in ex.run(checkpoints_then_dies, {}, buffer_size=1)]
        after = [w.pid for w in ex.workers]
        assert after == [before[0], spare]  # the survivor kept, the spare in rank 1's place
        assert ex.statistics().group_starts == 1  # no new group
        assert ex.statistics().restarts == 1  # but a restart (it counted none)
        second = [s for s in steps if s.attempt == 2]
        # Resumed after the latest checkpoint (the step before it), not from the start.
        resumed = second[0].reports[0].metrics["n"]
        assert resumed >= 3 and steps[second[0].index - 1].reports[0].metrics["n"] == resumed - 1
        assert next(e for e in logs if e["event"] == "spare_took_rank")["rank"] == 1
        # A new spare is started (or leased) in the background.
        await _wait_until(lambda: len(ex._slot.group.spares) == 1)  # type: ignore[union-attr]
        new_spare = ex._slot.group.spares[0].metadata.pid  # type: ignore[union-attr]
        assert new_spare not in [*before, spare]
    assert live_workers() == []


async def test_ray_is_left_as_it_was_by_a_pool() -> None:
    """The pool's placement group and actors are gone after it closes (also checked after
    every test); a pool can be entered only once."""
    before = await anyio.to_thread.run_sync(live_placement_groups)
    pool = asyncexec.WorkerPool(2, resources_per_worker=CPU)
    async with pool:
        held = await anyio.to_thread.run_sync(live_placement_groups)
        assert len(held) == len(before) + 1  # the pool's own, live (the table keeps removed ones)
        assert len(await anyio.to_thread.run_sync(live_workers)) == 2
    await anyio.to_thread.run_sync(wait_no_leaks)  # fails unless both are gone within 15 s
    with pytest.raises(asyncexec.ExecutorStateError, match="once"):
        async with pool:
            pass


async def test_every_lease_waiting_on_a_full_pool_is_served_when_workers_come_back() -> None:
    """Defect: with when_short="wait", only the newest waiting lease was woken; an earlier one
    timed out with workers idle."""
    options = {"resources_per_worker": CPU, "when_short": "wait", "placement_timeout_s": 20}
    async with asyncexec.WorkerPool(2, **options) as pool:  # type: ignore[arg-type]
        served: list[int] = []
        async with asyncexec.Executor(2, pool=pool) as holder:
            held = {w.pid for w in holder.workers}

            async def lease() -> None:
                async with asyncexec.Executor(1, pool=pool) as ex:
                    served.append(ex.workers[0].pid)

            async with anyio.create_task_group() as tg:
                tg.start_soon(lease)
                tg.start_soon(lease)
                await anyio.wait_all_tasks_blocked()
                await holder.aclose()
        assert len(served) == 2 and set(served) == held


async def test_a_pool_that_fails_to_start_raises_its_error_and_leaves_nothing() -> None:
    """The failure path of entering a pool exits its task group outside the shield (inside it,
    anyio raised 'Attempted to exit a cancel scope that isn't the current task's current cancel
    scope' instead of the start-up error)."""
    pool = asyncexec.WorkerPool(1, timeouts=asyncexec.Timeouts(start_s=0.001))
    with pytest.raises(asyncexec.StartupTimeoutError):
        async with pool:
            pass
    assert pool.statistics().idle == 0


# Workers that never come up (held at interpreter start: see conftest.HeldStart) ----------------


async def test_the_start_deadline_covers_a_worker_process_that_never_comes_up(
    held_start: Any,
) -> None:
    """The actors' descriptions were awaited outside the start-up deadline: with the executor's
    own placement group, a worker that never came up was waited for forever."""
    held_start.hold()
    ex = asyncexec.Executor(
        2,
        resources_per_worker=CPU,
        runtime_env=held_start.runtime_env,
        timeouts=asyncexec.Timeouts(start_s=2),
    )
    with anyio.fail_after(30), pytest.raises(asyncexec.StartupTimeoutError) as info:
        async with ex:
            pass
    assert "starting the worker processes" in str(info.value)
    assert ex.state is asyncexec.ExecutorState.CLOSED


def _rank_pids() -> Any:
    return os.getpid()


async def _event(logs: list[dict[str, Any]], name: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The first log event ``name`` once it has been logged (by a background task), bounded."""
    with anyio.fail_after(timeout_s):
        while not any(e["event"] == name for e in logs):  # noqa: ASYNC110 - a background log
            await anyio.sleep(0.02)
    return next(e for e in logs if e["event"] == name)


async def test_a_spare_that_fails_to_start_is_killed_not_left_holding_its_bundle(
    held_start: Any, tmp_path: Any
) -> None:
    """After a spare took a killed rank's place, the new spare's process never came up: its
    start timed out and it was dropped from the list, but never killed."""
    policy = asyncexec.RestartPolicy(max_restarts=1)
    options: dict[str, Any] = {"spares": 1, "restart": policy, "storage_path": str(tmp_path)}
    async with asyncexec.Executor(
        2,
        resources_per_worker=CPU,
        runtime_env=held_start.runtime_env,
        # Long enough for 3 processes with a runtime_env to come up on 2 busy cores (2 s was
        # not, at times); the held spare's start then times out after as long.
        timeouts=asyncexec.Timeouts(start_s=8),
        **options,
    ) as ex:
        held_start.hold()  # from now on, a new process does not come up
        with capture_logs() as logs:
            steps = [s async for s in ex.run(checkpoints_then_dies, {}, buffer_size=1)]
            assert {s.attempt for s in steps} == {1, 2}
            await _event(logs, "spare_refill_failed")
        # The ranks are live; the spare that never came up is not.
        assert len(live_workers()) == 2


async def test_leaving_an_executor_does_not_wait_for_a_spare_still_starting(
    held_start: Any, tmp_path: Any
) -> None:
    """Leaving never cancelled the executor's task group: a pooled spare still being started in
    the background (a fresh process beyond the pool, here one that never comes up) held the
    exit for the whole start-up deadline."""
    policy = asyncexec.RestartPolicy(max_restarts=1)
    pool = asyncexec.WorkerPool(
        3,
        resources_per_worker=CPU,
        runtime_env=held_start.runtime_env,
        timeouts=asyncexec.Timeouts(start_s=600),
    )
    with anyio.fail_after(60):
        async with pool:
            ex = asyncexec.Executor(
                2, pool=pool, spares=1, restart=policy, storage_path=str(tmp_path)
            )
            async with ex:
                held_start.hold()
                with capture_logs() as logs:
                    steps = [s async for s in ex.run(checkpoints_then_dies, {}, buffer_size=1)]
                assert any(e["event"] == "spare_took_rank" for e in logs)
                assert {s.attempt for s in steps} == {1, 2}
                assert pool.statistics().starting >= 1  # the pool's own refill, held too
            assert ex.state is asyncexec.ExecutorState.CLOSED
    assert live_workers() == []
