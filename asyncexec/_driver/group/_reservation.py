"""Reservation: one placement group that several executors (and pools) place their workers into.

Rank i of every executor on a reservation goes to bundle i, so the i-th workers of a learner and
of a rollout group share a node and, with fractional amounts, a GPU. The bundles are put in rank
order once, when the reservation is placed: the driver's node first, then the other nodes in the
order their first bundle appears. Each executor claims its share of every bundle it uses when it
is entered; a claim that would overfill a bundle is refused before anything starts, naming the
bundle, the claims already on it and what is left. A restart replaces an executor's processes,
never the reservation: the placement group lives as long as the ``async with`` block.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

import anyio

from ..._errors import ConfigurationError, ExecutorStateError
from ..._logging import get_logger
from .._config import (
    PlacementStrategy,
    check_address,
    check_count,
    check_positive,
    validate_resources,
)
from ..cluster import (
    PRECISION,
    Cluster,
    Placement,
    agreed,
    checked_cluster,
    rays_only,
)
from ._ranks import order_workers

__all__ = ["Claim", "Reservation", "ReservationStatistics"]

_DEFAULT_PLACEMENT_TIMEOUT_S = 60.0


@dataclass(frozen=True, eq=False)
class Claim:
    """An executor's (or pool's) share of a reservation: ``resources`` on each of the first
    ``count`` bundles (in rank order)."""

    owner: str
    count: int
    resources: Mapping[str, float]


@dataclass(frozen=True)
class ReservationStatistics:
    """A snapshot of a reservation, from :meth:`Reservation.statistics`."""

    bundles: int
    claims: tuple[tuple[str, int], ...]  # (owner, bundles used), in claim order
    free: tuple[dict[str, float], ...]  # what each bundle has left, in rank order
    nodes: tuple[str, ...]  # each bundle's node id, in rank order


class Reservation:
    """One placement group shared by several executors: rank i of each on bundle i.

    ::

        async with asyncexec.Reservation(4, {"CPU": 1, "GPU": 1}) as reservation:
            async with (
                asyncexec.Executor(4, reservation=reservation,
                                   resources_per_worker={"CPU": 0.5, "GPU": 0.5}) as learner,
                asyncexec.Executor(4, reservation=reservation,
                                   resources_per_worker={"CPU": 0.5, "GPU": 0.5}) as rollout,
            ):
                ...   # rank i of both sees the same GPU

    Args:
        bundles: how many bundles (the largest executor on it has this many workers).
        resources_per_bundle: Ray resources of each bundle (``{"CPU": 1}`` by default).
        strategy: how the bundles spread over nodes (``PACK``, ``SPREAD``, ``STRICT_PACK``,
            ``STRICT_SPREAD``).
        placement_timeout_s: how long the placement group may take to be ready.
        address: the Ray cluster to join when Ray is not initialized.
        name: a name for logs and errors.
        cluster: the cluster the bundles are placed in: ``None`` for Ray's (the only one that
            places bundles: a :class:`asyncexec.testing.SimCluster` is refused, also inside
            :func:`asyncexec.testing.simulated`). The executors and pools on the reservation
            run on it.
    """

    def __init__(
        self,
        bundles: int,
        resources_per_bundle: Mapping[str, float] | None = None,
        *,
        strategy: PlacementStrategy = "PACK",
        placement_timeout_s: float = _DEFAULT_PLACEMENT_TIMEOUT_S,
        address: str | None = None,
        name: str = "reservation",
        cluster: Cluster | None = None,
    ) -> None:
        check_count("bundles", bundles)
        resources = validate_resources(
            {"CPU": 1.0} if resources_per_bundle is None else resources_per_bundle
        )
        if strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigurationError(f"unknown placement strategy {strategy!r}")
        check_positive("placement_timeout_s", placement_timeout_s)
        check_address(address)
        self.size = bundles
        self.resources = {k: v for k, v in resources.items() if v > 0}
        self.strategy = strategy
        self.placement_timeout_s = float(placement_timeout_s)
        self.address = address
        self.name = name
        self.log = get_logger(reservation=f"{name}-{os.urandom(4).hex()}")
        #: Where the bundles are placed: Ray's (a local executor takes no reservation).
        handed = None if cluster is None else checked_cluster(cluster)
        self.cluster = rays_only(
            agreed([(f"the reservation {name!r} (cluster=)", handed)]),
            f"the reservation {name!r}, a placement group,",
            "places no bundles (a pool or an executor runs on it without one)",
        )
        self._placement: Placement | None = None
        self._order: list[int] = []  # bundle index of each slot, in rank order
        self._nodes: list[str] = []  # node id of each slot
        self._claims: list[Claim] = []
        self._open = False
        self._closed = False

    def __repr__(self) -> str:
        state = "open" if self._open else ("closed" if self._closed else "new")
        return f"<Reservation {self.name} {state} bundles={self.size} claims={len(self._claims)}>"

    async def __aenter__(self) -> Reservation:
        if self._open or self._closed:
            raise ExecutorStateError("a Reservation is entered once")
        cluster = self.cluster
        await cluster.connect(self.address)
        t0 = time.perf_counter()
        bundles = [dict(self.resources) for _ in range(self.size)]
        # bounded by the seam: placing is a request (see Cluster's bounds)
        with anyio.CancelScope(shield=True):  # once made, it must be known to be removed
            made = await cluster.place(bundles, self.strategy, None, self.log)
        assert made is not None  # a Ray cluster's placement
        placement: Placement = made
        self._placement = placement
        try:
            await cluster.wait_placed(placement, self.placement_timeout_s)
            nodes = await cluster.bundle_nodes(placement)
        except BaseException:
            # bounded by the seam: a release is a request (see Cluster's bounds)
            with anyio.CancelScope(shield=True):
                await cluster.release(placement)
            self._closed = True
            raise
        self._order = order_workers(nodes, [{} for _ in nodes], await cluster.driver_node())
        self._nodes = [nodes[b] for b in self._order]
        self._open = True
        self.log.info(
            "reservation_ready", bundles=self.size, seconds=round(time.perf_counter() - t0, 3)
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Remove the placement group (Ray kills any worker still in it: close the executors
        first). Shielded and idempotent."""
        if self._closed:
            return
        self._closed = True
        self._open = False
        if self._claims:
            self.log.warning(
                "reservation_closed_with_claims", owners=[c.owner for c in self._claims]
            )
        placement = self._placement
        if placement is not None:
            # bounded by the seam: a release is a request (see Cluster's bounds)
            with anyio.CancelScope(shield=True):
                await self.cluster.release(placement)
        self.log.info("reservation_closed")

    # Claims -----------------------------------------------------------------------------------

    def claim(self, owner: str, count: int, resources: Mapping[str, float]) -> Claim:
        """Claim ``resources`` on each of the first ``count`` bundles for ``owner``.

        Raises:
            ExecutorStateError: the reservation is not open.
            ConfigurationError: more workers than bundles, a resource the bundles do not hold,
                or a bundle that the claims together would overfill (named, with what is left).
        """
        if not self._open:
            state = "closed" if self._closed else "not entered: use `async with Reservation(...)`"
            raise ExecutorStateError(f"the reservation {self.name!r} is {state}")
        wanted = {k: float(v) for k, v in resources.items() if v > 0}
        if count > self.size:
            raise ConfigurationError(
                f"{owner} needs {count} bundles of the reservation {self.name!r}, "
                f"which has {self.size}"
            )
        missing = sorted(k for k in wanted if k not in self.resources)
        if missing:
            raise ConfigurationError(
                f"{owner} asks for {missing} per worker, which the bundles of the reservation "
                f"{self.name!r} do not hold ({self.resources})"
            )
        free = self._free(0)  # the first bundle is used by every claim: the fullest
        over = {k: v for k, v in wanted.items() if v > free.get(k, 0.0) + PRECISION / 2}
        if over:
            others = ", ".join(f"{c.owner} {dict(c.resources)}" for c in self._claims) or "none"
            raise ConfigurationError(
                f"{owner} asks for {wanted} per worker, but each bundle of the reservation "
                f"{self.name!r} holds {self.resources} and has {free} left (claims on it: "
                f"{others})"
            )
        claim = Claim(owner, count, wanted)
        self._claims.append(claim)
        return claim

    def release(self, claim: Claim) -> None:
        """Give a claim back (idempotent)."""
        if claim in self._claims:
            self._claims.remove(claim)

    def _free(self, slot: int) -> dict[str, float]:
        free = dict(self.resources)
        for c in self._claims:
            if slot < c.count:
                for k, v in c.resources.items():
                    free[k] = free.get(k, 0.0) - v
        return {k: round(v, 4) for k, v in free.items()}

    def placement(self, bundles: list[dict[str, float]]) -> Placement:
        """Where the workers of a claim go: worker i on the bundle of slot i."""
        if not self._open or self._placement is None:
            raise ExecutorStateError(f"the reservation {self.name!r} is closed")
        return self._placement.within(bundles, self._order[: len(bundles)])

    def statistics(self) -> ReservationStatistics:
        """Bundles, claims, what each bundle has left, and each bundle's node."""
        return ReservationStatistics(
            bundles=self.size,
            claims=tuple((c.owner, c.count) for c in self._claims),
            free=tuple(self._free(i) for i in range(self.size)),
            nodes=tuple(self._nodes),
        )
