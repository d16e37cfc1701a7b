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


def token_logprobs(
    model: Any,
    prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    state: Any = None,
    allowed: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """The log-probability of each completion token given the prompt and the tokens before it,
    one tensor per completion; under ``state`` (a state dict) instead of the model's own weights
    when given; over the ``allowed`` token ids only when given (as the engine samples with
    ``allowed_token_ids`` and reports ``logprobs_mode="processed_logprobs"``)."""
    if not completions:
        return []
    longest = max(len(c) for c in completions)
    rows = [list(prompt) + list(c) + [0] * (longest - len(c)) for c in completions]
    ids = torch.tensor(rows)
    mask = torch.tensor(
        [[1] * (len(prompt) + len(c)) + [0] * (longest - len(c)) for c in completions]
    )
    inputs = {"input_ids": ids, "attention_mask": mask}
    if state is None:
        logits = model(**inputs).logits
    else:
        logits = torch.func.functional_call(model, dict(state), args=(), kwargs=inputs).logits
    # The logits at position i predict token i + 1: those of the completion's tokens.
    start = len(prompt) - 1
    logits = logits[:, start : start + longest].float()
    if allowed is not None:
        mask = torch.full((logits.shape[-1],), float("-inf"))
        mask[list(allowed)] = 0.0
        logits = logits + mask
    lp = torch.log_softmax(logits, dim=-1)
    picked = lp.gather(-1, ids[:, start + 1 : start + 1 + longest, None])[..., 0]
    return [picked[i, : len(c)] for i, c in enumerate(completions)]


def grpo_loss(
    model: Any, groups: Sequence[Group], clip: float = 0.2, allowed: Sequence[int] | None = None
) -> torch.Tensor:
    """GRPO's loss: per completion, the mean over its tokens of the clipped objective with the
    group-normalised advantage (reward minus the group's mean, over its std); the mean over a
    group's completions, then over the groups. A group whose rewards are equal teaches nothing."""
    total = torch.zeros(())
    for g in groups:
        rewards = torch.tensor(g.rewards, dtype=torch.float32)
        advantage = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        new = token_logprobs(model, g.prompt_token_ids, g.token_ids, allowed=allowed)
        objectives = []
        for lp, old, a in zip(new, g.logprobs, advantage, strict=True):
            ratio = (lp - torch.tensor(old, dtype=torch.float32)).exp()
            clipped = ratio.clamp(1 - clip, 1 + clip)
            objectives.append(torch.min(ratio * a, clipped * a).mean())
        total = total - torch.stack(objectives).mean()
    return total / max(1, len(groups))


class CausalLMLearner:
    """A learner rank: a causal LM from ``model`` (a folder ``from_pretrained`` reads), Adam,
    GRPO. Made by an executor with ``TorchBackend`` for DDP over its ranks (gloo on CPUs).

    Args:
        model: the model's folder (the same the engines serve).
        lr: Adam's learning rate.
        clip: GRPO's ratio clip.
        keep_versions: how many served versions to remember for :meth:`recompute`.
        allowed_token_ids: the token ids the engines may sample (their ``allowed_token_ids``):
            log-probabilities are taken over these only.
        checkpoint: a file where rank 0 saves the weights, the optimizer and the count of
            updates after each update, and every rank resumes from when it exists (a learner
            group made again after a rank died goes on where it was).
        channel: the weight channel's name.
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
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.clip = clip
        self.allowed = None if allowed_token_ids is None else list(allowed_token_ids)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.trained = (
            torch.nn.parallel.DistributedDataParallel(self.model) if distributed else self.model
        )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.updates = 0
        self.checkpoint = checkpoint
        if checkpoint is not None and os.path.exists(checkpoint):
            saved = torch.load(checkpoint, weights_only=True)
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.updates = int(saved["updates"])
        try:
            self.rank = get_context().world_rank
        except Exception:  # made outside a worker (a unit test): rank 0
            self.rank = 0
        self.keep_versions = keep_versions
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()  # an update against the channel's reads
        serve_weights(self.weights, channel=channel)

    def weights(self) -> dict[str, torch.Tensor]:
        """A snapshot of the weights under the checkpoint's names (the channel reads it)."""
        with self.lock:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def update(self, groups: Sequence[Group]) -> dict[str, Any]:
        """One GRPO step on this rank's groups (DDP averages the gradients over the ranks; a
        rank with none still takes part). Returns the loss and the number of updates made."""
        with self.lock:
            if groups:
                loss = grpo_loss(self.trained, groups, self.clip, self.allowed)
            else:  # a zero loss that still reaches every parameter: DDP's all-reduce needs all
                loss = torch.stack([p.sum() for p in self.trained.parameters()]).sum() * 0.0
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
        return {"loss": float(loss.detach()), "updates": self.updates}

    def remember(self, version: int) -> None:
        """Remember the weights held now as ``version`` (call it right after the push that
        served them), the latest ``keep_versions`` of them."""
        self.versions[version] = self.weights()
        for old in sorted(self.versions)[: -self.keep_versions]:
            del self.versions[old]

    def recompute(
        self,
        prompt: Sequence[int],
        completions: Sequence[Sequence[int]],
        versions: Sequence[Sequence[int | None]],
    ) -> list[list[float | None]]:
        """The log-probability of each token under the weights of the version that made it
        (``versions``, per token; None where that version is not remembered)."""
        out: list[list[float | None]] = [[None] * len(c) for c in completions]
        with torch.no_grad():
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
