"""``EpisodeStream``: each env's episode index and seed, resumable, for env-driven runs without a dataset.

Episode ``k`` of env ``i`` always gets the seed derived from ``(seed, i, k)``,
so after a restore env ``i`` goes on with the same episodes, in order. An
episode that had begun but not finished at the snapshot is begun again with
its own seed (an env's internals are not saved; a seeded reset replays it
from its start), and is counted once, when it finishes.
"""

from __future__ import annotations

from rl_ckpt.data._checks import require_same, state_int

_ENV_MUL = 1_000_003


class EpisodeStream:
    """The episodes of ``n_envs`` envs as checkpoint state: for each env the next episode index and the one running.

    Example (gymnasium)::

        stream = EpisodeStream(n_envs=4, seed=7)
        engine.register("episodes", stream)
        obs, info = envs[i].reset(seed=stream.begin(i))
        ... when the episode ends: stream.finish(i)
    """

    checkpoint_kind = "other"  # per participant: each rollout worker its own envs
    data_position = True  # never in a light snapshot: it travels with the weights
    name = "EpisodeStream"

    def __init__(self, n_envs: int, seed: int = 0) -> None:
        if isinstance(n_envs, bool) or not isinstance(n_envs, int) or n_envs <= 0:
            raise ValueError(f"EpisodeStream: n_envs must be a positive int, got {n_envs!r}")
        self.n_envs = n_envs
        self.seed = int(seed)
        self.next_index = [0] * n_envs  # episodes begun so far, per env
        self.running = [False] * n_envs  # episode next_index - 1 begun and not finished
        self.finished = 0

    def episode_seed(self, env: int, index: int) -> int:
        """The reset seed of episode ``index`` of env ``env`` (fits a 32-bit seed)."""
        return ((self.seed * _ENV_MUL + env) * _ENV_MUL + index) % (2**31 - 1)

    def begin(self, env: int) -> int:
        """Start env ``env``'s next episode (or the one that was running at the snapshot); returns its seed."""
        if not self.running[env]:
            self.next_index[env] += 1
            self.running[env] = True
        return self.episode_seed(env, self.next_index[env] - 1)

    def current(self, env: int) -> int | None:
        """The index of env ``env``'s running episode, or None."""
        return self.next_index[env] - 1 if self.running[env] else None

    def finish(self, env: int) -> int:
        """Env ``env``'s running episode ended; returns its index."""
        if not self.running[env]:
            raise RuntimeError(f"EpisodeStream: env {env} has no running episode to finish")
        self.running[env] = False
        self.finished += 1
        return self.next_index[env] - 1

    def state_dict(self) -> dict:
        return {
            "n_envs": self.n_envs,
            "seed": self.seed,
            "next_index": list(self.next_index),
            "running": list(self.running),
            "finished": self.finished,
        }

    def load_state_dict(self, state: dict) -> None:
        hint = "Restore with the same number of envs and seed, or start a new run."
        require_same(self.name, "n_envs", state.get("n_envs"), self.n_envs, hint)
        require_same(self.name, "seed", state.get("seed"), self.seed, hint)
        nxt, running = state.get("next_index"), state.get("running")
        if (
            not isinstance(nxt, list)
            or not isinstance(running, list)
            or len(nxt) != self.n_envs
            or len(running) != self.n_envs
            or not all(isinstance(v, int) and v >= 0 for v in nxt)
            or not all(isinstance(v, bool) for v in running)
        ):
            require_same(self.name, "per-env lists of length n_envs", (nxt, running), self.n_envs, hint)
        self.finished = state_int(self.name, state, "finished")
        self.next_index, self.running = list(nxt), list(running)
