"""How a call on a worker ended, as the driver receives it: an :class:`Outcome` whose error (when
it pickles, else a ``RuntimeError`` that keeps its type and text) carries its traceback as text."""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

from .._errors import first_line
from .._wire._protocol import Outcome
from . import _place

__all__ = ["cancelled_by_caller", "error_outcome", "takes_config", "value_outcome"]

_WORKER_DIR = os.path.dirname(os.path.abspath(__file__))


def takes_config(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is called with the run's config (it has a positional parameter)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )


def error_outcome(exc: BaseException) -> Outcome:
    """The outcome of a call that raised ``exc``: the error as it travels (a pickled copy, or,
    when it does not pickle, a RuntimeError that keeps its type and text) and its traceback as
    text, without colours."""
    from ray import cloudpickle

    # The traceback from the user's code on: asyncexec's own frames above it say nothing.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_WORKER_DIR):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        # The copy, as a worker process's error reaches the driver: no frames (a local worker's
        # error would otherwise hold its session, and the function's locals, through its
        # traceback for as long as the application keeps the error).
        portable = cloudpickle.loads(cloudpickle.dumps(exc))
    except Exception:
        try:
            message = str(exc)
        except Exception:  # a __str__ that raises: this handler must not (see ``first_line``)
            message = first_line(exc)
        portable = RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {message}")
    return Outcome("error", error=portable, traceback=text)


def cancelled_by_caller() -> bool:
    """Whether a ``CancelledError`` seen now by a call on the worker's loop is the call's own
    cancellation (the driver cancelled it, or the worker closes: the task that runs it is being
    cancelled), not an error of the called code (it awaited a task that was cancelled), which
    is its outcome as any other error is."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def value_outcome(value: Any) -> Outcome:
    """The outcome of a call that returned ``value``; an error when it cannot be pickled.

    The value is pickled here, once (it was pickled to be tested, then again by Ray): in a
    worker process the outcome carries that pickle, its large buffers out of band (Ray sends
    them without a copy, as it sends a value's own), and the value is whole again when Ray
    unpickles the outcome on the driver. A local worker (a thread of the driver's process,
    where nothing is pickled) returns the value itself, pickled once to check that it would
    travel, as from a worker process. Numbers, strings, bytes and ``None`` travel as they are."""
    if type(value) in _PLAIN:
        return Outcome("ok", value)
    from ray import cloudpickle

    buffers: list[pickle.PickleBuffer] = []
    try:
        data = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception as exc:
        message = f"the return value cannot be pickled ({type(value).__name__}): {exc}"
        return Outcome("error", error=TypeError(message))
    if _place.PLACE.get(None) is not None:  # a local worker's call: nothing crosses a process
        return Outcome("ok", value)
    return Outcome("ok", _Pickled(data, buffers))


#: Return values that travel as they are (Ray pickles them at once, and always can).
_PLAIN = frozenset({type(None), bool, int, float, str, bytes})
#: A pickle longer than this travels out of band too (not copied into Ray's message).
_OUT_OF_BAND_BYTES = 64 * 1024


class _Pickled:
    """A return value pickled on the worker: it pickles as its pickle (the bytes, its buffers
    out of band) and unpickles as the value."""

    __slots__ = ("buffers", "data")

    def __init__(self, data: bytes, buffers: list[pickle.PickleBuffer]) -> None:
        self.data = data
        self.buffers = buffers

    def __reduce__(self) -> tuple[Any, ...]:
        data = self.data
        carried = pickle.PickleBuffer(data) if len(data) > _OUT_OF_BAND_BYTES else data
        return (_unpickled, (carried, self.buffers))


def _unpickled(data: Any, buffers: list[Any]) -> Any:
    """The value of a :class:`_Pickled`, where it arrives."""
    return pickle.loads(data, buffers=buffers)
