"""Manager-less multi-rank commit over plain ``torch.distributed`` (torchrun, gloo/NCCL process groups).

Rank 0 opens the attempt and tells the others where it is; every rank writes
its own files; each rank's manifest part goes to rank 0 as a byte tensor
(JSON, never a pickled object); rank 0 merges the parts and commits with the
ordinary commit strategy, then broadcasts the outcome, so every rank returns
the same manifest or raises the same error. The collectives run on a group
of their own, so a background save never interleaves with training's.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from rl_ckpt import errors
from rl_ckpt._commit.base import Attempt, CommitStrategy
from rl_ckpt._commit.parts import merge_parts
from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._run.snapshot_files import read_manifest


def _all_gather_bytes(data: bytes, group) -> list[bytes]:
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [bytes(o[: int(s.item())].numpy()) for o, s in zip(out, sizes)]


def _broadcast_bytes(data: bytes | None, group, src_rank: int = 0) -> bytes:
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if data is not None and data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if buf.numel():
        dist.broadcast(buf, src=src, group=group)
    return bytes(buf.numpy())


def _error_bytes(exc: BaseException) -> bytes:
    cls = type(exc).__name__ if isinstance(exc, CheckpointError) else "CheckpointError"
    return json.dumps({"ok": False, "type": cls, "message": str(exc) or type(exc).__name__}).encode()


def _raise(outcome: dict) -> None:
    cls = getattr(errors, outcome.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    raise cls(outcome["message"])


class DistributedCommit(CommitStrategy):
    """The commit strategy of a multi-rank engine without a manager: rank 0 commits over ``inner``."""

    def __init__(self, inner: CommitStrategy, rank: int, world_size: int, participants: list[str]) -> None:
        self.inner = inner
        super().__init__(inner.storage)
        self.rank = rank
        self.world_size = world_size
        self.participants = participants
        # Every rank constructs this at the same point (registration), as new_group requires.
        self.group = dist.new_group(backend="gloo")
        self._settled: set[str] = set()

    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        self._ready(b"\x01")
        payload = None
        if self.rank == 0:
            try:
                begun = dataclasses.asdict(self.inner.begin(snapshot_id, attempt_id))
                payload = json.dumps({"ok": True, **begun}).encode()
            except CheckpointError as exc:
                payload = _error_bytes(exc)
        outcome = json.loads(_broadcast_bytes(payload, self.group))
        if not outcome.pop("ok"):
            _raise(outcome)
        return Attempt(**outcome)

    def fail(self, snapshot_id: str, attempt: Attempt | None, error: BaseException) -> None:
        """Before ``begin``: every rank raises (see ``fail_begin``); after: as ``abort``."""
        if attempt is not None:
            self.abort(attempt)
        elif isinstance(error, Exception):  # a KeyboardInterrupt is not announced to the group
            self.fail_begin(error)

    def fail_begin(self, exc: BaseException) -> None:
        """Called instead of ``begin`` by a rank that could not stage its state: every rank raises the same error."""
        self._ready(b"\x00" + f"rank {self.rank}: {type(exc).__name__}: {exc}".encode())

    def _ready(self, mine: bytes) -> None:
        failed = [p[1:].decode(errors="replace") for p in _all_gather_bytes(mine, self.group) if p[:1] != b"\x01"]
        if failed:
            raise CheckpointError("save not started: a rank could not stage its state (" + "; ".join(failed) + ")")

    def commit(self, attempt: Attempt, manifest: bytes) -> Manifest:
        """Send this rank's part; returns the merged manifest that rank 0 committed (or raises its error on all)."""
        return self._settle(attempt, b"\x01" + manifest)

    def abort(self, attempt: Attempt) -> None:
        """Called on a rank whose save failed: tell rank 0 (which aborts the attempt for everyone)."""
        if attempt.attempt_id in self._settled:
            return  # the outcome was already agreed (the error came from the commit itself)
        exc = sys.exc_info()[1]
        try:
            self._settle(
                attempt, b"\x00" + f"rank {self.rank}: {type(exc).__name__ if exc else 'error'}: {exc}".encode()
            )
        except CheckpointError:
            pass  # the caller re-raises its own error

    def _settle(self, attempt: Attempt, part: bytes) -> Manifest:
        self._settled.add(attempt.attempt_id)
        parts = _all_gather_bytes(part, self.group)
        payload = None
        if self.rank == 0:
            payload = self._decide(attempt, parts)
        outcome = _broadcast_bytes(payload, self.group)
        if outcome[:1] != b"M":
            _raise(json.loads(outcome[1:]))
        return Manifest.from_bytes(outcome[1:], attempt.snapshot_id)

    def _decide(self, attempt: Attempt, parts: list[bytes]) -> bytes:
        failed = [p[1:].decode(errors="replace") for p in parts if p[:1] != b"\x01"]
        try:
            if failed:
                raise CheckpointError(
                    f"snapshot {attempt.snapshot_id} not committed: a rank's save failed (" + "; ".join(failed) + ")",
                    snapshot_id=attempt.snapshot_id,
                )
            manifests = {
                name: Manifest.from_bytes(p[1:], attempt.snapshot_id) for name, p in zip(self.participants, parts)
            }
            merged = merge_parts(manifests, attempt.attempt_id, self.participants, head=self.participants[0])
            data = merged.to_bytes()
            self.inner.commit(attempt, data)
            return b"M" + data
        except Exception as exc:  # every rank must hear the outcome, whatever went wrong here
            if not self._landed(attempt):
                try:
                    self.inner.abort(attempt)
                except CheckpointError:
                    pass  # gc removes what is left
            return b"E" + _error_bytes(exc)

    def _landed(self, attempt: Attempt) -> bool:
        try:
            return read_manifest(self.storage, attempt.snapshot_id).writer.get("attempt") == attempt.attempt_id
        except CheckpointError:
            return False
