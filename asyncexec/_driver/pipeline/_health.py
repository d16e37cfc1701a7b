"""The router's health watch, and how a server comes back.

The watch is a task of the router's task group: every ``health_interval_s`` it calls
``RolloutServer.health`` on each serving server (each server on its own clock), each call
bounded by ``health_timeout_s``. A
check that raises or times out counts as failed, unless the server (re)joined less than
``health_grace_s`` ago (its first compile); ``unhealthy_after`` failed checks in a row take the
server out: it gets no new request, its requests in flight are cancelled (an idempotent one is
sent to another server), and its process is killed.

A server taken out, or seen dead by a request or a check, comes back in a fresh process: the
first call that meets the dead one fails at once (its request goes elsewhere), and the
executor's dispatcher puts a fresh process in the rank's place (``_driver/_recovery.py``; it runs
the role's constructor), which the next call on the rank waits for. Before that server takes a
request, its rejoin (one task per server) makes sure that it holds the weight channel's current
version: a rank renewed outside a run does not get the channel's latest version by itself (the
channel gives it to ranks that join a run), so the rejoin asks the channel to bring every rank
of the group up to its latest (``GroupSlot.joiners``, as a run's start does) and checks the
server's ``weights_version``; it is paused as the router is, or resumed (the same process back
may have been paused before it was seen lost). Each step is bounded; a failed one is tried
again while the router is open.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio

from ..._dispatch._targets import rank as on_rank
from ..._errors import (
    ChannelError,
    ExecutorStateError,
    NodeLostError,
    RestartsExhaustedError,
    WorkerCrashedError,
    WorkerUnreachableError,
    describe,
)
from .._executor import Executor, slot_of
from .._taskgroups import task_group
from ._events import ServerReplaced, ServerTakenOut
from ._router_host import WatchHost
from ._router_state import ServerRecord

__all__ = ["GONE", "HealthWatch", "worker_keys"]

#: The errors that say a server is gone (or could not be reached): its requests go elsewhere.
GONE = (WorkerCrashedError, NodeLostError, WorkerUnreachableError)


def worker_keys(servers: Executor) -> list[str | None]:
    """The key of each live worker of ``servers``, in rank order (none while it has no live
    group): a rank whose key changed holds a fresh process."""
    group = slot_of(servers).group
    return [] if group is None or group.closed else [w.handle.key for w in group.workers]


class HealthWatch:
    """A router's health watch and its servers' rejoins (see the module's docstring).

    ``router`` is the :class:`~asyncexec.Router`, seen through
    :class:`~._router_host.WatchHost`."""

    def __init__(self, router: WatchHost) -> None:
        self.router = router
        #: Since when no server has served, seen by a rejoin that failed (None: one serves).
        self.none_since: float | None = None
        self.attempts = 0  # rejoins that failed while no server served
        self.failures: dict[int, BaseException] = {}  # the last failure of each server

    async def run(self) -> None:
        """Check every serving server each ``health_interval_s``, until cancelled: each server
        on its own clock, so that a check that hangs (to ``health_timeout_s``) delays no other
        server's."""
        async with task_group() as tg:
            for server in self.router.balance.servers:
                tg.start_soon(self._watch, server)

    async def _watch(self, server: ServerRecord) -> None:
        while True:
            await anyio.sleep(self.router.health_interval_s)
            self.follow_group()
            if server.serving:
                await self._check(server)

    async def _check(self, server: ServerRecord) -> None:
        router = self.router
        r, worker = server.rank, server.worker
        try:
            with anyio.fail_after(router.health_timeout_s):
                await router.servers.call(router.methods.health, on=on_rank(r))
        except GONE:
            self.lost(r, worker)
            return
        except ExecutorStateError:
            return  # the executor is closing: nothing to check
        except Exception as exc:  # health() raised, or did not answer in time
            failure = describe(exc) if not isinstance(exc, TimeoutError) else "timed out"
        else:
            if router.balance.live(r, worker):
                server.failures = 0
            return
        if not router.balance.live(r, worker):
            return
        if time.monotonic() - server.since < router.health_grace_s:
            router.log.info("health_failed_in_grace", rank=r, error=failure)
            return
        server.failures += 1
        router.log.warning("health_failed", rank=r, failures=server.failures, error=failure)
        if server.failures >= router.unhealthy_after:
            await self.take_out(server, failure)

    async def take_out(self, server: ServerRecord, why: str) -> None:
        """No new request for ``server``; its requests in flight are cancelled (and sent
        elsewhere when idempotent); its process is killed, and a fresh one rejoins."""
        router = self.router
        router.balance.out(server.rank)
        router.observer.emit(ServerTakenOut(server.rank, why))
        for scope in list(server.scopes):
            scope.cancel()
        group = slot_of(router.servers).group
        if group is not None and not group.closed and server.rank < len(group.workers):
            worker = group.workers[server.rank]
            if worker.handle.key == server.worker:
                await group.cluster.kill([worker.handle])
        self._rejoin_soon(server)

    def lost(self, r: int, worker: str | None) -> None:
        """A request or a check saw server ``r`` (the worker ``worker``) gone: no new request
        for it until a fresh process rejoins."""
        router = self.router
        if not router.balance.live(r, worker):
            return  # seen already
        server = router.balance.servers[r]
        router.balance.out(r)
        router.log.warning("server_lost", rank=r)
        self._rejoin_soon(server)

    def follow_group(self) -> None:
        """When the executor replaced its whole group (a group with a backend after a death,
        or a renewal that failed: the next call starts a fresh one), every server is a fresh
        process: each rejoins, at the channel's version, before it takes a request. Looked at
        before each request is placed, at each round of checks, and by each rejoin before it
        takes the group for the router's (one server's loss may be the first to see it)."""
        router = self.router
        current = slot_of(router.servers).group
        if current is router.group and current is not None and not current.closed:
            return
        router.group = None  # the next rejoin that succeeds says which group serves
        fresh = [s for s in router.balance.servers if s.serving]
        if fresh:
            router.log.warning("servers_group_replaced", servers=len(fresh))
        for server in fresh:
            router.balance.out(server.rank)
            self._rejoin_soon(server)

    def _rejoin_soon(self, server: ServerRecord) -> None:
        tg = self.router.tg
        if tg is not None and not server.rejoining:
            server.rejoining = True
            tg.start_soon(self._rejoin, server)

    async def _rejoin(self, server: ServerRecord) -> None:
        """Bring ``server`` back (see the module's docstring), trying again while the router
        is open."""
        router = self.router
        old = server.worker
        bound = router.health_timeout_s + router.servers.config.start_timeout_s
        if router.channel is not None:  # a fresh process, then the channel's latest version
            bound += router.channel.timeout_s
        try:
            while True:
                try:
                    with anyio.fail_after(bound):
                        worker = await self._ready(server.rank)
                    break
                except Exception as exc:  # dead again, not started yet, a failed join
                    router.log.warning("rejoin_failed", rank=server.rank, error=describe(exc))
                    if self._give_up(server, exc, bound):
                        return
                    await anyio.sleep(min(1.0, router.health_interval_s))
        finally:
            server.rejoining = False
        # No await from ``_ready``'s last look at the router's pause or resume to here: one
        # that begins from now on reaches this server.
        server.worker = worker
        server.failures = 0
        server.since = time.monotonic()
        server.serving = True
        self.none_since, self.attempts = None, 0
        self.failures.pop(server.rank, None)
        version = None if router.channel is None else router.channel.version
        router.observer.emit(ServerReplaced(server.rank, version, fresh=worker != old))
        router.balance.wake()

    def _give_up(self, server: ServerRecord, exc: BaseException, bound: float) -> bool:
        """Whether the router gives its servers up after ``server``'s rejoin failed with
        ``exc``: no server has served for longer than one rejoin's ``bound``. It then fails
        (``Router.fail``): every request waiting for a server, and the pipeline, raise
        :class:`RestartsExhaustedError` with each server's last failure."""
        router = self.router
        self.failures[server.rank] = exc
        if any(s.serving for s in router.balance.servers):
            self.none_since, self.attempts = None, 0
            return False
        now = time.monotonic()
        if self.none_since is None:
            self.none_since = now
        self.attempts += 1
        if now - self.none_since <= bound:
            return False
        error = RestartsExhaustedError(self.attempts, list(self.failures.values()))
        error.add_note(
            f"no rollout server of {router.servers.config.name!r} has served for "
            f"{now - self.none_since:.0f} s (more than a rejoin's bound, {bound:.0f} s): the "
            f"router gave them up; last failures by rank: "
            + ", ".join(f"{r}: {describe(e)}" for r, e in sorted(self.failures.items()))
        )
        router.fail(error)
        return True

    async def _ready(self, r: int) -> str | None:
        """Rank ``r``'s worker once it holds the channel's current version (and is paused as
        the router is, or resumed): its key. The first call on a dead rank raises, and the
        dispatcher puts a fresh process in its place, which the next call waits for."""
        router = self.router
        servers, methods = router.servers, router.methods
        try:
            held = await servers.call(methods.weights_version, on=on_rank(r))
        except GONE:  # the process taken out or seen dead: its fresh one answers
            held = await servers.call(methods.weights_version, on=on_rank(r))
        before = _key(servers, r)
        channel = router.channel
        if channel is not None and (held or 0) < channel.version:
            group = slot_of(servers).group
            if group is None or group.closed:
                raise ChannelError("the servers' group is not live")
            for join in slot_of(servers).joiners:  # the channel's latest version, first
                await join(group)
            held = await servers.call(methods.weights_version, on=on_rank(r))
            if (held or 0) < channel.version:
                raise ChannelError(
                    f"rank {r} holds version {held} after joining, not {channel.version}"
                )
        await self._as_ordered(r)
        group = slot_of(servers).group
        if _key(servers, r) != before or group is None:
            raise ExecutorStateError(f"rank {r} was replaced again while it rejoined")
        # A whole group replaced that this rejoin saw first (the server's loss, not the
        # router's look at the group): the others serve in fresh processes too, and rejoin.
        self.follow_group()
        router.group = group
        return before

    async def _as_ordered(self, r: int) -> None:
        """Pause rank ``r`` as the router's latest pause or resume says, or resume it (a
        process that comes back may have been paused before it was seen lost; a resume of one
        that is not paused does nothing); again while another begins during the call, which
        skipped the rank (it does not serve yet). The caller marks it serving with no await
        after this returns: any pause or resume that begins later reaches it."""
        router = self.router
        servers, methods = router.servers, router.methods
        while True:
            order = router.order
            if order.mode is None:
                await servers.call(methods.resume, on=on_rank(r))
            else:
                await servers.call(methods.pause, order.mode, on=on_rank(r))
            if router.order is order:
                return

    async def on_serving(self, fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
        """Call ``fn`` on every serving server at once, each bounded by ``health_timeout_s``;
        their results by rank. A server seen gone meanwhile is left out (it rejoins as the
        router says), and so is one that did not answer in time: it is taken out (its requests
        go elsewhere, its process is killed, a fresh one rejoins), so that a pause or a resume
        never waits on a server that hangs (an engine that is stopped)."""
        router = self.router
        results: dict[int, Any] = {}

        async def one(server: ServerRecord) -> None:
            r, worker = server.rank, server.worker
            try:
                with anyio.fail_after(router.health_timeout_s):
                    results[r] = await router.servers.call(fn, *args, on=on_rank(r))
            except GONE:
                self.lost(r, worker)
            except TimeoutError:
                if router.balance.live(r, worker):
                    await self.take_out(server, f"{getattr(fn, 'name', fn)}() timed out")

        async with task_group() as tg:
            for server in router.balance.servers:
                if server.serving:
                    tg.start_soon(one, server)
        return results


def _key(servers: Executor, r: int) -> str | None:
    keys = worker_keys(servers)
    return keys[r] if r < len(keys) else None
