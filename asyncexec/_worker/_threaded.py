"""The threaded worker actor: a *sync* Ray actor for the groups whose roles have only plain
methods. The driver's seam picks it (``_driver/cluster/_ray.py``: the rule is Ray's own, made
per group, see ``asyncexec._dispatch._role.plain_only``).

Ray makes an actor async when its class has an ``async def`` method, and then even a plain
method in a concurrency group of its own pays Ray's async-actor path, dearer than a sync
actor's call. This actor has no ``async def`` method, so Ray runs it as a
threaded sync actor: a role's plain method (``call_method_sync``) runs inline on its role's
concurrency-group thread (``role{i}``, one call at a time), as on a plain sync Ray actor.

Everything else is the async worker's code (``_actor._Worker``, held here, nothing
duplicated): the actor starts an asyncio event loop of its own in a daemon thread, and each of
the other methods of the worker's interface is a plain method that runs the worker's coroutine
of the same name on that loop and blocks a thread of the actor's default group until it ends
(``run_coroutine_threadsafe``). The default group has :data:`CONTROL_THREADS` threads: it bounds
the calls that wait at once on one worker (one long poll per run, channel calls, concurrent
``execute()`` calls and calls of roles that allow several plain calls at once); a call past
that waits for a thread. The worker's life (``ping``, ``wait_closed``, ``close``: :data:`LIFE`)
has a group of its own, so that a flood of those calls never starves a health check (which
still asks the loop) or the wait that tells the driver the process died.

A weight push's install (``channel_receive``) has a group of one thread of its own
(:data:`RECEIVE_GROUP`): a worker receives from one channel at a time, whose versions install
in order anyway, and the state is unpickled by the same thread each time, in memory its
allocator kept (see ``_memory``, which the actor applies when it starts); unpickled by whichever
thread of the default group was free, a 6 MB state took fresh pages of another arena.

Cancellation: Ray cannot interrupt a running task of a sync actor; it marks it cancelled. The
bridge of ``execute`` (the one call the driver cancels here: an ``async def`` function's) looks
at that mark while it waits and cancels the coroutine on the loop, which then ends as on the
async worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import ray

from .._wire._interface import WORKER_METHODS, unpacked
from .._wire._tracing import Carried, attached, split
from . import _channel, _memory, _roles
from ._actor import ROLE_GROUPS, WorkerCode, role_group

__all__ = [
    "CONTROL_THREADS",
    "LIFE",
    "LIFE_GROUP",
    "RECEIVE_GROUP",
    "ThreadedWorkerActor",
    "ThreadedWorkerCode",
]

#: The threads of the actor's default group: how many control calls (everything but a role's
#: plain calls) may wait at once on one worker. Ray starts them with the actor; 64 costs about
#: what 8 do in start-up time and memory (see docs/benchmarks.md).
CONTROL_THREADS = 64
#: The methods of the worker's life, and their concurrency group (``wait_closed`` holds one of
#: its threads for the worker's life; the driver sends one ping at a time).
LIFE = frozenset({"close", "ping", "wait_closed"})
LIFE_GROUP = "life"
#: The concurrency group of ``channel_receive`` (one thread; see the module's docstring).
RECEIVE_GROUP = "channel_receive"
#: How often a cancellable call's bridge looks whether Ray marked its task cancelled.
_CANCEL_POLL_S = 0.05


class _Threaded:
    """A worker as a sync Ray actor (see the module's docstring). Its methods are the worker
    interface's: ``call_method_sync`` here, the others made by :func:`_bridge`."""

    def __init__(self) -> None:
        _memory.keep_freed_memory()
        self._worker = WorkerCode()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="asyncexec-loop", daemon=True
        )
        self._thread.start()

    def _on_loop(self, coro: Coroutine[Any, Any, Any], cancellable: bool = False) -> Any:
        """Run ``coro`` on the actor's loop and return its value, from a thread of Ray's. A
        cancellable one is cancelled on the loop once Ray marks this call's task cancelled;
        the call then ends when the coroutine has (as an async actor's cancelled task does:
        the driver holds the call's place until then)."""
        if not cancellable:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        task: list[asyncio.Task[Any]] = []  # the coroutine's task, once it has started
        future = asyncio.run_coroutine_threadsafe(_told(coro, task), self._loop)
        context = ray.get_runtime_context()
        cancelled = False
        while True:
            try:
                # Once cancelled, this raises CancelledError when the coroutine has ended.
                return future.result(_CANCEL_POLL_S)
            except concurrent.futures.TimeoutError:
                if not cancelled and task and context.is_canceled():
                    cancelled = True  # the coroutine sees CancelledError on the loop
                    self._loop.call_soon_threadsafe(task[0].cancel)

    # A weight push's two ends run right here, on the call's thread: they block (the user's
    # read and install), and the bridge would hop to the loop and from there to a thread of
    # its own (two hops of each push's critical path).

    def channel_read(self, name: str, timeout_s: float, mapping: bool) -> tuple[str, Any]:
        """As the async worker's ``channel_read``, on this call's thread."""
        state = _channel.read_state(name, timeout_s, mapping=mapping)
        return type(state).__name__, state

    def channel_receive(self, name: str, version: int, *shards: Any) -> None:
        """As the async worker's ``channel_receive``, on this call's thread (of its group:
        :data:`RECEIVE_GROUP`)."""
        _channel.install_state(name, version, _channel.merge([*shards]))

    def call_method_sync(self, key: str | Carried | list[Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call the plain method ``key`` of this worker's instance of its role right here, on
        the role's concurrency-group thread (one call at a time, as on a sync Ray actor); an
        ``async def`` found under that name, or an awaitable that the method returns, is
        awaited on the actor's loop. Answers as the async worker's ``call_method_sync``."""
        lead, args = unpacked(key, args)
        lead, context = split(lead)
        if context is not None:
            with attached(context):
                return _roles.call_inline(lead, args, kwargs, self._loop)
        return _roles.call_inline(lead, args, kwargs, self._loop)


async def _told(coro: Coroutine[Any, Any, Any], task: list[asyncio.Task[Any]]) -> Any:
    """``coro``'s value; its task is put in ``task`` first (to be cancelled from a thread)."""
    current = asyncio.current_task()
    assert current is not None
    task.append(current)
    return await coro


def _bridge(name: str) -> Callable[..., Any]:
    """The plain method ``name`` of the threaded actor: the async worker's coroutine of that
    name, run on the actor's loop, with its signature and docstring (not ``functools.wraps``:
    Ray unwraps ``__wrapped__`` when it reads a method's options, and would read the
    coroutine's)."""
    code = getattr(WorkerCode, name)
    cancellable = name == "execute"

    def bridge(self: _Threaded, /, *args: Any, **kwargs: Any) -> Any:
        return self._on_loop(code(self._worker, *args, **kwargs), cancellable)

    bridge.__name__ = name
    bridge.__qualname__ = f"{_Threaded.__qualname__}.{name}"
    bridge.__doc__ = code.__doc__
    bridge.__signature__ = inspect.signature(code)  # type: ignore[attr-defined]
    if name in LIFE:
        in_group: Callable[..., Any] = ray.method(concurrency_group=LIFE_GROUP)(bridge)
        return in_group
    return bridge


for _name in sorted(WORKER_METHODS - {"call_method_sync", "channel_read", "channel_receive"}):
    setattr(_Threaded, _name, _bridge(_name))
del _name
_receive: Callable[..., Any] = ray.method(concurrency_group=RECEIVE_GROUP)(
    _Threaded.channel_receive
)
_Threaded.channel_receive = _receive  # type: ignore[method-assign]

#: The threaded worker's code, undecorated (the interface's test looks at its methods).
ThreadedWorkerCode = _Threaded
# max_restarts=0: as the async worker's (a dead worker is replaced by a gang restart).
ThreadedWorkerActor = ray.remote(
    max_restarts=0,
    max_task_retries=0,
    max_concurrency=CONTROL_THREADS,
    concurrency_groups={
        LIFE_GROUP: 4,
        RECEIVE_GROUP: 1,
        **{role_group(i): 1 for i in range(ROLE_GROUPS)},
    },
)(_Threaded)
