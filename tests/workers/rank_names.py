"""A plain Horovod-style Keras script with Keras's own progress bar on rank 0 (what a
Horovod user writes: ``verbose=1 if hvd.rank() == 0 else 0``), for the naming of
ranks and the announcement's line (tests/test_rank_names.py).

Test-only additions: a ``started-<pid>`` marker before ``init()`` (the test kills from
outside once rank 0's bar is half-drawn), a pause per batch so that the job lasts, and, with
``TEST_RAISE_AT_END=1``, the same uncaught exception on every rank after training (so
that the launcher reports ranks renumbered by the loss).  argv: epochs.
"""

import os
import sys
import time

import numpy as np
import tensorflow as tf

import elastic_hvd.tensorflow.keras as hvd

OUT = os.environ["TEST_OUT_DIR"]
EPOCHS, SAMPLES, BATCH = int(sys.argv[1]), 48, 8
open(os.path.join(OUT, f"started-{os.getpid()}"), "w").close()

hvd.init()
rank = hvd.rank()
x = np.random.default_rng(rank).normal(size=(SAMPLES, 4)).astype("float32")
y = x.sum(1, keepdims=True)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")


class Pause(tf.keras.callbacks.Callback):
    """A pause per batch; on the first rank 0, a ``drawing`` marker in the second
    epoch once its bar is half-drawn (the test kills a rank then)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if rank == 0 and self.epoch == 1 and batch == 1:
            open(os.path.join(OUT, "drawing"), "w").close()
        time.sleep(float(os.environ.get("TEST_STEP_SLEEP", "0")))


model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=1 if rank == 0 else 0, shuffle=False,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Pause()])
if os.environ.get("TEST_RAISE_AT_END") == "1":
    raise RuntimeError("the end of the test")
