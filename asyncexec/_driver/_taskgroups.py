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
stays its ``__context__`` (not shown in its traceback). A group of cancellations alone escapes as
it is: cancellation belongs to anyio.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import anyio
import anyio.abc

from .._errors import AsyncExecError, describe

__all__ = ["escaped", "one_error", "task_group"]


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
        # Its own cause kept (None: none shown); the group stays its __context__, unshown.
        raise error from error.__cause__


@contextlib.asynccontextmanager
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """``anyio.create_task_group()`` under :func:`one_error`: ``async with task_group() as tg``."""
    with one_error():
        async with anyio.create_task_group() as tg:
            yield tg
