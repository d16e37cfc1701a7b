"""What the chaos runner and the soak share: what is left in the cluster, an event-loop
heartbeat, and a percentile."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio
import ray


def live_workers() -> list[dict[str, Any]]:
    """asyncexec worker actors that are not dead. Blocking (it asks the GCS): call it off the
    event loop."""
    import ray._private.state as ray_state

    return [
        a
        for a in ray_state.actors().values()
        if a["ActorClassName"] == "_Worker" and a["State"] != "DEAD"
    ]


def live_placement_groups() -> list[dict[str, Any]]:
    """Placement groups that are not removed. Blocking, like :func:`live_workers`."""
    return [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]


class Heartbeat:
    """Measures the longest event-loop stall while :meth:`run` runs."""

    def __init__(self) -> None:
        self.max_gap = 0.0

    async def run(self) -> None:
        last = anyio.current_time()
        while True:
            await anyio.sleep(0.01)
            now = anyio.current_time()
            self.max_gap = max(self.max_gap, now - last - 0.01)
            last = now


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0-100) of ``values``; NaN when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]
