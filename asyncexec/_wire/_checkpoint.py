"""Checkpoints: a directory of files, persisted under the run's storage path, and the book of
which ones a run keeps.

Runs on both sides: workers persist what they report (before the report enters their buffer, so
a step is never yielded ahead of its checkpoint), the driver keeps the latest and prunes old ones
(:class:`CheckpointBook`).
"""

from __future__ import annotations

import filecmp
import math
import numbers
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "Checkpoint",
    "CheckpointBook",
    "filesystem",
    "is_uri",
    "join_path",
    "persist_directory",
    "remove_directory",
]


def is_uri(path: str) -> bool:
    """Whether ``path`` names a location on a filesystem that fsspec reaches (``s3://...``)."""
    return "://" in path


def join_path(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URI."""
    if is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def filesystem(uri: str) -> tuple[Any, str]:
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
            raise _missing(self._path)
        yield self._path

    def to_directory(self, destination: str | os.PathLike[str]) -> str:
        """Copy the files into ``destination`` (created if needed) and return its path. A file
        already there under the same name is overwritten; other files there are left."""
        if is_uri(self._path):
            fs, root = filesystem(self._path)
            if not fs.isdir(root):
                raise _missing(self._path)
            for remote in fs.find(root):
                target = Path(destination) / os.path.relpath(remote, root)
                target.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(remote, os.fspath(target))
            return os.fspath(destination)
        if not os.path.isdir(self._path):
            raise _missing(self._path)
        # A plain copy, as the remote branch's: persist_directory's refusal of a file that
        # differs guards the ranks of one step, not a user's copy over an older one.
        src, dst = Path(self._path), Path(destination)
        if src.resolve() != dst.resolve():
            dst.mkdir(parents=True, exist_ok=True)
            for relative, is_dir in _walk(src):
                if is_dir:
                    (dst / relative).mkdir(exist_ok=True)
                else:
                    shutil.copy2(src / relative, dst / relative)
        return os.fspath(destination)

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


def _missing(path: str) -> FileNotFoundError:
    """A checkpoint whose files are gone: the error names the ways that happens, and how to
    avoid each. Read after its executor closed, most likely those of an unnamed run; read by a
    worker while the run goes on (a restart's ``get_checkpoint()``), most likely a local
    storage path that the workers' nodes do not share."""
    return FileNotFoundError(
        f"checkpoint directory does not exist: {path!r}: it was deleted, or written on another "
        "node's disk. The checkpoints of an unnamed run are removed when its executor closes "
        "(name the run, run(..., name=...), keep them with CheckpointConfig(keep_runs=True), or "
        "copy one with to_directory() while the executor is open); CheckpointConfig(num_to_keep"
        "=N) removes older ones; and a local storage_path must be a folder that every node of "
        "the workers shares (or a URI that fsspec reaches)"
    )


def persist_directory(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> str:
    """Copy a local directory's files into ``destination`` (a local path or an fsspec URI),
    merging with what is there.

    Several ranks may report a checkpoint for the same step; their files land in one directory.
    A file that another rank already wrote under the same name is fine when its bytes are the
    same (every rank saving the same replicated weights); when they differ the report is refused,
    never silently overwritten: name each rank's files apart (``rank_{rank}.pt``) or let one rank
    write them. Each file is written next to the destination and linked into place, so a reader
    never sees a half-written file. A symbolic link is copied as what it points to (see
    :func:`_walk`). On a remote ``destination`` none of this is atomic (an object store cannot
    create a file only if it is absent): ranks that write different files of one name at the
    same moment may both pass the check, and the last one written stays.

    Raises:
        FileExistsError: a file of the same name and different content is already there.
    """
    src = Path(source)
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint directory does not exist: {os.fspath(source)!r}")
    if is_uri(os.fspath(destination)):
        fs, root = filesystem(os.fspath(destination))
        for relative, is_dir in _walk(src):
            if not is_dir:
                item = src / relative
                remote = f"{root.rstrip('/')}/{relative.as_posix()}"
                if fs.exists(remote):
                    if fs.cat_file(remote) != item.read_bytes():
                        raise _collision(remote)
                    continue
                fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(os.fspath(item), remote)
        return os.fspath(destination)
    dst = Path(destination)
    if src.resolve() == dst.resolve():
        return os.fspath(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for relative, is_dir in _walk(src):
        item, target = src / relative, dst / relative
        if is_dir:
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        # Unique to this writer: ranks of a local executor share a process.
        writer = f"{os.getpid()}.{threading.get_ident()}"
        partial = target.with_name(f".{target.name}.{writer}.partial")
        try:
            shutil.copy2(item, partial)  # removed below also when it fails (a full disk)
            os.link(partial, target)  # atomic, and fails if another rank got there first
        except FileExistsError:
            if not filecmp.cmp(partial, target, shallow=False):
                raise _collision(target) from None
        finally:
            partial.unlink(missing_ok=True)
    return os.fspath(dst)


def _walk(root: Path) -> Iterator[tuple[Path, bool]]:
    """The folders and files under ``root``, each as its path relative to ``root`` and whether
    it is a folder, a folder before what it holds.

    A symbolic link is taken for what it points to, as ``shutil.copytree`` takes it: a linked
    folder's files are part of the checkpoint (``Path.rglob`` does not enter linked folders, and
    copies made with it dropped those files without a word). A link to a folder that holds it
    (a cycle) is left out.
    """

    def walk(directory: Path, relative: Path, above: frozenset[str]) -> Iterator[tuple[Path, bool]]:
        with os.scandir(directory) as scan:
            entries = sorted(scan, key=lambda e: e.name)
        for entry in entries:
            path = relative / entry.name
            if not entry.is_dir():  # a file, or a link to one (or a broken link: copying fails)
                yield path, False
                continue
            real = os.path.realpath(entry.path)
            if real in above:
                continue
            yield path, True
            yield from walk(Path(entry.path), path, above | {real})

    yield from walk(root, Path(), frozenset({os.path.realpath(root)}))


def _collision(target: Path | str) -> FileExistsError:
    return FileExistsError(
        f"checkpoint file {os.fspath(target)!r} was already written by another rank for this "
        "step with different content; give each rank's files their own names, or report the "
        "files from one rank only"
    )


def remove_directory(path: str) -> None:
    """Delete a persisted checkpoint (local or remote); a missing one (or a part of it that
    went meanwhile) is fine.

    Raises:
        OSError: a file or folder of it could not be deleted (a local one's error, as a remote
            filesystem raises its own: the callers log it; ignoring it left folders that
            ``num_to_keep`` had dropped, or an earlier run's files, without a word).
    """
    if is_uri(path):
        fs, root = filesystem(path)
        if fs.exists(root):
            fs.rm(root, recursive=True)
    elif sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_missing_is_fine)
    else:
        shutil.rmtree(path, onerror=lambda f, p, info: _missing_is_fine(f, p, info[1]))


def _missing_is_fine(function: Any, path: str, error: BaseException) -> None:
    if not isinstance(error, FileNotFoundError):
        raise error


class CheckpointBook:
    """Which of a run's persisted checkpoints are kept. Pure.

    Every checkpoint is kept unless ``num_to_keep`` is set; then the ``num_to_keep`` most recent,
    or the best by ``score_attribute`` (rank 0's metric, ``score_order`` ``"max"`` or
    ``"min"``), and always the latest, so that a restart can resume from it.

    Of each checkpoint's metrics it holds the score only (``{score_attribute: value}``, or
    ``{}``): the book lives as long as the run, and every kept checkpoint's whole metrics (all
    of them, without ``num_to_keep``) grew the driver's memory with the run's length.
    """

    def __init__(
        self, num_to_keep: int | None, score_attribute: str | None, score_order: str
    ) -> None:
        self.num_to_keep = num_to_keep
        self.score_attribute = score_attribute
        self.sign = 1.0 if score_order == "max" else -1.0
        self.kept: list[tuple[Checkpoint, Any]] = []

    def add(self, checkpoint: Checkpoint, metrics: Any) -> list[str]:
        """Record ``checkpoint`` (reported with rank 0's ``metrics``); return the paths of the
        checkpoints that are no longer kept."""
        score = self.score_attribute
        value = metrics.get(score) if score is not None and isinstance(metrics, dict) else None
        self.kept.append((checkpoint, {} if value is None else {score: value}))
        keep = self.num_to_keep
        if keep is None or len(self.kept) <= keep:
            return []
        latest = self.kept[-1]
        if self.score_attribute is None:
            chosen = self.kept[-keep:]
        else:
            ranked = sorted(self.kept, key=lambda c: self._score(c[1]), reverse=True)
            chosen = ranked[:keep]
            if latest not in chosen:
                chosen.append(latest)
        dropped = [c[0].path for c in self.kept if c not in chosen]
        self.kept = [c for c in self.kept if c in chosen]
        return dropped

    def _score(self, metrics: Any) -> float:
        """Higher is better; a missing, non-numeric or NaN score is the worst (a NaN, a loss that
        diverged, compares false with everything: sorting by it dropped the best checkpoints).
        Any real number counts, numpy's scalars (``np.float32``) included."""
        value = metrics.get(self.score_attribute) if isinstance(metrics, dict) else None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            score = float(value)
            if not math.isnan(score):
                return self.sign * score
        return float("-inf")
