"""Placement groups: create, await ready, remove."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ._errors import PlacementTimeoutError

__all__ = ["Placement", "create_placement", "wait_placement_ready"]


@dataclass
class Placement:
    """The placement group a worker group lives in.

    ``owned`` is False when the executor runs inside a parent placement group that captures child
    tasks (for example inside a Ray Tune trial): that group is used as it is and never removed.
    """

    group: PlacementGroup
    bundles: list[dict[str, float]]
    owned: bool
    removed: bool = False

    def strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy for worker ``index``: its own bundle, or any bundle of a parent."""
        return PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=index if self.owned else -1
        )

    def remove(self) -> None:
        """Remove the group if this executor made it. Idempotent."""
        if self.owned and not self.removed:
            self.removed = True
            remove_placement_group(self.group)


def create_placement(bundles: list[dict[str, float]], strategy: str, name: str) -> Placement:
    """Make the placement group (the request is sent; readiness is awaited separately)."""
    worker = ray._private.worker.global_worker
    parent = get_current_placement_group()
    if parent is not None and worker.should_capture_child_tasks_in_placement_group:
        return Placement(parent, bundles, owned=False)
    group = placement_group(bundles, strategy=strategy, name="")
    return Placement(group, bundles, owned=True)


async def wait_placement_ready(placement: Placement, timeout_s: float) -> None:
    """Await the group's readiness.

    Raises:
        PlacementTimeoutError: not ready within ``timeout_s``; names the bundles requested and the
            resources the cluster has available.
    """
    with anyio.move_on_after(timeout_s):
        await placement.group.ready()
        return
    available = await anyio.to_thread.run_sync(ray.available_resources)
    raise PlacementTimeoutError(placement.bundles, available, timeout_s)
