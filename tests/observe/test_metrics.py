"""Prometheus metrics, scraped over HTTP from the real endpoint after a run with a restart: the
counts equal the run's."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import tenacity
from structlog.testing import capture_logs

import asyncexec
from asyncexec._driver import _metrics
from asyncexec.testing import metrics_enabled

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(120)]


@contextlib.contextmanager
def serving_metrics(**options: Any) -> Iterator[str]:
    """Metrics on with ``options`` (a registry of their own), served on a free loopback port;
    yields the URL; off again afterwards, for the other tests of the process."""
    pytest.importorskip("prometheus_client")
    with metrics_enabled(**options):
        server, thread = asyncexec.start_metrics_server(0)
        try:
            yield f"http://127.0.0.1:{server.server_port}/metrics"
        finally:
            server.shutdown()
            thread.join(5)


@pytest.fixture
def endpoint() -> Iterator[str]:
    """Every scrape asks the workers for their counts (the tests scrape rarely)."""
    with serving_metrics(backlog_refresh_s=0) as url:
        yield url


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


def _series(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of ``name``'s series in a scrape."""
    return [
        dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        for line in text.splitlines()
        if line.startswith(name + "{")
    ]


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
    assert ex not in _series(text, "asyncexec_backlog_reports")  # no active run of the name


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
    assert {"executor": "backlogged"} not in _series(text, "asyncexec_backlog_reports")
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


# Bounded labels and scrapes -------------------------------------------------------------------


async def test_backlog_series_of_a_name_goes_when_its_last_active_run_ends(endpoint: str) -> None:
    """Defect: the backlog gauge kept a series, and the metrics an entry, for every executor
    name ever seen (a service naming each run's executor grew them without bound)."""
    enabled = _metrics.metrics()
    assert enabled is not None
    short, kept = {"executor": "short"}, {"executor": "kept"}
    async with (
        asyncexec.Executor(1, name="short", local=True) as first,
        asyncexec.Executor(1, name="short", local=True) as second,
        asyncexec.Executor(1, name="kept", local=True) as third,
        httpx.AsyncClient() as client,
    ):
        runs = [e.run(report_forever, buffer_size=2) for e in (first, second, third)]
        for run in runs:
            await run.__anext__()
        text = await _scrape(client, endpoint)
        assert short in _series(text, "asyncexec_backlog_reports")
        assert kept in _series(text, "asyncexec_backlog_reports")

        await runs[0].aclose()  # another run of the name is still active: its series stays
        assert short in _series(await _scrape(client, endpoint), "asyncexec_backlog_reports")

        await runs[1].aclose()
        text = await _scrape(client, endpoint)
        assert short not in _series(text, "asyncexec_backlog_reports")
        assert kept in _series(text, "asyncexec_backlog_reports")
        assert set(enabled._watched) == {"kept"}
        await runs[2].aclose()
        text = await _scrape(client, endpoint)
    assert _series(text, "asyncexec_backlog_reports") == []
    assert enabled._watched == {}
    # The counters stay: they are cumulative.
    assert _value(text, "asyncexec_runs_total", outcome="cancelled", **short) == 2


async def test_names_past_the_cap_are_counted_under_one_overflow_label() -> None:
    """``max_executors`` names get a label each; every later name is counted under
    ``_overflow``, with one warning, in every collector."""
    names = ["n0", "n1", "n2", "n3", "n4"]
    with serving_metrics(max_executors=2) as url, capture_logs() as logs:
        for name in names:
            async with asyncexec.Executor(1, name=name, local=True) as executor:
                async for _ in executor.run(count_to, {"steps": 2}):
                    pass
        async with httpx.AsyncClient() as client:
            text = await _scrape(client, url)
    seen = {
        labels["executor"]
        for line in text.splitlines()
        if line.startswith("asyncexec_")
        for labels in [dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))]
        if "executor" in labels
    }
    assert seen == {"n0", "n1", _metrics.OVERFLOW}
    overflow = {"executor": _metrics.OVERFLOW}
    assert _value(text, "asyncexec_runs_total", outcome="started", **overflow) == 3
    assert _value(text, "asyncexec_runs_total", outcome="finished", **overflow) == 3
    assert _value(text, "asyncexec_steps_total", **overflow) == 6
    assert _value(text, "asyncexec_steps_total", executor="n1") == 2
    assert _value(text, "asyncexec_startup_seconds_count", phase="ready", **overflow) == 3
    capped = [e for e in logs if e["event"] == "metrics_labels_capped"]
    assert len(capped) == 1, logs
    assert (capped[0]["label"], capped[0]["limit"], capped[0]["value"]) == ("executor", 2, "n2")


def test_overflowing_labels_are_bounded_whatever_the_values() -> None:
    labels = _metrics.BoundedLabels("cause", 3)
    assert [labels(str(i % 5)) for i in range(10)] == [
        *["0", "1", "2", _metrics.OVERFLOW, _metrics.OVERFLOW],
        *["0", "1", "2", _metrics.OVERFLOW, _metrics.OVERFLOW],
    ]
    assert len({labels(f"x{i}") for i in range(1000)}) == 1


def test_metrics_server_listens_on_loopback_unless_told_otherwise() -> None:
    """Defect: it listened on every interface by default, with no authentication."""
    pytest.importorskip("prometheus_client")
    servers = []
    with metrics_enabled():
        try:
            servers.append(asyncexec.start_metrics_server(0))
            servers.append(asyncexec.start_metrics_server(0, addr="0.0.0.0"))
            assert [s.server_address[0] for s, _ in servers] == ["127.0.0.1", "0.0.0.0"]
        finally:
            for server, thread in servers:
                server.shutdown()
                thread.join(5)


async def test_scrapes_in_quick_succession_ask_the_workers_once() -> None:
    """Defect: every scrape sent one Ray call to every live worker. The workers' counts are
    asked at most once per ``backlog_refresh_s``; a scrape in between uses the last counts."""
    with serving_metrics(backlog_refresh_s=600) as url:
        enabled = _metrics.metrics()
        assert enabled is not None
        async with (
            asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, name="polled") as executor,
            httpx.AsyncClient() as client,
        ):
            run = executor.run(report_forever, buffer_size=4)
            await run.__anext__()
            [meter] = enabled._watched["polled"]
            asks = 0
            count = meter._count_buffered

            async def counted() -> int:
                nonlocal asks
                asks += 1
                return await count()

            meter._count_buffered = counted
            for _ in range(2):
                text = await _scrape(client, url)
                assert {"executor": "polled"} in _series(text, "asyncexec_backlog_reports")
            await run.aclose()
    assert asks == 1


def ahead_then_fail(config: dict[str, Any]) -> None:
    """Attempt 1: rank 0 reports 3 steps, rank 1 one, then raises; attempt 2 returns."""
    ctx = asyncexec.get_context()
    if ctx.attempt > 1:
        return
    if ctx.world_rank == 0:
        for i in range(3):
            asyncexec.report({"i": i})
        Path(config["dir"], "ahead").touch()
        return
    asyncexec.report({"i": 0})
    while not Path(config["dir"], "ahead").exists():
        time.sleep(0.005)
    raise ValueError("rank 1 fails")


async def test_backlog_leaves_out_the_reports_of_a_failed_attempt(
    endpoint: str, tmp_path: Path
) -> None:
    """Defect: while a run restarted (its policy's wait, the new group's start), the backlog
    gauge still counted the reports the failed attempt's ranks had sent beyond its last complete
    step (rank 0's steps 1 and 2 here): they are never delivered, and the driver held them
    until the next attempt began."""
    waiting, resume = anyio.Event(), anyio.Event()

    async def sleep(seconds: float) -> None:
        waiting.set()
        await resume.wait()

    policy = asyncexec.RestartPolicy(
        restart_on_user_error=True,
        backoff_after_progress=True,
        wait=tenacity.wait_fixed(1),
        sleep=sleep,
    )
    async with (
        asyncexec.Executor(
            2, local=True, name="restarting", restart=policy, buffer_size=8
        ) as executor,
        httpx.AsyncClient() as client,
    ):
        run = executor.run(ahead_then_fail, {"dir": str(tmp_path)})
        steps = []
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                steps.extend([step.index async for step in run])

            tg.start_soon(consume)
            with anyio.fail_after(30):
                await waiting.wait()  # the run waits to restart
            text = await _scrape(client, endpoint)
            resume.set()
    assert steps == [0]
    assert run.attempt == 2
    assert _value(text, "asyncexec_backlog_reports", executor="restarting") == 0
