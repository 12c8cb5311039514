"""``PromptSampler``: the index order of a prompt dataset, epoch by epoch, resumable at any position.

Epoch ``e``'s order is a permutation drawn from a generator seeded by
``(seed, e)`` alone, so the order never depends on how many times the process
restarted; the state is ``(epoch, position)`` plus what identifies the data
(length, seed, shuffle), checked at restore. ``take(k)`` crosses epoch
boundaries inside one call, so a resume at the boundary neither skips the next
epoch nor replays the last.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rl_ckpt.data._checks import require_same, state_int

_EPOCH_MUL = 1_000_003


class PromptSampler(torch.utils.data.Sampler[int]):
    """Prompt indices ``0 .. dataset_size-1`` in a per-epoch order, with its position as checkpoint state.

    Usable as a torch ``Sampler`` (``iter`` yields the rest of the current
    epoch, then moves to the next one) or directly by an RL loop
    (``take(k)``: the next ``k`` ``(epoch, index)`` pairs). Register it like
    any component; with several learner ranks that draw the same global batch,
    register it ``replicated=True``.

    Example::

        sampler = PromptSampler(len(prompts), seed=0)
        engine.register("sampler", sampler, replicated=True)
        for epoch, idx in sampler.take(16): ...
    """

    checkpoint_kind = "progress"  # replicated on learners by default: every rank draws the same global batch
    data_position = True  # never in a light snapshot: it travels with the weights
    name = "PromptSampler"

    def __init__(self, dataset_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size <= 0:
            raise ValueError(f"PromptSampler: dataset_size must be a positive int, got {dataset_size!r}")
        self.dataset_size = dataset_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0  # indices of ``epoch`` handed out so far
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s index order (cached for the current epoch)."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * _EPOCH_MUL + epoch)
                perm = torch.randperm(self.dataset_size, generator=g)
            else:
                perm = torch.arange(self.dataset_size)
            self._order = (epoch, perm)
        return self._order[1]

    def _roll(self) -> None:
        if self.position >= self.dataset_size:
            self.epoch, self.position = self.epoch + 1, 0

    def take(self, k: int) -> list[tuple[int, int]]:
        """The next ``k`` ``(epoch, index)`` pairs, crossing into the next epoch when this one ends."""
        out: list[tuple[int, int]] = []
        while len(out) < k:
            self._roll()
            order = self.order(self.epoch)
            n = min(k - len(out), self.dataset_size - self.position)
            out += [(self.epoch, int(i)) for i in order[self.position : self.position + n]]
            self.position += n
        self._roll()
        return out

    def __iter__(self) -> Iterator[int]:
        self._roll()
        epoch, order = self.epoch, self.order(self.epoch)
        while self.epoch == epoch and self.position < self.dataset_size:
            self.position += 1
            yield int(order[self.position - 1])
        self._roll()

    def __len__(self) -> int:
        return self.dataset_size

    def state_dict(self) -> dict:
        return {
            "dataset_size": self.dataset_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        hint = "Restore with the same dataset and seed, or start a new run for new data."
        require_same(self.name, "dataset_size", state.get("dataset_size"), self.dataset_size, hint)
        require_same(self.name, "seed", state.get("seed"), self.seed, hint)
        require_same(self.name, "shuffle", state.get("shuffle"), self.shuffle, hint)
        epoch = state_int(self.name, state, "epoch")
        position = state_int(self.name, state, "position")
        if position > self.dataset_size:
            require_same(self.name, "position <= dataset_size", position, self.dataset_size, hint)
        self.epoch, self.position = epoch, position
