"""Shared test state: a PPO-like training state with every kind of component."""

from __future__ import annotations

import time

import random

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from rl_ckpt import CheckpointEngine, RNGState, TrainingProgress


class RolloutBuffer:
    """A rollout buffer with NumPy arrays, a tensor, and ragged episodes in an Arrow table."""

    def __init__(self, capacity: int = 64, obs_dim: int = 4) -> None:
        self.obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.advantages = torch.zeros(capacity, dtype=torch.float64)
        self.pos = 0
        self.episodes: list[list[float]] = []

    def add(self, obs, action, adv) -> None:
        self.obs[self.pos], self.actions[self.pos], self.advantages[self.pos] = obs, action, adv
        self.pos += 1

    def state_dict(self) -> dict:
        table = pa.table({"rewards": pa.array(self.episodes, type=pa.list_(pa.float64()))})
        return {
            "obs": self.obs,
            "actions": self.actions,
            "advantages": self.advantages,
            "pos": self.pos,
            "episodes": table,
            "ptr": np.int64(self.pos),
        }

    def load_state_dict(self, state: dict) -> None:
        self.obs = np.array(state["obs"])
        self.actions = np.array(state["actions"])
        self.advantages = state["advantages"].clone()
        self.pos = state["pos"]
        self.episodes = state["episodes"].column("rewards").to_pylist()


class PPOState:
    """Policy + value MLPs, Adam, StepLR, RNGs (incl. a NumPy Generator), progress and a buffer."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.policy = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
        self.value = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
        params = list(self.policy.parameters()) + list(self.value.parameters())
        self.optimizer = torch.optim.Adam(params, lr=3e-3, betas=(0.9, 0.99))
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        self.explore = np.random.default_rng(seed + 100)
        self.rng = RNGState(numpy_generators={"explore": self.explore})
        self.progress = TrainingProgress(global_step=0, epoch=0)
        self.replay_buffer = RolloutBuffer()

    def components(self) -> dict:
        return {
            "policy": self.policy,
            "value": self.value,
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "rng": self.rng,
            "progress": self.progress,
            "replay_buffer": self.replay_buffer,
        }

    def register(self, engine: CheckpointEngine) -> CheckpointEngine:
        for name, obj in self.components().items():
            engine.register(name, obj)
        return engine

    def train_step(self) -> float:
        obs = torch.randn(16, 4)
        noise = float(np.random.rand()) + random.random() + float(self.explore.normal())
        loss = self.policy(obs).pow(2).mean() + self.value(obs).pow(2).mean() * (1 + noise * 1e-3)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.progress.global_step += 1
        self.progress.samples_seen += 16
        if self.replay_buffer.pos < 64:
            self.replay_buffer.add(obs[0].numpy(), int(self.explore.integers(2)), float(loss.detach()))
        self.replay_buffer.episodes.append([float(x) for x in obs[0][: 1 + self.progress.global_step % 3]])
        return float(loss.detach())

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.train_step()


def tensors_of(state: PPOState) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("policy", "value"):
        for k, v in getattr(state, name).state_dict().items():
            out[f"{name}.{k}"] = v
    for pid, st in state.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt.{pid}.{k}"] = v
    return out


def assert_same_state(a: PPOState, b: PPOState) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert a.optimizer.state_dict()["param_groups"] == b.optimizer.state_dict()["param_groups"]
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()
    assert a.progress.state_dict() == b.progress.state_dict()
    assert np.array_equal(a.replay_buffer.obs, b.replay_buffer.obs)
    assert np.array_equal(a.replay_buffer.actions, b.replay_buffer.actions)
    assert torch.equal(a.replay_buffer.advantages, b.replay_buffer.advantages)
    assert a.replay_buffer.pos == b.replay_buffer.pos and a.replay_buffer.episodes == b.replay_buffer.episodes


def next_draws() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


class Bag:
    """A Checkpointable holding whatever state a test hands it."""

    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def wait_until(predicate, what: str, timeout: float = 120.0):
    """Wait for an event seen through ``predicate`` (polled); fail naming ``what`` after a generous bound."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
