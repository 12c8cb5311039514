"""``rl-ckpt demo --rllib``: the RLlib crash drill run end to end, rl_ckpt and RLlib's own checkpoints side by side.

Three driver processes (each its own local Ray): a reference run of 8 iterations that only loses the EnvRunner
(SIGKILLed at iteration 3 and replaced by RLlib, as in the run below: the uninterrupted run); a run saving with
rl_ckpt and RLlib's ``save_to_path`` every 2 iterations, the same EnvRunner SIGKILLed at iteration 3 and the
driver at 5; the same script re-run, which restores, trains to 8, checks RLlib's own restore (the state right
after it, and one iteration on), and restores once more after a flipped byte in the newest checkpoint of each.
"""

from __future__ import annotations

import os
import statistics
import sys

from rl_ckpt.demo.figures import human_bytes
from rl_ckpt.demo.rllib_drill import run_driver

EVERY, KILL_RUNNER_AT, KILL_DRIVER_AT, UNTIL = 2, 3, 5, 8


def _bytes(folder: str) -> tuple[int, int, int]:
    """(bytes, files, pickle files) under ``folder``."""
    total = files = pickles = 0
    for d, _, names in os.walk(folder):
        for n in names:
            total += os.path.getsize(os.path.join(d, n))
            files += 1
            pickles += n.endswith(".pkl")
    return total, files, pickles


def run_demo(base: str, seed: int = 0) -> tuple[str, bool]:
    """Run the three drivers under ``base``; returns the printed summary and whether every check held."""
    os.makedirs(base, exist_ok=True)
    log = os.path.join(base, "drill.jsonl")
    common = dict(base_dir=base, seed=seed, every=EVERY, rllib_save_every=EVERY, rllib_path=os.path.join(base, "rllib"))
    print(f"1/3 reference run, {UNTIL} iterations (the EnvRunner SIGKILLed at {KILL_RUNNER_AT}) ...", file=sys.stderr)
    reference = dict(base_dir=base, seed=seed, log=os.path.join(base, "reference.jsonl"), until=UNTIL)
    ref = run_driver(dict(reference, kill_runner_at=KILL_RUNNER_AT))
    print(
        f"2/3 run with rl_ckpt and RLlib checkpoints every {EVERY} iterations; SIGKILL of an EnvRunner at "
        f"{KILL_RUNNER_AT}, of the driver at {KILL_DRIVER_AT} ...",
        file=sys.stderr,
    )
    first = run_driver(
        dict(common, run_name="ppo", log=log, until=UNTIL, kill_runner_at=KILL_RUNNER_AT, stop_at=KILL_DRIVER_AT),
        kill_when_ready=True,
    )
    print(
        "3/3 the script re-run: restore, train to the end, RLlib's restore, then a flipped byte in each newest "
        "checkpoint ...",
        file=sys.stderr,
    )
    second = run_driver(dict(common, run_name="ppo", log=log, until=UNTIL, corrupt_newest=True))
    return side_by_side(base, ref, first, second)


def side_by_side(base: str, ref: list[dict], first: list[dict], second: list[dict]) -> tuple[str, bool]:
    """The summary of the drill's three logs (see ``run_demo``)."""
    iters = {e["iteration"]: e for e in first if e["event"] == "iter"}
    after = {e["iteration"]: e for e in second if e["event"] == "iter"}
    reference = {e["iteration"]: e for e in ref if e["event"] == "iter"}
    built = next(e for e in second if e["event"] == "built")
    theirs = next(e for e in second if e["event"] == "rllib_restored")
    fb = next(e for e in second if e["event"] == "fallback")
    broken = next(e for e in second if e["event"] == "rllib_corrupt")
    replaced = next(e for e in first if e["event"] == "runner_replaced")
    step = built["restored_step"]
    ours_exact = built["learner"] == iters[step]["learner"] and built["connectors"] == iters[step]["connectors"]
    theirs_exact = theirs["learner"] == iters[step]["learner"] and theirs["connectors"] == iters[step]["connectors"]
    ours_counter = built["lifetimes"] == iters[step]["lifetimes"]
    theirs_counter = theirs["lifetimes"] == iters[step]["lifetimes"]
    # each iteration logs the driver's list so far: the last one of each driver holds all of its saves
    ours_blocked = iters[max(iters)]["rl_ckpt_blocked"] + after[max(after)]["rl_ckpt_blocked"]
    theirs_blocked = [e["rllib_blocked"] for e in list(iters.values()) + list(after.values()) if e["rllib_blocked"]]
    snap_bytes, snap_files, _ = _bytes(os.path.join(base, "ppo", f"step_{step:09d}"))
    rl_bytes, rl_files, rl_pickles = _bytes(os.path.join(base, "rllib", str(step)))
    next_it = step + 1  # the killed run made this iteration too: the first the resumed run repeats
    ours_next = after[next_it]["learner"] == iters[next_it]["learner"]
    theirs_next = theirs["resumed"] == iters[next_it]["learner"]
    final_equal = after[UNTIL]["learner"] == reference[UNTIL]["learner"]
    reference_same = all(reference[i]["learner"] == iters[i]["learner"] for i in iters)
    first_diff = min((i for i in after if after[i]["learner"] != reference[i]["learner"]), default=None)
    rollback_exact = fb["resumed"] == after[fb["resumed_iteration"]]["learner"]
    runner_ok = replaced["runner_connectors"] == [replaced["local_connector"]] * 2
    theirs_fell = broken["outcome"].startswith("raised")
    theirs_silent = not theirs_fell and broken.get("learner") != after[UNTIL]["learner"]

    def row(name: str, a: str, b: str) -> str:
        return f"  {name:<40} {a:<36} {b}"

    def yes(x: bool) -> str:
        return "YES" if x else "NO"

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1000:.1f} ms (median of {len(xs)})" if xs else "-"

    lines = [
        "rl_ckpt demo --rllib: RLlib PPO on CartPole-v1 (2 EnvRunners, CPU), an EnvRunner and the driver SIGKILLed",
        f"  EnvRunner killed at iteration {KILL_RUNNER_AT}: RLlib replaced it (pids {replaced['pids']}); its connector "
        f"state came from the driver's live EnvRunner: {yes(runner_ok)}",
        f"  driver killed after iteration {KILL_DRIVER_AT}; the re-run script restored {built['restored']} "
        f"({KILL_DRIVER_AT - step} iteration(s) redone)",
        "",
        row("", "rl_ckpt (CheckpointCallback)", "RLlib save_to_path / restore_from_path"),
        row("checkpoint every", f"{EVERY} iterations", f"{EVERY} iterations"),
        row("train() blocked per checkpoint", med(ours_blocked), med(theirs_blocked)),
        row(
            f"checkpoint of iteration {step}",
            f"{human_bytes(snap_bytes)}, {snap_files} files",
            f"{human_bytes(rl_bytes)}, {rl_files} files ({rl_pickles} pickles)",
        ),
        row("restore time", f"{built['restore_seconds']:.3f} s (fresh Algorithm)", f"{theirs['seconds']:.3f} s"),
        row(
            "state right after restore",
            f"{yes(ours_exact)} (bitwise = iteration {step})",
            f"{yes(theirs_exact)} (bitwise = iteration {step})",
        ),
        row(
            "sampled-steps counter after restore", f"{yes(ours_counter)} (= saved)", f"{yes(theirs_counter)} (= saved)"
        ),
        row(
            f"iteration {next_it} = the killed run's",
            f"{yes(ours_next)} (bitwise)",
            f"{yes(theirs_next)} (one iteration after its restore)",
        ),
        row(f"iteration {UNTIL} = uninterrupted run", yes(final_equal), "-"),
        row("checksums / atomic commit / pickle", "yes / yes / none", f"no / no / {rl_pickles} .pkl files"),
        row(
            f"a flipped byte in iteration {UNTIL}'s file",
            f"refused (checksum), restored step {fb['restored_step']}",
            broken["outcome"] + ("; other weights than saved" if theirs_silent else ""),
        ),
        row(f"  then iteration {fb['resumed_iteration']} = the run's", yes(rollback_exact), "-"),
    ]
    if built.get("warnings"):
        lines.append("  restore: " + "; ".join(built["warnings"]))
    if not final_equal:
        lines.append(
            f"  (the resumed run first differs from the uninterrupted one at iteration {first_diff}"
            + ("" if reference_same else "; the reference run itself differs from the killed run before the kill")
            + ": see docs/rllib.md, 'What is exact')"
        )
    if not theirs_next:
        lines.append(
            "  (RLlib's checkpoint holds no EnvRunner state (environments, episodes, random streams) nor PPO's KL "
            "coefficient: the iteration after its restore samples and learns other numbers)"
        )
    lines += [
        "",
        "Recovery plan printed by the re-run script:",
        built["plan"],
        "",
        "Plan after the flipped byte:",
        fb["plan"],
    ]
    ok = (
        ours_exact
        and ours_counter
        and ours_next
        and final_equal
        and rollback_exact
        and runner_ok
        and fb["restored"] == f"step_{UNTIL - EVERY:09d}"
        and fb["learner"] == after[UNTIL - EVERY]["learner"]
        and built["runner_weights"] == fb["runner_weights"] == [True] * 2
    )  # EnvRunners hold the restored weights
    return "\n".join(lines), ok
