"""A live group of workers and its lifecycle: start-up, calls, health, spares, the executor's
slot for its one group, elastic sizing, warm pools and reservations."""

from __future__ import annotations

from ._elastic import Resize, Sizer, decide_size, fitting_workers, measure_free
from ._group import STOP_MARGIN_S, WorkerGroup, answers, device_envs, with_others
from ._health import FailureSink, declare_hung, find_dead, watch, watch_steps
from ._members import Standby, WorkerInfo
from ._observed import ObservedCall, dropped, observed, unsent, watched
from ._pool import PoolStatistics, PoolWorker, WorkerPool
from ._reservation import Claim, Reservation, ReservationStatistics
from ._roles import PerRank
from ._slot import GroupSlot
from ._startup import start_group, worker_contexts

__all__ = [
    "ObservedCall",
    "dropped",
    "observed",
    "unsent",
    "watched",
    "STOP_MARGIN_S",
    "Claim",
    "FailureSink",
    "GroupSlot",
    "PerRank",
    "PoolStatistics",
    "PoolWorker",
    "Reservation",
    "ReservationStatistics",
    "Resize",
    "Sizer",
    "Standby",
    "WorkerGroup",
    "WorkerInfo",
    "WorkerPool",
    "answers",
    "declare_hung",
    "decide_size",
    "device_envs",
    "find_dead",
    "fitting_workers",
    "measure_free",
    "start_group",
    "watch",
    "watch_steps",
    "with_others",
    "worker_contexts",
]
