"""A small, bitwise-deterministic PPO on CartPole-v1 whose training state is split
into checkpointable components (each has ``state_dict()`` / ``load_state_dict()``
and holds only tensors, NumPy arrays/scalars and plain JSON data).

Components (see :meth:`PPOTrainer.components`): ``policy`` (ActorCritic),
``optimizer`` (Adam), ``lr_scheduler`` (StepLR), ``replay_buffer``
(RolloutBuffer), ``env`` (EnvState) and ``progress`` (TrainingProgress).
The global torch RNG (action sampling, minibatch shuffling) is NOT a component
here: the engine's RNGState saves/restores the torch/numpy/python global RNGs.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
from gymnasium.wrappers import OrderEnforcing, TimeLimit
from torch import nn

OBS_DIM, N_ACTIONS = 4, 2
# Bit generators we know how to rebuild from ``bit_generator.state['bit_generator']``.
_BIT_GENERATORS = {
    "PCG64": np.random.PCG64,
    "PCG64DXSM": np.random.PCG64DXSM,
    "Philox": np.random.Philox,
    "SFC64": np.random.SFC64,
    "MT19937": np.random.MT19937,
}


@dataclass
class PPOConfig:
    seed: int = 0
    # 8 envs x 32 steps x 4 training steps = 1024 transitions per update, in minibatches of 256:
    # the average reward climbs well past random play (~22) within the demo's 50 steps.
    num_envs: int = 8
    steps_per_train_step: int = 32  # env steps per env per training step
    train_steps_per_update: int = 4  # PPO update (and buffer clear) every N training steps
    epochs: int = 4
    minibatch_size: int = 256
    lr: float = 2.5e-3
    lr_step_size: int = 25  # StepLR step_size, counted in PPO updates
    lr_gamma: float = 0.7
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    hidden_sizes: tuple[int, ...] = (64, 64)
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate policy (obs -> logits) and value (obs -> scalar) MLPs."""

    def __init__(self, hidden_sizes: tuple[int, ...] = (64, 64)) -> None:
        super().__init__()
        self.policy = _mlp([OBS_DIM, *hidden_sizes, N_ACTIONS])
        self.value = _mlp([OBS_DIM, *hidden_sizes, 1])

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(action logits, value): what the post-load probe compares."""
        return self.policy(obs), self.value(obs)

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.policy(obs))

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.value(obs).squeeze(-1)


class RolloutBuffer:
    """Preallocated (T, num_envs, ...) arrays plus a fill pointer ``pos``.

    Invariant: rows ``>= pos`` are zero (``clear`` zeroes them), so saving only
    the filled rows still restores the object exactly.
    """

    FIELDS = {
        "obs": np.float32,
        "actions": np.int64,
        "logprobs": np.float32,
        "rewards": np.float32,
        "dones": np.float32,
        "values": np.float32,
    }

    def __init__(self, capacity: int, num_envs: int) -> None:
        self.capacity, self.num_envs = capacity, num_envs
        self.data: dict[str, np.ndarray] = {
            k: np.zeros((capacity, num_envs) + ((OBS_DIM,) if k == "obs" else ()), dtype=dt)
            for k, dt in self.FIELDS.items()
        }
        self.pos = 0

    @property
    def full(self) -> bool:
        return self.pos == self.capacity

    def add(self, **row: np.ndarray) -> None:
        if self.full:
            raise RuntimeError("RolloutBuffer is full")
        for k in self.FIELDS:
            self.data[k][self.pos] = row[k]
        self.pos += 1

    def clear(self) -> None:
        for arr in self.data.values():
            arr.fill(0)
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "num_envs": self.num_envs,
            "pos": self.pos,
            **{k: v[: self.pos].copy() for k, v in self.data.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["capacity"], state["num_envs"]) != (self.capacity, self.num_envs):
            raise ValueError("RolloutBuffer shape mismatch with checkpoint")
        pos = int(state["pos"])
        self.clear()
        for k, dt in self.FIELDS.items():
            self.data[k][:pos] = np.asarray(state[k], dtype=dt)
        self.pos = pos


def _wrapper(env: gym.Env, cls: type) -> Any:
    """Find wrapper ``cls`` in ``env``'s wrapper chain."""
    while isinstance(env, gym.Wrapper):
        if isinstance(env, cls):
            return env
        env = env.env
    raise ValueError(f"{cls.__name__} not found in env wrapper chain")


class EnvState:
    """N plain ``CartPole-v1`` envs with manual auto-reset, plus the current
    observation and per-env running episode return/length.

    We use a list of plain envs (not a VectorEnv) so every piece of hidden state
    is reachable: CartPoleEnv.state / steps_beyond_terminated / _np_random
    (+ _np_random_seed), TimeLimit._elapsed_steps, OrderEnforcing._has_reset.
    """

    def __init__(self, num_envs: int, seed: int) -> None:
        # The passive env checker only warns; disabled so it carries no hidden flags.
        self.envs = [gym.make("CartPole-v1", disable_env_checker=True) for _ in range(num_envs)]
        self.obs = np.stack([e.reset(seed=seed + i)[0] for i, e in enumerate(self.envs)])
        self.ep_return = np.zeros(num_envs, dtype=np.float64)
        self.ep_length = np.zeros(num_envs, dtype=np.int64)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[float]]:
        """Step every env; auto-reset finished ones. Returns (rewards, dones,
        returns of episodes that finished)."""
        rewards = np.zeros(len(self.envs), dtype=np.float32)
        dones = np.zeros(len(self.envs), dtype=np.float32)
        finished: list[float] = []
        for i, env in enumerate(self.envs):
            obs, r, term, trunc, _ = env.step(int(actions[i]))
            rewards[i] = r
            self.ep_return[i] += r
            self.ep_length[i] += 1
            if term or trunc:  # truncation treated as terminal (CleanRL-style), kept simple
                dones[i] = 1.0
                finished.append(float(self.ep_return[i]))
                self.ep_return[i], self.ep_length[i] = 0.0, 0
                obs, _ = env.reset()  # seed=None: continues the env's own np_random stream
            self.obs[i] = obs
        return rewards, dones, finished

    def state_dict(self) -> dict[str, Any]:
        envs = []
        for env in self.envs:
            u = env.unwrapped
            envs.append(
                {
                    "state": None if u.state is None else np.array(u.state, dtype=np.float64),
                    "steps_beyond_terminated": u.steps_beyond_terminated,
                    "np_random": u.np_random.bit_generator.state,  # fresh plain dict each call
                    "np_random_seed": u._np_random_seed,
                    "elapsed_steps": _wrapper(env, TimeLimit)._elapsed_steps,
                    "has_reset": _wrapper(env, OrderEnforcing)._has_reset,
                }
            )
        return {
            "envs": envs,
            "obs": self.obs.copy(),
            "ep_return": self.ep_return.copy(),
            "ep_length": self.ep_length.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["envs"]) != len(self.envs):
            raise ValueError("EnvState num_envs mismatch with checkpoint")
        for env, s in zip(self.envs, state["envs"]):
            u = env.unwrapped
            u.state = None if s["state"] is None else np.array(s["state"], dtype=np.float64)
            sbt = s["steps_beyond_terminated"]
            u.steps_beyond_terminated = None if sbt is None else int(sbt)
            gen_state = s["np_random"]
            gen = np.random.Generator(_BIT_GENERATORS[gen_state["bit_generator"]]())
            gen.bit_generator.state = gen_state
            u._np_random = gen  # set directly: the np_random setter would clobber the seed
            u._np_random_seed = s["np_random_seed"]
            es = s["elapsed_steps"]
            _wrapper(env, TimeLimit)._elapsed_steps = None if es is None else int(es)
            _wrapper(env, OrderEnforcing)._has_reset = bool(s["has_reset"])
        self.obs = np.array(state["obs"], dtype=np.float32)
        self.ep_return = np.array(state["ep_return"], dtype=np.float64)
        self.ep_length = np.array(state["ep_length"], dtype=np.int64)


class TrainingProgress:
    """Counters plus the window of recent episode returns behind ``avg_reward``."""

    WINDOW = 20

    def __init__(self) -> None:
        self.global_step = 0  # training steps done
        self.updates_done = 0  # PPO updates done
        self.env_steps = 0  # total env transitions (all envs)
        self.episodes_done = 0
        self.recent_returns: list[float] = []
        self.last_loss: float | None = None  # the last PPO update's mean loss (None before the first)

    def record_episode(self, ret: float) -> None:
        self.episodes_done += 1
        self.recent_returns = (self.recent_returns + [float(ret)])[-self.WINDOW :]

    @property
    def avg_reward(self) -> float:
        return float(np.mean(self.recent_returns)) if self.recent_returns else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "updates_done": self.updates_done,
            "env_steps": self.env_steps,
            "episodes_done": self.episodes_done,
            "recent_returns": list(self.recent_returns),
            "last_loss": self.last_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.updates_done = int(state["updates_done"])
        self.env_steps = int(state["env_steps"])
        self.episodes_done = int(state["episodes_done"])
        self.recent_returns = [float(x) for x in state["recent_returns"]]
        last = state.get("last_loss")  # (absent in snapshots of older demos)
        self.last_loss = None if last is None else float(last)


class PPOTrainer:
    """Owns all training state; everything that changes lives in ``components()``
    (plus the global torch RNG, which the engine's RNGState handles). Because the
    constructor reseeds that global RNG, run one trainer at a time per process."""

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg
        # Bitwise reproducibility across processes: deterministic kernels, and a
        # single thread so float reductions never change order.
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        torch.manual_seed(cfg.seed)  # model init + action sampling + minibatch shuffles
        self.model = ActorCritic(tuple(cfg.hidden_sizes))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, eps=1e-5)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(
            self.optimizer, step_size=cfg.lr_step_size, gamma=cfg.lr_gamma
        )
        self.buffer = RolloutBuffer(cfg.steps_per_train_step * cfg.train_steps_per_update, cfg.num_envs)
        self.env_state = EnvState(cfg.num_envs, cfg.seed)
        self.progress = TrainingProgress()

    def components(self) -> dict[str, Any]:
        return {
            "policy": self.model,
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "replay_buffer": self.buffer,
            "env": self.env_state,
            "progress": self.progress,
        }

    @torch.no_grad()
    def _collect(self) -> None:
        for _ in range(self.cfg.steps_per_train_step):
            obs = self.env_state.obs.copy()
            obs_t = torch.from_numpy(obs)
            dist = self.model.dist(obs_t)
            action = dist.sample()
            logprob = dist.log_prob(action)
            value = self.model.get_value(obs_t)
            rewards, dones, finished = self.env_state.step(action.numpy())
            self.buffer.add(
                obs=obs,
                actions=action.numpy(),
                logprobs=logprob.numpy(),
                rewards=rewards,
                dones=dones,
                values=value.numpy(),
            )
            for ret in finished:
                self.progress.record_episode(ret)
            self.progress.env_steps += self.cfg.num_envs

    def _update(self) -> float:
        cfg, d = self.cfg, self.buffer.data
        with torch.no_grad():
            # Bootstrap from the env's current obs: recomputable from saved state
            # (env.obs + policy params), so nothing extra needs checkpointing.
            next_value = self.model.get_value(torch.from_numpy(self.env_state.obs)).numpy()
        rewards, dones, values = d["rewards"], d["dones"], d["values"]
        adv = np.zeros_like(rewards)
        last_gae = np.zeros(cfg.num_envs, dtype=np.float32)
        for t in reversed(range(self.buffer.capacity)):
            nxt = next_value if t == self.buffer.capacity - 1 else values[t + 1]
            nonterm = 1.0 - dones[t]  # dones[t]: episode ended after step t
            delta = rewards[t] + cfg.gamma * nxt * nonterm - values[t]
            last_gae = delta + cfg.gamma * cfg.gae_lambda * nonterm * last_gae
            adv[t] = last_gae
        b_obs = torch.from_numpy(d["obs"].reshape(-1, OBS_DIM))
        b_act = torch.from_numpy(d["actions"].reshape(-1))
        b_logp = torch.from_numpy(d["logprobs"].reshape(-1))
        b_adv = torch.from_numpy(adv.reshape(-1).astype(np.float32))
        b_ret = b_adv + torch.from_numpy(values.reshape(-1))
        n, losses = b_obs.shape[0], []
        for _ in range(cfg.epochs):
            perm = torch.randperm(n)  # global torch RNG: restored by the engine's RNGState
            for start in range(0, n, cfg.minibatch_size):
                idx = perm[start : start + cfg.minibatch_size]
                dist = self.model.dist(b_obs[idx])
                ratio = torch.exp(dist.log_prob(b_act[idx]) - b_logp[idx])
                mb_adv = b_adv[idx]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = -torch.min(ratio * mb_adv, torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip) * mb_adv).mean()
                v_loss = 0.5 * ((self.model.get_value(b_obs[idx]) - b_ret[idx]) ** 2).mean()
                loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * dist.entropy().mean()
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                losses.append(loss.item())
        self.lr_scheduler.step()
        self.buffer.clear()
        self.progress.updates_done += 1
        self.progress.last_loss = float(np.mean(losses))
        return self.progress.last_loss

    def train_step(self) -> dict[str, Any]:
        """Collect one chunk of experience; run a PPO update when the buffer is full."""
        self._collect()
        self.progress.global_step += 1
        loss = self._update() if self.buffer.full else math.nan
        return {"avg_reward": self.progress.avg_reward, "loss": loss, "global_step": self.progress.global_step}

    def snapshot_metrics(self) -> dict[str, Any]:
        """The metrics a snapshot records: the last update's loss, not this step's (NaN at a step without an
        update: a reader of ``rl-ckpt ls`` takes that for a diverged run); no loss before the first update."""
        loss = self.progress.last_loss
        return {"avg_reward": self.progress.avg_reward, **({"loss": loss} if loss is not None else {})}

    def train(self, until_step: int, on_step: Callable[[int, dict[str, Any]], None] | None = None) -> None:
        if until_step < self.progress.global_step:
            raise ValueError(f"already at step {self.progress.global_step} > {until_step}")
        while self.progress.global_step < until_step:
            metrics = self.train_step()
            if on_step is not None:
                on_step(self.progress.global_step, metrics)


def param_digest(model: nn.Module) -> str:
    """sha256 over every state_dict tensor's raw bytes, in state_dict order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
