"""What a user reads on the console (tests/test_messages.py).

    python messages.py plain | fit <epochs> | mismatch | raise_all | crash <world rank>

``plain``: an unchanged Horovod Keras script -- each rank trains the shard chosen by
``hvd.rank()`` at start, the learning rate scaled by ``hvd.size()`` once.  ``fit``:
``hvd.fit`` on ``hvd.ElasticData`` without ``events=`` and without ``verbose=``.
``mismatch``: the ranks allreduce tensors named alike of other shapes, uncaught.
``raise_all``: every rank raises the same uncaught exception after a collective.
``crash``: that rank segfaults after a collective; the others finish.
Ranks are killed by the test's fault plan (a real SIGKILL).
"""

import os
import signal
import sys

import numpy as np

case = sys.argv[1]

if case in ("raise_all", "crash"):
    from elastic_hvd import core

    comm = core.init()
    comm.allreduce(np.ones(4, dtype=np.float32))
    if case == "raise_all":
        raise ValueError(f"the data of rank {comm.rank} is bad")
    if comm.original_id == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGSEGV)
    for _ in range(3):
        comm.allreduce(np.ones(4, dtype=np.float32))
    sys.exit(0)

import tensorflow as tf  # noqa: E402

import elastic_hvd.tensorflow.keras as hvd  # noqa: E402

hvd.init()
if case == "mismatch":
    hvd.allreduce(tf.ones((2, 3) if hvd.rank() == 0 else (3, 2)), name="grad_x")

rng = np.random.default_rng(hvd.rank() if case == "plain" else 0)
x = rng.normal(size=(4800 if case == "fit" else 480, 4)).astype("float32")
y = x.sum(1, keepdims=True)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size())),
              loss="mse")
if case == "plain":
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()])
elif case == "fit":
    hvd.fit(model, hvd.ElasticData((x, y), batch_size=8), epochs=int(sys.argv[2]))
