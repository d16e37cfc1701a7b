"""What the two ways of running (aligned attempts, independent ranks) share of one run: its
state, the executor's group slot and restart policy, the hand-over to the iterator, the run's
meter and log, the watch on its nodes' preemption, and the few things both do the same way (the
payload, each rank's start record, logging a failure).

The engine (``_engine``) makes one and hands it to the way of running the run asks for; neither
reaches into the other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..._errors import AsyncExecError, WorkerError, describe
from ..._wire._checkpoint import Checkpoint, join_path
from ..._wire._protocol import RunStart
from ..._wire._tracing import current_traceparent
from ...backends._base import Backend
from .._config import ExecutorConfig
from .._metrics import RunMeter
from .._observe import Observer
from .._restart import RestartPolicy
from ..group import GroupSlot, WorkerGroup, WorkerInfo
from ._iterator import RunCore
from ._preemption import PreemptionWatch
from ._prune import Pruner
from ._spec import RunSpec
from ._window import HandOver, Window

__all__ = ["INLINE_PAYLOAD_BYTES", "RunContext"]

#: The largest pickled function and config sent inline with each rank's call (Ray's own bound
#: for inlining a call's arguments is 100 KiB); a larger one goes through the object store once.
INLINE_PAYLOAD_BYTES = 64 * 1024


class RunContext:
    """One run's shared state (see the module's docstring)."""

    def __init__(
        self,
        slot: GroupSlot,
        policy: RestartPolicy,
        run: RunCore,
        spec: RunSpec,
        handover: HandOver,
        meter: RunMeter,
        log: Any,
        preemption: PreemptionWatch,
        observer: Observer,
    ) -> None:
        self.slot = slot
        self.config: ExecutorConfig = slot.config
        self.backend: Backend | None = slot.backend
        self.policy = policy
        self.run = run
        self.spec = spec
        self.handover = handover
        self.meter = meter
        #: The run's observer: its events go to the executor's statistics, metrics and
        #: timeline, and to the run's log (``_sinks.run_observer``).
        self.observer = observer
        self.log = log
        #: What the run knows of its nodes' preemption (notices, and the budget's count).
        self.preemption = preemption
        #: The checkpoint a restart starts from when no completed step carried one (the run's
        #: start, or a resumed run's record).
        self.latest: Checkpoint | None = spec.checkpoint
        #: Where this run's checkpoints go: ``<storage_path>/<run id>``.
        self.storage = join_path(self.config.storage_path, run.run_id)
        #: The group the run is on now (read by the metrics' backlog and by the run's end).
        self.group: WorkerGroup | None = None
        #: The current aligned attempt's window (its ranks' reports not yet assembled); None
        #: between attempts.
        self.window: Window | None = None
        #: Whether the run's functions may be running on ``group`` (stopped at the end).
        self.session_live = False
        #: The run's pruner (set by the engine): deletes what an attempt that ended early left.
        self.pruner: Pruner | None = None
        self._payload: Any = None

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The latest checkpoint: of a completed step, else the one the run started from."""
        return self.run.latest_checkpoint or self.latest

    def sweep(self, attempt: int) -> None:
        """``attempt`` has ended early and its workers are stopped: delete the checkpoints it
        persisted for the steps it never completed (those from the hand-over's count on, which
        no step carries and no book counts), apart from the run."""
        if self.pruner is not None:
            self.pruner.sweep(
                self.config.storage_path, self.run.run_id, attempt, self.handover.steps
            )

    async def payload(self) -> Any:
        """The function and config as each rank gets them: a small payload travels inline with
        the call (a reference would cost every rank a fetch from the driver, a large share of a
        warm executor's time from run() to the first step); a large one is put where every rank
        reads it, once per run."""
        if self._payload is None:
            payload = self.spec.payload
            if len(payload) > INLINE_PAYLOAD_BYTES:
                payload = await self.slot.cluster.put(payload)
            self._payload = payload
        return self._payload

    def run_start(
        self,
        worker: WorkerInfo,
        attempt: int,
        checkpoint: Checkpoint | None,
        step_offset: int,
        shards: Any,
        storage: str,
    ) -> RunStart:
        """What ``worker`` needs to start its function for ``attempt``."""
        context = replace(
            worker.context, run_id=self.run.run_id, attempt=attempt, storage_path=storage
        )
        function_context = self.backend.function_context() if self.backend else None
        return RunStart(
            context,
            checkpoint,
            self.spec.buffer_size,
            step_offset,
            shards,
            function_context,
            current_traceparent(),  # None unless traced
        )

    def log_failure(self, exc: AsyncExecError) -> None:
        fields: dict[str, Any] = {"attempt": self.run.attempt, "cause": type(exc).__name__}
        if isinstance(exc, WorkerError):
            fields.update(rank=exc.rank, node_id=exc.node_id, pid=exc.pid)
        self.log.warning("worker_failed", detail=describe(exc), **fields)
