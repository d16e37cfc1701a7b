"""The ``asyncexec`` command's arguments: the parser of its three commands (``run``, ``demo``,
``stack``) and their options, and the error of bad usage (exit status 2)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["UsageError", "build_parser"]


class UsageError(Exception):
    """The command line asked for something that cannot be done (exit status 2)."""


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
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
