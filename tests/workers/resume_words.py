"""``hvd.fit`` into a checkpoint directory that a run before may have filled
(tests/test_resume_words.py).

    python resume_words.py <epochs> <checkpoint dir>

Rank 0 prints ``batch E.B`` (counting from 1) after each training batch, on stdout as
Keras' own output and a script's prints go, and ``done`` once ``hvd.fit`` returns.
"""

import sys

import numpy as np
import tensorflow as tf

import elastic_hvd.tensorflow.keras as hvd


class PrintBatches(tf.keras.callbacks.Callback):
    """What a user sees of training: one line per batch, on rank 0."""

    epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == 0:
            print(f"batch {self.epoch + 1}.{batch + 1}", flush=True)


epochs, directory = int(sys.argv[1]), sys.argv[2]
hvd.init()
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
data = hvd.ElasticData((x, x.sum(1, keepdims=True)), batch_size=8, seed=1)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size())),
              loss="mse")
hvd.fit(model, data, epochs, checkpoint_dir=directory, verbose=0, callbacks=[PrintBatches()])
if hvd.rank() == 0:
    print("done", flush=True)
