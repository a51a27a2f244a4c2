"""Cost of ordering a graph's collectives (issue 13): microseconds per allreduce with
8 independent allreduces of 1 KiB, eagerly, in a tf.function and in a TF1 session
(there also each fed from a random op of its own, issue 19); and, in a TF1 session,
48 ``hvd.broadcast_`` each built and fetched by itself, as Horovod's
test_horovod_broadcast_inplace_cpu does: the collectives those fetches ran (counted
in the timeline) and milliseconds per fetch.

    elastic-hvd-run -np 2 python bench/graph_order_bench.py [--tf1]   # rank 0 prints JSON
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import elastic_hvd.tensorflow as hvd  # noqa: E402

OPS, CALLS, ROUNDS = 8, 100, 5


def per_op(fn):
    fn()
    best = []
    for _ in range(ROUNDS):
        hvd.barrier()
        started = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best.append((time.perf_counter() - started) / (CALLS * OPS) * 1e6)
    return round(float(np.median(best)), 1)


def build(random=False):
    """OPS independent allreduces; with ``random``, each is fed from a random op of its
    own as in Horovod's "fused" tests (chained since issue 19; MismatchError before)."""
    def source(k):
        value = tf.fill([256], float(k))
        return value + 0.0 * tf.random.uniform([256]) if random else value
    return [hvd.allreduce(source(k), op=hvd.Sum) for k in range(OPS)]


def successive_broadcasts(fetches=48):
    """Collectives run by ``fetches`` broadcast_ of new variables, each built and then
    fetched twice (Horovod's test evaluates the result, then a comparison with it),
    and milliseconds per broadcast_."""
    with tempfile.TemporaryDirectory() as folder, tf.Graph().as_default(), \
            tf.compat.v1.Session() as session:
        path = os.path.join(folder, "timeline{rank}.json")
        hvd.start_timeline(path)
        started = time.perf_counter()
        for k in range(fetches):
            v = tf.compat.v1.Variable(tf.fill([17, 17], float(hvd.rank())))
            session.run(tf.compat.v1.global_variables_initializer())
            [value] = hvd.broadcast_([v], k % hvd.size())
            session.run(value)
            session.run(tf.reduce_all(tf.equal(value, float(k % hvd.size()))))
        elapsed = time.perf_counter() - started
        hvd.stop_timeline()
        with open(path.format(rank=hvd.rank())) as f:
            ran = len(json.load(f))
    return {"fetches": 2 * fetches, "collectives_run": ran,
            "ms_per_broadcast_": round(elapsed / fetches * 1e3, 1)}


def main():
    hvd.init()
    result = {"eager": per_op(build), "function": per_op(tf.function(build))}
    report = {"us_per_allreduce": result, "size": hvd.size()}
    if "--tf1" in sys.argv:  # before issue 13, a TF1 session could mismatch or hang here
        for key, random in (("tf1", False), ("tf1_random_fed", True)):
            with tf.Graph().as_default():
                fetches = build(random)
                with tf.compat.v1.Session() as session:
                    result[key] = per_op(lambda f=fetches: session.run(f))
        report["tf1_successive_broadcast_"] = successive_broadcasts()
    if hvd.rank() == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
