"""The library's logger. asyncexec logs and never configures logging.

Events are short snake_case names with context bound per executor, run and rank (``executor``,
``run_id``, ``attempt``, ``rank``). Where they go is the application's choice, by the standard
library's convention for libraries:

- when the application has configured structlog (``structlog.configure``, or
  ``asyncexec.configure_logging()``), events go through structlog as it is configured;
- otherwise they go to the standard library's ``asyncexec`` logger, as one line each
  (``worker_failed rank=2 attempt=1 ...``): with nothing configured, Python prints warnings and
  errors on stderr and drops the rest (``logging.lastResort``), and ``logging.basicConfig`` or the
  application's handlers turn the rest on.

So a library user who configured nothing sees warnings on stderr and nothing on stdout, never
structlog's default of every event down to ``debug`` printed on stdout.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["Logger", "get_logger"]

_stdlib = logging.getLogger("asyncexec")
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class Logger:
    """A bound logger that follows whatever logging set-up the application has (see above)."""

    __slots__ = ("_context",)

    def __init__(self, context: dict[str, Any]) -> None:
        self._context = context

    def bind(self, **context: Any) -> Logger:
        return Logger({**self._context, **context})

    def _log(self, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            logger = structlog.get_logger("asyncexec")
            getattr(logger, method)(event, **self._context, **fields)
            return
        level = _LEVELS[method]
        if _stdlib.isEnabledFor(level):
            values = {**self._context, **fields}
            text = " ".join(f"{k}={v}" for k, v in values.items())
            _stdlib.log(level, "%s %s", event, text, extra={"asyncexec_fields": values})

    def debug(self, event: str, **fields: Any) -> None:
        self._log("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log("error", event, fields)


def get_logger(**context: Any) -> Logger:
    """A logger named ``asyncexec`` carrying ``context``."""
    return Logger(context)
