"""Runs that resume after the driver dies: a named run's record under its storage path.

A run started with ``name=`` keeps a small JSON record in its folder (``<storage>/<name>/``, where
its checkpoints are too): the latest checkpoint and the stream index of the step that carried it,
the checkpoints the run keeps (for ``CheckpointConfig``), how many steps the stream has
delivered, the attempt, the config's fingerprint and the run's status. It is written when a
checkpoint becomes the latest, every :data:`RECORD_INTERVAL_S` while steps flow, and when the run
ends, atomically (a temporary file renamed over the record). A new driver process that starts a
run of the same name and storage reads it and resumes: from the latest checkpoint, with the step
index going on from the step after it (so an index means the same work in both drivers: the
steps the dead driver delivered after its latest checkpoint are made and delivered again, with
the same indices), the attempt number going on from the recorded attempt, and the checkpoints
kept before still counted (and pruned) by ``CheckpointConfig``.

The config's fingerprint is taken of a canonical form of it (mappings and sets in a sorted order),
so that a config holding a set of strings, which pickles in an order that differs between
processes, is the same config in the new driver.

The workers of a dead driver are not this module's concern: Ray owns non-detached actors by the
driver that created them and kills them when it dies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from ..._errors import ConfigurationError, ExecutorStateError
from ..._wire._checkpoint import filesystem, is_uri, join_path
from ..cluster import dumps

__all__ = [
    "RECORD_FILE",
    "RECORD_INTERVAL_S",
    "Resume",
    "RunRecord",
    "check_name",
    "checkpoint_folders",
    "decide",
    "fingerprint",
    "legacy_fingerprint",
    "load_record",
    "save_record",
    "stray_checkpoints",
]

Resume = Literal["auto", "never", "force"]
RECORD_FILE = "asyncexec_run.json"
#: The longest the recorded step count lags the stream while steps flow without checkpoints.
RECORD_INTERVAL_S = 0.1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: A persisted checkpoint's folder (see ``_protocol.checkpoint_name``): its step index.
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)_a")


@dataclass(frozen=True)
class RunRecord:
    """What a named run keeps to resume after its driver dies."""

    name: str
    status: str  # "running", "finished", "failed" or "cancelled"
    steps: int  # the stream index of the next step (steps delivered so far)
    attempt: int  # the last attempt that started
    checkpoint: str | None  # the latest persisted checkpoint's path
    fingerprint: str  # of the config the run was started with
    updated: float = 0.0  # time.time() of the write
    #: The stream index of the step that carried ``checkpoint`` (None in records before it).
    checkpoint_index: int | None = None
    #: The checkpoints the run keeps, oldest first: [path, {score attribute: value}].
    kept: list[list[Any]] = field(default_factory=list)

    def resume_index(self) -> int:
        """The stream index of the step after the latest checkpoint (0 without one)."""
        if self.checkpoint is None:
            return 0
        if self.checkpoint_index is not None:
            return self.checkpoint_index + 1
        match = _CHECKPOINT_DIR.match(os.path.basename(self.checkpoint.rstrip("/")))
        return int(match.group(1)) + 1 if match else self.steps

    def advanced(self, **changes: Any) -> RunRecord:
        return replace(self, updated=time.time(), **changes)


def check_name(name: object) -> str:
    """A run name is a folder name: letters, digits, ``.``, ``_`` and ``-``.

    Raises:
        ConfigurationError: naming the problem.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"a run name is 1-128 letters, digits, '.', '_' or '-' (not starting with '.', "
            f"'_' or '-'), got {name!r}"
        )
    return name


def fingerprint(config: Any) -> str:
    """The fingerprint of a run's config (a resumed run must be given the same config), taken of
    its canonical form: the same in every process."""
    return hashlib.sha256(dumps(_canonical(config))).hexdigest()[:16]


def legacy_fingerprint(config: Any) -> str:
    """The fingerprint records written before the canonical form hold (of the pickled config)."""
    return hashlib.sha256(dumps(config)).hexdigest()[:16]


def _canonical(value: Any) -> Any:
    """``value`` with every mapping and set in a sorted order (of the items' reprs), containers
    and dataclasses walked; anything else as it is (it pickles the same way everywhere)."""
    if value is None or isinstance(value, str | bytes | int | float | complex):
        return value
    if isinstance(value, Mapping):
        items = [(_canonical(k), _canonical(v)) for k, v in value.items()]
        return ("mapping", type(value).__qualname__, sorted(items, key=repr))
    if isinstance(value, set | frozenset):
        return ("set", type(value).__qualname__, sorted((_canonical(v) for v in value), key=repr))
    if isinstance(value, list | tuple):
        return (type(value).__qualname__, [_canonical(v) for v in value])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, _canonical(getattr(value, f.name))) for f in dataclasses.fields(value)]
        return ("dataclass", type(value).__module__, type(value).__qualname__, fields)
    return value


def _record_path(storage: str, name: str) -> str:
    return join_path(storage, name, RECORD_FILE)


def load_record(storage: str, name: str) -> RunRecord | None:
    """The record of run ``name`` under ``storage``, or None. Blocking: call it in a thread.

    Raises:
        ExecutorStateError: the record exists but cannot be read.
    """
    path = _record_path(storage, name)
    try:
        if is_uri(path):
            fs, root = filesystem(path)
            if not fs.exists(root):
                return None
            with fs.open(root, "r") as f:
                data = json.load(f)
        else:
            if not os.path.exists(path):
                return None
            with open(path) as f:
                data = json.load(f)
        return RunRecord(**data)
    except (OSError, ValueError, TypeError) as exc:
        message = f"the record of run {name!r} at {path} cannot be read: {exc}"
        raise ExecutorStateError(message) from exc


def save_record(storage: str, record: RunRecord) -> None:
    """Write the record atomically (a temporary file renamed over it). Blocking."""
    path = _record_path(storage, record.name)
    text = json.dumps(asdict(record), indent=1)
    if is_uri(path):
        fs, root = filesystem(path)
        fs.makedirs(root.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(root + ".tmp", "w") as f:
            f.write(text)
        fs.mv(root + ".tmp", root)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic against the driver's death (not against power loss)


def stray_checkpoints(storage: str, record: RunRecord) -> list[str]:
    """The checkpoint folders of a resumed run that its record neither keeps nor resumes from:
    those its dead driver had dropped but not yet deleted, and the partial ones of an attempt
    that failed. Empty for a record that does not list what it keeps (written before 0.2).
    Blocking: call it in a thread."""
    if record.checkpoint_index is None:
        return []
    keep = {path.rstrip("/") for path, _ in record.kept}
    if record.checkpoint is not None:
        keep.add(record.checkpoint.rstrip("/"))
    return [p for p in checkpoint_folders(storage, record.name) if p.rstrip("/") not in keep]


def checkpoint_folders(storage: str, name: str) -> list[str]:
    """The checkpoint folders of the run ``name`` under ``storage``, sorted. Blocking: call it
    in a thread."""
    folder = join_path(storage, name)
    if is_uri(folder):
        fs, root = filesystem(folder)
        scheme = folder.split("://", 1)[0]
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        paths = [f"{scheme}://{root.rstrip('/')}/{n}" for n in names]
    elif os.path.isdir(folder):
        paths = [os.path.join(folder, n) for n in os.listdir(folder)]
    else:
        paths = []
    return sorted(p for p in paths if _CHECKPOINT_DIR.match(p.rstrip("/").rsplit("/", 1)[-1]))


def decide(
    record: RunRecord | None, name: str, fingerprints: Collection[str], resume: Resume
) -> RunRecord | None:
    """The record to resume from, or None to start the run afresh. Pure.

    Raises:
        ConfigurationError: the run already finished (``resume="auto"``), or was started with
            another config (unless ``resume="force"``).
    """
    if record is None or resume == "never":
        return None
    if record.status == "finished":
        raise ConfigurationError(
            f"run {name!r} already finished ({record.steps} steps); give another name, or "
            "resume='never' to start it over"
        )
    if record.fingerprint not in fingerprints and resume != "force":
        now = next(iter(fingerprints), "")
        raise ConfigurationError(
            f"run {name!r} was started with another config (fingerprint {record.fingerprint}, "
            f"now {now}); resume='force' resumes it anyway, resume='never' starts over"
        )
    return record
