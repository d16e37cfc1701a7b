"""What a weight channel emits (``Observer.emit``): one typed record per event, at the one place
it happens; ``_sinks`` turns each into the metrics', the log's and the timeline's forms."""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "ChannelClosed",
    "PushEnded",
    "PushFailed",
    "RanksJoined",
    "VersionInstalled",
    "VersionRead",
]


class VersionRead(NamedTuple):
    """Version ``version`` was read from the source; each target rank holds the version in
    ``held`` (``(rank, version)``, 0: none yet) until it installs this one."""

    version: int
    held: tuple[tuple[int, int], ...]


class VersionInstalled(NamedTuple):
    """Target rank ``rank`` installed ``version``; the channel's latest is ``latest``."""

    rank: int
    version: int
    latest: int


class PushEnded(NamedTuple):
    """Version ``version`` is installed on every target rank, ``seconds`` after its read
    began."""

    version: int
    seconds: float


class PushFailed(NamedTuple):
    """Reading or delivering ``version`` failed (``error``: why)."""

    version: int
    error: str


class RanksJoined(NamedTuple):
    """Target ranks ``ranks`` joined after a restart and get ``version``."""

    ranks: tuple[int, ...]
    version: int


class ChannelClosed(NamedTuple):
    """The channel closed at version ``version``: nothing more comes from it."""

    version: int
