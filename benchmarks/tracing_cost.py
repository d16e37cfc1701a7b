"""What tracing costs the driver's event loop through a pipeline, and whose cost it is: the same
pipeline with tracing off, with a tracer provider whose spans cost nothing (asyncexec's own work:
deciding, carrying and ending spans), and with OpenTelemetry's SDK (its spans made, batched and
exported to an exporter that drops them). No Ray: simulated workers on the driver's loop, so the
loop's CPU is the whole of the driver's work, the servers' side of a call included.

    python benchmarks/tracing_cost.py            # under a minute on 2 cores
    python benchmarks/tracing_cost.py --quick    # a smoke run

A round is one ``Pipeline`` of ``prompts`` one-chunk prompts on 2 simulated servers, batches of
32, a learner call and a ``keep`` update after each batch (``observe.py --pipeline``'s round);
the three systems run round by round, interleaved; a figure is the event loop's CPU a sample.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import _harness
import observe
from _harness import Result, Row, Table

import asyncexec
from asyncexec.testing import SimCluster

BATCH = observe.PIPELINE_BATCH


@dataclass(frozen=True)
class Sizes:
    repeats: int
    prompts: int  # a round's prompts


FULL, QUICK = Sizes(repeats=7, prompts=4000), Sizes(repeats=1, prompts=256)


Server, Learner = observe._rl_roles()  # observe.py's pipeline round: its classes and round


async def _round(learner: asyncexec.Executor, servers: asyncexec.Executor, prompts: int) -> float:
    """One pipeline of ``prompts`` prompts: the event loop's CPU a sample, in us."""
    loop = time.thread_time()
    await observe._rl_round(learner, servers, Learner.step, prompts)
    return (time.thread_time() - loop) / prompts * 1e6


def _providers() -> tuple[Any, Any]:
    """A provider whose spans cost nothing (valid contexts, no recording), and the SDK's, whose
    spans go in batches (as the SDK recommends) to an exporter that drops them."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Free:
        __slots__ = ("context",)

        def __init__(self) -> None:
            bits = random.getrandbits
            self.context = trace.SpanContext(bits(128), bits(64), False, trace.TraceFlags(1))

        def get_span_context(self) -> Any:
            return self.context

        def set_attribute(self, key: str, value: Any) -> None: ...
        def set_attributes(self, attributes: Any) -> None: ...
        def record_exception(self, error: BaseException) -> None: ...
        def set_status(self, status: Any) -> None: ...
        def end(self, end_time: int | None = None) -> None: ...

    class FreeTracer:
        def start_span(self, name: str, *args: Any, **kwargs: Any) -> Free:
            return Free()

    class FreeProvider(trace.TracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
            return FreeTracer()

    class Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            SPANS[0] += len(spans)
            return SpanExportResult.SUCCESS

    sdk = TracerProvider()
    sdk.add_span_processor(BatchSpanProcessor(Dropped()))
    return FreeProvider(), sdk


#: The SDK's spans exported (dropped) so far, and the samples of the rounds that made them.
SPANS, SDK_SAMPLES = [0], [0]


@contextmanager
def _provided(provider: Any, collect: bool = True) -> Iterator[None]:
    """``provider`` as the tracer provider asyncexec finds (None: the API's default, tracing
    off) for the block, and the collector off when not ``collect``."""
    from opentelemetry import trace

    default = trace.get_tracer_provider
    if provider is not None:
        trace.get_tracer_provider = lambda: provider
    if not collect:
        gc.disable()
    try:
        yield
    finally:
        trace.get_tracer_provider = default
        gc.enable()


async def bench(sizes: Sizes, args: argparse.Namespace) -> Result:
    free, sdk = _providers()
    row = Row(
        "the event loop's CPU a sample, through a pipeline on simulated servers",
        "us",
        measured="sdk",
        reference="off",
    )
    cluster = SimCluster()
    async with (
        asyncexec.Executor(1, cluster=cluster, roles=Learner) as learner,
        asyncexec.Executor(2, cluster=cluster, roles=Server) as servers,
    ):

        def system(provider: Any, collect: bool = True) -> Callable[[], Any]:
            async def one() -> float:
                if provider is sdk:
                    SDK_SAMPLES[0] += sizes.prompts
                with _provided(provider, collect):
                    return await _round(learner, servers, sizes.prompts)

            return one

        systems = {
            "off": system(None),
            "free": system(free),
            "sdk": system(sdk),
            "sdk_nogc": system(sdk, collect=False),
        }
        await _harness.repeat([row], systems, sizes.repeats, name="tracing cost")
    sdk.shutdown()  # (exports what is queued)
    m = row.medians()
    notes = [
        f"- the SDK made {SPANS[0] / SDK_SAMPLES[0]:.2f} spans a sample: a request's "
        f"and, for each batch of {BATCH}, the batch's, the update's with its pause, push and "
        "resume, and the learner's call",
        f"- tracing adds {m['sdk'] - m['off']:.0f} us a sample: asyncexec's own work "
        f"{m['free'] - m['off']:.0f} us (a provider whose spans cost nothing), the SDK's spans "
        f"the other {m['sdk'] - m['free']:.0f} us, of which the collector "
        f"{m['sdk'] - m['sdk_nogc']:.0f} us (the ended spans wait in the SDK's export queue)",
    ]
    table = Table(
        [
            ("off", "off"),
            ("free", "spans that cost nothing"),
            ("sdk", "the SDK's spans"),
            ("sdk_nogc", "the SDK's, collector off"),
        ],
        [("off", "SDK / off"), ("free", "SDK / free spans")],
        spread=True,
        small=1,
    )
    return Result([row], table, notes)


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="What tracing costs the driver through a pipeline (simulated servers)",
        full=FULL,
        quick=QUICK,
        run=bench,
    )


if __name__ == "__main__":
    sys.exit(main())
