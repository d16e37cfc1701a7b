"""A role method's call sent as one Ray argument: the Ray handle packs the method key and the
positional arguments into one list (``_interface.packed``: each argument of a Ray call is
serialised apart on the driver and on the worker) unless there are keyword arguments or an
``ObjectRef`` among them (a scattered part, a reference the caller passed: Ray resolves only
those at the top); the worker takes either form (``_interface.unpacked``), in local mode and on
simulated ranks too; and the quick plan, which binds a method's arguments once per count."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import ray
from conftest import wait_no_local_threads

import asyncexec
from asyncexec._driver.cluster import _ray
from asyncexec._driver.cluster._local import LocalWorker
from asyncexec._driver.cluster._sim import SimWorker
from asyncexec._wire._interface import packed, unpacked
from asyncexec.testing import SimCluster, SimLoad, simulated

CPU = {"CPU": 0.25}


class Adder:
    """Answers what arrived, so a test sees each argument as the method got it."""

    async def add(self, a: Any, b: Any = 0, *, c: Any = 0) -> Any:
        return [type(a).__name__, a + b + c if not isinstance(a, list) else a]

    def plain_add(self, a: int, b: int) -> int:
        return a + b

    async def total(self, part: Any, offset: int) -> float:
        return float(np.asarray(part).sum()) + offset


def test_packed_and_unpacked_round_trip() -> None:
    """The key first, the arguments after it, whatever they are (a list argument included);
    a call that was not packed is left as it is."""
    for args in [(), (1,), ([1, 2], "x"), ([],)]:
        lead = packed(("0:add", *args))
        assert type(lead) is list
        assert unpacked(lead, ()) == ("0:add", args)
    assert unpacked("0:add", ([1, 2], 3)) == ("0:add", ([1, 2], 3))


def packing(call: Any) -> Any:
    """A handle's ``call`` that packs a role method's call as the Ray handle does."""

    def packing_call(self: Any, method: str, /, *args: Any, **kwargs: Any) -> Any:
        if method in ("call_method", "call_method_sync") and not kwargs:
            return call(self, method, packed(args))
        return call(self, method, *args, **kwargs)

    return packing_call


async def answers_packed_calls() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Adder) as ex:
        assert await ex.call(Adder.add, 1, 2) == [["int", 3]] * 2
        assert await ex.call(Adder.add, [1, 2], on=asyncexec.rank(1)) == ["list", [1, 2]]
        assert await ex.call(Adder.plain_add, 4, 5, on=asyncexec.least_loaded()) == 9


@pytest.mark.timeout(30)
async def test_simulated_ranks_take_a_packed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated worker implements the same interface: a packed call is the same call."""
    monkeypatch.setattr(SimWorker, "call", packing(SimWorker.call))
    with simulated(SimCluster(SimLoad(reports=1))):
        await answers_packed_calls()


@pytest.mark.timeout(30)
async def test_local_workers_take_a_packed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The local worker runs the actor's code: a packed call is the same call."""
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    monkeypatch.setattr(LocalWorker, "call", packing(LocalWorker.call))
    await answers_packed_calls()
    wait_no_local_threads()


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What the Ray handle packed, call by call."""
    seen: list[tuple[Any, ...]] = []

    def spy(args: tuple[Any, ...]) -> list[Any]:
        seen.append(args)
        return packed(args)

    monkeypatch.setattr(_ray, "packed", spy)
    return seen


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("ray_local")
async def test_ray_handle_packs_plain_positional_calls_only(packs: list[tuple[Any, ...]]) -> None:
    """Positional arguments of plain values go packed (an ``async def`` and a plain method
    alike, a list argument arriving as a list); keyword arguments, a caller's ``ObjectRef``
    and a scattered part that was put go as separate arguments, the reference resolved."""
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=Adder) as ex:
        assert await ex.call(Adder.add, 1, 2) == [["int", 3]]
        assert await ex.call(Adder.add, [1, 2]) == [["list", [1, 2]]]
        assert await ex.call(Adder.plain_add, 4, 5) == [9]
        assert [args[1:] for args in packs] == [(1, 2), ([1, 2],), (4, 5)]
        packs.clear()
        assert await ex.call(Adder.add, 1, c=5) == [["int", 6]]
        assert await ex.call(Adder.add, ray.put(7), 1) == [["int", 8]]
        big = np.ones(100_000)  # over the inline limit: put, sent as an ObjectRef
        assert await ex.call(Adder.total, asyncexec.scatter(big), 1) == [100_001.0]
        assert packs == []


def test_the_quick_plan_binds_a_method_once_per_argument_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The arguments' names of a role method's call (its signature bound) are found once per
    number of arguments; a call that does not bind raises each time."""
    import asyncexec._dispatch._plan as dispatch

    bound: list[int] = []
    real = dispatch._role_method_names

    def counting(fn: Any, with_self: bool, positional: int, keywords: tuple[str, ...]) -> Any:
        bound.append(positional)
        return real(fn, with_self, positional, keywords)

    monkeypatch.setattr(dispatch, "_role_method_names", counting)
    roles = [asyncexec.Role(Adder)]
    for _ in range(3):
        assert dispatch.plan_call(Adder.plain_add, (1, 2), {}, 2, roles=roles).names == (
            "argument 'a'",
            "argument 'b'",
        )
        with pytest.raises(asyncexec.ConfigurationError, match="do not bind"):
            dispatch.plan_call(Adder.plain_add, (1, 2, 3), {}, 2, roles=roles)
    assert bound == [2, 3, 3, 3]
