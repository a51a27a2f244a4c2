"""A tiny data-parallel job that loses a rank and keeps going (the core, no TensorFlow).

    elastic-hvd-run -np 4 --faults "rank=2,coll=30,delay=0.005" python examples/recovery_demo.py

Each rank computes a "gradient" of a least-squares model on its shard, the ranks
average it with a resilient allreduce, and rank 0 prints what happened.
"""

import time

import numpy as np

from elastic_hvd import core


def main(steps=60, features=256, batch=512):
    comm = core.init()
    comm.listeners.add(lambda e: comm.rank == 0 and print(
        f"  !! lost original rank(s) {list(e.lost)}: {e.old_size} -> {e.new_size} ranks, "
        f"detected in {e.detect_s * 1e3:.1f} ms, repaired in {e.repair_s * 1e3:.2f} ms",
        flush=True))
    rng = np.random.default_rng(comm.original_id)
    true_w = np.linspace(-1, 1, features)
    w = comm.broadcast(np.zeros(features))
    if comm.rank == 0:
        print("step  ranks  loss      step time", flush=True)
    for step in range(1, steps + 1):
        started = time.perf_counter()
        x = rng.normal(size=(batch, features))
        y = x @ true_w
        grad = x.T @ (x @ w - y) / batch
        grad = comm.allreduce(grad, op=core.Average)
        w -= 0.05 * grad
        loss = comm.allreduce(np.array([np.mean((x @ w - y) ** 2)]), op=core.Average)[0]
        if comm.rank == 0 and (step % 10 == 0 or comm.events and comm.events[-1].sequence == step):
            elapsed_ms = 1e3 * (time.perf_counter() - started)
            print(f"{step:4d}  {comm.size:5d}  {loss:.6f}  {elapsed_ms:.1f} ms", flush=True)
    if comm.rank == 0:
        print(f"done on {comm.size} of {comm.initial_size} ranks; events: "
              f"{[e.as_dict() for e in comm.events]}", flush=True)


if __name__ == "__main__":
    main()
