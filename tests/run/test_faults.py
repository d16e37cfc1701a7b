"""Fault tolerance against a real Ray: SIGKILL mid-run resumes from the checkpoint, bounded and
unbounded policies, hung workers, user errors, the give-up error, cancelling a restart."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import tenacity
from structlog.testing import capture_logs

import asyncexec
from asyncexec._errors import short_node

pytestmark = pytest.mark.usefixtures("mode")

NO_WAIT = tenacity.wait_none()


def counter(config: dict[str, Any]) -> int:
    """Each rank sums step * (rank + 1); checkpoints every few steps; resumes from them. With
    ``fail_at``, rank 1 raises at that step of the first attempt."""
    ctx = asyncexec.get_context()
    start, total = 0, 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:  # a local copy when storage is remote
            state = json.loads((Path(directory) / f"rank{ctx.world_rank}.json").read_text())
        start, total = state["step"] + 1, state["total"]
    for step in range(start, config["steps"]):
        if ctx.attempt == 1 and ctx.world_rank == 1 and step == config.get("fail_at"):
            raise ValueError(f"bad batch at step {step}")
        total += step * (ctx.world_rank + 1)
        if config.get("sleep"):
            time.sleep(config["sleep"])
        saved = None
        if step % config["every"] == 0:
            tmp = tempfile.mkdtemp()
            (Path(tmp) / f"rank{ctx.world_rank}.json").write_text(
                json.dumps({"step": step, "total": total})
            )
            saved = asyncexec.Checkpoint.from_directory(tmp)
        asyncexec.report({"step": step, "total": total}, checkpoint=saved)
    return total


async def _consume(run: asyncexec.Run, on_step: Any = None) -> list[asyncexec.Step]:
    steps = []
    async for step in run:
        steps.append(step)
        if on_step is not None:
            on_step(step)
    return steps


@pytest.mark.smoke
@pytest.mark.ray_only
@pytest.mark.timeout(180)
async def test_sigkill_at_random_step_resumes_from_checkpoint_with_same_final_state(
    tmp_path: Path,
) -> None:
    config = {"steps": 30, "every": 4, "sleep": 0.02}
    rng = random.Random(1234)
    kill_at, kill_rank = rng.randrange(5, 25), rng.randrange(3)
    async with asyncexec.Executor(
        3,
        resources_per_worker={"CPU": 0.5},
        storage_path=tmp_path,
        restart=asyncexec.RestartPolicy(max_restarts=2, wait=NO_WAIT),
        buffer_size=2,
    ) as ex:
        clean = await _consume(ex.run(counter, config))
        expected = ex.result.return_values
        pids = [w.pid for w in ex.workers]

        def chaos(step: asyncexec.Step) -> None:
            if step.attempt == 1 and step.index == kill_at:
                os.kill(pids[kill_rank], signal.SIGKILL)

        run = ex.run(counter, config)
        steps = await _consume(run, chaos)
        result = run.result
    assert [s.metrics["step"] for s in clean] == list(range(30))
    assert result.return_values == expected
    assert result.attempts == 2
    assert len(result.failures) == 1
    failure = result.failures[0]
    assert isinstance(failure, asyncexec.WorkerCrashedError)
    assert failure.rank == kill_rank and failure.attempt == 1
    first = [s for s in steps if s.attempt == 1]
    second = [s for s in steps if s.attempt == 2]
    assert second, "no step of the second attempt was delivered"
    # The first attempt's steps are a prefix; the second resumes right after the checkpoint
    # and goes to the end without a gap.
    assert [s.metrics["step"] for s in first] == list(range(len(first)))
    resumed_from = second[0].metrics["step"]
    assert resumed_from % config["every"] == 1 and resumed_from <= len(first)
    assert [s.metrics["step"] for s in second] == list(range(resumed_from, 30))
    assert [s.index for s in steps] == list(range(len(steps)))


@pytest.mark.ray_only
@pytest.mark.timeout(180)
async def test_checkpoints_on_an_fsspec_filesystem_survive_a_restart(tmp_path: Path) -> None:
    """storage_path may be any URI that fsspec reaches; here its local filesystem via file://."""
    config = {"steps": 12, "every": 3, "sleep": 0.02}
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT)
    storage = f"file://{tmp_path}/remote"
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        storage_path=storage,
        restart=policy,
        buffer_size=1,
        # The run's folder is read below, after the executor closed.
        checkpoint=asyncexec.CheckpointConfig(num_to_keep=2, keep_runs=True),
    ) as ex:
        pids = [w.pid for w in ex.workers]

        def chaos(step: asyncexec.Step) -> None:
            if step.attempt == 1 and step.index == 6:
                os.kill(pids[0], signal.SIGKILL)

        run = ex.run(counter, config)
        steps = await _consume(run, chaos)
    assert run.result.attempts == 2
    assert run.result.return_values == [sum(range(12)), 2 * sum(range(12))]
    resumed = [s.metrics["step"] for s in steps if s.attempt == 2]
    assert resumed == list(range(resumed[0], 12))
    latest = run.result.checkpoint
    assert latest is not None
    assert latest.path.startswith(storage)
    kept = sorted(p.name for p in (tmp_path / "remote" / run.run_id).iterdir())
    assert len(kept) == 2  # retention works on the remote filesystem too
    with latest.as_directory() as local:
        assert sorted(os.listdir(local)) == ["rank0.json", "rank1.json"]


def always_dies(config: dict[str, Any]) -> None:
    asyncexec.report({"attempt": asyncexec.get_context().attempt})
    if asyncexec.get_context().world_rank == config["rank"]:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.ray_only
async def test_bounded_policy_restarts_exactly_n_times_then_gives_up() -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    policy = asyncexec.RestartPolicy(
        max_restarts=2,
        wait=tenacity.wait_exponential_jitter(initial=1, max=10, jitter=1),
        sleep=fake_sleep,
        backoff_after_progress=True,  # a step may complete before the death: still back off
    )
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, restart=policy) as ex:
        run = ex.run(always_dies, {"rank": 1})
        attempts_seen = []
        with capture_logs() as logs, pytest.raises(asyncexec.RestartsExhaustedError) as info:
            async for step in run:
                attempts_seen.append(step.attempt)
        assert ex.statistics().restarts == 2
    error = info.value
    assert error.attempts == 3
    assert len(error.failures) == 3
    assert all(isinstance(f, asyncexec.WorkerCrashedError) for f in error.failures)
    assert [f.attempt for f in error.failures] == [1, 2, 3]  # type: ignore[attr-defined]
    assert all(f.rank == 1 for f in error.failures)  # type: ignore[attr-defined]
    assert error.__cause__ is error.failures[-1]
    assert len(slept) == 2 and 1 <= slept[0] <= 2 and 2 <= slept[1] <= 3  # backoff with jitter
    assert set(attempts_seen) <= {1, 2, 3}
    failed = [e for e in logs if e["event"] == "worker_failed"]
    restarting = [e for e in logs if e["event"] == "restarting"]
    assert len(failed) == 3 and len(restarting) == 2
    assert {"run_id", "rank", "node_id", "cause", "attempt"} <= failed[0].keys()
    assert restarting[0]["wait_s"] == pytest.approx(slept[0], abs=1e-3)


def dies_after_a_consumed_step(config: dict[str, Any]) -> None:
    ctx = asyncexec.get_context()
    asyncexec.report({"n": 0})
    asyncexec.report({"n": 1})  # buffer_size=1: returns once step 0 has been taken
    if ctx.attempt == 1 and ctx.world_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.ray_only
async def test_a_restart_after_progress_does_not_wait_and_one_without_progress_does() -> None:
    """Defect: the default policy waited 0.5-1.0 s before the first restart even after hours of
    progress (Ray Train waits nothing). Now an attempt that completed a step restarts at once;
    the backoff is kept for failures that repeat without progress."""
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    policy = asyncexec.RestartPolicy(max_restarts=1, sleep=fake_sleep)
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, restart=policy) as ex:
        steps = [s async for s in ex.run(dies_after_a_consumed_step, buffer_size=1)]
        assert steps[0].attempt == 1 and steps[-1].attempt == 2
        assert slept == [0.0]
        with pytest.raises(asyncexec.RestartsExhaustedError):
            async for _ in ex.run(dies_at_once):
                pass
    assert len(slept) == 2 and slept[1] >= 0.5  # no step completed: the default backoff


def dies_at_once() -> None:
    if asyncexec.get_context().world_rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def dies_on_first_attempts(config: dict[str, Any]) -> int:
    ctx = asyncexec.get_context()
    assert ctx.attempt is not None
    if ctx.attempt <= config["failures"] and ctx.world_rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    asyncexec.report({"attempt": ctx.attempt})
    return ctx.attempt


@pytest.mark.ray_only
@pytest.mark.timeout(180)
async def test_unbounded_policy_survives_more_failures_than_a_small_bound() -> None:
    """And the failures the run keeps do not keep their attempts: each crash's error held, in
    its traceback's frames, the attempt's window and group (the poll that met the dead worker),
    one more of each for every failure of an unbounded policy."""
    policy = asyncexec.RestartPolicy.unbounded(wait=NO_WAIT)
    async with asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, restart=policy) as ex:
        run = ex.run(dies_on_first_attempts, {"failures": 4})
        steps = [s async for s in run]
        assert len(run.failures) == 4
        gc.collect()
        windows = [o for o in gc.get_objects() if type(o).__name__ == "Window"]
        assert len(windows) <= 1, len(windows)
    assert [s.attempt for s in steps] == [5]
    assert ex.result.attempts == 5 and ex.result.return_values == [5]


def raises_value_error(config: dict[str, Any]) -> None:
    ctx = asyncexec.get_context()
    asyncexec.report({"ok": True})
    if ctx.world_rank == 1 and (ctx.attempt or 0) <= config["times"]:
        raise ValueError(f"bad batch on attempt {ctx.attempt}")


async def test_user_error_is_not_retried_by_default_and_names_rank_and_node() -> None:
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}) as ex:
        nodes = [w.node_id for w in ex.workers]  # read before the run: it may close the group
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.run(raises_value_error, {"times": 5}):
                pass
        error = info.value
        assert error.rank == 1
        assert len(nodes) == 2 and error.node_id == nodes[1]
        assert f"rank 1 (node {short_node(nodes[1])}," in str(error)
        assert error.attempt == 1
        assert isinstance(error.__cause__, ValueError)
        assert "bad batch on attempt 1" in str(error)
        assert "raises_value_error" in error.remote_traceback
        assert ex.statistics().restarts == 0


async def awaits_a_cancelled_task(config: dict[str, Any]) -> None:
    asyncexec.report({"ok": True})
    if asyncexec.get_context().world_rank == 1:
        task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        await asyncio.sleep(0)
        task.cancel()
        await task  # raises CancelledError: the function's own, not a stop


@pytest.mark.timeout(120)
async def test_a_cancelled_error_of_the_function_is_its_error_with_its_traceback() -> None:
    """Defect: a CancelledError the run's function raised of its own (it awaited a cancelled
    task) was taken for the driver's stop: the run failed with 'the function was stopped',
    without the error or its traceback."""
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.run(awaits_a_cancelled_task):
                pass
    error = info.value
    assert error.rank == 1
    assert isinstance(error.__cause__, asyncio.CancelledError)
    assert "awaits_a_cancelled_task" in error.remote_traceback
    assert "stopped" not in str(error)


class Unprintable(Exception):
    """An error that does not pickle (it holds a lock) and whose ``__str__`` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def __str__(self) -> str:
        raise ValueError("no text")


def raises_unprintable(config: dict[str, Any]) -> None:
    asyncexec.report({"ok": True})
    raise Unprintable()


@pytest.mark.timeout(120)
async def test_an_error_that_neither_pickles_nor_prints_fails_the_run_with_its_type() -> None:
    """Defect: the error's stand-in (an error that does not pickle travels as a RuntimeError
    with its type and text) read its text with ``str()``, which raised: the function's thread
    died without an outcome, and the run waited for one for ever."""
    async with asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}) as ex:
        with anyio.fail_after(30), pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.run(raises_unprintable):
                pass
    assert info.value.rank == 0
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "Unprintable" in str(info.value)
    assert "raises_unprintable" in info.value.remote_traceback


async def test_user_error_is_retried_when_asked() -> None:
    policy = asyncexec.RestartPolicy(max_restarts=2, restart_on_user_error=True, wait=NO_WAIT)
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, restart=policy) as ex:
        run = ex.run(raises_value_error, {"times": 1})
        steps = [s async for s in run]
    # Attempt 1's step is delivered when both reports arrived before rank 1's error.
    assert [s.attempt for s in steps] in ([1, 2], [2])
    assert run.result.attempts == 2
    assert isinstance(run.result.failures[0], asyncexec.WorkerRaisedError)


def sleeps_forever_on_rank_0(config: dict[str, Any]) -> None:
    ctx = asyncexec.get_context()
    asyncexec.report({"attempt": ctx.attempt})
    if ctx.world_rank == 0 and ctx.attempt == 1:
        time.sleep(3600)
    asyncexec.report({"attempt": ctx.attempt})


@pytest.mark.ray_only
async def test_worker_that_stops_reporting_is_declared_hung_and_restarted() -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT)
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        restart=policy,
        health=asyncexec.HealthChecks(step_timeout_s=1.0),
    ) as ex:
        t0 = time.monotonic()
        run = ex.run(sleeps_forever_on_rank_0, {})
        steps = [s async for s in run]
        elapsed = time.monotonic() - t0
    failure = run.result.failures[0]
    assert isinstance(failure, asyncexec.WorkerHungError)
    assert failure.rank == 0 and "step deadline" in str(failure)
    assert [s.attempt for s in steps] == [1, 2, 2]
    assert elapsed < 20


def holds_the_gil_on_rank_1(config: dict[str, Any]) -> None:
    import re

    ctx = asyncexec.get_context()
    asyncexec.report({"attempt": ctx.attempt})
    if ctx.world_rank == 1 and ctx.attempt == 1:
        # Catastrophic backtracking: minutes inside the C regex engine, which holds the GIL, so
        # the actor's event loop cannot answer health checks.
        re.match(r"(a+)+$", "a" * 64 + "b")
    asyncexec.report({"attempt": ctx.attempt})


@pytest.mark.ray_only
async def test_worker_blocked_in_c_holding_the_gil_fails_health_checks() -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT)
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        restart=policy,
        health=asyncexec.HealthChecks(interval_s=0.5, timeout_s=2.0),
    ) as ex:
        run = ex.run(holds_the_gil_on_rank_1, {})
        steps = [s async for s in run]
    failure = run.result.failures[0]
    assert isinstance(failure, asyncexec.WorkerHungError)
    assert failure.rank == 1 and "health check" in str(failure)
    # Rank 1's first report may be stuck behind the GIL with it: attempt 1's step is optional.
    assert [s.attempt for s in steps] in ([1, 2, 2], [2, 2])


@pytest.mark.ray_only
async def test_cancelling_during_the_restart_wait_leaves_nothing_behind() -> None:
    waiting = anyio.Event()

    async def slow_sleep(seconds: float) -> None:
        waiting.set()
        await anyio.sleep(3600)

    policy = asyncexec.RestartPolicy(max_restarts=3, sleep=slow_sleep)
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, restart=policy) as ex:
        run = ex.run(always_dies, {"rank": 0})
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                async for _ in run:
                    pass

            tg.start_soon(consume)
            with anyio.fail_after(60):
                await waiting.wait()
            assert ex.workers == []  # the failed group is gone while the policy waits
            tg.cancel_scope.cancel()
        await run.aclose()
        assert run.state is asyncexec.RunState.CANCELLED
    # ray_local checks that no actor or placement group is left.


@pytest.mark.ray_only
@pytest.mark.timeout(180)
async def test_reuse_survivors_replaces_only_the_failed_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replacement is created off the event loop (the first actor of a class exports it
    synchronously, and its first call waits for its handle): it was created on the loop."""
    import threading

    from asyncexec._driver.cluster import _ray

    created_on: list[threading.Thread] = []

    class Spy:
        def options(self, **options: Any) -> Any:
            created_on.append(threading.current_thread())
            return real.options(**options)

    real = _ray.WorkerActor
    monkeypatch.setattr(_ray, "WorkerActor", Spy())
    config = {"steps": 20, "every": 3, "sleep": 0.02}
    policy = asyncexec.RestartPolicy(max_restarts=2, wait=NO_WAIT, reuse_survivors=True)
    async with asyncexec.Executor(
        3, resources_per_worker={"CPU": 0.5}, storage_path=tmp_path, restart=policy, buffer_size=2
    ) as ex:
        clean = [s async for s in ex.run(counter, config)]
        expected = ex.result.return_values
        before = [w.pid for w in ex.workers]

        def chaos(step: asyncexec.Step) -> None:
            if step.attempt == 1 and step.index == 7:
                os.kill(before[1], signal.SIGKILL)

        with capture_logs() as logs:
            run = ex.run(counter, config)
            steps = await _consume(run, chaos)
        after = [w.pid for w in ex.workers]
    assert len(clean) == 20
    assert run.result.return_values == expected
    assert run.result.attempts == 2
    assert run.failures == tuple(run.result.failures)
    assert after[0] == before[0] and after[2] == before[2]  # survivors kept
    assert after[1] != before[1]  # the dead rank has a new process
    assert [e["rank"] for e in logs if e["event"] == "rank_replaced"] == [1]
    assert created_on and threading.main_thread() not in created_on
    second = [s.metrics["step"] for s in steps if s.attempt == 2]
    assert second == list(range(second[0], 20))


@pytest.mark.ray_only
async def test_execute_works_again_after_a_failed_run() -> None:
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, restart=asyncexec.RestartPolicy.never()
    ) as ex:
        with pytest.raises(asyncexec.RestartsExhaustedError):
            async for _ in ex.run(always_dies, {"rank": 0}):
                pass
        assert sorted(await ex.execute(os.getpid)) != []
        steps = [s async for s in ex.run(counter, {"steps": 3, "every": 10})]
        assert len(steps) == 3


@pytest.mark.parametrize("independent", [False, True], ids=["aligned", "independent"])
@pytest.mark.parametrize("error", [OSError, TimeoutError])
async def test_a_checkpoint_that_cannot_be_deleted_never_fails_the_run(
    independent: bool, error: type[Exception], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pruning a checkpoint on a store whose ``rm`` fails (here our deletion, made to raise as
    a remote filesystem's would): it failed an aligned run, a TimeoutError restarted it as a
    start-up timeout, and in a run of independent ranks it cancelled the caller's body."""
    import asyncexec._wire._checkpoint

    def failing_rm(path: str) -> None:
        raise error(f"rm {path} failed on the remote store")

    monkeypatch.setattr(asyncexec._wire._checkpoint, "remove_directory", failing_rm)
    config = {"steps": 6, "every": 1}
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        storage_path=tmp_path,
        checkpoint=asyncexec.CheckpointConfig(num_to_keep=1),
        restart=asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT),
    ) as ex:
        with capture_logs() as logs:
            steps = [s async for s in ex.run(counter, config, independent=independent)]
        assert len(steps) == 6 * (2 if independent else 1)
        assert ex.result.attempts == 1 and ex.result.failures == []
    failed = [e for e in logs if e["event"] == "checkpoint_prune_failed"]
    assert failed and "failed on the remote store" in failed[0]["error"]
