"""Visible-device sets per node and accelerator kind. Pure: no Ray here.

Ray gives each worker only the accelerator ids of its own bundle (it sets, say,
``CUDA_VISIBLE_DEVICES=3`` for a worker that holds GPU 3). Collective libraries need the workers
of a node to see each other's devices, so every worker is given the union of the ids held by the
workers on its node, for each kind of accelerator, in the environment variable that kind's runtime
reads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

__all__ = ["DEVICE_KINDS", "DEVICE_ENV_VARS", "device_sort_key", "shared_device_env"]

#: Ray resource name -> the environment variables that expose that kind's devices.
#: GPUs are exposed both as CUDA (NVIDIA) and HIP (AMD) visible devices; the runtime that is not
#: present ignores its variable.
DEVICE_ENV_VARS: Mapping[str, tuple[str, ...]] = {
    "GPU": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
    "neuron_cores": ("NEURON_RT_VISIBLE_CORES",),
    "NPU": ("ASCEND_RT_VISIBLE_DEVICES",),
}
DEVICE_KINDS: tuple[str, ...] = tuple(DEVICE_ENV_VARS)


def device_sort_key(device_id: str) -> tuple[int, int | str]:
    """Order ids numerically when they are numbers ("2" before "10"), else as text."""
    try:
        return (0, int(device_id))
    except ValueError:
        return (1, device_id)


def shared_device_env(
    node_ids: Sequence[str],
    accelerator_ids: Sequence[Mapping[str, Sequence[str]]],
    kinds: Collection[str],
) -> list[dict[str, str]]:
    """The environment each worker needs so that it sees its node's devices.

    Args:
        node_ids: each worker's node, in worker order.
        accelerator_ids: each worker's own ids per kind (Ray's ``get_accelerator_ids()``).
        kinds: the kinds to share; a kind that no worker holds sets nothing.

    Returns:
        One dict of environment variables per worker, in worker order.
    """
    env: list[dict[str, str]] = [{} for _ in node_ids]
    for kind in kinds:
        per_node: dict[str, set[str]] = defaultdict(set)
        for node, ids in zip(node_ids, accelerator_ids, strict=True):
            per_node[node].update(ids.get(kind, ()))
        for i, node in enumerate(node_ids):
            shared = per_node[node]
            if not shared:
                continue
            value = ",".join(sorted(shared, key=device_sort_key))
            for var in DEVICE_ENV_VARS[kind]:
                env[i][var] = value
    return env
