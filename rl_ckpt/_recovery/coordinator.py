"""Recovery decisions: map a training failure to start fresh, restore latest, restore best or give up.

:func:`make_decision` is a pure function of the coordinator settings, the failure, the valid
full snapshots and the run's earlier decisions (as Ray Train's ``FailurePolicy.make_decision``):
it reads, writes and remembers nothing. Whoever acts on a decision records it in the run's
``decisions/`` folder (``recovery/history.py``); those records are the history the next
decision is made from, so it is the same after any process died.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from rl_ckpt.errors import CheckpointError, ConfigError
from rl_ckpt._format.manifest import now_iso

if TYPE_CHECKING:
    from rl_ckpt._run.catalog import SnapshotInfo

log = logging.getLogger("rl_ckpt")
RECORD_VERSION = 1
_NONFINITE = {"nan", "inf", "-inf"}


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:  # the plain value in messages, on every Python >= 3.10
        return self.value


class FailureKind(_StrEnum):
    exception = "exception"
    nan_loss = "nan_loss"  # NaN or inf loss
    process_killed = "process_killed"
    oom = "oom"
    heartbeat_lost = "heartbeat_lost"


class Action(_StrEnum):
    start_fresh = "start_fresh"
    restore_latest = "restore_latest"
    restore_best = "restore_best"
    give_up = "give_up"


def _metric(value: Any) -> float | None:
    """A metric as float (``'nan'``/``'inf'`` strings included), or None if it is not a number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:
        return float(value)
    return None


def _json_metrics(metrics: dict) -> dict:
    # JSON has no NaN/inf; use the catalog's spelling ('nan', 'inf', '-inf')
    return {
        str(k): (repr(float(v)) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()
    }


def _check_version(d: dict, what: str) -> None:
    version = d.get("version", 1)
    if not isinstance(version, int) or version > RECORD_VERSION:
        raise CheckpointError(
            f"{what} record has version {version!r}, this rl_ckpt reads up to "
            f"{RECORD_VERSION}; upgrade rl_ckpt to read it",
            version=version,
        )


@dataclasses.dataclass
class FailureInfo:
    """What went wrong: the kind, the global step at failure, and what is known about it."""

    kind: FailureKind
    step: int | None = None
    message: str = ""
    metrics: dict = dataclasses.field(default_factory=dict)
    first_nonfinite_step: int | None = None  # nan_loss: first step whose loss was non-finite
    participant: str | None = None  # rank / actor that failed
    time: str = dataclasses.field(default_factory=now_iso)

    def __post_init__(self) -> None:
        try:
            self.kind = FailureKind(self.kind)
        except ValueError:
            raise ConfigError(
                f"unknown failure kind {self.kind!r}; use one of {[k.value for k in FailureKind]}",
                key="kind",
                allowed=[k.value for k in FailureKind],
            ) from None

    def to_json(self) -> dict:
        return {
            "version": RECORD_VERSION,
            "kind": self.kind.value,
            "step": self.step,
            "message": self.message,
            "metrics": _json_metrics(self.metrics),
            "first_nonfinite_step": self.first_nonfinite_step,
            "participant": self.participant,
            "time": self.time,
        }

    @classmethod
    def from_json(cls, d: dict) -> "FailureInfo":
        _check_version(d, "failure")
        return cls(
            d["kind"],
            d.get("step"),
            d.get("message", ""),
            dict(d.get("metrics") or {}),
            d.get("first_nonfinite_step"),
            d.get("participant"),
            d.get("time") or now_iso(),
        )


@dataclasses.dataclass
class Decision:
    """One recovery decision, with the reason and every snapshot it looked at."""

    action: Action
    snapshot_id: str | None  # None for start_fresh / give_up
    global_step: int | None  # step to continue at: the snapshot's, 0 for start_fresh, None for give_up
    reason: str
    failure: FailureInfo
    considered: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # newest first
    attempt: int = 1  # this failure's number, counting from 1
    charged_to: str | None = None  # snapshot this failure was counted against (restored, then failed)
    time: str = dataclasses.field(default_factory=now_iso)

    def to_json(self) -> dict:
        return {
            "version": RECORD_VERSION,
            "action": Action(self.action).value,
            "snapshot_id": self.snapshot_id,
            "global_step": self.global_step,
            "reason": self.reason,
            "failure": self.failure.to_json(),
            "considered": [[sid, note] for sid, note in self.considered],
            "attempt": self.attempt,
            "charged_to": self.charged_to,
            "time": self.time,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Decision":
        _check_version(d, "decision")
        return cls(
            Action(d["action"]),
            d.get("snapshot_id"),
            d.get("global_step"),
            d.get("reason", ""),
            FailureInfo.from_json(d["failure"]),
            [(s, n) for s, n in d.get("considered") or []],
            int(d.get("attempt", 1)),
            d.get("charged_to"),
            d.get("time") or now_iso(),
        )


@dataclasses.dataclass
class CoordinatorConfig:
    """Thresholds of the decision table; None switches a guard off.

    ``divergence_threshold`` is relative: the newest candidate counts as diverged when its
    ``best_metric`` is worse than the best candidate's by more than ``threshold * |best|``
    ("worse" is lower for ``best_mode='max'``, higher for ``'min'``). 0.2 = more than 20% worse.
    """

    max_failures: int = 10
    max_same_snapshot_failures: int = 3
    max_acceptable_loss_steps: int | None = None
    divergence_threshold: float | None = None
    best_metric: str = "avg_reward"
    best_mode: str = "max"

    def __post_init__(self) -> None:
        for key, low in (("max_failures", 0), ("max_same_snapshot_failures", 1), ("max_acceptable_loss_steps", 0)):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ConfigError(f"{key} must be an int >= {low}, got {v!r}", key=key)
        if self.divergence_threshold is not None and not (self.divergence_threshold >= 0):
            raise ConfigError(
                f"divergence_threshold must be >= 0 or None, got {self.divergence_threshold!r}",
                key="divergence_threshold",
            )
        if self.best_mode not in ("max", "min"):
            raise ConfigError(
                f"best_mode must be 'max' or 'min', got {self.best_mode!r}", key="best_mode", allowed=["max", "min"]
            )


def snapshot_failures(history: Iterable[Decision]) -> dict[str, int]:
    """How many failures each snapshot was charged with (restored, then failed) in ``history``."""
    counts: dict[str, int] = {}
    for d in history:
        if d.charged_to:
            counts[d.charged_to] = counts.get(d.charged_to, 0) + 1
    return counts


def make_decision(
    config: CoordinatorConfig, failure: FailureInfo, snapshots: Iterable[SnapshotInfo], history: Sequence[Decision]
) -> Decision:
    """What to do about ``failure``: a pure function of its inputs (writes, logs and remembers nothing).

    Args:
        config: the decision table's thresholds.
        failure: the failure being answered.
        snapshots: the valid snapshots to choose from (light ones are ignored).
        history: the run's earlier decisions, oldest first (the ``decisions/`` records):
            they give the failure count and the snapshot a new failure is charged to.
    """
    snaps = sorted((s for s in snapshots if s.kind == "full"), key=lambda s: s.sort_key())
    charged = _charge(history, snaps)
    counts = snapshot_failures(history)
    if charged:
        counts[charged] = counts.get(charged, 0) + 1
    decision = _choose(config, failure, snaps, len(history) + 1, counts)
    decision.charged_to = charged
    return decision


def log_decision(decision: Decision) -> None:
    """One log line per decision (a warning when it gives up)."""
    (log.warning if decision.action == Action.give_up else log.info)(
        "recovery decision %d: %s%s — %s",
        decision.attempt,
        decision.action.value,
        f" {decision.snapshot_id}" if decision.snapshot_id else "",
        decision.reason,
    )


class RecoveryCoordinator:
    """A decision history with :func:`make_decision` over it: each ``decide`` adds one decision.

    For a loop that answers failures one after another; recovery planning
    calls :func:`make_decision` with the run's recorded history instead.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        snapshots_provider: Callable[[], list[SnapshotInfo]],
        history: Iterable[Decision] = (),
    ) -> None:
        self.config = config
        self._provider = snapshots_provider
        self._history: list[Decision] = list(history)

    @classmethod
    def from_history(
        cls,
        config: CoordinatorConfig,
        snapshots_provider: Callable[[], list[SnapshotInfo]],
        decisions: Iterable[Decision | dict],
    ) -> "RecoveryCoordinator":
        """Rebuild from recorded decisions (objects or their JSON dicts), e.g. read from the run's decisions/ folder."""
        return cls(
            config, snapshots_provider, [d if isinstance(d, Decision) else Decision.from_json(d) for d in decisions]
        )

    @property
    def failures(self) -> int:
        return len(self._history)

    @property
    def snapshot_failures(self) -> dict[str, int]:
        return snapshot_failures(self._history)

    @property
    def history(self) -> list[Decision]:
        return list(self._history)

    def decide(self, failure: FailureInfo) -> Decision:
        """Choose what to do about ``failure``, log it, remember it, and return it."""
        decision = make_decision(self.config, failure, self._provider(), self._history)
        self._history.append(decision)
        log_decision(decision)
        return decision


def _charge(history: Sequence[Decision], snaps: list[SnapshotInfo]) -> str | None:
    """The snapshot restored by the previous decision, if this failure counts against it.

    It does not count when the run got past it: a snapshot newer than the restored one that the
    previous decision had not seen means training progressed and saved, so the restore worked.
    """
    last = history[-1] if history else None
    if last is None or last.action not in (Action.restore_latest, Action.restore_best):
        return None
    seen = {sid for sid, _ in last.considered}
    if any(s.snapshot_id not in seen and s.global_step > (last.global_step or 0) for s in snaps):
        return None
    return last.snapshot_id


def _best(cfg: CoordinatorConfig, cands: list[SnapshotInfo]) -> SnapshotInfo | None:
    """Best candidate by ``best_metric`` (finite values only); ties go to the newer one."""
    sign = 1.0 if cfg.best_mode == "max" else -1.0
    best, best_v = None, -math.inf
    for s in cands:  # oldest first, so >= lets a newer tie win
        v = _metric(s.metrics.get(cfg.best_metric))
        if v is not None and math.isfinite(v) and sign * v >= best_v:
            best, best_v = s, sign * v
    return best


def _choose(
    cfg: CoordinatorConfig, failure: FailureInfo, snaps: list[SnapshotInfo], attempt: int, counts: dict[str, int]
) -> Decision:
    step = failure.step
    at = f"at step {step}" if step is not None else "(step unknown)"
    notes: dict[str, str] = {}

    def done(action: Action, reason: str, snap: SnapshotInfo | None = None) -> Decision:
        considered = [
            (s.snapshot_id, f"chosen: {action.value}" if s is snap else notes.get(s.snapshot_id, "candidate"))
            for s in reversed(snaps)
        ]
        gstep = snap.global_step if snap else (0 if action == Action.start_fresh else None)
        return Decision(action, snap.snapshot_id if snap else None, gstep, reason, failure, considered, attempt)

    if attempt > cfg.max_failures:
        return done(
            Action.give_up,
            f"failure {attempt} ({failure.kind.value} {at}) exceeds the failure budget "
            f"max_failures={cfg.max_failures}; giving up",
        )
    if not snaps:
        return done(
            Action.start_fresh,
            f"no valid full snapshot exists for the {failure.kind.value} {at}; starting fresh from step 0",
        )
    cands, context = list(snaps), ""
    if failure.kind == FailureKind.nan_loss:
        # Restore from before the loss first went non-finite, not the snapshot right before the crash:
        # the state that produced the NaN was likely already bad some steps earlier.
        bound = failure.first_nonfinite_step if failure.first_nonfinite_step is not None else step
        for s in snaps:
            bad = [f"{k}={v}" for k, v in s.metrics.items() if (m := _metric(v)) is not None and not math.isfinite(m)]
            if bound is not None and s.global_step >= bound:
                notes[s.snapshot_id] = (
                    f"skipped: step {s.global_step} is not before the first non-finite loss at step {bound}"
                )
            elif bad:  # a snapshot that recorded a non-finite metric is itself suspect
                notes[s.snapshot_id] = f"skipped: recorded non-finite metrics ({', '.join(bad)})"
        cands = [s for s in snaps if s.snapshot_id not in notes]
        if not cands:
            return done(
                Action.start_fresh,
                f"none of the {len(snaps)} snapshots is from before the first "
                f"non-finite loss at step {bound} with finite metrics; "
                f"starting fresh from step 0",
            )
        context = f", from before the first non-finite loss at step {bound} and with finite metrics,"
    limit, worn = cfg.max_same_snapshot_failures, []
    for s in cands:
        n = counts.get(s.snapshot_id, 0)
        if n >= limit:  # restoring it keeps being followed by failure: stop using it
            notes[s.snapshot_id] = (
                f"skipped: failed {n} times after being restored (max_same_snapshot_failures={limit})"
            )
            worn.append(f"{s.snapshot_id} (step {s.global_step}, {n}x)")
    remaining = [s for s in cands if s.snapshot_id not in notes]
    if not remaining:
        return done(
            Action.give_up,
            f"every remaining snapshot failed >= {limit} times after being restored "
            f"({', '.join(worn)}); giving up after the {failure.kind.value} {at}",
        )
    if worn:
        context = f" (skipping {', '.join(worn)}: failed >= {limit} times after restore)" + context
    newest, best = remaining[-1], _best(cfg, remaining)
    metric, nv = cfg.best_metric, _metric(newest.metrics.get(cfg.best_metric))
    bv = _metric(best.metrics.get(metric)) if best else None
    nd = f"newest valid snapshot {newest.snapshot_id} (step {newest.global_step})"
    bd = f"best {metric}={bv:g} at {best.snapshot_id} (step {best.global_step})" if best else ""

    if cfg.divergence_threshold is not None and best is not None and best is not newest and nv is not None:
        gap = (bv - nv) if cfg.best_mode == "max" else (nv - bv)
        allowed = cfg.divergence_threshold * abs(bv)
        if gap > allowed:
            return done(
                Action.restore_best,
                f"{nd}{context} has {metric}={nv:g}, {gap:g} worse than the {bd} "
                f"(> divergence_threshold={cfg.divergence_threshold:g} x |{bv:g}| "
                f"= {allowed:g}); restoring best after the {failure.kind.value} {at}",
                best,
            )
    if cfg.max_acceptable_loss_steps is not None and step is not None:
        lost = step - newest.global_step
        if lost > cfg.max_acceptable_loss_steps:
            head = (
                f"{nd}{context} is {lost} steps behind the {failure.kind.value} at step {step} "
                f"(> max_acceptable_loss_steps={cfg.max_acceptable_loss_steps})"
            )
            if best is None:
                return done(
                    Action.restore_latest, f"{head}, but no candidate records {metric}; restoring latest", newest
                )
            if best is newest:
                return done(Action.restore_latest, f"{head}, but it is also the {bd}; restoring latest", newest)
            return done(Action.restore_best, f"{head}; restoring {bd}", best)
    lost = None if step is None else step - newest.global_step
    lost_txt = (
        ""
        if lost is None
        else (
            f", losing {lost} steps"
            if lost >= 0
            # < 0: an older timeline
            else f", {-lost} steps ahead of the failure"
        )
    )
    return done(Action.restore_latest, f"restoring {nd}{context} after the {failure.kind.value} {at}{lost_txt}", newest)
