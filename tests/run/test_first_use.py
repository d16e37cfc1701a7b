"""What a new user hits first: Ray's lifetime when the executor starts it, cancelling the task
that consumes a run, the library's logs, and the smaller surprises."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
import tenacity

import asyncexec

CPU = {"CPU": 0.5}
ROOT = Path(__file__).resolve().parents[2]

# Ray started by the executor, in a program of its own ---------------------------------------

_PROGRAM = """
import asyncio, os, sys, time
import anyio
import anyio._backends._asyncio as anyio_asyncio
import asyncexec

# anyio ends worker threads idle this long (10 s by default); shortened so the test is quick.
anyio_asyncio.WorkerThread.MAX_IDLE_TIME = 0.5

def steps():
    for i in range(3):
        asyncexec.report({"i": i})

async def main(mode):
    async with asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}) as ex:
        print("ENTERED", flush=True)
        if mode == "idle":
            await anyio.sleep(1.5)                       # past the worker threads' idle limit
            await anyio.to_thread.run_sync(time.sleep, 0)  # anyio prunes idle threads here
            await anyio.sleep(0.5)
            got = [s.index async for s in ex.run(steps)]
            print("STEPS", got, flush=True)
        elif mode == "raise":
            raise RuntimeError("the user's own error")
        elif mode == "sigint":
            await anyio.sleep(120)

asyncio.run(main(sys.argv[1]))
print("DONE", flush=True)
"""


def _program(mode: str, tmp_path: Path) -> subprocess.Popen[str]:
    script = tmp_path / "program.py"
    script.write_text(_PROGRAM)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )


def _wait_for_line(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if marker in line:
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"no {marker!r} line; stderr:\n{proc.communicate()[1][-3000:]}")


@pytest.mark.slow
def test_ray_started_by_the_executor_survives_an_idle_program(tmp_path: Path) -> None:
    proc = _program("idle", tmp_path)
    out, err = proc.communicate(timeout=110)
    assert proc.returncode == 0, err[-3000:]
    assert "STEPS [0, 1, 2]" in out and "DONE" in out
    assert "SIGTERM handler is not set" not in err


@pytest.mark.slow
def test_an_uncaught_exception_exits_promptly_with_the_users_traceback(tmp_path: Path) -> None:
    proc = _program("raise", tmp_path)
    _wait_for_line(proc, "ENTERED", 90)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "RuntimeError: the user's own error" in err
    assert "Failed to connect to GCS" not in err
    assert time.monotonic() - t0 < 45  # Ray's own shutdown; a lost GCS would take 60 s


@pytest.mark.slow
def test_ctrl_c_exits_promptly_with_keyboard_interrupt(tmp_path: Path) -> None:
    proc = _program("sigint", tmp_path)
    _wait_for_line(proc, "ENTERED", 90)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert "Failed to connect to GCS" not in err


@pytest.fixture
def dead_cluster_on_record() -> Iterator[tuple[dict[str, str], str]]:
    """An environment whose Ray temp folder holds the address file of a cluster that is gone
    (a port nothing listens on), as a cluster killed before ``ray stop`` leaves it; and that
    address."""
    import shutil
    import socket

    with socket.socket() as sock:  # a free port, closed again: nothing answers there
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's sockets live under it
    try:
        os.makedirs(os.path.join(temp, "ray"))
        Path(temp, "ray", "ray_current_cluster").write_text(address)
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
        env.pop("RAY_ADDRESS", None)
        env["RAY_TMPDIR"] = temp
        yield env, address
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _enter(
    tmp_path: Path, env: dict[str, str], argument: str = ""
) -> subprocess.CompletedProcess[str]:
    """Enter an executor (its options followed by ``argument``) in a fresh interpreter: it
    prints ENTERED, or REFUSED and the ``StartupError``."""
    script = tmp_path / "enter.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, asyncexec

            async def main():
                try:
                    async with asyncexec.Executor(1, resources_per_worker={{"CPU": 0.5}}
                                                  {argument}):
                        print("ENTERED")
                except asyncexec.StartupError as exc:
                    print("REFUSED", exc)

            asyncio.run(main())
            """
        )
    )
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.timeout(90)
def test_a_dead_cluster_on_record_is_named_at_once_not_waited_on(
    tmp_path: Path, dead_cluster_on_record: tuple[dict[str, str], str]
) -> None:
    """Defect: with a dead cluster's address left in Ray's ``ray_current_cluster`` file (a CI
    machine's /tmp held one), entering an executor waited on the dead GCS for about a minute
    and failed saying only "Failed to connect to GCS"; a CI run lost 360 tests to it."""
    env, address = dead_cluster_on_record
    t0 = time.monotonic()
    done = _enter(tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED could not start Ray: Ray would join the cluster" in done.stdout, done.stdout
    assert f"nothing answers at {address}" in done.stdout
    assert "ray stop" in done.stdout and "address='local'" in done.stdout
    assert time.monotonic() - t0 < 30  # told at once: Ray itself waits about a minute

    cli = subprocess.run(
        [sys.executable, "-m", "asyncexec", "run", "json:dumps", "--workers", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert cli.returncode == 1, cli.stderr[-3000:]
    assert "could not start Ray" in cli.stderr and f"nothing answers at {address}" in cli.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("given", ["address", "RAY_ADDRESS"])
def test_an_address_where_nothing_answers_is_named_at_once_not_waited_on(
    tmp_path: Path, dead_cluster_on_record: tuple[dict[str, str], str], given: str
) -> None:
    """Defect: ``Executor(address=...)`` (or ``RAY_ADDRESS``) naming an address where nothing
    answers (a typo in the port, a head node that is down) left the executor's entry waiting
    on Ray's retries for minutes (over 200 s measured), where a dead address on record was
    named at once."""
    env, address = dead_cluster_on_record
    env = {**env, "RAY_ADDRESS": address} if given == "RAY_ADDRESS" else env
    argument = f", address={address!r}" if given == "address" else ""
    t0 = time.monotonic()
    done = _enter(tmp_path, env, argument)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED could not start Ray: Ray would join the cluster at" in done.stdout, done.stdout
    assert f"nothing answers at {address}" in done.stdout
    assert (given if given == "RAY_ADDRESS" else repr(address)) in done.stdout
    assert time.monotonic() - t0 < 30  # told at once: Ray itself retries for minutes


@pytest.mark.timeout(30)
async def test_ray_that_cannot_be_started_or_joined_is_a_startup_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: when ``ray.init`` failed on entering an executor (``address="auto"`` with no
    cluster running: "Could not find any running Ray instance"), its bare ``ConnectionError``
    came out of ``async with``, outside ``AsyncExecError``; a dead address on record was a
    ``StartupError``."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(asyncexec.StartupError, match=r"could not start Ray: .*running Ray") as e:
        async with asyncexec.Executor(1, address="local"):
            pass
    assert isinstance(e.value.__cause__, ConnectionError)
    assert not ray.is_initialized()


# Cancelling the consumer stops the run --------------------------------------------------------


def forever(config: Any = None) -> None:
    i = 0
    while True:
        asyncexec.report({"i": i})
        i += 1
        time.sleep(0.02)


def few() -> int:
    asyncexec.report({"i": 0})
    return asyncexec.get_context().world_rank


async def _consume(run: asyncexec.Run, started: anyio.Event) -> None:
    async for step in run:
        if step.index >= 2:
            started.set()


async def _assert_stops_and_runs_again(ex: asyncexec.Executor, run: asyncexec.Run) -> None:
    with anyio.fail_after(30):  # no garbage collection needed: the run stops by itself
        await run.wait_finished()
    assert run.state is asyncexec.RunState.CANCELLED
    assert ex.state is asyncexec.ExecutorState.READY
    steps = [s async for s in ex.run(few)]
    assert len(steps) == 1


@pytest.mark.usefixtures("mode")
async def test_cancelling_the_consuming_task_stops_the_run() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        run = ex.run(forever)
        started = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_consume, run, started)
            await started.wait()
            tg.cancel_scope.cancel()
        await _assert_stops_and_runs_again(ex, run)


@pytest.mark.usefixtures("mode")
async def test_cancelling_an_asyncio_task_that_consumes_stops_the_run() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        run = ex.run(forever)
        started = anyio.Event()
        task = asyncio.get_running_loop().create_task(_consume(run, started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _assert_stops_and_runs_again(ex, run)


@pytest.mark.usefixtures("mode")
@pytest.mark.parametrize("how", ["move_on_after", "asyncio.timeout"])
async def test_a_timeout_around_an_inline_loop_stops_the_run(how: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        run = ex.run(forever)
        seen = 0
        if how == "move_on_after":
            with anyio.move_on_after(1.0):
                async for _ in run:
                    seen += 1
        else:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.0):
                    async for _ in run:
                        seen += 1
        assert seen > 0
        await _assert_stops_and_runs_again(ex, run)


# Logs: quiet by default, warnings on stderr ---------------------------------------------------

_LOGGING_PROGRAM = """
import asyncio, sys
import asyncexec

def crash_once():
    ctx = asyncexec.get_context()
    if ctx.attempt == 1:
        raise ValueError("boom")
    asyncexec.report({"ok": 1})

async def main():
    policy = asyncexec.RestartPolicy(restart_on_user_error=True, wait=lambda state: 0.0)
    async with asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, restart=policy) as ex:
        steps = [s.index async for s in ex.run(crash_once)]
    print("RESULT", steps)

asyncio.run(main())
"""


@pytest.mark.slow
def test_with_nothing_configured_logs_are_warnings_on_stderr_and_stdout_is_the_programs(
    tmp_path: Path,
) -> None:
    script = tmp_path / "quiet.py"
    script.write_text(_LOGGING_PROGRAM)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines() == ["RESULT [0]"]
    assert "worker_failed" in done.stderr and "restarting" in done.stderr  # warnings
    assert "group_started" not in done.stderr and "run_started" not in done.stderr  # info


# Smaller things ----------------------------------------------------------------------------


def _length(value: Any) -> Any:
    return len(value) if isinstance(value, bytes) else type(value).__name__


@pytest.mark.usefixtures("ray_local")
async def test_execute_resolves_object_ref_arguments_as_ray_does() -> None:
    ref = ray.put(b"x" * 1000)
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        assert await ex.execute(_length, ref) == [1000, 1000]
        assert await ex.execute_single(1, _length, value=ref) == 1000


def _raise_deep() -> None:
    def inner() -> None:
        raise KeyError("missing weights")

    inner()


@pytest.mark.usefixtures("mode")
async def test_errors_from_execute_are_clean_text_like_those_from_run() -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            await ex.execute(_raise_deep)
    text = str(info.value)
    assert "\x1b[" not in text  # no ANSI colour codes
    assert "in inner" in text and "KeyError: 'missing weights'" in text
    assert "asyncexec/_worker" not in text and "ray/_private" not in text  # no internal frames
    assert isinstance(info.value.__cause__, KeyError)


def _steps(n: int) -> None:
    for i in range(n):
        asyncexec.report({"i": i})


@pytest.mark.usefixtures("mode")
async def test_statistics_count_steps_delivered_while_the_run_is_live() -> None:
    """Also: the executor entered again counts the steps of the runs before (the last run's were
    dropped)."""
    ex = asyncexec.Executor(1, resources_per_worker=CPU)
    async with ex:
        run = ex.run(_steps, 10)
        taken = 0
        async for _ in run:
            taken += 1
            assert ex.statistics().steps_delivered == taken
        again = [s async for s in ex.run(_steps, 3)]
        assert ex.statistics().steps_delivered == taken + len(again) == 13
    async with ex:
        assert ex.statistics().steps_delivered == 13
        assert len([s async for s in ex.run(_steps, 2)]) == 2
        assert ex.statistics().steps_delivered == 15


async def test_statistics_never_go_back_when_the_next_run_starts() -> None:
    """Defect: ``run()`` made the new run the one whose steps ``statistics()`` adds, while the
    previous run's steps were counted only once the new run's task had started: right after
    ``run()``, ``steps_delivered`` fell back by the previous run's steps (and ``runs_started``
    lagged)."""
    async with asyncexec.Executor(1, local=True) as ex:
        assert len([s async for s in ex.run(_steps, 5)]) == 5
        before = ex.statistics()
        assert (before.steps_delivered, before.runs_started) == (5, 1)
        again = ex.run(_steps, 2)
        now = ex.statistics()  # no await since run(): its task has not started
        assert (now.steps_delivered, now.runs_started) == (5, 2)
        assert len([s async for s in again]) == 2
        assert ex.statistics().steps_delivered == 7


def _fails_first_attempt(n: int) -> None:
    for i in range(n):
        asyncexec.report({"i": i})
    if asyncexec.get_context().attempt == 1:
        raise ValueError("the first attempt fails")


@pytest.mark.timeout(30)
async def test_statistics_of_an_executor_entered_again_count_its_lives_before() -> None:
    """Defect: an executor entered again after it closed reported the group starts, restarts
    and resizes of its new life only (``group_starts`` back to 1, ``restarts`` to 0), while its
    runs and steps went on counting from its lives before."""
    policy = asyncexec.RestartPolicy(
        max_restarts=1, wait=tenacity.wait_none(), restart_on_user_error=True
    )
    ex = asyncexec.Executor(1, local=True, restart=policy)
    async with ex:
        assert len([s async for s in ex.run(_fails_first_attempt, 2)]) >= 2
        first = ex.statistics()
    assert (first.group_starts, first.restarts, first.runs_started) == (2, 1, 1)
    async with ex:
        assert len([s async for s in ex.run(_steps, 2)]) == 2
        again = ex.statistics()
    assert (again.group_starts, again.restarts, again.runs_started) == (3, 1, 2)


_REPORTED = threading.Event()
_RELEASED = threading.Event()


def _reports_then_returns(n: int) -> None:
    for i in range(n):
        asyncexec.report({"i": i})
    _REPORTED.set()


def _reports_then_holds(n: int) -> None:
    """As above, and the run does not finish before the test says so."""
    _reports_then_returns(n)
    _RELEASED.wait(30)


async def test_no_step_is_yielded_after_aclose() -> None:
    """Defect: ``await run.aclose()`` inside the loop stopped the run, but the loop went on
    yielding the rest of the batch of steps at hand (as many as the consumer lagged behind)."""
    _REPORTED.clear()
    async with asyncexec.Executor(1, local=True) as ex:
        run = ex.run(_reports_then_returns, 200, buffer_size=256)
        assert (await run.__anext__()).index == 0
        # Every step reported meanwhile: those the consumer takes next come in one batch.
        assert await anyio.to_thread.run_sync(_REPORTED.wait, 30)
        assert (await run.__anext__()).index == 1
        assert (await run.__anext__()).index == 2
        await run.aclose()  # (the run may have finished meanwhile: its steps were all handed)
        with pytest.raises(StopAsyncIteration):
            await run.__anext__()
        assert [s.index async for s in run] == []


async def test_a_loop_over_a_run_stopped_by_break_yields_nothing() -> None:
    """Defect: after ``break`` had stopped the run, a new ``async for`` over the same Run was
    yielded the rest of the batch of steps at hand, of the stopped run."""
    _REPORTED.clear()
    _RELEASED.clear()
    async with asyncexec.Executor(1, local=True) as ex:
        run = ex.run(_reports_then_holds, 200, buffer_size=256)
        async for step in run:
            if step.index == 0:  # every step reported meanwhile: the next come in one batch
                assert await anyio.to_thread.run_sync(_REPORTED.wait, 30)
            if step.index == 2:
                break  # the function has not returned: this stops the run
        _RELEASED.set()
        assert [s.index async for s in run] == []
        await run.aclose()
        assert run.state is asyncexec.RunState.CANCELLED


def _same_name_checkpoint(content: str) -> None:
    ctx = asyncexec.get_context()
    with tempfile.TemporaryDirectory() as folder:
        text = content if content == "same" else f"rank {ctx.world_rank}"
        Path(folder, "model.txt").write_text(text)
        asyncexec.report({"i": 0}, checkpoint=asyncexec.Checkpoint.from_directory(folder))


@pytest.mark.usefixtures("mode")
async def test_same_named_checkpoint_files_of_two_ranks_are_refused_unless_identical(
    tmp_path: Path,
) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, storage_path=tmp_path) as ex:
        steps = [s async for s in ex.run(_same_name_checkpoint, "same")]
        assert steps[0].checkpoint is not None
        saved = anyio.Path(steps[0].checkpoint.path, "model.txt")
        assert await saved.read_text() == "same"
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.run(_same_name_checkpoint, "different"):
                pass
        assert isinstance(info.value.__cause__, FileExistsError)
        assert re.search(r"already written by another rank", str(info.value))


# What `import asyncexec` imports: the driver side in a driver, the light side in a worker ----

#: What a Ray worker must never import: the driver's libraries and asyncexec's driver side.
_DRIVER_SIDE = ("anyio", "structlog", "tenacity", "asyncexec._driver")


def _driver_side(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if m.startswith(_DRIVER_SIDE))


def _fresh(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it prints its findings as its last line, in JSON."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
        check=True,
    )
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_a_driver_imports_the_driver_side_with_asyncexec_itself() -> None:
    """In a driver, ``import asyncexec`` imports the driver side, so that neither the first
    touch of a public name nor a first executor's whole life (in a service: on the event loop,
    at the first request) imports anything. Local mode: the same driver code, without Ray."""
    found = _fresh(
        """
        import asyncio, json, sys
        import asyncexec

        def fn():
            asyncexec.report({"i": 0})

        async def first_request():
            async with asyncexec.Executor(2, local=True) as ex:
                return [s.index async for s in ex.run(fn)]

        loaded = set(sys.modules)
        for name in asyncexec.__all__:
            getattr(asyncexec, name)
        touched = set(sys.modules) - loaded
        steps = asyncio.run(first_request())
        used = set(sys.modules) - loaded - touched
        print(json.dumps({
            "loaded": sorted(loaded), "touched": sorted(touched), "used": sorted(used),
            "steps": steps,
        }))
        """
    )
    assert "asyncexec._driver._executor" in found["loaded"]
    assert found["touched"] == []
    assert found["steps"] == [0]
    assert found["used"] == []


def test_in_ray_worker_mode_asyncexec_imports_only_the_light_side() -> None:
    """In a process in Ray's worker mode (which Ray sets before a worker runs any application
    code), ``import asyncexec`` and the worker-side API import nothing of the driver side."""
    found = _fresh(
        """
        import json, sys
        import ray._private.worker as ray_worker
        ray_worker.global_worker.mode = ray_worker.WORKER_MODE
        import asyncexec
        from asyncexec._worker import _actor
        asyncexec.report, asyncexec.get_context, asyncexec.Checkpoint, asyncexec.WorkerError
        print(json.dumps({"modules": sorted(sys.modules)}))
        """
    )
    assert "asyncexec._worker._actor" in found["modules"]
    assert _driver_side(found["modules"]) == []


@ray.remote(num_cpus=0)
def _driver_modules_here() -> list[str]:
    # A real Ray worker imported this test module, and with it asyncexec, to run this task.
    return sorted(m for m in sys.modules if m.startswith("asyncexec._driver"))


@pytest.mark.usefixtures("ray_local")
async def test_a_real_ray_worker_that_imports_asyncexec_imports_no_driver_module() -> None:
    # A runtime environment of its own: a fresh worker process, none that ran other tests' tasks.
    fresh = _driver_modules_here.options(runtime_env={"env_vars": {"FIRST_USE_TEST": "1"}})
    assert await fresh.remote() == []
