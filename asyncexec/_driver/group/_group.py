"""The live group of workers: calls on all of them, set-up, stopping functions, closing.

Every call awaits its results (no ``ray.get``) in tasks of an anyio task group; each call is made
through the seam (``cluster.proxy``, with the group as its caller: its attempt and its cluster's
node table), so a failure arrives as asyncexec's error, mapped there; the first failure stops the
wait, and every rank that had failed by then is kept (the first is raised, the others
are attached to it as notes). Closing is shielded from cancellation, bounded in time and
idempotent; when it returns, the workers are dead (or back in their pool) and the placement is
given back. How a group's members change (a spare, a replaced rank, a smaller group) is in
``_spares``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio

from ..._dispatch._role import qualname
from ..._errors import (
    AsyncExecError,
    ConfigurationError,
    NodeLostError,
    WorkerCrashedError,
    describe,
)
from ..._wire._protocol import Outcome, RunStart, WorkerContext, WorkerMetadata
from ..._wire._tracing import call_span, carry
from ...backends._base import Backend
from .._config import ExecutorConfig
from .._interrupt import hurried_away
from .._observe import Observer
from .._taskgroups import task_group
from ..cluster import (
    Cluster,
    Handle,
    Placement,
    Unranked,
    backend_error,
    death_of,
    gathered,
    outcome_error,
    proxy,
)
from ._members import Standby, WorkerInfo
from ._observed import dropped, observed, unsent, watched

__all__ = ["STOP_MARGIN_S", "WorkerGroup", "answers", "device_envs", "with_others"]

T = TypeVar("T")

#: ``answers()``'s mark of a worker found dead (its call failed so).
_GONE = "gone"
#: Extra time a stop call gets beyond the worker-side bound it was given (the call's own trip).
STOP_MARGIN_S = 1.0


def device_envs(metas: Sequence[WorkerMetadata], config: ExecutorConfig) -> list[dict[str, str]]:
    """Each worker's environment for seeing its node's devices, in the order of ``metas``."""
    from .._devices import shared_device_env

    return shared_device_env(
        [m.node_id for m in metas],
        [m.accelerator_ids for m in metas],
        sorted(config.share_devices),
    )


def with_others(errors: Sequence[AsyncExecError]) -> AsyncExecError:
    """The first error, with every other one attached as a note (several ranks failed at once)."""
    first = errors[0]
    for other in errors[1:]:
        if other is not first:
            first.add_note(f"also failed at the same time: {describe(other)}")
    return first


class WorkerGroup:
    """N workers in rank order (one placement, or leased from a pool), and their spares."""

    #: The executor's observer (set by its slot; until then one without sinks).
    observer: Observer = Observer()

    def __init__(
        self,
        config: ExecutorConfig,
        backend: Backend | None,
        cluster: Cluster,
        placement: Placement | None,
        workers: list[WorkerInfo],
        attempt: int,
        log: Any,
        *,
        pool: Any = None,
        spares: Sequence[Standby] = (),
    ) -> None:
        self.config = config
        self.backend = backend
        self.cluster = cluster
        #: The group's own placement; None when its workers are leased from ``pool`` (a
        #: :class:`~._pool.WorkerPool`), which they go back to when the group closes.
        self.placement = placement
        self.pool = pool
        self.workers = workers
        #: Started workers kept beside the group, to take a failed rank's place.
        self.spares = list(spares)
        self.attempt = attempt
        self.log = log
        #: One pending ``wait_closed`` call per rank: it fails the moment the process dies.
        self.deaths: list[Any] = [
            w.death if w.death is not None else death_of(w.handle) for w in workers
        ]
        self.closed = False
        self.starting: list[Handle] = []  # spares being started
        #: The checkpoint the instances of the roles are restored from when they are made
        #: (a restart's: the slot sets it), and the roles as sent to the workers (see _roles).
        self.restore_from: Any = None
        self.roles_ref: Any = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "live"
        return f"<WorkerGroup {len(self.workers)} workers, attempt {self.attempt}, {state}>"

    @property
    def contexts(self) -> list[WorkerContext]:
        return [w.context for w in self.workers]

    def node_alive(self, node_id: str | None) -> Awaitable[bool]:
        """Whether ``node_id`` is alive in the cluster's node table (the seam asks it when a
        call of this group fails: a lost node or a crashed worker)."""
        return self.cluster.node_alive(node_id)

    # Calls ------------------------------------------------------------------------------------

    async def gather(self, calls: Sequence[Awaitable[Any]]) -> list[Any]:
        """Await calls made through the seam (``cluster.proxy``), one per worker; results in
        the order given.

        Raises:
            AsyncExecError: the first failure, as the seam mapped it (the wait stops there);
                the failures of other ranks seen by then are attached to it as notes.
        """
        results, errors = await gathered(calls)
        if errors:
            raise with_others(errors)
        return results

    def values(self, outcomes: Sequence[Outcome], workers: Sequence[WorkerInfo]) -> list[Any]:
        """The values of calls' outcomes; the failed ones raised (the lowest rank first)."""
        failed = [
            outcome_error(o, w, self.attempt)
            for o, w in zip(outcomes, workers, strict=True)
            if o.kind != "ok"
        ]
        if failed:
            raise with_others(failed)
        return [o.value for o in outcomes]

    async def execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn`` on every worker concurrently; results in rank order."""
        calls: list[Any] = []
        self.send_execute(fn, args, kwargs, calls)
        return await self.executed(fn, calls)

    def send_execute(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        calls: list[Any],
    ) -> None:
        """Send ``execute`` of ``fn`` to every worker, appending each call to ``calls`` as it
        goes out (so that a caller sees which were sent when a later one's send fails).

        Raises:
            ConfigurationError: an argument does not pickle (the calls sent before it are
                dropped: nothing waits for them).
        """
        try:
            for w in self.workers:
                calls.append(_execute_on(self, w, fn, args, kwargs))
        except BaseException as exc:
            dropped(calls, exc)
            raise

    async def executed(self, fn: Callable[..., T], calls: Sequence[Any]) -> list[T]:
        """The results of ``calls`` (of :meth:`send_execute`) in rank order."""
        return self.values(await _given_up(self.gather(calls), fn, calls), self.workers)

    def check_rank(self, rank: int) -> None:
        """Refuse ``rank`` unless it is one of the group's.

        Raises:
            ConfigurationError: it is not.
        """
        if not 0 <= rank < len(self.workers):
            raise ConfigurationError(f"rank must be in 0..{len(self.workers) - 1}, got {rank!r}")

    async def execute_single(
        self, rank: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``fn`` on one rank."""
        self.check_rank(rank)
        worker = self.workers[rank]
        calls = [_execute_on(self, worker, fn, args, kwargs)]
        values: list[T] = self.values(await _given_up(self.gather(calls), fn, calls), [worker])
        return values[0]

    async def start_runs(self, payload: bytes, starts: Sequence[RunStart]) -> None:
        """Start the run's function on every worker, each with its own start."""
        calls = [
            proxy(self, w).start_run(payload, start)
            for w, start in zip(self.workers, starts, strict=True)
        ]
        await self.gather(calls)

    async def setup(self, envs: Sequence[dict[str, str]], workers: Sequence[WorkerInfo]) -> None:
        """Give ``workers`` their device environment, context, data context and init hook."""
        data_context = await self.cluster.data_context()
        calls = [
            proxy(self, w).setup(env, w.context, self.config.init_hook, data_context)
            for w, env in zip(workers, envs, strict=True)
        ]
        self.values(await self.gather(calls), workers)

    async def run_backend_hook(self, hook: str) -> None:
        """Run a backend hook; a failure becomes a BackendError naming backend, hook and rank."""
        if self.backend is None:
            return
        name = getattr(self.backend, "name", type(self.backend).__name__)
        try:
            await getattr(self.backend, hook)(self)
        except Exception as exc:
            raise backend_error(exc, name, hook) from exc

    async def stop_functions(self, workers: Sequence[WorkerInfo], timeout_s: float) -> bool:
        """Stop the run's function on ``workers``; whether all ended within ``timeout_s``."""
        calls = [proxy(self, w).stop_run(timeout_s) for w in workers]
        with anyio.move_on_after(timeout_s + STOP_MARGIN_S):
            try:
                return all(await self.gather(calls))
            except AsyncExecError:
                return False
        return False

    async def stop_each(self, workers: Sequence[WorkerInfo], timeout_s: float) -> list[int]:
        """Stop the run's function on ``workers``; the ranks whose function did not end within
        ``timeout_s`` (or whose worker did not answer, or failed), waiting for every rank. A
        worker whose process is gone (its call says so) is not among them: no function of
        its runs, and it is no hang."""
        calls = [proxy(self, w).stop_run(timeout_s) for w in workers]  # (errors mapped)
        stopped = await answers(calls, timeout_s + STOP_MARGIN_S, dead=_GONE)
        return [
            w.rank for w, ok in zip(workers, stopped, strict=True) if ok is not True and ok != _GONE
        ]

    async def stacks(self) -> dict[int, str]:
        """Every worker's stacks by rank, read from outside (see ``Cluster.stacks``)."""
        return await self.cluster.stacks([(w.rank, w.handle, w.metadata) for w in self.workers])

    async def drop(self, handles: Sequence[Handle], *, clean: bool = False) -> None:
        """Let go of workers outside a close: back to the pool (``clean``: reusable), or
        killed."""
        # bounded by the seam: give_back() and kill() without patience
        with anyio.CancelScope(shield=True):
            if self.pool is not None:
                await self.pool.give_back([(h, clean) for h in handles])
            else:
                await self.cluster.kill(handles)

    # Shutdown ---------------------------------------------------------------------------------

    async def close(self, *, force: bool = False) -> None:
        """Stop the group: backend ``on_shutdown``, graceful exit with a patience bound, then kill,
        then give the placement back. ``force`` skips the graceful part (used after a failure:
        survivors may be stuck in a collective). Shielded, bounded, idempotent."""
        if self.closed:
            return
        self.closed = True
        # bounded: each step has its deadline (shutdown_timeout_s; the kill's patience, timeout_s)
        with anyio.CancelScope(shield=True):
            t0 = time.perf_counter()
            if self.pool is not None:
                await self._give_back(force)
                self.log.info("group_returned", seconds=round(time.perf_counter() - t0, 3))
                return
            handles = [w.handle for w in self.workers] + [s.handle for s in self.spares]
            handles += self.starting
            patience = 0.0  # what is left of it for the workers' graceful exit
            try:
                if not force:
                    with hurried_away():
                        patience = await self._close_gracefully()
            finally:
                # Whatever happened above, nothing of the group may be left behind: the
                # cluster's kill lets them exit gracefully first (a second Ctrl-C cuts that).
                with hurried_away():
                    await self.cluster.kill(
                        handles,
                        self.placement,
                        self.deaths,
                        self.config.shutdown_timeout_s,
                        patience_s=patience,
                    )
            self.log.info("group_closed", force=force, seconds=round(time.perf_counter() - t0, 3))

    async def _give_back(self, force: bool) -> None:
        """Return leased workers to their pool. A worker is reusable when its function stopped
        in time and its reset (asyncexec's state dropped, the pool's reset hook) succeeded; after
        a failure (``force``), a backend's workers are not reused (their framework's state may be
        broken). A spare is reset too (it is reusable when it answers: a spare that died while
        it stood by is not). The others are killed by the pool, which refills."""
        spares: list[Any] = [Unranked(s.handle, s.metadata) for s in self.spares]
        members: list[Any] = [*self.workers, *spares]
        clean = [False] * len(members)
        timeout = self.config.stop_timeout_s
        with anyio.move_on_after(self.config.shutdown_timeout_s + timeout), hurried_away():
            try:
                if self.backend is None or not force:
                    await self.run_backend_hook("on_shutdown")
                else:  # only the spares, which never joined the backend's group, are reused
                    members = spares
                hook = self.pool.reset_hook
                resets = [proxy(self, w).reset(timeout, hook) for w in members]
                bound = timeout + STOP_MARGIN_S + self.config.shutdown_timeout_s
                outcomes = await answers(resets, bound)
                oks = [isinstance(o, Outcome) and o.kind == "ok" for o in outcomes]
                clean[len(clean) - len(oks) :] = oks
                failed = [o.error for o in outcomes if isinstance(o, Outcome) and o.error]
                if failed:
                    self.log.warning("pool_reset_failed", error=describe(failed[0]))
            except Exception as exc:
                self.log.warning("pool_return_failed", error=describe(exc))
        handles = [w.handle for w in [*self.workers, *spares]]
        await self.pool.give_back(list(zip(handles, clean, strict=True)))

    async def _close_gracefully(self) -> float:
        """The backend's ``on_shutdown``; the patience for the workers' graceful exit (the
        cluster's kill's), within what is left of the shutdown bound."""
        with anyio.move_on_after(self.config.shutdown_timeout_s) as bound:
            try:
                await self.run_backend_hook("on_shutdown")
            except Exception as exc:
                self.log.warning("backend_shutdown_failed", error=describe(exc))
        left = bound.deadline - anyio.current_time()
        return max(0.0, min(self.config.graceful_patience_s, left))


async def answers(refs: Sequence[Any], timeout_s: float, *, dead: Any = None) -> list[Any]:
    """Each ref's value, or None where it failed or did not answer within ``timeout_s`` (a None
    in ``refs`` stays None); ``dead`` where its worker's process or node is gone."""
    results: list[Any] = [None] * len(refs)

    async def one(i: int) -> None:
        with anyio.move_on_after(timeout_s):
            try:
                results[i] = await refs[i]
            except (WorkerCrashedError, NodeLostError):
                results[i] = dead
            except Exception:
                results[i] = None

    async with task_group() as tg:
        for i, ref in enumerate(refs):
            if ref is not None:
                tg.start_soon(one, i)
    return results


async def _given_up(wait: Awaitable[T], fn: Any, calls: Sequence[Any]) -> T:
    """``wait`` for ``execute()``'s ``calls`` of ``fn``; when its caller stops waiting, an
    ``async def`` ``fn`` is cancelled on the workers (a plain one runs to its end), as
    ``call()`` does."""
    try:
        return await wait
    except anyio.get_cancelled_exc_class():
        if inspect.iscoroutinefunction(fn):
            for call in calls:
                call.cancel()
        raise


def _execute_on(
    group: WorkerGroup, worker: WorkerInfo, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Awaitable[Any]:
    """Send ``execute`` of ``fn`` to ``worker``: observed when the group's observer handles its
    end (``CallEnded``: the timeline draws it), in an OpenTelemetry span (its context carried to
    the worker) when tracing is on."""
    span, context = call_span(fn, worker.rank)  # None unless traced
    sent = fn if context is None else carry(fn, context)
    if not watched(group.observer, span):
        return proxy(group, worker).execute(sent, *args, **kwargs)
    start = time.monotonic()
    try:
        call = proxy(group, worker).execute(sent, *args, **kwargs)
    except BaseException as exc:
        unsent(span, qualname(fn), worker.rank, exc)
        raise
    return observed(group.observer, worker.rank, qualname(fn), call, span, start)
