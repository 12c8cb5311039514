"""Retention: which committed snapshots to keep, as small composable policies.

A policy is any object with ``keep(snapshots) -> set[str]`` (Orbax
``PreservationPolicy`` style). Policies see **full snapshots only**, oldest
first; :func:`plan_retention` turns their answer into a decision and adds the
hard rules no policy can override:

* the newest full snapshot is always kept (there is always a resume point);
* ids in ``protect`` are always kept;
* a kept light snapshot always keeps its base full snapshot.

Light snapshots follow their base. Rule: **for every kept full snapshot, keep
the newest light snapshot built on it; delete every other light snapshot.**
A light snapshot holds only progress/RNG/scheduler on top of its base's
weights, so an older light on the same base is superseded by a newer one, and a
light whose base is gone cannot be restored. The tip of the run (newest light
on the newest full) is therefore always kept, and nothing ever dangles.
A light snapshot named in ``protect`` (or returned by a custom policy) is kept
too, and pulls its base in with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Protocol, Sequence, runtime_checkable

from rl_ckpt._run.catalog import SnapshotInfo
from rl_ckpt.errors import ConfigError

_MODES = ("max", "min")


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, snapshots: Sequence[SnapshotInfo]) -> set[str]:
        """Ids to keep among ``snapshots`` (oldest first, committed, valid)."""
        ...


def _full(snapshots: Sequence[SnapshotInfo]) -> list[SnapshotInfo]:
    return [s for s in snapshots if s.kind == "full"]


def _explain(policy: RetentionPolicy, snapshots: Sequence[SnapshotInfo]) -> dict[str, list[str]]:
    """Reasons from a built-in policy; a user policy just gets its class name."""
    if hasattr(policy, "reasons"):
        return policy.reasons(snapshots)  # type: ignore[attr-defined]
    return {sid: [f"policy {type(policy).__name__}"] for sid in policy.keep(snapshots)}


class _Explained:
    """Built-ins compute reasons; ``keep`` is derived so the two never disagree."""

    def reasons(self, snapshots: Sequence[SnapshotInfo]) -> dict[str, list[str]]:
        raise NotImplementedError

    def keep(self, snapshots: Sequence[SnapshotInfo]) -> set[str]:
        return set(self.reasons(snapshots))


@dataclasses.dataclass(frozen=True)
class KeepLatest(_Explained):
    """The ``n`` newest full snapshots."""

    n: int

    def reasons(self, snapshots: Sequence[SnapshotInfo]) -> dict[str, list[str]]:
        fulls = _full(snapshots)
        return {s.snapshot_id: [f"latest {self.n}"] for s in (fulls[-self.n :] if self.n > 0 else [])}


def _number(value: object) -> float | None:
    """A finite float, or None: missing, non-numeric and nan/inf never rank."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # includes the 'nan'/'inf'/'-inf' strings the catalog stores
    return float(value) if math.isfinite(value) else None


def normalize_best(metric: str | Sequence[str], mode: str | Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``best_metric``/``best_mode`` (one or a list each) as two tuples of equal length;
    ConfigError if they do not match."""
    metrics = (metric,) if isinstance(metric, str) else tuple(metric)
    modes = (mode,) * len(metrics) if isinstance(mode, str) else tuple(mode)
    if not metrics or len(modes) != len(metrics):
        raise ConfigError(f"best_mode {mode!r} must be one mode or one per metric in {metric!r}", key="best_mode")
    for m in modes:
        if m not in _MODES:
            raise ConfigError(f"best_mode: got {m!r}; allowed: max, min", key="best_mode", allowed=list(_MODES))
    return metrics, modes


def rank_best(
    snapshots: Sequence[SnapshotInfo], metric: str | Sequence[str], mode: str | Sequence[str]
) -> list[SnapshotInfo]:
    """Full snapshots best first, metrics compared lexicographically in priority order.

    Snapshots without a finite first metric are left out. A missing or
    non-finite later metric ranks worst at that position. Exact ties go to the
    newer snapshot (later in the oldest-first input).
    """
    metrics, modes = normalize_best(metric, mode)

    def key(item: tuple[int, SnapshotInfo]) -> tuple:
        index, s = item
        parts = []
        for name, md in zip(metrics, modes):
            v = _number(s.metrics.get(name))
            parts.append((0, 0.0) if v is None else (1, v if md == "max" else -v))
        return (*parts, index)

    ranked = [(i, s) for i, s in enumerate(_full(snapshots)) if _number(s.metrics.get(metrics[0])) is not None]
    return [s for _, s in sorted(ranked, key=key, reverse=True)]


@dataclasses.dataclass(frozen=True)
class KeepBest(_Explained):
    """The ``n`` best full snapshots by ``metric`` (a name or names in priority order)."""

    n: int
    metric: str | Sequence[str] = "avg_reward"
    mode: str | Sequence[str] = "max"

    def __post_init__(self) -> None:
        metrics, modes = normalize_best(self.metric, self.mode)  # fail at construction, not at the first save
        if not isinstance(self.metric, str):  # tuples keep the frozen dataclass hashable
            object.__setattr__(self, "metric", metrics)
        if not isinstance(self.mode, str):
            object.__setattr__(self, "mode", modes)

    def reasons(self, snapshots: Sequence[SnapshotInfo]) -> dict[str, list[str]]:
        metrics, _ = normalize_best(self.metric, self.mode)
        out = {}
        for rank, s in enumerate(rank_best(snapshots, self.metric, self.mode)[: max(self.n, 0)], 1):
            values = ", ".join(f"{m}={s.metrics.get(m)}" for m in metrics)
            out[s.snapshot_id] = [f"best {values} (#{rank})"]
        return out


@dataclasses.dataclass(frozen=True)
class KeepEveryNSteps(_Explained):
    """Full snapshots whose step is a multiple of ``n`` (step 0 included): permanent archive points."""

    n: int

    def reasons(self, snapshots: Sequence[SnapshotInfo]) -> dict[str, list[str]]:
        if self.n <= 0:
            return {}
        why = f"archive every {self.n} steps"
        return {s.snapshot_id: [why] for s in _full(snapshots) if s.global_step % self.n == 0}


@dataclasses.dataclass(frozen=True)
class KeepAll(_Explained):
    """Every full snapshot (retention off)."""

    def reasons(self, snapshots: Sequence[SnapshotInfo]) -> dict[str, list[str]]:
        return {s.snapshot_id: ["keep all"] for s in _full(snapshots)}


class AnyOf(_Explained):
    """Union: a snapshot is kept if any of ``policies`` keeps it."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        self.policies = tuple(policies)

    def __repr__(self) -> str:
        return f"AnyOf{self.policies!r}"

    def reasons(self, snapshots: Sequence[SnapshotInfo]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for policy in self.policies:
            for sid, why in _explain(policy, snapshots).items():
                out.setdefault(sid, []).extend(why)
        return out


@dataclasses.dataclass
class RetentionDecision:
    """What to keep and delete (both oldest first), and why each kept id stays."""

    keep: list[str]
    delete: list[str]
    reasons: dict[str, list[str]]


def plan_retention(
    snapshots: Sequence[SnapshotInfo], policy: RetentionPolicy, *, protect: Iterable[str] = ()
) -> RetentionDecision:
    """Apply ``policy`` to the full snapshots, then the hard rules and the light rule (module docstring)."""
    ordered = sorted(snapshots, key=SnapshotInfo.sort_key)  # stable: callers' order among equals survives
    by_id = {s.snapshot_id: s for s in ordered}
    fulls = _full(ordered)
    reasons: dict[str, list[str]] = {}

    def add(sid: str, why: str) -> None:
        if sid in by_id and why not in reasons.get(sid, []):
            reasons.setdefault(sid, []).append(why)

    for sid, whys in _explain(policy, fulls).items():
        for why in whys:
            add(sid, why)  # ids a user policy invents are ignored by add()
    if fulls:
        add(fulls[-1].snapshot_id, "newest snapshot")
    for sid in protect:
        add(sid, "protected")
    # Lights kept explicitly (protect / user policy) pull their base in first,
    # so the per-base light rule below also sees those bases.
    for sid in list(reasons):
        base = by_id[sid].base_snapshot_id
        if by_id[sid].kind == "light" and base:
            add(base, f"base of {sid}")
    newest_light: dict[str, SnapshotInfo] = {}
    for s in ordered:
        if s.kind == "light" and s.base_snapshot_id:
            newest_light[s.base_snapshot_id] = s  # oldest first: the last one wins
    for base, light in newest_light.items():
        if base in reasons and by_id[base].kind == "full":
            add(light.snapshot_id, f"newest light on {base}")
            add(base, f"base of {light.snapshot_id}")
    keep = [s.snapshot_id for s in ordered if s.snapshot_id in reasons]
    delete = [s.snapshot_id for s in ordered if s.snapshot_id not in reasons]
    return RetentionDecision(keep, delete, {sid: reasons[sid] for sid in keep})


def policy_from_config(cfg) -> RetentionPolicy:
    """``AnyOf(KeepLatest, KeepBest if keep_best > 0, KeepEveryNSteps if keep_interval_steps)``."""
    policies: list[RetentionPolicy] = [KeepLatest(cfg.keep_latest)]
    if cfg.keep_best > 0:
        policies.append(KeepBest(cfg.keep_best, cfg.best_metric, cfg.best_mode))
    if cfg.keep_interval_steps:
        policies.append(KeepEveryNSteps(cfg.keep_interval_steps))
    return AnyOf(*policies)


def best_per_metric(
    snapshots: Sequence[SnapshotInfo], metrics: str | Sequence[str], modes: str | Sequence[str]
) -> dict[str, str]:
    """For each metric on its own, the id of the best full snapshot (for ``best/<metric>`` pointers).

    Metrics no snapshot has a finite value for are absent from the result.
    """
    names, mds = normalize_best(metrics, modes)
    out = {}
    for name, md in zip(names, mds):
        ranked = rank_best(snapshots, name, md)
        if ranked:
            out[name] = ranked[0].snapshot_id
    return out
