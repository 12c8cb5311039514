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
algorithm's metrics), ``progress`` (the training iteration) and ``rng`` (the
driver's random streams: the local learner shuffles minibatches with them).
Arrays go to safetensors, the rest to JSON; nothing is pickled. A value the
state codec cannot store is refused at save, naming the component and key.
Two explicit conversion rules (``to_storable`` / ``from_stored``): a ``None``
dict key (RLlib's single-agent id, e.g. in ``MeanStdFilter``'s state) is stored
as the key ``"rl_ckpt:None"`` and turned back on load; a ``set`` of trainable
policy ids is stored as a sorted list (RLlib accepts either).

Each part is restored through RLlib's ``set_state`` (the learner group's for
the learner's parts, the Algorithm's for the rest, which syncs the restored
connector states to the EnvRunners as RLlib does for its own checkpoints);
``restore_algorithm`` then sends the restored weights to every EnvRunner once
(``push_weights``), as RLlib's ``restore_from_path`` does.

What no RLlib checkpoint holds (RLlib's own or this one): the environments'
in-flight episodes and the EnvRunner processes' random streams. A resumed run
samples fresh episodes, so it equals an uninterrupted run right after the
restore, not after further iterations (docs/rllib.md).
"""

from __future__ import annotations

import atexit
import logging
import math
import re
import time
from typing import Any, Callable, Mapping

from ray.rllib.callbacks.callbacks import RLlibCallback

from rl_ckpt.components import RNGState
from rl_ckpt.errors import ConfigError, SerializationError

log = logging.getLogger("rl_ckpt")

LEARNER_GROUP, LEARNER, RL_MODULE, OPTIMIZER, METRICS = (
    "learner_group",
    "learner",
    "rl_module",
    "optimizer",
    "metrics_logger",
)
TRAINING_ITERATION, WEIGHTS_SEQ_NO = "training_iteration", "weights_seq_no"
NONE_KEY = "rl_ckpt:None"
BEST_METRIC = "env_runners/episode_return_mean"
DEFAULT_METRICS = (BEST_METRIC, "env_runners/num_env_steps_sampled_lifetime", "env_runners/episode_len_mean")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class AlgorithmPart:
    """One part of an ``Algorithm``'s state as an rl_ckpt ``Checkpointable``.

    ``get(algo)`` returns the part's state (what ``Algorithm.get_state`` holds
    for it); ``put(algo, state)`` sets it through RLlib's ``set_state``.
    """

    def __init__(
        self, algo: Any, kind: str, get: Callable[[Any], dict], put: Callable[[Any, dict], None], what: str
    ) -> None:
        self.algo = algo
        self.checkpoint_kind = kind
        self._get, self._put = get, put
        self.what = what

    def state_dict(self) -> dict:
        return to_storable(self._get(self.algo))

    def load_state_dict(self, state: dict) -> None:
        self._put(self.algo, from_stored(state))

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


def local_learner(algo: Any) -> Any:
    """The Learner itself when it runs in this process (RLlib's default ``num_learners=0``), else None."""
    group = algo.learner_group
    if not group.is_local:
        return None
    return next(iter(group.foreach_learner(lambda learner: learner))).get()


def plain_arrays(tree: Any) -> Any:
    """RLlib's ``convert_to_numpy`` without its copy: the same values (0-d tensors as Python numbers, other
    floats as float32 and the integers it narrows as int32, converted as it converts them), but an array
    already of that dtype is a view of the live tensor, not a copy. For a caller that copies what it keeps
    (staging, ``ray.put``) before training changes the tensors again."""
    import numpy as np
    import torch
    import tree as dm_tree

    def leaf(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            item = item.cpu().item() if item.dim() == 0 else item.detach().cpu().numpy()
        if isinstance(item, np.ndarray):
            if np.issubdtype(item.dtype, np.floating):
                return item if item.dtype == np.float32 else item.astype(np.float32)
            if np.issubdtype(item.dtype, int):
                return item if item.dtype == np.int32 else item.astype(np.int32)
        return item

    return dm_tree.map_structure(leaf, tree)


def module_weights(learner: Any, mid: str, *, inference_only: bool = False) -> dict:
    """What ``learner.module[mid].get_state(inference_only=...)`` returns, as views of the live weights
    (:func:`plain_arrays`) for a torch RLModule that keeps RLlib's ``get_state``; any other module's own."""
    from ray.rllib.core.rl_module.apis import InferenceOnlyAPI
    from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

    module = learner.module[mid]
    if type(module).get_state is not TorchRLModule.get_state:
        return module.get_state(inference_only=inference_only)
    state = module.state_dict()
    if inference_only and not module.inference_only and isinstance(module, InferenceOnlyAPI):
        drop = module.get_non_inference_attributes()
        state = {
            k: v
            for k, v in state.items()
            if not any(k.startswith(a) and (len(k) == len(a) or k[len(a)] == ".") for a in drop)
        }
    return plain_arrays(state)


def optimizer_state(learner: Any) -> dict | None:
    """The learner's optimizer state as ``get_state`` gives it (``{<module id>_<name>: {"module_id", "state"}}``),
    as views of the live moments (:func:`plain_arrays`); None for a Learner that is not RLlib's torch one with
    its own ``get_state`` (its state then comes from ``get_state``)."""
    from ray.rllib.core import ALL_MODULES
    from ray.rllib.core.learner.learner import Learner
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    if not isinstance(learner, TorchLearner) or type(learner).get_state is not Learner.get_state:
        return None
    out = {}
    for mid in [*learner.module.keys(), ALL_MODULES]:
        for name, optim in learner.get_optimizers_for_module(mid):
            out[f"{mid}_{name}"] = {"module_id": mid, "state": plain_arrays(optim.state_dict())}
    return out


def _optimizer_get(a: Any) -> dict:
    learner = local_learner(a)
    state = optimizer_state(learner) if learner is not None else None
    if state is None:
        state = a.learner_group.get_state(components=f"{LEARNER}/{OPTIMIZER}")[LEARNER][OPTIMIZER]
    return state


def _learner_get(a: Any) -> dict:
    state = a.learner_group.get_state(components=f"{LEARNER}/{METRICS}")[LEARNER]
    return {k: learner_value(k, v) for k, v in state.items()}


def learner_value(key: str, value: Any) -> Any:
    """Trainable policy ids given as a set are stored as a sorted list (RLlib's ``policies_to_train`` takes either)."""
    if key == "should_module_be_updated" and isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return value


def to_storable(tree: Any, path: str = "") -> Any:
    """``tree`` with every ``None`` dict key renamed ``NONE_KEY`` (the state codec stores str and int keys only).

    Raises:
        SerializationError: a dict holds both ``None`` and ``NONE_KEY`` as keys (naming the key path).
    """
    if isinstance(tree, dict):
        if None in tree and NONE_KEY in tree:
            raise SerializationError(
                f"RLlib state key {path or '<root>'!r} holds both None and {NONE_KEY!r} as "
                "keys: rl_ckpt stores a None key under that name; rename the other",
                key=path or "<root>",
            )
        return {NONE_KEY if k is None else k: to_storable(v, f"{path}/{k}") for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_storable(v, f"{path}/{i}") for i, v in enumerate(tree)]
    return tree


def from_stored(tree: Any) -> Any:
    """The inverse of :func:`to_storable`."""
    if isinstance(tree, dict):
        return {None if k == NONE_KEY else k: from_stored(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [from_stored(v) for v in tree]
    return tree


def algorithm_parts(algo: Any) -> dict[str, AlgorithmPart]:
    """Component name -> part, covering everything ``algo.get_state()`` holds."""
    parts = {name: _module_part(algo, mid) for mid, name in component_names(module_ids(algo)).items()}
    parts[OPTIMIZER] = AlgorithmPart(
        algo,
        "optimizer",
        _optimizer_get,
        lambda a, s: a.learner_group.set_state({LEARNER: {OPTIMIZER: s}}),
        "learner optimizer state",
    )
    parts[LEARNER] = AlgorithmPart(
        algo,
        "other",
        _learner_get,
        lambda a, s: a.learner_group.set_state({LEARNER: s}),
        "learner counters and metrics",
    )
    parts["algorithm"] = AlgorithmPart(
        algo,
        "other",
        lambda a: {k: v for k, v in a.get_state(not_components=[LEARNER_GROUP]).items() if k != TRAINING_ITERATION},
        lambda a, s: a.set_state(s),
        "env-runner connector states, counters, metrics",
    )
    parts["progress"] = AlgorithmPart(
        algo,
        "progress",
        lambda a: {TRAINING_ITERATION: int(a.training_iteration)},
        lambda a, s: a.set_state({TRAINING_ITERATION: int(s[TRAINING_ITERATION])}),
        "training iteration",
    )
    return parts


def register_algorithm(engine: Any, algo: Any, *, rng: bool = True) -> dict[str, AlgorithmPart]:
    """Register every part of ``algo``'s state with ``engine`` (plus the driver's ``RNGState`` when ``rng``)."""
    if not getattr(algo.config, "enable_env_runner_and_connector_v2", False):
        raise ConfigError(
            "rl_ckpt saves RLlib's new API stack (Algorithm.get_state); this Algorithm runs the old "
            "one: set config.api_stack(enable_rl_module_and_learner=True, "
            "enable_env_runner_and_connector_v2=True)",
            key="api_stack",
        )
    parts = algorithm_parts(algo)
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
    (checksum, decoding) is skipped for the plan's next fallback; ``result.skipped`` says why.
    """
    plan = engine.plan_recovery(failure, deep=deep)
    if out is not None:
        out(str(plan))
    before = learner_seq(algo)
    result = engine.restore(plan)
    if not result.fresh:
        push_weights(algo, rolled_back=before > learner_seq(algo))
    if out is not None:
        for sid, why in result.skipped.items():
            out(f"  fell back: {sid} not used: {why}")
        if not result.fresh:
            out(f"  restored {result.snapshot_id}: continuing after iteration {result.global_step}")
    return result


def learner_seq(algo: Any) -> int:
    """The learner's weights sequence number (one more per update)."""
    state = algo.learner_group.get_state(not_components=[f"{LEARNER}/{c}" for c in (RL_MODULE, OPTIMIZER, METRICS)])
    return int(state[LEARNER].get(WEIGHTS_SEQ_NO, 0) or 0)


def push_weights(algo: Any, *, rolled_back: bool = False) -> None:
    """Send every EnvRunner the learner's (restored) weights and sequence number, once.

    An EnvRunner takes weights only when they come without a sequence number or with one ahead of its own;
    the ``module-*`` parts load into the learner only and the ``learner`` part restores the sequence number, so
    the weights go out here, once every part is loaded, with the learner's number (ahead of a fresh EnvRunner's
    0). As RLlib's own ``restore_from_path`` does, the send is not awaited (``sync_weights``' call and tag; sent
    and awaited when an EnvRunner still has a call in flight, which RLlib would drop): an actor runs one
    caller's calls in order, so every EnvRunner holds the weights before it runs anything the
    driver asks next (the first ``train()``'s sampling, a ``get_state``); the driver's own EnvRunner has them
    on return. The weights are views of the learner's (one copy, into the object store), not ``get_state``'s
    copy. ``rolled_back`` (the learner was ahead of the snapshot): first without a number, which every
    EnvRunner takes, then with it, waiting for both (two calls; RLlib allows one in flight per EnvRunner).
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
    ref = ray.put(state)

    def take(runner: Any) -> None:
        sent = ray.get(ref)
        runner.set_state({RL_MODULE: sent[RL_MODULE]})
        runner.set_state(sent)

    for group in (algo.env_runner_group, getattr(algo, "eval_env_runner_group", None)):
        if group is None:
            continue
        if rolled_back:
            group.foreach_env_runner(take, local_env_runner=True)
            continue
        group.fetch_ready_async_reqs(tags="set_state", timeout_seconds=0)  # the slots of calls already done
        sent = group.foreach_env_runner_async("set_state", "set_state", kwargs={"state": ref})
        if sent < group.num_healthy_remote_workers():
            # An EnvRunner still runs an earlier call (RLlib allows one in flight and drops the next): this
            # one is not sent to it, so send it to every EnvRunner and wait.
            group.foreach_env_runner(lambda runner: runner.set_state(ray.get(ref)), local_env_runner=False)
        if group.local_env_runner is not None:
            group.local_env_runner.set_state(state)


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
        register_algorithm(self.engine, algorithm, rng=s.get("rng", True))
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
    verbose: bool = True,
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    **config: Any,
) -> type:
    """A ``CheckpointCallback`` class for ``config.callbacks(...)``.

    Args:
        resume: restore the chosen snapshot when the Algorithm is built (a re-run script resumes).
        rng: also save the driver's random streams.
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
    settings = {"config": dict(config), "resume": resume, "rng": rng, "verbose": verbose, "metrics": tuple(metrics)}
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
