"""RLlib (new API stack): a whole ``Algorithm`` as one rl_ckpt snapshot, saved on a cadence by an ``RLlibCallback``.

    from rl_ckpt.integrations.rllib import checkpoint_callback

    config = PPOConfig().environment("CartPole-v1").callbacks(
        checkpoint_callback(base_dir="./ckpt", run_name="ppo", save_interval_steps=2))
    algo = config.build_algo()   # restores the snapshot the coordinator chooses, printing the plan
    for _ in range(100):
        algo.train()             # blocks only while the state is staged; written in the background

``Algorithm.get_state()`` is split into components of one snapshot: one
``module-<policy id>`` per RLModule (the learner's weights), ``optimizer``
(the learner's optimizer state), ``learner`` (weights sequence number,
trainable policies, the learner's metrics), ``algorithm`` (env-runner
connector states such as ``MeanStdFilter``, sampled-steps counters, the
algorithm's metrics), ``progress`` (the training iteration), ``env_runners``
(what the EnvRunners hold between two iterations: environments, ongoing
episodes, random streams; ``_rllib_runners.py``) and ``rng`` (the driver's
random streams: the local learner shuffles minibatches with them). Arrays go
to safetensors, the rest to JSON; nothing is pickled, and nothing RLlib would
unpickle is stored or handed back to it (``_rllib_state.py``: arrays RLlib
keeps as ``.npy`` text are stored as arrays). A value the state codec cannot
store is refused at save, naming the component and key.

Each part is restored through RLlib's ``set_state`` (the learner group's for
the learner's parts, the Algorithm's for the rest: its metrics first, then the
EnvRunner connector states, which RLlib syncs to the EnvRunners with the
restored sampled-steps counter, as ``restore_from_path`` does);
``restore_algorithm`` then sends every EnvRunner the restored weights and its
own sampling state in one call (``push_weights``).

With the EnvRunners' sampling state (gymnasium classic control, or an env with
``state_dict()``/``load_state_dict()``, on RLlib's single-agent EnvRunner) a
resumed run samples what the uninterrupted one would: bitwise the same run.
Otherwise the restored EnvRunners reset their environments and the plan says
why the run is not exact (docs/rllib.md).
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import re
import time
from typing import Any, Callable, Mapping

from ray.rllib.callbacks.callbacks import RLlibCallback

from rl_ckpt.components import RNGState
from rl_ckpt.errors import ConfigError
from rl_ckpt.integrations._rllib_runners import gather, take_restored
from rl_ckpt.integrations._rllib_state import (  # noqa: F401 - NONE_KEY .. optimizer_state are public here
    NONE_KEY,
    NPY_KEY,
    from_stored,
    learner_value,
    module_weights,
    optimizer_state,
    plain_arrays,
    to_storable,
)

log = logging.getLogger("rl_ckpt")

LEARNER_GROUP, LEARNER, RL_MODULE, OPTIMIZER, METRICS = (
    "learner_group",
    "learner",
    "rl_module",
    "optimizer",
    "metrics_logger",
)
TRAINING_ITERATION, WEIGHTS_SEQ_NO = "training_iteration", "weights_seq_no"
ENV_RUNNERS = "env_runners"
RESTORE_TAG = "rl_ckpt_restore"
EXTRAS = "rl_ckpt:extras"  # learner state RLlib's get_state leaves out (learner_extras)
BEST_METRIC = "env_runners/episode_return_mean"
DEFAULT_METRICS = (BEST_METRIC, "env_runners/num_env_steps_sampled_lifetime", "env_runners/episode_len_mean")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class AlgorithmPart:
    """One part of an ``Algorithm``'s state as an rl_ckpt ``Checkpointable``.

    ``get(algo)`` returns the part's state (what ``Algorithm.get_state`` holds
    for it); ``put(algo, state)`` sets it through RLlib's ``set_state``.
    """

    def __init__(
        self,
        algo: Any,
        kind: str,
        get: Callable[[Any], dict],
        put: Callable[[Any, dict], None],
        what: str,
        name: str | None = None,
    ) -> None:
        self.algo = algo
        self.checkpoint_kind = kind
        self._get, self._put = get, put
        self.what = what
        self.name = name  # the component name, for errors

    def state_dict(self) -> dict:
        return to_storable(self._get(self.algo), component=self.name)

    def load_state_dict(self, state: dict) -> None:
        # Every value is converted and checked before RLlib sees any (CorruptSnapshotError: the restore falls back).
        self._put(self.algo, from_stored(state, component=self.name))

    def __repr__(self) -> str:
        return f"AlgorithmPart({self.what})"


def module_ids(algo: Any) -> list[str]:
    """The RLModule ids the learner trains (one per policy id in a multi-agent config)."""
    state = algo.learner_group.get_state(components=f"{LEARNER}/{RL_MODULE}")
    return sorted(state[LEARNER][RL_MODULE])


def component_names(ids: list[str]) -> dict[str, str]:
    """Module id -> component name ``module-<id>`` (characters a file name cannot hold become ``_``; clashes
    get a numeric suffix)."""
    out: dict[str, str] = {}
    for mid in ids:
        base = "module-" + _UNSAFE.sub("_", str(mid))[:80]
        name, n = base, 1
        while name in out.values():
            n += 1
            name = f"{base}-{n}"
        out[mid] = name
    return out


def _module_part(algo: Any, mid: str) -> AlgorithmPart:
    def get(a: Any) -> dict:
        learner = local_learner(a)
        if learner is not None:
            return module_weights(learner, mid)
        return a.learner_group.get_state(components=f"{LEARNER}/{RL_MODULE}/{mid}")[LEARNER][RL_MODULE][mid]

    def put(a: Any, weights: dict) -> None:
        # Into the learner only: ``Algorithm.set_state`` would also sync the weights to the EnvRunners (a copy of
        # every weight and a send per module) which they ignore (see ``push_weights``); ``restore_algorithm``
        # sends them once, after every part is loaded.
        a.learner_group.set_state({LEARNER: {RL_MODULE: {mid: weights}}})

    return AlgorithmPart(algo, "module", get, put, f"RLModule {mid!r}")


def _algorithm_put(a: Any, state: dict) -> None:
    """The metrics first: ``Algorithm.set_state`` syncs the EnvRunners' sampled-steps counter from the
    Algorithm's metrics before it restores them (one call would hand them the fresh Algorithm's 0)."""
    if METRICS in state:
        a.set_state({METRICS: state[METRICS]})
    a.set_state({k: v for k, v in state.items() if k != METRICS})


class RunnersPart:
    """The ``env_runners`` component: every EnvRunner's sampling state (``_rllib_runners.py``). Its restored
    state waits in ``pending`` for :func:`restore_algorithm`, which sends it with the weights in one call."""

    checkpoint_kind = "other"

    def __init__(self, algo: Any) -> None:
        self.algo = algo
        self.pending: dict | None = None

    def state_dict(self) -> dict:
        return to_storable(gather(self.algo), component=ENV_RUNNERS)

    def load_state_dict(self, state: dict) -> None:
        self.pending = from_stored(state, component=ENV_RUNNERS)

    def __repr__(self) -> str:
        return "RunnersPart(EnvRunner environments, episodes, random streams)"


def local_learner(algo: Any) -> Any:
    """The Learner itself when it runs in this process (RLlib's default ``num_learners=0``), else None."""
    group = algo.learner_group
    if not group.is_local:
        return None
    return next(iter(group.foreach_learner(lambda learner: learner))).get()


def _optimizer_get(a: Any) -> dict:
    learner = local_learner(a)
    state = optimizer_state(learner) if learner is not None else None
    if state is None:
        state = a.learner_group.get_state(components=f"{LEARNER}/{OPTIMIZER}")[LEARNER][OPTIMIZER]
    return state


def _learner_get(a: Any) -> dict:
    state = a.learner_group.get_state(components=f"{LEARNER}/{METRICS}")[LEARNER]
    out = {k: learner_value(k, v) for k, v in state.items()}
    extras = _first(a.learner_group.foreach_learner(learner_extras))
    if extras:
        out[EXTRAS] = {**extras, "timestep": _lifetime_steps(a)}
    return out


def _learner_put(a: Any, state: dict) -> None:
    extras = state.pop(EXTRAS, None)
    a.learner_group.set_state({LEARNER: state})
    if extras:
        a.learner_group.foreach_learner(functools.partial(load_learner_extras, extras))


def _first(results: Any) -> Any:
    """The first learner's answer of ``foreach_learner`` (a local learner's comes wrapped)."""
    first = next(iter(results), None)
    return first.get() if hasattr(first, "get") else first


def _lifetime_steps(a: Any) -> int:
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

    return int(a.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0) or 0)


def learner_extras(learner: Any) -> dict:
    """Learner state RLlib's ``get_state`` leaves out: PPO's adaptive KL coefficients (one per module; the KL term
    of every later loss), without which a restored run's first update differs from the uninterrupted one's."""
    coeffs = getattr(learner, "curr_kl_coeffs_per_module", None)
    if not isinstance(coeffs, dict) or not coeffs:
        return {}
    return {"curr_kl_coeffs": {str(mid): v.detach().clone() for mid, v in coeffs.items()}}


def load_learner_extras(extras: dict, learner: Any) -> None:
    """Put :func:`learner_extras` back, and bring PPO's entropy-coefficient schedules to the saved timestep (their
    value is updated after each update, from the sampled-steps counter, and read by the next one)."""
    import torch

    coeffs = getattr(learner, "curr_kl_coeffs_per_module", None)
    for mid, value in (extras.get("curr_kl_coeffs") or {}).items():
        if coeffs is not None:
            coeffs[mid].data.copy_(torch.as_tensor(value))  # (a default dict: made for the module if missing)
    schedules = getattr(learner, "entropy_coeff_schedulers_per_module", None)
    if schedules is not None:
        for mid in learner.module.keys():
            schedules[mid].update(timestep=int(extras.get("timestep", 0)))


def algorithm_parts(algo: Any) -> dict[str, AlgorithmPart]:
    """Component name -> part, covering everything ``algo.get_state()`` holds."""
    parts = {name: _module_part(algo, mid) for mid, name in component_names(module_ids(algo)).items()}
    for name, part in parts.items():
        part.name = name
    parts[OPTIMIZER] = AlgorithmPart(
        algo,
        "optimizer",
        _optimizer_get,
        lambda a, s: a.learner_group.set_state({LEARNER: {OPTIMIZER: s}}),
        "learner optimizer state",
        OPTIMIZER,
    )
    parts[LEARNER] = AlgorithmPart(
        algo,
        "other",
        _learner_get,
        _learner_put,
        "learner counters and metrics",
        LEARNER,
    )
    parts["algorithm"] = AlgorithmPart(
        algo,
        "other",
        lambda a: {k: v for k, v in a.get_state(not_components=[LEARNER_GROUP]).items() if k != TRAINING_ITERATION},
        _algorithm_put,
        "env-runner connector states, counters, metrics",
        "algorithm",
    )
    parts["progress"] = AlgorithmPart(
        algo,
        "progress",
        lambda a: {TRAINING_ITERATION: int(a.training_iteration)},
        lambda a, s: a.set_state({TRAINING_ITERATION: int(s[TRAINING_ITERATION])}),
        "training iteration",
        "progress",
    )
    return parts


def register_algorithm(engine: Any, algo: Any, *, rng: bool = True, env_runners: bool = True) -> dict[str, Any]:
    """Register every part of ``algo``'s state with ``engine`` (plus the driver's ``RNGState`` when ``rng``, and
    the EnvRunners' sampling state, ``env_runners``, when ``env_runners``)."""
    if not getattr(algo.config, "enable_env_runner_and_connector_v2", False):
        raise ConfigError(
            "rl_ckpt saves RLlib's new API stack (Algorithm.get_state); this Algorithm runs the old "
            "one: set config.api_stack(enable_rl_module_and_learner=True, "
            "enable_env_runner_and_connector_v2=True)",
            key="api_stack",
        )
    parts: dict[str, Any] = dict(algorithm_parts(algo))
    if env_runners:
        parts[ENV_RUNNERS] = RunnersPart(algo)
    for name, part in parts.items():
        engine.register(name, part, kind=part.checkpoint_kind)
    if rng:
        engine.register("rng", RNGState())
    return parts


def train_metrics(result: Mapping[str, Any], keys: tuple[str, ...] = DEFAULT_METRICS) -> dict[str, float]:
    """The finite numbers of ``result`` at ``keys`` (``a/b`` is ``result["a"]["b"]``), as a manifest holds them."""
    out: dict[str, float] = {}
    for key in keys:
        node: Any = result
        for part in key.split("/"):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(float(node)):
            out[key] = float(node)
        elif node is not None and hasattr(node, "item"):
            value = float(node.item())
            if math.isfinite(value):
                out[key] = value
    return out


def restore_algorithm(
    algo: Any, engine: Any, *, failure: Any = None, out: Callable[[str], None] | None = print, deep: bool = False
) -> Any:
    """Restore the snapshot the coordinator chooses into ``algo`` (built from the same config); prints the plan.

    Returns the ``RestoreResult`` (``fresh`` when the run has no snapshot). A snapshot that fails on load
    (checksum, decoding, a value RLlib would unpickle) is skipped for the plan's next fallback; ``result.skipped``
    says why. Whether the EnvRunners resume exactly is in ``result.warnings`` when they do not (and printed).
    """
    plan = engine.plan_recovery(failure, deep=deep)
    if out is not None:
        out(str(plan))
    runners = engine.components.get(ENV_RUNNERS)
    if isinstance(runners, RunnersPart):
        runners.pending = None
    before = learner_seq(algo)
    result = engine.restore(plan, strict=not _saved_without_runners(engine, plan, runners))
    if not result.fresh:
        pending = runners.pending if isinstance(runners, RunnersPart) else None
        note = runners_note(algo, pending)
        push_weights(algo, rolled_back=before > learner_seq(algo), runners=None if note else pending["runners"])
        if note:
            result.warnings.append(note)
    if out is not None:
        for sid, why in result.skipped.items():
            out(f"  fell back: {sid} not used: {why}")
        if not result.fresh:
            out(f"  restored {result.snapshot_id}: continuing after iteration {result.global_step}")
            out("  " + (note or "EnvRunners: environments, episodes and random streams restored (an exact resume)"))
    return result


def _saved_without_runners(engine: Any, plan: Any, runners: Any) -> bool:
    """The plan's target was saved without the ``env_runners`` component (by an rl_ckpt before it, or with
    ``env_runners=False``): restore the rest (the EnvRunners start fresh, and the restore says so)."""
    if runners is None or plan.target is None:
        return False
    info = engine.catalog.get(plan.target)
    manifest = info.manifest if info is not None else None
    return manifest is not None and ENV_RUNNERS not in manifest.components


def runners_note(algo: Any, pending: dict | None) -> str | None:
    """Why the EnvRunners do not resume exactly from the restored state (None when they do)."""
    if pending is None:
        return "EnvRunners not exact: the snapshot holds no EnvRunner state; they reset their environments"
    if not pending.get("exact"):
        return f"EnvRunners not exact: {pending.get('why')}; they reset their environments"
    group = algo.env_runner_group
    ids = sorted(group.healthy_env_runner_ids()) if group.num_remote_env_runners() else [0]
    saved = sorted(int(k) for k in pending["runners"])
    if ids != saved:
        return f"EnvRunners not exact: the snapshot holds EnvRunners {saved}, this Algorithm has {ids}"
    per_runner = algo.config.num_envs_per_env_runner
    wrong = [k for k, s in pending["runners"].items() if len(s["envs"]) != per_runner]
    if wrong:
        return f"EnvRunners not exact: EnvRunner {wrong[0]} held another number of environments than {per_runner}"
    return None


def learner_seq(algo: Any) -> int:
    """The learner's weights sequence number (one more per update)."""
    state = algo.learner_group.get_state(not_components=[f"{LEARNER}/{c}" for c in (RL_MODULE, OPTIMIZER, METRICS)])
    return int(state[LEARNER].get(WEIGHTS_SEQ_NO, 0) or 0)


def push_weights(algo: Any, *, rolled_back: bool = False, runners: dict | None = None) -> None:
    """Send every EnvRunner the learner's (restored) weights and sequence number, and its own sampling state
    (``runners``: worker index -> state, from the ``env_runners`` component), in one call each.

    An EnvRunner takes weights only when they come without a sequence number or with one ahead of its own;
    the ``module-*`` parts load into the learner only and the ``learner`` part restores the sequence number, so
    the weights go out here, once every part is loaded, with the learner's number (ahead of a fresh EnvRunner's
    0). As RLlib's own ``restore_from_path`` does, the call is not awaited (sent and awaited when an EnvRunner
    still has a call in flight, which RLlib would drop): an actor runs one caller's calls in order, so every
    EnvRunner holds the weights and its state before it runs anything the driver asks next (the first
    ``train()``'s sampling); the driver's own EnvRunner has them on return. The weights are views of the
    learner's (one copy, into the object store), not ``get_state``'s copy. ``rolled_back`` (the learner was
    ahead of the snapshot): first without a number, which every EnvRunner takes, then with it, awaited.
    """
    import ray

    learner = local_learner(algo)
    if learner is not None:
        weights = {mid: module_weights(learner, mid, inference_only=True) for mid in learner.module.keys()}
        seq = learner_seq(algo)
    else:
        state = algo.learner_group.get_state(components=f"{LEARNER}/{RL_MODULE}", inference_only=True)[LEARNER]
        weights, seq = state[RL_MODULE], state.get(WEIGHTS_SEQ_NO, 0)
    state = {RL_MODULE: weights, WEIGHTS_SEQ_NO: seq}
    training = algo.env_runner_group
    for group in (training, getattr(algo, "eval_env_runner_group", None)):
        if group is None:
            continue
        mine = runners if group is training else None  # the evaluation EnvRunners' indices are their own
        payload = {"weights": state, "unnumbered": rolled_back, "runners": mine}
        if group.num_remote_env_runners():
            take = functools.partial(take_restored, ray.put(payload))
            if rolled_back:
                group.foreach_env_runner(take, local_env_runner=False)
            else:
                group.fetch_ready_async_reqs(tags=RESTORE_TAG, timeout_seconds=0)  # the slots of calls already done
                if group.foreach_env_runner_async(take, RESTORE_TAG) < group.num_healthy_remote_workers():
                    # An EnvRunner still runs an earlier call (RLlib allows one in flight and drops the next): this
                    # one is not sent to it, so send it to every EnvRunner and wait (taking it twice is harmless).
                    group.foreach_env_runner(take, local_env_runner=False)
        if group.local_env_runner is not None:
            take_restored(payload, group.local_env_runner)


class CheckpointCallback(RLlibCallback):
    """Saves the Algorithm every N iterations (or T seconds) in the background; restores it when it is built.

    Build the class with :func:`checkpoint_callback` (RLlib instantiates callbacks without arguments, on the
    driver and on every EnvRunner; only the driver's ``on_algorithm_init`` opens the engine).
    """

    settings: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.engine = None
        self.scheduler = None
        self.restored = None
        self.restore_seconds: float | None = None
        self.blocked: list[float] = []  # seconds train() was held by each save started (staging)
        self.metric_keys: tuple[str, ...] = tuple(self.settings.get("metrics", DEFAULT_METRICS))

    def on_algorithm_init(self, *, algorithm: Any, **kwargs: Any) -> None:
        from rl_ckpt._core.engine import CheckpointEngine

        s = self.settings
        self.engine = CheckpointEngine(dict(s["config"]), train_config=recorded_config(algorithm))
        register_algorithm(self.engine, algorithm, rng=s.get("rng", True), env_runners=s.get("env_runners", True))
        if s.get("resume", True):
            started = time.perf_counter()
            self.restored = restore_algorithm(algorithm, self.engine, out=print if s.get("verbose", True) else None)
            self.restore_seconds = time.perf_counter() - started
        self.scheduler = self.engine.scheduler(start_step=int(algorithm.training_iteration))
        atexit.register(self.close)  # a save in flight finishes before a normal exit

    def on_train_result(self, *, algorithm: Any, result: dict, **kwargs: Any) -> None:
        if self.scheduler is None:
            return
        started = time.perf_counter()
        if self.scheduler.step(int(algorithm.training_iteration), train_metrics(result, self.metric_keys)) is not None:
            self.blocked.append(time.perf_counter() - started)

    def close(self) -> None:
        """Wait for the save in flight (its error is reported through the scheduler) and close the engine."""
        if self.scheduler is not None:
            self.scheduler.close()
            self.scheduler = None
            self.engine.close()  # snapshots() still lists what was committed


def checkpoint_callback(
    *,
    resume: bool = True,
    rng: bool = True,
    env_runners: bool = True,
    verbose: bool = True,
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    **config: Any,
) -> type:
    """A ``CheckpointCallback`` class for ``config.callbacks(...)``.

    Args:
        resume: restore the chosen snapshot when the Algorithm is built (a re-run script resumes).
        rng: also save the driver's random streams.
        env_runners: also save the EnvRunners' sampling state (environments, episodes, random streams) for an
            exact resume; where it cannot be captured the snapshot says why.
        verbose: print the recovery plan.
        metrics: result keys recorded with each snapshot (keep-best ranks by ``best_metric``).
        **config: rl_ckpt config keys (``base_dir``, ``run_name``, ``save_interval_steps`` in training
            iterations, ``keep_latest``, ``keep_best``, ``dedup``, S3 ``storage_options``...); ``best_metric``
            defaults to ``env_runners/episode_return_mean``.
    """
    config.setdefault("best_metric", BEST_METRIC)
    config.setdefault("best_mode", "max")
    from rl_ckpt.config import CheckpointConfig

    CheckpointConfig.from_dict(config)  # refuse a bad key here, not in the middle of building the Algorithm
    settings = {
        "config": dict(config),
        "resume": resume,
        "rng": rng,
        "env_runners": env_runners,
        "verbose": verbose,
        "metrics": tuple(metrics),
    }
    return type("CheckpointCallback", (CheckpointCallback,), {"settings": settings, "__module__": __name__})


def checkpointing(algo: Any) -> CheckpointCallback:
    """The ``CheckpointCallback`` of ``algo`` (its ``engine``, ``scheduler`` and ``restored``)."""
    callbacks = algo.callbacks if isinstance(algo.callbacks, list) else [algo.callbacks]
    for cb in callbacks:
        if isinstance(cb, CheckpointCallback):
            return cb
    raise ConfigError(
        "this Algorithm has no rl_ckpt CheckpointCallback: add config.callbacks(checkpoint_callback(...))",
        key="callbacks",
    )


def recorded_config(algo: Any) -> dict:
    """The Algorithm's plain-valued settings, recorded in every manifest and compared on restore."""
    try:
        items = algo.config.to_dict().items()
    except Exception as exc:  # a config RLlib itself cannot flatten: record the class only
        log.debug("RLlib config not recorded: %s", exc)
        items = ()
    plain = {
        k: v
        for k, v in items
        if isinstance(v, (str, int, float, bool))
        and not str(k).startswith("_")
        and not (isinstance(v, float) and not math.isfinite(v))
    }
    plain["algorithm_class"] = type(algo).__name__
    return plain
