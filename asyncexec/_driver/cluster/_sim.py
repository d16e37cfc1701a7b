r"""Simulated workers, for measuring the driver with thousands of ranks: the seam's third
implementation (see ``_base``), beside Ray's and local mode's.

A :class:`SimCluster`'s workers are small objects on the driver's own event loop: no process, no
thread and no event loop per rank. They implement the worker's interface
(``asyncexec._wire._interface``: ``describe``, ``setup``, ``start_run``, ``poll``, ``make_roles``,
``call_role``, ...) with the worker protocol's records; they make the group's role instances and
run their methods, and ``execute()``'s functions, on the driver's loop (``_sim_roles``: dispatch
at thousands of ranks); weight channels they refuse. The function a run "runs" is not the run's:
each rank reports at a fixed rate (:class:`SimLoad`), one report every ``1 / rate`` seconds of its
own work, waits for credit as ``report()`` does, and returns its rank after ``reports`` reports.
Reports are made lazily: a poll takes what its rank has reported by now, and a poll that finds
nothing waits on one timer, set for the rank's next report. Every answer crosses a pickle round
trip, as an actor's result does: dumped by the worker, loaded by the driver when it awaits it.
The user's arguments (``execute()``'s, a role method's) are dumped to check that Ray could send
them (one that does not pickle is refused as Ray's handle refuses it), and handed over as they
are.

What the simulated workers cost (making reports, answering calls, dumping answers, their timers)
is timed (:meth:`SimCluster.statistics`), so that a benchmark can subtract it from the process's
CPU time and keep the driver's own. A garbage collection that falls into their time is not
theirs: it is the whole process's (their objects stand for the ones Ray's calls would make), and
it is counted apart (``gc_s``) and left to the driver.

Users reach it through :mod:`asyncexec.testing` (``SimCluster``, ``SimLoad`` and
``simulated()``), to test their loops without Ray; the benchmarks and this project's tests too.
An object runs on it when it is handed in (``Executor(4, cluster=SimCluster())``, see
``_choice``), or made inside ``simulated()`` (the context's default); no configuration selects
it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import numbers
import time
import weakref
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ..._errors import ConfigurationError
from ..._wire._interface import WORKER_METHODS, WorkerInterface, WorkerMethod
from ..._wire._protocol import Outcome, Poll, ReportTimes, RunStart, WorkerMetadata
from ..._worker import Place, error_outcome
from .._config import ExecutorConfig, check_count
from ._base import Handle, PendingResult, Spawned
from ._inprocess import InProcessCluster
from ._local import LocalCallCancelled, LocalWorkerGone
from ._placement import Placement
from ._sim_answers import Pending, Ready, dumped, ready
from ._sim_roles import SimCalls

__all__ = ["GcClock", "SimCluster", "SimLoad", "SimStatistics", "SimWorker"]

#: The fake process ids of simulated workers start here.
_PID_BASE = 1_000_000


@dataclass(frozen=True)
class SimLoad:
    """What every simulated rank does in a run, in place of the run's function: it reports
    ``{"rank": r, "i": k}`` ``reports`` times at ``rate`` reports a second (waiting for credit
    as ``report()`` does), then returns its rank.

    Args:
        reports: how many reports each rank makes in an attempt before it returns its rank.
        rate: reports per second of each rank's own work (it waits for credit on top).
        slow: ranks made slower on purpose: rank -> how many times longer its steps take.
        tagged: each report is ``{"rank": r, "i": k}`` (k counts from 0 in each attempt); else
            all are one shared empty dict (the cheapest report).
        spread: the ranks' reports fall at different moments, spread evenly over a period (as
            real ranks' do); else every rank reports at once.
        slow_from: the ranks in ``slow`` are slow from this step on (each attempt's count).

    Raises:
        ConfigurationError: ``reports`` or ``slow_from`` is not an int of at least 0, ``rate``
            or a factor in ``slow`` is not a number above zero (NaN is not).
    """

    reports: int = 100
    rate: float = 100.0
    slow: Mapping[int, float] = field(default_factory=dict)
    tagged: bool = True
    spread: bool = True
    slow_from: int = 0

    def __post_init__(self) -> None:
        # Refused here, not when a run starts: a negative count or a NaN rate made ranks that
        # never finished (the run hung), a zero rate a ZeroDivisionError from the run.
        check_count("SimLoad(reports=...)", self.reports, minimum=0)
        _check_above_zero("SimLoad(rate=...)", self.rate)
        check_count("SimLoad(slow_from=...)", self.slow_from, minimum=0)
        if not isinstance(self.slow, Mapping):
            raise ConfigurationError(
                f"SimLoad(slow=...) must map ranks to factors, got {self.slow!r}"
            )
        for rank, factor in self.slow.items():
            _check_above_zero(f"SimLoad(slow={{{rank!r}: ...}})", factor)


def _check_above_zero(name: str, value: object) -> None:
    """Refuse anything but a number above zero (not a bool, not NaN; infinity is one: a rate
    of reports at once, a rank slowed to never report).

    Raises:
        ConfigurationError: naming ``name`` and the value.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not float(value) > 0:
        raise ConfigurationError(f"{name} must be a number above zero, got {value!r}")


class SimStatistics(NamedTuple):
    """What the simulated workers did, the time they took on the driver's thread (garbage
    collections left out), and the time the process spent in garbage collections since the
    cluster was made.

    Attributes:
        spent_s: the simulated workers' time on the driver's thread, in seconds.
        workers: how many workers the cluster made.
        reports: how many reports they made.
        polls: how many polls for reports they answered.
        calls: how many calls they answered, of every kind.
        gc_s: the process's time in garbage collections since the cluster was made.
    """

    spent_s: float
    workers: int
    reports: int
    polls: int
    calls: int
    gc_s: float


class GcClock:
    """The time the process spends in garbage collections (a ``gc.callbacks`` entry, while a
    simulated cluster lives)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._started


def _unhook(clock: GcClock) -> None:
    """Stop counting garbage collections on ``clock`` (its cluster is gone)."""
    with contextlib.suppress(ValueError):
        gc.callbacks.remove(clock)


_EMPTY: dict[str, Any] = {}
_GOLDEN = 0.6180339887498949


class _SimRun:
    """One attempt of a run on one simulated rank: its reports, made at a fixed rate."""

    __slots__ = (
        "ack",
        "blocked",
        "bound",
        "buffer",
        "busy",
        "calls",
        "made",
        "next_at",
        "outcome",
        "period",
        "rank",
        "slow_from",
        "slow_period",
        "tagged",
        "timer",
        "total",
        "waiting",
        "worker",
    )

    def __init__(self, worker: SimWorker, rank: int, load: SimLoad, bound: int) -> None:
        self.worker = worker
        self.rank = rank
        self.slow_period = load.slow.get(rank, 1.0) / load.rate
        self.slow_from = load.slow_from
        self.period = self.slow_period if load.slow_from == 0 else 1.0 / load.rate
        self.total = load.reports
        self.bound = bound
        self.tagged = load.tagged
        # When the next report() is called: a period on, and a fraction of one that differs
        # between ranks (spread evenly by the golden ratio) when the load spreads them.
        phase = (rank * _GOLDEN) % 1.0 if load.spread else 0.0
        self.next_at = time.monotonic() + self.period * (1.0 + phase)
        self.blocked = False  # that report() waits for credit
        self.made = 0
        self.ack = 0
        self.buffer: list[dict[str, Any]] = []
        self.calls: array[float] = array("d")
        self.busy: array[float] = array("d")
        self.outcome: Outcome | None = None if self.total else Outcome("ok", rank)
        self.waiting: tuple[Pending, int] | None = None  # a poll, and how much it takes
        self.timer: asyncio.TimerHandle | None = None

    def _make(self, at: float) -> None:
        self.buffer.append({"rank": self.rank, "i": self.made} if self.tagged else _EMPTY)
        self.calls.append(at)
        self.busy.append(self.period)
        self.made += 1
        if self.made == self.slow_from:
            self.period = self.slow_period
        if self.made == self.total:
            self.outcome = Outcome("ok", self.rank)

    def advance(self, now: float) -> None:
        """Make every report the function has made by ``now``, as credit allows."""
        while not self.blocked and self.made < self.total and self.next_at <= now:
            if self.made - self.ack >= self.bound:
                self.blocked = True
                break
            self._make(self.next_at)
            self.next_at += self.period

    def acknowledge(self, ack: int, now: float) -> None:
        """The consumer has taken ``ack`` steps: a report() waiting for credit goes on."""
        self.ack = max(self.ack, ack)
        if self.blocked and self.made - self.ack < self.bound:
            self.blocked = False
            self._make(self.next_at)
            self.next_at = now + self.period

    def take(self, max_items: int, now: float) -> Poll:
        buffer = self.buffer
        n = min(len(buffer), max_items)
        items, calls, busy = buffer[:n], self.calls[:n], self.busy[:n]
        del buffer[:n], self.calls[:n], self.busy[:n]
        outcome = self.outcome if not buffer else None
        times = ReportTimes(calls, busy, now).pack() if items else None
        self.worker.cluster.reports += n
        return Poll(items, None, outcome, None, times)

    def poll(self, ack: int, max_items: int) -> Awaitable[Any]:
        now = time.monotonic()
        self.acknowledge(ack, now)
        self.advance(now)
        if self.buffer or self.outcome is not None:
            return ready(self.take(max_items, now))
        pending = Pending()
        self.waiting = (pending, max_items)
        if not self.blocked:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_at(self.next_at, self.worker.cluster.timed, self._wake)
        return pending

    def _wake(self) -> None:
        self.timer = None
        if self.waiting is None:
            return
        now = time.monotonic()
        self.advance(now)
        if self.buffer or self.outcome is not None:
            pending, max_items = self.waiting
            self.waiting = None
            pending.answer(self.take(max_items, now))
        elif not self.blocked:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_at(self.next_at, self.worker.cluster.timed, self._wake)

    def stop(self, error: BaseException | None = None) -> None:
        """The function is stopped (or its worker killed: ``error`` fails a waiting poll)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.outcome is None:
            self.outcome = Outcome("stopped")
        self.total = self.made
        if self.waiting is not None:
            pending, max_items = self.waiting
            self.waiting = None
            if error is not None:
                pending.fail(error)
            else:
                pending.answer(self.take(max_items, time.monotonic()))

    @property
    def finished(self) -> bool:
        return self.outcome is not None


class SimWorker(SimCalls):
    """One simulated worker: answers the driver's calls (see the module's docstring); what
    runs the user's code (calls, roles, hooks) is :class:`~._sim_roles.SimCalls`'."""

    __slots__ = (
        "_closed",
        "_run",
        "cancelled",
        "cluster",
        "gone",
        "index",
        "metadata",
        "place",
        "tasks",
    )
    cluster: SimCluster

    def __init__(self, cluster: SimCluster, index: int, metadata: WorkerMetadata) -> None:
        self.cluster = cluster
        self.index = index
        self.metadata = metadata
        self.gone = False
        self.place = Place()
        self.tasks = {}
        self.cancelled = set()
        self._run: _SimRun | None = None
        #: The pending ``wait_closed`` calls; None once the worker has closed.
        self._closed: list[Pending] | None = []

    def __repr__(self) -> str:
        return f"<SimWorker {self.index} {'gone' if self.gone else 'live'}>"

    @property
    def key(self) -> str:
        return f"sim-{self.index}"

    def call(self, method: WorkerMethod, /, *args: Any, **kwargs: Any) -> PendingResult:
        """Answer the worker's ``method`` (timed as the simulated workers' cost)."""
        cluster = self.cluster
        t0, gc0 = time.thread_time(), cluster.gc_clock.total
        cluster.calls += 1
        try:
            if self.gone:
                return Ready(None, LocalWorkerGone(f"the simulated worker {self.index} is gone"))
            answer = _METHODS.get(method)
            if answer is None:
                error = NotImplementedError(f"a simulated worker has no method {method!r}")
                return Ready(None, error)
            if method in _USERS_ARGUMENTS:
                _check_sent(args, kwargs)
            return cast(PendingResult, answer(self, *args, **kwargs))
        finally:
            cluster.spend(t0, gc0)

    def call_n(self, method: WorkerMethod, n: int, /, *args: Any) -> list[Any]:
        raise NotImplementedError("a simulated worker's results are not references")

    def cancel(self, ref: Any) -> None:
        """Cancel the coroutine of the call whose answer is ``ref`` (as Ray cancels an async
        actor's task, started or not); its answer fails with ``LocalCallCancelled`` once it
        has ended (a ``wait_closed`` at once)."""
        for task, pending in self.tasks.items():
            if pending is ref:
                self.cancelled.add(task)
                task.cancel()
                return
        closed = self._closed or []
        if any(ref is waiting for waiting in closed):  # a ``wait_closed`` (an async call)
            self._closed = [waiting for waiting in closed if waiting is not ref]
            ref.fail(LocalCallCancelled(f"the call was cancelled on {self!r}"))

    # The worker's methods ---------------------------------------------------------------------

    def describe(self) -> Awaitable[WorkerMetadata]:
        return ready(self.metadata)

    def start_run(self, payload: bytes, start: RunStart) -> Awaitable[None]:
        if self._run is not None and not self._run.finished:
            return Ready(None, RuntimeError("a run is still in progress on this worker"))
        rank = start.context.world_rank
        self._run = _SimRun(self, rank, self.cluster.load, start.buffer_size)
        return ready(None)

    def poll(self, ack: int, max_items: int) -> Awaitable[Poll]:
        if self._run is None:
            return Ready(None, RuntimeError("poll() before start_run()"))
        self.cluster.polls += 1
        return self._run.poll(ack, max_items)

    def salvage(self) -> Awaitable[Poll | None]:
        return ready(None)

    def buffered(self) -> Awaitable[int]:
        return ready(0 if self._run is None else len(self._run.buffer))

    def stop_run(self, timeout_s: float) -> Awaitable[bool]:
        if self._run is not None:
            self._run.stop()
        return ready(True)

    def reset(
        self, stop_timeout_s: float, reset_hook: Callable[[], object] | None
    ) -> Awaitable[Outcome]:
        if self._run is not None:
            self._run.stop()
            self._run = None
        return self._later(self._reset(reset_hook), outcome=True)

    async def _reset(self, reset_hook: Callable[[], object] | None) -> Outcome:
        closing = await self.drop_roles()
        self.forget()
        if closing:  # (as the actor: not a worker to reuse)
            return error_outcome(closing[0])
        if reset_hook is None:
            return Outcome("ok")
        return await self._call_here(reset_hook, (), {})

    def ping(self) -> Awaitable[int]:
        return ready(self.metadata.pid)

    def wait_closed(self) -> Awaitable[None]:
        if self._closed is None:
            return ready(None)
        waiting = Pending()
        self._closed.append(waiting)
        return waiting

    def close(self) -> Awaitable[None]:
        return self._later(self._close())

    async def _close(self) -> None:
        try:
            await self.drop_roles()
        finally:
            closed, self._closed = self._closed or [], None
            for waiting in closed:
                waiting.answer(None)

    def kill(self) -> None:
        """The worker is gone: its pending calls fail, as a dead actor's do."""
        if self.gone:
            return
        self.gone = True
        self.cluster._drop(self)
        error = LocalWorkerGone(f"the simulated worker {self.index} was killed")
        if self._run is not None:
            self._run.stop(error)
        closed, self._closed = self._closed or [], []
        for waiting in closed:
            waiting.fail(error)
        self.fail_tasks(error)


#: The methods whose arguments are the user's (``execute()``'s function, a role method's).
_USERS_ARGUMENTS = frozenset({"execute", "call_method", "call_method_sync", "call_role"})


def _check_sent(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse arguments that Ray could not send, as Ray's handle refuses them (the seam
    names the first that does not pickle); they are handed over as they are.

    Raises:
        TypeError: an argument does not pickle.
    """
    try:
        dumped((args, kwargs))
    except Exception as exc:
        raise TypeError(f"an argument of the call cannot be pickled: {exc}") from exc


#: The worker interface's methods.
_METHODS: dict[str, Callable[..., Awaitable[Any]]] = {
    name: getattr(SimWorker, name) for name in sorted(WORKER_METHODS)
}
if TYPE_CHECKING:  # the simulated worker's methods are the interface's (mypy checks them)
    _IMPLEMENTS: type[WorkerInterface] = SimWorker


class SimCluster(InProcessCluster):
    """Simulated workers, for tests and benchmarks without Ray: executors handed it
    (``Executor(4, cluster=cluster)``), and those made inside
    :func:`~asyncexec.testing.simulated`, put their ranks here.

    Each worker is a small object on the driver's own event loop (no process, thread or loop
    of its own), ``ranks_per_node`` of them a node, each holding one GPU id of its node
    (``gpus``; nothing is reserved). ``execute()``, ``call()`` and the roles' methods run your
    code on them; a run's function does not run: each rank reports as :attr:`load` says.
    Weight channels are refused (``WeightChannel``): give the pipeline's states to
    ``Pipeline.update_weights(state)`` instead.

    Args:
        load: what each rank does in a run (:class:`SimLoad`'s defaults when None).
        ranks_per_node: how many workers make a node (their ``node_id`` and ``local_rank``).
        gpus: each worker holds the GPU id of its place in its node (``accelerator_ids``).

    Raises:
        ConfigurationError: ``ranks_per_node`` is not a positive int.

    Attributes:
        load: what the ranks do in the runs started from now on (it may be changed between
            runs).
    """

    def __init__(
        self, load: SimLoad | None = None, *, ranks_per_node: int = 8, gpus: bool = True
    ) -> None:
        check_count("SimCluster(ranks_per_node=...)", ranks_per_node)
        #: What the ranks' functions do in the runs started from now on.
        self.load = load if load is not None else SimLoad()
        self.ranks_per_node = ranks_per_node
        self.gpus = gpus
        self.spent = 0.0
        #: Counts the process's garbage collections while the cluster lives.
        self.gc_clock = GcClock()
        gc.callbacks.append(self.gc_clock)
        weakref.finalize(self, _unhook, self.gc_clock)
        self.reports = 0
        self.polls = 0
        self.calls = 0
        self._numbers = itertools.count()
        self._workers = 0
        #: The live workers by their (fake) process id, for :meth:`crash`.
        self._live: dict[int, SimWorker] = {}

    def __repr__(self) -> str:
        return f"<SimCluster workers={self._workers} {self.load!r}>"

    def crash(self, pid: int) -> None:
        """Kill the simulated worker whose process id is ``pid`` (``executor.workers[r].pid``),
        as a SIGKILL ends a Ray actor's process: the calls it holds fail with
        ``WorkerCrashedError``, and a run in progress restarts under the executor's policy.

        Raises:
            LookupError: no live simulated worker has that process id.
        """
        worker = self._live.get(pid)
        if worker is None:
            raise LookupError(f"no live simulated worker has the process id {pid}")
        worker.kill()

    def _drop(self, worker: SimWorker) -> None:
        """``worker`` was killed (by the driver, or :meth:`crash`)."""
        self._live.pop(worker.metadata.pid, None)

    def statistics(self) -> SimStatistics:
        """What the simulated workers did so far, and the time they took."""
        return SimStatistics(
            self.spent, self._workers, self.reports, self.polls, self.calls, self.gc_clock.total
        )

    def spend(self, t0: float, gc0: float) -> None:
        """Count the time since ``t0`` as the simulated workers', but for the garbage
        collections since ``gc0``."""
        self.spent += time.thread_time() - t0 - (self.gc_clock.total - gc0)

    def timed(self, callback: Callable[[], None]) -> None:
        """Run a simulated worker's ``callback`` (a timer's), timed as theirs."""
        t0, gc0 = time.thread_time(), self.gc_clock.total
        try:
            callback()
        finally:
            self.spend(t0, gc0)

    def node_of(self, index: int) -> str:
        return f"sim-node-{index // self.ranks_per_node}"

    def _worker(self) -> SimWorker:
        index = next(self._numbers)
        local = index % self.ranks_per_node
        metadata = WorkerMetadata(
            node_id=self.node_of(index),
            node_ip=f"10.{index // 65536 % 256}.{index // 256 % 256}.{index % 256}",
            hostname=self.node_of(index),
            pid=_PID_BASE + index,
            accelerator_ids={"GPU": (str(local),)} if self.gpus else {},
        )
        self._workers += 1
        worker = self._live[metadata.pid] = SimWorker(self, index, metadata)
        return worker

    # The seam (see ``InProcessCluster``) ------------------------------------------------------

    async def driver_node(self) -> str | None:
        return self.node_of(0)

    async def bundle_nodes(self, placement: Placement) -> list[str]:
        return [self.node_of(i) for i in range(len(placement.bundles))]

    def make_workers(self, config: ExecutorConfig, count: int) -> list[Spawned]:
        # In a thread: not counted (the driver's measures are its event loop's thread).
        workers = [self._worker() for _ in range(count)]
        return [Spawned(w, w.call("describe")) for w in workers]

    def end(self, handles: Sequence[Handle]) -> None:
        t0, gc0 = time.thread_time(), self.gc_clock.total
        for handle in handles:
            assert isinstance(handle, SimWorker)
            handle.kill()
        self.spend(t0, gc0)

    async def live_nodes(self) -> set[str] | None:
        return {self.node_of(i) for i in range(0, self._workers, self.ranks_per_node)}

    async def stacks(self, workers: Sequence[tuple[int, Handle, WorkerMetadata]]) -> dict[int, str]:
        return {rank: f"simulated worker {handle.key}: no threads" for rank, handle, _ in workers}
