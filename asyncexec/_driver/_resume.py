"""Runs that resume after the driver dies: a named run's record under its storage path.

A run started with ``name=`` keeps a small JSON record in its folder (``<storage>/<name>/``, where
its checkpoints are too): the latest checkpoint, how many steps the stream has delivered, the
attempt, the config's fingerprint and the run's status. It is written when a checkpoint becomes
the latest, every :data:`RECORD_INTERVAL_S` while steps flow, and when the run ends, atomically
(a temporary file renamed over the record). A new driver process that starts a run of
the same name and storage reads it and resumes: from the latest checkpoint, with the step index
going on from the recorded count and the attempt number from the recorded attempt.

The workers of a dead driver are not this module's concern: Ray owns non-detached actors by the
driver that created them and kills them when it dies.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from .._checkpoint import _filesystem, is_uri, join_path
from .._errors import ConfigurationError, ExecutorStateError

__all__ = [
    "RECORD_FILE",
    "RECORD_INTERVAL_S",
    "Resume",
    "RunRecord",
    "check_name",
    "decide",
    "fingerprint",
    "load_record",
    "save_record",
]

Resume = Literal["auto", "never", "force"]
RECORD_FILE = "asyncexec_run.json"
#: The longest the recorded step count lags the stream while steps flow without checkpoints.
RECORD_INTERVAL_S = 0.1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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


def fingerprint(config_bytes: bytes) -> str:
    """The fingerprint of a pickled config (a resumed run must be given the same config)."""
    return hashlib.sha256(config_bytes).hexdigest()[:16]


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
            fs, root = _filesystem(path)
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
        fs, root = _filesystem(path)
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


def decide(
    record: RunRecord | None, name: str, fingerprint: str, resume: Resume
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
    if record.fingerprint != fingerprint and resume != "force":
        raise ConfigurationError(
            f"run {name!r} was started with another config (fingerprint {record.fingerprint}, "
            f"now {fingerprint}); resume='force' resumes it anyway, resume='never' starts over"
        )
    return record
