"""A learner for the model kit: the same causal LM the engine serves, held in torch (DDP across
the learner's ranks when ``torch.distributed`` is up), trained with GRPO on the engine's samples,
its weights served over the weight channel under the names the engine's loader expects (the
model's checkpoint names: ``model.layers.0.self_attn.q_proj.weight``, ...).

It also answers the off-policy question RL users ask: recompute the log-probabilities of sampled
tokens under the weights of the version that made each token (the learner remembers the
versions it served, :meth:`CausalLMLearner.remember`) and compare them with the engine's.

Imports torch and transformers (a worker class: it runs where they are installed).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import get_context, serve_weights

__all__ = ["CausalLMLearner", "Group", "grpo_loss", "token_logprobs"]


@dataclass(frozen=True)
class Group:
    """A prompt's completions as GRPO trains on them: the prompt's token ids, each completion's
    token ids, the log-probabilities the engine sampled them with, and each completion's reward."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    rewards: tuple[float, ...]

    def __post_init__(self) -> None:
        """Refuse a group whose parts do not match: a completion of n tokens with another
        number of log-probabilities made a wrong loss (one was broadcast over every token)
        or a torch error that named no completion.

        Raises:
            ValueError: naming what does not match.
        """
        counts = (len(self.token_ids), len(self.logprobs), len(self.rewards))
        if len(set(counts)) != 1:
            raise ValueError(
                f"a Group needs as many log-probability rows and rewards as completions, got "
                f"{counts[0]} completions, {counts[1]} rows and {counts[2]} rewards"
            )
        for i, (ids, old) in enumerate(zip(self.token_ids, self.logprobs, strict=True)):
            if len(ids) != len(old):
                raise ValueError(
                    f"completion {i} of a Group has {len(ids)} tokens and {len(old)} "
                    "log-probabilities: one per token"
                )
        if not self.prompt_token_ids and any(self.token_ids):
            raise ValueError("a Group's prompt has no tokens: its first token has no logits")


def token_logprobs(
    model: Any,
    prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    state: Any = None,
    allowed: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """The log-probability of each completion token given the prompt and the tokens before it,
    one tensor per completion; under ``state`` (a state dict) instead of the model's own weights
    when given (swapped into ``model`` for the forward: hold whatever lock guards its weights);
    over the ``allowed`` token ids only when given (as the engine samples with
    ``allowed_token_ids`` and reports ``logprobs_mode="processed_logprobs"``)."""
    return _logprobs(model, [(prompt, c) for c in completions], state, allowed)


def _logprobs(
    model: Any,
    rows: Sequence[tuple[Sequence[int], Sequence[int]]],
    state: Any = None,
    allowed: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """:func:`token_logprobs` of (prompt, completion) rows, their prompts of any length: one
    forward of the model over the rows, right-padded to one length (a forward of a model under
    DDP is a collective: every rank makes one per update)."""
    if not rows:
        return []
    lengths = [len(p) + len(c) for p, c in rows]
    width = max(lengths)
    padded = [[*p, *c] + [0] * (width - n) for (p, c), n in zip(rows, lengths, strict=True)]
    ids = torch.tensor(padded)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    inputs = {"input_ids": ids, "attention_mask": mask}
    if state is None:
        logits = model(**inputs).logits
    else:
        logits = torch.func.functional_call(model, dict(state), args=(), kwargs=inputs).logits
    # The logits at position i predict token i + 1: those of each row's completion tokens, from
    # its prompt's last position on (past a row's end, positions that no completion reads).
    longest = max(len(c) for _, c in rows)
    starts = torch.tensor([len(p) - 1 for p, _ in rows])
    at = (starts[:, None] + torch.arange(longest)).clamp(max=width - 2)
    logits = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])).float()
    if allowed is not None:
        allowed_only = torch.full((logits.shape[-1],), float("-inf"))
        allowed_only[list(allowed)] = 0.0
        logits = logits + allowed_only
    lp = torch.log_softmax(logits, dim=-1)
    picked = lp.gather(-1, ids.gather(1, at + 1)[..., None])[..., 0]
    return [picked[i, : len(c)] for i, (_, c) in enumerate(rows)]


def grpo_loss(
    model: Any, groups: Sequence[Group], clip: float = 0.2, allowed: Sequence[int] | None = None
) -> torch.Tensor:
    """GRPO's loss: per completion, the mean over its tokens of the clipped objective with the
    group-normalised advantage (reward minus the group's mean, over its std); the mean over a
    group's completions, then over the groups. A group whose rewards are equal teaches nothing,
    nor does a completion with no tokens (its objective is 0: an engine that ended it at once).
    One forward of ``model`` over every completion of every group."""
    rows = [(g.prompt_token_ids, c) for g in groups for c in g.token_ids]
    new = iter(_logprobs(model, rows, allowed=allowed))
    total = torch.zeros(())
    for g in groups:
        rewards = torch.tensor(g.rewards, dtype=torch.float32)
        advantage = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        objectives = []
        lps = [next(new) for _ in g.token_ids]
        for lp, old, a in zip(lps, g.logprobs, advantage, strict=True):
            ratio = (lp - torch.tensor(old, dtype=torch.float32)).exp()
            clipped = ratio.clamp(1 - clip, 1 + clip)
            objective = torch.min(ratio * a, clipped * a)
            # The mean of no tokens is NaN; their sum is a 0 that the backward still reaches.
            objectives.append(objective.mean() if objective.numel() else objective.sum())
        total = total - torch.stack(objectives).mean()
    return total / max(1, len(groups))


class CausalLMLearner:
    """A learner rank: a causal LM from ``model`` (a folder ``from_pretrained`` reads), Adam,
    GRPO. Made by an executor with ``TorchBackend`` for DDP over its ranks (gloo on CPUs).

    Args:
        model: the model's folder (the same the engines serve).
        lr: Adam's learning rate.
        clip: GRPO's ratio clip.
        keep_versions: how many served versions to remember for :meth:`recompute` (0: none).
        allowed_token_ids: the token ids the engines may sample (their ``allowed_token_ids``):
            log-probabilities are taken over these only.
        checkpoint: a file where rank 0 saves the weights, the optimizer and the count of
            updates after each update, and which rank 0 alone reads when the learner is made:
            when it exists there, every rank resumes from what rank 0 read (a learner group
            made again after a rank died goes on where it was). The path need only exist
            where rank 0 runs.
        channel: the weight channel's name.

    Raises:
        ValueError: ``keep_versions`` is not a count (0 or more).
    """

    def __init__(
        self,
        model: str,
        *,
        lr: float = 1e-3,
        clip: float = 0.2,
        keep_versions: int = 4,
        allowed_token_ids: Sequence[int] | None = None,
        checkpoint: str | None = None,
        channel: str = "weights",
    ) -> None:
        if (
            isinstance(keep_versions, bool)
            or not isinstance(keep_versions, int)
            or keep_versions < 0
        ):
            raise ValueError(
                f"keep_versions must be a count of versions (0 or more), got {keep_versions!r}"
            )
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.clip = clip
        self.allowed = None if allowed_token_ids is None else list(allowed_token_ids)
        self.distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.distributed:  # the process group's: rank 0 reads (and saves) the checkpoint
            self.rank = torch.distributed.get_rank()
        else:
            try:
                self.rank = get_context().world_rank
            except Exception:  # made outside a worker (a unit test): rank 0
                self.rank = 0
        self.checkpoint = checkpoint
        saved = self._resumed(checkpoint)
        if saved is not None:
            self.model.load_state_dict(saved["model"])
        # No buffer broadcast before each forward (the model's buffers, rotary frequencies, are
        # the same on every rank and never change): the gradients' all-reduce is the only
        # collective of an update's forward and backward.
        self.trained = (
            torch.nn.parallel.DistributedDataParallel(self.model, broadcast_buffers=False)
            if self.distributed
            else self.model
        )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.updates = 0
        if saved is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
            self.updates = int(saved["updates"])
        self.keep_versions = keep_versions
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()  # an update against the channel's reads
        serve_weights(self.weights, channel=channel)

    def _resumed(self, checkpoint: str | None) -> dict[str, Any] | None:
        """What ``checkpoint`` holds, as rank 0 reads it (None when there is no file there),
        on every rank: rank 0 alone reads the file, and under DDP sends what it read to the
        others, so that a rank where the path names nothing (another node's disk) resumes as
        rank 0 does, not from the initial weights and an empty Adam."""
        if checkpoint is None:
            return None
        saved = None
        if self.rank == 0 and os.path.exists(checkpoint):
            saved = torch.load(checkpoint, weights_only=True)
        if self.distributed:
            sent = [saved]
            torch.distributed.broadcast_object_list(sent, src=0)
            saved = sent[0]
        return saved

    def weights(self) -> dict[str, torch.Tensor]:
        """A snapshot of the weights under the checkpoint's names (the channel reads it)."""
        with self.lock:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def update(self, groups: Sequence[Group]) -> dict[str, Any]:
        """One GRPO step on this rank's groups: under DDP, on the mean over every rank's groups
        (a rank with none still takes part, with one forward whose loss is 0). No step when no
        rank has a group: Adam's momentum would move the weights with no data. Returns the
        loss and the number of updates made."""
        with self.lock:
            total = self._everywhere(len(groups))
            if total == 0:
                return {"loss": 0.0, "updates": self.updates}
            if groups:
                loss = mean = grpo_loss(self.trained, groups, self.clip, self.allowed)
                if self.distributed:  # DDP averages the ranks' gradients: weigh this rank's
                    # mean by its share of the groups, for the mean over every rank's groups
                    world = torch.distributed.get_world_size()
                    loss = mean * (len(groups) * world / total)
            else:  # DDP's gradient all-reduce runs in the backward of a forward: one on a token
                dummy = torch.zeros((1, 1), dtype=torch.long)
                loss = mean = self.trained(input_ids=dummy).logits.sum() * 0.0
            self.optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
            self.updates += 1
        if self.checkpoint is not None and self.rank == 0:
            saved = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "updates": self.updates,
            }
            torch.save(saved, self.checkpoint + ".tmp")
            os.replace(self.checkpoint + ".tmp", self.checkpoint)  # whole, or the last one
        return {"loss": float(mean.detach()), "updates": self.updates}  # this rank's mean

    def _everywhere(self, count: int) -> int:
        """The sum of ``count`` over the learner's ranks (``count`` itself without DDP)."""
        if not self.distributed:
            return count
        total = torch.tensor([count])
        torch.distributed.all_reduce(total)
        return int(total)

    def remember(self, version: int) -> None:
        """Remember the weights held now as ``version`` (call it right after the push that
        served them), the latest ``keep_versions`` of them."""
        self.versions[version] = self.weights()
        # The oldest past the count (``[:-0]`` would be none of them: keep_versions=0 kept all).
        for old in sorted(self.versions)[: max(0, len(self.versions) - self.keep_versions)]:
            del self.versions[old]

    def recompute(
        self,
        prompt: Sequence[int],
        completions: Sequence[Sequence[int]],
        versions: Sequence[Sequence[int | None]],
    ) -> list[list[float | None]]:
        """The log-probability of each token under the weights of the version that made it
        (``versions``, per token; None where that version is not remembered).

        Each version's weights are swapped into the model for its forward: under the lock, so
        that the channel's :meth:`weights` never reads them as the weights held now."""
        out: list[list[float | None]] = [[None] * len(c) for c in completions]
        with self.lock, torch.no_grad():
            for version in {v for vs in versions for v in vs if v is not None}:
                state = self.versions.get(version)
                if state is None:
                    continue
                lps = token_logprobs(self.model, prompt, completions, state, self.allowed)
                for row, (lp, vs) in enumerate(zip(lps, versions, strict=True)):
                    for i, v in enumerate(vs):
                        if v == version:
                            out[row][i] = float(lp[i])
        return out

    def load(self, state: Mapping[str, Any]) -> None:
        """Replace the weights (a test's way to make the weights differ from a version)."""
        with self.lock:
            self.model.load_state_dict(dict(state))
