"""GRPO with FSDP2 learners on Ray Train and rollout actors fed from sharded snapshots.

- Learners: Ray Train v2 ``TorchTrainer`` ranks (gloo). The tiny GPT-2 policy
  is sharded with FSDP2 (``fully_shard`` per block and at the root) over all
  ranks; policy, Adam state, each rank's RNG and the progress go into one
  snapshot every ``save_every`` steps, each rank writing only its own shards
  (the run's ``CheckpointManager`` commits).
- Rollout actors: plain Ray actors, no process group. Before a rollout an
  actor loads the whole policy from the newest snapshot (durable or in
  memory) into an ordinary ``nn.Module`` with one ``engine.load_full_weights``
  call, samples, and returns answers with their log-probs; the learners'
  update is the clipped GRPO objective against those log-probs
  (``rl_ckpt.demo.grpo_rollout``).
- Prompts: rows of a Hugging Face dataset; every rank draws the step's global
  batch of ids from the same ``PromptSampler`` and a ``ConsumptionAuditor``
  records what each update trained on, both in the snapshot (replicated).
- A lost rollout actor costs the learners only the wait for its part: each rank
  calls its actors through a ``RolloutPool``; the actor is replaced (Ray's
  restart, or a warm standby: ``Run.fit(standbys=)``) and its task, a function
  of its arguments (step, prompts, snapshot), issued again whole; nothing rolls
  back. Faults: ``Run.fit(faults=)`` (``rl_ckpt.demo.faults``).
- Rank ``r`` of ``n`` learns on its slice of every step's global batch, so the
  data, and the mean of the gradients FSDP reduces, do not depend on ``n``: a
  run restored on fewer learners goes on with the same math.
- With the memory tier (``Run.start(memory_tier=...)``) each learner rank puts
  its own shards into a memory snapshot instead (``MemoryTier``, committed by
  the memory manager) and ``MemoryTierService`` makes the durable copies.

``Run.fit`` starts one attempt (``TorchTrainer.fit``) on some number of
learners; ``rl_ckpt.demo.sharded_drill`` SIGKILLs a learner mid-run and
restarts the run on fewer. Every event goes to a JSON-lines log the summary is
computed from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any

import torch

from rl_ckpt.demo.digests import batch_digest, gathered, weights_digest
from rl_ckpt.demo.grpo import GRPOConfig, Progress, make_policy, update
from rl_ckpt.demo.chaos import damage_version, strike
from rl_ckpt.demo.faults import fires, log_event
from rl_ckpt.demo.grpo_rollout import (
    current_actors,
    memory_source,
    RolloutActor,
    rollout_pool,
    start_actors,
)
from rl_ckpt.demo.ray_tier import standbys_of, start_standby

ENGINE_DEFAULTS = {"keep_latest": 4, "keep_best": 0, "commit_timeout_seconds": 60.0}


def shard_policy(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """FSDP2 over a 1-D CPU mesh of all ranks: each transformer block is one unit, the rest the root's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def actors_of(rank: int, world: int, n_actors: int) -> list[int]:
    """The rollout actors rank ``rank`` asks (every actor serves some rank; a rank with none borrows one)."""
    return [j for j in range(n_actors) if j % world == rank] or [rank % n_actors]


def _split(items: list, parts: int) -> list[list]:
    return [items[i * len(items) // parts : (i + 1) * len(items) // parts] for i in range(parts)]


def learner_loop(config: dict) -> None:
    """The Ray Train train function: restore from any layout, then rollout -> GRPO update -> save every k steps.

    With ``config["memory"]`` (the memory manager, the service and the ``memory_*`` config keys) each rank puts
    its own shards into a memory snapshot every ``memory_interval_steps`` through a ``MemoryTier`` (the
    service makes the durable copies) and the restore is across tiers; otherwise the learners save durable
    snapshots every ``save_every`` steps.
    """
    import numpy as np
    import ray
    import ray.train

    from rl_ckpt import CheckpointEngine, RNGState
    from rl_ckpt.demo.ray_tier import last_beat

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = GRPOConfig(**config["grpo"])
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} is not divisible by {world} learners")
    model = shard_policy(make_policy(cfg), world)
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    progress = Progress()
    memory = config.get("memory")
    options = {"storage_options": config["storage_options"]} if config.get("storage_options") else {}
    engine = CheckpointEngine(
        base_dir=config["base_dir"],
        run_name=config["run_name"],
        manager=config["manager"],
        train_config=cfg.to_json(),
        **options,
        **(memory["cfg"] if memory else {}),
    )
    tier = None
    if memory:
        from rl_ckpt.integrations.memory_tier import MemoryTier

        tier = MemoryTier(engine, manager=memory["manager"], service=memory["service"])
    saver = tier or engine
    saver.register("policy", model)
    versions = None
    if config.get("versions"):  # the rollout actors get the policy as versions (every rank publishes its shards)
        from actors.policy_versions import PolicyVersions

        versions = PolicyVersions(config["run_name"], model, keep=4, replicas=1)  # a node lost keeps them
    saver.register("optim", optim)
    saver.register("rng", RNGState())
    saver.register("progress", progress)
    # The data position and what was trained on: replicated (the same on every rank), in the same snapshot.
    from rl_ckpt.data import ConsumptionAuditor, PromptSampler

    sampler = PromptSampler(cfg.dataset_size, seed=cfg.seed)
    audit_log = audit_log_path(config["log"])
    auditor = ConsumptionAuditor(cfg.dataset_size, log_path=audit_log if rank == 0 else None)
    saver.register("sampler", sampler)
    saver.register("auditor", auditor)
    started = time.monotonic()
    result = saver.restore()
    restore_seconds = time.monotonic() - started
    start = result.global_step
    tier_name = (tier.tier_restored if tier is not None else "durable") if result.snapshot_id else None
    durable_source = {"base_dir": config["base_dir"], "run_name": config["run_name"], **options}
    source = memory_source(engine.config) if tier_name == "memory" else durable_source
    newest = result.snapshot_id
    if newest is None:  # a fresh run: the rollout actors need weights to act with
        newest, source = save(tier, engine, 0), memory_source(engine.config) if tier else durable_source
    if versions is not None:  # versions of the failed timeline go; the restored step is (re)published
        versions.rewind(parse_step(newest))
        versions.publish(parse_step(newest))
        source = {**source, "versions": config["run_name"]}
    if rank == 0:
        plan = result.plan
        saved_by = {}
        if result.snapshot_id is not None:  # who wrote the restored policy, as its manifest says
            from rl_ckpt._run.snapshot_files import read_manifest

            storage = tier.memory.storage if tier_name == "memory" else engine.storage
            section = read_manifest(storage, result.snapshot_id).components.get("policy") or {}
            saved_by = (section.get("layout") or {}).get("saved_by", {})
        log_event(
            config["log"],
            {
                "event": "attempt",
                "world": world,
                "restored": result.snapshot_id,
                "step": start,
                "tier": tier_name,
                "restore_seconds": restore_seconds,
                "restore_timings": dict(result.timings),  # where the restore's time went (plan, read, ...)
                "target": plan.target if plan else None,
                "continue": plan.continue_from_step if plan else None,
                "saved_by": saved_by,
                "plan": str(plan) if plan else "",
                "layout": plan.layout if plan else "",
            },
        )
    actors = current_actors(config["actors"], config["run_name"]) if config.get("standbys") else config["actors"]
    ids = actors_of(rank, world, len(actors))
    tasks: dict[str, dict] = {}  # rollout-<j> -> its task of the step in progress (what a recovery redid)
    pool = rollout_pool(config, rank, [actors[j] for j in ids], [f"rollout-{j}" for j in ids], tasks)
    crash = config.get("crash") or {}
    faults = config.get("faults")
    for step in range(start + 1, config["steps"] + 1):
        fault = fires(faults, f"learner-{rank}", step)
        if (step == crash.get("step") and rank == world - 1) or fault is not None:
            last_beat(engine, step - 1)  # the failure the manager records names the last step done
            killed = {"step": step, "last_done": step - 1, "rank": rank, "world": world, "fault": fault}
            log_event(config["log"], {"event": "kill", "target": f"learner-{rank}", **killed})
            os.kill(os.getpid(), signal.SIGKILL)  # a lost learner: no cleanup, no goodbye
        pairs = sampler.take(cfg.prompts_per_step)  # (epoch, prompt id): the global batch, on every rank
        mine = pairs[rank * cfg.prompts_per_step // world : (rank + 1) * cfg.prompts_per_step // world]
        calls = []
        for j, part in zip(ids, _split(mine, len(ids))):  # one task per actor: the unit issued again if it is lost
            name = f"rollout-{j}"
            tasks[name] = {"step": step, "snapshot": newest, "prompts": [list(p) for p in part]}
            aimed = [f for f in faults or () if f["target"] == name and f["step"] == step]
            calls.append((source, newest, step, [p for _, p in part], aimed, config["log"]))
        parts = pool.call("rollout", calls, step=step, record=False)  # stateless calls: nothing to journal
        batch = {k: torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in ("seqs", "logps", "rewards")}
        rollouts = gathered(batch_digest(batch), world)  # every rank's rollouts of this step, bitwise
        loss = update(model, optim, batch, cfg)
        reward = batch["rewards"].mean().reshape(1)
        torch.distributed.all_reduce(reward)  # equal slices: the mean of the ranks' means is the global mean
        progress.record(step, float(reward) / world)
        auditor.record(step, pairs)
        engine.beat(step)  # rate-limited: what the manager knows of this rank's progress
        saved = None
        if (tier.due(step) if tier else step % config["save_every"] == 0) or step == config["steps"]:
            saved = newest = save(tier, engine, step)
            source = memory_source(engine.config) if tier else durable_source
            if versions is not None:
                versions.publish(step)
                source = {**source, "versions": config["run_name"]}
        if rank == 0 and faults:  # the chaos drill's faults that are not a participant's own death
            memory_storage = tier.memory.storage if tier is not None else None
            damage = (lambda f: damage_version(config["run_name"])) if versions is not None else None
            strike(faults, config["log"], step, manager=config["manager"], memory=memory_storage, damage=damage)
        if rank == 0:
            log_event(
                config["log"],
                {
                    "event": "step",
                    "step": step,
                    "world": world,
                    "reward": progress.rewards[-1],
                    "loss": loss,
                    "rollout_snapshot": parts[0]["snapshot"],
                    "rollouts": rollouts,
                    "saved": saved,
                },
            )
    digest = weights_digest(model)  # a collective: every rank takes part
    if rank == 0:
        from rl_ckpt.data import replay_log

        log_event(
            config["log"],
            {
                "event": "done",
                "step": progress.global_step,
                "world": world,
                "reward": progress.rewards[-1] if progress.rewards else None,
                "digest": digest,
            },
        )
        log_event(
            config["log"],
            {
                "event": "audit",
                **auditor.report(complete_below=sampler.epoch).to_json(),
                "replayed": replay_log(audit_log, cfg.dataset_size).report(complete_below=sampler.epoch).to_json(),
            },
        )
    if versions is not None:
        versions.close()
    saver.close()


def audit_log_path(log: str) -> str:
    """The auditor's append-only log beside the run's event log."""
    return log[: -len(".log.jsonl")] + ".audit.jsonl" if log.endswith(".log.jsonl") else log + ".audit.jsonl"


def parse_step(snapshot_id: str) -> int:
    from rl_ckpt._format.manifest import parse_snapshot_id

    return parse_snapshot_id(snapshot_id)[0]


def save(tier, engine, step: int) -> str:
    """Save ``step`` (a memory snapshot with a tier, each finished before training goes on) and return its id."""
    return tier.save(step).wait().snapshot_id if tier is not None else engine.save(step).snapshot_id


# The sharded demo's memory tier: a memory snapshot every 2 steps, a durable copy of every 3rd (every 6 steps, as
# the durable-only drill saves), one node so no replicas.
MEMORY_DEFAULTS = {"memory_interval_steps": 2, "memory_flush_every": 3, "memory_replicas": 0}


@dataclasses.dataclass
class Run:
    """A GRPO run on the connected Ray cluster: its manager, rollout actors and event log (and, with the memory
    tier, the memory manager and ``MemoryTierService`` handles)."""

    base_dir: str
    run_name: str
    grpo: GRPOConfig
    manager: Any
    actors: list
    log: str
    storage_options: dict | None = None
    fits: int = 0
    memory: dict | None = None
    owns_actors: bool = True
    versions: bool = True  # the rollout actors pull policy versions (False: full weights from each snapshot)

    @classmethod
    def start(
        cls,
        base_dir: str,
        run_name: str,
        grpo: GRPOConfig | None = None,
        *,
        n_actors: int = 2,
        log_dir: str | None = None,
        storage_options: dict | None = None,
        engine_cfg: dict | None = None,
        actor_options: dict | None = None,
        actors: list | None = None,
        memory_tier: dict | None = None,
    ) -> "Run":
        """The run's manager and ``n_actors`` rollout actors (``actor_options``: e.g. resources pinning them;
        ``actors``: another run's rollout actors to share, left running by ``close``). ``memory_tier``: the
        ``memory_*`` config keys of a run whose learners save memory snapshots (its memory manager and service
        are started here, removed by ``close``)."""
        import ray

        from actors import CheckpointManager

        grpo = grpo or GRPOConfig()
        cfg = {**ENGINE_DEFAULTS, **(engine_cfg or {})}
        manager = CheckpointManager.get_or_create(
            run_name=run_name, base_dir=base_dir, storage_options=storage_options, config=cfg
        )
        memory = None
        if memory_tier is not None:
            from rl_ckpt.demo.ray_tier import start_memory_tier

            memory = {
                **start_memory_tier(
                    {
                        "base_dir": base_dir,
                        "run_name": run_name,
                        **cfg,
                        **memory_tier,
                        **({"storage_options": storage_options} if storage_options else {}),
                    }
                ),
                "cfg": dict(memory_tier),
            }
        owns = actors is None
        if actors is None:
            actors = start_actors(grpo, n_actors, actor_options)
        else:
            ray.get([a.reset.remote() for a in actors])
        log_dir = log_dir or base_dir
        os.makedirs(log_dir, exist_ok=True)
        return cls(
            base_dir,
            run_name,
            grpo,
            manager,
            actors,
            os.path.join(log_dir, f"{run_name}.log.jsonl"),
            storage_options,
            memory=memory,
            owns_actors=owns,
        )

    def fit(
        self,
        learners: int | tuple[int, int],
        steps: int,
        *,
        save_every: int = 2,
        crash_at: int | None = None,
        max_failures: int = 0,
        resize_interval_s: float = 60.0,
        resources_per_worker: dict | None = None,
        faults: list[dict] | None = None,
        standbys: int | dict[int, int] = 0,
        scoped: bool = True,
    ) -> Any:
        """One ``TorchTrainer.fit`` on ``learners`` workers (a ``(min, max)`` pair: Ray Train's elastic mode,
        which restarts the group on as many workers as the cluster then holds).

        ``faults`` (``rl_ckpt.demo.faults``; ``marker`` defaults to a file beside the log, so each fires once per
        run): ``rollout-<j>`` killed in its rollout of ``step`` at ``moment`` (``"pull"``, before it gets the
        weights, or an answer token's index: mid-generation), ``learner-<r>`` killed at the start of ``step``.
        A lost rollout actor is recovered alone: Ray's restart of it, or with ``standbys`` (warm spare actors per
        learner rank, or ``{rank: n}``; one made again after each use) a standby, and its task issued again, no
        learner step undone (``scoped=False``: it fails the attempt instead, a group restart as for a learner)."""
        import functools

        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from rl_ckpt.integrations.ray_train import CheckpointCallback

        log_dir = os.path.dirname(self.log)
        faults = [{"marker": os.path.join(log_dir, f"{self.run_name}.fault-{f['id']}"), **f} for f in faults or ()]
        n_ranks = learners if isinstance(learners, int) else learners[1]
        spares = standbys if isinstance(standbys, dict) else {r: standbys for r in range(n_ranks)}
        factory = (
            functools.partial(start_standby, RolloutActor, self.run_name, self.grpo.to_json(), None)
            if any(spares.values())
            else None
        )

        config = {
            "base_dir": self.base_dir,
            "run_name": self.run_name,
            "manager": self.manager,
            "actors": self.actors,
            "grpo": self.grpo.to_json(),
            "steps": steps,
            "save_every": save_every,
            "log": self.log,
            "storage_options": self.storage_options,
            "crash": {"step": crash_at} if crash_at else None,
            "memory": self.memory,
            "versions": self.versions,
            "faults": faults,
            "scoped": scoped,
            "standbys": {r: [factory() for _ in range(n)] for r, n in spares.items()} if factory else None,
            "standby_factory": factory,
        }
        self.fits += 1
        scaling = ScalingConfig(
            num_workers=learners,
            use_gpu=False,
            resources_per_worker=resources_per_worker or {"CPU": 0.5},
            elastic_resize_monitor_interval_s=resize_interval_s,
        )
        trainer = TorchTrainer(
            learner_loop,
            train_loop_config=config,
            scaling_config=scaling,
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(
                name=f"{self.run_name}-fit{self.fits}",
                storage_path=os.path.join(os.path.dirname(self.log), "ray_results"),
                failure_config=FailureConfig(max_failures=max_failures),
                callbacks=[CheckpointCallback(run_name=self.run_name)],
            ),
        )
        try:
            return trainer.fit()
        finally:
            self.actors = current_actors(self.actors, self.run_name)  # standbys that took over, in their places

    def events(self) -> list[dict]:
        with open(self.log) as f:
            return [json.loads(line) for line in f]

    def rollout_stats(self) -> list[dict]:
        """Each rollout actor's loads and bytes pulled (an actor Ray restarted counts since its restart)."""
        import ray

        return ray.get([a.stats.remote() for a in self.actors])

    def memory_status(self, flush_newest: bool = False) -> dict | None:
        """The ``MemoryTierService``'s figures now (``flush_newest``: first make a durable copy of the newest
        memory snapshot, e.g. the final one); None without the memory tier."""
        import ray

        if self.memory is None:
            return None
        if flush_newest:
            ray.get(self.memory["service"].flush_now.remote(), timeout=300)
        return ray.get(self.memory["service"].tick.remote(), timeout=300)

    def close(self) -> None:
        """Kill the rollout actors this run started and its standbys; stop its memory tier (service, manager,
        stores). Actors it was given stay up, a standby that took the place of one of them too (``self.actors``
        names them: the caller's to kill)."""
        import ray

        if self.memory is not None:
            from rl_ckpt.demo.ray_tier import stop_memory_tier

            stop_memory_tier(self.memory, {"base_dir": self.base_dir, "run_name": self.run_name, **self.memory["cfg"]})
            self.memory = None
        if self.versions:
            from actors.policy_versions import versions_storage

            versions_storage(self.run_name).destroy()
        for standby in standbys_of(self.run_name):  # spare or used: the run's own, unless serving shared actors
            if self.owns_actors or standby not in self.actors:
                ray.kill(standby, no_restart=True)
        if self.owns_actors:
            for a in self.actors:
                ray.kill(a, no_restart=True)
