"""Prometheus metrics, scraped over HTTP from the real endpoint after a run with a restart: the
counts equal the run's."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import asyncexec
from asyncexec._driver import _metrics

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(120)]


@pytest.fixture
def endpoint() -> Iterator[str]:
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    asyncexec.enable_metrics(registry)
    server, thread = asyncexec.start_metrics_server(0, "127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        thread.join(5)
        _metrics._metrics = None  # off again for the other tests of the process


def count_to(config: dict[str, Any]) -> None:
    for i in range(config["steps"]):
        asyncexec.report({"i": i, "pid": os.getpid()})
        time.sleep(0.01)


def _value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in the scrape")


async def test_scraped_counts_equal_the_runs_after_a_restart(endpoint: str, tmp_path: Any) -> None:
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path), name="metered"
    ) as executor:
        killed = False
        async for step in executor.run(count_to, {"steps": 30}):
            if not killed and step.index == 3:
                killed = True
                os.kill(executor.workers[1].pid, signal.SIGKILL)
        result = executor.result
        async with httpx.AsyncClient() as client:
            text = (await client.get(endpoint)).text
    ex = {"executor": "metered"}
    assert result.attempts == 2
    assert _value(text, "asyncexec_runs_total", outcome="started", **ex) == 1
    assert _value(text, "asyncexec_runs_total", outcome="finished", **ex) == 1
    assert _value(text, "asyncexec_restarts_total", cause="WorkerCrashedError", **ex) == 1
    assert _value(text, "asyncexec_steps_total", **ex) == result.steps
    assert _value(text, "asyncexec_reports_total", **ex) == 2 * result.steps
    assert _value(text, "asyncexec_startup_seconds_count", phase="ready", **ex) == 2
    assert _value(text, "asyncexec_restart_seconds_count", **ex) == 1
    assert _value(text, "asyncexec_backlog_reports", **ex) == 0
