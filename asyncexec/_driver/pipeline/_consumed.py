"""The ids the learner consumed, kept compact for its checkpoints: a watermark (every integer id
below it is consumed) and the ids above it (and any id that is not an integer). Pure."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from ..._errors import ConfigurationError

__all__ = ["Consumed"]

_FORMAT = 1


class Consumed:
    """A set of consumed ids: integers below :attr:`watermark`, and :attr:`above`."""

    __slots__ = ("above", "version", "watermark")

    def __init__(self, watermark: int = 0, above: set[Hashable] | None = None, version: int = 0):
        self.watermark = watermark
        self.above: set[Hashable] = set(above or ())
        #: The learner's version (updates done) when the state was taken.
        self.version = version
        self._compact()

    def __repr__(self) -> str:
        return f"<Consumed below {self.watermark} and {len(self.above)} above, v={self.version}>"

    def __contains__(self, id: object) -> bool:
        if _is_int(id):
            return id < self.watermark or id in self.above  # type: ignore[operator]
        return id in self.above

    def __len__(self) -> int:
        return self.watermark + len(self.above)

    def add(self, id: Hashable) -> bool:
        """Add ``id``; False when it was already in."""
        if id in self:
            return False
        self.above.add(id)
        if id == self.watermark:
            self._compact()
        return True

    def _compact(self) -> None:
        while self.watermark in self.above and _is_int(self.watermark):
            self.above.discard(self.watermark)
            self.watermark += 1

    def state(self) -> dict[str, Any]:
        """A plain, picklable (and, for integer ids, JSON-able) record."""
        above = sorted((i for i in self.above if _is_int(i)), key=int)  # type: ignore[arg-type]
        others = [i for i in self.above if not _is_int(i)]
        return {
            "format": _FORMAT,
            "version": self.version,
            "watermark": self.watermark,
            "above": [*above, *others],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> Consumed:
        """The set that :meth:`state` recorded (empty for None).

        Raises:
            ConfigurationError: ``state`` is not such a record.
        """
        if state is None:
            return cls()
        try:
            if state["format"] != _FORMAT:
                raise ValueError(f"format {state['format']!r}")
            # A float, a bool or a negative number is no record's: taken as it is, it would
            # resume at a version or watermark that no pipeline wrote.
            for key in ("watermark", "version"):
                if not _is_int(state[key]) or state[key] < 0:
                    raise ValueError(f"{key} must be an int of at least 0, got {state[key]!r}")
            above = state["above"]
            if not isinstance(above, list | tuple | set | frozenset):
                raise TypeError(f"above must be a list of ids, got {above!r:.100}")
            return cls(state["watermark"], set(above), state["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"consumed= takes a Pipeline.state_dict() record, got {state!r:.200}: {exc}"
            ) from exc


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
