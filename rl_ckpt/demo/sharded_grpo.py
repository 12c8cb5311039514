"""GRPO with FSDP2 learners on Ray Train and rollout actors fed from sharded snapshots.

- Learners: Ray Train v2 ``TorchTrainer`` ranks (gloo). The tiny GPT-2 policy
  is sharded with FSDP2 (``fully_shard`` per block and at the root) over all
  ranks; policy, Adam state, each rank's RNG and the progress go into one
  snapshot every ``save_every`` steps, each rank writing only its own shards
  (the run's ``CheckpointManager`` commits).
- Rollout actors: plain Ray actors, no process group. Before a rollout an
  actor loads the whole policy from the newest snapshot into an ordinary
  ``nn.Module`` with one ``engine.load_full_weights`` call, samples, and
  returns answers with their log-probs; the learners' update is the clipped
  GRPO objective against those log-probs.
- Rank ``r`` of ``n`` learns on its slice of every step's global batch, so the
  data, and the mean of the gradients FSDP reduces, do not depend on ``n``: a
  run restored on fewer learners goes on with the same math.

``run`` starts one attempt (``TorchTrainer.fit``) on some number of learners;
``crash_drill`` SIGKILLs a learner mid-run and restarts the run on fewer.
Every event goes to a JSON-lines log the summary is computed from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any

import torch

from rl_ckpt.demo.grpo import GRPOConfig, Progress, make_policy, sample, update

ENGINE_DEFAULTS = {"keep_latest": 4, "keep_best": 0, "commit_timeout_seconds": 60.0}


class RolloutActor:
    """A Ray actor sampling answers with the policy of a committed snapshot (full weights, no process group)."""

    def __init__(self, base_dir: str, run_name: str, grpo: dict, storage_options: dict | None = None) -> None:
        from rl_ckpt import CheckpointEngine

        torch.set_num_threads(1)
        self.cfg = GRPOConfig(**grpo)
        self.model = make_policy(self.cfg).eval()  # its weights all come from the snapshot
        self.engine = CheckpointEngine(base_dir=base_dir, run_name=run_name, retention=False,
                                       **({"storage_options": storage_options} if storage_options else {}))
        self.loaded: str | None = None
        self.loads = 0

    def rollout(self, snapshot_id: str, step: int, indices: list[int]) -> dict:
        """Answers to prompts ``indices`` of ``step``, sampled with the policy of ``snapshot_id``."""
        if snapshot_id != self.loaded:
            self.loaded = self.engine.load_full_weights("policy", self.model, snapshot_id)
            self.loads += 1
        out = {k: v.numpy() for k, v in sample(self.model, self.cfg, step, indices).items()}
        return {**out, "snapshot": self.loaded}

    def stats(self) -> dict:
        return {"loads": self.loads, "loaded": self.loaded}


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


def _split(items: list[int], parts: int) -> list[list[int]]:
    return [items[i * len(items) // parts:(i + 1) * len(items) // parts] for i in range(parts)]


def log_event(path: str, msg: dict) -> None:
    """Append one JSON line (with a wall-clock time): a single write, so concurrent ranks never interleave."""
    line = (json.dumps({**msg, "t": time.time()}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def learner_loop(config: dict) -> None:
    """The Ray Train train function: restore from any layout, then rollout -> GRPO update -> save every k steps."""
    import numpy as np
    import ray
    import ray.train

    from rl_ckpt import CheckpointEngine, RNGState
    from rl_ckpt.demo.ray_ppo import last_beat

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = GRPOConfig(**config["grpo"])
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} is not divisible by {world} learners")
    model = shard_policy(make_policy(cfg), world)
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    progress = Progress()
    options = {"storage_options": config["storage_options"]} if config.get("storage_options") else {}
    engine = CheckpointEngine(base_dir=config["base_dir"], run_name=config["run_name"], manager=config["manager"],
                              train_config=cfg.to_json(), **options)
    engine.register("policy", model)
    engine.register("optim", optim)
    engine.register("rng", RNGState())
    engine.register("progress", progress)
    result = engine.restore()
    start = result.global_step
    newest = result.snapshot_id
    if newest is None:  # a fresh run: the rollout actors need weights to act with
        newest = engine.save(0).snapshot_id
    if rank == 0:
        plan = result.plan
        saved_by = {}
        if result.snapshot_id is not None:  # who wrote the restored policy, as its manifest says
            from rl_ckpt.run.snapshot_files import read_manifest

            section = read_manifest(engine.storage, result.snapshot_id).components.get("policy") or {}
            saved_by = (section.get("layout") or {}).get("saved_by", {})
        log_event(config["log"], {"event": "attempt", "world": world, "restored": result.snapshot_id, "step": start,
                                  "target": plan.target if plan else None,
                                  "continue": plan.continue_from_step if plan else None,
                                  "saved_by": saved_by, "plan": str(plan) if plan else "",
                                  "layout": plan.layout if plan else ""})
    actors = config["actors"]
    mine = list(range(cfg.prompts_per_step))[rank * cfg.prompts_per_step // world:
                                              (rank + 1) * cfg.prompts_per_step // world]
    ids = actors_of(rank, world, len(actors))
    crash = config.get("crash") or {}
    for step in range(start + 1, config["steps"] + 1):
        if step == crash.get("step") and rank == world - 1:
            last_beat(engine, step - 1)  # the failure the manager records names the last step done
            log_event(config["log"], {"event": "kill", "step": step, "last_done": step - 1, "rank": rank,
                                      "world": world})
            os.kill(os.getpid(), signal.SIGKILL)  # a lost learner: no cleanup, no goodbye
        parts = ray.get([actors[j].rollout.remote(newest, step, idx) for j, idx in zip(ids, _split(mine, len(ids)))])
        batch = {k: torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in ("seqs", "logps", "rewards")}
        loss = update(model, optim, batch, cfg)
        reward = batch["rewards"].mean().reshape(1)
        torch.distributed.all_reduce(reward)  # equal slices: the mean of the ranks' means is the global mean
        progress.record(step, float(reward) / world)
        engine.beat(step)  # rate-limited: what the manager knows of this rank's progress
        saved = None
        if step % config["save_every"] == 0 or step == config["steps"]:
            saved = newest = engine.save(step).snapshot_id
        if rank == 0:
            log_event(config["log"], {"event": "step", "step": step, "world": world, "reward": progress.rewards[-1],
                                      "loss": loss, "rollout_snapshot": parts[0]["snapshot"], "saved": saved})
    if rank == 0:
        log_event(config["log"], {"event": "done", "step": progress.global_step, "world": world,
                                  "reward": progress.rewards[-1] if progress.rewards else None})
    engine.close()


@dataclasses.dataclass
class Run:
    """A GRPO run on the connected Ray cluster: its manager, rollout actors and event log."""

    base_dir: str
    run_name: str
    grpo: GRPOConfig
    manager: Any
    actors: list
    log: str
    storage_options: dict | None = None
    fits: int = 0

    @classmethod
    def start(cls, base_dir: str, run_name: str, grpo: GRPOConfig | None = None, *, n_actors: int = 2,
              log_dir: str | None = None, storage_options: dict | None = None, engine_cfg: dict | None = None,
              actor_options: dict | None = None) -> "Run":
        """The run's manager and ``n_actors`` rollout actors (``actor_options``: e.g. resources pinning them)."""
        import ray

        from actors import CheckpointManager

        grpo = grpo or GRPOConfig()
        cfg = {**ENGINE_DEFAULTS, **(engine_cfg or {})}
        manager = CheckpointManager.get_or_create(run_name=run_name, base_dir=base_dir, storage_options=storage_options,
                                                  config=cfg)
        actor_cls = ray.remote(num_cpus=0)(RolloutActor)
        actors = [actor_cls.options(**(actor_options or {})).remote(base_dir, run_name, grpo.to_json(), storage_options)
                  for _ in range(n_actors)]
        log_dir = log_dir or base_dir
        os.makedirs(log_dir, exist_ok=True)
        return cls(base_dir, run_name, grpo, manager, actors, os.path.join(log_dir, f"{run_name}.log.jsonl"),
                   storage_options)

    def fit(self, learners: int | tuple[int, int], steps: int, *, save_every: int = 2, crash_at: int | None = None,
            max_failures: int = 0, resize_interval_s: float = 60.0,
            resources_per_worker: dict | None = None) -> Any:
        """One ``TorchTrainer.fit`` on ``learners`` workers (a ``(min, max)`` pair: Ray Train's elastic mode,
        which restarts the group on as many workers as the cluster then holds)."""
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from rl_ckpt.integrations.ray_train import CheckpointCallback

        config = {"base_dir": self.base_dir, "run_name": self.run_name, "manager": self.manager, "actors": self.actors,
                  "grpo": self.grpo.to_json(), "steps": steps, "save_every": save_every, "log": self.log,
                  "storage_options": self.storage_options, "crash": {"step": crash_at} if crash_at else None}
        self.fits += 1
        scaling = ScalingConfig(num_workers=learners, use_gpu=False, resources_per_worker=resources_per_worker or {"CPU": 0.5},
                                elastic_resize_monitor_interval_s=resize_interval_s)
        trainer = TorchTrainer(
            learner_loop, train_loop_config=config, scaling_config=scaling, torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(name=f"{self.run_name}-fit{self.fits}", storage_path=os.path.join(os.path.dirname(self.log),
                                                                                        "ray_results"),
                                 failure_config=FailureConfig(max_failures=max_failures),
                                 callbacks=[CheckpointCallback(run_name=self.run_name)]))
        return trainer.fit()

    def events(self) -> list[dict]:
        with open(self.log) as f:
            return [json.loads(line) for line in f]

    def rollout_stats(self) -> list[dict]:
        import ray

        return ray.get([a.stats.remote() for a in self.actors])

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


@dataclasses.dataclass
class DrillReport:
    """What ``crash_drill`` prints, the figures behind it, and whether they agree with each other."""

    text: str
    figures: dict
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def crash_drill(base_dir: str, *, steps: int = 40, crash_at: int = 17, learners: int = 2, restart_learners: int = 1,
                save_every: int = 2, grpo: GRPOConfig | None = None, n_actors: int = 2,
                run_name: str = "grpo_gpt2") -> DrillReport:
    """Train on ``learners`` FSDP2 ranks, SIGKILL the last one at ``crash_at``, restart on ``restart_learners``."""
    from ray.train import TrainingFailedError

    if not save_every < crash_at <= steps:
        raise ValueError(f"crash_at={crash_at} must come after the first save (step {save_every}) and by step {steps}")
    run = Run.start(base_dir, run_name, grpo, n_actors=n_actors)
    try:
        try:
            run.fit(learners, steps, save_every=save_every, crash_at=crash_at)
        except TrainingFailedError:
            pass  # the attempt failed with its learner: what the drill is for
        if not any(e["event"] == "kill" for e in run.events()):
            raise RuntimeError("the first attempt ended without the planned SIGKILL of a learner")
        run.fit(restart_learners, steps, save_every=save_every)
        return summarize(run, learners, restart_learners, steps, save_every)
    finally:
        run.close()


def summarize(run: Run, learners: int, restart_learners: int, steps: int, save_every: int) -> DrillReport:
    """The drill's figures, from the event log and the snapshots, checked against each other."""
    from rl_ckpt.storage import open_storage
    from rl_ckpt.timeline import load

    events = run.events()
    kill = next(e for e in events if e["event"] == "kill")
    attempts = [e for e in events if e["event"] == "attempt"]
    resumed = attempts[-1]
    after = [e for e in events if e["event"] == "step" and e["t"] > resumed["t"]]
    before = [e for e in events if e["event"] == "step" and e["t"] < resumed["t"]]
    done = next((e for e in reversed(events) if e["event"] == "done"), None)
    storage = open_storage(f"{run.base_dir.rstrip('/')}/{run.run_name}", run.storage_options or {})
    committed = load(storage)["snapshots"]  # kept and since deleted by retention
    saved_by = resumed.get("saved_by") or {}
    newest_before_kill = max((s["step"] for s in committed if s["step"] <= kill["last_done"]), default=None)
    redone = kill["last_done"] - resumed["step"]
    downtime = after[0]["t"] - kill["t"] if after else float("nan")
    rewards = {e["step"]: e["reward"] for e in before + after}  # a redone step counts as it was last run
    first, final = rewards.get(1), done["reward"] if done else None
    loads = sum(s["loads"] for s in run.rollout_stats())
    figures = {"saved_world": saved_by.get("world_size"), "learners": learners, "restart_world": resumed["world"],
               "killed_rank": kill["rank"], "kill_step": kill["last_done"], "restored": resumed["restored"],
               "restored_step": resumed["step"], "plan_target": resumed["target"], "plan_continue": resumed["continue"],
               "newest_before_kill": newest_before_kill, "steps_redone": redone, "downtime_s": downtime,
               "first_step_after": after[0]["step"] if after else None, "first_reward": first, "final_reward": final,
               "final_step": done["step"] if done else None, "layout": resumed["layout"], "weight_loads": loads}
    problems = []
    expect = [("the snapshot was saved by the first attempt's learners", saved_by.get("world_size"), learners),
              ("the restart ran on the requested learners", resumed["world"], restart_learners),
              ("the plan's target is the snapshot restored", resumed["target"], resumed["restored"]),
              ("the plan continues from the restored step", resumed["continue"], resumed["step"]),
              ("the restored snapshot is the newest committed before the kill", newest_before_kill, resumed["step"]),
              ("the first step after the restart follows the restored one", figures["first_step_after"],
               resumed["step"] + 1),
              ("the run finished", figures["final_step"], steps)]
    problems += [f"{what}: {got} != {want}" for what, got, want in expect if got != want]
    if f"saved by {learners} ranks as FSDP({learners}) -> restored on {restart_learners} rank" not in resumed["layout"]:
        problems.append(f"the plan's layout line does not name FSDP({learners}) -> {restart_learners}: "
                        f"{resumed['layout']!r}")
    if redone < 0 or not downtime > 0:
        problems.append(f"time lost is negative: {redone} steps, {downtime} s")
    lines = [
        "rl_ckpt demo --sharded: GRPO on a tiny GPT-2, FSDP2 learners on Ray Train, SIGKILL, restart on fewer learners",
        f"  storage            {storage.url}",
        f"  task               repeat the prompt digit {run.grpo.gen_len} times; {run.grpo.prompts_per_step} prompts x "
        f"{run.grpo.group_size} answers per step; a snapshot every {save_every} steps",
        f"  failure            SIGKILL of learner rank {kill['rank']} of {kill['world']} after step {kill['last_done']}",
        f"  layout             {resumed['layout'] or '-'}",
        f"  restored           {resumed['restored']} (step {resumed['step']}) on {resumed['world']} learner(s)",
        f"  time lost          {redone} step{'' if redone == 1 else 's'} redone"
        + (f" (steps {resumed['step'] + 1}..{kill['last_done']})" if redone > 0 else "") + "; "
        f"{downtime:.1f} s from the kill to the first step after the restart",
        f"  reward             {first:.3f} at step 1 -> {final:.3f} at step {figures['final_step']}"
        if first is not None and final is not None else "  reward             -",
        f"  rollout actors     {len(run.actors)}, {loads} full-weight loads from snapshots (one call each)",
        f"  consistent         {'YES' if not problems else 'NO: ' + '; '.join(problems)}",
        "",
        "Recovery plan followed by the restarted learner(s):",
        resumed["plan"],
    ]
    return DrillReport("\n".join(lines), figures, problems)
