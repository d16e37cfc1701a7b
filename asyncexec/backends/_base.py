"""The Backend protocol: async hooks that set a framework up across the group."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from .._wire._protocol import WorkerContext

__all__ = ["Backend", "GroupHandle"]

T = TypeVar("T")


@runtime_checkable
class GroupHandle(Protocol):
    """What a backend hook sees of the live group."""

    @property
    def contexts(self) -> Sequence[WorkerContext]:
        """Each worker's context (ranks, node, devices), in rank order."""
        ...

    async def execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn`` on every worker concurrently; results in rank order."""
        ...

    async def execute_single(
        self, rank: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``fn`` on one rank."""
        ...


class Backend:
    """Sets a framework up across the worker group. Subclass it and override the hooks you need.

    One instance belongs to one executor's configuration; hooks get the live group as an
    argument and should keep per-group state on the workers, not on the backend, so an instance
    can be shared by several executors without interference.

    Every hook runs once per group (``on_training_start`` once per run attempt), may call
    ``group.execute`` to act on all workers concurrently, and is bounded by the executor's
    start-up (or shutdown) deadline. An exception from ``on_start`` or ``on_training_start`` fails
    start-up with a :class:`asyncexec.BackendError` naming the backend, hook and rank; the restart
    policy treats it as a start-up failure.
    """

    #: Shown in errors and logs.
    name: str = "backend"
    #: Whether the ranks it sets up are independent of each other (no collective between
    #: them): then a run on it replaces a failed rank on its own by default (see
    #: ``Executor.run(independent=...)``).
    independent_ranks: bool = False

    async def on_start(self, group: GroupHandle) -> None:
        """After the workers are up, ranked and have their devices; before any run."""

    async def on_training_start(self, group: GroupHandle) -> None:
        """Before each run (and each attempt of a run) starts the user's function."""

    async def on_shutdown(self, group: GroupHandle) -> None:
        """Before the workers are stopped on a graceful shutdown."""

    def function_context(self) -> Callable[[], AbstractContextManager[Any]] | None:
        """A picklable factory of a context manager that every worker enters around the user's
        function, in the function's own thread (for per-thread state such as the current CUDA
        device); None for none."""
        return None
