"""Child side of the SIGKILL tests: saves in a loop and acknowledges each committed step."""

from __future__ import annotations

import os

import numpy as np
import torch


class StepState:
    """Every value is a function of the step, so a mixed or partial snapshot is visible."""

    def __init__(self, nbytes: int = 3 * 1024 * 1024) -> None:
        self.step = -1
        self.weight = torch.zeros(nbytes // 8, dtype=torch.float64)
        self.table = np.zeros(1024, dtype=np.int64)

    def set_step(self, step: int) -> None:
        self.step = step
        self.weight.fill_(step)
        self.table.fill(step)

    def state_dict(self) -> dict:
        return {"step": self.step, "weight": self.weight, "table": self.table}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.weight = state["weight"].clone()
        self.table = np.array(state["table"])

    def consistent_step(self) -> int:
        assert bool((self.weight == self.step).all()), "tensor from another step: mixed snapshot"
        assert bool((self.table == self.step).all()), "array from another step: mixed snapshot"
        return self.step


def save_loop(cfg: dict, start_step: int, conn) -> None:
    """Save steps start_step, start_step+1, ... forever; send b'<step>' after each commit."""
    torch.set_num_threads(1)
    from rl_ckpt import CheckpointEngine

    engine = CheckpointEngine(**cfg)
    a, b = StepState(), StepState(nbytes=256 * 1024)
    engine.register("model", a)
    engine.register("buffer", b)
    conn.send_bytes(b"ready")
    step = start_step
    while True:
        a.set_step(step)
        b.set_step(step)
        engine.save(step, metrics={"avg_reward": float(step)})
        conn.send_bytes(str(step).encode())  # a synchronous pipe write: the ACK survives our death
        step += 1
    os._exit(0)  # pragma: no cover


def retention_crash(cfg: dict, op: str, nth: int, partial: bool) -> None:
    """Commit steps 1..3 with keep_latest=2; SIGKILL ourselves at the nth `op` of step 3's retention."""
    import signal

    from rl_ckpt import CheckpointEngine
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import open_storage

    storage = FaultyStorage(open_storage(cfg["base_dir"] + "/" + cfg.get("run_name", "run")))
    engine = CheckpointEngine(**cfg, storage=storage)
    engine.register("model", StepState(nbytes=64 * 1024))
    for step in (1, 2):
        engine.components["model"].set_step(step)
        engine.save(step)

    def die() -> None:
        if partial:  # delete part of what is being removed first: a deletion cut short
            inner = storage.inner
            target = storage.ops[-1][1]
            for entry in inner.list(target)[:1]:
                (inner.remove_tree if entry.is_dir else inner.remove)(f"{target}/{entry.name}")
        os.kill(os.getpid(), signal.SIGKILL)

    storage.before(op, die, nth=nth)
    engine.components["model"].set_step(3)
    engine.save(3)
    os._exit(0)  # retention finished without reaching the kill point
