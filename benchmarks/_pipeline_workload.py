"""The pipeline benchmark's workers and prompts: a rollout server whose work is simulated time
(a number of tokens per prompt, a sleep per decoding step, a pause point every few tokens) and a
trainer whose update is simulated time and whose weights are a small array.

What the workers import: numpy and asyncexec (no torch), as a rollout server should.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import asyncexec


@dataclass(frozen=True)
class Job:
    """A prompt: how many tokens it asks for, and how many make a chunk (None: the server's)."""

    tokens: int
    chunk_tokens: int | None = None


def long_tailed(
    seed: int, median: float = 8.0, sigma: float = 1.1, cap: int = 256
) -> Iterator[Job]:
    """Lognormal lengths, the same for the same seed: p99 / p50 = exp(2.33 sigma) (13 here)."""
    rng = np.random.default_rng(seed)
    while True:
        yield Job(int(np.clip(round(median * np.exp(sigma * rng.standard_normal())), 1, cap)))


def tail_ratio(seed: int, n: int = 4000) -> tuple[float, float]:
    """(p50, p99) of the first ``n`` lengths of :func:`long_tailed` for ``seed``."""
    jobs = long_tailed(seed)
    lengths = [next(jobs).tokens for _ in range(n)]
    return float(np.percentile(lengths, 50)), float(np.percentile(lengths, 99))


class SleepServer(asyncexec.RolloutServer):
    """A rollout server whose decoding step is a sleep: ``token_s`` per token, a chunk (and a
    pause point) every ``chunk_tokens`` tokens; requests on one server decode concurrently, as
    a batching engine's do. The output is the number of tokens made."""

    def __init__(self, token_s: float, chunk_tokens: int) -> None:
        super().__init__()
        self.token_s, self.chunk_tokens = token_s, chunk_tokens
        self.loaded: int | None = None

    def load_weights(self, state: Any, version: int) -> None:
        self.loaded = version

    async def chunks(self, job: Job) -> AsyncIterator[int]:
        step = job.chunk_tokens or self.chunk_tokens
        for start in range(0, job.tokens, step):
            n = min(step, job.tokens - start)
            await asyncio.sleep(self.token_s * n)
            yield n

    def finish(self, job: Job, chunks: list[int]) -> int:
        return sum(chunks)


class Trainer:
    """A learner rank: an update is ``seconds`` of time (a thread's sleep: the accelerator's);
    its weights are ``size`` floats, served to the weight channel."""

    def __init__(self, size: int) -> None:
        self.weights = {"w": np.zeros(size, np.float32)}
        asyncexec.serve_weights(lambda: self.weights)

    def train(self, samples: int, seconds: float) -> int:
        time.sleep(seconds)
        return samples


# The throughput figure (driver side) -----------------------------------------------------------


async def throughput(
    servers: asyncexec.Executor,
    trainer: asyncexec.Executor,
    channel: asyncexec.WeightChannel,
    sizes: Any,
    staleness: int,
    seed: int,
    mode: str = "strict",
    on_expire: str = "requeue",
    max_requeues: int = 4,
) -> dict[str, Any]:
    """Samples trained per second over ``sizes.batches`` batches of the long-tailed workload
    through a pipeline with bound ``staleness``, each batch trained (simulated time) and
    followed by a push (``on_update="keep"``); how many samples were beyond the bound, by each
    sample's oldest chunk against the batch's version (not the pipeline's staleness figures);
    the lengths trained and the lengths the source gave (the bias expiry may bring); the
    requests expired and the share of generation time they threw away."""
    router = asyncexec.Router(servers, max_in_flight=sizes.max_in_flight, channel=channel)
    given: list[int] = []

    def source() -> Iterator[Job]:
        for job in long_tailed(seed):
            given.append(job.tokens)
            yield job

    trained: list[int] = []
    beyond = stale_max = 0
    t0 = time.perf_counter()
    async with (
        router,
        asyncexec.Pipeline(
            router,
            source(),
            batch_size=sizes.batch,
            staleness=staleness,
            mode=mode,  # type: ignore[arg-type]
            on_expire=on_expire,  # type: ignore[arg-type]
            max_requeues=max_requeues,
            on_update="keep",
            channel=channel,
        ) as pipe,
    ):
        async for batch in pipe:
            for s in batch.samples:  # (their versions are the learner's, as the batch's)
                lag = 10**9 if s.version is None else batch.version - s.version
                beyond += lag > staleness
                stale_max = max(stale_max, lag)
            await trainer.call(Trainer.train, len(batch.samples), sizes.train_s)
            trained += [int(s.output) for s in batch.samples]
            if len(trained) >= sizes.batches * sizes.batch:
                break
            await pipe.update_weights()
        stats = pipe.statistics()
    seconds = time.perf_counter() - t0
    return {
        "rate": len(trained) / seconds,
        "beyond": float(beyond),
        "staleness_max": float(stale_max),
        "trainer_idle": stats.trainer_idle_ratio,
        "expired": float(stats.expired),
        "expired_share": stats.expired_s / stats.generation_s if stats.generation_s else 0.0,
        "trained_p50": float(np.percentile(trained, 50)),
        "trained_p99": float(np.percentile(trained, 99)),
        "given_p50": float(np.percentile(given, 50)),
        "given_p99": float(np.percentile(given, 99)),
    }
