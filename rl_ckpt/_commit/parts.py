"""Several participants' manifest parts -> the one manifest a commit publishes.

Every participant (a learner rank, a rollout worker) lists only its own files and
components; the coordinator (the manager, or rank 0 of a torch.distributed group)
merges the parts once all are in. Pure function: no storage, no Ray.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import Manifest, now_iso
from rl_ckpt._sharded.layout import merge_components


def merge_parts(
    parts: Mapping[str, Manifest],
    attempt_id: str,
    participants: list[str],
    head: str,
    extra_metrics: Mapping | None = None,
) -> Manifest:
    """One manifest from every participant's part (``participant -> part``).

    Files are concatenated, sharded layouts of one component unioned, probes
    and tags merged. ``head`` names the part whose header fields (step, kind,
    config, ...) the manifest keeps; metrics: ``extra_metrics`` first (e.g.
    Ray Train's reported ones), then every part's, then the head's. Parts that
    disagree on step or kind are a ``CheckpointError``: nothing is committed.
    """
    ordered = [parts[p] for p in sorted(parts)]
    first = parts[head]
    steps = {(m.global_step, m.kind) for m in ordered}
    if len(steps) != 1:
        raise CheckpointError(
            f"participants disagree on step/kind of this save: {sorted(steps)}; nothing was committed",
            snapshot_id=first.snapshot_id,
        )
    files, components, probes, metrics, tags = [], {}, {}, dict(extra_metrics or {}), {}
    for m in ordered:
        files += m.files
        merge_components(components, m.components)
        probes.update((m.extra or {}).get("probes") or {})
        tags.update(m.tags)
    for m in ordered:
        metrics.update(m.metrics)
    metrics.update(first.metrics)
    return dataclasses.replace(
        first,
        files=files,
        components=components,
        metrics=metrics,
        tags=tags,
        created_at=now_iso(),
        writer={"attempt": attempt_id, "participants": list(participants)},
        extra={"probes": probes} if probes else {},
    )
