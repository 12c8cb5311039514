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
import logging
import math
import time
from typing import Any, Callable, Mapping

from ray.rllib.callbacks.callbacks import RLlibCallback

from rl_ckpt.errors import ConfigError
from rl_ckpt.integrations._rllib_parts import (  # noqa: F401 - the names below are public here too
    ENV_RUNNERS,
    LEARNER,
    LEARNER_GROUP,
    METRICS,
    OPTIMIZER,
    RL_MODULE,
    TRAINING_ITERATION,
    WEIGHTS_SEQ_NO,
    AlgorithmPart,
    DriverRNG,
    RunnersPart,
    algorithm_parts,
    component_names,
    learner_extras,
    local_learner,
    module_ids,
)
from rl_ckpt.integrations._rllib_sync import learner_seq, push_weights, runners_note
from rl_ckpt.integrations._rllib_runners import sample_ended
from rl_ckpt.integrations._rllib_state import (  # noqa: F401
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

BEST_METRIC = "env_runners/episode_return_mean"
DEFAULT_METRICS = (BEST_METRIC, "env_runners/num_env_steps_sampled_lifetime", "env_runners/episode_len_mean")


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
        engine.register("rng", DriverRNG())
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
        loaded = isinstance(runners, RunnersPart) and ENV_RUNNERS in result.components
        note = runners_note(algo, runners.pending if loaded else None)
        if runners is None:
            note = "EnvRunners not exact: their state is not saved (env_runners=False); they reset their environments"
        missed = push_weights(
            algo, rolled_back=before > learner_seq(algo), runners=None if note else runners.pending["runners"]
        )
        note = note or ("EnvRunners not exact: " + "; ".join(missed) if missed else None)
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


class CheckpointCallback(RLlibCallback):
    """Saves the Algorithm every N iterations (or T seconds) in the background; restores it when it is built.

    Build the class with :func:`checkpoint_callback` (RLlib instantiates callbacks without arguments, on the
    driver and on every EnvRunner; only the driver's ``on_algorithm_init`` opens the engine).
    """

    settings: dict = {}

    def __init__(self) -> None:
        super().__init__()
        # RLlib makes one in each EnvRunner too: its decoders are imported now, not during the first restore.
        import rl_ckpt._format.safetensors_io  # noqa: F401
        import rl_ckpt._format.state_codec  # noqa: F401

        self.engine = None
        self.scheduler = None
        self.restored = None
        self.restore_seconds: float | None = None
        self.blocked: list[float] = []  # seconds train() was held by each save started (staging)
        self._arming = 0.0  # seconds spent arming the EnvRunners for the next save (counted in its blocked)
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
        runners = self.engine.components.get(ENV_RUNNERS)
        self._arm(runners if isinstance(runners, RunnersPart) else None, int(algorithm.training_iteration) + 1)
        atexit.register(self.close)  # a save in flight finishes before a normal exit

    def on_train_result(self, *, algorithm: Any, result: dict, **kwargs: Any) -> None:
        if self.scheduler is None:
            return
        started = time.perf_counter()
        step = int(algorithm.training_iteration)
        runners = self.engine.components.get(ENV_RUNNERS)
        runners = runners if isinstance(runners, RunnersPart) else None
        if runners is not None and self.scheduler.due(step):
            # The EnvRunners send their state while the driver takes the rest; when every iteration saves, the
            # same call arms them for the next one (a second call after the save would wait for the GIL while
            # the save's writer encodes).
            runners.prefetch(arm_next=self.scheduler.saves_every_step)
        handle = self.scheduler.step(step, train_metrics(result, self.metric_keys))
        if runners is not None:
            runners.discard()  # asked for, but no save took it (e.g. the previous save still running)
        if handle is not None:
            self.blocked.append(time.perf_counter() - started + self._arming)
            self._arming = 0.0
        self._arm(runners, step + 1)

    def _arm(self, runners: Any, step: int) -> None:
        """When ``step`` will save, have the EnvRunners take their state as they finish sampling it (its cost
        counts in the next save's ``blocked``), unless the call that took this save's state armed them."""
        if runners is not None and runners.armed_ahead:
            runners.armed_ahead = False
        elif runners is not None and self.scheduler.due(step):
            started = time.perf_counter()
            runners.arm()
            self._arming += time.perf_counter() - started

    def on_sample_end(self, *, env_runner: Any = None, **kwargs: Any) -> None:
        """In each remote EnvRunner: take its state now if the driver armed it (``_rllib_runners.sample_ended``)."""
        if env_runner is not None and env_runner.worker_index:
            sample_ended(env_runner)

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
