"""Faults at the engine's boundary, each with its recovery time and the tokens it threw away.

Two ``VLLMServer`` engines (the model kit's tiny Llama) under a ``Router`` (8 requests in flight,
n = 8 each) whose health watch checks every second, gives a check 5 s, and takes a server out at
the second miss (tighter than the defaults, 5 s, 10 s and 3, to be quicker to see a stopped engine;
a 3 s bound took a busy engine out here), a weight channel from a 1-rank state holder, and these
cases in a row, each on the servers the one before left:

- ``killed``: one engine's core SIGKILLed with requests inside;
- ``stopped``: one engine's core SIGSTOPped with requests inside (the health watch takes its
  server out; the reaper kills the core once its server is gone);
- ``push``: one engine's core SIGKILLed while a push is on its way, with requests parked in
  both engines by a ``keep`` pause (a pipeline's update: pause, push, resume);
- ``all``: both engines' cores SIGKILLed with requests inside.

For each: the requests answered (each once), the seconds from the fault to the last answer and
to serving again (every server replaced and taking requests, at the channel's version), and the
tokens thrown away: what the engines hit had generated in the case (vLLM's own counter, read in
their servers with the cores stopped just before the kill) less the tokens of the samples those
servers had answered by then, against all the case generated. The fault comes once the engines
hit have made ``before_fault`` tokens in the case: what is thrown away is what they had in
flight then, and nothing else (no other server's work, no answered sample). No floor: a
hand-written loop has no recovery to compare with (the tests hold the promises; this says what
they cost).

Run alone on the machine: each case waits for a new engine's start (20-60 s here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import _harness

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import anyio
from _common import progress
from _engines_workload import StateHolder, generated_tokens
from _harness import Grid, Result

import asyncexec
from asyncexec.engines import VLLMServer, build_tiny_llama, completions

CASES = ("killed", "stopped", "push", "all")
ENGINE = {"dtype": "bfloat16", "max_model_len": 512, "enforce_eager": True, "seed": 0}
DIGITS = list(range(4, 14))  # the kit's tokenizer: "0".."9"
HEALTH = {
    "health_interval_s": 1.0,
    "health_timeout_s": 5.0,
    "health_grace_s": 0.0,
    "unhealthy_after": 2,
}


@dataclass(frozen=True)
class Sizes:
    requests: int  # sent in each case, n = 8 completions each
    tokens: int  # per completion
    before_fault: int  # tokens the engines hit generate in the case before the fault


FULL = Sizes(requests=16, tokens=64, before_fault=1500)
QUICK = Sizes(requests=8, tokens=32, before_fault=300)


def prompts(sizes: Sizes, tag: str) -> Iterator[asyncexec.RolloutRequest]:
    sampling = {"n": 8, "max_tokens": sizes.tokens, "ignore_eos": True}
    for i in range(1_000_000):
        digits = [DIGITS[(i + k) % 10] for k in range(4)]
        yield asyncexec.RolloutRequest(
            f"{tag}-{i}", {"prompt_token_ids": [1, *digits], "sampling": sampling}
        )


def tokens(samples: list[asyncexec.Sample], rank: int) -> int:
    return sum(len(c.token_ids) for s in samples if s.rank == rank for c in completions(s))


@dataclass
class Faults:
    sizes: Sizes
    rollout: asyncexec.Executor
    router: asyncexec.Router
    channel: asyncexec.WeightChannel
    stopped: list[int] = field(default_factory=list)  # engine cores SIGSTOPped, to kill

    async def core(self, rank: int) -> int:
        """The pid of rank ``rank``'s engine core, once its server lists one."""
        with anyio.fail_after(400):
            while True:
                pids = await self.rollout.call(VLLMServer.engine_pids, on=asyncexec.rank(rank))
                if "VLLM::EngineCore" in pids:
                    return int(pids["VLLM::EngineCore"])
                await anyio.sleep(0.5)

    async def made(self, rank: int) -> float:
        return float(await self.rollout.call(generated_tokens, on=asyncexec.rank(rank)))

    async def generating(self, start: dict[int, float]) -> None:
        """Until the engines of ``start``'s ranks made ``before_fault`` tokens since it."""
        with anyio.fail_after(120):
            while True:
                made = [await self.made(r) - made0 for r, made0 in start.items()]
                if sum(made) >= self.sizes.before_fault:
                    return
                await anyio.sleep(0.05)

    async def case(self, case: str) -> list[str]:
        """Requests sent; once the engines to hit have made ``before_fault`` tokens, the fault
        (for ``push``: a ``keep`` pause and a push on its way first, the resume after the push);
        every request answered once; every server serving again."""
        ranks = {"killed": [1], "stopped": [0], "push": [1], "all": [0, 1]}[case]
        replaced = self.router.statistics().replaced + len(ranks)
        retries = self.router.statistics().retries
        cores = {r: await self.core(r) for r in ranks}
        start = {r: await self.made(r) for r in ranks}
        samples: list[asyncexec.Sample] = []
        pushed: list[float] = []
        push_ended = anyio.Event()

        async def one(request: asyncexec.RolloutRequest) -> None:
            samples.append(await self.router.generate(request))

        async def push() -> None:
            await self.channel.push()
            pushed.append(time.perf_counter())
            push_ended.set()

        source = prompts(self.sizes, case)
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.sizes.requests):
                    tg.start_soon(one, next(source))
                await self.generating(start)
                if case == "push":
                    await self.router.pause("keep")
                    tg.start_soon(push)
                for pid in cores.values():  # stopped first, to read what each engine made
                    os.kill(pid, signal.SIGSTOP)
                self.stopped = list(cores.values())
                made = {r: await self.made(r) - start[r] for r in ranks}
                before = list(samples)  # what the engines hit answered: before the fault
                t0 = time.perf_counter()
                if case != "stopped":
                    self.kill_stopped()
                if case == "push":
                    with anyio.fail_after(120):
                        await push_ended.wait()
                    await self.router.resume()
            answered = time.perf_counter() - t0
            with anyio.fail_after(600):
                while (s := self.router.statistics()).replaced < replaced or not all(s.serving):  # noqa: ASYNC110 (the router's state)
                    await anyio.sleep(0.2)
            back = time.perf_counter() - t0
        finally:
            self.kill_stopped()
        ids = [s.id for s in samples]
        assert len(set(ids)) == len(ids) == self.sizes.requests, sorted(ids)
        after = await self.router.generate(next(prompts(self.sizes, f"{case}-after")))
        assert set(after.versions) == {self.channel.version}, after.versions
        thrown = sum(made[r] - tokens(before, r) for r in ranks)
        total = sum(tokens(samples, r) for r in (0, 1)) + thrown
        progress(f"  answered {answered:.1f} s, serving again {back:.1f} s, thrown {thrown:.0f}")
        if pushed:
            progress(f"  the push returned {pushed[0] - t0:.1f} s after the kill")
        share = f"{thrown / total:.0%}" if total else "-"
        cells = [f"{answered:.1f}", f"{back:.1f}", f"{thrown:,.0f} of {total:,.0f} ({share})"]
        again = self.router.statistics().retries - retries
        return [LABELS[case], f"{len(samples)} ({again} sent again)", *cells]

    def kill_stopped(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.stopped = []


LABELS = {
    "killed": "one engine's core SIGKILLed with requests inside",
    "stopped": "one engine's core SIGSTOPped with requests inside",
    "push": "one engine's core SIGKILLed mid-push, requests parked by a keep pause",
    "all": "both engines' cores SIGKILLed with requests inside",
}


async def bench(sizes: Sizes, args: Any) -> Result:
    folder = build_tiny_llama(os.path.join(tempfile.gettempdir(), "asyncexec-bench-tiny"))
    rows: list[list[str]] = []
    progress("starting the engines")
    async with (
        asyncexec.Executor(
            2,
            roles=asyncexec.Role(VLLMServer, folder, engine=ENGINE, sampling={"n": 8}),
            name="vllm",
            resources_per_worker={"CPU": 0.5},
            timeouts=asyncexec.Timeouts(start_s=400),
            restart=asyncexec.RestartPolicy(max_restarts=8),
        ) as rollout,
        asyncexec.Executor(
            1,
            name="holder",
            roles=asyncexec.Role(StateHolder, folder),
            resources_per_worker={"CPU": 0.25},
        ) as holder,
        asyncexec.WeightChannel(holder, rollout) as channel,
        asyncexec.Router(rollout, max_in_flight=8, channel=channel, **HEALTH) as router,
    ):
        await channel.push()
        faults = Faults(sizes, rollout, router, channel)
        for case in CASES:
            if case in args.only:
                progress(case)
                rows.append(await faults.case(case))
        stats = router.statistics()
    notes = [
        f"- the router over the cases: {stats.requests} requests, {stats.retries} sent again, "
        f"{stats.duplicates_dropped} duplicates dropped, {stats.taken_out} taken out, "
        f"{stats.replaced} replaced; the tokens thrown away are the share of all the case made"
    ]
    head = [
        "fault",
        "answered",
        "to the last answer, s",
        "to serving again, s",
        "tokens thrown away",
    ]
    return Result(rows, Grid(head), notes)


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec engine faults",
        full=FULL,
        quick=QUICK,
        run=bench,
        ray={"num_cpus": 16, "object_store_bytes": 2 * 1024**3, "logging_level": logging.WARNING},
        figures=CASES,
    )


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is needed
    sys.exit(main())
