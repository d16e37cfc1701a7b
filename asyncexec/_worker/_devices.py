"""A worker's own accelerator among those its process sees (the standard library only: the
torch backend's ``get_device`` and the weight channel's torch transport both use it)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["cuda_device_index"]


def cuda_device_index(gpu_ids: Sequence[str], visible: str | None, local_rank: int) -> int:
    """The CUDA device index of this worker's own GPU, as Ray Train finds it.

    Workers on a node see all the node's GPUs (``CUDA_VISIBLE_DEVICES`` lists them), so a
    worker's device is the position of its own GPU id in that list. Without a list every GPU is
    visible and the id is the index. A worker that holds no GPU of its own uses its local rank.

    Raises:
        RuntimeError: the worker's GPU is not among the visible devices.
    """
    if not gpu_ids:
        return local_rank
    own = str(gpu_ids[0])
    listed = [] if visible in (None, "", "NoDevFiles") else [v.strip() for v in visible.split(",")]
    if not listed:
        return int(own) if own.isdigit() else local_rank
    if own not in listed:
        raise RuntimeError(f"this worker's GPU {own!r} is not in CUDA_VISIBLE_DEVICES={visible!r}")
    return listed.index(own)
