"""How a call on a worker ended, as the driver receives it: an :class:`Outcome` whose error (when
it pickles, else a ``RuntimeError`` that keeps its type and text) carries its traceback as text."""

from __future__ import annotations

import inspect
import os
import traceback
from collections.abc import Callable
from typing import Any

from .._protocol import Outcome

__all__ = ["error_outcome", "takes_config", "value_outcome"]

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
    """The outcome of a call that raised ``exc``: the error (when it pickles, else a
    RuntimeError that keeps its type and text) and its traceback as text, without colours."""
    from ray import cloudpickle

    # The traceback from the user's code on: asyncexec's own frames above it say nothing.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_WORKER_DIR):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        cloudpickle.loads(cloudpickle.dumps(exc))
        portable = exc
    except Exception:
        portable = RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
    return Outcome("error", error=portable, traceback=text)


def value_outcome(value: Any) -> Outcome:
    """The outcome of a call that returned ``value``; an error when it cannot be pickled."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        message = f"the return value cannot be pickled ({type(value).__name__}): {exc}"
        return Outcome("error", error=TypeError(message))
    return Outcome("ok", value)
