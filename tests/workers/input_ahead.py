"""hvd.fit on ElasticData that loads batches ahead, judged by counters (issue 44).

    python input_ahead.py <epochs>

The samples are ids 0..N-1; ``load`` (run in ElasticData's threads, TEST_LOAD_SLEEP
seconds a batch, like decoding files) turns a batch of ids into the model's input,
and ElasticData keeps ``ahead`` batches loading while a step trains (TEST_STEP_SLEEP
a step), so a membership change always meets several batches in flight.

The oracle does not use the sampler's rule: the model has one weight per sample id;
its output for a sample is that weight, the loss the weighted sum of outputs, the
reduction a Sum and SGD's rate 1 (``lr_policy="none"``), so each committed step
subtracts exactly 1 from the weight of each sample it trained (0 for padding).  Each
rank writes the weights at every epoch's end (TEST_OUT_DIR/epochs<id>.jsonl): after
epoch e every weight must be -(e+1), i.e. every sample trained exactly once in each
epoch, whoever trained it.  Each rank also writes its weights' digest after every
step (stepcheck.py) and, at the end, how many batches its work-ahead handed over,
missed and threw away.
"""

import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
from stepcheck import StepDigests  # noqa: E402
import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
from elastic_hvd.core import runtime  # noqa: E402

keras = tf.keras
N, BATCH, AHEAD = 96, 2, 4
OUT = os.environ["TEST_OUT_DIR"]


class Counter(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(N,), initializer="zeros", name="w")

    def call(self, ids):
        return tf.gather(self.w, ids)


class WeightedSum(keras.losses.Loss):
    def __init__(self):
        super().__init__(reduction="sum", name="weighted_sum")

    def call(self, y_true, y_pred):
        return y_pred


class EpochWeights(keras.callbacks.Callback):
    def __init__(self, original_id):
        super().__init__()
        self.path = os.path.join(OUT, f"epochs{original_id}.jsonl")

    def on_epoch_end(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": epoch,
                                "weights": self.model.get_weights()[0].tolist()}) + "\n")


class SlowSteps(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        # every rank sees the same agreed size: they slow down alike
        waiting = hvd.size() < int(os.environ.get("TEST_SLOW_UNTIL_SIZE", 0))
        time.sleep(2.0 if waiting else float(os.environ.get("TEST_STEP_SLEEP", 0.05)))


def main(epochs):
    hvd.init()
    comm = runtime.current()
    with open(os.path.join(OUT, f"pid{comm.original_id}"), "w") as f:
        f.write(str(os.getpid()))
    pause = float(os.environ.get("TEST_LOAD_SLEEP", 0.05))

    def load(ids):  # runs in the work-ahead's threads, also for batches thrown away
        time.sleep(pause)
        return ids.astype(np.int32), np.zeros(len(ids), np.float32)

    data = hvd.ElasticData(np.arange(N), BATCH, load=load, seed=7, ahead=AHEAD, workers=2)
    ids = keras.Input((), dtype="int32")
    model = keras.Model(ids, Counter(name="counter")(ids))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum),
                  loss=WeightedSum())
    hvd.fit(model, data, epochs, lr_policy="none", verbose=0,
            callbacks=[StepDigests(comm.original_id), EpochWeights(comm.original_id),
                       SlowSteps()])
    work = data.work
    report.write(comm.original_id, ids=list(comm.ids), hits=work.hits, misses=work.misses,
                 discarded=work.discarded, peak_bytes=work.peak_bytes,
                 lost=[i for e in comm.events for i in e.lost],
                 gained=[i for e in comm.events for i in e.gained])


if __name__ == "__main__":
    main(int(sys.argv[1]))
