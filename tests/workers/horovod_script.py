"""An unchanged Horovod Keras script (as users write them), run through --as-horovod."""

import json
import os

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd

hvd.init()
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size()))
model.compile(optimizer=opt, loss="mse")
x = np.random.default_rng(hvd.rank()).normal(size=(64, 4)).astype("float32")
model.fit(x, x.sum(1, keepdims=True), batch_size=16, epochs=2, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback()])
with open(os.path.join(os.environ["TEST_OUT_DIR"], f"rank{hvd.rank()}.json"), "w") as f:
    json.dump({"module": hvd.__name__, "size": hvd.size(),
               "weights": float(np.sum([w.sum() for w in model.get_weights()]))}, f)
