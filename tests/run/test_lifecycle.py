"""Start, stop, cancel and misuse: every cancellation path leaves nothing in the cluster and the
executor can start again; bad input is refused before anything starts; errors say what failed."""

from __future__ import annotations

import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
from conftest import (
    LOCAL_CPUS,
    cluster_held,
    live_placement_groups,
    live_workers,
    wait_no_leaks,
)
from structlog.testing import capture_logs

import asyncexec

pytestmark = pytest.mark.usefixtures("mode")

CPU = {"CPU": 0.5}


def forever(config: Any = None) -> None:
    i = 0
    while True:
        asyncexec.report({"i": i})
        i += 1
        time.sleep(0.01)


def few(config: dict[str, Any]) -> int:
    for i in range(config.get("steps", 3)):
        asyncexec.report({"i": i})
    return asyncexec.get_context().world_rank


async def _wait_until(predicate: Any, timeout_s: float = 30.0) -> None:
    """Wait for a state of the cluster (no event to wait on there), bounded."""
    with anyio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polling Ray's tables, not our own state
            await anyio.sleep(0.05)


async def test_break_stops_a_run_held_in_a_variable_and_the_next_run_is_accepted() -> None:
    """With the Run in a variable, ``break`` left it running (only garbage collection stopped
    it) and the next ``run()`` was refused."""
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        run = ex.run(forever)
        async for step in run:
            if step.index == 2:
                break
        second = ex.run(few, {"steps": 2})  # accepted at once; it waits for the first to stop
        with anyio.fail_after(30):
            await run.wait_finished()
        assert run.state is asyncexec.RunState.CANCELLED
        assert [s.index for s in [s async for s in second]] == [0, 1]
        # Read without a loop (``__anext__``), a run is not stopped by anything but aclose().
        third = ex.run(few, {"steps": 3})
        assert (await third.__anext__()).index == 0
        assert third.state is not asyncexec.RunState.CANCELLED
        await third.aclose()


async def test_break_stops_the_run_and_the_executor_runs_again() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        run = ex.run(forever)
        async for step in run:
            if step.index == 2:
                break
        await run.aclose()
        assert run.state is asyncexec.RunState.CANCELLED
        # The same workers (the stopped function let go of them) serve the next run.
        pids = [w.pid for w in ex.workers]
        steps = [s async for s in ex.run(few, {"steps": 2})]
        assert len(steps) == 2
        assert [w.pid for w in ex.workers] == pids
    assert ex.state is asyncexec.ExecutorState.CLOSED


async def test_dropping_the_iterator_stops_the_run() -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:

        async def take_two() -> asyncexec.Run:
            run = ex.run(forever)
            async for step in run:
                if step.index == 1:
                    break
            return run

        run = await take_two()
        core = run._core  # the shared state outlives the iterator
        del run  # the last reference: collecting the iterator stops the run
        with anyio.fail_after(30):
            await core.finished.wait()
        assert core.state is asyncexec.RunState.CANCELLED
        assert ex.statistics().runs_cancelled == 1


async def test_cancelling_the_consumer_mid_run_leaves_nothing_and_restarts() -> None:
    ex = asyncexec.Executor(2, resources_per_worker=CPU)
    third = anyio.Event()

    async def consume() -> None:
        async with ex:
            async for step in ex.run(forever):
                if step.index == 3:
                    third.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        with anyio.fail_after(60):
            await third.wait()
        tg.cancel_scope.cancel()
    assert ex.state is asyncexec.ExecutorState.CLOSED
    wait_no_leaks()
    async with ex:  # the executor can be started again
        steps = [s async for s in ex.run(few, {"steps": 2})]
        assert len(steps) == 2


@pytest.mark.ray_only
async def test_cancel_while_waiting_for_placement_leaves_nothing() -> None:
    ex = asyncexec.Executor(
        2, resources_per_worker={"CPU": 2}, timeouts=asyncexec.Timeouts(placement_s=600)
    )
    with cluster_held({"CPU": LOCAL_CPUS}):
        async with anyio.create_task_group() as tg:

            async def enter() -> None:
                async with ex:
                    pytest.fail("placement cannot succeed")

            tg.start_soon(enter)
            await _wait_until(lambda: len(live_placement_groups()) == 2)
            tg.cancel_scope.cancel()
    assert ex.state is asyncexec.ExecutorState.CLOSED
    wait_no_leaks()


def _slow_hook() -> None:
    Path(os.environ["HOOK_FLAG"]).touch()
    time.sleep(60)


@pytest.mark.ray_only
async def test_cancel_during_start_up_leaves_nothing(tmp_path: Path) -> None:
    flag = tmp_path / "hook-started"
    ex = asyncexec.Executor(
        2,
        resources_per_worker=CPU,
        init_hook=_slow_hook,
        runtime_env={"env_vars": {"HOOK_FLAG": str(flag)}},
    )
    async with anyio.create_task_group() as tg:

        async def enter() -> None:
            async with ex:
                pytest.fail("start-up should have been cancelled")

        tg.start_soon(enter)
        await _wait_until(flag.exists, 60)
        assert len(live_workers()) == 2
        tg.cancel_scope.cancel()
    wait_no_leaks()
    async with asyncexec.Executor(1, resources_per_worker=CPU) as again:
        assert len(again.workers) == 1


@pytest.mark.ray_only
async def test_placement_timeout_names_requested_and_available_resources() -> None:
    ex = asyncexec.Executor(
        2, resources_per_worker={"CPU": 2}, timeouts=asyncexec.Timeouts(placement_s=0.5)
    )
    with (
        cluster_held({"CPU": LOCAL_CPUS - 1}),
        pytest.raises(asyncexec.PlacementTimeoutError) as info,
    ):
        async with ex:
            pass
    error = info.value
    assert error.requested == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert error.available.get("CPU", 0) == 1
    assert "'CPU': 2.0" in str(error)
    assert ex.state is asyncexec.ExecutorState.CLOSED


@pytest.mark.ray_only
async def test_a_placement_that_can_never_fit_fails_at_once_without_an_autoscaler() -> None:
    """4 CPUs in all, no autoscaler: 2 workers of 3 CPUs can never be placed, so entering fails
    at once (a 10-minute placement deadline would outlive the test's timeout)."""
    ex = asyncexec.Executor(
        2, resources_per_worker={"CPU": 3}, timeouts=asyncexec.Timeouts(placement_s=600)
    )
    with pytest.raises(asyncexec.PlacementInfeasibleError) as info:
        async with ex:
            pass
    error = info.value
    assert error.requested == [{"CPU": 3.0}, {"CPU": 3.0}]
    assert error.nodes == [{"CPU": float(LOCAL_CPUS)}]
    assert "never be placed" in str(error) and "autoscaler" in str(error)
    assert pickle.loads(pickle.dumps(error)).nodes == error.nodes
    assert ex.state is asyncexec.ExecutorState.CLOSED


@pytest.mark.ray_only
async def test_a_resource_that_no_node_has_is_named() -> None:
    ex = asyncexec.Executor(1, resources_per_worker={"CPU": 0.5, "TPUX": 1})
    with pytest.raises(asyncexec.PlacementInfeasibleError) as info:
        async with ex:
            pass
    assert "no node has a resource named 'TPUX'" in info.value.reason
    assert "'CPU'" not in info.value.reason.split("(")[0]  # the name missing, alone
    assert "TPUX" in str(info.value)


@pytest.mark.ray_only
async def test_a_feasibility_check_that_raised_is_logged_and_the_deadline_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When Ray cannot say whether an autoscaler may add nodes, the placement waits for its
    deadline: the log says why (it was silent)."""
    import ray._private.state as ray_state

    def unavailable() -> Any:
        raise RuntimeError("GCS unavailable")

    monkeypatch.setattr(ray_state.state, "get_cluster_config", unavailable)
    ex = asyncexec.Executor(
        2, resources_per_worker={"CPU": 3}, timeouts=asyncexec.Timeouts(placement_s=1)
    )
    with capture_logs() as logs, pytest.raises(asyncexec.PlacementTimeoutError):
        async with ex:
            pass
    [event] = [e for e in logs if e["event"] == "placement_check_failed"]
    assert "GCS unavailable" in event["error"]


def uneven(config: Any = None) -> None:
    rank = asyncexec.get_context().world_rank
    for i in range(3 if rank == 0 else 2):
        asyncexec.report({"i": i})


def over_reports(config: Any = None) -> None:
    rank = asyncexec.get_context().world_rank
    asyncexec.report({"i": 0})
    if rank == 1:
        time.sleep(0.5)
        asyncexec.report({"i": 1})
        asyncexec.report({"i": 2})


@pytest.mark.parametrize("fn", [uneven, over_reports])
async def test_ranks_reporting_different_counts_end_with_a_clear_error(fn: Any) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        steps = []
        with pytest.raises(asyncexec.ReportMismatchError) as info:
            async for step in ex.run(fn):
                steps.append(step)
    counts = info.value.counts
    assert set(counts) == {0, 1}
    assert counts[0] != counts[1]
    assert "rank 0" in str(info.value)
    assert "rank 1" in str(info.value)
    assert len(steps) == min(counts.values())


async def test_misuse_before_start_and_after_close() -> None:
    ex = asyncexec.Executor(1, resources_per_worker=CPU)
    with pytest.raises(asyncexec.ExecutorStateError, match="not started"):
        ex.run(few, {})
    with pytest.raises(asyncexec.ExecutorStateError, match="not started"):
        await ex.execute(os.getpid)
    async with ex:
        pass
    with pytest.raises(asyncexec.ExecutorStateError, match="closed"):
        ex.run(few, {})
    with pytest.raises(asyncexec.ExecutorStateError, match="closed"):
        await ex.execute_single(0, os.getpid)
    with pytest.raises(asyncexec.ExecutorStateError, match="no run has finished"):
        _ = ex.result
    await ex.aclose()  # idempotent


class _Waiter:
    """A role whose method waits until its worker goes."""

    async def wait(self) -> int:
        await anyio.sleep(60)
        return asyncexec.get_context().world_rank


async def _wait_long() -> int:
    await anyio.sleep(60)
    return 0


@pytest.mark.timeout(120)
async def test_a_call_in_flight_when_the_executor_closes_says_it_closed() -> None:
    """Defect: a call still in flight when the executor closed failed with
    ``WorkerCrashedError`` ("crashed: the local worker was closed"), with a note that the
    executor had replaced its group in a restart and to call again; no worker had crashed, and
    calling again could not help. It fails with ``ExecutorStateError`` now."""
    errors: list[BaseException] = []
    retry = asyncexec.least_loaded(retry=True)
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=_Waiter) as ex:

        async def call(call: Any) -> None:
            try:
                await call()
            except asyncexec.AsyncExecError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, lambda: ex.execute(_wait_long))
            tg.start_soon(call, lambda: ex.call(_Waiter.wait))
            tg.start_soon(call, lambda: ex.call(_Waiter.wait, on=retry))
            with anyio.fail_after(30):  # 5 calls sent (2 + 2 + 1): all are in flight
                while ex.statistics().calls < 5:  # noqa: ASYNC110 - counted as they are sent
                    await anyio.sleep(0.01)
            with anyio.fail_after(60):
                await ex.aclose(force=True)
    assert len(errors) == 3
    for error in errors:
        assert isinstance(error, asyncexec.ExecutorStateError), repr(error)
        assert "closed while the call was in flight" in str(error)
        assert not getattr(error, "__notes__", None)


async def test_bad_run_arguments_are_refused_before_anything_starts(tmp_path: Path) -> None:
    lock = threading.Lock()

    def holds_a_lock() -> None:
        with lock:
            pass

    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.ConfigurationError, match="callable"):
            ex.run(42)  # type: ignore[arg-type]
        with pytest.raises(asyncexec.ConfigurationError, match="fn cannot be pickled"):
            ex.run(holds_a_lock)
        with pytest.raises(asyncexec.ConfigurationError, match="config cannot be pickled"):
            ex.run(few, {"lock": lock})
        with pytest.raises(asyncexec.ConfigurationError, match="buffer_size"):
            ex.run(few, {}, buffer_size=0)
        with pytest.raises(asyncexec.ConfigurationError, match="does not exist"):
            ex.run(few, {}, checkpoint=tmp_path / "missing")
        assert ex.statistics().runs_started == 0
        run = ex.run(forever)
        with pytest.raises(asyncexec.ExecutorStateError, match="in progress"):
            ex.run(few, {})
        await run.aclose()


_WEIGHTS: dict[str, Any] = {"version": 0}


def set_version(version: int) -> int:
    _WEIGHTS["version"] = version
    return asyncexec.get_context().world_rank


def follows_weights(config: Any = None) -> int:
    seen = 0
    while _WEIGHTS["version"] < 3:
        if _WEIGHTS["version"] != seen:
            seen = _WEIGHTS["version"]
            asyncexec.report({"version": seen})
        time.sleep(0.005)
    return int(_WEIGHTS["version"])


async def test_execute_reaches_live_workers_while_their_function_runs() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        await ex.execute(set_version, 0)
        run = ex.run(follows_weights)
        assert await ex.execute(set_version, 1) == [0, 1]
        versions = []
        async for step in run:
            versions.append(step.metrics["version"])
            await ex.execute_single(0, set_version, step.metrics["version"] + 1)
            await ex.execute_single(1, set_version, step.metrics["version"] + 1)
        assert versions == [1, 2]
        assert run.result.return_values == [3, 3]
        with pytest.raises(asyncexec.ConfigurationError, match="rank"):
            await ex.execute_single(5, os.getpid)


def raise_on_rank_1() -> None:
    if asyncexec.get_context().world_rank == 1:
        raise KeyError("missing weights")


async def test_execute_error_names_the_rank_and_keeps_the_cause() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            await ex.execute(raise_on_rank_1)
        assert info.value.rank == 1
        assert isinstance(info.value.__cause__, KeyError)
        assert "missing weights" in str(info.value)


@pytest.mark.ray_only
async def test_start_up_and_runs_are_logged_with_durations_and_the_worker_table() -> None:
    with capture_logs() as logs:
        t0 = time.perf_counter()
        async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
            entered = time.perf_counter() - t0
            [s async for s in ex.run(few, {"steps": 1})]
    events = {e["event"]: e for e in logs}
    # Seconds since start-up began, phase by phase, each within what entering took.
    phases = [events[e]["seconds"] for e in ("placement_ready", "workers_ready", "group_started")]
    assert all(isinstance(p, float) for p in phases)
    assert 0 < phases[0] <= phases[1] <= phases[2] <= entered + 0.001  # logged rounded to ms
    table = events["worker_table"]["workers"]
    assert [w["rank"] for w in table] == [0, 1]
    assert all(w["pid"] > 0 for w in table)
    assert events["run_started"]["run_id"] == events["run_finished"]["run_id"]
    assert events["run_finished"]["steps"] == 1
    assert events["group_closed"]["force"] is False


async def test_forced_close_skips_the_graceful_part() -> None:
    with capture_logs() as logs:
        async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
            await ex.aclose(force=True)
    closed = [e for e in logs if e["event"] == "group_closed"]
    assert len(closed) == 1
    assert closed[0]["force"] is True


async def test_checkpoints_are_persisted_before_their_step_and_pruned(tmp_path: Path) -> None:
    async with asyncexec.Executor(
        2,
        resources_per_worker=CPU,
        storage_path=tmp_path,
        checkpoint=asyncexec.CheckpointConfig(num_to_keep=2),
    ) as ex:
        seen = []
        async for step in ex.run(checkpoints_each_step, {"steps": 5}):
            assert step.checkpoint is not None
            files = _names(step.checkpoint.path)
            assert files == ["rank0.txt", "rank1.txt"]  # both ranks' files, merged
            seen.append(step.checkpoint.path)
        kept = sorted(p for p in (tmp_path / ex.result.run_id).iterdir())
        assert [str(p) for p in kept] == seen[-2:]
        assert ex.result.checkpoint is not None
        assert ex.result.checkpoint.path == seen[-1]
        # A later run can start from it; its workers see it through get_checkpoint().
        run = ex.run(reads_checkpoint, checkpoint=ex.result.checkpoint)
        [s async for s in run]
        assert run.result.return_values == ["4", "4"]


def _names(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir())


def checkpoints_each_step(config: dict[str, Any]) -> None:
    import tempfile

    rank = asyncexec.get_context().world_rank
    for i in range(config["steps"]):
        tmp = tempfile.mkdtemp()
        Path(tmp, f"rank{rank}.txt").write_text(str(i))
        asyncexec.report({"i": i}, checkpoint=asyncexec.Checkpoint.from_directory(tmp))


def reads_checkpoint() -> str:
    checkpoint = asyncexec.get_checkpoint()
    assert checkpoint is not None
    asyncexec.report({"ok": 1})
    return Path(checkpoint.path, "rank0.txt").read_text()


async def test_best_checkpoints_by_metric_are_kept(tmp_path: Path) -> None:
    async with asyncexec.Executor(
        1,
        resources_per_worker=CPU,
        storage_path=tmp_path,
        checkpoint=asyncexec.CheckpointConfig(
            num_to_keep=2, score_attribute="loss", score_order="min"
        ),
    ) as ex:
        losses = [5.0, 1.0, 4.0, 2.0, 3.0]
        paths = {}
        async for step in ex.run(scored, {"losses": losses}):
            assert step.checkpoint is not None
            paths[step.metrics["loss"]] = step.checkpoint.path
        kept = {str(p) for p in (tmp_path / ex.result.run_id).iterdir()}
    # The two best (1.0, 2.0) and the latest (3.0), which a restart would need.
    assert kept == {paths[1.0], paths[2.0], paths[3.0]}


def scored(config: dict[str, Any]) -> None:
    import tempfile

    for loss in config["losses"]:
        tmp = tempfile.mkdtemp()
        Path(tmp, "w").write_text(str(loss))
        asyncexec.report({"loss": loss}, checkpoint=asyncexec.Checkpoint.from_directory(tmp))


def report_bad_payload() -> None:
    asyncexec.report([1, 2, 3])  # type: ignore[arg-type]


async def test_a_report_that_is_not_a_mapping_fails_the_run_clearly() -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError, match="mapping"):
            async for _ in ex.run(report_bad_payload):
                pass


@pytest.mark.ray_only
def test_worker_side_calls_outside_a_worker_are_refused() -> None:
    with pytest.raises(asyncexec.ExecutorStateError, match="inside"):
        asyncexec.report({"x": 1})
    with pytest.raises(asyncexec.ExecutorStateError, match="inside"):
        asyncexec.get_context()
    assert ray.is_initialized()


def _log_to_file() -> None:
    import logging

    handler = logging.FileHandler(os.environ["WORKER_LOG"])
    handler.setFormatter(logging.Formatter("%(name)s %(message)s rank_attr=%(rank)s"))
    logger = logging.getLogger("asyncexec.worker")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


@pytest.mark.ray_only
async def test_worker_side_events_carry_run_id_attempt_and_rank(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    async with asyncexec.Executor(
        2,
        resources_per_worker=CPU,
        init_hook=_log_to_file,
        runtime_env={"env_vars": {"WORKER_LOG": str(log)}},
    ) as ex:
        run = ex.run(few, {"steps": 2})
        [s async for s in run]
    lines = log.read_text().splitlines()
    started = [line for line in lines if "fn_started" in line]
    ended = [line for line in lines if "fn_ended" in line]
    assert len(started) == 2
    assert len(ended) == 2
    assert {f"rank={r}" in " ".join(started) for r in (0, 1)} == {True}
    assert all(f"run_id={run.run_id}" in line and "attempt=1" in line for line in started)
    assert all("outcome=ok" in line and "reports=2" in line for line in ended)


def config_size(config: bytes) -> int:
    asyncexec.report({"n": len(config)})
    return len(config)


@pytest.mark.ray_only
async def test_a_large_config_goes_through_the_object_store_and_a_small_one_inline() -> None:
    """A payload above the inline bound (64 KiB) is put in the object store once per run; a
    small one travels with each rank's call: both reach every rank whole."""
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        for size in (10, 3 * 64 * 1024):
            run = ex.run(config_size, b"x" * size)
            assert [s.metrics["n"] async for s in run] == [size]
            assert run.result.return_values == [size, size]
