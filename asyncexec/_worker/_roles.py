"""The instances of a worker's roles (its worker classes), and the calls of their methods.

A group with roles sends every worker the roles pickled once (``asyncexec._dispatch._role.
roles_payload``); each worker makes one instance of each, in role order, after the group's
backend has set up (``torch.distributed`` is ready in ``__init__``). A plain ``__init__`` runs in
a thread, as ``execute()`` runs a plain function, inside the worker's context (``get_context()``
works in it); when the driver gives a checkpoint, a class's ``restore(checkpoint)`` is called
right after its ``__init__``. The instances live in the worker's :class:`~._place.Place` (in
local mode, several workers share a process), until the worker drops them: the roles are made
again (a spare took a rank, the group shrank), the worker is reset (a pooled worker going back)
or it is closed. Then each instance's ``close()``, where its class has one, is called (see
:func:`drop`): what an instance holds (an engine, its processes and memory) is let go before
another is made in the same process.

Calls of the instances' methods run as on a Ray actor: an ``async def`` on the actor's loop,
concurrently with any others; a plain method in a thread, one call at a time per instance (as a
plain Ray actor runs its methods), or up to the role's ``max_concurrency`` at once. A plain call
holds its place until its thread ends, even when the driver stopped waiting for it (a thread
cannot be cancelled): the next one starts after it, and the instance's ``close()`` waits for
it. The driver sends the plain calls of a role
that runs them one at a time to ``call_here`` instead, through the role's own Ray concurrency
group (see ``_actor.ROLE_GROUPS``): Ray runs them one at a time on that group's thread, so they
skip the hop from the actor's loop to a thread and back. On
the threaded worker (``_threaded``: a group whose roles have only plain methods), that group's
thread runs no loop, and ``call_inline`` runs the method there.

While the instances are made, ``_place.ROLE_LOOP`` holds the actor's loop (their ``__init__`` sees
it: ``RolloutServer._asyncexec_loop``), so that an engine with an event loop can live there, and
``_place.ROLE_BEGUN`` gathers the rollout servers that registered their weight installs, so that
one whose making fails is let go of too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

from .._errors import ExecutorStateError, describe
from .._wire._interface import BARE_TYPES, parse_key
from .._wire._protocol import Outcome, RoleFailure, RoleSpec
from . import _outcomes, _place

__all__ = ["Roles", "call", "call_here", "call_inline", "drop", "make", "method"]

#: A factory of the context entered around the roles' code (the backend's: the current CUDA
#: device), as around a run's function.
ContextFactory = Callable[[], AbstractContextManager[Any]]
#: The standard library's logging (structlog is not imported on workers); Ray forwards a
#: worker's log to the driver's output.
_log = logging.getLogger("asyncexec.worker")
#: How long each instance's ``close()`` may take when its worker drops it: then it is left
#: (a thread cannot be stopped) and the worker goes on.
CLOSE_TIMEOUT_S = 30.0
#: The most method keys a worker remembers parsed (a role has a few methods; this bounds a
#: caller that sends keys without end).
_KEYS = 1024


class Roles:
    """One worker's instances of its roles, in role order."""

    __slots__ = (
        "_closed",
        "_ended",
        "_keys",
        "_pools",
        "_running",
        "_sizes",
        "context",
        "instances",
        "limits",
    )

    def __init__(
        self,
        instances: list[object],
        context: ContextFactory | None,
        max_concurrency: list[int] | None = None,
    ) -> None:
        self.instances = instances
        #: Entered around each call of a method (in the thread that runs a plain one).
        self.context = context
        #: Per instance: the calls of its plain methods that may run at once (made on the
        #: actor's loop, where the calls come).
        self._sizes = max_concurrency or [1] * len(instances)
        self.limits = [asyncio.Semaphore(n) for n in self._sizes]
        #: Per instance: the threads its plain calls run in (made at its first such call).
        self._pools: list[concurrent.futures.ThreadPoolExecutor | None] = [None] * len(instances)
        self._closed = False
        #: Per instance: its plain calls running now, each in a thread (see ``wait_idle``).
        self._running = [0] * len(instances)
        self._ended = threading.Condition(threading.Lock())
        #: The role index and method name of each method key seen (a key is parsed once).
        self._keys: dict[str, tuple[int, str]] = {}

    def found(self, key: str) -> tuple[int, Callable[..., Any]]:
        """The role index and the bound method of the method key ``key``.

        Raises:
            ExecutorStateError: not a method key, no such role, or no such method.
        """
        parsed = self._keys.get(key)
        if parsed is None:
            try:
                parsed = parse_key(key)
            except (TypeError, ValueError):
                raise ExecutorStateError(f"not a role method: {key!r}") from None
            if len(self._keys) < _KEYS:
                self._keys[key] = parsed
        return parsed[0], self.method(*parsed)

    def pool(self, role_index: int) -> concurrent.futures.ThreadPoolExecutor:
        """The threads of the plain calls of role ``role_index``'s instance, as many as its
        limit lets run at once: the loop's default pool (a few threads per CPU, shared with
        every other thread of the worker) would run fewer at once than ``max_concurrency``
        says, and calls that wait on each other would never meet. On the actor's loop.

        Raises:
            ExecutorStateError: the worker let go of its instances (see :func:`drop`).
        """
        if self._closed:
            instance = self.instances[role_index]
            raise ExecutorStateError(
                f"this worker let go of its {type(instance).__qualname__} instance "
                "(its roles were made again, or the worker was reset or closed)"
            )
        pool = self._pools[role_index]
        if pool is None:
            pool = self._pools[role_index] = concurrent.futures.ThreadPoolExecutor(
                self._sizes[role_index], thread_name_prefix=f"asyncexec-role{role_index}"
            )
        return pool

    def began(self, role_index: int) -> None:
        """A plain call of role ``role_index``'s instance is sent to its thread (or runs)."""
        with self._ended:
            self._running[role_index] += 1

    def ended(self, role_index: int) -> None:
        """That call has ended."""
        with self._ended:
            self._running[role_index] -= 1
            self._ended.notify_all()

    @contextlib.contextmanager
    def running(self, role_index: int) -> Iterator[None]:
        """Around a plain call of role ``role_index``'s instance, in the thread that runs it."""
        self.began(role_index)
        try:
            yield
        finally:
            self.ended(role_index)

    def wait_idle(self, role_index: int, timeout_s: float) -> bool:
        """Until no plain call of role ``role_index``'s instance runs (a call whose caller
        stopped waiting runs to its end); whether none does within ``timeout_s``. Blocking."""
        with self._ended:
            return self._ended.wait_for(lambda: self._running[role_index] == 0, timeout_s)

    def shutdown(self) -> None:
        """Let the instances' call threads end (those running a call end with it)."""
        self._closed = True
        for pool in self._pools:
            if pool is not None:
                pool.shutdown(wait=False)

    def method(self, role_index: int, name: str) -> Callable[..., Any]:
        """The bound method ``name`` of the instance of role ``role_index``.

        Raises:
            ExecutorStateError: no such role, or its class has no such attribute.
        """
        if not 0 <= role_index < len(self.instances):
            raise ExecutorStateError(
                f"this worker holds {len(self.instances)} role(s), not role {role_index}"
            )
        instance = self.instances[role_index]
        found = getattr(instance, name, None)
        if not callable(found):
            raise ExecutorStateError(f"{type(instance).__qualname__} has no method {name!r}")
        return found  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<Roles {[type(i).__qualname__ for i in self.instances]}>"


async def make(
    payload: bytes, checkpoint: Any = None, context: ContextFactory | None = None
) -> Outcome:
    """Make this worker's instances of its roles from ``payload``, in role order, dropping those
    it held; call each class's ``restore(checkpoint)`` right after its ``__init__`` when
    ``checkpoint`` is not None. On the actor's loop.

    Returns:
        ``Outcome("ok")``, or an error outcome whose ``value`` is the :class:`RoleFailure` that
        says which role failed and where (the instances made before it, and the failed one when
        its ``restore`` failed, are closed as :func:`drop` closes them; one whose ``__init__``
        failed after it registered with the worker, a rollout server's weight installs, stops
        receiving them). Cancelled part-way, it lets go of the instances made so far too.
    """
    from ray import cloudpickle

    place = _place.current_place()
    await drop()  # the instances it held let go first: an engine's memory, before another's
    blobs: tuple[bytes, ...] = cloudpickle.loads(payload)
    instances: list[object] = []
    limits: list[int] = []
    # The loop the instances' async methods are called on, seen by their ``__init__`` (in a
    # thread, in a copy of this context): an engine with an event loop can live there.
    loop_set = _place.ROLE_LOOP.set(asyncio.get_running_loop())
    # The instances whose ``__init__`` registered with the worker (a rollout server's weight
    # installs): one whose making fails is let go of as well.
    begun: list[object] = []
    begun_set = _place.ROLE_BEGUN.set(begun)
    try:
        for index, blob in enumerate(blobs):
            stage: Literal["load", "init", "restore"] = "load"
            try:
                spec: RoleSpec = await asyncio.to_thread(cloudpickle.loads, blob)
                stage = "init"
                instance = await _invoke(spec.cls, spec.args, spec.kwargs, context)
                instances.append(instance)
                made = getattr(instance, "_asyncexec_check_made", None)
                if callable(made):  # the class's check of a made instance (RolloutServer's:
                    # in a thread, as it may load the weights the worker holds)
                    await _invoke(made, (), {}, context)
                restore = getattr(instance, "restore", None)
                if checkpoint is not None and callable(restore):
                    stage = "restore"
                    await _invoke(restore, (checkpoint,), {}, context)
            except Exception as exc:
                failed = _outcomes.error_outcome(exc)
                # What the instances made so far hold (an engine) is let go: no worker holds
                # them, and nothing else would call their close().
                held, instances = instances, []  # (a cancellation meanwhile closes none twice)
                await _close(held, context)
                await _let_go(begun, held)  # (the failed one: made in part, so not closed)
                return failed._replace(value=RoleFailure(index, stage))
            limits.append(spec.max_concurrency)
    except asyncio.CancelledError:
        # Cancelled part-way (the group's start was, the worker is closing): the instances
        # made so far are let go as on a failure, and a rollout server whose ``__init__`` runs
        # on in a thread (one cannot be stopped) stops receiving weight installs; what that
        # ``__init__`` makes from here on is left. Each close is bounded
        # (``CLOSE_TIMEOUT_S``); a second cancellation ends the wait.
        await _close(instances, context)
        await _let_go(begun, instances)
        raise
    finally:
        _place.ROLE_BEGUN.reset(begun_set)
        begun.clear()  # (an ``__init__`` left running in a thread holds the list)
        _place.ROLE_LOOP.reset(loop_set)
    place.roles = Roles(instances, context, limits)
    return Outcome("ok")


def method(role_index: int, name: str) -> Callable[..., Any]:
    """The bound method ``name`` of this worker's instance of role ``role_index`` (a run's
    function: the session enters the backend's context around it).

    Raises:
        ExecutorStateError: this worker holds no roles, or not that role or method.
    """
    return _held().method(role_index, name)


async def call(key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call the method ``key`` (``_interface.method_key``) of this worker's instance of its
    role: an ``async def`` on this loop, a plain method in a thread once the instance's limit
    lets it (see the module's docstring), inside the backend's context; its value when it is of
    a bare type (``_interface.BARE_TYPES``), else how it ended, as an outcome (a worker without
    that role or method is an error outcome too)."""
    try:
        roles = _held()
        role_index, fn = roles.found(key)
        if inspect.iscoroutinefunction(fn):
            with _entered(roles.context):
                result = await fn(*args, **kwargs)
        else:
            result = await _limited(roles, role_index, fn, args, kwargs)
    except Exception as exc:
        return _outcomes.error_outcome(exc)
    except asyncio.CancelledError as exc:
        if _outcomes.cancelled_by_caller():
            raise
        return _outcomes.error_outcome(exc)
    return result if type(result) in BARE_TYPES else _outcomes.value_outcome(result)


async def call_here(key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call the method ``key`` of this worker's instance of its role on the running loop's
    thread, inside the backend's context: a plain method inline (the caller runs it on a loop
    of its own: a Ray concurrency group's, one call at a time), an ``async def`` awaited there;
    its value or outcome, as :func:`call` returns it."""
    try:
        roles = _held()
        role_index, fn = roles.found(key)
        if inspect.iscoroutinefunction(fn):
            with _entered(roles.context):
                result = await fn(*args, **kwargs)
        else:
            with roles.running(role_index):
                result = _call_within(fn, args, kwargs, roles.context)
            if inspect.isawaitable(result):
                with _entered(roles.context):
                    result = await result
    except Exception as exc:
        return _outcomes.error_outcome(exc)
    except asyncio.CancelledError as exc:
        if _outcomes.cancelled_by_caller():
            raise
        return _outcomes.error_outcome(exc)
    return result if type(result) in BARE_TYPES else _outcomes.value_outcome(result)


def call_inline(
    key: str, args: tuple[Any, ...], kwargs: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> Any:
    """:func:`call_here`'s sync twin, for a thread that runs no loop (the threaded worker's
    role group): a plain method inline, inside the backend's context; an ``async def`` found
    under that name, or an awaitable that the method returns, awaited on ``loop`` (the
    worker's) while this thread waits; its value or outcome, as :func:`call` returns it."""
    try:
        roles = _held()
        role_index, fn = roles.found(key)
        if inspect.iscoroutinefunction(fn):
            result = _on(loop, _awaited(fn(*args, **kwargs), roles.context))
        else:
            with roles.running(role_index):
                result = _call_within(fn, args, kwargs, roles.context)
            if inspect.isawaitable(result):
                result = _on(loop, _awaited(result, roles.context))
    except Exception as exc:
        return _outcomes.error_outcome(exc)
    return result if type(result) in BARE_TYPES else _outcomes.value_outcome(result)


def _on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


async def _awaited(awaitable: Awaitable[Any], context: ContextFactory | None) -> Any:
    with _entered(context):
        return await awaitable


def _held() -> Roles:
    roles = _place.current_place().roles
    if not isinstance(roles, Roles):
        raise ExecutorStateError("this worker holds no instances of roles (make_roles first)")
    return roles


async def drop() -> list[BaseException]:
    """Let go of this worker's instances (their roles made again, a pooled worker going back,
    the worker closing): each instance's ``close()``, where its class has one (an ``async def``
    on this loop, else in a thread, inside the worker's context), is called in reverse role
    order, each within :data:`CLOSE_TIMEOUT_S`, then they are forgotten. A rollout server
    stops receiving weight installs first (``RolloutServer._asyncexec_dropped``). An
    instance's close waits first (as long again at most) for its plain calls still running (a
    call whose caller stopped waiting runs to its end): it does not let go of what they use
    under them. Returns the errors the closes raised (a close that took too long, or calls
    still running after that wait: TimeoutError), each logged; never raises."""
    place = _place.current_place()
    roles, place.roles = place.roles, None
    if not isinstance(roles, Roles):
        return []
    try:
        return await _close(roles.instances, roles.context, roles)
    finally:
        roles.shutdown()


async def _close(
    instances: list[object], context: ContextFactory | None, roles: Roles | None = None
) -> list[BaseException]:
    """Call each instance's ``close()``, as :func:`drop` says (once the plain calls of
    ``roles``' instances end); return the errors, each logged."""
    errors: list[BaseException] = []
    for index in reversed(range(len(instances))):
        instance = instances[index]
        name = type(instance).__qualname__
        await _dropped(instance, errors)
        close = getattr(instance, "close", None)
        if not callable(close):
            continue
        if (
            roles is not None
            and not roles.wait_idle(index, 0)  # (at once: no thread when none runs)
            and not await asyncio.to_thread(roles.wait_idle, index, CLOSE_TIMEOUT_S)
        ):
            busy = TimeoutError(f"a call of {name} still runs after {CLOSE_TIMEOUT_S:g} s")
            errors.append(busy)
            _log.warning("role_close_while_called role=%s error=%s", name, describe(busy))
        try:
            await asyncio.wait_for(_invoke(close, (), {}, context), CLOSE_TIMEOUT_S)
        except Exception as exc:
            errors.append(exc)
            _log.warning("role_close_failed role=%s error=%s", name, describe(exc))
    return errors


async def _dropped(instance: object, errors: list[BaseException]) -> None:
    """The class's own letting go of ``instance`` (RolloutServer's: of weight installs, in a
    thread, as it waits for an install that runs), where it has one; its error is added to
    ``errors``, and logged."""
    dropped = getattr(instance, "_asyncexec_dropped", None)
    if not callable(dropped):
        return
    try:
        await asyncio.wait_for(_invoke(dropped, (), {}, None), CLOSE_TIMEOUT_S)
    except Exception as exc:
        errors.append(exc)
        name = type(instance).__qualname__
        _log.warning("role_drop_failed role=%s error=%s", name, describe(exc))


async def _let_go(begun: list[object], held: list[object]) -> None:
    """Let go of each instance in ``begun`` (see ``_place.ROLE_BEGUN``) that is not in
    ``held``, whose making failed or was cancelled: its class's own letting go (no weight
    install reaches it from now on), not its ``close()``, as its ``__init__`` did not end."""
    for instance in reversed(begun):
        if not any(instance is made for made in held):
            await _dropped(instance, [])


async def _invoke(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: ContextFactory | None,
) -> Any:
    """``fn`` as ``execute()`` calls it: an ``async def`` on this loop, else in a thread."""
    if inspect.iscoroutinefunction(fn):
        with _entered(context):
            return await fn(*args, **kwargs)
    result = await asyncio.to_thread(_call_within, fn, args, kwargs, context)
    if inspect.isawaitable(result):
        with _entered(context):
            result = await result
    return result


async def _limited(
    roles: Roles,
    role_index: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A plain method in a thread of its instance's pool once the instance's limit lets it; the
    place is given back when the thread ends, not when this caller stops waiting (a cancelled
    call's thread runs on)."""
    limit, context = roles.limits[role_index], roles.context
    await limit.acquire()
    try:
        run = functools.partial(
            contextvars.copy_context().run, _call_within, fn, args, kwargs, context
        )
        thread = asyncio.get_running_loop().run_in_executor(roles.pool(role_index), run)
    except BaseException:
        limit.release()
        raise
    roles.began(role_index)  # from now until the thread ends (``drop`` waits for it)

    def done(_: object) -> None:
        roles.ended(role_index)
        limit.release()

    thread.add_done_callback(done)
    result = await asyncio.shield(thread)
    if inspect.isawaitable(result):
        with _entered(context):
            result = await result
    return result


def _call_within(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: ContextFactory | None,
) -> Any:
    with _entered(context):
        return fn(*args, **kwargs)


def _entered(context: ContextFactory | None) -> AbstractContextManager[Any]:
    return contextlib.nullcontext() if context is None else context()
