"""``rl-ckpt demo``: the crash drill, end to end, with a summary a person can read.

PPO on CartPole-v1 saves on a schedule (async, full + light layers, keep-best
on average reward); the training process is SIGKILLed mid-run; a new process
plans the recovery (the coordinator decides from the failure), restores,
verifies the probe, and finishes the run. The result is compared with a run
that never crashed, bit for bit. Exit 0 only if recovery was exact.

On Ray (the default) the same crash is then run with the memory tier (memory
snapshots every 2 steps, durable copies made from memory) and both are printed
side by side; ``--no-memory-tier`` skips it. ``--sharded`` does the same with
FSDP2 learners restarted on fewer ranks (``--sharded --crash-target rollout``: a
rollout actor SIGKILLed mid-generation instead, recovered alone, checked bitwise
against an uninterrupted run); ``--rllib`` runs RLlib's PPO with rl_ckpt's
``CheckpointCallback`` next to RLlib's own checkpoints (an EnvRunner and the driver killed).

``--crash-target rollout`` kills a rollout worker mid-rollout instead, and prints the old recovery (a group
restart) beside the scoped one (the worker recovered alone, by Ray's restart of it and by a warm standby).
``--chaos`` runs many faults in one run (rollout workers mostly, learner ranks, the manager, a memory store, a
damaged chunk) and prints how each was recovered, then the verdict.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from rl_ckpt._run.catalog import Catalog
from rl_ckpt._storage import open_storage
from rl_ckpt.demo.drill import crash_drill
from rl_ckpt.demo.figures import crash_figures, human_bytes, matches, memory_comparison


def summarize(result, cfg: dict, steps: int) -> str:
    storage = open_storage(f"{cfg['base_dir'].rstrip('/')}/{cfg['run_name']}")
    cat = Catalog(storage)
    cat.refresh()
    snaps = cat.snapshots()
    full = [i for i in snaps if i.kind == "full"]
    light = [i for i in snaps if i.kind == "light"]
    crashed_at = result.crashed.killed_at
    restored = result.restored_step
    lost_steps = crashed_at - restored
    per_step = result.reference.seconds / max(steps, 1)
    plan = result.resumed.restored.get("plan", "") if result.resumed.restored else ""
    decision = next((ln.split("decision:", 1)[1].strip() for ln in plan.splitlines() if "decision:" in ln), "-")
    lines = [
        "rl_ckpt demo: PPO on CartPole-v1, SIGKILL mid-run, verified exact restart",
        f"  storage            {storage.url}",
        f"  snapshots kept     {len(full)} full, {len(light)} light, {human_bytes(sum(i.size_bytes for i in snaps))}",
        f"  failure            SIGKILL of the training process at step {crashed_at}",
        f"  decision           {decision}",
        f"  restored           {result.resumed.restored.get('snapshot')} (step {restored})",
        f"  time lost          {lost_steps} steps (~{lost_steps * per_step:.1f} s of training) redone",
        f"  final avg reward   {result.resumed.rewards.get(steps, float('nan')):.1f} at step {steps}",
        f"  matches uninterrupted run: parameters {'YES' if result.params_equal else 'NO'}, "
        f"losses {'YES' if result.losses_equal else 'NO'}",
        "",
        "Recovery plan used by the restarted process:",
        plan,
    ]
    return "\n".join(lines)


def ray_summary(ref, run, base: str, steps: int, crash_at: int, png: str | None) -> tuple[str, bool]:
    """The summary of a Ray demo run and whether it matched the uninterrupted run."""
    from rl_ckpt._timeline import load

    storage = open_storage(f"{base}/{run.run_name}")
    data = load(storage)
    snaps = data["snapshots"]
    kept = [s for s in snaps if s["state"] == "kept"]
    cat = Catalog(storage)
    cat.refresh()
    logical = sum(i.size_bytes for i in cat.snapshots())
    # Every tensor's chunks as the kept snapshots reference them (the rollout workers' policy copies and the
    # learners' policy are the same bytes) against the objects actually stored for them.
    chunks = [
        (digest, size)
        for i in cat.snapshots()
        if i.manifest is not None
        for section in i.manifest.components.values()
        for tensor in (section.get("objects") or {}).values()
        for digest, size in tensor
    ]
    referenced = sum(size for _d, size in chunks)
    unique = sum(dict(chunks).values())
    params_equal, losses_equal = matches(ref, run, crash_at)
    # The failure recovery answered (the decision names it), with its step and participant as recorded.
    fig = crash_figures(run, data, crash_at)
    resumed, decision, failure = fig["resumed"], fig["decision"], fig["failure"]
    restored_step, crash_step = fig["restored_step"], fig["crash_step"]
    full = [s for s in kept if s["kind"] == "full"]
    light = [s for s in kept if s["kind"] == "light"]
    deleted = [s for s in snaps if s["state"] == "deleted"]
    ok = params_equal and losses_equal and resumed is not None
    lines = [
        "rl_ckpt demo: PPO on CartPole-v1 on Ray (2 learner ranks + 2 rollout workers), crash, verified restart",
        f"  storage            {storage.url}",
        f"  snapshots          {len(full)} full + {len(light)} light kept, {len(deleted)} deleted by retention; "
        f"{human_bytes(logical)} logical; tensor chunks {human_bytes(referenced)} referenced, "
        f"{human_bytes(unique)} stored "
        f"(dedup saved {human_bytes(referenced - unique)})",
        f"  failure            {failure['kind'] if failure else '-'} of "
        f"{failure.get('participant') if failure else '-'} at step {crash_step}",
        f"  decision           {decision['action'] if decision else '-'} -> "
        f"{decision['snapshot'] if decision else '-'} (step {decision['to'] if decision else '-'})",
        f"  restored           {resumed['restored'] if resumed else '-'} (step {restored_step}); "
        f"rollout workers: {[w[0] for w in resumed['workers']] if resumed else '-'}",
        f"  time lost          {fig['steps_lost']} steps redone; {fig['kill_to_first_step']:.1f} s from the kill to "
        f"the first step after the restart (restore {fig['restore_seconds']:.2f} s)",
        f"  final avg reward   {run.done['avg_reward']:.1f} at step {steps}" if run.done else "  final avg reward   -",
        f"  matches uninterrupted run: parameters {'YES' if params_equal else 'NO'}, "
        f"losses {'YES' if losses_equal else 'NO'}",
    ]
    if png:
        lines.append(f"  timeline           {png}")
    if resumed and resumed.get("plan"):
        lines += ["", "Recovery plan followed by every rank:", resumed["plan"]]
    return "\n".join(lines), ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rl-ckpt demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, help="training steps (default 50; --sharded: 40; --chaos: 200, 60 sharded)")
    p.add_argument("--crash-at", type=int, help="SIGKILL at this step (default 27; --sharded: 18)")
    p.add_argument("--crash-target", choices=["learner", "rollout"], default="learner")
    p.add_argument(
        "--chaos",
        action="store_true",
        help="many faults in one run (default 20 over 200 steps), each recovered by the smallest exact rung; "
        "a table of them and the verdict (bitwise equal to an uninterrupted run, auditors 0/0)",
    )
    p.add_argument("--faults", type=int, default=20, help="--chaos: how many faults (default 20)")
    p.add_argument("--standby", action="store_true", help="--chaos: a warm standby rollout worker per learner")
    p.add_argument("--base-dir", help="where to write snapshots (default: a fresh temp folder)")
    p.add_argument("--address", help="attach to this Ray cluster instead of starting a local one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local", action="store_true", help="no Ray: one training process, SIGKILLed and resumed")
    p.add_argument(
        "--sharded",
        action="store_true",
        help="GRPO on a tiny GPT-2 with FSDP2 learners: SIGKILL one, restart on fewer (examples/grpo_gpt2_fsdp.py)",
    )
    p.add_argument(
        "--rllib",
        action="store_true",
        help="RLlib PPO (new API stack) with rl_ckpt's CheckpointCallback "
        "next to RLlib's save_to_path: an EnvRunner and the driver SIGKILLed (examples/rllib_ppo.py)",
    )
    p.add_argument("--learners", type=int, default=2, help="--sharded: FSDP2 learners before the crash (default 2)")
    p.add_argument("--restart-learners", type=int, default=1, help="--sharded: learners after it (default 1)")
    p.add_argument(
        "--memory-tier",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the same crash with the memory tier (memory snapshots every 2 steps, durable copies "
        "made from memory) and print both side by side (the default on Ray; --no-memory-tier skips it; "
        "--local has no memory tier)",
    )
    args = p.parse_args(argv)
    if args.local and args.memory_tier:
        p.error("--memory-tier needs Ray (the memory stores are Ray actors): leave out --local, or --memory-tier")
    args.memory_tier = not args.local if args.memory_tier is None else args.memory_tier
    default_steps = (60 if args.sharded else 200) if args.chaos else 40 if args.sharded else 50
    args.steps = args.steps or default_steps
    args.crash_at = args.crash_at or (18 if args.sharded else 27)
    if not 0 < args.crash_at < args.steps:
        p.error("--crash-at must be between 0 and --steps")
    base = args.base_dir or tempfile.mkdtemp(prefix="rl-ckpt-demo-")
    if args.rllib:  # its drivers start a Ray of their own each (a killed driver takes its Ray with it)
        from rl_ckpt.demo.rllib_summary import run_demo

        text, ok = run_demo(base, seed=args.seed)
        print(text)
        return 0 if ok else 1
    if args.local:
        cfg = {
            "base_dir": base,
            "run_name": "ppo_cartpole",
            "save_interval_steps": 10,
            "save_interval_seconds": None,
            "light_interval_steps": 0,
            "keep_latest": 3,
            "keep_best": 1,
        }
        print(
            f"running: reference run, crashed run (SIGKILL at step {args.crash_at}), resumed run ...", file=sys.stderr
        )
        result = crash_drill(cfg, args.steps, args.crash_at, seed=args.seed)
        print(summarize(result, cfg, args.steps))
        return 0 if result.ok else 1

    import os

    import ray

    from rl_ckpt._timeline import load, plot
    from rl_ckpt.demo.ray_ppo import run

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    if args.address:
        ray.init(address=args.address, namespace="rl_ckpt", logging_level="ERROR", log_to_driver=False)
    else:
        # "local": a new cluster of its own, even when a `ray start` cluster runs on this machine (ray.init would
        # attach to that one, and refuse num_cpus).
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            namespace="rl_ckpt",
            logging_level="ERROR",
            log_to_driver=False,
        )
    if args.chaos and args.sharded:
        from rl_ckpt.demo.scoped_drill import sharded_chaos_drill

        text, ok = sharded_chaos_drill(
            base, args.steps, args.faults, seed=args.seed, standby=args.standby, memory_tier=args.memory_tier
        )
        print(text)
        ray.shutdown()
        return 0 if ok else 1
    if args.sharded:
        from rl_ckpt.demo.grpo import GRPOConfig

        # not the local `crash_drill`: --local uses that one
        from rl_ckpt.demo.sharded_drill import crash_drill as sharded_drill
        from rl_ckpt.demo.sharded_drill import scoped_drill, side_by_side

        if args.crash_target == "rollout":  # a rollout actor lost mid-rollout: recovered alone, nothing restarts
            print(
                f"GRPO on {args.learners} FSDP2 learners: an uninterrupted run, then one with a rollout actor "
                f"SIGKILLed mid-generation at step {args.crash_at} ...",
                file=sys.stderr,
            )
            report = scoped_drill(
                base, steps=args.steps, crash_at=args.crash_at, learners=args.learners, grpo=GRPOConfig(seed=args.seed)
            )
            print(report.text)
            ray.shutdown()
            return 0 if report.ok else 1
        runs = "durable-only, then with the memory tier" if args.memory_tier else "durable-only"
        print(
            f"GRPO on {args.learners} FSDP2 learners, SIGKILL of one at step {args.crash_at}, restart on "
            f"{args.restart_learners} ({runs}) ...",
            file=sys.stderr,
        )
        drill = side_by_side if args.memory_tier else sharded_drill
        report = drill(
            base,
            steps=args.steps,
            crash_at=args.crash_at,
            learners=args.learners,
            restart_learners=args.restart_learners,
            save_every=6,
            grpo=GRPOConfig(seed=args.seed),
        )
        print(report.text)
        ray.shutdown()
        return 0 if report.ok else 1
    if args.chaos or args.crash_target == "rollout":
        from rl_ckpt.demo.scoped_drill import chaos_drill, rollout_drill

        if args.chaos:
            text, ok = chaos_drill(base, args.steps, args.faults, seed=args.seed, standby=args.standby)
        else:
            text, ok = rollout_drill(base, args.steps, args.crash_at, seed=args.seed, memory_tier=args.memory_tier)
        print(text)
        ray.shutdown()
        return 0 if ok else 1
    engine_cfg = {
        "save_interval_steps": 10,
        "light_interval_steps": 5,
        "keep_latest": 2,
        "keep_best": 1,
        "dedup": True,
        "dedup_min_tensor_bytes": 4096,
    }  # the CartPole layers are 16 KiB: dedup them, keep biases in files
    n = 3 if args.memory_tier else 2
    print(f"1/{n} uninterrupted reference run ...", file=sys.stderr)
    ref = run(base_dir=base, run_name="ppo_reference", steps=args.steps, seed=args.seed, engine_cfg=engine_cfg)
    print(f"2/{n} run with a SIGKILL of a {args.crash_target} at step {args.crash_at} ...", file=sys.stderr)
    crashed = run(
        base_dir=base,
        run_name="ppo_cartpole",
        steps=args.steps,
        seed=args.seed,
        engine_cfg=engine_cfg,
        crash_at=args.crash_at,
        crash_target=args.crash_target,
    )
    png = os.path.join(base, "timeline.png")
    steps_log = [m for m in crashed.log if m["event"] == "step"]
    plot(load(open_storage(f"{base}/ppo_cartpole")), png, step_log=steps_log, title="rl-ckpt demo: PPO on CartPole-v1")
    text, ok = ray_summary(ref, crashed, base, args.steps, args.crash_at, png)
    if args.memory_tier:
        print("3/3 the same crash with the memory tier ...", file=sys.stderr)
        mem = run(
            base_dir=base,
            run_name="ppo_cartpole_memory",
            steps=args.steps,
            seed=args.seed,
            engine_cfg=engine_cfg,
            crash_at=args.crash_at,
            crash_target=args.crash_target,
            memory_tier=True,
        )
        mem_png = os.path.join(base, "timeline_memory.png")
        plot(
            load(open_storage(f"{base}/ppo_cartpole_memory")),
            mem_png,
            step_log=[m for m in mem.log if m["event"] == "step"],
            title="rl-ckpt demo: PPO on CartPole-v1, memory tier",
        )
        block, mem_ok = memory_summary(ref, crashed, mem, base, args.crash_at)
        text += f"\n\n{block}\n  timeline           {mem_png}"
        ok = ok and mem_ok
    print(text)
    ray.shutdown()
    return 0 if ok else 1


def memory_summary(ref, crashed, mem, base: str, crash_at: int) -> tuple[str, bool]:
    """The durable-only crash and the memory tier's crash side by side, and whether the memory run was exact
    and its figures agree (restored from memory, fewer or as many steps lost)."""
    from rl_ckpt.demo.ray_tier import MEMORY_DEFAULTS
    from rl_ckpt._timeline import load

    durable = crash_figures(crashed, load(open_storage(f"{base}/{crashed.run_name}")), crash_at)
    memory = crash_figures(mem, load(open_storage(f"{base}/{mem.run_name}")), crash_at)
    durable_exact, memory_exact = all(matches(ref, crashed, crash_at)), all(matches(ref, mem, crash_at))
    flushed = list((mem.memory_status or {}).get("flushed", []))  # durable copies the service made from memory
    text = memory_comparison(
        durable,
        memory,
        durable_exact,
        memory_exact,
        MEMORY_DEFAULTS["memory_interval_steps"],
        MEMORY_DEFAULTS["memory_flush_every"],
        flushed,
    )
    ok = memory_exact and memory["tier"] == "memory" and memory["steps_lost"] <= durable["steps_lost"]
    return text, ok


if __name__ == "__main__":
    sys.exit(main())
