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
