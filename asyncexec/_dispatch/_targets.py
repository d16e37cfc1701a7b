"""Where a call goes: every rank, a mesh of named axes, one given rank, or the least loaded
rank; and the load that chooses it. Pure: no Ray here."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from .._errors import ConfigurationError

__all__ = [
    "ALL",
    "AllRanks",
    "LeastLoaded",
    "Load",
    "Mesh",
    "OneRank",
    "Target",
    "fewest",
    "least_loaded",
    "rank",
]


@dataclass(frozen=True)
class AllRanks:
    """Every rank, with the same arguments (or its part of scattered ones); the results in rank
    order. The default target, :data:`ALL`."""

    def __repr__(self) -> str:
        return "ALL"


#: Every rank: ``call(fn, ...)``'s default target.
ALL: Final = AllRanks()


@dataclass(frozen=True)
class OneRank:
    """One given rank (see :func:`rank`)."""

    rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ConfigurationError(
                f"rank() takes a rank (an int of at least 0), got {self.rank!r}"
            )


def rank(i: int) -> OneRank:
    """Target one given rank: the call returns its result (not a list).

    Raises:
        ConfigurationError: ``i`` is not an int of at least 0 (a rank past the world size is
            refused when the call is planned).
    """
    return OneRank(i)


@dataclass(frozen=True)
class LeastLoaded:
    """One rank chosen by load (see :func:`least_loaded`)."""

    max_in_flight: int | None = None
    retry: bool = False

    def __post_init__(self) -> None:
        cap = self.max_in_flight
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ConfigurationError(
                f"least_loaded(max_in_flight=...) takes a positive int or None, got {cap!r}"
            )
        if not isinstance(self.retry, bool):
            raise ConfigurationError(f"least_loaded(retry=...) takes a bool, got {self.retry!r}")


def least_loaded(max_in_flight: int | None = None, retry: bool = False) -> LeastLoaded:
    """Target one rank: the one with the fewest of this executor's calls in flight (the lowest
    rank on ties). The call returns its result (not a list).

    Args:
        max_in_flight: the most calls a rank may have in flight; while every rank has that
            many, the call waits. None for no cap.
        retry: the call is idempotent: when the chosen rank dies, it is sent again to another
            live rank.

    Raises:
        ConfigurationError: ``max_in_flight`` is not a positive int or None.
    """
    return LeastLoaded(max_in_flight, retry)


class Mesh:
    """Named axes over the ranks, row-major: the last axis varies fastest. With
    ``{"dp": 2, "tp": 2}``, rank 1 is dp=0, tp=1 and rank 2 is dp=1, tp=0.

    As a call's target: every rank is called; ``scatter(value, axis="dp")`` splits into ``dp``
    parts, each replicated along the other axes, and a scatter without an axis splits over
    every rank. The product of the sizes must equal the world size when the call is planned.

    Args:
        axes: each axis' name and size, outermost first.
        collect: the coordinates whose ranks' results are returned (``{"tp": 0}``: the ranks
            at tp=0, in order of their other coordinates); None for every rank's.

    Raises:
        ConfigurationError: no axes, a size that is not a positive int, or a ``collect`` that
            names an unknown axis or a coordinate outside it.
    """

    __slots__ = ("_axes", "_collect", "_strides", "size")

    def __init__(self, axes: Mapping[str, int], *, collect: Mapping[str, int] | None = None):
        if not isinstance(axes, Mapping) or not axes:
            raise ConfigurationError(f"Mesh() takes a mapping of axis sizes, got {axes!r}")
        for name, size in axes.items():
            if not isinstance(name, str) or not name:
                raise ConfigurationError(f"Mesh(): an axis name is a non-empty str, got {name!r}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigurationError(
                    f"Mesh(): axis {name!r} has size {size!r}; a size is a positive int"
                )
        self._axes = dict(axes)
        strides, stride = {}, 1
        for name in reversed(self._axes):
            strides[name] = stride
            stride *= self._axes[name]
        self._strides = strides
        self.size: int = stride
        self._collect = None if collect is None else self._checked(dict(collect), "collect")

    def _checked(self, fixed: dict[str, int], what: str) -> dict[str, int]:
        for name, coord in fixed.items():
            if name not in self._axes:
                raise ConfigurationError(
                    f"Mesh {what}: no axis {name!r} (axes: {', '.join(self._axes)})"
                )
            size = self._axes[name]
            if not isinstance(coord, int) or isinstance(coord, bool) or not 0 <= coord < size:
                raise ConfigurationError(
                    f"Mesh {what}: {name}={coord!r} is outside the axis (0 to {size - 1})"
                )
        return fixed

    @property
    def axes(self) -> dict[str, int]:
        """Each axis' name and size, outermost first (a copy)."""
        return dict(self._axes)

    @property
    def collect(self) -> dict[str, int] | None:
        """The coordinates whose ranks' results are returned; None for every rank's."""
        return None if self._collect is None else dict(self._collect)

    def coord(self, r: int, axis: str) -> int:
        """Rank ``r``'s coordinate on ``axis``."""
        return (r // self._strides[axis]) % self._axes[axis]

    def coords(self, r: int) -> dict[str, int]:
        """Rank ``r``'s coordinates.

        Raises:
            ConfigurationError: ``r`` is not a rank of the mesh.
        """
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.size:
            raise ConfigurationError(f"Mesh: {r!r} is not a rank of {self!r}")
        return {name: self.coord(r, name) for name in self._axes}

    def ranks(self, **fixed: int) -> list[int]:
        """The ranks at the given coordinates, in rank order (every rank with none given).

        Raises:
            ConfigurationError: an unknown axis, or a coordinate outside its axis.
        """
        self._checked(fixed, "ranks()")
        return [
            r
            for r in range(self.size)
            if all(self.coord(r, name) == c for name, c in fixed.items())
        ]

    def collected(self) -> list[int]:
        """The ranks whose results a call returns, in rank order."""
        return self.ranks(**(self._collect or {}))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return list(self._axes.items()) == list(other._axes.items()) and (
            self._collect == other._collect
        )

    def __hash__(self) -> int:
        return hash((tuple(self._axes.items()), tuple(sorted((self._collect or {}).items()))))

    def __repr__(self) -> str:
        collect = "" if self._collect is None else f", collect={self._collect!r}"
        return f"Mesh({self._axes!r}{collect})"


#: Where a call goes: ``on=`` of ``call()`` and ``stream()``.
Target = AllRanks | Mesh | LeastLoaded | OneRank


def fewest(
    counts: Sequence[int], cap: int | None = None, exclude: Collection[int] = ()
) -> int | None:
    """Least-loaded with a cap, the one choice of the dispatcher's :class:`Load` and the
    router's servers: the index with the fewest in flight (the lowest on ties), leaving out
    ``exclude`` and those at ``cap``; None when none is left."""
    best: int | None = None
    for r, count in enumerate(counts):
        if r in exclude or (cap is not None and count >= cap):
            continue
        if best is None or count < counts[best]:
            best = r
    return best


class Load:
    """This executor's calls in flight on each rank of one live group: what
    :func:`least_loaded` chooses by. Pure bookkeeping, from one event loop.

    A restarted or resized group gets a fresh one; a call in flight on the old group finishes
    on the load it started on.
    """

    __slots__ = ("_counts",)

    def __init__(self, world_size: int) -> None:
        self._counts = [0] * world_size

    def choose(
        self, max_in_flight: int | None = None, *, exclude: Collection[int] = ()
    ) -> int | None:
        """The rank with the fewest calls in flight (the lowest on ties), leaving out
        ``exclude`` (dead ranks) and ranks at ``max_in_flight``; None when no rank is left."""
        return fewest(self._counts, max_in_flight, exclude)

    def started(self, r: int) -> None:
        """A call was sent to rank ``r``."""
        self._counts[r] += 1

    def finished(self, r: int) -> None:
        """A call on rank ``r`` ended (returned, raised, or was abandoned).

        Raises:
            ValueError: rank ``r`` has no call in flight (a bookkeeping error).
        """
        if self._counts[r] == 0:
            raise ValueError(f"rank {r} has no call in flight")
        self._counts[r] -= 1

    def in_flight(self, r: int) -> int:
        """Calls in flight on rank ``r``."""
        return self._counts[r]

    @property
    def counts(self) -> tuple[int, ...]:
        """Calls in flight per rank, in rank order."""
        return tuple(self._counts)

    def __repr__(self) -> str:
        return f"<Load in flight {self._counts}>"
