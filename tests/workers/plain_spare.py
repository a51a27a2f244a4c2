"""A plain Horovod-style Keras script (data sharded by ``hvd.rank()`` at start,
``DistributedOptimizer``, ``BroadcastGlobalVariablesCallback``, ``model.fit``), for
hot spares: nothing in it knows about failures or spares.

Test-only additions: a ``started-<pid>`` marker before ``init()`` (the test's
watcher kills from outside once every process runs), a weight digest after every
step (``stepcheck``), each epoch's batches with the rank the script started as,
a result file per process that ends training, and slow steps while the test holds
them (``TEST_HOLD_SLEEP`` more seconds a step while ``<out>/hold`` exists).  argv: epochs.
"""

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import elastic_hvd.tensorflow.keras as hvd
from elastic_hvd.core import runtime
from stepcheck import StepDigests

OUT = os.environ["TEST_OUT_DIR"]
EPOCHS, SAMPLES, BATCH = int(sys.argv[1]), 48, 8
open(os.path.join(OUT, f"started-{os.getpid()}"), "w").close()

hvd.init()
rank, size = hvd.rank(), hvd.size()  # what a plain script shards its data by
local = [hvd.local_rank(), hvd.local_size()]  # a GPU would be pinned by it here
x = np.random.default_rng(rank).normal(size=(SAMPLES, 4)).astype("float32")
y = x.sum(1, keepdims=True)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8),
                             tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * size)),
              loss="mse")


class Epochs(tf.keras.callbacks.Callback):
    """Batches trained per epoch (and a pause per batch, so that the job lasts)."""

    def __init__(self):
        super().__init__()
        self.epochs, self.batches = [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        time.sleep(float(os.environ.get("TEST_STEP_SLEEP", "0")))
        if os.path.exists(os.path.join(OUT, "hold")):
            time.sleep(float(os.environ.get("TEST_HOLD_SLEEP", "0")))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((epoch, self.batches))


epochs = Epochs()
model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback(), epochs, StepDigests(os.getpid())])
comm = runtime.current()
with open(os.path.join(OUT, f"rank{comm.original_id}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "started_as": [rank, size], "ends_as": [hvd.rank(), hvd.size()],
               "local_at_start": local,
               "epochs": epochs.epochs, "digest": StepDigests.digest(model),
               "lr": float(model.optimizer.learning_rate.numpy()),
               "events": [{"lost": list(e.lost), "gained": list(e.gained)} for e in comm.events]},
              f)
