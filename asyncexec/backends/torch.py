"""TorchBackend: set ``torch.distributed`` up across the worker group.

Importing this module does not import torch: the driver and light workers never pay for it.
Everything that needs torch runs on the workers, in module-level functions (so they pickle by
reference) that import torch inside.

The master port is never left free between choosing it and binding it. Ray Train's seed picks a
free port on rank 0, closes the socket and tells every rank to use the port; any process on that
node (another executor's rank 0 included) can bind it in between, and then ranks connect to a
stranger's store or fail with ``EADDRINUSE``. Here rank 0 starts torch's own ``TCPStore`` server on
port 0 (the kernel picks a port and the server keeps it bound) with ``multi_tenant=True`` and holds
it; when ``init_process_group`` on rank 0 then opens its store on that port, torch reuses the
server that is already listening instead of binding again. So there is no window, no retry and no
guess: the port is held from the moment it is chosen until the process group is destroyed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio

from .._errors import ConfigurationError
from .._logging import get_logger
from ._base import Backend, GroupHandle

if TYPE_CHECKING:
    import torch as torch_

    from .._session import WorkerContext

__all__ = ["TorchBackend", "cuda_device_index", "get_device", "resolve_backend"]

_INSTALL_HINT = "install the torch extra: pip install 'asyncexec[torch]'"

#: Process-group backends torch ships (``mpi`` only when torch was built with it).
_KNOWN_BACKENDS = frozenset({"gloo", "nccl", "mpi", "ucc", "xccl"})

_log = get_logger(component="torch_backend")


def _check_backend_name(value: str) -> None:
    """Accept a backend name or torch's per-device form (``"cpu:gloo,cuda:nccl"``)."""
    parts = value.split(",") if ":" in value else [value]
    for part in parts:
        name = part.split(":", 1)[1] if ":" in part else part
        if name not in _KNOWN_BACKENDS or (":" in value and ":" not in part):
            raise ConfigurationError(
                f"TorchBackend(backend=...) must be None, one of {sorted(_KNOWN_BACKENDS)} or "
                f"a per-device list such as 'cpu:gloo,cuda:nccl', got {value!r}"
            )


def resolve_backend(requested: str | None, contexts: Sequence[WorkerContext]) -> str:
    """The process-group backend to use: ``requested``, or nccl when any worker holds a GPU,
    else gloo."""
    if requested is not None:
        return requested
    has_gpu = any(ctx.accelerator_ids.get("GPU") for ctx in contexts)
    return "nccl" if has_gpu else "gloo"


def _uses_nccl(backend: str) -> bool:
    return backend == "nccl" or any(
        part.split(":", 1)[1] == "nccl" for part in backend.split(",") if ":" in part
    )


@dataclass(frozen=True)
class TorchBackend(Backend):
    """Sets up ``torch.distributed`` on every worker of the group.

    On start, rank 0 reserves the master address and port (held, never released before torch
    binds it; see the module docstring), every worker gets ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``,
    GPU workers make their own GPU the current CUDA device, and all ranks call
    ``torch.distributed.init_process_group`` concurrently. Before each run the environment is
    set again, and the process group is set up anew if a previous run destroyed it. On a
    graceful shutdown the process group is destroyed on every rank within
    ``shutdown_timeout_s`` (destroying a group can hang, so it runs in a thread that is given up
    on after the deadline).

    The instance holds configuration only, so one instance can serve several executors at once.

    Args:
        backend: ``"gloo"``, ``"nccl"`` (or another torch backend name, or a per-device list such
            as ``"cpu:gloo,cuda:nccl"``); ``None`` picks nccl when the workers hold GPUs, else
            gloo.
        init_method: ``"env"`` (``env://``, from the environment) or ``"tcp"``
            (``tcp://addr:port``).
        timeout_s: torch's timeout for the rendezvous and for collective operations.
        shutdown_timeout_s: how long ``destroy_process_group`` may take on each rank.

    Raises:
        ConfigurationError: an argument is invalid, or torch is not installed.
    """

    backend: str | None = None
    init_method: Literal["env", "tcp"] = "env"
    timeout_s: float = 1800.0
    shutdown_timeout_s: float = 30.0

    name = "torch"

    def __post_init__(self) -> None:
        if self.backend is not None:
            if not isinstance(self.backend, str):
                raise ConfigurationError(
                    f"TorchBackend(backend=...) must be a string or None, got {self.backend!r}"
                )
            _check_backend_name(self.backend)
        if self.init_method not in ("env", "tcp"):
            raise ConfigurationError(
                f"TorchBackend(init_method=...) must be 'env' or 'tcp', got {self.init_method!r}"
            )
        for field_name in ("timeout_s", "shutdown_timeout_s"):
            value = getattr(self, field_name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not value > 0
                or value == float("inf")
            ):
                raise ConfigurationError(
                    f"TorchBackend({field_name}=...) must be a positive number, got {value!r}"
                )
        if importlib.util.find_spec("torch") is None:
            raise ConfigurationError(f"TorchBackend needs torch: {_INSTALL_HINT}")

    async def on_start(self, group: GroupHandle) -> None:
        """Reserve the master port on rank 0 and initialise the process group on every rank."""
        await self._set_up(group)

    async def on_training_start(self, group: GroupHandle) -> None:
        """Set the environment again; set the process group up anew if a run destroyed it."""
        alive = await group.execute(_reassert_env)
        if all(alive):
            return
        # A previous run's function destroyed the group (a common last line of DDP scripts).
        # Ranks must agree, so any rank that still has one drops it and all rendezvous again.
        _log.info("torch_process_group_reinit", missing=[r for r, a in enumerate(alive) if not a])
        await group.execute(_destroy_process_group, self.shutdown_timeout_s)
        await self._set_up(group)

    async def on_shutdown(self, group: GroupHandle) -> None:
        """Destroy the process group on every rank, each bounded by ``shutdown_timeout_s``."""
        # The worker gives up on a hung destroy after the deadline; the margin covers the call.
        with anyio.move_on_after(self.shutdown_timeout_s + 5.0) as scope:
            done = await group.execute(_destroy_process_group, self.shutdown_timeout_s)
        if scope.cancelled_caught:
            _log.warning("torch_destroy_timed_out", seconds=self.shutdown_timeout_s)
            return
        hung = [rank for rank, ok in enumerate(done) if not ok]
        if hung:
            _log.warning("torch_destroy_timed_out", ranks=hung, seconds=self.shutdown_timeout_s)

    def function_context(self) -> Callable[[], AbstractContextManager[Any]]:
        """Make the worker's own GPU the current CUDA device in the function's thread (the
        setting is per thread; the one made at start-up does not carry over)."""
        return _device_context

    async def _set_up(self, group: GroupHandle) -> None:
        t0 = time.perf_counter()
        contexts = group.contexts
        backend = resolve_backend(self.backend, contexts)
        addr, port = await group.execute_single(0, _reserve_master, self.timeout_s)
        if self.init_method == "env":
            url = "env://"
        else:
            host = f"[{addr}]" if ":" in addr else addr
            url = f"tcp://{host}:{port}"
        await group.execute(_init_process_group, addr, port, backend, url, self.timeout_s)
        _log.info(
            "torch_process_group_ready",
            backend=backend,
            init_method=url if self.init_method == "env" else "tcp://",
            master=f"{addr}:{port}",
            world_size=len(contexts),
            seconds=round(time.perf_counter() - t0, 3),
        )


# Worker side --------------------------------------------------------------------------------
#
# These run in the worker processes, through group.execute. Per-group state lives here, in the
# worker's process (each worker belongs to exactly one group), never on the TorchBackend.

#: Rank 0's reservation of the master port, held until its process group owns the port.
_reserved: Any = None
#: The torch environment this worker was given, re-applied before each run.
_env: dict[str, str] = {}


def _import_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError(f"TorchBackend needs torch on every worker: {_INSTALL_HINT}") from exc
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support")
    return dist


def _reserve_master(timeout_s: float) -> tuple[str, int]:
    """On rank 0: start a TCPStore server on a port the kernel picks, keep it, return the
    address and port."""
    global _reserved
    from datetime import timedelta

    from .._session import get_context

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
        raise RuntimeError(
            f"this worker's GPU {own!r} is not in CUDA_VISIBLE_DEVICES={visible!r}"
        )
    return listed.index(own)


def get_device() -> torch_.device:
    """This worker's torch device: its own GPU when it holds one and CUDA is available, else the
    CPU. With TorchBackend it is already the current CUDA device in the function's thread."""
    import torch

    from .._session import get_context

    context = get_context()
    gpu_ids = context.accelerator_ids.get("GPU", ())
    if not gpu_ids or not torch.cuda.is_available():
        return torch.device("cpu")
    index = cuda_device_index(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), context.local_rank)
    return torch.device("cuda", index)


@contextlib.contextmanager
def _device_context() -> Iterator[None]:
    """On a worker, around the user's function: set the current CUDA device when there is one.
    Does not import torch unless the process already has (a function that never touches torch
    does not pay for it)."""
    if "torch" in sys.modules:
        import torch

        device = get_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
    yield


def _init_process_group(
    master_addr: str, master_port: int, backend: str, url: str, timeout_s: float
) -> None:
    """On every rank: set the environment and the CUDA device, join the process group."""
    global _reserved, _env
    from datetime import timedelta

    from .._session import get_context

    dist = _import_dist()
    context = get_context()
    _env = torch_env(context, master_addr, master_port)
    os.environ.update(_env)
    # As Ray Train: NCCL collectives that time out fail instead of hanging, unless the user chose.
    user_chose = any(
        v in os.environ for v in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")
    )
    if _uses_nccl(backend) and not user_chose:
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


def _reassert_env() -> bool:
    """Before a run: set the torch environment again; return whether the group is alive."""
    if _env:
        os.environ.update(_env)
    import sys

    if "torch" not in sys.modules:
        return False
    dist = _import_dist()
    return bool(dist.is_initialized())


def _destroy_process_group(timeout_s: float) -> bool:
    """Destroy this rank's process group; return False if it did not end within ``timeout_s``
    (the thread doing it is then abandoned: it is a daemon, and the worker is stopped next)."""
    global _reserved
    import sys

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


def _process_group_info() -> Mapping[str, Any]:
    """This rank's view of its process group (for tests and diagnostics)."""
    import sys

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
