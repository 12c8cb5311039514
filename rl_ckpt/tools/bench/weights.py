"""``rl-ckpt bench weights``: a policy delivered to rollout actors as versions, next to the object-store floor.

    rl-ckpt bench weights [--size 1GiB] [--receivers 4] [--rounds 5] [--changed 0.05] [--json FILE]
                          [--profile FILE] [--by-process]

On a Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``: the head, where the learner
(this process) publishes, and a worker node), ``--receivers`` rollout actors, half on each node, each holding
a module of the policy's shape (fp32, ``--size`` bytes in 16 tensors). Measured in the same run:

- ``safetensors``: the policy written to one ``.safetensors`` file (``save_file``, timed apart), then every
  receiver loading it (``load_file``) and copying it into its module, at once (warm page cache: same disk);
- then, after an untimed warm-up (versions 0 and 1: the stores started, the receivers' nodes known to the
  publisher, the stores' memory touched once; and ``WARM_ROUNDS`` rounds just as the timed ones: the first
  rounds of each kind after the other took the object store are several times slower, the floor's 6.2 and
  3.5 s against 1.5 s at 1 GiB), ``--rounds`` rounds of, in turn:

  - ``floor``: ``ray.put`` of the policy once, ``ray.get`` by every receiver at once and a copy into its
    module's parameters (what any delivery must at least do: move the bytes to each node and into each
    module; a real worker needs no more, its weights end up in its module);
  - ``full``: ``PolicyVersions.publish`` (write, verify, commit, place on the receivers' other node) of a
    version whose every chunk changed, then every receiver's ``WeightSubscriber.pull`` of it at once
    (pin, verify, copy into the module), then (untimed in the ratios) ``PolicyVersions.wait_owned``: the stores
    borrow the publisher's objects at publish and own copies in the background (``owned_after_pulls_s``: how
    long after the pulls that finished); ``full_vs_floor`` is (publish + pulls) / floor of the same round,
    ``pull_vs_floor`` the pulls alone / floor; the figures are the rounds' medians (each round in ``rounds``);
    ``full_vs_best_floor``: the median full version against the fastest floor round (the stricter figure);

- ``delta``: ``--changed`` of the 8 MiB chunks changed (rounded to whole chunks: ``changed_fraction``; one
  element each), published and pulled: ``delta_bytes_fraction`` = bytes moved into a module / the policy's
  bytes (``delta_vs_changed``: / the changed chunks' bytes);
- ``restart``: a receiver on the worker node killed and started again: seconds from asking for the new actor
  to it holding the newest version (``restart_total_s``; the pull alone: ``restart_pull_s``).

``--by-process``: each round's CPU seconds (user + system, ``/proc/<pid>/stat``) by kind of process (the
learner, the receivers, the version stores, the raylets, other Ray processes), for the floor and the full
version (``cpu_by_process``: medians; each round's in ``rounds``): where a full version's work goes.

Every figure is wall-clock time on this machine as it is (a shared machine's load shows in ``loadavg``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

from rl_ckpt.tools.bench.common import CpuWork, ProcessWork, human, log, parse_size, print_json, rmtree

TENSORS = 16
CHUNK = 8 << 20  # run/dedup.py's chunk size: what "a changed chunk" means
PULL_FIGURES = ("seconds", "place_seconds", "node_bytes_copied", "bytes_vouched")  # kept of each pull, per round
WARM_ROUNDS = 3  # untimed rounds (floor, then full version) before the timed ones (see the module docstring)


def make_policy(nbytes: int):
    import torch

    per = max(nbytes // TENSORS // 4, 1)
    module = torch.nn.Module()
    for i in range(TENSORS):
        module.register_parameter(f"w{i:02d}", torch.nn.Parameter(torch.zeros(per), requires_grad=False))
    return module


class Receiver:
    """A rollout actor: a module of the policy's shape, and the three ways of getting weights into it."""

    def __init__(self, run: str, nbytes: int, namespace: str) -> None:
        import torch

        from actors.weight_subscriber import WeightSubscriber

        torch.set_num_threads(1)
        self.module = make_policy(nbytes)
        self.sub = WeightSubscriber(run, namespace=namespace)

    def ready(self) -> str:
        return self.sub.storage.node_id

    def from_object(self, refs: list) -> float:
        import numpy as np
        import ray

        started = time.perf_counter()
        state = ray.get(refs[0])
        for k, t in self.module.state_dict().items():
            np.copyto(t.detach().numpy(), state[k])
        return time.perf_counter() - started

    def from_file(self, path: str) -> float:
        import torch
        from safetensors.torch import load_file

        started = time.perf_counter()
        state = load_file(path)
        with torch.no_grad():
            for k, t in self.module.state_dict().items():
                t.copy_(state[k])
        return time.perf_counter() - started

    def pull(self) -> dict:
        return self.sub.pull(self.module).to_json()

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.module.state_dict().values()))


def floor_round(policy, receivers) -> tuple[float, float]:
    """The object-store floor once: ``ray.put`` of the policy, every receiver ``ray.get`` + copy into its module.
    Returns (seconds in all, of which the ``ray.put``)."""
    import ray

    started = time.perf_counter()
    ref = ray.put({k: v.numpy() for k, v in policy.state_dict().items()})
    put_s = time.perf_counter() - started
    ray.get([r.from_object.remote([ref]) for r in receivers])
    return time.perf_counter() - started, put_s


def bump(policy, step: int) -> None:
    """A training step's worth of change: every chunk new (by less than 1 in total: tensor i never becomes an
    earlier version's tensor i + 1, which content addressing would recognise)."""
    import torch

    with torch.no_grad():
        for t in policy.state_dict().values():
            t.add_(0.5 ** (step + 1))


def process_kind(pid: int, cmdline: str) -> str | None:
    """What a process of this machine is to the bench (``--by-process``): this one is the learner."""
    if pid == os.getpid():
        return "learner"
    if "ray::Receiver" in cmdline:
        return "receivers"
    if "ray::MemoryStore" in cmdline:
        return "stores"
    if "/raylet" in cmdline.split(" ", 1)[0]:
        return "raylets"  # (each node's object store and its transfers)
    return "other ray" if "ray" in cmdline else "other"


def run(args) -> dict:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from actors.policy_versions import PolicyVersions, versions_storage

    nbytes, n = parse_size(args.size), args.receivers
    store = nbytes * 6 + (256 << 20)  # room for every copy in flight: a full object store spills to disk
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 64}, "object_store_memory": store}
    )
    cluster.add_node(num_cpus=1, resources={"worker": 64}, object_store_memory=store)
    cluster.wait_for_nodes()
    namespace, run_name = "bench-weights", f"bench-{uuid.uuid4().hex[:6]}"
    ray.init(address=cluster.address, namespace=namespace, logging_level="ERROR")
    tmp = tempfile.mkdtemp(prefix="rl-ckpt-bench-weights-", dir=args.dir)
    out: dict = {"bytes": nbytes, "receivers": n, "loadavg_start": os.getloadavg()}
    try:
        torch.set_num_threads(1)
        policy = make_policy(nbytes)
        with torch.no_grad():
            for i, t in enumerate(policy.state_dict().values()):
                t.copy_(torch.arange(t.numel(), dtype=torch.float32).mul_(1e-6).add_(i))
        cls = ray.remote(num_cpus=0, max_restarts=0)(Receiver)
        sides = ["head" if i % 2 == 0 else "worker" for i in range(n)]
        receivers = [cls.options(resources={s: 1}).remote(run_name, nbytes, namespace) for s in sides]
        nodes = ray.get([r.ready.remote() for r in receivers])
        log(f"{n} receivers on {len(set(nodes))} nodes; policy {human(nbytes)}")

        from safetensors.torch import save_file

        path = os.path.join(tmp, "policy.safetensors")
        started = time.perf_counter()
        save_file({k: v.contiguous() for k, v in policy.state_dict().items()}, path)
        out["safetensors_write_s"] = time.perf_counter() - started
        started = time.perf_counter()
        ray.get([r.from_file.remote(path) for r in receivers])
        out["safetensors_load_s"] = time.perf_counter() - started
        log(
            f"safetensors: write {out['safetensors_write_s']:.2f} s, every receiver loading it "
            f"{out['safetensors_load_s']:.2f} s"
        )

        versions = PolicyVersions(run_name, policy, replicas=0, namespace=namespace, keep=2)
        # Warm-up, untimed: versions 0 and 1 (they start the version stores, tell them where the receivers are,
        # and fill the stores' memory once, as a run's earlier versions have), then ``WARM_ROUNDS`` rounds just as
        # the timed ones: what is timed is both in a run's steady state, every chunk of each version new. (The
        # first rounds of each after the other took the object store are the slow ones: timing them would favour
        # whichever had more warm-up.)
        for step in range(2):
            bump(policy, step)
            versions.publish(step)
            ray.get([r.pull.remote() for r in receivers])
        versions.wait_owned(timeout=600)
        rounds, warmup, step = [], [], 2
        for _round in range(-WARM_ROUNDS, args.rounds):  # floor and full version in turns: the same load for both
            cpu = CpuWork()
            procs = ProcessWork(process_kind) if args.by_process else None
            cpu.start()
            if procs:
                procs.start()
            floor_s, floor_put_s = floor_round(policy, receivers)
            floor_cpu_s, floor_steal_s = cpu.stop()
            floor_by_process = procs.stop() if procs else None
            bump(policy, step)
            pushed = versions.storage.pushed_bytes
            profiler = None
            if args.profile and _round == args.rounds - 1:  # (the last timed round)
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            cpu.start()
            if procs:
                procs.start()
            started = time.perf_counter()
            versions.publish(step)
            publish_s = time.perf_counter() - started
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(args.profile)  # read it with: python -m pstats FILE
            started = time.perf_counter()
            pulls = ray.get([r.pull.remote() for r in receivers])
            pull_s = time.perf_counter() - started
            full_cpu_s, full_steal_s = cpu.stop()
            full_by_process = procs.stop() if procs else None
            started = time.perf_counter()  # untimed in the ratio: the stores owning their copies in the background
            owned = versions.wait_owned(timeout=600)  # (done before the next round: no round pays for another's)
            own_s = time.perf_counter() - started
            (rounds if _round >= 0 else warmup).append(
                {
                    "floor_s": floor_s,
                    "floor_put_s": floor_put_s,
                    "floor_cpu_s": floor_cpu_s,  # CPU seconds of every process (CpuWork), and stolen by the host
                    "floor_steal_s": floor_steal_s,
                    "full_cpu_s": full_cpu_s,
                    "full_steal_s": full_steal_s,
                    "publish_s": publish_s,
                    "pull_s": pull_s,
                    "full_vs_floor": (publish_s + pull_s) / floor_s,
                    "owned_after_pulls_s": own_s,
                    "owned": owned,
                    "node_bytes_copied": versions.storage.pushed_bytes
                    - pushed
                    + sum(p["node_bytes_copied"] for p in pulls),
                    "pulls": [{k: p[k] for k in PULL_FIGURES} for p in pulls],
                }
                | ({"by_process": {"floor": floor_by_process, "full": full_by_process}} if procs else {})
            )
            log(
                (f"round {_round + 1}" if _round >= 0 else f"warm-up round {_round + WARM_ROUNDS + 1} (untimed)")
                + f": floor {floor_s:.2f} s (its put {floor_put_s:.2f} s), full version: publish {publish_s:.2f} s + "
                f"pulls {pull_s:.2f} s = {(publish_s + pull_s) / floor_s:.2f} x floor; the stores "
                f"owned it {own_s:.2f} s after the pulls"
                + (
                    f"; CPU seconds (every process): floor {floor_cpu_s:.2f}, full version {full_cpu_s:.2f}"
                    f" (stolen by the host: {floor_steal_s:.2f}, {full_steal_s:.2f})"
                    if floor_cpu_s is not None
                    else ""
                )
            )
            step += 1
        out["rounds"], out["warmup_rounds"] = rounds, warmup
        for key in ("floor_s", "publish_s", "pull_s", "full_vs_floor", "owned_after_pulls_s"):
            out[key] = statistics.median(r[key] for r in rounds)
        out["full_s"] = out["publish_s"] + out["pull_s"]
        out["floor_best_s"] = min(r["floor_s"] for r in rounds)  # a busy machine's floor varies by rounds:
        out["full_vs_best_floor"] = out["full_s"] / out["floor_best_s"]  # the median full against the best floor
        out["pull_vs_floor"] = statistics.median(r["pull_s"] / r["floor_s"] for r in rounds)  # receivers alone
        if all(r["floor_cpu_s"] for r in rounds):  # the work done, whatever the scheduling: full / floor
            out["full_vs_floor_cpu"] = statistics.median(r["full_cpu_s"] / r["floor_cpu_s"] for r in rounds)
        if args.by_process:  # kind -> median CPU seconds a round, for the floor and the full version
            out["cpu_by_process"] = {
                phase: {
                    kind: statistics.median(r["by_process"][phase].get(kind, 0.0) for r in rounds)
                    for kind in sorted({k for r in rounds for k in r["by_process"][phase]})
                }
                for phase in ("floor", "full")
            }
            for phase, kinds in out["cpu_by_process"].items():
                shares = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items())
                log(f"CPU seconds by process, {phase} (medians): {shares}")
        out["full_bytes"] = pulls[0]["bytes_total"]
        out["node_bytes_copied"] = rounds[-1]["node_bytes_copied"]  # into the worker node, per version
        want = float(sum(t.double().sum() for t in policy.state_dict().values()))
        out["full_checked"] = all(
            abs(c - want) < 1e-6 * abs(want) + 1e-6 for c in ray.get([r.checksum.remote() for r in receivers])
        )
        log(
            f"full version: publish {out['publish_s']:.2f} s + pulls {out['pull_s']:.2f} s = "
            f"{out['full_vs_floor']:.2f} x floor (the pulls alone {out['pull_vs_floor']:.2f} x; against the best "
            f"floor, {out['floor_best_s']:.2f} s: {out['full_vs_best_floor']:.2f} x); "
            f"{human(out['node_bytes_copied'])} copied between nodes"
        )

        chunks = [
            (t, start) for t in policy.state_dict().values() for start in range(0, t.numel() * t.element_size(), CHUNK)
        ]
        # ``--changed`` of the chunks, rounded to whole chunks (32 chunks: 5 % is 2 of them, 6.25 %; 128 chunks,
        # 1 GiB: 6, 4.7 %), spread evenly: one element of each changed chunk.
        count = min(len(chunks), max(1, round(args.changed * len(chunks)))) if args.changed > 0 else 0
        picked = {int((j + 0.5) * len(chunks) / count) for j in range(count)} if count else set()
        with torch.no_grad():
            for i in sorted(picked):
                t, start = chunks[i]
                t.view(-1)[start // t.element_size()].add_(1.0)
        changed = len(picked)
        out["chunks_changed"], out["chunks"] = changed, len(chunks)
        out["changed_fraction"] = changed / len(chunks)  # what ``delta_bytes_fraction`` is to be read against
        started = time.perf_counter()
        versions.publish(step)
        out["delta_publish_s"] = time.perf_counter() - started
        started = time.perf_counter()
        pulls = ray.get([r.pull.remote() for r in receivers])
        out["delta_pull_s"] = time.perf_counter() - started
        out["delta_bytes"] = pulls[0]["bytes_moved"]
        out["delta_bytes_fraction"] = out["delta_bytes"] / out["full_bytes"]
        out["delta_vs_changed"] = out["delta_bytes"] / max(1, changed * CHUNK)  # 1.0: exactly the changed chunks
        log(
            f"delta ({changed} of {len(chunks)} chunks changed): {human(out['delta_bytes'])} moved per receiver = "
            f"{out['delta_bytes_fraction']:.3f} of full; publish {out['delta_publish_s']:.2f} s, pulls "
            f"{out['delta_pull_s']:.2f} s"
        )

        victim = sides.index("worker") if "worker" in sides else 0
        ray.kill(receivers[victim], no_restart=True)
        started = time.perf_counter()
        receivers[victim] = cls.options(resources={sides[victim]: 1}).remote(run_name, nbytes, namespace)
        ray.get(receivers[victim].ready.remote())
        got = ray.get(receivers[victim].pull.remote())
        out["restart_total_s"] = time.perf_counter() - started
        out["restart_pull_s"] = got["seconds"]
        out["restart_version"] = got["version"]
        log(
            f"restarted receiver: version {got['version']} after {out['restart_total_s']:.2f} s "
            f"(the pull {got['seconds']:.2f} s)"
        )
        versions.close()
        versions_storage(run_name, namespace=namespace).destroy()
        out["loadavg_end"] = os.getloadavg()
    finally:
        rmtree(tmp)
        ray.shutdown()
        cluster.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rl-ckpt bench weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="bytes of the fp32 policy (default 1GiB)")
    parser.add_argument("--receivers", type=int, default=4, help="rollout actors, half on each node (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of floor + full version (median)")
    parser.add_argument("--changed", type=float, default=0.05, help="fraction of chunks changed for the delta")
    parser.add_argument("--dir", default=None, help="folder for the safetensors file (default: the temp dir)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--profile", default=None, help="cProfile the last round's publish into this pstats file")
    parser.add_argument(
        "--by-process",
        action="store_true",
        help="also count each round's CPU seconds by kind of process (learner, receivers, stores, raylets, ...)",
    )
    args = parser.parse_args(argv)
    print_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
