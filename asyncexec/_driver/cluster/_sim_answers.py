"""How a simulated worker answers a call (see ``_sim``): at once (:class:`Ready`) or later
(:class:`Pending`), each answer crossing a pickle round trip as an actor's result does: dumped by
the worker, loaded by the driver when it awaits it. No task, thread or loop of its own.

An answer is dumped by plain pickle, or, where plain pickle cannot (a class or function defined
in a function, a lambda, in a value or an error), by Ray's cloudpickle, as Ray dumps an actor's
result. One that neither can dump fails its call: it never leaves the call unanswered."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Generator
from typing import Any

from ..._wire._pickle import dumps as cloud_dumps

__all__ = ["PROTOCOL", "Pending", "Ready", "dumped", "ready"]

PROTOCOL = pickle.HIGHEST_PROTOCOL


class Ready:
    """A call's answer that is there: awaitable any number of times, without waiting."""

    __slots__ = ("_data", "_error")

    def __init__(self, data: bytes | None, error: BaseException | None = None) -> None:
        self._data = data
        self._error = error

    def __await__(self) -> Generator[Any, None, Any]:
        if self._error is not None:
            raise self._error
        assert self._data is not None
        return pickle.loads(self._data)
        yield  # a generator: ``await`` accepts it

    def loop_future(self) -> None:
        return None  # (awaited at once: no future)


class Pending:
    """A call's answer to come: awaitable any number of times and from several tasks; a
    cancelled wait does not cancel the call (as with an ``ObjectRef``)."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.future.add_done_callback(_retrieve)

    def __await__(self) -> Generator[Any, None, Any]:
        data = yield from asyncio.shield(self.future).__await__()
        return pickle.loads(data)

    def loop_future(self) -> None:
        return None  # (awaited as it is: a future's waiter already)

    def answer(self, value: Any) -> None:
        if self.future.done():
            return
        try:
            data = dumped(value)
        except Exception as exc:  # no pickler could: the call fails rather than hangs
            self.future.set_exception(exc)
        else:
            self.future.set_result(data)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def ready(value: Any) -> Ready:
    """The answer ``value``, there at once."""
    try:
        return Ready(dumped(value))
    except Exception as exc:  # no pickler could: the call fails
        return Ready(None, exc)


def dumped(value: Any) -> bytes:
    """``value`` dumped as an answer: by plain pickle (the cheaper), else by Ray's cloudpickle.

    Raises:
        Exception: neither could dump it (cloudpickle's error).
    """
    try:
        return pickle.dumps(value, PROTOCOL)
    except Exception:
        return cloud_dumps(value)
