"""The parts of an RLlib ``Algorithm``'s state, each an rl_ckpt component, and how a restore reaches the EnvRunners.

``algorithm_parts`` splits ``Algorithm.get_state()`` (module weights per policy, optimizer, learner counters and
the learner state RLlib's ``get_state`` leaves out, the Algorithm's own state, progress); :class:`RunnersPart` is
the EnvRunners' sampling state (``_rllib_runners.py``); how a restore then reaches the EnvRunners is
``_rllib_sync.py``. The public front is ``rl_ckpt.integrations.rllib``.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable

import numpy as np

from rl_ckpt.components import RNGState
from rl_ckpt.integrations._rllib_runners import arm, capture, capture_and_arm
from rl_ckpt.integrations._rllib_state import from_stored, learner_value, module_weights, optimizer_state, to_storable

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
SYNC_TAG = "set_state"  # RLlib's broadcast of the connector states after each iteration
EXTRAS = "rl_ckpt:extras"  # learner state RLlib's get_state leaves out (learner_extras)
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
        # Counters and metrics (hundreds of small values) are copied at the call and encoded by the save's
        # writer, off the training thread; weights and optimizer moments are staged from views of the learner's.
        self.checkpoint_detached_state = kind in ("other", "progress")
        self._get, self._put = get, put
        self.what = what
        self.name = name  # the component name, for errors

    def state_dict(self) -> dict:
        return to_storable(self._get(self.algo), component=self.name, detach=self.checkpoint_detached_state)

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
        live = live_tensors(a)
        if live is not None and weights.keys() == live.keys() and all(_in_place(weights[k], live[k]) for k in live):
            return  # the restore read every weight straight into the module's own tensors: nothing to copy
        # Into the learner only: ``Algorithm.set_state`` would also sync the weights to the EnvRunners (a copy of
        # every weight and a send per module) which they ignore (see ``push_weights``); ``restore_algorithm``
        # sends them once, after every part is loaded.
        a.learner_group.set_state({LEARNER: {RL_MODULE: {mid: weights}}})

    def live_tensors(a: Any = algo) -> dict | None:
        """The module's own tensors by name, when its state is exactly them and RLlib's ``set_state`` would only
        copy a weight into each (a torch RLModule of the learner in this process, keeping RLlib's get_state and
        set_state): the restore reads the stored weights straight into them (``_core.reader.own_slots``)."""
        from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

        learner = local_learner(a)
        module = learner.module[mid] if learner is not None and mid in learner.module.keys() else None
        if (
            not isinstance(module, TorchRLModule)
            or type(module).get_state is not TorchRLModule.get_state
            or type(module).set_state is not TorchRLModule.set_state
        ):
            return None
        return module.state_dict()

    part = AlgorithmPart(algo, "module", get, put, f"RLModule {mid!r}")
    # RLlib's module set_state copies every weight into the module's parameters (torch's load_state_dict): the
    # reader may hand it views of the bytes it read, without a copy of its own.
    part.copies_on_load = True
    part.live_tensors = live_tensors
    return part


def _in_place(value: Any, tensor: Any) -> bool:
    """Whether ``value`` (a tensor, or the NumPy array RLlib's weights are stored as, decoded as a view of the
    stored tensor) is ``tensor``'s very memory (the restore read into it), not a copy of its bytes."""
    import torch

    if isinstance(value, np.ndarray) and value.flags.c_contiguous:
        try:
            value = torch.from_numpy(value)  # a view: the same memory
        except (TypeError, ValueError):
            return False
    return (
        isinstance(value, torch.Tensor)
        and value.data_ptr() == tensor.data_ptr()
        and value.shape == tensor.shape
        and value.dtype == tensor.dtype
        and value.stride() == tensor.stride()
    )


def _algorithm_put(a: Any, state: dict) -> None:
    """The metrics first (the EnvRunners' sampled-steps counter is taken from them), then the driver's connector
    states, then the rest through ``Algorithm.set_state``.

    ``Algorithm.set_state`` would sync the connector states to the remote EnvRunners: it asks each for its own
    and waits (a round trip on the restore's critical path), merges theirs into the restored ones (what they
    gathered since their last sync, none of the snapshot's) and sends the result. Here the driver's own
    (EnvRunner or connectors) take the restored states as they are, and ``push_weights`` sends them to the
    remote EnvRunners with the weights, in the one call each gets anyway. An Algorithm class with a
    ``set_state`` of its own gets the whole state through it."""
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.core import COMPONENT_ENV_RUNNER

    if METRICS in state:
        a.set_state({METRICS: state[METRICS]})
    rest = {k: v for k, v in state.items() if k != METRICS}
    if COMPONENT_ENV_RUNNER in rest and type(a).set_state is Algorithm.set_state:
        from rl_ckpt.integrations._rllib_sync import driver_connectors_put

        driver_connectors_put(a, rest.pop(COMPONENT_ENV_RUNNER))
    if rest:
        a.set_state(rest)


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


def _optimizer_live(a: Any) -> dict | None:
    """The learner's optimizer state as stored (``optimizer_state``'s structure) holding the optimizers' own state
    tensors, when RLlib's restore of it is torch's ``load_state_dict`` (a torch Learner of this process keeping
    RLlib's ``set_state``): the restore reads the stored moments straight into them (``_core.reader.own_slots``),
    and ``load_state_dict`` then keeps the very memory it is given (same dtype and device: no copy)."""
    from ray.rllib.core import ALL_MODULES
    from ray.rllib.core.learner.learner import Learner
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    learner = local_learner(a)
    if (
        not isinstance(learner, TorchLearner)
        or type(learner).get_state is not Learner.get_state
        or type(learner).set_state is not Learner.set_state
        or type(learner)._set_optimizer_state is not TorchLearner._set_optimizer_state
    ):
        return None
    out = {}
    for mid in [*learner.module.keys(), ALL_MODULES]:
        for name, optim in learner.get_optimizers_for_module(mid):
            out[f"{mid}_{name}"] = {"module_id": mid, "state": optim.state_dict()}
    return out


def _learner_get(a: Any) -> dict:
    state = a.learner_group.get_state(components=f"{LEARNER}/{METRICS}")[LEARNER]
    out = {k: learner_value(k, v) for k, v in state.items()}
    extras = _first(a.learner_group.foreach_learner(learner_extras))
    if extras:
        out[EXTRAS] = {**extras, "timestep": lifetime_steps(a)}
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


def lifetime_steps(a: Any) -> int:
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
    parts[OPTIMIZER].live_tensors = functools.partial(_optimizer_live, algo)
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


class DriverRNG(RNGState):
    """The driver's random streams (``RNGState``), Python's as one array: its 625 numbers are 625 JSON nodes to
    encode at every save and decode at every restore. A snapshot holding them as a list loads too."""

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["python"]["internal"] = np.array(state["python"]["internal"], dtype=np.uint64)
        return state

    def load_state_dict(self, state: dict) -> None:
        internal = state["python"]["internal"]
        if isinstance(internal, np.ndarray):
            state = {**state, "python": {**state["python"], "internal": internal.tolist()}}
        super().load_state_dict(state)


def ask_runners(group: Any, ids: list[int], fn: Callable[[Any], Any]) -> dict[int, Any]:
    """``fn`` sent to the remote EnvRunners ``ids`` of ``group`` through their actor handles: worker id -> the
    ObjectRef of its answer. Outside RLlib's request bookkeeping (whose fetches cost the training thread a
    ``ray.wait`` and are not thread-safe); an actor runs one caller's calls in order, so each runs ``fn`` before
    anything the driver asks it next."""
    actors = group._worker_manager.actors()  # (RLlib's handles, by worker id)
    return {i: actors[i].apply.remote(fn) for i in ids if i in actors}


class RunnersPart:
    """The ``env_runners`` component: every training EnvRunner's sampling state (``_rllib_runners.py``), by
    worker index; ``exact`` False with why when any cannot be captured (then none is kept).

    The EnvRunners encode their state themselves; the driver stores what they send as it is. A save that is
    due asks them first (:meth:`prefetch`, not awaited) so that they capture while the driver takes the rest
    of the state; a background save collects their answers on its writer (:meth:`state_dict_later`), not on
    the training thread. The requests go to the EnvRunner actors directly (an actor runs one caller's calls in
    order: each captures before the next sampling the driver asks for), outside RLlib's request bookkeeping,
    which would have to be fetched on the training thread. The restored state waits in ``pending`` for
    ``restore_algorithm``, which sends each EnvRunner its own with the weights, in one call.
    """

    checkpoint_kind = "other"
    checkpoint_detached_state = True  # what the EnvRunners sent, nobody else's: collected and encoded by the writer

    def __init__(self, algo: Any) -> None:
        self.algo = algo
        self.pending: dict | None = None
        self._asked: dict[int, Any] = {}  # worker id -> the ObjectRef of its capture, asked by prefetch
        self._capture: Callable[[Any], dict] = capture  # ``capture_and_arm`` when the next iteration saves too
        self.armed_ahead = False  # the EnvRunners asked for this save's state were armed for the next one too

    def prefetch(self, arm_next: bool = False) -> None:
        """Ask every healthy remote EnvRunner for its state now, without waiting; collected by the save.
        ``arm_next``: the iteration after this one saves too: the same call arms them for it (:meth:`arm`).
        Not asked while other requests are in flight (asynchronous sampling: that save is not exact)."""
        self._capture, self.armed_ahead = (capture_and_arm if arm_next else capture), False
        group = self.algo.env_runner_group
        if self._asked or not group.num_remote_env_runners() or self._others_in_flight():
            return
        self._asked = ask_runners(group, group.healthy_env_runner_ids(), self._capture)
        self.armed_ahead = arm_next

    def _others_in_flight(self) -> int:
        """Requests RLlib has in flight to the EnvRunners other than its connector broadcast (sampling)."""
        group = self.algo.env_runner_group
        return group.num_in_flight_async_reqs() - group.num_in_flight_async_reqs(SYNC_TAG)

    def arm(self) -> None:
        """The next iteration saves: every remote EnvRunner takes its state at the end of its sampling and encodes
        it while the driver learns (``_rllib_runners.sample_ended``; sent, not awaited)."""
        group = self.algo.env_runner_group
        if group.num_remote_env_runners():
            ask_runners(group, group.healthy_env_runner_ids(), arm)

    def discard(self) -> None:
        """Drop what :meth:`prefetch` asked for when no save used it (the EnvRunners still answer, unread)."""
        self._capture, self._asked = capture, {}

    def state_dict(self) -> dict:
        """Every training EnvRunner's capture (the remote ones, or the driver's own when there are none)."""
        return self._collect(*self._take())

    def state_dict_later(self) -> Callable[[], dict]:
        """The state as of this call, collected when the returned function is called (on a save's writer): every
        EnvRunner has been asked by now, and answers before it samples again."""
        return functools.partial(self._collect, *self._take())

    def load_state_dict(self, state: dict) -> None:
        self.pending = from_stored(state, component=ENV_RUNNERS)

    def _take(self) -> tuple[list[str], dict[int, Any], list[dict], int]:
        """On the training thread: why not exact so far, the requests (every healthy EnvRunner asked by now),
        the driver's own capture when there are no remote EnvRunners, and how many are expected."""
        algo, group = self.algo, self.algo.env_runner_group
        expected, whys, local = group.num_remote_env_runners(), [], []
        ask, self._capture = self._capture, capture  # (a save without prefetch arms nothing)
        asked, self._asked = self._asked, {}
        if expected and self._others_in_flight():
            whys.append("the EnvRunners had sampling requests in flight at the save (asynchronous sampling)")
        missing = [i for i in group.healthy_env_runner_ids() if i not in asked] if expected else []
        if missing:  # not asked ahead (no prefetch, or RLlib had requests in flight): ask now
            asked.update(ask_runners(group, missing, ask))
            self.armed_ahead = ask is capture_and_arm
        elif not expected and algo.env_runner is not None:
            local = [capture(algo.env_runner)]
        return whys, asked, local, expected

    @staticmethod
    def _collect(whys: list[str], asked: dict[int, Any], local: list[dict], expected: int) -> dict:
        """The EnvRunners' answers (waited for), as the stored tree; any thread."""
        import ray

        states = list(local)
        for ref in asked.values():
            try:
                states.append(ray.get(ref))
            except ray.exceptions.RayError:  # died since: counted as not answering
                pass
        whys = whys + [f"EnvRunner {s['worker_index']}: {s['why']}" for s in states if not s["exact"]]
        if expected and len(states) < expected:
            whys.append(f"{expected - len(states)} of {expected} EnvRunners did not answer (unhealthy)")
        if not states:
            whys.append("no EnvRunner samples")
        if whys:
            tree = {"exact": False, "why": "; ".join(whys), "runners": {}}
        else:
            tree = {"exact": True, "why": None, "runners": {str(s["worker_index"]): s for s in states}}
        return to_storable(tree, component=ENV_RUNNERS)  # (new containers; the answers are this save's own)

    def __repr__(self) -> str:
        return "RunnersPart(EnvRunner environments, episodes, random streams)"
