"""What crosses the wire between the driver and a worker, as typed records.

Both sides import this module; it imports only the standard library. The driver sends a
:class:`WorkerContext` at set-up and a :class:`RunStart` per attempt; a worker answers with its
:class:`WorkerMetadata`, with :class:`Poll` results while a run goes on, and with an
:class:`Outcome` when its function (or an ``execute()`` call) ends. A group with worker classes
(roles) sends each role as a :class:`RoleSpec` once, names a role's method as a
:class:`RoleMethod` where a run's function goes, and learns which role failed to start from a
:class:`RoleFailure`. When nodes of the group are about to be taken away (a preemption), the
driver tells every worker with a :class:`PreemptionNotice`.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

__all__ = [
    "Outcome",
    "Poll",
    "PreemptionNotice",
    "ReportTimes",
    "RoleFailure",
    "RoleMethod",
    "RoleSpec",
    "RunStart",
    "WorkerContext",
    "WorkerMetadata",
    "checkpoint_name",
]


@dataclass(frozen=True)
class WorkerContext:
    """Who and where this worker is. ``get_context()`` returns it inside ``fn`` and ``execute()``.

    ``run_id``, ``attempt`` and ``storage_path`` are set while a run is in progress.
    """

    world_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    node_id: str
    node_ip: str
    pid: int = 0
    accelerator_ids: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    executor_name: str = "asyncexec"
    run_id: str | None = None
    attempt: int | None = None
    storage_path: str | None = None

    def get_world_rank(self) -> int:
        """Ray Train's spelling of ``world_rank``."""
        return self.world_rank

    def get_local_rank(self) -> int:
        """Ray Train's spelling of ``local_rank``."""
        return self.local_rank

    def get_world_size(self) -> int:
        """Ray Train's spelling of ``world_size``."""
        return self.world_size


@dataclass(frozen=True)
class WorkerMetadata:
    """What a worker tells the driver about itself when it starts."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    accelerator_ids: Mapping[str, tuple[str, ...]]


class Outcome(NamedTuple):
    """How a call on a worker ended: the run's function, or an ``execute()`` call.

    ``error`` is the exception itself when it pickles, else a ``RuntimeError`` that keeps its
    type and text; ``traceback`` is the traceback as formatted on the worker, without colours.
    When the roles of a worker could not be made, ``value`` is a :class:`RoleFailure`.
    """

    kind: Literal["ok", "error", "stopped"]
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""


class Poll(NamedTuple):
    """One poll's answer: the reports queued since the last poll, the persisted checkpoint path
    of those that carried one (by the report's sequence number in the attempt), the function's
    outcome once it has ended and every report has been taken, and the weight versions the
    worker took since the last poll, as (sequence number of the first report that holds it,
    version)."""

    reports: list[dict[str, Any]]
    checkpoints: dict[int, str] | None
    outcome: Outcome | None
    versions: list[tuple[int, int]] | None = None
    #: When the reports were made: a :class:`ReportTimes`, packed (None without reports).
    times: bytes | None = None


class ReportTimes(NamedTuple):
    """When a poll's reports were made, on the worker's own clock (``time.monotonic()``, which
    only differences make sense of): ``calls`` holds the time each ``report()`` was called,
    ``busy`` how long the function ran before it (since its previous ``report()`` returned, or
    since it started: the time ``report()`` waited for credit or persisted a checkpoint is not
    in it), one entry per report; ``now`` is when the poll answered, so that the driver can place
    ``calls`` on its own clock.

    It crosses the wire packed into one ``bytes`` (``now``, then ``calls``, then ``busy``, as
    doubles): that unpickles in a third of the time two arrays in a record take, which is a
    cost per poll on the driver's event loop."""

    calls: array[float]
    busy: array[float]
    now: float

    def pack(self) -> bytes:
        return array("d", (self.now,)).tobytes() + self.calls.tobytes() + self.busy.tobytes()

    @classmethod
    def unpack(cls, data: bytes) -> ReportTimes:
        calls: array[float] = array("d")
        busy: array[float] = array("d")
        now = cls.unpack_into(data, calls, busy)
        return cls(calls, busy, now)

    @staticmethod
    def unpack_into(data: bytes, calls: array[float], busy: array[float]) -> float:
        """Append packed times to ``calls`` and ``busy``; return ``now``. (No array of its own
        is made: what the driver keeps of a poll goes straight where it is kept.)"""
        view = memoryview(data)
        half = (len(data) - 8) // 2
        calls.frombytes(view[8 : 8 + half])
        busy.frombytes(view[8 + half :])
        now: float = array("d", view[:8].tobytes())[0]
        return now


@dataclass(frozen=True)
class RunStart:
    """What a worker needs to start one attempt of a run (the function and its config travel
    apart, pickled once for every rank)."""

    context: WorkerContext
    checkpoint: Any  # Checkpoint | None; typed loosely so this module imports nothing of ours
    buffer_size: int
    step_offset: int
    shards: Mapping[str, Any]
    function_context: Callable[[], AbstractContextManager[Any]] | None = None
    #: The W3C trace context of the driver's span that started it (the attempt's; see
    #: ``asyncexec._wire._tracing``), current while the function runs; None when not traced.
    trace_context: str | None = None


class RoleSpec(NamedTuple):
    """One role as a worker receives it: the class, its constructor's arguments, and how many
    calls of its plain methods may run at once on an instance."""

    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    max_concurrency: int = 1


class RoleMethod(NamedTuple):
    """A method of a role, named where a function goes (a run's function): each worker calls it
    on its own instance of the role at ``role_index`` (in the group's role order)."""

    role_index: int
    name: str


class RoleFailure(NamedTuple):
    """Which role could not be made on a worker, and at which stage: ``"load"`` (its class or
    arguments did not unpickle there), ``"init"`` (its ``__init__`` raised) or ``"restore"``
    (its ``restore(checkpoint)`` raised)."""

    role_index: int
    stage: Literal["load", "init", "restore"]


@dataclass(frozen=True)
class PreemptionNotice:
    """Nodes of the group that the cluster is about to take away, and when.

    A spot or preemptible node is announced before it goes: the cluster marks it as draining,
    with a deadline (Ray's ``DrainNode``). The driver sees the mark and tells the run
    (``Step.preemption``, ``RunResult.preemption_notices``, a ``preemption_noticed`` log event)
    and every worker of the group (:func:`asyncexec.get_preemption_info`), so that the function
    can save a checkpoint before the deadline; once it has, the group moves to other nodes
    where they have room (the run goes on from that checkpoint). When several of the group's
    nodes are marked, one notice covers them all: the earliest deadline, every rank on them.

    Attributes:
        deadline: when the nodes go, in seconds since the epoch (``time.time()``); None when
            the cluster gave no deadline (save a checkpoint now).
        node_ids: the nodes that go, sorted.
        ranks: the world ranks on them, sorted (the ranks that will go).
        noticed: when the driver saw the mark, in seconds since the epoch.
    """

    deadline: float | None
    node_ids: tuple[str, ...]
    ranks: tuple[int, ...]
    noticed: float

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (0.0 once it has passed), or None without one."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.time())


def checkpoint_name(step_index: int, attempt: int | None) -> str:
    """The folder of a persisted checkpoint under the run's storage path, named by step index
    and attempt: a failed attempt's partial checkpoint (not every rank reported it) never mixes
    with the files of the attempt that replaces it."""
    return f"checkpoint_{step_index:06d}_a{attempt}"
