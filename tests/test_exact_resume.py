"""Exact resume: PPO on CartPole in a real process, scheduled async saves, SIGKILL at a random
step, restore through a recovery plan in a new process, continue to step N: bitwise-equal
parameters and equal losses compared with a run that never crashed."""

from __future__ import annotations

import random

import pytest

from rl_ckpt.demo.drill import context, crash_drill

STEPS = 40


@pytest.fixture(scope="module")
def ctx():
    return context()


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_mid_run_then_exact_resume(ctx, tmp_path, seed):
    rnd = random.Random(seed + 99)
    crash_at = rnd.randint(12, STEPS - 6)
    cfg = {
        "base_dir": str(tmp_path),
        "run_name": "ppo",
        "save_interval_steps": 5,
        "save_interval_seconds": None,
        "keep_latest": 3,
        "keep_best": 1,
    }
    result = crash_drill(cfg, STEPS, crash_at, seed=seed, ctx=ctx)
    assert result.crashed.killed_at >= crash_at and result.crashed.done is None
    assert result.resumed.restored["snapshot"] is not None, "nothing was restored"
    restored = result.restored_step
    # The newest snapshot at the kill: the one reported committed, or the save that was in flight
    # (a due save is deferred while the previous one still writes, so steps need not be multiples of 5).
    assert result.crashed.committed is not None and result.crashed.committed <= restored <= result.crashed.killed_at
    assert "checksums verified" in result.resumed.restored["plan"]
    assert min(result.resumed.losses) == restored + 1  # it continued right after the snapshot
    assert result.losses_equal, "losses differ from the uninterrupted run"
    assert result.params_equal, "final parameters differ from the uninterrupted run"
    assert result.resumed.done["step"] == result.reference.done["step"] == STEPS


class TorchRLLearner:
    """A small off-policy learner: Q-network, Adam, a torchrl replay buffer filled from a seeded env stand-in."""

    def __init__(self, seed: int) -> None:
        import torch
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.data.replay_buffers import SamplerWithoutReplacement

        from rl_ckpt import RNGState, TrainingProgress

        torch.manual_seed(seed)
        self.q = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.opt = torch.optim.Adam(self.q.parameters(), lr=1e-2)
        self.rb = ReplayBuffer(storage=LazyTensorStorage(40), sampler=SamplerWithoutReplacement(), batch_size=16)
        self.progress = TrainingProgress()
        self.rng = RNGState()
        self.losses: list[float] = []

    def register(self, engine):
        for name, obj in (
            ("q", self.q),
            ("optimizer", self.opt),
            ("replay_buffer", self.rb),
            ("progress", self.progress),
            ("rng", self.rng),
        ):
            engine.register(name, obj)
        return engine

    def step(self) -> None:
        import torch
        from tensordict import TensorDict

        obs = torch.randn(8, 4)
        self.rb.extend(
            TensorDict({"obs": obs, "action": torch.randint(0, 2, (8,)), "reward": obs.sum(-1)}, batch_size=[8])
        )
        batch = self.rb.sample()
        q = self.q(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
        loss = torch.nn.functional.mse_loss(q, batch["reward"])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.progress.global_step += 1
        self.losses.append(loss.item())


def test_torchrl_replay_learner_resumes_bitwise(tmp_path):
    """Save at step 6 (the buffer has wrapped around by then), restore into fresh objects, run to 14:
    the same losses and parameters as the run that never stopped."""
    from rl_ckpt import CheckpointEngine

    cfg = {"base_dir": str(tmp_path), "run_name": "q"}
    ref = TorchRLLearner(seed=0)
    engine = ref.register(CheckpointEngine(**cfg))
    for step in range(1, 15):
        ref.step()
        if step == 6:
            engine.save(step)
            saved_len, saved_cursor = len(ref.rb), ref.rb._writer._cursor
    resumed = TorchRLLearner(seed=123)
    result = resumed.register(CheckpointEngine(**cfg)).restore()
    assert result.global_step == 6 and resumed.progress.global_step == 6
    assert (len(resumed.rb), resumed.rb._writer._cursor) == (saved_len, saved_cursor) == (40, 8)
    for _ in range(7, 15):
        resumed.step()
    assert resumed.losses == ref.losses[6:]
    for a, b in zip(ref.q.state_dict().values(), resumed.q.state_dict().values()):
        assert a.equal(b)
