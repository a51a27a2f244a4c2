"""A CNN on numpy arrays that keeps training when ranks die (README's elastic example).

    elastic-hvd-run -np 4 python examples/elastic_keras.py
    mpirun --with-ft ulfm -np 4 python examples/elastic_keras.py
"""

import argparse

import numpy as np
import tensorflow as tf

import elastic_hvd.tensorflow.keras as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--samples", type=int, default=2048)
parser.add_argument("--out", default="elastic_keras_out")
args = parser.parse_args()

hvd.init()
rng = np.random.default_rng(0)  # the same data on every rank: each trains its share
x = rng.random((args.samples, 28, 28, 1), dtype=np.float32)
y = (x.mean(axis=(1, 2, 3)) > 0.5).astype(np.int64)  # a learnable toy label
data = hvd.ElasticData((x, y), batch_size=32, seed=1)

tf.keras.utils.set_random_seed(1)
model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(8, 3, activation="relu"),
    tf.keras.layers.MaxPooling2D(),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(2),
])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size())),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
history = hvd.fit(model, data, epochs=args.epochs, validation_data=(x[:256], y[:256]),
                  checkpoint_dir=f"{args.out}/checkpoint", events=f"{args.out}/events.jsonl")
if hvd.rank() == 0:
    print("final accuracy", history.history["accuracy"][-1], "on", hvd.size(), "ranks")
