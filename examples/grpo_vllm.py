"""Fully async GRPO on real engines: 2 vLLM rollout servers, a learner of 2 ranks (DDP over
gloo), the weight channel into the running engines, ``Pipeline(staleness=1, on_update="keep")``.
Runs on 2 CPU cores with vLLM's CPU wheel and a tiny Llama made on the spot (nothing is
downloaded): ``pip install -e ".[vllm,torch]"`` (see docs/engines.md).

    python examples/grpo_vllm.py                                      # about 1 min on 2 cores
    python examples/grpo_vllm.py --kill-engine-at 3 --kill-learner-at 6   # with faults
    python examples/grpo_vllm.py --max-updates 12 --timeline grpo.png --timeline grpo.json

The task: a prompt is ``<s>`` and 4 random digits; the answer should repeat the prompt's first
digit at every position. A completion's reward is the share of its tokens that do (a random
policy scores 0.1: the engines sample digits only). Each prompt asks for a number of tokens
drawn from a long-tailed distribution, so some generations run several times longer than most:
what the async pipeline is for.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import asyncexec
from asyncexec.backends import TorchBackend
from asyncexec.engines import CausalLMLearner, Group, VLLMServer, build_tiny_llama, completions

DIGIT_IDS = range(4, 14)  # the kit's tokenizer: "0".."9" are ids 4..13, "<s>" is 1


@dataclass(frozen=True)
class Settings:
    group_size: int = 8  # completions per prompt (G)
    batch_size: int = 16  # prompts per update (B)
    median_tokens: float = 6.0  # the long tail of the requested lengths:
    sigma: float = 0.8  # lognormal (p99 / p50 about 6),
    max_tokens: int = 48  # capped
    lr: float = 1e-3
    seed: int = 0


def prompts(s: Settings) -> Iterator[dict[str, Any]]:
    """An endless source of prompts: token ids, and how each is sampled (the task's settings
    travel with the prompt, so that any server of the model can answer it: ``group_size``
    completions of digits only, and a number of tokens from the long tail)."""
    rng = np.random.default_rng(s.seed)
    task = {
        "n": s.group_size,
        "temperature": 1.0,
        "ignore_eos": True,
        "allowed_token_ids": list(DIGIT_IDS),
    }
    while True:
        digits = rng.choice(DIGIT_IDS, 4).tolist()
        length = int(
            np.clip(
                round(s.median_tokens * np.exp(s.sigma * rng.standard_normal())), 2, s.max_tokens
            )
        )
        yield {"prompt_token_ids": [1, *digits], "sampling": {**task, "max_tokens": length}}


def group_of(sample: asyncexec.Sample) -> Group:
    """A sample's completions with their rewards: the share of tokens that repeat the prompt's
    first digit."""
    done = completions(sample)
    target = done[0].prompt_token_ids[1]
    rewards = tuple(float(np.mean([t == target for t in c.token_ids])) for c in done)
    return Group(
        done[0].prompt_token_ids,
        tuple(c.token_ids for c in done),
        tuple(c.logprobs for c in done),
        rewards,
    )


@dataclass
class Summary:
    threshold: float
    started: float = field(default_factory=time.perf_counter)
    rewards: list[float] = field(default_factory=list)
    staleness_max: int = 0
    reached_after_s: float | None = None
    killed: dict[str, int] = field(default_factory=lambda: {"engine": 0, "learner": 0})
    learner_restarts: int = 0
    seconds: float = 0.0
    tokens: int = 0
    statistics: Any = None
    router: Any = None

    def report(self) -> str:
        reached = (
            f"reached {self.threshold} after {self.reached_after_s:.1f} s"
            if self.reached_after_s is not None
            else f"did NOT reach {self.threshold}"
        )
        first = np.mean(self.rewards[:3]) if self.rewards else 0.0
        last = np.mean(self.rewards[-3:]) if self.rewards else 0.0
        return (
            f"{reached}: mean reward {first:.2f} (first 3 batches) -> {last:.2f} (last 3), "
            f"{len(self.rewards)} updates, {self.tokens} tokens in {self.seconds:.1f} s; "
            f"staleness max {self.staleness_max}; killed {self.killed}, learner restarts "
            f"{self.learner_restarts}\npipeline: {self.statistics}\nrouter: {self.router}"
        )


async def learn(learner: asyncexec.Executor, groups: list[Group], s: Summary) -> None:
    """One update on the learner; after a learner rank died, a fresh group makes it, resumed
    from the learner's checkpoint of the update before."""
    for _ in range(3):
        try:
            await learner.call(CausalLMLearner.update, asyncexec.scatter(groups))
            return
        except asyncexec.WorkerCrashedError:
            s.learner_restarts += 1
    raise RuntimeError("the learner kept dying")


async def main(
    *,
    threshold: float = 0.6,
    max_updates: int = 150,
    staleness: int = 1,
    on_update: str = "keep",
    kill_engine_at: int | None = None,
    kill_learner_at: int | None = None,
    settings: Settings = Settings(),
    model_dir: str | None = None,
    timeline: Sequence[str] = (),
) -> Summary:
    """Start the learner and the engines, and :func:`train` until the mean reward of the last
    3 batches reaches ``threshold`` or ``max_updates``; what happened. ``timeline``: write one
    timeline of the learner, the engines and the pipeline to each of these paths (a ``.json``
    for Perfetto, a ``.png``)."""
    folder = build_tiny_llama(model_dir or os.path.join(tempfile.gettempdir(), "asyncexec-tiny"))
    s = Summary(threshold)
    # The engines report log-probabilities over the digits (after the mask), as the learner
    # computes them.
    engine = {
        "dtype": "bfloat16",
        "max_model_len": 256,
        "enforce_eager": True,
        "seed": settings.seed,
        "logprobs_mode": "processed_logprobs",
    }
    slow_start = asyncexec.Timeouts(start_s=300)  # an engine takes 10-30 s to start here
    shared = asyncexec.Timeline() if timeline else False  # both groups on one clock
    async with (
        asyncexec.Executor(
            2,
            backend=TorchBackend(backend="gloo"),
            name="learner",
            roles=asyncexec.Role(
                CausalLMLearner,
                folder,
                lr=settings.lr,
                allowed_token_ids=list(DIGIT_IDS),
                checkpoint=os.path.join(tempfile.mkdtemp(prefix="grpo_vllm_"), "learner.pt"),
            ),
            resources_per_worker={"CPU": 0.5},
            timeline=shared,
        ) as learner,
        asyncexec.Executor(
            2,
            roles=asyncexec.Role(VLLMServer, folder, engine=engine),
            name="vllm",
            resources_per_worker={"CPU": 0.5},
            timeouts=slow_start,
            restart=asyncexec.RestartPolicy(max_restarts=3),
            timeline=shared,
        ) as rollout,
        asyncexec.WeightChannel(learner, rollout) as channel,
    ):
        await channel.push()  # the learner's weights into the engines: version 1
        await train(
            learner,
            rollout,
            channel,
            s,
            settings=settings,
            max_updates=max_updates,
            staleness=staleness,
            on_update=on_update,
            kill_engine_at=kill_engine_at,
            kill_learner_at=kill_learner_at,
        )
    s.seconds = time.perf_counter() - s.started
    if shared:
        title = f"GRPO on vLLM: {len(s.rewards)} updates, staleness {staleness}, {on_update}"
        for path in timeline:
            shared.export(path, title)
            print(f"wrote the timeline to {path}")
    return s


async def train(
    learner: asyncexec.Executor,
    rollout: asyncexec.Executor,
    channel: asyncexec.WeightChannel,
    s: Summary,
    *,
    settings: Settings = Settings(),
    max_updates: int = 150,
    staleness: int = 1,
    on_update: str = "keep",
    kill_engine_at: int | None = None,
    kill_learner_at: int | None = None,
) -> None:
    """The loop itself, on a learner of :class:`CausalLMLearner` and servers of
    :class:`VLLMServer` that hold the same model: batches from the pipeline, an update on the
    learner, the new weights into the running engines; into ``s``, until ``s.threshold`` or
    ``max_updates``. ``kill_*_at``: SIGKILL server 1's engine core (mid-generation) or learner
    rank 1 after that update."""
    router = asyncexec.Router(rollout, max_in_flight=8, channel=channel)
    async with (
        router,
        asyncexec.Pipeline(
            router,
            prompts(settings),
            batch_size=settings.batch_size,
            staleness=staleness,
            on_update=on_update,
            channel=channel,
        ) as pipe,
    ):
        async for batch in pipe:
            groups = [group_of(x) for x in batch.samples]
            s.tokens += sum(len(t) for g in groups for t in g.token_ids)
            s.staleness_max = max(s.staleness_max, batch.staleness_max)
            s.rewards.append(float(np.mean([np.mean(g.rewards) for g in groups])))
            await learn(learner, groups, s)
            print(f"update {len(s.rewards)}: mean reward {s.rewards[-1]:.2f}", flush=True)
            if np.mean(s.rewards[-3:]) >= s.threshold and len(s.rewards) >= 3:
                s.reached_after_s = time.perf_counter() - s.started
                break
            if len(s.rewards) >= max_updates:
                break
            await pipe.update_weights()
            if kill_engine_at == len(s.rewards):  # server 1's engine core, mid-generation
                pids = await rollout.call(VLLMServer.engine_pids, on=asyncexec.rank(1))
                os.kill(pids["VLLM::EngineCore"], signal.SIGKILL)
                s.killed["engine"] += 1
            if kill_learner_at == len(s.rewards):
                os.kill(learner.workers[1].pid, signal.SIGKILL)
                s.killed["learner"] += 1
        s.statistics, s.router = pipe.statistics(), router.statistics()


def cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fully async GRPO on vLLM engines.")
    parser.add_argument("--threshold", type=float, default=0.6)
    parser.add_argument("--max-updates", type=int, default=150)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--on-update", choices=["keep", "wait", "abort"], default="keep")
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--kill-engine-at", type=int, metavar="UPDATE")
    parser.add_argument("--kill-learner-at", type=int, metavar="UPDATE")
    parser.add_argument(
        "--timeline",
        metavar="PATH",
        action="append",
        default=[],
        help="write the run's timeline there (.json for Perfetto, .png); may be given again",
    )
    args = parser.parse_args(argv)
    # Refused here, before Ray and the engines start, rather than with a traceback later (the
    # timeline's after the whole run).
    for name, value, low in (
        ("max-updates", args.max_updates, 1),
        ("staleness", args.staleness, 0),
    ):
        if value < low:
            parser.error(f"--{name} must be at least {low}, got {value}")
    for path in args.timeline:
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"--timeline {path}: its folder does not exist")
        if path.endswith(".png") and not importlib.util.find_spec("matplotlib"):
            parser.error("--timeline *.png needs matplotlib: pip install 'asyncexec[timeline]'")
    asyncexec.configure_logging("console", "warning")
    import ray

    if not ray.is_initialized():  # before the event loop: ray.init blocks for seconds
        ray.init(
            num_cpus=max(os.cpu_count() or 1, 2),
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    summary = asyncio.run(
        main(
            threshold=args.threshold,
            max_updates=args.max_updates,
            staleness=args.staleness,
            on_update=args.on_update,
            kill_engine_at=args.kill_engine_at,
            kill_learner_at=args.kill_learner_at,
            settings=Settings(lr=args.lr),
            timeline=args.timeline,
        )
    )
    print(summary.report())
    bound_held = summary.staleness_max <= args.staleness
    return 0 if summary.reached_after_s is not None and bound_held else 1


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is needed
    sys.exit(cli())
