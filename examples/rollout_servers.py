"""Rollout servers behind a driver: each worker holds a ``Server`` that serves one request at a
time; the driver sends many requests at once, each to the least-loaded server with at most ``k``
in flight on any server, handles each answer as it comes back, and kills a server midway: the
requests it held are sent again to the others, and every request is answered exactly once.

    python examples/rollout_servers.py                      # 4 servers, 200 requests, k = 2
    python examples/rollout_servers.py --kill-after 0       # no kill
    ASYNCEXEC_LOCAL=1 python examples/rollout_servers.py    # local mode: threads, no kill

What it shows:

- ``Server`` is a worker class: each rank holds one instance (its lock, its counters) between
  calls. ``generate`` is an ``async def``: the calls sent to a server run on its event loop
  together, and its ``asyncio.Lock`` makes them take turns, as an engine with one slot would.
  The work is simulated: a sleep per token (the accelerator's time) and tokens drawn from a
  generator seeded by the request, so the same request gets the same answer on any server.
- ``on=asyncexec.least_loaded(max_in_flight=k, retry=True)``: each call goes to the server with
  the fewest of the driver's calls in flight; while every server holds ``k``, the call waits in
  the driver, so no server ever holds more than ``k`` (the servers count it themselves).
  ``retry=True`` is the caller's word that ``generate`` is idempotent: when its server dies, the
  call is sent to another server.
- One task per request; the answers are read from a stream as they come back, in the order
  they are ready. After ``--kill-after`` answers the driver SIGKILLs server 1: each call it held
  is sent to another server (asyncexec logs ``call_sent_again`` for each: the example counts
  those events), and rank 1 gets a fresh process of its own while the others go on (outside a
  run, a group without a backend replaces only the dead rank).
- Local mode (``ASYNCEXEC_LOCAL=1``) runs the servers as threads of this process: there is no
  server process to kill, so the kill is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectSendStream

import asyncexec

VOCAB = 32_000


@dataclass(frozen=True)
class Request:
    id: int
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Answer:
    id: int
    rank: int  # the server's
    pid: int
    tokens: tuple[int, ...]
    held: int  # the requests its server held when it took this one, this one included


def make_requests(n: int, seed: int = 0) -> list[Request]:
    """``n`` requests of 8 prompt tokens, each asking for 8 to 32 new ones."""
    rng = np.random.default_rng(seed)
    return [
        Request(i, tuple(rng.integers(0, VOCAB, 8).tolist()), int(rng.integers(8, 33)))
        for i in range(n)
    ]


def complete(request: Request) -> tuple[int, ...]:
    """The tokens a request gets: the same on every server (so sending it again is safe)."""
    rng = np.random.default_rng([request.id, *request.prompt])
    return tuple(rng.integers(0, VOCAB, request.max_tokens).tolist())


class Server:
    """One rank's server: one request at a time; counts the requests it holds."""

    def __init__(self, token_s: float) -> None:
        self.rank = asyncexec.get_context().world_rank
        self.token_s = token_s
        self.lock = asyncio.Lock()
        self.held = self.most_held = 0

    async def generate(self, request: Request) -> Answer:
        self.held += 1
        self.most_held = max(self.most_held, self.held)
        held = self.held
        try:
            async with self.lock:  # the others wait their turn here
                await asyncio.sleep(self.token_s * request.max_tokens)
                tokens = complete(request)
        finally:
            self.held -= 1
        return Answer(request.id, self.rank, os.getpid(), tokens, held)

    def most_in_flight(self) -> int:
        return self.most_held


class SentAgain(logging.Handler):
    """Counts asyncexec's ``call_sent_again`` events (a call whose server died, sent to another
    server): records of the standard library's ``asyncexec`` logger, with logging left alone or
    set up by ``asyncexec.configure_logging()``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("call_sent_again")


@dataclass
class Summary:
    """What :func:`main` did."""

    requests: int
    max_in_flight: int
    answers: list[Answer] = field(default_factory=list)  # in the order they came back
    killed_pid: int | None = None
    kill_skipped: bool = False  # local mode: no server process to kill
    sent_again: int = 0
    most_in_flight: int = 0  # the most requests a server held at once, by the servers' counts
    seconds: float = 0.0

    @property
    def answered_once(self) -> bool:
        counts = Counter(a.id for a in self.answers)
        return sorted(counts) == list(range(self.requests)) and set(counts.values()) == {1}

    def report(self) -> str:
        by_rank = Counter(a.rank for a in self.answers)
        lines = [
            f"{len(self.answers)} answers to {self.requests} requests in {self.seconds:.2f} s, "
            f"{'each request answered exactly once' if self.answered_once else 'NOT each once'}",
            f"answers per server: {dict(sorted(by_rank.items()))}; at most "
            f"{self.most_in_flight} in flight on a server (cap {self.max_in_flight})",
            f"first answers, in the order they came back: {[a.id for a in self.answers[:12]]}",
        ]
        if self.killed_pid is not None:
            before = sum(a.pid == self.killed_pid for a in self.answers)
            after = sum(a.rank == 1 and a.pid != self.killed_pid for a in self.answers)
            lines.append(
                f"server 1 (pid {self.killed_pid}) killed after answering {before}: "
                f"{self.sent_again} of its requests sent again to the others; "
                f"its fresh process answered {after}"
            )
        elif self.kill_skipped:
            lines.append("local mode: the servers are threads of this process, no kill")
        return "\n".join(lines)


async def serve(
    servers: asyncexec.Executor, requests: list[Request], summary: Summary, kill_after: int
) -> None:
    """Send every request at once; take the answers as they come back; kill server 1 after
    ``kill_after`` of them (0: never)."""
    to = asyncexec.least_loaded(max_in_flight=summary.max_in_flight, retry=True)

    async def ask(request: Request, send: MemoryObjectSendStream[Answer]) -> None:
        async with send:
            await send.send(await servers.call(Server.generate, request, on=to))

    send, receive = anyio.create_memory_object_stream[Answer](len(requests))
    async with anyio.create_task_group() as tg, receive:
        async with send:
            for request in requests:
                tg.start_soon(ask, request, send.clone())
        async for answer in receive:  # ends when every ask() has sent its answer
            summary.answers.append(answer)
            if len(summary.answers) == kill_after:
                pid = servers.workers[1].pid
                if pid == os.getpid():  # local mode: it would kill this process
                    summary.kill_skipped = True
                else:
                    os.kill(pid, signal.SIGKILL)
                    summary.killed_pid = pid


async def main(
    *,
    servers: int = 4,
    requests: int = 200,
    max_in_flight: int = 2,
    kill_after: int = 50,
    token_s: float = 0.001,
    seed: int = 0,
) -> Summary:
    """Serve ``requests`` requests with ``servers`` servers; return what happened."""
    todo = make_requests(requests, seed)
    summary = Summary(requests, max_in_flight)
    counter, log = SentAgain(), logging.getLogger("asyncexec")
    log.addHandler(counter)
    t0 = time.perf_counter()
    try:
        async with asyncexec.Executor(
            servers, resources_per_worker={"CPU": 0.25}, roles=asyncexec.Role(Server, token_s)
        ) as ex:
            await serve(ex, todo, summary, kill_after)
            summary.seconds = time.perf_counter() - t0
            # The live servers' own counts (the killed one's died with it; its answers tell).
            live = await ex.call(Server.most_in_flight)
            summary.most_in_flight = max([*live, *(a.held for a in summary.answers)])
    finally:
        log.removeHandler(counter)
    summary.sent_again = counter.count
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rollout servers behind a driver.")
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-in-flight", type=int, default=2, help="per server (2)")
    parser.add_argument("--kill-after", type=int, default=50, help="answers; 0: no kill (50)")
    parser.add_argument("--token-ms", type=float, default=1.0, help="simulated time per token")
    args = parser.parse_args()
    # Refused here, before Ray starts, rather than with a traceback from the run.
    lows = {"servers": 1, "requests": 1, "max_in_flight": 1, "kill_after": 0, "token_ms": 0}
    for name, value in ((name, getattr(args, name)) for name in lows):
        if not value >= lows[name]:
            parser.error(f"--{name.replace('_', '-')} must be at least {lows[name]}, got {value}")
    if args.kill_after and args.servers < 2:
        parser.error(
            "--kill-after kills server 1: it needs --servers 2 or more (or --kill-after 0)"
        )
    summary = asyncio.run(
        main(
            servers=args.servers,
            requests=args.requests,
            max_in_flight=args.max_in_flight,
            kill_after=args.kill_after,
            token_s=args.token_ms / 1000,
        )
    )
    print(summary.report())
