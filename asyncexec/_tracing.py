"""OpenTelemetry spans of runs, attempts, restarts, calls and pushes, with the W3C trace context
carried into the workers (both sides import this module; it needs nothing but the standard
library until a span is made).

With the ``tracing`` extra (``opentelemetry-api``) and a tracer provider set by the application
(``opentelemetry.trace.set_tracer_provider``: the SDK with the exporter it chose), the driver
opens spans named ``asyncexec.run``, ``asyncexec.attempt``, ``asyncexec.restart``,
``asyncexec.call`` (one per rank a call goes to) and ``asyncexec.push.read`` /
``asyncexec.push.deliver``. A call carries its span's context to the worker as a W3C
``traceparent`` (an extra keyword argument of the worker's method, taken off before the user's
method sees its arguments), where it is the current context while the method runs: a span the
method opens is a child of the driver's call. asyncexec configures no exporter, as it configures
no logging: with no provider set (the API's default), nothing is made and nothing is carried,
and without the API installed each place pays one check.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

__all__ = [
    "CARRIER",
    "Opened",
    "begin",
    "call_span",
    "carried",
    "current",
    "end",
    "finish",
    "in_span",
    "inject",
    "start",
    "tracer",
]

T = TypeVar("T")
#: The keyword that carries a call's trace context to the worker.
CARRIER = "_asyncexec_trace_context"
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
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    if _tracer[0] is not provider:  # a provider makes a tracer object at each ask
        _tracer = (provider, provider.get_tracer(_NAME))
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
        trace = _trace()
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
    span.end()


@contextlib.contextmanager
def current(span: Any) -> Iterator[None]:
    """``span`` as the current span while the block runs (nothing when it is None)."""
    if span is None:
        yield
        return
    trace = _trace()
    with trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    ):
        yield


async def in_span(name: str, awaitable: Awaitable[T], **attributes: Any) -> T:
    """Await ``awaitable`` inside a span ``name`` (current while it runs) when tracing is on."""
    span = start(name, **attributes)
    if span is None:
        return await awaitable
    try:
        with current(span):
            value = await awaitable
    except BaseException as exc:
        end(span, exc)
        raise
    end(span)
    return value


def inject(kwargs: dict[str, Any], span: Any) -> None:
    """Put ``span``'s context in ``kwargs`` (a call's keyword arguments) as a W3C carrier
    (``traceparent``, and ``tracestate`` when there is one, as one string): W3C's propagator,
    whatever the
    application set as its global one, since the worker reads it with that one."""
    carrier: dict[str, str] = {}
    _w3c().inject(carrier, context=_trace().set_span_in_context(span))
    # One string (the traceparent, then the tracestate's line when there is one): the cheapest
    # argument for Ray to send.
    kwargs[CARRIER] = "\n".join(carrier[k] for k in ("traceparent", "tracestate") if k in carrier)


_propagator: Any = None


def _w3c() -> Any:
    global _propagator
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = TraceContextTextMapPropagator()
    return _propagator


async def carried(kwargs: dict[str, Any], fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """On a worker: ``await fn(*args)`` with the trace context the call carried (in ``kwargs``,
    taken off them first) as the current context; a plain ``await`` when it carried none."""
    carrier = kwargs.pop(CARRIER, None)
    if carrier is None:
        return await fn(*args)
    try:
        from opentelemetry import context
    except ImportError:  # the worker lacks the API: the method runs, untraced
        return await fn(*args)
    fields = dict(zip(("traceparent", "tracestate"), carrier.split("\n"), strict=False))
    token = context.attach(_w3c().extract(fields))
    try:
        return await fn(*args)
    finally:
        context.detach(token)


def call_span(fn: Any, rank: int, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A call's span on ``rank`` (a child of the caller's current context), and the keyword
    arguments that carry its context to the worker; ``(None, kwargs)`` when tracing is off."""
    made = tracer()
    if made is None:
        return None, kwargs
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    span = made.start_span(
        "asyncexec.call", attributes={"asyncexec.function": name, "asyncexec.rank": rank}
    )
    carrying = dict(kwargs)
    inject(carrying, span)
    return span, carrying


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
