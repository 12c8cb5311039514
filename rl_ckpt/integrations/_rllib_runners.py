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

The EnvRunner encodes it itself (:func:`pack`: rl_ckpt's state codec, arrays as one safetensors buffer, the
tree as JSON text), so the driver stores two values as they are. Armed by the driver the iteration before a save
(:func:`arm`), it takes the state at the end of its sampling (:func:`sample_ended`, RLlib's ``on_sample_end``)
and encodes it in a thread while the driver learns; the save then only fetches it (:func:`capture`).

:func:`apply` puts it back into a freshly built (or live) EnvRunner of the same worker index, after decoding and
checking all of it (rl_ckpt's own decoders; the spaces come from the EnvRunner's env, never from the snapshot).
What cannot be captured is said, not guessed: :func:`capture` returns ``exact: False`` and why (another
EnvRunner class, an async vector env, an env or wrapper whose state is unknown, a value of a type the snapshot
cannot hold).
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

import numpy as np

from rl_ckpt.errors import CheckpointError, CorruptSnapshotError, SerializationError

COMPONENT = "env_runners"
log = logging.getLogger("rl_ckpt")
_ARMED: set[int] = set()  # EnvRunners (by id) that take their state at the end of their next sample()
_SAMPLED: dict[int, int] = {}  # sample() calls each EnvRunner made (counted in on_sample_end)
_AHEAD: dict[int, dict] = {}  # the state taken at the end of a sample(), encoded in a thread

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
    """This EnvRunner's sampling state (run in its process), encoded here (:func:`pack`): the driver receives two
    values it stores as they are. ``{"exact": False, "why": ...}`` when it cannot be captured.

    When the driver armed this EnvRunner (:func:`arm`), the state was taken at the end of its last ``sample()``
    and encoded in a thread while the driver learned (:func:`sample_ended`): that one is returned, if nothing it
    holds has changed since (else the state is taken now)."""
    key = id(runner)
    ahead = _AHEAD.pop(key, None)
    if ahead is not None and ahead["sampled"] == _SAMPLED.get(key) and _unchanged(runner, ahead):
        ahead["thread"].join()
        if "result" in ahead:
            return ahead["result"]
    why = _not_capturable(runner)
    if why:
        return {"worker_index": int(runner.worker_index or 0), "exact": False, "why": why}
    chunks = list(runner._ongoing_episodes_for_metrics.items())
    done = list(runner._done_episodes_for_metrics)
    return _encoded(runner.worker_index, _taken(runner, chunks, done))


def arm(runner: Any) -> None:
    """Take the state at the end of this EnvRunner's next ``sample()`` (a save is due after it): sent by the
    driver, not awaited, before the iteration samples."""
    _ARMED.add(id(runner))


def capture_and_arm(runner: Any) -> dict:
    """:func:`capture`, then :func:`arm`: one call instead of two when the iteration after this save saves too."""
    try:
        return capture(runner)
    finally:
        arm(runner)


def sample_ended(runner: Any) -> None:
    """``on_sample_end`` in the EnvRunner: when armed, take everything the next calls may change now (a few
    small copies) and encode it in a thread, while the driver learns from the samples.

    RLlib calls ``get_metrics()`` right after ``sample()`` (in the same remote call): it drops the metric chunks
    of the episodes that ended and forgets them; the state taken here is the one after it."""
    key = id(runner)
    _SAMPLED[key] = _SAMPLED.get(key, 0) + 1
    if key not in _ARMED:
        return
    _ARMED.discard(key)
    if _not_capturable(runner):
        return
    ended = {e.id_ for e in runner._done_episodes_for_metrics}
    chunks = [(eid, list(c)) for eid, c in runner._ongoing_episodes_for_metrics.items() if eid not in ended]
    state = _taken(runner, [], [])
    ahead: dict = {"sampled": _SAMPLED[key], "chunk_ids": [eid for eid, _ in chunks], "rng": state["rng"]}

    def encode() -> None:
        try:
            state["metric_chunks"] = [[eid, [episode_state(c) for c in saved]] for eid, saved in chunks]
            ahead["result"] = _encoded(runner.worker_index, state)
        except Exception:  # noqa: BLE001 - capture() then takes the state itself, and reports what fails
            log.debug("EnvRunner state taken ahead could not be encoded", exc_info=True)

    ahead["thread"] = threading.Thread(target=encode, name="rl_ckpt-envrunner-state", daemon=True)
    ahead["thread"].start()
    _AHEAD[key] = ahead


def _unchanged(runner: Any, ahead: dict) -> bool:
    """Whether what the state taken ahead holds is still this EnvRunner's (``get_metrics`` ran as RLlib runs it,
    and nothing drew from the random streams)."""
    from rl_ckpt.components import RNGState

    if runner._done_episodes_for_metrics or list(runner._ongoing_episodes_for_metrics) != ahead["chunk_ids"]:
        return False
    now, then = RNGState().state_dict(), ahead["rng"]
    return (
        list(now["python"]["internal"]) == [int(v) for v in then["python"]["internal"]]
        and np.array_equal(now["numpy"]["keys"], then["numpy"]["keys"])
        and now["numpy"]["pos"] == then["numpy"]["pos"]
        and bool(now["torch_cpu"].equal(then["torch_cpu"]))
    )


def _taken(runner: Any, chunks: list, done: list) -> dict:
    """The state, not yet encoded: copies of what changes as the EnvRunner samples."""
    from rl_ckpt.components import RNGState

    vector = _vector_env(runner.env)
    rng = RNGState().state_dict()
    rng["python"]["internal"] = np.array(rng["python"]["internal"], dtype=np.uint64)  # one array, not 625 numbers
    return {
        "envs": [env_state(e) for e in vector.envs],
        "autoreset": np.array(vector._autoreset_envs, dtype=np.bool_),
        "needs_initial_reset": bool(runner._needs_initial_reset),
        "episodes": [None if e is None else episode_state(e) for e in runner._ongoing_episodes],
        "metric_chunks": [[eid, [episode_state(c) for c in saved]] for eid, saved in chunks],
        "done_episodes": [episode_state(e) for e in done],
        "cached_to_module": runner._cached_to_module,
        "shared_data": copy.deepcopy(runner._shared_data),
        "rng": rng,
        "num_envs": len(vector.envs),
    }


def _encoded(worker_index: Any, state: dict) -> dict:
    index = int(worker_index or 0)
    num_envs = state.pop("num_envs")
    try:
        packed = pack(state)
    except CheckpointError as exc:  # a value the snapshot cannot hold (e.g. an object in an episode's custom_data)
        return {"worker_index": index, "exact": False, "why": str(exc)}
    return {"worker_index": index, "exact": True, "num_envs": num_envs, **packed}


def pack(state: dict) -> dict:
    """``state`` as rl_ckpt encodes any state (``_format/state_codec.py``): its JSON tree as text and its arrays
    as one safetensors buffer (uint8). SerializationError for a value it cannot hold."""
    import json

    from rl_ckpt._format import safetensors_io
    from rl_ckpt._format.state_codec import encode_state
    from rl_ckpt.integrations._rllib_state import to_storable

    encoded = encode_state(COMPONENT, to_storable(state, component=COMPONENT))
    if encoded.tables:
        raise SerializationError(f"component {COMPONENT!r}: a table in an EnvRunner's state", component=COMPONENT)
    chunks, _ = safetensors_io.encode(encoded.arrays)
    blob = b"".join(bytes(c) for c in chunks)
    return {"tree": json.dumps(encoded.tree, separators=(",", ":")), "arrays": np.frombuffer(blob, dtype=np.uint8)}


def unpack(packed: dict, where: str) -> dict:
    """The inverse of :func:`pack`, reading its input as hostile (rl_ckpt's own decoders, nothing unpickled);
    CorruptSnapshotError naming ``where``."""
    from rl_ckpt._format import safetensors_io
    from rl_ckpt._format.state_decode import decode_state
    from rl_ckpt._format.untrusted import parse_json
    from rl_ckpt.integrations._rllib_state import from_stored

    blob = packed.get("arrays") if isinstance(packed, dict) else None
    if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or not isinstance(packed.get("tree"), str):
        raise CorruptSnapshotError(f"{where}: an EnvRunner's state must hold tree (text) and arrays (uint8)")
    arrays = {
        name: np.array(safetensors_io.to_numpy(code, shape, view))  # a copy: RLlib writes into episode arrays
        for name, (code, shape, view) in safetensors_io.decode(blob.tobytes(), where=where).items()
    }
    tree = parse_json(packed["tree"].encode(), where, error=CorruptSnapshotError)
    return from_stored(decode_state(tree, arrays, {}, where=where), component=COMPONENT)


def apply(runner: Any, packed: dict) -> None:
    """Put ``packed`` (from :func:`capture` of the EnvRunner of the same worker index) into ``runner``: everything
    is decoded and checked before anything is set."""
    from collections import defaultdict

    from rl_ckpt.components import RNGState

    state = unpack(packed, f"{COMPONENT}/{runner.worker_index}")
    vector = _vector_env(runner.env)
    if vector is None or len(state["envs"]) != len(vector.envs):
        raise ValueError(f"the snapshot holds {len(state['envs'])} environments; this EnvRunner has others")
    for env, saved in zip(vector.envs, state["envs"]):
        check_env_state(env, saved)
    episodes = [None if s is None else _episode(runner, s) for s in state["episodes"]]
    chunks = {eid: [_episode(runner, s) for s in saved] for eid, saved in state["metric_chunks"]}
    done = [_episode(runner, s) for s in state["done_episodes"]]
    rng = state["rng"]
    rng["python"]["internal"] = [int(v) for v in rng["python"]["internal"]]
    for env, saved in zip(vector.envs, state["envs"]):
        load_env_state(env, saved)
    vector._autoreset_envs = np.array(state["autoreset"], dtype=np.bool_)
    runner._needs_initial_reset = bool(state["needs_initial_reset"])
    runner._ongoing_episodes = episodes
    runner._ongoing_episodes_for_metrics = defaultdict(list, chunks)
    runner._done_episodes_for_metrics = done
    runner._cached_to_module = _on_device(state["cached_to_module"], runner.module)
    runner._shared_data = state["shared_data"]
    RNGState().load_state_dict(rng)  # last: nothing above draws a random number


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


def check_env_state(env: Any, state: dict) -> None:
    """ValueError unless ``state`` was captured from an env of this class, in these wrappers."""
    chain = _chain(env)
    inner = chain[-1]
    if type(inner).__name__ != state["class"]:
        raise ValueError(
            f"the snapshot holds a {state['class']} environment, this EnvRunner has {type(inner).__name__}"
        )
    names = [type(w).__name__ for w in chain[:-1]]
    if names != [name for name, _ in state["wrappers"]]:
        raise ValueError(f"the snapshot's env wrappers {[n for n, _ in state['wrappers']]} are not these: {names}")
    for name, values in state["wrappers"]:
        if set(values) != set(WRAPPERS[name]):
            raise ValueError(f"the snapshot's {name} holds {sorted(values)}, not {list(WRAPPERS[name])}")
    saved = state["np_random"]
    if saved is not None and (not isinstance(saved, dict) or saved.get("bit_generator") not in BIT_GENERATORS):
        raise ValueError("the snapshot's env random generator is not one of NumPy's bit generators")
    if "hook" not in state["env"] and set(state["env"]) != set(CLASSIC_CONTROL.get(state["class"], ())):
        raise ValueError(f"the snapshot's {state['class']} state holds {sorted(state['env'])}")


def load_env_state(env: Any, state: dict) -> None:
    """Put ``state`` (checked by :func:`check_env_state`) into ``env``."""
    chain = _chain(env)
    inner = chain[-1]
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

    # The spaces come from this EnvRunner's env, never from the snapshot: RLlib decodes a stored space's bounds
    # with np.load(allow_pickle=True).
    state = dict(state, _observation_space=None, _action_space=None)
    for key in ("observations", "actions", "rewards", "infos"):
        state[key] = dict(state[key], space=None)
    if state["extra_model_outputs"]:
        state["extra_model_outputs"] = {k: dict(v, space=None) for k, v in state["extra_model_outputs"].items()}
    episode = SingleAgentEpisode.from_state(state)
    episode.observation_space = runner.env.single_observation_space
    episode.action_space = runner.env.single_action_space
    return episode


def _on_device(tree: Any, module: Any) -> Any:
    """``tree``'s tensors on the device of ``module``'s parameters (they are decoded on the CPU)."""
    import torch
    import tree as dm_tree

    params = module.parameters() if isinstance(module, torch.nn.Module) else iter(())
    device = next(params, torch.empty(0)).device
    if device.type == "cpu":
        return tree
    return dm_tree.map_structure(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _copy(value: Any) -> Any:
    return value.copy() if isinstance(value, np.ndarray) else value


def take_restored(sent: Any, runner: Any) -> str | None:
    """Run in an EnvRunner after a restore: the driver's connector states and sampled-steps counter
    (``sent["connectors"]``, when sent), the learner's weights (``sent["weights"]``: one ``set_state``, or two
    for a rollback: first without the sequence number, which any EnvRunner takes), then its own sampling state
    (``sent["runners"]`` by worker index). ``sent``: that dict, or an ObjectRef of it. Returns why the sampling
    state was not taken (nothing of it is then set), else None."""
    import ray

    if isinstance(sent, ray.ObjectRef):
        sent = ray.get(sent)
    if sent.get("connectors"):
        runner.set_state(sent["connectors"])
    if sent.get("unnumbered"):
        runner.set_state({k: v for k, v in sent["weights"].items() if k != "weights_seq_no"})
    runner.set_state(sent["weights"])
    own = (sent.get("runners") or {}).get(str(int(runner.worker_index or 0)))
    if own is None:
        return None
    try:
        apply(runner, own)
    except Exception as exc:  # noqa: BLE001 - reported; this EnvRunner then samples as restored by RLlib
        note = f"EnvRunner {runner.worker_index} did not take its sampling state: {type(exc).__name__}: {exc}"
        log.warning("RLlib restore: %s; the resumed run is not exact", note)
        return note
    return None
