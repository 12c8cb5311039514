"""What a recovery plan says: :class:`RecoveryPlan` and its parts (candidates with reasons, load actions,
the verdicts on the snapshots checked), its JSON form (the manager sends plans as JSON) and ``str(plan)``, the
report a person reads (``rl-ckpt plan URL``). How a plan is decided is :mod:`rl_ckpt._recovery.plan`.
"""

from __future__ import annotations

import dataclasses

from rl_ckpt._format.manifest import now_iso
from rl_ckpt._recovery.coordinator import Decision, FailureInfo


@dataclasses.dataclass
class CandidateNote:
    snapshot_id: str
    global_step: int
    kind: str
    status: str  # chosen | light | skipped | fallback | quarantined | not needed
    reason: str


@dataclasses.dataclass
class LoadAction:
    component: str
    kind: str
    snapshot_id: str
    files: int
    bytes: int


@dataclasses.dataclass
class Verdict:
    """What a plan found of one snapshot it checked, for the restore to reuse
    (:func:`rl_ckpt._recovery.plan.verdict_of`).

    ``schema_version``: the job's schema the snapshot was checked against and fits; ``config_digest``: the
    digest of the manifest checked (a manifest that changed since is checked anew); ``config_warnings``: the
    job's config compared with the snapshot's (None: not compared, e.g. a plan made by the manager).
    """

    schema_version: int
    config_digest: str
    config_warnings: list[str] | None = None


@dataclasses.dataclass
class RecoveryPlan:
    run_url: str
    action: str  # restore | start_fresh | give_up
    reason: str
    target: str | None = None
    light: str | None = None
    continue_from_step: int = 0
    candidates: list[CandidateNote] = dataclasses.field(default_factory=list)
    actions: list[LoadAction] = dataclasses.field(default_factory=list)
    checks: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    failure: FailureInfo | None = None
    decision: Decision | None = None
    deep: bool = True
    layout: str = ""  # sharded components: the layout saved and the one restored onto (rl_ckpt._sharded.layout)
    retired: list[str] | None = None  # newer snapshots moved into history/retired/ by the restore (None: not yet)
    # Ranks of the restoring group the target holds no per-rank state for, and what they get (recovery/new_ranks.py).
    new_ranks: list[str] = dataclasses.field(default_factory=list)
    created_at: str = dataclasses.field(default_factory=now_iso)
    verdicts: dict[str, Verdict] = dataclasses.field(default_factory=dict)  # snapshot id -> what the plan found
    loaded: str | None = None  # what the restore that followed the plan loaded (None: not restored yet)

    @property
    def fresh(self) -> bool:
        return self.action == "start_fresh"

    @property
    def requested(self) -> bool:
        """A plan for the snapshot a caller named (``snapshot_id=``), not one recovery chose."""
        return self.action == "restore" and self.reason == "requested snapshot"

    def followed(self, loaded: str, skipped: dict[str, str]) -> None:
        """Note what the restore that followed this plan did: ``loaded`` was loaded, the snapshots in ``skipped``
        failed while loading (checksums are checked then, before decoding), each with its reason. The plan printed
        after a restore then says why a snapshot it had chosen was not the one loaded."""
        self.loaded = loaded
        for c in self.candidates:
            if c.snapshot_id in skipped and c.status != "skipped":
                c.status, c.reason = "skipped", f"failed while loading: {skipped[c.snapshot_id]}"
            elif c.snapshot_id == loaded and c.status != "chosen":
                c.status, c.reason = "loaded", f"fallback loaded ({c.reason})" if c.reason else "fallback loaded"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["failure"] = self.failure.to_json() if self.failure else None
        d["decision"] = self.decision.to_json() if self.decision else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RecoveryPlan":
        d = dict(d)
        d["candidates"] = [CandidateNote(**c) for c in d.get("candidates", [])]
        d["actions"] = [LoadAction(**a) for a in d.get("actions", [])]
        d["failure"] = FailureInfo.from_json(d["failure"]) if d.get("failure") else None
        d["decision"] = Decision.from_json(d["decision"]) if d.get("decision") else None
        d["verdicts"] = {sid: Verdict(**v) for sid, v in (d.get("verdicts") or {}).items()}
        return cls(**d)

    def __str__(self) -> str:
        checked = "checksums verified" if self.deep else "sizes checked"
        lines = [f"Recovery plan for {self.run_url}  ({checked}; {self.created_at})"]
        if self.failure is not None:
            f = self.failure
            first = f.message.strip().splitlines()[0] if f.message.strip() else ""
            lines.append(f"  failure:   {f.kind} at step {f.step}: {first[:240]}".rstrip(": "))
        if self.decision is not None:
            lines.append(f"  decision:  {self.decision.action} - {self.decision.reason}")
        if self.action == "restore":
            lines.append(f"  target:    {self.target}" + (f" + light {self.light}" if self.light else ""))
            lines.append(f"  why:       {self.reason}")
            if self.loaded is not None and self.loaded != self.target:
                lines.append(f"  loaded:    {self.loaded} (the target failed while loading: see below)")
            elif self.loaded is None and not self.deep:
                lines.append(
                    "  checksums: not checked by this plan; each file is checked as it loads, before it is decoded, "
                    "and a snapshot that fails is skipped with its reason for the next fallback"
                )
            resumes = next((c.global_step for c in self.candidates if c.snapshot_id == self.loaded), None)
            lines.append(f"  continue:  training resumes after step {resumes or self.continue_from_step}")
            if self.layout:
                lines.append(f"  layout:    {self.layout}")
            lines += [f"  new ranks: {line}" for line in self.new_ranks]
            if self.retired:
                lines.append(
                    f"  retired:   {', '.join(self.retired)} (newer: the failed timeline, moved to history/retired/)"
                )
        else:
            lines.append(f"  action:    {self.action.upper()} - {self.reason}")
        if self.candidates:
            lines.append("  snapshots (newest first):")
            for c in self.candidates:
                lines.append(f"    {c.snapshot_id:<28} step {c.global_step:<9} {c.kind:<5} {c.status:<11} {c.reason}")
        if self.actions:
            lines.append("  load, in order:")
            for i, a in enumerate(self.actions, 1):
                lines.append(
                    f"    {i}. {a.component:<16} ({a.kind}) from {a.snapshot_id}: {a.files} file(s), {a.bytes} bytes"
                )
        if self.checks:
            lines.append("  after loading:")
            lines += [f"    - {c}" for c in self.checks]
        if self.fallbacks:
            lines.append(f"  if a step fails: fall back to {', '.join(self.fallbacks)}")
        for w in self.warnings:
            lines.append(f"  WARNING: {w}")
        return "\n".join(lines)
