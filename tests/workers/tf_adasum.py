"""Adasum through the TF layer, and the Keras wrapper's ``_compute_gradients`` and
``_agg_helper`` (Horovod's semantics), on however many ranks it is launched with;
each rank reports what it got (tests/test_adasum.py checks it).
"""

import numpy as np
import tensorflow as tf

import report
import elastic_hvd.tensorflow as hvd


def tensor(rank, k, shape):
    """As tests/test_adasum.py rebuilds it."""
    return np.random.default_rng(50 * (rank + 1) + k).normal(size=shape).astype(np.float32)


def main():
    hvd.init()
    r = hvd.rank()
    out = {}
    x = tf.constant(tensor(r, 0, (3, 4)))
    out["allreduce"] = hvd.allreduce(x, op=hvd.Adasum).numpy().tolist()
    out["allreduce_fn"] = tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum))(x).numpy().tolist()
    grouped = hvd.grouped_allreduce([tf.constant(tensor(r, 1, (5,))),
                                     tf.constant(tensor(r, 2, (2, 3)))], op=hvd.Adasum)
    out["grouped"] = [g.numpy().tolist() for g in grouped]

    # loss = sum(w * c): this rank's gradient is c
    c = tf.constant(tensor(r, 3, (6,)))
    w = tf.Variable(tf.zeros(6))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * c)
    out["tape"] = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [w])[0] \
        .numpy().tolist()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), op=hvd.Adasum)
    opt.apply_gradients([(c, w)])
    out["optimizer"] = w.numpy().tolist()  # -Adasum(c over ranks)

    refusals = []
    slices = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([0]), tf.constant([3, 2]))
    for name, call in (
            ("sparse", lambda: hvd.allreduce(slices, op=hvd.Adasum)),
            ("average_aggregated", lambda: hvd.DistributedOptimizer(
                tf.keras.optimizers.SGD(1.0), op=hvd.Adasum, backward_passes_per_step=2,
                average_aggregated_gradients=True)),
            ("reducescatter", lambda: hvd.reducescatter(tf.ones(4), op=hvd.Adasum))):
        try:
            call()
        except (NotImplementedError, ValueError, tf.errors.OpError) as exc:
            refusals.append([name, str(exc)[:300]])
    out["refusals"] = refusals

    # _compute_gradients, op=Sum: this rank's gradient of sum(v * (rank + 1)) is rank + 1
    # per element; reduced once, then applied without a second reduction.  The local
    # variable's gradient is divided by the size once.
    v, local = tf.Variable(tf.zeros(2)), tf.Variable(tf.zeros(2))
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), op=hvd.Sum)
    opt.register_local_var(local)
    pairs = opt._compute_gradients(lambda: tf.reduce_sum((v + local) * (r + 1)), [v, local])
    out["computed"] = [g.numpy().tolist() for g, _ in pairs]
    opt.apply_gradients(pairs)
    out["applied"] = [v.numpy().tolist(), local.numpy().tolist()]
    out["helper_none"] = opt._agg_helper is None

    # _agg_helper, backward_passes_per_step=2, op=Sum, in a tf.function as model.fit
    # runs it: passes 1 and 3 return the local sums and only count an iteration,
    # pass 2 returns the reduced sums and applies them.
    u = tf.Variable(tf.zeros(2))
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), op=hvd.Sum,
                                   backward_passes_per_step=2)

    @tf.function
    def step():
        pairs = opt._compute_gradients(lambda: tf.reduce_sum(u * (r + 1)), [u])
        opt.apply_gradients(pairs)
        return pairs[0][0]

    passes = []
    for _ in range(3):
        grad = step()
        passes.append({"grad": grad.numpy().tolist(), "u": u.numpy().tolist(),
                       "counter": int(opt._agg_helper.counter.numpy()),
                       "iterations": int(opt.iterations.numpy())})
    out["passes"] = passes
    report.write(r, size=hvd.size(), **out)


if __name__ == "__main__":
    main()
