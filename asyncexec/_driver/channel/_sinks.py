"""The sinks of a weight channel's events (``_events``): its metrics (``_metrics``), its log
lines and its install spans on the target's timeline. An observer made by
:func:`channel_observer` holds them in that order."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..._timeline._timeline import Timeline, installed
from .._observe import Handler, Observer
from ._events import (
    ChannelClosed,
    PushEnded,
    PushFailed,
    RanksJoined,
    VersionInstalled,
    VersionRead,
)
from ._metrics import ChannelMeters

__all__ = ["ChannelLog", "ChannelMetrics", "ChannelTimeline", "channel_observer"]


class ChannelMetrics:
    """Push seconds, failed pushes, and each target rank's version lag (the series of a rank
    that a push does not reach, one that left the target's group, go at that push)."""

    def __init__(self, meters: ChannelMeters) -> None:
        self.meters = meters
        self.ranks: set[int] = set()  # the target ranks with a lag series
        meters.zero()

    def handlers(self) -> Mapping[type, Handler]:
        return {
            VersionRead: self._read,
            VersionInstalled: self._installed,
            PushEnded: self._ended,
            PushFailed: self._failed,
            ChannelClosed: self._closed,
        }

    def _read(self, event: VersionRead) -> None:
        for rank, held in event.held:
            self._lag(rank, event.version - held)
        # The ranks the push does not reach left the target (its group shrank or closed):
        # their series go, or they would be shown at their last lag for ever.
        left = self.ranks.difference(rank for rank, _ in event.held)
        if left:
            self.meters.forget(left)
            self.ranks -= left

    def _installed(self, event: VersionInstalled) -> None:
        self._lag(event.rank, event.latest - event.version)

    def _lag(self, rank: int, versions: int) -> None:
        self.ranks.add(rank)
        self.meters.lag(rank, versions)

    def _closed(self, event: ChannelClosed) -> None:
        self.meters.forget(self.ranks)
        self.ranks.clear()

    def _ended(self, event: PushEnded) -> None:
        self.meters.pushed(event.seconds)

    def _failed(self, event: PushFailed) -> None:
        self.meters.failed()


class ChannelLog:
    """The channel's log lines of failed pushes and joining ranks."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def handlers(self) -> Mapping[type, Handler]:
        return {PushFailed: self._failed, RanksJoined: self._joined}

    def _failed(self, event: PushFailed) -> None:
        self.log.warning("push_failed", version=event.version, error=event.error)

    def _joined(self, event: RanksJoined) -> None:
        self.log.info("ranks_join", ranks=list(event.ranks), version=event.version)


class ChannelTimeline:
    """Each target rank's install span on the target's timeline (when it keeps one: the
    target's group may change, so its timeline is looked up at each event)."""

    def __init__(self, timeline: Callable[[], Timeline | None]) -> None:
        self.timeline = timeline

    def handlers(self) -> Mapping[type, Handler]:
        return {VersionInstalled: self._installed}

    def _installed(self, event: VersionInstalled) -> None:
        installed(self.timeline(), event.rank, event.version)


def channel_observer(target: str, log: Any, timeline: Callable[[], Timeline | None]) -> Observer:
    """A channel's observer: its metrics (by the target executor's name ``target``), log and
    the target's timeline."""
    return Observer(
        ChannelMetrics(ChannelMeters(target)), ChannelLog(log), ChannelTimeline(timeline)
    )
