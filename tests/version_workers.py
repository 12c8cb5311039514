"""Learners and rollout workers for the policy-version Ray tests (importable by workers through PYTHONPATH)."""

from __future__ import annotations

import hashlib
import os

import torch

LAYER = 512  # a Linear(LAYER, LAYER) weight is LAYER * LAYER * 4 bytes (1 MiB: its chunks are borrowed at publish)


def make_policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(LAYER, LAYER),
        torch.nn.Linear(LAYER, LAYER),
        torch.nn.Linear(LAYER, LAYER),
        torch.nn.LayerNorm(LAYER),
    )


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def change(model: torch.nn.Module, version: int) -> None:
    """The update that makes ``version``: every layer at 1 and 3, only layer 1's weight otherwise."""
    with torch.no_grad():
        if version in (1, 3):
            for p in model.parameters():  # scalar ops: the same on plain tensors and FSDP2 shards
                p.mul_(0.9).add_(0.001 * version)
        else:
            model[1].weight.mul_(0.5)


class Learner:
    """A replicated learner (plain module, same weights on every rank) or an FSDP2 one (``world`` > 1 with a
    gloo group at ``master``)."""

    def __init__(self, run: str, rank: int, world: int, namespace: str, master: str | None = None) -> None:
        from actors.policy_versions import PolicyVersions

        torch.set_num_threads(1)
        self.model = make_policy()
        if master is not None:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world)
            fully_shard(self.model, mesh=init_device_mesh("cpu", (world,)))
        self.versions = PolicyVersions(
            run, self.model, keep=3, replicas=0, rank=rank, world_size=world, namespace=namespace
        )

    def publish(self, version: int) -> tuple[str | None, str]:
        """Make ``version`` (the same update on every rank) and publish it; returns (snapshot id, digest of the
        full weights)."""
        change(self.model, version)
        sid = self.versions.publish(version)
        return sid, digest(self.full_state())

    def placed(self) -> dict:
        """node -> bytes this learner's publishes placed in that node's store, so far (once they landed: a publish
        returns before)."""
        assert self.versions.wait_placed(timeout=120)
        return dict(self.versions.storage.placed)

    def wait_placed(self) -> bool:
        return self.versions.wait_placed(timeout=120)

    def pid(self) -> int:
        return os.getpid()

    def full_state(self) -> dict:
        from torch.distributed.tensor import DTensor

        return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        self.versions.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class Rollout:
    """A rollout worker: a plain module and a ``WeightSubscriber``; knows nothing of the learners."""

    def __init__(self, namespace: str) -> None:
        torch.set_num_threads(1)
        self.namespace = namespace
        self.runs: dict = {}  # run -> (module, subscriber): one worker serves the runs of several scenarios

    def _of(self, run: str):
        from actors.weight_subscriber import WeightSubscriber

        if run not in self.runs:  # its weights all come from the versions
            self.runs[run] = (make_policy(seed=99), WeightSubscriber(run, namespace=self.namespace))
        return self.runs[run]

    def pull(self, run: str, version="latest") -> dict:
        model, sub = self._of(run)
        result = sub.pull(model, version)
        return {
            **result.to_json(),
            "digest": digest(model.state_dict()),
            "node": sub.storage.node_id,
            "pid": os.getpid(),
        }

    def try_pull(self, run: str, version) -> dict:
        try:
            return self.pull(run, version)
        except Exception as exc:  # the error, as the worker sees it
            return {"error": type(exc).__name__, "message": str(exc), "fields": getattr(exc, "fields", {})}

    def status(self, run: str) -> dict:
        return self._of(run)[1].status()
