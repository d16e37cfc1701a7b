"""WeightChannel: moves a state (weights) from one executor's workers to every worker of another,
with a version per push, while both executors' functions run.

How a state travels is a transport's (``_object_store``, ``_torch``, behind the protocol of
``_transport``); this module holds what every transport shares: the versions, the deliveries in
order, the ranks that join, the counters.

Versions: ``push()`` numbers the states 1, 2, 3, ...; a target rank installs a version with the
``install`` function its run's function registered (``receive_weights``), in a thread, while the
function keeps running, and tags its later reports with it. ``max_staleness`` K bounds how far
behind a target rank may be: ``push()`` of version v returns once v - (K - 1) is installed on
every rank (K = 1: v itself), so the next state can be computed while earlier ones travel. A rank
that joins after a restart (a fresh group, a spare, a replaced rank) gets the latest version
before its function starts.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from ..._config import check_count
from ..._errors import ChannelError, ConfigurationError, ExecutorStateError, describe
from .._executor import Executor, slot_of
from .._logging import get_logger
from ..group import GroupSlot, WorkerGroup, WorkerInfo
from ._object_store import ObjectStoreTransport
from ._torch import TorchTransport
from ._transport import Pending, Transport, channel_error

if TYPE_CHECKING:
    from ..run import Step

__all__ = ["ChannelStatistics", "WeightChannel"]

#: How long closing a channel waits for the workers to drop its groups and buffers.
_CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ChannelStatistics:
    """Counters of a channel, from :meth:`WeightChannel.statistics`."""

    version: int  # the latest version pushed (0 before the first)
    delivered: int  # the latest version installed on every target rank
    pushes: int
    failed_pushes: int
    joins: int  # target ranks that joined after a restart and got the latest version
    rebuilds: int  # torch process groups built (once, then after each change of workers)
    last_push_s: float  # the last delivery's duration, from the read to the last install


class WeightChannel:
    """Moves a state from ``source``'s workers to every worker of ``target``.

    ::

        channel = asyncexec.WeightChannel(learner, rollout, transport="torch")
        async with channel:
            ...                               # both executors' run()s going on
            version = await channel.push()    # rank 0's state to every rollout rank

    In the workers, the source's function calls ``asyncexec.serve_weights(read)`` and the
    target's ``asyncexec.receive_weights(install)``. Each report of a target rank carries the
    version it held (``Report.version``, ``Step.versions``).

    Args:
        source: the executor whose rank 0 (every rank, with ``sharded``) has the state.
        target: the executor whose every rank receives it. One open channel per target.
        name: the channel's name, as the workers' ``serve_weights`` / ``receive_weights`` use it.
        transport: ``"object_store"`` (any picklable state; a mapping when ``sharded``) or
            ``"torch"`` (a flat mapping of name to tensor, broadcast over torch.distributed).
        sharded: every source rank has a part of the state (disjoint keys); a target installs
            their union.
        max_staleness: K: a push returns once the version K - 1 before it is installed
            everywhere (1: once it is).
        torch_backend: ``"gloo"`` or ``"nccl"`` for the torch transport; by default nccl when
            the source's workers have CUDA, else gloo.
        reuse_buffers: torch transport: receive into two buffers per tensor, used in turn,
            so the tensors given to ``install`` are written again two versions later (copy what
            you keep: ``load_state_dict`` does). Fresh memory for every version costs more than
            the broadcast itself (page faults: 0.55 s against 0.23 s for 256 MB here). False:
            new tensors for every version.
        timeout_s: bound on reading a state (waiting for ``serve_weights`` included), on
            building a process group and on one delivery.
    """

    def __init__(
        self,
        source: Executor,
        target: Executor,
        *,
        name: str = "weights",
        transport: Literal["object_store", "torch"] = "object_store",
        sharded: bool = False,
        max_staleness: int = 1,
        torch_backend: Literal["gloo", "nccl"] | None = None,
        reuse_buffers: bool = True,
        timeout_s: float = 120.0,
    ) -> None:
        _check(source, target, name, transport, torch_backend, max_staleness, timeout_s)
        self.source = source
        self.target = target
        self.name = name
        self.transport = transport
        self.sharded = sharded
        self.max_staleness = max_staleness
        self.timeout_s = float(timeout_s)
        self.id = os.urandom(4).hex()
        self.log = get_logger(channel=f"{name}-{self.id}")
        self.counts = {"pushes": 0, "failed_pushes": 0, "joins": 0, "rebuilds": 0}
        self._moves: Transport = (
            ObjectStoreTransport(self)
            if transport == "object_store"
            else TorchTransport(self, self.id, torch_backend, bool(reuse_buffers))
        )
        self._version = 0
        self._delivered = 0
        self._pending: dict[int, Pending] = {}
        self._last: Pending | None = None  # the latest version read (its refs serve joins)
        self._held: dict[str, int] = {}  # target worker -> version installed
        #: The target group the held versions are of: a new group (a restart, a lease of
        #: pooled workers whose channel state was reset) starts from nothing held.
        self._held_group: WorkerGroup | None = None
        self._read_lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self._open = False
        self._closed = False
        self._last_push_s = 0.0

    def __repr__(self) -> str:
        return f"<WeightChannel {self.name} {self.transport} version={self._version}>"

    @property
    def version(self) -> int:
        """The latest version pushed (0 before the first push)."""
        return self._version

    def statistics(self) -> ChannelStatistics:
        """A snapshot of the channel's counters: versions pushed and delivered, pushes, failed
        pushes, joins, process-group rebuilds and the last delivery's duration."""
        return ChannelStatistics(
            version=self._version,
            delivered=self._delivered,
            last_push_s=round(self._last_push_s, 4),
            **self.counts,
        )

    def lag(self, step: Step) -> int | None:
        """How many versions the oldest report of ``step`` is behind the latest push (None when
        no rank of it held a version)."""
        versions = [v for v in step.versions if v is not None]
        return self._version - min(versions) if versions else None

    # What the transports use (see ``_transport.Core``) ---------------------------------------

    @property
    def source_slot(self) -> GroupSlot:
        return slot_of(self.source)

    @property
    def target_slot(self) -> GroupSlot:
        return slot_of(self.target)

    def installed(self, worker: WorkerInfo, version: int) -> None:
        key = worker.handle.key
        self._held[key] = max(version, self._held.get(key, 0))

    def latest(self) -> Pending | None:
        return self._last

    async def push_now(self) -> Pending:
        return await self._push()

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> WeightChannel:
        if self._open or self._closed:
            raise ExecutorStateError("a WeightChannel is entered once")
        joiners = self.target_slot.joiners
        if joiners:
            raise ConfigurationError(
                f"the executor {self.target.config.name!r} already receives from an open "
                "channel: a rank's reports carry the version of one channel"
            )
        joiners.append(self._join)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._open = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        self._closed = True
        joiners = self.target_slot.joiners
        if self._join in joiners:
            joiners.remove(self._join)
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()  # deliveries still on their way
            await tg.__aexit__(None, None, None)
        self._pending.clear()
        self._last = None  # the references go: the states are freed
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT_S):
            await self._forget()

    async def _forget(self) -> None:
        """Tell the live workers of both sides to drop the channel's process groups and
        buffers (best effort: a worker that is gone has nothing to drop)."""
        workers = self._live(self.source_slot) + self._live(self.target_slot)

        async def one(worker: WorkerInfo) -> None:
            with contextlib.suppress(Exception):
                await worker.handle.call("channel_close", self.name)

        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(one, worker)

    def _check_open(self) -> anyio.abc.TaskGroup:
        if not self._open or self._tg is None:
            raise ExecutorStateError(
                "the channel is not open: use `async with WeightChannel(...)`"
                if not self._closed
                else "the channel is closed"
            )
        return self._tg

    # Pushes -----------------------------------------------------------------------------------

    async def push(self) -> int:
        """Read the source's state and deliver it to every target rank as the next version;
        return that version. Returns once the version ``max_staleness - 1`` before it is
        installed on every target rank.

        Raises:
            ChannelError: the state could not be read (the source has no live workers, a
                source rank died or raised, no ``serve_weights`` within ``timeout_s``) or
                delivered (a target's ``install`` raised; with the torch transport, a rank died
                during the broadcast). A target rank that died is skipped: it gets the latest
                version when it joins again.
            ExecutorStateError: the channel is not open.
        """
        pending = await self._push()
        wait_for = self._pending.get(pending.version - (self.max_staleness - 1))
        if wait_for is not None:
            await wait_for.done.wait()
            if wait_for.error is not None:
                raise wait_for.error
        return pending.version

    async def _push(self) -> Pending:
        tg = self._check_open()
        async with self._read_lock:
            version = self._version + 1
            pending = Pending(version, anyio.Event(), started=time.perf_counter())
            try:
                with anyio.fail_after(self.timeout_s):
                    await self._read(pending)
            except anyio.get_cancelled_exc_class():
                raise  # the caller was cancelled: not the channel's failure
            except Exception as exc:
                self.counts["failed_pushes"] += 1
                raise channel_error(f"reading version {version}", exc, self.timeout_s) from exc
            # At once (no wait in between): the version is the latest, and its targets are the
            # target's workers now (unless the transport fixed them before the read). A group
            # that joined during the read got the previous version and is among them; one that
            # joins from now on gets this one (see ``_join``).
            self._version = version
            self.counts["pushes"] += 1
            previous = self._pending.get(version - 1)
            self._pending[version] = pending
            self._last = pending
            if pending.targets is None:
                pending.targets = self._live(self.target_slot)
            tg.start_soon(self._deliver, pending, previous)
        return pending

    async def _read(self, pending: Pending) -> None:
        sources = self._live(self.source_slot)
        if not sources:
            raise ChannelError(
                f"the source executor {self.source.config.name!r} has no live workers "
                "(it is starting, restarting or closed)"
            )
        pending.sources = sources if self.sharded else sources[:1]
        if self._moves.targets_before_read:
            pending.targets = self._live(self.target_slot)
        await self._moves.read(pending)

    async def _deliver(self, pending: Pending, previous: Pending | None) -> None:
        try:
            if previous is not None:
                await previous.done.wait()  # versions arrive in order
            with anyio.fail_after(self.timeout_s):
                await self._moves.deliver(pending, pending.targets or [])
            self._delivered = max(self._delivered, pending.version)
            self._last_push_s = time.perf_counter() - pending.started
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()) and not self._open:
                raise
            self.counts["failed_pushes"] += 1
            self._moves.broken()
            pending.error = channel_error(f"delivering version {pending.version}", exc, 0)
            self.log.warning("push_failed", version=pending.version, error=describe(exc))
        finally:
            pending.done.set()
            for v in [v for v in self._pending if v < pending.version - self.max_staleness]:
                del self._pending[v]

    # Joins ------------------------------------------------------------------------------------

    async def _join(self, group: WorkerGroup) -> None:
        """Called by the target executor before its functions start on ``group``: every rank
        that does not hold the latest version gets it first."""
        if self._version == 0 or not self._open:
            return
        if group is not self._held_group:
            self._held_group = group
            self._held = {}
        joiners = [w for w in group.workers if self._held.get(w.handle.key, 0) < self._version]
        if not joiners:
            return
        self.counts["joins"] += len(joiners)
        self.log.info("ranks_join", ranks=[w.rank for w in joiners], version=self._version)
        try:
            with anyio.fail_after(self.timeout_s):
                await self._moves.join(joiners)
        except ChannelError:
            raise
        except Exception as exc:
            raise channel_error(
                "giving joining ranks the latest version", exc, self.timeout_s
            ) from exc

    @staticmethod
    def _live(slot: GroupSlot) -> list[WorkerInfo]:
        group = slot.group
        return [] if group is None or group.closed else list(group.workers)


def _check(
    source: Any,
    target: Any,
    name: Any,
    transport: Any,
    torch_backend: Any,
    max_staleness: Any,
    timeout_s: Any,
) -> None:
    """Refuse a channel's arguments before anything is made.

    Raises:
        ConfigurationError: naming the argument.
    """
    if not isinstance(source, Executor) or not isinstance(target, Executor):
        raise ConfigurationError("a WeightChannel connects two asyncexec.Executors")
    if source is target:
        raise ConfigurationError("a WeightChannel's source and target must differ")
    if source.config.local or target.config.local:
        raise ConfigurationError(
            "a WeightChannel does not connect local executors: its transports need Ray's "
            "object store or a process group per worker process"
        )
    if transport not in ("object_store", "torch"):
        raise ConfigurationError(f'transport must be "object_store" or "torch", got {transport!r}')
    if torch_backend not in (None, "gloo", "nccl"):
        raise ConfigurationError(f'torch_backend must be "gloo" or "nccl", got {torch_backend!r}')
    check_count("max_staleness", max_staleness)
    if not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ConfigurationError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"name must be a non-empty string, got {name!r}")
