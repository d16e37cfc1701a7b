"""A web service on asyncexec: start a run per request, stream its steps to the client as
server-sent events, list and cancel runs, many at once in one event loop.

    pip install -e ".[service]"
    python examples/service.py --port 8000
    curl -N -X POST localhost:8000/runs -H 'content-type: application/json' -d '{"steps": 20}'
    curl localhost:8000/runs
    curl -X DELETE localhost:8000/runs/<id>

Endpoints:

- ``POST /runs`` with a JSON config (``steps``, ``step_s``, ``fail_at``) starts a run on its own
  group of workers, leased from the app's pool of warm workers (no process starts), and answers
  with an event stream: a ``run`` event (the run's id and state; also in the ``X-Run-Id``
  header), one ``step`` event per step (index, attempt, rank 0's ``metrics`` and every rank's in
  ``reports``, as a ``Step`` names them), and an ``end`` event (finished, failed or cancelled,
  with the result or the error).
  The stream is backpressured: a slow client slows its run down, and memory stays bounded.
  If the client goes away, its run is cancelled and its workers are stopped (and go back to the
  pool).
- ``GET /runs`` lists the runs and their state; ``GET /runs/{id}`` shows one.
- ``DELETE /runs/{id}`` cancels a run and answers once its workers have stopped (and are back in
  the pool).
- ``GET /healthz`` answers whether the service is up, its active runs, and its pool's counters.

Where the tasks live: an Executor must be entered and left in one task, and a request handler's
task ends with its response. So every run gets a task of its own in a task group that the app's
lifespan owns, and that task holds the run's Executor from start to teardown; the request's event
stream only reads from a bounded memory stream that the run's task writes to. Leaving the
lifespan (server shutdown) cancels the runs still going and waits for their teardown; open
streams end with their run's end event.

Warm workers: the lifespan also owns one :class:`asyncexec.WorkerPool` (``pool_size`` workers,
``--pool-size``), entered before the runs' task group and closed after it. Each run's Executor
leases its workers from the pool (milliseconds instead of a process start per request) and gives
them back when it closes; a worker that failed or did not stop in time is replaced in the
background. A ``pool_size`` of 0 or None starts fresh workers for every run instead. The
defaults (2 runs at once of 2 workers of 0.5 CPU) fit a 2-core machine.

Names: every run's Executor has the same name (``"service"``): an executor's name is a label of
the metrics and of the workers' threads, so it names a role, never a run. A run's id is in the
service's log lines and its record.

Ray: ``cli()`` starts Ray (or joins ``--address``) in the main thread before the server starts
its event loop. An app served some other way (``uvicorn --factory``) leaves it to the pool and
the executors, which start it in asyncexec's own thread (see ``asyncexec._driver.cluster._start``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal

import anyio
import anyio.abc
import ray
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import asyncexec

log = structlog.get_logger("service")

#: States of a run as the service shows them; the last three are final.
STATES = ("starting", "running", "restarting", "finished", "failed", "cancelled")


# The job the service runs ---------------------------------------------------------------------


def train(config: dict[str, Any]) -> dict[str, Any]:
    """A stand-in for a training job: ``steps`` steps of ``step_s`` seconds, one report each;
    it raises at step ``fail_at`` when that is set."""
    ctx = asyncexec.get_context()
    loss = 1.0 + 0.1 * ctx.world_rank
    for step in range(config["steps"]):
        time.sleep(config["step_s"])
        if step == config.get("fail_at"):
            raise RuntimeError(f"failed at step {step}, as the config asked")
        loss *= 0.95
        asyncexec.report({"step": step, "loss": round(loss, 6)})
    return {"rank": ctx.world_rank, "loss": loss}


def validate_train_config(body: Mapping[str, Any]) -> dict[str, Any]:
    """Check a request's config for :func:`train`; defaults: 20 steps of 0.1 s.

    Raises:
        ValueError: an unknown key, or a value of the wrong type or out of range.
    """
    unknown = set(body) - {"steps", "step_s", "fail_at"}
    if unknown:
        raise ValueError(f"unknown config keys: {sorted(unknown)}")
    steps = body.get("steps", 20)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 1_000_000:
        raise ValueError(f"steps must be an int from 1 to 1000000, got {steps!r}")
    step_s = body.get("step_s", 0.1)
    if not isinstance(step_s, int | float) or isinstance(step_s, bool) or not 0 <= step_s <= 60:
        raise ValueError(f"step_s must be a number of seconds from 0 to 60, got {step_s!r}")
    fail_at = body.get("fail_at")
    if fail_at is not None and (not isinstance(fail_at, int) or isinstance(fail_at, bool)):
        raise ValueError(f"fail_at must be a step number or null, got {fail_at!r}")
    return {"steps": steps, "step_s": float(step_s), "fail_at": fail_at}


# Runs ------------------------------------------------------------------------------------------


class TooManyRunsError(Exception):
    """The service already runs as many runs as it may."""


class ServiceClosingError(Exception):
    """The service is shutting down and starts no runs."""


class RunRecord:
    """One run as the service knows it: its config, its state, and the stream of its steps."""

    def __init__(self, config: Any, events_buffer: int) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.config = config
        self.created = time.time()
        self.finished: float | None = None
        self.steps = 0
        self.run: asyncexec.Run | None = None
        #: The process ids of the run's workers (of the current attempt), in rank order.
        self.pids: list[int] = []
        self.final: str | None = None
        self.error: str | None = None
        self.result: Any = None
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.send: MemoryObjectSendStream[dict[str, Any]]
        self.receive: MemoryObjectReceiveStream[dict[str, Any]]
        self.send, self.receive = anyio.create_memory_object_stream[dict[str, Any]](events_buffer)

    @property
    def state(self) -> str:
        """One of :data:`STATES`."""
        if self.final is not None:
            return self.final
        return "starting" if self.run is None else self.run.state.value

    def describe(self) -> dict[str, Any]:
        """The run as ``GET /runs`` shows it."""
        return {
            "id": self.id,
            "state": self.state,
            "config": self.config,
            "steps": self.steps,
            "attempt": self.run.attempt if self.run is not None else None,
            "run_id": self.run.run_id if self.run is not None else None,
            "pids": self.pids,
            "created": self.created,
            "finished": self.finished,
            "error": self.error,
            "result": self.result,
        }

    def cancel(self) -> None:
        """Ask the run to stop (idempotent; a finished run stays as it ended)."""
        if not self.done.is_set():
            self.scope.cancel()

    async def wait_done(self) -> None:
        """Wait until the run has ended and its workers are gone."""
        await self.done.wait()


class RunManager:
    """Starts runs in a task group it owns, each with its own Executor, and keeps their records.

    Args:
        fn: the function every run runs on its workers.
        validate: turns a request's JSON body into ``fn``'s config; raises ValueError.
        num_workers: workers per run.
        resources_per_worker: Ray resources of each worker.
        pool_size: warm workers the runs lease from (a :class:`asyncexec.WorkerPool` open while
            :meth:`running`); 0 or None: every run starts fresh workers.
        pool_options: more keyword arguments for the pool (``max_leases``, ``reset_hook``,
            ``when_short``: by default a run that finds too few idle workers, while one is
            being replaced, starts fresh ones for the rest).
        max_active_runs: runs that may be in progress at once; more are refused.
        buffer_size: reports a rank may have that the run's client has not taken yet.
        events_buffer: steps held between a run and its client's stream.
        keep_finished: finished runs remembered for ``GET /runs``.
        executor_options: more keyword arguments for every run's :class:`asyncexec.Executor`.
        name: the name of the pool and of every run's Executor (one name for all runs: it is
            a metrics label).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        validate: Callable[[Mapping[str, Any]], Any] | None = None,
        num_workers: int = 2,
        resources_per_worker: Mapping[str, float] | None = None,
        pool_size: int | None = None,
        pool_options: Mapping[str, Any] | None = None,
        max_active_runs: int = 4,
        buffer_size: int = 16,
        events_buffer: int = 16,
        keep_finished: int = 100,
        executor_options: Mapping[str, Any] | None = None,
        name: str = "service",
    ) -> None:
        if pool_size and pool_size < num_workers:
            raise ValueError(f"pool_size {pool_size} is smaller than a run's {num_workers} workers")
        self.fn = fn
        self.validate = validate
        self.num_workers = num_workers
        self.resources_per_worker = dict(resources_per_worker or {"CPU": 1})
        self.max_active_runs = max_active_runs
        self.buffer_size = buffer_size
        self.events_buffer = events_buffer
        self.keep_finished = keep_finished
        self.executor_options = dict(executor_options or {})
        self.name = name
        self.pool_size = pool_size or 0
        self.pool_options = dict(pool_options or {})
        #: The warm workers, while :meth:`running` (None without a pool).
        self.pool: asyncexec.WorkerPool | None = None
        self.records: dict[str, RunRecord] = {}
        #: Set when the service shuts down: the runs still going are cancelled. The server's
        #: event streams set it too (sse-starlette's shutdown_event), so that open streams see
        #: their runs end and send their end event before the server closes them.
        self.closing = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RunManager]:
        """Open the pool (ready: its workers started), then own the runs' task group; on the
        way out, cancel the runs still going, wait for their teardown (their workers go back
        to the pool), then close the pool (its workers killed)."""
        async with contextlib.AsyncExitStack() as stack:
            if self.pool_size:
                self.pool = await stack.enter_async_context(
                    asyncexec.WorkerPool(
                        self.pool_size,
                        resources_per_worker=self.resources_per_worker,
                        runtime_env=self.executor_options.get("runtime_env"),
                        address=self.executor_options.get("address"),
                        name=self.name,
                        **self.pool_options,
                    )
                )
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._cancel_all_when_closing)
                try:
                    yield self
                finally:
                    self._tg = None
                    self.closing.set()

    def pool_statistics(self) -> dict[str, int] | None:
        """The pool's counters (:class:`asyncexec.PoolStatistics`), or None without a pool."""
        if self.pool is None:
            return None
        return dataclasses.asdict(self.pool.statistics())

    async def _cancel_all_when_closing(self) -> None:
        await self.closing.wait()
        self._tg = None  # no new runs
        for record in self.records.values():
            record.cancel()

    def active(self) -> list[RunRecord]:
        return [r for r in self.records.values() if not r.done.is_set()]

    def start(self, body: Mapping[str, Any]) -> RunRecord:
        """Start a run of ``fn`` with the config made from ``body``.

        Raises:
            ValueError: the config is invalid.
            TooManyRunsError: ``max_active_runs`` runs are in progress.
            ServiceClosingError: the service is not serving (before start-up, after shutdown).
        """
        config = self.validate(body) if self.validate is not None else dict(body)
        if self._tg is None:
            raise ServiceClosingError("the service is not running")
        if len(self.active()) >= self.max_active_runs:
            raise TooManyRunsError(f"{self.max_active_runs} runs are in progress; try later")
        record = RunRecord(config, self.events_buffer)
        self.records[record.id] = record
        self._forget_old()
        self._tg.start_soon(self._drive, record, name=f"run-{record.id}")
        log.info("run_requested", id=record.id, config=config)
        return record

    def _forget_old(self) -> None:
        finished = [r for r in self.records.values() if r.done.is_set()]
        for record in finished[: max(0, len(finished) - self.keep_finished)]:
            del self.records[record.id]

    async def _drive(self, record: RunRecord) -> None:
        """The run's task: enter its Executor, feed its steps to the stream, leave the Executor
        (workers stopped, placement group removed), record how it ended. Never raises, except
        when the whole service is cancelled."""
        try:
            with record.scope:
                async with asyncexec.Executor(
                    self.num_workers,
                    resources_per_worker=self.resources_per_worker,
                    pool=self.pool,
                    name=self.name,
                    **self.executor_options,
                ) as executor:
                    record.pids = [w.pid for w in executor.workers]
                    run = executor.run(self.fn, record.config, buffer_size=self.buffer_size)
                    record.run = run
                    attempt = 1
                    async for step in run:
                        if step.attempt != attempt:  # a restart: a new group of workers
                            attempt = step.attempt
                            record.pids = [w.pid for w in executor.workers]
                        record.steps += 1
                        await record.send.send(_step_event(step))
                    record.result = _jsonable(run.result.return_values)
                record.final = "finished"
        except anyio.BrokenResourceError:
            pass  # the client stopped reading: a cancellation
        except asyncexec.AsyncExecError as exc:
            record.final = "failed"
            first_line = str(exc).partition("\n")[0]  # (an empty message has one too)
            record.error = f"{type(exc).__name__}: {first_line}"
        except Exception as exc:
            # One run's bug must not take the service down: it is recorded, logged with its
            # traceback, and told to the client in the run's end event.
            record.final = "failed"
            record.error = f"{type(exc).__name__}: {exc}"
            log.exception("run_crashed", id=record.id)
        finally:
            if record.final is None:
                record.final = "cancelled"
            record.finished = time.time()
            record.send.close()
            record.done.set()
            log.info("run_ended", id=record.id, state=record.final, steps=record.steps)


def _step_event(step: asyncexec.Step) -> dict[str, Any]:
    return {
        "index": step.index,
        "attempt": step.attempt,
        "metrics": _jsonable(dict(step.metrics)),
        "reports": [_jsonable(dict(r.metrics)) for r in step.reports],
        "checkpoint": step.checkpoint.path if step.checkpoint is not None else None,
    }


def _jsonable(value: Any) -> Any:
    """``value`` as JSON types (numbers that are not finite become null; other objects, text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        with contextlib.suppress(TypeError, ValueError):
            return _jsonable(item())
    return str(value)


async def _events(record: RunRecord) -> AsyncIterator[dict[str, str]]:
    """The SSE stream of one run. When it is left early (the client went away), the run is
    cancelled."""
    try:
        yield {"event": "run", "data": json.dumps(record.describe())}
        async for payload in record.receive:
            yield {"event": "step", "id": str(payload["index"]), "data": json.dumps(payload)}
        await record.wait_done()  # the workers are gone: the end event tells the final state
        yield {"event": "end", "data": json.dumps(record.describe())}
    finally:
        # First cancel (a no-op after the end), then close: the run's task then sees the
        # cancellation, not a broken stream.
        record.cancel()
        record.receive.close()


# The app ----------------------------------------------------------------------------------------


def create_app(
    fn: Callable[..., Any] = train,
    *,
    validate: Callable[[Mapping[str, Any]], Any] | None = validate_train_config,
    num_workers: int = 2,
    cpus_per_worker: float = 0.5,
    pool_size: int | Literal["auto"] | None = "auto",
    pool_options: Mapping[str, Any] | None = None,
    max_active_runs: int = 2,
    buffer_size: int = 16,
    storage_path: str | None = None,
    address: str | None = None,
    ping_s: float = 15.0,
    delete_timeout_s: float = 60.0,
    shutdown_grace_s: float = 10.0,
    executor_options: Mapping[str, Any] | None = None,
) -> Starlette:
    """Build the service.

    Args:
        fn: the function every run runs on its workers (:func:`train` by default).
        validate: turns a request's body into ``fn``'s config, raising ValueError when it is
            invalid (``None``: the body itself).
        num_workers: workers per run.
        cpus_per_worker: CPUs of each worker.
        pool_size: warm workers that runs lease instead of starting processes; ``"auto"``:
            enough for ``max_active_runs`` runs at once (``num_workers * max_active_runs``);
            0 or None: no pool, every run starts fresh workers.
        pool_options: more keyword arguments for the :class:`asyncexec.WorkerPool`.
        max_active_runs: runs in progress at once; more are answered 429.
        buffer_size: reports a rank may have that its client has not taken.
        storage_path: where runs persist checkpoints.
        address: the Ray cluster to join when the program has not started Ray (the pool and
            the executors then join it, or start a local Ray, in asyncexec's own thread; a
            program should start Ray before its event loop, as :func:`cli` does).
        ping_s: keep-alive comments on idle event streams, every this many seconds.
        delete_timeout_s: how long ``DELETE`` waits for the run's workers to be gone.
        shutdown_grace_s: on server shutdown, how long open streams get to send their run's
            end event (keep it below the server's graceful-shutdown timeout).
        executor_options: more keyword arguments for every run's :class:`asyncexec.Executor`.
    """
    options = dict(executor_options or {})
    if pool_size == "auto":
        pool_size = num_workers * max_active_runs
    if storage_path is not None:
        options["storage_path"] = storage_path
    if address is not None:
        options["address"] = address
    manager = RunManager(
        fn,
        validate=validate,
        num_workers=num_workers,
        resources_per_worker={"CPU": cpus_per_worker},
        pool_size=pool_size,
        pool_options=pool_options,
        max_active_runs=max_active_runs,
        buffer_size=buffer_size,
        executor_options=options,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Ready means ready: the service takes requests once the pool's workers are up.
        async with manager.running():
            # What exists now (Ray's objects, the imports, the pool) lives as long as the
            # service: out of the collector's way, full collections stall the loop far less
            # (docs/operating.md).
            gc.collect()
            gc.freeze()
            try:
                yield
            finally:
                gc.unfreeze()

    async def start_run(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as exc:
            # Not only JSONDecodeError: a body that is not UTF-8 (UnicodeDecodeError), an int
            # of more digits than Python converts (ValueError) or arrays nested past the
            # recursion limit (RecursionError) are bad input too, not a server error.
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object (the run's config)")
        try:
            record = manager.start(body)
        except ValueError as exc:
            return _error(400, str(exc))
        except TooManyRunsError as exc:
            return _error(429, str(exc))
        except ServiceClosingError as exc:
            return _error(503, str(exc))

        async def cancel_unless_done() -> None:
            # Also when the stream never started (the response failed before its first
            # event): a run nobody reads would otherwise hold its workers forever.
            record.cancel()

        return EventSourceResponse(
            _events(record),
            ping=ping_s,
            headers={"X-Run-Id": record.id},
            background=BackgroundTask(cancel_unless_done),
            # On server shutdown: cancel the runs, and give their streams time to tell the
            # clients (the end event) before the server closes them.
            shutdown_event=manager.closing,
            shutdown_grace_period=shutdown_grace_s,
        )

    async def list_runs(request: Request) -> Response:
        runs = sorted(manager.records.values(), key=lambda r: r.created)
        return JSONResponse({"runs": [r.describe() for r in runs]})

    async def get_run(request: Request) -> Response:
        record = manager.records.get(request.path_params["run_id"])
        if record is None:
            return _error(404, "no such run")
        return JSONResponse(record.describe())

    async def cancel_run(request: Request) -> Response:
        record = manager.records.get(request.path_params["run_id"])
        if record is None:
            return _error(404, "no such run")
        record.cancel()
        with anyio.move_on_after(delete_timeout_s):
            await record.wait_done()
        return JSONResponse(record.describe(), status_code=200 if record.done.is_set() else 202)

    async def health(request: Request) -> Response:
        return JSONResponse(
            {"ok": True, "active_runs": len(manager.active()), "pool": manager.pool_statistics()}
        )

    app = Starlette(
        routes=[
            Route("/runs", start_run, methods=["POST"]),
            Route("/runs", list_runs, methods=["GET"]),
            Route("/runs/{run_id}", get_run, methods=["GET"]),
            Route("/runs/{run_id}", cancel_run, methods=["DELETE"]),
            Route("/healthz", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.manager = manager
    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def cli() -> None:
    """Serve the app with uvicorn."""
    import uvicorn

    parser = argparse.ArgumentParser(description="A web service that runs asyncexec jobs.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2, help="workers per run (default 2)")
    parser.add_argument("--cpus-per-worker", type=float, default=0.5)
    parser.add_argument(
        "--pool-size",
        type=int,
        default=None,
        help="warm workers that runs lease (default: workers x max-active-runs; 0: none, "
        "every run starts its own processes)",
    )
    parser.add_argument(
        "--max-active-runs",
        type=int,
        default=2,
        help="runs at once (default 2: with the other defaults, a pool of 2 CPUs)",
    )
    parser.add_argument("--storage-path", default=None)
    parser.add_argument("--address", default=None, help="Ray cluster to join")
    parser.add_argument("--log-format", choices=("console", "json"), default="console")
    args = parser.parse_args()
    # Refused here, before Ray starts, rather than with a traceback from create_app.
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be from 0 to 65535, got {args.port}")
    lows = {"workers": 1, "max_active_runs": 1, "pool_size": 0}
    for name, value in ((name, getattr(args, name)) for name in lows):
        if value is not None and value < lows[name]:
            parser.error(f"--{name.replace('_', '-')} must be at least {lows[name]}, got {value}")
    if not args.cpus_per_worker > 0:
        parser.error(f"--cpus-per-worker must be positive, got {args.cpus_per_worker}")
    asyncexec.configure_logging(args.log_format, "info")
    # In the main thread, before the server's event loop starts: ray.init blocks for seconds,
    # and Ray's processes must outlive the thread that starts them.
    ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING)
    app = create_app(
        num_workers=args.workers,
        cpus_per_worker=args.cpus_per_worker,
        pool_size="auto" if args.pool_size is None else args.pool_size,
        max_active_runs=args.max_active_runs,
        storage_path=args.storage_path,
        address=args.address,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    cli()
