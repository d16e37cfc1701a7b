"""The ``asyncexec`` command line: ``run`` with the live view, plain lines and ``--json``, the
demo's crash and recovery, usage errors and exit statuses, and ``configure_logging``.

The commands run in-process with ``main(argv)`` on the shared local Ray; one test runs the real
``python -m asyncexec`` in a subprocess, which starts a Ray of its own, as on a fresh machine.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

import asyncexec
from asyncexec import Report, Step, configure_logging
from asyncexec.__main__ import main
from asyncexec._cli._main import total_steps
from asyncexec._cli._views import JsonView
from asyncexec._driver.cluster import quiet_planned_crash


def counting(config: dict[str, Any]) -> int:
    rank = asyncexec.get_context().world_rank
    for i in range(config["steps"]):
        asyncexec.report({"step": i, "rank": rank, "value": i * 10 + rank})
    return rank


def five_steps() -> str:
    for i in range(5):
        asyncexec.report({"step": i, "loss": 1.0 / (i + 1)})
    return "done"


five_steps.total_steps = 5  # type: ignore[attr-defined]


def failing(config: dict[str, Any]) -> None:
    asyncexec.report({"x": 1})
    raise ValueError(f"bad input {config['n']}")


def removes_the_folder(config: dict[str, Any]) -> None:
    asyncexec.report({"step": 0})
    shutil.rmtree(config["folder"])
    raise ValueError("the run's own error")


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """main() configures logging for the process; leave it as other tests expect it."""
    yield
    structlog.reset_defaults()
    stdlib = logging.getLogger("asyncexec")
    for handler in list(stdlib.handlers):
        stdlib.removeHandler(handler)
    stdlib.setLevel(logging.NOTSET)
    stdlib.propagate = True


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# run ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
def test_run_json_prints_one_object_per_step(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(
        [
            "run",
            "test_cli:counting",
            "--workers",
            "2",
            "--cpus-per-worker",
            "0.5",
            "--config",
            '{"steps": 7}',
            "--json",
            "--storage-path",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = _json_lines(out)  # stdout holds the steps and nothing else
    assert [line["index"] for line in lines] == list(range(7))
    for line in lines:
        assert set(line) == {"index", "attempt", "metrics", "reports", "checkpoint"}
        assert line["attempt"] == 1
        assert line["checkpoint"] is None
        assert line["metrics"] == line["reports"][0]  # rank 0's, as Step.metrics
        assert [m["rank"] for m in line["reports"]] == [0, 1]
        assert [m["value"] for m in line["reports"]] == [line["index"] * 10, line["index"] * 10 + 1]
    assert "finished: 7 steps in 1 attempt(s)" in err
    assert "returned: [0, 1]" in err


def test_json_view_names_its_keys_as_step_does() -> None:
    """``metrics`` is rank 0's mapping (``Step.metrics``); ``reports`` has every rank's
    (``Step.reports``)."""
    out = io.StringIO()
    step = Step(3, 2, [Report(0, {"loss": 0.5}), Report(1, {"loss": 0.7, "extra": 1})])
    JsonView(out).on_step(step)
    assert json.loads(out.getvalue()) == {
        "index": 3,
        "attempt": 2,
        "metrics": {"loss": 0.5},
        "reports": [{"loss": 0.5}, {"loss": 0.7, "extra": 1}],
        "checkpoint": None,
    }
    assert out.getvalue().count("\n") == 1


@pytest.mark.usefixtures("ray_local")
def test_run_live_view_shows_metrics_attempt_and_progress(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The rich view's final frame: the target, attempt, each rank's row, the progress bar from
    the function's total_steps attribute."""
    rc = main(
        [
            "run",
            "test_cli:five_steps",
            "--workers",
            "2",
            "--cpus-per-worker",
            "0.5",
            "--storage-path",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "test_cli:five_steps" in out
    assert "attempt 1 (0 restarts)" in out
    assert "finished" in out
    assert "5/5" in out  # the progress bar's count
    header = next(line for line in out.splitlines() if "rank" in line and "loss" in line)
    assert header.split() == ["rank", "step", "loss"]
    rows = [line.split() for line in out.splitlines()]
    last = [r for r in rows if r[:2] in (["0", "4"], ["1", "4"])]
    assert last == [["0", "4", "0.2"], ["1", "4", "0.2"]]
    assert "finished: 5 steps in 1 attempt(s)" in out


@pytest.mark.usefixtures("ray_local")
def test_run_without_rich_falls_back_to_plain_lines(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in (
        "rich",
        "rich.box",
        "rich.console",
        "rich.live",
        "rich.progress_bar",
        "rich.table",
        "rich.text",
    ):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import rich...` fail
    rc = main(
        [
            "run",
            "test_cli:counting",
            "--workers",
            "2",
            "--cpus-per-worker",
            "0.5",
            "--config",
            '{"steps": 3, "total_steps": 3}',
            "--storage-path",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "pip install 'asyncexec[cli]'" in out
    assert "step 2 (3/3) attempt 1" in out  # the last line is always printed
    assert "finished: 3 steps" in out


@pytest.mark.usefixtures("ray_local")
def test_failing_function_exits_1_with_the_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(
        [
            "run",
            "test_cli:failing",
            "--workers",
            "1",
            "--cpus-per-worker",
            "0.5",
            "--config",
            '{"n": 42}',
            "--json",
            "--storage-path",
            str(tmp_path),
        ]
    )
    _, err = capsys.readouterr()
    assert rc == 1
    assert "the run failed: WorkerRaisedError" in err
    assert "ValueError: bad input 42" in err


@pytest.mark.usefixtures("ray_local")
def test_run_imports_a_module_from_the_working_directory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With Ray already running, the workers still import MODULE from the current directory
    (through a runtime environment)."""
    (tmp_path / "cwd_job.py").write_text(
        textwrap.dedent(
            """
            import asyncexec

            def train(config):
                for i in range(config["steps"]):
                    asyncexec.report({"step": i, "where": __name__})
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.delitem(sys.modules, "cwd_job", raising=False)
    try:
        rc = main(
            [
                "run",
                "cwd_job:train",
                "--workers",
                "2",
                "--cpus-per-worker",
                "0.5",
                "--config",
                '{"steps": 3}',
                "--json",
                "--storage-path",
                str(tmp_path / "s"),
            ]
        )
    finally:
        sys.modules.pop("cwd_job", None)
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = _json_lines(out)
    assert [line["index"] for line in lines] == [0, 1, 2]
    assert lines[0]["reports"][1]["where"] == "cwd_job"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "no_colon", "--workers", "1"], "expected MODULE:FUNCTION"),
        (["run", "no_such_module_xyz:fn", "--workers", "1"], "cannot import module"),
        (["run", "test_cli:missing", "--workers", "1"], "has no 'missing'"),
        (["run", "test_cli:counting", "--workers", "1", "--config", "{bad"], "not valid JSON"),
        (["run", "test_cli:counting", "-n", "1", "--config", "@/no/such.json"], "cannot read"),
        (["run", "test_cli:counting", "-n", "1", "--cpus-per-worker", "0"], "positive amount"),
        (["run", "test_cli:counting", "--workers", "0"], "must be at least 1"),
        (["demo", "--steps", "-3"], "must be at least 1"),
        # Defect: a value that was no number was "invalid _positive_int value: 'four'".
        (["run", "test_cli:counting", "--workers", "four"], "must be a whole number, got 'four'"),
        (["demo", "--step-seconds", "fast"], "--step-seconds: must be a number, got 'fast'"),
        (["launch"], "invalid choice"),
        # Defect: --address was ignored without a word beside --local.
        (
            ["run", "test_cli:counting", "-n", "1", "--local", "--address", "auto"],
            "one or the other",
        ),
    ],
)
def test_usage_errors_exit_2_before_ray_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_a_timeline_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: ``--timeline`` naming a file in a folder that does not exist ran the whole run,
    then failed with a FileNotFoundError traceback (exit 1; with a failed run, in place of the
    run's own error). Now it is refused at once, naming the folder (exit 2), and the demo makes
    no temporary folder before refusing."""
    missing = tmp_path / "no_such_folder" / "run.json"
    argv = ["run", "test_cli:counting", "-n", "1", "--local", "--config", '{"steps": 2}']
    assert main([*argv, "--timeline", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert f"the folder {missing.parent} does not exist" in err
    assert out == ""  # nothing ran
    assert main([*argv, "--timeline", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(["demo", "--timeline", str(missing.with_suffix(".png"))]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no asyncexec-demo-* folder left


@pytest.mark.timeout(30)
def test_a_timeline_that_cannot_be_written_after_the_run_leaves_the_runs_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect: when the timeline could not be written after a run that failed, the command
    ended with the OSError's traceback in place of the run's error. Now it says that the
    timeline was not written, and the run's error and exit status stand."""
    folder = tmp_path / "gone"
    folder.mkdir()
    config = json.dumps({"folder": str(folder)})
    argv = ["run", "test_cli:removes_the_folder", "-n", "1", "--local", "--config", config]
    assert main([*argv, "--timeline", str(folder / "run.json")]) == 1
    err = capsys.readouterr().err
    assert f"could not write the timeline to {folder / 'run.json'}" in err
    assert "the run failed: WorkerRaisedError" in err and "the run's own error" in err
    assert "timeline written" not in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    assert "total_steps" in capsys.readouterr().out


def test_total_steps_prefers_the_config_key_to_the_function_attribute() -> None:
    assert total_steps(five_steps, None) == 5
    assert total_steps(five_steps, {"total_steps": 9}) == 9
    assert total_steps(counting, {"steps": 9}) is None
    assert total_steps(counting, {"total_steps": True}) is None


# demo -----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
def test_demo_crashes_once_and_recovers_from_its_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(["demo", "--json", "--storage-path", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = _json_lines(out)
    first = [line for line in lines if line["attempt"] == 1]
    second = [line for line in lines if line["attempt"] == 2]
    assert first
    assert second
    assert len(first) + len(second) == len(lines)
    assert [line["index"] for line in lines] == list(range(len(lines)))
    # Attempt 1 got at least to the step-5 checkpoint and never past the crash at step 7.
    steps_1 = [line["metrics"]["step"] for line in first]
    assert steps_1 == list(range(len(first)))
    assert 6 <= len(first) <= 7
    # Attempt 2 resumed every rank after the latest checkpoint (step 5) and ran to the end.
    assert [line["metrics"]["step"] for line in second] == list(range(6, 12))
    assert all(m["resumed_from"] == 6 for line in second for m in line["reports"])
    assert all(len(line["reports"]) == 4 for line in lines)
    checkpoints = [line["checkpoint"] for line in lines if line["checkpoint"]]
    assert checkpoints
    assert all(Path(c).is_relative_to(tmp_path) for c in checkpoints)
    every_rank = {f"rank_{r}.json" for r in range(4)}
    assert all(every_rank <= set(os.listdir(c)) for c in checkpoints)
    assert "worker_failed" in err
    assert "WorkerCrashedError" in err
    assert f"finished: {len(lines)} steps in 2 attempt(s) (1 restart)" in err
    assert "recovered: rank 3 was killed on attempt 1" in err
    # Ray's "(raylet) A worker died or was killed ..." paragraph about the planned SIGKILL is not
    # the demo's output (the story is told by worker_failed and the summary).
    assert "A worker died or was killed" not in out + err
    assert "(raylet)" not in out + err


def test_quiet_planned_crash_drops_only_the_dead_worker_notice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The demo's filter on the driver's printing of Ray's error messages: the raylet's notice of
    a dead worker goes, every other line stays, and it is undone afterwards (``asyncexec run``
    keeps the notice)."""
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    # A mark of this test's own: Ray's listener may print real notices of workers that earlier
    # tests killed into the captured output at any time.
    died = (
        "A worker died or was killed while executing a task by an unexpected system error. "
        "To troubleshoot the problem, check the logs for the dead worker. (test-mark-7f3a)"
    )

    def raylet(line: str) -> dict[str, Any]:
        return {"lines": [line], "pid": "raylet", "is_err": False}

    with quiet_planned_crash():
        ray_worker.print_to_stdstream(raylet(died), ignore_prefix=False)
        ray_worker.print_to_stdstream(raylet("Task was cancelled"), ignore_prefix=False)
        ray_worker.print_to_stdstream(
            {"lines": [f"worker says: {died}"], "pid": 4242, "ip": "x", "is_err": True},
            ignore_prefix=True,
        )
    out, err = capsys.readouterr()
    assert "test-mark-7f3a" not in out
    assert "Task was cancelled" in out
    assert f"worker says: {died}" in err  # a worker's own output is not Ray's notice
    assert ray_worker.print_to_stdstream is original
    ray_worker.print_to_stdstream(raylet(died), ignore_prefix=False)
    assert "test-mark-7f3a" in capsys.readouterr().out


# The real command, in a process of its own --------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_console_command_runs_a_module_from_the_working_directory(tmp_path: Path) -> None:
    """``python -m asyncexec run`` from a fresh process: it starts its own Ray, the workers import
    the module from the working directory, and the exit status is 0."""
    (tmp_path / "fresh_job.py").write_text(
        textwrap.dedent(
            """
            import asyncexec

            def train(config):
                for i in range(config["steps"]):
                    asyncexec.report({"step": i})
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncexec",
            "run",
            "fresh_job:train",
            "--workers",
            "2",
            "--cpus-per-worker",
            "0.5",
            "--config",
            '{"steps": 4}',
            "--json",
            "--storage-path",
            str(tmp_path / "storage"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert [line["index"] for line in _json_lines(proc.stdout)] == [0, 1, 2, 3]


# configure_logging -----------------------------------------------------------------------------


def test_configure_logging_json_carries_the_bound_context() -> None:
    from asyncexec._logging import get_logger

    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    log = get_logger(executor="ex-1").bind(run_id="run-1")
    log.info("run_started", attempt=2)
    log.debug("not_shown")
    logging.getLogger("asyncexec.test").warning("from %s", "stdlib")
    first, second = _json_lines(out.getvalue())
    assert first["event"] == "run_started"
    assert (first["run_id"], first["attempt"], first["executor"]) == ("run-1", 2, "ex-1")
    assert (first["level"], first["logger"]) == ("info", "asyncexec")
    assert first["timestamp"].endswith("Z")
    assert second == {**second, "event": "from stdlib", "level": "warning"}


def test_configure_logging_console_filters_by_level() -> None:
    from asyncexec._logging import get_logger

    out = io.StringIO()
    configure_logging("console", "warning", stream=out, colors=False)
    log = get_logger().bind(run_id="run-2")
    log.info("quiet")
    log.warning("worker_failed", rank=3, attempt=1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    for text in ("worker_failed", "rank=3", "run_id=run-2"):
        assert text in lines[0]


def test_configure_logging_renders_other_structlog_users_and_replaces_itself(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An application's own structlog logger renders like asyncexec's events (as the service
    example's does); a second call replaces the first (one handler, the new stream, the new
    level); without a stream, lines go to whatever sys.stderr is at each write."""
    from asyncexec._logging import get_logger

    first, second = io.StringIO(), io.StringIO()
    configure_logging("console", "debug", stream=first, colors=False)
    configure_logging("json", "info", stream=second)
    structlog.get_logger("service").info("run_requested", id="r1")
    structlog.get_logger("service").debug("not_shown")
    logging.getLogger("asyncexec").info("stdlib %s", "record")
    logging.getLogger("unrelated").warning("not ours")  # other stdlib loggers are left alone
    assert first.getvalue() == ""
    app, lib = _json_lines(second.getvalue())
    assert app == {**app, "event": "run_requested", "id": "r1", "logger": "service"}
    assert lib == {**lib, "event": "stdlib record", "logger": "asyncexec", "level": "info"}
    assert len(logging.getLogger("asyncexec").handlers) == 1

    configure_logging("console", "warning", colors=False)
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)  # as rich's live view does while it runs
    get_logger(run_id="r2").warning("worker_failed", rank=1)
    assert "worker_failed" in later.getvalue()
    assert "run_id=r2" in later.getvalue()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(("fmt", "level"), [("xml", "info"), ("json", "loud"), ("json", True)])
def test_configure_logging_refuses_bad_arguments(fmt: Any, level: Any) -> None:
    with pytest.raises(asyncexec.ConfigurationError):
        configure_logging(fmt, level)


def test_the_summary_names_failures_with_empty_or_broken_messages() -> None:
    from asyncexec._cli._drive import summary as _summary
    from asyncexec._cli._views import Tracker

    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    result = asyncexec.RunResult("run-x", [1], None, 3, 3, [ValueError(), Broken()])
    text = _summary(result, Tracker("t", 1))
    assert "failure 1: ValueError\n" in text
    assert "failure 2: Broken: <the message could not be read" in text


def test_the_demos_story_says_when_the_crash_came_before_any_checkpoint() -> None:
    """Defect: ``asyncexec demo --crash-step 1`` (a crash before the first checkpoint) said
    "attempt 2 resumed every rank from the checkpoint of step - and finished": there was no
    checkpoint; the ranks started again from step 0."""
    from asyncexec._cli._drive import demo_story

    crash = asyncexec.WorkerCrashedError(1, attempt=1)
    returned = [{"resumed_from": 0}, {"resumed_from": 0}]
    story = demo_story(asyncexec.RunResult("run-x", returned, None, 14, 2, [crash]))
    assert "checkpoint of step -" not in story
    assert "attempt 2 started every rank again from step 0 (no checkpoint" in story
    returned = [{"resumed_from": 6}, {"resumed_from": 6}]
    story = demo_story(asyncexec.RunResult("run-x", returned, None, 14, 2, [crash]))
    assert "attempt 2 resumed every rank from the checkpoint of step 5 and finished" in story


def test_the_demos_story_says_why_no_crash_came_when_the_crash_step_is_past_the_last() -> None:
    """Defect: ``asyncexec demo --steps 5`` (the crash at step 7 never reached) said "no crash
    was injected" without saying why."""
    from asyncexec._cli._drive import demo_story

    result = asyncexec.RunResult("run-x", [{"resumed_from": 0}], None, 5, 1, [])
    story = demo_story(result, crash_step=7, steps=5)
    assert "the crash comes at step 7 (--crash-step), after the last of --steps 5" in story
    assert demo_story(result, crash_step=None, steps=5).startswith("no crash was injected")


def test_a_run_shorter_than_a_redraw_shows_a_rate() -> None:
    """Defect: a run that ended before the view had sampled its progress twice (an eighth of a
    second) showed "50 steps · 0.0 steps/s" in its last frame. Now the rate is taken over the
    whole run until there are two samples."""
    from asyncexec._cli._views import Tracker

    tracker = Tracker("t", 2)
    assert tracker.rate == 0.0  # no step yet
    for i in range(50):
        tracker.add(Step(i, 1, [Report(0, {"step": i}), Report(1, {"step": i})]))
    tracker.sample()
    assert tracker.rate > 0.0


def test_the_demos_summary_says_its_checkpoint_is_removed(tmp_path: Path) -> None:
    """Defect: ``asyncexec demo`` ended with "latest checkpoint: /tmp/asyncexec-demo-.../..."
    and then removed that folder with the demo's temporary storage: the path it gave was gone.
    Now the line says so (and how to keep it); a run's own storage path is given as it is."""
    from asyncexec._cli._drive import summary as _summary
    from asyncexec._cli._views import Tracker

    result = asyncexec.RunResult("r", [1], asyncexec.Checkpoint(str(tmp_path)), 3, 1)
    demo = _summary(result, Tracker("t", 1), removed=True)
    assert f"latest checkpoint: {tmp_path} (removed with the demo's temporary folder" in demo
    assert _summary(result, Tracker("t", 1)).endswith(
        f"latest checkpoint: {tmp_path}\n  returned: [1]"
    )
