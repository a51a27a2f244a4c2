"""hvd.SyncBatchNormalization on real ranks; each rank reports JSON (see report.py).

    python sync_bn.py <scenario> [args...]

The reference everywhere is one process running plain ``BatchNormalization`` on the
joint batch (every rank's rows, in rank order), computed here without collectives.
"""

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
import elastic_hvd.tensorflow as hvd  # noqa: E402
import elastic_hvd.tensorflow.keras as hvd_keras  # noqa: E402
from elastic_hvd.core import faults, runtime  # noqa: E402

keras = tf.keras
SHAPE = (2, 3, 4)  # per sample: channels last, so statistics reduce over 3 axes


def joint_batch(sizes, seed=3):
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    # A large offset: the variance must not cancel away (E[x^2] - E[x]^2 in float32 would).
    x = (rng.normal(size=(total, *SHAPE)) * 2.0 + 10.0).astype(np.float32)
    w = rng.normal(size=(total, *SHAPE)).astype(np.float32)  # loss = sum(w * y)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return x, w, starts


def layer_pair():
    kwargs = dict(momentum=0.9, epsilon=1e-3, gamma_initializer=keras.initializers.Constant(1.5),
                  beta_initializer=keras.initializers.Constant(0.25))
    sync = hvd.SyncBatchNormalization(**kwargs)
    if not keras.layers.BatchNormalization.__module__.startswith("keras."):
        # tf_keras: its fused kernel (the default on 4-D inputs) moves the variance
        # with Bessel's correction; SyncBN, like Horovod's, is the unfused layer.
        kwargs["fused"] = False
    plain = keras.layers.BatchNormalization(**kwargs)
    sync.build((None, *SHAPE))
    plain.build((None, *SHAPE))
    return sync, plain


def forward_backward(layer, x, w):
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * w)
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
    return y, dx, dgamma, dbeta


def maxdiff(a, b):
    """Largest difference, relative to the reference ``b``'s largest value when over 1."""
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def equivalence(*sizes):
    """Rank r has sizes[r] samples; SyncBN's output, gradients and moving statistics
    (eager, then in a tf.function) against plain BN on the joint batch."""
    sizes = [int(s) for s in sizes]
    r = hvd.rank()
    assert hvd.size() == len(sizes), (hvd.size(), sizes)
    x, w, starts = joint_batch(sizes)
    mine = slice(starts[r], starts[r + 1])
    result = {}
    for mode in ("eager", "function"):
        sync, plain = layer_pair()
        step_sync = forward_backward if mode == "eager" else tf.function(forward_backward)
        y, dx, dgamma, dbeta = step_sync(sync, x[mine], w[mine])
        ry, rdx, _, _ = forward_backward(plain, x, w)
        # This rank's gamma/beta gradient: that of the loss over its own rows only.
        plain_only_mine = layer_pair()[1]
        w_mine = np.zeros_like(w)
        w_mine[mine] = w[mine]
        _, _, rdgamma, rdbeta = forward_backward(plain_only_mine, x, w_mine)
        # The ranks' gamma gradients summed are the joint batch's.
        summed = hvd.allreduce(dgamma, op=hvd.Sum, name="check_sum")
        _, _, joint_dgamma, _ = forward_backward(layer_pair()[1], x, w)
        result[mode] = dict(
            y=maxdiff(y, ry[mine]), dx=maxdiff(dx, rdx[mine]), dgamma=maxdiff(dgamma, rdgamma),
            dbeta=maxdiff(dbeta, rdbeta), dgamma_sum=maxdiff(summed, joint_dgamma),
            moving_mean=maxdiff(sync.moving_mean, plain.moving_mean),
            moving_variance=maxdiff(sync.moving_variance, plain.moving_variance),
            moved=maxdiff(sync.moving_mean, np.zeros(SHAPE[-1])),
            y_scale=float(np.max(np.abs(ry))), dx_scale=float(np.max(np.abs(rdx))),
            stats=np.concatenate([sync.moving_mean.numpy(),
                                  sync.moving_variance.numpy()]).tolist())
        # Inference mode: the moving statistics, unchanged, and no collective.
        before = [v.numpy() for v in sync.non_trainable_weights]
        inferred = sync(x[mine], training=False)
        result[mode]["inference"] = maxdiff(inferred, plain(x[mine], training=False))
        result[mode]["inference_kept_stats"] = max(
            maxdiff(a, v) for a, v in zip(before, sync.non_trainable_weights))
    report.write(runtime.current().original_id, **result)


def fit(sizes_arg="4,4", steps="5"):
    """model.fit with SyncBN on rank r's share of each joint batch against one process
    fitting plain BN on the joint batches (equal shares: the averaged loss is the joint
    one); the final weights and moving statistics compared."""
    sizes = [int(s) for s in sizes_arg.split(",")]
    steps = int(steps)
    r = hvd.rank()
    total = sum(sizes)
    rng = np.random.default_rng(11)
    x = rng.normal(size=(total * steps, 5)).astype(np.float32) + 3.0
    y = rng.normal(size=(total * steps, 2)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    idx = np.concatenate([np.arange(b * total + starts[r], b * total + starts[r + 1])
                          for b in range(steps)])

    def model(bn):
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6), bn,
                                 keras.layers.Activation("tanh"), keras.layers.Dense(2)])

    sync_model = model(hvd_keras.SyncBatchNormalization(momentum=0.5))
    plain_model = model(keras.layers.BatchNormalization(momentum=0.5))
    plain_model.set_weights(sync_model.get_weights())
    sync_model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                       loss="mse")
    plain_model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    sync_model.fit(x[idx], y[idx], batch_size=sizes[r], epochs=1, shuffle=False, verbose=0)
    plain_model.fit(x, y, batch_size=total, epochs=1, shuffle=False, verbose=0)
    a, b = sync_model.get_weights(), plain_model.get_weights()
    names = [v.name for v in sync_model.weights]
    # Round trip through Keras' serialization: the class comes back.
    config = sync_model.layers[1].get_config()
    again = keras.layers.deserialize(keras.layers.serialize(sync_model.layers[1]))
    report.write(runtime.current().original_id,
                 diffs={n: maxdiff(p, q) for n, p, q in zip(names, a, b)},
                 moved=maxdiff(a[4], np.zeros_like(a[4])),
                 weights=[w.tolist() for w in a], keras=keras.__name__ if hasattr(
                     keras, "__name__") else str(keras),
                 layer_class=type(sync_model.layers[1]).__name__,
                 round_trip_class=type(again).__name__, momentum=config["momentum"],
                 base=type(sync_model.layers[1]).__mro__[1].__module__)


def killed(phase, *sizes):
    """Rank 2 dies in its SyncBN allreduce (the first collective after the plan is
    armed), as it starts or (``phase=after``) once its data went out but before the
    ranks agreed on the outcome; the survivors' statistics are those of their own rows."""
    sizes = [int(s) for s in sizes]
    original = runtime.current().original_id
    x, w, starts = joint_batch(sizes)
    mine = slice(starts[original], starts[original + 1])
    sync, _ = layer_pair()
    step = tf.function(forward_backward)
    # Trace first (no collective runs while tracing), then arm the fault.
    step.get_concrete_function(sync, tf.TensorSpec((sizes[original], *SHAPE), tf.float32),
                               tf.TensorSpec((sizes[original], *SHAPE), tf.float32))
    hvd.barrier()
    faults.configure(original, f"rank=2,coll=1,signal=KILL,phase={phase}")
    y, dx, dgamma, dbeta = step(sync, tf.constant(x[mine]), tf.constant(w[mine]))
    size_after = hvd.size()
    survivors = [i for i in range(len(sizes)) if i != 2]
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in survivors])
    _, plain = layer_pair()
    ry, rdx, _, _ = forward_backward(plain, x[rows], w[rows])
    offset = sum(sizes[i] for i in survivors if i < original)
    ours = slice(offset, offset + sizes[original])
    report.write(original, size=size_after, y=maxdiff(y, ry[ours]), dx=maxdiff(dx, rdx[ours]),
                 moving_mean=maxdiff(sync.moving_mean, plain.moving_mean),
                 moving_variance=maxdiff(sync.moving_variance, plain.moving_variance),
                 stats=np.concatenate([sync.moving_mean.numpy(),
                                       sync.moving_variance.numpy()]).tolist())


if __name__ == "__main__":
    hvd.init()
    scenario, *args = sys.argv[1:]
    globals()[scenario](*args)
    hvd.shutdown()
