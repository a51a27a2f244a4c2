"""Exactly-once oracle: one weight per sample id, gradients summed, SGD with lr 1.

    python step_oracle.py <case> <epochs>

The model's output for a sample is the sum, over several *counters*, of the
counter's entry for the sample's id; the loss is the weighted sum of outputs.
So the gradient of a counter is +1 at each id trained in the step (0 for
padding), the reduction is a Sum over ranks and every committed step subtracts
1 from the entry of each sample it trained.  After E epochs every entry of
every counter must be exactly -E: -E-1 means a sample was trained twice (in that
counter's buffer), -E+1 that it was lost.  The counters' gradients travel in
different collectives (the case decides how), so a rank lost between two
buffers of one step shows up as counters that disagree.  This oracle does not
use the sampler's rule: it reads what the model actually applied.

Each rank also writes a digest of its weights after every batch
(``TEST_OUT_DIR/steps<id>.jsonl``) so that the test can compare ranks step by step.
"""

import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
from stepcheck import StepDigests  # noqa: E402
import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
import keras_callbacks as kc  # noqa: E402
from elastic_hvd.core import runtime  # noqa: E402
from elastic_hvd.sharding import ElasticSampler  # noqa: E402
from elastic_hvd.tensorflow.data import elastic_dataset  # noqa: E402

keras = tf.keras
N, BATCH = 48, 2
OUT = os.environ["TEST_OUT_DIR"]

#: case -> (counters as (dtype, sparse), DistributedOptimizer kwargs)
CASES = {
    "mixed_dtypes": ([("float32", False), ("float16", False)], {}),
    "num_groups": ([("float32", False)] * 3, {"num_groups": 3}),
    "fusion": ([("float32", False)] * 3, {}),  # with HOROVOD_FUSION_THRESHOLD below one counter
    "sparse": ([("float32", True), ("float32", False)], {}),
    "accumulate": ([("float32", False)], {"backward_passes_per_step": 2}),
}


class Counter(keras.layers.Layer):
    """One entry per sample id; dense gradients (one-hot) or IndexedSlices (gather)."""

    def __init__(self, sparse, **kwargs):
        super().__init__(**kwargs)
        self.sparse = sparse

    def build(self, input_shape):
        self.w = self.add_weight(shape=(N,), initializer="zeros", name="w")

    def call(self, ids):
        if self.sparse:
            out = tf.gather(self.w, ids)
        else:
            out = tf.reduce_sum(self.w * tf.one_hot(ids, N, dtype=self.w.dtype), axis=-1)
        return tf.cast(out, "float32")


def build(case):
    counters, kwargs = CASES[case]
    ids = keras.Input((), dtype="int32")
    outs = [Counter(sparse, dtype=dtype, name=f"c{k}")(ids)
            for k, (dtype, sparse) in enumerate(counters)]
    total = outs[0] if len(outs) == 1 else keras.layers.Add()(outs)
    model = keras.Model(ids, total)

    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum,
                                                     **kwargs), loss=WeightedSum())
    return model


class WeightedSum(keras.losses.Loss):
    """The outputs themselves, times the sample weights, summed (not averaged)."""

    def __init__(self):
        super().__init__(reduction="sum", name="weighted_sum")

    def call(self, y_true, y_pred):
        return y_pred


def main(case, epochs):
    hvd.init()
    comm = runtime.current()
    with open(os.path.join(OUT, f"pid{comm.original_id}"), "w") as f:
        f.write(str(os.getpid()))
    sampler = ElasticSampler(comm, N, BATCH, seed=3)
    dataset = elastic_dataset(
        sampler, lambda ids, weights: (ids.astype(np.int32), np.zeros(len(ids), np.float32),
                                       weights),
        (tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.float32),
         tf.TensorSpec([None], tf.float32)))
    model = build(case)
    slow = float(os.environ.get("TEST_STEP_SLEEP", 0))
    callbacks = [kc.FaultInjection(), StepDigests(comm.original_id)]
    if slow:
        callbacks.append(keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs=None: time.sleep(slow)))
    kc.fit_elastic(model, dataset, epochs, verbose=0, callbacks=callbacks)
    report.write(comm.original_id, ids=list(comm.ids), step=runtime.session().step,
                 requeued=sampler.requeued,
                 counters=[w.astype(np.float64).tolist() for w in model.get_weights()],
                 lost=[i for e in comm.events for i in e.lost])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
