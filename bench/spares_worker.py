"""The job of bench/spares_bench.py: MobileNetV2 (alpha 0.35, 64x64, 10 classes) in
``hvd.fit`` on synthetic images, 16 per rank and step, one thread per process.

Every rank appends ``wall_time duration size`` after each of its steps to
``<out>/steps-<pid>.txt``; rank 0's event log is ``<out>/events.jsonl``.

    elastic-hvd-run -np 4 --spares 1 python bench/spares_worker.py --out DIR
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
import keras_callbacks as kc  # noqa: E402


class StepTimes(tf.keras.callbacks.Callback):
    """Each step's end time, its duration and the job's size then, one line per step.
    A step's duration runs from the previous step's end, so that it includes the
    work at the step boundary (a spawn, an adoption, the state's hand-over)."""

    def __init__(self, path):
        super().__init__()
        self.path, self.last = path, None

    def on_train_batch_begin(self, batch, logs=None):
        if self.last is None:
            self.last = time.time()

    def on_train_batch_end(self, batch, logs=None):
        now = time.time()
        with open(self.path, "a") as f:
            f.write(f"{now:.6f} {now - self.last:.6f} {hvd.size()}\n")
        self.last = now


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60, help="steps per epoch at the full size")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.applications.MobileNetV2(input_shape=(64, 64, 3), alpha=0.35,
                                              weights=None, classes=10)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size())),
                  loss="sparse_categorical_crossentropy")
    count = args.steps * args.batch * hvd.size()
    rng = np.random.default_rng(0)
    images = rng.random((count, 64, 64, 3), dtype=np.float32)
    labels = rng.integers(0, 10, count)
    data = hvd.ElasticData((images, labels), args.batch, seed=0)
    log = kc.MembershipEventLog(os.path.join(args.out, "events.jsonl"))
    hvd.fit(model, data, args.epochs, verbose=0,
            callbacks=[log, StepTimes(os.path.join(args.out, f"steps-{os.getpid()}.txt"))])


if __name__ == "__main__":
    main()
