"""WeightChannel: moves a state (weights) from one executor's workers to every worker of another,
with a version per push, while both executors' functions run.

How a state travels is a transport's (``_object_store``, ``_torch``, behind the protocol of
``_transport``); this module holds what every transport shares: the versions, the deliveries in
order, the ranks that join, the counters.

Versions: ``push()`` numbers the states 1, 2, 3, ... (after the latest version a target rank
holds, when an earlier channel to the target delivered some); a target rank installs a version
with the ``install`` function its run's function registered (``receive_weights``), in a thread,
while the function keeps running, and tags its later reports with it. ``max_staleness`` K
bounds how far behind a target rank may be: ``push()`` of version v returns once v - (K - 1) is
installed on every rank (K = 1: v itself), so the next state can be computed while earlier ones
travel. A rank that joins after a restart (a fresh group, a spare, a replaced rank) gets the
latest version before its function starts.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from ..._errors import AsyncExecError, ConfigurationError, ExecutorStateError
from ..._logging import get_logger
from .._config import check_count
from .._executor import Executor, slot_of
from .._taskgroups import task_group, teardown
from ..cluster import Caller, agreed, proxy, rays_only
from ..group import WorkerInfo
from ._events import ChannelClosed
from ._object_store import ObjectStoreTransport
from ._sinks import channel_observer
from ._torch import TorchTransport
from ._transport import caller_of
from ._versions import Versions, delivered, live

if TYPE_CHECKING:
    from ..run import Step

__all__ = ["ChannelStatistics", "WeightChannel"]

#: How long closing a channel waits for the workers to drop its groups and buffers.
_CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ChannelStatistics:
    """Counters of a channel, from :meth:`WeightChannel.statistics`."""

    #: The latest version pushed (0 before the first; a channel opened on a target whose ranks
    #: hold versions of an earlier channel starts from the latest of them).
    version: int
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
        torch_backend: ``"gloo"`` or ``"nccl"`` for the torch transport (refused with the
            object store); by default nccl when the source's workers have CUDA, else gloo.
        reuse_buffers: torch transport: receive into two buffers per tensor, used in turn,
            so the tensors given to ``install`` are written again two versions later (copy what
            you keep: ``load_state_dict`` does). Fresh memory for every version costs more than
            the broadcast itself (its page faults). False: new tensors for every version
            (refused with the object store, which receives into no buffers).
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
        for flag, value in (("sharded", sharded), ("reuse_buffers", reuse_buffers)):
            if not isinstance(value, bool):
                raise ConfigurationError(f"{flag} must be a bool, got {value!r:.100}")
        _check_torch_only(transport, torch_backend, reuse_buffers)
        self.source = source
        self.target = target
        self.name = name
        self.transport = transport
        self.sharded = sharded
        self.max_staleness = max_staleness
        self.timeout_s = float(timeout_s)
        self.id = os.urandom(4).hex()
        self.log = get_logger(channel=f"{name}-{self.id}")
        self._versions = Versions(
            name,
            lambda: slot_of(source),
            lambda: slot_of(target),
            sharded,
            max_staleness,
            self.timeout_s,
            self.log,
            channel_observer(target.config.name, self.log, lambda: slot_of(target).timeline),
        )
        self._versions.moves = (
            ObjectStoreTransport(self._versions)
            if transport == "object_store"
            else TorchTransport(self._versions, self.id, torch_backend, reuse_buffers)
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None  # holds ``_tg`` open
        self._open = False
        self._closed = False

    def __repr__(self) -> str:
        return f"<WeightChannel {self.name} {self.transport} version={self.version}>"

    @property
    def version(self) -> int:
        """The latest version pushed (0 before the first push; after the latest version the
        target's ranks held when the channel was opened, when an earlier channel delivered
        some)."""
        return self._versions.version

    def statistics(self) -> ChannelStatistics:
        """A snapshot of the channel's counters: versions pushed and delivered, pushes, failed
        pushes, joins, process-group rebuilds and the last delivery's duration."""
        versions = self._versions
        return ChannelStatistics(
            version=versions.version,
            delivered=versions.delivered,
            last_push_s=round(versions.last_push_s, 4),
            **versions.counts,
        )

    def lag(self, step: Step) -> int | None:
        """How many versions the oldest report of ``step`` is behind the latest push (None when
        no rank of it held a version)."""
        versions = [v for v in step.versions if v is not None]
        return self.version - min(versions) if versions else None

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> WeightChannel:
        if self._open or self._closed:
            raise ExecutorStateError("a WeightChannel is entered once")
        joiners = slot_of(self.target).joiners
        if joiners:
            raise ConfigurationError(
                f"the executor {self.target.config.name!r} already receives from an open "
                "channel: a rank's reports carry the version of one channel"
            )
        await self._versions.start_after_held()
        joiners.append(self._versions.join)
        async with contextlib.AsyncExitStack() as stack:
            self._tg = await stack.enter_async_context(task_group())
            self._versions.tg = self._tg
            self._open = True
            self._stack = stack.pop_all()  # left in __aexit__, with the body's exception
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        self._closed = True
        joiners = slot_of(self.target).joiners
        if self._versions.join in joiners:
            joiners.remove(self._versions.join)
        tg, self._tg = self._tg, None
        stack, self._stack = self._stack, None
        self._versions.tg = None
        try:
            if tg is not None and stack is not None:
                tg.cancel_scope.cancel()  # deliveries still on their way
                await stack.__aexit__(exc_type, exc, tb)
        finally:
            self._versions.forget()
            self._versions.observer.emit(ChannelClosed(self._versions.version))
        with teardown("channel_forget", _CLOSE_TIMEOUT_S):
            await self._forget()

    async def _forget(self) -> None:
        """Tell the live workers of both sides to drop the channel's process groups and
        buffers (best effort: a worker that is gone has nothing to drop)."""
        sides = [slot_of(self.source), slot_of(self.target)]

        async def one(caller: Caller, worker: WorkerInfo) -> None:
            with contextlib.suppress(AsyncExecError):
                await proxy(caller, worker).channel_close(self.name)

        async with task_group() as tg:
            for slot in sides:
                for worker in live(slot):
                    tg.start_soon(one, caller_of(slot), worker)

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
        installed on every target rank. With the object store, the installs go out with the
        read (as a push by hand sends them), which numbers the version: a push cancelled
        after that, or whose read then fails, has used up its number.

        Raises:
            ChannelError: the state could not be read (the source has no live workers, a
                source rank died or raised, no ``serve_weights`` within ``timeout_s``) or
                delivered (a target's ``install`` raised; with the torch transport, a rank died
                during the broadcast). A target rank that died is skipped: it gets the latest
                version when it joins again.
            ExecutorStateError: the channel is not open.
        """
        self._check_open()
        return await self._versions.push()

    async def _push_read(self) -> tuple[int, Callable[[], Awaitable[None]]]:
        """:meth:`push` up to the read (for ``Pipeline.update_weights(wait=False)``): the
        version read, and a wait for its delivery that raises what failed."""
        self._check_open()
        pending = await self._versions.push_read()
        return pending.version, functools.partial(delivered, pending)


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
    cluster = agreed(  # before anything starts: the channel's two ends run on one cluster
        [
            (f"the channel's source {source.config.name!r}", source.cluster),
            (f"its target {target.config.name!r}", target.cluster),
        ]
    )
    rays_only(
        cluster,
        "a WeightChannel",
        "has no object store or process group to move states through (hand a Pipeline's "
        "states to Pipeline.update_weights(state) instead)",
    )
    if transport not in ("object_store", "torch"):
        raise ConfigurationError(f'transport must be "object_store" or "torch", got {transport!r}')
    if torch_backend not in (None, "gloo", "nccl"):
        raise ConfigurationError(f'torch_backend must be "gloo" or "nccl", got {torch_backend!r}')
    check_count("max_staleness", max_staleness)
    number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
    if not number or not 0 < timeout_s < math.inf:
        raise ConfigurationError(
            f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}"
        )
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"name must be a non-empty string, got {name!r}")


def _check_torch_only(transport: str, torch_backend: Any, reuse_buffers: bool) -> None:
    """Refuse the torch transport's options given to another: the channel would move the
    state otherwise than the caller thinks (through the object store, not over nccl)."""
    if transport == "torch":
        return
    for given, option in (
        (torch_backend is not None, f"torch_backend={torch_backend!r}"),
        (not reuse_buffers, "reuse_buffers=False"),
    ):
        if given:
            raise ConfigurationError(
                f'{option} applies to transport="torch" only; this channel\'s transport is '
                f"{transport!r}"
            )
