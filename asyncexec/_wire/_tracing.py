"""OpenTelemetry spans of runs, attempts, restarts, calls and pushes, with the W3C trace context
carried into the workers (both sides import this module; it needs nothing but the standard
library until a span is made).

With the ``tracing`` extra (``opentelemetry-api``) and a tracer provider set by the application
(``opentelemetry.trace.set_tracer_provider``: the SDK with the exporter it chose), the driver
opens spans named ``asyncexec.run``, ``asyncexec.attempt``, ``asyncexec.restart``,
``asyncexec.call`` (one per rank a call goes to), ``asyncexec.push.read`` /
``asyncexec.push.deliver``, and the RL loop's: ``asyncexec.pipeline.batch``,
``asyncexec.pipeline.update`` (holding ``.pause``, ``.push`` and ``.resume``, each standing
for the servers' calls it made, see :func:`as_calls`, and holding the channel's pushes) and
``asyncexec.router.request``, which stands for its first
attempt's call (its ``asyncexec.function`` and ``asyncexec.rank``, its context carried: see
:func:`as_first_call`) and holds an ``asyncexec.router.attempt`` for each attempt after the
first (standing for its call: :func:`as_call`) and for a first attempt that failed.
A call carries its span's context to the worker as a W3C ``traceparent`` (inside the call's
leading argument: see :class:`Carried`), where it is the current context while the method
runs: a span the method opens is a child of the driver's call (a run's function, likewise,
of its attempt's span: ``RunStart.trace_context``). asyncexec configures no exporter, as it
configures no logging: with no provider set (the API's default), nothing is made and nothing
is carried, and without the API installed each place pays one check.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "Carried",
    "Opened",
    "as_call",
    "as_calls",
    "as_first_call",
    "attached",
    "begin",
    "call_span",
    "carried",
    "carry",
    "current",
    "current_traceparent",
    "end",
    "end_call",
    "finish",
    "in_request",
    "in_span",
    "plain",
    "record",
    "split",
    "spanned",
    "start",
    "traceparent",
    "tracer",
    "under_request",
    "within",
]

T = TypeVar("T")
_NAME = "asyncexec"
_tracer: tuple[Any, Any] = (None, None)  # the provider, and asyncexec's tracer of it


def _trace() -> Any:
    """``opentelemetry.trace`` when the application has imported it, else None. An application
    that set a tracer provider has imported it; asyncexec never imports it itself, so a driver
    without tracing (or a service's first request, on its event loop) pays no import."""
    return sys.modules.get("opentelemetry.trace")


def tracer() -> Any:
    """asyncexec's tracer when the application has set a tracer provider, else None (the
    API's default provider makes spans that record nothing: none are made then)."""
    trace = _trace()
    if not trace:
        return None
    global _tracer
    provider = trace.get_tracer_provider()
    if _tracer[0] is provider:  # (asked on every call and request: the checks once)
        return _tracer[1]
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    _tracer = (provider, provider.get_tracer(_NAME))  # a provider makes one at each ask
    return _tracer[1]


def start(name: str, **attributes: Any) -> Any:
    """A span ``name``, a child of the current context, started now; None when tracing is
    off. End it with :func:`end`."""
    made = tracer()
    if made is None:
        return None
    return made.start_span(name, attributes={k: v for k, v in attributes.items() if v is not None})


def end(span: Any, error: BaseException | None = None) -> None:
    """End ``span`` (None: nothing), marked as failed with ``error``."""
    if span is None:
        return
    if error is not None:
        _failed(span, error)
    span.end()


def _failed(span: Any, error: BaseException, stack: str | None = None) -> None:
    """Mark ``span`` as failed with ``error`` (its exception recorded, with ``stack`` as its
    stack trace when given: a worker's error arrives without its frames, its traceback as
    text). Never raises: the SDK reads the error's message with ``str()``, which a user's
    exception may fail (its type and stack are recorded then, without its message)."""
    trace = _trace()
    try:
        span.record_exception(error, {"exception.stacktrace": stack} if stack else None)
    except Exception:
        attributes = {
            "exception.type": type(error).__qualname__,
            "exception.message": "<the message could not be read: its __str__ raised>",
            "exception.stacktrace": stack or "".join(traceback.format_exception(error)),
        }
        span.add_event("exception", attributes)
    span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))


@contextlib.contextmanager
def current(span: Any) -> Iterator[None]:
    """``span`` as the current span while the block runs (nothing when it is None)."""
    if span is None:
        yield
        return
    token = _attach(span)
    try:
        yield
    finally:
        _detach(token)


def _attach(span: Any) -> Any:
    """Make ``span`` the current span (what ``trace.use_span`` does, without its two context
    managers: a fifth of its cost); the token to detach."""
    return sys.modules["opentelemetry.context"].attach(_trace().set_span_in_context(span))


def _detach(token: Any) -> None:
    sys.modules["opentelemetry.context"].detach(token)


async def in_span(name: str, awaitable: Awaitable[T], **attributes: Any) -> T:
    """Await ``awaitable`` inside a span ``name`` (current while it runs) when tracing is on."""
    span = start(name, **attributes)
    if span is None:
        return await awaitable
    return await within(span, awaitable)


async def within(span: Any, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` with ``span`` (not None) current, then end it (failed with what
    ``awaitable`` raised): a call made meanwhile is its child."""
    token = _attach(span)
    try:
        value = await awaitable
    except BaseException as exc:
        _detach(token)
        end(span, exc)
        raise
    _detach(token)
    end(span)
    return value


@contextlib.contextmanager
def spanned(name: str, **attributes: Any) -> Iterator[Any]:
    """A span ``name``, current while the block runs, ended (failed with what the block raised)
    after it; yields the span (None when tracing is off)."""
    span = start(name, **attributes)
    if span is None:
        yield None
        return
    try:
        with current(span):
            yield span
    except BaseException as exc:
        end(span, exc)
        raise
    end(span)


def record(name: str, seconds: float, **attributes: Any) -> None:
    """A span ``name`` that ended now after ``seconds`` (something already over, as an event
    says: a batch the learner waited for), a child of the current context; nothing when
    tracing is off."""
    made = tracer()
    if made is None:
        return
    now = time.time_ns()
    attrs = {k: v for k, v in attributes.items() if v is not None}
    span = made.start_span(name, start_time=now - int(seconds * 1e9), attributes=attrs)
    span.end(now)


class Carried(NamedTuple):
    """A call's leading argument (the function of ``execute``) with the W3C trace context of
    the call's span (``traceparent``, then the ``tracestate``'s line when there is one, as one
    string): the context rides inside an argument the call sends anyway (one more argument
    costs Ray a serialisation and an entry of the task's specification on each side; a record
    inside one costs a few bytes of its pickle). A method's key (a string) carries it as a
    string instead: see :func:`carry`."""

    value: Any
    context: str


def carry(value: Any, context: str) -> Any:
    """A call's leading argument ``value`` with the trace context ``context``: a method's key
    (``call_method``'s, a string, which never holds a newline) as one string, the key, a
    newline and the context (a string is written by Ray's serialiser as MessagePack, where a
    :class:`Carried` record would be pickled, on both sides of every call); anything else
    (``execute``'s function, pickled anyway) as a :class:`Carried`. :func:`split` reads it
    back."""
    return f"{value}\n{context}" if type(value) is str else Carried(value, context)


def split(value: Any) -> tuple[Any, str | None]:
    """A call's leading argument without the trace context it may carry (see :func:`carry`),
    and that context (None: none)."""
    if type(value) is str:
        key, newline, context = value.partition("\n")
        return (key, context) if newline else (value, None)
    if type(value) is Carried:
        return value.value, value.context
    return value, None


def plain(value: Any) -> Any:
    """``value`` without the trace context it may carry (see :func:`carry`)."""
    if type(value) is str:
        return value.partition("\n")[0]
    return value.value if type(value) is Carried else value


def traceparent(span: Any) -> str:
    """``span``'s context as W3C's ``traceparent`` (and its ``tracestate`` after a newline
    when it has one), formatted here: what W3C's propagator writes, without its carrier and
    context objects."""
    c = span.get_span_context()
    line = f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"
    state = c.trace_state
    return f"{line}\n{state.to_header()}" if state else line


#: The API's ``context`` and ``trace`` modules on a worker (imported at its first carried
#: context), None where it is not installed; ``()`` until then.
_API: tuple[Any, Any] | tuple[()] | None = ()


def _api() -> tuple[Any, Any] | None:
    """The API's ``context`` and ``trace`` modules, imported once (None without the API: one
    failed import a process, not one a call)."""
    global _API
    if _API == ():
        try:
            from opentelemetry import context, trace
        except ImportError:
            _API = None
        else:
            _API = (context, trace)
    return _API  # type: ignore[return-value]


def _remote_parent(trace: Any, carrier: str) -> Any:
    """The remote span of a carried context, or None when it is not a valid W3C one."""
    line, _, state = carrier.partition("\n")
    # Version 00's layout (what :func:`traceparent` writes): 2, 32, 16 and 2 hex digits.
    if len(line) != 55 or line[2] != "-" or line[35] != "-" or line[52] != "-":
        return None
    try:
        trace_id, span_id, flags = int(line[3:35], 16), int(line[36:52], 16), int(line[53:], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    context = trace.SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=trace.TraceFlags(flags & 0xFF),
        trace_state=trace.TraceState.from_header([state]) if state else None,
    )
    return trace.NonRecordingSpan(context)


async def carried(carrier: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """On a worker: ``await fn(*args)`` with the trace context a call carried (the
    ``context`` of its :class:`Carried` argument) as the current context."""
    api = _api()
    if api is None:  # the worker lacks the API: the method runs, untraced
        return await fn(*args)
    context, trace = api
    parent = _remote_parent(trace, carrier)
    if parent is None:
        return await fn(*args)
    token = context.attach(trace.set_span_in_context(parent))
    try:
        return await fn(*args)
    finally:
        context.detach(token)


def current_traceparent() -> str | None:
    """The W3C context of the current span (see :func:`traceparent`), to carry to a worker;
    None when tracing is off or no span is current."""
    if tracer() is None:
        return None
    span = _trace().get_current_span()
    return traceparent(span) if span.get_span_context().is_valid else None


@contextlib.contextmanager
def attached(carrier: str | None) -> Iterator[None]:
    """On a worker: the trace context a driver carried (None: none) current while the block
    runs (a run's function, in its thread)."""
    if carrier is None:
        yield
        return
    api = _api()
    if api is None:  # the worker lacks the API: the function runs, untraced
        yield
        return
    context, trace = api
    parent = _remote_parent(trace, carrier)
    if parent is None:
        yield
        return
    token = context.attach(trace.set_span_in_context(parent))
    try:
        yield
    finally:
        context.detach(token)


#: The span that stands for the next call made in this context (a router attempt's: see
#: :func:`as_call`), or None.
_FOR_CALL: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "asyncexec_span_for_call", default=None
)


def call_span(fn: Any, rank: int) -> tuple[Any, str | None]:
    """A call's span on ``rank`` (a child of the caller's current context), and the context
    it carries to the worker (see :class:`Carried`); ``(None, None)`` when tracing is off. End
    it with :func:`end_call` (which sets its attributes). Inside :func:`as_call`, the first
    call makes no span: ``(None, its context)``, the span given there standing for it; inside
    :func:`as_calls`, likewise each call made while its span is the current one."""
    made = tracer()
    if made is None:
        return None, None
    standing = _FOR_CALL.get()
    if standing is not None:
        _FOR_CALL.set(None)  # a second call of the block is a span of its own
        return None, traceparent(standing)
    phase = _FOR_CALLS.get()
    if phase is not None and _trace().get_current_span() is phase:
        return None, traceparent(phase)
    span = made.start_span("asyncexec.call")
    return span, traceparent(span)


async def as_call(span: Any, awaitable: Awaitable[T]) -> T:
    """:func:`within` ``span``, which stands for the call ``awaitable`` makes (a router's
    attempt: one call on one server, from about its send to its answer): that call makes no
    ``asyncexec.call`` span of its own, and carries ``span``'s context to the worker, where
    what the method opens is ``span``'s child. One SDK span fewer for each request (of 3),
    the same story told: ``span`` holds the call's ``asyncexec.function`` and
    ``asyncexec.rank`` (given when it was started)."""
    token = _FOR_CALL.set(span)
    try:
        return await within(span, awaitable)
    finally:
        _FOR_CALL.reset(token)


#: The span that stands for each call made while it is the current span (an update's phase:
#: see :func:`as_calls`), or None.
_FOR_CALLS: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "asyncexec_span_for_calls", default=None
)


async def as_calls(name: str, awaitable: Awaitable[T], **attributes: Any) -> T:
    """Await ``awaitable`` inside a span ``name`` (as :func:`in_span`) that stands for the
    calls made while it is the current span (an update's pause, push or resume: one call on
    each server): they make no ``asyncexec.call`` span of their own and carry this span's
    context to the worker, where what the method opens is its child. A call made under a span
    of its own (the channel's ``asyncexec.push.read``) is that span's child, as anywhere."""
    span = start(name, **attributes)
    if span is None:
        return await awaitable
    token = _FOR_CALLS.set(span)
    try:
        return await within(span, awaitable)
    finally:
        _FOR_CALLS.reset(token)


#: The span of the router request this context serves (see :func:`in_request`), or None: its
#: attempts (tasks started inside it) find it here.
_REQUEST: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "asyncexec_request_span", default=None
)


async def in_request(made: Any, name: str, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` (a router request) inside a span ``name`` of ``made`` (the tracer:
    tracing is on), a child of the current context, ended (failed with what it raised) after
    it. The span is not made the current span (the OpenTelemetry context's attach, detach and
    look-ups would be paid by every request for nothing: what the request makes under it is its
    attempts, which find it in a variable of their own, :func:`as_first_call` and
    :func:`under_request`)."""
    span = made.start_span(name)
    token = _REQUEST.set(span)
    try:
        value = await awaitable
    except BaseException as exc:
        _REQUEST.reset(token)
        end(span, exc)
        raise
    _REQUEST.reset(token)
    span.end()
    return value


def under_request(name: str, attributes: Mapping[str, Any]) -> Any:
    """A span ``name`` with ``attributes``, a child of the router request's span (of the
    current context outside one: see :func:`in_request`), started now; None when tracing is
    off."""
    made = tracer()
    if made is None:
        return None
    parent = _REQUEST.get()
    context = None if parent is None else _trace().set_span_in_context(parent)
    return made.start_span(name, context=context, attributes=attributes)


async def as_first_call(awaitable: Awaitable[T], failed: str, attributes: Mapping[str, Any]) -> T:
    """The router request's span (see :func:`in_request`) stands for the call ``awaitable``
    makes, as :func:`as_call`'s span does, and takes its ``attributes`` (what ran, on which
    rank): a request answered by its first attempt is one SDK span, not two (the SDK's span is
    most of what tracing costs a request: ``benchmarks/tracing_cost.py``). When the
    call fails, a span ``failed`` is recorded for it after the fact, a child of the request's
    with its error, so that a request sent again still shows each attempt (the later ones as
    spans of their own: :func:`under_request`). Outside a request's span (tracing turned on
    while the request was on its way), the call is awaited as it is."""
    span = _REQUEST.get()
    if span is None:
        return await awaitable
    span.set_attributes(attributes)
    started = time.time_ns()
    token = _FOR_CALL.set(span)
    try:
        return await awaitable
    except BaseException as exc:
        made = tracer()
        if made is not None:
            parent = _trace().set_span_in_context(span)
            failed_span = made.start_span(
                failed, context=parent, start_time=started, attributes=attributes
            )
            end(failed_span, exc)
        raise
    finally:
        _FOR_CALL.reset(token)


def end_call(
    span: Any, name: str, rank: int, error: BaseException | None = None, stack: str | None = None
) -> None:
    """End a call's span now, failed with ``error`` (``stack``: the worker's traceback of it,
    as text): its end time is taken now, and the rest (its attributes ``asyncexec.function``,
    ``name``: what ran, as ``PolicyServer.generate``, and ``asyncexec.rank``, the SDK's end
    and span processor) is done on the event loop's next turn, after the caller has its
    result."""
    end_ns = time.time_ns()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        _end_call(span, name, rank, error, stack, end_ns)
        return
    loop.call_soon(_end_call, span, name, rank, error, stack, end_ns)


def _end_call(
    span: Any, name: str, rank: int, error: BaseException | None, stack: str | None, end_ns: int
) -> None:
    span.set_attributes({"asyncexec.function": name, "asyncexec.rank": rank})
    if error is not None:
        _failed(span, error, stack)
    span.end(end_ns)


class Opened:
    """A span made current in this task until :func:`finish` (the run's, for its attempts)."""

    __slots__ = ("span", "token")

    def __init__(self, span: Any, token: Any) -> None:
        self.span = span
        self.token = token


def begin(name: str, **attributes: Any) -> Opened | None:
    """Start span ``name`` and make it this task's current span; None when tracing is off."""
    span = start(name, **attributes)
    if span is None:
        return None
    from opentelemetry import context

    return Opened(span, context.attach(_trace().set_span_in_context(span)))


def finish(opened: Opened | None, error: BaseException | None = None) -> None:
    """End what :func:`begin` started (in the same task), failed with ``error``."""
    if opened is None:
        return
    from opentelemetry import context

    context.detach(opened.token)
    end(opened.span, error)
