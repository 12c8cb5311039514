"""The Ray PPO demo's drills of lost rollout workers: ``rl-ckpt demo --crash-target rollout`` (one worker killed
mid-rollout: the old group restart beside the scoped recovery, by Ray's restart and by a warm standby) and
``rl-ckpt demo --chaos`` (many faults in one run, then the verdict). Both compare with an uninterrupted run."""

from __future__ import annotations

import sys

from rl_ckpt.demo.chaos import chaos_report, plan_faults
from rl_ckpt.demo.figures import matches, rollout_comparison, scoped_figures
from rl_ckpt.demo.ppo import PPOConfig

ENGINE = {
    "save_interval_steps": 10,
    "light_interval_steps": 0,
    "keep_latest": 2,
    "keep_best": 1,
    "dedup": True,
    "dedup_min_tensor_bytes": 4096,
}  # full snapshots only: a rollout worker rejoins from one


def rollout_drill(base: str, steps: int, crash_at: int, *, seed: int = 0, memory_tier: bool = True) -> tuple[str, bool]:
    """rollout-0 SIGKILLed halfway through its collect of ``crash_at``, three ways: a group restart (scoped
    recovery off, as before), recovered alone by Ray's restart of it, recovered alone by a warm standby."""
    from rl_ckpt.demo.ray_ppo import run

    common = {"base_dir": base, "steps": steps, "seed": seed, "engine_cfg": ENGINE, "memory_tier": memory_tier}
    print("1/4 uninterrupted reference run ...", file=sys.stderr)
    ref = run(run_name="ppo_reference", **common)
    crash = {"crash_at": crash_at, "crash_target": "rollout"}
    print(
        f"2/4 rollout-0 SIGKILLed mid-rollout at step {crash_at}: group restart (scoped recovery off) ...",
        file=sys.stderr,
    )
    group = run(run_name="ppo_group", scoped=False, **crash, **common)
    print("3/4 the same, recovered alone (Ray restarts the worker) ...", file=sys.stderr)
    alone = run(run_name="ppo_scoped", **crash, **common)
    print("4/4 the same, recovered alone by a warm standby ...", file=sys.stderr)
    standby = run(run_name="ppo_standby", standbys=1, **crash, **common)
    columns = [
        ("group restart (before)", scoped_figures(group), all(matches(ref, group, crash_at))),
        ("scoped: Ray restart", scoped_figures(alone), all(matches(ref, alone, crash_at))),
        ("scoped: warm standby", scoped_figures(standby), all(matches(ref, standby, crash_at))),
    ]
    tier = "memory tier on" if memory_tier else "durable snapshots only"
    head = (
        f"rl_ckpt demo: PPO on CartPole-v1 on Ray (2 learner ranks + 2 rollout workers, {tier}); rollout-0 "
        f"SIGKILLed halfway through its collect of step {crash_at}"
    )
    audits = [m for r in (alone, standby) for m in r.log if m["event"] == "audit"]
    audit = all(a["skipped"] == 0 and a["duplicated"] == 0 for a in audits) and bool(audits)
    ok = all(e for _t, _f, e in columns) and audit and all(f.get("undone") == 0 for _t, f, _e in columns[1:])
    verdict = "0 skipped / 0 duplicated" if audit else "FAILED"
    return "\n".join([head, rollout_comparison(columns), f"  auditor (scoped runs): {verdict}"]), ok


def chaos_drill(base: str, steps: int, count: int, *, seed: int = 0, standby: bool = False) -> tuple[str, bool]:
    """``count`` seeded faults over one run with the memory tier, then the table and the verdict."""
    from rl_ckpt.demo.ray_ppo import run

    env_steps = PPOConfig().steps_per_train_step
    faults = plan_faults(seed=seed, steps=steps, count=count, learners=2, workers=2, env_steps=env_steps)
    print(f"1/2 uninterrupted reference run ({steps} steps) ...", file=sys.stderr)
    ref = run(base_dir=base, run_name="ppo_reference", steps=steps, seed=seed, engine_cfg=ENGINE)
    print(f"2/2 the same run with {len(faults)} faults (seed {seed}) ...", file=sys.stderr)
    chaos = run(
        base_dir=base,
        run_name="ppo_chaos",
        steps=steps,
        seed=seed,
        engine_cfg=ENGINE,
        memory_tier=True,
        faults=faults,
        standbys=1 if standby else 0,
    )
    text, ok = chaos_report(ref.done["digest"] if ref.done else "", chaos.log, faults)
    head = (
        f"rl_ckpt demo --chaos: PPO on CartPole-v1 on Ray (2 learner ranks + 2 rollout workers, memory tier"
        f"{', warm standbys' if standby else ''}), {len(faults)} faults over {steps} steps (seed {seed})"
    )
    return f"{head}\n{text}", ok


def sharded_chaos_drill(
    base: str, steps: int, count: int, *, seed: int = 0, standby: bool = False, memory_tier: bool = True
) -> tuple[str, bool]:
    """``rl-ckpt demo --chaos --sharded``: the sharded GRPO demo (2 FSDP2 learners, 2 rollout actors pulling policy
    versions) with ``count`` seeded faults: rollout actors mid-generation or before their pull, learner ranks, the
    manager, the memory store, a damaged policy-version chunk (the pulls that meet it load the same snapshot)."""
    import ray

    from rl_ckpt.demo.chaos import KINDS
    from rl_ckpt.demo.grpo import GRPOConfig
    from rl_ckpt.demo.grpo_rollout import start_actors
    from rl_ckpt.demo.sharded_grpo import MEMORY_DEFAULTS, Run

    grpo = GRPOConfig(seed=seed)
    kinds = KINDS if memory_tier else tuple(k for k in KINDS if k != "memory_store")
    moments = [*range(grpo.gen_len), "pull"]
    faults = plan_faults(
        seed=seed,
        steps=steps,
        count=count,
        learners=2,
        workers=2,
        moments=moments,
        save_moment=False,
        chunk_kill=False,
        kinds=kinds,
        unit="token",
    )
    learner_faults = sum(f["kind"] == "learner" for f in faults)
    logs = {}
    actors = start_actors(grpo, 2)  # stateless: one set serves both runs
    try:
        for name, fit, tier in (
            ("grpo_reference", {}, None),
            (
                "grpo_chaos",
                {"faults": faults, "max_failures": learner_faults + 1, "standbys": int(standby)},
                MEMORY_DEFAULTS if memory_tier else None,
            ),
        ):
            print(f"{name}: {steps} steps" + (f", {len(faults)} faults (seed {seed})" if fit else ""), file=sys.stderr)
            run = Run.start(base, name, grpo, actors=actors, memory_tier=tier)
            try:
                run.fit(2, steps, **fit)
                logs[name] = run.events()
            finally:
                actors = run.actors
                run.close()
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
    done = next((m for m in reversed(logs["grpo_reference"]) if m["event"] == "done"), {})
    text, ok = chaos_report(done.get("digest", ""), logs["grpo_chaos"], faults)
    head = (
        f"rl_ckpt demo --chaos --sharded: GRPO on a tiny GPT-2 (2 FSDP2 learners, 2 rollout actors pulling policy "
        f"versions{', memory tier' if memory_tier else ''}), {len(faults)} faults over {steps} steps (seed {seed})"
    )
    return f"{head}\n{text}", ok
