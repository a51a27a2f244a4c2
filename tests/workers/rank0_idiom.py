"""Horovod's rank-0 idiom: callbacks only rank 0 runs (``if hvd.rank() == 0:
callbacks.append(CSVLogger(...))``), in the two kinds of script (issue 42).

    python rank0_idiom.py fit|plain <epochs> [events-on-rank-0]

``fit``: ``hvd.fit`` on ``hvd.ElasticData`` (a spare joins at a step boundary, as a
new rank); with ``events-on-rank-0`` rank 0 alone also logs membership events (an
elastic_hvd callback given to one rank: a joiner must fail, naming it).  ``plain``: a
plain Horovod script (data by ``hvd.rank()``, ``model.fit``; a spare takes the lost
rank's number, waiting in ``init()``), which also saves a ``ModelCheckpoint`` on rank 0.
A ``started-<pid>`` marker before ``init()`` (the test's watcher kills from outside);
TEST_STEP_SLEEP slows every step down; an
``epoch-<n>`` marker once epoch n ended; a result file per process that ends training.
"""

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import elastic_hvd.tensorflow.keras as hvd
from elastic_hvd.core import runtime

OUT = os.environ["TEST_OUT_DIR"]
MODE, EPOCHS = sys.argv[1], int(sys.argv[2])
EVENTS_ON_RANK_0 = sys.argv[3:] == ["events-on-rank-0"]
SAMPLES, BATCH = 48, 8
open(os.path.join(OUT, f"started-{os.getpid()}"), "w").close()


class Slow(tf.keras.callbacks.Callback):
    """A pause per step (the job lasts), and an ``epoch-<n>`` marker per epoch ended."""

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(float(os.environ.get("TEST_STEP_SLEEP", "0")))

    def on_epoch_end(self, epoch, logs=None):
        open(os.path.join(OUT, f"epoch-{epoch}"), "w").close()


hvd.init()
rank, size = hvd.rank(), hvd.size()
seed = rank if MODE == "plain" else 0  # a plain script shards by rank; ElasticData shares
x = np.random.default_rng(seed).normal(size=(SAMPLES, 4)).astype("float32")
y = x.sum(1, keepdims=True)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8),
                             tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * size)),
              loss="mse")
callbacks = [Slow()]
if hvd.rank() == 0:  # Horovod's idiom: what only rank 0 does
    callbacks.append(tf.keras.callbacks.CSVLogger(os.path.join(OUT, "log.csv")))
    if MODE == "plain":
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(OUT, "ckpt-{epoch:02d}.weights.h5"), save_weights_only=True))
if MODE == "fit":
    events = os.path.join(OUT, "events.jsonl") if EVENTS_ON_RANK_0 and rank == 0 else None
    hvd.fit(model, hvd.ElasticData((x, y), batch_size=BATCH, seed=1), EPOCHS,
            callbacks=callbacks, events=events, verbose=0)
else:
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(), *callbacks])
comm = runtime.current()
with open(os.path.join(OUT, f"rank{comm.original_id}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "started_as": [rank, size], "ends_as": [hvd.rank(), hvd.size()],
               "events": [{"lost": list(e.lost), "gained": list(e.gained)} for e in comm.events]},
              f)
