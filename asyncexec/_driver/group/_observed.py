"""A call on a rank as the executor's observer sees it: its first end is emitted once, as a
:class:`~.._events.CallEnded` from its send (the timeline draws it as the rank's span), and ends
its OpenTelemetry span (opened at the send: its context travels to the worker with the call).
A method or function that raised on the worker ended the call with that error, though the call
itself answers it as an outcome (the caller raises it later, with the rank's context).

A call nobody observes is not wrapped at all: the call sites ask ``observer.handles(CallEnded)``
and whether tracing made a span first (a dict look-up and a None check on a call's hot path)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, TypeVar, cast

from ..._wire import _tracing
from ..._wire._protocol import Outcome
from .._events import CallEnded
from .._observe import Observer

__all__ = ["ObservedCall", "dropped", "observed", "unsent", "watched"]

T = TypeVar("T")


class ObservedCall:
    """A call on a rank, awaitable as often as the call is, whose first end is emitted (see the
    module's docstring); cancelled as the call is."""

    __slots__ = ("_call", "_done", "_name", "_observer", "_rank", "_span", "_start")

    def __init__(
        self, observer: Observer | None, rank: int, name: str, call: Any, span: Any, start: float
    ) -> None:
        self._call = call
        self._observer = observer  # None: nothing handles CallEnded
        self._span = span
        self._done = False
        self._rank = rank
        self._name = name
        self._start = start

    def cancel(self) -> None:
        """Cancel the call on the worker (see ``cluster.Call.cancel``)."""
        self._call.cancel()

    def __await__(self) -> Any:
        error: BaseException | None = None
        stack: str | None = None
        try:
            answer = yield from self._call.__await__()
            error = _failure(answer)
            if error is not None:
                stack = answer.traceback or None
            return answer
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.ended(error, stack)

    def ended(self, error: BaseException | None, stack: str | None = None) -> None:
        """The call's end, emitted and its span ended, once (``error``: what it ended with,
        ``stack``: the worker's traceback of it, as text): when it is first awaited to its end,
        or when its caller will not await it (a later rank's send failed: see
        :func:`dropped`)."""
        if self._done:
            return
        self._done = True
        if self._observer is not None:
            event = CallEnded(self._rank, self._name, self._start, time.monotonic(), error)
            self._observer.emit(event)
        if self._span is not None:
            _tracing.end_call(self._span, self._name, self._rank, error, stack)


def _failure(answer: Any) -> BaseException | None:
    """The worker's error when ``answer`` is the outcome of a method or function that failed
    there (the call answers that failure, it does not raise it; its traceback comes as text,
    ``answer.traceback``), else None."""
    if type(answer) is not Outcome or answer.kind == "ok":
        return None
    return answer.error or RuntimeError("the function was stopped")


def dropped(calls: Iterable[Any], error: BaseException) -> None:
    """``calls``, sent, will not be awaited (the send of a later rank's failed with ``error``):
    each observed one ends now, failed with ``error`` (its span would never end otherwise)."""
    for call in calls:
        if type(call) is ObservedCall:
            call.ended(error)


def unsent(span: Any, name: str, rank: int, error: BaseException) -> None:
    """A call whose send failed with ``error`` (an argument that does not pickle): its span
    (None: none) ends, failed with it."""
    if span is not None:
        _tracing.end_call(span, name, rank, error)


def watched(observer: Observer, span: Any) -> bool:
    """Whether a call is observed or traced (``span``: its OpenTelemetry span, or None): the
    call sites ask before they send it, and take the time of the send (see :func:`observed`)."""
    return span is not None or observer.handles(CallEnded)


def observed(observer: Observer, rank: int, name: str, call: T, span: Any, start: float) -> T:
    """``call`` (sent to ``rank`` at ``start``, by ``time.monotonic()``, running ``name``) as an
    :class:`ObservedCall`, awaited as the call is; ``span``: its OpenTelemetry span, or None.
    For a call that is observed or traced (the caller checks). ``start`` is taken before the
    send: a worker in this process (local mode) may run the call before the send returns, and
    a start taken after it made the span shorter than the call (by the time the driver's
    thread waited for the GIL)."""
    watching = observer if observer.handles(CallEnded) else None
    return cast(T, ObservedCall(watching, rank, name, call, span, start))
