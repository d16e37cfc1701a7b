"""``configure_logging()``: console or JSON log output for applications and the command line.

The library itself only logs (see ``_logging``); an application that wants asyncexec's events on
its terminal or in a log pipeline calls this once at start-up, as the ``asyncexec`` command and
the examples do. It configures structlog globally (the library's events, and any other
structlog user in the process) and the ``asyncexec`` stdlib logger, so both render alike. The
context the core binds (``executor``, ``run_id``, ``attempt``, ``rank``) appears as fields.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Literal, TextIO

import structlog

from ._errors import ConfigurationError

__all__ = ["configure_logging"]

LogFormat = Literal["console", "json"]

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _StreamLogger:
    """A structlog logger that writes each rendered line to a stream.

    Without an explicit stream it writes to whatever ``sys.stderr`` is at the time of the write
    (not at configuration time), so a live terminal view that redirects stderr (rich) or a test
    that captures it sees the lines.
    """

    _lock = threading.Lock()  # lines from several threads (Ray's log monitor) must not interleave

    def __init__(self, name: str, stream: TextIO | None) -> None:
        self.name = name
        self._stream = stream

    def msg(self, message: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        with self._lock:
            stream.write(message + "\n")
            stream.flush()

    log = debug = info = warn = warning = error = err = critical = exception = fatal = msg


class _StreamLoggerFactory:
    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def __call__(self, *args: Any) -> _StreamLogger:
        name = args[0] if args and isinstance(args[0], str) else "app"
        return _StreamLogger(name, self._stream)


class _LazyStreamHandler(logging.Handler):
    """A stdlib handler that writes to ``stream``, or to the current ``sys.stderr``."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__()
        self._stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            stream = self._stream if self._stream is not None else sys.stderr
            stream.write(line + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _level(level: str | int) -> int:
    if isinstance(level, bool):
        raise ConfigurationError(f"level must be a level name or number, got {level!r}")
    if isinstance(level, int):
        return level
    if isinstance(level, str) and level.lower() in _LEVELS:
        return _LEVELS[level.lower()]
    raise ConfigurationError(
        f"level must be one of {', '.join(_LEVELS)} or a number, got {level!r}"
    )


def _use_colors(stream: TextIO | None, colors: bool | None) -> bool:
    if colors is not None:
        return colors
    if os.environ.get("NO_COLOR"):
        return False
    target = stream if stream is not None else sys.stderr
    isatty = getattr(target, "isatty", None)
    return bool(isatty and isatty())


def configure_logging(
    fmt: LogFormat = "console",
    level: str | int = "info",
    *,
    stream: TextIO | None = None,
    colors: bool | None = None,
) -> None:
    """Send asyncexec's log events to a stream, as console lines or as JSON objects.

    ``"console"`` renders ``12:00:01 [warning ] worker_failed  attempt=1 rank=2 run_id=...``
    lines for people; ``"json"`` renders one JSON object per line (``event``, ``level``,
    ``timestamp`` in UTC ISO 8601, ``logger``, and every bound field such as ``run_id``,
    ``attempt`` and ``rank``) for log pipelines. Events below ``level`` are dropped before they
    are rendered. Calling it again replaces the previous set-up.

    The library never calls this: it is for applications, the ``asyncexec`` command and the
    examples. It configures structlog for the whole process.

    Args:
        fmt: ``"console"`` or ``"json"``.
        level: ``"debug"``, ``"info"``, ``"warning"``, ``"error"``, ``"critical"``, or a
            stdlib level number.
        stream: where lines go; by default the current ``sys.stderr`` at each write.
        colors: colour console lines; by default when the stream is a terminal and ``NO_COLOR``
            is not set.

    Raises:
        ConfigurationError: ``fmt`` or ``level`` is not one of the accepted values.
    """
    if fmt not in ("console", "json"):
        raise ConfigurationError(f"fmt must be 'console' or 'json', got {fmt!r}")
    levelno = _level(level)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
    ]
    renderer: Any
    if fmt == "json":
        shared.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
        # Tracebacks as data, without frame locals (large, and they may hold secrets).
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
        tail: list[Any] = [structlog.processors.StackInfoRenderer(), tracebacks]
        renderer = structlog.processors.JSONRenderer(default=_json_default)
    else:
        shared.append(structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False))
        tail = [structlog.processors.StackInfoRenderer()]
        use_colors = _use_colors(stream, colors)
        renderer = structlog.dev.ConsoleRenderer(
            colors=use_colors, exception_formatter=_console_tracebacks(use_colors)
        )
    structlog.configure(
        processors=[*shared, *tail, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(levelno),
        logger_factory=_StreamLoggerFactory(stream),
        context_class=dict,
        cache_logger_on_first_use=False,
    )
    # The stdlib side: records of the "asyncexec" logger render like structlog's events.
    stdlib = logging.getLogger("asyncexec")
    for handler in list(stdlib.handlers):
        if getattr(handler, "_asyncexec_configured", False):
            stdlib.removeHandler(handler)
    handler = _LazyStreamHandler(stream)
    handler._asyncexec_configured = True  # type: ignore[attr-defined]
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *tail,
                renderer,
            ],
            foreign_pre_chain=shared,
        )
    )
    stdlib.addHandler(handler)
    stdlib.setLevel(levelno)
    # Our handler prints them; the root logger's handlers (if any) would print them twice.
    stdlib.propagate = False


def _console_tracebacks(colors: bool) -> Any:
    """Rich tracebacks without frame locals on a colour terminal with rich, else plain ones."""
    if colors and getattr(structlog.dev, "rich", None) is not None:
        return structlog.dev.RichTracebackFormatter(show_locals=False)
    return structlog.dev.plain_traceback


def _json_default(value: Any) -> Any:
    """Make numpy scalars, paths and other odd values JSON-serialisable."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return str(value)
