"""Ray actors used by the Ray tests (importable by workers through PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import torch

from rl_ckpt import CheckpointEngine, RNGState
from rl_ckpt._storage.local import LocalStorage


def loads_torch(pid: int) -> bool:
    """Whether process ``pid`` (on this machine) has torch's library mapped: it imported torch."""
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


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

    def __init__(
        self,
        base_dir: str,
        run_name: str,
        manager,
        rank: int,
        world_size: int,
        role: str,
        participants: list[str],
        nbytes: int = 64 * 1024,
        cfg: dict | None = None,
    ) -> None:
        torch.manual_seed(rank)
        self.model = torch.nn.Linear(64, 64)
        self.env = EnvShard(nbytes)
        self.engine = CheckpointEngine(
            base_dir=base_dir,
            run_name=run_name,
            manager=manager,
            rank=rank,
            world_size=world_size,
            role=role,
            participants=participants,
            **(cfg or {}),
        )
        if role == "learner":
            self.engine.register("policy", self.model)
        self.engine.register("env", self.env)
        self.engine.register("rng", RNGState())

    def save(self, step: int, kind: str = "full") -> str:
        self.env.set_step(step)
        with torch.no_grad():
            self.model.weight.fill_(float(step))
        return self.engine.save(step, metrics={"avg_reward": float(step)}, kind=kind).snapshot_id

    def resize(self, nbytes: int) -> None:
        """Its own state grows (or shrinks) to ``nbytes``: the next snapshot carries that much of it."""
        self.env.obs = np.zeros(nbytes // 4, dtype=np.float32)

    def save_async(self, step: int):
        self.env.set_step(step)
        return self.engine.save_async(step, metrics={"avg_reward": float(step)})

    def restore(self, light: bool = True) -> tuple:
        r = self.engine.restore(light=light)
        return r.snapshot_id, r.global_step, self.env.step, float(self.model.weight[0, 0])

    def beat(self, step: int) -> None:
        self.engine.beat(step)

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def hang(self) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: every thread stops, the heartbeat thread too

    def pid(self) -> int:
        return os.getpid()

    def bytes_sent(self) -> int:
        return self.engine.commit.bytes_sent

    def close(self) -> None:
        self.engine.close()


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
        return result.snapshot_id, float(self.model.weight[0, 0]), dict(result.skipped), dict(result.timings)


class GatedStorage(LocalStorage):
    """A local storage whose writes wait while its gate is closed (a slow or stuck disk, on demand)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()  # set once a write is waiting at the closed gate

    def _pass(self) -> None:
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait()

    def write(self, *args, **kwargs):
        self._pass()
        return super().write(*args, **kwargs)

    def write_atomic(self, *args, **kwargs):
        self._pass()
        return super().write_atomic(*args, **kwargs)

    def write_many_atomic(self, *args, **kwargs):
        self._pass()
        return super().write_many_atomic(*args, **kwargs)


class Unsaveable:
    """A value no codec takes (a user put a lock into their optimizer state)."""


class Rank:
    """A learner rank with a policy, an Adam optimizer and its RNG, saving through the manager.

    ``poison()`` puts a value that cannot be encoded into the optimizer state
    (written by rank 0 only: it is replicated state); ``rng=False`` leaves a
    rank > 0 with nothing of its own to save.
    """

    def __init__(
        self, base_dir: str, run_name: str, manager, rank: int, world: int, cfg: dict | None = None, rng: bool = True
    ) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 16)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.model(torch.ones(2, 16)).sum().backward()
        self.opt.step()
        self.storage = GatedStorage(os.path.join(base_dir, run_name))
        self.engine = CheckpointEngine(
            base_dir=base_dir,
            run_name=run_name,
            manager=manager,
            rank=rank,
            world_size=world,
            storage=self.storage,
            **(cfg or {}),
        )
        self.engine.register("policy", self.model)
        self.engine.register("optimizer", self.opt)
        if rng:
            self.engine.register("rng", RNGState())
        self.scheduler = self.engine.scheduler(start_step=0)
        self.handle = None
        self.failed_at: float | None = None

    def poison(self, on: bool = True) -> None:
        state = self.opt.state[self.model.weight]
        if on:
            state["note"] = Unsaveable()
        else:
            state.pop("note", None)

    def save(self, step: int) -> tuple:
        """(snapshot id or None, error text or None, CLOCK_MONOTONIC when it ended): comparable across processes."""
        try:
            sid = self.engine.save(step, metrics={"avg_reward": float(step)}).snapshot_id
            return sid, None, time.monotonic()
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}", time.monotonic()

    def save_async(self, step: int) -> None:
        self.failed_at = None
        self.ended = threading.Event()
        self.handle = self.engine.save_async(step, metrics={"avg_reward": float(step)})

        def ended(h) -> None:
            if h.exception() is not None:
                self.failed_at = time.monotonic()
            self.ended.set()

        self.handle.add_done_callback(ended)

    def wait(self) -> tuple:
        try:
            return self.handle.wait().snapshot_id, None, None
        except Exception as exc:
            self.ended.wait()  # the callback that took the time runs after waiters wake
            return None, f"{type(exc).__name__}: {exc}", self.failed_at

    def sched_step(self, step: int) -> bool:
        """The scheduler's decision at ``step``: True if it started a save."""
        return self.scheduler.step(step, metrics={"avg_reward": float(step)}) is not None

    def sched_wait(self) -> dict:
        self.engine.wait()
        return {
            "skipped": self.scheduler.skipped,
            "failures": self.scheduler.failures,
            "error": str(self.scheduler.last_error) if self.scheduler.last_error else None,
        }

    def beat(self, step: int) -> None:
        self.engine.beat(step)

    def close_gate(self) -> None:
        self.storage.held.clear()
        self.storage.gate.clear()

    def wait_held(self) -> bool:
        """Block until a write waits at the closed gate."""
        return self.storage.held.wait(120)

    def open_gate(self) -> None:
        self.storage.gate.set()

    def close(self) -> None:
        self.scheduler.close()
        self.engine.close()
