"""Executor: the public entry point. Its life (``_lifecycle``), its calls on the workers
(``_dispatcher``), its runs and counters (``_runs``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from .._dispatch._role import Role, roles_of, roles_payload
from .._errors import ConfigurationError
from .._logging import get_logger
from .._timeline._timeline import Timeline, new_timeline
from .._wire._protocol import WorkerContext
from ..backends._base import Backend
from ._config import (
    CheckpointConfig,
    ExecutorConfig,
    HealthChecks,
    PlacementStrategy,
    Timeouts,
    grouped_options,
)
from ._dispatcher import WorkerCalls
from ._lifecycle import LOCAL_ENV, ExecutorState, Lifecycle, local_default
from ._restart import RestartPolicy
from ._runs import ExecutorRuns, ExecutorStatistics
from ._sinks import ExecutorCounts, executor_observer
from .cluster import Cluster, agreed, checked_cluster, rays_only
from .group import GroupSlot, Reservation, WorkerPool
from .run import RunState

__all__ = ["Executor", "ExecutorState", "ExecutorStatistics", "local_default", "slot_of"]

T = TypeVar("T")
#: Defaults of the configuration, written once (in ExecutorConfig's fields).
_D = ExecutorConfig


def _check_parts(
    local: bool, backend: object, pool: object, reservation: object, elastic: bool
) -> None:
    """Refuse parts that do not go together (the rest is checked by ``ExecutorConfig``).

    Raises:
        ConfigurationError: naming the argument, and why.
    """
    why = {
        "backend": "a framework's process group is one per process, and local workers are "
        "threads of one",
        "pool": "a pool holds Ray actors",
        "reservation": "a reservation is a Ray placement group",
    }
    parts = {"backend": backend, "pool": pool, "reservation": reservation}
    for name, value in parts.items():
        if local and value is not None:
            raise ConfigurationError(
                f"a local executor (local=True, or {LOCAL_ENV}=1) takes no {name}: {why[name]}"
            )
    if backend is not None and not isinstance(backend, Backend):
        raise ConfigurationError(f"backend must be an asyncexec.backends.Backend, got {backend!r}")
    if pool is not None and not isinstance(pool, WorkerPool):
        raise ConfigurationError(f"pool must be an asyncexec.WorkerPool, got {pool!r}")
    if reservation is not None and not isinstance(reservation, Reservation):
        raise ConfigurationError(
            f"reservation must be an asyncexec.Reservation, got {reservation!r}"
        )
    if pool is not None and reservation is not None:
        raise ConfigurationError(
            "an executor takes a pool or a reservation, not both: to lease from the "
            "reservation, build the pool on it"
        )
    if elastic and (pool is not None or reservation is not None):
        raise ConfigurationError(
            f"an elastic executor takes no {'pool' if pool is not None else 'reservation'}: "
            "its groups are placed in placement groups of their own size"
        )


def _cluster_of(
    name: str,
    cluster: Cluster | None,
    pool: WorkerPool | None,
    reservation: Reservation | None,
    local: bool,
) -> Cluster:
    """Where an executor's workers live: the cluster handed in, else its pool's or its
    reservation's, else the default (see ``cluster._choice``). Decided once, when it is made.

    Raises:
        ConfigurationError: the cluster handed in and the pool's or reservation's differ.
    """
    sides: list[tuple[str, Cluster | None]] = [(f"the executor {name!r} (cluster=)", cluster)]
    if pool is not None:
        sides.append((f"its pool {pool.config.name!r}", pool.cluster))
    if reservation is not None:
        sides.append((f"its reservation {reservation.name!r}", reservation.cluster))
    return agreed(sides, local)


class Executor(WorkerCalls, ExecutorRuns):
    """Runs one function on a group of Ray actor workers and streams their reports.

    Use it as an async context manager::

        async with asyncexec.Executor(num_workers=4, resources_per_worker={"CPU": 0.5}) as ex:
            async for step in ex.run(train_fn, {"lr": 0.1}):
                print(step.index, step.metrics)
            print(ex.result.return_values)

    Args:
        num_workers: how many workers (Ray actors) to start; or ``(min, max)`` for an elastic
            size: each group starts with as many as fit now (at least ``min``), goes on with
            the workers left after a lost node, and grows back from the latest checkpoint when
            more would fit (every ``elastic_check_interval_s``). Not with ``pool``,
            ``reservation``, ``spares`` or independent runs.
        resources_per_worker: Ray resources of each worker, ``{"CPU": 1}`` by default
            (``"GPU"``, ``"memory"``, custom resources such as ``"neuron_cores"``).
        backend: a :class:`asyncexec.backends.Backend` that sets a framework up across the
            group, such as :class:`asyncexec.backends.TorchBackend`.
        roles: the worker classes each rank holds an instance of (:class:`Role`, a class, or
            a list of them: colocated in one process), made once the backend has set up and
            again after a restart; their methods are called with :meth:`call`.
        restart: the :class:`RestartPolicy` (3 restarts with backoff by default).
        checkpoint: which persisted checkpoints are kept (:class:`CheckpointConfig`).
        timeouts: the :class:`Timeouts` of placement, start-up, stopping and shutdown.
        health: the :class:`HealthChecks` that notice hung workers.
        placement_strategy: ``"PACK"`` (few nodes) or ``"SPREAD"`` (many), or their strict forms.
        share_devices: make every worker see its node's accelerators (``True``: GPUs, Neuron
            cores and Ascend NPUs), ``False`` for none, or a collection of kinds (``{"GPU"}``).
        buffer_size: reports a rank may have outstanding before ``report()`` waits; a run may
            override it.
        storage_path: where checkpoints are persisted, one folder per run
            (``~/asyncexec_results`` by default); must be reachable from every worker.
        init_hook: called on every worker at start-up, before the backend's hooks.
        runtime_env: Ray runtime environment of the workers.
        address: the Ray cluster to join when Ray is not initialized (``"auto"``); by Ray's own
            rule a running one is joined when found, else a local Ray is started. ``"auto"``,
            ``"local"``, ``"host:port"`` or ``"ray://host:port"``; one where nothing answers
            fails the entry at once with a :class:`StartupError`. Not with a local executor.
        name: a name for logs and metrics.
        pool: a :class:`WorkerPool` to lease warm workers from instead of starting processes
            (``resources_per_worker`` and ``runtime_env`` default to the pool's).
        spares: standby workers kept beside the group: a spare on a failed rank's node takes
            its place (the others are kept), instead of a new group starting.
        reservation: a :class:`Reservation` to place rank i on bundle i of (claimed while the
            executor is open).
        elastic_check_interval_s: how often a smaller elastic group checks whether more
            workers would fit.
        local: run the ranks as threads of this process instead of Ray actors (local mode:
            no Ray; for debugging and tests); ``None``: as ``ASYNCEXEC_LOCAL`` says.
        timeline: keep a :class:`Timeline` of the ranks' steps, calls, pushes and restarts
            (``executor.timeline``; export it for Perfetto or draw it as a PNG): ``True`` for
            the last 100,000 events, or how many to keep, or a :class:`Timeline` that other
            executors record into too (this one's part a process named ``name``, on one
            clock); off (``False``) by default.
        cluster: the cluster the workers run on, such as an
            :class:`asyncexec.testing.SimCluster` (simulated workers, no Ray); ``None``: its
            pool's or reservation's, else Ray's (or, inside
            :func:`asyncexec.testing.simulated`, that block's). Not with ``local=True``
            (``ASYNCEXEC_LOCAL`` does not apply to it); a pool or reservation must run on the
            same one. A simulated cluster takes no ``backend``. Not a local executor's
            cluster: local mode is ``local=True``.
        **legacy: the options grouped into ``timeouts`` and ``health`` in 0.2, under their old
            names (``start_timeout_s=``, ``health_check_interval_s=``, ...): deprecated.
    """

    def __init__(
        self,
        num_workers: int | tuple[int, int],
        *,
        resources_per_worker: Mapping[str, float] | None = None,
        backend: Backend | None = None,
        roles: Role[Any] | type | Sequence[Role[Any] | type] | None = None,
        restart: RestartPolicy | None = None,
        checkpoint: CheckpointConfig | None = None,
        timeouts: Timeouts | None = None,
        health: HealthChecks | None = None,
        placement_strategy: PlacementStrategy = _D.placement_strategy,
        share_devices: bool | Collection[str] = True,
        buffer_size: int = _D.buffer_size,
        storage_path: str | os.PathLike[str] | None = None,
        init_hook: Callable[[], object] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        address: str | None = None,
        name: str = _D.name,
        pool: WorkerPool | None = None,
        spares: int = _D.spares,
        reservation: Reservation | None = None,
        elastic_check_interval_s: float = _D.elastic_check_interval_s,
        local: bool | None = None,
        timeline: bool | int | Timeline = False,
        cluster: Cluster | None = None,
        **legacy: Any,
    ) -> None:
        timeouts, health = grouped_options(timeouts, health, legacy)
        if cluster is not None:  # refused with local=True; ASYNCEXEC_LOCAL does not apply
            cluster = checked_cluster(cluster, local)
            local = False if local is None else local
        local = local_default(local)
        _check_parts(local, backend, pool, reservation, isinstance(num_workers, tuple))
        if restart is not None and not isinstance(restart, RestartPolicy):
            raise ConfigurationError(f"restart must be a RestartPolicy, got {restart!r}")
        if pool is not None:  # workers of the pool's shape, unless the caller says otherwise
            resources_per_worker = resources_per_worker or pool.config.resources_per_worker
            runtime_env = runtime_env or pool.config.runtime_env
        self.config = ExecutorConfig.build(
            num_workers,
            resources_per_worker=resources_per_worker,
            placement_strategy=placement_strategy,
            placement_timeout_s=timeouts.placement_s,
            start_timeout_s=timeouts.start_s,
            shutdown_timeout_s=timeouts.shutdown_s,
            graceful_patience_s=timeouts.graceful_patience_s,
            stop_timeout_s=timeouts.stop_s,
            health_check_interval_s=health.interval_s,
            health_check_timeout_s=health.timeout_s,
            step_timeout_s=health.step_timeout_s,
            straggler_factor=health.straggler_factor,
            straggler_steps=health.straggler_steps,
            share_devices=share_devices,
            buffer_size=buffer_size,
            storage_path=storage_path,
            checkpoint=checkpoint,
            address=address,
            runtime_env=runtime_env,
            init_hook=init_hook,
            name=name,
            spares=spares,
            elastic_check_interval_s=elastic_check_interval_s,
            local=local,
            roles=(checked := roles_of(roles)),
            roles_payload=roles_payload(checked) if checked else None,
        )
        if pool is not None:
            pool.check_shape(self.config)
        self.pool = pool
        self.reservation = reservation
        self.backend = backend
        self.restart_policy = restart if restart is not None else RestartPolicy()
        self.id = uuid.uuid4().hex[:8]
        self.log = get_logger(executor=f"{name}-{self.id}")
        #: What the ranks and the driver did, and when (a :class:`Timeline`), or None when off.
        self.timeline = new_timeline(timeline, name)
        #: The counters ``statistics()`` reports: the statistics sink of the executor's
        #: observer, which its groups, runs and calls emit their events to.
        self._counts = ExecutorCounts()
        observer = executor_observer(self._counts, self.config.name, self.timeline)
        cluster = _cluster_of(name, cluster, pool, reservation, local)
        if backend is not None:
            rays_only(
                cluster,
                f"a backend ({type(backend).__name__})",
                "runs its workers in this process, where a framework's process group cannot "
                "span the ranks (its set-up would wait on the driver's loop for ranks that "
                "cannot run)",
            )
        self._life = Lifecycle(
            self.config, backend, self.log, cluster, pool, reservation, self.timeline, observer
        )
        self._init_calls()
        self._init_runs()

    def __repr__(self) -> str:
        return f"<Executor {self.config.name}-{self.id} {self.state.value} workers={self._size()}>"

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> Executor:
        await self._life.enter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._life.exit(exc_type, exc, tb)
        finally:
            await self._retention.remove()

    async def aclose(self, *, force: bool = False) -> None:
        """Stop any run and tear the group down; ``force`` skips the graceful part. Shielded,
        bounded and idempotent: afterwards no actor or placement group of this executor is left,
        and the folders of its unnamed runs are removed (unless
        ``CheckpointConfig(keep_runs=True)``)."""
        try:
            await self._life.aclose(force=force)
        finally:
            await self._retention.remove()

    # State ------------------------------------------------------------------------------------

    @property
    def state(self) -> ExecutorState:
        """Where the executor is: new, starting, ready, running, restarting, closing, closed."""
        life = self._life
        if life.state is not ExecutorState.READY:
            return life.state
        if life.slot.starting is not None:
            return ExecutorState(life.slot.starting)
        run = life.run
        if run is not None and run.active:
            if run.state is RunState.RESTARTING:
                return ExecutorState.RESTARTING
            return ExecutorState.RUNNING
        return ExecutorState.READY

    @property
    def cluster(self) -> Cluster:
        """The cluster the workers run on (handed in as ``cluster=``, or the default)."""
        return self._life.cluster

    @property
    def workers(self) -> list[WorkerContext]:
        """Each live worker's context (ranks, node, pid, devices), in rank order."""
        group = self._life.slot.group
        return [] if group is None else group.contexts

    @property
    def _slot(self) -> GroupSlot:
        """The slot of the executor's group (tests and benchmarks look at the live group)."""
        return self._life.slot

    def _size(self) -> int:
        """The live group's size, else the configured one (an elastic executor's maximum)."""
        group = self._life.slot.group
        return self.config.num_workers if group is None else len(group.workers)


def slot_of(executor: Executor) -> GroupSlot:
    """The executor's slot for its group (what a weight channel reads of the executors it
    connects: their live workers, and who joins)."""
    return executor._life.slot
