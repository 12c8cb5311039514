"""What one ``ray.put`` of a publish's batch costs by its shape: 1 GiB put as 16 batches of 64 MiB, each batch
a list of 8 arrays of 8 MiB (what a policy-version publish puts today: one item per chunk), one array of
64 MiB, or 64 arrays of 1 MiB, in turns.

    python benchmarks/ray_put_shape.py [--rounds 8]

Ray copies each array of a put into its object store with several threads when it is larger than 1 MiB
(starting them for each array), and on the calling thread otherwise. Prints, for each shape, the wall time and
this process's CPU seconds (``getrusage``, the copy threads included) of putting the 16 batches: medians of
``--rounds`` rounds after one untimed round of each (the object store's first touch of its memory)."""

import argparse
import resource
import statistics
import time

import numpy as np
import ray

MIB = 1 << 20
BATCH = 64 * MIB


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batch_items(block: np.ndarray, shape: str) -> list:
    piece = {"8 x 8 MiB": 8 * MIB, "1 x 64 MiB": BATCH, "64 x 1 MiB": MIB}[shape]
    return [block[i : i + piece] for i in range(0, block.nbytes, piece)]


def put_all(source: np.ndarray, shape: str) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    refs = [ray.put(batch_items(source[i : i + BATCH], shape)) for i in range(0, source.nbytes, BATCH)]
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    del refs  # (the next round reuses the store's memory)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=1, object_store_memory=4 << 30, logging_level="ERROR")
    source = np.frombuffer(np.random.default_rng(0).bytes(1 << 30), dtype=np.uint8)
    shapes = ["8 x 8 MiB", "1 x 64 MiB", "64 x 1 MiB"]
    figures: dict[str, list] = {s: [] for s in shapes}
    for round_ in range(args.rounds + 1):
        for shape in shapes:
            measured = put_all(source, shape)
            if round_:  # (round 0: untimed)
                figures[shape].append(measured)
    print(f"ray.put of 1 GiB as 16 batches of 64 MiB, medians of {args.rounds} rounds:")
    for shape, rows in figures.items():
        wall = statistics.median(w for w, _c in rows)
        cpu = statistics.median(c for _w, c in rows)
        print(f"  each batch {shape:>10}: {wall:.3f} s wall, {cpu:.3f} CPU s")
    ray.shutdown()


if __name__ == "__main__":
    main()
