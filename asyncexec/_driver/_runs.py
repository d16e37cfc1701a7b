"""What an executor does with runs: start one (``run()``), count them (``statistics()``), and
keep the last one's result."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from .._errors import ExecutorStateError
from .._logging import Logger
from .._wire._checkpoint import Checkpoint
from ..backends._base import Backend
from ._config import ExecutorConfig
from ._events import RunStarted
from ._lifecycle import ExecutorState, Lifecycle
from ._loads import Loads
from ._restart import RestartPolicy
from ._retention import Retention
from ._sinks import ExecutorCounts
from .run import Resume, Run, RunCore, RunDriver, RunResult, new_run_id, prepare

__all__ = ["ExecutorRuns", "ExecutorStatistics"]


@dataclass(frozen=True)
class ExecutorStatistics:
    """Counters of an executor, from :meth:`Executor.statistics` (over its whole life: a closed
    executor entered again goes on counting from its lives before)."""

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
    #: Restarts after a preemption (workers lost with a node the cluster had drained), counted
    #: apart from ``restarts``: of the group, or of one rank of an independent run.
    preemptions: int = 0
    #: Calls sent to a rank by ``call()``, ``stream()`` and ``execute()`` (a call to N ranks
    #: counts N; a call sent again counts again).
    calls: int = 0
    #: Idempotent calls (``least_loaded(retry=True)``) sent again after their rank died.
    resends: int = 0
    #: Dead ranks that got a fresh process in their place outside a run.
    renewed_ranks: int = 0
    #: Calls chosen by load (``least_loaded()``) in flight on each rank of the live group.
    in_flight: tuple[int, ...] = ()


class ExecutorRuns:
    """The runs of an :class:`asyncexec.Executor` (see the module's docstring)."""

    config: ExecutorConfig
    backend: Backend | None
    restart_policy: RestartPolicy
    _life: Lifecycle
    _loads: Loads
    _counts: ExecutorCounts
    log: Logger

    def _init_runs(self) -> None:
        self._result: RunResult | None = None
        self._retention = Retention(self.config, self.log)

    @property
    def state(self) -> ExecutorState:
        raise NotImplementedError

    def _size(self) -> int:
        raise NotImplementedError

    @property
    def result(self) -> RunResult:
        """The result of the last run that finished.

        Raises:
            ExecutorStateError: no run has finished yet.
        """
        if self._result is None:
            raise ExecutorStateError("no run has finished on this executor")
        return self._result

    def statistics(self) -> ExecutorStatistics:
        """A snapshot of the executor's counters (``steps_delivered`` counts the steps taken
        from every run, the one in progress included)."""
        counts = dict(self._counts.counts)  # the statistics sink's (see ``_sinks``)
        if self._life.run is not None:
            counts["steps_delivered"] += self._life.run.delivered
        slot = self._life.slot
        starts, restarts, resizes = self._life.earlier  # (of its lives before this one)
        return ExecutorStatistics(
            state=self.state,
            num_workers=self._size(),
            group_starts=starts + slot.starts,
            restarts=restarts + slot.restarts,
            resizes=resizes + slot.resizes,
            in_flight=self._loads.in_flight(slot.group),
            **counts,
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
        self._retention.started(core.run_id, named=spec.name is not None)
        driver = RunDriver(life.slot, self.restart_policy, core, send, spec, self._run_ended)
        life.run = core
        tg.start_soon(self._retention.mark, core.run_id)
        tg.start_soon(driver.main, previous)
        # Here, not in the run's task: from now on statistics() adds this run's steps instead
        # of the previous run's, which must be counted by then (with no await between).
        try:
            core.observer.emit(RunStarted(previous.delivered if previous is not None else 0))
        except BaseException:
            # A sink that raises (a processor of the application's logging, under the
            # run_started line) raises here: the run is stopped before it begins (its task
            # ends it as cancelled and tears it down), so that the next run does not wait for
            # it for ever.
            core.cancel()
            receive.close()
            raise
        return Run(core, receive)

    def _run_ended(self, run: RunCore) -> None:
        if run.result is not None:
            self._result = run.result
