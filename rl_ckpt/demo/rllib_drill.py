"""The RLlib crash drill: real PPO on CartPole-v1 (2 EnvRunners, CPU), an EnvRunner and then the driver SIGKILLed.

A driver process (``python -m rl_ckpt.demo.rllib_drill <json>``, its own local Ray) trains with rl_ckpt
saving every ``every`` iterations through the ``CheckpointCallback`` and logs, per iteration, a digest
of the learner state (weights + optimizer, bitwise) and of the connector states. ``kill_runner_at``: it
SIGKILLs one EnvRunner process (RLlib replaces it: ``restart_failed_env_runners``). ``stop_at``: it waits
for the save in flight, logs ``ready`` and blocks until the drill SIGKILLs it. A second driver built from
the same config restores the snapshot the coordinator chooses (the plan printed to its log), checks the
state against the digest the killed driver logged at that iteration, does the same with RLlib's own
``restore_from_path``, trains on, and finally restores once more after a byte of its newest snapshot was
flipped (the restore falls back).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np


def ppo_config(cfg: dict):
    """The drill's PPOConfig: CartPole-v1, 2 EnvRunners with a MeanStdFilter, tiny batches, seeded."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.env_to_module.mean_std_filter import MeanStdFilter

    from rl_ckpt.integrations.rllib import checkpoint_callback

    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(
            num_env_runners=2,
            num_envs_per_env_runner=1,
            env_to_module_connector=lambda env, spaces, device: MeanStdFilter(),
        )
        .training(train_batch_size_per_learner=cfg.get("batch", 256), minibatch_size=64, num_epochs=2)
        .debugging(seed=cfg.get("seed", 0), log_level="ERROR")
        .fault_tolerance(restart_failed_env_runners=True)
    )
    config = waits_for_every_answer(config)
    if cfg.get("hidden"):
        from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

        config = config.rl_module(model_config=DefaultModelConfig(fcnet_hiddens=list(cfg["hidden"])))
    if cfg.get("run_name"):
        config = config.callbacks(
            checkpoint_callback(
                base_dir=cfg["base_dir"],
                run_name=cfg["run_name"],
                save_interval_steps=cfg.get("every", 2),
                save_interval_seconds=0,
                keep_latest=cfg.get("keep_latest", 5),
                keep_best=1,
                resume=cfg.get("resume", True),
                env_runners=cfg.get("env_runners", True),
            )
        )
    return config


def waits_for_every_answer(config):
    """``config`` with RLlib's timers on the EnvRunners' answers off.

    RLlib drops an EnvRunner's answer that comes late: its samples after ``sample_timeout_s`` (60 s), its connector
    state for the merge after ``sync_filters_on_rollout_workers_timeout_s`` (10 s; the merged state is then
    broadcast without that EnvRunner's observations). On a starved machine (Ray runs the EnvRunners at nice 15) a
    run then differs from the same run on a quiet one, checkpointed or not. Runs compared bitwise wait for every
    answer instead (a dead EnvRunner still fails its call at once)."""
    config = config.env_runners(sample_timeout_s=None)
    config.sync_filters_on_rollout_workers_timeout_s = None
    return config


def flat_arrays(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Every array of a nested state dict by its ``a/b/c`` path."""
    out: dict[str, np.ndarray] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat_arrays(v, f"{prefix}/{k}"))
    elif isinstance(tree, np.ndarray):
        out[prefix] = tree
    elif hasattr(tree, "detach"):
        out[prefix] = tree.detach().cpu().numpy()
    return out


def digest(tree: Any) -> str:
    """A bitwise digest of a state: every array (path, dtype, shape, bytes) and every other leaf (path, repr)."""
    h = hashlib.sha256()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k in sorted(node, key=repr):
                walk(node[k], f"{path}/{k!r}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
        elif isinstance(node, np.ndarray) or hasattr(node, "detach"):
            a = np.ascontiguousarray(node if isinstance(node, np.ndarray) else node.detach().cpu().numpy())
            h.update(f"{path}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
        else:
            h.update(f"{path}={node!r}|".encode())

    walk(tree, "")
    return h.hexdigest()[:16]


def learner_state(algo) -> dict:
    """The learner's weights, optimizer state and weights sequence number, as RLlib reports them."""
    state = algo.get_state(components="learner_group")["learner_group"]["learner"]
    return {k: v for k, v in state.items() if k in ("rl_module", "optimizer", "weights_seq_no")}


def learner_detail(algo) -> dict:
    """What ``learner_state``'s digest covers, part by part, with what else the next update draws on: PPO's KL
    coefficients and the driver's random streams (the minibatch shuffle draws from NumPy's). When two runs' learners
    differ, this says where."""
    import random

    import torch

    state = learner_state(algo)
    out = {k: digest(v) for k, v in state.items()}
    learner = getattr(algo.learner_group, "_learner", None)
    kl = getattr(learner, "curr_kl_coeffs_per_module", None) or {}
    out["kl_coeffs"] = {str(m): float(getattr(v, "item", lambda v=v: v)()) for m, v in dict(kl).items()}
    _, keys, pos, *_ = np.random.get_state()
    out["numpy_rng"] = digest({"keys": keys, "pos": int(pos)})
    out["torch_rng"] = digest(torch.get_rng_state())
    out["python_rng"] = digest(np.array(random.getstate()[1], dtype=np.uint64))
    return out


def connector_state(algo) -> dict:
    state = algo.get_state(components="env_runner").get("env_runner", {})
    return {k: v for k, v in state.items() if "connector" in k}


def runner_pids(algo) -> list[int]:
    return sorted(algo.env_runner_group.foreach_env_runner(lambda r: os.getpid(), local_env_runner=False))


def runner_pid(algo, worker_index: int) -> int:
    """The process id of the remote EnvRunner of ``worker_index``."""
    found = algo.env_runner_group.foreach_env_runner(lambda r: (r.worker_index, os.getpid()), local_env_runner=False)
    return dict(found)[worker_index]


def _env_to_module(runner) -> dict:
    return runner.get_state(components=["env_to_module_connector"])["env_to_module_connector"]


def runner_connectors(algo) -> list[str]:
    """The env-to-module connector state (MeanStdFilter) digest of each remote EnvRunner."""
    return [digest(s) for s in algo.env_runner_group.foreach_env_runner(_env_to_module, local_env_runner=False)]


def local_connector(algo) -> str:
    """The same digest of the driver's EnvRunner (RLlib syncs it to the remote ones after each iteration)."""
    return digest(_env_to_module(algo.env_runner))


def runners_have_learner_weights(algo) -> list[bool]:
    """Per remote EnvRunner: its module weights equal the learner's (the inference-only part), bitwise."""
    learner = algo.learner_group.get_state(components="learner/rl_module", inference_only=True)["learner"]
    learner = learner["rl_module"]

    def same(state: dict) -> bool:
        for mid, weights in state.items():
            mine = learner.get(mid, {})
            if not all(k in mine and np.array_equal(mine[k], v) for k, v in weights.items()):
                return False
        return True

    states = algo.env_runner_group.foreach_env_runner(
        lambda r: r.get_state(components="rl_module")["rl_module"], local_env_runner=False
    )
    return [
        same(s if isinstance(s, dict) and all(isinstance(v, dict) for v in s.values()) else {"default_policy": s})
        for s in states
    ]


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def largest_file(snapshot_dir: str) -> str:
    files = [os.path.join(d, n) for d, _, names in os.walk(snapshot_dir) for n in names if n.endswith(".safetensors")]
    return max(files, key=os.path.getsize)


def driver(cfg: dict) -> None:
    """One driver process of the drill; appends JSON lines to ``cfg['log']``."""
    import ray

    from rl_ckpt.integrations.rllib import checkpointing, restore_algorithm

    def log(**event) -> None:
        with open(cfg["log"], "a") as f:
            f.write(json.dumps({"t": time.time(), **event}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    algo = ppo_config(cfg).build_algo()
    cp = checkpointing(algo) if cfg.get("run_name") else None  # none: the uninterrupted reference run
    restored = cp.restored if cp is not None else None
    log(
        event="built",
        seconds=time.perf_counter() - t0,
        iteration=algo.training_iteration,
        restored=None if restored is None or restored.fresh else restored.snapshot_id,
        restored_step=0 if restored is None or restored.fresh else restored.global_step,
        plan=str(restored.plan) if restored is not None and restored.plan is not None else "",
        restore_seconds=cp.restore_seconds if cp is not None else None,
        learner=digest(learner_state(algo)),
        learner_detail=learner_detail(algo),
        connectors=digest(connector_state(algo)),
        pids=runner_pids(algo),
        runner_weights=runners_have_learner_weights(algo),
        lifetimes=lifetimes(algo),
        warnings=list(restored.warnings) if restored is not None else [],
    )
    while algo.training_iteration < cfg["until"]:
        t = time.perf_counter()
        algo.train()
        it = algo.training_iteration
        rllib_blocked = None
        if cfg.get("rllib_save_every") and it % cfg["rllib_save_every"] == 0:
            s = time.perf_counter()
            algo.save_to_path(os.path.join(cfg["rllib_path"], str(it)))
            rllib_blocked = time.perf_counter() - s
        log(
            event="iter",
            iteration=it,
            seconds=time.perf_counter() - t,
            rl_ckpt_blocked=list(cp.blocked) if cp else [],
            rllib_blocked=rllib_blocked,
            learner=digest(learner_state(algo)),
            learner_detail=learner_detail(algo),
            connectors=digest(connector_state(algo)),
            pids=runner_pids(algo),
            runner_connectors=runner_connectors(algo),
            local_connector=local_connector(algo),
            lifetimes=lifetimes(algo),
        )
        if it == cfg.get("kill_runner_at"):
            pid = runner_pid(algo, 1)  # by worker index: the same EnvRunner in every run of the drill
            os.kill(pid, signal.SIGKILL)
            log(event="runner_killed", iteration=it, pid=pid)
            _wait_for_replacement(algo, pid)
            log(
                event="runner_replaced",
                iteration=algo.training_iteration,
                pids=runner_pids(algo),
                connectors=digest(connector_state(algo)),
                runner_connectors=runner_connectors(algo),
                local_connector=local_connector(algo),
            )
        if it == cfg.get("stop_at"):
            cp.engine.wait()  # the save in flight lands: the snapshot the restart should pick is deterministic
            log(event="ready", iteration=it)
            signal.pause()  # the drill SIGKILLs this process now
    if cp is not None:
        cp.engine.wait()
    if cp is not None and cfg.get("rllib_path") and restored is not None and not restored.fresh:
        log(**rllib_restore(algo, cfg["rllib_path"], restored.global_step))
    if cp is not None and cfg.get("corrupt_newest"):
        newest = cp.engine.snapshots()[-1]
        flip_byte(largest_file(os.path.join(cp.engine.storage.url.replace("file://", ""), newest.snapshot_id)))
        # A rollback of the live Algorithm (its learner is ahead of the snapshot); deep: the plan re-hashes the
        # candidates and says why it skips one.
        result = restore_algorithm(algo, cp.engine, out=None, deep=True)
        event = dict(
            event="fallback",
            corrupted=newest.snapshot_id,
            restored=result.snapshot_id,
            restored_step=result.global_step,
            skipped=result.skipped,
            plan=str(result.plan),
            learner=digest(learner_state(algo)),
            runner_weights=runners_have_learner_weights(algo),
        )
        algo.train()  # one iteration on from the rolled-back state: the same as the run made from it
        log(**event, resumed_iteration=algo.training_iteration, resumed=digest(learner_state(algo)))
        if cfg.get("rllib_path"):  # the same flipped byte in RLlib's newest checkpoint
            log(event="rllib_corrupt", **rllib_corrupt(algo, cfg["rllib_path"], newest.global_step))
    if cp is not None:
        cp.close()
    log(event="done", iteration=algo.training_iteration)
    algo.stop()
    ray.shutdown()


def lifetimes(algo) -> list:
    """The sampled-steps counter of the Algorithm, its own EnvRunner and each remote one (RLlib keeps them equal)."""
    remote = algo.env_runner_group.foreach_env_runner(
        lambda r: r.num_env_steps_sampled_lifetime, local_env_runner=False
    )
    key = ("env_runners", "num_env_steps_sampled_lifetime")
    return [float(algo.metrics.peek(key, default=0)), float(algo.env_runner.num_env_steps_sampled_lifetime), *remote]


def rllib_restore(algo, rllib_path: str, iteration: int) -> dict:
    """RLlib's own ``restore_from_path`` of ``iteration`` into the live Algorithm: the state right after it, then
    one iteration on (its checkpoint holds no EnvRunner state, nor PPO's KL coefficient: the EnvRunners go on
    from what they hold)."""
    t = time.perf_counter()
    algo.restore_from_path(os.path.join(rllib_path, str(iteration)))
    seconds = time.perf_counter() - t
    out = dict(
        event="rllib_restored",
        seconds=seconds,
        iteration=algo.training_iteration,
        learner=digest(learner_state(algo)),
        connectors=digest(connector_state(algo)),
        lifetimes=lifetimes(algo),
    )
    algo.train()
    return dict(out, resumed_iteration=algo.training_iteration, resumed=digest(learner_state(algo)))


def rllib_corrupt(algo, rllib_path: str, iteration: int) -> dict:
    """Flip a byte in the largest file of RLlib's checkpoint of ``iteration`` and restore it: what RLlib does."""
    folder = os.path.join(rllib_path, str(iteration))
    files = [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names]
    target = max(files, key=os.path.getsize)
    flip_byte(target)
    try:
        algo.restore_from_path(folder)
    except Exception as exc:  # what RLlib raises on a damaged file is the figure
        return {"file": os.path.relpath(target, folder), "outcome": f"raised {type(exc).__name__}: {str(exc)[:200]}"}
    return {
        "file": os.path.relpath(target, folder),
        "outcome": "loaded without error",
        "learner": digest(learner_state(algo)),
    }


def _wait_for_replacement(algo, dead_pid: int, timeout: float = 300) -> None:
    """Until RLlib has brought the killed EnvRunner back (``restore_env_runners``, as each ``train()`` does: the
    new one gets the weights and connector states of the driver's live EnvRunner)."""
    group = algo.env_runner_group
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = runner_pids(algo)  # a call to every runner: RLlib marks the dead one unhealthy
        if len(pids) == 2 and dead_pid not in pids:
            return
        algo.restore_env_runners(group)
        time.sleep(0.5)
    raise TimeoutError(f"RLlib did not replace the killed EnvRunner (pid {dead_pid}) within {timeout} s")


def run_driver(cfg: dict, *, kill_when_ready: bool = False, timeout: float = 600) -> list[dict]:
    """Run one driver process; with ``kill_when_ready`` SIGKILL it (and its process group: its Ray) when it logs
    ``ready``. Returns the events it logged."""
    start = _read_log(cfg["log"])
    errors = open(cfg["log"] + ".stderr", "ab")  # a file, not a pipe: Ray's chatter must never block the driver
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl_ckpt.demo.rllib_drill", json.dumps(cfg)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=errors,
    )
    try:
        if kill_when_ready:
            _wait_for(cfg["log"], len(start), "ready", proc, timeout)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        else:
            proc.wait(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"rllib drill driver failed ({proc.returncode}): {_tail(cfg['log'])}")
    finally:
        errors.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # Ray processes the driver started, if any outlived it
            except ProcessLookupError:
                pass
    return _read_log(cfg["log"])[len(start) :]


def _read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _tail(log: str) -> str:
    try:
        with open(log + ".stderr", "rb") as f:
            return f.read()[-3000:].decode(errors="replace")
    except OSError:
        return ""


def _wait_for(path: str, skip: int, event: str, proc, timeout: float) -> None:
    """Block until the driver logged ``event`` (by polling its log; its exit first is an error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["event"] == event for e in _read_log(path)[skip:]):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"rllib drill driver exited ({proc.returncode}) before {event!r}: {_tail(path)}")
        time.sleep(0.2)
    raise TimeoutError(f"rllib drill driver did not log {event!r} within {timeout} s")


if __name__ == "__main__":
    driver(json.loads(sys.argv[1]))
