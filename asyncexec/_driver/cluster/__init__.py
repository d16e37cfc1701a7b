"""The one seam to where the workers live (see ``_base``): the only driver code that imports Ray.

Upper layers are handed a :class:`Cluster` (``cluster=``), or get the default from ``_choice``
(:func:`agreed`: handed in, the parts', or the default), and call workers' methods through
the typed proxy of ``_proxy`` (:func:`proxy`), whose calls (``_calls.Call``) raise asyncexec's
errors: Ray's become asyncexec's in ``_errors`` and nowhere else. A :class:`Handle` is passed
around above, never called there.
"""

from __future__ import annotations

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
from ._choice import DEFAULT_CLUSTER, agreed, checked_cluster, rays_by_default, rays_only
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
from ._local import LocalWorkerGone
from ._placement import PRECISION, Placement, infeasible_reason
from ._process import init_ray, quiet_planned_crash, ray_is_initialized, shutdown_ray
from ._proxy import WorkerProxy, proxy
from ._ray import RayCluster
from ._sim import GcClock, SimCluster, SimLoad
from ._stacks import DUMP_TIMEOUT_S, NOT_TAKEN, dump_processes, take_stacks

__all__ = [
    "DEFAULT_CLUSTER",
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
    "agreed",
    "at_attempt",
    "awaited",
    "death_of",
    "gathered",
    "backend_error",
    "checked_cluster",
    "described",
    "dump_processes",
    "dumps",
    "infeasible_reason",
    "make_shards",
    "outcome_error",
    "rays_by_default",
    "rays_only",
    "proxy",
    "ray_error_kind",
    "release_shards",
    "result_of",
    "settled",
    "settle",
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
