"""asyncexec's Prometheus metrics, on for a block of a test: :func:`metrics_enabled`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .._driver._metrics import disable_metrics, enable_metrics, metrics
from .._errors import ExecutorStateError

__all__ = ["metrics_enabled"]


@contextlib.contextmanager
def metrics_enabled(registry: Any = None, **options: Any) -> Iterator[Any]:
    """Turn asyncexec's metrics on for the block, in ``registry`` (a fresh
    ``prometheus_client.CollectorRegistry`` when None), and off again after it, so that the
    next test starts without them (``asyncexec.enable_metrics`` keeps its first call's registry
    for the whole process). Yields the registry.

    ::

        with asyncexec.testing.metrics_enabled() as registry:
            async with asyncexec.Executor(2, name="trainer") as executor:
                ...
            assert registry.get_sample_value("asyncexec_runs_total", {...}) == 1

    Args:
        registry: the registry to add the collectors to.
        options: ``enable_metrics``' own (``max_executors``, ``backlog_refresh_s``).

    Raises:
        ImportError: prometheus_client is not installed (the ``metrics`` extra).
        ExecutorStateError: the metrics are on already (``enable_metrics`` was called, or a
            block of this one is open).
    """
    if metrics() is not None:
        raise ExecutorStateError(
            "asyncexec's metrics are on already: metrics_enabled() would not be the one "
            "that turns them off"
        )
    if registry is None:
        import prometheus_client

        registry = prometheus_client.CollectorRegistry()
    enable_metrics(registry, **options)
    try:
        yield registry
    finally:
        disable_metrics()
