"""Where a worker's state lives: its :class:`Place`, one per worker process, or one per worker
thread in local mode, where several workers share the driver's process (the current place is a
context variable that each local worker's calls, and the threads they start, carry)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, Protocol

from .._wire._protocol import PreemptionNotice, WorkerContext

__all__ = [
    "PLACE",
    "ROLE_BEGUN",
    "ROLE_LOOP",
    "Place",
    "Session",
    "current_place",
    "current_session",
    "set_group_context",
    "set_report_version",
]


class Session(Protocol):
    """What the place knows of a run's session (``_session.Session``)."""

    context: WorkerContext
    checkpoint: Any
    shards: dict[str, Any]
    thread: threading.Thread
    reports: Any

    def halt(self) -> None: ...

    @property
    def finished(self) -> bool:
        """Whether the run's function has ended."""
        ...


class Place:
    """One worker's state: the group's context, the run's session, the weight version held,
    the instances of its roles, the preemption notice the driver gave it."""

    __slots__ = ("context", "preemption", "roles", "session", "version")

    def __init__(self) -> None:
        self.context: WorkerContext | None = None
        self.session: Session | None = None
        #: The weight version this worker holds (of the channel it receives from), tagged on
        #: reports.
        self.version: int | None = None
        #: The instances of the group's roles (a ``_roles.Roles``), once made.
        self.roles: Any = None
        #: The driver's latest word on the preemption of the group's nodes (a
        #: ``PreemptionNotice``), or None.
        self.preemption: PreemptionNotice | None = None


#: The current worker's place when a local worker's call set it (see
#: ``asyncexec._driver.cluster._local``); else the process's own.
PLACE: contextvars.ContextVar[Place] = contextvars.ContextVar("asyncexec_place")
_PROCESS = Place()
#: The worker's event loop (the actor's), while the worker makes its roles' instances: where
#: their ``async def`` methods will be called. None outside (an instance made by hand).
ROLE_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "asyncexec_role_loop", default=None
)
#: While the worker makes its roles' instances: those whose ``__init__`` registered with the
#: worker (a rollout server, for its weight installs), so that one whose making failed, or was
#: cancelled, is let go of too. None outside.
ROLE_BEGUN: contextvars.ContextVar[list[object] | None] = contextvars.ContextVar(
    "asyncexec_role_begun", default=None
)


def current_place() -> Place:
    """The current worker's state."""
    return PLACE.get(_PROCESS)


def current_session() -> Session | None:
    """The current worker's session, if a run is on it."""
    return PLACE.get(_PROCESS).session


def set_group_context(context: WorkerContext | None) -> None:
    """Install the group's context in this worker (called at set-up; None when a pooled worker
    is returned)."""
    PLACE.get(_PROCESS).context = context


def set_report_version(version: int | None) -> None:
    """This worker holds weight ``version`` (a weight channel installed it): reports made from
    now on carry it (``report()`` reads it when it is called)."""
    PLACE.get(_PROCESS).version = version
