"""What an executor's wings emit (``Observer.emit``): one typed record per event, at the one place
it happens; ``_sinks`` turns each into the statistics', the metrics' and the timeline's forms. A
log line that only a log line is (``call_sent_again``, ``restarting``) stays a log call, as the
pipeline's do.

Span-shaped events (a call, a wait: see ``_observe``) end with ``start``, ``end`` and ``error``.
The events are ``NamedTuple`` s, as the pipeline's are: typed, immutable and cheap to make on
the dispatch path (one a call); the one that every call sends is made once
(:data:`ONE_CALL_SENT`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

__all__ = [
    "ONE_CALL_SENT",
    "AttemptFailed",
    "CallEnded",
    "CallResent",
    "CallsSent",
    "FunctionStarted",
    "PhaseEnded",
    "Preemption",
    "RankChosen",
    "RankFailed",
    "RankRenewed",
    "RankReplaced",
    "RankReported",
    "RankRestarting",
    "Restarting",
    "RunEnded",
    "RunStarted",
    "SlotWaited",
    "StepsQueued",
    "StepsTaken",
    "StragglerFound",
    "TornDown",
]

# Dispatch (``call()``, ``stream()``, ``execute()``) -------------------------------------------


class CallsSent(NamedTuple):
    """``calls`` calls were sent to ranks (a call to N ranks is N)."""

    calls: int


#: One call sent: the event of every call to one rank, made once.
ONE_CALL_SENT = CallsSent(1)


class CallResent(NamedTuple):
    """An idempotent call chosen by load is sent again after the rank it went to died."""


class RankRenewed(NamedTuple):
    """Dead rank ``rank`` got a fresh process in its place, outside a run."""

    rank: int


class RankChosen(NamedTuple):
    """A call chosen by load went to ``rank``."""

    rank: int


class SlotWaited(NamedTuple):
    """A call chosen by load waited for a free slot (every rank at its cap)."""

    start: float
    end: float
    error: BaseException | None


class CallEnded(NamedTuple):
    """A call on ``rank`` (``name``: what it ran, as ``PolicyServer.generate``) ended: from its
    send to its first end (also when it failed or was cancelled: ``error``)."""

    rank: int
    name: str
    start: float
    end: float
    error: BaseException | None


# A group's start-up ---------------------------------------------------------------------------


class PhaseEnded(NamedTuple):
    """Start-up phase ``phase`` (``placement``, ``workers``, ``set_up``, ``ready``, ``leased``)
    of a group ended ``seconds`` after the start-up began (at ``t0``, ``time.perf_counter()``:
    the start-up's key)."""

    phase: str
    t0: float
    seconds: float


# Runs -----------------------------------------------------------------------------------------


class RunStarted(NamedTuple):
    """A run started; the run before it (if any) handed ``previous_steps`` steps to its
    iterator."""

    previous_steps: int


class RunEnded(NamedTuple):
    """A run ended: ``finished`` (its ``attempts`` and ``seconds``), ``failed`` (with
    ``error``) or ``cancelled``, after ``steps`` steps."""

    outcome: Literal["finished", "failed", "cancelled"]
    steps: int = 0
    attempts: int = 0
    seconds: float = 0.0
    error: BaseException | None = None


class AttemptFailed(NamedTuple):
    """An attempt of an aligned run failed with ``error``: a restart may follow."""

    error: BaseException


class Restarting(NamedTuple):
    """The restart policy restarts an aligned run after ``wait_s``, as attempt ``attempt``,
    from ``checkpoint`` (its path; None: from the start); ``error``: the failure it restarts
    after (None: the attempt did not fail)."""

    error: BaseException | None
    wait_s: float
    attempt: int
    checkpoint: str | None


class TornDown(NamedTuple):
    """A failed attempt's group was recovered (a spare, a rank replaced) or torn down."""

    start: float
    end: float
    error: BaseException | None


class FunctionStarted(NamedTuple):
    """Attempt ``attempt``'s function was started on every rank (``error``: it was not)."""

    attempt: int
    start: float
    end: float
    error: BaseException | None


class RankFailed(NamedTuple):
    """Rank ``rank`` of a run of independent ranks failed with ``error`` (the others go on)."""

    rank: int
    error: BaseException


class RankRestarting(NamedTuple):
    """The restart policy restarts rank ``rank`` of a run of independent ranks after ``wait_s``,
    as its attempt ``attempt``, after its failure ``error`` (None: not a failure)."""

    rank: int
    error: BaseException | None
    attempt: int
    wait_s: float


class RankReplaced(NamedTuple):
    """Rank ``rank`` of a run of independent ranks was given a fresh process (or tried)."""

    rank: int
    start: float
    end: float
    error: BaseException | None


class RankReported(NamedTuple):
    """Rank ``rank`` of a run of independent ranks sent reports, their stream indices from
    ``first``, their times ``packed`` (``ReportTimes``; None: its worker does not time them)."""

    rank: int
    first: int
    packed: bytes | None


class StepsQueued(NamedTuple):
    """A batch of steps (a ``StepBatch``) was queued for the run's iterator."""

    batch: Any


class StepsTaken(NamedTuple):
    """The run's iterator took a batch of steps (a ``StepBatch``)."""

    batch: Any


class StragglerFound(NamedTuple):
    """Rank ``rank`` (on node ``node_id``, short; process ``pid``) was found slower than the
    others in attempt ``attempt``: its shortest step of the window that ended at step ``step``
    (of ``steps`` steps a window) took ``step_s``, the typical rank's ``typical_s``;
    ``stack``: what it was running (None: not taken)."""

    rank: int
    node_id: str
    pid: int
    attempt: int
    step: int
    steps: int
    step_s: float
    typical_s: float
    factor: float
    stack: str | None


class Preemption(NamedTuple):
    """A preemption notice (``noticed``), a move off drained nodes before their deadline
    (``moved``) or a restart after workers were lost with a drained node (``restarted``)."""

    stage: Literal["noticed", "moved", "restarted"]
    #: What the run's log line says of it (nodes, ranks, deadline, the budget, the error).
    details: Mapping[str, Any] | None = None
