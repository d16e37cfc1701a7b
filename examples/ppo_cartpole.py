"""PPO on CartPole-v1 (the algorithm, verified in one process; asyncexec wiring to follow).

    python -c "from examples.ppo_cartpole import train_local; print(train_local(lag=2))"

:func:`train_local` runs PPO (clipped objective, GAE, value head) with collectors that act with
weights ``lag`` updates old, as the asynchronous loop's rollout workers will.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

OBS_DIM = 4
N_ACTIONS = 2
ENV_ID = "CartPole-v1"
SOLVED_RETURN = 475.0  # gymnasium's reward_threshold for CartPole-v1
SOLVED_WINDOW = 100  # episodes the average is taken over


@dataclass(frozen=True)
class PPOConfig:
    """PPO's hyper-parameters, tuned to solve CartPole-v1 in few updates on a CPU."""

    envs_per_worker: int = 8  # environments each rollout worker steps (even: halved per learner)
    rollout_steps: int = 64  # steps of every environment per rollout batch
    hidden: int = 64
    lr: float = 1e-3
    anneal_updates: int = 0  # > 0: the learning rate falls linearly to 10% over so many updates
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    epochs: int = 4
    minibatches: int = 4  # per learner rank and epoch
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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

    class ActorCritic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            s = 2.0**0.5
            self.actor = nn.Sequential(
                layer(OBS_DIM, hidden, s), nn.Tanh(), layer(hidden, hidden, s), nn.Tanh(),
                layer(hidden, N_ACTIONS, 0.01),
            )  # fmt: skip
            self.critic = nn.Sequential(
                layer(OBS_DIM, hidden, s), nn.Tanh(), layer(hidden, hidden, s), nn.Tanh(),
                layer(hidden, 1, 1.0),
            )  # fmt: skip

        def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.actor(obs), self.critic(obs).squeeze(-1)

    torch.manual_seed(seed)
    return ActorCritic()


class Collector:
    """``n`` CartPole environments stepped in a loop with a policy; each :meth:`collect` returns
    ``steps`` steps of every environment (the experience of one rollout batch)."""

    def __init__(self, n: int, seed: int, gamma: float) -> None:
        import gymnasium as gym

        self.envs = [gym.make(ENV_ID) for _ in range(n)]
        self.gamma = gamma
        self.obs = np.stack(
            [env.reset(seed=seed * 10_007 + i)[0] for i, env in enumerate(self.envs)]
        ).astype(np.float32)
        self.returns = np.zeros(n)
        self.env_steps = 0

    def collect(self, model: Any, steps: int) -> dict[str, Any]:
        """Act with ``model`` for ``steps`` steps in every environment.

        A truncated episode (500 steps) is not a failure: its last reward is bootstrapped with
        ``gamma * V(final observation)`` and the step is marked done, as a termination is.
        """
        import torch

        n = len(self.envs)
        obs = np.zeros((steps, n, OBS_DIM), np.float32)
        actions = np.zeros((steps, n), np.int64)
        logps = np.zeros((steps, n), np.float32)
        rewards = np.zeros((steps, n), np.float32)
        dones = np.zeros((steps, n), np.float32)
        finished: list[float] = []
        with torch.no_grad():
            for t in range(steps):
                obs[t] = self.obs
                logits, _ = model(torch.from_numpy(self.obs))
                dist = torch.distributions.Categorical(logits=logits)
                action = dist.sample()
                actions[t] = action.numpy()
                logps[t] = dist.log_prob(action).numpy()
                for i, env in enumerate(self.envs):
                    o, r, term, trunc, _ = env.step(int(actions[t, i]))
                    self.returns[i] += r
                    rewards[t, i] = r
                    if term or trunc:
                        if trunc and not term:
                            _, v = model(torch.as_tensor(o, dtype=torch.float32)[None])
                            rewards[t, i] += self.gamma * float(v[0])
                        dones[t, i] = 1.0
                        finished.append(float(self.returns[i]))
                        self.returns[i] = 0.0
                        o, _ = env.reset()
                    self.obs[i] = o
        self.env_steps += steps * n
        return {
            "obs": obs,
            "actions": actions,
            "logp": logps,
            "rewards": rewards,
            "dones": dones,
            "last_obs": self.obs.copy(),
            "episode_returns": np.asarray(finished, np.float64),
        }


def split_envs(batch: Mapping[str, Any], parts: int) -> list[dict[str, Any]]:
    """Deal a batch's environments out to ``parts`` learners (environment ``i`` to part
    ``i % parts``): each gets whole trajectories, all the same size."""
    out: list[dict[str, Any]] = []
    for p in range(parts):
        part = {k: batch[k][:, p::parts] for k in ("obs", "actions", "logp", "rewards", "dones")}
        part["last_obs"] = batch["last_obs"][p::parts]
        out.append(part)
    return out


def concat_envs(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several batches of the same length side by side, as one batch of more environments."""
    out = {k: np.concatenate([b[k] for b in batches], axis=1) for k in
           ("obs", "actions", "logp", "rewards", "dones")}  # fmt: skip
    out["last_obs"] = np.concatenate([b["last_obs"] for b in batches], axis=0)
    return out


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
        running = delta + gamma * lam * alive * running
        adv[t] = running
        next_values = values[t]
    return adv


def ppo_update(
    model: Any,
    optimizer: Any,
    batch: Mapping[str, Any],
    cfg: PPOConfig,
    rng: np.random.Generator,
    forward: Callable[[Any], Any] | None = None,
) -> dict[str, float]:
    """One PPO update on ``batch`` (``[T, N]`` arrays): GAE with the current value head, then
    ``epochs`` passes of ``minibatches`` clipped-objective steps. ``forward`` is the module to
    call (a DistributedDataParallel wrapper of ``model``, which averages the gradients)."""
    import torch

    forward = forward or model
    obs = torch.from_numpy(batch["obs"]).reshape(-1, OBS_DIM)
    with torch.no_grad():
        _, values = model(obs)
        _, last_values = model(torch.from_numpy(batch["last_obs"]))
    t_, n_ = batch["rewards"].shape
    values_np = values.numpy().reshape(t_, n_)
    adv_np = gae(
        values_np, last_values.numpy(), batch["rewards"], batch["dones"], cfg.gamma,
        cfg.gae_lambda,
    )  # fmt: skip
    advantages = torch.from_numpy(adv_np).reshape(-1)
    returns = advantages + values
    actions = torch.from_numpy(batch["actions"]).reshape(-1)
    old_logp = torch.from_numpy(batch["logp"]).reshape(-1)
    size = obs.shape[0]
    mb = size // cfg.minibatches
    stats = {"loss": 0.0, "policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "kl": 0.0,
             "clip_frac": 0.0}  # fmt: skip
    count = 0
    for _ in range(cfg.epochs):
        order = torch.from_numpy(rng.permutation(size))
        for k in range(cfg.minibatches):
            idx = order[k * mb : (k + 1) * mb]
            logits, value = forward(obs[idx])
            dist = torch.distributions.Categorical(logits=logits)
            logp = dist.log_prob(actions[idx])
            entropy = dist.entropy().mean()
            log_ratio = logp - old_logp[idx]
            ratio = log_ratio.exp()
            a = advantages[idx]
            a = (a - a.mean()) / (a.std() + 1e-8)
            policy_loss = torch.max(
                -a * ratio, -a * ratio.clamp(1.0 - cfg.clip, 1.0 + cfg.clip)
            ).mean()
            value_loss = 0.5 * (value - returns[idx]).pow(2).mean()
            loss = policy_loss - cfg.ent_coef * entropy + cfg.vf_coef * value_loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            with torch.no_grad():
                stats["loss"] += float(loss)
                stats["policy_loss"] += float(policy_loss)
                stats["value_loss"] += float(value_loss)
                stats["entropy"] += float(entropy)
                stats["kl"] += float(((ratio - 1) - log_ratio).mean())
                stats["clip_frac"] += float(((ratio - 1.0).abs() > cfg.clip).float().mean())
            count += 1
    return {k: v / count for k, v in stats.items()}


def set_lr(optimizer: Any, cfg: PPOConfig, update: int) -> None:
    """Anneal the learning rate linearly to 10% of ``cfg.lr`` over ``cfg.anneal_updates``."""
    if cfg.anneal_updates > 0:
        frac = max(0.1, 1.0 - update / cfg.anneal_updates)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * frac


@dataclass
class LocalResult:
    """What :func:`train_local` did."""

    updates: int
    env_steps: int
    episodes: int
    returns: list[float] = field(repr=False)
    average_return: float
    solved: bool
    seconds: float


def average_last(returns: Sequence[float], n: int = SOLVED_WINDOW) -> float:
    tail = returns[-n:]
    return float(np.mean(tail)) if len(tail) else 0.0


def train_local(
    cfg: PPOConfig = PPOConfig(),
    *,
    rollout_workers: int = 2,
    max_updates: int = 500,
    lag: int = 0,
    verbose: bool = False,
) -> LocalResult:
    """The same algorithm in one process, without Ray: ``rollout_workers`` collectors act with
    weights ``lag`` updates old (as the async loop's stale rollouts do), one learner trains on
    their batches side by side. Stops when solved or after ``max_updates``."""
    import copy

    import torch

    torch.set_num_threads(1)
    model = make_model(cfg.hidden, cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-5)
    collectors = [
        Collector(cfg.envs_per_worker, cfg.seed * 1000 + r, cfg.gamma)
        for r in range(rollout_workers)
    ]
    history = [copy.deepcopy(model)]
    returns: list[float] = []
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    update = 0
    while update < max_updates:
        actor = history[0]
        batches = [c.collect(actor, cfg.rollout_steps) for c in collectors]
        for b in batches:
            returns.extend(b["episode_returns"].tolist())
        if len(returns) >= SOLVED_WINDOW and average_last(returns) >= SOLVED_RETURN:
            break
        set_lr(optimizer, cfg, update)
        stats = ppo_update(model, optimizer, concat_envs(batches), cfg, rng)
        update += 1
        history.append(copy.deepcopy(model))
        history = history[-(lag + 1) :]
        if verbose and update % 10 == 0:
            print(
                f"update {update}: avg return {average_last(returns):.1f} over "
                f"{min(len(returns), SOLVED_WINDOW)} of {len(returns)} episodes, "
                f"kl {stats['kl']:.4f}, entropy {stats['entropy']:.3f}, "
                f"{time.perf_counter() - t0:.1f} s"
            )
    avg = average_last(returns)
    return LocalResult(
        updates=update,
        env_steps=sum(c.env_steps for c in collectors),
        episodes=len(returns),
        returns=returns,
        average_return=avg,
        solved=len(returns) >= SOLVED_WINDOW and avg >= SOLVED_RETURN,
        seconds=time.perf_counter() - t0,
    )
