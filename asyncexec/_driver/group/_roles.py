"""The instances of a group's roles (its worker classes) on its workers: made on every worker once
the group is set up (after the backend's ``on_start``: ``torch.distributed`` is ready in
``__init__``), on a worker that joins the group in a failed rank's place, and again on every worker
when the group's world changes (a smaller group, a backend's group formed anew); each instance's
``restore(checkpoint)`` is called after its ``__init__`` when the group has a checkpoint to
restore from (a restart, or a rank replaced after a run: the run's latest; after independent
ranks, each rank's own, :class:`PerRank`). The roles are pickled once per executor and sent once
per group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..._errors import AsyncExecError, StartupError, describe
from ..._wire._protocol import Outcome, RoleFailure
from ..cluster import proxy
from ._members import WorkerInfo

__all__ = ["INLINE_ROLES_BYTES", "PerRank", "make_roles"]

#: Roles pickled to at most this travel inline with each worker's call; larger ones are put
#: where every worker reads them, once per group.
INLINE_ROLES_BYTES = 64 * 1024


@dataclass(frozen=True)
class PerRank:
    """A checkpoint per rank to restore the instances from (after a run of independent ranks,
    each rank's own latest); a rank past them, or with None, is not restored."""

    checkpoints: tuple[Any, ...]

    def of(self, rank: int) -> Any:
        return self.checkpoints[rank] if 0 <= rank < len(self.checkpoints) else None


def _restore_from(group: Any, rank: int) -> Any:
    found = group.restore_from
    return found.of(rank) if isinstance(found, PerRank) else found


async def make_roles(group: Any, workers: Sequence[WorkerInfo]) -> None:
    """Make the instances of the group's roles on ``workers`` (every worker of ``group`` when
    they are its workers), restoring them from ``group.restore_from`` when it is set.

    Raises:
        StartupError: a role could not be unpickled, its ``__init__`` or its ``restore``
            raised on a rank (named, with the rank and the cause).
    """
    payload = group.config.roles_payload
    if payload is None or not workers:
        return
    if group.roles_ref is None:
        big = len(payload) > INLINE_ROLES_BYTES
        group.roles_ref = await group.cluster.put(payload) if big else payload
    context = group.backend.function_context() if group.backend is not None else None
    calls = [
        proxy(group, w).make_roles(group.roles_ref, _restore_from(group, w.rank), context)
        for w in workers
    ]
    outcomes: list[Outcome] = await group.gather(calls)
    for worker, outcome in zip(workers, outcomes, strict=True):
        if outcome.kind != "ok":
            raise _role_error(group.config.roles, worker, outcome)


def _role_error(roles: Sequence[Any], worker: WorkerInfo, outcome: Outcome) -> AsyncExecError:
    failure = outcome.value
    cause = outcome.error
    if isinstance(failure, RoleFailure):
        name = roles[failure.role_index].name
        what = {
            "load": f"role {name} could not be unpickled",
            "init": f"{name}.__init__ raised",
            "restore": f"{name}.restore(checkpoint) raised",
        }[failure.stage]
    else:
        what = "the roles could not be made"
    detail = describe(cause) if cause is not None else outcome.kind
    error = StartupError(f"{what} on rank {worker.rank}: {detail}")
    if outcome.traceback:
        error.add_note(f"Remote traceback (rank {worker.rank}):\n{outcome.traceback}")
    error.__cause__ = cause
    return error
