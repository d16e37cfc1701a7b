"""asyncexec: an asyncio-first executor for groups of Ray actor workers.

Start N workers, run one function on all of them, and read what they report as an async iterator
of per-step results; failures restart the whole group under a tenacity policy and resume from the
latest checkpoint.
"""

from ._checkpoint import Checkpoint
from ._config import CheckpointConfig
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
from ._reports import Report, RunResult, Step
from ._restart import RestartPolicy
from ._run import Run, RunState
from ._session import WorkerContext, get_checkpoint, get_context, get_dataset_shard, report

__version__ = "0.1.0"

__all__ = [
    "AsyncExecError",
    "BackendError",
    "Checkpoint",
    "CheckpointConfig",
    "ConfigurationError",
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
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("asyncexec."):
        _obj.__module__ = "asyncexec"
del _name, _obj
