"""What an RLlib EnvRunner holds between two ``sample()`` calls, captured so that a resumed run samples on exactly
as the uninterrupted one would.

No RLlib checkpoint holds it (RLlib's own or, before this, rl_ckpt's): a restored EnvRunner resets its
environments with the seed and samples fresh episodes, so the first batch after a restore differs, and everything
trained from it. For a ``SingleAgentEnvRunner`` over a gymnasium ``SyncVectorEnv`` whose environments can be
captured, this module captures, inside each EnvRunner process (:func:`capture`, run through
``foreach_env_runner``) and as plain data (arrays, tensors, JSON values; nothing pickled):

- every sub-environment: gymnasium classic control (CartPole, Acrobot, MountainCar(Continuous), Pendulum: the
  physics ``state``, ``steps_beyond_terminated``, ``last_u``) or an env whose unwrapped object has
  ``state_dict()``/``load_state_dict()`` (the user's hook); its ``np_random`` generator; the wrappers
  ``TimeLimit`` (``_elapsed_steps``), ``OrderEnforcing`` (``_has_reset``), ``PassiveEnvChecker`` (its flags);
  the vector env's pending auto-resets;
- the ongoing episode chunks (the lookback the next chunk continues from, ids, step counts) and the chunks kept
  for the episode metrics, through RLlib's ``SingleAgentEpisode.get_state`` (spaces left out: they come from
  the env at restore), the env-to-module output cached for the next action (the normalized observation: it is
  computed once, when the observation arrives, and updates ``MeanStdFilter``), the connectors' shared data;
- the process's random streams (Python, NumPy, torch: the policy samples its actions from torch's).

:func:`apply` puts it back into a freshly built (or live) EnvRunner of the same worker index. What cannot be
captured is said, not guessed: :func:`capture` returns ``exact: False`` and why (another EnvRunner class, an
async vector env, an env or wrapper whose state is unknown, a value of a type the snapshot cannot hold).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Sub-environment state of gymnasium's classic-control envs, by class: every attribute a step reads and writes
# (the rest of each class is constants and rendering).
CLASSIC_CONTROL = {
    "CartPoleEnv": ("state", "steps_beyond_terminated"),
    "AcrobotEnv": ("state",),
    "MountainCarEnv": ("state",),
    "Continuous_MountainCarEnv": ("state",),
    "PendulumEnv": ("state", "last_u"),
}
WRAPPERS = {  # gymnasium wrappers RLlib's envs come in, and what each holds
    "TimeLimit": ("_elapsed_steps",),
    "OrderEnforcing": ("_has_reset",),
    "PassiveEnvChecker": ("checked_reset", "checked_step", "checked_render", "close_called"),
}
VECTOR_WRAPPERS = ("DictInfoToList",)  # stateless
BIT_GENERATORS = {name: getattr(np.random, name) for name in ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")}


def capture(runner: Any) -> dict:
    """This EnvRunner's sampling state (run in its process); ``{"exact": False, "why": ...}`` when not capturable."""
    index = int(runner.worker_index or 0)
    why = _not_capturable(runner)
    if why:
        return {"worker_index": index, "exact": False, "why": why}
    from rl_ckpt.components import RNGState

    vector = _vector_env(runner.env)
    try:
        envs = [env_state(e) for e in vector.envs]
    except ValueError as exc:
        return {"worker_index": index, "exact": False, "why": str(exc)}
    state = {
        "worker_index": index,
        "exact": True,
        "envs": envs,
        "autoreset": np.array(vector._autoreset_envs, dtype=np.bool_),
        "needs_initial_reset": bool(runner._needs_initial_reset),
        "episodes": [None if e is None else episode_state(e) for e in runner._ongoing_episodes],
        "metric_chunks": [
            [eid, [episode_state(c) for c in chunks]] for eid, chunks in runner._ongoing_episodes_for_metrics.items()
        ],
        "done_episodes": [episode_state(e) for e in runner._done_episodes_for_metrics],
        "cached_to_module": runner._cached_to_module,
        "shared_data": runner._shared_data,
        "rng": RNGState().state_dict(),
    }
    bad = unstorable(state)
    if bad:
        return {"worker_index": index, "exact": False, "why": bad}
    return state


def apply(runner: Any, state: dict) -> None:
    """Put ``state`` (from :func:`capture` of the EnvRunner of the same worker index) into ``runner``."""
    from collections import defaultdict

    from rl_ckpt.components import RNGState

    vector = _vector_env(runner.env)
    if len(state["envs"]) != len(vector.envs):
        raise ValueError(f"the snapshot holds {len(state['envs'])} environments, this EnvRunner has {len(vector.envs)}")
    for env, saved in zip(vector.envs, state["envs"]):
        load_env_state(env, saved)
    vector._autoreset_envs = np.array(state["autoreset"], dtype=np.bool_)
    runner._needs_initial_reset = bool(state["needs_initial_reset"])
    runner._ongoing_episodes = [None if s is None else _episode(runner, s) for s in state["episodes"]]
    runner._ongoing_episodes_for_metrics = defaultdict(
        list, {eid: [_episode(runner, s) for s in chunks] for eid, chunks in state["metric_chunks"]}
    )
    runner._done_episodes_for_metrics = [_episode(runner, s) for s in state["done_episodes"]]
    runner._cached_to_module = state["cached_to_module"]
    runner._shared_data = state["shared_data"]
    RNGState().load_state_dict(state["rng"])  # last: nothing above draws a random number


def _not_capturable(runner: Any) -> str | None:
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    if not isinstance(runner, SingleAgentEnvRunner):  # (a Ray actor's class derives from the one it was made from)
        return (
            f"{type(runner).__name__}: only RLlib's SingleAgentEnvRunner is captured (a multi-agent or other "
            "EnvRunner is not)"
        )
    if runner.env is None:
        return None if runner.num_envs == 0 else "the EnvRunner has no environment"
    vector = _vector_env(runner.env)
    if vector is None:
        return (
            f"vector env {type(runner.env).__name__}: only gymnasium's SyncVectorEnv is captured "
            "(config.env_runners(gym_env_vectorize_mode='SYNC'))"
        )
    for env in vector.envs:
        why = _env_not_capturable(env)
        if why:
            return why
    return None


def _vector_env(env: Any) -> Any:
    """The ``SyncVectorEnv`` under RLlib's stateless vector wrappers, or None."""
    from gymnasium.vector import SyncVectorEnv

    while env is not None and type(env).__name__ in VECTOR_WRAPPERS:
        env = env.env
    return env if type(env) is SyncVectorEnv else None


def _chain(env: Any) -> list:
    out = [env]
    while hasattr(out[-1], "env") and out[-1] is not out[-1].unwrapped:
        out.append(out[-1].env)
    return out


def _env_not_capturable(env: Any) -> str | None:
    chain = _chain(env)
    for wrapper in chain[:-1]:
        if type(wrapper).__name__ not in WRAPPERS:
            return f"wrapper {type(wrapper).__name__}: its state is not captured (known: {', '.join(WRAPPERS)})"
    inner = chain[-1]
    if (
        _hook(inner)
        or type(inner).__name__ in CLASSIC_CONTROL
        and type(inner).__module__.startswith("gymnasium.envs.classic_control")
    ):
        return None
    return (
        f"env {type(inner).__name__}: its state is not captured (gymnasium classic control is; give the env "
        "state_dict() and load_state_dict() to have it captured)"
    )


def _hook(env: Any) -> bool:
    return callable(getattr(env, "state_dict", None)) and callable(getattr(env, "load_state_dict", None))


def env_state(env: Any) -> dict:
    """One sub-environment: its wrappers' counters, the unwrapped env's state and its random generator."""
    chain = _chain(env)
    inner = chain[-1]
    wrappers = [[type(w).__name__, {a: getattr(w, a) for a in WRAPPERS[type(w).__name__]}] for w in chain[:-1]]
    if _hook(inner):
        own = {"hook": inner.state_dict()}
    else:
        own = {a: _copy(getattr(inner, a)) for a in CLASSIC_CONTROL[type(inner).__name__]}
    rng = inner._np_random
    return {
        "class": type(inner).__name__,
        "wrappers": wrappers,
        "env": own,
        "np_random": None if rng is None else rng.bit_generator.state,
        "np_random_seed": inner._np_random_seed,
    }


def load_env_state(env: Any, state: dict) -> None:
    chain = _chain(env)
    inner = chain[-1]
    if type(inner).__name__ != state["class"]:
        raise ValueError(
            f"the snapshot holds a {state['class']} environment, this EnvRunner has {type(inner).__name__}"
        )
    names = [type(w).__name__ for w in chain[:-1]]
    if names != [name for name, _ in state["wrappers"]]:
        raise ValueError(f"the snapshot's env wrappers {[n for n, _ in state['wrappers']]} are not these: {names}")
    for wrapper, (_name, values) in zip(chain[:-1], state["wrappers"]):
        for attr, value in values.items():
            setattr(wrapper, attr, value)
    if "hook" in state["env"]:
        inner.load_state_dict(state["env"]["hook"])
    else:
        for attr, value in state["env"].items():
            setattr(inner, attr, _copy(value))
    saved = state["np_random"]
    if saved is None:
        inner._np_random = None
    else:
        generator = np.random.Generator(BIT_GENERATORS[saved["bit_generator"]]())
        generator.bit_generator.state = saved
        inner._np_random = generator  # set directly: the np_random setter would drop the seed
    inner._np_random_seed = state["np_random_seed"]


def episode_state(episode: Any) -> dict:
    """RLlib's ``get_state`` of an episode chunk without its spaces (restored from the env: no text to decode)."""
    state = episode.get_state()
    state["_observation_space"] = state["_action_space"] = None
    for key in ("observations", "actions", "rewards", "infos"):
        state[key] = dict(state[key], space=None)
    # Every buffer's own state: RLlib's get_state keeps an empty one (a chunk just cut: its data all lookback) as the
    # buffer object itself.
    extra = episode.extra_model_outputs
    state["extra_model_outputs"] = {k: dict(b.get_state(), space=None) for k, b in extra.items()} if extra else None
    return state


def _episode(runner: Any, state: dict) -> Any:
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    episode = SingleAgentEpisode.from_state(state)
    episode.observation_space = runner.env.single_observation_space
    episode.action_space = runner.env.single_action_space
    return episode


def _copy(value: Any) -> Any:
    return value.copy() if isinstance(value, np.ndarray) else value


def unstorable(tree: Any, path: str = "") -> str | None:
    """Where ``tree`` holds a value the snapshot cannot store (the first one, with its type), else None."""
    import torch

    stack = [(tree, path)]
    while stack:
        node, where = stack.pop()
        if node is None or isinstance(node, (bool, int, float, str, np.generic, torch.Tensor)):
            continue
        if isinstance(node, np.ndarray):
            if node.dtype.hasobject or node.dtype.kind in "USV":
                return f"{where.lstrip('/')}: a {node.dtype} array cannot be stored"
            continue
        if isinstance(node, dict):
            for k, v in node.items():
                if not (k is None or isinstance(k, (str, int))):
                    return f"{where.lstrip('/')}: a {type(k).__name__} dict key cannot be stored"
                stack.append((v, f"{where}/{k}"))
            continue
        if isinstance(node, (list, tuple)):
            stack.extend((v, f"{where}/{i}") for i, v in enumerate(node))
            continue
        return f"{where.lstrip('/')}: a {type(node).__name__} cannot be stored"
    return None


def gather(algo: Any) -> dict:
    """Every training EnvRunner's :func:`capture` (the remote ones, or the driver's own when there are none), by
    worker index; ``exact`` False with why when any cannot be captured (then none is kept)."""
    group = algo.env_runner_group
    expected = group.num_remote_env_runners()
    if expected:
        states = group.foreach_env_runner(capture, local_env_runner=False)
    else:
        states = [capture(algo.env_runner)] if algo.env_runner is not None else []
    whys = [f"EnvRunner {s['worker_index']}: {s['why']}" for s in states if not s["exact"]]
    if expected and len(states) < expected:
        whys.append(f"{expected - len(states)} of {expected} EnvRunners did not answer (unhealthy)")
    if not states:
        whys.append("no EnvRunner samples")
    if whys:
        return {"exact": False, "why": "; ".join(whys), "runners": {}}
    return {"exact": True, "why": None, "runners": {str(s["worker_index"]): s for s in states}}


def take_restored(sent: Any, runner: Any) -> None:
    """Run in an EnvRunner after a restore: the learner's weights (``sent["weights"]``: one ``set_state``, or two
    for a rollback: first without the sequence number, which any EnvRunner takes), then its own sampling state
    (``sent["runners"]`` by worker index). ``sent``: that dict, or an ObjectRef of it."""
    import ray

    if isinstance(sent, ray.ObjectRef):
        sent = ray.get(sent)
    if sent.get("unnumbered"):
        runner.set_state({k: v for k, v in sent["weights"].items() if k != "weights_seq_no"})
    runner.set_state(sent["weights"])
    own = (sent.get("runners") or {}).get(str(int(runner.worker_index or 0)))
    if own is not None:
        apply(runner, own)
