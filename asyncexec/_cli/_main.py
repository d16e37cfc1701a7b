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

The command by concept: its arguments (``_parser``), what ``run`` and ``demo`` run
(``_target``), the run with its live view and what is printed at its end (``_drive``), the
workers' stacks (``_stack``); this module puts them together.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Sequence

import anyio

from .._driver._config import validate_resources
from .._driver.cluster import init_ray, shutdown_ray
from .._driver.run import RunResult
from .._errors import AsyncExecError, ConfigurationError
from ._drive import demo_story, drive
from ._drive import summary as run_summary
from ._logconfig import configure_logging
from ._parser import UsageError, build_parser
from ._target import total_steps, what_to_run
from ._views import Tracker, make_view

__all__ = ["build_parser", "main", "total_steps"]


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
        fn, config, title, options = what_to_run(args, quiet)
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
        summary = run_summary(result, tracker, removed=cleanup is not None)
        if args.command == "demo":
            crash_step = None if args.no_crash else args.crash_step
            summary += "\n" + demo_story(result, crash_step, args.steps)
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
