"""The service example's latency: from ``POST /runs`` to the first server-sent step event.

The real app (``examples/service.py``'s ``create_app``) is served by uvicorn in this process, on the
caller's event loop, from a socket bound to a free local port, as ``tests/examples/test_service.py``
serves it. Once its lifespan is up (Ray joined; with a pool, every warm worker started: the pool is
entered before the first request is answered), a real httpx client over TCP sends ``repeats``
requests one after another. Each request starts a run of one step that reports at once (``{"steps":
1, "step_s": 0}``); its sample is the seconds from sending ``POST /runs`` to receiving the stream's
first ``step`` event. The stream is then read to its ``end`` event, which the app sends once the
run's executor has closed (its workers given back to the pool, or stopped), so each request starts
from the same state.

With ``pool_size`` the app keeps that many warm workers and each run leases ``num_workers`` of
them; with ``None`` every run starts its own worker processes (cold), as the app did before it had
a pool. The server's start-up, the pool's included, is not in any sample.

Expects Ray started by the caller (``ray.init``), like the other benchmark modules, with the
repository root on the workers' import path: they import ``examples.service.train`` by name. Ray
puts the driver's current directory there, so a driver started from the repository root works;
``benchmarks/run.py`` also puts the root on ``PYTHONPATH`` before starting Ray. This module puts
the root on this process's ``sys.path``, so that ``examples.service`` imports here. Needs the
``service`` extra (starlette, sse-starlette, uvicorn, httpx).

The first request on each warm worker also pays that import in the worker (the train function
lives in the app's module, which imports starlette and sse-starlette): take the median.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import uvicorn

__all__ = ["measure_service_first_event"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Each request's run: one step, reported at once.
RUN_CONFIG = {"steps": 1, "step_s": 0}
#: Bound on one request, from the POST to the end event (a cold start takes seconds).
REQUEST_TIMEOUT_S = 120.0


async def measure_service_first_event(
    repeats: int,
    pool_size: int | None,
    *,
    num_workers: int = 4,
    resources_per_worker: dict[str, float] | None = None,
) -> list[float]:
    """Seconds from ``POST /runs`` to the first ``step`` event, for ``repeats`` requests in turn.

    Args:
        repeats: how many requests (samples).
        pool_size: warm workers the app keeps (at least ``num_workers``); ``None``: no pool,
            every run starts its own processes.
        num_workers: workers per run.
        resources_per_worker: Ray resources of each worker; only ``"CPU"`` is used (the app's
            ``cpus_per_worker``), ``{"CPU": 0.25}`` by default.

    Raises:
        RuntimeError: a request was not answered with an event stream, or its run did not
            finish.
    """
    service = _service_module()
    cpus = (resources_per_worker or {"CPU": 0.25}).get("CPU", 0.25)
    with tempfile.TemporaryDirectory(prefix="asyncexec-bench-service-") as storage:
        app = service.create_app(
            num_workers=num_workers,
            cpus_per_worker=cpus,
            pool_size=pool_size,
            max_active_runs=1,
            storage_path=storage,
        )
        return await _serve_and_measure(app, repeats)


async def _serve_and_measure(app: Any, repeats: int) -> list[float]:
    """Serve ``app`` with uvicorn on a free local port while the requests are measured, then
    shut it down gracefully (its lifespan closes the pool) and return the samples."""
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(
        app, lifespan="on", log_config=None, log_level="warning", timeout_graceful_shutdown=30
    )
    server = uvicorn.Server(config)
    samples: list[float] = []
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            # Connections wait in the socket's backlog until the server (and its lifespan) is up.
            tg.start_soon(server.serve, [sock])
            try:
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    # Answered once the lifespan is up: the pool's workers are started.
                    (await http.get("/healthz")).raise_for_status()
                    for _ in range(repeats):
                        with anyio.fail_after(REQUEST_TIMEOUT_S):
                            samples.append(await _first_event_s(http))
            except Exception as exc:
                # Raised once the server has shut down gracefully (its runs torn down, its pool
                # closed), not from a task group that would cancel its lifespan half-way.
                failure = exc
            finally:
                server.should_exit = True
    finally:
        sock.close()
    if failure is not None:
        raise failure
    return samples


async def _first_event_s(http: httpx.AsyncClient) -> float:
    """One request: the seconds to its first step event; then its stream, read to the end."""
    first: float | None = None
    end: dict[str, Any] | None = None
    t0 = time.perf_counter()
    async with http.stream("POST", "/runs", json=RUN_CONFIG) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"POST /runs answered {response.status_code}: {response.text}")
        async for event, data in _sse_events(response):
            if event == "step" and first is None:
                first = time.perf_counter() - t0
            elif event == "end":
                end = data
    if first is None or end is None or end["state"] != "finished":
        raise RuntimeError(f"the run did not finish with a step: {end!r}")
    return first


def _service_module() -> Any:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return importlib.import_module("examples.service")


async def _sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, Any]]:
    """Parse a text/event-stream body into (event, decoded JSON data) pairs."""
    event = "message"
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif not line.startswith(":"):  # a comment is a keep-alive
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
