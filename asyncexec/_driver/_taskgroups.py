"""What escapes a task group: one policy for every task group of the package.

anyio's task groups raise an ``ExceptionGroup`` when a task fails, even when one task failed;
a caller who writes ``except asyncexec.WorkerRaisedError`` misses it. Every task group of the
driver is made by :func:`task_group` (or, held open by hand, closed under :func:`one_error`),
which raises one error of what escaped instead:

- a ``KeyboardInterrupt``, ``SystemExit`` or other ``BaseException`` that is not a cancellation,
  first of all (it must not be lost behind an ordinary failure);
- else the first of asyncexec's errors (a rank's failure, mapped at the seam);
- else the first other ``Exception``.

The others are attached to it as notes (``also failed at the same time: ...``) and the group
becomes its ``__context__`` (not shown in its traceback) unless it had one. A group of
cancellations alone escapes as it is: cancellation belongs to anyio.

An object that holds a task group open between its own ``__aenter__`` and ``__aexit__`` (a
router, a pipeline, an executor's life) enters it with ``async with`` on a
``contextlib.AsyncExitStack`` whose ``pop_all()`` it keeps, and leaves that stack with the body's
exception (``await stack.__aexit__(exc_type, exc, tb)``): the group sees what its body raised, as
under a plain ``async with``, and never a made-up ``(None, None, None)``.

A teardown step runs under :func:`teardown`: shielded from the cancellation that closes its
object, and bounded by a deadline of its own, so that a step that hangs (a call that never
answers its cancellation) cannot hang ``close()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import TracebackType

import anyio
import anyio.abc

from .._errors import AsyncExecError, describe
from .._logging import get_logger

__all__ = ["TEARDOWN_S", "escaped", "one_error", "task_group", "teardown"]

#: The longest one step of a teardown waits (cancelling a router's attempts and waiting for them
#: to end, stopping a pipeline's requests) unless it is given a bound of its own: past it,
#: ``close()`` goes on without that step (logged as ``teardown_timed_out``). Well above what a
#: step takes when every worker answers (milliseconds to a few seconds); a step that waits for a
#: worker that never answers is what it cuts short.
TEARDOWN_S = 30.0


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def escaped(exc: BaseException) -> BaseException:
    """The one error that stands for ``exc`` (see the module's docstring); ``exc`` itself when it
    is no group, or a group of cancellations alone."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    cancelled = anyio.get_cancelled_exc_class()
    leaves = [e for e in _leaves(exc) if not isinstance(e, cancelled)]
    if not leaves:
        return exc
    chosen = (
        next((e for e in leaves if not isinstance(e, Exception)), None)
        or next((e for e in leaves if isinstance(e, AsyncExecError)), None)
        or leaves[0]
    )
    for other in leaves:
        if other is not chosen:
            chosen.add_note(f"also failed at the same time: {describe(other)}")
    return chosen


@contextlib.contextmanager
def one_error() -> Iterator[None]:
    """Around ``async with anyio.create_task_group()``: what escapes the group escapes as one
    error (see the module's docstring)::

        with one_error():
            async with anyio.create_task_group() as tg:
                ...
    """
    try:
        yield
    except BaseExceptionGroup as group:
        error = escaped(group)
        if error is group:
            raise
        # Its own cause kept (None: none shown); the group becomes its __context__, unshown,
        # unless it had one (a body's exception raised while handling another): that stays.
        context, suppress = error.__context__, error.__suppress_context__
        try:
            raise error from error.__cause__
        finally:
            if context is not None:
                error.__context__, error.__suppress_context__ = context, suppress


class task_group:  # a class used as a function: ``async with task_group() as tg``
    """``anyio.create_task_group()`` under :func:`one_error`: ``async with task_group() as tg``.

    A class, not an async generator: an object that holds its group open and is dropped
    without being left (an executor entered by hand and closed with ``aclose()`` alone) leaves
    a plain object to the garbage collector. An async generator would be closed by asyncio's
    finalizer in a task of its own, whose exit of the group's cancel scope cancels whatever task
    then runs (``RuntimeError: Attempted to exit cancel scope in a different task``)."""

    __slots__ = ("_tg",)

    def __init__(self) -> None:
        self._tg = anyio.create_task_group()

    async def __aenter__(self) -> anyio.abc.TaskGroup:
        return await self._tg.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        with one_error():
            return bool(await self._tg.__aexit__(exc_type, exc, tb))


@contextlib.contextmanager
def teardown(what: str, bound_s: float | None = None) -> Iterator[anyio.CancelScope]:
    """One step of a teardown: shielded from outer cancellation, bounded by its own deadline
    (``bound_s``; None: :data:`TEARDOWN_S`). A step cut short by its deadline is logged
    (``teardown_timed_out``, with ``what``) and the caller goes on::

        with teardown("router_attempts"):
            await wait_every_attempt()
    """
    if bound_s is None:
        bound_s = TEARDOWN_S  # (read here: a test may lower it)
    with anyio.move_on_after(bound_s, shield=True) as scope:
        yield scope
    if scope.cancelled_caught:
        get_logger().warning("teardown_timed_out", step=what, bound_s=bound_s)
