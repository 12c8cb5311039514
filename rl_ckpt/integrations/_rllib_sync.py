"""How a restore reaches the EnvRunners: the driver's connectors take the restored states (without RLlib's sync to
the remote EnvRunners), and :func:`push_weights` sends every EnvRunner the restored connector states, the weights
and its own sampling state, in one call each; :func:`runners_note` says why they do not resume exactly."""

from __future__ import annotations

import functools
from typing import Any

from rl_ckpt.integrations._rllib_parts import (
    LEARNER,
    METRICS,
    OPTIMIZER,
    RL_MODULE,
    WEIGHTS_SEQ_NO,
    lifetime_steps,
    ask_runners,
    local_learner,
)
from rl_ckpt.integrations._rllib_runners import take_restored
from rl_ckpt.integrations._rllib_state import module_weights


def driver_connectors_put(a: Any, runner_state: dict) -> None:
    """What ``Algorithm.set_state`` does with the ``env_runner`` state in this process, without its sync to the
    remote EnvRunners (``push_weights`` sends them :func:`connector_states`)."""
    from ray.rllib.core import COMPONENT_ENV_TO_MODULE_CONNECTOR, COMPONENT_MODULE_TO_ENV_CONNECTOR
    from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

    if a.env_runner is not None:
        a.env_runner.set_state(runner_state)
        a.env_runner.set_state({NUM_ENV_STEPS_SAMPLED_LIFETIME: lifetime_steps(a)})  # (as RLlib's sync sets it)
    else:
        a.env_to_module_connector.set_state(runner_state[COMPONENT_ENV_TO_MODULE_CONNECTOR])
        a.module_to_env_connector.set_state(runner_state[COMPONENT_MODULE_TO_ENV_CONNECTOR])


def connector_states(algo: Any) -> dict:
    """What RLlib's sync sends the remote training EnvRunners after a restore, without merging in their own: the
    driver's (restored) connector states and the sampled-steps counter; nothing when the config does not
    broadcast them (``broadcast_env_runner_states=False``)."""
    from ray.rllib.core import COMPONENT_ENV_TO_MODULE_CONNECTOR, COMPONENT_MODULE_TO_ENV_CONNECTOR
    from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

    if not algo.config.broadcast_env_runner_states:
        return {}
    names = [COMPONENT_ENV_TO_MODULE_CONNECTOR, COMPONENT_MODULE_TO_ENV_CONNECTOR]
    if algo.env_runner is not None:
        out = algo.env_runner.get_state(components=names)
    else:
        out = {names[0]: algo.env_to_module_connector.get_state(), names[1]: algo.module_to_env_connector.get_state()}
    return {**out, NUM_ENV_STEPS_SAMPLED_LIFETIME: lifetime_steps(algo)}


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
    wrong = [k for k, s in pending["runners"].items() if s.get("num_envs") != per_runner]
    if wrong:
        return f"EnvRunners not exact: EnvRunner {wrong[0]} held another number of environments than {per_runner}"
    return None


def learner_seq(algo: Any) -> int:
    """The learner's weights sequence number (one more per update)."""
    state = algo.learner_group.get_state(not_components=[f"{LEARNER}/{c}" for c in (RL_MODULE, OPTIMIZER, METRICS)])
    return int(state[LEARNER].get(WEIGHTS_SEQ_NO, 0) or 0)


def push_weights(algo: Any, *, rolled_back: bool = False, runners: dict | None = None) -> list[str]:
    """Send every EnvRunner the learner's (restored) weights and sequence number, and its own sampling state
    (``runners``: worker index -> state, from the ``env_runners`` component), in one call each; the remote
    training EnvRunners also get the driver's restored connector states (:func:`connector_states`).

    An EnvRunner takes weights only when they come without a sequence number or with one ahead of its own;
    the ``module-*`` parts load into the learner only and the ``learner`` part restores the sequence number, so
    the weights go out here, once every part is loaded, with the learner's number (ahead of a fresh EnvRunner's
    0). As RLlib's own weight sync (``restore_from_path``'s too), the call is sent and not awaited, outside the
    one-request-in-flight slots RLlib keeps per EnvRunner (its connector broadcast, which the restore started,
    may still hold them): an actor runs one caller's calls in order, so every EnvRunner holds the weights and
    its state before it runs anything the driver asks next (the first ``train()``'s sampling); the driver's own
    EnvRunner has them on return. An EnvRunner that cannot take its sampling state keeps none of it and logs
    why. The weights are views of the learner's (one copy, into the object store), not ``get_state``'s copy.
    ``rolled_back`` (the learner was ahead of the snapshot): first without a number, which every EnvRunner
    takes, then with it, awaited. Returns why an EnvRunner did not take its sampling state, from the calls that
    were awaited.
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
    training, notes = algo.env_runner_group, []
    for group in (training, getattr(algo, "eval_env_runner_group", None)):
        if group is None:
            continue
        mine = runners if group is training else None  # the evaluation EnvRunners' indices are their own
        payload = {"weights": state, "unnumbered": rolled_back, "runners": mine}
        if group.num_remote_env_runners():
            if group is training:
                payload["connectors"] = connector_states(algo)
            take = functools.partial(take_restored, ray.put(payload))
            if rolled_back:
                notes += group.foreach_env_runner(take, local_env_runner=False, timeout_seconds=None)
            else:
                ask_runners(group, group.healthy_env_runner_ids(), take)  # (answers unread: not awaited)
        if group.local_env_runner is not None:
            notes.append(take_restored(payload, group.local_env_runner))
    return [note for note in notes if note]
