"""The data-position components through a real engine (local files): each resumes exactly where it was saved,
mid-epoch and at an epoch boundary, and refuses a saved position that does not fit the data given at restore."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt.data import (
    ConsumptionAuditor,
    DataLoaderPosition,
    EpisodeStream,
    InflightRollouts,
    IterablePosition,
    PromptSampler,
    replay_log,
)
from rl_ckpt.errors import DataPositionError


def _roundtrip(tmp_path, name: str, obj, fresh, step: int = 1):
    """Save ``obj`` in a snapshot, restore it into ``fresh`` through a new engine; returns ``fresh``."""
    cfg = dict(base_dir=str(tmp_path), run_name=f"r-{name}")
    engine = CheckpointEngine(**cfg)
    engine.register(name, obj)
    engine.save(step)
    engine.close()
    engine = CheckpointEngine(**cfg)
    engine.register(name, fresh)
    assert engine.restore().global_step == step
    engine.close()
    return fresh


@pytest.mark.parametrize("cut", [0, 7, 10, 11, 20, 23])  # start, mid-epoch, exactly at the boundaries, later
def test_prompt_sampler_resumes_mid_epoch_and_at_the_epoch_boundary(tmp_path, cut):
    reference = PromptSampler(10, seed=3).take(30)
    assert sorted(p for e, p in reference if e == 1) == list(range(10))  # each epoch is a permutation
    assert [p for e, p in reference if e == 0] != [p for e, p in reference if e == 1]  # reshuffled per epoch
    first = PromptSampler(10, seed=3)
    head = first.take(cut)
    resumed = _roundtrip(tmp_path, "sampler", first, PromptSampler(10, seed=3))
    assert head + resumed.take(30 - cut) == reference


@pytest.mark.parametrize("save", ["last_index", "after_loop"])
def test_prompt_sampler_registered_itself_in_a_plain_epoch_loop_resumes_at_the_epoch_end(tmp_path, save):
    """``for epoch in range(start, 2): for idx in sampler``, a snapshot at epoch 0's last index (the epoch in
    progress, 0, is saved) or after its loop (the next, 1): the resumed run is the uninterrupted one."""
    from rl_ckpt import TrainingProgress

    def run(stop: bool) -> list:
        sampler, progress = PromptSampler(10, seed=3), TrainingProgress()
        engine = CheckpointEngine(base_dir=str(tmp_path), run_name="loop")
        engine.register("sampler", sampler)
        engine.register("progress", progress)
        engine.restore()
        out = []
        try:
            for epoch in range(progress.epoch, 2):
                progress.epoch = epoch
                for idx in sampler:
                    out.append((epoch, idx))
                    if stop and save == "last_index" and len(out) == 10:
                        engine.save(1)
                        return out
                progress.epoch = epoch + 1
                if stop and save == "after_loop":
                    engine.save(1)
                    return out
            return out
        finally:
            engine.close()

    reference = PromptSampler(10, seed=3)
    assert run(stop=True) + run(stop=False) == [(e, int(i)) for e in range(2) for i in reference.order(e)]


def test_prompt_sampler_iteration_state_must_fit_the_sampler_state():
    sampler = PromptSampler(10, seed=3)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 2, "position": 0})
    ended = iter(sampler)
    ended.load_state_dict({"epoch": 1})  # epoch 1's iteration had ended (the sampler moved on): nothing left
    assert list(ended) == [] and (sampler.epoch, sampler.position) == (2, 0)
    assert len(list(iter(sampler))) == 10 and sampler.epoch == 3  # a new iteration: the next epoch, whole
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 2, "position": 10})  # all handed out, not ended
    assert list(iter(sampler)) == [] and (sampler.epoch, sampler.position) == (3, 0)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 2, "position": 4})
    for bad in ({"epoch": 0}, {"epoch": 1}, {"epoch": 3}, {"epoch": -1}, {"epoch": "2"}):
        with pytest.raises(DataPositionError, match="PromptSampler"):
            iter(sampler).load_state_dict(bad)


def test_prompt_sampler_as_a_torch_sampler_in_a_stateful_dataloader(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(10))

    def loader(workers: int):
        return StatefulDataLoader(data, batch_size=3, sampler=PromptSampler(10, seed=1), num_workers=workers)

    full = loader(0)
    reference = [b.tolist() for _ in range(2) for b in full]
    for workers in (0, 2):
        dl = loader(workers)
        it = iter(dl)
        got = [next(it).tolist() for _ in range(2)]
        other = StatefulDataLoader(data, batch_size=3, sampler=PromptSampler(10, seed=2), num_workers=workers)
        with pytest.raises(DataPositionError, match="seed=1.*seed=2"):  # at restore, not at the next batch
            DataLoaderPosition(other).load_state_dict(DataLoaderPosition(dl).state_dict())
        fresh = _roundtrip(tmp_path / str(workers), "data", DataLoaderPosition(dl), DataLoaderPosition(loader(workers)))
        got += [b.tolist() for b in fresh.loader]  # the rest of epoch 0
        got += [b.tolist() for b in fresh.loader]  # epoch 1, not skipped
        assert got == reference, workers


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_with_a_shuffling_generator_resumes_exactly_once(tmp_path, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader(seed: int = 5):
        return StatefulDataLoader(
            list(range(12)),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(seed),
        )

    ref = loader()
    reference = [[b.tolist() for b in ref] for _ in range(3)]
    dl = loader()
    it = iter(dl)
    head = [next(it).tolist()]
    fresh = _roundtrip(tmp_path, "data", DataLoaderPosition(dl), DataLoaderPosition(loader()))
    got = [head + [b.tolist() for b in fresh.loader]] + [[b.tolist() for b in fresh.loader] for _ in range(2)]
    assert got[0] == reference[0]  # the rest of the epoch, exactly
    for epoch in got[1:]:  # every later epoch: each item exactly once
        assert sorted(sum(epoch, [])) == list(range(12))
    if workers:  # with workers the later epochs' order is the uninterrupted one too (the generator state is saved)
        assert got == reference
    with pytest.raises(DataPositionError, match="generator_seed=5.*generator_seed=6"):
        DataLoaderPosition(loader(6)).load_state_dict(DataLoaderPosition(dl).state_dict())


def test_pickled_bytes_in_a_loader_state_are_refused_at_save():
    import pickle

    from torchdata.stateful_dataloader import StatefulDataLoader

    class PickledState(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return i

        def state_dict(self):
            return {"opaque": pickle.dumps({"x": 1}), "raw": b"\x00plain bytes"}

        def load_state_dict(self, state):
            pass

    dl = StatefulDataLoader(PickledState(), batch_size=2)
    next(iter(dl))
    with pytest.raises(DataPositionError, match=r"dataset_state\.opaque holds pickled bytes"):
        DataLoaderPosition(dl).state_dict()


def test_plain_bytes_in_a_dataset_state_come_back_as_bytes(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Cursor(torch.utils.data.Dataset):
        def __init__(self):
            self.token = b""

        def __len__(self):
            return 6

        def __getitem__(self, i):
            return i

        def state_dict(self):
            return {"token": b"\x00\x01 resume-token \xff", "shard": 3}

        def load_state_dict(self, state):
            self.token = state["token"]

    dl = StatefulDataLoader(Cursor(), batch_size=2)
    it = iter(dl)
    next(it)
    fresh = _roundtrip(
        tmp_path, "data", DataLoaderPosition(dl), DataLoaderPosition(StatefulDataLoader(Cursor(), batch_size=2))
    )
    assert [b.tolist() for b in fresh.loader] == [[2, 3], [4, 5]]
    assert fresh.loader.dataset.token == b"\x00\x01 resume-token \xff"  # exact bytes, exact type


def _hf(num_shards: int = 3, rows: int = 10):
    from datasets import Dataset

    return Dataset.from_dict({"id": list(range(rows)), "text": [f"p{i}" for i in range(rows)]}).to_iterable_dataset(
        num_shards=num_shards
    )


def test_hf_iterable_position_resumes_and_refuses_other_data(tmp_path):
    pos = IterablePosition(_hf(), fingerprint="toy-v1")
    it = iter(pos)
    head = [next(it)["id"] for _ in range(4)]
    fresh = _roundtrip(tmp_path, "prompts", pos, IterablePosition(_hf(), fingerprint="toy-v1"))
    assert fresh.yielded == 4
    assert head + [r["id"] for r in fresh] == list(range(10))
    saved = pos.state_dict()
    with pytest.raises(DataPositionError, match="num_shards=3.*num_shards=2"):
        IterablePosition(_hf(num_shards=2), fingerprint="toy-v1").load_state_dict(saved)
    with pytest.raises(DataPositionError, match="fingerprint='toy-v1'.*fingerprint='toy-v2'"):
        IterablePosition(_hf(), fingerprint="toy-v2").load_state_dict(saved)
    with pytest.raises(DataPositionError, match="shuffle buffer"):
        IterablePosition(_hf().shuffle(seed=1, buffer_size=4))


@pytest.mark.parametrize(
    "field,fresh", [("dataset_size", PromptSampler(11, seed=3)), ("seed", PromptSampler(10, seed=4))]
)
def test_sampler_position_for_other_data_is_an_error_naming_both(tmp_path, field, fresh):
    sampler = PromptSampler(10, seed=3)
    sampler.take(4)
    with pytest.raises(DataPositionError) as info:
        _roundtrip(tmp_path, "sampler", sampler, fresh)
    err = info.value
    assert (err.field, err.saved, err.given) == (field, getattr(sampler, field), getattr(fresh, field))
    assert f"{field}={getattr(sampler, field)}" in str(err) and f"{field}={getattr(fresh, field)}" in str(err)


def test_episode_stream_with_gymnasium_resumes_every_env_without_replay_or_skip(tmp_path):
    gym = pytest.importorskip("gymnasium")

    def run(stream: EpisodeStream, envs, episodes: int, log: list) -> None:
        for _ in range(episodes):
            for i, env in enumerate(envs):
                obs, _ = env.reset(seed=stream.begin(i))
                log.append((i, stream.current(i), tuple(np.round(obs, 6))))
                stream.finish(i)

    envs = [gym.make("CartPole-v1") for _ in range(2)]
    reference: list = []
    run(EpisodeStream(2, seed=7), envs, 5, reference)
    stream, got = EpisodeStream(2, seed=7), []
    run(stream, envs, 2, got)
    stream.begin(0)  # env 0's third episode had begun when the snapshot was taken
    fresh = _roundtrip(tmp_path, "episodes", stream, EpisodeStream(2, seed=7))
    assert fresh.current(0) == 2 and fresh.current(1) is None
    run(fresh, envs, 3, got)
    assert got == reference  # episode 2 of env 0 begun again with its seed, counted once; nothing skipped
    assert fresh.finished == 10
    with pytest.raises(DataPositionError, match="n_envs=2.*n_envs=3"):
        EpisodeStream(3, seed=7).load_state_dict(fresh.state_dict())


def test_inflight_rollouts_resume_with_the_same_next_tokens(tmp_path):
    def step(inflight: InflightRollouts, key: str) -> None:
        r = inflight.rollouts[key]
        tok = int(torch.randint(0, 50, (1,), generator=r.generator))
        inflight.extend(key, tok, -float(tok))

    ref = InflightRollouts()
    keys = [ref.begin(p, 1, seed=100 + p).key for p in (3, 8)]
    for _ in range(6):
        for k in keys:
            step(ref, k)
    worker = InflightRollouts()
    for p in (3, 8):
        worker.begin(p, 1, seed=100 + p)
    for _ in range(2):
        for k in keys:
            step(worker, k)
    fresh = _roundtrip(tmp_path, "inflight", worker, InflightRollouts())
    assert fresh.resumed_total == 2 and all(r.resumed for r in fresh.rollouts.values())
    for _ in range(4):
        for k in keys:
            step(fresh, k)
    assert fresh.tokens_after_resume == 8  # only the missing tokens were generated
    for k in keys:
        assert fresh.rollouts[k].tokens == ref.rollouts[k].tokens


def test_inflight_log_probs_come_back_bit_for_bit_in_the_dtype_they_were_given(tmp_path):
    given = {  # per rollout (prompt id): its log-probs, and the dtype they are kept in
        1: ([-1.0986122886681098, torch.tensor(-0.1, dtype=torch.float64), 0], torch.float64),
        2: ([torch.tensor(-1.0986122886681098), np.float32(-2.5e-8)], torch.float32),
        3: ([torch.tensor(-1.0986, dtype=torch.bfloat16)], torch.bfloat16),
        4: ([torch.tensor(-0.3, dtype=torch.float16), torch.tensor(-0.7, dtype=torch.bfloat16)], torch.float32),
        5: ([torch.tensor(-0.3, dtype=torch.float32), -0.3], torch.float64),  # each held exactly by float64
        6: ([], None),
    }
    worker = InflightRollouts()
    for p, (logps, _) in given.items():
        r = worker.begin(p, 0, seed=p)
        for i, lp in enumerate(logps):
            worker.extend(r.key, i, lp)
    fresh = _roundtrip(tmp_path, "inflight", worker, InflightRollouts())
    again = _roundtrip(tmp_path / "again", "inflight", fresh, InflightRollouts())  # saved again after a restore
    for p, (logps, dtype) in given.items():
        exact = [float(lp) for lp in logps]  # what the worker holds: every kept dtype fits a float exactly
        assert worker.rollouts[f"0:{p}"].logps == exact
        for restored in (fresh, again):
            r = restored.rollouts[f"0:{p}"]
            assert r.logps == exact, (p, r.logps)
            assert r.logp_dtype == dtype, (p, r.logp_dtype)
    assert fresh.rollouts["0:1"].logps[0] == -1.0986122886681098  # not -1.0986123085021973 (a float32's)
    r = worker.begin(9, 0, seed=9)
    for bad in (
        complex(-1.0, 0.5),
        torch.tensor([-1.0, -2.0]),
        torch.tensor(-1, dtype=torch.int64),
        np.longdouble(-1.25),
        "-1.0",
        True,
        2**60,
    ):
        with pytest.raises(TypeError, match=r"rollout '0:9'.*no stored dtype keeps exactly"):
            worker.extend(r.key, 0, bad)
    assert r.tokens == [] and r.logps == []  # a refused log-prob adds nothing
    r.logps.append(-1.0986122886681098)  # by hand, into a rollout kept in float32: refused at save, not rounded
    r.logp_dtype = torch.float32
    with pytest.raises(DataPositionError, match=r"rollout '0:9'.*does not fit its dtype torch.float32"):
        worker.state_dict()


def test_auditor_counts_skips_and_duplicates_and_its_log_agrees_after_a_rollback(tmp_path):
    log = str(tmp_path / "audit.jsonl")
    audit = ConsumptionAuditor(4, log_path=log)
    audit.record(1, [(0, 0), (0, 1)])
    audit.record(2, [(0, 2), (0, 3)])  # epoch 0 exact: folded away
    assert audit.counts == {} and audit.exact_epochs == [0]
    snap = _roundtrip(tmp_path, "audit", audit, ConsumptionAuditor(4), step=2).state_dict()
    audit.record(3, [(1, 0), (1, 1)], resumed=1)  # lost in the crash below
    restored = ConsumptionAuditor(4, log_path=log)
    restored.load_state_dict(snap)  # the restore writes its line to the log
    restored.record(3, [(1, 0), (1, 1)], resumed=1)  # replayed: not a duplicate
    restored.record(4, [(1, 2), (1, 2)])  # prompt 2 twice, prompt 3 never
    restored.record(5, [(2, 0)])
    report = restored.report()
    assert (report.skipped, report.duplicated, report.resumed_in_flight, report.epochs) == (1, 1, 1, 2)
    assert report.consumed == 9
    replayed = replay_log(log, 4)
    assert replayed.report() == report
    with open(log, "a") as f:
        f.write('{"event": "consume", "step": 6, "pai')  # a torn last line: ignored
    assert replay_log(log, 4).report() == report
    with pytest.raises(DataPositionError, match="dataset_size=4.*dataset_size=5"):
        ConsumptionAuditor(5).load_state_dict(snap)
    # A run killed before its first snapshot starts again from nothing: the first attempt's updates are not counted.
    log2 = str(tmp_path / "audit2.jsonl")
    ConsumptionAuditor(4, log_path=log2).record(1, [(0, 0), (0, 1)])
    again = ConsumptionAuditor(4, log_path=log2)  # nothing to restore
    again.record(1, [(0, 0), (0, 1)])
    assert replay_log(log2, 4).report() == again.report() and again.report().duplicated == 0
    assert os.path.getsize(log) > 0


def test_the_data_position_travels_with_the_weights_never_in_a_light_snapshot(tmp_path):
    cfg = dict(base_dir=str(tmp_path), run_name="light", light_components=["progress", "sampler"])

    def engine_with(model, sampler, progress):
        engine = CheckpointEngine(**cfg)
        for name, obj in (("policy", model), ("sampler", sampler), ("progress", progress)):
            engine.register(name, obj)
        return engine

    from rl_ckpt import TrainingProgress

    model, sampler, progress = torch.nn.Linear(2, 2), PromptSampler(10, seed=0), TrainingProgress()
    engine = engine_with(model, sampler, progress)
    sampler.take(4)
    engine.save(4)  # full: weights and the data they trained on
    sampler.take(4)
    progress.global_step = 8
    engine.save(8, kind="light")  # listed, yet the sampler is left out: the weights of step 8 are not saved
    engine.close()
    fresh = PromptSampler(10, seed=0)
    engine = engine_with(torch.nn.Linear(2, 2), fresh, TrainingProgress())
    engine.restore()
    engine.close()
    assert (fresh.epoch, fresh.position) == (0, 4)  # the position the restored weights trained to
