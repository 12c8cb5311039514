"""Samples tagged with policy versions: saved with their versions, and after a restore the plan states their
staleness against the restored policy and what a bound kept and dropped."""

from __future__ import annotations

import pytest
import torch

from rl_ckpt import CheckpointEngine, ConfigError
from rl_ckpt.integrations.samples import VersionedSamples, apply_staleness, tag


def test_restored_plan_states_staleness_and_applies_the_bound(tmp_path):
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="s", keep_best=0)
    buffer = VersionedSamples()
    engine.register("samples", buffer)
    for version in range(1, 7):  # the batch of each step came from the policy one version behind
        buffer.add(tag({"obs": torch.full((2, 3), float(version)), "ids": [version]}, version - 1))
    engine.save(6)
    buffer.add({"obs": torch.zeros(2, 3), "ids": [99]}, 6)  # after the snapshot: lost with the crash
    engine.close()

    for bound, kept, dropped in ((None, 6, 0), (2, 2, 4), (0, 0, 6)):
        fresh = CheckpointEngine(base_dir=str(tmp_path), run_name="s", keep_best=0)
        restored = VersionedSamples()
        fresh.register("samples", restored)
        result = fresh.restore()
        assert len(restored) == 6 and restored.versions == [0, 1, 2, 3, 4, 5]
        (report,) = apply_staleness(result, {"samples": restored}, max_staleness=bound)
        assert (report.kept, report.dropped, report.policy_version) == (kept, dropped, 6)
        assert restored.versions == [v for v in range(6) if bound is None or 6 - v <= bound]
        assert [b["ids"] for b in restored.batches] == [[v + 1] for v in restored.versions]
        if restored.batches:
            assert torch.equal(restored.batches[-1]["obs"], torch.full((2, 3), 6.0))
        text = str(result.plan)
        assert "samples samples: against policy version 6, " in text and f"kept {kept}, dropped {dropped}" in text
        fresh.close()


def test_newer_samples_are_dropped_and_bad_bounds_named():
    buffer = VersionedSamples()
    for v in (3, 5, 8):
        buffer.add({"x": torch.ones(1)}, v)
    report = buffer.apply_bound(5, None, "b")
    assert (report.kept, report.dropped, report.dropped_newer, buffer.versions) == (2, 1, 1, [3, 5])
    assert "1 from policies newer" in report.line() and "kept samples are 0..2 versions old" in report.line()
    with pytest.raises(ConfigError, match="max_staleness"):
        buffer.apply_bound(5, -1)
    with pytest.raises(ConfigError, match="policy_version"):
        buffer.add({"x": torch.ones(1)})
