"""A participant with a memory tier, for the memory-tier Ray tests (importable by workers through PYTHONPATH)."""

from __future__ import annotations

import hashlib
import os
import signal

import numpy as np
import torch

from rl_ckpt import CheckpointEngine, RNGState


class Shard:
    """A participant's own state (env buffer): filled from the global torch RNG, so it depends on history."""

    def __init__(self, nbytes: int) -> None:
        self.data = np.zeros(nbytes // 4, dtype=np.float32)

    def state_dict(self) -> dict:
        return {"data": self.data}

    def load_state_dict(self, state: dict) -> None:
        self.data = np.array(state["data"])


class MemParticipant:
    """Trains a tiny model plus a shard, memory snapshots through the memory manager, restores across tiers."""

    def __init__(
        self,
        base_dir: str,
        run_name: str,
        durable_mgr,
        memory_mgr,
        rank: int,
        participants: list[str],
        cfg: dict,
        nbytes: int = 256 * 1024,
    ) -> None:
        from rl_ckpt.integrations.memory_tier import MemoryTier

        torch.manual_seed(1000 + rank)
        self.model = torch.nn.Linear(32, 32)
        self.shard = Shard(nbytes)
        engine = CheckpointEngine(
            base_dir=base_dir,
            run_name=run_name,
            manager=durable_mgr,
            rank=rank,
            world_size=len(participants),
            role="rollout",
            participants=participants,
            **cfg,
        )
        self.tier = MemoryTier(engine, manager=memory_mgr)
        self.tier.register("policy", self.model)
        self.tier.register("shard", self.shard)
        self.tier.register("rng", RNGState())
        self.step = 0

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def train_to(self, last: int) -> list[str]:
        """Train steps step+1..last; a memory snapshot whenever one is due (each finished before the next)."""
        saved = []
        while self.step < last:
            self.step += 1
            with torch.no_grad():
                self.model.weight.add_(torch.randn(32, 32) * 0.01)
            self.shard.data += torch.rand(self.shard.data.size).numpy()
            handle = self.tier.maybe_save(self.step)
            if handle is not None:
                saved.append(handle.wait().snapshot_id)
        return saved

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(self.model.weight.detach().numpy().tobytes())
        h.update(self.model.bias.detach().numpy().tobytes())
        h.update(self.shard.data.tobytes())
        h.update(torch.get_rng_state().numpy().tobytes())
        return h.hexdigest()

    def restore(self) -> dict:
        result = self.tier.restore()
        self.step = result.global_step
        return {
            "tier": self.tier.tier_restored,
            "snapshot": result.snapshot_id,
            "step": result.global_step,
            "reason": result.warnings[0] if result.warnings else "",
            "digest": self.digest(),
        }

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        self.tier.close()
