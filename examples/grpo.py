"""Fully async GRPO on a toy task with asyncexec's Pipeline: rollout servers (a
:class:`PolicyServer` per rank, a :class:`asyncexec.RolloutServer`) generate groups of
completions in chunks, with long-tailed lengths; a learner of 2 ranks (a :class:`Learner` per
rank, DDP over gloo) trains on each batch the pipeline hands it; the weights go back to the
servers over a WeightChannel while they generate. docs/pipeline.md walks through it;
:func:`train_local` runs the same algorithm in one process, without Ray.

    python examples/grpo.py                          # until the reward threshold (about 1 min)
    python examples/grpo.py --kill-server-at 8 --kill-learner-at 16     # with faults
    python examples/grpo.py --staleness 0            # the synchronous loop, for comparison
    python examples/grpo.py --mode aggregate --on-update abort

The task: a prompt is 4 random digits and asks for a number of tokens (lognormal: the median
asks for 8, one in a hundred for more than 100); the answer must repeat the prompt's first
digit at every position. A completion's reward is the share of its tokens that do (a random
policy scores 0.1). GRPO: G completions per prompt (one sample of the pipeline is a group),
advantage = (reward - the group's mean) / the group's std, a clipped ratio to the servers'
log-probabilities (a sample may be a version or more old), no critic.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

import asyncexec
from asyncexec.backends import TorchBackend

VOCAB, DIGITS = 10, 4
FEATURES = DIGITS * VOCAB + DIGITS  # the prompt's digits one-hot, and the position modulo 4


@dataclass(frozen=True)
class GRPOConfig:
    """The task's and GRPO's settings, tuned to learn in about 50 updates on a CPU."""

    group_size: int = 4  # completions per prompt (G)
    batch_size: int = 16  # prompts (groups) per update (B)
    hidden: int = 64
    lr: float = 1e-2
    clip: float = 0.2
    median_tokens: float = 8.0  # the lognormal length of a request: its median,
    sigma: float = 1.1  # its spread (p99 / p50 = exp(2.33 sigma) = 13),
    max_tokens: int = 256  # and its cap
    chunk_tokens: int = 4  # tokens per chunk: a pause point every 4 tokens
    token_s: float = 0.004  # the engine's simulated time per token (a decoding step)
    seed: int = 0


@dataclass(frozen=True)
class Task:
    """A prompt: its digits and how many tokens it asks for."""

    digits: tuple[int, ...]
    length: int


@dataclass(frozen=True)
class Group:
    """A prompt's G completions, as the server made them: tokens and their log-probabilities
    under the weights that made them ``[G, length]``, and each completion's reward ``[G]``."""

    tokens: np.ndarray
    logp: np.ndarray
    rewards: np.ndarray


# The algorithm (numpy on the servers, torch on the learner) -------------------------------------


def make_tasks(cfg: GRPOConfig, seed: int | None = None) -> Iterator[Task]:
    """An endless source of prompts, the same for the same seed (so S = 0 and S = 1 compare on
    one workload)."""
    rng = np.random.default_rng(cfg.seed if seed is None else seed)
    while True:
        length = cfg.median_tokens * np.exp(cfg.sigma * rng.standard_normal())
        yield Task(
            tuple(rng.integers(0, VOCAB, DIGITS).tolist()),
            int(np.clip(round(length), 1, cfg.max_tokens)),
        )


def features(digits: Sequence[int], positions: np.ndarray) -> np.ndarray:
    """The policy's input at each of ``positions``: ``[len(positions), FEATURES]``."""
    x = np.zeros((len(positions), FEATURES), np.float32)
    for j, d in enumerate(digits):
        x[:, j * VOCAB + d] = 1.0
    x[np.arange(len(positions)), DIGITS * VOCAB + positions % DIGITS] = 1.0
    return x


def log_probs(weights: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The policy in numpy (the servers import no torch): log-softmax of the MLP's logits."""
    h = np.tanh(x @ weights["0.weight"].T + weights["0.bias"])
    z = h @ weights["2.weight"].T + weights["2.bias"]
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))  # type: ignore[no-any-return]


def sample(
    weights: Mapping[str, np.ndarray], x: np.ndarray, group: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``group`` completions' tokens at the positions of ``x``, and their log-probabilities."""
    lp = log_probs(weights, x)  # [n, VOCAB]
    u = rng.random((group, len(x), 1))
    tokens = (np.exp(lp).cumsum(-1)[None] < u).sum(-1).clip(0, VOCAB - 1)
    return tokens, lp[np.arange(len(x))[None], tokens]


def reward(digits: Sequence[int], tokens: np.ndarray) -> np.ndarray:
    """Each completion's share of tokens that repeat the prompt's first digit."""
    return (tokens == digits[0]).mean(-1)  # type: ignore[no-any-return]


def make_policy(cfg: GRPOConfig) -> Any:
    """The torch policy, the same weights for the same seed."""
    import torch

    torch.manual_seed(cfg.seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, cfg.hidden), torch.nn.Tanh(), torch.nn.Linear(cfg.hidden, VOCAB)
    )


def numpy_weights(policy: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in policy.state_dict().items()}


def grpo_loss(forward: Any, prompts: Sequence[Task], groups: Sequence[Group], clip: float) -> Any:
    """GRPO's loss over groups: per completion, the mean over its tokens of the clipped
    objective with the group-normalised advantage; the mean over completions. A group whose
    rewards are all equal teaches nothing (its advantages are 0)."""
    import torch

    total = torch.zeros(())
    for task, g in zip(prompts, groups, strict=True):
        # torch.tensor copies: arrays out of Ray's object store are read-only.
        advantage = torch.tensor((g.rewards - g.rewards.mean()) / (g.rewards.std() + 1e-6))
        n = g.tokens.shape[1]
        lp = torch.log_softmax(forward(torch.from_numpy(features(task.digits, np.arange(n)))), -1)
        new = lp[torch.arange(n)[None], torch.tensor(g.tokens)]  # [G, n]
        ratio = (new - torch.tensor(g.logp)).exp()
        a = advantage.float()[:, None]
        objective = torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean(-1)
        total = total - objective.mean()
    return total / max(1, len(groups))


def generate_group(
    weights: Mapping[str, np.ndarray], task: Task, cfg: GRPOConfig, rng: np.random.Generator
) -> Group:
    tokens, logp = sample(
        weights, features(task.digits, np.arange(task.length)), cfg.group_size, rng
    )
    return Group(tokens, logp, reward(task.digits, tokens))


def train_local(cfg: GRPOConfig = GRPOConfig(), *, updates: int = 60, lag: int = 0) -> list[float]:
    """The same algorithm in one process, without Ray, acting with weights ``lag`` updates
    old; the mean reward of each batch."""
    import torch

    torch.set_num_threads(1)
    policy = make_policy(cfg)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    tasks, rng = make_tasks(cfg), np.random.default_rng(cfg.seed + 1)
    history, rewards = [numpy_weights(policy)], list[float]()
    for _ in range(updates):
        prompts = [next(tasks) for _ in range(cfg.batch_size)]
        groups = [generate_group(history[0], t, cfg, rng) for t in prompts]
        rewards.append(float(np.mean([g.rewards.mean() for g in groups])))
        loss = grpo_loss(policy, prompts, groups, cfg.clip)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history = [*history, numpy_weights(policy)][-(lag + 1) :]
    return rewards


# The workers' classes ---------------------------------------------------------------------------


class PolicyServer(asyncexec.RolloutServer):
    """A rollout server: the policy in numpy, G completions of a prompt decoded together, a
    pause point every ``chunk_tokens`` tokens. Decoding costs ``token_s`` per token (the
    engine's time; requests on one server decode concurrently, as a batching engine's do)."""

    def __init__(self, cfg: GRPOConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weights: Mapping[str, np.ndarray] | None = None
        self.rng = np.random.default_rng()

    def load_weights(self, state: Mapping[str, np.ndarray], version: int) -> None:
        self.weights = state  # no chunk runs meanwhile (the base's gate)

    async def chunks(self, task: Task) -> Any:
        step = self.cfg.chunk_tokens
        for start in range(0, task.length, step):
            positions = np.arange(start, min(start + step, task.length))
            await asyncio.sleep(self.cfg.token_s * len(positions))  # the decoding step
            if self.weights is None:
                raise RuntimeError("no weights yet: push a version before generating")
            x = features(task.digits, positions)
            yield sample(self.weights, x, self.cfg.group_size, self.rng)

    def finish(self, task: Task, chunks: list[tuple[np.ndarray, np.ndarray]]) -> Group:
        tokens = np.concatenate([t for t, _ in chunks], axis=1)
        logp = np.concatenate([lp for _, lp in chunks], axis=1)
        return Group(tokens, logp, reward(task.digits, tokens))


class Learner:
    """A learner rank: the policy in DDP and its optimizer, checkpointed after every update
    with the pipeline's consumed ids, and resumed from that checkpoint."""

    def __init__(self, cfg: GRPOConfig, checkpoint: str) -> None:
        import torch

        torch.set_num_threads(1)
        self.cfg, self.path = cfg, checkpoint
        self.policy = make_policy(cfg)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=cfg.lr)
        self.updates = self.resumed_from = 0
        if os.path.exists(checkpoint):
            state = torch.load(checkpoint, weights_only=False)
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.updates = self.resumed_from = int(state["updates"])
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.policy)  # gloo is up
        self.rank = asyncexec.get_context().world_rank
        self.lock = threading.Lock()  # an update against the channel's reads of the weights
        asyncexec.serve_weights(self.weights)

    def weights(self) -> dict[str, np.ndarray]:
        """The weights as numpy arrays (the servers import no torch)."""
        with self.lock:
            return numpy_weights(self.policy)

    def update(self, samples: list[asyncexec.Sample], index: int, pipeline: Any) -> dict[str, Any]:
        """Update ``index`` (1, 2, ...) on this rank's part of the batch; rank 0 then saves the
        policy, the optimizer and ``pipeline`` (the pipeline's state after this batch). An
        update the checkpoint already holds (its call was cut off by a kill after the save) is
        not made again. Returns the ids trained on."""
        import torch

        if index <= self.updates:
            return {"trained": [], "already": True, "resumed_from": self.resumed_from}
        with self.lock:
            loss = grpo_loss(
                self.ddp, [s.prompt for s in samples], [s.output for s in samples], self.cfg.clip
            )
            self.optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients over the ranks
            self.optimizer.step()
            self.updates = index
        if self.rank == 0:
            state = {
                "policy": self.policy.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "updates": index,
                "pipeline": pipeline,
            }
            torch.save(state, self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)  # a kill mid-save keeps the last one whole
        return {
            "trained": [s.id for s in samples],
            "already": False,
            "resumed_from": self.resumed_from,
        }


# The driver -------------------------------------------------------------------------------------


@dataclass
class Summary:
    """What a run of :func:`main` did (filled in as it goes)."""

    threshold: float
    window: int
    started: float = field(default_factory=time.perf_counter)
    updates: int = 0
    rewards: list[float] = field(default_factory=list)  # each batch's mean reward
    reached_after_s: float | None = None
    consumed: list[Any] = field(default_factory=list, repr=False)  # ids, as batches came
    trained: list[Any] = field(default_factory=list, repr=False)  # ids, as learners said
    staleness_max: int = 0  # by the pipeline's count and by each sample's oldest chunk
    lengths: list[int] = field(default_factory=list, repr=False)  # tokens asked, per sample
    started_from: int = 0  # the checkpoint's update when the driver resumed from one
    killed: dict[str, int] = field(default_factory=lambda: {"server": 0, "learner": 0})
    learner_restarts: int = 0
    learner_resumed_from: list[int] = field(default_factory=list)  # the checkpoints' updates
    statistics: Any = None  # the pipeline's, at the end
    router: Any = None  # the router's, at the end
    seconds: float = 0.0

    @property
    def average(self) -> float:
        """The mean reward of the last ``window`` batches."""
        return float(np.mean(self.rewards[-self.window :])) if self.rewards else 0.0

    @property
    def reached(self) -> bool:
        return self.reached_after_s is not None

    @property
    def exactly_once(self) -> bool:
        """No id consumed or trained twice, and every consumed id trained."""
        twice = any(n > 1 for n in Counter(self.consumed).values())
        return not twice and sorted(map(str, self.trained)) == sorted(map(str, self.consumed))

    def report(self) -> str:
        reached = (
            f"reached {self.threshold} after {self.reached_after_s:.1f} s"
            if self.reached
            else f"did NOT reach {self.threshold}"
        )
        first = float(np.mean(self.rewards[: self.window])) if self.rewards else 0.0
        lengths = np.asarray(self.lengths or [1])
        p50, p99 = np.percentile(lengths, 50), np.percentile(lengths, 99)
        return "\n".join(
            [
                f"{reached}: mean reward {first:.2f} (first {self.window} batches) -> "
                f"{self.average:.2f} (last {self.window}), {self.updates} updates in "
                f"{self.seconds:.1f} s",
                f"lengths: p50 {p50:.0f}, p99 {p99:.0f} tokens (p99 / p50 {p99 / p50:.1f}); "
                f"staleness max {self.staleness_max}",
                f"consumed {len(self.consumed)} samples, trained {len(self.trained)}: "
                f"{'each exactly once' if self.exactly_once else 'NOT exactly once'}",
                f"started from update {self.started_from}; killed: {self.killed}; learner "
                f"restarts: {self.learner_restarts}, resumed from updates "
                f"{self.learner_resumed_from}",
                f"pipeline: {self.statistics}",
                f"router: {self.router}",
            ]
        )


def load_checkpoint(path: str) -> dict[str, Any] | None:
    """The learner's checkpoint (the driver reads the pipeline's state from it), or None."""
    if not os.path.exists(path):
        return None
    import torch

    return dict(torch.load(path, weights_only=False))


async def learn(
    learner: asyncexec.Executor,
    samples: list[asyncexec.Sample],
    index: int,
    state: Any,
    s: Summary,
    max_restarts: int,
) -> None:
    """The learner's update ``index``, each rank sent its part. After a learner rank died the
    call raises, and calling again starts a fresh group that resumes from its checkpoint."""
    while True:
        try:
            out = await learner.call(Learner.update, asyncexec.scatter(samples), index, state)
            break
        except asyncexec.WorkerCrashedError:
            if s.learner_restarts == max_restarts:
                raise
            s.learner_restarts += 1
            s.learner_resumed_from.append(-1)  # filled in below
    if s.learner_resumed_from and s.learner_resumed_from[-1] == -1:
        s.learner_resumed_from[-1] = int(out[0]["resumed_from"])
    if any(o["already"] for o in out):  # the checkpoint holds this update: trained once
        s.trained.extend(x.id for x in samples)
    else:
        s.trained.extend(i for o in out for i in o["trained"])


@contextlib.asynccontextmanager
async def frozen_heap() -> AsyncIterator[None]:
    """What start-up made is never walked by a garbage collection again (as docs/operating.md
    advises, "Many ranks"); unfrozen when the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def main(
    *,
    servers: int = 2,
    learners: int = 2,
    staleness: int = 1,
    mode: Literal["strict", "aggregate"] = "strict",
    on_update: Literal["keep", "wait", "abort"] = "keep",
    on_expire: Literal["requeue", "wait"] = "requeue",
    max_requeues: int = 4,
    max_updates: int = 200,
    threshold: float = 0.9,
    window: int = 3,
    max_in_flight: int = 8,
    kill_server_at: int | None = None,
    kill_learner_at: int | None = None,
    max_restarts: int = 3,
    checkpoint_dir: str | None = None,
    grpo: GRPOConfig | None = None,
    on_batch: Any = None,
    timeline: str | None = None,
) -> Summary:
    """Train with a rollout group, a router and a pipeline over it, and a learner group, until
    the mean reward of the last ``window`` batches reaches ``threshold`` or ``max_updates``;
    what happened. A checkpoint in ``checkpoint_dir`` resumes the learner and the pipeline
    (no sample trained on twice); ``on_batch(update, reward)`` is called after each update;
    ``timeline``: write one timeline of the learner, the servers and the pipeline there (a
    ``.json`` for Perfetto, a ``.png``)."""
    cfg = grpo or GRPOConfig()
    s = Summary(threshold=threshold, window=window)
    folder = checkpoint_dir or tempfile.mkdtemp(prefix="grpo_")
    os.makedirs(folder, exist_ok=True)  # the learner saves into it from the first update
    path = os.path.join(folder, "learner.pt")
    resumed = load_checkpoint(path)
    consumed = resumed["pipeline"] if resumed else None
    s.started_from = int(resumed["updates"]) if resumed else 0
    shared = asyncexec.Timeline() if timeline else False  # both groups on one clock
    async with (
        asyncexec.Executor(
            learners,
            backend=TorchBackend(backend="gloo"),
            roles=asyncexec.Role(Learner, cfg, path),
            name="learner",
            resources_per_worker={"CPU": 0.5},
            timeline=shared,
        ) as learner,
        asyncexec.Executor(
            servers,
            roles=asyncexec.Role(PolicyServer, cfg),
            name="servers",
            restart=asyncexec.RestartPolicy(max_restarts=max_restarts),
            resources_per_worker={"CPU": 0.5},
            timeline=shared,
        ) as rollout,
        asyncexec.WeightChannel(learner, rollout) as channel,
    ):
        await channel.push()  # the learner's first weights (or its checkpoint's)
        router = asyncexec.Router(rollout, max_in_flight=max_in_flight, channel=channel)
        async with (
            frozen_heap(),
            router,
            asyncexec.Pipeline(
                router,
                make_tasks(cfg),
                batch_size=cfg.batch_size,
                staleness=staleness,
                mode=mode,
                on_update=on_update,
                on_expire=on_expire,
                max_requeues=max_requeues,
                channel=channel,
                consumed=consumed,
            ) as pipe,
        ):
            async for batch in pipe:
                index = s.started_from + s.updates + 1
                s.consumed.extend(batch.ids)
                s.lengths.extend(x.prompt.length for x in batch.samples)
                # Staleness by the samples' own versions (the learner's: the batch's scale).
                lags = [
                    batch.version - (0 if x.version is None else x.version) for x in batch.samples
                ]
                s.staleness_max = max(s.staleness_max, batch.staleness_max, *lags)
                s.rewards.append(float(np.mean([x.output.rewards.mean() for x in batch.samples])))
                await learn(learner, batch.samples, index, pipe.state_dict(), s, max_restarts)
                s.updates += 1
                if on_batch is not None:
                    on_batch(s.updates, s.rewards[-1])
                if len(s.rewards) >= window and s.average >= threshold:
                    s.reached_after_s = time.perf_counter() - s.started
                    break
                if s.updates >= max_updates:
                    break
                await pipe.update_weights()
                if kill_server_at == s.updates:  # server rank 1 (if there): the router replaces
                    os.kill(rollout.workers[-1].pid, signal.SIGKILL)
                    s.killed["server"] += 1
                if kill_learner_at == s.updates:  # learner rank 0: the next update resumes
                    os.kill(learner.workers[0].pid, signal.SIGKILL)
                    s.killed["learner"] += 1
            s.statistics, s.router = pipe.statistics(), router.statistics()
    s.seconds = time.perf_counter() - s.started
    if shared:
        shared.export(timeline, f"GRPO: {s.updates} updates, staleness {staleness}, {on_update}")
        print(f"wrote the timeline to {timeline}")
    return s


def cli(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, train, print the summary; 0 when the threshold was reached with every
    sample consumed exactly once and none beyond the staleness bound (strict mode)."""
    parser = argparse.ArgumentParser(description="Fully async GRPO with asyncexec's Pipeline.")
    add = parser.add_argument
    add("--servers", type=int, default=2, help="rollout servers (2)")
    add("--learners", type=int, default=2, help="learner ranks, DDP over gloo (2)")
    add("--staleness", type=int, default=1, help="S: 0 is the synchronous loop (1)")
    add("--mode", choices=["strict", "aggregate"], default="strict")
    add("--on-update", choices=["keep", "wait", "abort"], default="keep")
    add(
        "--on-expire",
        choices=["requeue", "wait"],
        default="requeue",
        help="strict mode: a straggler a batch would wait for is cancelled and its prompt "
        "requeued at the next version (requeue), or waited for (wait)",
    )
    add("--max-requeues", type=int, default=4, help="requeues of one prompt at most (4)")
    add("--max-updates", type=int, default=200, help="at most so many (200)")
    add("--threshold", type=float, default=0.9, help="mean reward to reach (0.9)")
    add("--window", type=int, default=3, help="over the last so many batches (3)")
    add("--max-in-flight", type=int, default=8, help="requests per server (8)")
    add("--kill-server-at", type=int, metavar="UPDATE", help="SIGKILL a server after it")
    add("--kill-learner-at", type=int, metavar="UPDATE", help="SIGKILL learner rank 0 after it")
    add("--checkpoint-dir", default=None, help="resume from (and save to) here (made if missing)")
    add("--batch-size", type=int, default=GRPOConfig.batch_size, help="prompts per update")
    add("--group-size", type=int, default=GRPOConfig.group_size, help="completions per prompt")
    add("--token-ms", type=float, default=GRPOConfig.token_s * 1e3, help="engine time per token")
    add("--seed", type=int, default=GRPOConfig.seed)
    add("--quiet", action="store_true", help="print the summary only")
    add("--timeline", metavar="PATH", help="write the run's timeline (.json, or .png) there")
    args = vars(parser.parse_args(argv))
    # Refused here, before Ray starts, rather than with a traceback later (the timeline's after
    # the whole run).
    lows = {"servers": 1, "learners": 1, "staleness": 0, "max_requeues": 0, "max_updates": 1}
    lows |= {"window": 1, "max_in_flight": 1, "batch_size": 1, "group_size": 2, "token_ms": 0}
    for name, low in lows.items():
        if not args[name] >= low:
            parser.error(f"--{name.replace('_', '-')} must be at least {low}, got {args[name]}")
    if args["timeline"] and not os.path.isdir(os.path.dirname(os.path.abspath(args["timeline"]))):
        parser.error(f"--timeline {args['timeline']}: its folder does not exist")
    if (args["timeline"] or "").endswith(".png") and not importlib.util.find_spec("matplotlib"):
        parser.error("--timeline *.png needs matplotlib: pip install 'asyncexec[timeline]'")
    quiet = args.pop("quiet")
    grpo = GRPOConfig(
        batch_size=args.pop("batch_size"),
        group_size=args.pop("group_size"),
        token_s=args.pop("token_ms") / 1e3,
        seed=args.pop("seed"),
    )

    def progress(update: int, mean_reward: float) -> None:
        if update % 5 == 0:
            print(f"update {update}: mean reward {mean_reward:.2f}", flush=True)

    asyncexec.configure_logging("console", "warning")
    import ray

    if not ray.is_initialized():  # before the event loop: ray.init blocks for seconds
        ray.init(
            num_cpus=max(os.cpu_count() or 1, 2),
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    summary = asyncio.run(main(**args, grpo=grpo, on_batch=None if quiet else progress))
    print(summary.report())
    bound_held = args["mode"] == "aggregate" or summary.staleness_max <= args["staleness"]
    return 0 if summary.reached and summary.exactly_once and bound_held else 1


if __name__ == "__main__":
    sys.exit(cli())
