"""Calls on a group's workers that raise asyncexec's errors: the seam maps its own failures.

As httpx's transports map httpcore's errors inside themselves, a call made with :func:`submit`
(or a pending result awaited through :func:`result_of`) raises asyncexec's errors, never the
cluster's: mapped by :func:`~._errors.call_error` with the worker's rank and node, the attempt of
the caller (read when the call fails: a group's attempt changes when a run takes it) and the node
table of the caller's cluster (``Cluster.node_alive``: one liveness cache per cluster, see
``_liveness``). Arguments that do not pickle are refused when the call is submitted (Ray raises
``TypeError`` then, a long text with colours) as a :class:`~asyncexec.ConfigurationError` that
names the first argument that does not pickle.

A call costs one object (:class:`Call`) beside the cluster's own reference: no task, and no
coroutine unless it fails.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, Generic, NamedTuple, NoReturn, Protocol, TypeVar

from ray import cloudpickle
from ray._raylet import ObjectRef

from ..._errors import AsyncExecError, ConfigurationError, describe
from ..._wire._interface import WorkerMethod
from ..._wire._protocol import WorkerMetadata
from ..._wire._tracing import plain
from .._taskgroups import task_group
from ._base import Handle
from ._errors import call_error
from ._ray import Result

__all__ = [
    "Call",
    "Caller",
    "Member",
    "Names",
    "Naming",
    "NodeTable",
    "at_attempt",
    "gathered",
    "result_of",
    "settled",
    "submit",
    "submit_n",
    "submit_named",
    "unpicklable",
]

#: How a call's argument is named in messages, by its position among the arguments given to the
#: worker's method (an int) or its keyword.
Names = Callable[[int | str], str]
#: How many of the arguments of a worker's method come before the user's: ``execute``'s function,
#: ``call_role``'s role and method name, ``call_method``'s (and ``call_method_sync``'s) method key.
_LEADING: dict[str, int] = {"execute": 1, "call_role": 2, "call_method": 1, "call_method_sync": 1}


class Naming(Protocol):
    """How a call's planner names its arguments in messages (a call plan)."""

    def argument_name(self, rank: int, key: int | str) -> str:
        """The name of the argument that rank ``rank`` receives at position ``key`` (among the
        user's arguments) or by keyword ``key``."""
        ...


class Member(Protocol):
    """A worker as its caller knows it (a group's :class:`~..group.WorkerInfo`)."""

    @property
    def handle(self) -> Handle: ...

    @property
    def rank(self) -> int: ...

    @property
    def metadata(self) -> WorkerMetadata: ...


class Caller(Protocol):
    """Who calls the workers (a group): the attempt its errors carry, and its cluster, whose
    node table says whether a failed call's node is gone."""

    @property
    def attempt(self) -> int: ...

    def node_alive(self, node_id: str | None) -> Awaitable[bool]: ...


T = TypeVar("T")


class Call(Generic[T]):
    """A call on a worker, awaitable (as often as its reference is): its value, or the failure
    mapped to asyncexec's error (never the cluster's); a cancelled wait leaves the call running
    on the worker, as a cancelled wait on its reference does.

    The one protocol of a pending call: awaitable, :meth:`cancel`, :meth:`loop_future` (None
    where the cluster gives none) and :meth:`mapped`. What wraps a call (a group's
    ``ObservedCall``, for the timeline and tracing) passes its wait and :meth:`cancel` on, not
    the other two: :func:`gathered` and :func:`settled` wait for it in a task of its own."""

    __slots__ = ("_caller", "_cancelled", "_ref", "_who")

    def __init__(self, ref: Any, who: Member, caller: Caller) -> None:
        self._ref = ref
        self._who = who
        self._caller = caller
        self._cancelled = False  # the driver asked to cancel it

    def __repr__(self) -> str:
        return f"<Call on rank {self._who.rank}>"

    def cancel(self) -> None:
        """Cancel the call on the worker: an ``async def`` is cancelled there, and awaiting
        this call then fails (once the worker has ended it) with asyncexec's error for a call
        that did not complete (:class:`~._errors.CallCancelledError`: the driver asked for
        it, no failure of the worker's). Only for ``async def`` calls (see
        ``Handle.cancel``)."""
        self._cancelled = True
        self._who.handle.cancel(self._ref)

    def __await__(self) -> Generator[Any, None, T]:
        try:
            value: T = yield from self._ref.__await__()
            return value
        except Exception as exc:
            error = yield from self.mapped(exc).__await__()
        raise error  # outside the handler: the cluster's error is its cause, not its context

    def loop_future(self) -> asyncio.Future[Any] | None:
        """A future of the running loop settled with the call's unmapped result (see
        :meth:`mapped`), where the cluster's reference gives one (a Ray call's); None where it
        does not."""
        future: asyncio.Future[Any] | None = self._ref.loop_future()
        return future

    def mapped(self, exc: Exception) -> Awaitable[AsyncExecError]:
        """asyncexec's error for the call's failure ``exc`` (the cluster's)."""
        return _mapped(exc, self._who, self._caller, self._cancelled)


async def gathered(calls: Sequence[Awaitable[Any]]) -> tuple[list[Any], list[AsyncExecError]]:
    """Await ``calls`` (one per worker, made with :func:`submit`) at once: their results in the
    order given, and the failures seen when the wait stopped (it stops at the first; empty when
    none failed). Calls whose references give loop futures (Ray's) are waited for together,
    without a task each (cheaper for the loop than a task group's task per call); others
    each in a task of one task group."""
    if not calls:
        return [], []
    futures: list[asyncio.Future[Any]] = []
    for call in calls:
        future = call.loop_future() if isinstance(call, Call) else None
        if future is None:
            for made in futures:
                made.cancel()
            return await _gathered_in_tasks(calls)
        futures.append(future)
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for future in futures:  # after a failure, or the caller's cancellation: the calls go on
            future.cancel()
    results: list[Any] = [None] * len(calls)
    failed: list[Awaitable[AsyncExecError]] = []
    for i, (call, future) in enumerate(zip(calls, futures, strict=True)):
        if future.cancelled():
            continue
        if (exc := future.exception()) is None:
            results[i] = future.result()
        elif isinstance(exc, Exception):
            assert isinstance(call, Call)
            failed.append(call.mapped(exc))
        else:
            raise exc
    return results, list(await asyncio.gather(*failed)) if failed else []


async def settled(
    calls: Sequence[Awaitable[Any]], on_settled: Callable[[int, Any, AsyncExecError | None], None]
) -> None:
    """Await every one of ``calls`` (made with :func:`submit`), whatever the others do, and tell
    ``on_settled(i, value, error)`` as call ``i`` ends (``error``: asyncexec's, None when it
    returned). Calls whose references give loop futures (Ray's) are waited for together, as
    :func:`gathered` waits, without a task each; others each in a task of one task group."""
    futures: dict[asyncio.Future[Any], int] = {}
    for i, call in enumerate(calls):
        future = call.loop_future() if isinstance(call, Call) else None
        if future is None:
            for made in futures:
                made.cancel()
            return await _settled_in_tasks(calls, on_settled)
        futures[future] = i
    waiting = set(futures)
    try:
        while waiting:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=futures.__getitem__):
                i = futures[future]
                if (exc := future.exception()) is None:
                    on_settled(i, future.result(), None)
                elif isinstance(exc, Exception):
                    call = calls[i]
                    assert isinstance(call, Call)
                    on_settled(i, None, await call.mapped(exc))
                else:
                    raise exc
    finally:
        for future in waiting:  # the caller's cancellation: the calls go on
            future.cancel()


async def _settled_in_tasks(
    calls: Sequence[Awaitable[Any]], on_settled: Callable[[int, Any, AsyncExecError | None], None]
) -> None:
    async def one(i: int) -> None:
        try:
            value = await calls[i]
        except AsyncExecError as exc:
            on_settled(i, None, exc)
        else:
            on_settled(i, value, None)

    async with task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)


async def _gathered_in_tasks(
    calls: Sequence[Awaitable[Any]],
) -> tuple[list[Any], list[AsyncExecError]]:
    results: list[Any] = [None] * len(calls)
    errors: list[AsyncExecError] = []

    async def one(i: int) -> None:
        try:
            results[i] = await calls[i]
        except AsyncExecError as exc:
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return results, errors


class NodeTable(Protocol):
    """What says whether a node is alive (a cluster, or a group of it)."""

    def node_alive(self, node_id: str | None) -> Awaitable[bool]: ...


class _AtAttempt:
    """A caller whose calls' errors carry a fixed attempt."""

    __slots__ = ("_table", "attempt")

    def __init__(self, table: NodeTable, attempt: int) -> None:
        self._table = table
        self.attempt = attempt

    def node_alive(self, node_id: str | None) -> Awaitable[bool]:
        return self._table.node_alive(node_id)


class Unranked(NamedTuple):
    """A worker outside any group's ranks (a pool's idle worker), as a call's member: its
    errors name rank -1."""

    handle: Handle
    metadata: WorkerMetadata
    rank: int = -1


def death_of(handle: Handle) -> Any:
    """The worker's death call: a pending result that fails the moment its process dies
    (its ``wait_closed``), unmapped (a kill settles it), awaited as a call through
    :func:`result_of`. One per worker: every group that holds the worker awaits the same."""
    return handle.call("wait_closed")


def at_attempt(table: NodeTable, attempt: int) -> Caller:
    """A caller for calls whose errors carry ``attempt`` (an independent run's rank has its own;
    a channel's calls, outside any run, 0), whose nodes ``table`` (a cluster, or a group)
    knows."""
    return _AtAttempt(table, attempt)


async def _mapped(
    exc: Exception, who: Member, caller: Caller, cancelled: bool = False
) -> AsyncExecError:
    return await call_error(exc, who, caller.attempt, caller.node_alive, cancelled=cancelled)


def submit(
    caller: Caller, who: Member, method: WorkerMethod, /, *args: Any, **kwargs: Any
) -> Call[Any]:
    """Call ``who``'s ``method``; awaiting the result raises asyncexec's errors (see the module's
    docstring).

    Raises:
        ConfigurationError: an argument does not pickle (named).
    """
    try:
        ref = who.handle.call(method, *args, **kwargs)
    except TypeError as exc:
        _refuse(exc, method, args, kwargs, None)
    return Call(ref, who, caller)


def submit_named(
    caller: Caller, who: Member, naming: Naming, method: WorkerMethod, /, *args: Any, **kwargs: Any
) -> Call[Any]:
    """:func:`submit`, where ``naming`` says how messages name the user's arguments (as the
    call's plan named them: ``argument 'batch'``)."""
    try:
        ref = who.handle.call(method, *args, **kwargs)
    except TypeError as exc:
        lead = _LEADING.get(method, 0)
        default = _default_names(method, args)

        def names(key: int | str) -> str:
            if isinstance(key, int) and key < lead:
                return default(key)
            return naming.argument_name(who.rank, key - lead if isinstance(key, int) else key)

        _refuse(exc, method, args, kwargs, names)
    return Call(ref, who, caller)


def submit_n(caller: Caller, who: Member, method: WorkerMethod, n: int, /, *args: Any) -> list[Any]:
    """Call ``method``, which returns ``n`` values: a reference to each, to pass to other
    workers' calls (they receive the value) or to await through :func:`result_of`.

    Raises:
        ConfigurationError: an argument does not pickle (named).
    """
    try:
        return who.handle.call_n(method, n, *args)
    except TypeError as exc:
        _refuse(exc, method, args, {}, None)


def result_of(caller: Caller, who: Member, ref: Any) -> Call[Any]:
    """A pending result of ``who`` (of :func:`submit_n`, or its death call), awaited as a
    :class:`Call`; a Ray reference through one loop future (see ``_ray.Result``), as a call's
    result is, not through the ``concurrent.futures.Future`` that awaiting it makes."""
    return Call(Result(ref) if type(ref) is ObjectRef else ref, who, caller)


def _refuse(
    exc: TypeError,
    method: WorkerMethod,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    names: Names | None,
) -> NoReturn:
    error = unpicklable(exc, method, args, kwargs, names)
    if error is exc:
        raise exc
    raise error from exc


def unpicklable(
    exc: Exception,
    method: WorkerMethod,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    names: Names | None = None,
) -> Exception:
    """What to raise when submitting a call failed with ``exc`` (Ray's ``TypeError`` for an
    argument that does not pickle): a :class:`ConfigurationError` that names the first argument
    that does not pickle, or ``exc`` itself when each does (another ``TypeError``). Pickles the
    arguments again: only on such a failure."""
    keyed: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    for key, value in keyed:
        try:
            cloudpickle.dumps(value)
        except Exception as failure:
            return ConfigurationError(
                f"{_name(key, method, args, names)} ({type(value).__name__}) cannot be pickled "
                f"to be sent to the workers: {describe(failure)}"
            )
    return exc


def _name(key: int | str, method: WorkerMethod, args: Sequence[Any], names: Names | None) -> str:
    """The argument's name in the message (never raises: this runs while an error is handled)."""
    try:
        return (names or _default_names(method, args))(key)
    except Exception:
        return f"argument {key!r}"


def _default_names(method: WorkerMethod, args: Sequence[Any]) -> Names:
    """How messages name the arguments of a call of ``method``: ``execute``'s by the parameters
    of its function (its first argument), ``call_role``'s (``call_method``'s) by their place
    after the role and the method's name (the method key), any other's by their place."""
    if method == "execute" and args:
        return _function_names(plain(args[0]))  # (without a call's trace context)
    lead = _LEADING.get(method, 0) if method != "execute" else 0
    if lead and len(args) >= lead:
        what = str(plain(args[1])) if lead == 2 else str(plain(args[0])).partition(":")[2]

        def of_role_method(key: int | str) -> str:
            if isinstance(key, int):
                return "the role" if key < lead else f"argument {key - lead} of {what}"
            return f"argument {key!r} of {what}"

        return of_role_method
    return lambda key: f"argument {key!r} of {method}"


def _function_names(fn: Any) -> Names:
    """Names for ``execute``'s arguments: the function, then its parameters' names (where its
    signature has them) for the arguments after it."""
    label = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a builtin: no names
        params = []

    def of_function(key: int | str) -> str:
        if key == 0:
            return f"the function {label}"
        if isinstance(key, int):
            name: Any = params[key - 1] if key - 1 < len(params) else key - 1
            return f"argument {name!r} of {label}"
        return f"argument {key!r} of {label}"

    return of_function
