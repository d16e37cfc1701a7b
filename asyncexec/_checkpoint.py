"""Checkpoints: a directory of files, persisted under the run's storage path.

Runs on both sides: workers persist what they report (before the report enters their buffer, so
a step is never yielded ahead of its checkpoint), the driver keeps the latest and prunes old ones.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["Checkpoint", "is_uri", "join_path", "persist_directory", "remove_directory"]


def is_uri(path: str) -> bool:
    """Whether ``path`` names a location on a filesystem that fsspec reaches (``s3://...``)."""
    return "://" in path


def join_path(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URI."""
    if is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def _filesystem(uri: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - checked when the executor is configured
        raise RuntimeError(f"storage at {uri!r} needs fsspec: pip install fsspec") from exc
    fs, root = fsspec.core.url_to_fs(uri)
    return fs, str(root)


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
        """Yield a local directory that holds the checkpoint's files (a temporary copy when the
        checkpoint is on a remote filesystem)."""
        if is_uri(self._path):
            with tempfile.TemporaryDirectory(prefix="asyncexec-checkpoint-") as local:
                yield self.to_directory(local)
            return
        if not os.path.isdir(self._path):
            raise FileNotFoundError(f"checkpoint directory does not exist: {self._path!r}")
        yield self._path

    def to_directory(self, destination: str | os.PathLike[str]) -> str:
        """Copy the files into ``destination`` (created if needed) and return its path."""
        if is_uri(self._path):
            fs, root = _filesystem(self._path)
            if not fs.isdir(root):
                raise FileNotFoundError(f"checkpoint directory does not exist: {self._path!r}")
            for remote in fs.find(root):
                target = Path(destination) / os.path.relpath(remote, root)
                target.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(remote, os.fspath(target))
            return os.fspath(destination)
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
    """Copy a local directory's files into ``destination`` (a local path or an fsspec URI),
    merging with what is there.

    Several ranks may report a checkpoint for the same step; their files land in one directory.
    The copy is written next to the destination and moved into place file by file, so a reader
    never sees a half-written file.
    """
    src = Path(source)
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint directory does not exist: {os.fspath(source)!r}")
    if is_uri(os.fspath(destination)):
        fs, root = _filesystem(os.fspath(destination))
        for item in src.rglob("*"):
            if item.is_file():
                remote = f"{root.rstrip('/')}/{item.relative_to(src).as_posix()}"
                fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(os.fspath(item), remote)
        return os.fspath(destination)
    dst = Path(destination)
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


def remove_directory(path: str) -> None:
    """Delete a persisted checkpoint (local or remote); a missing one is fine."""
    if is_uri(path):
        fs, root = _filesystem(path)
        if fs.exists(root):
            fs.rm(root, recursive=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
