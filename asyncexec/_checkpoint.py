"""Checkpoints: a directory of files, persisted under the run's storage path.

Runs on both sides: workers persist what they report (before the report enters their buffer, so
a step is never yielded ahead of its checkpoint), the driver keeps the latest and prunes old ones.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["Checkpoint", "persist_directory"]


class Checkpoint:
    """A directory of files that a worker reported, or that a run starts from.

    Create one with :meth:`from_directory` in the worker and pass it to
    :func:`asyncexec.report`; asyncexec copies the files under the run's storage path, and the
    :class:`Step` that carries it (and ``get_checkpoint()`` on the workers of a later attempt)
    refers to that persisted copy.
    """

    __slots__ = ("_path",)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Refer to an existing directory.

        Raises:
            FileNotFoundError: the directory does not exist.
        """
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory does not exist: {os.fspath(path)!r}")
        return cls(path)

    @property
    def path(self) -> str:
        """Where the files are."""
        return self._path

    @contextmanager
    def as_directory(self) -> Iterator[str]:
        """Yield a local directory that holds the checkpoint's files."""
        if not os.path.isdir(self._path):
            raise FileNotFoundError(f"checkpoint directory does not exist: {self._path!r}")
        yield self._path

    def to_directory(self, destination: str | os.PathLike[str]) -> str:
        """Copy the files into ``destination`` (created if needed) and return its path."""
        return persist_directory(self._path, destination)

    def __fspath__(self) -> str:
        return self._path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other._path == self._path

    def __hash__(self) -> int:
        return hash(self._path)

    def __repr__(self) -> str:
        return f"Checkpoint({self._path!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Checkpoint, (self._path,))


def persist_directory(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> str:
    """Copy a directory's files into ``destination``, merging with what is there.

    Several ranks may report a checkpoint for the same step; their files land in one directory.
    The copy is written next to the destination and moved into place file by file, so a reader
    never sees a half-written file.
    """
    src = Path(source)
    dst = Path(destination)
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint directory does not exist: {os.fspath(source)!r}")
    if src.resolve() == dst.resolve():
        return os.fspath(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.rglob("*"):
        target = dst / item.relative_to(src)
        if item.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        shutil.copy2(item, partial)
        os.replace(partial, target)
    return os.fspath(dst)
