"""The ``asyncexec`` command line: run a function on a group of workers with a live view.

    asyncexec run MODULE:FUNCTION --workers N [--cpus-per-worker X] [--gpus-per-worker G]
                  [--config JSON] [--max-restarts N] [--json] [--storage-path P] [--address A]
    asyncexec demo [--workers N] [--steps N] [--crash-step N | --no-crash] [--json]
    asyncexec stack [--address A] [--timeout S]

``run`` imports ``FUNCTION`` from ``MODULE`` (importable from the current directory), runs it on
the workers and shows a live terminal view (with the ``cli`` extra, which installs rich): each
rank's latest metrics, steps per second, the attempt and restarts, and a progress bar when the
length of the run is known. ``--json`` prints one JSON object per step instead (``index``,
``attempt``, ``metrics``: rank 0's, ``reports``: every rank's, ``checkpoint``). ``demo`` runs a
built-in job that checkpoints, loses a worker to SIGKILL and recovers from its checkpoint.
``stack`` prints the stacks of a running cluster's asyncexec workers (see ``_stack``).

Exit status: 0 when the run finished, 1 when it failed (the error is printed), 2 for bad usage
(an unknown function, bad JSON, a bad option), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio

from .._driver._config import CheckpointConfig, validate_resources
from .._driver.cluster import init_ray, quiet_planned_crash, ray_is_initialized, shutdown_ray
from .._driver.run import RunResult
from .._errors import AsyncExecError, ConfigurationError, describe
from ._heap import frozen_heap
from ._logconfig import configure_logging
from ._views import Tracker, View, make_view

__all__ = ["build_parser", "main"]

#: Redraws of the live view per second.
_REFRESH_HZ = 8


class UsageError(Exception):
    """The command line asked for something that cannot be done (exit status 2)."""


# Parsing --------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``asyncexec`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="asyncexec",
        description="Run a function on a group of Ray actor workers and watch its steps.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _run_command(commands)
    _demo_command(commands)
    _stack_command(commands)
    return parser


def _run_command(commands: Any) -> None:
    """The ``run`` command."""
    run = commands.add_parser(
        "run",
        help="run MODULE:FUNCTION on a group of workers",
        description=(
            "Import FUNCTION from MODULE (importable from the current directory) and run it on "
            "every worker. The progress bar appears when the run's length is known: a "
            "'total_steps' key in --config, else a 'total_steps' attribute of the function; it "
            "counts the 'step' metric of rank 0 when the function reports one, else the steps "
            "delivered."
        ),
    )
    run.add_argument("target", metavar="MODULE:FUNCTION", help="the function to run")
    run.add_argument("--workers", "-n", type=_positive_int, required=True, help="number of workers")
    run.add_argument(
        "--cpus-per-worker",
        type=_non_negative_float,
        default=1.0,
        help="CPUs of each worker (default 1)",
    )
    run.add_argument(
        "--gpus-per-worker",
        type=_non_negative_float,
        default=0.0,
        help="GPUs of each worker (default 0)",
    )
    run.add_argument(
        "--config",
        default=None,
        help="the function's argument, as JSON, or @FILE to read the JSON from a file",
    )
    run.add_argument(
        "--local",
        action="store_true",
        help="run the ranks in threads of this process, without Ray (local mode; also "
        "ASYNCEXEC_LOCAL=1)",
    )
    _common_options(run, max_restarts=3)


def _demo_command(commands: Any) -> None:
    """The ``demo`` command."""
    demo = commands.add_parser(
        "demo",
        help="a built-in job that checkpoints, crashes once and recovers",
        description=(
            "Run a toy training job on a few workers: every rank checkpoints every few steps; "
            "on the first attempt one worker kills itself with SIGKILL; the group restarts and "
            "resumes from the latest checkpoint as attempt 2."
        ),
    )
    demo.add_argument(
        "--workers", "-n", type=_positive_int, default=4, help="number of workers (default 4)"
    )
    demo.add_argument(
        "--cpus-per-worker",
        type=_non_negative_float,
        default=0.25,
        help="CPUs of each worker (default 0.25)",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=12, help="steps of the job (default 12)"
    )
    demo.add_argument(
        "--crash-step",
        type=_non_negative_int,
        default=7,
        help="the step at which the last worker crashes (default 7)",
    )
    demo.add_argument("--no-crash", action="store_true", help="run without the injected crash")
    demo.add_argument(
        "--step-seconds",
        type=_non_negative_float,
        default=0.15,
        help="seconds each step takes (default 0.15)",
    )
    _common_options(demo, max_restarts=2)


def _stack_command(commands: Any) -> None:
    """The ``stack`` command."""
    stack = commands.add_parser(
        "stack",
        help="print the stacks of a running cluster's asyncexec workers",
        description=(
            "Join a running Ray cluster, find its live asyncexec workers and print every "
            "thread's stack of each, read from outside the process with py-spy on its node (a "
            "hung worker too); needs py-spy on the nodes (the diagnostics extra). A cluster "
            "with token authentication is joined as Ray's own CLI joins it: set "
            "RAY_AUTH_MODE=token, with the token in ~/.ray/auth_token, the file "
            "RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN."
        ),
    )
    stack.add_argument(
        "--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else 'auto')"
    )
    stack.add_argument(
        "--timeout",
        type=_non_negative_float,
        default=10.0,
        help="seconds to wait for the stacks (default 10)",
    )


def _common_options(parser: argparse.ArgumentParser, *, max_restarts: int) -> None:
    parser.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=max_restarts,
        help=f"group restarts allowed after failures (default {max_restarts})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per step instead of the view: index, attempt, metrics "
        "(rank 0's), reports (every rank's metrics), checkpoint",
    )
    parser.add_argument(
        "--storage-path",
        default=None,
        help="where checkpoints are persisted (run: ~/asyncexec_results; demo: a temporary "
        "folder, removed afterwards)",
    )
    parser.add_argument(
        "--address", default=None, help="Ray cluster to join ('auto'); default: a local Ray"
    )
    parser.add_argument(
        "--log-format", choices=("console", "json"), default="console", help="log line format"
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="least severe log events shown, on stderr (default warning)",
    )
    parser.add_argument("--timeline", metavar="PATH", help="write the run's timeline: .png or JSON")


def parse_config(text: str | None) -> Any:
    """The ``--config`` value: JSON, or ``@FILE`` holding JSON; None when absent.

    Raises:
        UsageError: the JSON does not parse or the file cannot be read.
    """
    if text is None:
        return None
    source = "--config"
    if text.startswith("@"):
        source = text[1:]
        try:
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise UsageError(f"cannot read the config file {source!r}: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source} is not valid JSON: {exc}") from exc


def load_target(spec: str, directory: str) -> Callable[..., Any]:
    """Import ``MODULE:FUNCTION`` (``FUNCTION`` may be dotted), with ``directory`` on the path.

    Raises:
        UsageError: the spec is malformed, the module cannot be imported, or the name is
            missing or not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:FUNCTION (for example train:main), got {spec!r}")
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import module {module_name!r} from {directory}: {exc}") from exc
    except Exception as exc:
        detail = "".join(traceback.format_exception_only(exc)).strip()
        raise UsageError(f"importing {module_name!r} failed: {detail}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"module {module_name!r} has no {attr!r}") from None
    if not callable(target):
        raise UsageError(f"{spec} is not callable: {target!r}")
    return target  # type: ignore[no-any-return]


def total_steps(fn: Callable[..., Any], config: Any) -> int | None:
    """The run's length for the progress bar: ``config["total_steps"]``, else
    ``fn.total_steps``, else None."""
    for value in (
        config.get("total_steps") if isinstance(config, Mapping) else None,
        getattr(fn, "total_steps", None),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def worker_import_path(directory: str, address: str | None) -> dict[str, Any] | None:
    """Make modules in ``directory`` importable by the workers.

    Workers unpickle the function by reference, so they must import its module. Putting the
    directory on ``PYTHONPATH`` before Ray starts is enough for a local Ray that this process
    starts (its workers inherit the environment). When Ray is already running, or a cluster is
    joined, the workers' environment is set through a runtime environment instead (it is
    returned; None when none is needed).
    """
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    known = {os.path.realpath(p) for p in parts}
    if os.path.realpath(directory) in known:
        return None
    os.environ["PYTHONPATH"] = os.pathsep.join([directory, *parts])
    if ray_is_initialized() or address is not None or os.environ.get("RAY_ADDRESS"):
        return {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
    return None


# What the views show ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    """What the command asks of the executor."""

    num_workers: int
    resources: Mapping[str, float]
    max_restarts: int
    storage_path: str | None
    address: str | None
    runtime_env: Mapping[str, Any] | None = None
    restart_wait_s: float | None = None
    local: bool = False  # the ranks in threads of this process, no Ray
    timeline: str | None = None  # where the run's timeline is written (PNG or trace JSON)


async def drive(
    fn: Callable[..., Any], config: Any, options: RunOptions, tracker: Tracker, view: View
) -> RunResult:
    """Run ``fn`` on a fresh executor, feeding the view; return the run's result.

    Raises:
        AsyncExecError: the run failed (after the restarts the policy allows).
    """
    import tenacity

    from .._driver._executor import Executor
    from .._driver._restart import RestartPolicy

    policy = RestartPolicy(max_restarts=options.max_restarts)
    if options.restart_wait_s is not None:
        policy = replace(policy, wait=tenacity.wait_fixed(options.restart_wait_s))
    async with Executor(
        options.num_workers,
        resources_per_worker=options.resources,
        restart=policy,
        storage_path=options.storage_path, checkpoint=CheckpointConfig(keep_runs=True),
        address=options.address,
        runtime_env=options.runtime_env,
        name="cli",
        local=options.local,
        timeline=options.timeline is not None,
    ) as executor, frozen_heap():
        run = executor.run(fn, config)
        tracker.run_id = run.run_id
        tracker.state = "running"
        error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_refresh_loop, run, tracker, view)
            try:
                async for step in run:
                    tracker.add(step)
                    view.on_step(step)
            except Exception as exc:  # re-raised below, outside the task group
                error = exc
            finally:
                tg.cancel_scope.cancel()
        tracker.state = run.state.value
        if executor.timeline is not None and options.timeline:  # also when the run failed
            executor.timeline.export(options.timeline, "asyncexec run")
        if error is not None:
            raise error
        return run.result


async def _refresh_loop(run: Any, tracker: Tracker, view: View) -> None:
    seen_attempt = 1
    while True:
        tracker.state = run.state.value
        tracker.attempt = max(tracker.attempt, run.attempt)
        if run.attempt != seen_attempt:
            seen_attempt = run.attempt
            ckpt = run.latest_checkpoint
            origin = f"from {ckpt.path}" if ckpt is not None else "from the start (no checkpoint)"
            view.note(f"attempt {run.attempt}: the group restarted; resuming {origin}")
        tracker.sample()
        view.refresh()
        await anyio.sleep(1 / _REFRESH_HZ)


def _summary(result: RunResult, tracker: Tracker) -> str:
    restarts = result.attempts - 1
    lines = [
        f"finished: {result.steps} steps in {result.attempts} attempt(s) "
        f"({restarts} restart{'s' if restarts != 1 else ''}), {tracker.elapsed:.1f} s",
    ]
    for i, failure in enumerate(result.failures, 1):
        lines.append(f"  failure {i}: {describe(failure)}")
    if result.checkpoint is not None:
        lines.append(f"  latest checkpoint: {result.checkpoint.path}")
    values = repr(result.return_values)
    lines.append(f"  returned: {values if len(values) <= 400 else values[:399] + '…'}")
    return "\n".join(lines)


def _demo_story(result: RunResult) -> str:
    """What happened in the demo, from its result."""
    if not result.failures:
        return "no crash was injected; nothing to recover from"
    failure = result.failures[0]
    rank = getattr(failure, "rank", "?")
    resumed = sorted({v["resumed_from"] for v in result.return_values if isinstance(v, dict)})
    return (
        f"recovered: rank {rank} was killed on attempt 1 ({type(failure).__name__}); attempt "
        f"{result.attempts} resumed every rank from the checkpoint of step "
        f"{resumed[0] - 1 if resumed and resumed[0] else '-'} and finished"
    )


def _what_to_run(
    args: argparse.Namespace, quiet: contextlib.ExitStack
) -> tuple[Callable[..., Any], Any, str, RunOptions]:
    """The function, its config, the view's title and the executor's options for ``run`` or
    ``demo`` (the demo filters Ray's notice of its own planned crash, and keeps its checkpoints
    in a temporary folder unless told where).

    Raises:
        UsageError: the target or the config cannot be read.
    """
    if args.command == "run":
        directory = os.getcwd()
        fn = load_target(args.target, directory)
        resources: dict[str, float] = {"CPU": args.cpus_per_worker}
        if args.gpus_per_worker:
            resources["GPU"] = args.gpus_per_worker
        from .._driver._executor import local_default

        local = local_default(True if args.local else None)
        options = RunOptions(
            num_workers=args.workers,
            resources=resources,
            max_restarts=args.max_restarts,
            storage_path=args.storage_path,
            address=args.address,
            runtime_env=None if local else worker_import_path(directory, args.address),
            local=local,
            timeline=args.timeline,
        )
        return fn, parse_config(args.config), args.target, options
    from ._demo import DEFAULT_CONFIG, demo_train

    config = {
        **DEFAULT_CONFIG,
        "total_steps": args.steps,
        "crash_step": None if args.no_crash else args.crash_step,
        "step_s": args.step_seconds,
    }
    quiet.enter_context(quiet_planned_crash())
    storage = args.storage_path or tempfile.mkdtemp(prefix="asyncexec-demo-")
    options = RunOptions(
        num_workers=args.workers,
        resources={"CPU": args.cpus_per_worker},
        max_restarts=args.max_restarts,
        storage_path=storage,
        address=args.address,
        restart_wait_s=0.5,
        timeline=args.timeline,
    )
    return demo_train, config, "asyncexec demo", options


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asyncexec`` command with ``argv`` (``sys.argv[1:]`` by default); return the
    exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error that argparse has printed
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "stack":
        from ._stack import stack_command

        return stack_command(args.address, args.timeout)
    configure_logging(args.log_format, args.log_level)
    cleanup: str | None = None
    started_ray = False
    quiet = contextlib.ExitStack()  # the demo's filter of Ray's output, until Ray is shut down
    try:
        fn, config, title, options = _what_to_run(args, quiet)
        if args.command == "demo" and args.storage_path is None:
            cleanup = options.storage_path  # the demo's own temporary folder
        validate_resources(options.resources)  # refused here, before Ray is started
        tracker = Tracker(title, options.num_workers, total_steps(fn, config))

        try:
            # The demo kills a worker process: it always runs on Ray, whatever ASYNCEXEC_LOCAL
            # says (its options say local=False).
            started_ray = False if options.local else init_ray(options.address)
        except Exception as exc:  # ray.init's errors are not one family: say what failed
            where = f"join the Ray cluster at {options.address}" if options.address else "start Ray"
            print(f"asyncexec: could not {where}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1

        view = make_view(tracker, as_json=args.json)

        async def command() -> RunResult:
            with view:
                return await drive(fn, config, options, tracker, view)

        if args.json:
            # stdout carries the steps and nothing else: whatever else is printed there (Ray's
            # error messages, the workers' forwarded prints) goes to stderr meanwhile.
            with contextlib.redirect_stdout(sys.stderr):
                result = anyio.run(command)
        else:
            result = anyio.run(command)
        summary = _summary(result, tracker)
        if args.command == "demo":
            summary += "\n" + _demo_story(result)
        print(summary, file=sys.stderr if args.json else sys.stdout)
        return 0
    except (UsageError, ConfigurationError) as exc:
        print(f"asyncexec: error: {exc}", file=sys.stderr)
        return 2
    except AsyncExecError as exc:
        print(f"asyncexec: the run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("asyncexec: interrupted; the workers were stopped", file=sys.stderr)
        return 130
    finally:
        if started_ray:
            shutdown_ray()
        quiet.close()
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
