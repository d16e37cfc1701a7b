"""OpenTelemetry spans: the driver's run, attempt, restart, call and push spans, and the W3C
trace context carried into the workers, where a span the user's method opens is a child of the
driver's call. In-memory exporters in the driver and in the worker (the worker's spans are
returned)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import tenacity

import asyncexec
from asyncexec._wire import _tracing

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

pytestmark = pytest.mark.timeout(45)


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The driver's spans, kept in memory: the application's provider, as asyncexec sees it
    (the process's global provider is left alone for the other tests)."""
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    yield exporter
    provider.shutdown()


def span_in_worker(x: int) -> dict[str, Any]:
    """Open a span where the user's code runs (a worker), with a provider of its own, and
    return its ids and its parent's."""
    from opentelemetry import trace as api
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("user").start_as_current_span("user.work"):
        inner = api.get_current_span().get_span_context()
    [span] = exporter.get_finished_spans()
    parent = span.parent
    return {
        "x": x,
        "trace_id": inner.trace_id,
        "span_id": inner.span_id,
        "parent": None if parent is None else (parent.trace_id, parent.span_id),
    }


class Worker:
    def work(self, x: int) -> dict[str, Any]:
        return span_in_worker(x)

    async def work_async(self, x: int) -> dict[str, Any]:
        return span_in_worker(x)


def _ids(span: Any) -> tuple[int, int]:
    return span.context.trace_id, span.context.span_id


async def test_a_span_the_users_method_opens_is_a_child_of_the_drivers_call(
    mode: str, exported: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer_provider().get_tracer("app")
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, roles=Worker) as ex:
        with tracer.start_as_current_span("app.request"):
            plain = await ex.call(span_in_worker, 1)
            method = await ex.call(Worker.work, 2, on=asyncexec.rank(1))
            streamed = [out async for _, out in ex.stream(Worker.work_async, 3)]
            executed = await ex.execute(span_in_worker, 4)
    spans = exported.get_finished_spans()
    [request] = [s for s in spans if s.name == "app.request"]
    calls = {_ids(s): s for s in spans if s.name == "asyncexec.call"}
    assert len(calls) == 2 + 1 + 2 + 2
    for call in calls.values():  # each rank's call is a child of the application's span
        assert call.parent is not None and call.parent.span_id == request.context.span_id
    for out in [*plain, method, *streamed, *executed]:
        assert out["parent"] in calls, out  # the worker's span: a child of one call's span
        assert out["trace_id"] == request.context.trace_id
    ranks = sorted(calls[out["parent"]].attributes["asyncexec.rank"] for out in plain)
    assert ranks == [0, 1]
    assert calls[method["parent"]].attributes["asyncexec.function"] == "Worker.work"


class Raising:
    def fail(self, x: int) -> int:
        raise ValueError(f"bad {x}")

    async def fail_async(self, x: int) -> int:
        raise ValueError(f"bad {x}")

    def ok(self, x: int) -> int:
        return x


def raise_in_worker(x: int) -> None:
    raise ValueError(f"bad {x}")


async def test_a_call_whose_method_raised_is_a_failed_span_holding_its_exception(
    mode: str, exported: InMemorySpanExporter
) -> None:
    """A method or function that raised on the worker (answered as an outcome, not raised by
    the call itself): its call's span has status ERROR and records the worker's exception; a
    call that answered stays OK."""
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, roles=Raising) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError, match="bad 1"):
            await ex.call(Raising.fail, 1, on=asyncexec.rank(0))
        with pytest.raises(asyncexec.WorkerRaisedError, match="bad 2"):
            await ex.call(Raising.fail_async, 2, on=asyncexec.rank(1))
        with pytest.raises(asyncexec.WorkerRaisedError, match="bad 3"):
            await ex.call(raise_in_worker, 3, on=asyncexec.rank(0))
        with pytest.raises(asyncexec.WorkerRaisedError, match="bad 4"):
            await ex.execute(raise_in_worker, 4)
        assert await ex.call(Raising.ok, 5, on=asyncexec.rank(0)) == 5
    calls = [s for s in exported.get_finished_spans() if s.name == "asyncexec.call"]
    failed = [s for s in calls if s.attributes["asyncexec.function"] != "Raising.ok"]
    assert len(failed) == 1 + 1 + 1 + 2
    for span in failed:
        assert span.status.status_code == trace.StatusCode.ERROR, span.attributes
        [event] = [e for e in span.events if e.name == "exception"]
        assert event.attributes["exception.type"] == "ValueError"
        assert str(event.attributes["exception.message"]).startswith("bad ")
    [ok] = [s for s in calls if s.attributes["asyncexec.function"] == "Raising.ok"]
    assert ok.status.is_ok and not ok.events


class Base:
    def who(self, x: int) -> int:
        return x


class Named(Base):
    """A role whose method is inherited: ``Named.who`` is ``Base.who``."""


class Echo(asyncexec.RolloutServer):
    async def chunks(self, prompt: Any) -> Any:
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        self.opened = span_in_worker(version)  # (in the install call's trace context)

    def last_opened(self) -> dict[str, Any]:
        return self.opened


async def test_every_call_is_named_by_its_roles_class_and_method(
    mode: str, exported: InMemorySpanExporter
) -> None:
    """A method named through ``asyncexec.method`` (as the router names its servers'), an
    inherited one and a plain function: each span says what ran, never ``NamedMethod``."""
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, roles=Named) as ex:
        await ex.call(asyncexec.method(Named, "who"), 1, on=asyncexec.rank(0))
        await ex.call(Named.who, 2, on=asyncexec.rank(1))
        await ex.execute(span_in_worker, 3)
    async with (
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, roles=SpanEcho) as servers,
        asyncexec.Router(servers) as router,
    ):
        sample = await router.generate(asyncexec.RolloutRequest(0, "p"))
    spans = exported.get_finished_spans()
    names = [
        s.attributes["asyncexec.function"] for s in spans if "asyncexec.function" in s.attributes
    ]
    assert names.count("Named.who") == 2
    assert names.count("span_in_worker") == 2
    assert names.count("SpanEcho.generate") == 1  # the router's request stands for its call
    assert not [n for n in names if "NamedMethod" in n or n == "Base.who"], names
    [request] = [s for s in spans if s.name == "asyncexec.router.request"]
    assert request.attributes["asyncexec.function"] == "SpanEcho.generate"
    assert not [s for s in spans if s.name == "asyncexec.router.attempt"]  # one attempt
    [opened] = sample.output  # the server's span: a child of the request, carried to it
    assert opened["parent"] == _ids(request)


class SpanEcho(asyncexec.RolloutServer):
    """A server whose generation opens a span (as an engine's would)."""

    async def chunks(self, prompt: Any) -> Any:
        yield span_in_worker(0)

    def load_weights(self, state: Any, version: int) -> None:
        pass


class WeightsLearner:
    def __init__(self) -> None:
        asyncexec.serve_weights(lambda: {"w": 1})


async def test_the_rl_loop_is_spans_a_batch_an_update_its_phases_a_request_its_attempts(
    mode: str, exported: InMemorySpanExporter
) -> None:
    """A batch, an update holding its pause, push and resume (each standing for the servers'
    calls it made, and holding the channel's pushes), a router request standing for its (first
    and only) attempt's call."""
    prompts = [f"p{i}" for i in range(8)]
    async with contextlib.AsyncExitStack() as stack:
        servers = await stack.enter_async_context(
            asyncexec.Executor(2, resources_per_worker={"CPU": 0.25}, roles=Echo)
        )
        channel = None
        if mode == "ray":  # (a channel needs Ray's object store)
            learner = await stack.enter_async_context(
                asyncexec.Executor(1, resources_per_worker={"CPU": 0.25}, roles=WeightsLearner)
            )
            channel = await stack.enter_async_context(asyncexec.WeightChannel(learner, servers))
        pipe = await stack.enter_async_context(
            asyncexec.Pipeline(servers, prompts, batch_size=4, staleness=1, channel=channel)
        )
        async for _ in pipe:
            state = () if channel else ({"w": 1},)
            await pipe.update_weights(*state, on_update="abort")
        opened = await servers.call(Echo.last_opened)  # (the last install's, on each server)
    spans = exported.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    def parent(span: Any) -> Any:
        return None if span.parent is None else by_id.get(span.parent.span_id)

    batches = [s for s in spans if s.name == "asyncexec.pipeline.batch"]
    assert [s.attributes["version"] for s in batches] == [0, 1]
    assert all(s.attributes["size"] == 4 for s in batches)
    updates = [s for s in spans if s.name == "asyncexec.pipeline.update"]
    assert [(u.attributes["mode"], u.attributes["version"]) for u in updates] == [
        ("abort", 1),
        ("abort", 2),
    ]
    phases = {}
    for phase in ("pause", "push", "resume"):
        found = [s for s in spans if s.name == f"asyncexec.pipeline.{phase}"]
        assert sorted(parent(s).context.span_id for s in found) == sorted(
            u.context.span_id for u in updates
        ), phase
        phases[phase] = {s.context.span_id for s in found}
    # A phase stands for the servers' calls it made (their pause, install, resume): no
    # ``asyncexec.call`` of their own; what a call opens on its server is the phase's child.
    under_updates = set().union(*phases.values(), (u.context.span_id for u in updates))
    calls = [s for s in spans if s.name == "asyncexec.call"]
    assert not [s for s in calls if parent(s) and parent(s).context.span_id in under_updates]
    reads = [s for s in spans if s.name == "asyncexec.push.read"]  # the channel's
    assert len(reads) == (3 if mode == "ray" else 0)  # (the pipeline's first push, then 2)
    assert all(parent(s).context.span_id in phases["push"] for s in reads[1:])
    if mode == "local":  # (without a channel: the push is the servers' installs)
        assert all(o["parent"][1] in phases["push"] for o in opened), opened
    requests = [s for s in spans if s.name == "asyncexec.router.request"]
    assert len(requests) >= len(prompts)
    assert not [s for s in spans if s.name == "asyncexec.router.attempt"]  # none sent again
    # A request stands for its one attempt's call (one span a request): what ran, and where.
    generates = [s for s in spans if s.attributes.get("asyncexec.function") == "Echo.generate"]
    assert generates == requests
    assert all(s.attributes["asyncexec.rank"] in (0, 1) for s in requests)
    assert not [s for s in spans if s.name == "asyncexec.call" and parent(s) in requests]


class Flaky(asyncexec.RolloutServer):
    """Rank 0 raises on ``"bad"`` and holds ``"slow"`` for a minute; rank 1 answers at once."""

    async def chunks(self, prompt: Any) -> Any:
        import asyncio

        rank = asyncexec.get_context().world_rank
        if rank == 0 and prompt == "bad":
            raise ValueError("bad prompt")
        if rank == 0 and prompt == "slow":
            await asyncio.sleep(60)
        yield span_in_worker(rank)

    def load_weights(self, state: Any, version: int) -> None:
        pass


async def test_a_request_sent_again_or_failed_shows_each_attempt(
    mode: str, exported: InMemorySpanExporter
) -> None:
    """A request whose one attempt raised: the request's span fails, and holds that attempt
    recorded after the fact with its error. A request whose first attempt outlived its deadline:
    its span stands for that first call (rank 0, the lowest of two free), the second is an
    ``asyncexec.router.attempt`` span of its own (rank 1), holding what the server opened; the
    first, cancelled when the router closed, is recorded then."""
    async with (
        asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, roles=Flaky) as servers,
        asyncexec.Router(servers, max_in_flight=1) as router,
    ):
        with pytest.raises(asyncexec.WorkerRaisedError, match="bad prompt"):
            await router.generate(asyncexec.RolloutRequest("bad", "bad"))
        again = await router.generate(asyncexec.RolloutRequest("slow", "slow"), deadline_s=1.0)
        at_once = await router.generate(asyncexec.RolloutRequest("ok", "ok"))
    spans = exported.get_finished_spans()
    bad, slow, ok = [s for s in spans if s.name == "asyncexec.router.request"]
    # A request answered by its first attempt: what the server opened is the request's child
    # (its span is carried, though it is not the driver's current span while it runs).
    [opened_at_once] = at_once.output
    assert opened_at_once["parent"] == _ids(ok) and ok.status.is_ok
    assert not [s for s in spans if s.parent == ok.context]  # no attempt or call span under it

    def attempts(request: Any) -> list[Any]:
        found = [s for s in spans if s.name == "asyncexec.router.attempt"]
        return sorted(
            (s for s in found if s.parent == request.context),
            key=lambda s: s.attributes["asyncexec.rank"],
        )

    assert bad.attributes["asyncexec.rank"] == 0 and not bad.status.is_ok
    [failed] = attempts(bad)
    assert failed.attributes["asyncexec.rank"] == 0 and not failed.status.is_ok
    assert "exception" in [e.name for e in failed.events]
    assert slow.attributes["asyncexec.rank"] == 0 and slow.status.is_ok  # its first call
    first, second = attempts(slow)
    assert second.attributes["asyncexec.rank"] == 1 and second.status.is_ok
    [opened] = again.output  # the server's span: a child of the second attempt's
    assert opened["parent"] == _ids(second)
    assert first.attributes["asyncexec.rank"] == 0 and not first.status.is_ok  # cancelled


def span_in_run() -> None:
    asyncexec.report(span_in_worker(asyncexec.get_context().world_rank))


async def test_a_span_the_runs_function_opens_is_a_child_of_its_attempt(
    mode: str, exported: InMemorySpanExporter
) -> None:
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}) as ex:
        outs = [r.metrics async for step in ex.run(span_in_run) for r in step.reports]
    [attempt] = [s for s in exported.get_finished_spans() if s.name == "asyncexec.attempt"]
    assert sorted(out["x"] for out in outs) == [0, 1]
    for out in outs:
        assert out["parent"] == _ids(attempt) and out["trace_id"] == attempt.context.trace_id


def fail_first_attempt() -> None:
    if asyncexec.get_context().attempt == 1:
        asyncexec.report({"i": 0})
        raise ValueError("first attempt fails")
    asyncexec.report({"i": 1})


async def test_run_attempts_and_the_restart_between_them_are_spans_of_the_run(
    mode: str, exported: InMemorySpanExporter
) -> None:
    policy = asyncexec.RestartPolicy(
        max_restarts=1, restart_on_user_error=True, wait=tenacity.wait_none()
    )
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, restart=policy, name="traced"
    ) as executor:
        steps = [step.index async for step in executor.run(fail_first_attempt)]
    assert steps == [0, 1]
    spans = exported.get_finished_spans()
    [run] = [s for s in spans if s.name == "asyncexec.run"]
    attempts = sorted(
        (s for s in spans if s.name == "asyncexec.attempt"), key=lambda s: s.start_time
    )
    [restart] = [s for s in spans if s.name == "asyncexec.restart"]
    assert [s.attributes["attempt"] for s in attempts] == [1, 2]
    for child in [*attempts, restart]:
        assert child.parent is not None and child.parent.span_id == run.context.span_id
    assert attempts[0].status.status_code == trace.StatusCode.ERROR
    assert attempts[0].end_time <= restart.start_time <= restart.end_time <= attempts[1].start_time
    assert run.attributes["executor"] == "traced"


def test_nothing_is_made_or_carried_without_a_provider() -> None:
    """The API's default provider: no span, no carrier (each place pays one check)."""
    assert _tracing.tracer() is None
    assert _tracing.call_span(span_in_worker, 0) == (None, None)
    assert _tracing.begin("asyncexec.run") is None


def test_the_carried_context_is_w3cs_traceparent_and_reads_back_as_the_remote_parent() -> None:
    """The driver formats the ``traceparent`` itself (W3C's propagator writes the same) and the
    worker reads it back as the call's span, remote; a carrier that is not W3C's is no
    parent (the method runs untraced)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = sdk_trace.TracerProvider()
    span = provider.get_tracer("t").start_span("s")
    state = trace.TraceState([("vendor", "v1")])
    stated = trace.NonRecordingSpan(
        trace.SpanContext(7, 9, is_remote=False, trace_flags=trace.TraceFlags(1), trace_state=state)
    )
    for made in (span, stated):
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(made))
        assert _tracing.traceparent(made).split("\n") == [
            carrier[k] for k in ("traceparent", "tracestate") if k in carrier
        ]
        parent = _tracing._remote_parent(trace, _tracing.traceparent(made)).get_span_context()
        sent = made.get_span_context()
        assert (parent.trace_id, parent.span_id, parent.trace_flags, parent.is_remote) == (
            sent.trace_id,
            sent.span_id,
            sent.trace_flags,
            True,
        )
        assert parent.trace_state == sent.trace_state
    for bad in ("", "x", "00-zz-yy-01", f"00-{0:032x}-{1:016x}-01", f"00-{1:032x}-{1:08x}-01"):
        assert _tracing._remote_parent(trace, bad) is None, bad
    assert _tracing.plain(_tracing.Carried(len, "00-...")) is len
    assert _tracing.plain("method") == "method"
    # A method's key carries the context as one string (MessagePack on Ray, not a pickle);
    # anything else as a Carried record. Each reads back as it was sent.
    context = _tracing.traceparent(stated)
    assert _tracing.carry("0:generate", context) == f"0:generate\n{context}"
    assert type(_tracing.carry(len, context)) is _tracing.Carried
    for lead in ("0:generate", len):
        assert _tracing.split(_tracing.carry(lead, context)) == (lead, context)
        assert _tracing.plain(_tracing.carry(lead, context)) == lead
        assert _tracing.split(lead) == (lead, None)


class _Open(sdk_trace.SpanProcessor):
    """The spans started and not ended yet, by name."""

    def __init__(self) -> None:
        self.spans: dict[int, str] = {}

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.spans[span.context.span_id] = span.name

    def on_end(self, span: Any) -> None:
        self.spans.pop(span.context.span_id, None)


def _unpicklable() -> Any:
    import threading

    return threading.Lock()


async def test_a_call_that_could_not_be_sent_ends_its_span_and_the_ranks_sent_before_it(
    monkeypatch: pytest.MonkeyPatch, exported: InMemorySpanExporter
) -> None:
    """Defect: a call whose argument does not pickle raised ConfigurationError, but the
    ``asyncexec.call`` span opened for its send never ended (nor did those of the ranks sent
    before it, which nothing awaits): missing from the trace, held by any processor that
    tracks open spans."""
    import asyncio

    from asyncexec.testing import SimCluster

    provider = trace.get_tracer_provider()
    opened = _Open()
    provider.add_span_processor(opened)  # type: ignore[attr-defined]
    async with asyncexec.Executor(2, cluster=SimCluster(), roles=Worker) as ex:
        lock = _unpicklable()
        with pytest.raises(asyncexec.ConfigurationError, match="pickle"):
            await ex.call(span_in_worker, lock, on=asyncexec.rank(1))
        with pytest.raises(asyncexec.ConfigurationError, match="pickle"):
            await ex.call(Worker.work, asyncexec.scatter([1, lock]))  # rank 0's is sent
        with pytest.raises(asyncexec.ConfigurationError, match="pickle"):
            await ex.execute(span_in_worker, lock)
        await asyncio.sleep(0)  # (a call's span ends on the loop's next turn)
        assert opened.spans == {}
    failed = [s for s in exported.get_finished_spans() if s.name == "asyncexec.call"]
    assert len(failed) == 4 and all(s.status.status_code == trace.StatusCode.ERROR for s in failed)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


def raise_unprintable(x: int) -> None:
    raise _Unprintable()


async def test_a_call_that_raised_an_error_whose_str_raises_still_ends_its_span(
    exported: InMemorySpanExporter,
) -> None:
    """Defect: the SDK reads a recorded exception's message with ``str()``; a user's exception
    whose ``__str__`` raised made the call's span end raise on the event loop ("Exception in
    callback _end_call"), and the span never ended."""
    import asyncio

    async with asyncexec.Executor(1, local=True) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as raised:
            await ex.call(raise_unprintable, 1)
        assert isinstance(raised.value.__cause__, _Unprintable)
        await asyncio.sleep(0)  # (a call's span ends on the loop's next turn)
    [call] = [s for s in exported.get_finished_spans() if s.name == "asyncexec.call"]
    assert call.status.status_code == trace.StatusCode.ERROR
    [event] = call.events
    assert event.attributes is not None
    assert event.attributes["exception.type"].endswith("_Unprintable")
    assert "raise_unprintable" in event.attributes["exception.stacktrace"]
