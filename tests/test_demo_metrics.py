"""The PPO demo's snapshots record the last update's loss (or none before the first update), never the NaN of
a step without an update, across a restore too; ``rl-ckpt ls`` on such a run shows no ``loss=nan``."""

from __future__ import annotations

import math

from rl_ckpt import CheckpointEngine, RNGState
from rl_ckpt.cli import main as cli_main
from rl_ckpt.demo.ppo import PPOConfig, PPOTrainer


def demo_engine(tmp_path, trainer: PPOTrainer) -> CheckpointEngine:
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="ppo", keep_latest=20, keep_best=0)
    for name, component in trainer.components().items():  # as the demo registers them (rl_ckpt/demo/drill.py)
        engine.register(name, component)
    engine.register("rng", RNGState())
    return engine


def train_and_save(trainer: PPOTrainer, engine: CheckpointEngine, until: int) -> dict[int, float]:
    losses = {}
    while trainer.progress.global_step < until:
        loss = trainer.train_step()["loss"]
        losses[trainer.progress.global_step] = loss
        engine.save(trainer.progress.global_step, metrics=trainer.snapshot_metrics())
    return losses


def test_snapshots_at_steps_without_an_update_record_the_last_updates_loss(tmp_path, capsys):
    cfg = PPOConfig(num_envs=2, steps_per_train_step=8, train_steps_per_update=4, epochs=1, minibatch_size=16)
    trainer = PPOTrainer(cfg)
    with demo_engine(tmp_path, trainer) as engine:
        losses = train_and_save(trainer, engine, 5)  # an update at step 4 only
    assert [s for s, v in losses.items() if math.isfinite(v)] == [4]  # the other steps' loss is NaN
    resumed = PPOTrainer(PPOConfig(**{**cfg.__dict__, "seed": 1}))
    with demo_engine(tmp_path, resumed) as engine:
        assert engine.restore().global_step == 5
        train_and_save(resumed, engine, 7)  # no update at 6 and 7 either
        recorded = {i.global_step: i.metrics for i in engine.snapshots()}
    assert sorted(recorded) == list(range(1, 8))
    assert all("loss" not in recorded[s] for s in (1, 2, 3)), recorded  # before the first update: no loss
    assert all(recorded[s]["loss"] == losses[4] for s in (4, 5, 6, 7)), recorded  # 6, 7: after the restore
    assert cli_main(["ls", str(tmp_path / "ppo")]) == 0
    out = capsys.readouterr().out
    assert "step_000000007" in out and "loss=" in out and "nan" not in out.lower(), out
