"""WeightChannel: moves a state (weights) from one executor's workers to every worker of another,
with a version per push, while both executors' functions run.

Two transports:

- ``"object_store"``: the source rank returns its state from a call whose result the driver owns
  but never fetches: it stays in the source node's object store, and the target ranks fetch it
  by reference (put once, never copied through the driver). The driver keeps the latest
  version's reference, so a rank that joins later gets it even after the source died.
- ``"torch"``: a torch.distributed process group per source rank spans that rank and every
  target rank (gloo for CPU tensors, nccl for CUDA), built when first needed and rebuilt when
  either executor's workers change (a restart); the state is broadcast tensor by tensor.

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
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from .._config import check_count
from .._errors import AsyncExecError, ChannelError, ConfigurationError, ExecutorStateError, describe
from ._boundary import call_error
from ._group import WorkerGroup
from ._logging import get_logger
from ._workers import WorkerInfo

if TYPE_CHECKING:
    from ._executor import Executor

__all__ = ["ChannelStatistics", "WeightChannel"]

Transport = Literal["object_store", "torch"]
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


@dataclass
class _Pending:
    """One version on its way: what was read, and whether it has been delivered."""

    version: int
    done: anyio.Event
    refs: list[Any] | None = None  # object store: the shards' references
    parts: list[tuple[str, Any]] | None = None  # torch: (group id, tensor list) per source
    targets: list[WorkerInfo] | None = None
    sources: list[WorkerInfo] | None = None
    error: BaseException | None = None
    started: float = 0.0


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
        transport: Transport = "object_store",
        sharded: bool = False,
        max_staleness: int = 1,
        torch_backend: Literal["gloo", "nccl"] | None = None,
        reuse_buffers: bool = True,
        timeout_s: float = 120.0,
    ) -> None:
        from ._executor import Executor

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
            raise ConfigurationError(
                f'transport must be "object_store" or "torch", got {transport!r}'
            )
        if torch_backend not in (None, "gloo", "nccl"):
            raise ConfigurationError(
                f'torch_backend must be "gloo" or "nccl", got {torch_backend!r}'
            )
        check_count("max_staleness", max_staleness)
        if not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ConfigurationError(f"timeout_s must be a positive number, got {timeout_s!r}")
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"name must be a non-empty string, got {name!r}")
        self.source = source
        self.target = target
        self.name = name
        self.transport = transport
        self.sharded = sharded
        self.max_staleness = max_staleness
        self.torch_backend = torch_backend
        self.reuse_buffers = bool(reuse_buffers)
        self.timeout_s = float(timeout_s)
        self.id = os.urandom(4).hex()
        self.log = get_logger(channel=f"{name}-{self.id}")
        self._version = 0
        self._delivered = 0
        self._pending: dict[int, _Pending] = {}
        self._last: _Pending | None = None  # the latest version read (its refs serve joins)
        self._held: dict[str, int] = {}  # target actor -> version installed
        #: The target group the held versions are of: a new group (a restart, a lease of
        #: pooled workers whose channel state was reset) starts from nothing held.
        self._held_group: WorkerGroup | None = None
        self._read_lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self._open = False
        self._closed = False
        self._groups: tuple[tuple[str, ...], list[tuple[str, WorkerInfo]], str] | None = None
        self._generation = 0
        self._counts = {"pushes": 0, "failed_pushes": 0, "joins": 0, "rebuilds": 0}
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
            **self._counts,
        )

    def lag(self, step: Any) -> int | None:
        """How many versions the oldest report of ``step`` is behind the latest push (None when
        no rank of it held a version)."""
        versions = [v for v in step.versions if v is not None]
        return self._version - min(versions) if versions else None

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> WeightChannel:
        if self._open or self._closed:
            raise ExecutorStateError("a WeightChannel is entered once")
        joiners = self.target._joiners
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
        if self._join in self.target._joiners:
            self.target._joiners.remove(self._join)
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()  # deliveries still on their way
            await tg.__aexit__(None, None, None)
        self._pending.clear()
        self._last = None  # the references go: Ray frees the states
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT_S):
            await self._forget()

    async def _forget(self) -> None:
        """Tell the live workers of both sides to drop the channel's process groups and
        buffers (best effort: a worker that is gone has nothing to drop)."""
        workers = [
            w
            for ex in (self.source, self.target)
            if ex._slot.group is not None and not ex._slot.group.closed
            for w in ex._slot.group.workers
        ]

        async def one(worker: WorkerInfo) -> None:
            with contextlib.suppress(Exception):
                await worker.actor.channel_close.remote(self.name)

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

    async def _push(self) -> _Pending:
        tg = self._check_open()
        async with self._read_lock:
            version = self._version + 1
            pending = _Pending(version, anyio.Event(), started=time.perf_counter())
            try:
                with anyio.fail_after(self.timeout_s):
                    await self._read(pending)
            except anyio.get_cancelled_exc_class():
                raise  # the caller was cancelled: not the channel's failure
            except Exception as exc:
                self._counts["failed_pushes"] += 1
                raise _channel_error(f"reading version {version}", exc, self.timeout_s) from exc
            # At once (no wait in between): the version is the latest, and its targets are the
            # target's workers now. A group that joined during the read got the previous version
            # and is among them; one that joins from now on gets this one (see ``_join``).
            self._version = version
            self._counts["pushes"] += 1
            previous = self._pending.get(version - 1)
            self._pending[version] = pending
            if self.transport == "object_store":
                self._last = pending
                pending.targets = self._live(self.target, "target", allow_none=True)
            tg.start_soon(self._deliver, pending, previous)
        return pending

    async def _read(self, pending: _Pending) -> None:
        sources = self._live(self.source, "source")
        if not self.sharded:
            sources = sources[:1]
        pending.sources = sources
        if self.transport == "object_store":
            calls = [
                w.actor.channel_read.options(num_returns=2).remote(
                    self.name, self.timeout_s, self.sharded
                )
                for w in sources
            ]
            # The first results (the states' types) are awaited; the states stay where they
            # are, referenced.
            await _gather([c[0] for c in calls], sources, self.source)
            pending.refs = [c[1] for c in calls]
            return
        # torch: the process groups span the targets, so they are fixed before the read.
        pending.targets = self._live(self.target, "target", allow_none=True)
        groups = await self._torch_groups(sources, pending.targets)
        metas = await _gather(
            [
                w.actor.channel_snapshot.remote(self.name, pending.version, self.timeout_s)
                for w in sources
            ],
            sources,
            self.source,
        )
        pending.parts = [(gid, meta) for (gid, _), meta in zip(groups, metas, strict=True)]

    async def _deliver(self, pending: _Pending, previous: _Pending | None) -> None:
        try:
            if previous is not None:
                await previous.done.wait()  # versions arrive in order
            with anyio.fail_after(self.timeout_s):
                if self.transport == "object_store":
                    await self._deliver_refs(pending, pending.targets or [])
                else:
                    await self._deliver_torch(pending)
            self._delivered = max(self._delivered, pending.version)
            self._last_push_s = time.perf_counter() - pending.started
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()) and not self._open:
                raise
            self._counts["failed_pushes"] += 1
            self._groups = None  # a broken collective: rebuilt at the next push
            pending.error = _channel_error(f"delivering version {pending.version}", exc, 0)
            self.log.warning("push_failed", version=pending.version, error=describe(exc))
        finally:
            pending.done.set()
            for v in [v for v in self._pending if v < pending.version - self.max_staleness]:
                del self._pending[v]

    async def _deliver_refs(self, pending: _Pending, targets: Sequence[WorkerInfo]) -> None:
        """Every live target rank fetches and installs the shards; one that died is skipped."""
        refs = [
            w.actor.channel_receive.remote(self.name, pending.version, pending.refs)
            for w in targets
        ]
        errors: list[AsyncExecError] = []

        async def one(i: int) -> None:
            try:
                await refs[i]
                self._held[_key(targets[i])] = max(
                    pending.version, self._held.get(_key(targets[i]), 0)
                )
            except Exception as exc:
                error = await call_error(exc, targets[i], targets[i].context.attempt or 0)
                if _died(error):
                    self.log.info("push_skipped_dead_rank", rank=targets[i].rank)
                else:
                    errors.append(error)

        async with anyio.create_task_group() as tg:
            for i in range(len(refs)):
                tg.start_soon(one, i)
        if errors:
            raise errors[0]

    async def _deliver_torch(self, pending: _Pending) -> None:
        sources, targets, parts = pending.sources or [], pending.targets or [], pending.parts or []
        device = "cuda" if self._groups is not None and self._groups[2] == "nccl" else "cpu"
        refs = [
            w.actor.channel_send.remote(self.name, pending.version, gid)
            for w, (gid, _) in zip(sources, parts, strict=True)
        ]
        refs += [
            w.actor.channel_receive_torch.remote(
                self.name, pending.version, parts, device, self.reuse_buffers
            )
            for w in targets
        ]
        await _gather(refs, [*sources, *targets], self.target)
        for w in targets:
            self._held[_key(w)] = max(pending.version, self._held.get(_key(w), 0))

    async def _torch_groups(
        self, sources: list[WorkerInfo], targets: list[WorkerInfo]
    ) -> list[tuple[str, WorkerInfo]]:
        """The process groups (one per source rank, with every target rank), built anew when
        the workers changed."""
        key = tuple(_key(w) for w in [*sources, *targets])
        if self._groups is not None and self._groups[0] == key:
            return self._groups[1]
        self._groups = None
        backend = self.torch_backend
        if backend is None:
            cuda = await _gather([sources[0].actor.channel_cuda.remote()], sources[:1], self.source)
            backend = "nccl" if cuda[0] else "gloo"
        self._generation += 1
        groups: list[tuple[str, WorkerInfo]] = []
        joins: list[Any] = []
        members: list[WorkerInfo] = []
        for k, src in enumerate(sources):
            gid = f"{self.id}.{self._generation}/{k}"
            ((address, port),) = await _gather(
                [src.actor.channel_port.remote(self.name, gid, self.timeout_s)], [src], self.source
            )
            size = 1 + len(targets)
            for rank, w in enumerate([src, *targets]):
                joins.append(
                    w.actor.channel_join.remote(
                        self.name, gid, address, port, rank, size, backend, self.timeout_s
                    )
                )
                members.append(w)
            groups.append((gid, src))
        await _gather(joins, members, self.target)
        self._groups = (key, groups, backend)
        self._counts["rebuilds"] += 1
        self.log.info("channel_group_built", generation=self._generation, backend=backend)
        return groups

    # Joins ------------------------------------------------------------------------------------

    async def _join(self, group: WorkerGroup) -> None:
        """Called by the target executor before its functions start on ``group``: every rank
        that does not hold the latest version gets it first."""
        if self._version == 0 or not self._open:
            return
        if group is not self._held_group:
            self._held_group = group
            self._held = {}
        joiners = [w for w in group.workers if self._held.get(_key(w), 0) < self._version]
        if not joiners:
            return
        self._counts["joins"] += len(joiners)
        self.log.info("ranks_join", ranks=[w.rank for w in joiners], version=self._version)
        try:
            with anyio.fail_after(self.timeout_s):
                if self.transport == "object_store" and self._last is not None:
                    await self._deliver_refs(self._last, joiners)
                    return
                # torch: the workers changed, so the groups are rebuilt; the source's current
                # state goes to every target rank as a new version.
                pending = await self._push()
                await pending.done.wait()
                if pending.error is not None:
                    raise pending.error
        except ChannelError:
            raise
        except Exception as exc:
            raise _channel_error(
                "giving joining ranks the latest version", exc, self.timeout_s
            ) from exc

    # Helpers ----------------------------------------------------------------------------------

    def _live(self, executor: Executor, side: str, *, allow_none: bool = False) -> list[WorkerInfo]:
        group = executor._slot.group
        if group is None or group.closed:
            if allow_none:
                return []
            raise ChannelError(
                f"the {side} executor {executor.config.name!r} has no live workers "
                "(it is starting, restarting or closed)"
            )
        return list(group.workers)


def _key(worker: WorkerInfo) -> str:
    return str(worker.actor._actor_id.hex())


def _died(error: AsyncExecError) -> bool:
    from .._errors import NodeLostError, WorkerCrashedError

    return isinstance(error, WorkerCrashedError | NodeLostError)


async def _gather(refs: list[Any], workers: list[WorkerInfo], executor: Any) -> list[Any]:
    """Await calls on workers; the first failure raised as asyncexec's error."""
    group = executor._slot.group
    if group is None:
        results: list[Any] = []
        for ref, w in zip(refs, workers, strict=True):
            try:
                results.append(await ref)
            except Exception as exc:
                raise await call_error(exc, w, w.context.attempt or 0) from exc
        return results
    values: list[Any] = await group.gather(refs, workers)
    return values


def _channel_error(what: str, exc: BaseException, timeout_s: float) -> ChannelError:
    if isinstance(exc, ChannelError):
        return exc
    if isinstance(exc, TimeoutError) and timeout_s:
        error = ChannelError(f"{what}: no answer within {timeout_s:g} s")
    else:
        error = ChannelError(f"{what}: {describe(exc)}")
    error.__cause__ = exc
    return error
