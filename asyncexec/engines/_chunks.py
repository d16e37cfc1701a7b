"""What a :class:`~asyncexec.engines.VLLMServer`'s samples hold: each chunk's deltas of the
request's completions (token ids, the sampler's log-probabilities, the end, vLLM's record of the
weights that sampled them) with the weights version that made them, and :func:`completions`,
which puts a sample's chunks together. No vLLM needed: the driver reads these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import Sample

__all__ = ["Completion", "Delta", "EngineChunk", "completions", "deltas_of", "joined"]


@dataclass(frozen=True)
class Delta:
    """What one completion of a request gained in one chunk."""

    index: int  # the completion's index among the request's ``n``
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # the sampler's, of each token (empty without ``logprobs``)
    finish_reason: str | None = None  # "length", "stop", "abort" in the completion's last
    #: vLLM's own record, in the completion's last delta: (version, start, end) spans of token
    #: indexes sampled under each weights version the engine was told (``"default"``: none).
    engine_versions: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class EngineChunk:
    """One chunk of a vLLM request: the deltas of its completions, the version of the weights
    that made them, and (in the first chunk) the prompt's token ids."""

    deltas: tuple[Delta, ...]
    version: int | None
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Completion:
    """One completion of a sample, put together from its chunks by :func:`completions`."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    #: The weights version that made each token (its chunk's; None before the first version).
    versions: tuple[int | None, ...]
    finish_reason: str | None
    engine_versions: tuple[tuple[str, int, int], ...] = ()


def completions(sample: Sample) -> list[Completion]:
    """The completions of a :class:`VLLMServer`'s sample (aborted or not), in index order, each
    token with its log-probability and the weights version that made it.

    A completion of an aborted sample that has no end of its own ends ``"abort"``: the pause
    ended its generation at a chunk the engine made before its final output (the engine's
    abort of it then never reaches the sample)."""
    prompt: tuple[int, ...] = ()
    parts: dict[int, dict[str, Any]] = {}
    for chunk, version in zip(sample.output, sample.versions, strict=True):
        if chunk.prompt_token_ids is not None:
            prompt = chunk.prompt_token_ids
        for delta in chunk.deltas:
            part = parts.setdefault(
                delta.index, {"ids": [], "lps": [], "vs": [], "end": None, "spans": ()}
            )
            part["ids"].extend(delta.token_ids)
            part["lps"].extend(delta.logprobs)
            part["vs"].extend([version] * len(delta.token_ids))
            part["end"] = delta.finish_reason or part["end"]
            part["spans"] = delta.engine_versions or part["spans"]
    unfinished = "abort" if sample.aborted else None
    return [
        Completion(
            prompt,
            tuple(p["ids"]),
            tuple(p["lps"]),
            tuple(p["vs"]),
            p["end"] or unfinished,
            p["spans"],
        )
        for _, p in sorted(parts.items())
    ]


def deltas_of(outputs: list[Any]) -> tuple[Delta, ...]:
    """The engine's delta outputs of one request, joined per completion."""
    parts = [tuple(_delta(c) for c in output.outputs) for output in outputs]
    return parts[0] if len(parts) == 1 else joined(parts)


def _delta(c: Any) -> Delta:
    """One completion's delta output (vLLM's ``CompletionOutput``)."""
    ids = tuple(c.token_ids)
    lps = (
        tuple(_logprob(lp, t) for lp, t in zip(c.logprobs, ids, strict=True)) if c.logprobs else ()
    )
    spans = tuple((s.version, s.start, s.end) for s in c.weight_versions or ())
    return Delta(c.index, ids, lps, c.finish_reason, spans)


def joined(parts: list[tuple[Delta, ...]]) -> tuple[Delta, ...]:
    """Consecutive deltas of one request's completions, joined per completion."""
    merged: dict[int, dict[str, Any]] = {}
    for deltas in parts:
        for d in deltas:
            part = merged.setdefault(d.index, {"ids": [], "lps": [], "end": None, "spans": ()})
            part["ids"].extend(d.token_ids)
            part["lps"].extend(d.logprobs)
            part["end"] = d.finish_reason or part["end"]
            part["spans"] = d.engine_versions or part["spans"]
    return tuple(
        Delta(i, tuple(p["ids"]), tuple(p["lps"]), p["end"], p["spans"])
        for i, p in sorted(merged.items())
    )


def _logprob(position: Any, token: int) -> float:
    """The sampled token's log-probability at one position of the engine's logprobs."""
    return float(position[token].logprob)
