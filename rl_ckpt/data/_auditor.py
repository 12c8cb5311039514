"""``ConsumptionAuditor``: which prompts the learners trained on, per epoch, as of the restored snapshot.

"Trained on" means: in an update whose weights are in the snapshot. The
auditor is a component saved in the same cut as the weights, so after a
restore it counts exactly what the restored weights consumed; updates lost in
the crash are not counted, and their prompts being trained on again is not a
duplicate. An append-only log (one JSON line per update, one per restore,
each a single ``O_APPEND`` write) keeps the whole history outside the
snapshots: ``replay_log`` rebuilds the counts from it, dropping what each
restore undid, and must agree with the snapshot's counts.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from rl_ckpt.data._checks import require_same, state_int
from rl_ckpt.errors import DataPositionError


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Counts over the epochs seen: ``skipped`` (a prompt of a complete epoch never trained on),
    ``duplicated`` (extra trainings of a prompt within one epoch), ``resumed_in_flight`` (rollouts trained on
    that were resumed from a snapshot), ``consumed`` (prompt trainings in all), ``epochs`` (complete ones)."""

    consumed: int
    skipped: int
    duplicated: int
    resumed_in_flight: int
    epochs: int
    last_step: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        return (
            f"prompts trained on: {self.consumed} over {self.epochs} complete epoch(s); skipped {self.skipped}, "
            f"duplicated {self.duplicated}, in-flight rollouts resumed {self.resumed_in_flight}"
        )


def _append(path: str, record: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class ConsumptionAuditor:
    """Counts, per epoch and prompt id, how often the learners trained on it.

    Call ``record(step, pairs)`` after each update with the ``(epoch,
    prompt)`` pairs of its batch (with several learner ranks: the global
    batch, on every rank; register ``replicated=True``). ``log_path``: the
    append-only log (rank 0 only). An epoch whose every prompt was trained on
    exactly once is folded into a count, so the state stays small in a long run.
    """

    checkpoint_kind = "progress"  # replicated on learners by default: it records the global batch
    data_position = True  # never in a light snapshot: it travels with the weights
    name = "ConsumptionAuditor"

    def __init__(self, dataset_size: int, log_path: str | None = None) -> None:
        self.dataset_size = int(dataset_size)
        self.log_path = log_path
        self.counts: dict[int, np.ndarray] = {}  # open epochs
        self.exact_epochs: list[int] = []  # epochs folded away: every prompt exactly once
        self.resumed = 0
        self.last_step = 0
        if log_path:  # a new process: until a restore says otherwise, it starts from nothing (see replay_log)
            _append(log_path, {"event": "begin"})

    def record(self, step: int, pairs: list[tuple[int, int]], resumed: int = 0) -> None:
        """The update of ``step`` trained on these ``(epoch, prompt)`` pairs (``resumed`` of them resumed in flight)."""
        for epoch, prompt in pairs:
            if not 0 <= prompt < self.dataset_size:
                raise DataPositionError(
                    f"{self.name}: prompt {prompt} of epoch {epoch} at step {step} is outside "
                    f"the dataset of {self.dataset_size}",
                    component=self.name,
                    field="prompt",
                    saved=(epoch, prompt),
                    given=self.dataset_size,
                )
            if epoch in self.exact_epochs:  # a folded epoch trained on again: unfold it to count the duplicate
                self.exact_epochs.remove(epoch)
                self.counts[int(epoch)] = np.ones(self.dataset_size, dtype=np.uint16)
            counts = self.counts.setdefault(int(epoch), np.zeros(self.dataset_size, dtype=np.uint16))
            counts[prompt] = min(int(counts[prompt]) + 1, np.iinfo(np.uint16).max)
        self.resumed += int(resumed)
        self.last_step = int(step)
        for epoch in sorted(self.counts):
            if (self.counts[epoch] == 1).all():
                self.exact_epochs.append(epoch)
                del self.counts[epoch]
        if self.log_path:
            _append(
                self.log_path,
                {
                    "event": "consume",
                    "step": int(step),
                    "pairs": [[int(e), int(p)] for e, p in pairs],
                    "resumed": int(resumed),
                },
            )

    def report(self, complete_below: int | None = None) -> AuditReport:
        """The counts; epochs ``< complete_below`` (default: all but the newest epoch seen) must be complete."""
        epochs = sorted(set(self.counts) | set(self.exact_epochs))
        if complete_below is None:
            complete_below = epochs[-1] if epochs else 0
        skipped = sum(int((c[...] == 0).sum()) for e, c in self.counts.items() if e < complete_below)
        skipped += self.dataset_size * len([e for e in range(complete_below) if e not in epochs])
        duplicated = sum(int(np.clip(c.astype(np.int64) - 1, 0, None).sum()) for c in self.counts.values())
        consumed = len(self.exact_epochs) * self.dataset_size + sum(int(c.sum()) for c in self.counts.values())
        return AuditReport(consumed, skipped, duplicated, self.resumed, complete_below, self.last_step)

    def state_dict(self) -> dict:
        return {
            "dataset_size": self.dataset_size,
            "last_step": self.last_step,
            "resumed": self.resumed,
            "exact_epochs": list(self.exact_epochs),
            "counts": {str(e): c for e, c in self.counts.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        require_same(
            self.name,
            "dataset_size",
            state.get("dataset_size"),
            self.dataset_size,
            "Audit with the dataset the run trains on.",
        )
        counts = {}
        for key, c in (state.get("counts") or {}).items():
            c = np.asarray(c)
            if c.shape != (self.dataset_size,):
                require_same(self.name, f"counts[{key}].shape", c.shape, (self.dataset_size,), "")
            counts[int(key)] = c.astype(np.uint16)
        self.counts = counts
        self.exact_epochs = [int(e) for e in state.get("exact_epochs", [])]
        self.resumed = state_int(self.name, state, "resumed")
        self.last_step = state_int(self.name, state, "last_step")
        if self.log_path:
            _append(self.log_path, {"event": "restore", "step": self.last_step})


def replay_log(path: str, dataset_size: int) -> ConsumptionAuditor:
    """The auditor rebuilt from its append-only log: each restore to step ``s`` drops the updates after ``s``.

    A process that began and trained without restoring anything (no snapshot yet) started from nothing: the
    updates before it are dropped too. A torn last line (a kill mid-write) is ignored; what it described was
    not in any snapshot either.
    """
    updates: list[dict] = []
    fresh = False  # a process began and has not restored (yet)
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            event = rec.get("event")
            if event == "begin":
                fresh = True
            elif event == "restore":
                updates, fresh = [u for u in updates if u["step"] <= rec["step"]], False
            elif event == "consume":
                if fresh:
                    updates, fresh = [], False
                updates.append(rec)
    audit = ConsumptionAuditor(dataset_size)
    for u in updates:
        audit.record(u["step"], [(e, p) for e, p in u["pairs"]], u.get("resumed", 0))
    return audit
