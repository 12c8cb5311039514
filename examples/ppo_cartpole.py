r"""PPO on CartPole-v1 on Ray, checkpointed by rl_ckpt, with an optional crash drill.

    python examples/ppo_cartpole.py --steps 60                          # local Ray, ./checkpoints
    python examples/ppo_cartpole.py --steps 60 --crash-at 33            # SIGKILL a learner rank at step 33
    python examples/ppo_cartpole.py --crash-at 33 --crash-target rollout
    python examples/ppo_cartpole.py --storage s3://bucket/ckpt --config configs/ppo.yaml
    python examples/ppo_cartpole.py --address auto                      # attach to a running cluster (ray start --head)
    RAY_AUTH_MODE=token python examples/ppo_cartpole.py --address HOST:6379   # an explicit address needs the auth mode
    RAY_AUTH_MODE=token RAY_ADDRESS=http://DASHBOARD_HOST:PORT \
        ray job submit --working-dir . -- python examples/ppo_cartpole.py --address auto
    (`ray start --head` prints the dashboard's HOST:PORT; so does `ray.init(address="auto").dashboard_url`.)

Learners are Ray Train TorchTrainer ranks (gloo); rollout workers are Ray actors; all of them
checkpoint one run through the detached CheckpointManager. A lost rollout worker is recovered alone
(its newest snapshot, then the collects since replayed: docs/recovery.md); after a learner crash Ray
Train restarts the learners and everyone restores the snapshot the RecoveryCoordinator chose.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--storage", default="./checkpoints", help="base_dir: a folder or any fsspec URL (s3://...)")
    p.add_argument("--run-name", default="ppo_cartpole")
    p.add_argument("--crash-at", type=int, help="SIGKILL a learner rank (or rollout worker) at this step, once")
    p.add_argument("--crash-target", choices=["learner", "rollout"], default="learner")
    p.add_argument("--address", help="Ray cluster to attach to (e.g. 'auto'); default: start a local one")
    p.add_argument("--config", help="YAML checkpoint config (e.g. configs/ppo.yaml); --storage/--run-name win")
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--workers-per-learner", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import ray

    from rl_ckpt import CheckpointConfig
    from rl_ckpt.demo.ray_ppo import run

    engine_cfg = {}
    if args.config:
        engine_cfg = CheckpointConfig.from_yaml(args.config).to_dict()
        engine_cfg.pop("base_dir"), engine_cfg.pop("run_name")
    if args.address:
        ray.init(address=args.address, namespace="rl_ckpt")
    else:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, namespace="rl_ckpt")
    storage = args.storage if "://" in args.storage else os.path.abspath(args.storage)
    result = run(
        base_dir=storage,
        run_name=args.run_name,
        steps=args.steps,
        learners=args.learners,
        workers_per_learner=args.workers_per_learner,
        crash_at=args.crash_at,
        crash_target=args.crash_target,
        seed=args.seed,
        engine_cfg=engine_cfg,
        log_dir=os.path.abspath("./rl_ckpt_logs") if "://" in storage else None,
    )
    done = result.done or {}
    print(
        json.dumps(
            {
                "run": args.run_name,
                "storage": storage,
                "attempts": len(result.attempts),
                "restored": [a["restored"] for a in result.attempts],
                "recovered_alone": [
                    f"{m['participant']} at step {m['step']}" for m in result.log if m["event"] == "scoped_recovery"
                ],
                "final_step": done.get("step"),
                "avg_reward": done.get("avg_reward"),
                "param_digest": done.get("digest"),
                "seconds": round(result.seconds, 1),
            },
            indent=1,
        )
    )
    return 0 if done.get("step") == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
