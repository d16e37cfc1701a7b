"""What the pipeline and the router emit (``Observer.emit``): one typed record per event, at the
one place it happens; ``_sinks`` turns each into the timeline's, the metrics', the log's and the
statistics' forms. A log line that only a log line is (``health_failed``, ``router_started``)
stays a log call.

The events are ``NamedTuple`` s, typed and immutable: made on the hot paths (every admission,
every request's start and end), one costs a third of a frozen dataclass's ``__init__`` (which
sets each field through ``object.__setattr__``)."""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = [
    "Admitted",
    "AnswerDropped",
    "BatchHanded",
    "GenerationEnded",
    "PipelineClosed",
    "RequestAnswered",
    "RequestExpired",
    "RequestReceived",
    "RequestRetried",
    "RequestTimedOut",
    "SampleReturned",
    "ServerLoad",
    "ServerReplaced",
    "ServerTakenOut",
    "UpdateEnded",
    "UpdatePaused",
]

# The pipeline ---------------------------------------------------------------------------------


class Admitted(NamedTuple):
    """A prompt went to the servers; ``in_flight`` requests and ``buffered`` samples now."""

    in_flight: int
    buffered: int


class PipelineClosed(NamedTuple):
    """The pipeline closed: nothing more is admitted or returned."""


class GenerationEnded(NamedTuple):
    """A request's generation ended, whatever its end, ``seconds`` after its admission."""

    seconds: float


class SampleReturned(NamedTuple):
    """A request's sample came back: ``"finished"`` (into the buffer), ``"aborted"`` (its prompt
    requeued at the head) or ``"duplicate"`` (its id consumed already: dropped)."""

    outcome: Literal["finished", "aborted", "duplicate"]
    in_flight: int
    buffered: int


class RequestExpired(NamedTuple):
    """A request a strict batch would wait for was cancelled after ``in_flight_s`` (its prompt
    held, then requeued) at the learner's ``version``."""

    version: int
    in_flight_s: float
    in_flight: int
    buffered: int


class BatchHanded(NamedTuple):
    """The learner took a batch at ``version`` after waiting ``waited_s``; ``bound``: the
    pipeline's staleness bound S; ``buffered``: the samples left in the buffer."""

    version: int
    staleness: tuple[int, ...]
    staleness_max: int
    waited_s: float
    buffered: int
    bound: int


class UpdatePaused(NamedTuple):
    """A weight update that began at ``began`` (``time.monotonic()``) has paused generation as
    ``mode`` says, with ``in_flight`` generations in flight then; its push begins at ``at``."""

    mode: str
    began: float
    at: float
    in_flight: int


class UpdateEnded(NamedTuple):
    """A weight update is over: the learner's version is ``version``; generation was paused
    ``pause_s`` (the push apart), the push took ``push_s``."""

    mode: str
    version: int
    pause_s: float
    push_s: float
    in_flight: int


# The router -----------------------------------------------------------------------------------


class RequestReceived(NamedTuple):
    """A request was given to ``Router.generate``."""


class RequestRetried(NamedTuple):
    """A request is sent again to another server."""


class RequestAnswered(NamedTuple):
    """A request was answered with a sample (by server ``rank``)."""

    rank: int


class AnswerDropped(NamedTuple):
    """A sample of server ``rank`` answered nothing: its request was answered already
    (``duplicate``), or had given up."""

    rank: int
    duplicate: bool


class RequestTimedOut(NamedTuple):
    """A request gave up on its deadline, after attempts on ``ranks``."""

    ranks: tuple[int, ...]
    deadline_s: float | None


class ServerLoad(NamedTuple):
    """Server ``rank`` holds ``in_flight`` of the router's requests now."""

    rank: int
    in_flight: int


class ServerTakenOut(NamedTuple):
    """The health watch took server ``rank`` out (``error``: why)."""

    rank: int
    error: str


class ServerReplaced(NamedTuple):
    """Server ``rank`` serves again (``fresh``: in a new process; else the same came back), at
    the channel's ``version`` (None: no channel)."""

    rank: int
    version: int | None
    fresh: bool
