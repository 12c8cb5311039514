"""A ``StatefulDataLoader`` at an epoch's end, end to end: registered only through ``DataLoaderPosition`` (as
docs/data.md says), trained by the standard loop ``for epoch in range(start_epoch, E): for batch in loader``,
snapshotted by a real engine (local files) at an epoch's last batch or after an epoch's loop, the run stopped
there and resumed by a fresh loader, sampler and engine. The ``ConsumptionAuditor`` (a component of the same
snapshot) must count 0 skipped and 0 duplicated, and the run must make the updates of an uninterrupted one:
with a ``PromptSampler`` exactly as torchdata's own ``shuffle=True`` sampler does, with 0 and 2 workers."""

from __future__ import annotations

import pytest
import torch

from rl_ckpt import CheckpointEngine, TrainingProgress
from rl_ckpt.data import ConsumptionAuditor, DataLoaderPosition, PromptSampler

pytest.importorskip("torchdata")

BATCH, EPOCHS = 5, 2  # 2 workers x prefetch 2 = 4 batches, less than an epoch


def _loader(sampler: str, workers: int, size: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    kw = dict(batch_size=BATCH, num_workers=workers, prefetch_factor=2 if workers else None)
    if sampler == "prompt":
        return StatefulDataLoader(list(range(size)), sampler=PromptSampler(size, seed=7), **kw)
    return StatefulDataLoader(list(range(size)), shuffle=True, generator=torch.Generator().manual_seed(7), **kw)


def _run(
    base_dir: str, sampler: str, workers: int, size: int, save: str | None = None
) -> tuple[list, ConsumptionAuditor]:
    """Train from the newest snapshot (none: from the start); with ``save``, snapshot at epoch 0's end and stop.

    ``save="last_batch"``: inside the loop, at epoch 0's last batch (the epoch in progress is saved as 0);
    ``save="after_loop"``: after epoch 0's loop (the next epoch, 1, is saved). Returns the ``(epoch, prompt)``
    pairs trained on by this process, and the auditor.
    """
    loader = _loader(sampler, workers, size)
    progress = TrainingProgress()
    auditor = ConsumptionAuditor(size)
    engine = CheckpointEngine(base_dir=base_dir, run_name="epochs")
    engine.register("data", DataLoaderPosition(loader))
    engine.register("progress", progress)
    engine.register("auditor", auditor)
    engine.restore()
    trained: list[tuple[int, int]] = []
    try:
        for epoch in range(progress.epoch, EPOCHS):
            progress.epoch = epoch
            for batch in loader:
                pairs = [(epoch, int(p)) for p in batch]
                progress.global_step += 1
                trained += pairs
                auditor.record(progress.global_step, pairs)
                if save == "last_batch" and progress.global_step == -(-size // BATCH):
                    engine.save(progress.global_step)
                    return trained, auditor  # the run stops here: a crash right after the snapshot
            progress.epoch = epoch + 1
            if save == "after_loop" and epoch == 0:
                engine.save(progress.global_step)
                return trained, auditor
        return trained, auditor
    finally:
        engine.close()
        del loader  # shuts its workers down now


def _expected_order(size: int) -> list[tuple[int, int]]:
    sampler = PromptSampler(size, seed=7)
    return [(e, int(p)) for e in range(EPOCHS) for p in sampler.order(e)]


# 30 prompts: 6 full batches an epoch; 32: a short last batch (its sampler ran out while the epoch's loop goes on)
@pytest.mark.parametrize("size", [30, 32])
@pytest.mark.parametrize("save", ["last_batch", "after_loop"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", ["prompt", "torchdata"])
def test_a_snapshot_at_an_epoch_end_resumes_every_prompt_exactly_once(tmp_path, sampler, workers, save, size):
    head, _ = _run(str(tmp_path), sampler, workers, size, save=save)
    assert len(head) == size  # epoch 0, whole, before the snapshot
    tail, auditor = _run(str(tmp_path), sampler, workers, size)
    report = auditor.report(complete_below=EPOCHS)
    assert (report.skipped, report.duplicated, report.epochs) == (0, 0, EPOCHS), report
    assert report.consumed == size * EPOCHS  # every prompt of every epoch once...
    assert auditor.last_step == EPOCHS * -(-size // BATCH)  # ...in the updates of an uninterrupted run
    assert sorted(head + tail) == sorted((e, p) for e in range(EPOCHS) for p in range(size))
    if sampler == "prompt":  # a PromptSampler's order does not depend on the restore: the uninterrupted one
        assert head + tail == _expected_order(size)
