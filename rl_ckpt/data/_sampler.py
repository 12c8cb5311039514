"""``PromptSampler``: the index order of a prompt dataset, epoch by epoch, resumable at any position.

Epoch ``e``'s order is a permutation drawn from a generator seeded by
``(seed, e)`` alone, so the order never depends on how many times the process
restarted; the state is ``(epoch, position)`` plus what identifies the data
(length, seed, shuffle), checked at restore. ``take(k)`` crosses epoch
boundaries inside one call, so a resume at the boundary neither skips the next
epoch nor replays the last.

As a torch ``Sampler``, ``iter`` is one iteration over the rest of the current
epoch, an object with its own state (the epoch it iterates) that a torchdata
``StatefulDataLoader`` saves beside the sampler's, as it does for its own
samplers' iterators. An epoch ends when its iteration ends (``StopIteration``),
not when its last index is handed out: a loader restored from a snapshot taken
at an epoch's last batch resumes that epoch's iteration, which has nothing
left, instead of yielding the next epoch under the loop's old epoch; and a
loader restored as finished (saved after an epoch's loop) draws nothing from
the next epoch before torchdata drops its iterator and starts a fresh one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rl_ckpt.data._checks import require_same, state_int
from rl_ckpt.errors import DataPositionError

_EPOCH_MUL = 1_000_003


class _EpochIteration(Iterator[int]):
    """One iteration of a ``PromptSampler``: the rest of one epoch (the sampler's position is shared).

    Bound at its first draw to the epoch the sampler is in; yields from the sampler's position until the epoch
    is handed out, then ends it (the sampler moves to the next epoch) and stops. It stops too when the sampler
    has moved past its epoch (another iteration or ``take`` ended it). Its state is that epoch: torchdata saves
    it as the sampler iterator's state, and restores it into a new iteration after the sampler's own state.
    """

    def __init__(self, sampler: PromptSampler) -> None:
        self.sampler = sampler
        self.epoch: int | None = None  # bound at the first draw, or by load_state_dict

    def __iter__(self) -> _EpochIteration:
        return self

    def __next__(self) -> int:
        s = self.sampler
        if self.epoch is None:
            self.epoch = s.epoch
        if s.epoch != self.epoch:
            raise StopIteration
        if s.position >= s.dataset_size:
            s.end_epoch(self.epoch)
            raise StopIteration
        s.position += 1
        return int(s.order(self.epoch)[s.position - 1])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        """Resume the saved iteration (after the sampler's state was loaded, as torchdata does)."""
        s = self.sampler
        epoch = state.get("epoch")
        if epoch is None:  # saved before its first draw: it binds at its first draw, as a new one does
            self.epoch = None
            return
        epoch = state_int(s.name, state, "epoch")
        # The iteration is the sampler's epoch, or the one just before when that ended and the sampler moved on.
        if not (epoch == s.epoch or (epoch == s.epoch - 1 and s.position == 0)):
            raise DataPositionError(
                f"{s.name}: the saved iteration is over epoch {epoch}, but the saved sampler is at epoch {s.epoch} "
                f"position {s.position}; the loader state is inconsistent. Restore an intact snapshot.",
                component=s.name,
                field="iteration epoch",
                saved=epoch,
                given=(s.epoch, s.position),
            )
        self.epoch = epoch


class PromptSampler(torch.utils.data.Sampler[int]):
    """Prompt indices ``0 .. dataset_size-1`` in a per-epoch order, with its position as checkpoint state.

    Usable as a torch ``Sampler`` (``iter`` is one iteration over the rest of
    the current epoch, see below) or directly by an RL loop (``take(k)``: the
    next ``k`` ``(epoch, index)`` pairs). Register it like any component; with
    several learner ranks that draw the same global batch, register it
    ``replicated=True``. In a torchdata ``StatefulDataLoader``, register only
    the loader (``DataLoaderPosition``).

    An iteration yields the current epoch's remaining indices and then ends the
    epoch (the next iteration begins the next one); an iteration begun when all
    of the epoch was handed out but its iteration had not ended (a snapshot
    taken at the epoch's last index) yields nothing and ends it.

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

    def end_epoch(self, epoch: int) -> None:
        """Epoch ``epoch``'s iteration ended: move to the next epoch if this one was all handed out."""
        if self.epoch == epoch:
            self._roll()

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
        return _EpochIteration(self)

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

    def check_state(self, state: dict) -> tuple[int, int]:
        """The saved ``(epoch, position)``, if ``state`` fits this sampler's data; else a ``DataPositionError``."""
        hint = "Restore with the same dataset and seed, or start a new run for new data."
        require_same(self.name, "dataset_size", state.get("dataset_size"), self.dataset_size, hint)
        require_same(self.name, "seed", state.get("seed"), self.seed, hint)
        require_same(self.name, "shuffle", state.get("shuffle"), self.shuffle, hint)
        epoch = state_int(self.name, state, "epoch")
        position = state_int(self.name, state, "position")
        if position > self.dataset_size:
            require_same(self.name, "position <= dataset_size", position, self.dataset_size, hint)
        return epoch, position

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = self.check_state(state)
