"""The sharded GRPO demo's rollout side: plain Ray actors, no process group, sampling with the policy of a
committed snapshot (``rl_ckpt.demo.sharded_grpo`` has the learners and the run).

Before a rollout an actor gets the snapshot's whole policy into an ordinary ``nn.Module``: one
``engine.load_full_weights`` call (the snapshot durable or in memory, ``source`` says where), or, when the
learners publish policy versions, a pull of only the chunks that changed since the version it holds.

An actor holds no state a rollout depends on: ``rollout(source, snapshot_id, step, prompts)`` is a function of
its arguments (the weights of that snapshot, the step's seeded noise per prompt), so a task lost with its actor is
issued again, whole, to Ray's restart of the actor or to a warm standby, and comes back bitwise the same (the
learners' :class:`~actors.rollout_pool.RolloutPool` does it; ``rejoin`` has nothing to take back).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from actors.rollout_pool import ScopedWorker
from rl_ckpt.demo.faults import fires, kill_self, log_event
from rl_ckpt.demo.grpo import GRPOConfig, make_policy, prompt_dataset, sample
from rl_ckpt.demo.ray_tier import spare, standbys_of

log = logging.getLogger("rl_ckpt")


class RolloutActor(ScopedWorker):
    """A Ray actor sampling answers with the policy of a committed snapshot (full weights, no process group).

    Each call names where the snapshot lives (``source``: base_dir, run_name, storage_options: a durable run
    folder or a run's ``raymem://`` memory tier), so one set of actors can serve several runs and both tiers.
    ``index``: it is ``rollout-<index>`` (what faults target); None: a warm standby until ``assume(index)``."""

    def __init__(self, grpo: dict, index: int | None = None) -> None:
        torch.set_num_threads(1)
        self.index = index
        self.cfg = GRPOConfig(**grpo)
        self.model = make_policy(self.cfg).eval()  # its weights all come from the snapshot
        prompt_dataset(self.cfg.seed, self.cfg.dataset_size)  # loaded now: a standby is warm when it takes over
        self.engines: dict[str, Any] = {}
        self.loaded: str | None = None
        self.loads = 0
        self.subs: dict[str, Any] = {}  # versions run -> WeightSubscriber
        self.moved = {"full": 0, "delta": 0, "pulls": 0}

    def _engine(self, source: dict):
        from rl_ckpt import CheckpointEngine

        key = f"{source['base_dir'].rstrip('/')}/{source['run_name']}"
        if key not in self.engines:
            options = source.get("storage_options")
            self.engines[key] = CheckpointEngine(
                base_dir=source["base_dir"],
                run_name=source["run_name"],
                retention=False,
                **({"storage_options": options} if options else {}),
            )
        return self.engines[key]

    @property
    def name(self) -> str:
        return f"rollout-{self.index}"

    def rollout(
        self,
        source: dict,
        snapshot_id: str,
        step: int,
        indices: list[int],
        faults: list[dict] | None = None,
        log_path: str | None = None,
    ) -> dict:
        """Answers to prompts ``indices`` of ``step``, sampled with the policy of ``snapshot_id`` in ``source``.

        ``faults`` (``rl_ckpt.demo.faults``) aimed at this actor and ``step`` strike at their ``moment``: ``"pull"``,
        before it gets the snapshot's weights, or a token index, mid-generation (before that answer token; a fault
        without a moment strikes at the first of these); the kill is logged to ``log_path`` first."""
        if faults:
            self._strike(faults, step, "pull", log_path)
        key = f"{source['base_dir'].rstrip('/')}/{source['run_name']}/{snapshot_id}"
        if key != self.loaded:
            if source.get("versions") and self._pull(source["versions"], snapshot_id):
                pass
            else:
                self._engine(source).load_full_weights("policy", self.model, snapshot_id)
            self.loaded = key
            self.loads += 1
        on_token = (lambda t: self._strike(faults, step, t, log_path)) if faults else None
        out = {k: v.numpy() for k, v in sample(self.model, self.cfg, step, indices, on_token).items()}
        return {**out, "snapshot": snapshot_id}

    def _strike(self, faults: list[dict], step: int, moment: object, log_path: str | None) -> None:
        fault = fires(faults, self.name, step, moment)
        if fault is None:
            return
        if log_path:
            log_event(log_path, {"event": "kill", "step": step, "target": self.name, "moment": moment, "fault": fault})
        kill_self()  # mid-rollout: no cleanup, no goodbye

    def rejoin(self) -> dict:
        """A replacement (Ray's restart of this actor, or a standby that ``assume``d it) has no state to take back:
        the weights a rollout uses come with each call. The learners' pool then issues the lost call again."""
        return {"snapshot_id": None, "step": None, "tier": None}

    def assume(self, index: int) -> str:
        """A standby becomes ``rollout-<index>`` (the faults aimed at it, ``identity``)."""
        from rl_ckpt.errors import CheckpointError

        if self.index is not None:
            raise CheckpointError(f"{self.name} is not a standby: it cannot become rollout-{index}")
        self.index = index
        return self.name

    def identity(self) -> int | None:
        """The index of the actor it is (None: a standby not used yet)."""
        return self.index

    def _pull(self, run: str, snapshot_id: str) -> bool:
        """The policy version of ``snapshot_id``'s step (the learners publish one per snapshot): only the chunks
        that changed since the version held move (the first pull moves all)."""
        from actors.weight_subscriber import WeightSubscriber
        from rl_ckpt._format.manifest import parse_snapshot_id

        from rl_ckpt.errors import CheckpointError

        sub = self.subs.get(run) or self.subs.setdefault(run, WeightSubscriber(run))
        first = sub.version is None
        version = parse_snapshot_id(snapshot_id)[0]
        try:
            got = sub.pull(self.model, version)
        except CheckpointError as exc:  # e.g. every copy lost with a node: the snapshot itself is still there
            log.warning("rollout actor: policy version of %s not pulled (%s); loading the snapshot", snapshot_id, exc)
            self.subs.pop(run, None)
            return False
        if got.version != version:  # a bad chunk made it take an older version: not the weights asked for
            log.warning(
                "rollout actor: the pull of version %d gave version %d (%s); loading the snapshot",
                version,
                got.version,
                got.reason,
            )
            self.subs.pop(run, None)  # the module no longer holds what the subscriber thinks: the next pull is whole
            return False
        self.moved["full" if first else "delta"] += got.bytes_moved
        self.moved["pulls"] += 1
        return True

    def stats(self) -> dict:
        return {"loads": self.loads, "loaded": self.loaded, "moved": dict(self.moved)}

    def reset(self) -> None:
        """Forget the runs served so far (their engines closed, the load count back to 0)."""
        for engine in self.engines.values():
            engine.close()
        self.engines, self.loaded, self.loads = {}, None, 0
        self.subs, self.moved = {}, {"full": 0, "delta": 0, "pulls": 0}


def memory_source(config) -> dict:
    """Where a run's memory snapshots are, for the rollout actors."""
    from rl_ckpt.integrations.memory_tier import MEMORY_BASE, memory_options

    return {"base_dir": MEMORY_BASE, "run_name": config.run_name, "storage_options": memory_options(config)}


def start_actors(grpo: GRPOConfig, n_actors: int, actor_options: dict | None = None) -> list:
    """``n_actors`` rollout actors ``rollout-0`` ... (``num_cpus=0``; ``actor_options``: e.g. resources pinning
    them). Ray restarts an actor that dies (``max_restarts=-1``) and never runs a lost call again by itself
    (``max_task_retries=0``): the learners' pool issues it again, and logs it."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(RolloutActor)
    return [actor_cls.options(**(actor_options or {})).remote(grpo.to_json(), j) for j in range(n_actors)]


def current_actors(actors: list, run_name: str) -> list:
    """``actors`` with each one a standby replaced (killed for good) swapped for the standby now in its place."""
    import ray
    from ray.exceptions import RayActorError

    out = list(actors)
    for standby in standbys_of(run_name):
        try:
            index = ray.get(standby.identity.remote(), timeout=60)
        except RayActorError:  # a standby that took over and was lost since
            continue
        if index is not None and 0 <= index < len(out):
            out[index] = standby
    return out


def rollout_pool(config: dict, rank: int, actors: list, names: list[str], tasks: dict) -> Any:
    """Learner rank ``rank``'s rollout actors as a ``RolloutPool``: an actor lost during a rollout is replaced (Ray's
    restart, or one of the rank's spare standbys, ``config["standbys"][rank]``) and its task issued again, the other
    actors and the learners going on; each recovery is logged as a ``scoped_recovery`` event with the task redone
    (``tasks[name]``: step, snapshot, (epoch, prompt id) pairs). ``config["scoped"]`` False: a lost actor fails
    the attempt instead (a group restart)."""

    from actors.rollout_pool import RolloutPool

    def on_recovery(event) -> None:
        task = tasks.get(event.participant)
        log_event(config["log"], {"event": "scoped_recovery", "rank": rank, **event.to_json(), "task": task})

    return RolloutPool(
        actors,
        names,
        standbys=spare((config.get("standbys") or {}).get(rank, [])),
        standby_factory=config.get("standby_factory"),
        attempts=3 if config.get("scoped", True) else 0,
        on_recovery=on_recovery,
    )
