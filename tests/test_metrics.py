"""Prometheus metrics, scraped over HTTP from the real endpoint after a run with a restart: the
counts equal the run's."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
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


def _value(text: str, name: str, default: float | None = None, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:  # a labelled series appears once it has been counted
        return default
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


def report_forever() -> None:
    while True:  # paced, so that each poll takes a report or two, never a whole window
        asyncexec.report({"pid": os.getpid()})
        time.sleep(0.01)


def fail_at_once() -> None:
    raise ValueError("no")


async def _scrape(client: httpx.AsyncClient, endpoint: str) -> str:
    return (await client.get(endpoint)).text


@pytest.mark.parametrize("local", [False, True], ids=["ray", "local"])
async def test_backlog_counts_reports_waiting_in_the_workers_buffers(
    endpoint: str, local: bool
) -> None:
    """Consumers that stop taking steps leave each rank's window full: most of it waits in the
    worker (the driver polls a rank only once three quarters of its window is free). The gauge
    counts it there too, not only what the driver holds, over every active run of the name
    (two executors of one rank each here, as a service runs them)."""
    size = 8
    options: dict[str, Any] = {"name": "backlogged", "local": local}
    if not local:
        options["resources_per_worker"] = {"CPU": 0.5}
    async with (
        asyncexec.Executor(1, **options) as first,
        asyncexec.Executor(1, **options) as second,
        httpx.AsyncClient() as client,
    ):
        runs = [e.run(report_forever, buffer_size=size) for e in (first, second)]
        for run in runs:
            await run.__anext__()  # one step taken, then the consumer stops
        backlog = 0.0
        with anyio.fail_after(30):
            while backlog < 2 * (size - 1):  # each rank's report() waits for credit
                backlog = _value(await _scrape(client, endpoint), "asyncexec_backlog_reports")
        # At most a window per rank: what the worker made beyond the steps consumed.
        assert backlog <= 2 * size
        # Read on the runs' own loop (an in-process metrics route), the scrape cannot wait for
        # the workers: it gives the counts of the last scrape, at once (the ranks are blocked).
        enabled = _metrics.metrics()
        assert enabled is not None
        prom = pytest.importorskip("prometheus_client")
        began = time.monotonic()
        here = prom.generate_latest(enabled.registry).decode()
        assert time.monotonic() - began < _metrics.SCRAPE_WAIT_S  # it never waited on itself
        assert _value(here, "asyncexec_backlog_reports", executor="backlogged") == backlog
        for run in runs:
            await run.aclose()
        text = await _scrape(client, endpoint)
    assert _value(text, "asyncexec_backlog_reports", executor="backlogged") == 0
    assert _value(text, "asyncexec_runs_total", outcome="cancelled", executor="backlogged") == 2


async def test_failed_runs_and_start_up_phases_are_counted(endpoint: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, name="failing") as executor:
        with pytest.raises(asyncexec.WorkerRaisedError):
            async for _ in executor.run(fail_at_once):
                pass
        async with httpx.AsyncClient() as client:
            text = await _scrape(client, endpoint)
    ex = {"executor": "failing"}
    assert _value(text, "asyncexec_runs_total", outcome="started", **ex) == 1
    assert _value(text, "asyncexec_runs_total", outcome="failed", **ex) == 1
    assert _value(text, "asyncexec_runs_total", outcome="finished", default=0, **ex) == 0
    for phase in ("placement", "workers", "set_up", "ready"):
        assert _value(text, "asyncexec_startup_seconds_count", phase=phase, **ex) == 1
    placement = _value(text, "asyncexec_startup_seconds_sum", phase="placement", **ex)
    ready = _value(text, "asyncexec_startup_seconds_sum", phase="ready", **ex)
    assert 0 < placement <= ready  # phases are cumulative, from the start of start-up
