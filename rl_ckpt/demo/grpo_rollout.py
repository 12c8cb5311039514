"""The sharded GRPO demo's rollout side: plain Ray actors, no process group, sampling with the policy of a
committed snapshot (``rl_ckpt.demo.sharded_grpo`` has the learners and the run).

Before a rollout an actor gets the snapshot's whole policy into an ordinary ``nn.Module``: one
``engine.load_full_weights`` call (the snapshot durable or in memory, ``source`` says where), or, when the
learners publish policy versions, a pull of only the chunks that changed since the version it holds.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rl_ckpt.demo.grpo import GRPOConfig, make_policy, sample

log = logging.getLogger("rl_ckpt")


class RolloutActor:
    """A Ray actor sampling answers with the policy of a committed snapshot (full weights, no process group).

    Each call names where the snapshot lives (``source``: base_dir, run_name, storage_options: a durable run
    folder or a run's ``raymem://`` memory tier), so one set of actors can serve several runs and both tiers."""

    def __init__(self, grpo: dict) -> None:
        torch.set_num_threads(1)
        self.cfg = GRPOConfig(**grpo)
        self.model = make_policy(self.cfg).eval()  # its weights all come from the snapshot
        self.engines: dict[str, Any] = {}
        self.loaded: str | None = None
        self.loads = 0
        self.subs: dict[str, Any] = {}  # versions run -> WeightSubscriber
        self.moved = {"full": 0, "delta": 0, "pulls": 0}

    def _engine(self, source: dict):
        from rl_ckpt import CheckpointEngine

        key = f"{source['base_dir'].rstrip('/')}/{source['run_name']}"
        if key not in self.engines:
            options = source.get("storage_options")
            self.engines[key] = CheckpointEngine(
                base_dir=source["base_dir"],
                run_name=source["run_name"],
                retention=False,
                **({"storage_options": options} if options else {}),
            )
        return self.engines[key]

    def rollout(self, source: dict, snapshot_id: str, step: int, indices: list[int]) -> dict:
        """Answers to prompts ``indices`` of ``step``, sampled with the policy of ``snapshot_id`` in ``source``."""
        key = f"{source['base_dir'].rstrip('/')}/{source['run_name']}/{snapshot_id}"
        if key != self.loaded:
            if source.get("versions") and self._pull(source["versions"], snapshot_id):
                pass
            else:
                self._engine(source).load_full_weights("policy", self.model, snapshot_id)
            self.loaded = key
            self.loads += 1
        out = {k: v.numpy() for k, v in sample(self.model, self.cfg, step, indices).items()}
        return {**out, "snapshot": snapshot_id}

    def _pull(self, run: str, snapshot_id: str) -> bool:
        """The policy version of ``snapshot_id``'s step (the learners publish one per snapshot): only the chunks
        that changed since the version held move (the first pull moves all)."""
        from actors.weight_subscriber import WeightSubscriber
        from rl_ckpt._format.manifest import parse_snapshot_id

        from rl_ckpt.errors import CheckpointError

        sub = self.subs.get(run) or self.subs.setdefault(run, WeightSubscriber(run))
        first = sub.version is None
        try:
            got = sub.pull(self.model, parse_snapshot_id(snapshot_id)[0])
        except CheckpointError as exc:  # e.g. every copy lost with a node: the snapshot itself is still there
            log.warning("rollout actor: policy version of %s not pulled (%s); loading the snapshot", snapshot_id, exc)
            self.subs.pop(run, None)
            return False
        self.moved["full" if first else "delta"] += got.bytes_moved
        self.moved["pulls"] += 1
        return True

    def stats(self) -> dict:
        return {"loads": self.loads, "loaded": self.loaded, "moved": dict(self.moved)}

    def reset(self) -> None:
        """Forget the runs served so far (their engines closed, the load count back to 0)."""
        for engine in self.engines.values():
            engine.close()
        self.engines, self.loaded, self.loads = {}, None, 0
        self.subs, self.moved = {}, {"full": 0, "delta": 0, "pulls": 0}


def memory_source(config) -> dict:
    """Where a run's memory snapshots are, for the rollout actors."""
    from rl_ckpt.integrations.memory_tier import MEMORY_BASE, memory_options

    return {"base_dir": MEMORY_BASE, "run_name": config.run_name, "storage_options": memory_options(config)}


def start_actors(grpo: GRPOConfig, n_actors: int, actor_options: dict | None = None) -> list:
    """``n_actors`` rollout actors (``num_cpus=0``; ``actor_options``: e.g. resources pinning them)."""
    import ray

    actor_cls = ray.remote(num_cpus=0)(RolloutActor)
    return [actor_cls.options(**(actor_options or {})).remote(grpo.to_json()) for _ in range(n_actors)]
