"""PPO on CartPole-v1 with asyncexec: a rollout group plays the environments and streams its
experience back, a learner group trains on it with DistributedDataParallel, both on one
reservation; the weights go back over a WeightChannel after every update; the event loop stays
free throughout. Solved: the last 100 episodes average 475 or more (gymnasium's threshold).

    pip install -e ".[torch,rl]"                   # torch and gymnasium
    python examples/ppo_cartpole.py                 # until solved (about 20 s on 2 cores)
    python examples/ppo_cartpole.py --kill-rollout-at 20 --kill-learner-at 47   # with faults
    python examples/ppo_cartpole.py --rollout-workers 4 --staleness 2 --max-updates 400

How the pieces fit (docs/rl-loops.md walks through it):

- Every rollout rank holds a :class:`Rollout` (its policy, the newest weights pushed to it) and
  runs ``rollout.run(Rollout.collect, buffer_size=1)``: load the newest weights, play a batch,
  ``report()`` it with the version it acted with.
- Every learner rank holds a :class:`Learner` (the model in DDP, its optimizer). For each step
  (a batch from every rollout rank) the driver checks the batches' staleness, then calls
  ``learner.call(Learner.update, asyncexec.scatter(batch))``: each rank is sent only its share
  of the environments; rank 0 saves a checkpoint every few updates. Then ``channel.push()``
  sends learner rank 0's weights to every rollout rank.
- Staleness: with ``buffer_size=1`` a batch is at most 2 versions behind when it is trained on
  (1 in every run measured); a step over the bound K (``--staleness``) is dropped and counted.
- Faults: ``--kill-rollout-at N`` SIGKILLs rollout rank 1 after update N: the run restarts and
  the new workers get the latest weights before ``collect`` starts. ``--kill-learner-at N``
  SIGKILLs learner rank 0: the next update raises ``WorkerCrashedError``, and calling it again
  starts a fresh learner group whose ``Learner`` resumes from the latest checkpoint.
- A coroutine on the driver's loop wakes every 5 ms and records how late it wakes up.

:func:`train_local` runs the same algorithm in one process, without Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import numpy as np

import asyncexec
from asyncexec.backends import TorchBackend

OBS_DIM, N_ACTIONS, ENV_ID = 4, 2, "CartPole-v1"
SOLVED_RETURN = 475.0  # gymnasium's reward_threshold for CartPole-v1
SOLVED_WINDOW = 100  # episodes the average is taken over
STEP_KEYS = ("obs", "actions", "logp", "rewards", "dones")
Batch = dict[str, np.ndarray]  # environment-major: obs [N, T, 4], actions/logp/rewards/dones [N, T]


@dataclass(frozen=True)
class PPOConfig:
    """PPO's hyper-parameters, tuned to solve CartPole-v1 in few updates on a CPU."""

    envs_per_worker: int = 8  # environments each rollout worker steps
    rollout_steps: int = 64  # steps of every environment per rollout batch
    hidden: int = 64
    lr: float = 1e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    epochs: int = 4
    minibatches: int = 4  # per learner rank and epoch
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    seed: int = 0


# The algorithm (torch, no Ray) ------------------------------------------------------------------


def make_model(hidden: int, seed: int) -> Any:
    """The actor-critic: two MLPs of ``hidden`` x ``hidden`` (tanh), orthogonal initialisation
    as in the PPO paper's implementation; ``model(obs)`` returns ``(logits, value)``."""
    import torch
    from torch import nn

    def layer(n_in: int, n_out: int, std: float) -> nn.Linear:
        lin = nn.Linear(n_in, n_out)
        nn.init.orthogonal_(lin.weight, std)
        nn.init.constant_(lin.bias, 0.0)
        return lin

    def mlp(n_out: int, std: float) -> nn.Sequential:
        s = 2.0**0.5
        return nn.Sequential(layer(OBS_DIM, hidden, s), nn.Tanh(), layer(hidden, hidden, s),
                             nn.Tanh(), layer(hidden, n_out, std))  # fmt: skip

    class ActorCritic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.actor, self.critic = mlp(N_ACTIONS, 0.01), mlp(1, 1.0)

        def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.actor(obs), self.critic(obs).squeeze(-1)

    torch.manual_seed(seed)
    return ActorCritic()


class Collector:
    """``n`` CartPole environments stepped in a loop with a policy."""

    def __init__(self, n: int, seed: int, gamma: float) -> None:
        import gymnasium as gym

        self.envs = [gym.make(ENV_ID) for _ in range(n)]
        self.gamma = gamma
        self.obs = np.stack([env.reset(seed=seed * 10_007 + i)[0] for i, env in
                             enumerate(self.envs)]).astype(np.float32)  # fmt: skip
        self.returns = np.zeros(n)

    def collect(self, model: Any, steps: int) -> tuple[Batch, np.ndarray]:
        """Act with ``model`` for ``steps`` steps in every environment: the batch, and the
        returns of the episodes that ended. A truncated episode (500 steps) is not a failure:
        its last reward is bootstrapped with ``gamma * V(final observation)``."""
        import torch

        n = len(self.envs)
        obs = np.zeros((n, steps, OBS_DIM), np.float32)
        actions = np.zeros((n, steps), np.int64)
        logp, rewards, dones = (np.zeros((n, steps), np.float32) for _ in range(3))
        finished: list[float] = []
        with torch.no_grad():
            for t in range(steps):
                obs[:, t] = self.obs
                dist = torch.distributions.Categorical(logits=model(torch.from_numpy(self.obs))[0])
                action = dist.sample()
                actions[:, t], logp[:, t] = action.numpy(), dist.log_prob(action).numpy()
                for i, env in enumerate(self.envs):
                    o, r, term, trunc, _ = env.step(int(actions[i, t]))
                    self.returns[i] += r
                    rewards[i, t] = r
                    if term or trunc:
                        if trunc and not term:
                            value = model(torch.as_tensor(o, dtype=torch.float32)[None])[1]
                            rewards[i, t] += self.gamma * float(value[0])
                        dones[i, t] = 1.0
                        finished.append(float(self.returns[i]))
                        self.returns[i] = 0.0
                        o, _ = env.reset()
                    self.obs[i] = o
        batch: Batch = {"obs": obs, "actions": actions, "logp": logp, "rewards": rewards,
                        "dones": dones, "last_obs": self.obs.copy()}  # fmt: skip
        return batch, np.asarray(finished, np.float64)


def gae(
    values: np.ndarray, last_values: np.ndarray, rewards: np.ndarray, dones: np.ndarray,
    gamma: float, lam: float,
) -> np.ndarray:  # fmt: skip
    """Generalised advantage estimates, ``[T, N]``: ``dones[t]`` ends the episode after step t."""
    adv = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[1], np.float32)
    next_values = last_values
    for t in range(rewards.shape[0] - 1, -1, -1):
        alive = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * alive - values[t]
        running = adv[t] = delta + gamma * lam * alive * running
        next_values = values[t]
    return adv


def ppo_update(
    model: Any, optimizer: Any, batch: Mapping[str, np.ndarray], cfg: PPOConfig,
    rng: np.random.Generator, forward: Callable[[Any], Any] | None = None,
) -> dict[str, float]:  # fmt: skip
    """One PPO update on ``batch``: GAE with the current value head, then ``epochs`` passes of
    ``minibatches`` clipped-objective steps. ``forward`` is the module to call (a
    DistributedDataParallel wrapper of ``model``, which averages the gradients)."""
    import torch

    forward = forward or model
    # Time-major ([T, N]) from here on, copied (arrays out of Ray's store are read-only).
    steps = {k: np.array(np.swapaxes(batch[k], 0, 1), order="C") for k in STEP_KEYS}
    obs = torch.from_numpy(steps["obs"]).reshape(-1, OBS_DIM)
    with torch.no_grad():
        values = model(obs)[1]
        last_values = model(torch.tensor(batch["last_obs"]))[1]
    adv = gae(values.numpy().reshape(steps["rewards"].shape), last_values.numpy(),
              steps["rewards"], steps["dones"], cfg.gamma, cfg.gae_lambda)  # fmt: skip
    advantages = torch.from_numpy(adv).reshape(-1)
    returns = advantages + values
    actions = torch.from_numpy(steps["actions"]).reshape(-1)
    old_logp = torch.from_numpy(steps["logp"]).reshape(-1)
    size, count = obs.shape[0], cfg.epochs * cfg.minibatches
    mb = size // cfg.minibatches
    stats = dict.fromkeys(("loss", "policy_loss", "value_loss", "entropy", "kl"), 0.0)
    for _ in range(cfg.epochs):
        order = torch.from_numpy(rng.permutation(size))
        for k in range(cfg.minibatches):
            idx = order[k * mb : (k + 1) * mb]
            logits, value = forward(obs[idx])
            dist = torch.distributions.Categorical(logits=logits)
            log_ratio = dist.log_prob(actions[idx]) - old_logp[idx]
            ratio = log_ratio.exp()
            a = advantages[idx]
            a = (a - a.mean()) / (a.std() + 1e-8)
            clipped = ratio.clamp(1.0 - cfg.clip, 1.0 + cfg.clip)
            policy_loss = torch.max(-a * ratio, -a * clipped).mean()
            value_loss = 0.5 * (value - returns[idx]).pow(2).mean()
            loss = policy_loss + cfg.vf_coef * value_loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            kl = ((ratio - 1) - log_ratio).mean()
            for key, v in zip(
                stats, (loss, policy_loss, value_loss, dist.entropy().mean(), kl), strict=True
            ):
                stats[key] += v.item() / count
    return stats


def average_last(returns: Sequence[float], n: int = SOLVED_WINDOW) -> float:
    return float(np.mean(returns[-n:])) if len(returns) else 0.0


def train_local(
    cfg: PPOConfig = PPOConfig(), *, rollout_workers: int = 2, max_updates: int = 500, lag: int = 0
) -> tuple[int, list[float]]:
    """The same algorithm in one process, without Ray: ``rollout_workers`` collectors act with
    weights ``lag`` updates old (as the async loop's stale rollouts do), one learner trains on
    their batches side by side, until solved or ``max_updates``. Returns the updates made and
    the episodes' returns. This is how the hyper-parameters were chosen::

        python -c "from examples.ppo_cartpole import *; print(train_local(lag=2)[0])"
    """
    import torch

    torch.set_num_threads(1)
    model = make_model(cfg.hidden, cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-5)
    collectors = [Collector(cfg.envs_per_worker, cfg.seed * 1000 + r, cfg.gamma)
                  for r in range(rollout_workers)]  # fmt: skip
    history, update, returns = [copy.deepcopy(model)], 0, list[float]()
    rng = np.random.default_rng(cfg.seed)
    while update < max_updates:
        batches = [c.collect(history[0], cfg.rollout_steps) for c in collectors]
        returns.extend(r for _, finished in batches for r in finished.tolist())
        if len(returns) >= SOLVED_WINDOW and average_last(returns) >= SOLVED_RETURN:
            break
        ppo_update(model, optimizer, asyncexec.concat([b for b, _ in batches]), cfg, rng)
        update += 1
        history = [*history, copy.deepcopy(model)][-(lag + 1) :]
    return update, returns


# The workers' classes ---------------------------------------------------------------------------


class Learner:
    """A learner rank: the actor-critic in DistributedDataParallel and its optimizer, resumed from
    the checkpoint in ``checkpoint_dir`` when a group before this one saved one (a restart)."""

    def __init__(self, cfg: PPOConfig, checkpoint_dir: str, checkpoint_every: int) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        self.cfg, self.checkpoint_every = cfg, checkpoint_every
        self.path = os.path.join(checkpoint_dir, "learner.pt")
        self.model = make_model(cfg.hidden, cfg.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, eps=1e-5)
        self.updates = 0
        if os.path.exists(self.path):
            state = torch.load(self.path, weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.updates = int(state["updates"])
        self.resumed_from = self.updates
        self.ddp = DistributedDataParallel(self.model)  # torch.distributed is set up already
        self.rank = asyncexec.get_context().world_rank
        self.rng = np.random.default_rng([cfg.seed, self.rank, 1 + self.updates])  # minibatches
        self.lock = threading.Lock()  # an update against the channel's reads of the weights
        asyncexec.serve_weights(self.weights)

    def weights(self) -> dict[str, Any]:
        """A copy of the weights (the channel reads them in a thread of this worker)."""
        with self.lock:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def update(self, batch: Batch) -> dict[str, float]:
        """One PPO update on this rank's part of the batch; rank 0 checkpoints every few."""
        import torch

        with self.lock:
            stats = ppo_update(self.model, self.optimizer, batch, self.cfg, self.rng, self.ddp)
            self.updates += 1
        if self.rank == 0 and self.updates % self.checkpoint_every == 0:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save({**state, "updates": self.updates}, self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)  # a kill mid-save keeps the last one whole
        return {**stats, "resumed_from": self.resumed_from}


class Rollout:
    """A rollout rank: its copy of the policy and the newest weights pushed to it."""

    def __init__(self, cfg: PPOConfig) -> None:
        import torch

        torch.set_num_threads(1)
        self.cfg = cfg
        self.model = make_model(cfg.hidden, cfg.seed)
        self.lock = threading.Lock()
        self.pushed: Mapping[str, Any] | None = None  # not loaded yet
        self.received = self.version = 0  # the newest version pushed; the one acted with
        asyncexec.receive_weights(self.install)

    def install(self, state: Mapping[str, Any], version: int) -> None:
        """Keep the newest weights (the channel calls this in a thread of this worker)."""
        with self.lock:
            if version > self.received:
                self.pushed, self.received = state, version

    def collect(self) -> None:
        """The run's function: act with the newest weights, report a batch, again, until the
        driver stops the run (``report()`` then raises)."""
        ctx = asyncexec.get_context()  # in a run: a restarted attempt plays other episodes
        seed = self.cfg.seed * 1000 + 97 * (ctx.attempt or 1) + ctx.world_rank
        envs = Collector(self.cfg.envs_per_worker, seed, self.cfg.gamma)
        while True:
            with self.lock:
                pushed, self.pushed, received = self.pushed, None, self.received
            if pushed is not None:
                self.model.load_state_dict(pushed)
                self.version = received
            batch, returns = envs.collect(self.model, self.cfg.rollout_steps)
            asyncexec.report({"batch": batch, "returns": returns, "version": self.version})


# The driver -------------------------------------------------------------------------------------


@dataclass
class Summary:
    """What a run of :func:`main` did (filled in as it goes)."""

    staleness_bound: int
    started: float = field(default_factory=time.perf_counter)
    updates: int = 0
    pushes: int = 0
    env_steps: int = 0
    returns: list[float] = field(default_factory=list, repr=False)  # of the episodes played
    solved_after_s: float | None = None
    max_lag: int = 0  # over the batches trained on: channel.version - the version acted with
    max_report_lag: int = 0  # the same with Report.version (the version held at report())
    dropped: int = 0  # steps over the bound, not trained on
    restarts: dict[str, int] = field(default_factory=lambda: {"rollout": 0, "learner": 0})
    back_after_s: dict[str, float] = field(default_factory=dict)  # kill -> next step or update
    learner_resumed_from: list[int] = field(default_factory=list)  # the checkpoints' updates
    loop_lag_ms: tuple[float, ...] = (0.0, 0.0, 0.0)  # p50, p99, max
    running_loop_lag_ms: tuple[float, ...] = (0.0, 0.0, 0.0)  # once the groups had started
    seconds: float = 0.0

    @property
    def initial_average_return(self) -> float:
        return float(np.mean(self.returns[:SOLVED_WINDOW])) if self.returns else 0.0

    @property
    def final_average_return(self) -> float:
        return average_last(self.returns)

    @property
    def solved(self) -> bool:
        return self.solved_after_s is not None

    def report(self) -> str:
        """A few lines for people."""
        solved = f"solved after {self.solved_after_s:.1f} s" if self.solved else "not solved"
        back = {k: f" (back after {v:.2f} s)" for k, v in self.back_after_s.items()}
        restarts = [f"{n} {group}{back.get(group, '')}" for group, n in self.restarts.items()]
        return "\n".join([
            f"{solved}: average return {self.initial_average_return:.1f} (first 100 episodes) "
            f"-> {self.final_average_return:.1f} (last 100)",
            f"{self.updates} updates, {self.pushes} weight pushes, {self.env_steps} environment "
            f"steps, {len(self.returns)} episodes in {self.seconds:.1f} s",
            f"staleness: max lag {self.max_lag} versions (Report.version: {self.max_report_lag};"
            f" bound {self.staleness_bound}), {self.dropped} steps dropped",
            f"restarts: {', '.join(restarts)}; the learner resumed from updates "
            f"{self.learner_resumed_from}",
            "loop lag p50 {:.2f} ms, p99 {:.2f} ms, max {:.2f} ms".format(*self.loop_lag_ms)
            + " (once started: p99 {1:.2f} ms, max {2:.2f} ms)".format(*self.running_loop_lag_ms),
        ])  # fmt: skip


async def probe_loop_lag(lags: list[float], interval_s: float = 0.005) -> None:
    """Wake every ``interval_s`` on the driver's loop and record how late, in seconds."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(interval_s)
        lags.append(max(0.0, time.perf_counter() - t0 - interval_s))


def percentiles_ms(lags: Sequence[float]) -> tuple[float, ...]:
    ms = np.asarray(lags or [0.0]) * 1000.0
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), float(ms.max())


@dataclass
class Trainer:
    """The driver's loop: the rollout run's batches to the learner, its weights back."""

    learner: asyncexec.Executor
    rollout: asyncexec.Executor
    channel: asyncexec.WeightChannel
    summary: Summary
    learners: int  # learner ranks
    max_restarts: int  # of the learner (the rollout executor's RestartPolicy has its own)
    kill_at: dict[str, int | None]  # "rollout", "learner": kill a worker after this update
    on_update: Callable[[int, float], None] | None = None
    killed: dict[str, float] = field(default_factory=dict)  # when (perf_counter)

    async def train(self, max_updates: int, stop_when_solved: bool) -> None:
        s = self.summary
        s.pushes = await self.channel.push()  # version 1: the learner's initial weights
        async for step in self.rollout.run(Rollout.collect, buffer_size=1):
            if step.attempt > 1 and "rollout" in self.killed:
                s.back_after_s["rollout"] = time.perf_counter() - self.killed.pop("rollout")
            s.returns.extend(x for r in step.reports for x in r.metrics["returns"].tolist())
            s.env_steps += sum(r.metrics["batch"]["rewards"].size for r in step.reports)
            solved = len(s.returns) >= SOLVED_WINDOW and s.final_average_return >= SOLVED_RETURN
            if solved and not s.solved:
                s.solved_after_s = time.perf_counter() - s.started
            if (s.solved and stop_when_solved) or s.updates >= max_updates:
                break
            if (batch := self.take(step)) is None:
                continue
            await self.update(batch)
            s.pushes = await self.channel.push()
            s.updates += 1
            if self.on_update is not None:
                self.on_update(s.updates, s.final_average_return)
            for group, executor in (("rollout", self.rollout), ("learner", self.learner)):
                if self.kill_at[group] == s.updates:
                    rank = 1 if group == "rollout" and len(executor.workers) > 1 else 0
                    os.kill(executor.workers[rank].pid, signal.SIGKILL)
                    self.killed[group] = time.perf_counter()

    def take(self, step: asyncexec.Step) -> Batch | None:
        """Count a step's staleness; its batch, or None when it is over the bound."""
        s, now = self.summary, self.channel.version
        acted = min(int(r.metrics["version"]) for r in step.reports)
        held = min(acted if r.version is None else r.version for r in step.reports)
        s.max_lag, s.max_report_lag = max(s.max_lag, now - acted), max(s.max_report_lag, now - held)
        if max(now - acted, now - held) > s.staleness_bound:
            s.dropped += 1
            return None
        batch = asyncexec.concat([r.metrics["batch"] for r in step.reports])  # side by side
        # Deal the environments out (i to learner rank i % L): the contiguous parts scatter()
        # sends then hold environments of every rollout rank.
        n, every = len(batch["obs"]), self.learners
        dealt = np.concatenate([np.arange(j, n, every) for j in range(every)])
        return {k: v[dealt] for k, v in batch.items()}

    async def update(self, batch: Batch) -> None:
        """The learner's update on ``batch``, each rank sent its part of it. After a
        learner rank died the call raises, and the next one starts a fresh learner group,
        which resumes from its checkpoint: the batch is sent again."""
        s, restarted = self.summary, False
        while True:
            try:
                stats = await self.learner.call(Learner.update, asyncexec.scatter(batch))
                break
            except asyncexec.WorkerCrashedError:
                if s.restarts["learner"] == self.max_restarts:
                    raise
                s.restarts["learner"] += 1
                restarted = True
        if restarted:
            s.learner_resumed_from.append(int(stats[0]["resumed_from"]))
            if "learner" in self.killed:
                s.back_after_s["learner"] = time.perf_counter() - self.killed.pop("learner")


async def main(
    *,
    rollout_workers: int = 2,
    learner_workers: int = 2,
    staleness: int = 2,
    max_updates: int = 400,
    stop_when_solved: bool = True,
    kill_rollout_at: int | None = None,
    kill_learner_at: int | None = None,
    checkpoint_every: int = 5,
    max_restarts: int = 3,
    transport: Literal["object_store", "torch"] = "object_store",
    ppo: PPOConfig | None = None,
    storage_path: str | os.PathLike[str] | None = None,
    on_update: Callable[[int, float], None] | None = None,
) -> Summary:
    """Train PPO on CartPole-v1 with a learner and a rollout group; return what happened.

    The arguments are the command line's (see :func:`cli`); ``storage_path`` is where the
    learner's checkpoints (and the executors' records) go, ``on_update`` is called with (update,
    average return of the last 100 episodes) after each update.
    """
    ppo = ppo or PPOConfig()
    if rollout_workers * ppo.envs_per_worker < learner_workers:
        raise ValueError("fewer environments than learner ranks")
    summary, lags = Summary(staleness_bound=staleness), list[float]()
    half = {"CPU": 0.5}
    checkpoints = tempfile.mkdtemp(prefix="ppo_learner_", dir=storage_path)
    async with anyio.create_task_group() as probe:
        probe.start_soon(probe_loop_lag, lags)
        async with (
            asyncexec.Reservation(
                max(rollout_workers, learner_workers), {"CPU": 1}, name="ppo"
            ) as reservation,
            asyncexec.Executor(
                learner_workers,
                reservation=reservation,
                resources_per_worker=half,
                backend=TorchBackend(backend="gloo"),
                roles=asyncexec.Role(Learner, ppo, checkpoints, checkpoint_every),
                storage_path=storage_path,
                name="learner",
            ) as learner,
            asyncexec.Executor(
                rollout_workers,
                reservation=reservation,
                resources_per_worker=half,
                roles=asyncexec.Role(Rollout, ppo),
                restart=asyncexec.RestartPolicy(max_restarts=max_restarts),
                storage_path=storage_path,
                name="rollout",
            ) as rollout,
            asyncexec.WeightChannel(
                learner, rollout, transport=transport, max_staleness=1
            ) as channel,
        ):
            kill_at = {"rollout": kill_rollout_at, "learner": kill_learner_at}
            trainer = Trainer(learner, rollout, channel, summary, learner_workers, max_restarts,
                              kill_at, on_update)  # fmt: skip
            started = len(lags)
            await trainer.train(max_updates, stop_when_solved)
            summary.restarts["rollout"] = rollout.statistics().restarts
        probe.cancel_scope.cancel()
    summary.loop_lag_ms = percentiles_ms(lags)
    summary.running_loop_lag_ms = percentiles_ms(lags[started:])
    summary.seconds = time.perf_counter() - summary.started
    return summary


def cli(argv: Sequence[str] | None = None) -> int:
    """The command line: parse ``argv``, train, print the summary; 0 when solved (or, with
    ``--no-stop``, when the return rose) with no step over the staleness bound."""
    defaults = PPOConfig()
    parser = argparse.ArgumentParser(description="PPO on CartPole-v1 with asyncexec.")
    add = parser.add_argument
    add("--rollout-workers", type=int, default=2, help="rollout ranks R (2)")
    add("--learner-workers", type=int, default=2, help="learner ranks L, DDP over gloo (2)")
    add("--staleness", type=int, default=2, help="bound K on a batch's lag in versions (2)")
    add("--max-updates", type=int, default=400, help="at most so many (400)")
    add("--no-stop", action="store_true", help="train for --max-updates even once solved")
    add("--kill-rollout-at", type=int, metavar="UPDATE", help="SIGKILL rollout rank 1 after it")
    add("--kill-learner-at", type=int, metavar="UPDATE", help="SIGKILL learner rank 0 after it")
    add("--checkpoint-every", type=int, default=5, help="learner updates (5)")
    add("--max-restarts", type=int, default=3, help="per group (3)")
    add("--transport", choices=["object_store", "torch"], default="object_store")
    add("--envs-per-worker", type=int, default=defaults.envs_per_worker)
    add("--rollout-steps", type=int, default=defaults.rollout_steps)
    add("--lr", type=float, default=defaults.lr)
    add("--seed", type=int, default=defaults.seed)
    add("--storage-path", default=None, help="where checkpoints go")
    add("--quiet", action="store_true", help="print the summary only")
    args = parser.parse_args(argv)
    ppo = PPOConfig(envs_per_worker=args.envs_per_worker, rollout_steps=args.rollout_steps,
                    lr=args.lr, seed=args.seed)  # fmt: skip

    def progress(update: int, average: float) -> None:
        if update % 10 == 0:
            print(f"update {update}: the last 100 episodes average {average:.1f}", flush=True)

    asyncexec.configure_logging("console", "warning")
    import ray

    if not ray.is_initialized():
        # Before the event loop starts (ray.init blocks for seconds). Logical CPUs: the
        # reservation's bundles of 1 CPU each, even on a smaller machine.
        bundles = max(args.rollout_workers, args.learner_workers)
        ray.init(num_cpus=max(os.cpu_count() or 1, bundles), include_dashboard=False,
                 logging_level=logging.WARNING)  # fmt: skip
        gc.collect()
        gc.freeze()  # Ray's heap is long-lived: keep full collections from walking it (loop lag)
    summary = asyncio.run(main(
        rollout_workers=args.rollout_workers, learner_workers=args.learner_workers,
        staleness=args.staleness, max_updates=args.max_updates, stop_when_solved=not args.no_stop,
        kill_rollout_at=args.kill_rollout_at, kill_learner_at=args.kill_learner_at,
        checkpoint_every=args.checkpoint_every, max_restarts=args.max_restarts,
        transport=args.transport, ppo=ppo, storage_path=args.storage_path,
        on_update=None if args.quiet else progress,
    ))  # fmt: skip
    print(summary.report())
    rose = args.no_stop and summary.final_average_return > summary.initial_average_return
    ok = (summary.solved or rose) and summary.dropped == 0
    return 0 if ok and summary.max_lag <= args.staleness else 1


if __name__ == "__main__":
    sys.exit(cli())
