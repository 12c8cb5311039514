"""Crash drill: PPO on CartPole with scheduled saves, SIGKILLed mid-run, resumed through a
recovery plan, and compared bitwise with an uninterrupted run.

Each run happens in its own process (a crash is a real SIGKILL). A training
process reports one JSON line per step (step, loss, avg_reward, what it
restored); the driver kills it at the chosen step, starts a new process that
plans and restores, and compares losses and final parameters with a
reference process that never crashed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import signal
import time
from typing import Any, Callable

from rl_ckpt import CheckpointEngine, RNGState
from rl_ckpt._recovery.coordinator import FailureInfo
from rl_ckpt.demo.ppo import PPOConfig, PPOTrainer, param_digest


def train(
    cfg: dict,
    until_step: int,
    report: Callable[[dict], None],
    *,
    seed: int = 0,
    resume: bool = True,
    failure: dict | None = None,
    settle_at: int | None = None,
) -> None:
    """One training process: restore (through a plan) if there is a snapshot, train, save on schedule.

    ``failure`` (a FailureInfo as JSON) is what killed the previous process: the
    coordinator turns it into the decision the plan follows. ``settle_at``: the
    step the drill kills at; the save in flight lands before that step is
    reported, so what is restored does not depend on how fast the disk was.
    """
    trainer = PPOTrainer(PPOConfig(seed=seed))
    # The seed is left out: the resumed process is deliberately built with another one.
    hyper = {k: v for k, v in dataclasses.asdict(trainer.cfg).items() if k != "seed"}
    engine = CheckpointEngine(**cfg, train_config=hyper)
    for name, component in trainer.components().items():
        engine.register(name, component)
    engine.register("rng", RNGState())
    start = 0
    if resume:
        plan = engine.plan_recovery(FailureInfo.from_json(failure) if failure else None, deep=True)
        result = engine.restore(plan)
        start = result.global_step
        report({"event": "restored", "snapshot": result.snapshot_id, "step": start, "plan": str(plan)})
    scheduler = engine.scheduler(start_step=start)
    while trainer.progress.global_step < until_step:
        metrics = trainer.train_step()
        step = trainer.progress.global_step
        scheduler.step(step, metrics=trainer.snapshot_metrics())
        if step == settle_at:
            engine.wait()
        newest = engine.snapshots()
        report(
            {
                "event": "step",
                "step": step,
                "loss": _json_float(metrics["loss"]),
                "avg_reward": metrics["avg_reward"],
                "committed": newest[-1].global_step if newest else None,
            }
        )
    scheduler.close()
    engine.close()
    report(
        {
            "event": "done",
            "step": trainer.progress.global_step,
            "digest": param_digest(trainer.model),
            "snapshots": len(engine.snapshots()),
        }
    )


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


def _child(
    cfg: dict, until_step: int, conn, seed: int, resume: bool, failure: dict | None, settle_at: int | None
) -> None:
    train(
        cfg,
        until_step,
        lambda msg: conn.send_bytes(json.dumps(msg).encode()),
        seed=seed,
        resume=resume,
        failure=failure,
        settle_at=settle_at,
    )
    conn.close()


@dataclasses.dataclass
class RunLog:
    losses: dict[int, Any] = dataclasses.field(default_factory=dict)
    rewards: dict[int, float] = dataclasses.field(default_factory=dict)
    restored: dict | None = None
    done: dict | None = None
    killed_at: int | None = None
    committed: int | None = None  # the newest committed step the process had reported
    seconds: float = 0.0


def run_process(
    ctx,
    cfg: dict,
    until_step: int,
    *,
    seed: int = 0,
    resume: bool = True,
    kill_at_step: int | None = None,
    failure: dict | None = None,
    timeout: float = 600.0,
) -> RunLog:
    """Run ``train`` in a child process; SIGKILL it once it reports ``kill_at_step``."""
    log = RunLog()
    started = time.monotonic()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(cfg, until_step, child, seed, resume, failure, kill_at_step), daemon=True)
    proc.start()
    child.close()
    try:
        while True:
            if not parent.poll(timeout):
                raise TimeoutError(f"training process silent for {timeout} s")
            try:
                msg = json.loads(parent.recv_bytes())
            except EOFError:
                break
            if msg["event"] == "step":
                log.losses[msg["step"]] = msg["loss"]
                log.rewards[msg["step"]] = msg["avg_reward"]
                log.committed = msg.get("committed")
                # Kill at the chosen step, but only once a snapshot is committed: on a loaded machine
                # every due save may still be in flight (skipped, not queued), and a crash before the
                # first commit would only show a fresh start.
                if kill_at_step is not None and msg["step"] >= kill_at_step and msg.get("committed") is not None:
                    os.kill(proc.pid, signal.SIGKILL)
                    log.killed_at = msg["step"]
                    break
            elif msg["event"] == "restored":
                log.restored = msg
            elif msg["event"] == "done":
                log.done = msg
    finally:
        proc.join(60)
        parent.close()
        if proc.is_alive():
            proc.kill()
    if kill_at_step is not None and log.killed_at is not None and proc.exitcode != -signal.SIGKILL:
        raise RuntimeError(f"the training process was not killed by SIGKILL (exit code {proc.exitcode})")
    if kill_at_step is None and proc.exitcode != 0:
        raise RuntimeError(f"the training process failed (exit code {proc.exitcode})")
    log.seconds = time.monotonic() - started
    return log


@dataclasses.dataclass
class DrillResult:
    reference: RunLog
    crashed: RunLog
    resumed: RunLog

    @property
    def restored_step(self) -> int:
        return self.resumed.restored["step"] if self.resumed.restored else 0

    @property
    def params_equal(self) -> bool:
        return self.reference.done["digest"] == self.resumed.done["digest"]

    @property
    def losses_equal(self) -> bool:
        steps = [s for s in self.resumed.losses]
        return all(self.resumed.losses[s] == self.reference.losses[s] for s in steps) and all(
            self.crashed.losses[s] == self.reference.losses[s] for s in self.crashed.losses
        )

    @property
    def ok(self) -> bool:
        return self.params_equal and self.losses_equal


def context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "gymnasium", "rl_ckpt._core.engine", "rl_ckpt.demo.ppo", __name__])
    return ctx


def crash_drill(cfg: dict, steps: int, crash_at: int, *, seed: int = 0, ctx=None) -> DrillResult:
    """Reference run, crashed run (SIGKILL at ``crash_at``), resumed run; all to ``steps``."""
    ctx = ctx or context()
    ref_cfg = {**cfg, "run_name": cfg.get("run_name", "run") + "-reference"}
    reference = run_process(ctx, ref_cfg, steps, seed=seed, resume=False)
    crashed = run_process(ctx, cfg, steps, seed=seed, resume=True, kill_at_step=crash_at)
    failure = FailureInfo(kind="process_killed", step=crashed.killed_at, message="SIGKILL (crash drill)").to_json()
    # Another seed: only the snapshot carries state into the resumed process.
    resumed = run_process(ctx, cfg, steps, seed=seed + 1000, resume=True, failure=failure)
    return DrillResult(reference, crashed, resumed)
