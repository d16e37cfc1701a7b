"""A stand-in rollout server: a :class:`~asyncexec.RolloutServer` without a model, whose
generations a test scripts (how many chunks, how long each takes, where one fails), for testing
a ``Router`` or ``Pipeline`` loop on simulated workers, in local mode or on Ray.

Light imports only: on Ray it runs in the workers' processes (``tests/worker/test_boundary.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from .._worker import RolloutServer, get_context

__all__ = ["Script", "ScriptedServer"]


@dataclass(frozen=True)
class Script:
    """A prompt that tells a :class:`ScriptedServer` how to generate for it (any other prompt
    gets the server's defaults).

    Args:
        chunks: how many chunks the generation yields (``0, 1, ..., chunks - 1``).
        delay_s: how long each chunk takes (the engine's step), before it is yielded.
        fail_at: the chunk before which the generation raises ``RuntimeError``; None: never.
    """

    chunks: int = 1
    delay_s: float = 0.0
    fail_at: int | None = None


class ScriptedServer(RolloutServer):
    """A rollout server that generates by script: chunk ``i`` of a prompt is the number ``i``,
    made after ``delay_s`` (times the rank's factor in ``slow``), so a sample's output is
    ``[0, 1, ..., n - 1]`` and its ``versions`` say which weights each chunk ran under. It
    keeps the last state installed (:meth:`weights`) and counts what it served
    (:meth:`served`); read both from the driver with ``servers.call(ScriptedServer.weights)``.

    ::

        servers = asyncexec.Executor(4, roles=asyncexec.Role(ScriptedServer, chunks=3))

    Args:
        chunks: the chunks of a prompt that is not a :class:`Script`.
        delay_s: the time each of those chunks takes.
        slow: ranks made slower on purpose: rank -> how many times longer its chunks take
            (a :class:`Script`'s ``delay_s`` too).
        channel: the weight channel's name whose versions this server installs.
    """

    def __init__(
        self,
        chunks: int = 1,
        delay_s: float = 0.0,
        *,
        slow: Mapping[int, float] | None = None,
        channel: str = "weights",
    ) -> None:
        super().__init__(channel=channel)
        self.script = Script(chunks, delay_s)
        try:
            rank = get_context().world_rank
        except Exception:  # made outside a worker (a unit test): rank 0
            rank = 0
        self.factor = (slow or {}).get(rank, 1.0)
        self.state: Any = None
        self.count = 0

    async def chunks(self, prompt: Any) -> AsyncIterator[int]:
        script = prompt if isinstance(prompt, Script) else self.script
        self.count += 1
        for i in range(script.chunks):
            if i == script.fail_at:
                raise RuntimeError(f"scripted failure before chunk {i} of {prompt!r}")
            await asyncio.sleep(script.delay_s * self.factor)
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        self.state = state

    def weights(self) -> Any:
        """The last state installed (``Pipeline.update_weights(state)``, or a channel's),
        None before the first."""
        return self.state

    def served(self) -> int:
        """How many generations this server has begun."""
        return self.count
