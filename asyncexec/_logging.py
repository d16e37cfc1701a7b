"""The library's structlog logger. asyncexec logs and never configures logging.

Events are short snake_case names with context bound per executor, run and rank (``executor``,
``run_id``, ``attempt``, ``rank``). ``asyncexec.configure_logging()`` is offered to applications
and the command line; the library itself never calls it.
"""

from __future__ import annotations

from typing import Any

import structlog

__all__ = ["get_logger"]


def get_logger(**context: Any) -> Any:
    """A bound logger named ``asyncexec`` carrying ``context``."""
    return structlog.get_logger("asyncexec").bind(**context)
