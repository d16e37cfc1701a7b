"""Which cluster an object runs on, decided once, when it is made: the one handed in
(``cluster=``, as httpx takes ``transport=``), else the one of what it is made on (an executor's
pool or reservation, a pool's reservation), else the context's default (set for a block by
``asyncexec.testing.simulated``), else Ray's, or this process's threads for a local executor.

Objects that work together run on one cluster: :func:`agreed` refuses a mismatch before
anything starts, naming both clusters.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar

from ..._errors import ConfigurationError
from .._config import LOCAL_ENV, local_default
from ._base import Cluster
from ._inprocess import InProcessCluster
from ._local import LocalCluster
from ._ray import RayCluster

__all__ = [
    "DEFAULT_CLUSTER",
    "agreed",
    "checked_cluster",
    "default_cluster",
    "rays_by_default",
    "rays_only",
]

#: The cluster that objects made without one run on in this context, or None (Ray's, or the
#: threads of a local executor). Only ``asyncexec.testing.simulated`` sets it, for a block; an
#: object made inside keeps it afterwards.
DEFAULT_CLUSTER: ContextVar[Cluster | None] = ContextVar("asyncexec_cluster", default=None)

_RAY = RayCluster()
_LOCAL = LocalCluster()


def checked_cluster(cluster: object, local: bool | None = None) -> Cluster:
    """``cluster``, handed to an object whose ``local`` (an executor's) is as given, if it is
    one of the seam's clusters.

    Local mode's threads (a local executor's ``cluster``) are not handed in: handed to an
    executor they skipped every refusal of local mode (``runtime_env`` ignored, ``spares`` and
    elastic sizes taken), and a pool or reservation holds Ray's workers.

    Raises:
        ConfigurationError: it is not, it is local mode's threads, or ``local`` is True
            (naming both).
    """
    if isinstance(cluster, LocalCluster):
        raise ConfigurationError(
            f"{cluster!r} is local mode's, chosen with local=True (or ASYNCEXEC_LOCAL=1), not "
            "handed in as cluster=: make the executor with local=True (a pool or a reservation "
            "holds Ray's workers and cannot run there)"
        )
    if not isinstance(cluster, RayCluster | InProcessCluster):
        raise ConfigurationError(
            "cluster must be a cluster to run the workers on, such as "
            f"asyncexec.testing.SimCluster(), or None for Ray's; got {cluster!r:.100}"
        )
    if local is True:
        raise ConfigurationError(
            f"an executor takes local=True or a cluster ({cluster!r}), not both: a local "
            "executor's workers are threads of this process, a cluster's live in it"
        )
    return cluster


def default_cluster(local: bool = False) -> Cluster:
    """The cluster of an object made without one: the context's default, else this process's
    threads (``local``) or Ray's."""
    in_context = DEFAULT_CLUSTER.get()
    if in_context is not None:
        return in_context
    return _LOCAL if local else _RAY


def rays_by_default(sides: Sequence[tuple[str, Cluster | None]], what: str) -> Cluster:
    """:func:`agreed` for ``what``, which holds Ray's workers when none of ``sides`` is given
    (a pool): refused when ``ASYNCEXEC_LOCAL`` makes the default local mode's, which starts
    no Ray (and whose executors take no pool).

    Raises:
        ConfigurationError: two sides differ, or none is given under ``ASYNCEXEC_LOCAL=1``
            (naming the variable), or the variable is neither a true nor a false word.
    """
    given = any(cluster is not None for _, cluster in sides)
    cluster = agreed(sides, local=not given and local_default(None))
    if isinstance(cluster, LocalCluster):
        raise ConfigurationError(
            f"{what} holds Ray's workers, and {LOCAL_ENV}=1 makes executors local (threads, "
            "no Ray), which take no pool: unset it to use the pool, or hand the pool a "
            "cluster (cluster=)"
        )
    return cluster


def rays_only(cluster: Cluster, what: str, lacks: str) -> Cluster:
    """``cluster``, for ``what``, which only Ray's workers can serve: a cluster in this process
    (simulated workers, local mode's threads) ``lacks`` what it needs.

    Raises:
        ConfigurationError: ``cluster`` is in this process (naming it, ``what`` and why).
    """
    if isinstance(cluster, InProcessCluster):
        raise ConfigurationError(f"{what} needs Ray's workers: {cluster!r} {lacks}")
    return cluster


def agreed(sides: Sequence[tuple[str, Cluster | None]], local: bool = False) -> Cluster:
    """The one cluster that objects working together run on: ``sides`` are each one's
    description and cluster (None: not given, or none handed in), the first given one wins;
    none given: the default (for ``local``).

    Raises:
        ConfigurationError: two of them differ (naming both).
    """
    given = [(name, cluster) for name, cluster in sides if cluster is not None]
    if not given:
        return default_cluster(local)
    (first_name, first), *rest = given
    for name, other in rest:
        if other != first:
            raise ConfigurationError(
                f"{first_name} runs on {first!r} but {name} on {other!r}: objects that work "
                "together run on one cluster (hand the same one to each, or none)"
            )
    return first
