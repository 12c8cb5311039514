"""A process saving in a loop is SIGKILLed at random moments, over and over.

Invariants after every kill: the restored state is one complete snapshot (never
mixed, never partial), and no acknowledged snapshot is lost (restored step >=
the last step whose save() returned).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal

import pytest

from kill_child import StepState, save_loop
from rl_ckpt import CheckpointEngine

KILLS_PER_VARIANT = 30  # two variants: >= 60 kills in the suite


@pytest.fixture(scope="module")
def ctx():
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "numpy", "rl_ckpt._core.engine", "kill_child"])  # what each child uses
    return context


def _run_until_killed(ctx, cfg: dict, start: int, min_acks: int, delay: float) -> list[int]:
    """Start a saving child; after ``min_acks`` committed saves and ``delay`` more seconds, SIGKILL it."""
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=save_loop, args=(cfg, start, child), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(60), "child did not start"
    assert parent.recv_bytes() == b"ready"
    acks: list[int] = []
    while len(acks) < min_acks and parent.poll(60):  # progress whatever the machine's speed
        acks.append(int(parent.recv_bytes()))
    if delay:
        parent.poll(delay)  # lands anywhere in the next save(s): staging, writing, fsync, rename
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    while parent.poll(0):  # ACKs written before the kill
        try:
            acks.append(int(parent.recv_bytes()))
        except EOFError:
            break
    parent.close()
    return acks


@pytest.mark.parametrize("atomic_write", [True, False], ids=["staged-rename", "manifest-last"])
def test_sigkill_at_random_moments(ctx, tmp_path, atomic_write):
    cfg = {"base_dir": str(tmp_path), "run_name": "run", "atomic_write": atomic_write}
    rnd = random.Random(1234 + atomic_write)
    last_ack = -1
    next_start = 0
    restored_steps = []
    for _ in range(KILLS_PER_VARIANT):
        acks = _run_until_killed(ctx, cfg, next_start, rnd.randint(0, 3), rnd.uniform(0.0, 0.05))
        if acks:
            assert acks == list(range(acks[0], acks[-1] + 1))
            last_ack = max(last_ack, acks[-1])
        model, buffer = StepState(), StepState(nbytes=256 * 1024)
        engine = CheckpointEngine(**cfg)
        engine.register("model", model)
        engine.register("buffer", buffer)
        result = engine.restore()
        if result.fresh:
            assert last_ack == -1, "an acknowledged snapshot was lost"
            next_start = 0
        else:
            step = model.consistent_step()
            assert buffer.consistent_step() == step == result.global_step
            assert step >= last_ack, f"acknowledged step {last_ack} lost; restored {step}"
            assert not result.skipped, result.skipped  # a killed save never leaves a corrupt committed snapshot
            next_start = step + 1
        restored_steps.append(result.global_step)
    assert CheckpointEngine(**cfg).verify().ok
    assert last_ack >= 5, "kills landed too early to exercise saving"
    assert len(set(restored_steps)) > KILLS_PER_VARIANT // 3
