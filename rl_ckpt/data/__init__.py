"""Exactly-once data: the data position and in-flight rollouts as components of a snapshot, and an auditor.

- ``PromptSampler``: a prompt dataset's per-epoch order and position (a torch ``Sampler``).
- ``DataLoaderPosition``: a torchdata ``StatefulDataLoader``'s state, stored without pickle.
- ``IterablePosition``: a Hugging Face ``datasets.IterableDataset``'s position.
- ``EpisodeStream``: each env's episode index and reset seed.
- ``InflightRollouts``: a rollout worker's partial rollouts.
- ``ConsumptionAuditor``: what the learners trained on, per epoch and prompt; ``replay_log``.

Each checks at restore that the saved position fits the data given now
(``DataPositionError`` naming both values).
"""

from rl_ckpt.data._auditor import AuditReport, ConsumptionAuditor, replay_log
from rl_ckpt.data._episodes import EpisodeStream
from rl_ckpt.data._hf import IterablePosition
from rl_ckpt.data._inflight import InflightRollouts, Rollout
from rl_ckpt.data._loader import DataLoaderPosition
from rl_ckpt.data._sampler import PromptSampler

__all__ = [
    "AuditReport",
    "ConsumptionAuditor",
    "DataLoaderPosition",
    "EpisodeStream",
    "InflightRollouts",
    "IterablePosition",
    "PromptSampler",
    "Rollout",
    "replay_log",
]
