"""The worker's one typed interface (``asyncexec._wire._interface``), which the Ray actor's
code, the local worker and the simulated worker implement, method for method; the simulated cluster
running roles and dispatch on it; and the programs asyncexec ships, which freeze their heap once
their groups have started (docs/operating.md's advice: a full collection of Ray's heap stalls
the loop)."""

from __future__ import annotations

import ast
import asyncio
import gc
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import anyio
import pytest
from conftest import import_example

import asyncexec
from asyncexec.__main__ import main
from asyncexec._driver.cluster import WorkerProxy
from asyncexec._driver.cluster._local import _ThreadWorker
from asyncexec._driver.cluster._sim import SimWorker
from asyncexec._wire._interface import WORKER_METHODS, WorkerInterface, WorkerMethod
from asyncexec._worker import ThreadedWorkerCode, WorkerCode
from asyncexec.testing import SimCluster, SimLoad

ROOT = Path(__file__).resolve().parents[2]
NO_HEALTH = asyncexec.HealthChecks(interval_s=None)


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The collector as a fresh program has it (nothing frozen), before and after the test."""
    gc.unfreeze()
    yield
    gc.unfreeze()


# gc.freeze() after start-up ---------------------------------------------------------------------


def reports_the_frozen_heap(config: Any = None) -> None:
    """A run's function (in local mode, a thread of the test's process): how many objects the
    collector holds frozen while the run goes on."""
    asyncexec.report({"frozen": gc.get_freeze_count()})


@pytest.mark.usefixtures("unfrozen")
@pytest.mark.timeout(30)
def test_asyncexec_run_freezes_the_heap_once_the_group_has_started(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Frozen while the run goes on (local mode: the function runs in this process), and
    unfrozen when the command returns (a test, or a program, that calls it in-process gets
    its collector back)."""
    rc = main(
        [
            "run",
            "test_worker_interface:reports_the_frozen_heap",
            "--workers",
            "1",
            "--local",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    steps = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(steps) == 1 and steps[0]["metrics"]["frozen"] > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.usefixtures("unfrozen")
@pytest.mark.timeout(30)
async def test_the_service_freezes_the_heap_once_its_pool_is_up() -> None:
    """Its lifespan (no pool here, so no Ray) freezes the heap before it serves, and unfreezes
    it on the way out."""
    pytest.importorskip("starlette")
    service = import_example("service")
    app = service.create_app(pool_size=0)
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


# One typed interface, three workers -------------------------------------------------------------

IMPLEMENTATIONS = {
    "actor": WorkerCode,
    "threaded actor": ThreadedWorkerCode,
    "local": _ThreadWorker,
    "simulated": SimWorker,
    "the driver's proxy": WorkerProxy,
}


def _parameters(fn: Any) -> list[tuple[str, Any, Any]]:
    """A method's parameters as the driver sees them: name, kind, default (types are mypy's).
    Ray's tracing adds a keyword of its own to an actor class's methods: not the worker's."""
    parameters = inspect.signature(fn).parameters.values()
    return [(p.name, p.kind, p.default) for p in parameters if p.name != "_ray_trace_ctx"]


@pytest.mark.parametrize("kind", sorted(IMPLEMENTATIONS))
def test_each_worker_implements_every_method_of_the_interface(kind: str) -> None:
    cls = IMPLEMENTATIONS[kind]
    wrong = {}
    for name in sorted(WORKER_METHODS):
        method = getattr(cls, name, None)
        if method is None:
            wrong[name] = "missing"
        elif _parameters(method) != _parameters(getattr(WorkerInterface, name)):
            wrong[name] = str(inspect.signature(method))
    assert wrong == {}


def test_the_interface_holds_every_remote_method_of_the_actor() -> None:
    remote = {
        name
        for name, value in vars(WorkerCode).items()
        if not name.startswith("_") and inspect.iscoroutinefunction(value)
    }
    assert remote == set(WORKER_METHODS)


#: Where the method's name is among the arguments of each way of calling a worker by name.
_NAME_AT = {"call": 0, "call_n": 0, "_call": 0, "submit": 2, "submit_n": 2, "submit_named": 3}


def _names_called() -> dict[str, str]:
    """Every method name the driver calls on a worker by name (``handle.call("name", ...)``,
    ``call_n``, a ``call`` taken from a handle, the seam's ``submit(caller, worker, "name",
    ...)`` and its proxy's ``_call("name", ...)``), with where."""
    called = {}
    for path in sorted((ROOT / "asyncexec" / "_driver").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            at = _NAME_AT.get(name) if isinstance(name, str) else None
            if (
                isinstance(node, ast.Call)
                and at is not None
                and len(node.args) > at
                and isinstance(node.args[at], ast.Constant)
                and isinstance(node.args[at].value, str)
            ):
                called[node.args[at].value] = f"{path.relative_to(ROOT)}:{node.lineno}"
    return called


def test_the_names_a_handle_takes_are_the_interface_s_methods() -> None:
    """``WorkerMethod`` (what mypy checks every ``handle.call`` name against) is the interface's
    methods (Ray's graceful exit is the cluster's kill's, never called by name)."""
    assert set(get_args(WorkerMethod)) == WORKER_METHODS


def test_every_method_the_driver_calls_by_name_is_in_the_interface() -> None:
    called = _names_called()
    assert {"call_method", "make_roles", "poll", "setup"} <= set(called)  # the scan finds them
    unknown = {n: where for n, where in called.items() if n not in WORKER_METHODS}
    assert unknown == {}


# The simulated cluster runs roles and dispatch --------------------------------------------------


class Shard:
    """A role for simulated ranks: state kept on the instance, a plain and an async method."""

    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.rank = asyncexec.get_context().world_rank
        self.seen: list[int] = []

    def take(self, part: list[int]) -> dict[str, Any]:
        self.seen.extend(part)
        return {"rank": self.rank, "sum": sum(part) * self.scale}

    def seen_count(self) -> int:
        return len(self.seen)

    async def wait(self, event_name: str) -> int:
        ARRIVED.append(self.rank)
        if len(ARRIVED) == 4:
            EVENTS["all_in"].set()
        await EVENTS[event_name].wait()
        return self.rank

    def fail(self) -> None:
        raise KeyError(f"no shard on rank {self.rank}")


EVENTS: dict[str, asyncio.Event] = {}
ARRIVED: list[int] = []


async def async_rank() -> int:
    await asyncio.sleep(0)
    return asyncexec.get_context().world_rank


@pytest.mark.timeout(30)
async def test_simulated_ranks_run_roles_and_every_dispatch_form() -> None:
    """Instances made on every simulated rank (``get_context()`` works in ``__init__``), a
    scatter, one rank, least-loaded under a cap with async methods in flight, a raised error,
    and an ``async def`` function through ``execute`` (awaited, not left a coroutine)."""
    cluster = SimCluster(SimLoad(reports=1))
    role = asyncexec.Role(Shard, 10)
    async with asyncexec.Executor(4, roles=role, health=NO_HEALTH, cluster=cluster) as ex:
        results = await ex.call(Shard.take, asyncexec.scatter(list(range(10))))
        assert [r["rank"] for r in results] == [0, 1, 2, 3]
        assert sum(r["sum"] for r in results) == 10 * sum(range(10))
        counts = await ex.call(Shard.seen_count)
        assert await ex.call(Shard.seen_count, on=asyncexec.rank(2)) == counts[2]
        assert sum(counts) == 10 and all(c > 0 for c in counts)  # state kept per instance
        EVENTS.update(held=asyncio.Event(), all_in=asyncio.Event())
        ARRIVED.clear()
        cap = asyncexec.least_loaded(max_in_flight=1)
        async with anyio.create_task_group() as tg:
            ranks: list[int] = []

            async def one() -> None:
                ranks.append(await ex.call(Shard.wait, "held", on=cap))

            for _ in range(4):
                tg.start_soon(one)
            await EVENTS["all_in"].wait()
            assert sorted(ARRIVED) == [0, 1, 2, 3]  # a cap of 1: each rank holds one
            EVENTS["held"].set()
        assert sorted(ranks) == [0, 1, 2, 3]
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            await ex.call(Shard.fail, on=asyncexec.rank(3))
        assert info.value.rank == 3 and isinstance(info.value.__cause__, KeyError)
        assert await ex.execute(async_rank) == [0, 1, 2, 3]


@pytest.mark.timeout(30)
async def test_a_killed_simulated_rank_fails_the_calls_it_holds() -> None:
    """A call held by an ``async def`` method of a simulated rank that is killed fails, as a
    dead actor's calls do, instead of waiting for ever."""
    cluster = SimCluster(SimLoad(reports=1))
    role = asyncexec.Role(Shard, 1)
    async with asyncexec.Executor(2, roles=role, health=NO_HEALTH, cluster=cluster) as ex:
        EVENTS.update(never=asyncio.Event(), all_in=asyncio.Event())
        ARRIVED[:] = [0, 0, 0]  # the fourth arrival sets all_in
        failed: list[BaseException] = []

        async def held() -> None:
            try:
                await ex.call(Shard.wait, "never", on=asyncexec.rank(1))
            except asyncexec.WorkerError as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(held)
            await EVENTS["all_in"].wait()
            cluster.crash(ex.workers[1].pid)
        assert [type(e).__name__ for e in failed] == ["WorkerCrashedError"]
        assert failed[0].rank == 1  # type: ignore[attr-defined]
