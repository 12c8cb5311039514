"""The Ray PPO demo's rollout workers: Ray actors holding CartPole envs, acting with the weights they are sent.

Each is a checkpoint participant ``rollout-<i>`` (env state, action-sampling RNG, and the copy of the policy it
acts with: the learners' bytes, which dedup stores once) and a :class:`~actors.rollout_pool.ScopedWorker`: lost,
it is recovered alone by the learners' :class:`~actors.rollout_pool.RolloutPool` (``rejoin`` takes back its state
from its newest snapshot, memory tier first; ``replay`` runs the collects since with the weights of their steps).
A worker is deterministic given its state and the weights it is sent: its envs reset with seeds, its actions come
from its own torch RNG stream, both in its snapshot.

A worker built with ``index=None`` is a warm standby: its process, imports and envs' module are ready, and
``assume(index)`` makes it participant ``rollout-<index>`` (engine built and registered) in a fraction of a Ray
actor restart.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from actors.rollout_pool import ScopedWorker
from rl_ckpt import CheckpointEngine, RNGState, TrainingProgress
from rl_ckpt.demo.faults import fires, kill_self, log_event
from rl_ckpt.demo.ppo import ActorCritic, EnvState, PPOConfig
from rl_ckpt.demo.ray_tier import last_beat, memory_tier
from rl_ckpt.errors import CheckpointError

log = logging.getLogger("rl_ckpt")


class RolloutWorker(ScopedWorker):
    """A Ray actor holding envs; collects experience with the weights it is sent (see the module docstring)."""

    def __init__(
        self,
        index: int | None,
        ppo: dict,
        engine_cfg: dict,
        manager,
        participants: list[str],
        memory: dict | None = None,
        faults: list[dict] | None = None,
        log_path: str | None = None,
    ) -> None:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        self.cfg = PPOConfig(**ppo)
        self.engine_cfg, self.manager, self.participants, self.memory = engine_cfg, manager, participants, memory
        self.faults, self.log_path = faults or [], log_path
        self.index: int | None = None
        self.pending = None
        self.ready = False  # set by restore() / rejoin(): a worker Ray restarted must not serve fresh state
        if index is not None:
            self._become(index)

    def _become(self, index: int) -> None:
        """Participant ``rollout-<index>`` in its initial state (seeded by the index)."""
        cfg = self.cfg
        self.index = index
        torch.manual_seed(cfg.seed * 1000 + 17 + index)  # this worker's action-sampling stream
        self.envs = EnvState(cfg.num_envs, cfg.seed * 1000 + index)
        self.model = ActorCritic(tuple(cfg.hidden_sizes))
        self.collects = TrainingProgress()  # collects done: each batch is tagged with its number (the audit)
        self.engine = CheckpointEngine(
            **self.engine_cfg,
            manager=self.manager,
            rank=index,
            world_size=1,
            role="rollout",
            participants=self.participants,
        )
        self.tier = memory_tier(self.engine, self.memory, service=False)
        front = self.tier or self.engine
        front.register("policy", self.model)  # the weights it acts with
        front.register("env", self.envs)
        front.register("rng", RNGState())
        front.register("collects", self.collects, replicated=False)

    def identity(self) -> int | None:
        """The index of the worker it is (None: a standby not used yet)."""
        return self.index

    @property
    def name(self) -> str:
        return f"rollout-{self.index}"

    def assume(self, index: int) -> str:
        """A standby takes the identity of lost worker ``index``; ``rejoin`` then gives it that worker's state."""
        if self.index is not None:
            raise CheckpointError(f"{self.name} is not a standby: it cannot become rollout-{index}")
        self._become(index)
        return self.name

    def _check_ready(self) -> None:
        if not self.ready:
            raise CheckpointError(
                f"rollout worker {self.index} was restarted and has not restored its state; "
                "the learners must restore it first (the attempt fails and Ray Train recovers)"
            )

    @torch.no_grad()
    def collect(self, weights: dict, steps: int, global_step: int) -> dict:
        self._check_ready()
        self.engine.beat(global_step)
        self.model.load_state_dict(weights)
        rows: dict[str, list] = {k: [] for k in ("obs", "actions", "logprobs", "rewards", "dones", "values")}
        finished: list[float] = []
        for t in range(steps):
            fault = fires(self.faults, self.name, global_step + 1, t)
            if fault is not None:  # mid-rollout: part of this step's experience collected, then gone
                self._die(fault, global_step)
            obs = self.envs.obs.copy()
            obs_t = torch.from_numpy(obs)
            dist = self.model.dist(obs_t)
            action = dist.sample()
            rows["obs"].append(obs)
            rows["actions"].append(action.numpy())
            rows["logprobs"].append(dist.log_prob(action).numpy())
            rows["values"].append(self.model.get_value(obs_t).numpy())
            rewards, dones, done_returns = self.envs.step(action.numpy())
            rows["rewards"].append(rewards)
            rows["dones"].append(dones)
            finished += done_returns
        out = {k: np.stack(v) for k, v in rows.items()}
        out["next_obs"] = self.envs.obs.copy()
        out["finished"] = finished
        out["collect"] = self.collects.global_step  # which of this worker's batches this is (0, 1, ...)
        self.collects.global_step += 1
        return out

    def _die(self, fault: dict, global_step: int) -> None:
        """The fault: SIGKILL this worker during step ``global_step + 1`` (its collect, or its save)."""
        last_beat(self.engine, global_step)  # the manager knows how far it got (a group restart names the step)
        if self.log_path:
            log_event(self.log_path, {"event": "kill", "step": global_step + 1, "target": self.name, "fault": fault})
        kill_self()

    def save(self, step: int, kind: str = "full") -> None:
        """Stage now (the state as of this call), persist in the background; same step and kind as the learners."""
        self._check_ready()
        self._settle()  # one in flight
        fault = fires(self.faults, self.name, step, "save")
        if fault is not None:  # before its part of the snapshot: the run's manager waits for it
            self._die(fault, step - 1)
        self.pending = self.tier.save(step) if self.tier is not None else self.engine.save_async(step, kind=kind)

    def _settle(self) -> None:
        """Wait for the save in flight. Its failure is the snapshot's (the manager aborted it for every
        participant and the learners' schedulers report it): logged here, it must not stop later saves."""
        if self.pending is not None:
            try:
                self.pending.wait()
            except CheckpointError as exc:
                log.warning("rollout worker %d: save failed: %s", self.index, exc)
            self.pending = None

    def restore(self, light: bool = False) -> tuple:
        """A group restart: every participant restores the snapshot the run's plan chose."""
        self.pending = None
        result = self.tier.restore() if self.tier is not None else self.engine.restore(light=light)
        self.ready = True
        return result.snapshot_id, result.global_step

    def rejoin(self) -> dict:
        """Scoped recovery (a replacement for this worker): its own newest snapshot, memory tier first."""
        self.pending = None
        started = time.monotonic()
        result = (self.tier or self.engine).rejoin()
        self.ready = True
        tier = (self.tier.tier_restored if self.tier is not None else "durable") if result.snapshot_id else None
        return {
            "snapshot_id": result.snapshot_id,
            "step": result.global_step if result.snapshot_id else None,
            "tier": tier,
            "skipped": {sid: why[:300] for sid, why in result.skipped.items()},
            "seconds": time.monotonic() - started,
        }

    def close(self) -> None:
        """A clean end: the manager forgets this participant (its silence is no lost heartbeat)."""
        if self.index is None:
            return
        self._settle()
        (self.tier or self.engine).close()
