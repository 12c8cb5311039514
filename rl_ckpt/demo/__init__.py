"""Demo workloads for rl_ckpt (a small deterministic PPO on CartPole)."""
