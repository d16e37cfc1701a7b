"""Executor: the public entry point. Its life (``_lifecycle``), run(), execute(), statistics."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import anyio

from .._checkpoint import Checkpoint
from .._config import (
    CheckpointConfig,
    ExecutorConfig,
    HealthChecks,
    PlacementStrategy,
    Timeouts,
    grouped_options,
)
from .._errors import ConfigurationError, ExecutorStateError, NodeLostError, WorkerCrashedError
from .._protocol import WorkerContext
from ..backends._base import Backend
from ._lifecycle import LOCAL_ENV, ExecutorState, Lifecycle, local_default
from ._logging import get_logger
from ._metrics import metrics
from ._restart import RestartPolicy
from .group import GroupSlot, Reservation, WorkerGroup, WorkerPool
from .run import Resume, Run, RunCore, RunDriver, RunResult, RunState, new_run_id, prepare

__all__ = ["Executor", "ExecutorState", "ExecutorStatistics", "local_default", "slot_of"]

T = TypeVar("T")
#: Defaults of the configuration, written once (in ExecutorConfig's fields).
_D = ExecutorConfig


@dataclass(frozen=True)
class ExecutorStatistics:
    """Counters of an executor, from :meth:`Executor.statistics`."""

    state: ExecutorState
    num_workers: int
    group_starts: int
    runs_started: int
    runs_finished: int
    runs_failed: int
    runs_cancelled: int
    #: Restarts after a failure: of the whole group, or of one rank (a standby spare taking a
    #: failed rank's place, a rank replaced alone, a rank of an independent run renewed).
    restarts: int
    steps_delivered: int
    #: Groups of an elastic executor that started at another size than the one before: after
    #: a loss (shrinking, counted in ``restarts`` too) or a planned growth (not a restart).
    resizes: int = 0


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


class Executor:
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
            rule a running one is joined when found, else a local Ray is started.
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
        **legacy: the options grouped into ``timeouts`` and ``health`` in 0.2, under their old
            names (``start_timeout_s=``, ``health_check_interval_s=``, ...): deprecated.
    """

    def __init__(
        self,
        num_workers: int | tuple[int, int],
        *,
        resources_per_worker: Mapping[str, float] | None = None,
        backend: Backend | None = None,
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
        **legacy: Any,
    ) -> None:
        timeouts, health = grouped_options(timeouts, health, legacy)
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
        )
        if pool is not None:
            pool.check_shape(self.config)
        self.pool = pool
        self.reservation = reservation
        self.backend = backend
        self.restart_policy = restart if restart is not None else RestartPolicy()
        self.id = uuid.uuid4().hex[:8]
        self.log = get_logger(executor=f"{name}-{self.id}")
        self._life = Lifecycle(self.config, backend, self.log, pool, reservation)
        self._result: RunResult | None = None
        self._stats = dict.fromkeys(
            ("runs_started", "runs_finished", "runs_failed", "runs_cancelled", "steps_delivered"),
            0,
        )

    def __repr__(self) -> str:
        return (
            f"<Executor {self.config.name}-{self.id} {self.state.value} "
            f"workers={self._size()}>"
        )

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
        await self._life.exit()

    async def aclose(self, *, force: bool = False) -> None:
        """Stop any run and tear the group down; ``force`` skips the graceful part. Shielded,
        bounded and idempotent: afterwards no actor or placement group of this executor is left."""
        await self._life.aclose(force=force)

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
    def result(self) -> RunResult:
        """The result of the last run that finished.

        Raises:
            ExecutorStateError: no run has finished yet.
        """
        if self._result is None:
            raise ExecutorStateError("no run has finished on this executor")
        return self._result

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

    def statistics(self) -> ExecutorStatistics:
        """A snapshot of the executor's counters (``steps_delivered`` counts the steps taken
        from every run, the one in progress included)."""
        stats = dict(self._stats)
        if self._life.run is not None:
            stats["steps_delivered"] += self._life.run.delivered
        slot = self._life.slot
        return ExecutorStatistics(
            state=self.state,
            num_workers=self._size(),
            group_starts=slot.starts,
            restarts=slot.restarts,
            resizes=slot.resizes,
            **stats,
        )

    # Runs -------------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        config: Any = None,
        *,
        checkpoint: Checkpoint | str | os.PathLike[str] | None = None,
        buffer_size: int | None = None,
        datasets: Mapping[str, Any] | None = None,
        data_config: Any = None,
        name: str | None = None,
        resume: Resume = "auto",
        independent: bool | None = None,
    ) -> Run:
        """Start ``fn`` on every worker and return an async iterator of its steps.

        ``fn`` is a plain function (run in a thread) or an ``async def``, called with ``config``
        when it takes a positional parameter, else with no argument. Inside it,
        :func:`asyncexec.report`, :func:`asyncexec.get_context` and
        :func:`asyncexec.get_checkpoint` are available.

        Args:
            fn: the function; it must pickle (it is sent to the workers).
            config: passed to ``fn``; it must pickle.
            checkpoint: the checkpoint (or directory) the first attempt starts from.
            buffer_size: this run's bound on unconsumed reports per rank.
            datasets: Ray Data datasets by name; each rank reads its part with
                :func:`asyncexec.get_dataset_shard` (needs the ``data`` extra).
            data_config: an :class:`asyncexec.DataConfig` saying which datasets are split.
            name: names the run (its id, and its folder under ``storage_path``): a new driver
                process starting a run of the same name and storage resumes it after this one
                died, from the latest checkpoint (see the docs: resuming after the driver dies).
            resume: for a named run: ``"auto"`` resumes an unfinished run of that name (and
                refuses a finished one, or one started with another config), ``"force"``
                resumes it whatever its config, ``"never"`` starts it over.
            independent: the ranks do not depend on each other: a rank that fails is replaced
                on its own and restarts from its own latest checkpoint while the others go on,
                and the stream yields each report as it arrives (a step of one report, with its
                ``rank``). ``None``: as the backend declares, else False.

        Raises:
            ConfigurationError: ``fn`` is not callable or does not pickle, the checkpoint
                directory does not exist, ``buffer_size`` is not a positive int, or ``name``
                or ``resume`` is invalid. A named run whose record refuses it (finished, or
                another config) fails with it when first iterated.
            ExecutorStateError: the executor is not started or is closed, or another run is in
                progress (leave its ``async for``, call its ``aclose()``, or let it finish).
        """
        life = self._life
        tg = life.check_open()
        spec = prepare(
            self.config,
            self.backend,
            fn,
            config,
            checkpoint=checkpoint,
            buffer_size=buffer_size,
            datasets=datasets,
            data_config=data_config,
            name=name,
            resume=resume,
            independent=independent,
        )
        previous = life.run
        if previous is not None and previous.active and not previous.closed:
            raise ExecutorStateError(
                f"run {previous.run_id} is in progress: leave its `async for` (break), call "
                "its aclose(), or let it finish first"
            )
        send, receive = anyio.create_memory_object_stream[Any](0)
        core = RunCore(spec.name or new_run_id())
        driver = RunDriver(life.slot, self.restart_policy, core, send, spec, self._run_ended)
        life.run = core
        if previous is not None:
            self._stats["steps_delivered"] += previous.delivered
        self._count("runs_started")
        tg.start_soon(driver.main, previous)
        return Run(core, receive)

    def _run_ended(self, run: RunCore) -> None:
        outcome = {RunState.FINISHED: "finished", RunState.FAILED: "failed"}
        self._count(f"runs_{outcome.get(run.state, 'cancelled')}")
        if run.result is not None:
            self._result = run.result

    def _count(self, key: str) -> None:
        if key != "runs_started":
            self._stats[key] += 1
        else:
            self._stats[key] += 1
        meters = metrics()
        if meters is not None:
            meters.runs.labels(self.config.name, key.removeprefix("runs_")).inc()

    # Calls on the live workers ----------------------------------------------------------------

    async def execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every worker; return the results in rank order.

        Works while a run is in progress (an ``async def`` runs on the worker's event loop, a
        plain function in a thread), for example to push new weights to live workers. Arguments
        travel as Ray passes them: an ``ObjectRef`` argument arrives resolved (``ray.put`` a
        large state once and pass the ref, instead of pickling it once per rank).

        ``fn`` is pickled by reference when its module can be imported on the workers, and by
        value otherwise (a function defined in ``__main__``): then it runs on a copy of its
        globals, and module-level state it changes is not the workers' state. Keep state that
        ``execute()`` updates in an importable module.

        Raises:
            WorkerRaisedError: ``fn`` raised on a rank (the lowest failing rank is reported).
            WorkerCrashedError: a worker died.
        """
        group = await self._group()
        try:
            return await group.execute(fn, *args, **kwargs)
        except (WorkerCrashedError, NodeLostError):
            await self._drop_broken(group)
            raise

    async def execute_single(
        self, rank: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``fn(*args, **kwargs)`` on one rank and return its result."""
        group = await self._group()
        try:
            return await group.execute_single(rank, fn, *args, **kwargs)
        except (WorkerCrashedError, NodeLostError):
            await self._drop_broken(group)
            raise

    async def _group(self) -> WorkerGroup:
        self._life.check_open()
        return await self._life.slot.acquire()

    async def _drop_broken(self, group: WorkerGroup) -> None:
        """A worker of the group is dead: discard the group (unless a run has already replaced
        it), so that the next call or run starts a fresh one."""
        run = self._life.run
        if run is None or not run.active:
            await self._life.slot.drop_if(group)


def slot_of(executor: Executor) -> GroupSlot:
    """The executor's slot for its group (what a weight channel reads of the executors it
    connects: their live workers, and who joins)."""
    return executor._life.slot
