"""What the router's helpers see of it: one narrow, typed view each. The request path
(``_router_requests``) and the health watch (``_health``) are handed the
:class:`~asyncexec.Router` itself, typed as the protocol here that lists what each reads and
calls, so that the type checker holds the router to it and a helper cannot reach past it. The
server role's methods, named once through its class, are here too (both use them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import anyio.abc

from ..._dispatch._role import method
from ..._logging import Logger
from ..._worker import RolloutServer
from .._observe import Observer
from ._router_state import Balance, Pacer, PauseOrder, Sessions

if TYPE_CHECKING:
    from .._executor import Executor
    from ..channel import WeightChannel

__all__ = ["RequestsHost", "ServerMethods", "WatchHost", "Watched"]


class ServerMethods:
    """The server role's methods, named through its class (see ``asyncexec.method``)."""

    def __init__(self, cls: type[RolloutServer]) -> None:
        self.cls = cls
        self.generate = method(cls, "generate")
        self.health = method(cls, "health")
        self.pause = method(cls, "pause")
        self.abort = method(cls, "abort")
        self.resume = method(cls, "resume")
        self.weights_version = method(cls, "weights_version")


class Watched(Protocol):
    """What the request path tells the health watch."""

    def follow_group(self) -> None:
        """Before a request is placed: follow a group the executor replaced."""

    def lost(self, r: int, worker: str | None) -> None:
        """A request saw server ``r`` (the worker ``worker``) gone."""


class _Common(Protocol):
    """What both helpers read: the records, the events' observer, the log, the servers."""

    @property
    def balance(self) -> Balance: ...
    @property
    def observer(self) -> Observer: ...
    @property
    def log(self) -> Logger: ...
    @property
    def servers(self) -> Executor: ...
    @property
    def methods(self) -> ServerMethods: ...


class RequestsHost(_Common, Protocol):
    """The router as its request path sees it."""

    @property
    def sessions(self) -> Sessions: ...
    @property
    def pacer(self) -> Pacer: ...
    @property
    def watch(self) -> Watched: ...
    def check_open(self) -> anyio.abc.TaskGroup: ...

    def fail(self, error: BaseException) -> None:
        """Fail the router (an attempt failed other than through its call: a defect)."""


class WatchHost(_Common, Protocol):
    """The router as its health watch sees it."""

    @property
    def channel(self) -> WeightChannel | None: ...
    @property
    def order(self) -> PauseOrder: ...
    @property
    def tg(self) -> anyio.abc.TaskGroup | None: ...
    @property
    def health_interval_s(self) -> float: ...
    @property
    def health_timeout_s(self) -> float: ...
    @property
    def health_grace_s(self) -> float: ...
    @property
    def unhealthy_after(self) -> int: ...

    #: The servers' group the records are of (None: being replaced); set by the watch.
    group: Any

    def fail(self, error: BaseException) -> None: ...
