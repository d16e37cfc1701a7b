"""One live worker as the driver knows it, and the node table that tells a lost node from a
crashed process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import ray
from ray.actor import ActorHandle

from .._protocol import WorkerContext, WorkerMetadata

__all__ = ["Standby", "WorkerInfo", "node_alive"]

#: How long a look-up in Ray's node table may take before the node is taken to be alive.
NODE_LOOKUP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class WorkerInfo:
    """One live worker: its actor, what it said about itself, and its place in the group."""

    actor: ActorHandle
    metadata: WorkerMetadata
    context: WorkerContext
    bundle: int | None = None  # its bundle in its placement group (None: outside any)
    #: Its pending ``wait_closed`` call when it already has one (a pooled worker's lasts its
    #: life); None: the group makes one.
    death: Any = None

    @property
    def rank(self) -> int:
        return self.context.world_rank


@dataclass(frozen=True)
class Standby:
    """A started worker kept beside a group, to take the place of a rank that fails."""

    actor: ActorHandle
    metadata: WorkerMetadata
    bundle: int | None
    death: Any = None


async def node_alive(node_id: str | None) -> bool:
    """Whether Ray's node table holds ``node_id`` as alive (True when it cannot tell in time).

    The look-up is a blocking GCS call: it runs in a thread that is abandoned at the bound."""
    if node_id is None:
        return True

    def lookup() -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    with anyio.move_on_after(NODE_LOOKUP_TIMEOUT_S):
        return await anyio.to_thread.run_sync(lookup, abandon_on_cancel=True)
    return True
