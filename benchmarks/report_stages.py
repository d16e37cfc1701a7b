"""Microseconds per report in each stage of the report path: asyncexec beside the batched floor.

    python benchmarks/report_stages.py                  # the stages measured in this process
    python benchmarks/report_stages.py --transfer       # and the round trip through Ray

Each stage is run by itself on this process, with the sizes of a run of tiny reports
(``{"step": i}``) at full speed: polls of :data:`PER_POLL` reports per rank (what ``run.py``'s
rows carry), for 1 and 4 ranks. The stages:

- ``report()``: the worker's function calling it (the dict made by the caller included), from
  the public ``asyncexec.report`` down to the buffer; the floor's thread appending to its deque;
- worker poll: what the poll does with the queued reports (take them, pack their times);
- pickle / unpickle: the poll's answer (``Poll``; the floor's ``(items, done)``) through
  cloudpickle, protocol 5, as Ray pickles a return value;
- transfer (``--transfer``, starts Ray): an actor call that returns a prebuilt answer, less
  the pickling and unpickling above: Ray's own cost per report;
- credit window: the driver's pump around each poll (credit, acknowledgement, hand to the
  assembly), with the poll itself answered at once;
- step assembly: the polls of every rank into complete steps (``Assembly.add`` and ``take``;
  the floor's deques popped a step at a time);
- hand-off: the batches through the hand-over and the memory stream to the ``async for``, one
  :class:`Step` per step (the floor's consumer takes its step in the assembly loop).

Every figure is the median of ``--repeats`` runs, each of ``--reports`` reports per rank.
Below the table: the bytes per report on the wire, and the objects the collector tracks that
the step assembly makes a step and keeps until the steps are consumed (asyncexec: one list a
rank a batch of steps; the floor: a list a step).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median

import asyncexec
from asyncexec._driver.run import _window
from asyncexec._driver.run._iterator import Run, RunCore
from asyncexec._driver.run._steps import StepBatch
from asyncexec._wire._protocol import Outcome, Poll
from asyncexec._worker._place import PLACE, Place
from asyncexec._worker._reports import Reports

#: Reports per poll per rank, as a run of tiny reports at full speed has them.
PER_POLL = 768

STAGES = (
    "report()",
    "worker poll",
    "pickle",
    "transfer",
    "unpickle",
    "credit window",
    "step assembly",
    "hand-off",
)


def _timed(fn: Callable[[], Any], reports: int) -> float:
    """Microseconds per report of one call of ``fn`` that handles ``reports`` reports."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / reports * 1e6


class _Session:
    def __init__(self, reports: Reports) -> None:
        self.reports = reports


@contextlib.contextmanager
def _ae_reports(loop: asyncio.AbstractEventLoop) -> Iterator[Reports]:
    """A worker's place with a run on it, current while the block runs (then the process is a
    driver again: ``report()`` outside a worker is refused)."""
    place = Place()
    reports = Reports(None, 1 << 60, 0, loop, place)  # type: ignore[arg-type]
    place.session = _Session(reports)  # type: ignore[assignment]
    token = PLACE.set(place)
    try:
        yield reports
    finally:
        PLACE.reset(token)


def _ae_polls(n: int) -> list[Poll]:
    """``n`` reports made through ``asyncexec.report``, as the polls that take them."""
    loop = asyncio.new_event_loop()
    polls = []
    with _ae_reports(loop) as reports:
        for start in range(0, n, PER_POLL):
            for i in range(start, min(n, start + PER_POLL)):
                asyncexec.report({"step": i})
            with reports._lock:
                polls.append(reports._take(PER_POLL))
    loop.close()
    return polls


def worker_stages(n: int) -> dict[str, dict[str, float]]:
    """The worker's stages (``report()``, its poll) and the answers' pickling."""
    loop = asyncio.new_event_loop()
    report = asyncexec.report
    with _ae_reports(loop) as reports:

        def ae_report() -> None:
            for i in range(n):
                report({"step": i})

        ae = {"report()": _timed(ae_report, n)}

        def ae_take() -> None:
            with reports._lock:
                while reports._buffer:
                    reports._take(PER_POLL)

        ae["worker poll"] = _timed(ae_take, n)
    loop.close()

    from _workload import LoopWorker  # the floor's actor class (its plain class underneath)

    floor_worker = LoopWorker.__ray_metadata__.modified_class()
    floor_worker._wake = asyncio.Event()
    fl = {"report()": _timed(lambda: floor_worker._produce(n, 1 << 60, False), n)}

    async def floor_take() -> None:
        while floor_worker._buf:
            await floor_worker.poll(PER_POLL)

    fl["worker poll"] = _timed(lambda: asyncio.run(floor_take()), n)

    polls = _ae_polls(n)
    items = [{"step": i} for i in range(n)]
    answers = [(items[s : s + PER_POLL], False) for s in range(0, n, PER_POLL)]
    from ray import cloudpickle

    for row, objs in ((ae, polls), (fl, answers)):
        data: list[bytes] = []

        def dump(objs: list[Any] = objs, data: list[bytes] = data) -> None:
            data.extend(cloudpickle.dumps(x, protocol=5) for x in objs)

        def load(data: list[bytes] = data) -> None:
            for x in data:
                pickle.loads(x)

        row["pickle"] = _timed(dump, n)
        row["unpickle"] = _timed(load, n)
        row["bytes"] = sum(map(len, data)) / n
    return {"asyncexec": ae, "floor": fl}


def driver_stages(n: int, ranks: int) -> dict[str, dict[str, float]]:
    """The driver's stages, per report, for ``ranks`` ranks of ``n`` reports each."""
    polls = _ae_polls(n)
    ae: dict[str, float] = {}
    total = n * ranks

    # The credit window: the pump around each poll, the poll answered at once.
    async def pump_all() -> None:
        for _ in range(ranks):
            answers = iter([*polls[:-1], polls[-1]._replace(outcome=Outcome("ok"))])

            async def submit(*args: Any, answers: Any = answers) -> Poll:
                return next(answers)  # type: ignore[no-any-return]

            async def take(poll: Poll) -> None:
                pass

            async def changed() -> None:
                pass

            _window.submit = submit  # type: ignore[assignment]
            await _window.pump(None, None, lambda: 1 << 30, lambda: 0, changed, lambda: 1, take)  # type: ignore[arg-type]

    submit = _window.submit
    try:
        ae["credit window"] = _timed(lambda: asyncio.run(pump_all()), total)
    finally:
        _window.submit = submit

    # Step assembly: every rank's polls added, complete steps taken in batches.
    def assemble() -> list[StepBatch]:
        asm = _window.Assembly(ranks, 1, 0)
        batches = []
        for poll in polls:
            for rank in range(ranks):
                asm.add(rank, poll)
            while asm.ready:
                batches.append(asm.take(_window.BATCH))
        return batches

    batches: list[StepBatch] = []
    ae["step assembly"] = _timed(lambda: batches.extend(assemble()), total)

    # The hand-off: the hand-over's queue and drain, the memory stream, the ``async for``.
    async def hand_off() -> None:
        import anyio

        from asyncexec._wire._checkpoint import CheckpointBook

        send, receive = anyio.create_memory_object_stream[Any](0)
        core = RunCore("stages")
        handover = _window.HandOver(core, send, CheckpointBook(None, None, "max"), lambda p: None)

        async def produce() -> None:
            for batch in batches:
                handover.queue(batch)
                await handover.drain()
            send.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            async for _step in Run(core, receive):
                pass

    ae["hand-off"] = _timed(lambda: asyncio.run(hand_off()), total)

    # The floor: the answers' items into one deque per rank, a step popped from each.
    answers = [[{"step": i} for i in range(s, min(n, s + PER_POLL))] for s in range(0, n, PER_POLL)]

    def floor() -> None:
        queues: list[deque[dict[str, Any]]] = [deque() for _ in range(ranks)]
        for items in answers:
            for q in queues:
                q.extend(items)
            for _ in range(min(map(len, queues))):
                [q.popleft() for q in queues]

    fl = {"credit window": 0.0, "step assembly": _timed(floor, total), "hand-off": 0.0}
    return {"asyncexec": ae, "floor": fl}


def transfer(n: int) -> dict[str, float]:
    """Microseconds per report of an actor call that returns a prebuilt answer of
    :data:`PER_POLL` reports, for each system (its pickling and unpickling included)."""
    import ray

    @ray.remote(num_cpus=0)
    class Answer:
        def __init__(self, answer: Any) -> None:
            self.answer = answer

        async def get(self) -> Any:
            return self.answer

    polls = _ae_polls(PER_POLL)
    floor_answer = ([{"step": i} for i in range(PER_POLL)], False)
    out = {}
    for name, answer in (("asyncexec", polls[0]), ("floor", floor_answer)):
        actor = Answer.remote(answer)

        async def calls(a: Any = actor) -> None:
            for _ in range(n // PER_POLL):
                await a.get.remote()

        asyncio.run(calls())  # warm-up
        out[name] = _timed(lambda c=calls: asyncio.run(c()), n // PER_POLL * PER_POLL)
        ray.kill(actor)
    return out


def objects_per_step(n: int) -> dict[str, float]:
    """Objects the collector tracks that the step assembly makes a step and keeps until the
    steps are consumed: one rank's polls of ``n`` reports taken as complete steps in batches
    (asyncexec: one list a rank a batch, not a tuple a step), against the floor's deque popped
    a step at a time (a list a step)."""
    polls = _ae_polls(n)
    answers = [[{"step": i} for i in range(s, min(n, s + PER_POLL))] for s in range(0, n, PER_POLL)]

    def assemble() -> list[StepBatch]:
        asm = _window.Assembly(1, 1, 0)
        batches = []
        for poll in polls:
            asm.add(0, poll)
            while asm.ready:
                batches.append(asm.take(_window.BATCH))
        return batches

    def floor() -> list[list[dict[str, Any]]]:
        queue: deque[dict[str, Any]] = deque()
        steps = []
        for items in answers:
            queue.extend(items)
            while queue:
                steps.append([queue.popleft()])
        return steps

    made = {}
    for system, fn in (("asyncexec", assemble), ("floor", floor)):
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            kept = fn()
            made[system] = (len(gc.get_objects()) - before) / n
        finally:
            gc.enable()
        del kept
    return made


def measure(reports: int, repeats: int, with_transfer: bool) -> list[str]:
    rows: dict[tuple[str, str, int], list[float]] = {}

    def keep(ranks: int, result: dict[str, dict[str, float]]) -> None:
        for system, stages in result.items():
            for stage, value in stages.items():
                rows.setdefault((system, stage, ranks), []).append(value)

    for _ in range(repeats):
        worker = worker_stages(reports)
        for ranks in (1, 4):
            keep(ranks, worker)
            keep(ranks, driver_stages(reports, ranks))
    if with_transfer:
        import _harness  # imported here: it sets the environment Ray's workers inherit

        with _harness.ray_session(num_cpus=4, fresh_workers=False):
            for _ in range(repeats):
                trip = transfer(reports)
                worker = worker_stages(reports)
                for system in ("asyncexec", "floor"):
                    net = trip[system] - worker[system]["pickle"] - worker[system]["unpickle"]
                    for ranks in (1, 4):
                        rows.setdefault((system, "transfer", ranks), []).append(net)
    lines = [
        "| stage (us per report) | asyncexec, 1 rank | floor, 1 rank | asyncexec, 4 ranks "
        "| floor, 4 ranks |",
        "|---|---:|---:|---:|---:|",
    ]
    totals = {k: 0.0 for k in (("asyncexec", 1), ("floor", 1), ("asyncexec", 4), ("floor", 4))}
    for stage in STAGES:
        cells = []
        for ranks in (1, 4):
            for system in ("asyncexec", "floor"):
                values = rows.get((system, stage, ranks))
                if values is None:
                    cells.append("-")
                    continue
                value = median(values)
                totals[(system, ranks)] += value
                cells.append(f"{value:.2f}")
        lines.append(f"| {stage} | {' | '.join(cells)} |")
    cells = [f"**{totals[(s, r)]:.2f}**" for r in (1, 4) for s in ("asyncexec", "floor")]
    lines.append(f"| **total** | {' | '.join(cells)} |")
    sizes = [median(rows[(s, "bytes", 1)]) for s in ("asyncexec", "floor")]
    lines.append("")
    lines.append(
        f"Bytes per report on the wire: asyncexec {sizes[0]:.1f}, floor {sizes[1]:.1f}; "
        f"{PER_POLL} reports a poll; medians of {repeats} runs of {reports} reports a rank."
    )
    made = objects_per_step(reports)
    lines.append(
        "Objects the collector tracks, made a step by the step assembly and kept until the "
        f"steps are consumed (1 rank): asyncexec {made['asyncexec']:.3f}, floor "
        f"{made['floor']:.3f}."
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reports", type=int, default=PER_POLL * 40, help=f"reports per rank (>= {PER_POLL})"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transfer", action="store_true", help="the Ray round trip (starts Ray)")
    args = parser.parse_args(argv)
    if args.reports < PER_POLL or args.repeats < 1:
        # The round trip moves whole polls: fewer reports than a poll holds would time none.
        parser.error(f"--reports takes {PER_POLL} or more (a poll's reports), --repeats 1 or more")
    threading.current_thread().name = "report-stages"
    print("\n".join(measure(args.reports, args.repeats, args.transfer)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
