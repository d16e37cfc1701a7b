"""asyncexec: an asyncio-first executor for groups of Ray actor workers.

Start N workers, run one function on all of them, and read what they report as an async iterator
of per-step results; failures restart the whole group under a tenacity policy and resume from the
latest checkpoint.

The names below are loaded on first use (PEP 562): a worker process imports only the light
worker-side modules (``report``, ``get_context``, ``Checkpoint``), never the driver's (anyio task
groups, tenacity, structlog), so it costs about what a plain Ray actor costs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the private module that defines it.
_EXPORTS: dict[str, str] = {
    "AsyncExecError": "_errors",
    "BackendError": "_errors",
    "Checkpoint": "_checkpoint",
    "CheckpointConfig": "_config",
    "ConfigurationError": "_errors",
    "DataConfig": "_data",
    "Executor": "_executor",
    "ExecutorState": "_executor",
    "ExecutorStateError": "_errors",
    "ExecutorStatistics": "_executor",
    "NodeLostError": "_errors",
    "PlacementTimeoutError": "_errors",
    "Report": "_reports",
    "ReportMismatchError": "_errors",
    "RestartPolicy": "_restart",
    "RestartsExhaustedError": "_errors",
    "Run": "_run",
    "RunResult": "_reports",
    "RunState": "_run",
    "StartupError": "_errors",
    "StartupTimeoutError": "_errors",
    "Step": "_reports",
    "WorkerContext": "_session",
    "WorkerCrashedError": "_errors",
    "WorkerError": "_errors",
    "WorkerHungError": "_errors",
    "WorkerRaisedError": "_errors",
    "configure_logging": "_logconfig",
    "get_checkpoint": "_session",
    "get_context": "_session",
    "get_dataset_shard": "_session",
    "report": "_session",
}

__all__ = [
    "AsyncExecError",
    "BackendError",
    "Checkpoint",
    "CheckpointConfig",
    "ConfigurationError",
    "DataConfig",
    "Executor",
    "ExecutorState",
    "ExecutorStateError",
    "ExecutorStatistics",
    "NodeLostError",
    "PlacementTimeoutError",
    "Report",
    "ReportMismatchError",
    "RestartPolicy",
    "RestartsExhaustedError",
    "Run",
    "RunResult",
    "RunState",
    "StartupError",
    "StartupTimeoutError",
    "Step",
    "WorkerContext",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerHungError",
    "WorkerRaisedError",
    "configure_logging",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
]


def _load(module_name: str) -> None:
    """Import a private module and publish its exports here, under public paths (so tracebacks
    and pickles say ``asyncexec.WorkerCrashedError``)."""
    module = importlib.import_module(f".{module_name}", __name__)
    for name, home in _EXPORTS.items():
        if home == module_name:
            obj = getattr(module, name)
            if getattr(obj, "__module__", "").startswith("asyncexec."):
                obj.__module__ = __name__
            globals()[name] = obj


def __getattr__(name: str) -> Any:
    home = _EXPORTS.get(name)
    if home is None:
        raise AttributeError(f"module 'asyncexec' has no attribute {name!r}")
    _load(home)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


if TYPE_CHECKING:
    from ._checkpoint import Checkpoint
    from ._config import CheckpointConfig
    from ._data import DataConfig
    from ._errors import (
        AsyncExecError,
        BackendError,
        ConfigurationError,
        ExecutorStateError,
        NodeLostError,
        PlacementTimeoutError,
        ReportMismatchError,
        RestartsExhaustedError,
        StartupError,
        StartupTimeoutError,
        WorkerCrashedError,
        WorkerError,
        WorkerHungError,
        WorkerRaisedError,
    )
    from ._executor import Executor, ExecutorState, ExecutorStatistics
    from ._logconfig import configure_logging
    from ._reports import Report, RunResult, Step
    from ._restart import RestartPolicy
    from ._run import Run, RunState
    from ._session import WorkerContext, get_checkpoint, get_context, get_dataset_shard, report
else:
    # The error tree and the worker-side API are light and always needed: load them now.
    _load("_errors")
    _load("_checkpoint")
    _load("_session")
