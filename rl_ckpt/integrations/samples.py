"""Samples tagged with the policy version that produced them, and a staleness bound applied after a restore.

    buffer = VersionedSamples()                         # a component like any other
    engine.register("samples", buffer)
    ...
    result = sub.pull(policy)                           # a rollout worker: the version it now holds
    buffer.add(batch, result.version)                   # (or tag(batch, version) on the worker, add it later)
    ...
    restored = engine.restore()
    apply_staleness(restored, {"samples": buffer}, max_staleness=4)
    print(restored.plan)                                # "after loading: samples: ... kept 12, dropped 3 ..."

The versions are saved with the batches (an int64 tensor beside them), so a restored buffer knows how old
each batch is against the restored policy: with versions numbered by the learners' step (as
``PolicyVersions`` publishes them), the restored policy is the restored step's. ``max_staleness=K`` drops
the batches produced by a policy more than K versions older; None keeps them all (and still says how stale
they are). Batches newer than the restored policy (from the timeline that failed) are always dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from rl_ckpt.errors import ConfigError

VERSION_KEY = "policy_version"


def tag(batch: Mapping[str, Any], version: int) -> dict:
    """``batch`` with the version of the policy that produced it (``batch["policy_version"]``)."""
    return {**batch, VERSION_KEY: int(version)}


@dataclasses.dataclass
class StalenessReport:
    """What a staleness bound did to one buffer, against the restored policy version."""

    name: str
    policy_version: int
    bound: int | None
    kept: int
    dropped: int
    dropped_newer: int  # produced by the failed timeline's policies (newer than the restored one)
    oldest: int | None  # staleness of the oldest batch kept (versions behind the policy)
    newest: int | None

    def line(self) -> str:
        ages = "no samples kept" if self.kept == 0 else f"kept samples are {self.newest}..{self.oldest} versions old"
        bound = "no bound (all kept)" if self.bound is None else f"bound {self.bound} versions"
        newer = (
            f" (of which {self.dropped_newer} from policies newer than the restored one)" if self.dropped_newer else ""
        )
        return (
            f"samples {self.name}: against policy version {self.policy_version}, {bound}: kept {self.kept}, "
            f"dropped {self.dropped}{newer}; {ages}"
        )


class VersionedSamples:
    """A buffer of rollout batches (dicts of tensors, arrays or JSON values), each with its policy version."""

    def __init__(self) -> None:
        self.batches: list[dict] = []
        self.versions: list[int] = []

    def add(self, batch: Mapping[str, Any], version: int | None = None) -> None:
        """Keep ``batch``, produced by policy ``version`` (default: its ``policy_version`` tag)."""
        if version is None:
            if VERSION_KEY not in batch:
                raise ConfigError(
                    f"VersionedSamples.add: the batch has no {VERSION_KEY!r} tag and no version was "
                    "given; tag it with rl_ckpt.integrations.samples.tag(batch, version)",
                    key=VERSION_KEY,
                )
            version = batch[VERSION_KEY]
        self.batches.append({k: v for k, v in batch.items() if k != VERSION_KEY})
        self.versions.append(int(version))

    def __len__(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict:
        return {"versions": torch.tensor(self.versions, dtype=torch.int64), "batches": list(self.batches)}

    def load_state_dict(self, state: dict) -> None:
        versions = [int(v) for v in state["versions"].tolist()]
        if len(versions) != len(state["batches"]):
            raise ConfigError(
                f"VersionedSamples: {len(versions)} versions for {len(state['batches'])} batches", key="versions"
            )
        self.batches, self.versions = list(state["batches"]), versions

    def apply_bound(self, policy_version: int, max_staleness: int | None, name: str = "") -> StalenessReport:
        """Drop the batches more than ``max_staleness`` versions older than ``policy_version`` (None: keep all)
        and those newer than it; returns what was kept and dropped."""
        if max_staleness is not None and (
            isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
        ):
            raise ConfigError(
                f"max_staleness={max_staleness!r}; allowed: an integer >= 0 or None",
                key="max_staleness",
                allowed=">= 0 | None",
            )
        keep = [
            policy_version >= v and (max_staleness is None or policy_version - v <= max_staleness)
            for v in self.versions
        ]
        newer = sum(1 for v in self.versions if v > policy_version)
        ages = [policy_version - v for v, k in zip(self.versions, keep) if k]
        self.batches = [b for b, k in zip(self.batches, keep) if k]
        self.versions = [v for v, k in zip(self.versions, keep) if k]
        return StalenessReport(
            name,
            policy_version,
            max_staleness,
            len(ages),
            len(keep) - len(ages),
            newer,
            max(ages) if ages else None,
            min(ages) if ages else None,
        )


def apply_staleness(
    result: Any, buffers: Mapping[str, VersionedSamples], max_staleness: int | None, policy_version: int | None = None
) -> list[StalenessReport]:
    """After ``engine.restore()``: bound each buffer's staleness against the restored policy (``policy_version``,
    default the restored step) and state it in the plan (``result.plan.checks``, printed under "after
    loading") and the result's warnings. A fresh start (nothing restored) leaves the buffers alone."""
    if getattr(result, "snapshot_id", None) is None:
        return []
    version = result.global_step if policy_version is None else policy_version
    reports = [buf.apply_bound(version, max_staleness, name) for name, buf in buffers.items()]
    for report in reports:
        if getattr(result, "plan", None) is not None:
            result.plan.checks.append(report.line())
        result.warnings.append(report.line())
    return reports
