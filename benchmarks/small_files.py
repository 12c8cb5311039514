"""Re-hashing a snapshot of small files (verify-after-write, a manager's deep plan, ``rl-ckpt verify``): the
read buffer sized to each file against one of 16 MiB per file (what ``hash_file`` allocated before), in turns on
the same files, next to a save of the same state (which re-hashes each file it wrote).

    python benchmarks/small_files.py [--rounds 30] [--files 35]

Saves ``--files`` small tensors (a CartPole-sized policy, optimizer and RNG state, one component each) with
``CheckpointEngine.save`` and prints medians over ``--rounds``: the save, ``verify_snapshot`` of it, and the same
files hashed through a 16 MiB buffer each (the baseline), with their ratio."""

import argparse
import statistics
import tempfile
import time

import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt._format.hashed_io import READ_CHUNK
from rl_ckpt._format.checksum import new_hasher
from rl_ckpt._run.snapshot_files import read_manifest, verify_snapshot


class Part:
    def __init__(self, n: int) -> None:
        self.t = torch.randn(n)

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.t.copy_(state["t"])


def hash_with_16mib_buffers(storage, sid: str) -> None:
    for f in read_manifest(storage, sid).files:
        hasher = new_hasher(f.algo)
        view = memoryview(bytearray(READ_CHUNK))
        with storage.open_read(f"{sid}/{f.path}") as fh:
            while n := fh.readinto(view):
                hasher.update(view[:n])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--files", type=int, default=35)
    args = ap.parse_args()
    engine = CheckpointEngine(base_dir=tempfile.mkdtemp(), run_name="small", retention=False)
    parts = [Part(1024 + 64 * i) for i in range(args.files)]
    for i, part in enumerate(parts):
        engine.register(f"part{i}", part)
    saves, sized, fixed = [], [], []
    for step in range(1, args.rounds + 1):
        for part in parts:
            part.t.add_(1)
        started = time.perf_counter()
        sid = engine.save(step).snapshot_id
        saves.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert verify_snapshot(engine.storage, sid).ok
        sized.append(time.perf_counter() - started)
        started = time.perf_counter()
        hash_with_16mib_buffers(engine.storage, sid)
        fixed.append(time.perf_counter() - started)
    files = len(read_manifest(engine.storage, sid).files)
    engine.close()
    med = {k: statistics.median(v) * 1e3 for k, v in (("save", saves), ("sized", sized), ("fixed", fixed))}
    print(f"{files} files a snapshot, medians of {args.rounds} rounds:")
    print(f"  save (writes, fsyncs, re-hashes each file)   {med['save']:8.2f} ms")
    print(f"  verify_snapshot (buffers sized to the files) {med['sized']:8.2f} ms")
    print(f"  the same files, a 16 MiB buffer each         {med['fixed']:8.2f} ms")
    print(f"  verify / 16 MiB buffers: {med['sized'] / med['fixed']:.2f}x")


if __name__ == "__main__":
    main()
