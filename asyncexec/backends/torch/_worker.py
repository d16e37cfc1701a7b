"""The worker part of :class:`TorchBackend`: what runs in the worker processes, through
``group.execute``. It imports the standard library, torch (inside the functions, so a worker
that never touches torch does not pay for it) and asyncexec's worker side only.

Per-group state lives here, in the worker's process (each worker belongs to exactly one group at
a time), never on the TorchBackend. The master port is never left free between choosing it and
binding it: see :func:`reserve_master`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..._worker import cuda_device_index, get_context

if TYPE_CHECKING:
    import torch as torch_

    from ..._wire._protocol import WorkerContext

__all__ = [
    "cuda_device_index",
    "destroy_process_group",
    "device_context",
    "get_device",
    "init_process_group",
    "process_group_info",
    "reassert_env",
    "reserve_master",
    "torch_env",
    "uses_nccl",
]

INSTALL_HINT = "install the torch extra: pip install 'asyncexec[torch]'"


def uses_nccl(backend: str) -> bool:
    """Whether a process-group backend name (or per-device list) uses nccl."""
    return backend == "nccl" or any(
        part.split(":", 1)[1] == "nccl" for part in backend.split(",") if ":" in part
    )


#: Rank 0's reservation of the master port, held until its process group owns the port.
_reserved: Any = None
#: The torch environment this worker was given, re-applied before each run.
_env: dict[str, str] = {}


def _import_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError(f"TorchBackend needs torch on every worker: {INSTALL_HINT}") from exc
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support")
    return dist


def reserve_master(timeout_s: float) -> tuple[str, int]:
    """On rank 0: start a TCPStore server on a port the kernel picks, keep it, return the
    address and port."""
    global _reserved
    from datetime import timedelta

    dist = _import_dist()
    addr = get_context().node_ip
    _reserved = None  # a stale reservation of an earlier set-up in this process
    _reserved = dist.TCPStore(
        addr,
        0,
        is_master=True,
        wait_for_workers=False,
        # init_process_group's store on this port joins this server instead of binding anew.
        multi_tenant=True,
        timeout=timedelta(seconds=timeout_s),
    )
    return addr, int(_reserved.port)


def torch_env(context: WorkerContext, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment variables torch.distributed (and torchrun-style code) reads."""
    return {
        "RANK": str(context.world_rank),
        "LOCAL_RANK": str(context.local_rank),
        "WORLD_SIZE": str(context.world_size),
        "LOCAL_WORLD_SIZE": str(context.local_world_size),
        "NODE_RANK": str(context.node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def get_device() -> torch_.device:
    """This worker's torch device: its own GPU when it holds one and CUDA is available, else the
    CPU. With TorchBackend it is already the current CUDA device in the function's thread."""
    import torch

    context = get_context()
    gpu_ids = context.accelerator_ids.get("GPU", ())
    if not gpu_ids or not torch.cuda.is_available():
        return torch.device("cpu")
    index = cuda_device_index(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), context.local_rank)
    return torch.device("cuda", index)


@contextlib.contextmanager
def device_context() -> Iterator[None]:
    """On a worker, around the user's function: set the current CUDA device when there is one.
    Does not import torch unless the process already has (a function that never touches torch
    does not pay for it)."""
    if "torch" in sys.modules:
        import torch

        device = get_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
    yield


def init_process_group(
    master_addr: str, master_port: int, backend: str, url: str, timeout_s: float
) -> None:
    """On every rank: set the environment and the CUDA device, join the process group."""
    global _reserved, _env
    from datetime import timedelta

    dist = _import_dist()
    context = get_context()
    _env = torch_env(context, master_addr, master_port)
    os.environ.update(_env)
    # As Ray Train: NCCL collectives that time out fail instead of hanging, unless the user chose.
    user_chose = any(
        v in os.environ for v in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")
    )
    if uses_nccl(backend) and not user_chose:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    device = get_device()
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend=backend,
            init_method=url,
            rank=context.world_rank,
            world_size=context.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    finally:
        # The process group's store now shares the reserved server (or set-up failed).
        _reserved = None


def reassert_env() -> bool:
    """Before a run: set the torch environment again; return whether the group is alive."""
    if _env:
        os.environ.update(_env)

    if "torch" not in sys.modules:
        return False
    dist = _import_dist()
    return bool(dist.is_initialized())


def destroy_process_group(timeout_s: float) -> bool:
    """Destroy this rank's process group; return False if it did not end within ``timeout_s``
    (the thread doing it is then abandoned: it is a daemon, and the worker is stopped next)."""
    global _reserved

    _reserved = None
    if "torch" not in sys.modules:
        return True
    dist = _import_dist()
    if not dist.is_initialized():
        return True
    errors: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as exc:  # reported below, in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=destroy, name="asyncexec-torch-destroy", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False
    if errors:
        raise errors[0]
    _empty_cuda_cache()
    return True


def _empty_cuda_cache() -> None:
    import torch

    # Only when CUDA is already in use: initialising it here would cost seconds for nothing.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def process_group_info() -> Mapping[str, Any]:
    """This rank's view of its process group (for tests and diagnostics)."""

    if "torch" not in sys.modules:
        return {"initialized": False}
    dist = _import_dist()
    if not dist.is_initialized():
        return {"initialized": False}
    return {
        "initialized": True,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "master_port": int(os.environ.get("MASTER_PORT", "0")),
    }
