"""examples/service.py against a real uvicorn server, a real HTTP client and a real Ray.

The server runs in-process on 127.0.0.1 (a socket bound to a free port) in the test's event loop;
the client is httpx over TCP. Every app has a pool of warm workers (the no-pool path is the
failing-run test's second case). (httpx's ASGITransport is not used: it hands the app's response to
the client only once the app has finished it, so it cannot stream, and it cannot deliver a client
that goes away mid-stream.)
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import httpx
import pytest
import ray
import uvicorn
from conftest import cluster_held, live_workers

from asyncexec.testing import metrics_enabled

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    # Imported as examples.service: the workers import train() by that name (the repository
    # root is on their PYTHONPATH).
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("examples.service")


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Serve ``app`` with uvicorn on a free local port; yield its URL and the server; on the way
    out, shut it down (its lifespan cancels the runs still going and waits for their teardown)."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, lifespan="on", log_config=None, log_level="warning", timeout_graceful_shutdown=30
    )
    server = uvicorn.Server(config)
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        # Connections wait in the socket's backlog until the server (and its lifespan) is up.
        tg.start_soon(server.serve, [sock])
        try:
            yield f"http://127.0.0.1:{port}", server
        except Exception as exc:
            # A failed assertion still shuts the server down gracefully (runs torn down, not
            # abandoned in a cancelled lifespan task); the error is raised afterwards.
            failure = exc
        finally:
            server.should_exit = True
    sock.close()
    if failure is not None:
        raise failure


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, Any]]:
    """Parse a text/event-stream body into (event, decoded JSON data) pairs."""
    event, data = "message", []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue  # a keep-alive comment
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("ray_local")
async def test_concurrent_runs_interleave_a_disconnect_cancels_its_run_the_other_finishes(
    tmp_path: Path,
) -> None:
    """Run A (too long to finish during the test) and run B stream at once; B's steps arrive
    between A's and A's between B's; B finishes; then A's client goes away and A is cancelled:
    its state says so and nothing of it is left in the cluster (checked by ray_local)."""
    service = _example()
    app = service.create_app(
        num_workers=2, cpus_per_worker=0.5, pool_size=4, storage_path=str(tmp_path)
    )
    arrivals: list[str] = []
    b_done = anyio.Event()
    ids: dict[str, str] = {}
    events: dict[str, list[tuple[str, Any]]] = {"a": [], "b": []}

    async def client(url: str, name: str, config: dict[str, Any]) -> None:
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as http,
            http.stream("POST", "/runs", json=config) as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            ids[name] = response.headers["x-run-id"]
            async for event, data in sse_events(response):
                events[name].append((event, data))
                if event == "step":
                    arrivals.append(name)
                # A leaves mid-run once B has finished and A has streamed a little more.
                if name == "a" and b_done.is_set() and arrivals[-3:] == ["a"] * 3:
                    return
        if name == "b":
            b_done.set()

    async with serving(app) as (url, _):
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client, url, "a", {"steps": 100_000, "step_s": 0.05})
                tg.start_soon(client, url, "b", {"steps": 30, "step_s": 0.05})
            record_a = app.state.manager.records[ids["a"]]
            await record_a.wait_done()  # the disconnect cancelled it; its workers are gone
        async with httpx.AsyncClient(base_url=url) as http:
            listing = (await http.get("/runs")).json()["runs"]
            one = (await http.get(f"/runs/{ids['a']}")).json()

    states = {run["id"]: run["state"] for run in listing}
    assert states == {ids["a"]: "cancelled", ids["b"]: "finished"}
    assert one["state"] == "cancelled"
    assert 3 <= one["steps"] < 100_000

    # Interleaved: each run's steps arrived while the other was streaming.
    first_b, last_b = arrivals.index("b"), len(arrivals) - 1 - arrivals[::-1].index("b")
    assert "a" in arrivals[first_b:last_b]
    first_a = arrivals.index("a")
    assert first_a < last_b
    assert "b" in arrivals[first_a:]

    # B's stream: the run event, every step in order with both ranks, and the end.
    kinds = [event for event, _ in events["b"]]
    assert kinds == ["run"] + ["step"] * 30 + ["end"]
    steps = [data for event, data in events["b"] if event == "step"]
    assert [s["index"] for s in steps] == list(range(30))
    assert all(len(s["reports"]) == 2 and s["attempt"] == 1 for s in steps)
    assert [s["reports"][0]["step"] for s in steps] == list(range(30))
    assert all(s["metrics"] == s["reports"][0] for s in steps)
    end = events["b"][-1][1]
    assert (end["state"], end["steps"], end["id"]) == ("finished", 30, ids["b"])
    assert [r["rank"] for r in end["result"]] == [0, 1]
    # A's stream stopped where its client left: no end event.
    assert events["a"][0][0] == "run"
    assert events["a"][-1][0] == "step"


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("ray_local")
async def test_delete_cancels_a_streaming_run_and_its_stream_ends(tmp_path: Path) -> None:
    service = _example()
    app = service.create_app(
        num_workers=2,
        cpus_per_worker=0.5,
        pool_size=2,
        storage_path=str(tmp_path),
        max_active_runs=1,
    )
    async with serving(app) as (url, _), httpx.AsyncClient(base_url=url, timeout=60) as http:
        with anyio.fail_after(60):
            config = {"steps": 100_000, "step_s": 0.02}
            async with http.stream("POST", "/runs", json=config) as response:
                stream = sse_events(response)
                event, run = await anext(stream)
                assert (event, run["state"]) == ("run", "starting")
                event, step = await anext(stream)
                assert (event, step["index"]) == ("step", 0)

                # One run at a time here: another is refused while this one runs.
                refused = await http.post("/runs", json={"steps": 1})
                assert refused.status_code == 429

                deleted = await http.delete(f"/runs/{run['id']}")
                assert deleted.status_code == 200
                assert deleted.json()["state"] == "cancelled"
                # The stream drains what was sent, then ends with the final state.
                rest = [item async for item in stream]
            assert rest[-1][0] == "end"
            assert rest[-1][1]["state"] == "cancelled"
            assert all(event == "step" for event, _ in rest[:-1])

        again = await http.delete(f"/runs/{run['id']}")  # idempotent
        assert again.json()["state"] == "cancelled"
        assert (await http.get("/runs/nope")).status_code == 404
        assert (await http.delete("/runs/nope")).status_code == 404
        bad = await http.post("/runs", json={"steps": "many"})
        assert bad.status_code == 400
        assert "steps" in bad.json()["error"]
        assert (await http.post("/runs", content=b"[1, 2]")).status_code == 400


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("pool_size", [2, None], ids=["pool", "fresh-workers"])
async def test_failing_run_ends_its_stream_with_the_error(
    tmp_path: Path, pool_size: int | None
) -> None:
    service = _example()
    app = service.create_app(
        num_workers=2, cpus_per_worker=0.5, pool_size=pool_size, storage_path=str(tmp_path)
    )
    async with serving(app) as (url, _), httpx.AsyncClient(base_url=url, timeout=60) as http:
        with anyio.fail_after(60):
            async with http.stream(
                "POST", "/runs", json={"steps": 10, "step_s": 0.01, "fail_at": 3}
            ) as response:
                items = [item async for item in sse_events(response)]
        health = (await http.get("/healthz")).json()
    kinds = [event for event, _ in items]
    assert kinds[0] == "run"
    assert kinds[-1] == "end"
    assert set(kinds[1:-1]) <= {"step"}
    assert len(kinds) - 2 <= 3  # steps 0-2 at most: every rank raises at step 3
    end = items[-1][1]
    assert end["state"] == "failed"
    assert "WorkerRaisedError" in end["error"]
    assert "failed at step 3" in end["error"]
    assert (health["ok"], health["active_runs"]) == (True, 0)
    if pool_size is None:
        assert health["pool"] is None
    else:  # the workers are back (or, if the pool replaced them, being replaced)
        assert (health["pool"]["size"], health["pool"]["leased"]) == (2, 0)


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("ray_local")
async def test_server_shutdown_cancels_the_runs_in_progress(tmp_path: Path) -> None:
    """Stopping the server ends the open event streams and cancels their runs; the lifespan waits
    for their teardown (ray_local then finds nothing left)."""
    service = _example()
    app = service.create_app(
        num_workers=2, cpus_per_worker=0.5, pool_size=2, storage_path=str(tmp_path)
    )
    with anyio.fail_after(60):
        async with serving(app) as (url, server), httpx.AsyncClient(base_url=url) as http:
            config = {"steps": 100_000, "step_s": 0.02}
            async with http.stream("POST", "/runs", json=config) as response:
                stream = sse_events(response)
                _, run = await anext(stream)
                assert (await anext(stream))[0] == "step"
                server.should_exit = True
                rest = [item async for item in stream]  # the server ends the stream
        record = app.state.manager.records[run["id"]]
        assert record.done.is_set()  # the lifespan waited for the teardown
    assert record.state == "cancelled"
    assert rest[-1][0] == "end"
    assert rest[-1][1]["state"] == "cancelled"
    assert all(event == "step" for event, _ in rest[:-1])


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("ray_local")
async def test_requests_lease_the_pools_warm_workers_and_the_pool_closes_with_the_app(
    tmp_path: Path,
) -> None:
    """The lifespan starts the pool before the first request; each run then runs on the pool's
    warm processes (no process starts), which are all idle again once its stream has ended; the
    next run gets the same processes; leaving the lifespan kills them."""
    service = _example()
    app = service.create_app(
        num_workers=2, cpus_per_worker=0.5, pool_size=2, storage_path=str(tmp_path)
    )
    prom = pytest.importorskip("prometheus_client")
    with metrics_enabled() as registry:
        async with (
            serving(app) as (url, _),
            httpx.AsyncClient(base_url=url, timeout=60) as http,
        ):
            with anyio.fail_after(60):
                health = (await http.get("/healthz")).json()  # answered once the lifespan is up
                assert health["pool"] == {
                    "size": 2,
                    "idle": 2,
                    "leased": 0,
                    "starting": 0,
                    "leases": 0,
                    "returned": 0,
                    "replaced": 0,
                    "fresh_for_leases": 0,
                }
                warm = {actor["Pid"] for actor in live_workers()}
                assert len(warm) == 2  # the pool's, and nothing else

                runs = []
                for _ in range(2):
                    config = {"steps": 5, "step_s": 0.01}
                    async with http.stream("POST", "/runs", json=config) as response:
                        stream = sse_events(response)
                        assert (await anext(stream))[0] == "run"
                        assert (await anext(stream))[0] == "step"
                        # While the run streams, its workers are leased from the pool.
                        during = (await http.get("/healthz")).json()["pool"]
                        assert (during["idle"], during["leased"]) == (0, 2)
                        running = (await http.get(f"/runs/{response.headers['x-run-id']}")).json()
                        rest = [item async for item in stream]
                    assert rest[-1][0] == "end"
                    end = rest[-1][1]
                    assert end["state"] == "finished"
                    assert end["pids"] == running["pids"]
                    runs.append(set(end["pids"]))
                    # The end event comes once the executor has closed: its workers are back.
                    after = (await http.get("/healthz")).json()["pool"]
                    assert (after["idle"], after["leased"], after["replaced"]) == (2, 0, 0)
                assert runs == [warm, warm]  # the pool's processes, the same ones for each run
                assert {actor["Pid"] for actor in live_workers()} == warm  # none started
                pool_stats = (await http.get("/healthz")).json()["pool"]
                assert (pool_stats["leases"], pool_stats["fresh_for_leases"]) == (2, 0)
                # The runs' executors share one name: runs add no label value to the metrics
                # (the run id is in the logs and the run record).
                scraped = prom.generate_latest(registry).decode()
                assert set(re.findall(r'executor="([^"]*)"', scraped)) == {"service"}
                assert 'asyncexec_runs_total{executor="service",outcome="finished"} 2.0' in scraped
    # The lifespan closed the pool: its workers are gone (ray_local checks placement groups).
    assert live_workers() == []
    assert app.state.manager.pool.statistics().idle == 0


@pytest.mark.timeout(60)
async def test_a_body_that_is_not_json_is_answered_400_not_500() -> None:
    """Defect: a body that json.loads refuses with another error than JSONDecodeError (not
    UTF-8, an int of more digits than Python converts, arrays nested past the recursion limit)
    was answered 500 Internal Server Error instead of 400. No Ray: the app has no pool, and no
    run starts."""
    service = _example()
    app = service.create_app(pool_size=None, executor_options={"local": True})
    bodies = [b"\x80", b'{"steps": ' + b"1" * 5000 + b"}", b"[" * 100_000]
    async with serving(app) as (url, _), httpx.AsyncClient(base_url=url, timeout=30) as http:
        with anyio.fail_after(30):
            for body in bodies:
                response = await http.post("/runs", content=body)
                assert response.status_code == 400, (body[:20], response.text)
                assert response.json()["error"].startswith("the body is not JSON")
            assert (await http.get("/healthz")).json()["active_runs"] == 0


#: What the test below holds of the shared Ray's 4 CPUs: 2 are left, as on a 2-core machine.
LOCAL_CPUS_HELD = 2

_RECORD_RAY_INIT = """
import sys, threading, ray
init = ray.init
def recorded_init(*args, **kwargs):
    print("ray_init_thread", threading.current_thread().name, flush=True)
    return init(*args, **kwargs)
ray.init = recorded_init
"""
#: How the service is started: as docs/services.md gives it (``python examples/service.py``: its
#: cli()), and as an app factory served by uvicorn, where nothing but asyncexec starts Ray.
#: ``sys.argv[1]`` is the port.
_SERVE = {
    "main": """
import runpy
sys.argv = ["examples/service.py", "--port", sys.argv[1]]
runpy.run_path("examples/service.py", run_name="__main__")
""",
    "factory": """
import uvicorn
sys.path.insert(0, ".")
from examples.service import create_app
uvicorn.run(create_app(), host="127.0.0.1", port=int(sys.argv[1]))
""",
}
#: The thread that starts Ray: the main one, before the server's loop; else asyncexec's own.
_RAY_STARTED_IN = {"main": "MainThread", "factory": "asyncexec-ray"}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("how", ["main", "factory"])
async def test_the_service_serves_with_its_defaults_on_two_free_cpus(how: str) -> None:
    """Defect: ``python examples/service.py --port 8000`` (docs/services.md) asked for a pool of
    2 workers x 4 runs x 0.5 CPU, which a 2-core machine cannot place, and the app's lifespan
    called ``ray.init`` in an anyio worker thread. With 2 CPUs free (the rest of the shared Ray
    held), its defaults serve; Ray is started (joined here, through RAY_ADDRESS) in the main
    thread before the server's loop, or in asyncexec's lifelong thread, never a worker thread."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    url = f"http://127.0.0.1:{port}"
    with cluster_held({"CPU": LOCAL_CPUS_HELD}):
        process = await anyio.open_process(
            [sys.executable, "-c", _RECORD_RAY_INIT + _SERVE[how], str(port)],
            cwd=ROOT,
            env=env,
            stderr=subprocess.STDOUT,
        )
        output: list[str] = []
        up = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:

                async def read_output() -> None:
                    assert process.stdout is not None
                    async for chunk in process.stdout:
                        output.append(chunk.decode(errors="replace"))
                        # uvicorn says so once its socket listens; "Application startup
                        # complete" comes before it binds, and a client that went then could
                        # find nothing there (CI, stop 60).
                        if "Uvicorn running on" in "".join(output[-3:]):
                            up.set()
                    up.set()  # the server ended before it listened: the assert below says so

                tg.start_soon(read_output)
                with anyio.fail_after(45):  # before the fix: the pool waited to be placed
                    await up.wait()
                assert "Uvicorn running on" in "".join(output), "".join(output)[-3000:]
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    config = {"steps": 3, "step_s": 0.01}
                    async with http.stream("POST", "/runs", json=config) as response:
                        items = [item async for item in sse_events(response)]
                    health = (await http.get("/healthz")).json()
                process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
                with anyio.fail_after(30):
                    await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    text = "".join(output)
    assert items[-1][0] == "end" and items[-1][1]["state"] == "finished", text[-3000:]
    assert (health["pool"]["size"], health["pool"]["leased"]) == (4, 0)  # 2 runs x 2 workers
    assert re.findall(r"ray_init_thread (.+)", text) == [_RAY_STARTED_IN[how]], text[-3000:]
    assert process.returncode == 0, text[-3000:]
