"""Ray actors of the exactly-once test: a learner drawing prompts and auditing what it trains on, and rollout
workers generating tokens one per tick, their partial rollouts saved in the same commit as the learner."""

from __future__ import annotations

import os
import signal

import torch

from rl_ckpt import CheckpointEngine, TrainingProgress
from rl_ckpt.data import ConsumptionAuditor, InflightRollouts, PromptSampler

GEN = 3  # tokens per rollout: a rollout spans several steps, so snapshots catch rollouts half-generated
VOCAB = 50


def rollout_seed(epoch: int, prompt: int) -> int:
    return 10_000 * epoch + prompt


def expected_tokens(epoch: int, prompt: int) -> list[int]:
    """What an uninterrupted rollout of ``prompt`` in ``epoch`` generates."""
    g = torch.Generator().manual_seed(rollout_seed(epoch, prompt))
    return [int(torch.randint(0, VOCAB, (1,), generator=g)) for _ in range(GEN)]


class DataLearner:
    """The learner: hands out prompts from its sampler, trains on finished rollouts, audits each update."""

    def __init__(self, base_dir: str, run_name: str, manager, participants: list[str], size: int, log: str) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1, bias=False)
        self.sampler = PromptSampler(size, seed=11)
        self.auditor = ConsumptionAuditor(size, log_path=log)
        self.progress = TrainingProgress()
        self.engine = CheckpointEngine(
            base_dir=base_dir,
            run_name=run_name,
            manager=manager,
            rank=0,
            world_size=1,
            role="learner",
            participants=participants,
            keep_latest=3,
            keep_best=0,
        )
        for name, obj in (
            ("policy", self.model),
            ("sampler", self.sampler),
            ("auditor", self.auditor),
            ("progress", self.progress),
        ):
            self.engine.register(name, obj)

    def restore(self) -> tuple:
        r = self.engine.restore()
        return r.snapshot_id, r.global_step

    def hand_out(self, k: int, stop_epoch: int) -> list[list[int]]:
        out = []
        while len(out) < k and self.sampler.epoch < stop_epoch:
            out += [list(p) for p in self.sampler.take(1)]
        return out

    def train(self, step: int, rollouts: list[dict]) -> None:
        with torch.no_grad():
            for r in rollouts:
                self.model.weight += torch.tensor(r["tokens"][:1] * 4, dtype=torch.float32) * 1e-3
        self.auditor.record(
            step, [(r["epoch"], r["prompt"]) for r in rollouts], resumed=sum(bool(r["resumed"]) for r in rollouts)
        )
        self.progress.global_step = step

    def save(self, step: int) -> str:
        return self.engine.save(step).snapshot_id

    def report(self) -> dict:
        return self.auditor.report(complete_below=self.sampler.epoch).to_json()

    def position(self) -> tuple:
        return self.sampler.epoch, self.sampler.position

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        self.engine.close()


class DataRollout:
    """A rollout worker: one token per tick for each rollout it holds; the partial rollouts are its state."""

    def __init__(self, base_dir: str, run_name: str, manager, participants: list[str], rank: int, world: int) -> None:
        self.inflight = InflightRollouts()
        self.engine = CheckpointEngine(
            base_dir=base_dir,
            run_name=run_name,
            manager=manager,
            rank=rank,
            world_size=world,
            role="rollout",
            participants=participants,
            keep_best=0,
        )
        self.engine.register("inflight", self.inflight)
        self.saved_tokens = 0  # tokens of resumed rollouts that came from the snapshot
        self.begun = 0

    def restore(self) -> tuple:
        r = self.engine.restore()
        self.saved_tokens += sum(len(x.tokens) for x in self.inflight.rollouts.values())
        return r.snapshot_id, r.global_step, len(self.inflight)

    def assign(self, pairs: list[list[int]]) -> None:
        for epoch, prompt in pairs:
            self.inflight.begin(prompt, epoch, rollout_seed(epoch, prompt))
            self.begun += 1

    def tick(self) -> list[dict]:
        done = []
        for key in list(self.inflight.rollouts):
            r = self.inflight.rollouts[key]
            tok = int(torch.randint(0, VOCAB, (1,), generator=r.generator))
            self.inflight.extend(key, tok, 0.0)
            if len(r.tokens) == GEN:
                r = self.inflight.finish(key)
                done.append(
                    {
                        "prompt": r.prompt,
                        "epoch": r.epoch,
                        "tokens": r.tokens,
                        "resumed": r.resumed,
                        "restored_tokens": r.restored_tokens,
                    }
                )
        return done

    def save(self, step: int) -> str:
        return self.engine.save(step).snapshot_id

    def stats(self) -> dict:
        return {
            "in_flight": len(self.inflight),
            "begun": self.begun,
            "saved_tokens": self.saved_tokens,
            "tokens_after_resume": self.inflight.tokens_after_resume,
        }

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        self.engine.close()


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


DataLearner.node = lambda self: _node()
DataRollout.node = lambda self: _node()
