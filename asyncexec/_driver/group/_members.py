"""One live worker as its group knows it, and a started worker kept beside a group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._wire._protocol import WorkerContext, WorkerMetadata
from ..cluster import Handle

__all__ = ["Standby", "WorkerInfo"]


@dataclass(frozen=True)
class WorkerInfo:
    """One live worker: its handle, what it said about itself, and its place in the group."""

    handle: Handle
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

    handle: Handle
    metadata: WorkerMetadata
    bundle: int | None
    death: Any = None
