"""Loading one snapshot into the registered objects (the restorer's per-snapshot step).

Check the schema (the plan's verdict), load every component (light overlay on top, sharded components
in place), check that each fits its registered object, load it, fill the per-rank state of a rank that
did not exist at save, and re-run the post-load probes. A component that does not fit its object (or a
user object's own load error) raises ``StateMismatchError``/``RestoreError``: falling back would not
help. A snapshot whose probe disagrees is quarantined, then ``CorruptSnapshotError`` lets the restorer
(``core/restorer.py``) fall back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

import torch

from rl_ckpt.config import CheckpointConfig, recorded_config
from rl_ckpt._core.reader import LoadReport, copies_on_load, load_component
from rl_ckpt._core.registry import ComponentRegistry
from rl_ckpt.errors import CheckpointError, CorruptSnapshotError, RestoreError, StateMismatchError
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._format.metrics import decode_metrics
from rl_ckpt._recovery.new_ranks import NewRankGap, derive_seed, new_rank_gaps
from rl_ckpt._recovery.plan import RecoveryPlan, verdict_of
from rl_ckpt._recovery.probe import compare, run_probe
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.quarantine import quarantine
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._storage import Storage
from rl_ckpt._storage.base import per_file

log = logging.getLogger("rl_ckpt")


@dataclasses.dataclass
class RestoreResult:
    """What ``restore`` did. ``snapshot_id`` is None when nothing was found and training starts fresh."""

    snapshot_id: str | None
    global_step: int
    light_snapshot_id: str | None = None
    components: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # snapshot id -> why it was not used
    warnings: list[str] = dataclasses.field(default_factory=list)
    metrics: dict = dataclasses.field(default_factory=dict)
    plan: Any = dataclasses.field(default=None, repr=False)
    # Snapshots newer than the restored step, moved into history/retired/ (the failed timeline).
    retired: list[str] = dataclasses.field(default_factory=list)
    # Where the restore's time went, in seconds: plan, read, hash, decode, copy, probe (and total).
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def fresh(self) -> bool:
        return self.snapshot_id is None


class SnapshotLoader:
    """Loads one snapshot of a run into the components of a registry."""

    def __init__(
        self,
        config: CheckpointConfig,
        train_config: Mapping[str, Any],
        storage: Storage,
        catalog: Catalog,
        registry: ComponentRegistry,
    ) -> None:
        self.config = config
        self.train_config = train_config
        self.storage = storage
        self.catalog = catalog
        self.registry = registry
        self.probe_outputs: dict = {}  # the last load's post-load probe outputs (ranks compare them)
        self.report = LoadReport()  # the last load's timings, and whose objects got a file's bytes in place

    def load(self, sid: str, skipped: dict, strict: bool, light: bool, plan: RecoveryPlan) -> RestoreResult:
        """Load snapshot ``sid`` (with the newest valid light layer on it if ``light``) into the registry.

        ``skipped`` (snapshot id -> reason) gains the light snapshots passed over; the result carries a copy.
        """
        self.probe_outputs = {}
        self.report = report = LoadReport()
        manifest = self._manifest(sid)
        # The plan's schema check and config warnings for this snapshot (made now for one it did not check).
        warnings = verdict_of(
            plan, manifest, self.config.schema_version, recorded_config(self.config, self.train_config)
        )
        missing = []
        sharded: dict[str, str] = {}
        plain = []
        for reg in self.registry:
            key = self.registry.stored_key(manifest, reg.name)
            if key is None:
                missing.append(reg.name)
                continue
            if reg.sharded is not None or "layout" in (manifest.components.get(key) or {}):
                sharded[reg.name] = key  # loaded in place below, after every other check
                continue
            plain.append((reg, key))

        owns = [LoadReport() for _ in plain]  # one per file read (maybe at once); merged even when one fails

        def load_one(i: int) -> Any:
            reg, key = plain[i]
            # A module copies every tensor into its own parameters: it may get views of read-only memory (the
            # memory tier's shared object store: no copy out of it); anything else may keep what it is given.
            return load_component(
                self.storage, manifest, key, readonly_ok=copies_on_load(reg.obj), into=reg.obj, report=owns[i]
            )

        started = time.perf_counter()
        try:
            loaded = per_file(self.storage, list(range(len(plain))), load_one)
        finally:
            for own in owns:
                report.merge(own)
            if self.storage.files_at_once > 1 and len(plain) > 1:  # files read at once: the phases overlapped
                report.overlapped(time.perf_counter() - started)
        states: dict[str, Any] = {reg.name: state for (reg, _key), state in zip(plain, loaded)}
        gaps = self._new_rank_gaps(manifest, missing)
        missing = [m for m in missing if m not in {g.component for g in gaps}]
        if missing:
            msg = f"{sid}: registered component(s) {missing} are not in the snapshot"
            if strict and not all(self.registry.excluded(self.registry.get(m)) for m in missing):
                raise StateMismatchError(
                    msg + "; register them under the names used when saving, or restore(strict=False)",
                    component=missing[0],
                    mismatches=missing,
                    snapshot_id=sid,
                )
            warnings.append(msg + "; they keep their current state")
        top = self._apply_light(manifest, states, skipped, plan) if light else None
        for name, state in states.items():
            check_fits(name, self.registry.get(name).obj, state, sid)
        self._load_sharded(manifest, sharded)
        started = time.perf_counter()
        for name, state in states.items():
            try:
                self.registry.get(name).obj.load_state_dict(state)
            except StateMismatchError as exc:  # the state does not fit (e.g. a data position, other data): say where
                raise exc.reworded(f"{sid}: component {name!r}: {exc}", snapshot_id=sid) from exc
            except CorruptSnapshotError as exc:  # the component found its stored state bad: fall back, as for a file
                raise exc.reworded(f"{sid}: {exc}", snapshot_id=sid) from exc
            except Exception as exc:  # a user object's own error: name the component and snapshot
                raise RestoreError(
                    f"{sid}: loading component {name!r} failed: {type(exc).__name__}: {exc}",
                    snapshot_id=sid,
                    component=name,
                ) from exc
        report.add("copy", time.perf_counter() - started)
        self._fill_new_rank(manifest, [g for g in gaps if g.component not in states])  # (a light layer may hold it)
        started = time.perf_counter()
        self._post_load_check(manifest)
        report.add("probe", time.perf_counter() - started)
        for w in warnings:
            log.warning(w)
        last = top or manifest
        log.info("restored %s (step %d)%s", sid, last.global_step, f" + light {top.snapshot_id}" if top else "")
        return RestoreResult(
            sid,
            last.global_step,
            top.snapshot_id if top else None,
            [*states, *sharded],
            dict(skipped),
            warnings,
            decode_metrics(last.metrics),
            timings=dict(report.timing),
        )

    def _manifest(self, sid: str) -> Manifest:
        """``sid``'s manifest as the catalog parsed it when the plan was made; read alone otherwise (a plan the manager
        made: this process builds no catalog of the whole run just to load one snapshot)."""
        info = self.catalog.known(sid)
        return info.manifest if info is not None and info.manifest is not None else read_manifest(self.storage, sid)

    def _new_rank_gaps(self, manifest: Manifest, missing: list[str]) -> list[NewRankGap]:
        """This participant's per-rank components that other ranks saved and it did not (it did not exist at
        save); StateMismatchError under ``new_rank_state='error'``."""
        me, rule = self.registry.participant, self.config.new_rank_state
        gaps = [
            g
            for g in new_rank_gaps(list(manifest.components), self.registry.group(), self.registry.per_rank(), rule)
            if me in g.new and g.component in missing
        ]
        if gaps and rule == "error":
            names = [g.component for g in gaps]
            raise StateMismatchError(
                f"{manifest.snapshot_id}: {me} has no saved {', '.join(names)}: the snapshot holds them for "
                f"{', '.join(gaps[0].saved_by)} only (the group grew since). new_rank_state='error' refuses this; set "
                "new_rank_state to 'derive' (RNG derived from the saved streams and the rank, other per-rank state "
                "starts as constructed) or 'empty' (all start as constructed)",
                component=names[0],
                mismatches=[g.line() for g in gaps],
                snapshot_id=manifest.snapshot_id,
            )
        return gaps

    def _fill_new_rank(self, manifest: Manifest, gaps: list[NewRankGap]) -> None:
        """Apply ``new_rank_state`` to this participant's components the snapshot holds nothing for."""
        me = self.registry.participant
        for gap in gaps:
            if gap.derives:
                self.registry.get(gap.component).obj.derive_state(derive_seed(manifest, gap, me))
            log.info("restore of %s: %s", manifest.snapshot_id, dataclasses.replace(gap, new=(me,)).line())

    def _load_sharded(self, manifest: Manifest, keys: dict[str, str]) -> None:
        """Each sharded component: this rank reads and verifies only the byte ranges of its own shards."""
        if not keys:
            return
        from rl_ckpt._sharded import is_sharded_section, load_sharded, sharded_view  # (lazy: registry.SHARDED_IMPORT)

        objects = [r.sharded or r.obj for r in self.registry]
        for name, key in keys.items():
            reg = self.registry.get(name)
            if not is_sharded_section(manifest.components[key]):
                raise StateMismatchError(
                    f"{manifest.snapshot_id}: component {name!r} holds sharded state here but was "
                    "saved unsharded; register it as it was saved",
                    component=name,
                    mismatches=[name],
                    snapshot_id=manifest.snapshot_id,
                )
            view = reg.sharded or sharded_view(name, reg.obj, objects)
            load_sharded(self.storage, manifest, key, view, name, self.report.timing)

    def _post_load_check(self, manifest: Manifest) -> None:
        """Re-run the probes recorded at save; a mismatch quarantines the snapshot (then recovery falls back)."""
        if not self.config.post_load_check:
            return
        probes = (manifest.extra or {}).get("probes") or {}
        for reg in self.registry:
            name = reg.name
            reference = probes.get(self.registry.stored_key(manifest, name) or name)
            if reference is None:
                continue
            got = run_probe(reg.obj, fn=reg.probe, shape=self.config.probe_shapes.get(name))
            self.probe_outputs[name] = got
            problem = compare(reference, got, rtol=self.config.probe_rtol, atol=self.config.probe_atol)
            if problem:
                reason = f"post-load check failed for component {name!r}: {problem}"
                quarantine(self.storage, manifest.snapshot_id, reason, source="post-load check")
                self.catalog.mark_quarantined(manifest.snapshot_id, reason)
                raise CorruptSnapshotError(
                    f"{manifest.snapshot_id}: {reason}; snapshot quarantined",
                    snapshot_id=manifest.snapshot_id,
                    problems=[reason],
                )

    def _apply_light(self, full: Manifest, states: dict, skipped: dict, plan: RecoveryPlan) -> Manifest | None:
        """Overlay the newest valid light snapshot built on ``full``; a broken one is skipped."""
        for info in reversed(self.catalog.snapshots("light")):
            if info.base_snapshot_id != full.snapshot_id or info.global_step < full.global_step:
                continue
            try:
                manifest = info.manifest if info.manifest is not None else read_manifest(self.storage, info.snapshot_id)
                verdict_of(plan, manifest, self.config.schema_version)
                light_states = {}
                for reg in self.registry:
                    key = self.registry.stored_key(manifest, reg.name)
                    if key is not None:
                        light_states[reg.name] = load_component(
                            self.storage, manifest, key, readonly_ok=copies_on_load(reg.obj)
                        )
            except CheckpointError as exc:
                skipped[info.snapshot_id] = str(exc)
                log.warning("skipping light snapshot %s: %s", info.snapshot_id, exc)
                continue
            states.update(light_states)
            return manifest
        return None


def check_fits(name: str, obj: Any, state: Any, sid: str) -> None:
    """For modules: every tensor's name, shape and dtype must match, or StateMismatchError lists them."""
    if not isinstance(obj, torch.nn.Module):
        return
    current = obj.state_dict()
    problems = []
    for key, tensor in current.items():
        if key not in state:
            problems.append(f"{key}: missing from snapshot")
            continue
        saved = state[key]
        if not isinstance(saved, torch.Tensor):
            problems.append(f"{key}: snapshot holds {type(saved).__name__}, not a tensor")
        elif tuple(saved.shape) != tuple(tensor.shape):
            problems.append(f"{key}: snapshot shape {list(saved.shape)} != model shape {list(tensor.shape)}")
        elif saved.dtype != tensor.dtype:
            problems.append(f"{key}: snapshot dtype {saved.dtype} != model dtype {tensor.dtype}")
    problems += [f"{key}: in snapshot, not in model" for key in state if key not in current]
    if problems:
        shown = "\n  ".join(problems[:50]) + (f"\n  ... {len(problems) - 50} more" if len(problems) > 50 else "")
        raise StateMismatchError(
            f"{sid}: component {name!r} does not fit the registered model ({len(problems)} tensor(s) differ):\n"
            f"  {shown}\n"
            "Is this snapshot from a different model? Restore into the model it was saved from, or start a new run.",
            component=name,
            mismatches=problems,
            snapshot_id=sid,
        )


__all__ = ["RestoreResult", "SnapshotLoader", "check_fits", "copies_on_load"]
