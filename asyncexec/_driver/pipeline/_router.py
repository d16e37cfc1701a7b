"""Router: sends rollout requests to the servers of an executor whose role is a
:class:`~asyncexec.RolloutServer`, each to one server, and returns each request's answer once.

Where a request goes: to the server its session key went to before, while that server serves in
the same process (sticky sessions: multi-turn affinity; the keys are kept in a bounded LRU);
else to the serving server with the fewest of the router's requests in flight under the cap
(``max_in_flight`` per server), the lowest rank on ties. When every serving server holds the
cap (or a session's server does), the request waits in the driver for a slot.

Failures: an idempotent request (``retry=True``) is sent again to another server when its
server dies, when the health watch takes its server out, or when the attempt's deadline passes
(``deadline_s`` bounds each attempt, from when it is sent; the earlier attempt goes on, and
whichever answers first is the answer). A request is sent at most one time more than there are
servers. The first answer is returned; a later answer of the same request is dropped and
counted (``RouterStatistics.duplicates_dropped``). A request that is not idempotent raises its
server's error, or ``TimeoutError`` on its deadline. An error the server's ``generate`` raised
(``WorkerRaisedError``) is never retried.

One request's attempts, deadline and retries: ``_router_requests``. The health watch, the
replacement of a server and its rejoin at the channel's current version: ``_health``. The
bookkeeping (records, the choice, sessions, the pacing of bursts, counters): ``_router_state``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc

from ..._errors import ConfigurationError, ExecutorStateError, describe
from ..._logging import get_logger
from ..._wire._rollout import RolloutRequest, Sample
from ..._wire._tracing import in_request, tracer
from ..._worker import RolloutServer
from .._config import check_count
from .._executor import Executor, slot_of
from .._taskgroups import task_group, teardown
from ..channel import WeightChannel
from ._events import ServerLoad
from ._health import HealthWatch, worker_keys
from ._router_host import ServerMethods
from ._router_metrics import RouterMeters
from ._router_requests import Requests
from ._router_state import Balance, Pacer, PauseOrder, RouterStatistics, Sessions
from ._sinks import RouterCounts, router_observer

__all__ = ["Router", "RouterStatistics"]

#: How many session keys the router remembers (the least recently used are forgotten).
MAX_SESSIONS = 100_000
#: How long a closing router waits for the replies a pause to abort answered already.
HANDED_WAIT_S = 1.0

#: The process's routers, for their default names (a name is free again once its router
#: closed or was collected); under ``_NAMES_LOCK``: routers are made on several threads' loops.
_ROUTERS: weakref.WeakSet[Router] = weakref.WeakSet()
_NAMES_LOCK = threading.Lock()


class Router:
    """Sends :class:`~asyncexec.RolloutRequest` s to rollout servers (see the module's
    docstring)::

        async with asyncexec.Router(servers, max_in_flight=4, channel=channel) as router:
            sample = await router.generate(asyncexec.RolloutRequest(0, prompt, key="chat-7"))

    Args:
        servers: an open :class:`~asyncexec.Executor` one of whose roles is a
            :class:`~asyncexec.RolloutServer` subclass.
        max_in_flight: the cap: requests of this router in flight on one server.
        channel: the :class:`~asyncexec.WeightChannel` into ``servers``: a server that comes
            back in a fresh process installs its latest version before it takes a request.
        health_interval_s: how often the health watch calls each serving server's ``health``.
        health_timeout_s: how long one check (and one step of a rejoin) may take.
        health_grace_s: a server's failed checks within this long after it (re)joined do not
            count (its first compile).
        unhealthy_after: failed checks in a row after which a server is taken out (no new
            requests, its requests in flight sent elsewhere), killed and replaced.
        max_sessions: how many session keys are remembered (least recently used forgotten).
        name: the router's name in its metrics (their ``router`` label) and its log lines.
            None: its servers' executor name, or, while another router of this process that
            is not closed has that name, the name with the first free suffix (``-2``, ``-3``,
            ...): two routers over one executor have their own series.
    """

    def __init__(
        self,
        servers: Executor,
        *,
        max_in_flight: int = 4,
        channel: WeightChannel | None = None,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 10.0,
        health_grace_s: float = 60.0,
        unhealthy_after: int = 3,
        max_sessions: int = MAX_SESSIONS,
        name: str | None = None,
    ) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigurationError(f"name must be a non-empty string, got {name!r}")
        self.servers = servers
        self.methods = ServerMethods(_server_class(servers))
        _check_channel(channel, servers)
        check_count("max_in_flight", max_in_flight)
        check_count("unhealthy_after", unhealthy_after)
        check_count("max_sessions", max_sessions)
        for what, value in (
            ("health_interval_s", health_interval_s),
            ("health_timeout_s", health_timeout_s),
            ("health_grace_s", health_grace_s),
        ):
            _check_seconds(what, value, zero=what == "health_grace_s")
        self.max_in_flight = max_in_flight
        self.channel = channel
        self.health_interval_s = float(health_interval_s)
        self.health_timeout_s = float(health_timeout_s)
        self.health_grace_s = float(health_grace_s)
        self.unhealthy_after = unhealthy_after
        self._closed = False
        #: Its name: the ``router`` label of its metrics (and its pipeline's), in its log lines.
        self.name = ""
        _name(self, servers.config.name, name)
        self.log = get_logger(router=self.name)
        self.meters = RouterMeters(servers.config.name, self.name)
        self.sessions = Sessions(max_sessions)
        self.balance = Balance([], max_in_flight)
        self.pacer = Pacer()
        self.counts = RouterCounts()
        #: Every event of the router goes through it: its counters, metrics and log.
        self.observer = router_observer(self.counts, self.meters, self.log)
        #: The mode the servers are paused in, from when a pause begins until a resume has
        #: returned (a resume cut short leaves it: resume again).
        self.paused: Literal["keep", "abort"] | None = None
        #: The latest pause or resume begun: what a server that rejoins is brought to.
        self.order = PauseOrder(0, None)
        self.watch = HealthWatch(self)
        self.requests = Requests(self)
        self.tg: anyio.abc.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None  # holds ``tg`` open
        #: Set when the router gave its servers up (``fail``): what every call raises.
        self.failure: BaseException | None = None
        #: The servers' group the router's records are of (None: being replaced).
        self.group: Any = None

    def __repr__(self) -> str:
        serving = sum(s.serving for s in self.balance.servers)
        in_flight = sum(s.in_flight for s in self.balance.servers)
        return (
            f"<Router {self.name} servers={serving}/{len(self.balance.servers)} "
            f"in_flight={in_flight}>"
        )

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> Router:
        if self.tg is not None or self._closed:
            raise ExecutorStateError("a Router is entered once")
        keys = worker_keys(self.servers)
        if not keys:
            raise ExecutorStateError(
                "the router's executor has no live workers: enter it (async with) first"
            )
        self.balance = Balance(keys, self.max_in_flight, time.monotonic(), self._load)
        for rank in range(len(keys)):  # each server's gauge at 0 from the start, not missing
            self._load(rank, 0)
        self.group = slot_of(self.servers).group
        async with contextlib.AsyncExitStack() as stack:
            self.tg = await stack.enter_async_context(task_group())
            self.tg.start_soon(self.watch.run)
            self._stack = stack.pop_all()  # left in __aexit__, with the body's exception
        self.log.info("router_started", servers=len(keys), max_in_flight=self.max_in_flight)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        tg, self.tg = self.tg, None
        stack, self._stack = self._stack, None
        self.balance.wake()  # requests waiting for a slot see the router closed
        if tg is not None and stack is not None:
            # The replies held by a pause to abort come once the servers resumed: cancelling
            # them would cost a call each (and the driver their errors), so they come first.
            if self.paused is None:
                with teardown("router_held_replies", HANDED_WAIT_S):
                    await self.requests.wait_held()
            await self.requests.close()  # (plain tasks, not the task group's)
            tg.cancel_scope.cancel()
            await stack.__aexit__(exc_type, exc, tb)
        self.meters.forget(len(self.balance.servers))

    def _load(self, rank: int, in_flight: int) -> None:
        """Server ``rank``'s requests in flight changed (``Balance``: every change)."""
        self.observer.emit(ServerLoad(rank, in_flight))

    def check_open(self) -> anyio.abc.TaskGroup:
        if self.failure is not None:
            raise self.failure
        if self.tg is None:
            raise ExecutorStateError(
                "the router is closed" if self._closed else "use `async with Router(...)`"
            )
        return self.tg

    def fail(self, error: BaseException) -> None:
        """Fail the router: the requests waiting for a server, and every call after, raise
        ``error`` (its servers are gone and none came back within the bound)."""
        if self.failure is None:
            self.failure = error
            self.log.error("router_failed", error=describe(error))
            self.balance.wake()

    # Requests ---------------------------------------------------------------------------------

    async def generate(
        self, request: RolloutRequest, *, deadline_s: float | None = None, retry: bool = True
    ) -> Sample:
        """Send ``request`` to a server and return its sample (see the module's docstring).

        Args:
            request: the request; its ``key`` (when not None) is its session.
            deadline_s: bound on each attempt, from when it is sent (not the wait for a slot):
                an idempotent request is sent again to another server once it passes; None for
                no bound.
            retry: the request is idempotent: send it again when its server dies, is taken
                out, or the deadline passes.

        Raises:
            TimeoutError: the deadline passed and the request may not (or may no more) be sent
                again.
            WorkerRaisedError: the server's ``generate`` raised.
            WorkerCrashedError, NodeLostError, WorkerUnreachableError, WorkerHungError: its
                server died, could not be reached or was taken out, and it may not (or may no
                more) be sent again.
            ExecutorStateError: the router is not open, or closed meanwhile, or its servers'
                executor closes or is closed.
            ConfigurationError: ``request`` is not a :class:`~asyncexec.RolloutRequest`, or
                ``deadline_s`` or ``retry`` is invalid.
        """
        self.check_open()
        _check_request(request, deadline_s, retry)
        run = self.requests.run(request, deadline_s, retry)
        made = tracer()
        return await (run if made is None else in_request(made, "asyncexec.router.request", run))

    async def generate_stoppable(
        self, request: RolloutRequest, *, deadline_s: float | None = None, retry: bool = True
    ) -> Sample:
        """:meth:`generate`, except that when its caller is cancelled, or it gives up (its
        deadline passed, an attempt's error), the request's attempts still in flight are
        cancelled too: each stops on its server (``RolloutServer.generate`` is an ``async
        def``) and frees its slot, rather than run to its end and be dropped. The pipeline's
        way (a strict batch expiring a request, the pipeline closing)."""
        self.check_open()
        _check_request(request, deadline_s, retry)
        run = self.requests.run(request, deadline_s, retry, stop=True)
        made = tracer()
        return await (run if made is None else in_request(made, "asyncexec.router.request", run))

    # Pause, resume, state ---------------------------------------------------------------------

    async def pause(self, mode: Literal["keep", "abort"]) -> int:
        """Pause every serving server (``RolloutServer.pause``): ``"keep"`` parks each
        generation at its next pause point, ``"abort"`` ends each there; a server that joins
        while paused is paused before it takes a request. Returns once every server's chunks
        have stopped, with the number of generations that were in flight.

        With ``"abort"`` each server hands its aborted samples back in one reply
        (``RolloutServer.abort``), and each request they belong to is answered with its
        aborted sample from there, over the next turns of the event loop, except while a
        :meth:`resume` is in flight: its end comes first (the request's own reply, which the
        server sends after the resume, is then dropped, uncounted)."""
        if mode not in ("keep", "abort"):
            raise ConfigurationError(f'pause() takes "keep" or "abort", got {mode!r}')
        self.check_open()
        self.paused = mode
        self.order = PauseOrder(self.order.number + 1, mode)
        if mode == "keep":
            counts = list((await self.watch.on_serving(self.methods.pause, mode)).values())
        else:
            replies = await self.watch.on_serving(self.methods.abort)
            counts = [count for count, _ in replies.values()]
            # The requests are answered over the next turns of the loop, as the resume goes.
            self.check_open().start_soon(self.requests.hand_back, replies)
        self.log.info("servers_paused", mode=mode, generations=sum(counts))
        return sum(counts)

    async def resume(self) -> None:
        """Let every serving server's parked generations go on (``RolloutServer.resume``); a
        server that joins meanwhile is resumed before it takes a request. ``paused`` is
        cleared once every call returned: a resume cut short (cancelled) leaves it set, and
        some servers paused, until the next resume."""
        self.check_open()
        order = self.order = PauseOrder(self.order.number + 1, None)
        with self.requests.resuming():  # the callers a pause to abort answers wait for it
            await self.watch.on_serving(self.methods.resume)
        if self.order is order:  # (no pause began meanwhile)
            self.paused = None
        self.log.info("servers_resumed")

    @property
    def in_flight(self) -> dict[int, int]:
        """The router's requests in flight on each server, by rank."""
        return self.balance.in_flight

    def statistics(self) -> RouterStatistics:
        """A snapshot of the router's counters (see :class:`RouterStatistics`)."""
        servers = self.balance.servers
        return RouterStatistics(
            **self.counts.counts,
            in_flight=tuple(s.in_flight for s in servers),
            in_flight_max=tuple(s.peak for s in servers),
            serving=tuple(s.serving for s in servers),
        )


def _name(router: Router, executor: str, name: str | None) -> None:
    """Name ``router``: ``name``, or by default ``executor`` with the first suffix that no
    other open router of the process has (see ``Router``)."""
    with _NAMES_LOCK:
        if name is None:
            taken = {r.name for r in list(_ROUTERS) if not r._closed}
            name, n = executor, 2
            while name in taken:
                name, n = f"{executor}-{n}", n + 1
        router.name = name
        _ROUTERS.add(router)


def _server_class(servers: Any) -> type[RolloutServer]:
    if not isinstance(servers, Executor):
        raise ConfigurationError(f"a Router routes to an asyncexec.Executor, got {servers!r}")
    roles = servers.config.roles
    found: list[type[RolloutServer]] = [r.cls for r in roles if issubclass(r.cls, RolloutServer)]
    if len(found) != 1:
        raise ConfigurationError(
            "a Router needs an executor with exactly one role that subclasses "
            f"asyncexec.RolloutServer, found {len(found)}"
        )
    return found[0]


def _check_channel(channel: Any, servers: Executor) -> None:
    """Refuse a ``channel`` that is not a weight channel into ``servers``: the router uses it
    only when a server rejoins, long after it was made."""
    if channel is None:
        return
    if not isinstance(channel, WeightChannel):
        raise ConfigurationError(f"channel must be a WeightChannel or None, got {channel!r:.100}")
    if channel.target is not servers:
        raise ConfigurationError(
            f"channel must be a WeightChannel into the router's servers "
            f"({servers.config.name!r}); it goes into {channel.target.config.name!r}"
        )


def _check_request(request: Any, deadline_s: Any, retry: Any) -> None:
    """Refuse a call's arguments before the request is sent (a prompt where the request goes
    would fail deep in the router, naming none of them)."""
    if not isinstance(request, RolloutRequest):
        raise ConfigurationError(
            f"request must be an asyncexec.RolloutRequest(id, prompt), got {request!r:.100}"
        )
    if deadline_s is not None:
        _check_seconds("deadline_s", deadline_s)
    if not isinstance(retry, bool):
        raise ConfigurationError(f"retry must be a bool, got {retry!r:.100}")


def _check_seconds(name: str, value: Any, *, zero: bool = False) -> None:
    """Refuse anything but a finite number of seconds, above 0 (or at least 0 with ``zero``)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not (0 <= value < math.inf) or (value == 0 and not zero):
        what = "0 or more" if zero else "a positive number of"
        raise ConfigurationError(f"{name} must be {what} seconds, got {value!r}")
