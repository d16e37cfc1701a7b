"""What ``asyncexec run`` and ``asyncexec demo`` run: the function (``MODULE:FUNCTION``
imported from the current directory, or the demo's), its config, how many steps it will take
when it says, where its workers import it from, and the options of the executor it runs on.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._driver.cluster import quiet_planned_crash, ray_is_initialized
from ._parser import UsageError

__all__ = [
    "RunOptions",
    "check_timeline",
    "load_target",
    "parse_config",
    "total_steps",
    "what_to_run",
    "worker_import_path",
]


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


def check_timeline(path: str | None) -> str | None:
    """The ``--timeline`` value, refused before anything starts when it cannot be written
    after the run: a folder, a file in a folder that does not exist or cannot be written, or a
    ``.png`` without matplotlib (the ``timeline`` extra).

    Raises:
        UsageError: the timeline could not be written there.
    """
    if path is None:
        return None
    where = os.path.abspath(path)
    folder = os.path.dirname(where)
    if os.path.isdir(where):
        raise UsageError(f"--timeline {path!r} is a folder: name a .json or .png file")
    if not os.path.isdir(folder):
        raise UsageError(f"--timeline {path!r}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"--timeline {path!r}: the folder {folder} is not writable")
    if where.lower().endswith(".png") and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            f"--timeline {path!r}: drawing a timeline needs matplotlib: "
            "pip install 'asyncexec[timeline]' (or write a .json)"
        )
    return path


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


def what_to_run(
    args: argparse.Namespace, quiet: contextlib.ExitStack
) -> tuple[Callable[..., Any], Any, str, RunOptions]:
    """The function, its config, the view's title and the executor's options for ``run`` or
    ``demo`` (the demo filters Ray's notice of its own planned crash, and keeps its checkpoints
    in a temporary folder unless told where).

    Raises:
        UsageError: the target or the config cannot be read, or the timeline cannot be
            written where ``--timeline`` says.
    """
    timeline = check_timeline(args.timeline)  # before the demo makes its temporary folder
    if args.command == "run":
        directory = os.getcwd()
        fn = load_target(args.target, directory)
        resources: dict[str, float] = {"CPU": args.cpus_per_worker}
        if args.gpus_per_worker:
            resources["GPU"] = args.gpus_per_worker
        from .._driver._executor import local_default

        local = local_default(True if args.local else None)
        if local and args.address:  # one says no Ray, the other which Ray: not both
            why = "--local" if args.local else "ASYNCEXEC_LOCAL=1"
            raise UsageError(
                f"{why} runs the ranks in threads of this process, without Ray, and --address "
                f"{args.address} joins a Ray cluster: give one or the other"
            )
        options = RunOptions(
            num_workers=args.workers,
            resources=resources,
            max_restarts=args.max_restarts,
            storage_path=args.storage_path,
            address=args.address,
            runtime_env=None if local else worker_import_path(directory, args.address),
            local=local,
            timeline=timeline,
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
        timeline=timeline,
    )
    return demo_train, config, "asyncexec demo", options
