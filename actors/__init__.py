"""The Ray side of rl_ckpt (the detached CheckpointManager actor and friends).

It is built on top of the engine in ``rl_ckpt``; see docs/architecture.md.
"""
