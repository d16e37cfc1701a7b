"""A Grafana dashboard generated from asyncexec's own metric definitions, so it cannot drift.

The collectors are made as :class:`asyncexec._driver._metrics.Metrics` makes them (in a
registry of their own) and read back: every metric gets a panel, its query built from the
metric's type and labels, its title and description from the metric's help text. A metric
added to ``_metrics.py`` gets its panel at the next generation; ``tests/observe/test_dashboard.py``
fails while the checked-in ``dashboards/asyncexec.json`` differs from what this module makes,
or while a panel names a series that no metric exposes.

    python dashboards/generate.py          # rewrites dashboards/asyncexec.json

Queries use two Grafana variables: ``$executor`` (a multi-value choice of executor names, all
by default) and ``$__rate_interval``; the datasource is the ``$datasource`` variable (any
Prometheus).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["MetricDef", "dashboard", "dashboard_json", "metric_definitions", "series_of"]

#: Counters of rare events: shown as how many happened per interval (bars), not a rate.
EVENTS = frozenset(
    {
        "asyncexec_runs",
        "asyncexec_restarts",
        "asyncexec_preemptions",
        "asyncexec_stragglers",
        "asyncexec_call_resends",
        "asyncexec_ranks_renewed",
        "asyncexec_router_retries",
        "asyncexec_router_duplicates_dropped",
        "asyncexec_router_late_dropped",
        "asyncexec_router_timeouts",
        "asyncexec_router_taken_out",
        "asyncexec_router_replaced",
        "asyncexec_channel_failed_pushes",
    }
)
#: The panels that come first, in this order (the rest follow by name).
FIRST = (
    "asyncexec_runs",
    "asyncexec_steps",
    "asyncexec_reports",
    "asyncexec_backlog_reports",
    "asyncexec_restarts",
    "asyncexec_restart_seconds",
)
#: The quantiles drawn for a histogram.
QUANTILES = (0.5, 0.95)
_WIDTH, _HEIGHT = 12, 8


@dataclass(frozen=True)
class MetricDef:
    """One metric as defined in the driver: its name (without ``_total``), type, help text and
    label names."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...]


def metric_definitions() -> list[MetricDef]:
    """asyncexec's metrics (the executors', the RL pipeline's, the router's and the weight
    channel's), read from collectors made in a registry of their own (the process's metrics are
    not touched): those of :data:`FIRST`, then the rest by name.

    Raises:
        ImportError: prometheus_client is not installed (the ``metrics`` extra).
    """
    import prometheus_client as prom

    from .._driver._metrics import Metrics, pipeline_collectors
    from .._driver.channel._metrics import channel_collectors
    from .._driver.pipeline._router_metrics import router_collectors

    registry = prom.CollectorRegistry()
    made = Metrics(registry)
    for collectors in (pipeline_collectors, router_collectors, channel_collectors):
        collectors(made)  # made on first use by a pipeline, a router, a channel
    found = []
    for collector in _collectors(registry):
        [family] = collector.describe()
        labels = tuple(getattr(collector, "_labelnames", ()))
        found.append(MetricDef(family.name, family.type, family.documentation, labels))
    first = {name: i for i, name in enumerate(FIRST)}
    return sorted(found, key=lambda m: (first.get(m.name, len(first)), m.name))


def _collectors(registry: Any) -> Iterator[Any]:
    # prometheus_client keeps its collectors by name; the labels are only on the collectors.
    yield from dict.fromkeys(registry._names_to_collectors.values())


def series_of(metric: MetricDef) -> set[str]:
    """The series names ``metric`` exposes (as Prometheus stores them)."""
    if metric.type == "counter":
        return {f"{metric.name}_total", f"{metric.name}_created"}
    if metric.type == "histogram":
        suffixes = ("_bucket", "_sum", "_count", "_created")
        return {metric.name + suffix for suffix in suffixes}
    return {metric.name}


def _selector(metric: MetricDef, suffix: str = "") -> str:
    where = '{executor=~"$executor"}' if "executor" in metric.labels else ""
    return f"{metric.name}{suffix}{where}"


def _targets(metric: MetricDef) -> tuple[list[dict[str, Any]], str]:
    """The panel's queries and unit."""
    by = ", ".join(metric.labels)
    legend = " ".join("{{" + label + "}}" for label in metric.labels)
    if metric.type == "counter":
        func = "increase" if metric.name in EVENTS else "rate"
        expr = f"sum by ({by}) ({func}({_selector(metric, '_total')}[$__rate_interval]))"
        return [_target(expr, legend, "A")], "none" if func == "increase" else "ops"
    if metric.type == "histogram":
        rate = f"rate({_selector(metric, '_bucket')}[$__rate_interval])"
        targets = []
        for i, q in enumerate(QUANTILES):
            expr = f"histogram_quantile({q}, sum by ({by}, le) ({rate}))"
            targets.append(_target(expr, f"p{round(q * 100)} {legend}", chr(ord("A") + i)))
        # Seconds by the name's convention; a histogram of a count (the pipeline's staleness,
        # in versions) has no unit.
        return targets, "s" if metric.name.endswith("_seconds") else "none"
    expr = f"sum by ({by}) ({_selector(metric)})"
    return [_target(expr, legend, "A")], "none"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
    }


def _panel(metric: MetricDef, index: int) -> dict[str, Any]:
    targets, unit = _targets(metric)
    title = metric.name.removeprefix("asyncexec_").replace("_", " ")
    bars = metric.type == "counter" and metric.name in EVENTS
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "description": f"{metric.help} ({metric.type} {metric.name})",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {
            "x": (index % 2) * _WIDTH,
            "y": (index // 2) * _HEIGHT,
            "w": _WIDTH,
            "h": _HEIGHT,
        },
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {"drawStyle": "bars" if bars else "line", "fillOpacity": 10},
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": targets,
    }


def _variables() -> list[dict[str, Any]]:
    return [
        {
            "name": "datasource",
            "type": "datasource",
            "query": "prometheus",
            "label": "Prometheus",
        },
        {
            "name": "executor",
            "type": "query",
            "label": "executor",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": "label_values(asyncexec_runs_total, executor)", "refId": "A"},
            "definition": "label_values(asyncexec_runs_total, executor)",
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        },
    ]


def dashboard() -> dict[str, Any]:
    """The dashboard, as Grafana's JSON model: one panel per metric."""
    metrics = metric_definitions()
    return {
        "uid": "asyncexec",
        "title": "asyncexec",
        "description": "Generated from asyncexec's metric definitions "
        "(python dashboards/generate.py); do not edit by hand.",
        "tags": ["asyncexec"],
        "editable": True,
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {"list": _variables()},
        "panels": [_panel(metric, i) for i, metric in enumerate(metrics)],
    }


def dashboard_json() -> str:
    """The dashboard as the text of ``dashboards/asyncexec.json``."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"
