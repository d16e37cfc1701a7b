"""Placement groups: find the parent, check that the bundles can ever fit, create, await ready,
remove.

Creating and removing a group are synchronous calls to the GCS, and the first ``ready()`` in a
process exports a remote function synchronously: they run in a worker thread, never on the loop.
The parent placement group lives in Ray's task context, which is thread-local: it is read on the
calling thread (:func:`current_parent`) before anything moves to a worker thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..._errors import PlacementInfeasibleError, PlacementTimeoutError, describe

__all__ = [
    "PRECISION",
    "Placement",
    "check_feasible",
    "create_placement",
    "current_parent",
    "infeasible_reason",
    "wait_placement_ready",
]


@dataclass
class Placement:
    """The placement group a worker group lives in.

    ``owned`` is False when the executor runs inside a parent placement group that captures child
    tasks (for example inside a Ray Tune trial), or on a :class:`~._reservation.Reservation`:
    that group is used as it is and never removed. ``slots`` maps worker ``i`` to its bundle of
    a reservation (worker order is then rank order).
    """

    group: PlacementGroup
    bundles: list[dict[str, float]]
    owned: bool
    ready: Any = None  # the ObjectRef that resolves when the group is placed
    removed: bool = False
    slots: Sequence[int] | None = None

    def strategy(self, index: int | None) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy for worker ``index``: its own bundle (its slot's, on a
        reservation), or any bundle (of a parent, or when ``index`` is None)."""
        bundle = index if self.owned and index is not None else -1
        if self.slots is not None and index is not None:
            bundle = self.slots[index]
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)

    def within(self, bundles: list[dict[str, float]], slots: Sequence[int]) -> Placement:
        """A part of this placement (a reservation's) that another owner's workers go into:
        worker i on bundle ``slots[i]``; never removed by them."""
        return Placement(self.group, bundles, owned=False, slots=slots)

    def remove(self) -> None:
        """Remove the group if this executor made it. Idempotent. Blocking (a GCS call): call it
        off the event loop."""
        if self.owned and not self.removed:
            self.removed = True
            remove_placement_group(self.group)


def current_parent() -> PlacementGroup | None:
    """The placement group of the current Ray task or actor when it captures child tasks, else
    None. Reads Ray's thread-local task context: call it on the thread that runs the executor."""
    worker = ray._private.worker.global_worker
    parent = get_current_placement_group()
    if parent is not None and worker.should_capture_child_tasks_in_placement_group:
        return parent
    return None


#: Ray counts resources in units of 1/10000: smaller differences are rounding.
PRECISION = 1e-4


def _fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + PRECISION / 2 >= v for k, v in bundle.items())


def _take(bundle: Mapping[str, float], free: dict[str, float]) -> None:
    for k, v in bundle.items():
        free[k] = free.get(k, 0.0) - v


def infeasible_reason(
    bundles: Sequence[Mapping[str, float]], strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why ``bundles`` can never be placed on nodes of these total resources, or None when they
    can (first-fit, largest bundles first: exact for the equal bundles an executor asks for).
    Pure."""
    if not nodes:
        return "the cluster has no live node"
    have = {k for n in nodes for k, v in n.items() if v > 0}
    unknown = sorted({k for b in bundles for k, v in b.items() if v > 0} - have)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        known = ", ".join(sorted(k for k in have if not k.startswith("node:")))
        return f"no node has a resource named {names} (the nodes have {known})"
    ordered = sorted(bundles, key=lambda b: -sum(b.values()))
    if strategy == "STRICT_PACK":
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        if not any(_fits(total, n) for n in nodes):
            return f"STRICT_PACK needs one node with {total}"
        return None
    if strategy == "STRICT_SPREAD":
        fitting = sum(1 for n in nodes if _fits(ordered[0], n))
        if fitting < len(bundles):
            return f"STRICT_SPREAD needs {len(bundles)} nodes that each hold {ordered[0]}"
        return None
    free = [dict(n) for n in nodes]
    for bundle in ordered:
        node = next((f for f in free if _fits(bundle, f)), None)
        if node is None:
            return "the nodes' total resources cannot hold every bundle at once"
        _take(bundle, node)
    return None


def _cluster_can_grow() -> bool:
    """Whether an autoscaler may add nodes (it publishes a cluster config with node types).
    Blocking (a GCS call); raises when Ray cannot tell."""
    config = ray._private.state.state.get_cluster_config()
    return config is not None and bool(getattr(config, "node_group_configs", None))


def _node_totals() -> list[dict[str, float]]:
    return [{k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n.get("Alive")]


def check_feasible(bundles: list[dict[str, float]], strategy: str, log: Any) -> None:
    """Refuse at once bundles that no node of the cluster can ever hold while no autoscaler
    can add one. When Ray cannot tell (a GCS call raised), say so in the log: the placement
    deadline then decides. Blocking (GCS calls): call it in a thread.

    Raises:
        PlacementInfeasibleError: naming why.
    """
    try:
        nodes = _node_totals()
        reason = infeasible_reason(bundles, strategy, nodes)
        if reason is None or _cluster_can_grow():
            return
    except Exception as exc:
        log.warning(
            "placement_check_failed",
            error=describe(exc),
            detail="whether the workers can ever fit is unknown: the placement deadline applies",
        )
        return
    raise PlacementInfeasibleError(bundles, nodes, reason)


def create_placement(
    bundles: list[dict[str, float]], strategy: str, parent: PlacementGroup | None, log: Any
) -> Placement:
    """Make the placement group and request its readiness. Blocking: call it in a thread.

    Raises:
        PlacementInfeasibleError: no node could ever hold the bundles and no autoscaler can add
            one; raised at once instead of after the placement deadline.
    """
    if parent is not None:
        return Placement(parent, bundles, owned=False)
    check_feasible(bundles, strategy, log)
    group = placement_group(bundles, strategy=strategy, name="")
    return Placement(group, bundles, owned=True, ready=group.ready())


async def wait_placement_ready(
    placement: Placement,
    timeout_s: float,
    available: Callable[[], Awaitable[Mapping[str, float] | None]],
) -> None:
    """Await the group's readiness.

    Raises:
        PlacementTimeoutError: not ready within ``timeout_s``; names the bundles requested and the
            resources the cluster has available (``available()``: bounded, None when the cluster
            did not answer in time).
    """
    if placement.ready is None:
        return
    with anyio.move_on_after(timeout_s):
        await placement.ready
        return
    raise PlacementTimeoutError(placement.bundles, await available(), timeout_s)
