"""The calls an executor makes on its live workers: ``execute()`` (a function on every rank),
``call()`` (a function, or a method of the ranks' instances of a role, with dispatch: scattered
arguments, mesh axes, the least-loaded rank, merged results) and ``stream()`` (each rank's result
as it is ready).

A call is planned before anything is sent (``asyncexec._dispatch._plan.plan_call``: bad arguments
are refused there). Each distinct part of its arguments that is large (over 64 KiB by its ``nbytes``
or length) is put where every worker reads it, once, and each rank is sent references to its own
parts only; a small part travels inline with the call. A call on a rank that died raises
``WorkerCrashedError`` with its rank (with a note saying so when the executor replaced the group
while the call was on its way: a restart) as soon as the death is seen; no call hangs on a dead
worker. Outside a run, a crashed rank of a group without a backend gets a fresh process in its
place (the others keep their calls), and a call sent to that rank meanwhile waits for it; otherwise
the dead group is dropped and the next call starts a fresh one (see ``_recovery``). A
caller that stops waiting for an ``async def`` cancels it on the workers it was sent to; a plain
method runs to its end. A call chosen by load holds its rank's slot until the remote call ends (or
its cancellation lands), also when its caller stops waiting, and a call that ends hands its slot to
the longest waiter; an idempotent one follows the group when it is replaced (see ``_loads`` for the
bookkeeping). A role's plain method that runs one call at a time is sent as ``call_method_sync``
(the worker runs it where its calls queue, without a hop to a thread), every other method as
``call_method``: the role and the method's name travel as one key, and a small value (a number, a
string, bytes, None) comes back as it is, without an outcome around it (see
``asyncexec._wire._interface``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from typing import Any, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._dispatch._plan import CallPlan, plan_call
from .._dispatch._targets import ALL, Load, Target
from .._errors import (
    AsyncExecError,
    NodeLostError,
    WorkerCrashedError,
    describe,
)
from .._wire._interface import as_outcome
from .._wire._protocol import Outcome
from .._wire._tracing import call_span, carry
from ._config import ExecutorConfig
from ._events import ONE_CALL_SENT, CallResent, CallsSent, RankChosen, SlotWaited
from ._lifecycle import Lifecycle
from ._loads import Loads, Slot
from ._recovery import Recovery
from ._taskgroups import task_group
from .cluster import Call, Cluster, proxy
from .group import GroupSlot, WorkerGroup, WorkerInfo, dropped, observed, unsent, watched

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
        #: The calls chosen by load in flight per group, and renewals.
        self._loads = Loads()
        #: Where the calls' events go (the executor's observer: statistics, metrics, timeline).
        self._observer = self._life.observer
        self._recovery = Recovery(self._life, self._loads, self.log)
        self._life.renewing = self._loads.any_renewal  # what a run's attempt waits for

    async def _group(self) -> WorkerGroup:
        self._life.check_open()
        return _live(self._life.slot) or await self._life.slot.acquire()

    async def execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every worker; return the results in rank order.

        Works while a run is in progress (an ``async def`` runs on the worker's event loop, a
        plain function in a thread), for example to push new weights to live workers. A caller
        that stops waiting cancels an ``async def`` on the workers (a plain function runs to its
        end). Arguments travel as Ray passes them: an ``ObjectRef`` argument arrives resolved.
        ``fn`` is pickled by reference when its module can be imported on the workers, and by
        value otherwise (a function defined in ``__main__``: it then runs on a copy of its
        globals; keep state that ``execute()`` updates in an importable module, or in a role's
        instances).

        Raises:
            ConfigurationError: an argument does not pickle (named).
            WorkerRaisedError: ``fn`` raised on a rank (the lowest failing rank is reported).
            WorkerCrashedError: a worker died.
            ExecutorStateError: the executor is not started or is closed (also when it closed
                while the call was in flight).
        """
        group = await self._group()
        if self._loads.renewing(group.workers, range(len(group.workers))) is not None:
            group = await self._recovery.renewed(group, range(len(group.workers)))
        workers = list(group.workers)
        calls: list[Any] = []
        try:
            group.send_execute(fn, args, kwargs, calls)
        finally:  # the calls sent, also when a later rank's send failed
            self._observer.emit(CallsSent(len(calls)))
        try:
            return await group.executed(fn, calls)
        except _DIED as exc:
            raise await self._recovery.lost(group, _who(workers, exc), exc) from exc

    async def execute_single(
        self, rank: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``fn(*args, **kwargs)`` on one rank and return its result."""
        group = await self._group()
        if self._loads.renewing(group.workers, (rank,)) is not None:
            group = await self._recovery.renewed(group, (rank,))
        workers = list(group.workers)
        group.check_rank(rank)  # (a call to no rank is none sent)
        self._observer.emit(ONE_CALL_SENT)
        try:
            return await group.execute_single(rank, fn, *args, **kwargs)
        except _DIED as exc:
            raise await self._recovery.lost(group, _who(workers, exc), exc) from exc

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
            ExecutorStateError: the executor is not started or is closed (also when it closed
                while the call was in flight).
        """
        self._life.check_open()  # as ``_group()``, without its coroutine: the hot path
        group = _live(self._life.slot) or await self._life.slot.acquire()
        plan = plan_call(
            fn, args, kwargs, len(group.workers), on, roles=self.config.roles, merge=merge
        )
        if self._loads.renewing(group.workers, plan.ranks) is not None:
            group = await self._recovery.renewed(group, plan.ranks)
            plan = plan_call(
                fn, args, kwargs, len(group.workers), on, roles=self.config.roles, merge=merge
            )
        parts = plan.inline(INLINE_PART_BYTES) or await _put_parts(group.cluster, plan)
        if plan.choose is not None:
            return (await self._call_one(group, plan, parts))[1]
        workers = [group.workers[r] for r in plan.ranks]
        if len(workers) == 1:
            return plan.result([await self._one(group, workers[0], plan, parts)])
        calls: list[Any] = []
        try:
            for w in workers:
                calls.append(_send(group, w, plan, parts))
        except BaseException as exc:  # a rank's arguments that do not pickle: the others'
            if plan.cancellable:  # go no further
                for sent in calls:
                    sent.cancel()
            dropped(calls, exc)
            raise
        finally:  # the calls sent (not those a failed send left out)
            self._observer.emit(CallsSent(len(calls)))
        try:
            outcomes = await group.gather(calls)
        except _DIED as exc:
            raise await self._recovery.lost(group, _who(workers, exc), exc) from exc
        except anyio.get_cancelled_exc_class():
            if plan.cancellable:  # the caller gave up: so do the workers' coroutines
                for sent in calls:
                    sent.cancel()
            raise
        return plan.result(_values(group, outcomes, workers))

    def stream(
        self, fn: Callable[..., Any], /, *args: Any, on: Target = ALL, **kwargs: Any
    ) -> CallStream:
        """Call ``fn`` as :meth:`call` does, and yield ``(rank, result)`` for each rank whose
        result is returned, as each is ready::

            async for rank, out in rollout.stream(Rollout.generate, asyncexec.scatter(prompts)):
                ...

        Leaving the loop early (``break``) cancels the waits for the others (an ``async def``
        is cancelled on their workers too; a plain method runs to its end). Errors are raised
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
                    if self._loads.renewing(group.workers, plan.ranks) is not None:
                        group = await self._recovery.renewed(group, plan.ranks)
                        plan = plan_call(fn, args, kwargs, len(group.workers), on, roles=roles)
                    parts = await _put_parts(group.cluster, plan)
                    if plan.choose is not None:
                        await send.send(await self._call_one(group, plan, parts))
                        return
                    async with task_group() as tg:  # a rank's error, not a group of them
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
        self,
        group: WorkerGroup,
        worker: WorkerInfo,
        plan: CallPlan,
        parts: Sequence[Any],
        held: tuple[Load, int] | None = None,
    ) -> Any:
        """One rank's call; its value (awaited as ``group.gather`` awaits one, without a task
        group of its own: a call's hot path). ``held``: the rank's slot taken by load, given
        back when the remote call ends (when the caller stops waiting first, a task of the
        executor's waits for that end). A caller that stops waiting for an ``async def``
        cancels it on the worker; a plain method runs to its end."""
        try:
            call = _send(group, worker, plan, parts)
        except BaseException:  # not sent (an argument that does not pickle): its slot is free
            if held is not None:
                self._loads.release(*held)
            raise
        self._observer.emit(ONE_CALL_SENT)
        try:
            outcome = await call
        except BaseException as exc:
            stopped = isinstance(exc, anyio.get_cancelled_exc_class())
            if stopped and plan.cancellable:
                call.cancel()  # its slot frees when the cancellation has landed
            if held is not None:
                if stopped:
                    # The call ends on the worker later: its slot is held until then.
                    self._loads.release_when_done(call, *held, self._life.tg)
                else:
                    self._loads.release(*held)
            if isinstance(exc, _DIED):
                error = exc
            else:
                raise
        else:
            if held is not None:
                self._loads.release(*held)
            return _value(group, outcome, worker)
        raise await self._recovery.lost(group, worker, error) from error

    async def _call_one(
        self, group: WorkerGroup, plan: CallPlan, parts: Sequence[Any]
    ) -> tuple[int, Any]:
        """A call to one rank chosen by load (with a cap in flight): the rank, and its result.
        An idempotent call whose rank died goes again to another live rank, and to the group
        that took its group's place when the executor replaced or dropped it; it gives up after
        as many deaths as its first group had ranks, raising the last."""
        choose = plan.choose
        assert choose is not None
        loads = self._loads
        dead: set[str] = set()  # the workers (by key) that died under this call
        tried: set[int] = set()  # their ranks in ``group``: elsewhere first
        last: AsyncExecError | None = None
        limit = len(group.workers)
        handed: Slot | None = None  # a slot an ended call handed to this one
        while True:
            if group.closed:  # replaced or dropped: the slot's live group now
                if handed is not None:
                    loads.refuse(handed)
                    handed = None
                try:
                    group, tried = await self._group(), set()
                except AsyncExecError as exc:  # the executor closed, or no group starts
                    raise exc from last
            exclude: Collection[int] = tried
            if len(tried) >= len(group.workers):  # a rank renewed meanwhile may take it
                exclude = {w.rank for w in group.workers if w.handle.key in dead}
            renewing = loads.renewing_ranks(group.workers)  # none to a dead worker
            if renewing:
                exclude = {*exclude, *renewing}
            taken = _next_slot(loads, group, handed, choose.max_in_flight, exclude)
            handed = None
            if taken is None:
                if renewing and len(exclude) == len(group.workers):
                    # Only ranks being renewed are left: the first fresh process takes it (a group
                    # replaced meanwhile is seen at the top of the loop).
                    await self._recovery.renewed(group, renewing[:1])
                    continue
                if last is not None and len(exclude) == len(group.workers):
                    # Every rank this call could go to died under it, and none was replaced.
                    last.add_note(f"sent {len(dead)} times: every rank it went to died")
                    raise last
                handed = await _slot_freed(group, loads)
                continue
            worker = group.workers[taken[1]]
            if group.observer.handles(RankChosen):  # the timeline's: not made when off
                group.observer.emit(RankChosen(taken[1]))
            if dead:
                self._observer.emit(CallResent())
            try:
                return taken[1], await self._one(group, worker, plan, parts, taken)
            except _DIED as exc:
                if not choose.retry or len(dead) + 1 > limit:
                    if dead:
                        exc.add_note(f"sent {len(dead) + 1} times: every rank it went to died")
                    raise
                last = exc
                dead.add(worker.handle.key)
                tried.add(taken[1])
                self.log.warning(
                    "call_sent_again", function=plan.label, rank=taken[1], error=describe(exc)
                )


def _slot_freed(group: WorkerGroup, loads: Loads) -> Awaitable[Slot | None]:
    """A slot an ended call hands over (see ``Loads.wait_slot``), observed as a ``SlotWaited``
    when a sink handles it (without a coroutine of its own when none does)."""
    waiting = loads.wait_slot()
    observer = group.observer
    return observer.timed(waiting, SlotWaited) if observer.handles(SlotWaited) else waiting


def _next_slot(
    loads: Loads,
    group: WorkerGroup,
    handed: Slot | None,
    max_in_flight: int | None,
    exclude: Collection[int],
) -> Slot | None:
    """The slot a call chosen by load takes now: the one an ended call handed it (counted
    already) when it may use it (``group``'s, a rank it does not leave out, within its cap),
    else the least-loaded rank's (a handed slot it cannot use given back first); None when no
    rank is free."""
    if handed is None:
        return loads.take(group, max_in_flight, exclude=exclude)
    held, r = handed
    if (
        held is not loads.of(group)
        or r in exclude
        or (max_in_flight is not None and held.in_flight(r) > max_in_flight)
    ):
        loads.refuse(handed)  # free again: this call looks too, as every waiter does
        return loads.take(group, max_in_flight, exclude=exclude)
    return handed


def _value(group: WorkerGroup, answer: Any, worker: WorkerInfo) -> Any:
    """The value of one rank's answer (a bare value, or an outcome: see ``call_method``);
    raised when it failed."""
    if type(answer) is not Outcome:
        return answer
    return group.values([answer], [worker])[0]


def _values(group: WorkerGroup, answers: Sequence[Any], workers: Sequence[WorkerInfo]) -> list[Any]:
    """The values of role methods' or functions' answers (a bare value, or an outcome: see
    ``call_method``); the failed ones raised (the lowest rank first)."""
    if all(type(answer) is not Outcome for answer in answers):
        return list(answers)
    return group.values([as_outcome(answer) for answer in answers], workers)


def _who(workers: Sequence[WorkerInfo], exc: AsyncExecError) -> WorkerInfo | None:
    """The worker a call's error is about, of the workers the call was sent to."""
    rank = getattr(exc, "rank", None)
    if isinstance(rank, int) and 0 <= rank < len(workers):
        return workers[rank]
    return None


def _live(slot: GroupSlot) -> WorkerGroup | None:
    """The slot's group when it is live: what ``acquire()`` returns then, without taking its
    lock (a call's hot path)."""
    group = slot.group
    if group is None or group.closed:
        return None
    slot.start_refills()
    return group


def _send(
    group: WorkerGroup, worker: WorkerInfo, plan: CallPlan, parts: Sequence[Any]
) -> Call[Any]:
    """Send rank ``worker``'s call (an argument that does not pickle is named as the plan names
    it: see ``cluster.WorkerProxy``)."""
    args, kwargs = plan.arguments(worker.rank, parts)
    span, context = call_span(plan.fn, worker.rank)  # None unless traced
    start = time.monotonic() if watched(group.observer, span) else None
    try:
        if plan.method is None:
            fn = plan.fn if context is None else carry(plan.fn, context)
            call = proxy(group, worker, plan).execute(fn, *args, **kwargs)
        else:
            # The trace context rides with the method's key.
            key = plan.key if context is None else carry(plan.key, context)
            if plan.plain:  # one call at a time, without a hop to a thread (``CallPlan.plain``)
                call = proxy(group, worker, plan).call_method_sync(key, *args, **kwargs)
            else:
                call = proxy(group, worker, plan).call_method(key, *args, **kwargs)
    except BaseException as exc:  # not sent (an argument that does not pickle)
        unsent(span, plan.label, worker.rank, exc)
        raise
    if start is None:
        return call
    return observed(group.observer, worker.rank, plan.label, call, span, start)


async def _put_parts(cluster: Cluster, plan: CallPlan) -> list[Any]:
    """Each part of the call, or a reference to it where it is large (by
    ``asyncexec._dispatch._split.estimated_nbytes``): put once, copied and put off the loop (see
    ``CallPlan.travelling``). A call whose parts all travel inline takes them from
    ``CallPlan.inline`` first, without this coroutine (a call without arguments comes here)."""
    return await plan.travelling(cluster.put, INLINE_PART_BYTES)


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
        weakref.finalize(self, _stop_dropped, self.scope, loop, receive).atexit = False

    def __aiter__(self) -> _StreamLoop:
        # Each ``async for`` gets an iterator of its own: when the loop is left early (break, an
        # exception), it is dropped and the waits for the rest are cancelled, also while the
        # stream is held in a variable (as a run's loop is).
        return _StreamLoop(self)

    async def __anext__(self) -> tuple[int, Any]:
        try:
            item = await self._receive.receive()
        except anyio.EndOfStream:
            self._receive.close()
            raise StopAsyncIteration from None
        except anyio.ClosedResourceError:  # closed: read to its end, failed, or aclose()d
            raise StopAsyncIteration from None
        except anyio.get_cancelled_exc_class():
            self.scope.cancel()
            raise
        if isinstance(item, _Failed):
            self.scope.cancel()
            self._receive.close()
            raise item.error
        pair: tuple[int, Any] = item
        return pair

    async def aclose(self) -> None:
        """Stop waiting for the rest."""
        self.scope.cancel()
        self._receive.close()


class _StreamLoop:
    """One ``async for`` over a :class:`CallStream`: dropped when the loop ends, which cancels
    the waits for the rest (nothing is left after the last result). ``await
    stream.__anext__()`` reads the stream without one."""

    __slots__ = ("__weakref__", "_stream")

    def __init__(self, stream: CallStream) -> None:
        self._stream = stream
        loop = asyncio.get_running_loop()
        weakref.finalize(self, _cancel_dropped, stream.scope, loop).atexit = False

    def __aiter__(self) -> _StreamLoop:
        return self

    def __anext__(self) -> Coroutine[Any, Any, tuple[int, Any]]:
        return self._stream.__anext__()


def _cancel_dropped(scope: anyio.CancelScope, loop: asyncio.AbstractEventLoop) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed
        loop.call_soon_threadsafe(scope.cancel)


def _stop_dropped(
    scope: anyio.CancelScope,
    loop: asyncio.AbstractEventLoop,
    receive: MemoryObjectReceiveStream[Any],
) -> None:
    """A dropped stream: its waits cancelled and its end closed (nothing reads it now; an
    unclosed one is a ResourceWarning when collected)."""

    def stop() -> None:
        scope.cancel()  # first: a send cancelled at its checkpoint never finds the end closed
        receive.close()

    try:
        loop.call_soon_threadsafe(stop)
    except RuntimeError:  # the loop has closed: nothing sends
        receive.close()
