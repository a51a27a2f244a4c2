"""A script written against Horovod's elastic Keras API, grown back by elastic_hvd.

    python hvd_elastic_grow.py <steps>

``hvd.elastic.run`` + ``KerasState`` + ``CommitStateCallback`` (every 2 batches), as
in Horovod's examples; ELASTIC_HVD_FAULTS step faults fire before each step.
Every rank alive at the end reports its weights' digest and the state.
"""

import hashlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
from elastic_hvd.core import faults, runtime  # noqa: E402

BATCH = 8


def main(steps):
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(8, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.5)),
                  loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, restarts=0)
    state.register_reset_callbacks([lambda: setattr(state, "restarts", state.restarts + 1)])

    class Steps(tf.keras.callbacks.Callback):
        def __init__(self, offset):
            super().__init__()
            self.offset = offset

        def on_train_batch_begin(self, batch, logs=None):
            faults.at_step(self.offset + batch + 1)

        def on_train_batch_end(self, batch, logs=None):
            state.batch = self.offset + batch + 1
            time.sleep(float(os.environ.get("TEST_STEP_SLEEP", 0)))

    @hvd.elastic.run
    def train(state):
        start = state.batch
        commit = hvd.elastic.CommitStateCallback(state, batches_per_commit=2)
        model.fit(x[start * BATCH:], y[start * BATCH:], batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0, callbacks=[Steps(start), commit])

    train(state)
    comm = runtime.current()
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    report.write(comm.original_id, ids=list(comm.ids), batch=state.batch, restarts=state.restarts,
                 digest=hashlib.sha256(weights.tobytes()).hexdigest(),
                 events=[e.as_dict() for e in comm.events])


if __name__ == "__main__":
    main(int(sys.argv[1]))
