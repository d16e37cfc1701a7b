"""PPO on CartPole-v1 with asyncexec: a rollout group (a :class:`Rollout` per rank) plays and
reports batches; a learner group (a :class:`Learner` per rank, DDP over gloo) trains on each
step's batch, every rank sent its part by ``learner.call(Learner.update, scatter(batch))``; the
weights go back over a WeightChannel. Solved: the last 100 episodes average 475 or more.
docs/rl-loops.md walks through it; :func:`train_local` runs the same algorithm without Ray.

    pip install -e ".[torch,rl]"                   # torch and gymnasium
    python examples/ppo_cartpole.py                 # until solved (about 40 s on 2 cores)
    python examples/ppo_cartpole.py --kill-rollout-at 20 --kill-learner-at 47   # with faults
    python examples/ppo_cartpole.py --rollout-workers 4 --staleness 2 --max-updates 400
    python examples/ppo_cartpole.py --max-updates 12 --kill-rollout-at 6 --timeline ppo.png
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import importlib.util
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
SOLVED_RETURN, SOLVED_WINDOW = 475.0, 100  # gymnasium's threshold, over the last 100 episodes
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
# torch and gymnasium are imported where they are used: run as a script, this module is __main__,
# which cloudpickle sends by value, and a reference to a module-level torch slows that down.


def make_model(hidden: int, seed: int) -> Any:
    """The actor-critic, the same weights for the same seed: two MLPs of ``hidden`` x ``hidden``
    (tanh, orthogonal weights as in the PPO paper's code); ``model(obs)`` is (logits, value)."""
    import torch
    from torch import nn

    def mlp(n_out: int, gain: float) -> nn.Sequential:
        sizes, layers = [OBS_DIM, hidden, hidden, n_out], list[nn.Module]()
        for i in range(3):
            lin = nn.Linear(sizes[i], sizes[i + 1])
            nn.init.orthogonal_(lin.weight, gain if i == 2 else 2.0**0.5)
            nn.init.constant_(lin.bias, 0.0)
            layers += [lin, nn.Tanh()] if i < 2 else [lin]
        return nn.Sequential(*layers)

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
        self.obs = np.stack(
            [env.reset(seed=seed * 10_007 + i)[0] for i, env in enumerate(self.envs)]
        ).astype(np.float32)
        self.returns = np.zeros(n)

    def collect(self, model: Any, steps: int) -> tuple[Batch, np.ndarray]:
        """A batch of ``steps`` steps of every environment, and the returns of the episodes that
        ended. A truncated episode's last reward is bootstrapped with ``gamma * V(last obs)``."""
        import torch

        n = len(self.envs)
        obs, actions = np.zeros((n, steps, OBS_DIM), np.float32), np.zeros((n, steps), np.int64)
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
        batch: Batch = {
            "obs": obs,
            "actions": actions,
            "logp": logp,
            "rewards": rewards,
            "dones": dones,
            "last_obs": self.obs.copy(),
        }
        return batch, np.asarray(finished, np.float64)


def gae(
    values: np.ndarray,
    last_values: np.ndarray,
    rewards: np.ndarray,
    dones: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
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
    model: Any,
    optimizer: Any,
    batch: Mapping[str, np.ndarray],
    cfg: PPOConfig,
    rng: np.random.Generator,
    forward: Callable[[Any], Any] | None = None,
) -> dict[str, float]:
    """One PPO update (GAE with the current value head, then clipped-objective minibatches)
    through ``forward``, a DistributedDataParallel wrapper of ``model``; the mean losses."""
    import torch

    forward = forward or model
    # Time-major ([T, N]) from here on, copied (arrays out of Ray's store are read-only).
    steps = {k: np.array(np.swapaxes(batch[k], 0, 1), order="C") for k in STEP_KEYS}
    obs = torch.from_numpy(steps["obs"]).reshape(-1, OBS_DIM)
    with torch.no_grad():
        values = model(obs)[1]
        last_values = model(torch.tensor(batch["last_obs"]))[1]
    adv = gae(
        values.numpy().reshape(steps["rewards"].shape),
        last_values.numpy(),
        steps["rewards"],
        steps["dones"],
        cfg.gamma,
        cfg.gae_lambda,
    )
    advantages = torch.from_numpy(adv).reshape(-1)
    returns = advantages + values
    actions = torch.from_numpy(steps["actions"]).reshape(-1)
    old_logp = torch.from_numpy(steps["logp"]).reshape(-1)
    size = obs.shape[0]
    mb, count = size // cfg.minibatches, cfg.epochs * cfg.minibatches
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
            losses = (loss, policy_loss, value_loss, dist.entropy().mean(), kl)
            for key, v in zip(stats, losses, strict=True):
                stats[key] += v.item() / count
    return stats


def train_local(
    cfg: PPOConfig = PPOConfig(), *, rollout_workers: int = 2, max_updates: int = 500, lag: int = 0
) -> tuple[int, list[float]]:
    """The same algorithm in one process, without Ray: collectors act with weights ``lag``
    updates old, until solved or ``max_updates``; the updates made and the episodes' returns."""
    import torch

    torch.set_num_threads(1)
    model = make_model(cfg.hidden, cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-5)
    collectors = [
        Collector(cfg.envs_per_worker, cfg.seed * 1000 + r, cfg.gamma)
        for r in range(rollout_workers)
    ]
    history, update, returns = [copy.deepcopy(model)], 0, list[float]()
    rng = np.random.default_rng(cfg.seed)
    while update < max_updates:
        batches = [c.collect(history[0], cfg.rollout_steps) for c in collectors]
        returns.extend(r for _, finished in batches for r in finished.tolist())
        if len(returns) >= SOLVED_WINDOW and np.mean(returns[-SOLVED_WINDOW:]) >= SOLVED_RETURN:
            break
        ppo_update(model, optimizer, asyncexec.concat([b for b, _ in batches]), cfg, rng)
        update += 1
        history = [*history, copy.deepcopy(model)][-(lag + 1) :]
    return update, returns


# The workers' classes ---------------------------------------------------------------------------


class Learner:
    """A learner rank: the model in DDP and its optimizer, resumed from ``checkpoint_dir``."""

    def __init__(self, cfg: PPOConfig, checkpoint_dir: str, checkpoint_every: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.cfg, self.checkpoint_every = cfg, checkpoint_every
        self.path = os.path.join(checkpoint_dir, "learner.pt")
        self.model = make_model(cfg.hidden, cfg.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, eps=1e-5)
        self.updates = self.resumed_from = 0
        if os.path.exists(self.path):
            state = torch.load(self.path, weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.updates = self.resumed_from = int(state["updates"])
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)  # process group is up
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
        """The run's function: play and report batches until ``report()`` raises (stopped)."""
        ctx = asyncexec.get_context()  # a restarted attempt plays other episodes
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
    killed: dict[str, float] = field(default_factory=dict, repr=False)  # group -> perf_counter
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
        return float(np.mean(self.returns[-SOLVED_WINDOW:])) if self.returns else 0.0

    @property
    def solved(self) -> bool:
        return self.solved_after_s is not None

    def report(self) -> str:
        solved = f"solved after {self.solved_after_s:.1f} s" if self.solved else "not solved"
        back = {k: f" (back after {v:.2f} s)" for k, v in self.back_after_s.items()}
        restarts = ", ".join(f"{n} {k}{back.get(k, '')}" for k, n in self.restarts.items())
        return "\n".join(
            [
                f"{solved}: average return {self.initial_average_return:.1f} (first 100 episodes) "
                f"-> {self.final_average_return:.1f} (last 100)",
                f"{self.updates} updates, {self.pushes} weight pushes, "
                f"{self.env_steps} environment steps, {len(self.returns)} episodes in "
                f"{self.seconds:.1f} s",
                f"staleness: max lag {self.max_lag} versions "
                f"(Report.version: {self.max_report_lag}; bound {self.staleness_bound}), "
                f"{self.dropped} steps dropped",
                f"restarts: {restarts}; the learner resumed from updates "
                f"{self.learner_resumed_from}",
                "loop lag p50 {:.2f} ms, p99 {:.2f} ms, max {:.2f} ms".format(*self.loop_lag_ms)
                + " (once started: p99 {1:.2f} ms, max {2:.2f} ms)".format(
                    *self.running_loop_lag_ms
                ),
            ]
        )


async def probe_loop_lag(lags: list[float], interval_s: float = 0.005) -> None:
    """Wake every ``interval_s`` on the driver's loop and record how late, in seconds."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(interval_s)
        lags.append(max(0.0, time.perf_counter() - t0 - interval_s))


def percentiles_ms(lags: Sequence[float]) -> tuple[float, ...]:
    ms = np.asarray(lags or [0.0]) * 1000.0
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), float(ms.max())


def take(step: asyncexec.Step, s: Summary, version: int, learners: int) -> Batch | None:
    """Count a step's staleness against the channel's ``version``; its batch, dealt out to
    ``learners`` ranks, or None when it is over the bound."""
    acted = min(int(r.metrics["version"]) for r in step.reports)
    held = min(acted if r.version is None else r.version for r in step.reports)
    s.max_lag = max(s.max_lag, version - acted)
    s.max_report_lag = max(s.max_report_lag, version - held)
    if max(version - acted, version - held) > s.staleness_bound:
        s.dropped += 1
        return None
    batch = asyncexec.concat([r.metrics["batch"] for r in step.reports])  # side by side
    # Environment i to learner rank i % L: each part scatter() sends holds every rollout rank's.
    n = len(batch["obs"])
    dealt = np.concatenate([np.arange(j, n, learners) for j in range(learners)])
    return {k: v[dealt] for k, v in batch.items()}


async def learn(learner: asyncexec.Executor, batch: Batch, s: Summary, max_restarts: int) -> None:
    """The learner's update, each rank sent its part of ``batch``. After a learner rank died
    the call raises, and calling again starts a fresh group that resumes from its checkpoint."""
    restarted = False
    while True:
        try:
            stats = await learner.call(Learner.update, asyncexec.scatter(batch))
            break
        except asyncexec.WorkerCrashedError:
            if s.restarts["learner"] == max_restarts:
                raise
            s.restarts["learner"] += 1
            restarted = True
    if restarted:
        s.learner_resumed_from.append(int(stats[0]["resumed_from"]))
        if "learner" in s.killed:
            s.back_after_s["learner"] = time.perf_counter() - s.killed.pop("learner")


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
    timeline: str | None = None,
) -> Summary:
    """Train PPO with a learner and a rollout group; what happened. The arguments are the
    command line's (:func:`cli`); ``on_update(update, average return of the last 100 episodes)``
    is called after each update; ``timeline``: where to write the rollout group's timeline
    (``.png`` or Perfetto JSON), and the learner's beside it (``-learner`` added to its name)."""
    ppo = ppo or PPOConfig()
    if rollout_workers * ppo.envs_per_worker < learner_workers:
        raise ValueError("fewer environments than learner ranks")
    s, lags = Summary(staleness_bound=staleness), list[float]()
    kill_at = {"rollout": kill_rollout_at, "learner": kill_learner_at}
    if storage_path is not None:
        os.makedirs(storage_path, exist_ok=True)  # made if missing, as the executors make it
    checkpoints = tempfile.mkdtemp(prefix="ppo_learner_", dir=storage_path)
    bundles = max(rollout_workers, learner_workers)  # rank i of either group on bundle i
    reservation = asyncexec.Reservation(bundles, {"CPU": 1}, name="ppo")
    shared = {
        "reservation": reservation,
        "resources_per_worker": {"CPU": 0.5},
        "storage_path": storage_path,
    }
    timed = timeline is not None  # each group keeps a timeline
    async with anyio.create_task_group() as probe:
        probe.start_soon(probe_loop_lag, lags)
        async with (
            reservation,
            asyncexec.Executor(
                learner_workers,
                backend=TorchBackend(backend="gloo"),
                roles=asyncexec.Role(Learner, ppo, checkpoints, checkpoint_every),
                name="learner",
                timeline=timed,
                **shared,
            ) as learner,
            asyncexec.Executor(
                rollout_workers,
                roles=asyncexec.Role(Rollout, ppo),
                restart=asyncexec.RestartPolicy(max_restarts=max_restarts),
                name="rollout",
                timeline=timed,
                **shared,
            ) as rollout,
            asyncexec.WeightChannel(
                learner, rollout, transport=transport, max_staleness=1
            ) as channel,
        ):
            gc.collect()
            gc.freeze()  # what lives now lives long (Ray's heap): full collections skip it
            started = len(lags)
            s.pushes = await channel.push()  # version 1: the learner's initial weights
            async for step in rollout.run(Rollout.collect, buffer_size=1):
                if step.attempt > 1 and "rollout" in s.killed:
                    s.back_after_s["rollout"] = time.perf_counter() - s.killed.pop("rollout")
                s.returns.extend(x for r in step.reports for x in r.metrics["returns"].tolist())
                s.env_steps += sum(r.metrics["batch"]["rewards"].size for r in step.reports)
                solved = len(s.returns) >= SOLVED_WINDOW and s.final_average_return >= SOLVED_RETURN
                if solved and not s.solved:
                    s.solved_after_s = time.perf_counter() - s.started
                if (s.solved and stop_when_solved) or s.updates >= max_updates:
                    break
                if (batch := take(step, s, channel.version, learner_workers)) is None:
                    continue
                await learn(learner, batch, s, max_restarts)
                s.pushes = await channel.push()
                s.updates += 1
                if on_update is not None:
                    on_update(s.updates, s.final_average_return)
                for group, executor in (("rollout", rollout), ("learner", learner)):
                    if kill_at[group] == s.updates:  # rollout rank 1 (if there), learner rank 0
                        rank = 1 if group == "rollout" and len(executor.workers) > 1 else 0
                        os.kill(executor.workers[rank].pid, signal.SIGKILL)
                        s.killed[group] = time.perf_counter()
            s.restarts["rollout"] = rollout.statistics().restarts
        probe.cancel_scope.cancel()
    s.loop_lag_ms, s.running_loop_lag_ms = percentiles_ms(lags), percentiles_ms(lags[started:])
    s.seconds = time.perf_counter() - s.started
    if timeline is not None and rollout.timeline and learner.timeline:
        stem, ext = os.path.splitext(timeline)
        rollout.timeline.export(timeline, f"PPO rollout ranks ({s.updates} updates)")
        learner.timeline.export(f"{stem}-learner{ext}", f"PPO learner ranks ({s.updates} updates)")
    return s


def cli(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, train, print the summary; 0 when solved (or, with ``--no-stop``, when the
    return rose) with no step over the staleness bound."""
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
    add("--envs-per-worker", type=int, default=PPOConfig.envs_per_worker)
    add("--rollout-steps", type=int, default=PPOConfig.rollout_steps)
    add("--lr", type=float, default=PPOConfig.lr)
    add("--seed", type=int, default=PPOConfig.seed)
    add("--storage-path", default=None, help="where checkpoints go")
    add("--timeline", metavar="PATH", help="write the groups' timelines (.png or JSON)")
    add("--quiet", action="store_true", help="print the summary only")
    args = vars(parser.parse_args(argv))  # main()'s arguments, and these:
    # Refused here, before Ray starts, rather than with a traceback later (the timeline's after
    # the whole run).
    lows = {"rollout_workers": 1, "learner_workers": 1, "staleness": 0, "max_updates": 1}
    lows |= {"checkpoint_every": 1, "max_restarts": 0, "envs_per_worker": 1, "rollout_steps": 1}
    for name, low in lows.items():
        if not args[name] >= low:
            parser.error(f"--{name.replace('_', '-')} must be at least {low}, got {args[name]}")
    if args["rollout_workers"] * args["envs_per_worker"] < args["learner_workers"]:
        parser.error("fewer environments (rollout workers x envs per worker) than learner ranks")
    if args["timeline"] and not os.path.isdir(os.path.dirname(os.path.abspath(args["timeline"]))):
        parser.error(f"--timeline {args['timeline']}: its folder does not exist")
    if (args["timeline"] or "").endswith(".png") and not importlib.util.find_spec("matplotlib"):
        parser.error("--timeline *.png needs matplotlib: pip install 'asyncexec[timeline]'")
    quiet, stop_when_solved = args.pop("quiet"), not args.pop("no_stop")
    ppo = PPOConfig(**{k: args.pop(k) for k in ("envs_per_worker", "rollout_steps", "lr", "seed")})

    def progress(update: int, average: float) -> None:
        if update % 10 == 0:
            print(f"update {update}: the last 100 episodes average {average:.1f}", flush=True)

    asyncexec.configure_logging("console", "warning")
    import ray

    if not ray.is_initialized():
        # Before the event loop (ray.init blocks for seconds); a logical CPU for every bundle.
        bundles = max(args["rollout_workers"], args["learner_workers"])
        ray.init(
            num_cpus=max(os.cpu_count() or 1, bundles),
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    summary = asyncio.run(
        main(
            **args,
            stop_when_solved=stop_when_solved,
            ppo=ppo,
            on_update=None if quiet else progress,
        )
    )
    print(summary.report())
    rose = not stop_when_solved and summary.final_average_return > summary.initial_average_return
    ok = (summary.solved or rose) and summary.dropped == 0
    return 0 if ok and summary.max_lag <= args["staleness"] else 1


if __name__ == "__main__":
    sys.exit(cli())
