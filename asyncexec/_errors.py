"""The error tree of asyncexec.

Every error the library raises derives from :class:`AsyncExecError`::

    AsyncExecError
    ├── ConfigurationError (ValueError)     bad arguments, refused before anything starts
    ├── ExecutorStateError (RuntimeError)   used before start, after close, or while busy
    ├── StartupError                           the group could not be started
    │   ├── PlacementTimeoutError (TimeoutError)  the placement group was not ready in time
    │   ├── PlacementInfeasibleError              no node can ever hold the workers
    │   ├── StartupTimeoutError (TimeoutError)    start-up overran its deadline
    │   └── BackendError                          a backend hook failed
    ├── WorkerError                  one rank failed (``rank``, ``node_id``, ``pid``, ``attempt``)
    │   ├── WorkerCrashedError                 the worker process died
    │   ├── NodeLostError                      the worker's node left the cluster
    │   ├── WorkerHungError (TimeoutError)     it stopped answering or reporting (``stacks``)
    │   ├── WorkerUnreachableError             Ray could not carry a call to or from it
    │   └── WorkerRaisedError                  the user's function raised (``__cause__``)
    ├── ReportMismatchError                    ranks reported a different number of times
    ├── RestartsExhaustedError                 the restart policy gave up (``failures``)
    ├── MergeError (TypeError)                 a call's results did not merge (``results``)
    └── ChannelError                           a weight channel could not read or deliver a state

Errors cross process boundaries (worker to driver, driver to a process pool), so each one
pickles with its attributes (and its notes); the message is built from them in one place,
``_message()``. :func:`describe` is the one way to name an exception in a message or a log line:
it never raises, whatever the exception's message is.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "AsyncExecError",
    "BackendError",
    "ChannelError",
    "ConfigurationError",
    "ExecutorStateError",
    "MergeError",
    "NodeLostError",
    "PlacementInfeasibleError",
    "PlacementTimeoutError",
    "ReportMismatchError",
    "RestartsExhaustedError",
    "StartupError",
    "StartupTimeoutError",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerHungError",
    "WorkerRaisedError",
    "WorkerUnreachableError",
]

#: Longest first line :func:`first_line` keeps.
_LINE_LIMIT = 300


#: How many characters of a node id name it in messages and logs.
NODE_ID_CHARS = 12


def short_node(node_id: str) -> str:
    """A node id shortened for messages and logs."""
    return node_id[:NODE_ID_CHARS]


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message ('' when it has none). Never raises: safe
    inside an ``except`` block on any exception (an empty message, a ``__str__`` that raises)."""
    try:
        text = str(exc)
    except Exception:
        return "<the message could not be read: its __str__ raised>"
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:_LINE_LIMIT]
    return ""


def describe(exc: BaseException) -> str:
    """``"TypeName: first line"``, or the type's name alone for an empty message. Never raises."""
    line = first_line(exc)
    name = type(exc).__name__
    return f"{name}: {line}" if line else name


def _notes(exc: BaseException) -> dict[str, Any]:
    """The state that pickles beside an error's constructor arguments: its notes."""
    notes = getattr(exc, "__notes__", None)
    return {"__notes__": list(notes)} if notes else {}


class AsyncExecError(Exception):
    """The root of every error that asyncexec raises."""


class ConfigurationError(AsyncExecError, ValueError):
    """An argument is invalid; raised before anything is started in the cluster."""


class ExecutorStateError(AsyncExecError, RuntimeError):
    """The executor is not in a state that allows the call (not started, closed, busy)."""


class StartupError(AsyncExecError):
    """The worker group could not be started."""


class PlacementTimeoutError(StartupError, TimeoutError):
    """The placement group did not become ready before its deadline.

    Attributes:
        requested: the bundles that were asked for.
        available: the cluster's available resources when the deadline passed (None: unknown,
            the cluster did not answer in time).
        timeout_s: the deadline.
    """

    def __init__(
        self,
        requested: Sequence[Mapping[str, float]],
        available: Mapping[str, float] | None,
        timeout_s: float,
        parent: bool = False,
    ) -> None:
        self.requested = [dict(b) for b in requested]
        kinds = {k for bundle in self.requested for k in bundle}
        # Only the kinds asked for: Ray's table also lists memory and one entry per node.
        self.available = (
            None
            if available is None
            else {k: v for k, v in available.items() if k in kinds or not kinds}
        )
        self.timeout_s = timeout_s
        self.parent = parent
        super().__init__(self._message())

    def _message(self) -> str:
        where = (
            "the parent placement group has no room for the workers"
            if self.parent
            else "placement group not ready"
        )
        free = "unknown (the cluster did not answer)" if self.available is None else self.available
        return (
            f"{where} after {self.timeout_s:g} s: requested "
            f"{len(self.requested)} bundle(s) {self.requested}, cluster has available {free}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.requested, self.available, self.timeout_s, self.parent),
            _notes(self),
        )


class PlacementInfeasibleError(StartupError):
    """The workers can never be placed: no node (or set of nodes) of the cluster holds the
    bundles, and no autoscaler can add one. Raised at once, not after the placement deadline.

    Attributes:
        requested: the bundles that were asked for.
        nodes: each live node's total resources.
        reason: why they cannot fit.
    """

    def __init__(
        self,
        requested: Sequence[Mapping[str, float]],
        nodes: Sequence[Mapping[str, float]],
        reason: str,
    ) -> None:
        self.requested = [dict(b) for b in requested]
        kinds = {k for bundle in self.requested for k in bundle}
        self.nodes = [{k: v for k, v in n.items() if k in kinds} for n in nodes]
        self.reason = reason
        super().__init__(self._message())

    def _message(self) -> str:
        return (
            f"the workers can never be placed: {self.reason}; requested "
            f"{len(self.requested)} bundle(s) {self.requested}, the cluster's nodes hold "
            f"{self.nodes} in all, and no autoscaler can add nodes"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.requested, self.nodes, self.reason), _notes(self))


class StartupTimeoutError(StartupError, TimeoutError):
    """Start-up (actors, set-up, backend) overran its deadline."""

    def __init__(self, phase: str, timeout_s: float) -> None:
        self.phase = phase
        self.timeout_s = timeout_s
        super().__init__(f"start-up timed out after {timeout_s:g} s while {phase}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.phase, self.timeout_s), _notes(self))


class BackendError(StartupError):
    """A backend hook failed on a rank."""

    def __init__(self, backend: str, hook: str, rank: int | None, detail: str) -> None:
        self.backend = backend
        self.hook = hook
        self.rank = rank
        self.detail = detail
        where = "" if rank is None else f" on rank {rank}"
        super().__init__(f"backend {backend} failed in {hook}{where}: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.backend, self.hook, self.rank, self.detail), _notes(self))


class WorkerError(AsyncExecError):
    """A failure of one rank; the subclass says what failed.

    Attributes:
        rank: the world rank that failed.
        node_id: the node it ran on.
        pid: its process id, when known.
        attempt: the attempt it belonged to (1 for the first).
        detail: what was seen.
        time: when the failure was recorded (seconds since the epoch).
    """

    what = "failed"

    def __init__(
        self,
        rank: int,
        *,
        node_id: str | None = None,
        pid: int | None = None,
        attempt: int = 1,
        detail: str = "",
        time_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.node_id = node_id
        self.pid = pid
        self.attempt = attempt
        self.detail = detail
        self.time = time.time() if time_s is None else time_s
        super().__init__(self._message())

    def _message(self) -> str:
        node = "?" if self.node_id is None else short_node(self.node_id)
        text = f"rank {self.rank} (node {node}, pid {self.pid}, attempt {self.attempt}) {self.what}"
        return f"{text}: {self.detail}" if self.detail else text

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_worker_error,
            (type(self), self.rank, self.node_id, self.pid, self.attempt, self.detail, self.time),
            _notes(self),
        )


def _rebuild_worker_error(
    cls: type[WorkerError],
    rank: int,
    node_id: str | None,
    pid: int | None,
    attempt: int,
    detail: str,
    time_s: float,
) -> WorkerError:
    return cls(rank, node_id=node_id, pid=pid, attempt=attempt, detail=detail, time_s=time_s)


class WorkerCrashedError(WorkerError):
    """The worker's process died (killed, out of memory, segfault)."""

    what = "crashed"


class NodeLostError(WorkerError):
    """The node that held the worker left the cluster."""

    what = "lost its node"


class WorkerUnreachableError(WorkerError):
    """Ray could not carry a call to or from the worker, while the worker itself was not seen to
    die: an RPC failure, a call's result lost or freed before it was read, a full object store or
    disk. The default restart policy restarts after it, as after a crash."""

    what = "could not be reached"


class WorkerHungError(WorkerError, TimeoutError):
    """The worker stopped answering health checks, did not report within the step deadline, or
    its function did not end in time after its run was stopped.

    Attributes:
        stacks: every rank's threads' stacks (rank -> text, in rank order), read from outside
            the processes (py-spy) when the hang was declared, before anything was killed; a
            rank whose stack could not be taken has a note saying why. ``str(error)`` shows the
            hung rank's.
    """

    what = "hung"

    def __init__(
        self,
        rank: int,
        *,
        node_id: str | None = None,
        pid: int | None = None,
        attempt: int = 1,
        detail: str = "",
        time_s: float | None = None,
        stacks: Mapping[int, str] | None = None,
    ) -> None:
        self.stacks = dict(stacks or {})
        super().__init__(
            rank, node_id=node_id, pid=pid, attempt=attempt, detail=detail, time_s=time_s
        )

    def __str__(self) -> str:
        text = super().__str__()
        stack = self.stacks.get(self.rank)
        if stack is None:
            return text
        others = "; every rank's is in .stacks" if len(self.stacks) > 1 else ""
        head = f"Stack of rank {self.rank}, taken when it was declared hung{others}:"
        return f"{text}\n\n{head}\n{stack}"

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild, args, state = super().__reduce__()
        return rebuild, args, {**state, "stacks": self.stacks}


class WorkerRaisedError(WorkerError):
    """The user's function raised on a rank.

    The original exception is ``__cause__`` (also ``.error``); ``remote_traceback`` holds the
    traceback as it was formatted on the worker.
    """

    what = "raised"

    def __init__(
        self,
        rank: int,
        *,
        node_id: str | None = None,
        pid: int | None = None,
        attempt: int = 1,
        detail: str = "",
        time_s: float | None = None,
        error: BaseException | None = None,
        remote_traceback: str = "",
    ) -> None:
        self.error = error
        self.remote_traceback = remote_traceback
        super().__init__(
            rank, node_id=node_id, pid=pid, attempt=attempt, detail=detail, time_s=time_s
        )
        self.__cause__ = error

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            return f"{text}\n\nRemote traceback (rank {self.rank}):\n{self.remote_traceback}"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_raised,
            (
                self.rank,
                self.node_id,
                self.pid,
                self.attempt,
                self.detail,
                self.time,
                self.error,
                self.remote_traceback,
            ),
            _notes(self),
        )


def _rebuild_raised(
    rank: int,
    node_id: str | None,
    pid: int | None,
    attempt: int,
    detail: str,
    time_s: float,
    error: BaseException | None,
    remote_traceback: str,
) -> WorkerRaisedError:
    return WorkerRaisedError(
        rank,
        node_id=node_id,
        pid=pid,
        attempt=attempt,
        detail=detail,
        time_s=time_s,
        error=error,
        remote_traceback=remote_traceback,
    )


class ReportMismatchError(AsyncExecError):
    """Ranks called ``report()`` a different number of times.

    Attributes:
        counts: reports received per rank.
        finished: the ranks whose function had returned when the mismatch was seen.
    """

    def __init__(self, counts: Mapping[int, int], finished: Sequence[int] = ()) -> None:
        self.counts = dict(counts)
        self.finished = list(finished)
        super().__init__(self._message())

    def _message(self) -> str:
        table = ", ".join(f"rank {r}: {c}" for r, c in sorted(self.counts.items()))
        done = f" (finished: {sorted(self.finished)})" if self.finished else ""
        return f"ranks reported a different number of times: {table}{done}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.counts, self.finished), _notes(self))


class RestartsExhaustedError(AsyncExecError):
    """The restart policy gave up.

    Attributes:
        attempts: how many attempts ran.
        failures: the error that ended each attempt, in order; the last one is ``__cause__``.
    """

    def __init__(self, attempts: int, failures: Sequence[BaseException]) -> None:
        self.attempts = attempts
        self.failures = list(failures)
        super().__init__(self._message())
        if self.failures:
            self.__cause__ = self.failures[-1]

    def _message(self) -> str:
        lines = [f"gave up after {self.attempts} attempt(s); failures:"]
        for i, failure in enumerate(self.failures, 1):
            lines.append(f"  {i}. {describe(failure)}")
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.attempts, self.failures), _notes(self))


class MergeError(AsyncExecError, TypeError):
    """A call's ``merge=`` failed on the ranks' results, after every rank had run the call; the
    merge's own error is ``__cause__``.

    Attributes:
        merge: the merge, by name (``"concat"``).
        method: the function called, by name (``"Learner.update"``).
        ranks: the ranks whose results were merged, in order.
        results: each of those ranks' result, in the same order: nothing is lost.
    """

    def __init__(
        self, merge: str, method: str, ranks: Sequence[int], results: Sequence[Any], detail: str
    ) -> None:
        self.merge = merge
        self.method = method
        self.ranks = list(ranks)
        self.results = list(results)
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        return (
            f"merge={self.merge} could not merge the results of {self.method} from ranks "
            f"{self.ranks}: {self.detail}; every rank ran the call, and their results are this "
            "error's .results (leave merge= out for the list of them)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.merge, self.method, self.ranks, self.results, self.detail),
            _notes(self),
        )


class ChannelError(AsyncExecError):
    """A weight channel could not read a state from its source or deliver it to its target (the
    cause, when there is one, is ``__cause__``).

    Attributes:
        remote_traceback: when a worker's code raised (``serve_weights``' read, an install,
            ``load_weights``), its traceback as formatted on the worker, also in ``str(error)``
            after the first line: it survives a pickle, which ``__cause__`` does not.
    """

    def __init__(self, message: str, *, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            return f"{text}\n\nRemote traceback:\n{self.remote_traceback}"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_channel, (self.args[0], self.remote_traceback), _notes(self)


def _rebuild_channel(message: str, remote_traceback: str) -> ChannelError:
    return ChannelError(message, remote_traceback=remote_traceback)
