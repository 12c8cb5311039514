"""PPO on CartPole-v1 on Ray: TorchTrainer learner ranks + rollout-worker actors, one run, one manager.

- Rollout workers (plain Ray actors) own the envs and the action-sampling RNG;
  each is a checkpoint participant ``rollout-i`` (env state, RNG, and the copy of the
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
- A failure anywhere (a killed learner rank or rollout worker) fails the
  attempt; the ``CheckpointCallback`` records it; Ray Train restarts the
  learners; every learner and worker restores the snapshot the coordinator
  chose, and training continues exactly where that snapshot left it.
"""

from __future__ import annotations

import dataclasses
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
from rl_ckpt.errors import CheckpointError
from rl_ckpt.demo.ppo import PPOConfig, PPOTrainer, EnvState
from rl_ckpt.demo.ray_tier import (
    MEMORY_DEFAULTS,
    last_beat,
    memory_tier,
    start_memory_tier,
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


class RolloutWorker:
    """A Ray actor holding envs; collects experience with the weights it is sent."""

    def __init__(
        self, index: int, ppo: dict, engine_cfg: dict, manager, participants: list[str], memory: dict | None = None
    ) -> None:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        cfg = PPOConfig(**ppo)
        self.index = index
        torch.manual_seed(cfg.seed * 1000 + 17 + index)  # this worker's action-sampling stream
        self.envs = EnvState(cfg.num_envs, cfg.seed * 1000 + index)
        from rl_ckpt.demo.ppo import ActorCritic

        self.model = ActorCritic(tuple(cfg.hidden_sizes))
        self.engine = CheckpointEngine(
            **engine_cfg, manager=manager, rank=index, world_size=1, role="rollout", participants=participants
        )
        self.tier = memory_tier(self.engine, memory, service=False)
        front = self.tier or self.engine
        front.register("policy", self.model)  # the weights it acts with
        front.register("env", self.envs)
        front.register("rng", RNGState())
        self.pending = None
        self.ready = False  # set by restore(): a worker Ray restarted must not serve fresh state

    def _check_ready(self) -> None:
        if not self.ready:
            raise CheckpointError(
                f"rollout worker {self.index} was restarted and has not restored its state; "
                "the learners must restore it first (the attempt fails and Ray Train recovers)"
            )

    @torch.no_grad()
    def collect(self, weights: dict, steps: int, global_step: int) -> dict:
        self._check_ready()
        self.engine.beat(global_step)
        self.model.load_state_dict(weights)
        rows: dict[str, list] = {k: [] for k in ("obs", "actions", "logprobs", "rewards", "dones", "values")}
        finished: list[float] = []
        for _ in range(steps):
            obs = self.envs.obs.copy()
            obs_t = torch.from_numpy(obs)
            dist = self.model.dist(obs_t)
            action = dist.sample()
            rows["obs"].append(obs)
            rows["actions"].append(action.numpy())
            rows["logprobs"].append(dist.log_prob(action).numpy())
            rows["values"].append(self.model.get_value(obs_t).numpy())
            rewards, dones, done_returns = self.envs.step(action.numpy())
            rows["rewards"].append(rewards)
            rows["dones"].append(dones)
            finished += done_returns
        out = {k: np.stack(v) for k, v in rows.items()}
        out["next_obs"] = self.envs.obs.copy()
        out["finished"] = finished
        return out

    def save(self, step: int, kind: str = "full") -> None:
        """Stage now (the state as of this call), persist in the background; same step and kind as the learners."""
        self._check_ready()
        self._settle()  # one in flight
        self.pending = self.tier.save(step) if self.tier is not None else self.engine.save_async(step, kind=kind)

    def _settle(self) -> None:
        """Wait for the save in flight. Its failure is the snapshot's (the manager aborted it for every
        participant and the learners' schedulers report it): logged here, it must not stop later saves."""
        if self.pending is not None:
            try:
                self.pending.wait()
            except CheckpointError as exc:
                log.warning("rollout worker %d: save failed: %s", self.index, exc)
            self.pending = None

    def restore(self, light: bool = False) -> tuple:
        self.pending = None
        result = self.tier.restore() if self.tier is not None else self.engine.restore(light=light)
        self.ready = True
        return result.snapshot_id, result.global_step

    def die(self, step: int) -> None:
        """The crash drill: SIGKILL this worker at ``step`` (the manager knows the step first)."""
        last_beat(self.engine, step)
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        """A clean end: the manager forgets this participant (its silence is no lost heartbeat)."""
        self._settle()
        (self.tier or self.engine).close()


def _save_outcome(last) -> dict | None:
    """How this rank's newest save ended (it is finished): its step and its error, None if it committed. The
    crash drill logs it with the kill, so a restart point other than that step says why."""
    if last is None:
        return None
    step, handle = last
    error = handle.exception()
    return {"step": step, "error": f"{type(error).__name__}: {error}" if error is not None else None}


class Learner(PPOTrainer):
    """A PPOTrainer whose experience comes from rollout workers and whose gradients are all-reduced."""

    def __init__(self, cfg: PPOConfig, workers: list, worker_names: list[str]) -> None:
        super().__init__(cfg)
        self.workers = workers
        self.worker_names = worker_names
        self.env_state = ObsState(cfg.num_envs)  # replaces the local envs: the workers own them
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()

            def average(param: torch.Tensor) -> None:
                dist.all_reduce(param.grad)
                param.grad.div_(world)

            for p in self.model.parameters():
                p.register_post_accumulate_grad_hook(average)

    def call_workers(self, refs: list, step: int) -> list:
        """``ray.get`` on calls to this learner's workers; a dead worker fails the attempt naming it and the
        last step it completed (the manager may already see its restarted process)."""
        import ray
        from ray.exceptions import RayActorError

        from rl_ckpt.integrations.ray_train import ParticipantFailedError, dead_pid

        try:
            return ray.get(refs)
        except RayActorError as exc:
            ids = [w._actor_id.hex() for w in self.workers]
            name = self.worker_names[ids.index(exc.actor_id)] if exc.actor_id in ids else "a rollout worker"
            raise ParticipantFailedError(
                f"{name} died after step {step}: {type(exc).__name__}: {exc}",
                participant=name,
                step=step,
                kind="process_killed",
                actor_id=exc.actor_id,
                pid=dead_pid(exc),
            ) from exc

    def components(self) -> dict[str, Any]:
        parts = super().components()
        parts["env"] = self.env_state
        return parts

    def _collect(self) -> None:
        weights = {k: v.clone() for k, v in self.model.state_dict().items()}
        step = self.progress.global_step
        batches = self.call_workers(
            [w.collect.remote(weights, self.cfg.steps_per_train_step, step) for w in self.workers], step
        )
        for t in range(self.cfg.steps_per_train_step):
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
        self.progress.env_steps += self.cfg.steps_per_train_step * self.buffer.num_envs


def learner_loop(config: dict) -> None:
    """The Ray Train train function (one per learner rank)."""
    import ray
    import ray.train

    from rl_ckpt.integrations.ray_train import report

    phases = {"began": time.time()}  # when this attempt reached each phase: where kill-to-first-step goes
    rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    k = config["workers_per_learner"]
    workers = config["workers"][rank * k : (rank + 1) * k]
    ppo = PPOConfig(**{**config["ppo"], "num_envs": config["ppo"]["num_envs"] * k})
    learner = Learner(ppo, workers, [f"rollout-{i}" for i in range(rank * k, (rank + 1) * k)])
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
    worker_restores = ray.get([w.restore.remote(use_light) for w in workers])
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
                "phases": phases,
                "plan": str(result.plan) if result.plan is not None else "",
            },
        )
    scheduler = engine.scheduler(start_step=start) if tier is None else None  # with the tier: memory saves only
    crash = config.get("crash")
    last = None  # (step, handle) of this rank's newest save
    while learner.progress.global_step < config["steps"]:
        metrics = learner.train_step()
        step = learner.progress.global_step
        crasher = 0 if crash and crash["target"] == "rollout" else world - 1
        if crash and rank == crasher and step == crash["step"] and not os.path.exists(crash["marker"]):
            open(crash["marker"], "w").close()  # once per run: the restarted attempt goes on
            if crash["target"] == "rollout":
                # Wait for the kill to land (the actor may first finish a queued save): the call fails with
                # the actor's death here, at this step, and Ray Train restarts the attempt.
                _log(config, {"event": "kill", "step": step, "target": "rollout"})
                learner.call_workers([workers[0].die.remote(step)], step)
            else:
                front.wait()  # the snapshot in flight commits first: what a restart finds does not depend on load
                last_beat(engine, step)
                _log(config, {"event": "kill", "step": step, "target": "learner", "last_save": _save_outcome(last)})
                os.kill(os.getpid(), signal.SIGKILL)
        values = learner.snapshot_metrics()
        if tier is not None and tier.due(step):
            tier.wait()  # every due memory snapshot is taken (none skipped because the previous one still runs)
        handle = scheduler.step(step, metrics=values) if tier is None else tier.maybe_save(step, values)
        if handle is not None:  # the workers join the same snapshot: same step, same kind
            last = (step, handle)
            for w in workers:
                w.save.remote(step, handle.kind)
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
    front.close()


def _num(x: float) -> float | str:
    return x if x == x else "nan"


def _log(config: dict, msg: dict) -> None:
    with open(config["log"], "a") as f:
        f.write(json.dumps({**msg, "t": time.time()}) + "\n")


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
) -> RunResult:
    """Run one PPO job on the connected Ray cluster; returns its step log and the manager handle.

    ``memory_tier``: memory snapshots (``MEMORY_DEFAULTS`` unless ``engine_cfg`` sets the ``memory_*`` keys)
    instead of durable saves by the trainer; the run's memory manager, service and stores are removed at the
    end (the durable copies stay)."""
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
    worker_cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(RolloutWorker)
    workers = [
        worker_cls.options(name=f"rl_ckpt-rollout:{run_name}:{i}", get_if_exists=True).remote(
            i, ppo, engine_cfg, manager, participants, memory
        )
        for i in range(n_workers)
    ]
    log_dir = log_dir or base_dir
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{run_name}.log.jsonl")
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
    }
    if crash_at is not None:
        config["crash"] = {
            "step": crash_at,
            "target": crash_target,
            "marker": os.path.join(log_dir, f"{run_name}.crashed"),
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
    ray.get([w.close.remote() for w in workers])  # finished, not lost
    for w in workers:
        ray.kill(w)
    status = stop_memory_tier(memory, engine_cfg) if memory is not None else None
    with open(log_path) as f:
        log = [json.loads(line) for line in f]
    return RunResult(run_name, log, manager, time.monotonic() - started, status)
