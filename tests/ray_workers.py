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


def ddp_train(config: dict) -> None:
    """A DDP (gloo) training loop that checkpoints through the manager and can SIGKILL itself once."""
    import hashlib

    import ray.train
    from torch.nn.parallel import DistributedDataParallel

    from rl_ckpt import TrainingProgress
    from rl_ckpt.integrations.ray_train import report

    rank = ray.train.get_context().get_world_rank()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # each rank draws its own data: the RNG state is per rank
    progress = TrainingProgress()
    engine = CheckpointEngine(base_dir=config["base_dir"], run_name=config["run_name"], manager=config["manager"],
                              save_interval_steps=config["every"], save_interval_seconds=None, keep_latest=3,
                              commit_timeout_seconds=15.0)
    engine.register("policy", model)
    engine.register("optimizer", opt)
    engine.register("progress", progress)
    engine.register("rng", RNGState())
    result = engine.restore()
    start = result.global_step
    if rank == 0 and config.get("log"):
        with open(config["log"], "a") as f:
            f.write(f"attempt restored={result.snapshot_id} step={start}\n")
    scheduler = engine.scheduler(start_step=start)
    for step in range(start + 1, config["steps"] + 1):
        x = torch.randn(16, 8)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        progress.global_step = step
        marker = config.get("crash_marker")
        if marker and rank == 1 and step == config["crash_at"] and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        scheduler.step(step, metrics={"loss": float(loss)})
        report({"loss": float(loss), "step": step}, engine)
    scheduler.close()
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        with open(config["out"], "w") as f:
            f.write(digest)
    engine.close()
