"""A restore across tiers through the memory tier's manager, in a fresh Ray actor each time: the manager's plan
with the versions of the target's files noted at its commit (it re-hashes nothing) against the same plan made by
a manager restarted since (nothing noted: it maps and re-hashes every file of the target), in turns.

    python benchmarks/memory_manager_plan.py [--size-mib 512] [--rounds 3]

Each round: a writer actor restores (the newest snapshot) and saves a new memory snapshot of ``--size-mib`` MiB
(one participant, committed through the memory manager); a fresh actor restores it (noted); the memory manager is
restarted (``ray.kill`` with restarts on); another fresh actor restores it (not noted). Prints each restore's
``plan_memory`` and total (``result.timings``) and the medians' ratio."""

import argparse
import statistics
import tempfile
import uuid

import ray
import torch


class Holder:
    """``size`` MiB of float32 in 8 MiB tensors, registered as one component."""

    def __init__(self, size_mib: int) -> None:
        self.tensors = [torch.zeros(2 << 20) for _ in range(max(1, size_mib // 8))]

    def state_dict(self) -> dict:
        return {f"t{i}": t for i, t in enumerate(self.tensors)}

    def load_state_dict(self, state: dict) -> None:
        for i, t in enumerate(self.tensors):
            t.copy_(state[f"t{i}"])


class Participant:
    def __init__(self, base_dir: str, run: str, durable_mgr, memory_mgr, size_mib: int, cfg: dict) -> None:
        from rl_ckpt import CheckpointEngine
        from rl_ckpt.integrations.memory_tier import MemoryTier

        engine = CheckpointEngine(
            base_dir=base_dir, run_name=run, manager=durable_mgr, role="learner", participants=["learner-0"], **cfg
        )
        self.tier = MemoryTier(engine, manager=memory_mgr)
        self.holder = Holder(size_mib)
        self.tier.register("state", self.holder)

    def restore(self) -> dict:
        result = self.tier.restore()
        return {"snapshot": result.snapshot_id, "tier": self.tier.tier_restored, **result.timings}

    def save(self, step: int) -> None:
        for t in self.holder.tensors:
            t.fill_(float(step))
        self.tier.save(step).wait()

    def close(self) -> None:
        self.tier.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from actors import CheckpointManager
    from actors.memory_tier import memory_manager, release_run
    from rl_ckpt.config import CheckpointConfig

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    base, run = tempfile.mkdtemp(), f"mplan-{uuid.uuid4().hex[:6]}"
    cfg = {"keep_latest": 1, "keep_best": 0, "memory_replicas": 0, "memory_flush_every": None}
    config = CheckpointConfig(base_dir=base, run_name=run, **cfg)
    durable_mgr = CheckpointManager.get_or_create(run_name=run, base_dir=base, config=cfg, healthz_port=None)
    memory_mgr = memory_manager(config)
    actor = ray.remote(num_cpus=0, max_restarts=0)(Participant)
    rows: dict[str, list[dict]] = {"noted": [], "restarted manager": []}

    def restore_in_a_fresh_actor() -> dict:
        p = actor.remote(base, run, durable_mgr, memory_mgr, args.size_mib, cfg)
        got = ray.get(p.restore.remote())
        ray.get(p.close.remote())
        ray.kill(p)
        return got

    for step in range(1, args.rounds + 1):
        writer = actor.remote(base, run, durable_mgr, memory_mgr, args.size_mib, cfg)
        ray.get(writer.restore.remote())
        ray.get(writer.save.remote(step))
        ray.get(writer.close.remote())
        ray.kill(writer)
        rows["noted"].append(restore_in_a_fresh_actor())
        ray.kill(memory_mgr, no_restart=False)  # restarted by Ray: it noted nothing
        ray.get(memory_mgr.run_url.remote(), timeout=120)
        rows["restarted manager"].append(restore_in_a_fresh_actor())
    print(f"{args.size_mib} MiB, one participant, fresh actors, {args.rounds} rounds (seconds):")
    med = {}
    for name, got in rows.items():
        assert all(g["tier"] == "memory" for g in got), got
        med[name] = {k: statistics.median(g[k] for g in got) for k in ("plan_memory", "total")}
        runs = ", ".join(f"{g['plan_memory']:.3f}/{g['total']:.3f}" for g in got)
        print(f"  {name:18s} plan_memory {med[name]['plan_memory']:.3f}  total {med[name]['total']:.3f}   [{runs}]")
    noted, again = med["noted"], med["restarted manager"]
    print(
        f"  noted / restarted manager: plan {noted['plan_memory'] / again['plan_memory']:.2f}x, "
        f"restore {noted['total'] / again['total']:.2f}x"
    )
    release_run(run, flush=False, force=True)
    ray.kill(durable_mgr, no_restart=True)


if __name__ == "__main__":
    main()
