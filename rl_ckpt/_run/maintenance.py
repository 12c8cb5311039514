"""Run maintenance after a commit: best aliases, retention, tombstones, object sweeps.

Whoever commits a snapshot runs one pass of :meth:`RunMaintenance.after_commit`
(the engine of a single-writer run, the ``CheckpointManager`` of a sharded
one). Order matters for crash safety: best aliases are written first and
deletions come last, so a crash in between only leaves extra snapshots, never
an alias pointing at a deleted one. Every deletion is preceded by a tombstone
(``history/retired/<id>.json``) for the timeline and for people.

The pass runs after the commit point, so nothing in it may fail the save:
each step's error is logged and returned as a warning, and the pass goes on.
A snapshot found gone (deleted by hand, or by another engine on the run) just
leaves the catalog.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable, Sequence

from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import now_iso
from rl_ckpt._format.metrics import clean_metrics
from rl_ckpt._format.untrusted import read_json
from rl_ckpt._run.catalog import Catalog, SnapshotInfo
from rl_ckpt.errors import post_commit_text
from rl_ckpt._run.delete import delete_snapshot
from rl_ckpt._run.dedup import manifest_objects, object_path
from rl_ckpt._run.layout import BEST, RETIRED, best_alias_path, manifest_path, retired_path
from rl_ckpt._run.retention import (
    RetentionDecision,
    RetentionPolicy,
    best_per_metric,
    normalize_best,
    plan_retention,
    policy_from_config,
)
from rl_ckpt._storage import Storage

log = logging.getLogger("rl_ckpt")


def referenced_objects(snapshots: Iterable[SnapshotInfo]) -> dict[str, tuple[str, int]]:
    """Every dedup object the (parsed) manifests of ``snapshots`` reference: digest -> (algo, size)."""
    out: dict[str, tuple[str, int]] = {}
    for info in snapshots:
        if info.manifest is not None:
            out.update(manifest_objects(info.manifest))
    return out


class RunMaintenance:
    """One run's housekeeping after each commit.

    Args:
        storage: the run's storage.
        catalog: the run's catalog (kept in step with what this pass deletes).
        retention: the policy applied after each commit; ``None`` keeps everything.
        best_metric, best_mode: what ranks snapshots for the ``best/`` aliases
            (one metric or a list in priority order; one mode or one per metric).
        keep_best: aliases are written only when this is > 0 (as ``keep_best`` in the config).
        sweep_objects: delete the dedup objects only deleted snapshots referenced,
            right after deleting them. ``False`` when participants may be reusing
            chunks at this moment (the manager of a sharded run): ``rl-ckpt gc``
            sweeps them later, with its grace period.
    """

    def __init__(
        self,
        storage: Storage,
        catalog: Catalog,
        *,
        retention: RetentionPolicy | None,
        best_metric: str | Sequence[str] = "avg_reward",
        best_mode: str | Sequence[str] = "max",
        keep_best: int = 0,
        sweep_objects: bool = True,
    ) -> None:
        self.storage = storage
        self.catalog = catalog
        self.retention = retention
        self.metrics, self.modes = normalize_best(best_metric, best_mode)
        self.keep_best = keep_best
        self.sweep_objects = sweep_objects
        self.last_retention: RetentionDecision | None = None
        # (catalog version, {metric: best id} and the ids seen then): between two changes other
        # than adds, a new best is the old best or one of the snapshots added since.
        self._best_cache: tuple[int, dict | None] = (-1, None)

    @classmethod
    def from_config(
        cls,
        storage: Storage,
        catalog: Catalog,
        config: Any,
        *,
        retention: RetentionPolicy | bool | None = None,
        sweep_objects: bool = True,
    ) -> "RunMaintenance":
        """Maintenance as a :class:`CheckpointConfig` describes it.

        ``retention``: ``None``/``True`` builds the policy from keep_latest, keep_best and
        keep_interval_steps; ``False`` keeps everything; a policy is used as given.
        """
        if retention is None or retention is True:
            retention = policy_from_config(config)
        return cls(
            storage,
            catalog,
            retention=retention or None,
            best_metric=config.best_metric,
            best_mode=config.best_mode,
            keep_best=config.keep_best,
            sweep_objects=sweep_objects,
        )

    # -- the pass ----------------------------------------------------------------
    def after_commit(self) -> list[str]:
        """Aliases, then retention (tombstone, delete, sweep) over the catalog; returns the warnings.

        Never raises for a storage problem: each step's error becomes one warning
        (the snapshot just committed stays committed), and the next pass retries.
        """
        problems: list[str] = []

        def guarded(what: str, fn: Callable, *args: Any) -> Any:
            try:
                return fn(*args)
            except Exception as exc:  # the snapshot is committed whatever happens here
                msg = f"{what}: {post_commit_text(exc)}"
                log.warning("after committing: %s", msg)
                problems.append(msg)
                return None

        if self.keep_best > 0:
            guarded("best-snapshot alias not updated", self._write_best_aliases, self.catalog.snapshots())
        if self.retention is None:
            return problems
        # Quarantined snapshots are neither kept-counted nor deleted: a person decides.
        decision = plan_retention([i for i in self.catalog.snapshots() if not i.quarantined], self.retention)
        self.last_retention = decision
        freed: dict[str, tuple[str, int]] = {}
        for sid in decision.delete:
            info = self.catalog.get(sid)
            if guarded(f"retention could not check {sid}", self.forget_if_vanished, sid):
                continue
            guarded(f"retention: no tombstone for {sid}", self._tombstone, info)
            retired = guarded(f"retention could not delete {sid}", delete_snapshot, self.storage, sid)
            if retired is None:
                continue  # still there: the next pass tries again
            if info is not None and info.manifest is not None:
                freed.update(manifest_objects(info.manifest))
            self.catalog.discard([sid])
            log.info("retention: deleted %s" if retired else "retention: %s was already gone", sid)
        if freed and self.sweep_objects:
            guarded("retention could not sweep unused objects", self._sweep_objects, freed)
        return problems

    def forget_if_vanished(self, snapshot_id: str) -> bool:
        """True (and the catalog forgets it) when a listed snapshot's manifest is gone from storage."""
        if self.storage.exists(manifest_path(snapshot_id)):
            return False
        log.warning(
            "snapshot %s is no longer in %s (deleted outside this engine); forgetting it", snapshot_id, self.storage.url
        )
        self.catalog.discard([snapshot_id])
        return True

    def best(self, metric: str | None = None) -> SnapshotInfo | None:
        """The best committed snapshot by ``metric`` (default: the first best metric; unknown metrics rank by max)."""
        metric = metric or self.metrics[0]
        mode = self.modes[self.metrics.index(metric)] if metric in self.metrics else "max"
        sid = best_per_metric(self.catalog.snapshots(), [metric], [mode]).get(metric)
        return self.catalog.get(sid) if sid else None

    # -- steps ---------------------------------------------------------------------
    def _tombstone(self, info: SnapshotInfo | None) -> None:
        """A note of what retention deleted, written before deleting."""
        if info is None:
            return
        body = {
            "snapshot_id": info.snapshot_id,
            "global_step": info.global_step,
            "kind": info.kind,
            "metrics": clean_metrics(info.metrics),
            "size_bytes": info.size_bytes,
            "deleted_at": now_iso(),
        }
        self.storage.makedirs(RETIRED)
        self.storage.write_atomic(retired_path(info.snapshot_id), json.dumps(body).encode())

    def _sweep_objects(self, candidates: dict[str, tuple[str, int]]) -> None:
        """Delete dedup objects of deleted snapshots that no remaining manifest references.

        Only the committer writes to the run here and it is between saves, so no
        in-flight save can be reusing them (``gc`` sweeps everything else, with a
        grace period).
        """
        live = referenced_objects(self.catalog.snapshots())
        if self.catalog.unreadable():
            return  # an unreadable manifest may reference these: leave them to gc
        for digest, (algo, _size) in candidates.items():
            if digest not in live:
                self.storage.remove(object_path(algo, digest))

    def _write_best_aliases(self, snapshots: list[SnapshotInfo]) -> None:
        version, cached = self._best_cache
        if version == self.catalog.version and cached is not None:
            known = cached["_seen"]
            best_ids = {v for k, v in cached.items() if k != "_seen"}
            pool = [i for i in snapshots if i.snapshot_id in best_ids or i.snapshot_id not in known]
        else:
            pool = snapshots
        best = best_per_metric(pool, self.metrics, self.modes)
        gone = [sid for sid in set(best.values()) if self.forget_if_vanished(sid)]
        if gone:  # a best snapshot deleted outside this engine: rank again without it
            return self._write_best_aliases(self.catalog.snapshots())
        self._best_cache = (self.catalog.version, {**best, "_seen": {i.snapshot_id for i in snapshots}})
        for metric, sid in best.items():
            info = self.catalog.get(sid)
            mode = self.modes[self.metrics.index(metric)]
            body = {
                "snapshot_id": sid,
                "global_step": info.global_step if info else None,
                "metric": metric,
                "mode": mode,
                "value": info.metrics.get(metric) if info else None,
                "updated_at": now_iso(),
            }
            if self._best_alias(metric) != body["snapshot_id"]:
                self.storage.makedirs(BEST)
                self.storage.write_atomic(best_alias_path(metric), json.dumps(body).encode())

    def _best_alias(self, metric: str) -> str | None:
        path = best_alias_path(metric)
        try:
            record = read_json(self.storage, path) if self.storage.exists(path) else None
        except CheckpointError:  # unreadable or planted: the alias is rewritten from the catalog
            return None
        sid = record.get("snapshot_id") if isinstance(record, dict) else None
        return sid if isinstance(sid, str) else None


__all__ = ["RunMaintenance", "referenced_objects"]
