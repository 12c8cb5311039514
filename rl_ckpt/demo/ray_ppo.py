"""PPO on CartPole-v1 on Ray: TorchTrainer learner ranks + rollout-worker actors, one run, one manager.

- Rollout workers (Ray actors, ``rl_ckpt.demo.ppo_rollout``) own the envs and the action-sampling
  RNG; each is a checkpoint participant ``rollout-i`` (env state, RNG, and the copy of the
  policy it acts with: the same bytes as the learners' policy, which dedup stores once).
- Learner ranks (Ray Train v2 ``TorchTrainer``, gloo) send the policy weights to
  their workers, keep the rollout buffer, and run the PPO update with
  gradients all-reduced across ranks, so the model/optimizer/scheduler are
  replicated and written once (``shared/``); each rank's buffer, progress and
  RNG are its own (``learner-r/``).
- Saves: the learners' scheduler decides (layered: full + light, keep-best on
  ``avg_reward``); when it starts a save, each learner tells its workers to save
  the same step, and the manager commits the snapshot once all reported.
- With the memory tier (``run(memory_tier=True)``) every participant saves
  memory snapshots instead (``MemoryTier``, committed by the memory manager) and
  the ``MemoryTierService`` makes the durable copies; a restart restores the
  newest complete snapshot of either tier.
- A lost rollout worker costs the learners only its batch: their ``RolloutPool``
  (``actors.rollout_pool``) has Ray's restart of the actor, or a warm standby
  (``standbys=``), take back the worker's newest snapshot (memory tier first) and
  replay the collects since with the weights of their steps, then asks for the
  missing batch again; nothing rolls back (``scoped=False``: the old way, below).
- A lost learner rank fails the attempt; the ``CheckpointCallback`` records it;
  Ray Train restarts the learners; every learner and worker restores the
  snapshot the coordinator chose, and training continues exactly where that
  snapshot left it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import signal
import time
from typing import Any

import numpy as np
import torch

from rl_ckpt import CheckpointEngine, RNGState
from rl_ckpt.data import ConsumptionAuditor, replay_log
from rl_ckpt.demo.chaos import damage_newest, strike
from rl_ckpt.demo.faults import fires, log_event
from rl_ckpt.demo.ppo import PPOConfig, PPOTrainer
from rl_ckpt.demo.ppo_rollout import RolloutWorker
from rl_ckpt.demo.ray_tier import (
    MEMORY_DEFAULTS,
    last_beat,
    memory_tier,
    spare,
    standbys_of,
    start_memory_tier,
    start_standby,
    stop_memory_tier,
)

log = logging.getLogger("rl_ckpt")


class ObsState:
    """The learner's copy of its workers' current observations (for the GAE bootstrap)."""

    def __init__(self, num_envs: int) -> None:
        self.obs = np.zeros((num_envs, 4), dtype=np.float32)

    def state_dict(self) -> dict:
        return {"obs": self.obs}

    def load_state_dict(self, state: dict) -> None:
        self.obs = np.array(state["obs"], dtype=np.float32)


def _save_outcome(last) -> dict | None:
    """How this rank's newest save ended (it is finished): its step and its error, None if it committed. The
    crash drill logs it with the kill, so a restart point other than that step says why."""
    if last is None:
        return None
    step, handle = last
    error = handle.exception()
    return {"step": step, "error": f"{type(error).__name__}: {error}" if error is not None else None}


class Learner(PPOTrainer):
    """A PPOTrainer whose experience comes from rollout workers (through a ``RolloutPool``: a lost worker is
    recovered alone, or with ``attempts=0`` fails the attempt as before) and whose gradients are all-reduced."""

    def __init__(self, cfg: PPOConfig, pool, audit_log: str | None = None) -> None:
        super().__init__(cfg)
        self.pool = pool
        # What the updates trained on: batch j of each of this rank's workers exactly once (epoch = the batch's
        # number at its worker, prompt = the worker): a lost or replayed batch shows as skipped or duplicated.
        self.auditor = ConsumptionAuditor(len(pool), log_path=audit_log)
        self.env_state = ObsState(cfg.num_envs)  # replaces the local envs: the workers own them
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()

            def average(param: torch.Tensor) -> None:
                dist.all_reduce(param.grad)
                param.grad.div_(world)

            for p in self.model.parameters():
                p.register_post_accumulate_grad_hook(average)

    def components(self) -> dict[str, Any]:
        parts = super().components()
        parts["env"] = self.env_state
        parts["auditor"] = self.auditor
        return parts

    def _collect(self) -> None:
        weights = {k: v.clone() for k, v in self.model.state_dict().items()}
        step = self.progress.global_step + 1  # the step this experience trains
        n = self.cfg.steps_per_train_step
        batches = self.pool.call("collect", [(weights, n, step - 1)] * len(self.pool), step=step)
        for t in range(n):
            self.buffer.add(
                **{
                    k: np.concatenate([b[k][t] for b in batches])
                    for k in ("obs", "actions", "logprobs", "rewards", "dones", "values")
                }
            )
        for b in batches:
            for ret in b["finished"]:
                self.progress.record_episode(ret)
        self.env_state.obs = np.concatenate([b["next_obs"] for b in batches])
        self.progress.env_steps += n * self.buffer.num_envs
        self.auditor.record(step, [(b["collect"], j) for j, b in enumerate(batches)])


def worker_pool(config: dict, rank: int, on_recovery) -> Any:
    """This learner rank's rollout workers as a ``RolloutPool``: the handles the run's manager knows for them now
    (a standby that replaced one registered itself under its name), scoped recovery unless ``scoped`` is off."""
    import ray

    from actors.rollout_pool import RolloutPool

    k = config["workers_per_learner"]
    names = [f"rollout-{i}" for i in range(rank * k, (rank + 1) * k)]
    given = dict(zip(names, config["workers"][rank * k : (rank + 1) * k]))
    known = ray.get(config["manager"].participant_handles.remote(names), timeout=60)
    memory = config.get("memory")
    return RolloutPool(
        [known.get(n, given[n]) for n in names],
        names,
        managers=[config["manager"], memory["manager"] if memory else None],
        standbys=spare(config.get("standbys", {}).get(rank, [])),
        standby_factory=config.get("standby_factory"),
        attempts=3 if config.get("scoped", True) else 0,
        on_recovery=on_recovery,
    )


def learner_loop(config: dict) -> None:
    """The Ray Train train function (one per learner rank)."""
    import ray
    import ray.train

    from rl_ckpt.integrations.ray_train import report

    phases = {"began": time.time()}  # when this attempt reached each phase: where kill-to-first-step goes
    rank = ray.train.get_context().get_world_rank()
    k = config["workers_per_learner"]
    ppo = PPOConfig(**{**config["ppo"], "num_envs": config["ppo"]["num_envs"] * k})
    pool = worker_pool(config, rank, lambda event: _log(config, {"event": "scoped_recovery", **event.to_json()}))
    phases["pool"] = time.time()
    learner = Learner(ppo, pool, audit_log=f"{config['log'][: -len('.log.jsonl')]}.audit-{rank}.jsonl")
    phases["learner"] = time.time()  # the user's side: model, optimizer (its first one imports torch._dynamo)
    engine = CheckpointEngine(
        **config["engine"],
        manager=config["manager"],
        participants=config["participants"],
        train_config={k2: v for k2, v in config["ppo"].items() if k2 != "seed"},
    )
    tier = memory_tier(engine, config.get("memory"))
    front = tier or engine
    phases["engine_ready"] = time.time()
    for name, component in learner.components().items():
        front.register(name, component, replicated=name in ("policy", "optimizer", "lr_scheduler"))
    front.register("rng", RNGState())
    # Full snapshots only: that restore is exact (a light layer trades exactness for fresher bookkeeping).
    use_light = bool(config.get("use_light"))
    started = time.monotonic()
    result = tier.restore() if tier is not None else engine.restore(light=use_light)
    restore_seconds = time.monotonic() - started
    phases["restored"] = time.time()
    worker_restores = ray.get([w.restore.remote(use_light) for w in pool.workers])
    phases["workers_restored"] = time.time()
    start = result.global_step
    if rank == 0:
        tier_name = tier.tier_restored if tier is not None else ("durable" if result.snapshot_id else None)
        _log(
            config,
            {
                "event": "attempt",
                "restored": result.snapshot_id,
                "step": start,
                "light": result.light_snapshot_id,
                "workers": worker_restores,
                "tier": tier_name,
                "restore_seconds": restore_seconds,
                "restore_timings": dict(result.timings),  # where the restore's time went (plan, read, ...)
                "skipped": {sid: why[:300] for sid, why in result.skipped.items()},
                "phases": phases,
                "plan": str(result.plan) if result.plan is not None else "",
            },
        )
    scheduler = engine.scheduler(start_step=start) if tier is None else None  # with the tier: memory saves only
    last = full = None  # (step, handle) of this rank's newest save, and of its newest full durable one

    def damage(fault: dict) -> str | None:  # the chaos drill: a rollout worker's newest memory snapshot
        if tier is None:
            return None
        tier.wait()  # this step's memory snapshot committed first: the damage is to the newest one
        return damage_newest(tier.memory.storage, fault["victim"])

    while learner.progress.global_step < config["steps"]:
        metrics = learner.train_step()
        step = learner.progress.global_step
        fault = fires(config.get("faults"), f"learner-{rank}", step)
        if fault is not None:
            front.wait()  # the snapshot in flight commits first: what a restart finds does not depend on load
            last_beat(engine, step)
            killed = {"step": step, "target": f"learner-{rank}", "last_save": _save_outcome(last), "fault": fault}
            _log(config, {"event": "kill", **killed})
            os.kill(os.getpid(), signal.SIGKILL)
        values = learner.snapshot_metrics()
        if tier is not None and tier.due(step):
            tier.wait()  # every due memory snapshot is taken (none skipped because the previous one still runs)
        handle = scheduler.step(step, metrics=values) if tier is None else tier.maybe_save(step, values)
        if full is not None and full[1].done() and full[1].exception() is None:
            pool.truncate(full[0])  # a full durable snapshot holding every worker: none rejoins from before it
            full = None
        if handle is not None:  # the workers join the same snapshot: same step, same kind
            last = (step, handle)
            full = last if tier is None and handle.kind == "full" else full
            pool.cast("save", [(step, handle.kind)] * len(pool), step=step, save=True)
        if rank == 0 and config.get("faults"):  # the chaos drill's faults that are not a participant's own death
            memory = tier.memory.storage if tier is not None else None
            strike(config["faults"], config["log"], step, manager=config["manager"], memory=memory, damage=damage)
        if rank == 0:
            _log(
                config,
                {"event": "step", "step": step, "loss": _num(metrics["loss"]), "avg_reward": metrics["avg_reward"]},
            )
        if step % config.get("report_every", 10) == 0 or step == config["steps"]:
            report({"avg_reward": metrics["avg_reward"], "step": step}, engine)
    if tier is not None:
        tier.wait()
    else:
        scheduler.close()
    if rank == 0:
        digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in learner.model.state_dict().values())).hexdigest()
        _log(
            config,
            {
                "event": "done",
                "step": learner.progress.global_step,
                "digest": digest,
                "avg_reward": learner.progress.avg_reward,
            },
        )
    done = learner.progress.global_step  # every batch 0 .. done-1 of every worker of this rank trained once
    replayed = replay_log(learner.auditor.log_path, len(pool)).report(complete_below=done)
    _log(
        config,
        {
            "event": "audit",
            "rank": rank,
            **learner.auditor.report(complete_below=done).to_json(),
            "replayed": replayed.to_json(),
        },
    )
    front.close()


def _num(x: float) -> float | str:
    return x if x == x else "nan"


def _log(config: dict, msg: dict) -> None:
    log_event(config["log"], msg)


@dataclasses.dataclass
class RunResult:
    run_name: str
    log: list[dict]
    manager: Any
    seconds: float
    memory_status: dict | None = None  # the MemoryTierService's figures at the end (memory tier runs)

    @property
    def done(self) -> dict | None:
        return next((m for m in reversed(self.log) if m["event"] == "done"), None)

    @property
    def attempts(self) -> list[dict]:
        return [m for m in self.log if m["event"] == "attempt"]

    def losses(self) -> dict[int, Any]:
        return {m["step"]: m["loss"] for m in self.log if m["event"] == "step"}


def run(
    *,
    base_dir: str,
    run_name: str,
    steps: int,
    learners: int = 2,
    workers_per_learner: int = 1,
    crash_at: int | None = None,
    crash_target: str = "learner",
    seed: int = 0,
    engine_cfg: dict | None = None,
    ppo: dict | None = None,
    log_dir: str | None = None,
    max_failures: int = 2,
    memory_tier: bool = False,
    faults: list[dict] | None = None,
    scoped: bool = True,
    standbys: int = 0,
    worker_options: dict | None = None,
) -> RunResult:
    """Run one PPO job on the connected Ray cluster; returns its step log and the manager handle.

    ``memory_tier``: memory snapshots (``MEMORY_DEFAULTS`` unless ``engine_cfg`` sets the ``memory_*`` keys)
    instead of durable saves by the trainer; the run's memory manager, service and stores are removed at the
    end (the durable copies stay). ``crash_at`` / ``crash_target``: one SIGKILL (a learner rank after that step,
    or ``rollout-0`` in the middle of that step's collect), or ``faults`` (``rl_ckpt.demo.faults``) for several.
    ``scoped``: a lost rollout worker is recovered alone (False: it fails the attempt, a group restart);
    ``standbys``: warm standby workers per learner rank (else Ray's restart of the actor replaces it);
    ``worker_options``: Ray actor options of the rollout workers (e.g. ``resources`` placing them on some nodes)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from actors import CheckpointManager

    from rl_ckpt.integrations.ray_train import CheckpointCallback

    started = time.monotonic()
    engine_cfg = {
        "base_dir": base_dir,
        "run_name": run_name,
        "save_interval_steps": 10,
        "save_interval_seconds": None,
        "light_interval_steps": 0,
        "keep_latest": 3,
        "keep_best": 1,
        # A bound for a participant that never reports, not for a slow one: a loaded machine can keep a
        # participant's part tens of seconds late, and a save aborted then would move the crash drill's restart
        # point. A lost participant does not wait it out: the recovery plan aborts the saves pending.
        "commit_timeout_seconds": 120.0,
        **(MEMORY_DEFAULTS if memory_tier else {}),
        **(engine_cfg or {}),
    }
    # Per learner: 4 envs and minibatches of 128; the two ranks' gradients are averaged (256 per update step).
    ppo = {**dataclasses.asdict(PPOConfig(seed=seed, num_envs=4, minibatch_size=128)), **(ppo or {})}
    ppo["hidden_sizes"] = list(ppo["hidden_sizes"])
    manager = CheckpointManager.get_or_create(
        run_name=run_name,
        base_dir=base_dir,
        config={k: v for k, v in engine_cfg.items() if k not in ("base_dir", "run_name")},
    )
    n_workers = learners * workers_per_learner
    participants = [f"learner-{r}" for r in range(learners)] + [f"rollout-{i}" for i in range(n_workers)]
    memory = start_memory_tier(engine_cfg) if memory_tier else None
    log_dir = log_dir or base_dir
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{run_name}.log.jsonl")
    if faults is None and crash_at is not None:
        target = f"learner-{learners - 1}" if crash_target == "learner" else "rollout-0"
        moment = None if crash_target == "learner" else ppo["steps_per_train_step"] // 2  # mid-rollout
        faults = [{"id": 0, "target": target, "step": crash_at, "moment": moment}]
    faults = [{**f, "marker": os.path.join(log_dir, f"{run_name}.fault-{f['id']}")} for f in faults or ()]
    max_failures = max(max_failures, 1 + sum(f["target"].startswith("learner") for f in faults))  # one restart each
    args = (ppo, engine_cfg, manager, participants, memory, faults, log_path)
    worker_cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(RolloutWorker)
    # (Ray 2.60 ignores a scheduling strategy or resources given with get_if_exists: only without options)
    placed = dict(worker_options) if worker_options else {"get_if_exists": True}
    workers = [
        worker_cls.options(name=f"rl_ckpt-rollout:{run_name}:{i}", **placed).remote(i, *args) for i in range(n_workers)
    ]
    factory = functools.partial(start_standby, RolloutWorker, run_name, None, *args)
    config = {
        "engine": engine_cfg,
        "ppo": ppo,
        "manager": manager,
        "workers": workers,
        "workers_per_learner": workers_per_learner,
        "participants": participants,
        "steps": steps,
        "log": log_path,
        "memory": memory,
        "faults": faults,
        "scoped": scoped,
        "standbys": {r: [factory() for _ in range(standbys)] for r in range(learners)},
        "standby_factory": factory if standbys else None,
    }
    trainer = TorchTrainer(
        learner_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=learners, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=run_name,
            storage_path=os.path.join(log_dir, "ray_results"),
            failure_config=FailureConfig(max_failures=max_failures),
            callbacks=[CheckpointCallback(run_name=run_name)],
        ),
    )
    trainer.fit()
    names = [f"rollout-{i}" for i in range(n_workers)]
    now = ray.get(manager.participant_handles.remote(names), timeout=60)  # standbys may have replaced some
    current = [now.get(n, w) for n, w in zip(names, workers)]
    ray.get([w.close.remote() for w in current])  # finished, not lost
    for w in {*current, *workers, *standbys_of(run_name)}:
        ray.kill(w, no_restart=True)
    status = stop_memory_tier(memory, engine_cfg) if memory is not None else None
    with open(log_path) as f:
        log = [json.loads(line) for line in f]
    return RunResult(run_name, log, manager, time.monotonic() - started, status)
