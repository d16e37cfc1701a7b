"""The worker side: what runs inside each worker process.

It imports the standard library, ray and ``asyncexec._wire._protocol`` (with the small modules both
sides share: errors and checkpoints) only, never the driver's modules, anyio, structlog or
tenacity: ``tests/worker/test_boundary.py`` checks it in a fresh interpreter.

Code outside this package takes what it needs of it from here, never from its private modules
(``tests/project/test_structure.py`` checks it): the actor and its undecorated code (for local
mode's threads), the threaded actor (the workers of a group whose roles have only plain methods), a
worker's place (its state, per thread in local mode), how a call's outcome is made (the
simulated workers make theirs so), and the run's functions for worker-side helpers.
"""

from __future__ import annotations

from ._actor import ROLE_GROUPS, WorkerActor, WorkerCode, in_ray_worker, role_group
from ._channel import release_stores, weights_version
from ._devices import cuda_device_index
from ._outcomes import cancelled_by_caller, error_outcome, value_outcome
from ._place import PLACE, Place
from ._rollout import RolloutServer
from ._session import get_checkpoint, get_context, report
from ._threaded import CONTROL_THREADS, ThreadedWorkerActor, ThreadedWorkerCode

__all__ = [
    "CONTROL_THREADS",
    "PLACE",
    "ROLE_GROUPS",
    "Place",
    "WorkerActor",
    "RolloutServer",
    "ThreadedWorkerActor",
    "ThreadedWorkerCode",
    "WorkerCode",
    "cancelled_by_caller",
    "cuda_device_index",
    "error_outcome",
    "get_checkpoint",
    "get_context",
    "in_ray_worker",
    "release_stores",
    "report",
    "role_group",
    "value_outcome",
    "weights_version",
]
