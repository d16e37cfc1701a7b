"""What seeing a run costs: reports/s and call latency with the timeline and traces off, the
timeline on, and tracing on, side by side in one run; and the timeline's memory over 100,000
steps. The tree before a change, nothing on, against this one: ``before_after.py --before TREE
--what observe`` (this file's measurement, run on each tree's asyncexec).

    python benchmarks/observe.py                      # about 4 minutes on 2 cores
    python benchmarks/observe.py --quick              # a smoke run
    python benchmarks/observe.py --pictures docs/img  # the docs' timelines (PNG; the GRPO
                                                      # one: examples/grpo.py --timeline)
    python benchmarks/observe.py --pipeline           # only the pipeline's figures

The variants are measured in turn, round by round (each round in another order), on the same
4 workers in one process with one Ray (the timeline handed to the executor's runs or taken
away between runs; a second executor of 4 workers open beside it), so that the machine's drift
falls on all of them; ``--repeats`` processes (2) of ``--rounds`` rounds (5) each.

- **reports/s**: 4 workers report tiny metrics as fast as they can for ``STEPS`` steps (an
  aligned run, default ``buffer_size``), counted from the run's start to its last step.
- **call latency**: ``CALLS`` calls of a tiny function on one rank (``on=rank(0)``) a round,
  one every millisecond (about 1,000 calls/s), each timed from the call to its result.
- **memory**: the driver's RSS after 10,000, 50,000 and 100,000 steps of 4 workers with the
  timeline on (its default ring of 100,000 events) and off, and the events it holds.
- **samples/s through a pipeline** (issue 41's figures): a learner (1 worker) and 2 rollout
  servers, both on one shared timeline (``Executor(timeline=shared)``), a ``Pipeline`` of
  ``PIPELINE_SAMPLES`` prompts (one chunk each), batches of 32, a weight update (``keep``) after
  each; ``off``, ``timeline`` (the shared one) and ``tracing`` in turn, round by round, with
  the driver's CPU a sample beside (its process, all threads; its event loop's thread alone,
  ``loop_us``: what a variant adds there is robust to a loaded machine, where samples/s are
  not); and the driver's RSS after 10,000, 50,000 and 100,000 requests with the shared
  timeline on and off.

Variants: ``off`` (this tree, nothing on), ``timeline`` (``Executor(timeline=True)``),
``tracing`` (an OpenTelemetry SDK provider with a ``BatchSpanProcessor`` whose exporter drops
the spans: every span is made, carried to the worker, attached there and ended).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if ROOT not in sys.path:
    # After PYTHONPATH: a child measuring another tree (``before_after.py --what observe``)
    # imports that tree's asyncexec (its PYTHONPATH), as its workers do, not this one.
    sys.path.append(ROOT)

from _common import median, progress  # noqa: E402 (this folder is on sys.path now)

STEPS, CALLS, WORKERS = 20_000, 1_000, 4
MEMORY_MARKS = (10_000, 50_000, 100_000)
PIPELINE_SAMPLES, PIPELINE_BATCH = 4_000, 32
CPUS = ("cpu_us", "loop_us")  # the driver's CPU a sample through a pipeline: process, loop


def steps_fn(config: dict[str, Any]) -> None:
    import asyncexec

    report = asyncexec.report
    for i in range(config["steps"]):
        report({"step": i})


def tiny(x: int) -> int:
    return x + 1


CPU = {"CPU": 0.25}


def _keep_timeline(ex: Any, timeline: Any) -> None:
    """Turn ``ex``'s timeline on (``timeline``) or off (None) between runs: where the executor
    hands it to its runs, group and calls (a benchmark's reach into private names, so that
    every variant runs on the same workers)."""
    from asyncexec._driver._sinks import ExecutorTimeline

    ex._life.timeline = ex._slot.timeline = timeline
    observer = ex._life.observer  # the slot's, its group's and the calls' too
    for sink in [s for s in observer.sinks if isinstance(s, ExecutorTimeline)]:
        observer.remove(sink)
    if timeline is not None:
        observer.add(ExecutorTimeline(timeline))


def _provider() -> Any:
    """An OpenTelemetry SDK provider whose spans go, in batches as the SDK recommends, to an
    exporter that drops them: every span is made, carried to the worker and ended."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    return provider


async def _reports(ex: Any, steps: int) -> float:
    t0 = time.perf_counter()
    last = t0
    async for _ in ex.run(steps_fn, {"steps": steps}):
        last = time.perf_counter()
    return float(steps * WORKERS / (last - t0))


async def _latencies(ex: Any, calls: int) -> list[float]:
    import anyio

    import asyncexec

    latencies = []
    start = time.perf_counter()
    for i in range(calls):
        wait = start + i * 0.001 - time.perf_counter()
        if wait > 0:
            await anyio.sleep(wait)  # paced: about 1,000 calls/s
        t = time.perf_counter()
        await ex.call(tiny, i, on=asyncexec.rank(0))
        latencies.append(time.perf_counter() - t)
    return latencies


async def _measure(variants: list[str], steps: int, calls: int, rounds: int) -> dict[str, Any]:
    """One process's measurements (its own Ray): ``rounds`` rounds, each variant in turn, on
    one executor (tracing is on while the application's provider is set, the timeline while
    the executor holds it), a second one open beside it."""
    import asyncexec

    trace: Any = None
    if "tracing" in variants:
        from opentelemetry import trace

        provider, default = _provider(), trace.get_tracer_provider
    out: dict[str, Any] = {v: {"reports_per_s": [], "calls_s": []} for v in variants}
    on = {"timeline": True} if "timeline" in variants else {}  # (an older tree has none)
    async with (
        asyncexec.Executor(WORKERS, resources_per_worker=CPU, **on) as ex,
        asyncexec.Executor(WORKERS, resources_per_worker=CPU),  # the same load in every tree
    ):
        async for _ in ex.run(steps_fn, {"steps": 500}):  # warm-up
            pass
        for i in range(50):
            await ex.call(tiny, i, on=asyncexec.rank(0))
        kept = getattr(ex, "timeline", None)
        for r in range(rounds):
            for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
                if trace is not None:
                    trace.get_tracer_provider = (
                        (lambda: provider) if variant == "tracing" else default
                    )
                if kept is not None:
                    _keep_timeline(ex, kept if variant == "timeline" else None)
                out[variant]["reports_per_s"].append(await _reports(ex, steps))
                out[variant]["calls_s"].extend(await _latencies(ex, calls))
        if trace is not None:
            trace.get_tracer_provider = default
            provider.shutdown()
    return out


async def _memory(variant: str, marks: tuple[int, ...]) -> dict[str, Any]:
    import psutil

    import asyncexec

    options: dict[str, Any] = {"timeline": True} if variant == "timeline" else {}
    rss: dict[int, float] = {}
    async with asyncexec.Executor(
        WORKERS, resources_per_worker={"CPU": 0.25}, buffer_size=256, **options
    ) as ex:
        async for step in ex.run(steps_fn, {"steps": marks[-1]}):
            if step.index + 1 in marks:
                rss[step.index + 1] = psutil.Process().memory_info().rss / 2**20
        stats = ex.timeline.statistics() if ex.timeline is not None else None
    return {
        "variant": variant,
        "rss_mib": rss,
        "events": None if stats is None else stats.events,
        "dropped": None if stats is None else stats.dropped,
    }


def _rl_roles() -> tuple[type, type]:
    """The pipeline's server and learner classes (made here: asyncexec is imported from the
    tree measured)."""
    import asyncexec

    class Server(asyncexec.RolloutServer):
        async def chunks(self, prompt: int) -> Any:
            yield prompt

        def load_weights(self, state: Any, version: int) -> None:
            self.weights = state

    class Learner:
        def step(self, n: int) -> int:
            return n

    return Server, Learner


async def _rl_round(learner: Any, servers: Any, learn: Any, samples: int) -> float:
    """One pipeline of ``samples`` prompts: its samples/s, from its start to its last batch."""
    import asyncexec

    t0 = time.perf_counter()
    async with asyncexec.Pipeline(
        servers, list(range(samples)), batch_size=PIPELINE_BATCH, staleness=2
    ) as pipe:
        async for batch in pipe:
            await learner.call(learn, len(batch), on=asyncexec.rank(0))
            await pipe.update_weights({"v": pipe.version}, on_update="keep")
        return samples / (time.perf_counter() - t0)


async def _rl_measure(variants: list[str], samples: int, rounds: int) -> dict[str, Any]:
    """Samples/s through a pipeline, the variants in turn round by round, on one learner and
    one servers' executor that share a timeline (taken away for ``off`` and ``tracing``)."""
    import asyncexec

    trace: Any = None
    if "tracing" in variants:
        from opentelemetry import trace

        provider, default = _provider(), trace.get_tracer_provider
    server, learner_cls = _rl_roles()
    shared = asyncexec.Timeline()
    out: dict[str, Any] = {v: {"samples_per_s": [], "cpu_us": [], "loop_us": []} for v in variants}
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, roles=learner_cls, timeline=shared) as lx,
        asyncexec.Executor(2, resources_per_worker=CPU, roles=server, timeline=shared) as sx,
    ):
        views = {ex: ex.timeline for ex in (lx, sx)}
        learn = learner_cls.step
        await _rl_round(lx, sx, learn, 256)  # warm-up
        for r in range(rounds):
            for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
                if trace is not None:
                    trace.get_tracer_provider = (
                        (lambda: provider) if variant == "tracing" else default
                    )
                for ex, view in views.items():
                    _keep_timeline(ex, view if variant == "timeline" else None)
                    ex.timeline = view if variant == "timeline" else None  # (the pipeline's)
                cpu, loop = time.process_time(), time.thread_time()
                out[variant]["samples_per_s"].append(await _rl_round(lx, sx, learn, samples))
                out[variant]["cpu_us"].append((time.process_time() - cpu) / samples * 1e6)
                out[variant]["loop_us"].append((time.thread_time() - loop) / samples * 1e6)
        if trace is not None:
            trace.get_tracer_provider = default
            provider.shutdown()
    out["events"] = shared.statistics().events
    return out


async def _rl_memory(variant: str, marks: tuple[int, ...]) -> dict[str, Any]:
    """The driver's RSS after each mark of requests through one pipeline, with the shared
    timeline on (``timeline``) or off."""
    import psutil

    import asyncexec

    server, learner_cls = _rl_roles()
    shared = asyncexec.Timeline() if variant == "timeline" else False
    rss: dict[int, float] = {}
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, roles=learner_cls, timeline=shared) as lx,
        asyncexec.Executor(2, resources_per_worker=CPU, roles=server, timeline=shared) as sx,
        asyncexec.Pipeline(sx, range(marks[-1]), batch_size=256, staleness=2) as pipe,
    ):
        done, due = 0, list(marks)
        async for batch in pipe:
            done += len(batch)
            await lx.call(learner_cls.step, len(batch), on=asyncexec.rank(0))
            await pipe.update_weights({"v": pipe.version}, on_update="keep")
            while due and done >= due[0]:
                rss[due.pop(0)] = psutil.Process().memory_info().rss / 2**20
    stats = shared.statistics() if shared else None
    return {
        "variant": variant,
        "rss_mib": rss,
        "events": None if stats is None else stats.events,
        "dropped": None if stats is None else stats.dropped,
    }


def paced(config: dict[str, Any]) -> None:
    """Steps of ``config["step_s"]`` seconds; rank ``config["slow"]`` takes twice as long."""
    import asyncexec

    rank = asyncexec.get_context().world_rank
    for i in range(config["steps"]):
        time.sleep(config["step_s"] * (2 if rank == config.get("slow") else 1))
        asyncexec.report({"step": i})


async def _pictures(folder: str) -> dict[str, Any]:
    """The docs' pictures: a run through a killed worker (with calls chosen by load), and a
    straggler's."""
    import signal

    import asyncexec

    os.makedirs(folder, exist_ok=True)
    async with asyncexec.Executor(4, resources_per_worker={"CPU": 0.25}, timeline=True) as ex:
        killed = False
        async for step in ex.run(paced, {"steps": 24, "step_s": 0.05}):
            if step.index in (3, 15):
                await ex.call(tiny, step.index, on=asyncexec.least_loaded())
            if not killed and step.index == 8:
                killed = True
                os.kill(ex.workers[2].pid, signal.SIGKILL)
        assert ex.timeline is not None
        ex.timeline.render(  # the start-up drawn: the restart's is set beside the first's
            os.path.join(folder, "timeline-restart.png"),
            "4 ranks; rank 2 killed at step 8",
            startup=True,
        )
    async with asyncexec.Executor(4, resources_per_worker={"CPU": 0.25}, timeline=True) as ex:
        async for _ in ex.run(paced, {"steps": 16, "step_s": 0.05, "slow": 1}):
            pass
        assert ex.timeline is not None
        ex.timeline.render(
            os.path.join(folder, "timeline-straggler.png"),
            "4 ranks; rank 1 twice as slow",
            startup=True,
        )
    return {"folder": folder}


def _child(args: argparse.Namespace) -> None:
    import anyio

    import asyncexec

    if args.child == "pictures":
        out = anyio.run(_pictures, args.pictures)
    elif args.child == "memory":
        out = anyio.run(_memory, args.variant, tuple(args.marks))
    elif args.child == "rl":
        out = anyio.run(_rl_measure, args.variant.split(","), args.samples, args.rounds)
    elif args.child == "rl-memory":
        out = anyio.run(_rl_memory, args.variant, tuple(args.marks))
    else:
        variants = args.variant.split(",")
        out = anyio.run(_measure, variants, args.steps, args.calls, args.rounds)
    where = os.path.dirname(os.path.abspath(asyncexec.__file__))
    print("RESULT " + json.dumps({"asyncexec": where, "out": out}), flush=True)


@dataclass(frozen=True)
class Sizes:
    repeats: int  # processes of each measurement
    rounds: int  # rounds of the variants in each
    steps: int = STEPS
    calls: int = CALLS
    marks: tuple[int, ...] = MEMORY_MARKS
    samples: int = PIPELINE_SAMPLES


FULL, QUICK = Sizes(2, 5), Sizes(1, 1, 2_000, 100, (1_000, 5_000), 512)


def _run(variant: str, tree: str, what: str, sizes: Sizes, pictures: str | None = None) -> Any:
    """One child process of this file measuring ``what`` with ``tree``'s asyncexec."""
    import _harness

    command = ["--child", what, "--variant", variant]
    command += ["--steps", str(sizes.steps), "--calls", str(sizes.calls)]
    command += ["--rounds", str(sizes.rounds), "--marks", *map(str, sizes.marks)]
    command += ["--samples", str(sizes.samples)]
    if pictures:
        command += ["--pictures", os.path.abspath(pictures)]
    return _harness.child(os.path.abspath(__file__), *command, tree=tree)["out"]


async def _observe(sizes: Sizes, args: argparse.Namespace) -> Any:
    """The variants' reports/s and call latency, the driver's memory with the timeline on and
    off, and the same through a pipeline (only those with ``--pipeline``)."""
    import _harness

    if args.pictures:
        _run("pictures", ROOT, "pictures", sizes, args.pictures)
        return _harness.Result([], _harness.Grid([]), [f"- pictures in {args.pictures}"])
    notes: list[str] = []
    rows: list[list[str]] = []
    if not args.pipeline:
        results: dict[str, dict[str, list[float]]] = {}
        for repeat in range(sizes.repeats):
            progress(f"repeat {repeat + 1}: off, timeline, tracing")
            for variant, values in _run("off,timeline,tracing", ROOT, "measure", sizes).items():
                mine = results.setdefault(variant, {"reports_per_s": [], "calls_s": []})
                for key, found in values.items():
                    mine[key].extend(found)
        off = _figures(results["off"])
        for variant, runs in results.items():
            cells = [f"{m:,.0f}" if i == 0 else f"{m:.3f}" for i, m in enumerate(_figures(runs))]
            ratios = [f"{m / o:.3f}" for m, o in zip(_figures(runs), off, strict=True)]
            rows.append([variant, *(c for pair in zip(cells, ratios, strict=True) for c in pair)])
        notes += _memory_notes("steps", "memory", sizes)
    notes += _pipeline_notes(sizes)
    head = ["variant", "reports/s", "ratio", "call p50, ms", "ratio", "call p90, ms", "ratio"]
    return _harness.Result(rows, _harness.Grid(head), notes)


def _figures(runs: dict[str, list[float]]) -> tuple[float, float, float]:
    """Median reports/s, call p50 and p90 (ms)."""
    calls = sorted(runs["calls_s"])
    return median(runs["reports_per_s"]), median(calls) * 1e3, calls[int(len(calls) * 0.9)] * 1e3


def _memory_notes(what: str, child: str, sizes: Sizes) -> list[str]:
    """The driver's RSS after each mark of ``what`` with the timeline off and on."""
    notes = [f"- memory: the driver's RSS (MiB) after each number of {what}, off / timeline:"]
    for variant in ("off", "timeline"):
        mem = _run(variant, ROOT, child, sizes)
        marks = ", ".join(f"{int(k):,}: {v:.1f}" for k, v in mem["rss_mib"].items())
        held = ""
        if mem["events"] is not None:
            held = f" (events held {mem['events']:,}, dropped {mem['dropped']:,})"
        notes.append(f"  - {variant}: {marks}{held}")
    return notes


def _pipeline_notes(sizes: Sizes) -> list[str]:
    """Issue 41's figures: samples/s through a pipeline with the shared timeline and tracing
    on, beside off; the driver's memory after 100,000 requests."""
    runs: dict[str, dict[str, list[float]]] = {}
    for repeat in range(sizes.repeats):
        progress(f"repeat {repeat + 1}: pipeline")
        measured = _run("off,timeline,tracing", ROOT, "rl", sizes)
        for variant in ("off", "timeline", "tracing"):
            mine = runs.setdefault(variant, {})
            for key, values in measured[variant].items():
                mine.setdefault(key, []).extend(values)
    off = {key: median(values) for key, values in runs["off"].items()}
    notes = [
        f"- pipeline: a learner and 2 servers on one shared timeline, {sizes.samples:,} samples "
        f"a run, a keep update each batch of {PIPELINE_BATCH}; {sizes.repeats * sizes.rounds} "
        "rounds (medians; the driver's CPU a sample, µs: its process, and its event loop's "
        "thread alone, with what the variant adds to off's):"
    ]
    for variant, found in runs.items():
        rate = median(found["samples_per_s"])
        cpus = ", ".join(
            f"{k} {median(found[k]):.1f} ({median(found[k]) - off[k]:+.1f})" for k in CPUS
        )
        notes.append(
            f"  - {variant}: {rate:,.0f} samples/s ({rate / off['samples_per_s']:.3f}x), {cpus}"
        )
    return notes + _memory_notes("requests through a pipeline", "rl-memory", sizes)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, help="rounds of the variants in each process (5)")
    parser.add_argument("--pictures", metavar="DIR", help="draw the docs' timelines into DIR")
    parser.add_argument(
        "--pipeline", action="store_true", help="only the pipeline's figures (issue 41's)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:  # one measurement, with the asyncexec first on PYTHONPATH
        parser = argparse.ArgumentParser()
        parser.add_argument("--child", choices=("measure", "memory", "pictures", "rl", "rl-memory"))
        parser.add_argument("--variant", default="off")
        parser.add_argument("--pictures")
        for name, default in asdict(QUICK if "--quick" in argv else FULL).items():
            parser.add_argument(f"--{name}", type=int, nargs="+" if name == "marks" else None)
            parser.set_defaults(**{name: default})
        parser.add_argument("--quick", action="store_true")
        _child(parser.parse_args(argv))
        return 0
    import _harness

    return _harness.main(
        argv,
        doc=__doc__,
        title="what seeing a run costs",
        full=FULL,
        quick=QUICK,
        run=_observe,
        options=_options,
        about=lambda sizes, args: (
            f"{WORKERS} workers, {sizes.steps:,} steps a run; {sizes.calls:,} calls a round at "
            f"~1,000/s; {sizes.repeats} process(es) of {sizes.rounds} round(s); median "
            "reports/s and calls, each variant's ratio to off"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
