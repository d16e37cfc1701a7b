"""Local mode: the workers are threads of the driver's process, Ray is never started. The
behaviour tests of the stream, errors, checkpoints and ``execute()`` run in both modes (the
``mode`` fixture); these are what only local mode has, or does its own way: no Ray, the
environment switch, what it refuses, hang stacks read in-process, restarts from a checkpoint, a
debugger's trace hook reaching the function, a rank of independent ranks replaced alone."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import tenacity
from conftest import wait_no_local_threads
from test_faults import counter

import asyncexec
from asyncexec.testing import SimCluster, simulated

NO_WAIT = tenacity.wait_none()


@pytest.fixture(autouse=True)
def _no_threads_left() -> Any:
    yield
    wait_no_local_threads()


def test_a_local_run_never_starts_ray_and_the_environment_switches_it_on(tmp_path: Path) -> None:
    """A program that never says local=True runs locally under ASYNCEXEC_LOCAL=1: no Ray, every
    rank a thread of the driver's process, with its ranks and the run's id in its context."""
    program = tmp_path / "prog.py"
    program.write_text(
        textwrap.dedent(
            """
            import asyncio, json, os, threading
            import ray
            import asyncexec

            def fn(config):
                ctx = asyncexec.get_context()
                asyncexec.report({"rank": ctx.world_rank, "pid": ctx.pid,
                                  "thread": threading.current_thread().name,
                                  "run": ctx.run_id, "node": ctx.node_id})
                return ctx.world_size

            async def main():
                async with asyncexec.Executor(3, resources_per_worker={"GPU": 1}) as ex:
                    steps = [s async for s in ex.run(fn)]
                    print(json.dumps({
                        "reports": [r.metrics for r in steps[0].reports],
                        "values": ex.result.return_values,
                        "pid": os.getpid(),
                        "ray": ray.is_initialized(),
                    }))

            asyncio.run(main())
            """
        )
    )
    env = {**os.environ, "ASYNCEXEC_LOCAL": "1"}
    done = subprocess.run(
        [sys.executable, str(program)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ray"] is False
    assert out["values"] == [3, 3, 3]
    reports = out["reports"]
    assert [r["rank"] for r in reports] == [0, 1, 2]
    assert {r["pid"] for r in reports} == {out["pid"]}
    assert [r["thread"].endswith(f"rank {r['rank']}") for r in reports] == [True] * 3
    assert all(r["run"] and r["node"] == "local" for r in reports)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"backend": "torch"}, "backend"),
        ({"pool": "pool"}, "pool"),
        ({"reservation": "reservation"}, "reservation"),
        ({"spares": 1}, "spares"),
        ({"num_workers": (1, 2)}, "elastic"),
        ({"runtime_env": {"env_vars": {"A": "1"}}}, "runtime_env"),
        # Defect: an address was ignored (the executor ran locally as if none were given).
        ({"address": "10.0.0.1:6379"}, "address"),
    ],
)
def test_what_local_mode_cannot_do_is_refused_by_name(options: dict[str, Any], named: str) -> None:
    from asyncexec import backends

    made = {
        "torch": backends.TorchBackend(),
        "pool": asyncexec.WorkerPool.__new__(asyncexec.WorkerPool),
        "reservation": asyncexec.Reservation.__new__(asyncexec.Reservation),
    }
    options = {k: made.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
    num_workers = options.pop("num_workers", 2)
    with pytest.raises(asyncexec.ConfigurationError, match=named):
        asyncexec.Executor(num_workers, local=True, **options)


@pytest.mark.timeout(30)
async def test_a_local_executors_cluster_handed_in_is_refused_by_name() -> None:
    """Defect: a local executor's ``cluster`` handed to another executor (``cluster=a.cluster``)
    ran it on local mode's threads with every refusal of local mode skipped (its
    ``runtime_env`` ignored, ``spares`` taken), and a ``WorkerPool`` took it as well."""
    async with asyncexec.Executor(1, local=True) as a:
        for options in ({}, {"spares": 1}, {"runtime_env": {"env_vars": {"A": "1"}}}):
            with pytest.raises(asyncexec.ConfigurationError, match="local=True"):
                asyncexec.Executor(1, cluster=a.cluster, **options)
        with pytest.raises(asyncexec.ConfigurationError, match="local mode's"):
            asyncexec.WorkerPool(1, cluster=a.cluster)


def test_a_worker_pool_under_the_local_switch_is_refused_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: under ``ASYNCEXEC_LOCAL=1`` a ``WorkerPool`` started Ray when entered (local
    mode starts none), and only the executors that then leased from it were refused. The pool
    is refused when it is made now, naming the variable; one handed a cluster is not."""
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    with pytest.raises(asyncexec.ConfigurationError, match="ASYNCEXEC_LOCAL=1"):
        asyncexec.WorkerPool(1)
    assert isinstance(asyncexec.WorkerPool(1, cluster=SimCluster()).cluster, SimCluster)
    with simulated():
        assert isinstance(asyncexec.WorkerPool(1).cluster, SimCluster)


def test_a_bad_local_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "maybe")
    with pytest.raises(asyncexec.ConfigurationError, match="ASYNCEXEC_LOCAL"):
        asyncexec.Executor(1)
    with pytest.raises(asyncexec.ConfigurationError, match="local must be"):
        asyncexec.Executor(1, local="yes")  # type: ignore[arg-type]
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "0")
    assert asyncexec.Executor(1).config.local is False
    assert asyncexec.Executor(1, local=True).config.local is True


async def test_datasets_and_weight_channels_are_refused_in_local_mode() -> None:
    async with (
        asyncexec.Executor(1, local=True) as a,
        asyncexec.Executor(1, local=True) as b,
    ):
        with pytest.raises(asyncexec.ConfigurationError, match="datasets"):
            a.run(_steps, datasets={"train": object()})
        with pytest.raises(asyncexec.ConfigurationError, match="local"):
            asyncexec.WeightChannel(a, b)


def _steps(n: int = 1) -> None:
    for i in range(n):
        asyncexec.report({"i": i})


RELEASE = threading.Event()


def stuck_in_python(config: Any) -> None:
    asyncexec.report({"i": 0})
    if asyncexec.get_context().world_rank == 1:
        while not RELEASE.wait(0.05):  # no report: the step deadline declares it hung
            pass
    asyncexec.report({"i": 1})


async def test_a_hung_rank_is_declared_with_its_threads_stack() -> None:
    """The step deadline fires; the error holds every rank's stack, read in this process, and
    the hung rank's has its function's name in it. The executor goes on with a fresh group."""
    RELEASE.clear()
    policy = asyncexec.RestartPolicy(max_restarts=0)
    try:
        async with asyncexec.Executor(
            2, local=True, restart=policy, health=asyncexec.HealthChecks(step_timeout_s=0.5)
        ) as ex:
            run = ex.run(stuck_in_python)
            with pytest.raises(asyncexec.RestartsExhaustedError) as info:
                async for _ in run:
                    pass
            hung = info.value.failures[0]
            assert isinstance(hung, asyncexec.WorkerHungError)
            assert hung.rank == 1 and "step deadline" in str(hung)
            assert set(hung.stacks) == {0, 1}
            assert "stuck_in_python" in hung.stacks[1]
            assert "asyncexec-fn asyncexec rank 1" in hung.stacks[1]
            RELEASE.set()
            assert len([s async for s in ex.run(_steps, 3)]) == 3
    finally:
        RELEASE.set()


async def test_a_restart_resumes_from_the_latest_checkpoint_with_the_same_result(
    tmp_path: Path,
) -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, restart_on_user_error=True, wait=NO_WAIT)
    async with asyncexec.Executor(
        2, local=True, restart=policy, storage_path=tmp_path, buffer_size=2
    ) as ex:
        clean = [s async for s in ex.run(counter, {"steps": 12, "every": 3})]
        expected = ex.result.return_values
        run = ex.run(counter, {"steps": 12, "every": 3, "fail_at": 7})
        steps = [s async for s in run]
    assert len(clean) == 12
    assert run.result.return_values == expected
    assert run.result.attempts == 2
    assert isinstance(run.result.failures[0], asyncexec.WorkerRaisedError)
    second = [s.metrics["step"] for s in steps if s.attempt == 2]
    assert second == list(range(second[0], 12)) and second[0] % 3 == 1  # after a checkpoint
    assert run.result.checkpoint is not None
    assert Path(run.result.checkpoint.path).is_relative_to(tmp_path)


def traced(config: Any) -> None:
    asyncexec.report({"rank": asyncexec.get_context().world_rank})


async def test_a_debuggers_trace_hook_reaches_the_function() -> None:
    """Debuggers (pdb, debugpy) stop in code through the trace hook of its thread: set for
    new threads before the executor starts, it sees the function run on every rank."""
    seen: list[str] = []
    lock = threading.Lock()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is traced.__code__:
            with lock:
                seen.append(threading.current_thread().name)
        return None

    threading.settrace(tracer)
    try:
        async with asyncexec.Executor(2, local=True) as ex:
            steps = [s async for s in ex.run(traced)]
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    assert [r.metrics["rank"] for r in steps[0].reports] == [0, 1]
    assert sorted(seen) == ["asyncexec-fn asyncexec rank 0", "asyncexec-fn asyncexec rank 1"]


def flaky_rank(config: Any) -> int:
    ctx = asyncexec.get_context()
    for i in range(config["steps"]):
        if ctx.world_rank == 1 and ctx.attempt == 1 and i == 2:
            raise ValueError("rank 1 fails once")
        asyncexec.report({"i": i})
    return ctx.world_rank


async def test_an_independent_rank_is_replaced_alone() -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, restart_on_user_error=True, wait=NO_WAIT)
    async with asyncexec.Executor(3, local=True, restart=policy) as ex:
        before = [w.pid for w in ex.workers]
        run = ex.run(flaky_rank, {"steps": 5}, independent=True)
        steps = [s async for s in run]
    by_rank = {r: [s.metrics["i"] for s in steps if s.rank == r] for r in range(3)}
    assert by_rank[0] == by_rank[2] == list(range(5))  # the others went on
    assert by_rank[1][-5:] == list(range(5))  # rank 1 started over (no checkpoint)
    assert run.result.return_values == [0, 1, 2]
    assert len(run.result.failures) == 1 and run.result.failures[0].rank == 1
    assert before == [os.getpid()] * 3


def test_the_command_line_runs_a_function_locally(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(
        textwrap.dedent(
            """
            import ray
            import asyncexec

            def train(config):
                for step in range(config["steps"]):
                    asyncexec.report({"step": step, "ray": ray.is_initialized()})
            """
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncexec",
            "run",
            "job:train",
            "-n",
            "2",
            "--local",
            "--json",
            "--config",
            '{"steps": 3}',
            "--storage-path",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [s["metrics"]["step"] for s in steps] == [0, 1, 2]
    assert all(len(s["reports"]) == 2 for s in steps)
    assert not any(r["ray"] for s in steps for r in s["reports"])


def _reports(config: Any = None) -> None:
    asyncexec.report({"i": 0})


@pytest.mark.timeout(60)
async def test_runs_on_one_executor_leave_no_wait_behind() -> None:
    """Defect: every run's death watch awaited each local worker's ``wait_closed`` call anew,
    and the cancelled wait left its future on the call until the worker died: a long-lived
    local executor gathered one pending future per rank and run (and a callback of it)."""

    def pending() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, asyncio.Future) and not o.done())

    async with asyncexec.Executor(2, local=True) as ex:
        [s async for s in ex.run(_reports)]
        before = pending()
        for _ in range(20):
            [s async for s in ex.run(_reports)]
        assert pending() - before < 5


_HOLD_START = threading.Event()


def _held_start() -> None:
    _HOLD_START.wait(30)


@pytest.mark.timeout(60)
async def test_aclose_during_start_up_leaves_no_group_behind() -> None:
    """Defect: ``aclose()`` called while the executor was starting (a service shutting down
    while a request's executor leased its workers) returned with the executor closed, and then
    the start finished: the executor was ready again, its workers alive after the close. The
    start now closes the group it got, and fails with ``ExecutorStateError``."""
    import anyio

    _HOLD_START.clear()
    ex = asyncexec.Executor(2, local=True, init_hook=_held_start)
    entered: list[BaseException | None] = []

    async def enter() -> None:
        try:
            async with ex:
                entered.append(None)
        except asyncexec.ExecutorStateError as exc:
            entered.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(enter)
        with anyio.fail_after(20):
            while ex._slot.starting is None:  # noqa: ASYNC110 - no event for the slot's start
                await anyio.sleep(0.01)
        tg.start_soon(ex.aclose)
        with anyio.fail_after(20):
            closing = (asyncexec.ExecutorState.CLOSING, asyncexec.ExecutorState.CLOSED)
            while ex.state not in closing:  # noqa: ASYNC110 - aclose() has begun
                await anyio.sleep(0.01)
        _HOLD_START.set()  # the start goes on, and ends
    assert ex.state is asyncexec.ExecutorState.CLOSED
    assert ex.workers == []
    assert len(entered) == 1 and isinstance(entered[0], asyncexec.ExecutorStateError)


#: The run's first function's thread, left running after its run stopped, and the next run's
#: function: each waits for the other at a point of its own (a local worker's threads are this
#: process's).
_LEFTOVER: dict[str, Any] = {}


async def _leaves_a_reporting_thread() -> None:
    def loop() -> None:
        asyncexec.report({"run": 1})
        _LEFTOVER["next_run_on"].wait(20)
        try:
            asyncexec.report({"run": 1})
        except BaseException as exc:  # what it raised (nothing, before the fix)
            _LEFTOVER["refused"] = exc
        finally:
            _LEFTOVER["run_id"] = asyncexec.get_context().run_id
            _LEFTOVER["tried"].set()

    await asyncio.to_thread(loop)  # cancelled when the run stops; the thread goes on


def _the_next_run() -> None:
    asyncexec.report({"run": 2})
    _LEFTOVER["next_run_on"].set()
    _LEFTOVER["tried"].wait(20)
    asyncexec.report({"run": 2})


@pytest.mark.timeout(60)
async def test_a_thread_left_running_by_a_stopped_run_cannot_report_into_the_next_run() -> None:
    """Defect: ``report()`` went to whatever run was on the worker when it was called: a thread
    that a stopped run's function left running (its ``asyncio.to_thread()``, which a stop cannot
    end) reported into the next run on that worker, whose stream then held the old run's
    steps, and ``get_context()`` there gave the next run's context. ``report()`` now raises
    ``ExecutorStateError`` there, as it does between runs, and ``get_context()`` gives the
    group's (no run)."""
    _LEFTOVER.update(next_run_on=threading.Event(), tried=threading.Event(), refused=None)
    async with asyncexec.Executor(1, local=True) as ex:
        async for step in ex.run(_leaves_a_reporting_thread):
            assert step.metrics == {"run": 1}
            break  # the run stops; its function's thread goes on
        steps = [s.metrics async for s in ex.run(_the_next_run)]
    assert steps == [{"run": 2}, {"run": 2}]
    assert isinstance(_LEFTOVER["refused"], asyncexec.ExecutorStateError), _LEFTOVER["refused"]
    assert _LEFTOVER["run_id"] is None


def _reports_then_raises() -> None:
    asyncexec.report({"attempt": asyncexec.get_context().attempt})
    raise ValueError("every attempt fails")


def _live(kind: str, side: str = "_driver") -> int:
    """The objects of asyncexec's class ``kind`` (of the driver's side, or ``"_worker"``) the
    collector can reach (by name: the test imports no private module)."""
    gc.collect()
    return sum(
        1
        for o in gc.get_objects()
        if type(o).__name__ == kind and type(o).__module__.startswith(f"asyncexec.{side}")
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("independent", [False, True], ids=["aligned", "independent"])
async def test_the_failures_a_run_keeps_hold_no_attempts_group_or_window(independent: bool) -> None:
    """Defect: each error in ``run.failures`` kept the attempt that failed alive through its
    traceback: the attempt's frame held its group (the workers' handles) and its window (the
    reports it buffered), so under an unbounded policy every failure kept one more of each for
    the run's life (31 windows and 31 groups after 30 restarts; of independent ranks, each
    failed rank's worker)."""
    kinds = ("Window", "WorkerGroup", "WorkerInfo")
    before = {kind: _live(kind) for kind in kinds}  # (what earlier tests left, if anything)
    policy = asyncexec.RestartPolicy(max_restarts=12, restart_on_user_error=True, wait=NO_WAIT)
    async with asyncexec.Executor(1, local=True, restart=policy) as ex:
        run = ex.run(_reports_then_raises, independent=independent)
        with pytest.raises(asyncexec.RestartsExhaustedError):
            async for _ in run:
                pass
        assert len(run.failures) == 13
        grown = {kind: _live(kind) - before[kind] for kind in kinds}
        assert max(grown.values()) <= 2, grown  # the live group's, and its last attempt's


def _raises() -> None:
    raise ValueError("the run fails")


@pytest.mark.timeout(60)
async def test_a_run_that_ended_with_an_error_is_freed_once_dropped() -> None:
    """Defect: a run read to its error was never freed: the error, kept as the run's end, held
    the iterator in its traceback, and the finalizer that stops a dropped run held the run's
    state, so nothing was ever collected; and the error's traceback held the run before it, so
    an executor kept every run that had failed (with their drivers, attempts and workers'
    handles: one more of each for every failed run of a service)."""
    dropped = []
    async with asyncexec.Executor(1, local=True) as ex:
        for _ in range(3):
            run = ex.run(_raises)
            try:
                async for _ in run:
                    pass
            except asyncexec.WorkerRaisedError:
                pass
            dropped.append(weakref.ref(run))
            del run
    gc.collect()
    # The executor keeps its last run (its result or error); the others are gone.
    assert [ref() is None for ref in dropped] == [True, True, False]
    del ex
    gc.collect()
    assert dropped[-1]() is None


class _Held:
    """An object only a failing function's frame refers to."""


_HELD: list[weakref.ref[_Held]] = []


def _raises_holding() -> None:
    held = _Held()
    _HELD.append(weakref.ref(held))
    raise ValueError("the run fails")


@pytest.mark.timeout(60)
async def test_a_kept_error_of_a_local_run_holds_neither_the_functions_frame_nor_its_session() -> (
    None
):
    """Defect: the error of a failed local run, kept by the application, kept the worker's
    side alive through tracebacks a Ray worker's error never carries: the function's own
    exception (its frames, their locals), and the cancellation of the closed worker's
    pending calls (their frames held the worker's code and its run's session), reached
    through the driver's frames. Now the error is the copy a worker process would send, and a
    closed local worker lets go of what it held."""
    _HELD.clear()
    sessions = _live("Session", "_worker")  # (what earlier tests left, if anything)
    async with asyncexec.Executor(1, local=True) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as caught:
            async for _ in ex.run(_raises_holding):
                pass
    del ex
    error = caught.value
    assert isinstance(error.__cause__, ValueError)  # what the function raised, still said
    assert "the run fails" in str(error)
    assert _live("Session", "_worker") == sessions
    assert _HELD[0]() is None


#: How many workers the init hook below has set up (the first only succeeds).
_SET_UP = [0]


def _sets_up_once() -> None:
    _SET_UP[0] += 1
    if _SET_UP[0] > 1:
        raise RuntimeError("a replacement cannot be set up")


@pytest.mark.timeout(60)
async def test_an_independent_ranks_failed_renewal_counts_as_its_attempt() -> None:
    """Defect: a rank of independent ranks whose renewal failed (its replacement could not be
    set up) was not counted as having made that attempt: the run gave up with "gave up after 1
    attempt(s)" and listed two failures."""
    _SET_UP[0] = 0
    policy = asyncexec.RestartPolicy(max_restarts=1, restart_on_user_error=True, wait=NO_WAIT)
    async with asyncexec.Executor(1, local=True, restart=policy, init_hook=_sets_up_once) as ex:
        run = ex.run(_raises, independent=True)
        with pytest.raises(asyncexec.RestartsExhaustedError) as caught:
            async for _ in run:
                pass
    assert len(caught.value.failures) == 2
    assert caught.value.attempts == 2, caught.value
    assert run.attempt == 2


def _reports_three() -> None:
    for i in range(3):
        asyncexec.report({"i": i})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["local", "simulated"])
async def test_a_run_never_read_or_read_to_its_end_leaves_no_stream_open(where: str) -> None:
    """Defect: a run left its streams open when it was never read (dropped at once, or held
    until the executor closed) or read to its end: the iterator's stream, and the queue of
    checkpoints to delete of a run stopped before its work began; Python warned of each
    ("Unclosed <MemoryObjectReceiveStream>", "...SendStream") when the run was collected."""
    gc.collect()  # what earlier tests left is collected first: this test's own is counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        cluster = SimCluster() if where == "simulated" else None
        async with asyncexec.Executor(2, local=cluster is None, cluster=cluster) as ex:
            dropped = ex.run(_reports_three)
            del dropped
            gc.collect()
            read = ex.run(_reports_three)  # (accepted: the dropped run counts as closed)
            assert [step async for step in read]  # (simulated ranks report as they are told)
            del read
            gc.collect()
            held = ex.run(_reports_three)  # never read: the executor's close stops it
        assert held.state is asyncexec.RunState.CANCELLED
        del held
        gc.collect()
    unclosed = [str(w.message) for w in caught if "MemoryObject" in str(w.message)]
    assert unclosed == []
