"""The one place where Ray's errors (and the outcomes workers send) become asyncexec's.

Like httpcore's ``map_exceptions``: every call on a worker that fails goes through
:func:`call_error`, inside the seam (a call made through ``_calls`` raises what it maps to),
every failed outcome through :func:`outcome_error`, start-up failures through
:func:`startup_error` and backend hooks through :func:`backend_error`. This module alone knows
Ray's error classes, and that a ``RayTaskError`` is also an instance of its cause's class (Ray's
``as_instanceof_cause``): a worker-side ``AsyncExecError`` arrives as a ``RayTaskError`` that
*is* an ``AsyncExecError``, so Ray's classes are checked first and the rank is never lost.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio
import ray.exceptions as rex

from ..._errors import (
    AsyncExecError,
    BackendError,
    NodeLostError,
    StartupError,
    StartupTimeoutError,
    WorkerCrashedError,
    WorkerError,
    WorkerHungError,
    WorkerRaisedError,
    WorkerUnreachableError,
    describe,
    first_line,
    short_node,
)
from ..._logging import get_logger
from ..._wire._protocol import Outcome, WorkerMetadata
from ._local import LocalCallCancelled, LocalWorkerGone
from ._ray import LOOKUP_TIMEOUT_S, node_alive

__all__ = [
    "NODE_CHECK_S",
    "RAY_ERROR_KINDS",
    "CallCancelledError",
    "backend_error",
    "call_error",
    "outcome_error",
    "ray_error_kind",
    "startup_error",
    "worker_error",
]

E = TypeVar("E", bound=WorkerError)
_log = get_logger(component="cluster")


class Who(Protocol):
    """The worker an error is about (a group's member)."""

    @property
    def rank(self) -> int: ...

    @property
    def metadata(self) -> WorkerMetadata: ...


#: The longest a death's mapping waits for the node table (``alive``) to say whether the worker's
#: node is still there; past it the node is taken as alive (unknown, as a look-up that fails
#: says), so the death is a crashed or unreachable worker. Ray's look-up is bounded by its own
#: timeout (``LOOKUP_TIMEOUT_S``, through ``Liveness``); this bound holds for any cluster's
#: ``node_alive`` (a simulated one, a test's), twice Ray's so that it never cuts a Ray look-up
#: short. The check is shielded (see :func:`_gone`): without a deadline of its own, a table that
#: never answers would hang whatever waits for the call (a task group's close, a teardown).
NODE_CHECK_S = 2 * LOOKUP_TIMEOUT_S

#: The most of a death message kept as the error's detail.
_DETAIL_CHARS = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: Lines of Ray's actor-death messages that say which actor, not what happened.
_ACTOR_FIELDS = ("class_name", "actor_id", "pid:", "namespace", "ip:")


class CallCancelledError(WorkerError):
    """A call that the driver cancelled (``Call.cancel``: its caller gave up on it) and that
    ended so on the worker. Not a failure of the worker, and not restarted after: the driver
    asked for it. Private: its caller stopped waiting, so only the driver's own waits (a slot
    given back when the call ends, a timeline's span) see it."""

    what = "had its call cancelled by the driver"


def worker_error(cls: type[E], worker: Who, attempt: int, detail: str, **extra: Any) -> E:
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


def _raised(worker: Who, attempt: int, cause: BaseException, tb: str) -> WorkerRaisedError:
    return worker_error(
        WorkerRaisedError, worker, attempt, describe(cause), error=cause, remote_traceback=tb
    )


#: What each of Ray's exception classes means for a call on a worker, decided class by class
#: (a test checks that every class of ``ray.exceptions`` is here): the user's code raised
#: (``raised``), the worker or its node is gone (``died``: a lost node or a crash, after a look
#: at the node table), the call timed out (``hung``), the worker could not be started
#: (``startup``), or Ray failed to carry the call (``unreachable``: after a look at the node
#: table too, since a lost node is the common reason for a lost result). A class not listed
#: takes the kind of its nearest listed base.
RAY_ERROR_KINDS: dict[type[BaseException], str] = {
    rex.RayError: "unreachable",
    # The user's code raised on the worker.
    rex.RayTaskError: "raised",
    rex.UserCodeException: "raised",
    rex.UnserializableException: "raised",
    # The worker's process, or its node, is gone.
    rex.RayActorError: "died",
    rex.ActorDiedError: "died",
    rex.ActorUnavailableError: "died",
    rex.WorkerCrashedError: "died",
    rex.OutOfMemoryError: "died",
    rex.LocalRayletDiedError: "died",
    rex.NodeDiedError: "died",
    rex.ActorPlacementGroupRemoved: "died",
    rex.TaskPlacementGroupRemoved: "died",
    rex.AsyncioActorExit: "died",
    # A result lost on its way (its owner or its node died, or it was freed).
    rex.ObjectLostError: "unreachable",
    rex.OwnerDiedError: "unreachable",
    rex.ObjectFetchTimedOutError: "unreachable",
    rex.ObjectFreedError: "unreachable",
    rex.ObjectReconstructionFailedError: "unreachable",
    rex.ReferenceCountingAssertionError: "unreachable",
    rex.PlasmaObjectNotAvailable: "unreachable",
    # Ray itself failed to carry the call.
    rex.RaySystemError: "unreachable",
    rex.RpcError: "unreachable",
    rex.ObjectStoreFullError: "unreachable",
    rex.OutOfDiskError: "unreachable",
    rex.PendingCallsLimitExceeded: "unreachable",
    rex.TaskCancelledError: "unreachable",  # (one the driver asked for: see ``call_error``)
    rex.AuthenticationError: "unreachable",
    rex.CrossLanguageError: "unreachable",
    rex.OufOfBandObjectRefSerializationException: "unreachable",
    rex.ObjectRefStreamEndOfStreamError: "unreachable",
    rex.ActorAlreadyExistsError: "unreachable",
    rex.ActorHandleNotFoundError: "unreachable",
    rex.RayChannelError: "unreachable",
    rex.RayCgraphCapacityExceeded: "unreachable",
    rex.RayDirectTransportError: "unreachable",
    rex.StreamingGeneratorReplayInconsistentError: "unreachable",
    # Timed out.
    rex.GetTimeoutError: "hung",
    rex.RayChannelTimeoutError: "hung",
    # The worker could not be started.
    rex.RuntimeEnvSetupError: "startup",
    rex.ActorUnschedulableError: "startup",
    rex.TaskUnschedulableError: "startup",
}


def ray_error_kind(exc: BaseException) -> str | None:
    """The kind of a Ray error (see :data:`RAY_ERROR_KINDS`), or None for any other exception.
    Ray's ``as_instanceof_cause`` classes are subclasses of ``RayTaskError``, so they are
    ``raised`` whatever their cause's class."""
    for cls in type(exc).__mro__:
        kind = RAY_ERROR_KINDS.get(cls)
        if kind is not None:
            return kind
    return None


async def _gone(worker: Who, alive: Callable[[str | None], Awaitable[bool]] | None) -> bool:
    """Whether the worker's node has left the cluster. Shielded: a failure seen just before its
    attempt is cancelled (the other ranks' failures are collected for a moment, then the attempt
    goes) is still mapped, so that ranks that fail together are all recorded. Bounded by
    :data:`NODE_CHECK_S` (no answer in time: alive)."""
    found = True
    with anyio.move_on_after(NODE_CHECK_S, shield=True) as scope:
        found = await (alive or node_alive)(worker.metadata.node_id)
    if scope.cancelled_caught:
        _log.warning("node_check_timed_out", rank=worker.rank, bound_s=NODE_CHECK_S)
    return not found


async def call_error(
    exc: BaseException,
    worker: Who,
    attempt: int,
    alive: Callable[[str | None], Awaitable[bool]] | None = None,
    *,
    cancelled: bool = False,
) -> AsyncExecError:
    """Map the error of a call on ``worker`` to asyncexec's tree (see :data:`RAY_ERROR_KINDS`).

    A dead actor or a lost result is a lost node when the node table (``alive``, the cluster's
    ``node_alive``; Ray's by default) no longer holds the worker's node (Ray marks a lost node's
    actors dead only after the node), else a crashed worker or an unreachable one. The failed
    calls of one death share one look-up of the node (``_liveness``). A call the driver
    cancelled (``cancelled``) that ended so is a :class:`CallCancelledError`. The error keeps
    ``exc`` as its ``__cause__`` (a raised one, the user's own error)."""
    kind = ray_error_kind(exc)
    if cancelled and isinstance(exc, rex.TaskCancelledError | LocalCallCancelled):
        # Ray's TaskCancelledError: bare for a call not started yet, a RayTaskError that is
        # one (``as_instanceof_cause``) for a coroutine cancelled on the actor's loop.
        error: AsyncExecError = worker_error(
            CallCancelledError, worker, attempt, _death_detail(exc)
        )
        error.__cause__ = exc
        return error
    if kind == "raised":
        cause = _attribute(exc, "cause")
        cause = cause if isinstance(cause, BaseException) else exc
        return _raised(worker, attempt, cause, _remote_traceback(exc))  # the user's as cause
    if kind in ("died", "unreachable"):
        if isinstance(exc, rex.NodeDiedError) or await _gone(worker, alive):
            node = short_node(worker.metadata.node_id)
            error = worker_error(NodeLostError, worker, attempt, f"node {node} left the cluster")
        elif kind == "unreachable":
            error = worker_error(WorkerUnreachableError, worker, attempt, _death_detail(exc))
        else:
            error = worker_error(WorkerCrashedError, worker, attempt, _death_detail(exc))
    elif isinstance(exc, LocalWorkerGone):  # (in this process: no node to look up)
        error = worker_error(WorkerCrashedError, worker, attempt, str(exc))
    elif isinstance(exc, LocalCallCancelled):  # as Ray's TaskCancelledError, not asked for
        error = worker_error(WorkerUnreachableError, worker, attempt, str(exc))
    elif kind == "hung":
        error = worker_error(WorkerHungError, worker, attempt, describe(exc))
    elif kind == "startup":
        error = StartupError(f"rank {worker.rank} could not be started: {describe(exc)}")
    elif isinstance(exc, AsyncExecError):
        return exc
    else:
        return _raised(worker, attempt, exc, "")
    error.__cause__ = exc  # the cluster's error kept (as ``raise ... from exc``)
    return error


def outcome_error(outcome: Outcome, worker: Who, attempt: int) -> WorkerError:
    """The error of a call whose outcome is not ``ok`` (the user's function raised, or its run
    was stopped)."""
    if outcome.kind == "error" and outcome.error is not None:
        return _raised(worker, attempt, outcome.error, outcome.traceback)
    return worker_error(WorkerRaisedError, worker, attempt, "the function was stopped")


def startup_error(exc: BaseException, phase: str, timeout_s: float) -> BaseException:
    """What a failed start-up raises: asyncexec's errors as they are, a deadline as
    :class:`StartupTimeoutError`, anything else as :class:`StartupError` naming the phase and
    the worker's own error first (not Ray's coloured task header)."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, AsyncExecError | rex.RayError):
        timeout = StartupTimeoutError(phase, timeout_s)
        timeout.__cause__ = exc
        return timeout
    if isinstance(exc, WorkerRaisedError) and exc.error is not None:
        error = StartupError(f"start-up failed while {phase}: {describe(exc.error)}")
        error.__cause__ = exc.error
        return error
    cause = _attribute(exc, "cause") if isinstance(exc, rex.RayTaskError) else None
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
