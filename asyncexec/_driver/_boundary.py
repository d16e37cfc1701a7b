"""The one place where Ray's errors (and the outcomes workers send) become asyncexec's.

Like httpcore's ``map_exceptions``: every call on a worker that fails goes through
:func:`call_error`, every failed outcome through :func:`outcome_error`, start-up failures through
:func:`startup_error` and backend hooks through :func:`backend_error`. This module alone knows
Ray's error classes, and that a ``RayTaskError`` is also an instance of its cause's class (Ray's
``as_instanceof_cause``): a worker-side ``AsyncExecError`` arrives as a ``RayTaskError`` that
*is* an ``AsyncExecError``, so Ray's classes are checked first and the rank is never lost.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from ray.exceptions import RayActorError, RayError, RayTaskError

from .._errors import (
    AsyncExecError,
    BackendError,
    NodeLostError,
    StartupError,
    StartupTimeoutError,
    WorkerCrashedError,
    WorkerError,
    WorkerRaisedError,
    describe,
    first_line,
    short_node,
)
from .._protocol import Outcome
from ._local import LocalWorkerGone
from ._workers import WorkerInfo, node_alive

__all__ = ["backend_error", "call_error", "outcome_error", "startup_error", "worker_error"]

E = TypeVar("E", bound=WorkerError)
#: The most of a death message kept as the error's detail.
_DETAIL_CHARS = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: Lines of Ray's actor-death messages that say which actor, not what happened.
_ACTOR_FIELDS = ("class_name", "actor_id", "pid:", "namespace", "ip:")


def worker_error(cls: type[E], worker: WorkerInfo, attempt: int, detail: str, **extra: Any) -> E:
    """An error of ``cls`` about ``worker``, with its rank, node, pid and attempt filled in."""
    return cls(
        worker.rank,
        node_id=worker.metadata.node_id,
        pid=worker.metadata.pid,
        attempt=attempt,
        detail=detail,
        **extra,
    )


def _death_detail(exc: BaseException) -> str:
    """Ray's actor-death messages run to many lines of advice; keep what happened."""
    try:
        text = str(exc)
    except Exception:
        return type(exc).__name__
    for line in text.strip().splitlines():
        line = line.strip()
        if line and not line.startswith(_ACTOR_FIELDS):
            return line.split(" Some common causes")[0][:_DETAIL_CHARS]
    return type(exc).__name__


def _attribute(exc: BaseException, name: str) -> Any:
    """An attribute of a Ray error, or None: Ray's ``as_instanceof_cause`` classes forward
    missing attributes to the cause, so a plain lookup can raise."""
    try:
        return getattr(exc, name, None)
    except Exception:
        return None


def _remote_traceback(exc: BaseException) -> str:
    """The worker's traceback as plain text (Ray colours its task header)."""
    text = _attribute(exc, "traceback_str")
    if not isinstance(text, str):
        try:
            text = str(exc)
        except Exception:
            return ""
    return _ANSI.sub("", text)


def _raised(worker: WorkerInfo, attempt: int, cause: BaseException, tb: str) -> WorkerRaisedError:
    return worker_error(
        WorkerRaisedError, worker, attempt, describe(cause), error=cause, remote_traceback=tb
    )


async def call_error(exc: BaseException, worker: WorkerInfo, attempt: int) -> AsyncExecError:
    """Map the error of a call on ``worker`` to asyncexec's tree.

    A dead actor is a lost node when Ray's node table no longer holds the worker's node (Ray marks
    a lost node's actors dead only after the node), else a crashed worker."""
    if isinstance(exc, RayTaskError):
        cause = _attribute(exc, "cause")
        cause = cause if isinstance(cause, BaseException) else exc
        return _raised(worker, attempt, cause, _remote_traceback(exc))
    if isinstance(exc, RayActorError):
        node = worker.metadata.node_id
        if not await node_alive(node):
            return worker_error(
                NodeLostError, worker, attempt, f"node {short_node(node)} left the cluster"
            )
        return worker_error(WorkerCrashedError, worker, attempt, _death_detail(exc))
    if isinstance(exc, LocalWorkerGone):
        return worker_error(WorkerCrashedError, worker, attempt, str(exc))
    if isinstance(exc, AsyncExecError):
        return exc
    return _raised(worker, attempt, exc, "")


def outcome_error(outcome: Outcome, worker: WorkerInfo, attempt: int) -> WorkerError:
    """The error of a call whose outcome is not ``ok`` (the user's function raised, or its run
    was stopped)."""
    if outcome.kind == "error" and outcome.error is not None:
        return _raised(worker, attempt, outcome.error, outcome.traceback)
    return worker_error(WorkerRaisedError, worker, attempt, "the function was stopped")


def startup_error(exc: BaseException, phase: str, timeout_s: float) -> BaseException:
    """What a failed start-up raises: asyncexec's errors as they are, a deadline as
    :class:`StartupTimeoutError`, anything else as :class:`StartupError` naming the phase and
    the worker's own error first (not Ray's coloured task header)."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, AsyncExecError | RayError):
        timeout = StartupTimeoutError(phase, timeout_s)
        timeout.__cause__ = exc
        return timeout
    if isinstance(exc, WorkerRaisedError) and exc.error is not None:
        error = StartupError(f"start-up failed while {phase}: {describe(exc.error)}")
        error.__cause__ = exc.error
        return error
    cause = _attribute(exc, "cause") if isinstance(exc, RayTaskError) else None
    if isinstance(cause, BaseException):
        error = StartupError(f"start-up failed while {phase}: {describe(cause)}")
        error.__cause__ = cause
        return error
    if isinstance(exc, StartupError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, AsyncExecError) and not isinstance(exc, WorkerError):
        return exc
    error = StartupError(f"start-up failed while {phase}: {describe(exc)}")
    error.__cause__ = exc
    return error


def backend_error(exc: Exception, backend: str, hook: str) -> AsyncExecError:
    """A backend hook's failure as a :class:`BackendError` naming the backend, hook and rank."""
    if isinstance(exc, WorkerError):
        cause = exc.__cause__ or exc
        return BackendError(backend, hook, exc.rank, first_line(cause))
    if isinstance(exc, AsyncExecError):
        return exc
    return BackendError(backend, hook, None, describe(exc))
