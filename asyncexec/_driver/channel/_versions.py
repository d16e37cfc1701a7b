"""The versions of a weight channel on their way: each push reads the source's state as the next
version and delivers it to the target's ranks, in order, through the channel's transport; a rank
that joins the target gets the latest version. This is what the transports see of their channel
(``_transport.Core``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc

from ..._errors import AsyncExecError, ChannelError, describe
from ..._timeline._timeline import DRIVER, timed, timed_delivery
from ..._worker import weights_version
from .._observe import Observer
from .._taskgroups import task_group
from ..cluster import proxy
from ..group import GroupSlot, WorkerGroup, WorkerInfo
from ._events import PushEnded, PushFailed, RanksJoined, VersionInstalled, VersionRead
from ._transport import Pending, Transport, caller_of, channel_error, died, settle

__all__ = ["Versions", "delivered", "live"]


async def delivered(pending: Pending) -> None:
    """Until ``pending`` is delivered (see :meth:`Versions.push_read`).

    Raises:
        ChannelError: its read or its delivery failed.
    """
    await pending.done.wait()
    if pending.error is not None:
        raise pending.error


def live(slot: GroupSlot) -> list[WorkerInfo]:
    """The workers of ``slot``'s live group (none while it starts, restarts or is closed)."""
    group = slot.group
    return [] if group is None or group.closed else list(group.workers)


class Versions:
    """A channel's versions and their deliveries (see the module's docstring)."""

    def __init__(
        self,
        name: str,
        source: Callable[[], GroupSlot],
        target: Callable[[], GroupSlot],
        sharded: bool,
        max_staleness: int,
        timeout_s: float,
        log: Any,
        observer: Observer | None = None,
    ) -> None:
        self.name = name
        self._source, self._target = source, target
        self.sharded = sharded
        self.max_staleness = max_staleness
        self.timeout_s = timeout_s
        self.log = log
        #: Where the channel's events go (its metrics, log and the target's timeline).
        self.observer = observer if observer is not None else Observer()
        self.counts = {"pushes": 0, "failed_pushes": 0, "joins": 0, "rebuilds": 0}
        self.moves: Transport | None = None  # set by the channel
        #: Where deliveries run: the channel's task group, while it is open.
        self.tg: anyio.abc.TaskGroup | None = None
        self.version = 0
        self.delivered = 0
        self.last_push_s = 0.0
        self.pending: dict[int, Pending] = {}
        self._last: Pending | None = None  # the latest version read (its refs serve joins)
        self._held: dict[str, int] = {}  # target worker -> version installed
        #: The target group the held versions are of: a new group (a restart, a lease of
        #: pooled workers whose channel state was reset) starts from nothing held.
        self._held_group: WorkerGroup | None = None
        #: Reads one at a time (versions are numbered in the order read); a free lock is taken
        #: without a turn of the event loop (one turn less on each push's path).
        self._read_lock = anyio.Lock(fast_acquire=True)

    @property
    def source_slot(self) -> GroupSlot:
        return self._source()

    @property
    def target_slot(self) -> GroupSlot:
        return self._target()

    def _held_by(self, group: WorkerGroup | None) -> dict[str, int]:
        """The versions held by ``group``'s workers (those of the target's group before it, when
        ``group`` is None): a new group (a restart, a lease of pooled workers whose channel
        state was reset) starts from nothing held."""
        if group is not None and group is not self._held_group:
            self._held_group = group
            self._held = {}
        return self._held

    def installed(self, worker: WorkerInfo, version: int) -> None:
        key = worker.handle.key
        self._held[key] = max(version, self._held.get(key, 0))
        self.observer.emit(VersionInstalled(worker.rank, version, self.version))

    def latest(self) -> Pending | None:
        return self._last

    def read_done(self, pending: Pending) -> None:
        if self._last is None or self._last.version < pending.version:
            self._last = pending

    def behind(self, version: int, covered: Sequence[WorkerInfo]) -> list[WorkerInfo]:
        keys = {w.handle.key for w in covered}
        held = self._held
        return [
            w
            for w in live(self.target_slot)
            if w.handle.key not in keys and held.get(w.handle.key, 0) < version
        ]

    def delivered_before(self, version: int) -> bool:
        return all(p.done.is_set() for v, p in self.pending.items() if v < version)

    def targets_now(self) -> list[WorkerInfo]:
        return live(self.target_slot)

    async def push_now(self) -> Pending:
        return await self._push()

    def forget(self) -> None:
        """The channel closed: nothing is on its way, nothing is kept (the states are freed)."""
        self.pending.clear()
        self._last = None

    async def start_after_held(self) -> None:
        """Number this channel's versions after the latest that a live rank of the target holds
        (an earlier channel to it delivered them): a rank installs only versions newer than the
        one it holds, so a channel numbering from 1 again would have every push skipped. A rank
        that died meanwhile holds nothing when it comes back.

        Raises:
            ChannelError: a target rank could not say which version it holds.
        """
        group = self.target_slot.group
        workers = live(self.target_slot)
        caller = caller_of(self.target_slot)
        held: dict[str, int] = {}
        errors: list[BaseException] = []

        async def one(worker: WorkerInfo) -> None:
            try:
                outcome = await proxy(caller, worker).execute(weights_version, self.name)
            except AsyncExecError as error:
                if not died(error):
                    errors.append(error)
                return
            if outcome.kind != "ok":
                why = "stopped" if outcome.error is None else describe(outcome.error)
                failed = ChannelError(f"rank {worker.rank}: {why}")
                failed.__cause__ = outcome.error
                errors.append(failed)
            else:
                held[worker.handle.key] = outcome.value or 0

        what = "reading the versions the target's ranks hold"
        try:
            with anyio.fail_after(self.timeout_s):
                async with task_group() as tg:
                    for worker in workers:
                        tg.start_soon(one, worker)
        except TimeoutError as exc:
            raise channel_error(what, exc, self.timeout_s) from exc
        if errors:
            raise channel_error(what, errors[0], 0) from errors[0]
        if held:
            # What each rank holds, as if this channel had delivered it: the version lag, the
            # ranks behind a push and those that join are counted from it.
            self._held_by(group).update(held)
            self.version, self.delivered = max(held.values()), min(held.values())
            if self.version:
                self.log.info("versions_continue", after=self.version)

    async def push(self) -> int:
        """See ``WeightChannel.push``."""
        pending = await self._push(here=self.max_staleness == 1)
        if pending.here:
            await self._deliver(pending, None, here=True)
        wait_for = self.pending.get(pending.version - (self.max_staleness - 1))
        if wait_for is not None:
            if not wait_for.done.is_set():
                await wait_for.done.wait()
            if wait_for.error is not None:
                raise wait_for.error
        return pending.version

    async def push_read(self) -> Pending:
        """``push``'s first half: read the next version and start its delivery (in the
        channel's task group, after the versions before it); returns once the source's state
        is read, so that the source may change its weights from then on. :func:`delivered`
        waits for the rest and raises what failed."""
        pending = await self._push()
        if pending.read:  # the installs went out with the read: wait for the read's own end
            await settle(pending.read, self.timeout_s)  # (its outcome is the delivery's)
        return pending

    async def _push(self, here: bool = False) -> Pending:
        """Read the next version and start its delivery: in the channel's task group, or, when
        ``here`` allows it and no earlier version is on its way, by the caller at once
        (``pending.here``: a push that waits for its delivery anyway spares a task and the
        turn of the loop its end takes; see ``_deliver``)."""
        tg = self._open_tg()
        async with self._read_lock:
            version = self.version + 1
            pending = Pending(version, anyio.Event(), started=time.perf_counter())
            try:
                with anyio.fail_after(self.timeout_s):
                    await self._read(pending)
            except anyio.get_cancelled_exc_class():
                raise  # the caller was cancelled: not the channel's failure
            except Exception as exc:
                self.counts["failed_pushes"] += 1
                self.observer.emit(PushFailed(version, describe(exc)))
                raise channel_error(f"reading version {version}", exc, self.timeout_s) from exc
            # At once (no wait in between): the version is the latest, and its targets are the
            # target's workers now (unless the transport fixed them before the read). A group
            # that joined during the read got the previous version and is among them; one that
            # joins from now on gets this one (see ``join``). A read left to its installs to
            # tell (``pending.read``) is still going: ranks that join meanwhile get the version
            # before, and its delivery then gives them this one (``behind``).
            self.version = version
            self.counts["pushes"] += 1
            previous = self.pending.get(version - 1)
            self.pending[version] = pending
            if pending.read is None:  # else once its installs say it ended well
                self._last = pending
            if pending.targets is None:
                pending.targets = live(self.target_slot)
            # Of the group the push goes to: a run that starts on it later is no join.
            held = self._held_by(self.target_slot.group)
            self.observer.emit(
                VersionRead(
                    version, tuple((w.rank, held.get(w.handle.key, 0)) for w in pending.targets)
                )
            )
            if here and (previous is None or previous.done.is_set()):
                pending.here = True
            else:
                tg.start_soon(self._deliver, pending, previous)
        return pending

    async def _read(self, pending: Pending) -> None:
        sources = live(self.source_slot)
        if not sources:
            raise ChannelError(
                f"the source executor {self.source_slot.config.name!r} has no live workers "
                "(it is starting, restarting or closed)"
            )
        pending.sources = sources if self.sharded else sources[:1]
        if self._transport().targets_before_read:
            pending.targets = live(self.target_slot)
        read = self._transport().read(pending)
        tl, name = self.source_slot.timeline, f"read v{pending.version}"
        await timed(tl, DRIVER, name, "push", read, span="asyncexec.push.read")

    async def _deliver(
        self, pending: Pending, previous: Pending | None, here: bool = False
    ) -> None:
        """Deliver ``pending`` after ``previous``; its outcome in ``pending`` (``done``,
        ``error``). ``here``: by the push that read it, whose cancellation does not cancel the
        delivery: the channel's task group takes it over (installs sent again to a rank that
        holds the version already are skipped there)."""
        handed_over = False
        try:
            if previous is not None and not previous.done.is_set():
                await previous.done.wait()  # versions arrive in order
            with anyio.fail_after(self.timeout_s):
                delivered = self._transport().deliver(pending, pending.targets or [])
                await timed_delivery(self.target_slot.timeline, pending.version, delivered)
            self.delivered = max(self.delivered, pending.version)
            self.last_push_s = time.perf_counter() - pending.started
            self.observer.emit(PushEnded(pending.version, self.last_push_s))
        except BaseException as exc:
            cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
            if cancelled and here and self.tg is not None:
                handed_over = True
                self.tg.start_soon(self._deliver, pending, None)
                raise
            if cancelled and not self._is_open():
                # Not delivered: a push or a pipeline that waits for it must not take it as
                # installed.
                pending.error = ChannelError(
                    f"the channel closed before version {pending.version} was delivered"
                )
                raise
            self.counts["failed_pushes"] += 1
            self._transport().broken()
            bound = self.timeout_s if isinstance(exc, TimeoutError) else 0
            pending.error = channel_error(f"delivering version {pending.version}", exc, bound)
            self.observer.emit(PushFailed(pending.version, describe(exc)))
        finally:
            if not handed_over:
                self._delivered(pending)

    def _delivered(self, pending: Pending) -> None:
        """``pending``'s delivery ended (its outcome set): the versions after it go on."""
        pending.done.set()
        for v in [v for v in self.pending if v < pending.version - self.max_staleness]:
            del self.pending[v]
        # The entries kept for the pushes that wait on them need no state: a delivered
        # version's references (its state in the object store) go, but the latest's, which
        # serves the ranks that join.
        for kept in self.pending.values():
            if kept.done.is_set() and kept is not self._last:
                kept.refs = None

    # Joins ------------------------------------------------------------------------------------

    async def join(self, group: WorkerGroup) -> None:
        """Called by the target executor before its functions start on ``group``: every rank
        that does not hold the latest version gets it first."""
        if self.version == 0 or not self._is_open():
            return
        held = self._held_by(group)
        joiners = [w for w in group.workers if held.get(w.handle.key, 0) < self.version]
        if not joiners:
            return
        self.observer.emit(RanksJoined(tuple(w.rank for w in joiners), self.version))
        try:
            with anyio.fail_after(self.timeout_s):
                await self._transport().join(joiners)
        except ChannelError:
            raise
        except Exception as exc:
            raise channel_error(
                "giving joining ranks the latest version", exc, self.timeout_s
            ) from exc
        self.counts["joins"] += len(joiners)  # (those that got it: a join that failed is none)

    def _open_tg(self) -> anyio.abc.TaskGroup:
        if self.tg is None:
            raise ChannelError("the channel is closed")
        return self.tg

    def _is_open(self) -> bool:
        return self.tg is not None

    def _transport(self) -> Transport:
        assert self.moves is not None
        return self.moves
