"""The figures of a Ray demo run, read from its step log and run folder, and the memory tier comparison.

One function computes them for every line that prints them, so the summary's
numbers agree with each other: steps lost is the failure step minus the step
restored, the restored step is the step of the snapshot named, kill-to-first-step
runs from the ``kill`` event the crashing process logged to the first step the
restarted attempt logged.
"""

from __future__ import annotations

import math
from typing import Any


def human_bytes(n: float) -> str:
    """``n`` bytes as the demos print them (one decimal, binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def matches(ref, run, crash_at: int) -> tuple[bool, bool]:
    """(final parameters equal, every logged loss equal) between ``run`` and the uninterrupted ``ref``."""
    last = {}
    for m in run.log:  # the resumed attempt re-logs the redone steps: the last value per step counts
        if m["event"] == "step":
            last[m["step"]] = m
    ref_steps = {m["step"]: m for m in ref.log if m["event"] == "step"}
    pre_crash = [m for m in run.log if m["event"] == "step" and m["step"] <= crash_at][:crash_at]
    losses_equal = all(s in last and last[s]["loss"] == ref_steps[s]["loss"] for s in ref_steps) and all(
        m["loss"] == ref_steps[m["step"]]["loss"] for m in pre_crash
    )
    params_equal = bool(run.done and ref.done and run.done["digest"] == ref.done["digest"])
    return params_equal, losses_equal


# Kill to first step, split: Ray's part (the death noticed, a new worker group up to the train function) and
# the run's own (from the train function's first line to its first step: set up, plan, restore, workers).
SPLIT = (
    ("ray_restart_seconds", "  of which Ray"),
    ("resume_seconds", "  of which resume"),
    ("product_seconds", "    rl_ckpt's share"),
)


def crash_figures(run, data: dict, crash_at: int) -> dict[str, Any]:
    """What the crash cost ``run``: the failure and decision recorded, the tier and snapshot restored, steps lost,
    restore time (the learner's ``restore()`` call), and seconds from the kill to the first step after it."""
    attempts = run.attempts
    resumed = attempts[-1] if len(attempts) > 1 else None
    decision = data["decisions"][0] if data["decisions"] else None
    failure = decision["failure"] if decision else (data["failures"][0] if data["failures"] else None)
    crash_step = failure["step"] if failure and failure["step"] is not None else crash_at
    restored_step = resumed["step"] if resumed else 0
    kill = next((m for m in run.log if m["event"] == "kill"), None)
    back = min((m["t"] for m in run.log if m["event"] == "step" and resumed and m["t"] > resumed["t"]), default=None)
    phases = (resumed.get("phases") or {}) if resumed else {}
    began = phases.get("began")
    # rl_ckpt's own share of the restart: the workers' pool, the engines, the plan and restore, the workers told
    # (not the train function's model and optimizer, nor the first training step, nor the restore's wait for the
    # other learner rank to reach the ranks' agreement: that rank's own start).
    parts = [("began", "pool"), ("learner", "workers_restored")]
    product = sum(phases[b] - phases[a] for a, b in parts) if all(k in phases for p in parts for k in p) else math.nan
    product -= ((resumed or {}).get("restore_timings") or {}).get("agree", 0.0)
    return {
        "failure": failure,
        "decision": decision,
        "crash_step": crash_step,
        "resumed": resumed,
        "tier": (resumed.get("tier") or "durable") if resumed and resumed["restored"] else None,
        "snapshot": resumed["restored"] if resumed else None,
        "restored_step": restored_step,
        "steps_lost": crash_step - restored_step,
        "restore_seconds": resumed.get("restore_seconds", math.nan) if resumed else math.nan,
        "kill_to_first_step": (back - kill["t"]) if (kill and back) else math.nan,
        # Split at the restarted attempt's first line: Ray (noticing the death, a new worker group) and then
        # the run's own restart (engine and tiers set up, restore, rollout workers restored, the first step).
        "ray_restart_seconds": (began - kill["t"]) if (kill and began) else math.nan,
        "resume_seconds": (back - began) if (back and began) else math.nan,
        "product_seconds": product,
    }


def memory_comparison(
    durable: dict,
    memory: dict,
    durable_exact: bool | None,
    memory_exact: bool | None,
    interval: int,
    flush_every: int | None,
    flushed: list[str],
) -> str:
    """Two crash runs side by side, durable-only and with the memory tier (the lines ``tests/test_demo_ray.py``
    and ``tests/test_demo_sharded.py`` parse). ``durable`` / ``memory``: the figures of ``crash_figures`` (or the
    same keys from the sharded drill); ``*_exact``: whether each run ended bitwise equal to an uninterrupted one
    (None for both: the drill makes no such claim, e.g. it restarts on fewer ranks, and the row is left out)."""

    def row(name: str, a: str, b: str) -> str:
        return f"  {name:<20} {a:<28} {b}"

    def seconds(x: float) -> str:
        return f"{x:.2f} s"

    every = f"a durable copy of one in {flush_every}" if flush_every else "durable copies by time"
    rows = [
        f"Memory tier: the same crash with memory snapshots every {interval} steps ({every}; "
        f"durable copies made from memory: {', '.join(flushed) or 'none'})",
        row("", "durable only", "with memory tier"),
        row("restored from", f"{durable['tier']} {durable['snapshot']}", f"{memory['tier']} {memory['snapshot']}"),
        row("restored step", str(durable["restored_step"]), str(memory["restored_step"])),
        row("failure step", str(durable["crash_step"]), str(memory["crash_step"])),
        row("steps lost", str(durable["steps_lost"]), str(memory["steps_lost"])),
        row("restore time", seconds(durable["restore_seconds"]), seconds(memory["restore_seconds"])),
        row("kill to first step", seconds(durable["kill_to_first_step"]), seconds(memory["kill_to_first_step"])),
    ]
    for key, name in SPLIT:  # where the runs have it (the sharded drill times the whole only)
        if not (math.isnan(durable.get(key, math.nan)) or math.isnan(memory.get(key, math.nan))):
            rows.append(row(name, seconds(durable[key]), seconds(memory[key])))
    if durable_exact is not None or memory_exact is not None:
        rows.append(row("exact restart", "YES" if durable_exact else "NO", "YES" if memory_exact else "NO"))
    return "\n".join(rows)


def scoped_figures(run) -> dict[str, Any]:
    """What a lost rollout worker cost ``run``: recovered alone (``RolloutPool``) or by a group restart, whichever
    the log shows after the first ``kill`` of a rollout worker. Seconds from the kill: until the learners saw the
    failure, the replacement was up, rl_ckpt's own share (rejoin + replay; or engines, plan, restore, workers told),
    until the lost work was back in the learners' hands, and until the next training step was done."""
    kill = next((m for m in run.log if m["event"] == "kill" and str(m.get("target", "")).startswith("rollout")), None)
    if kill is None:
        return {}
    t = kill["t"]
    scoped = next((m for m in run.log if m["event"] == "scoped_recovery" and m["t"] > t), None)
    restart = next((m for m in run.log if m["event"] == "attempt" and m["t"] > t), None)
    if scoped is not None and (restart is None or scoped["t"] < restart["t"]):
        nxt = next((m for m in run.log if m["event"] == "step" and m["t"] > t and m["step"] >= kill["step"]), None)
        seen = scoped["t"] - scoped["seconds"] - t  # the event is logged as the batch comes back
        return {
            "how": "alone: " + ("warm standby" if scoped["replacement"] == "standby" else "Ray actor restart"),
            "restored": f"{scoped['restored'] or '-'} ({scoped['tier'] or 'initial state'})",
            "undone": 0,
            "redone": f"{len(scoped['replayed_steps'])} collects replayed + 1",
            "seen": seen,
            "replace": seen + scoped["replace_seconds"],  # (replace_seconds counts from the failure seen)
            "ours": scoped["rejoin_seconds"] + scoped["replay_seconds"],
            "waited": scoped["t"] - t,
            "to_step": (nxt["t"] - t) if nxt else math.nan,
        }
    if restart is None:
        return {}
    fig = crash_figures(run, {"decisions": [], "failures": []}, kill["step"])
    first = next((m for m in run.log if m["event"] == "step" and m["t"] > restart["t"]), None)
    began = (restart.get("phases") or {}).get("began")
    return {
        "how": "group restart (Ray Train)",
        "restored": f"{restart['restored']} ({restart.get('tier') or 'durable'})",
        "undone": kill["step"] - restart["step"],
        "redone": f"{kill['step'] - restart['step']} steps, everyone",
        "seen": math.nan,
        "replace": (began - t) if began else math.nan,
        "ours": fig["product_seconds"],
        "waited": (first["t"] - t) if first else math.nan,
        "to_step": (first["t"] - t) if first else math.nan,
    }


def rollout_comparison(columns: list[tuple[str, dict, bool]]) -> str:
    """A lost rollout worker, side by side: ``(title, scoped_figures(run), exact)`` per run (the lines
    ``tests/test_demo_ray.py`` parses)."""

    def row(name: str, values: list[str]) -> str:
        return f"  {name:<24}" + "".join(f"{v:<31}" for v in values)

    def secs(x: float) -> str:
        return "-" if x != x else f"{x:.2f} s"

    figs = [f for _t, f, _e in columns]
    return "\n".join(
        [
            row("", [t for t, _f, _e in columns]),
            row("recovered", [f.get("how", "-") for f in figs]),
            row("state from", [f.get("restored", "-") for f in figs]),
            row("learner steps undone", [str(f.get("undone", "-")) for f in figs]),
            row("rollout work redone", [f.get("redone", "-") for f in figs]),
            row("kill: failure seen", [secs(f.get("seen", math.nan)) for f in figs]),
            row("kill: replacement up", [secs(f.get("replace", math.nan)) for f in figs]),
            row("rl_ckpt's share", [secs(f.get("ours", math.nan)) for f in figs]),
            row("kill: lost work back", [secs(f.get("waited", math.nan)) for f in figs]),
            row("kill: next step done", [secs(f.get("to_step", math.nan)) for f in figs]),
            row("exact", ["YES" if e else "NO" for _t, _f, e in columns]),
        ]
    )
