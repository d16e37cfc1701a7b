"""The router's parts without Ray: the choice of a server (least in flight under the cap, the
lowest rank on ties, a session's server first, the servers already tried last), the sessions'
bounded memory, the counters, the arguments refused before anything is made, and an answer
that comes in the turn of the loop its deadline passes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import asyncexec
from asyncexec._driver.pipeline._router_metrics import RouterMeters
from asyncexec._driver.pipeline._router_requests import _Answer, _Inbox, _next
from asyncexec._driver.pipeline._router_state import Balance, Sessions
from asyncexec.testing import metrics_enabled


class Toy(asyncexec.RolloutServer):
    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        pass


class Plain:
    def work(self) -> int:
        return 1


def _balance(n: int, cap: int) -> Balance:
    return Balance([f"w{r}" for r in range(n)], cap)


@pytest.mark.timeout(10)
def test_least_in_flight_under_the_cap_lowest_rank_on_ties() -> None:
    balance = _balance(3, 2)
    chosen = []
    for _ in range(6):
        r = balance.choose()
        assert r is not None
        balance.take(r)
        chosen.append(r)
    assert chosen == [0, 1, 2, 0, 1, 2]  # round the servers, each up to the cap
    assert balance.choose() is None  # every server holds the cap: the request waits
    balance.release(1)
    assert balance.choose() == 1
    assert balance.in_flight == {0: 2, 1: 1, 2: 2}
    assert [s.peak for s in balance.servers] == [2, 2, 2]


@pytest.mark.timeout(10)
def test_servers_tried_come_last_and_a_server_out_gets_nothing() -> None:
    balance = _balance(3, 4)
    assert balance.choose(exclude=[0]) == 1
    assert balance.choose(exclude=[0, 1, 2]) == 0  # all tried: the least loaded of them
    balance.servers[1].serving = False
    balance.take(0)
    assert balance.choose() == 2
    assert balance.choose(exclude=[2]) == 0  # 1 is out; 0 holds one, but it is not tried
    balance.servers[0].serving = balance.servers[2].serving = False
    assert balance.choose() is None


@pytest.mark.timeout(10)
def test_a_session_goes_to_its_server_while_it_serves_in_the_same_worker() -> None:
    balance = _balance(3, 1)
    assert balance.choose(pinned=(2, "w2")) == 2  # not the least loaded's tie-break (0)
    balance.take(2)
    assert balance.choose(pinned=(2, "w2")) is None  # its server at the cap: it waits there
    assert balance.choose(pinned=(2, "w-old")) == 0  # a replaced server: chosen afresh
    balance.servers[2].serving = False
    assert balance.choose(pinned=(2, "w2")) == 0  # taken out: chosen afresh


@pytest.mark.timeout(10)
def test_sessions_forget_the_least_recently_used_past_the_limit() -> None:
    sessions = Sessions(limit=3)
    for key in "abc":
        sessions.pin(key, 0, "w0")
    assert sessions.get("a") == (0, "w0")  # used: now the most recent
    sessions.pin("d", 1, "w1")
    assert len(sessions) == 3
    assert sessions.get("b") is None  # the least recently used went
    assert sessions.get("a") == (0, "w0") and sessions.get("d") == (1, "w1")
    for i in range(1000):
        sessions.pin(i, i % 3, None)
    assert len(sessions) == 3  # bounded however many sessions come


@pytest.mark.timeout(10)
async def test_a_waiting_request_is_woken_when_a_slot_is_freed() -> None:
    balance = _balance(1, 1)
    balance.take(0)
    got: list[int] = []

    async def wait() -> None:
        got.append(await balance.acquire())

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        assert not got
        balance.release(0)
        await anyio.wait_all_tasks_blocked()
    assert got == [0] and balance.in_flight == {0: 1}  # the slot went on to the waiter


@pytest.mark.timeout(10)
async def test_the_request_that_waited_longest_gets_the_freed_slot() -> None:
    """A freed slot is handed to the request waiting longest: one that comes in the same turn
    of the loop (it did not wait) does not take it first and leave the other waiting (as a
    stream of newcomers would for ever)."""
    balance = _balance(1, 1)
    balance.take(0)
    order: list[str] = []

    async def request(name: str) -> None:
        r = await balance.acquire()
        order.append(name)
        balance.release(r)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, "waited")
        await anyio.wait_all_tasks_blocked()
        balance.release(0)
        await request("came later")  # in the turn of the release
    assert order == ["waited", "came later"]
    assert balance.in_flight == {0: 0}


@pytest.mark.timeout(10)
async def test_a_freed_slot_wakes_one_waiting_request_not_every_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waking every waiting request on each freed slot costs each a look at the servers, with
    one of them served (a thundering herd): the slot is handed to one, who takes it without a
    look."""
    balance = _balance(2, 1)
    balance.take(0)
    balance.take(1)
    looks = 0
    choose = balance.choose

    def counted(*args: Any, **kwargs: Any) -> int | None:
        nonlocal looks
        looks += 1
        return choose(*args, **kwargs)

    monkeypatch.setattr(balance, "choose", counted)
    served: list[int] = []

    async def request() -> None:
        served.append(await balance.acquire())

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(request)
        await anyio.wait_all_tasks_blocked()
        looks = 0
        balance.release(1)
        await anyio.wait_all_tasks_blocked()
        assert served == [1] and looks <= 1
        tg.cancel_scope.cancel()


@pytest.mark.timeout(10)
async def test_a_sessions_request_waits_for_its_server_and_holds_no_other_up() -> None:
    """The request of a session waits for its own server's slot: a slot freed elsewhere goes
    to the next request that may take it, and its server's next freed slot to it."""
    balance = _balance(2, 1)
    balance.take(0)
    balance.take(1)
    got: dict[str, int] = {}

    async def request(name: str, pinned: tuple[int, str | None] | None) -> None:
        got[name] = await balance.acquire(session=lambda: pinned)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, "session of 1", (1, "w1"))
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(request, "any", None)
        await anyio.wait_all_tasks_blocked()
        balance.release(0)
        await anyio.wait_all_tasks_blocked()
        assert got == {"any": 0}
        balance.release(1)
        await anyio.wait_all_tasks_blocked()
    assert got == {"any": 0, "session of 1": 1}
    assert balance.in_flight == {0: 1, 1: 1}


@pytest.mark.timeout(10)
async def test_a_waiting_request_cancelled_passes_its_handed_slot_on() -> None:
    balance = _balance(1, 1)
    balance.take(0)
    got: list[int] = []

    async def request() -> None:
        got.append(await balance.acquire())

    async with anyio.create_task_group() as tg:
        async with anyio.create_task_group() as first:
            first.start_soon(request)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(request)
            await anyio.wait_all_tasks_blocked()
            first.cancel_scope.cancel()
            balance.release(0)  # handed to the first, cancelled: it passes the slot on
        await anyio.wait_all_tasks_blocked()
    assert got == [0] and balance.in_flight == {0: 1}


@pytest.mark.timeout(10)
def test_router_refuses_bad_arguments_before_anything_starts() -> None:
    servers = asyncexec.Executor(2, roles=Toy, local=True)
    with pytest.raises(asyncexec.ConfigurationError, match="RolloutServer"):
        asyncexec.Router(asyncexec.Executor(2, roles=Plain, local=True))
    with pytest.raises(asyncexec.ConfigurationError, match="Executor"):
        asyncexec.Router("servers")  # type: ignore[arg-type]
    with pytest.raises(asyncexec.ConfigurationError, match="max_in_flight"):
        asyncexec.Router(servers, max_in_flight=0)
    with pytest.raises(asyncexec.ConfigurationError, match="unhealthy_after"):
        asyncexec.Router(servers, unhealthy_after=0)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(asyncexec.ConfigurationError, match="health_interval_s"):
            asyncexec.Router(servers, health_interval_s=bad)
    for bad in (3, "weights", object()):
        with pytest.raises(asyncexec.ConfigurationError, match="channel must be a WeightChannel"):
            asyncexec.Router(servers, channel=bad)  # type: ignore[arg-type]
    for bad in ("", 3):
        with pytest.raises(asyncexec.ConfigurationError, match="name must be a non-empty"):
            asyncexec.Router(servers, name=bad)  # type: ignore[arg-type]
    asyncexec.Router(servers, health_grace_s=0)  # no grace is allowed
    router = asyncexec.Router(servers)
    assert router.statistics() == asyncexec.RouterStatistics()
    assert "Router" in repr(router)


@pytest.mark.timeout(10)
async def test_router_used_before_it_is_entered_says_so() -> None:
    router = asyncexec.Router(asyncexec.Executor(2, roles=Toy, local=True))
    with pytest.raises(asyncexec.ExecutorStateError, match="async with"):
        await router.generate(asyncexec.RolloutRequest(0, "p"))
    with pytest.raises(asyncexec.ExecutorStateError):
        await router.pause("keep")


@pytest.mark.timeout(10)
async def test_generate_refuses_what_is_not_a_rollout_request_naming_it() -> None:
    """A prompt given where a request goes is named, not an ``AttributeError`` of the
    router's internals."""
    async with (
        asyncexec.Executor(1, roles=Toy, local=True) as servers,
        asyncexec.Router(servers) as router,
    ):
        for call in (router.generate, router.generate_stoppable):
            with pytest.raises(asyncexec.ConfigurationError, match=r"RolloutRequest.*'hello'"):
                await call("hello")  # type: ignore[arg-type]
            with pytest.raises(asyncexec.ConfigurationError, match="retry must be a bool"):
                await call(asyncexec.RolloutRequest(1, "p"), retry="yes")  # type: ignore[arg-type]
            with pytest.raises(asyncexec.ConfigurationError, match="deadline_s"):
                await call(asyncexec.RolloutRequest(1, "p"), deadline_s=0)
        sample = await router.generate(asyncexec.RolloutRequest(0, "p"))
    assert sample.output == ["p"]


@pytest.mark.timeout(20)
async def test_metrics_count_requests_by_executor_and_in_flight_by_rank_only() -> None:
    """Local mode (threads, no Ray): the router's counters by the executor's name, its requests
    in flight by executor and rank, and no label of a session key or a request id; the
    in-flight series go when the router closes."""
    pytest.importorskip("prometheus_client")
    with metrics_enabled() as registry:
        async with (
            asyncexec.Executor(2, roles=Toy, local=True, name="servers") as servers,
            asyncexec.Router(servers, max_in_flight=2) as router,
        ):
            for i in range(5):
                await router.generate(asyncexec.RolloutRequest(i, "p", key=f"chat-{i}"))
            value = registry.get_sample_value
            by = {"executor": "servers", "router": "servers"}
            assert value("asyncexec_router_requests_total", by) == 5
            assert value("asyncexec_router_answered_total", by) == 5
            in_flight = {**by, "rank": "0"}
            assert value("asyncexec_router_in_flight", in_flight) == 0
            labels = {
                name
                for family in registry.collect()
                if family.name.startswith("asyncexec_router")
                for sample in family.samples
                for name in sample.labels
            }
            assert labels == {"executor", "router", "rank"}
        assert registry.get_sample_value("asyncexec_router_in_flight", in_flight) is None


@pytest.mark.timeout(10)
def test_a_closed_routers_in_flight_series_do_not_come_back() -> None:
    """A slot freed after its router closed (an attempt that outlived the close's bound) sets
    no gauge: the closed router's series stay gone, and do not overwrite those of a router of
    the same name made since."""
    pytest.importorskip("prometheus_client")
    labels = {"executor": "servers", "router": "servers", "rank": "0"}
    with metrics_enabled() as registry:
        meters = RouterMeters("servers")
        meters.in_flight(0, 1)
        assert registry.get_sample_value("asyncexec_router_in_flight", labels) == 1
        meters.forget(1)
        meters.in_flight(0, 0)
        assert registry.get_sample_value("asyncexec_router_in_flight", labels) is None


class Held(asyncexec.RolloutServer):
    """Generates until its request is stopped."""

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        await anyio.sleep_forever()
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        pass


@pytest.mark.timeout(20)
async def test_two_routers_over_one_executor_have_their_own_series() -> None:
    """Defect: the routers' metrics were labelled by their servers' executor only, so two
    routers over the same servers overwrote each other's ``asyncexec_router_in_flight`` (the
    last one set won) and the first to close took the other's series with it. Each router
    has its name now (``name=``; by default the executor's, with a suffix while another
    router over it is open), as the ``router`` label."""
    pytest.importorskip("prometheus_client")

    def in_flight(router: str) -> float | None:
        labels = {"executor": "shared", "router": router, "rank": "0"}
        return registry.get_sample_value("asyncexec_router_in_flight", labels)

    async def requests(router: asyncexec.Router, n: int) -> None:
        async with anyio.create_task_group() as tg:
            for i in range(n):  # stopped on the server when cancelled
                tg.start_soon(router.generate_stoppable, asyncexec.RolloutRequest(i, "p"))

    with metrics_enabled() as registry:
        async with asyncexec.Executor(1, roles=Held, local=True, name="shared") as servers:
            first = asyncexec.Router(servers)
            second = asyncexec.Router(servers)
            named = asyncexec.Router(servers, name="evaluation")
            assert (first.name, second.name, named.name) == ("shared", "shared-2", "evaluation")
            async with first, anyio.create_task_group() as on_first:
                on_first.start_soon(requests, first, 2)
                async with second, anyio.create_task_group() as on_second:
                    on_second.start_soon(requests, second, 1)
                    with anyio.fail_after(5):
                        while (first.in_flight[0], second.in_flight[0]) != (2, 1):  # noqa: ASYNC110
                            await anyio.sleep(0.005)
                    assert (in_flight("shared"), in_flight("shared-2")) == (2, 1)
                    on_second.cancel_scope.cancel()
                assert (in_flight("shared"), in_flight("shared-2")) == (2, None)
                on_first.cancel_scope.cancel()
            assert asyncexec.Router(servers).name == "shared"  # free again once closed


@pytest.mark.timeout(10)
async def test_a_burst_of_sends_is_spread_over_turns_of_the_event_loop() -> None:
    """50 requests that start together, each send taking 1 ms of the loop: at most the turn's
    budget (2 ms) of sends, and one more, go in one turn; the rest wait for the next turns, so
    the loop serves its timers in between (a burst of 256 sends on Ray held it 100 ms)."""
    import asyncio
    import time

    from asyncexec._driver.pipeline._router_state import Pacer

    pacer = Pacer(budget_s=0.002)
    turn = 0
    loop = asyncio.get_running_loop()
    ticking = True

    def tick() -> None:
        nonlocal turn
        turn += 1
        if ticking:
            loop.call_soon(tick)

    sent_in: list[int] = []

    async def send() -> None:
        await pacer.wait_turn()
        sent_in.append(turn)
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:  # the send's own work, on the loop
            pass

    loop.call_soon(tick)
    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(send)
    ticking = False
    per_turn = [sent_in.count(t) for t in set(sent_in)]
    assert len(sent_in) == 50
    assert max(per_turn) <= 3 and len(per_turn) >= 17
    assert pacer.waits > 0


class Slow(asyncexec.RolloutServer):
    """``prompt`` chunks of 50 ms each."""

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        for i in range(prompt):
            await anyio.sleep(0.05)
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        pass


@pytest.mark.timeout(20)
async def test_a_caller_that_stops_waiting_leaves_the_slot_held_until_the_server_answers() -> None:
    """Local mode: a request whose caller is cancelled keeps its server's slot until the
    server's answer comes, which is then dropped (counted as late); closing the router with
    requests in flight raises ExecutorStateError in their callers, and leaves none in flight."""
    async with (
        asyncexec.Executor(2, roles=Slow, local=True) as servers,
        asyncexec.Router(servers, max_in_flight=1) as router,
    ):
        with anyio.move_on_after(0.1):
            await router.generate(asyncexec.RolloutRequest("gone", 6))  # 0.3 s on rank 0
        assert router.in_flight == {0: 1, 1: 0}
        sample = await router.generate(asyncexec.RolloutRequest("next", 1))
        assert sample.rank == 1  # rank 0 still holds the cancelled one
        with anyio.fail_after(5):
            while router.statistics().late_dropped == 0:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert router.in_flight == {0: 0, 1: 0}
    errors: list[BaseException] = []

    async def ask(router: asyncexec.Router, i: int) -> None:
        try:
            await router.generate(asyncexec.RolloutRequest(i, 100))
        except asyncexec.ExecutorStateError as exc:
            errors.append(exc)

    async with asyncexec.Executor(2, roles=Slow, local=True) as servers:
        router = asyncexec.Router(servers, max_in_flight=1)
        async with anyio.create_task_group() as tg, router:
            for i in range(3):  # two in flight, one waiting for a slot
                tg.start_soon(ask, router, i)
            with anyio.fail_after(5):
                while sum(router.in_flight.values()) < 2:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
        assert len(errors) == 3
        assert router.in_flight == {0: 0, 1: 0}
        with pytest.raises(asyncexec.ExecutorStateError, match="closed"):
            await router.generate(asyncexec.RolloutRequest("after", 1))


class ChunksAList(asyncexec.RolloutServer):
    def chunks(self, prompt: Any) -> Any:  # a list, not an async generator
        return [prompt]

    def load_weights(self, state: Any, version: int) -> None:
        pass


class ChunksSync(asyncexec.RolloutServer):
    def chunks(self, prompt: Any) -> Any:  # a generator, not an async one
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        pass


class ChunksAwaited(asyncexec.RolloutServer):
    async def chunks(self, prompt: Any) -> Any:  # a coroutine, not an async generator
        return [prompt]

    def load_weights(self, state: Any, version: int) -> None:
        pass


class NoChunks(asyncexec.RolloutServer):
    def load_weights(self, state: Any, version: int) -> None:
        pass


class ForgetsSuper(Toy):
    def __init__(self) -> None:  # no super().__init__()
        self.engine = "ready"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("cls", "kind"),
    [
        (ChunksAList, "a function"),
        (ChunksSync, "a plain generator function (make it `async def`)"),
        (ChunksAwaited, "a coroutine function"),
        (NoChunks, "must implement"),
    ],
)
def test_a_server_class_whose_chunks_is_no_async_generator_is_refused_when_made(
    cls: type[asyncexec.RolloutServer], kind: str
) -> None:
    """It failed only at the first request, with ``'list' object is not an async iterator``,
    naming neither ``chunks()`` nor the class; the error says what ``chunks`` is instead."""
    with pytest.raises(
        asyncexec.ConfigurationError, match=rf"{cls.__name__}.*chunks\(prompt\)"
    ) as e:
        asyncexec.Executor(1, roles=cls, local=True)
    assert kind in str(e.value), e.value
    with pytest.raises(asyncexec.ConfigurationError, match=rf"{cls.__name__}.*chunks\(prompt\)"):
        asyncexec.Executor(1, roles=asyncexec.Role(cls), local=True)


@pytest.mark.timeout(20)
async def test_a_server_class_that_skips_super_init_fails_its_group_start_naming_it() -> None:
    """It was caught only at the first request (or the router's first health check)."""
    with pytest.raises(asyncexec.AsyncExecError, match=r"ForgetsSuper") as raised:
        async with asyncexec.Executor(1, roles=ForgetsSuper, local=True):
            pass
    assert "super().__init__()" in str(raised.value) + str(raised.value.__cause__)


@pytest.mark.timeout(10)
async def test_a_sessions_request_waiting_for_a_server_taken_out_goes_elsewhere() -> None:
    balance = _balance(2, 1)
    balance.take(0)
    balance.take(1)
    got: list[int] = []

    async def request() -> None:
        got.append(await balance.acquire(session=lambda: (1, "w1")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await anyio.wait_all_tasks_blocked()
        balance.out(1)  # its server: the request waits for any other now
        await anyio.wait_all_tasks_blocked()
        balance.release(1)  # (out: freed, handed to no one)
        balance.release(0)
        await anyio.wait_all_tasks_blocked()
    assert got == [0] and balance.in_flight == {0: 1, 1: 0}


@pytest.mark.timeout(20)
async def test_an_attempt_that_fails_in_its_own_bookkeeping_fails_its_request_and_the_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Simulated servers: an attempt is a plain task that the router's request path owns. One
    that raised other than through its call (here in its clean-up, a stand-in for a defect of
    the path) was lost: its task's error never retrieved, its request waiting for an answer
    that would not come. It now answers its request with that error and fails the router, as a
    failed task fails its task group."""
    from asyncexec._driver.pipeline import _router_requests
    from asyncexec.testing import ScriptedServer, SimCluster

    def broken(*args: Any) -> None:
        raise RuntimeError("a defect in the attempt's bookkeeping")

    async with (
        asyncexec.Executor(
            2, roles=asyncexec.Role(ScriptedServer), cluster=SimCluster()
        ) as servers,
        asyncexec.Router(servers, max_in_flight=2) as router,
    ):
        monkeypatch.setattr(_router_requests, "_forget", broken)  # (the attempt's alone)
        with anyio.fail_after(5), pytest.raises(RuntimeError, match="bookkeeping"):
            await router.generate(asyncexec.RolloutRequest(0, "prompt"))
        with pytest.raises(RuntimeError, match="bookkeeping"):  # the router is failed
            await router.generate(asyncexec.RolloutRequest(1, "prompt"))
        assert router.requests.attempts == {}


@pytest.mark.timeout(10)
async def test_an_answer_that_comes_in_the_turn_its_deadline_passes_is_the_answer() -> None:
    """The deadline's cancellation reached a request waiting for its answer, and the answer
    came before the request ran again (one turn of the loop): the request saw no answer
    (``TimeoutError``, or a needless attempt more) though one was there. It takes it."""
    inbox = _Inbox()
    answer = _Answer(0, None, sample=asyncexec.Sample(0, "prompt", [0], (None,), 0))
    got: list[Any] = []

    async def wait() -> None:  # the deadline passed as it begins to wait
        got.append(await _next(inbox, time.monotonic() - 1.0, 0.5))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        with anyio.fail_after(5):
            while not (inbox.waiter is not None and inbox.waiter.cancelled()):
                await anyio.lowlevel.checkpoint()
        inbox.put(answer)  # before the request runs again (it would have disarmed)
    assert got == [answer]


@pytest.mark.timeout(20)
async def test_a_request_after_its_servers_executor_closed_raises_at_once() -> None:
    """Defect: with its servers' executor closed under an open router, a request in flight
    raised ``ExecutorStateError`` at once, but one waiting for a slot, and every request
    after, waited for a server to rejoin (each rejoin failing, ``rejoin_failed`` each second)
    until the router gave its servers up, a start timeout later (minutes by default). Each
    now raises ``ExecutorStateError`` at once, saying so."""
    from asyncexec.testing import Script, ScriptedServer, SimCluster

    servers = asyncexec.Executor(1, roles=asyncexec.Role(ScriptedServer), cluster=SimCluster())
    errors: list[BaseException] = []

    async def ask(i: int) -> None:
        with pytest.raises(asyncexec.ExecutorStateError) as caught:
            await router.generate(asyncexec.RolloutRequest(i, Script(100, 0.05)))
        errors.append(caught.value)

    async with servers, asyncexec.Router(servers, max_in_flight=1) as router:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask, 0)  # in flight
                while router.in_flight[0] < 1:  # noqa: ASYNC110 (the router's state)
                    await anyio.sleep(0.01)
                tg.start_soon(ask, 1)  # waits for the slot
                while router.statistics().requests < 2:  # (the router's counters)
                    await anyio.lowlevel.checkpoint()
                await servers.aclose()
            await ask(2)
        assert "are closed" in str(errors[-1])
        assert len(errors) == 3


@pytest.mark.timeout(20)
async def test_a_request_sent_its_most_times_waits_for_its_attempts_still_in_flight() -> None:
    """Defect: a request sent as often as it may be (here 3 times on 2 servers, its deadline
    passing twice) raised the error of one attempt whose server died (``WorkerCrashedError``,
    "every server it went to failed"), though its other attempts still ran on a live server:
    the first of them answers within the latest attempt's deadline, and is the answer."""
    from asyncexec.testing import Script, ScriptedServer, SimCluster

    cluster = SimCluster()
    async with (
        asyncexec.Executor(2, roles=asyncexec.Role(ScriptedServer), cluster=cluster) as servers,
        asyncexec.Router(servers, max_in_flight=4) as router,
    ):

        async def crash() -> None:  # once its third attempt is sent (rank 0 again)
            while router.statistics().retries < 2:  # noqa: ASYNC110 (the router's counters)
                await anyio.sleep(0.01)
            cluster.crash(servers.workers[1].pid)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(crash)
                # Each attempt takes 1 s: sent at 0 (rank 0), 0.4 (rank 1), 0.8 (rank 0).
                request = asyncexec.RolloutRequest("r", Script(10, 0.1))
                sample = await router.generate(request, deadline_s=0.4)
        assert sample.rank == 0 and sample.output == list(range(10))
        stats = router.statistics()
        assert (stats.answered, stats.retries, stats.timeouts) == (1, 2, 0)


@pytest.mark.timeout(20)
async def test_a_request_sent_its_most_times_whose_servers_all_died_raises_their_error() -> None:
    """A request sent as often as it may be whose every attempt's server died at once raises
    the death (``WorkerCrashedError``, "every server it went to failed"), not a
    ``TimeoutError`` of no answer: the answers of its ended attempts, already in, are read
    before it gives up waiting for more."""
    from asyncexec.testing import Script, ScriptedServer, SimCluster

    cluster = SimCluster()
    async with (
        asyncexec.Executor(2, roles=asyncexec.Role(ScriptedServer), cluster=cluster) as servers,
        asyncexec.Router(servers, max_in_flight=4, unhealthy_after=1000) as router,
    ):

        async def crash() -> None:  # once its third attempt is sent: both servers at once
            while router.statistics().retries < 2:  # noqa: ASYNC110 (the router's counters)
                await anyio.sleep(0.01)
            for worker in servers.workers:
                cluster.crash(worker.pid)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(crash)
                request = asyncexec.RolloutRequest("r", Script(10, 0.1))
                with pytest.raises(asyncexec.WorkerCrashedError) as caught:
                    await router.generate(request, deadline_s=0.4)
        assert "every server it went to failed" in "".join(caught.value.__notes__)
