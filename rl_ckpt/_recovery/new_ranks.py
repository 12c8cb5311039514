"""Per-rank state of ranks that did not exist when a snapshot was saved (a group restored larger).

Learners 0 and 1 saved ``learner-0/rng`` and ``learner-1/rng``; restored on four ranks, learner-2 and
learner-3 find none. The ``new_rank_state`` config key is the declared rule for what they get:

- ``derive`` (default): a component that can derive its state (``derive_state(seed)``, e.g. ``RNGState``)
  is seeded from a digest of what the snapshot holds of that component (every saved rank's files, by
  their checksums) and the new rank's name: the same restore derives the same streams, each new rank
  gets streams of its own, and none is a copy of a saved rank's (which would repeat its dropout masks or
  exploration noise). Any other per-rank component (a replay buffer) starts as constructed, i.e. empty.
- ``empty``: every such component starts as constructed (an ``RNGState`` keeps what the process seeded).
- ``error``: the restore refuses, naming the ranks and components.

Ranks that existed at save load their own state as always; a group restored smaller drops the state
of the ranks that are gone. Pure functions of a manifest's component keys and checksums: the engine
prints the plan's line with them and the restorer applies the same decision.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any, Mapping, Sequence

from rl_ckpt._format.manifest import Manifest

NEW_RANK_RULES = ("derive", "empty", "error")
_SEED_DOMAIN = b"rl_ckpt new-rank state v1\0"


@dataclasses.dataclass(frozen=True)
class NewRankGap:
    """One per-rank component that the snapshot holds for some ranks of a role and not for others."""

    component: str  # the registered name
    saved_by: tuple[str, ...]  # participants the snapshot holds it for
    new: tuple[str, ...]  # participants of the restoring group it holds nothing for
    derivable: bool  # the component has ``derive_state(seed)``
    rule: str  # new_rank_state

    @property
    def derives(self) -> bool:
        return self.rule == "derive" and self.derivable

    def line(self) -> str:
        """The plan's line: ``learner-2, learner-3: no saved rng; derived from ...``."""
        if self.rule == "error":
            then = "the restore refuses (new_rank_state='error')"
        elif self.derives:
            then = (
                f"derived from the saved streams of {', '.join(self.saved_by)} and the rank's name "
                "(new_rank_state='derive')"
            )
        else:
            why = "it has no derive_state()" if self.rule == "derive" else "new_rank_state='empty'"
            then = f"starts as constructed ({why})"
        return f"{', '.join(self.new)}: no saved {self.component}; {then}"


def _rank_of(participant: str) -> tuple[str, int]:
    role, _, rank = participant.rpartition("-")
    return role, int(rank) if rank.isdigit() else -1


def new_rank_gaps(
    stored: Sequence[str], participants: Sequence[str], per_rank: Mapping[str, bool], rule: str
) -> list[NewRankGap]:
    """The per-rank components some ranks of the restoring group have no saved state for.

    Args:
        stored: the snapshot's component keys (``learner-0/rng``, ``shared/policy``, ...).
        participants: the restoring group of this process's role (``learner-0`` ... ``learner-3``).
        per_rank: the registered components stored per participant: name -> has ``derive_state``.
        rule: ``new_rank_state``.
    """
    gaps = []
    roles = {_rank_of(p)[0] for p in participants}
    for name, derivable in per_rank.items():
        pattern = re.compile(r"(?P<p>(?P<role>.+)-\d+)/" + re.escape(name))
        saved = {m["p"] for m in map(pattern.fullmatch, stored) if m is not None and m["role"] in roles}
        new = tuple(p for p in participants if p not in saved)
        if saved and new:  # held for nobody: a component missing from the snapshot, not a new rank's
            gaps.append(NewRankGap(name, tuple(sorted(saved, key=_rank_of)), new, derivable, rule))
    return gaps


def derive_seed(manifest: Manifest, gap: NewRankGap, participant: str) -> bytes:
    """32 bytes for ``participant``'s ``gap.component``: a digest of the saved ranks' state of it (the
    manifest's checksums of their files and dedup objects) and the participant's name."""
    h = hashlib.sha256(_SEED_DOMAIN)
    h.update(f"{participant}\0{gap.component}\0".encode())
    for saved in gap.saved_by:
        key = f"{saved}/{gap.component}"
        files = sorted((f.path, f.algo, f.checksum) for f in manifest.files_of(key))
        objects = (manifest.components.get(key) or {}).get("objects") or {}
        h.update(json.dumps([key, files, objects], sort_keys=True, default=str).encode())
    return h.digest()


def plan_lines(
    manifest_components: Mapping[str, Any], participants: Sequence[str], per_rank: Mapping[str, bool], rule: str
) -> list[str]:
    """The plan's lines for the new ranks of a restore onto ``participants`` (none when nothing is new)."""
    return [g.line() for g in new_rank_gaps(list(manifest_components), participants, per_rank, rule)]


__all__ = ["NEW_RANK_RULES", "NewRankGap", "derive_seed", "new_rank_gaps", "plan_lines"]
