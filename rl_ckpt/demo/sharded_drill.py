"""The sharded demo's crash drill: FSDP2 learners SIGKILLed mid-run, the run restarted on fewer, figures checked.

``crash_drill`` runs it once: durable snapshots saved by the learners, or
(``memory_tier=``) memory snapshots with durable copies made from memory by the
run's ``MemoryTierService``. ``side_by_side`` runs it both ways on one set of
rollout actors and prints time lost, restore time and kill-to-first-step of the
two next to each other (``figures.memory_comparison``). Every figure comes from
the run's JSON-lines event log and its run folder, and the figures are checked
against each other: a disagreement is reported, never hidden.
"""

from __future__ import annotations

import dataclasses
import os

from rl_ckpt.demo.figures import memory_comparison
from rl_ckpt.demo.grpo import GRPOConfig
from rl_ckpt.demo.grpo_rollout import start_actors
from rl_ckpt.demo.sharded_grpo import MEMORY_DEFAULTS, Run


AUDIT_KEYS = ("consumed", "skipped", "duplicated", "resumed_in_flight", "epochs")


@dataclasses.dataclass
class DrillReport:
    """What ``crash_drill`` prints, the figures behind it, and whether they agree with each other."""

    text: str
    figures: dict
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def crash_drill(
    base_dir: str,
    *,
    steps: int = 40,
    crash_at: int = 17,
    learners: int = 2,
    restart_learners: int = 1,
    save_every: int = 2,
    grpo: GRPOConfig | None = None,
    n_actors: int = 2,
    run_name: str = "grpo_gpt2",
    memory_tier: dict | None = None,
    actors: list | None = None,
) -> DrillReport:
    """Train on ``learners`` FSDP2 ranks, SIGKILL the last one at ``crash_at``, restart on ``restart_learners``.

    ``save_every``: durable snapshots by the learners. ``memory_tier``: the ``memory_*`` config keys
    (``MEMORY_DEFAULTS``) of a drill whose learners save memory snapshots instead, the durable copies made
    from memory by the service (and the final snapshot flushed at the end). ``actors``: rollout actors to use
    (default: the drill's own).
    """
    from ray.train import TrainingFailedError

    first = memory_tier["memory_interval_steps"] if memory_tier else save_every
    if not first < crash_at <= steps:
        raise ValueError(f"crash_at={crash_at} must come after the first save (step {first}) and by step {steps}")
    run = Run.start(base_dir, run_name, grpo, n_actors=n_actors, actors=actors, memory_tier=memory_tier)
    try:
        failed = None
        try:
            run.fit(learners, steps, save_every=save_every, crash_at=crash_at)
        except TrainingFailedError as exc:
            failed = exc  # the attempt failed with its learner: what the drill is for
        if not os.path.exists(run.log) or not any(e["event"] == "kill" for e in run.events()):
            raise RuntimeError(
                f"the first attempt ended without the planned SIGKILL of a learner: {failed}"
            ) from failed
        run.fit(restart_learners, steps, save_every=save_every)
        status = run.memory_status(flush_newest=True)
        return summarize(run, learners, restart_learners, steps, save_every, status)
    finally:
        run.close()


def side_by_side(
    base_dir: str,
    *,
    steps: int = 40,
    crash_at: int = 18,
    learners: int = 2,
    restart_learners: int = 1,
    save_every: int = 6,
    memory_tier: dict | None = None,
    grpo: GRPOConfig | None = None,
    n_actors: int = 2,
    run_name: str = "grpo_gpt2",
) -> DrillReport:
    """The drill durable-only (a snapshot every ``save_every`` steps), then with the memory tier (``memory_tier``,
    default ``MEMORY_DEFAULTS``: a memory snapshot every 2 steps, a durable copy of every 3rd), on one set of
    rollout actors; the report holds both drills and the comparison table."""
    import ray

    memory_tier = dict(memory_tier or MEMORY_DEFAULTS)
    grpo = grpo or GRPOConfig()
    actors = start_actors(grpo, n_actors)
    try:
        common = {
            "steps": steps,
            "crash_at": crash_at,
            "learners": learners,
            "restart_learners": restart_learners,
            "save_every": save_every,
            "grpo": grpo,
            "actors": actors,
        }
        durable = crash_drill(base_dir, run_name=run_name, **common)
        memory = crash_drill(base_dir, run_name=f"{run_name}_memory", memory_tier=memory_tier, **common)
    finally:
        for a in actors:
            ray.kill(a)
    d, m = durable.figures, memory.figures
    table = memory_comparison(
        d, m, None, None, memory_tier["memory_interval_steps"], memory_tier.get("memory_flush_every"), m["flushed"]
    )
    problems = [f"durable drill: {p}" for p in durable.problems] + [f"memory drill: {p}" for p in memory.problems]
    if m["tier"] != "memory":
        problems.append(f"the memory drill restored from {m['tier']}, not from memory")
    if not m["steps_lost"] <= d["steps_lost"]:
        problems.append(f"the memory tier lost more steps than durable-only: {m['steps_lost']} > {d['steps_lost']}")
    text = "\n\n".join(
        [
            durable.text,
            memory.text,
            table + f"\n  consistent           {'YES' if not problems else 'NO: ' + '; '.join(problems)}",
        ]
    )
    return DrillReport(text, {"durable": d, "memory": m}, problems)


def summarize(
    run: Run, learners: int, restart_learners: int, steps: int, save_every: int, memory_status: dict | None = None
) -> DrillReport:
    """The drill's figures, from the event log and the snapshots, checked against each other."""
    from rl_ckpt._storage import open_storage
    from rl_ckpt._timeline import load

    events = run.events()
    kill = next(e for e in events if e["event"] == "kill")
    attempts = [e for e in events if e["event"] == "attempt"]
    resumed = attempts[-1]
    after = [e for e in events if e["event"] == "step" and e["t"] > resumed["t"]]
    before = [e for e in events if e["event"] == "step" and e["t"] < resumed["t"]]
    done = next((e for e in reversed(events) if e["event"] == "done"), None)
    audit = next((e for e in reversed(events) if e["event"] == "audit"), None)
    storage = open_storage(f"{run.base_dir.rstrip('/')}/{run.run_name}", run.storage_options or {})
    data = load(storage)
    # Committed (kept and since deleted by retention) on durable storage, and in memory as recorded in the run.
    committed = [s["step"] for s in data["snapshots"]] + [s["step"] for s in data["memory_snapshots"]]
    saved_by = resumed.get("saved_by") or {}
    newest_before_kill = max((s for s in committed if s <= kill["last_done"]), default=None)
    redone = kill["last_done"] - resumed["step"]
    downtime = after[0]["t"] - kill["t"] if after else float("nan")
    rewards = {e["step"]: e["reward"] for e in before + after}  # a redone step counts as it was last run
    first, final = rewards.get(1), done["reward"] if done else None
    stats = run.rollout_stats()
    loads = sum(s["loads"] for s in stats)
    moved = {k: sum(s.get("moved", {}).get(k, 0) for s in stats) for k in ("full", "delta", "pulls")}
    memory = run.memory["cfg"] if run.memory else None
    flushed = sorted((memory_status or {}).get("flushed", []))  # durable copies the service made from memory
    tier = resumed.get("tier")
    figures = {
        "saved_world": saved_by.get("world_size"),
        "learners": learners,
        "restart_world": resumed["world"],
        "killed_rank": kill["rank"],
        "kill_step": kill["last_done"],
        "restored": resumed["restored"],
        "restored_step": resumed["step"],
        "plan_target": resumed["target"],
        "plan_continue": resumed["continue"],
        "newest_before_kill": newest_before_kill,
        "steps_redone": redone,
        "downtime_s": downtime,
        "first_step_after": after[0]["step"] if after else None,
        "first_reward": first,
        "final_reward": final,
        "final_step": done["step"] if done else None,
        "layout": resumed["layout"],
        "weight_loads": loads,
        "version_bytes_full": moved["full"],
        "version_bytes_delta": moved["delta"],
        "version_pulls": moved["pulls"],
        "flushed": flushed,
        # The names figures.memory_comparison reads (the same figures).
        "tier": tier,
        "snapshot": resumed["restored"],
        "crash_step": kill["last_done"],
        "steps_lost": redone,
        "restore_seconds": resumed.get("restore_seconds", float("nan")),
        "kill_to_first_step": downtime,
        "audit": {k: audit[k] for k in AUDIT_KEYS} if audit else None,
    }
    problems = []
    expect = [
        ("the snapshot was saved by the first attempt's learners", saved_by.get("world_size"), learners),
        ("the restart ran on the requested learners", resumed["world"], restart_learners),
        ("the plan's target is the snapshot restored", resumed["target"], resumed["restored"]),
        ("the plan continues from the restored step", resumed["continue"], resumed["step"]),
        ("the restored snapshot is the newest committed before the kill", newest_before_kill, resumed["step"]),
        ("the first step after the restart follows the restored one", figures["first_step_after"], resumed["step"] + 1),
        ("the run finished", figures["final_step"], steps),
    ]
    if audit:
        expect += [
            ("no prompt skipped", audit["skipped"], 0),
            ("no prompt trained on twice", audit["duplicated"], 0),
            (
                "the auditor's log agrees with its snapshot",
                {k: audit["replayed"][k] for k in AUDIT_KEYS},
                figures["audit"],
            ),
            ("every step's prompts trained on", audit["consumed"], steps * run.grpo.prompts_per_step),
        ]
    else:
        problems.append("the learners reported no audit")
    if memory:
        expect.append(("the restart restored from memory", tier, "memory"))
        expect.append(
            (
                "the final snapshot has a durable copy made from memory",
                flushed[-1] if flushed else None,
                f"step_{steps:09d}",
            )
        )
    problems += [f"{what}: {got} != {want}" for what, got, want in expect if got != want]
    if f"saved by {learners} ranks as FSDP({learners}) -> restored on {restart_learners} rank" not in resumed["layout"]:
        problems.append(
            f"the plan's layout line does not name FSDP({learners}) -> {restart_learners}: {resumed['layout']!r}"
        )
    if redone < 0 or not downtime > 0:
        problems.append(f"time lost is negative: {redone} steps, {downtime} s")
    cadence = (
        f"a memory snapshot every {memory['memory_interval_steps']} steps, a durable copy of one in "
        f"{memory['memory_flush_every']} made from memory"
        if memory
        else f"a snapshot every {save_every} steps"
    )
    lines = [
        "rl_ckpt demo --sharded: GRPO on a tiny GPT-2, FSDP2 learners on Ray Train, SIGKILL, restart on fewer learners"
        + (", memory tier" if memory else ", durable snapshots only"),
        f"  storage            {storage.url}" + (f" (memory: raymem://mem/{run.run_name})" if memory else ""),
        f"  task               repeat the prompt digit {run.grpo.gen_len} times; {run.grpo.prompts_per_step} prompts x "
        f"{run.grpo.group_size} answers per step; {cadence}",
        f"  failure            SIGKILL of learner rank {kill['rank']} of {kill['world']} "
        f"after step {kill['last_done']}",
        f"  layout             {resumed['layout'] or '-'}",
        f"  restored           {resumed['restored']} (step {resumed['step']}) on {resumed['world']} learner(s), "
        f"from {tier or '-'} in {figures['restore_seconds']:.2f} s",
        f"  time lost          {redone} step{'' if redone == 1 else 's'} redone"
        + (f" (steps {resumed['step'] + 1}..{kill['last_done']})" if redone > 0 else "")
        + "; "
        f"{downtime:.1f} s from the kill to the first step after the restart",
    ]
    if memory:
        lines.append(f"  durable copies     {', '.join(flushed) or 'none'} (made from memory by the service)")
    lines += [
        f"  reward             {first:.3f} at step 1 -> {final:.3f} at step {figures['final_step']}"
        if first is not None and final is not None
        else "  reward             -",
        f"  rollout actors     {len(run.actors)}, {loads} weight loads"
        + (
            f": policy versions pulled, {moved['full'] / 2**20:.1f} MiB full (first pulls) + "
            f"{moved['delta'] / 2**20:.1f} MiB delta (changed chunks only) in {moved['pulls']} pulls"
            if moved["pulls"]
            else " of full weights from snapshots (one call each)"
        ),
        f"  data               {run.grpo.dataset_size} prompts (a Hugging Face dataset), a PromptSampler's order; "
        + (
            f"{audit['consumed']} trained on over {audit['epochs']} complete epoch(s): skipped {audit['skipped']}, "
            f"duplicated {audit['duplicated']}, resumed in flight {audit['resumed_in_flight']} (rollouts are "
            "synchronous here: none is in flight at a snapshot)"
            if audit
            else "no audit"
        ),
        f"  consistent         {'YES' if not problems else 'NO: ' + '; '.join(problems)}",
        "",
        "Recovery plan followed by the restarted learner(s):",
        resumed["plan"],
    ]
    return DrillReport("\n".join(lines), figures, problems)


def scoped_drill(
    base_dir: str,
    *,
    steps: int = 12,
    crash_at: int = 7,
    faults: list[dict] | None = None,
    learners: int = 2,
    save_every: int = 2,
    standbys: int | dict[int, int] = 0,
    grpo: GRPOConfig | None = None,
    n_actors: int = 2,
    run_name: str = "grpo_gpt2_scoped",
) -> DrillReport:
    """An uninterrupted run, then the same run with rollout actors SIGKILLed mid-rollout, recovered alone.

    ``faults`` (``Run.fit``'s; default: ``rollout-1`` at step ``crash_at``, mid-generation). ``standbys``: warm
    spare actors per learner rank (else Ray restarts the lost actor). The report checks that the learners never
    went back a step and never restarted, that each fault was recovered alone with its task issued again, that every
    step's rollouts and the final weights are bitwise the uninterrupted run's, and that the auditor counts every
    prompt once."""
    grpo = grpo or GRPOConfig()
    if faults is None:
        if not 0 < crash_at <= steps:
            raise ValueError(f"crash_at={crash_at} must be a step of the run (1..{steps})")
        faults = [{"id": 0, "target": "rollout-1", "step": crash_at, "moment": grpo.gen_len // 2}]
    import ray

    events, stats = {}, []
    actors = start_actors(grpo, n_actors)  # one set for both runs (stateless: each call names its weights)
    try:
        for name, fit in ((f"{run_name}_reference", {}), (run_name, {"faults": faults, "standbys": standbys})):
            run = Run.start(base_dir, name, grpo, actors=actors)
            try:
                run.fit(learners, steps, save_every=save_every, **fit)
                events[name], stats = run.events(), run.rollout_stats()
            finally:
                actors = run.actors  # a standby that took over stands in for the actor it replaced
                run.close()
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
    report = scoped_summary(events[f"{run_name}_reference"], events[run_name], faults, steps, grpo)
    report.figures["rollout_stats"] = stats  # the faulted run's actors (a replacement counts from its start)
    return report


def scoped_summary(
    ref: list[dict], events: list[dict], faults: list[dict], steps: int, grpo: GRPOConfig
) -> DrillReport:
    """The scoped drill's figures (from the two runs' event logs), checked against what it claims."""

    def of(log: list[dict], kind: str) -> list[dict]:
        return [e for e in log if e["event"] == kind]

    done, ref_done = (next(iter(of(log, "done")[::-1]), None) for log in (events, ref))
    audit = next(iter(of(events, "audit")[::-1]), None)
    kills = [e for e in of(events, "kill") if str(e.get("target", "")).startswith("rollout-")]
    recoveries = of(events, "scoped_recovery")
    logged = [e["step"] for e in of(events, "step")]
    rollouts = {e["step"]: e.get("rollouts") for e in of(events, "step")}
    ref_rollouts = {e["step"]: e.get("rollouts") for e in of(ref, "step")}
    differ = sorted(s for s in ref_rollouts if rollouts.get(s) != ref_rollouts[s])
    worlds = "/".join(str(e["world"]) for e in of(events, "attempt")) or "-"
    undone = sum(a - b + 1 for a, b in zip(logged, logged[1:]) if b <= a)  # steps logged again after going back
    figures = {
        "attempts": len(of(events, "attempt")),
        "steps_logged": logged,
        "steps_undone": undone,
        "kills": [(e["target"], e["step"], e.get("moment")) for e in kills],
        "recoveries": [
            {
                **{
                    k: r.get(k)
                    for k in ("participant", "step", "replacement", "seconds", "replace_seconds", "restored", "task")
                },
                "kill_to_result": r["t"]
                - next((k["t"] for k in kills if (k["target"], k["step"]) == (r["participant"], r["step"])), r["t"]),
            }
            for r in recoveries
        ],
        "rollouts_equal": not differ and len(rollouts) == len(ref_rollouts) == steps,
        "rollouts_differ": differ,
        "weights_equal": bool(done and ref_done and done.get("digest") == ref_done.get("digest")),
        "digest": done.get("digest") if done else None,
        "final_step": done["step"] if done else None,
        "audit": {k: audit[k] for k in AUDIT_KEYS} if audit else None,
    }
    expect = [
        ("one attempt: Ray Train never restarted the learners", figures["attempts"], 1),
        ("the learners' steps went 1, 2, ... never back", logged, list(range(1, steps + 1))),
        (
            "every fault struck",
            sorted((k[0], k[1]) for k in figures["kills"]),
            sorted((f["target"], f["step"]) for f in faults),
        ),
        (
            "each lost actor was recovered alone at the step it was lost",
            sorted((r["participant"], r["step"]) for r in recoveries),
            sorted((f["target"], f["step"]) for f in faults),
        ),
        ("every step's rollouts are the uninterrupted run's, bitwise", differ, []),
        ("the final weights are the uninterrupted run's, bitwise", figures["weights_equal"], True),
        ("the run finished", figures["final_step"], steps),
    ]
    if audit:
        expect += [
            ("no prompt skipped", audit["skipped"], 0),
            ("no prompt trained on twice", audit["duplicated"], 0),
            ("every step's prompts trained on", audit["consumed"], steps * grpo.prompts_per_step),
            (
                "the auditor's log agrees with its snapshot",
                {k: audit["replayed"][k] for k in AUDIT_KEYS},
                figures["audit"],
            ),
        ]
    problems = [f"{what}: {got} != {want}" for what, got, want in expect if got != want]
    if not audit:
        problems.append("the learners reported no audit")
    lines = [
        "rl_ckpt demo --sharded --crash-target rollout: GRPO on a tiny GPT-2, FSDP2 learners on Ray Train, rollout "
        "actors SIGKILLed mid-rollout and recovered alone",
        f"  run                {steps} steps on {worlds} learner(s), compared with an uninterrupted run of the same "
        "config",
    ]
    replacements = {"restart": "Ray's restart of the actor", "standby": "a warm standby taking its place"}
    for r in recoveries:
        task = r.get("task") or {}
        prompts = task.get("prompts") or []
        epochs = ", ".join(str(e) for e in sorted({p[0] for p in prompts})) or "-"
        kill = next((k for k in kills if (k["target"], k["step"]) == (r["participant"], r["step"])), {})
        moment = kill.get("moment")
        where = {"pull": "before it got the step's weights", None: "in its rollout"}.get(
            moment, f"mid-generation (before answer token {moment} of {grpo.gen_len})"
        )
        lines += [
            f"  lost               {r['participant']} at step {r['step']}, {where}",
            f"    replacement      {replacements.get(r['replacement'], r['replacement'])}",
            f"    task redone      step {task.get('step', '-')}, {len(prompts)} prompts of epoch {epochs}, the policy "
            f"of {task.get('snapshot', '-')}: issued again whole",
            f"    learners waited  {r['t'] - kill.get('t', float('nan')):.2f} s from the kill for that part: the loss",
            f"                     seen after {r['t'] - r['seconds'] - kill.get('t', float('nan')):.2f} s, the "
            f"replacement up {r['replace_seconds']:.2f} s later, then {r['seconds'] - r['replace_seconds']:.2f} s to "
            "get the weights and sample",
        ]
    lines += [
        f"  learner steps      {logged[0] if logged else '-'}..{logged[-1] if logged else '-'} in order, "
        f"{figures['attempts']} attempt(s): {figures['steps_undone']} step(s) undone",
        "  rollouts           every step's equal to the uninterrupted run's: "
        + ("YES" if figures["rollouts_equal"] else f"NO (steps {differ})"),
        f"  final weights      bitwise equal to the uninterrupted run's: {'YES' if figures['weights_equal'] else 'NO'}",
        "  data               "
        + (
            f"{audit['consumed']} prompts trained on over {audit['epochs']} complete epoch(s): skipped "
            f"{audit['skipped']}, duplicated {audit['duplicated']}"
            if audit
            else "no audit"
        ),
        f"  consistent         {'YES' if not problems else 'NO: ' + '; '.join(problems)}",
    ]
    return DrillReport("\n".join(lines), figures, problems)
