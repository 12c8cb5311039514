"""Ray's cost per object: 1 GiB moved as 128 objects of 8 MiB or as 16 of 64 MiB, in turns.

    python benchmarks/ray_object_granularity.py

Each round puts the objects, hands their refs to a store-like actor on each of two nodes
(``ray.cluster_utils.Cluster``; the worker node's actor moves them there), then 4 receivers (2 per node) get
the refs from their node's actor, map the objects and copy them out. Prints the wall time and the CPU seconds
every process of the machine spent (``/proc/stat``), rounds 3-8 (the first two warm up)."""

import os
import sys
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rl_ckpt.tools.bench.common import CpuWork  # noqa: E402

G = 1 << 30
head = {"num_cpus": 1, "resources": {"head": 64}, "object_store_memory": 6 * G}
cluster = Cluster(initialize_head=True, head_node_args=head)
cluster.add_node(num_cpus=1, resources={"worker": 64}, object_store_memory=6 * G)
cluster.wait_for_nodes()
ray.init(address=cluster.address, logging_level="ERROR")


@ray.remote(num_cpus=0)
class Store:
    def __init__(self):
        self.refs = []

    def borrow(self, refs, place):
        if place:
            ray.wait(refs, num_returns=len(refs), fetch_local=True)
            self.vals = ray.get(refs)
        self.refs = refs
        return len(refs)

    def get_many(self):
        return [[r] for r in self.refs]


@ray.remote(num_cpus=0)
class Recv:
    def __init__(self):
        self.out = np.empty(G, dtype=np.uint8)

    def pull(self, store):
        got = ray.get(store.get_many.remote())
        datas = ray.get([g[0] for g in got])
        pos = 0
        for d in datas:
            n = d.nbytes
            self.out[pos : pos + n] = d
            pos += n
        return pos


src = np.random.randint(0, 255, size=G, dtype=np.uint8)
stores = {s: Store.options(resources={s: 1}).remote() for s in ("head", "worker")}
rs = [Recv.options(resources={"head" if i % 2 == 0 else "worker": 1}).remote() for i in range(4)]
ray.get([s.get_many.remote() for s in stores.values()])
cpu = CpuWork()
for rnd in range(8):
    for n in (128, 16):
        size = G // n
        cpu.start()
        t = time.perf_counter()
        refs = [ray.put(src[i * size : (i + 1) * size]) for i in range(n)]
        ray.get([stores["head"].borrow.remote(refs, False), stores["worker"].borrow.remote(refs, True)])
        pub = time.perf_counter() - t
        got = ray.get([r.pull.remote(stores["head" if i % 2 == 0 else "worker"]) for i, r in enumerate(rs)])
        wall = time.perf_counter() - t
        work, steal = cpu.stop()
        del refs
        ray.get([s.borrow.remote([], False) for s in stores.values()])
        if rnd >= 2:
            print(f"{n:4d} objects: publish {pub:.2f} s, total {wall:.2f} s, CPU {work:.2f} s", flush=True)
ray.shutdown()
cluster.shutdown()
