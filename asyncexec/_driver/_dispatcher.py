"""The calls an executor makes on its live workers: ``execute()`` (a function on every rank),
``call()`` (a function, or a method of the ranks' instances of a role, with dispatch: scattered
arguments, mesh axes, the least-loaded rank, merged results) and ``stream()`` (each rank's result
as it is ready).

A call is planned before anything is sent (``asyncexec._dispatch.plan_call``: bad arguments are
refused there). Each distinct part of its arguments that is large (over 64 KiB by its ``nbytes``
or length) is put where every worker reads it, once, and each rank is sent references to its own
parts only; a small part travels inline with the call. A call on a rank that died raises
``WorkerCrashedError`` with its rank (with a note saying so when the executor replaced the group
while the call was on its way: a restart); no call hangs on a dead worker. Outside a run, a
crashed rank of a group without a backend gets a fresh process in its place (the others keep
their calls); otherwise the dead group is dropped and the next call starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._config import ExecutorConfig
from .._dispatch import ALL, CallPlan, Load, Target, plan_call
from .._errors import (
    AsyncExecError,
    ExecutorStateError,
    NodeLostError,
    WorkerCrashedError,
    describe,
)
from ._lifecycle import Lifecycle
from .cluster import Cluster, call_error
from .group import GroupSlot, WorkerGroup, WorkerInfo, renew_rank

__all__ = ["CallStream", "WorkerCalls"]

T = TypeVar("T")
#: Parts of a call's arguments larger than this are put in the object store once.
INLINE_PART_BYTES = 64 * 1024
_DIED = (WorkerCrashedError, NodeLostError)


class WorkerCalls:
    """What an executor calls on its live workers (see the module's docstring)."""

    config: ExecutorConfig
    log: Any
    _life: Lifecycle

    def _init_calls(self) -> None:
        #: The calls in flight on the ranks of the group they were sent to (see ``_load_of``).
        self._load_group: WorkerGroup | None = None
        self._load = Load(0)
        self._freed = anyio.Event()  # set (and replaced) when a call chosen by load ends
        self._waiting = 0  # callers waiting on it for a rank under the cap
        self._renewing = anyio.Lock()

    async def _group(self) -> WorkerGroup:
        self._life.check_open()
        return _live(self._life.slot) or await self._life.slot.acquire()

    async def execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every worker; return the results in rank order.

        Works while a run is in progress (an ``async def`` runs on the worker's event loop, a
        plain function in a thread), for example to push new weights to live workers. Arguments
        travel as Ray passes them: an ``ObjectRef`` argument arrives resolved. ``fn`` is pickled
        by reference when its module can be imported on the workers, and by value otherwise (a
        function defined in ``__main__``: it then runs on a copy of its globals; keep state
        that ``execute()`` updates in an importable module, or in a role's instances).

        Raises:
            WorkerRaisedError: ``fn`` raised on a rank (the lowest failing rank is reported).
            WorkerCrashedError: a worker died.
        """
        group = await self._group()
        try:
            return await group.execute(fn, *args, **kwargs)
        except _DIED as exc:
            raise await self._lost(group, exc) from exc

    async def execute_single(
        self, rank: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``fn(*args, **kwargs)`` on one rank and return its result."""
        group = await self._group()
        try:
            return await group.execute_single(rank, fn, *args, **kwargs)
        except _DIED as exc:
            raise await self._lost(group, exc) from exc

    async def call(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        on: Target = ALL,
        merge: Callable[[list[Any]], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call ``fn`` on the live workers with dispatch; ``fn`` is a method of a role
        (``Learner.update``: each rank's instance's) or a plain function.

        ``asyncexec.scatter(value)`` among the arguments splits ``value`` over the ranks (each
        rank receives its part only); ``on=`` says which ranks: every rank (the default), an
        ``asyncexec.Mesh`` (split along some axes, replicate along the others, results from the
        ranks it collects), ``asyncexec.least_loaded(max_in_flight=..., retry=...)`` or
        ``asyncexec.rank(i)`` (one rank: its result, not a list). ``merge=`` merges the results
        (``asyncexec.concat``). A method whose own keyword is ``on`` or ``merge`` gets it through
        ``functools.partial``.

        Returns:
            The results in rank order (of the ranks a mesh collects), their merge, or one
            rank's result.

        Raises:
            ConfigurationError: before anything is sent: a method of a class that is not a
                role, arguments that do not fit the method, a value that cannot be split, a mesh
                that does not multiply to the world size.
            WorkerRaisedError: the method raised on a rank.
            WorkerCrashedError: a worker died (a call to a dead rank names it; a note says when
                the executor replaced the group meanwhile: a restart).
        """
        group = await self._group()
        plan = plan_call(
            fn, args, kwargs, len(group.workers), on, roles=self.config.roles, merge=merge
        )
        parts = await _put_parts(group.cluster, plan.parts)
        if plan.choose is not None:
            return (await self._call_one(group, plan, parts))[1]
        workers = [group.workers[r] for r in plan.ranks]
        if len(workers) == 1:
            return plan.result([await self._one(group, workers[0], plan, parts)])
        try:
            outcomes = await group.gather([_send(w, plan, parts) for w in workers], workers)
        except _DIED as exc:
            raise await self._lost(group, exc) from exc
        return plan.result(group.values(outcomes, workers))

    def stream(
        self, fn: Callable[..., Any], /, *args: Any, on: Target = ALL, **kwargs: Any
    ) -> CallStream:
        """Call ``fn`` as :meth:`call` does, and yield ``(rank, result)`` for each rank whose
        result is returned, as each is ready::

            async for rank, out in rollout.stream(Rollout.generate, asyncexec.scatter(prompts)):
                ...

        Leaving the loop early (``break``) cancels the waits for the others. Errors are raised
        by the iteration (a bad call before anything is sent, at the first step)."""
        tg = self._life.check_open()
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        results = CallStream(receive)
        tg.start_soon(self._stream, fn, args, kwargs, on, send, results.scope)
        return results

    async def _stream(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        on: Target,
        send: MemoryObjectSendStream[Any],
        scope: anyio.CancelScope,
    ) -> None:
        async with send:
            with scope:
                try:
                    group = await self._group()
                    roles = self.config.roles
                    plan = plan_call(fn, args, kwargs, len(group.workers), on, roles=roles)
                    parts = await _put_parts(group.cluster, plan.parts)
                    if plan.choose is not None:
                        await send.send(await self._call_one(group, plan, parts))
                        return
                    async with anyio.create_task_group() as tg:
                        for r in plan.ranks:
                            tg.start_soon(self._stream_one, group, plan, parts, r, send)
                except Exception as exc:
                    await send.send(_Failed(exc))

    async def _stream_one(
        self,
        group: WorkerGroup,
        plan: CallPlan,
        parts: Sequence[Any],
        r: int,
        send: MemoryObjectSendStream[Any],
    ) -> None:
        value = await self._one(group, group.workers[r], plan, parts)
        if plan.returns(r):
            await send.send((r, value))

    async def _one(
        self, group: WorkerGroup, worker: WorkerInfo, plan: CallPlan, parts: Sequence[Any]
    ) -> Any:
        """One rank's call; its value (awaited as ``group.gather`` awaits one, without a task
        group of its own: a call's hot path)."""
        ref = _send(worker, plan, parts)
        try:
            outcome = await ref
        except Exception as exc:
            error = await call_error(exc, worker, group.attempt)
        else:
            return group.values([outcome], [worker])[0]
        if isinstance(error, _DIED):
            raise await self._lost(group, error) from error
        raise error

    async def _call_one(
        self, group: WorkerGroup, plan: CallPlan, parts: Sequence[Any]
    ) -> tuple[int, Any]:
        """A call to one rank chosen by load (with a cap in flight, and again elsewhere when the
        chosen rank died and the call is idempotent): the rank, and its result."""
        choose = plan.choose
        assert choose is not None
        load, freed = self._load_of(group)
        dead: set[int] = set()
        while True:
            r = load.choose(choose.max_in_flight, exclude=dead)
            if r is None:
                if len(dead) == len(group.workers):
                    raise ExecutorStateError("every rank of the group died during the call")
                self._waiting += 1
                try:
                    await freed.wait()
                finally:
                    self._waiting -= 1
                load, freed = self._load_of(group)
                continue
            load.started(r)
            try:
                return r, await self._one(group, group.workers[r], plan, parts)
            except _DIED as exc:
                if not choose.retry:
                    raise
                dead.add(r)
                self.log.warning("call_sent_again", rank=r, error=describe(exc))
            finally:
                load.finished(r)
                self._wake()

    def _load_of(self, group: WorkerGroup) -> tuple[Load, anyio.Event]:
        """The calls in flight on ``group``'s ranks (a new group starts from none), and the
        event set when one of them ends."""
        if self._load_group is not group:
            self._load_group = group
            self._load = Load(len(group.workers))
        return self._load, self._freed

    def _wake(self) -> None:
        if self._waiting:  # a new event per ended call only when someone waits for one
            freed, self._freed = self._freed, anyio.Event()
            freed.set()

    async def _lost(self, group: WorkerGroup, exc: AsyncExecError) -> AsyncExecError:
        """The error of a call whose worker died, saying so when the executor replaced the group
        meanwhile (a restart); a dead group that no run replaces is discarded, so that the next
        call starts a fresh one."""
        slot = self._life.slot
        if group.closed and slot.group is not group:
            exc.add_note(
                "the call was on its way when the executor replaced its group (a restart): the "
                "new group has new instances; call again"
            )
            return exc
        run = self._life.run
        if (run is None or not run.active) and not await self._renew(group, exc):
            await slot.drop_if(group)
        return exc

    async def _renew(self, group: WorkerGroup, exc: AsyncExecError) -> bool:
        """Outside a run, put a fresh process in a crashed rank's place and keep the others
        (their calls in flight go on: rollout servers lose only the dead one's requests); False
        where that cannot be done (a backend's group is formed anew as a whole, a lost node
        takes more than one rank, or no bundle of its own), and the group is then dropped."""
        if not isinstance(exc, WorkerCrashedError) or group.backend is not None:
            return False
        async with self._renewing:  # the failed calls of one death renew its rank once
            if group.closed or self._life.slot.group is not group:
                return True
            if exc.pid is not None and group.workers[exc.rank].metadata.pid != exc.pid:
                return True  # renewed already
            with anyio.CancelScope(shield=True):
                try:
                    return await renew_rank(group, exc.rank) is not None
                except Exception as failure:
                    self.log.warning("rank_renew_failed", rank=exc.rank, error=describe(failure))
        return False


def _live(slot: GroupSlot) -> WorkerGroup | None:
    """The slot's group when it is live: what ``acquire()`` returns then, without taking its
    lock (a call's hot path)."""
    group = slot.group
    if group is None or group.closed:
        return None
    slot.start_refills()
    return group


def _send(worker: WorkerInfo, plan: CallPlan, parts: Sequence[Any]) -> Any:
    args, kwargs = plan.arguments(worker.rank, parts)
    if plan.method is None:
        return worker.handle.call("execute", plan.fn, *args, **kwargs)
    index, name = plan.method
    return worker.handle.call("call_role", index, name, *args, **kwargs)


async def _put_parts(cluster: Cluster, parts: Sequence[Any]) -> list[Any]:
    """Each part, or a reference to it where it is large: put once, off the loop."""
    return [await cluster.put(p) if _nbytes(p) > INLINE_PART_BYTES else p for p in parts]


def _nbytes(value: Any, depth: int = 0) -> int:
    """About how many bytes ``value`` pickles to, without pickling it: arrays and tensors by
    their ``nbytes``, bytes and strings by length, containers by their first items."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, bytes | bytearray | memoryview | str):
        return len(value)
    if depth < 2 and isinstance(value, list | tuple | dict):
        items = list(value.values() if isinstance(value, dict) else value)
        sample = items[:64]
        seen = sum(_nbytes(v, depth + 1) for v in sample)
        return seen if len(items) <= 64 else seen * len(items) // len(sample)
    return 64


class _Failed:
    """An error on its way to the stream's reader."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class CallStream:
    """The results of :meth:`WorkerCalls.stream`, as ``(rank, result)`` pairs as they are
    ready."""

    def __init__(self, receive: MemoryObjectReceiveStream[Any]) -> None:
        self._receive = receive
        self.scope = anyio.CancelScope()
        loop = asyncio.get_running_loop()
        weakref.finalize(self, _cancel_dropped, self.scope, loop).atexit = False

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        try:
            item = await self._receive.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        except anyio.get_cancelled_exc_class():
            self.scope.cancel()
            raise
        if isinstance(item, _Failed):
            self.scope.cancel()
            raise item.error
        pair: tuple[int, Any] = item
        return pair

    async def aclose(self) -> None:
        """Stop waiting for the rest."""
        self.scope.cancel()
        self._receive.close()


def _cancel_dropped(scope: anyio.CancelScope, loop: asyncio.AbstractEventLoop) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed
        loop.call_soon_threadsafe(scope.cancel)
