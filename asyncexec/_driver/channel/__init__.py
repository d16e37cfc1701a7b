"""The weight channel: versions and deliveries (``_channel``), and its transports as classes
behind one protocol (``_transport``): the object store, and torch.distributed."""

from __future__ import annotations

from ._channel import ChannelStatistics, WeightChannel

__all__ = ["ChannelStatistics", "WeightChannel"]
