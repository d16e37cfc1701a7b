"""The torch transport: a torch.distributed process group per source rank spans that rank and
every target rank (gloo for CPU tensors, nccl for CUDA), built when first needed and rebuilt when
either executor's workers change (a restart); the state is broadcast tensor by tensor. A rank that
joins the target gets the source's current state as a new version (the groups are rebuilt for
it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from ..._worker import release_stores
from ..cluster import proxy
from ..group import WorkerInfo
from ._transport import Core, Pending, caller_of, gather, settle

__all__ = ["TorchTransport"]

#: How long a set-up that failed waits for its sources to close the store servers it reserved.
_RELEASE_S = 5.0


class TorchTransport:
    """Moves a flat mapping of name to tensor over torch.distributed."""

    targets_before_read = True

    def __init__(
        self, core: Core, channel_id: str, backend: str | None, reuse_buffers: bool
    ) -> None:
        self.core = core
        self.channel_id = channel_id
        self.backend = backend
        self.reuse_buffers = reuse_buffers
        #: The built groups: (the members' keys, (group id, source) per source, backend).
        self._groups: tuple[tuple[str, ...], list[tuple[str, WorkerInfo]], str] | None = None
        self._generation = 0

    async def read(self, pending: Pending) -> None:
        core, sources = self.core, pending.sources or []
        groups = await self._built(sources, pending.targets or [])
        caller = caller_of(core.source_slot)
        metas = await gather(
            [
                proxy(caller, w).channel_snapshot(core.name, pending.version, core.timeout_s)
                for w in sources
            ],
            core.source_slot,
        )
        pending.parts = [(gid, meta) for (gid, _), meta in zip(groups, metas, strict=True)]

    async def deliver(self, pending: Pending, targets: Sequence[WorkerInfo]) -> None:
        core = self.core
        sources, parts = pending.sources or [], pending.parts or []
        device = "cuda" if self._groups is not None and self._groups[2] == "nccl" else "cpu"
        source, target = caller_of(core.source_slot), caller_of(core.target_slot)
        calls = [
            proxy(source, w).channel_send(core.name, pending.version, gid)
            for w, (gid, _) in zip(sources, parts, strict=True)
        ]
        calls += [
            proxy(target, w).channel_receive_torch(
                core.name,
                pending.version,
                parts,
                device,
                self.reuse_buffers,
            )
            for w in targets
        ]
        await gather(calls, core.target_slot)
        for w in targets:
            core.installed(w, pending.version)

    async def join(self, joiners: Sequence[WorkerInfo]) -> None:
        # The workers changed, so the groups are rebuilt; the source's current state goes to
        # every target rank as a new version.
        pending = await self.core.push_now()
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error

    def broken(self) -> None:
        self._groups = None  # a broken collective: rebuilt at the next push

    async def _built(
        self, sources: list[WorkerInfo], targets: list[WorkerInfo]
    ) -> list[tuple[str, WorkerInfo]]:
        """The process groups (one per source rank, with every target rank), built anew when
        the workers changed."""
        core = self.core
        key = tuple(w.handle.key for w in [*sources, *targets])
        if self._groups is not None and self._groups[0] == key:
            return self._groups[1]
        self._groups = None
        backend = self.backend
        source, target = caller_of(core.source_slot), caller_of(core.target_slot)
        if backend is None:
            calls = [proxy(source, sources[0]).channel_cuda()]
            cuda = await gather(calls, core.source_slot)
            backend = "nccl" if cuda[0] else "gloo"
        self._generation += 1
        # Every source's store server first, then the joins: a port call that fails leaves the
        # servers reserved before it unjoined (a group joined on their ports would form, and
        # hold them, after the set-up failed), and they are closed before the error goes on.
        reserved: list[tuple[str, WorkerInfo, str, int]] = []
        try:
            for k, src in enumerate(sources):
                gid = f"{self.channel_id}.{self._generation}/{k}"
                port_call = proxy(source, src).channel_port(core.name, gid, core.timeout_s)
                ((address, port),) = await gather([port_call], core.source_slot)
                reserved.append((gid, src, address, port))
        except BaseException:
            await self._release(reserved)
            raise
        groups: list[tuple[str, WorkerInfo]] = []
        joins: list[Any] = []
        for gid, src, address, port in reserved:
            size = 1 + len(targets)
            for rank, w in enumerate([src, *targets]):
                joins.append(
                    proxy(source if rank == 0 else target, w).channel_join(
                        core.name,
                        gid,
                        address,
                        port,
                        rank,
                        size,
                        backend,
                        core.timeout_s,
                    )
                )
            groups.append((gid, src))
        await gather(joins, core.target_slot)
        self._groups = (key, groups, backend)
        core.counts["rebuilds"] += 1
        core.log.info("channel_group_built", generation=self._generation, backend=backend)
        return groups

    async def _release(self, reserved: list[tuple[str, WorkerInfo, str, int]]) -> None:
        """Close the store servers ``reserved`` on the sources for a set-up that failed before
        any was joined (each listens, with its thread, until closed); best effort: a source
        that is gone holds none."""
        caller = caller_of(self.core.source_slot)
        calls = [
            proxy(caller, w).execute(release_stores, self.core.name, [gid])
            for gid, w, _, _ in reserved
        ]
        # bounded by _RELEASE_S: a source that does not answer keeps its server until the
        # next set-up's port call on it, or the channel's close
        with anyio.CancelScope(shield=True):
            await settle(calls, _RELEASE_S)
