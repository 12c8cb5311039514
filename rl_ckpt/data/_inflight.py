"""``InflightRollouts``: a rollout worker's partial rollouts as checkpoint state.

A rollout in flight is a prompt (id and epoch), the tokens generated so far
(with their log-probs) and the generator that draws its next tokens. Saved in
the same commit as the learners' snapshot, it is resumed after a restore
where it stopped: the same next tokens, none generated twice, none dropped.
"""

from __future__ import annotations

import dataclasses

import torch

from rl_ckpt.data._checks import state_int
from rl_ckpt.errors import DataPositionError


@dataclasses.dataclass
class Rollout:
    """One partial rollout: ``prompt`` (id), ``epoch``, ``tokens`` and ``logps`` so far, its ``generator``."""

    prompt: int
    epoch: int
    tokens: list[int]
    logps: list[float]
    generator: torch.Generator
    resumed: bool = False  # restored from a snapshot rather than begun in this process
    restored_tokens: int = 0  # how many of ``tokens`` came from the snapshot

    @property
    def key(self) -> str:
        return f"{self.epoch}:{self.prompt}"


class InflightRollouts:
    """The partial rollouts a worker holds: begin, extend, finish; saved and resumed whole.

    ``resumed_total`` counts the rollouts this object got back from a snapshot
    (saved too, so it adds up across restores); ``tokens_after_resume`` the
    tokens generated for them after a restore: only what was missing.

    Example::

        inflight = InflightRollouts()
        engine.register("inflight", inflight)            # engine of a rollout participant
        r = inflight.begin(prompt_id, epoch, seed)
        r.tokens.append(sample(r.generator)); ...
        done = inflight.finish(r.key)                     # handed to the learner
    """

    checkpoint_kind = "other"  # not a replay buffer: saved whatever save_replay_buffer says, per participant
    data_position = True  # never in a light snapshot: it travels with the weights
    name = "InflightRollouts"

    def __init__(self) -> None:
        self.rollouts: dict[str, Rollout] = {}
        self.resumed_total = 0
        self.tokens_after_resume = 0

    def begin(self, prompt: int, epoch: int, seed: int) -> Rollout:
        r = Rollout(int(prompt), int(epoch), [], [], torch.Generator().manual_seed(int(seed)))
        if r.key in self.rollouts:
            raise DataPositionError(
                f"{self.name}: prompt {prompt} of epoch {epoch} is already in flight here",
                component=self.name,
                field="prompt",
                saved=r.key,
                given=r.key,
            )
        self.rollouts[r.key] = r
        return r

    def extend(self, key: str, token: int, logp: float) -> None:
        r = self.rollouts[key]
        r.tokens.append(int(token))
        r.logps.append(float(logp))
        if r.resumed:
            self.tokens_after_resume += 1

    def finish(self, key: str) -> Rollout:
        return self.rollouts.pop(key)

    def __len__(self) -> int:
        return len(self.rollouts)

    def state_dict(self) -> dict:
        rollouts = {
            k: {
                "prompt": r.prompt,
                "epoch": r.epoch,
                "tokens": torch.tensor(r.tokens, dtype=torch.int64),
                "logps": torch.tensor(r.logps, dtype=torch.float32),
                "generator": r.generator.get_state(),
                "resumed": r.resumed,
            }
            for k, r in self.rollouts.items()
        }
        return {"rollouts": rollouts, "resumed_total": self.resumed_total}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("rollouts")
        if not isinstance(saved, dict):
            raise DataPositionError(
                f"{self.name}: the saved state has no rollouts",
                component=self.name,
                field="rollouts",
                saved=None,
                given=None,
            )
        rollouts = {}
        for key, s in saved.items():
            gen = torch.Generator()
            gen.set_state(torch.as_tensor(s["generator"]).to(torch.uint8))
            r = Rollout(
                int(s["prompt"]),
                int(s["epoch"]),
                [int(t) for t in torch.as_tensor(s["tokens"]).tolist()],
                [float(v) for v in torch.as_tensor(s["logps"]).tolist()],
                gen,
                resumed=True,
            )
            r.restored_tokens = len(r.tokens)
            if r.key != key:
                raise DataPositionError(
                    f"{self.name}: saved rollout {key!r} names prompt {r.key!r}",
                    component=self.name,
                    field="key",
                    saved=key,
                    given=r.key,
                )
            rollouts[key] = r
        self.resumed_total = state_int(self.name, state, "resumed_total") + len(rollouts)
        self.rollouts = rollouts
