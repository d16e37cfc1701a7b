"""Executor: the public entry point. Lifecycle, run(), execute(), restarts.

Entering the executor starts Ray (off the event loop, when none is running) and the worker group;
leaving it stops any run and tears the group down, also on error or cancellation. The tasks that
drive runs belong to a task group that the executor's context owns.
"""

from __future__ import annotations

import enum
import os
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.abc

from .._checkpoint import Checkpoint
from .._config import CheckpointConfig, ExecutorConfig, PlacementStrategy
from .._errors import (
    ConfigurationError,
    ExecutorStateError,
    NodeLostError,
    WorkerCrashedError,
)
from .._protocol import WorkerContext
from ..backends._base import Backend
from ._attempts import RunDriver, RunSpec
from ._interrupt import defer_interrupts, restore_interrupts
from ._logging import get_logger
from ._metrics import metrics
from ._pool import WorkerPool
from ._ray import ensure_ray
from ._reservation import Claim, Reservation
from ._restart import RestartPolicy
from ._resume import Resume
from ._run import Run, RunCore, RunState, new_run_id
from ._slot import GroupSlot
from ._spec import named_spec, run_spec
from ._stacks import DUMP_TIMEOUT_S
from ._steps import RunResult

__all__ = ["Executor", "ExecutorState", "ExecutorStatistics"]

T = TypeVar("T")
#: Defaults of the configuration, written once (in ExecutorConfig's fields).
_D = ExecutorConfig
_NOT_CONFIG = frozenset({"self", "num_workers", "backend", "restart", "pool", "reservation"})
#: Beyond the stop and shutdown bounds, what closing the executor gives a run to end.
_RUN_END_MARGIN_S = 10.0
#: The environment variable that makes executors local by default (``local=None``).
LOCAL_ENV = "ASYNCEXEC_LOCAL"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def local_default(local: object) -> bool:
    """``local`` as given, or (None) as ``ASYNCEXEC_LOCAL`` says.

    Raises:
        ConfigurationError: ``local`` is not a bool or None, or the variable is neither a
            true nor a false word.
    """
    if isinstance(local, bool):
        return local
    if local is not None:
        raise ConfigurationError(f"local must be True, False or None, got {local!r}")
    value = os.environ.get(LOCAL_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigurationError(
        f"{LOCAL_ENV} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}"
    )


def _check_local(backend: object, pool: object, reservation: object) -> None:
    """Refuse what a local executor cannot take (see ``_config._check_local`` for the rest).

    Raises:
        ConfigurationError: naming the argument, and why.
    """
    why = {
        "backend": "a framework's process group is one per process, and local workers are "
        "threads of one",
        "pool": "a pool holds Ray actors",
        "reservation": "a reservation is a Ray placement group",
    }
    for name, value in (("backend", backend), ("pool", pool), ("reservation", reservation)):
        if value is not None:
            raise ConfigurationError(
                f"a local executor (local=True, or {LOCAL_ENV}=1) takes no {name}: {why[name]}"
            )


class ExecutorState(enum.Enum):
    """Where an executor is in its life."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    RUNNING = "running"
    RESTARTING = "restarting"
    CLOSING = "closing"
    CLOSED = "closed"


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


class Executor:
    """Runs one function on a group of Ray actor workers and streams their reports.

    Use it as an async context manager::

        async with asyncexec.Executor(num_workers=4, resources_per_worker={"CPU": 0.5}) as ex:
            async for step in ex.run(train_fn, {"lr": 0.1}):
                print(step.index, step.metrics)
            print(ex.result.return_values)

    Args:
        num_workers: how many workers (Ray actors) to start; or ``(min, max)`` for an elastic
            size: each group starts with as many of ``max`` as fit in the cluster now (at least
            ``min``, which then waits for the placement deadline); a restart after a lost node
            goes on with what fits; and while a run has fewer than ``max``, it is restarted on a
            larger group from its latest checkpoint once more would fit (checked every
            ``elastic_check_interval_s``). ``get_context().world_size`` is the current size.
            Not with ``pool``, ``reservation``, ``spares`` or independent runs.
        resources_per_worker: Ray resources of each worker, ``{"CPU": 1}`` by default; ``"GPU"``,
            ``"memory"`` and custom resources (``"neuron_cores"``, ``"NPU"``) are accepted.
        backend: a :class:`asyncexec.backends.Backend` that sets a framework up across the group,
            such as :class:`asyncexec.backends.TorchBackend`.
        restart: the :class:`RestartPolicy` applied to runs (3 restarts with backoff by default).
        placement_strategy: ``"PACK"`` (few nodes) or ``"SPREAD"`` (many), or their strict forms.
        placement_timeout_s: how long the placement group may take to be ready.
        start_timeout_s: deadline for the rest of start-up (processes, set-up, backend hooks).
        shutdown_timeout_s: bound on each teardown.
        graceful_patience_s: how long workers get to exit before they are killed.
        init_hook: called on every worker at start-up, before the backend's hooks.
        share_devices: make every worker see its node's accelerators (``True``: GPUs, Neuron
            cores and Ascend NPUs), ``False`` for none, or a collection of kinds (``{"GPU"}``).
        buffer_size: reports a rank may have outstanding before ``report()`` waits; a run may
            override it.
        health_check_interval_s: how often workers are pinged (``None`` disables pings).
        health_check_timeout_s: a worker that does not answer a ping within this is hung.
        step_timeout_s: a rank that does not report within this (while not held back by the
            consumer) is hung; ``None`` (default) for no deadline.
        stop_timeout_s: how long a stopped run's functions get to end before the group is
            discarded.
        storage_path: where checkpoints are persisted, one folder per run
            (``~/asyncexec_results`` by default); must be reachable from every worker.
        checkpoint: which persisted checkpoints are kept (:class:`CheckpointConfig`).
        address: the Ray cluster to join when Ray is not initialized (``"auto"``); a local Ray is
            started when it is None.
        runtime_env: Ray runtime environment of the workers.
        name: a name for logs.
        pool: a :class:`WorkerPool` to lease warm workers from instead of starting processes;
            they go back to it when the executor closes or replaces its group. The pool's
            placement group decides where they are (``placement_strategy`` does not apply);
            ``resources_per_worker`` and ``runtime_env`` default to the pool's.
        spares: standby workers kept started beside the group (from the pool, or in the
            executor's placement group): when a rank crashes or hangs, a spare on its node takes
            its place and the other ranks are kept (their functions are stopped and the attempt
            restarts from the checkpoint), instead of a new group starting. A new spare is then
            started in the background.
        reservation: a :class:`Reservation` to place the workers on instead of a placement group
            of the executor's own: rank i (spares after the ranks) on its bundle i, sharing it
            with the rank i of every other executor on it. Entering the executor claims
            ``resources_per_worker`` on each bundle it uses (refused when it would overfill
            one); closing gives the claim back. ``placement_strategy`` does not apply.
        elastic_check_interval_s: how often a run of an elastic executor with fewer than its
            maximum of workers checks whether more would fit (10 s by default).
        local: local mode, for debugging and for tests without a cluster: the ``num_workers``
            ranks are threads of this process instead of Ray actors (Ray is not started), with
            the same context, reports, checkpoints, errors, restarts and ``execute()``; a
            debugger stops in the function. No process isolation, devices or resources; no
            backend, datasets, pool, reservation, spares, elastic size, ``runtime_env`` or
            weight channel. ``None`` (default): local when the ``ASYNCEXEC_LOCAL``
            environment variable is ``1``.
    """

    def __init__(
        self,
        num_workers: int | tuple[int, int],
        *,
        resources_per_worker: Mapping[str, float] | None = None,
        backend: Backend | None = None,
        restart: RestartPolicy | None = None,
        placement_strategy: PlacementStrategy = _D.placement_strategy,
        placement_timeout_s: float = _D.placement_timeout_s,
        start_timeout_s: float = _D.start_timeout_s,
        shutdown_timeout_s: float = _D.shutdown_timeout_s,
        graceful_patience_s: float = _D.graceful_patience_s,
        init_hook: Callable[[], object] | None = None,
        share_devices: bool | Collection[str] = True,
        buffer_size: int = _D.buffer_size,
        health_check_interval_s: float | None = _D.health_check_interval_s,
        health_check_timeout_s: float = _D.health_check_timeout_s,
        step_timeout_s: float | None = _D.step_timeout_s,
        stop_timeout_s: float = _D.stop_timeout_s,
        storage_path: str | os.PathLike[str] | None = None,
        checkpoint: CheckpointConfig | None = None,
        address: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        name: str = _D.name,
        pool: WorkerPool | None = None,
        spares: int = _D.spares,
        reservation: Reservation | None = None,
        elastic_check_interval_s: float = _D.elastic_check_interval_s,
        local: bool | None = None,
    ) -> None:
        # Every keyword argument but these is a field of the configuration.
        options = {k: v for k, v in locals().items() if k not in _NOT_CONFIG}
        options["local"] = local_default(local)
        if options["local"]:
            _check_local(backend, pool, reservation)
        if pool is not None:
            if not isinstance(pool, WorkerPool):
                raise ConfigurationError(f"pool must be an asyncexec.WorkerPool, got {pool!r}")
            # Workers of the pool's shape, unless the caller says otherwise (then checked).
            for key in ("resources_per_worker", "runtime_env"):
                if options[key] is None:
                    options[key] = getattr(pool.config, key)
        self.config = ExecutorConfig.build(num_workers, **options)
        if self.config.elastic and (pool is not None or reservation is not None):
            raise ConfigurationError(
                f"an elastic executor (num_workers={num_workers!r}) takes no "
                f"{'pool' if pool is not None else 'reservation'}: its groups are placed "
                "in placement groups of their own size"
            )
        if pool is not None:
            pool.check_shape(self.config)
        if reservation is not None:
            if not isinstance(reservation, Reservation):
                raise ConfigurationError(
                    f"reservation must be an asyncexec.Reservation, got {reservation!r}"
                )
            if pool is not None:
                raise ConfigurationError(
                    "an executor takes a pool or a reservation, not both: "
                    "to lease from the reservation, build the pool on it"
                )
        self.pool = pool
        self.reservation = reservation
        self._claim: Claim | None = None
        if backend is not None and not isinstance(backend, Backend):
            raise ConfigurationError(
                f"backend must be an asyncexec.backends.Backend, got {backend!r}"
            )
        if restart is not None and not isinstance(restart, RestartPolicy):
            raise ConfigurationError(f"restart must be a RestartPolicy, got {restart!r}")
        self.backend = backend
        self.restart_policy = restart if restart is not None else RestartPolicy()
        self.id = uuid.uuid4().hex[:8]
        self.log = get_logger(executor=f"{name}-{self.id}")
        self._state = ExecutorState.NEW
        self._tg: anyio.abc.TaskGroup | None = None
        self._slot = GroupSlot(self.config, backend, self.log, pool, reservation)
        #: What runs before a run's functions start on a group (see WeightChannel).
        self._joiners: list[Callable[[Any], Awaitable[None]]] = []
        self._slot.joiners = self._joiners
        self._run: RunCore | None = None
        self._result: RunResult | None = None
        self._closed = anyio.Event()
        self._interrupts = False  # whether this executor defers SIGINT (see _interrupt)
        self._stats = {
            "runs_started": 0,
            "runs_finished": 0,
            "runs_failed": 0,
            "runs_cancelled": 0,
            "steps_delivered": 0,
        }

    def __repr__(self) -> str:
        return (
            f"<Executor {self.config.name}-{self.id} {self.state.value} "
            f"workers={self._size()}>"
        )

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> Executor:
        if self._state is ExecutorState.CLOSED:
            # A closed executor may be entered again: it starts a fresh group.
            self._closed = anyio.Event()
            self._slot = GroupSlot(
                self.config, self.backend, self.log, self.pool, self.reservation
            )
            self._slot.joiners = self._joiners
            self._run = None
        elif self._state is not ExecutorState.NEW:
            raise ExecutorStateError(f"the executor is already {self._state.value}")
        self._state = ExecutorState.STARTING
        self._interrupts = defer_interrupts()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._slot.tg = self._tg
        try:
            if not self.config.local:
                await ensure_ray(self.config.address)
            if self.reservation is not None:
                self._claim = self.reservation.claim(
                    f"executor {self.config.name!r}",
                    self.config.num_workers + self.config.spares,
                    self.config.resources_per_worker,
                )
            await self._slot.acquire()
            self._state = ExecutorState.READY
        except BaseException:
            self._release_claim()
            self._state = ExecutorState.CLOSED
            self._closed.set()
            try:
                # Exit the task group in this task's own scope (no shield around it: anyio
                # requires the group's scope to be the innermost one). It has no tasks yet.
                await self._tg.__aexit__(None, None, None)
            finally:
                self._restore_interrupts()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        finally:
            if self._tg is not None:
                tg, self._tg = self._tg, None
                # What is left (a spare still starting in the background, a run task that
                # outlived aclose()'s bound) is cancelled: leaving never waits without a bound.
                tg.cancel_scope.cancel()
                try:
                    await tg.__aexit__(None, None, None)
                finally:
                    self._restore_interrupts()

    async def aclose(self, *, force: bool = False) -> None:
        """Stop any run and tear the group down; ``force`` skips the graceful part. Shielded,
        bounded and idempotent: afterwards no actor or placement group of this executor is left."""
        if self._state in (ExecutorState.CLOSING, ExecutorState.CLOSED):
            with anyio.CancelScope(shield=True):
                await self._closed.wait()
            return
        self._state = ExecutorState.CLOSING
        self._slot.closing = True
        with anyio.CancelScope(shield=True):
            run = self._run
            if run is not None:
                run.cancel()
                bound = self.config.stop_timeout_s + self.config.shutdown_timeout_s
                bound += DUMP_TIMEOUT_S  # the stacks of functions that did not stop
                with anyio.move_on_after(bound + _RUN_END_MARGIN_S):
                    await run.finished.wait()
            await self._slot.discard(force=force)
        self._release_claim()
        self._state = ExecutorState.CLOSED
        self._closed.set()
        self.log.info("executor_closed")

    def _independent(self, spec: RunSpec) -> RunSpec:
        """A run of independent ranks, if this executor can run one.

        Raises:
            ConfigurationError: the backend's ranks depend on each other, or datasets.
        """
        if self.backend is not None and not self.backend.independent_ranks:
            raise ConfigurationError(
                f"the {self.backend.name} backend's ranks depend on each other: a run with it "
                "cannot be independent"
            )
        if spec.datasets is not None:
            raise ConfigurationError("a run of independent ranks does not take datasets")
        return replace(spec, independent=True)

    def _restore_interrupts(self) -> None:
        if self._interrupts:
            self._interrupts = False
            restore_interrupts()

    def _release_claim(self) -> None:
        if self._claim is not None and self.reservation is not None:
            self.reservation.release(self._claim)
        self._claim = None

    def _check_open(self) -> anyio.abc.TaskGroup:
        if self._state is ExecutorState.NEW:
            raise ExecutorStateError("the executor is not started: use `async with Executor(...)`")
        if self._state in (ExecutorState.CLOSING, ExecutorState.CLOSED) or self._tg is None:
            raise ExecutorStateError("the executor is closed")
        return self._tg

    def _run_active(self) -> bool:
        return self._run is not None and self._run.active

    def _run_ended(self, run: RunCore) -> None:
        key = {
            RunState.FINISHED: "runs_finished",
            RunState.FAILED: "runs_failed",
        }.get(run.state, "runs_cancelled")
        self._stats[key] += 1
        meters = metrics()
        if meters is not None:
            meters.runs.labels(self.config.name, key.removeprefix("runs_")).inc()
        if run.result is not None:
            self._result = run.result

    # Public API -------------------------------------------------------------------------------

    @property
    def state(self) -> ExecutorState:
        """Where the executor is: new, starting, ready, running, restarting, closing, closed."""
        if self._state is not ExecutorState.READY:
            return self._state
        if self._slot.starting is not None:
            return ExecutorState(self._slot.starting)
        run = self._run
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
        group = self._slot.group
        return [] if group is None else group.contexts

    def _size(self) -> int:
        """The live group's size, else the configured one (an elastic executor's maximum)."""
        group = self._slot.group
        return self.config.num_workers if group is None else len(group.workers)

    def statistics(self) -> ExecutorStatistics:
        """A snapshot of the executor's counters (``steps_delivered`` counts the steps taken
        from every run, the one in progress included)."""
        stats = dict(self._stats)
        if self._run is not None:
            stats["steps_delivered"] += self._run.delivered
        return ExecutorStatistics(
            state=self.state,
            num_workers=self._size(),
            group_starts=self._slot.starts,
            restarts=self._slot.restarts,
            resizes=self._slot.resizes,
            **stats,
        )

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
            name: names the run (its id, and its folder under ``storage_path``): a named run
                keeps a record there (latest checkpoint, steps delivered, attempt, the config's
                fingerprint) so that a new driver process starting a run of the same name and
                storage resumes it after this one died: from the latest checkpoint, with the
                step index and the attempt going on.
            independent: the ranks do not depend on each other (rollouts, evaluation, data
                generation): a rank that fails is replaced on its own (a standby spare, or a
                fresh process in its bundle) and restarts from its own latest checkpoint while
                the others go on, and the stream yields each report as soon as it arrives, as a
                step of one report with its ``rank``. ``None``: as the backend declares
                (``Backend.independent_ranks``), else False.
            resume: for a named run: ``"auto"`` resumes an unfinished run of that name (and
                refuses a finished one, or one started with another config), ``"force"``
                resumes it whatever its config, ``"never"`` starts it over.

        Raises:
            ConfigurationError: ``fn`` is not callable or does not pickle, the checkpoint
                directory does not exist, ``buffer_size`` is not a positive int, or ``name``
                or ``resume`` is invalid. A named run whose record refuses it (finished, or
                another config) fails with it when first iterated.
            ExecutorStateError: the executor is not started or is closed, or another run is in
                progress.
        """
        tg = self._check_open()
        bound = self.config.buffer_size if buffer_size is None else buffer_size
        if self.config.local and (datasets is not None or data_config is not None):
            raise ConfigurationError("a local executor takes no datasets: Ray Data needs Ray")
        spec = run_spec(fn, config, checkpoint, bound, datasets, data_config)
        if name is not None or resume != "auto":
            spec = named_spec(spec, name, resume, config)
        if independent is None:
            independent = bool(self.backend is not None and self.backend.independent_ranks)
        if independent:
            spec = self._independent(spec)
            if self.config.elastic:
                raise ConfigurationError("an elastic executor does not run independent ranks")
        if self._run is not None and self._run.active and not self._run.closed:
            raise ExecutorStateError(
                f"run {self._run.run_id} is in progress: leave its `async for` (break), call "
                "its aclose(), or let it finish first"
            )
        send, receive = anyio.create_memory_object_stream[Any](0)
        core = RunCore(spec.name or new_run_id())
        driver = RunDriver(self._slot, self.restart_policy, core, send, spec, self._run_ended)
        previous, self._run = self._run, core
        if previous is not None:
            self._stats["steps_delivered"] += previous.delivered
        self._stats["runs_started"] += 1
        meters = metrics()
        if meters is not None:
            meters.runs.labels(self.config.name, "started").inc()
        tg.start_soon(driver.main, previous)
        return Run(core, receive)

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
        self._check_open()
        group = await self._slot.acquire()
        try:
            return await group.execute(fn, *args, **kwargs)
        except (WorkerCrashedError, NodeLostError):
            await self._drop_broken(group)
            raise

    async def execute_single(
        self, rank: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``fn(*args, **kwargs)`` on one rank and return its result."""
        self._check_open()
        group = await self._slot.acquire()
        try:
            return await group.execute_single(rank, fn, *args, **kwargs)
        except (WorkerCrashedError, NodeLostError):
            await self._drop_broken(group)
            raise

    async def _drop_broken(self, group: Any) -> None:
        """A worker of the group is dead: discard the group (unless a run has already replaced
        it), so that the next call or run starts a fresh one."""
        if not self._run_active():
            await self._slot.drop_if(group)
