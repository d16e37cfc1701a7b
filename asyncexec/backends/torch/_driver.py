"""TorchBackend, its driver part: set ``torch.distributed`` up across the worker group.

Importing this module does not import torch. Everything that needs torch runs on the workers,
in the module-level functions of ``_worker`` (they pickle by reference, so a worker imports that
module, never this one).

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

import importlib.util
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio

from ..._errors import ConfigurationError
from ..._logging import get_logger
from .._base import Backend, GroupHandle
from . import _worker

if TYPE_CHECKING:
    from ..._wire._protocol import WorkerContext

__all__ = ["TorchBackend", "resolve_backend"]


#: Process-group backends torch ships (``mpi`` only when torch was built with it).
_KNOWN_BACKENDS = frozenset({"gloo", "nccl", "mpi", "ucc", "xccl"})


def _log() -> Any:
    """The logger, looked up when an event is logged (never bound at import time, so
    ``configure_logging`` and the application's set-up apply to it)."""
    return get_logger(component="torch_backend")


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
            raise ConfigurationError(f"TorchBackend needs torch: {_worker.INSTALL_HINT}")

    async def on_start(self, group: GroupHandle) -> None:
        """Reserve the master port on rank 0 and initialise the process group on every rank."""
        await self._set_up(group)

    async def on_training_start(self, group: GroupHandle) -> None:
        """Set the environment again; set the process group up anew if a run destroyed it.

        Raises:
            RuntimeError: a rank's process group, to be set up anew, was not destroyed within
                ``shutdown_timeout_s``.
        """
        alive = await group.execute(_worker.reassert_env)
        if all(alive):
            return
        # A previous run's function destroyed the group (a common last line of DDP scripts).
        # Ranks must agree, so any rank that still has one drops it and all rendezvous again.
        _log().info("torch_process_group_reinit", missing=[r for r, a in enumerate(alive) if not a])
        done = await group.execute(_worker.destroy_process_group, self.shutdown_timeout_s)
        hung = [rank for rank, ok in enumerate(done) if not ok]
        if hung:  # their group is still there: set up anew, torch would say "twice" and no more
            raise RuntimeError(
                f"the process group of rank(s) {hung} was not destroyed within "
                f"shutdown_timeout_s={self.shutdown_timeout_s:g} s (a collective still waiting?), "
                "so it cannot be set up anew for this run"
            )
        await self._set_up(group)

    async def on_shutdown(self, group: GroupHandle) -> None:
        """Destroy the process group on every rank, each bounded by ``shutdown_timeout_s``."""
        # The worker gives up on a hung destroy after the deadline; the margin covers the call.
        with anyio.move_on_after(self.shutdown_timeout_s + 5.0) as scope:
            done = await group.execute(_worker.destroy_process_group, self.shutdown_timeout_s)
        if scope.cancelled_caught:
            _log().warning("torch_destroy_timed_out", seconds=self.shutdown_timeout_s)
            return
        hung = [rank for rank, ok in enumerate(done) if not ok]
        if hung:
            _log().warning("torch_destroy_timed_out", ranks=hung, seconds=self.shutdown_timeout_s)

    def function_context(self) -> Callable[[], AbstractContextManager[Any]]:
        """Make the worker's own GPU the current CUDA device in the function's thread (the
        setting is per thread; the one made at start-up does not carry over)."""
        return _worker.device_context

    async def _set_up(self, group: GroupHandle) -> None:
        t0 = time.perf_counter()
        contexts = group.contexts
        backend = resolve_backend(self.backend, contexts)
        addr, port = await group.execute_single(0, _worker.reserve_master, self.timeout_s)
        if self.init_method == "env":
            url = "env://"
        else:
            host = f"[{addr}]" if ":" in addr else addr
            url = f"tcp://{host}:{port}"
        await group.execute(_worker.init_process_group, addr, port, backend, url, self.timeout_s)
        _log().info(
            "torch_process_group_ready",
            backend=backend,
            init_method=url if self.init_method == "env" else "tcp://",
            master=f"{addr}:{port}",
            world_size=len(contexts),
            seconds=round(time.perf_counter() - t0, 3),
        )
