"""Scenario 8: a 2-rank sharded (FSDP2, gloo) save killed on one rank at every storage call; damaged chunks.

Every case is real processes: two forkserver children form a gloo group,
shard a small model with ``fully_shard`` and save it with its Adam state
(each rank writes its own shards; rank 0 commits). Every parameter and
optimizer tensor is a function of the step, so a restore that mixes two
snapshots, or loads part of one, shows when the state is gathered with
``full_tensor()``.

- *kills*: the storage calls of one save (step 3 over committed steps 1
  and 2) are recorded per rank; for each call *k* of rank *r* a new pair
  saves and rank *r* SIGKILLs itself right before call *k* (the other rank
  then fails on its next collective or finishes, as it may).
- *corruption*: in the newest committed snapshot, a flipped byte in a chunk
  and a truncated shard file, for each rank's file of the model and the
  optimizer. The rank that reads the damaged chunk must detect it (a
  truncation may be caught earlier, by the size check every rank makes
  before reading), and both ranks must restore the previous snapshot together.

After every case a fresh pair restores and checks the state bitwise;
``rl-ckpt gc --grace 0`` must then leave only verifiable snapshots, a later
2-rank save must succeed, and nothing outside the run folder may change.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket

import torch

from rl_ckpt.tools.fault_suite.common import child_init, engine_cfg, op_phases, run_url, stamp
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.report import ScenarioResult

WORLD = 2
ROWS = (24, 10)  # odd splits for the optimizer's step count, even for the rest: both kinds of chunk
CHILD_TIMEOUT = 180.0  # harness guard for a hung gloo peer; cases finish in seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, ROWS[0]),
        torch.nn.Tanh(),
        torch.nn.Linear(ROWS[0], ROWS[1]),
        torch.nn.Tanh(),
        torch.nn.Linear(ROWS[1], 3),
    )


def expected(step: int, i: int, shape) -> torch.Tensor:
    """The value of the ``i``-th tensor (sorted FQN order) at ``step``: exact in float32, unique per step."""
    n = 1
    for d in shape:
        n *= d
    return (stamp(step) + 100 * i + torch.arange(n, dtype=torch.float32) * 0.25).reshape(shape)


class _Rank:
    """One rank: a gloo group member with an FSDP2 model + Adam whose state is a function of the step."""

    def __init__(self, cfg: dict, rank: int, port: int, storage=None, seed: int = 0) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from rl_ckpt._core.engine import CheckpointEngine

        child_init()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=CHILD_TIMEOUT / 2),
        )
        self.rank = rank
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _model(seed)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.model(torch.ones(2, 16)).sum().backward()  # Adam's state exists from the first step on
        self.optim.step()
        self.optim.zero_grad()
        self.engine = CheckpointEngine(**cfg, storage=storage, rank=rank, world_size=WORLD)
        self.engine.register("policy", self.model)
        self.engine.register("optim", self.optim)

    def tensors(self) -> dict:
        """FQN -> live tensor (DTensor or plain) of every parameter and optimizer state, in a fixed order."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        out = {f"model.{k}": v for k, v in msd.items()}
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                out[f"optim.{fqn}.{k}"] = v
        return dict(sorted(out.items()))

    def set_step(self, step: int) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            for i, (_k, t) in enumerate(self.tensors().items()):
                full = expected(step, i, tuple(t.shape)).to(t.dtype)
                if isinstance(t, DTensor):
                    t.to_local().copy_(
                        distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local()
                    )
                else:
                    t.copy_(full)

    def mismatches(self, step: int) -> list[str]:
        """Tensors whose gathered value is not ``step``'s (a collective: every rank calls it)."""
        from torch.distributed.tensor import DTensor

        bad = []
        for i, (k, t) in enumerate(self.tensors().items()):
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if not torch.equal(full.detach(), expected(step, i, tuple(t.shape)).to(t.dtype)):
                bad.append(k)
        return bad

    def close(self) -> None:
        import torch.distributed as dist

        self.engine.close()
        dist.destroy_process_group()


def _child_save(cfg: dict, rank: int, port: int, step: int, kill_rank: int, nth: int, record: bool, conn) -> None:
    """Save ``step`` on this rank; the ``kill_rank`` rank SIGKILLs itself right before its ``nth`` storage call."""
    from rl_ckpt._storage import LocalStorage
    from rl_ckpt.tools.faults import FaultyStorage

    storage = FaultyStorage(LocalStorage(run_url(cfg)))
    try:
        me = _Rank(cfg, rank, port, storage)
        me.set_step(step)
        storage.ops.clear()
        if rank == kill_rank:
            storage.before("*", lambda: os.kill(os.getpid(), signal.SIGKILL), nth=nth)
        me.engine.save(step)
        conn.send_bytes(json.dumps({"ack": step, "ops": storage.ops if record else []}).encode())
        me.close()
    except BaseException as exc:  # the peer died: a failed collective or a CheckpointError, as it may
        conn.send_bytes(json.dumps({"error": f"{type(exc).__name__}: {str(exc)[:300]}"}).encode())
    os._exit(0)


def _child_check(cfg: dict, rank: int, port: int, save_after: int, conn) -> None:
    """Restore on this rank (other initial values), gather, compare with the restored step; then save ``save_after``."""
    out: dict = {"rank": rank}
    try:
        me = _Rank(cfg, rank, port, seed=100 + rank)
        try:
            result = me.engine.restore()
        except Exception as exc:
            out["restore_error"] = f"{type(exc).__name__}: {exc}"
        else:
            out.update(
                snapshot=result.snapshot_id,
                step=result.global_step,
                fresh=result.fresh,
                skipped={k: str(v) for k, v in result.skipped.items()},
            )
            out["mismatch"] = me.mismatches(result.global_step) if not result.fresh else []
        if save_after is not None and "restore_error" not in out:
            me.set_step(save_after)
            try:
                me.engine.save(save_after)
                out["saved"] = save_after
            except Exception as exc:
                out["save_error"] = f"{type(exc).__name__}: {exc}"
        me.close()
    except BaseException as exc:
        out["crash"] = f"{type(exc).__name__}: {exc}"
    conn.send_bytes(json.dumps(out, default=str).encode())
    os._exit(0)


def _pair(suite: Suite, fn, args: tuple) -> list[tuple[int | None, dict]]:
    """Run ``fn`` as ranks 0 and 1 of a new gloo group; each rank's (exit code, last message)."""
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        recv, send = suite.ctx.Pipe(duplex=False)
        p = suite.ctx.Process(target=fn, args=(args[0], rank, port, *args[1:], send), daemon=True)
        p.start()
        send.close()
        procs.append((p, recv))
    out = []
    for p, recv in procs:
        p.join(CHILD_TIMEOUT)
        if p.is_alive():  # a rank stuck on its dead peer: the harness ends it
            p.kill()
            p.join(10)
        msg: dict = {}
        while recv.poll(0):
            try:
                msg = json.loads(recv.recv_bytes())
            except (EOFError, ValueError):
                break
        recv.close()
        out.append((p.exitcode, msg))
    return out


def sharded(suite: Suite) -> ScenarioResult:
    """Kill one rank of a 2-rank FSDP2 save at every storage call; damage chunks of a committed sharded snapshot."""
    res = ScenarioResult("sharded", "2-rank FSDP2 save: SIGKILL of one rank at every storage call; damaged chunks")
    prof = suite.profile
    tpl = _template(suite)
    ops = _record(suite, tpl)
    jobs = []
    stride = prof.sharded_kill_stride
    # Rank 0 commits; rank 1 writes its files into the attempt, then (after the commit) reads the catalog.
    marks = [op_phases(ops[0]), ["write" if path.startswith(".staging") else "after-commit" for _op, path in ops[1]]]
    first = [marks[0].index("commit") % stride if "commit" in marks[0] else 0, 0]  # the commit call is always one
    for rank in range(WORLD):
        for k in range(first[rank], len(ops[rank]), stride):
            jobs.append(lambda part, rank=rank, k=k: _kill(suite, part, tpl, rank, k, ops[rank][k][0], marks[rank][k]))
        suite.progress(f"  sharded: rank {rank} makes {len(ops[rank])} storage calls in a save")
    for i, (comp, rank) in enumerate((c, r) for c in ("policy", "optim") for r in range(WORLD)):
        jobs.append(lambda part, comp=comp, rank=rank: _damage(suite, part, tpl, comp, rank, "flip"))
        if prof.name == "long" or i % 2 == 0:  # a truncation is caught by the size check, before any rank reads
            jobs.append(lambda part, comp=comp, rank=rank: _damage(suite, part, tpl, comp, rank, "truncate"))
    # Each case is two gloo processes: run them one pair at a time, so 2 cores are not oversubscribed.
    workers, suite.workers = suite.workers, 1
    try:
        suite.run_jobs(res, jobs)
    finally:
        suite.workers = workers
    return res


def _cfg(parent: str) -> dict:
    return engine_cfg(parent, retention=False)


def _template(suite: Suite) -> str:
    """A run with steps 1 and 2 committed by a 2-rank sharded save."""
    parent = os.path.join(suite.root, "_templates", "sharded")
    cfg = _cfg(parent)
    os.makedirs(run_url(cfg), exist_ok=True)
    for step in (1, 2):
        for code, msg in _pair(suite, _child_save, (cfg, step, -1, 0, False)):
            if msg.get("ack") != step:
                raise RuntimeError(f"sharded template: save {step} failed (exit {code}): {msg}")
    return run_url(cfg)


def _record(suite: Suite, tpl: str) -> list[list[tuple[str, str]]]:
    target = suite.case("sharded-record", {"retention": False}, tpl)
    ops = [msg.get("ops") for _code, msg in _pair(suite, _child_save, (target.cfg, 3, -1, 0, True))]
    suite.done(target, True)
    if not all(ops):
        raise RuntimeError(f"sharded: recording a save failed: {ops}")
    return [[tuple(o) for o in rank_ops] for rank_ops in ops]


def _kill(suite: Suite, part: ScenarioResult, tpl: str, rank: int, k: int, op: str, mark: str) -> None:
    target = suite.case(f"sharded-kill-r{rank}-{k}", {"retention": False}, tpl)
    before = target.outside()
    outcome = _pair(suite, _child_save, (target.cfg, 3, rank, k + 1, False))
    part.tried += 1
    part.injected[f"SIGKILL of rank {rank} before a storage call"] += 1
    part.note(f"rank {rank} kill points in phase {mark}")
    label = f"kill rank {rank} before call {k} ({op}, {mark})"
    if outcome[rank][0] != -signal.SIGKILL:
        part.violate("2 ranks", label, "harness", f"kill point not reached: rank {rank} exited {outcome[rank][0]}")
    acked = any(msg.get("ack") == 3 for _c, msg in outcome)
    if acked:
        part.note("kills after the save was acknowledged by the other rank")
    ok = _check(
        suite,
        part,
        label,
        target,
        must_list={1, 2} | ({3} if acked else set()),
        allowed={1, 2, 3},
        acked_max=3 if acked else 2,
        in_flight=3,
        outside_before=before,
    )
    suite.done(target, ok)


def _damage(suite: Suite, part: ScenarioResult, tpl: str, comp: str, rank: int, how: str) -> None:
    target = suite.case(f"sharded-{how}-{comp}-r{rank}", {"retention": False}, tpl)
    before = target.outside()
    sid = "step_000000002"
    with open(os.path.join(target.run, sid, "meta.json")) as f:
        meta = json.load(f)
    name = f"{comp}.rank{rank}.safetensors"
    path = os.path.join(target.run, sid, name)
    chunks = [
        c for t in meta["components"][comp]["layout"]["tensors"].values() for c in t["chunks"] if c["file"] == name
    ]
    chunk = max(chunks, key=lambda c: c["start"])  # the last chunk: a truncation cuts into it too
    with open(path, "r+b") as f:
        if how == "flip":
            f.seek(chunk["start"] + 1)
            byte = f.read(1)
            f.seek(chunk["start"] + 1)
            f.write(bytes([byte[0] ^ 0x20]))
        else:
            f.truncate(os.path.getsize(path) - 3)
    part.tried += 1
    part.injected[f"{how} in a rank's chunk"] += 1
    part.corruptions_injected += 1
    label = f"{how} {name} of {sid}"
    ok = _check(
        suite,
        part,
        label,
        target,
        must_list=set(),
        allowed={1, 2},
        acked_max=None,
        in_flight=None,
        outside_before=before,
        damaged=frozenset({sid}),
        expect_rollback=(sid, rank, name, how == "truncate"),
    )
    if ok:
        part.corruptions_detected += 1
    suite.done(target, ok)


def _check(
    suite: Suite,
    res: ScenarioResult,
    label: str,
    target,
    *,
    must_list: set[int],
    allowed: set[int],
    acked_max: int | None,
    in_flight: int | None,
    outside_before: dict,
    damaged: frozenset = frozenset(),
    expect_rollback: tuple[str, int, str, bool] | None = None,
) -> bool:
    """The suite's invariants for a sharded run: one complete snapshot restored bitwise on both ranks, together.

    ``expect_rollback``: (damaged snapshot, the rank reading the damaged chunk, its file, whether a size check
    may catch it before any rank reads: a truncation) -- both ranks must fall back to step 1 together.
    """
    from rl_ckpt._core.engine import CheckpointEngine
    from rl_ckpt._run.gc import find_debris

    n_before = len(res.violations)
    variant = "2 ranks"
    seen: set[str] = set()

    def bad(kind: str, msg: str) -> None:
        if kind not in seen:
            seen.add(kind)
            res.violate(variant, label, kind, msg)

    try:
        look = CheckpointEngine(**target.cfg)
        listed = sorted(i.global_step for i in look.snapshots())
        report = look.verify()
        look.close()
        if must_list - set(listed):
            bad("acked_lost", f"acknowledged step(s) {sorted(must_list - set(listed))} not listed (listed: {listed})")
        if set(listed) - allowed:
            bad("unexpected", f"snapshots {sorted(set(listed) - allowed)} listed; only {sorted(allowed)} may be")
        if set(report.bad_snapshots) - damaged:
            bad("broken_listed", f"verify: {report}")
        if damaged and not set(report.bad_snapshots) & damaged:
            bad("undetected", f"verify did not flag the damaged {sorted(damaged)}")
        outcome = [msg for _code, msg in _pair(suite, _child_check, (target.cfg, 9))]
        for msg in outcome:
            if not msg or "crash" in msg or "restore_error" in msg:
                bad("restore_failed", f"rank {msg.get('rank', '?')}: {msg.get('crash') or msg.get('restore_error')}")
        if "restore_failed" not in seen:
            steps = {m["step"] for m in outcome}
            if len(steps) != 1:
                bad("corrupt_load", f"the ranks restored different snapshots: {[m['snapshot'] for m in outcome]}")
            step = outcome[0]["step"]
            if outcome[0]["fresh"]:
                bad("acked_lost", f"restore started fresh with {listed} listed")
            elif any(m["mismatch"] for m in outcome):
                bad(
                    "corrupt_load",
                    f"restored step {step}, but these tensors are not its: "
                    f"{sorted({k for m in outcome for k in m['mismatch']})[:6]}",
                )
            if acked_max is not None and step < acked_max:
                bad("acked_lost", f"restored step {step} < acknowledged step {acked_max}")
            if in_flight is not None:
                res.max_rolled_back = max(res.max_rolled_back, in_flight - step)
            skipped = {k: v for m in outcome for k, v in m["skipped"].items()}
            if set(skipped) - damaged:
                bad("broken_listed", f"restore skipped {skipped}")
            if expect_rollback is not None:
                sid, rank, name, size_check = expect_rollback
                if step != 1 or sid not in skipped:
                    bad("undetected", f"restored step {step} (skipped {skipped}); expected a joint fall back to step 1")
                elif f"rank {rank}" not in skipped[sid] and not (size_check and name in skipped[sid]):
                    bad(
                        "undetected",
                        f"the damage in {name} was not reported by rank {rank}, which reads it: {skipped[sid]}",
                    )
            for m in outcome:
                if m.get("saved") != 9:
                    bad("later_save", f"rank {m['rank']}: a later save of step 9 failed: {m.get('save_error')}")
        target.gc()
        look = CheckpointEngine(**target.cfg)
        after = look.verify()
        if set(after.bad_snapshots) - damaged:
            bad("gc", f"verify after gc and a later save: {after}")
        look.close()
        left = [d.path for d in find_debris(target.storage(), grace_seconds=0)]
        if left:
            bad("gc", f"gc left debris: {left[:5]}")
    except Exception as exc:  # a suite bug or an error where none was due
        bad("crash", f"{type(exc).__name__}: {exc}")
    if target.outside() != outside_before:
        bad("escape", "something outside the run folder changed")
    return len(res.violations) == n_before
