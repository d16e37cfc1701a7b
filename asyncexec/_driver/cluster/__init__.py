"""The one seam to where the workers live (see ``_base``): the only driver code that imports Ray.

Upper layers get a :class:`Cluster` from :func:`cluster_for` and call workers' methods through
the typed proxy of ``_proxy`` (:func:`proxy`), whose calls (``_calls.Call``) raise asyncexec's
errors: Ray's become asyncexec's in ``_errors`` and nowhere else. A :class:`Handle` is passed
around above, never called there.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from ..._wire._pickle import dumps as pickled
from ._base import Cluster, Handle, PendingResult, Spawned, awaited, described, settle
from ._calls import (
    Call,
    Caller,
    Member,
    Names,
    Unranked,
    at_attempt,
    death_of,
    gathered,
    result_of,
    settled,
)
from ._data import DataConfig, make_shards, release_shards, validate_datasets
from ._errors import (
    RAY_ERROR_KINDS,
    CallCancelledError,
    backend_error,
    outcome_error,
    ray_error_kind,
    startup_error,
    worker_error,
)
from ._join import WorkerProcess, join_cluster, live_workers
from ._local import LocalCluster, LocalWorkerGone
from ._placement import PRECISION, Placement, infeasible_reason
from ._process import init_ray, quiet_planned_crash, ray_is_initialized, shutdown_ray
from ._proxy import WorkerProxy, proxy
from ._ray import RayCluster
from ._sim import GcClock, SimCluster, SimLoad
from ._stacks import DUMP_TIMEOUT_S, NOT_TAKEN, dump_processes, take_stacks

__all__ = [
    "DUMP_TIMEOUT_S",
    "NOT_TAKEN",
    "PRECISION",
    "RAY_ERROR_KINDS",
    "Call",
    "CallCancelledError",
    "Caller",
    "Cluster",
    "DataConfig",
    "GcClock",
    "Handle",
    "LocalWorkerGone",
    "Member",
    "Names",
    "PendingResult",
    "Unranked",
    "WorkerProxy",
    "Placement",
    "RayCluster",
    "SimCluster",
    "SimLoad",
    "Spawned",
    "at_attempt",
    "awaited",
    "death_of",
    "gathered",
    "backend_error",
    "cluster_for",
    "described",
    "dump_processes",
    "dumps",
    "infeasible_reason",
    "make_shards",
    "outcome_error",
    "proxy",
    "ray_error_kind",
    "release_shards",
    "result_of",
    "settled",
    "settle",
    "simulated",
    "startup_error",
    "take_stacks",
    "WorkerProcess",
    "init_ray",
    "join_cluster",
    "live_workers",
    "quiet_planned_crash",
    "ray_is_initialized",
    "shutdown_ray",
    "validate_datasets",
    "worker_error",
]

#: How what crosses to the workers is pickled (they unpickle with Ray's cloudpickle).
dumps = pickled

_RAY: Cluster = RayCluster()
_LOCAL: Cluster = LocalCluster()
#: Simulated clusters in force (see :func:`simulated`), the innermost last.
_SIMULATED: list[Cluster] = []


def cluster_for(local: bool) -> Cluster:
    """The cluster an executor's workers live in: Ray's, or this process's threads (or, inside
    :func:`simulated`, the simulated one)."""
    if _SIMULATED:
        return _SIMULATED[-1]
    return _LOCAL if local else _RAY


@contextlib.contextmanager
def simulated(cluster: SimCluster) -> Iterator[SimCluster]:
    """Executors (and pools, reservations) made inside get ``cluster``'s simulated workers,
    whatever their ``local`` says: the benchmarks' and tests' thousands of cheap ranks (see
    ``_sim``). Users reach it as ``asyncexec.testing.simulated``; no configuration does."""
    _SIMULATED.append(cluster)
    gc.callbacks.append(cluster.gc_clock)
    try:
        yield cluster
    finally:
        gc.callbacks.remove(cluster.gc_clock)
        _SIMULATED.remove(cluster)
