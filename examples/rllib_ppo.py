"""RLlib PPO on CartPole-v1 (new API stack, 2 EnvRunners, CPU), checkpointed by rl_ckpt with one line of config.

    python examples/rllib_ppo.py                        # 20 iterations, a snapshot every 2, ./checkpoints/rllib_ppo
    python examples/rllib_ppo.py                        # run it again: it resumes from the newest verified snapshot
    python examples/rllib_ppo.py --crash-drill          # SIGKILL an EnvRunner, then the driver; restore; compare
    rl-ckpt ls ./checkpoints/rllib_ppo                  # the snapshots; also verify, plan, timeline

``checkpoint_callback(...)`` is an ``RLlibCallback`` class: ``on_algorithm_init`` restores the snapshot the
coordinator chooses (printing the plan), ``on_train_result`` saves every ``--save-every`` iterations in the
background (``train()`` waits only while the state is staged), keeping the newest 3 and the best by
``env_runners/episode_return_mean``. The snapshot also holds what RLlib's own checkpoints do not: the
EnvRunners' environments, episodes in progress and random streams, and PPO's KL coefficient, so the resumed run
is the uninterrupted one, bitwise (CartPole is gymnasium classic control; docs/rllib.md says when it is not).
``--crash-drill`` is ``rl-ckpt demo --rllib``: a side-by-side summary with RLlib's own ``save_to_path``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--storage", default="./checkpoints", help="base_dir: a folder, or s3://bucket/prefix")
    p.add_argument("--run-name", default="rllib_ppo")
    p.add_argument("--save-every", type=int, default=2, help="training iterations between snapshots")
    p.add_argument("--crash-drill", action="store_true", help="run the crash drill instead (rl-ckpt demo --rllib)")
    args = p.parse_args(argv)
    if args.crash_drill:
        from rl_ckpt.demo.__main__ import main as demo

        return demo(["--rllib"])

    import ray
    from ray.rllib.algorithms.ppo import PPOConfig

    from rl_ckpt.integrations.rllib import checkpoint_callback, checkpointing

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=2)
        .training(train_batch_size_per_learner=1000, minibatch_size=250, num_epochs=4)
        .fault_tolerance(restart_failed_env_runners=True)
        .debugging(seed=0)
        # the one line: snapshots every N iterations, async, retention + keep-best, resume on build
        .callbacks(
            checkpoint_callback(
                base_dir=args.storage,
                run_name=args.run_name,
                save_interval_steps=args.save_every,
                save_interval_seconds=0,
                keep_latest=3,
                keep_best=1,
            )
        )
    )
    algo = config.build_algo()
    while algo.training_iteration < args.iterations:
        result = algo.train()
        ret = result["env_runners"].get("episode_return_mean", float("nan"))
        print(f"iteration {algo.training_iteration:3d}  return {ret:7.1f}")
    ckpt = checkpointing(algo)
    ckpt.close()  # the last save lands
    print(f"snapshots: {[s.snapshot_id for s in ckpt.engine.snapshots()]}")
    algo.stop()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
