"""``rl-ckpt timeline URL -o FILE.png``: one picture of a run.

Steps on x; the reward curve (from snapshot metrics, or a per-step log);
snapshots as marks (full/light, kept/deleted by retention/retired by a restore, best starred);
memory-tier snapshots as orange diamonds on a row of their own; failures as
red lines and restarts as arrows back to the restored step (green from
durable storage, orange from memory).
Everything comes from the run folder: manifests, ``history/retired/``,
``best/``, ``failures/``, ``decisions/`` and the memory tier's ``memory_tier/``.
"""

from __future__ import annotations

from typing import Any

from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.layout import BEST, DECISIONS, FAILURES, RETIRED
from rl_ckpt._run.records import RecordStore
from rl_ckpt._run.tier_events import load_tier_events
from rl_ckpt._storage import Storage


MEMORY_COLOR = "#e07b00"


def _records(storage: Storage, folder: str) -> list[dict]:
    """The folder's records that are JSON objects (anything else was planted or damaged: not drawn)."""
    return RecordStore(storage, folder).load()


def _step(v: Any) -> int | None:
    """A step read from a record, or None when the record holds something else there."""
    return v if type(v) is int else None


def _str(v: Any) -> str | None:
    """A name read from a record, or None when the record holds something else there."""
    return v if isinstance(v, str) else None


def _failure(record: dict) -> dict:
    """The failure a decision record answered, or {} when the record holds something else there."""
    failure = record.get("failure")
    return failure if isinstance(failure, dict) else {}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def load(storage: Storage, metric: str = "avg_reward") -> dict:
    """The facts the timeline draws."""
    cat = Catalog(storage)
    cat.refresh()
    snaps = [
        {
            "id": i.snapshot_id,
            "step": i.global_step,
            "kind": i.kind,
            "value": _num(i.metrics.get(metric)),
            "state": "quarantined" if i.quarantined else "kept",
        }
        for i in cat.snapshots()
    ]
    listed = {s["id"] for s in snaps}
    for r in _records(storage, RETIRED):
        if not (
            isinstance(r.get("snapshot_id"), str)
            and _step(r.get("global_step")) is not None
            and r.get("kind") in ("full", "light")
            and isinstance(r.get("metrics", {}), dict)
        ):
            continue  # a damaged note: the snapshot is gone either way
        if r["snapshot_id"] in listed:
            continue  # the note is written before the deletion: a crash in between leaves it listed
        # A restore's retire record names what it restored; retention's notes do not.
        state = "retired" if "restored_step" in r else "deleted"
        snaps.append(
            {
                "id": r["snapshot_id"],
                "step": r["global_step"],
                "kind": r["kind"],
                "value": _num(r.get("metrics", {}).get(metric)),
                "state": state,
            }
        )
    best = {r.get("metric"): r.get("snapshot_id") for r in _records(storage, BEST) if isinstance(r.get("metric"), str)}
    failures = [
        {"step": _step(r.get("step")), "kind": str(r.get("kind")), "participant": _str(r.get("participant"))}
        for r in _records(storage, FAILURES)
    ]
    decisions = [
        {
            "step": _step(_failure(r).get("step")),
            "action": r.get("action"),
            "to": _step(r.get("global_step")),
            "snapshot": r.get("snapshot_id"),
            "time": _str(r.get("time")),
            "failure": {
                "step": _step(_failure(r).get("step")),
                "kind": _str(_failure(r).get("kind")),
                "participant": _str(_failure(r).get("participant")),
            },
        }
        for r in _records(storage, DECISIONS)
    ]
    memory, restores = load_tier_events(storage)
    free = list(restores)
    for d in decisions:  # a restart the memory tier answered: where training really resumed, and from which tier
        # The restore names the decision it followed; one planned before the failure record landed names none,
        # and answers the first failure at or after the step it restored.
        got = next(
            (r for r in free if r["decision_time"] is not None and r["decision_time"] == d["time"]), None
        ) or next(
            (r for r in free if r["decision_time"] is None and d["step"] is not None and r["to"] <= d["step"]), None
        )
        if got is not None:
            free.remove(got)
        d["resumed_to"], d["tier"] = (got["to"], got["tier"]) if got else (d["to"], "durable")
    resumes = [r for r in free if r["failure_step"] is not None]
    return {
        "snapshots": sorted(snaps, key=lambda s: s["step"]),
        "best": best,
        "failures": failures,
        "decisions": decisions,
        "metric": metric,
        "memory_snapshots": [
            {"id": m["id"], "step": m["step"], "kind": m["kind"], "value": _num(m["metrics"].get(metric))}
            for m in memory
        ],
        "tier_restores": resumes,
    }


def plot(data: dict, out: str, step_log: list[dict] | None = None, title: str = "") -> dict:
    """Draw ``data`` (from :func:`load`) into the image ``out``; returns what was drawn: the legend entries and the
    text notes (``{"legend": [...], "notes": [...]}``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = data["metric"]
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    if step_log:
        pts = sorted((r["step"], r[metric]) for r in step_log if r.get(metric) is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="#4c72b0", lw=1.4, label=f"{metric} (training log)")
    snaps = data["snapshots"]
    curve = [(s["step"], s["value"]) for s in snaps if s["value"] is not None and s["kind"] == "full"]
    if curve and not step_log:
        ax.plot([c[0] for c in curve], [c[1] for c in curve], color="#4c72b0", lw=1.4, label=f"{metric} at snapshots")
    ymin, ymax = ax.get_ylim() if (curve or step_log) else (0.0, 1.0)
    base = ymin - 0.06 * (ymax - ymin or 1.0)
    styles = {
        ("full", "kept"): dict(marker="^", color="#2a9d4b", s=60),
        ("full", "deleted"): dict(marker="^", facecolors="none", edgecolors="#999999", s=60),
        ("full", "quarantined"): dict(marker="x", color="#d62728", s=60),
        ("light", "kept"): dict(marker="o", color="#8c8cd9", s=18),
        ("light", "deleted"): dict(marker="o", facecolors="none", edgecolors="#bbbbbb", s=18),
        ("light", "quarantined"): dict(marker="x", color="#d62728", s=18),
        ("full", "retired"): dict(marker="v", facecolors="none", edgecolors="#8c564b", s=60),
        ("light", "retired"): dict(marker="o", facecolors="none", edgecolors="#8c564b", s=18),
    }
    labels = {
        ("full", "kept"): "full snapshot (kept)",
        ("full", "deleted"): "full (deleted by retention)",
        ("full", "quarantined"): "quarantined",
        ("light", "kept"): "light snapshot (kept)",
        ("light", "deleted"): "light (deleted)",
        ("light", "quarantined"): None,
        ("full", "retired"): "full (retired: newer than a restore)",
        ("light", "retired"): "light (retired)",
    }
    for key, style in styles.items():
        xs = [s["step"] for s in snaps if (s["kind"], s["state"]) == key]
        if xs:
            ax.scatter(
                xs,
                [s["value"] if s["value"] is not None else base for s in snaps if (s["kind"], s["state"]) == key]
                if key[0] == "full"
                else [base] * len(xs),
                label=labels[key],
                zorder=3,
                **style,
            )
    best_id = data["best"].get(metric)
    best = next((s for s in snaps if s["id"] == best_id), None)
    if best is not None and best["value"] is not None:
        ax.scatter(
            [best["step"]],
            [best["value"]],
            marker="*",
            s=260,
            color="#f2b134",
            edgecolors="k",
            zorder=4,
            label=f"best {metric}",
        )
    for i, f in enumerate(data["failures"]):
        if f["step"] is not None:
            ax.axvline(f["step"], color="#d62728", ls="-", lw=1.5, label="failure" if i == 0 else None)
            ax.annotate(f["kind"], (f["step"], ymax), rotation=90, va="top", ha="right", fontsize=8, color="#d62728")
    memory = data.get("memory_snapshots", [])
    if memory:
        row = ymin - 0.14 * (ymax - ymin or 1.0)
        ax.scatter(
            [m["step"] for m in memory],
            [row] * len(memory),
            marker="D",
            color=MEMORY_COLOR,
            s=22,
            zorder=3,
            label="memory-tier snapshot (Ray memory)",
        )
    resumes = [(d["step"], d.get("resumed_to", d["to"]), d.get("tier", "durable")) for d in data["decisions"]]
    resumes += [(r["failure_step"], r["to"], r["tier"]) for r in data.get("tier_restores", [])]
    for start, to, tier in resumes:
        if start is not None and to is not None:
            y = ymin + 0.85 * (ymax - ymin)
            color = MEMORY_COLOR if tier == "memory" else "#2a9d4b"
            ax.annotate("", xy=(to, y), xytext=(start, y), arrowprops=dict(arrowstyle="->", color=color, lw=1.6))
            ax.annotate(
                f"resume from {'memory ' if tier == 'memory' else ''}step {to}",
                (to, y),
                xytext=(4, 4),
                textcoords="offset points",
                fontsize=8,
                color=color,
            )
    ax.set_xlabel("training step")
    ax.set_ylabel(metric)
    ax.set_title(title or "rl_ckpt timeline")
    ax.grid(alpha=0.25)
    ax.legend(loc="upper left", fontsize=8, ncol=2, framealpha=0.85)
    drawn = {"legend": ax.get_legend_handles_labels()[1], "notes": [t.get_text() for t in ax.texts if t.get_text()]}
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return drawn
