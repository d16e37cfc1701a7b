"""Hang diagnostics: a worker declared hung (health check, step deadline) or a stopped run whose
function does not end carries every rank's stack, read from outside the processes with py-spy;
``asyncexec stack`` prints a live run's; a stack that cannot be taken is a note saying why."""

from __future__ import annotations

import ctypes
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
from structlog.testing import capture_logs

import asyncexec
from asyncexec._cli._stack import WorkerProcess, format_stacks
from asyncexec._driver.cluster import NOT_TAKEN, _stacks, dump_processes, take_stacks

pytestmark = pytest.mark.skipif(_stacks.find_pyspy() is None, reason="py-spy is not installed")

NO_RESTART = asyncexec.RestartPolicy(max_restarts=0)


def _names_function(stack: str, name: str) -> bool:
    """Whether a py-spy dump shows a frame of the function ``name``."""
    return any(line.strip().startswith(f"{name} (") for line in stack.splitlines())


# What the workers run ---------------------------------------------------------------------------


def holds_the_gil_in_c() -> None:
    # A foreign call made through PyDLL keeps the GIL (CDLL would release it): the worker's actor
    # cannot answer a health check while libc's sleep runs.
    ctypes.PyDLL(None).sleep(600)


def waits_in_python() -> None:
    time.sleep(600)


def one_rank_stuck_in_c(config: dict[str, Any]) -> None:
    asyncexec.report({"step": 0})
    if asyncexec.get_context().world_rank == 1:
        holds_the_gil_in_c()
    else:
        waits_in_python()


def naps_in_a_python_function() -> None:
    time.sleep(600)


def one_rank_stops_reporting(config: dict[str, Any]) -> None:
    rank = asyncexec.get_context().world_rank
    for step in range(100_000):
        asyncexec.report({"step": step})
        if rank == 1:
            naps_in_a_python_function()
        time.sleep(0.05)


def ignores_the_stop() -> None:
    time.sleep(600)  # never reports again, so the stop never reaches it


def deaf_to_stop(config: dict[str, Any]) -> None:
    asyncexec.report({"step": 0})
    if asyncexec.get_context().world_rank == 0:
        ignores_the_stop()


def waits_for_the_cli(config: dict[str, Any]) -> None:
    while True:  # blocked in report() once a report is unconsumed (buffer_size=1); stops there
        asyncexec.report({"pid": os.getpid()})


# Hung workers ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_worker_stuck_in_c_holding_the_gil_is_declared_hung_with_its_stack() -> None:
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        restart=NO_RESTART,
        health=asyncexec.HealthChecks(interval_s=0.2, timeout_s=1.0),
    ) as ex:
        with pytest.raises(asyncexec.RestartsExhaustedError) as info:
            async for _ in ex.run(one_rank_stuck_in_c):
                pass
    hung = info.value.__cause__
    assert isinstance(hung, asyncexec.WorkerHungError)
    assert hung.rank == 1 and "health check" in hung.detail
    assert sorted(hung.stacks) == [0, 1]
    assert _names_function(hung.stacks[1], "holds_the_gil_in_c"), hung.stacks[1]
    assert _names_function(hung.stacks[1], "one_rank_stuck_in_c")
    assert "asyncexec-fn asyncexec rank 1" in hung.stacks[1]  # the function's thread, named
    assert _names_function(hung.stacks[0], "waits_in_python"), hung.stacks[0]
    # The message shows the hung rank's stack; the stacks survive a trip through pickle.
    assert "holds_the_gil_in_c" in str(hung) and "waits_in_python" not in str(hung)
    copy = pickle.loads(pickle.dumps(hung))
    assert copy.stacks == hung.stacks and str(copy) == str(hung)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_rank_sleeping_in_python_is_caught_by_the_step_deadline_with_its_stack() -> None:
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        restart=NO_RESTART,
        health=asyncexec.HealthChecks(step_timeout_s=1.0),
    ) as ex:
        with pytest.raises(asyncexec.RestartsExhaustedError) as info:
            async for _ in ex.run(one_rank_stops_reporting):
                pass
    hung = info.value.__cause__
    assert isinstance(hung, asyncexec.WorkerHungError)
    assert hung.rank == 1 and "step deadline" in hung.detail
    assert _names_function(hung.stacks[1], "naps_in_a_python_function"), hung.stacks[1]
    assert not _names_function(hung.stacks[0], "naps_in_a_python_function")
    assert "naps_in_a_python_function" in str(hung)


def reports_until_stopped() -> None:
    while True:
        asyncexec.report({"rank": asyncexec.get_context().world_rank})


def kills_rank_one() -> None:
    if asyncexec.get_context().world_rank == 1:
        os.kill(os.getpid(), 9)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_a_rank_that_died_during_the_run_is_not_reported_hung_when_it_stops() -> None:
    """``execute()`` during a run in which a rank SIGKILLs itself raises WorkerCrashedError;
    the run then stopped reported the dead rank as hung (its stop call failed, counted as
    late), with py-spy's failure to read a dead process's stack in one line of 8 KB."""
    with capture_logs() as logs:
        async with asyncexec.Executor(
            2, resources_per_worker={"CPU": 0.5}, restart=NO_RESTART, buffer_size=1
        ) as ex:
            run = ex.run(reports_until_stopped)
            await run.__anext__()
            with pytest.raises(asyncexec.WorkerCrashedError) as crashed:
                await ex.execute(kills_rank_one)
            assert crashed.value.rank == 1
            await run.aclose()
    events = [e["event"] for e in logs]
    assert "run_stop_timed_out" not in events, [e for e in logs if "stop" in e["event"]]
    assert not any(isinstance(f, asyncexec.WorkerHungError) for f in run.failures)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_function_that_does_not_stop_is_recorded_with_the_stacks() -> None:
    with capture_logs() as logs:
        async with asyncexec.Executor(
            2, resources_per_worker={"CPU": 0.5}, timeouts=asyncexec.Timeouts(stop_s=0.5)
        ) as ex:
            run = ex.run(deaf_to_stop)
            async for _ in run:
                break
            await run.aclose()
            assert ex._slot.group is None  # discarded: its functions did not stop
    [event] = [e for e in logs if e["event"] == "run_stop_timed_out"]
    assert event["ranks"] == [0]
    assert "stacks" not in event and len(str(event)) < 1000  # one short line
    assert event["stacks_event"] == "run_stop_stack"  # it says where the stacks are
    stacks = {e["rank"]: e["stack"] for e in logs if e["event"] == "run_stop_stack"}
    assert all(e["log_level"] == "debug" for e in logs if e["event"] == "run_stop_stack")
    assert _names_function(stacks[0], "ignores_the_stop"), stacks[0]
    assert run.state is asyncexec.RunState.CANCELLED
    [hung] = run.failures
    assert isinstance(hung, asyncexec.WorkerHungError)
    assert hung.rank == 0 and "did not end within 0.5 s" in str(hung)
    assert hung.stacks == stacks


# asyncexec stack ------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(120)
async def test_stack_command_prints_a_live_runs_stacks() -> None:
    address = ray.get_runtime_context().gcs_address
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, buffer_size=1, name="stackdemo"
    ) as ex:
        run = ex.run(waits_for_the_cli)
        await run.__anext__()  # every rank's function runs (a loop left by break would stop it)
        done = await anyio.run_process(
            [sys.executable, "-m", "asyncexec", "stack", "--address", address],
            check=False,
        )
        pids = [w.pid for w in ex.workers]
        await run.aclose()
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert out.startswith("2 live asyncexec worker(s) on 1 node(s)"), out[:500]
    for rank, pid in enumerate(pids):
        assert f"pid {pid}, actor" in out
        assert f"executor stackdemo, rank {rank}" in out
    assert out.count("waits_for_the_cli (") == 2, out


class _PlainRole:
    def who(self) -> int:
        return os.getpid()


class _AsyncRole:
    async def who(self) -> int:
        return os.getpid()


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_the_stack_command_finds_the_workers_of_plain_and_async_roles() -> None:
    """Defect: a group whose roles have only plain methods runs the threaded worker actor, which
    the command's look-up of live workers did not know: "no live asyncexec worker"."""
    from asyncexec._driver.cluster import live_workers

    cpu = {"CPU": 0.25}
    async with (
        asyncexec.Executor(1, resources_per_worker=cpu, roles=_PlainRole) as plain,
        asyncexec.Executor(1, resources_per_worker=cpu, roles=_AsyncRole) as coroutines,
    ):
        pids = {w.pid for w in [*plain.workers, *coroutines.workers]}
        found = {w.pid for w in await anyio.to_thread.run_sync(live_workers)}
    assert pids <= found, (pids, found)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
def test_stack_command_on_a_cluster_without_workers_says_so() -> None:
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, "-m", "asyncexec", "stack", "--address", address],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"no live asyncexec worker at {address}" in done.stderr


@pytest.mark.timeout(30)
def test_stack_command_at_an_address_where_nothing_answers_fails_at_once() -> None:
    """Defect: ``ray.init`` tried for minutes (measured: over 2 min) to join an address where
    nothing listens; the command now checks the address first."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{free.getsockname()[1]}"  # closed again below: nothing listens
    done = subprocess.run(  # before the fix, this timeout expired
        [sys.executable, "-m", "asyncexec", "stack", "--address", address],
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert done.returncode == 1
    assert f"could not join the Ray cluster at {address}: nothing answers" in done.stderr


# Taking stacks ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_stacks_of_other_nodes_are_taken_by_a_task_pinned_there() -> None:
    """The path for workers on other nodes (a Ray task on the worker's node), forced here on
    this one node; a dead process's text is a note."""
    async with asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}) as ex:
        group = ex._slot.group
        assert group is not None
        [worker] = group.workers
        node = worker.metadata.node_id
        texts = await dump_processes([(node, worker.metadata.pid), (node, 2**22 + 1)], local=False)
        by_rank = await group.stacks()
    assert f"Process {worker.metadata.pid}" in texts[0], texts[0]
    assert texts[1].startswith(f"{NOT_TAKEN}py-spy failed on node {node[:12]}"), texts[1]
    assert list(by_rank) == [0] and f"Process {worker.metadata.pid}" in by_rank[0]


def test_missing_pyspy_is_a_note_that_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_stacks, "find_pyspy", lambda: None)
    texts = take_stacks([os.getpid(), 1], 1.0, "node abc")
    assert (
        texts
        == [
            f"{NOT_TAKEN}py-spy is not installed on node abc "
            "(pip install py-spy, or asyncexec[diagnostics])"
        ]
        * 2
    )


def test_pyspy_that_does_not_answer_or_fails_is_a_note(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    slow = tmp_path / "slow-py-spy"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setattr(_stacks, "find_pyspy", lambda: str(slow))
    t0 = time.monotonic()
    [text] = take_stacks([os.getpid()], 0.5, "node abc")
    assert text == f"{NOT_TAKEN}py-spy did not finish in time on node abc (pid {os.getpid()})"
    assert time.monotonic() - t0 < 10
    denied = tmp_path / "denied-py-spy"
    denied.write_text("#!/bin/sh\necho 'Error: Permission denied (os error 13)' >&2\nexit 1\n")
    denied.chmod(0o755)
    monkeypatch.setattr(_stacks, "find_pyspy", lambda: str(denied))
    [text] = take_stacks([1], 5.0, "node abc")
    assert text.startswith(f"{NOT_TAKEN}py-spy failed on node abc (pid 1, exit 1): Error: Perm")
    assert "CAP_SYS_PTRACE" in text


def test_a_pyspy_that_does_not_answer_loses_no_other_processs_stack(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The dumps of one node are read at once: one that does not answer in time is a note, and
    the others' stacks (taken in time, one of them longer than a pipe holds) are still there."""
    program = tmp_path / "one-hangs-py-spy"
    program.write_text(
        "#!/bin/sh\n"  # py-spy dump --pid PID
        'if [ "$3" = 111 ]; then exec sleep 30; fi\n'
        'echo "Process $3"\n'
        'if [ "$3" = 333 ]; then head -c 200000 /dev/zero | tr "\\0" x; echo; fi\n'
    )
    program.chmod(0o755)
    monkeypatch.setattr(_stacks, "find_pyspy", lambda: str(program))
    t0 = time.monotonic()
    texts = take_stacks([111, 222, 333], 1.0, "node abc")
    assert time.monotonic() - t0 < 10
    assert texts[0] == f"{NOT_TAKEN}py-spy did not finish in time on node abc (pid 111)"
    assert texts[1] == "Process 222"
    assert texts[2].startswith("Process 333\nxxx") and len(texts[2]) > 200_000


def test_a_node_answers_within_its_budget_when_a_killed_pyspy_leaves_a_child_holding_its_pipes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``take_stacks`` ends within its budget, the kill of a py-spy that did not answer
    included: here its child keeps its pipes open after the kill, which took a second more,
    and a dump's bound of 2.5 s (``asyncexec stack --timeout 2.5``: 1.75 s for py-spy) then
    passed before the node's answer came, and every stack of the node, those taken in time
    too, became 'no answer'."""
    program = tmp_path / "child-holds-pipes-py-spy"
    program.write_text(
        "#!/bin/sh\n"  # py-spy dump --pid PID; sleep is a child of the shell, not exec'd
        'if [ "$3" = 111 ]; then sleep 30; fi\n'
        'echo "Process $3"\n'
    )
    program.chmod(0o755)
    monkeypatch.setattr(_stacks, "find_pyspy", lambda: str(program))
    t0 = time.monotonic()
    texts = take_stacks([111, 222], 1.75, "node abc")
    took = time.monotonic() - t0
    assert texts == [
        f"{NOT_TAKEN}py-spy did not finish in time on node abc (pid 111)",
        "Process 222",
    ]
    assert took < 1.75 + 0.5, took  # was 1.75 + 1 (the reap)


def test_this_process_stack_names_the_calling_function() -> None:
    """py-spy reads a process from outside it (here: this test's own process, from a child)."""
    [text] = take_stacks([os.getpid()], 10.0, "node here")
    assert _names_function(text, "take_stacks"), text
    assert _names_function(text, "test_this_process_stack_names_the_calling_function")


def test_hung_error_without_stacks_reads_as_before() -> None:
    error = asyncexec.WorkerHungError(2, node_id="n", detail="no answer")
    assert error.stacks == {} and "\n" not in str(error)
    one = asyncexec.WorkerHungError(2, detail="x", stacks={2: "Thread 1\n    f (a.py:1)"})
    head = "Stack of rank 2, taken when it was declared hung:"
    assert str(one).endswith(f"{head}\nThread 1\n    f (a.py:1)")
    copy = pickle.loads(pickle.dumps(one))
    assert copy.stacks == one.stacks and copy.time == one.time


def test_stack_report_orders_workers_by_driver_executor_and_rank() -> None:
    """Idle workers (no run's function) come after those running one; the header names the
    executor and rank from the function's thread."""

    def worker(job: str, pid: int) -> WorkerProcess:
        return WorkerProcess(job, "n" * 20, "10.0.0.1", pid, "a" * 32)

    def dump(name: str | None, rank: int) -> str:
        thread = f'"asyncexec-fn {name} rank {rank}"' if name else '"MainThread"'
        return f"Thread 1 (idle): {thread}\n    f (x.py:1)"

    workers = [worker("02", 5), worker("01", 9), worker("01", 7), worker("01", 8)]
    texts = [dump("b", 0), dump(None, 0), dump("a", 1), dump("a", 0)]
    report = format_stacks(workers, texts)
    heads = [line for line in report.splitlines() if line.startswith("===")]
    assert report.startswith("4 live asyncexec worker(s) on 1 node(s), 2 driver(s)")
    assert [h.split(", pid ")[1].split(",")[0] for h in heads] == ["8", "7", "9", "5"]
    assert heads[0].endswith(": executor a, rank 0") and heads[2].endswith("actor aaaaaaaaaaaa")


@pytest.mark.timeout(30)
async def test_a_dump_is_bounded_when_sending_the_task_to_another_node_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sending the task to a worker's node (the first send exports it: a blocking call to
    Ray's GCS, in a thread) that does not return in time is a note at the dump's bound: its
    thread is abandoned, not waited for."""
    release = threading.Event()

    def blocked(node: str, pids: list[int], timeout_s: float, where: str) -> Any:
        release.wait(10)  # a GCS that does not answer
        raise RuntimeError("sent too late")

    monkeypatch.setattr(_stacks, "_submit", blocked)
    t0 = time.monotonic()
    try:
        texts = await dump_processes([("ab" * 28, 4321)], timeout_s=0.5, local=False)
    finally:
        release.set()
    assert time.monotonic() - t0 < 5
    assert texts == [f"{NOT_TAKEN}no answer from node {'ab' * 6} within 0.5 s"]
