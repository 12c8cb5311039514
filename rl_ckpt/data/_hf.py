"""``IterablePosition``: the position of a Hugging Face ``datasets.IterableDataset`` as checkpoint state.

``IterableDataset.state_dict()`` records shard and example indices, exact
as long as nothing holds examples outside them. A shuffle buffer
(``IterableDataset.shuffle``) does: its content is not in the state, so the
buffered examples would be skipped at resume (the library says so in a
warning). Such a dataset is refused here; shuffle with a ``PromptSampler``
over a map-style dataset instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rl_ckpt.data._checks import require_same, state_int
from rl_ckpt.errors import DataPositionError

_BUFFER = "BufferShuffledExamplesIterable"


def _types(dataset) -> set[str]:
    """Class names of the dataset's chain of example iterables (the buffer leaves no trace in the state)."""
    out: set[str] = set()
    todo: list[Any] = [getattr(dataset, "_ex_iterable", None)]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        out.add(type(node).__name__)
        todo.append(getattr(node, "ex_iterable", None))
        todo += list(getattr(node, "ex_iterables", None) or [])
    return out


class IterablePosition:
    """Iterate a ``datasets.IterableDataset`` through this object; its position is checkpoint state.

    ``yielded`` counts the examples handed out (also saved). The number of
    shards is saved and checked at restore, as is the dataset's ``epoch``
    (``set_epoch``) and an optional ``fingerprint`` of your choosing (a
    dataset name and revision): a mismatch names both values.

    Example::

        ds = Dataset.from_dict(rows).to_iterable_dataset(num_shards=4)
        prompts = IterablePosition(ds, fingerprint="prompts-v3")
        engine.register("prompts", prompts)
        for row in prompts: ...
    """

    checkpoint_kind = "other"  # per rank by default (each rank its own shards); replicated=True to share one
    data_position = True  # never in a light snapshot: it travels with the weights
    name = "IterablePosition"

    def __init__(self, dataset, fingerprint: str | None = None) -> None:
        if not callable(getattr(dataset, "state_dict", None)):
            raise TypeError("IterablePosition needs a datasets.IterableDataset (datasets >= 2.18: state_dict())")
        if _BUFFER in _types(dataset):
            raise DataPositionError(
                f"{self.name}: this IterableDataset has a shuffle buffer, whose examples are not in its "
                "state_dict: a resume would skip them. Shuffle with rl_ckpt.data.PromptSampler over a map-style "
                "Dataset, or iterate without IterableDataset.shuffle.",
                component=self.name,
                field="shuffle",
                saved=None,
                given="buffer",
            )
        self.dataset = dataset
        self.fingerprint = fingerprint
        self.yielded = 0

    def __iter__(self) -> Iterator[dict]:
        for row in self.dataset:
            self.yielded += 1
            yield row

    def _identity(self) -> dict:
        return {
            "num_shards": int(self.dataset.num_shards),
            "fingerprint": self.fingerprint,
            "epoch": int(getattr(self.dataset, "epoch", 0) or 0),
        }

    def state_dict(self) -> dict:
        return {**self._identity(), "yielded": self.yielded, "dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        hint = "Restore with the same dataset (shards, fingerprint) and set_epoch, or start a new run."
        for key, given in self._identity().items():
            require_same(self.name, key, state.get(key), given, hint)
        yielded = state_int(self.name, state, "yielded")
        if not isinstance(state.get("dataset"), dict):
            raise DataPositionError(
                f"{self.name}: the saved state has no dataset position",
                component=self.name,
                field="dataset",
                saved=None,
                given=None,
            )
        self.dataset.load_state_dict(state["dataset"])
        self.yielded = yielded
