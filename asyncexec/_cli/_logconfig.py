"""``configure_logging()``: console or JSON log output for applications and the command line.

The library itself only logs (see ``asyncexec._logging``); an application that wants asyncexec's
events on its terminal or in a log pipeline calls this once at start-up, as the ``asyncexec``
command and the examples do. It is structlog's standard-library integration: structlog's events
(the library's, and any other structlog user's in the process) become ``logging`` records
(``structlog.stdlib.LoggerFactory``, ``ProcessorFormatter.wrap_for_formatter``), and one handler
on the ``asyncexec`` logger renders them and the library's own ``logging`` records alike
(``ProcessorFormatter``). The context the core binds (``executor``, ``run_id``, ``attempt``,
``rank``) appears as fields.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Literal, TextIO

import structlog

from .._errors import ConfigurationError

__all__ = ["configure_logging"]

LogFormat = Literal["console", "json"]

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _Handler(logging.StreamHandler[TextIO]):
    """A stream handler that writes to ``stream`` or, without one, to whatever ``sys.stderr`` is
    at each write (as the standard library's own last-resort handler does), so that a live view
    that redirects stderr (rich) or a test that captures it gets the lines."""

    def __init__(self, stream: TextIO | None) -> None:
        logging.Handler.__init__(self)
        self._stream = stream

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    @stream.setter
    def stream(self, value: TextIO | None) -> None:
        self._stream = value


class _LoggerFactory(structlog.stdlib.LoggerFactory):
    """structlog's standard-library logger factory, with every structlog logger reaching the
    handler: asyncexec's events go to the ``asyncexec`` logger, and another structlog user's
    logger (an application's ``structlog.get_logger("service")``) becomes a standard-library
    logger of the same name, outside logging's registry, that writes to the handler too (the
    application's own logging set-up for that name is left alone)."""

    def __init__(self, handler: logging.Handler, level: int) -> None:
        super().__init__(ignore_frame_names=[__name__])
        self._handler = handler
        self._level = level
        self._others: dict[str, logging.Logger] = {}

    def __call__(self, *args: Any) -> logging.Logger:
        logger = super().__call__(*args)
        name = logger.name
        if name == "asyncexec" or name.startswith("asyncexec."):
            return logger
        other = self._others.get(name)
        if other is None:
            other = logging.Logger(name, self._level)
            other.addHandler(self._handler)
            other.propagate = False
            other = self._others.setdefault(name, other)
        return other


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
    examples. It configures structlog for the whole process, and the standard library's
    ``asyncexec`` logger (its level, one handler, no propagation to the root logger's handlers);
    other loggers of the standard library are left alone.

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
    shared, render = _processors(fmt, stream, colors)
    handler = _Handler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processors=render, foreign_pre_chain=shared)
    )
    # The standard library's side: the "asyncexec" logger (and its children) writes to the
    # handler, and only there: the root logger's handlers (if any) would print it twice.
    stdlib = logging.getLogger("asyncexec")
    for old in [h for h in stdlib.handlers if isinstance(h, _Handler)]:
        stdlib.removeHandler(old)
        old.close()
    stdlib.addHandler(handler)
    stdlib.setLevel(levelno)
    stdlib.propagate = False
    # structlog's side: events become records of standard-library loggers, rendered by the
    # handler's formatter.
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(levelno),
        logger_factory=_LoggerFactory(handler, levelno),
        context_class=dict,
        cache_logger_on_first_use=False,
    )


def _processors(
    fmt: LogFormat, stream: TextIO | None, colors: bool | None
) -> tuple[list[Any], list[Any]]:
    """The processors run on every event (in structlog's chain for structlog's events, in the
    formatter's pre-chain for the standard library's records), and those the formatter runs on
    both, last."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
    ]
    render: list[Any] = [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        structlog.processors.StackInfoRenderer(),
    ]
    if fmt == "json":
        shared.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
        # Tracebacks as data, without frame locals (large, and they may hold secrets).
        render.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        )
        render.append(structlog.processors.JSONRenderer(default=_json_default))
    else:
        shared.append(structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False))
        use_colors = _use_colors(stream, colors)
        render.append(
            structlog.dev.ConsoleRenderer(
                colors=use_colors, exception_formatter=_console_tracebacks(use_colors)
            )
        )
    return shared, render


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
