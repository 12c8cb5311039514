"""Ray actors used by the Ray tests (importable by workers through PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import torch

from rl_ckpt import CheckpointEngine, RNGState


class EnvShard:
    """A rollout worker's env state and buffer slice: values derived from the step."""

    def __init__(self, nbytes: int) -> None:
        self.obs = np.zeros(nbytes // 4, dtype=np.float32)
        self.step = -1

    def set_step(self, step: int) -> None:
        self.step = step
        self.obs.fill(step)

    def state_dict(self) -> dict:
        return {"obs": self.obs, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.obs = np.array(state["obs"])
        self.step = state["step"]


class Participant:
    """A learner rank or rollout worker that checkpoints through the manager."""

    def __init__(self, base_dir: str, run_name: str, manager, rank: int, world_size: int, role: str,
                 participants: list[str], nbytes: int = 64 * 1024, cfg: dict | None = None) -> None:
        torch.manual_seed(rank)
        self.model = torch.nn.Linear(64, 64)
        self.env = EnvShard(nbytes)
        self.engine = CheckpointEngine(base_dir=base_dir, run_name=run_name, manager=manager, rank=rank,
                                       world_size=world_size, role=role, participants=participants, **(cfg or {}))
        if role == "learner":
            self.engine.register("policy", self.model)
        self.engine.register("env", self.env)
        self.engine.register("rng", RNGState())

    def save(self, step: int) -> str:
        self.env.set_step(step)
        with torch.no_grad():
            self.model.weight.fill_(float(step))
        return self.engine.save(step, metrics={"avg_reward": float(step)}).snapshot_id

    def save_async(self, step: int):
        self.env.set_step(step)
        return self.engine.save_async(step, metrics={"avg_reward": float(step)})

    def restore(self) -> tuple:
        r = self.engine.restore()
        return r.snapshot_id, r.global_step, self.env.step, float(self.model.weight[0, 0])

    def beat(self, step: int) -> None:
        self.engine.beat(step)

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def hang(self) -> None:
        time.sleep(3600)

    def pid(self) -> int:
        return os.getpid()

    def bytes_sent(self) -> int:
        return self.engine.commit.bytes_sent



class GlooLearner:
    """A learner rank in a real torch.distributed gloo group, checkpointing through the manager."""

    def __init__(self, base_dir: str, run_name: str, manager, rank: int, world: int, init: str) -> None:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 16)
        self.rank = rank
        torch.manual_seed(100 + rank)
        self.engine = CheckpointEngine(base_dir=base_dir, run_name=run_name, manager=manager, keep_latest=5)
        self.engine.register("policy", self.model)
        self.engine.register("rng", RNGState())

    def save(self, step: int) -> str:
        with torch.no_grad():
            self.model.weight.fill_(float(step))
        torch.rand(3)  # move this rank's RNG
        return self.engine.save(step).snapshot_id

    def restore(self) -> tuple:
        result = self.engine.restore()
        return result.snapshot_id, float(self.model.weight[0, 0]), dict(result.skipped)
