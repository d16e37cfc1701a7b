"""The Grafana dashboard is generated from the metric definitions and cannot drift: every metric
has a panel, every panel names series that exist, the checked-in file is what the generator
makes, and against a real Prometheus scraping a run with a restart every panel's query returns
data."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import httpx
import pytest

import asyncexec
from asyncexec._cli import _dashboard
from asyncexec._driver import _metrics
from asyncexec.testing import metrics_enabled

pytest.importorskip("prometheus_client")

CHECKED_IN = pathlib.Path(__file__).resolve().parents[2] / "dashboards" / "asyncexec.json"
_SERIES = re.compile(r"\basyncexec_[a-z_]+")


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """Each panel's title and query."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def problems(board: dict[str, Any], metrics: list[_dashboard.MetricDef]) -> list[str]:
    """What makes ``board`` disagree with ``metrics``: a metric without a panel, a query naming
    a series that no metric exposes."""
    exposed = {series: m.name for m in metrics for series in _dashboard.series_of(m)}
    named = {(title, s) for title, expr in queries(board) for s in _SERIES.findall(expr)}
    found = [
        f"panel {title!r} names {s}, which no metric exposes"
        for title, s in named
        if s not in exposed
    ]
    covered = {exposed[s] for _, s in named if s in exposed}
    found += [f"metric {m.name} has no panel" for m in metrics if m.name not in covered]
    return sorted(found)


def test_every_metric_has_a_panel_and_every_panel_names_real_series() -> None:
    metrics = _dashboard.metric_definitions()
    assert {"asyncexec_runs", "asyncexec_steps", "asyncexec_backlog_reports"} <= {
        m.name for m in metrics
    }
    assert problems(json.loads(CHECKED_IN.read_text()), metrics) == []


def test_a_panels_unit_is_seconds_only_for_a_metric_in_seconds() -> None:
    """Defect: every histogram's panel was in seconds, so the pipeline's staleness (versions)
    read "2 s"."""
    panels = json.loads(_dashboard.dashboard_json())["panels"]
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels}
    assert units["pipeline staleness"] == "none"
    assert units["pipeline pause seconds"] == units["channel push seconds"] == "s"


def test_checked_in_dashboard_is_what_the_generator_makes() -> None:
    """Regenerate with ``python dashboards/generate.py``."""
    assert CHECKED_IN.read_text() == _dashboard.dashboard_json(), (
        "dashboards/asyncexec.json is stale: run python dashboards/generate.py"
    )


def test_the_generators_help_is_help_and_a_path_is_where_it_writes(tmp_path: pathlib.Path) -> None:
    """``generate.py --help`` printed nothing and wrote the dashboard to a file named --help."""
    script = str(CHECKED_IN.parent / "generate.py")
    shown = subprocess.run(
        [sys.executable, script, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "usage:" in shown.stdout, shown
    assert list(tmp_path.iterdir()) == []
    made = subprocess.run(
        [sys.executable, script, "out.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "out.json").read_text() == _dashboard.dashboard_json()
    # Defect: a path in a folder that does not exist was a FileNotFoundError's traceback.
    for bad in ("no_such_folder/out.json", "."):
        refused = subprocess.run(
            [sys.executable, script, bad], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2 and "a file to write" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr


def test_a_metric_without_a_panel_or_a_panel_without_a_metric_is_found() -> None:
    """The check can fail: a metric added to the definitions after the dashboard was made, and
    a panel whose series was renamed away."""
    metrics = _dashboard.metric_definitions()
    board = _dashboard.dashboard()
    added = _dashboard.MetricDef("asyncexec_new_thing", "counter", "New.", ("executor",))
    assert problems(board, [*metrics, added]) == ["metric asyncexec_new_thing has no panel"]
    board["panels"][0]["targets"][0]["expr"] = "sum(rate(asyncexec_gone_total[1m]))"
    title = board["panels"][0]["title"]
    first = board["panels"][0]["description"].rsplit(" ", 1)[1].rstrip(")")
    assert problems(board, metrics) == sorted(
        [
            f"metric {first} has no panel",
            f"panel {title!r} names asyncexec_gone_total, which no metric exposes",
        ]
    )


def test_a_new_metric_gets_its_panel_at_the_next_generation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = _metrics.Metrics._dispatch_collectors

    def with_one_more(self: Any, prom: Any, registry: Any) -> None:
        made(self, prom, registry)
        prom.Histogram("asyncexec_new_seconds", "New.", ["executor"], registry=registry)

    monkeypatch.setattr(_metrics.Metrics, "_dispatch_collectors", with_one_more)
    metrics = _dashboard.metric_definitions()
    board = _dashboard.dashboard()
    assert problems(board, metrics) == []
    assert CHECKED_IN.read_text() != _dashboard.dashboard_json()  # the stale test would fail
    [panel] = [p for p in board["panels"] if p["title"] == "new seconds"]
    assert "asyncexec_new_seconds_bucket" in panel["targets"][0]["expr"]


# Against a real Prometheus ---------------------------------------------------------------------


def prometheus_binary() -> str | None:
    """``$ASYNCEXEC_PROMETHEUS``, else ``prometheus`` on the PATH (Debian's package puts it in
    /usr/bin)."""
    return os.environ.get("ASYNCEXEC_PROMETHEUS") or shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving_metrics() -> Iterator[int]:
    """Metrics on (a registry of their own), served on a free loopback port; off afterwards."""
    with metrics_enabled(backlog_refresh_s=0):
        server, thread = asyncexec.start_metrics_server(0)
        try:
            yield int(server.server_port)
        finally:
            server.shutdown()
            thread.join(5)


@contextlib.contextmanager
def prometheus(binary: str, target_port: int, root: pathlib.Path) -> Iterator[str]:
    """A Prometheus server scraping ``127.0.0.1:target_port`` every 0.5 s; yields its URL."""
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
        "scrape_configs:\n  - job_name: asyncexec\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n"
    )
    port = _free_port()
    with open(root / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def _wait_for(client: httpx.AsyncClient, url: str, query: str) -> None:
    """Until Prometheus answers ``query`` with a non-empty result (it is up and has scraped)."""
    with anyio.fail_after(30):
        while True:
            with contextlib.suppress(httpx.HTTPError):
                answer = await client.get(f"{url}/api/v1/query", params={"query": query})
                if answer.status_code == 200 and answer.json()["data"]["result"]:
                    return
            await anyio.sleep(0.2)


def count_to(config: dict[str, Any]) -> None:
    for i in range(config["steps"]):
        asyncexec.report({"i": i, "pid": os.getpid()})
        time.sleep(0.05)


def where() -> int:
    return os.getpid()


class Server(asyncexec.RolloutServer):
    async def chunks(self, prompt: int) -> AsyncIterator[int]:
        for i in range(prompt):
            await anyio.sleep(0.005)
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        self.weights = state


class Learner:
    def __init__(self) -> None:
        self.w = 0
        asyncexec.serve_weights(lambda: {"w": self.w})

    def step(self) -> int:
        self.w += 1
        return self.w


async def rl_loop(scraped: Callable[[str], Awaitable[None]]) -> None:
    """A real pipeline (its router, a weight channel) over servers named ``board``, each
    update mode once. It starts once Prometheus has scraped its histograms (at 0, the push
    at the pipeline's first push): the loop takes less than a scrape interval, and a histogram
    whose first scrape already holds every observation has no rate; it ends once Prometheus
    has scraped them again."""
    cpu = {"CPU": 0.25}
    async with (
        asyncexec.Executor(1, resources_per_worker=cpu, roles=Learner, name="learner") as learner,
        asyncexec.Executor(2, resources_per_worker=cpu, roles=Server, name="board") as servers,
        asyncexec.WeightChannel(learner, servers) as channel,
        asyncexec.Pipeline(
            servers, [2 + i % 7 for i in range(48)], batch_size=4, staleness=1, channel=channel
        ) as pipe,
    ):
        for histogram in ("channel_push_seconds", "pipeline_pause_seconds"):
            await scraped(f'asyncexec_{histogram}_count{{executor="board"}}')
        modes = ["keep", "wait", "abort"]
        async for _ in pipe:
            await learner.call(Learner.step)
            await pipe.update_weights(on_update=modes[pipe.version % 3])  # type: ignore[arg-type]
        # Scraped once more after the loop, before the series go with the close: a counter
        # scraped only once (the loop and the close within one scrape interval) has no
        # increase(), and its panel no data (a whole-file run failed so, 2 times in 8).
        ended = time.time()
        await scraped(f'timestamp(asyncexec_router_in_flight{{executor="board"}}) > {ended:.3f}')


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(120)
async def test_every_panel_query_returns_data_from_a_real_prometheus(tmp_path: Any) -> None:
    """Prometheus scrapes ``start_metrics_server`` during a run with a restart and calls, then an
    RL loop (a pipeline, its router, a weight channel); each panel's query, as Grafana would
    send it, returns data (a finite value) over the runs."""
    binary = prometheus_binary()
    if binary is None:
        pytest.skip(
            "no prometheus binary: apt-get install prometheus (or dpkg -x its .deb) and put it "
            "on the PATH, or set ASYNCEXEC_PROMETHEUS; .ci/run installs it when it can"
        )
    with (
        serving_metrics() as port,
        prometheus(binary, port, tmp_path) as url,
    ):
        async with httpx.AsyncClient(timeout=10) as client:
            await _wait_for(client, url, 'up{job="asyncexec"} == 1')
            start = time.time()
            async with asyncexec.Executor(
                2, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path), name="board"
            ) as executor:
                killed = False
                async for step in executor.run(count_to, {"steps": 40}):
                    if not killed and step.index == 3:
                        killed = True
                        await executor.execute(where)
                        os.kill(executor.workers[1].pid, signal.SIGKILL)
                    if step.index % 10 == 0:
                        await executor.execute(where)
                    if step.index == 20:  # its series exists only while a run is active
                        await _wait_for(client, url, 'asyncexec_backlog_reports{executor="board"}')
                assert executor.result.attempts == 2
            await rl_loop(functools.partial(_wait_for, client, url))
            await _wait_for(client, url, 'asyncexec_runs_total{outcome="finished"} == 1')
            end = time.time() + 1
            empty = []
            for title, expr in queries(json.loads(CHECKED_IN.read_text())):
                promql = expr.replace("$executor", "board").replace("$__rate_interval", "2s")
                answer = await client.get(
                    f"{url}/api/v1/query_range",
                    params={"query": promql, "start": start, "end": end, "step": 0.5},
                )
                assert answer.status_code == 200, (promql, answer.text)
                if not _finite(answer.json()["data"]["result"]):
                    empty.append((title, promql))
    assert empty == []


def test_a_names_series_start_at_zero_so_rate_sees_the_first_event() -> None:
    """Defect: a counter's series appeared at 1 with its first event (the first restart), so
    Prometheus' ``rate()`` saw no increase and the dashboard's restart panel stayed empty."""
    import prometheus_client as prom

    registry = prom.CollectorRegistry()
    meters = _metrics.Metrics(registry)
    assert meters.executors("zeroed") == "zeroed"
    samples = {
        (s.name, s.labels.get("outcome", s.labels.get("stage"))): s.value
        for family in registry.collect()
        for s in family.samples
        if s.labels.get("executor") == "zeroed"
    }
    for name in ("steps", "stragglers", "calls", "call_resends", "ranks_renewed"):
        assert samples[(f"asyncexec_{name}_total", None)] == 0
    assert samples[("asyncexec_runs_total", "failed")] == 0
    assert samples[("asyncexec_preemptions_total", "moved")] == 0
    assert samples[("asyncexec_restart_seconds_count", None)] == 0


def test_the_rl_loops_counters_start_at_zero_and_the_channel_meters_its_lag() -> None:
    """The router's retry, duplicate, late, timeout, taken-out and replaced counters, the
    pipeline's sample events and update modes made no series before their first event (the
    dashboard's panels showed "no data"); the channel had no metric at all."""
    import prometheus_client as prom

    from asyncexec._driver.channel._events import (
        ChannelClosed,
        PushEnded,
        VersionInstalled,
        VersionRead,
    )
    from asyncexec._driver.channel._metrics import ChannelMeters
    from asyncexec._driver.channel._sinks import ChannelMetrics
    from asyncexec._driver.pipeline._router_metrics import RouterMeters
    from asyncexec._driver.pipeline._sinks import PipelineMetrics, RouterMetrics

    registry = prom.CollectorRegistry()
    asyncexec.enable_metrics(registry)
    try:
        RouterMetrics(RouterMeters("rl"))
        PipelineMetrics(_metrics.pipeline_meters("rl"))
        channel = ChannelMetrics(ChannelMeters("rl"))
        channel.handlers()[VersionRead](VersionRead(3, ((0, 2), (1, 0))))
        channel.handlers()[VersionInstalled](VersionInstalled(1, 3, 3))
        channel.handlers()[PushEnded](PushEnded(3, 0.25))

        def sampled() -> dict[tuple[str, Any], float]:
            return {
                (s.name, s.labels.get("event") or s.labels.get("mode") or s.labels.get("rank")): (
                    s.value
                )
                for family in registry.collect()
                for s in family.samples
                if s.labels.get("executor") == "rl"
            }

        samples = sampled()
        channel.handlers()[ChannelClosed](ChannelClosed(3))  # its lag series go
        lags = [key for key in sampled() if key[0] == "asyncexec_channel_version_lag"]
    finally:
        _metrics._metrics = None
    for name in ("retries", "duplicates_dropped", "late_dropped", "timeouts", "taken_out"):
        assert samples[(f"asyncexec_router_{name}_total", None)] == 0
    assert samples[("asyncexec_router_replaced_total", None)] == 0
    for event in ("admitted", "consumed", "aborted", "requeued", "duplicates", "expired"):
        assert samples[("asyncexec_pipeline_samples_total", event)] == 0
    for mode in ("keep", "wait", "abort"):
        assert samples[("asyncexec_pipeline_pause_seconds_count", mode)] == 0
    assert samples[("asyncexec_channel_failed_pushes_total", None)] == 0
    assert samples[("asyncexec_channel_push_seconds_count", None)] == 1
    assert samples[("asyncexec_channel_version_lag", "0")] == 1  # holds 2 of 3
    assert samples[("asyncexec_channel_version_lag", "1")] == 0  # installed 3
    assert lags == []


def test_the_pipelines_requests_in_flight_are_a_gauge_set_at_each_batch_and_update() -> None:
    """The pipeline's requests in flight had no metric (issue 41 item 6): a gauge at 0 from the
    start, then the count at the latest sample event, set at each batch and each update."""
    import prometheus_client as prom

    from asyncexec._driver.pipeline._events import (
        Admitted,
        BatchHanded,
        SampleReturned,
        UpdateEnded,
    )
    from asyncexec._driver.pipeline._sinks import PipelineMetrics

    def in_flight() -> float | None:
        labels = {"executor": "rl", "router": "rl"}
        return registry.get_sample_value("asyncexec_pipeline_in_flight", labels)

    registry = prom.CollectorRegistry()
    asyncexec.enable_metrics(registry)
    try:
        sink = PipelineMetrics(_metrics.pipeline_meters("rl"))
        handlers = sink.handlers()
        assert in_flight() == 0
        for n in (1, 2, 3):
            handlers[Admitted](Admitted(n, 0))
        handlers[SampleReturned](SampleReturned("finished", 2, 1))
        handlers[BatchHanded](BatchHanded(0, (0,), 0, 0.0, 0, 1))
        assert in_flight() == 2
        handlers[Admitted](Admitted(3, 0))
        handlers[UpdateEnded](UpdateEnded("keep", 1, 0.01, 0.01, 2))
        assert in_flight() == 3
    finally:
        _metrics._metrics = None
