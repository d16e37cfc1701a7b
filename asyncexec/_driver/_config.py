"""Validated, frozen configuration. Pure: no Ray here.

Everything the user passes to :class:`asyncexec.Executor` or ``run()`` is checked here, before
anything is started in the cluster, and refused with a :class:`ConfigurationError` that names
the argument and the value.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._errors import ConfigurationError
from .._wire._pickle import dumps as pickled
from ._devices import DEVICE_KINDS

__all__ = [
    "LEGACY_OPTIONS",
    "LOCAL_ENV",
    "CheckpointConfig",
    "ExecutorConfig",
    "HealthChecks",
    "Timeouts",
    "grouped_options",
    "local_default",
    "check_address",
    "check_count",
    "check_positive",
    "check_stragglers",
    "validate_buffer_size",
    "validate_resources",
]

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

#: Reports a rank may have outstanding (reported, not yet taken by the consumer) by default,
#: wherever they are: in the worker, on the wire, in the driver. A rank learns what the consumer
#: took from its next poll, so it moves at most a window per round trip: 2048 is what keeps a
#: fast rank from waiting for credit (the batched floor's deque of 1024 has as many in flight:
#: 1024 waiting in the worker and 1024 travelling). A held-back window of tiny reports holds
#: about 0.5 MiB in the worker and 0.4 MiB in the driver per rank, of 1 KB reports 2.6 and
#: 1.6 MiB (benchmarks/report_window.py). An RL loop that bounds staleness sets it low.
DEFAULT_BUFFER_SIZE = 2048


#: The environment variable that makes executors local by default (``local=None``).
LOCAL_ENV = "ASYNCEXEC_LOCAL"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def local_default(local: object) -> bool:
    """``local`` as given, or (None) as ``ASYNCEXEC_LOCAL`` says.

    Raises:
        ConfigurationError: ``local`` is not a bool or None, or the variable is neither a
            true nor a false word.
    """
    if isinstance(local, bool):
        return local
    if local is not None:
        raise ConfigurationError(f"local must be True, False or None, got {local!r}")
    value = os.environ.get(LOCAL_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigurationError(
        f"{LOCAL_ENV} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}"
    )


def _is_number(value: object) -> bool:
    """A real number that a float holds and that is finite (no bool, NaN, infinity, or an int
    too large for a float)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def check_count(name: str, value: object, *, minimum: int = 1, allow_none: bool = False) -> None:
    """Refuse anything but an int (not a bool) of at least ``minimum`` (or None when allowed).

    Raises:
        ConfigurationError: naming ``name`` and the value.
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int of at least {minimum}"
        raise ConfigurationError(
            f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}"
        )


def check_positive(name: str, value: object, *, allow_none: bool = False) -> None:
    """Refuse anything but a positive finite number (not a bool), or None when allowed.

    Raises:
        ConfigurationError: naming ``name`` and the value.
    """
    if value is None and allow_none:
        return
    if not _is_number(value) or float(value) <= 0:  # type: ignore[arg-type]
        raise ConfigurationError(f"{name} must be a positive number, got {value!r}")


def validate_resources(resources: object) -> dict[str, float]:
    """Check a per-worker resource request and return it as a plain dict.

    Raises:
        ConfigurationError: not a mapping of names to non-negative finite numbers, no positive
            amount at all, or a fractional GPU amount above 1 (Ray cannot place it).
    """
    if not isinstance(resources, Mapping):
        raise ConfigurationError(
            f"resources_per_worker must be a mapping such as {{'CPU': 1}}, got {resources!r}"
        )
    out: dict[str, float] = {}
    for key, value in resources.items():
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"resources_per_worker has a key that is not a name: {key!r}")
        if not _is_number(value):
            raise ConfigurationError(
                f"resources_per_worker[{key!r}] must be a number, got {value!r}"
            )
        if value < 0:
            raise ConfigurationError(
                f"resources_per_worker[{key!r}] must not be negative, got {value!r}"
            )
        if key == "GPU" and value > 1 and float(value) != int(value):
            raise ConfigurationError(
                f"resources_per_worker['GPU'] above 1 must be a whole number, got {value!r}"
            )
        out[key] = float(value)
    if not any(v > 0 for v in out.values()):
        raise ConfigurationError(
            f"resources_per_worker must ask for a positive amount of something, got {resources!r}"
        )
    return out


@dataclass(frozen=True)
class CheckpointConfig:
    """Which persisted checkpoints a run keeps, and whether its folder outlives the executor.

    Args:
        num_to_keep: keep this many checkpoints (``None`` keeps all). The latest one is always
            kept, so that a restart can resume from it.
        score_attribute: a metric of rank 0's report; when set, the ``num_to_keep`` best by it are
            kept instead of the most recent.
        score_order: ``"max"`` or ``"min"``: which end of ``score_attribute`` is best.
        keep_runs: keep the folders of the executor's unnamed runs when it closes. By default
            they are removed then (an unnamed run cannot be resumed; its checkpoints are the
            executor's while it is open); a named run's folder is always kept.
    """

    num_to_keep: int | None = None
    score_attribute: str | None = None
    score_order: Literal["max", "min"] = "max"
    keep_runs: bool = False

    def __post_init__(self) -> None:
        check_count("num_to_keep", self.num_to_keep, allow_none=True)
        if not isinstance(self.keep_runs, bool):
            raise ConfigurationError(f"keep_runs must be a bool, got {self.keep_runs!r}")
        if self.score_order not in ("max", "min"):
            raise ConfigurationError(
                f"score_order must be 'max' or 'min', got {self.score_order!r}"
            )
        if self.score_attribute is not None and not isinstance(self.score_attribute, str):
            raise ConfigurationError(
                f"score_attribute must be a metric name, got {self.score_attribute!r}"
            )


@dataclass(frozen=True)
class Timeouts:
    """How long an executor waits for each part of a group's life.

    Args:
        placement_s: for the placement group (the workers' resources) to be ready.
        start_s: for the rest of start-up: the worker processes, their set-up, the backend's
            ``on_start``, and each attempt's start of the function.
        stop_s: for a stopped run's functions to end before the group is discarded.
        shutdown_s: bound on each teardown (the backend's ``on_shutdown``, the workers' exit).
        graceful_patience_s: how long workers get to exit before they are killed.
    """

    placement_s: float = 60.0
    start_s: float = 120.0
    stop_s: float = 10.0
    shutdown_s: float = 30.0
    graceful_patience_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("placement_s", "start_s", "stop_s", "shutdown_s"):
            check_positive(f"Timeouts.{name}", getattr(self, name))
        patience = self.graceful_patience_s
        if not _is_number(patience) or patience < 0:
            raise ConfigurationError(
                f"Timeouts.graceful_patience_s must be a non-negative number, got {patience!r}"
            )


@dataclass(frozen=True)
class HealthChecks:
    """How an executor notices a worker that hangs (one that dies is noticed at once), and a
    rank that the others wait for (a straggler).

    Args:
        interval_s: how often every worker is pinged (``None``: no pings).
        timeout_s: a worker that does not answer a ping within this is hung.
        step_timeout_s: a rank that has credit and reports nothing for this long is hung
            (``None``, the default: no deadline).
        straggler_factor: a rank whose steps all take more than this many times the typical
            rank's (the lower median of the ranks' shortest step), for ``straggler_steps``
            steps in a row, is a straggler: logged once (``straggler``, with its stack when
            py-spy can read it) and counted (``asyncexec_stragglers_total``); its steps' times
            are ``Step.durations``, its own speed, the time it waits for credit left out.
            ``None``: not watched. Above 1; 2.0 by default.
        straggler_steps: the steps in a row (10 by default).
    """

    interval_s: float | None = 5.0
    timeout_s: float = 30.0
    step_timeout_s: float | None = None
    straggler_factor: float | None = 2.0
    straggler_steps: int = 10

    def __post_init__(self) -> None:
        check_positive("HealthChecks.interval_s", self.interval_s, allow_none=True)
        check_positive("HealthChecks.timeout_s", self.timeout_s)
        check_positive("HealthChecks.step_timeout_s", self.step_timeout_s, allow_none=True)
        check_stragglers("HealthChecks.", self.straggler_factor, self.straggler_steps)
        if self.interval_s is not None and self.interval_s < 0.05:
            raise ConfigurationError(
                f"HealthChecks.interval_s below 0.05 s would flood the workers, got "
                f"{self.interval_s!r}"
            )


def check_stragglers(prefix: str, factor: object, steps: object) -> None:
    """Refuse a straggler factor that is not a number above 1 (or None), and a count of steps
    that is not a positive int.

    Raises:
        ConfigurationError: naming the argument (after ``prefix``) and the value.
    """
    if factor is not None and (not _is_number(factor) or float(factor) <= 1):  # type: ignore[arg-type]
        raise ConfigurationError(
            f"{prefix}straggler_factor must be a number above 1 or None, got {factor!r}"
        )
    check_count(f"{prefix}straggler_steps", steps)


#: The keyword arguments ``Executor`` took before they were grouped, and where each went: kept
#: for a release, with a DeprecationWarning.
LEGACY_OPTIONS: dict[str, tuple[str, str]] = {
    "placement_timeout_s": ("timeouts", "placement_s"),
    "start_timeout_s": ("timeouts", "start_s"),
    "stop_timeout_s": ("timeouts", "stop_s"),
    "shutdown_timeout_s": ("timeouts", "shutdown_s"),
    "graceful_patience_s": ("timeouts", "graceful_patience_s"),
    "health_check_interval_s": ("health", "interval_s"),
    "health_check_timeout_s": ("health", "timeout_s"),
    "step_timeout_s": ("health", "step_timeout_s"),
}


#: The old keyword arguments ``WorkerPool`` took (its only timeouts).
POOL_LEGACY_OPTIONS = frozenset({"placement_timeout_s", "start_timeout_s", "shutdown_timeout_s"})


def grouped_options(
    timeouts: Timeouts | None,
    health: HealthChecks | None,
    legacy: Mapping[str, Any],
    owner: str = "Executor",
    accepted: Collection[str] = LEGACY_OPTIONS.keys(),
) -> tuple[Timeouts, HealthChecks]:
    """The timeouts and health checks, from the grouped values and the old keyword arguments
    (``start_timeout_s=``: deprecated, warned about) that ``owner`` accepted.

    Raises:
        TypeError: an unknown keyword argument (as Python would say it).
        ConfigurationError: a value and an old argument for the same group, or a bad value.
    """
    import warnings

    unknown = sorted(k for k in legacy if k not in accepted)
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    if timeouts is not None and not isinstance(timeouts, Timeouts):
        raise ConfigurationError(f"timeouts must be an asyncexec.Timeouts, got {timeouts!r}")
    if health is not None and not isinstance(health, HealthChecks):
        raise ConfigurationError(f"health must be an asyncexec.HealthChecks, got {health!r}")
    groups: dict[str, dict[str, Any]] = {"timeouts": {}, "health": {}}
    for key, value in legacy.items():
        group, field_name = LEGACY_OPTIONS[key]
        given = timeouts if group == "timeouts" else health
        new = "Timeouts" if group == "timeouts" else "HealthChecks"
        if given is not None:
            raise ConfigurationError(
                f"{key}= and {group}= were both given: write {group}={new}({field_name}=...)"
            )
        warnings.warn(
            f"{owner}({key}=...) is deprecated: use {group}=asyncexec.{new}({field_name}=...)",
            DeprecationWarning,
            stacklevel=3,
        )
        groups[group][field_name] = value
    try:
        return (
            timeouts if timeouts is not None else Timeouts(**groups["timeouts"]),
            health if health is not None else HealthChecks(**groups["health"]),
        )
    except ConfigurationError as exc:
        # Name the argument as it was given.
        message = str(exc)
        for key, (group, field_name) in LEGACY_OPTIONS.items():
            prefix = f"{'Timeouts' if group == 'timeouts' else 'HealthChecks'}.{field_name} "
            if key in legacy and message.startswith(prefix):
                raise ConfigurationError(key + message[len(prefix) - 1 :]) from None
        raise


@dataclass(frozen=True)
class ExecutorConfig:
    """Everything an executor needs, checked. Built by :meth:`Executor.__init__`."""

    num_workers: int
    resources_per_worker: Mapping[str, float]
    placement_strategy: PlacementStrategy = "PACK"
    placement_timeout_s: float = 60.0
    start_timeout_s: float = 120.0
    shutdown_timeout_s: float = 30.0
    graceful_patience_s: float = 5.0
    share_devices: frozenset[str] = field(default_factory=lambda: frozenset(DEVICE_KINDS))
    buffer_size: int = DEFAULT_BUFFER_SIZE
    health_check_interval_s: float | None = 5.0
    health_check_timeout_s: float = 30.0
    step_timeout_s: float | None = None
    #: See :class:`HealthChecks`.
    straggler_factor: float | None = 2.0
    straggler_steps: int = 10
    stop_timeout_s: float = 10.0
    storage_path: str = field(default_factory=lambda: str(Path.home() / "asyncexec_results"))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    address: str | None = None
    runtime_env: Mapping[str, Any] | None = None
    init_hook: Callable[[], object] | None = None
    name: str = "asyncexec"
    spares: int = 0
    #: An elastic executor's bounds (``num_workers=(min, max)``); None for a fixed size. Its
    #: config's ``num_workers`` is ``max_workers``; each group start decides the group's size
    #: and starts it with a copy whose ``num_workers`` is that size.
    min_workers: int | None = None
    max_workers: int | None = None
    elastic_check_interval_s: float = 10.0
    #: Local mode: the workers are threads of the driver's process, not Ray actors.
    local: bool = False
    #: The worker classes each rank holds an instance of (``asyncexec.Role``), in order, and
    #: them pickled once for every worker (None without roles).
    roles: tuple[Any, ...] = ()
    roles_payload: bytes | None = None

    @classmethod
    def build(cls, num_workers: object, **options: Any) -> ExecutorConfig:
        """Validate user arguments and build a config.

        Raises:
            ConfigurationError: an argument is invalid; the message names it and its value.
        """
        num_workers, bounds = _worker_count(num_workers)
        if bounds is not None:
            options["min_workers"], options["max_workers"] = bounds
        resources = options.pop("resources_per_worker", None)
        resources = validate_resources({"CPU": 1} if resources is None else resources)
        strategy = options.get("placement_strategy", "PACK")
        if strategy not in _STRATEGIES:
            raise ConfigurationError(
                f"placement_strategy must be one of {', '.join(_STRATEGIES)}, got {strategy!r}"
            )
        for name in (
            "placement_timeout_s",
            "start_timeout_s",
            "shutdown_timeout_s",
            "health_check_timeout_s",
            "stop_timeout_s",
        ):
            if name in options:
                check_positive(name, options[name])
        for name in ("health_check_interval_s", "step_timeout_s"):
            if name in options:
                check_positive(name, options[name], allow_none=True)
        interval = options.get("health_check_interval_s")
        if interval is not None and interval < 0.05:
            raise ConfigurationError(
                f"health_check_interval_s below 0.05 s would flood the workers, got {interval!r}"
            )
        patience = options.get("graceful_patience_s", 0.0)
        if not _is_number(patience) or patience < 0:
            raise ConfigurationError(
                f"graceful_patience_s must be a non-negative number, got {patience!r}"
            )
        check_stragglers(
            "", options.get("straggler_factor", 2.0), options.get("straggler_steps", 10)
        )
        if "share_devices" in options:
            options["share_devices"] = _share_devices(options["share_devices"])
        if "buffer_size" in options:
            options["buffer_size"] = validate_buffer_size(options["buffer_size"])
        check_count("spares", options.get("spares", 0), minimum=0)
        if "elastic_check_interval_s" in options:
            check_positive("elastic_check_interval_s", options["elastic_check_interval_s"])
        if bounds is not None and options.get("spares", 0):
            raise ConfigurationError(
                f"an elastic executor (num_workers={bounds!r}) takes no spares: a group that "
                "can shrink and grow has no fixed set of ranks for them to stand in for"
            )
        _check_storage(options)
        _check_init_hook(options.get("init_hook"))
        if options.get("local", False):
            _check_local(options, bounds)
        check_address(options.get("address"))
        env = options.get("runtime_env")
        if env is not None and not isinstance(env, Mapping):
            raise ConfigurationError(f"runtime_env must be a mapping, got {env!r}")
        name = options.get("name", "asyncexec")
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"name must be a non-empty string, got {name!r}")
        return cls(num_workers=num_workers, resources_per_worker=resources, **options)

    @property
    def elastic(self) -> bool:
        """Whether the group's size is decided at each start (``num_workers=(min, max)``)."""
        return self.min_workers is not None

    @property
    def bundle(self) -> dict[str, float]:
        """One worker's placement-group bundle (the amounts Ray reserves for it)."""
        return {k: v for k, v in self.resources_per_worker.items() if v > 0}

    @property
    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per worker, spares included."""
        return [self.bundle] * (self.num_workers + self.spares)


def _worker_count(value: object) -> tuple[int, tuple[int, int] | None]:
    """``num_workers``: a positive int (a fixed size), or a ``(min, max)`` tuple of them with
    min <= max (an elastic size; ``(n, n)`` is the fixed size n). Returns the size to aim for
    and the elastic bounds, or None.

    Raises:
        ConfigurationError: anything else, named.
    """
    if not isinstance(value, tuple):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value, None
        raise ConfigurationError(
            f"num_workers must be a positive int or a (min, max) tuple of them, got {value!r}"
        )
    if len(value) != 2 or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
    ):
        raise ConfigurationError(
            f"num_workers as (min, max) must be two positive ints, got {value!r}"
        )
    low, high = value
    if low > high:
        raise ConfigurationError(
            f"num_workers=(min, max) must have min <= max, got min {low} > max {high}"
        )
    return high, (None if low == high else (low, high))


def _check_local(options: dict[str, Any], bounds: tuple[int, int] | None) -> None:
    """Refuse what a local executor (threads of the driver's process) cannot do.

    Raises:
        ConfigurationError: naming the option, and why.
    """
    if bounds is not None:
        raise ConfigurationError(
            f"a local executor has no elastic size (num_workers={bounds!r}): its workers are "
            "threads, and there is no cluster to fit"
        )
    if options.get("spares", 0):
        raise ConfigurationError(
            "a local executor takes no spares: a failed rank's thread cannot be replaced alone"
        )
    if options.get("runtime_env") is not None:
        raise ConfigurationError(
            "a local executor takes no runtime_env: its workers run in the driver's process "
            "and environment"
        )
    if options.get("address") is not None:
        raise ConfigurationError(
            f"a local executor joins no cluster (address={options['address']!r}): its workers "
            "are threads of the driver's process, and Ray is never started or joined"
        )


def _check_storage(options: dict[str, Any]) -> None:
    """Check ``storage_path`` and normalise it in ``options`` (dropped when None)."""
    storage = options.get("storage_path")
    if storage is None:
        options.pop("storage_path", None)
    elif isinstance(storage, str) and not storage.strip():
        raise ConfigurationError("storage_path must not be empty")
    elif isinstance(storage, str) and "://" in storage:
        if importlib.util.find_spec("fsspec") is None:
            raise ConfigurationError(
                f"storage_path {storage!r} is a URI: it needs fsspec (pip install fsspec)"
            )
    elif isinstance(storage, str | os.PathLike):
        options["storage_path"] = str(Path(os.fspath(storage)).expanduser())
    else:
        raise ConfigurationError(f"storage_path must be a path, got {storage!r}")
    ckpt = options.get("checkpoint")
    if ckpt is None:
        options.pop("checkpoint", None)
    elif not isinstance(ckpt, CheckpointConfig):
        raise ConfigurationError(f"checkpoint must be a CheckpointConfig, got {ckpt!r}")


def _check_init_hook(hook: object) -> None:
    if hook is None:
        return
    if not callable(hook):
        raise ConfigurationError(f"init_hook must be callable, got {hook!r}")
    try:
        pickled(hook)
    except Exception as exc:
        raise ConfigurationError(
            f"init_hook cannot be pickled to send to the workers: {exc}"
        ) from exc


def validate_buffer_size(value: object) -> int:
    """Check a report buffer bound (reports outstanding per rank)."""
    check_count("buffer_size", value)
    assert isinstance(value, int)
    return value


def check_address(address: object) -> None:
    """Check the address of a Ray cluster to join: None, ``"auto"``, ``"local"``, an address
    with a scheme (``ray://host:port``: Ray's to read) or ``host:port`` (``[ipv6]:port``), as
    ``ray.init`` takes it.

    Raises:
        ConfigurationError: anything else, when it is given (Ray refused it only when the
            executor was entered, with a bare ``ValueError``).
    """
    if address is None:
        return
    if not isinstance(address, str):
        raise ConfigurationError(f"address must be a string such as 'auto', got {address!r}")
    if address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    bracketed = len(host) > 2 and host.startswith("[") and host.endswith("]")  # IPv6
    if (bracketed or (host and ":" not in host)) and port.isdigit() and 0 < int(port) < 65536:
        return
    raise ConfigurationError(
        f"address must be 'auto', 'local', 'host:port' (the cluster's GCS, as `ray start` "
        f"prints it) or 'ray://host:port', got {address!r}"
    )


def _share_devices(value: object) -> frozenset[str]:
    if value is True:
        return frozenset(DEVICE_KINDS)
    if value is False or value is None:
        return frozenset()
    if isinstance(value, str) or not isinstance(value, Collection):
        raise ConfigurationError(
            f"share_devices must be True, False or a collection of device kinds "
            f"({', '.join(DEVICE_KINDS)}), got {value!r}"
        )
    unknown = [k for k in value if k not in DEVICE_KINDS]
    if unknown:
        raise ConfigurationError(
            f"share_devices names unknown device kinds {unknown!r}; "
            f"known: {', '.join(DEVICE_KINDS)}"
        )
    return frozenset(value)
