"""asyncexec: an asyncio-first executor for groups of Ray actor workers.

Start N workers, run one function on all of them, and read what they report as an async iterator
of per-step results; failures restart the whole group under a tenacity policy and resume from the
latest checkpoint.

Which side a process imports is decided when it imports asyncexec. A Ray worker process imports
only the light worker side (``asyncexec._worker``, ``_protocol``, ``_errors``, ``_checkpoint``),
never the driver's modules (anyio task groups, tenacity, structlog), so it costs about what a plain
Ray actor costs; the driver-side names stay loadable there on first use (PEP 562). Any other
process is a driver and imports the driver side with asyncexec itself: otherwise the first touch
of ``asyncexec.Executor`` would import it, on whatever thread touched it; in a service, on the
event loop at the first request, which then stalls for the whole import.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the private module that defines it. The one list of the public names:
# ``__all__`` is made from it, and a test checks it against the type checkers' imports below.
_EXPORTS: dict[str, str] = {
    "AsyncExecError": "_errors",
    "BackendError": "_errors",
    "ChannelError": "_errors",
    "ChannelStatistics": "_driver.channel",
    "Checkpoint": "_wire._checkpoint",
    "CheckpointConfig": "_driver._config",
    "ConfigurationError": "_errors",
    "DataConfig": "_driver.cluster",
    "Executor": "_driver._executor",
    "ExecutorState": "_driver._executor",
    "ExecutorStateError": "_errors",
    "ExecutorStatistics": "_driver._executor",
    "HealthChecks": "_driver._config",
    "MergeError": "_errors",
    "NodeLostError": "_errors",
    "Pipeline": "_driver.pipeline",
    "PipelineBatch": "_driver.pipeline",
    "PipelineStatistics": "_driver.pipeline",
    "PlacementInfeasibleError": "_errors",
    "PlacementTimeoutError": "_errors",
    "PreemptionNotice": "_wire._protocol",
    "Report": "_driver.run",
    "Reservation": "_driver.group",
    "ReservationStatistics": "_driver.group",
    "ReportMismatchError": "_errors",
    "RestartPolicy": "_driver._restart",
    "RestartsExhaustedError": "_errors",
    "RolloutRequest": "_wire._rollout",
    "RolloutServer": "_worker._rollout",
    "Router": "_driver.pipeline",
    "RouterStatistics": "_driver.pipeline",
    "Run": "_driver.run",
    "RunResult": "_driver.run",
    "RunState": "_driver.run",
    "Sample": "_wire._rollout",
    "StartupError": "_errors",
    "StartupTimeoutError": "_errors",
    "Step": "_driver.run",
    "Timeline": "_timeline._timeline",
    "TimelineStatistics": "_timeline._timeline",
    "Timeouts": "_driver._config",
    "WorkerContext": "_wire._protocol",
    "Mesh": "_dispatch._targets",
    "Role": "_dispatch._role",
    "Splittable": "_dispatch._split",
    "concat": "_dispatch._split",
    "least_loaded": "_dispatch._targets",
    "method": "_dispatch._role",
    "rank": "_dispatch._targets",
    "scatter": "_dispatch._split",
    "WorkerCrashedError": "_errors",
    "WorkerError": "_errors",
    "WorkerHungError": "_errors",
    "WorkerPool": "_driver.group",
    "PoolStatistics": "_driver.group",
    "WorkerRaisedError": "_errors",
    "WorkerUnreachableError": "_errors",
    "WeightChannel": "_driver.channel",
    "configure_logging": "_cli._logconfig",
    "enable_metrics": "_driver._metrics",
    "start_metrics_server": "_driver._metrics",
    "get_checkpoint": "_worker._session",
    "get_context": "_worker._session",
    "get_dataset_shard": "_worker._session",
    "get_preemption_info": "_worker._session",
    "receive_weights": "_worker._channel",
    "report": "_worker._session",
    "serve_weights": "_worker._channel",
    "weights_version": "_worker._channel",
}

__all__ = sorted(_EXPORTS)


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


def _load_driver_side() -> None:
    """Load every public name now, while the program imports, not on its event loop later."""
    for home in sorted(set(_EXPORTS.values())):
        _load(home)
    # anyio imports its asyncio backend at its first call in a running event loop, which would
    # be asyncexec's first entry: import it now too.
    if importlib.util.find_spec("anyio._backends._asyncio") is not None:
        importlib.import_module("anyio._backends._asyncio")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


if TYPE_CHECKING:
    from ._cli._logconfig import configure_logging as configure_logging
    from ._dispatch._role import Role as Role
    from ._dispatch._role import method as method
    from ._dispatch._split import Splittable as Splittable
    from ._dispatch._split import concat as concat
    from ._dispatch._split import scatter as scatter
    from ._dispatch._targets import Mesh as Mesh
    from ._dispatch._targets import least_loaded as least_loaded
    from ._dispatch._targets import rank as rank
    from ._driver._config import CheckpointConfig as CheckpointConfig
    from ._driver._config import HealthChecks as HealthChecks
    from ._driver._config import Timeouts as Timeouts
    from ._driver._executor import Executor as Executor
    from ._driver._executor import ExecutorState as ExecutorState
    from ._driver._executor import ExecutorStatistics as ExecutorStatistics
    from ._driver._metrics import enable_metrics as enable_metrics
    from ._driver._metrics import start_metrics_server as start_metrics_server
    from ._driver._restart import RestartPolicy as RestartPolicy
    from ._driver.channel import ChannelStatistics as ChannelStatistics
    from ._driver.channel import WeightChannel as WeightChannel
    from ._driver.cluster import DataConfig as DataConfig
    from ._driver.group import PoolStatistics as PoolStatistics
    from ._driver.group import Reservation as Reservation
    from ._driver.group import ReservationStatistics as ReservationStatistics
    from ._driver.group import WorkerPool as WorkerPool
    from ._driver.pipeline import Pipeline as Pipeline
    from ._driver.pipeline import PipelineBatch as PipelineBatch
    from ._driver.pipeline import PipelineStatistics as PipelineStatistics
    from ._driver.pipeline import Router as Router
    from ._driver.pipeline import RouterStatistics as RouterStatistics
    from ._driver.run import Report as Report
    from ._driver.run import Run as Run
    from ._driver.run import RunResult as RunResult
    from ._driver.run import RunState as RunState
    from ._driver.run import Step as Step
    from ._errors import AsyncExecError as AsyncExecError
    from ._errors import BackendError as BackendError
    from ._errors import ChannelError as ChannelError
    from ._errors import ConfigurationError as ConfigurationError
    from ._errors import ExecutorStateError as ExecutorStateError
    from ._errors import MergeError as MergeError
    from ._errors import NodeLostError as NodeLostError
    from ._errors import PlacementInfeasibleError as PlacementInfeasibleError
    from ._errors import PlacementTimeoutError as PlacementTimeoutError
    from ._errors import ReportMismatchError as ReportMismatchError
    from ._errors import RestartsExhaustedError as RestartsExhaustedError
    from ._errors import StartupError as StartupError
    from ._errors import StartupTimeoutError as StartupTimeoutError
    from ._errors import WorkerCrashedError as WorkerCrashedError
    from ._errors import WorkerError as WorkerError
    from ._errors import WorkerHungError as WorkerHungError
    from ._errors import WorkerRaisedError as WorkerRaisedError
    from ._errors import WorkerUnreachableError as WorkerUnreachableError
    from ._timeline._timeline import Timeline as Timeline
    from ._timeline._timeline import TimelineStatistics as TimelineStatistics
    from ._wire._checkpoint import Checkpoint as Checkpoint
    from ._wire._protocol import PreemptionNotice as PreemptionNotice
    from ._wire._protocol import WorkerContext as WorkerContext
    from ._wire._rollout import RolloutRequest as RolloutRequest
    from ._wire._rollout import Sample as Sample
    from ._worker._channel import receive_weights as receive_weights
    from ._worker._channel import serve_weights as serve_weights
    from ._worker._channel import weights_version as weights_version
    from ._worker._rollout import RolloutServer as RolloutServer
    from ._worker._session import get_checkpoint as get_checkpoint
    from ._worker._session import get_context as get_context
    from ._worker._session import get_dataset_shard as get_dataset_shard
    from ._worker._session import get_preemption_info as get_preemption_info
    from ._worker._session import report as report
else:
    # The error tree and the worker-side API are light and always needed: load them now.
    _load("_errors")
    _load("_wire._checkpoint")
    _load("_wire._protocol")
    _load("_worker._session")
    _load("_worker._channel")
    # Whether this process is a Ray worker is the worker side's to tell (it knows Ray).
    if not importlib.import_module("._worker", __name__).in_ray_worker():
        _load_driver_side()
