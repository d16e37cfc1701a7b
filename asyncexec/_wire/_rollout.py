"""The rollout records of the RL pipeline: what the driver sends a rollout server
(:class:`RolloutRequest`) and what it answers (:class:`Sample`). Both sides import them: the
servers (``asyncexec._worker._rollout``) and the pipeline and its router (``_driver/pipeline``),
so the driver names them without importing the worker side.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["RolloutRequest", "Sample"]


@dataclass(frozen=True)
class RolloutRequest:
    """A prompt sent to a rollout server.

    Attributes:
        id: the prompt's id, unique in the pipeline's source (its position, unless given).
        prompt: what ``chunks()`` generates from.
        key: a session key: requests with the same key go to the same server while it lives
            (the router's sticky sessions); None for none.
    """

    id: Hashable
    prompt: Any
    key: Hashable | None = None


@dataclass(frozen=True)
class Sample:
    """What a rollout server returns for a :class:`RolloutRequest`.

    Attributes:
        id: the request's id.
        prompt: the request's prompt.
        output: ``finish(prompt, chunks)`` (by default the list of chunks); for an aborted
            sample, the chunks made before the abort.
        versions: the weights version each chunk ran under, in order (None: before the first
            version arrived): the weight channel's, or in a :class:`~asyncexec.Pipeline`'s
            batches the learner's (``PipelineBatch.version``'s scale).
        rank: the server's world rank.
        aborted: the generation was ended at a pause point by ``pause("abort")``.
    """

    id: Hashable
    prompt: Any
    output: Any
    versions: tuple[int | None, ...]
    rank: int
    aborted: bool = False

    @property
    def version(self) -> int | None:
        """The oldest chunk's version, the one staleness counts from: None when any chunk ran
        before the first version arrived (or there is no chunk), else the smallest."""
        if not self.versions or any(v is None for v in self.versions):
            return None
        return min(v for v in self.versions if v is not None)
