"""Worker order and rank maps. Pure: no Ray here.

The order is Ray Train's: workers grouped by node, the driver's node first and the other nodes in
the order their first worker appears, and within a node by lowest GPU id. World rank is the
position in that order; local rank counts the workers before it on its node; node rank numbers
the nodes in order of appearance; local world size is the number of workers on the node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._devices import device_sort_key

__all__ = ["RankInfo", "assign_ranks", "order_workers"]


@dataclass(frozen=True)
class RankInfo:
    """Where one worker sits in the group."""

    world_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int


def _lowest_gpu(ids: Mapping[str, Sequence[str]]) -> tuple[int, int | str]:
    gpus = ids.get("GPU", ())
    if not gpus:
        return (0, 0)
    return min(device_sort_key(g) for g in gpus)


def order_workers(
    node_ids: Sequence[str],
    accelerator_ids: Sequence[Mapping[str, Sequence[str]]],
    first_node: str | None = None,
) -> list[int]:
    """Return the indices of the workers in rank order.

    Args:
        node_ids: each worker's node id, in creation order.
        accelerator_ids: each worker's accelerator ids per kind, in creation order.
        first_node: the node whose workers come first (the driver's), when it holds any.
    """
    by_node: dict[str, list[int]] = {}
    if first_node is not None:
        by_node[first_node] = []
    for i, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(i)
    order: list[int] = []
    for members in by_node.values():
        order.extend(sorted(members, key=lambda i: _lowest_gpu(accelerator_ids[i])))
    return order


def assign_ranks(ordered_node_ids: Sequence[str]) -> list[RankInfo]:
    """Rank information for workers already in rank order (see :func:`order_workers`)."""
    counts: dict[str, int] = {}
    node_rank: dict[str, int] = {}
    local: list[int] = []
    for node in ordered_node_ids:
        local.append(counts.get(node, 0))
        counts[node] = counts.get(node, 0) + 1
        node_rank.setdefault(node, len(node_rank))
    size = len(ordered_node_ids)
    return [
        RankInfo(
            world_rank=i,
            local_rank=local[i],
            node_rank=node_rank[node],
            world_size=size,
            local_world_size=counts[node],
        )
        for i, node in enumerate(ordered_node_ids)
    ]
