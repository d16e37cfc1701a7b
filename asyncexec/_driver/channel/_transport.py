"""What a weight channel's transports share: the version on its way, the calls on both sides'
workers, and the protocol a transport implements."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc

from ..._errors import (
    AsyncExecError,
    ChannelError,
    NodeLostError,
    WorkerCrashedError,
    WorkerRaisedError,
    describe,
)
from ..cluster import Call, Caller, at_attempt
from ..group import GroupSlot, WorkerInfo

__all__ = [
    "Core",
    "Pending",
    "Transport",
    "caller_of",
    "channel_error",
    "died",
    "gather",
    "settle",
]


@dataclass
class Pending:
    """One version on its way: what was read, and whether it has been delivered."""

    version: int
    done: anyio.Event
    refs: list[Any] | None = None  # object store: the shards' references
    #: object store: the installs sent with the read, by target worker (see its ``read``)
    early: dict[str, Any] | None = None
    #: object store: the read's own results, while its installs tell its outcome (see
    #: ``ObjectStoreTransport.read``); None once it is known to have ended well
    read: list[Any] | None = None
    parts: list[tuple[str, Any]] | None = None  # torch: (group id, tensor list) per source
    targets: list[WorkerInfo] | None = None
    sources: list[WorkerInfo] | None = None
    error: BaseException | None = None
    started: float = 0.0
    here: bool = False  # delivered by the push that read it (see ``Versions._push``)


class Core(Protocol):
    """What a transport uses of its channel."""

    name: str
    timeout_s: float
    sharded: bool
    log: Any
    counts: dict[str, int]
    #: The channel's task group while it is open (work that outlives one push runs there).
    tg: anyio.abc.TaskGroup | None

    @property
    def source_slot(self) -> GroupSlot:
        """The source executor's slot (its live group)."""
        ...

    @property
    def target_slot(self) -> GroupSlot: ...

    def installed(self, worker: WorkerInfo, version: int) -> None:
        """``worker`` holds ``version`` now."""
        ...

    def latest(self) -> Pending | None:
        """The latest version read (what a rank that joins gets)."""
        ...

    def read_done(self, pending: Pending) -> None:
        """``pending``'s read, left to its installs to tell, ended well."""
        ...

    def behind(self, version: int, covered: Sequence[WorkerInfo]) -> list[WorkerInfo]:
        """The target's live workers, besides ``covered``, that hold a version before
        ``version``."""
        ...

    def delivered_before(self, version: int) -> bool:
        """Whether every version before ``version`` has been delivered (or failed)."""
        ...

    def targets_now(self) -> list[WorkerInfo]:
        """The target's live workers."""
        ...

    async def push_now(self) -> Pending:
        """Read the source's state as a new version and start delivering it."""
        ...


class Transport(Protocol):
    """How a channel moves a state from its source's ranks to its target's."""

    #: Whether the targets are fixed before the state is read (its groups span them), or after.
    targets_before_read: bool

    async def read(self, pending: Pending) -> None:
        """Read the state of ``pending.sources`` for ``pending.version`` (the targets too, when
        they are fixed before the read)."""
        ...

    async def deliver(self, pending: Pending, targets: Sequence[WorkerInfo]) -> None:
        """Install ``pending``'s state on ``targets``; a target rank that died is skipped."""
        ...

    async def join(self, joiners: Sequence[WorkerInfo]) -> None:
        """Give ranks that joined the target (after a restart) the latest version."""
        ...

    def broken(self) -> None:
        """A delivery failed: what it built (process groups) is rebuilt at the next push."""
        ...


def died(error: AsyncExecError) -> bool:
    return isinstance(error, WorkerCrashedError | NodeLostError)


def caller_of(slot: GroupSlot) -> Caller:
    """For whom a channel calls ``slot``'s workers (see ``cluster.proxy``): its live group,
    whose attempt their errors carry, else its cluster (attempt 0)."""
    group = slot.group
    return group if group is not None else at_attempt(slot.cluster, 0)


async def gather(calls: Sequence[Call[Any]], slot: GroupSlot) -> list[Any]:
    """Await calls on workers (made through the seam: their errors are asyncexec's); the first
    failure raised."""
    group = slot.group
    if group is None:
        return [await call for call in calls]
    values: list[Any] = await group.gather(calls)
    return values


def channel_error(what: str, exc: BaseException, timeout_s: float) -> ChannelError:
    if isinstance(exc, ChannelError):
        return exc
    if isinstance(exc, TimeoutError) and timeout_s:
        error = ChannelError(f"{what}: no answer within {timeout_s:g} s")
    else:
        remote = exc.remote_traceback if isinstance(exc, WorkerRaisedError) else ""
        error = ChannelError(f"{what}: {describe(exc)}", remote_traceback=remote)
    error.__cause__ = exc
    return error


async def settle(calls: Sequence[Call[Any]], timeout_s: float) -> None:
    """Await ``calls`` (within ``timeout_s``) for their end alone: their errors are told
    elsewhere."""
    with anyio.move_on_after(timeout_s):
        for call in calls:
            with contextlib.suppress(AsyncExecError):
                await call
