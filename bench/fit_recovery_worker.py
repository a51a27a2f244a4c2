"""One Keras training job that loses a rank, under elastic_hvd or Elastic Horovod.

Both run this same script, written against Horovod's elastic Keras API
(``hvd.elastic.run``, ``KerasState``, commit every ``--commit-every`` batches), so the
comparison is like for like.  Every rank appends ``time step size`` after each
batch to ``<out>/steps<rank>.txt``, where ``step`` is the position in the epoch
(repeated after Elastic Horovod rolls back to its last commit); the victim writes
the wall-clock time of its SIGKILL to ``<out>/killed``.  With ``--grow-at N`` rank 0
writes the time to ``<out>/grow`` once N steps are done, and the host-discovery
script of bench/growth_vs_elastic_horovod.py then offers more slots.
"""

import argparse
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["horovod", "elastic"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=30)
    p.add_argument("--victim", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--grow-at", type=int, default=0, help="steps after which to offer more slots")
    args = p.parse_args()
    if args.impl == "horovod":
        import horovod.tensorflow.keras as hvd
    else:
        import elastic_hvd.tensorflow.keras as hvd
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(64, 64, 3), alpha=0.35, weights=None,
                                           classes=10)
    base_lr = 0.01
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(base_lr * hvd.size())),
                  loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(hvd.rank())
    x = rng.random((args.batch * args.steps, 64, 64, 3), dtype=np.float32)
    y = rng.integers(0, 10, args.batch * args.steps)
    me = hvd.rank()
    log = open(os.path.join(args.out, f"steps{me}.txt"), "a")

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    class Record(keras.callbacks.Callback):
        """Logs each step and keeps ``state.batch`` = steps done (absolute, for commits)."""

        def __init__(self, offset):
            super().__init__()
            self.offset = offset

        def on_train_batch_begin(self, batch, logs=None):
            if me == args.victim and self.offset + batch + 1 == args.kill_step:
                with open(os.path.join(args.out, "killed"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            state.batch = self.offset + batch + 1
            grow = os.path.join(args.out, "grow")
            if state.batch == args.grow_at and hvd.rank() == 0 and not os.path.exists(grow):
                with open(grow, "w") as f:
                    f.write(repr(time.time()))
            log.write(f"{time.time()!r} {state.batch} {hvd.size()}\n")
            log.flush()

    @hvd.elastic.run
    def train(state):
        start = state.batch
        model.fit(x[start * args.batch:], y[start * args.batch:], batch_size=args.batch,
                  epochs=1, shuffle=False, verbose=0, callbacks=[
                      Record(start),
                      hvd.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every)])

    train(state)


if __name__ == "__main__":
    main()
