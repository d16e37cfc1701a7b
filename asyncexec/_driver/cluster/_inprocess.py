"""What the seam's two clusters of this process share (see ``_base``): local mode's workers in
threads (``_local``) and the simulated workers (``_sim``). Nothing to start or join, no
placement, no resources, no node table to ask (every node is alive, none drained or preempted),
values "put" as they are, no graceful exit to wait for: a subclass says where its workers are
(:meth:`driver_node`, :meth:`bundle_nodes`, :meth:`live_nodes`, :meth:`stacks`), how it makes
them (:meth:`make_workers`) and how it ends them (:meth:`end`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import anyio

from ..._wire._protocol import WorkerMetadata
from .._config import ExecutorConfig
from ._base import Handle, Spawned, described, settle
from ._placement import Placement

__all__ = ["InProcessCluster"]


class InProcessCluster:
    """The seam's members that a cluster of workers in this process answers alike."""

    # Where the workers are (each subclass's own) ----------------------------------------------

    async def driver_node(self) -> str | None:
        raise NotImplementedError

    async def bundle_nodes(self, placement: Placement) -> list[str]:
        raise NotImplementedError

    async def live_nodes(self) -> set[str] | None:
        raise NotImplementedError

    async def stacks(self, workers: Sequence[tuple[int, Handle, WorkerMetadata]]) -> dict[int, str]:
        raise NotImplementedError

    def make_workers(self, config: ExecutorConfig, count: int) -> list[Spawned]:
        """Make ``count`` workers of ``config``, each asked to describe itself (in a thread)."""
        raise NotImplementedError

    def end(self, handles: Sequence[Handle]) -> None:
        """End the workers at once: their pending calls fail as a dead worker's do."""
        raise NotImplementedError

    # The same for both ------------------------------------------------------------------------

    async def connect(self, address: str | None) -> None:
        return None

    async def parent(self) -> Any:
        return None

    async def place(
        self, bundles: list[dict[str, float]], strategy: str, parent: Any, log: Any
    ) -> Placement | None:
        return None

    async def wait_placed(self, placement: Placement | None, timeout_s: float) -> None:
        return None

    async def release(self, placement: Placement | None) -> None:
        return None

    async def spawn(
        self, config: ExecutorConfig, placement: Placement | None, bundles: Sequence[int | None]
    ) -> list[Spawned]:
        # In a thread, as Ray's are made: what the driver's loop spends is the driver's own.
        # bounded: the workers are made in this process; nothing is awaited
        with anyio.CancelScope(shield=True):
            made = await anyio.to_thread.run_sync(self.make_workers, config, len(bundles))
        return made

    async def start_workers(
        self,
        config: ExecutorConfig,
        placement: Placement | None,
        bundles: Sequence[int | None],
        timeout_s: float,
        *,
        track: list[Handle] | None = None,
    ) -> list[tuple[Handle, WorkerMetadata]]:
        return await described(self, await self.spawn(config, placement, bundles), timeout_s, track)

    async def kill(
        self,
        handles: Sequence[Handle],
        placement: Placement | None = None,
        deaths: Sequence[Any] = (),
        timeout_s: float = 0.0,
        *,
        patience_s: float = 0.0,
    ) -> None:
        try:
            if patience_s > 0 and handles:  # (no process to end: each is closed, then ended)
                with anyio.move_on_after(patience_s):
                    await settle([h.call("close") for h in handles])
        finally:
            self.end(handles)
            if deaths:
                with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
                    await settle(deaths)

    async def node_alive(self, node_id: str | None) -> bool:
        return True

    async def available(self) -> dict[str, float] | None:
        return {}

    async def draining(self) -> dict[str, float | None] | None:
        return {}  # the driver's own process is never drained

    async def preempted(self, node_ids: Collection[str]) -> set[str]:
        return set()

    async def free_nodes(
        self, bundle: Mapping[str, float], placement: Placement | None, held: Mapping[str, int]
    ) -> list[dict[str, float]] | None:
        return None  # no resources: an elastic size is refused

    async def put(self, value: Any) -> Any:
        return value

    async def data_context(self) -> Any:
        return None
