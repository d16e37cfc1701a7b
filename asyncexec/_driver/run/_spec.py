"""What ``Executor.run()`` checks and prepares before anything starts: the function and its
config pickled once, the starting checkpoint, the buffer bound, datasets, a named run's fields."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..._dispatch._role import method_of
from ..._errors import ConfigurationError, describe
from ..._wire._checkpoint import Checkpoint, is_uri
from .._config import ExecutorConfig, validate_buffer_size
from ..cluster import dumps, validate_datasets
from ._resume import Resume, check_name, fingerprint, legacy_fingerprint

__all__ = ["RunSpec", "named_spec", "prepare", "run_spec"]


@dataclass(frozen=True)
class RunSpec:
    """What ``Executor.run()`` checked and prepared for the driver task."""

    payload: bytes  # the function and its config, pickled once
    checkpoint: Checkpoint | None
    buffer_size: int
    datasets: Any  # (prepared datasets, DataConfig) or None
    independent: bool = False  # ranks replaced on their own, an unaligned stream
    name: str | None = None  # a named run keeps a record to resume from (see _resume)
    resume: Resume = "auto"
    #: The config's fingerprint (then the form records written before 0.2 hold).
    fingerprints: tuple[str, ...] = ()


def _as_checkpoint(value: Checkpoint | str | os.PathLike[str] | None) -> Checkpoint | None:
    if value is None:
        return None
    if isinstance(value, Checkpoint):
        path = value.path
    elif isinstance(value, str | os.PathLike):
        path = os.fspath(value)
    else:
        raise ConfigurationError(f"checkpoint must be a Checkpoint or a directory, got {value!r}")
    if not is_uri(path) and not Path(path).is_dir():
        raise ConfigurationError(f"checkpoint directory does not exist: {path!r}")
    return Checkpoint(path)


def run_spec(
    fn: Callable[..., Any],
    config: Any,
    checkpoint: Checkpoint | str | os.PathLike[str] | None,
    buffer_size: int,
    datasets: Mapping[str, Any] | None,
    data_config: Any,
    roles: Sequence[Any] = (),
) -> RunSpec:
    """Check what ``run()`` was given and prepare it for the driver task (``fn`` may be a
    method of one of ``roles``).

    Raises:
        ConfigurationError: anything invalid, named.
    """
    if not callable(fn):
        raise ConfigurationError(f"fn must be callable, got {fn!r}")
    # A role's method runs on each rank's instance (the worker turns the name into it).
    method = method_of(fn, roles) if roles else None
    payload = _pickle(method if method is not None else fn, config)
    start = _as_checkpoint(checkpoint)
    bound = validate_buffer_size(buffer_size)
    data = None
    if datasets is not None or data_config is not None:
        data = validate_datasets({} if datasets is None else datasets, data_config)
    return RunSpec(payload, start, bound, data)


def named_spec(spec: RunSpec, name: str | None, resume: Any, config: Any) -> RunSpec:
    """A named run's spec: its name, what to do with a previous record, and its config's
    fingerprint.

    Raises:
        ConfigurationError: a bad name or ``resume``, or ``resume`` without a name.
    """
    if resume not in ("auto", "never", "force"):
        raise ConfigurationError(f'resume must be "auto", "never" or "force", got {resume!r}')
    if name is None:
        raise ConfigurationError("resume= applies to a named run: give run(..., name=...)")
    check_name(name)
    return replace(
        spec,
        name=name,
        resume=resume,
        fingerprints=(fingerprint(config), legacy_fingerprint(config)),
    )


def _pickle(fn: Any, config: Any) -> bytes:
    """The function and its config, pickled once for every rank and attempt (on the loop: its
    cost is the one Ray's ``.remote()`` would pay per rank; a large state is better put in the
    object store and passed as a reference).

    Raises:
        ConfigurationError: either one cannot be pickled.
    """
    try:
        return bytes(dumps((fn, config)))
    except Exception as error:
        for what, value in (("fn", fn), ("config", config)):
            try:
                dumps(value)
            except Exception as exc:
                raise ConfigurationError(
                    f"{what} cannot be pickled to send to the workers: {describe(exc)}"
                ) from exc
        raise ConfigurationError(f"fn and config cannot be pickled: {describe(error)}") from error


def prepare(
    config: ExecutorConfig,
    backend: Any,
    fn: Callable[..., Any],
    run_config: Any,
    *,
    checkpoint: Checkpoint | str | os.PathLike[str] | None,
    buffer_size: int | None,
    datasets: Mapping[str, Any] | None,
    data_config: Any,
    name: str | None,
    resume: Any,
    independent: bool | None,
) -> RunSpec:
    """Everything ``Executor.run()`` checks before a run starts, and its spec.

    Raises:
        ConfigurationError: anything invalid, named (see ``Executor.run``).
    """
    bound = config.buffer_size if buffer_size is None else buffer_size
    if config.local and (datasets is not None or data_config is not None):
        raise ConfigurationError("a local executor takes no datasets: Ray Data needs Ray")
    spec = run_spec(fn, run_config, checkpoint, bound, datasets, data_config, config.roles)
    if name is not None or resume != "auto":
        spec = named_spec(spec, name, resume, run_config)
    if independent is None:
        independent = bool(backend is not None and backend.independent_ranks)
    if not independent:
        return spec
    if backend is not None and not backend.independent_ranks:
        raise ConfigurationError(
            f"the {backend.name} backend's ranks depend on each other: a run with it cannot be "
            "independent"
        )
    if spec.datasets is not None:
        raise ConfigurationError("a run of independent ranks does not take datasets")
    if config.elastic:
        raise ConfigurationError("an elastic executor does not run independent ranks")
    if spec.name is not None:
        raise ConfigurationError(
            f"a run of independent ranks cannot be named ({spec.name!r}): each rank resumes "
            "from its own checkpoint, and a named run's record holds one for the run"
        )
    return replace(spec, independent=True)
