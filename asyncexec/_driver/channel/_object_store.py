"""The object-store transport: the source rank returns its state from a call whose result the
driver owns but never fetches: it stays in the source node's object store, and each target rank
fetches it by reference (put once, never copied through the driver). The channel keeps the latest
version's reference, so a rank that joins later gets it even after the source died."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._errors import AsyncExecError
from ..cluster import Call, proxy, result_of, settled
from ..group import WorkerInfo
from ._transport import Core, Pending, caller_of, channel_error, died, gather, settle

__all__ = ["ObjectStoreTransport"]


class ObjectStoreTransport:
    """Moves any picklable state (a mapping when sharded) by reference."""

    targets_before_read = False

    def __init__(self, core: Core) -> None:
        self.core = core

    async def read(self, pending: Pending) -> None:
        core, sources = self.core, pending.sources or []
        caller = caller_of(core.source_slot)
        calls = [
            proxy(caller, w).channel_read_parts(core.name, core.timeout_s, core.sharded)
            for w in sources
        ]
        refs = [c[1] for c in calls]
        types = [result_of(caller, w, c[0]) for w, c in zip(sources, calls, strict=True)]
        # The installs are sent now, with the states' references, as a hand-written push
        # sends them: Ray starts each once the read is done, with no turn of the driver in
        # between (awaiting the read first puts a round trip of the driver on the push's
        # path). Not while an earlier version is on its way: versions arrive in order. A
        # target that joins meanwhile gets its call at delivery.
        if core.delivered_before(pending.version):
            target = caller_of(core.target_slot)
            pending.early = {
                w.handle.key: proxy(target, w).channel_receive(core.name, pending.version, *refs)
                for w in core.targets_now()
            }
        pending.refs = refs
        if pending.early:
            # An install runs only once the read's state is there, and fails with the read's
            # error when it failed: the installs tell the read's outcome, and its own result
            # (the states' types) is looked at only when one of them fails (see ``_install``).
            # Awaited here, it would wake the driver just as the installs start, on the cores
            # they run on (docs/benchmarks.md, the small push).
            pending.read = types
            return
        try:
            await gather(types, core.source_slot)
        except BaseException:
            self._settle_failed(pending, types)
            raise

    async def _read_failed(self, pending: Pending) -> BaseException | None:
        """The error of ``pending``'s read, once it ended (None: it did not fail); its calls
        settled."""
        types = pending.read or []
        try:
            await gather(types, self.core.source_slot)
        except Exception as exc:
            self._settle_failed(pending, types)
            return exc
        return None

    def _settle_failed(self, pending: Pending, types: Sequence[Call[Any]]) -> None:
        """A read failed: a state's reference holds the error too (and so do the installs sent
        with it); left unawaited, Ray logs it as an "Unhandled error" (with the worker's
        traceback, at ERROR) when the reference goes. Awaited (in the channel's group), it
        does not."""
        caller = caller_of(self.core.source_slot)
        sources = pending.sources or []
        states = [result_of(caller, w, r) for w, r in zip(sources, pending.refs or [], strict=True)]
        early, pending.early = pending.early or {}, None
        self._settle([*states, *(c for c in early.values() if c is not None)])

    def _settle(self, calls: Sequence[Call[Any]]) -> None:
        tg = self.core.tg
        if calls and tg is not None:
            tg.start_soon(settle, calls, self.core.timeout_s)

    async def deliver(self, pending: Pending, targets: Sequence[WorkerInfo]) -> None:
        """Every live target rank fetches and installs the shards; one that died is skipped."""
        early, pending.early = pending.early or {}, None
        unread = pending.read is not None
        await self._install(pending, targets, early)
        if unread:  # ranks that joined while the state was read got the version before
            behind = self.core.behind(pending.version, targets)
            if behind:
                await self._install(pending, behind, {})

    async def _install(
        self, pending: Pending, targets: Sequence[WorkerInfo], early: dict[str, Call[Any] | None]
    ) -> None:
        """Install ``pending`` on ``targets`` (with the calls sent ``early``, where there is
        one for a target)."""
        core = self.core
        caller = caller_of(core.target_slot)
        calls = [
            early.pop(w.handle.key, None)
            or proxy(caller, w).channel_receive(core.name, pending.version, *(pending.refs or []))
            for w in targets
        ]
        self._settle([c for c in early.values() if c is not None])  # to ranks that left
        failed: list[tuple[int, AsyncExecError]] = []

        def one(i: int, _: object, error: AsyncExecError | None) -> None:
            if error is None:
                core.installed(targets[i], pending.version)
            else:
                failed.append((i, error))

        await settled(calls, one)
        if pending.read is not None:  # the installs tell the read's outcome
            if failed:  # with the read's error when it failed (a dead source's too)
                read_error = await self._read_failed(pending)
                if read_error is not None:
                    raise channel_error(f"reading version {pending.version}", read_error, 0)
            pending.read = None
            core.read_done(pending)
        errors = []
        for i, error in failed:
            if died(error):
                core.log.info("push_skipped_dead_rank", rank=targets[i].rank)
            else:
                errors.append(error)
        if errors:
            raise errors[0]

    async def join(self, joiners: Sequence[WorkerInfo]) -> None:
        latest = self.core.latest()
        if latest is not None:
            await self._install(latest, joiners, {})

    def broken(self) -> None:
        return None
