"""Native memory Keras keeps per epoch, without elastic_hvd (issue 18's soak RSS).

The soak's ranks grew ~100 kB per epoch, with or without faults.  Two causes,
both Keras 3's (Python's own allocations do not grow: tracemalloc sees nothing):

* a ``model.fit`` call on a dataset of unknown length, with no
  ``steps_per_epoch``, keeps ~50-140 kB after it returns, and
  ``keras_callbacks.fit_elastic`` makes one call per epoch.  Given a
  ``steps_per_epoch`` that the data never reaches, the same calls keep nothing
  (what fit_elastic now does);
* ``model.save_weights`` of a compiled model keeps ~70 kB per call, linearly
  (282 MB after 4000 saves): Keras caches the attribute skip set of each saved
  type under a key it never reads, so every save builds a reference
  ``Optimizer(1.0)``, and each built optimizer keeps ~70 kB.  With the optimizer
  skipped, or with the cache filled under the key Keras reads
  (``keras_callbacks.keras_leaks.save_weights``, what the checkpoint's writer
  calls), a save keeps nothing.

Each variant runs in a process of its own: a warm-up of 30 epochs, then the RSS
difference over ``--epochs`` epochs (one save, or one optimizer built, per epoch
for the last four).

    python bench/fit_memory.py [--epochs 300] [--runs 3] [--legacy]
"""

import argparse
import gc
import os
import statistics
import subprocess
import sys

VARIANTS = {
    "per-epoch fit, length unknown": "unknown",
    "per-epoch fit, length unknown, steps_per_epoch bound": "bound",
    "per-epoch fit, length known": "known",
    "one fit for all epochs, length unknown": "one-call",
    "per-epoch fit, generator": "gen",
    "per-epoch fit, generator, steps_per_epoch bound": "gen-bound",
    "per-epoch fit, generator, length asserted": "gen-known",
    "save_weights of a compiled model": "save",
    "save_weights, the optimizer skipped": "save-skip",
    "save_weights, Keras' skip-set cache filled (keras_leaks)": "save-cached",
    "keras.optimizers.Optimizer(1.0) built, nothing saved": "optimizer",
}
KERAS_3_ONLY = ("save-skip", "optimizer")  # saving_lib's objects_to_skip; the base class


def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def measure(variant, epochs):
    """kB of RSS kept per epoch by ``variant`` (runs in this process)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import warnings

    import numpy as np
    import tensorflow as tf
    warnings.filterwarnings("ignore")  # "Your input ran out of data": the point
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras = tf.keras
    x = np.random.default_rng(0).normal(size=(1024, 8)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32)
    if variant.startswith("gen"):
        def batches():
            for start in range(0, 1024, 32):
                yield x[start:start + 32], x[start:start + 32, :1]
        data = tf.data.Dataset.from_generator(batches, output_signature=(
            tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None, 1], tf.float32)))
        if variant == "gen-known":
            data = data.apply(tf.data.experimental.assert_cardinality(32))
    elif variant != "known":
        data = data.filter(lambda *_: True)  # the length is unknown, as an elastic epoch's
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    bound = {"steps_per_epoch": sys.maxsize} if variant.endswith("bound") else {}
    if variant.startswith("save"):
        return _saves(model, data, epochs, variant)
    if variant == "optimizer":
        return _kept_per_epoch(lambda n: [keras.optimizers.Optimizer(1.0) for _ in range(n)],
                               epochs)

    def train(n):
        if variant == "one-call":
            model.fit(data, epochs=n, verbose=0)
            return
        for _ in range(n):
            model.fit(data, epochs=1, verbose=0, **bound)

    return _kept_per_epoch(train, epochs)


def _kept_per_epoch(run, epochs):
    """kB of RSS that ``run(epochs)`` keeps per epoch, after ``run(30)`` of warm-up."""
    run(30)
    gc.collect()
    before = rss_kb()
    run(epochs)
    gc.collect()
    return (rss_kb() - before) / epochs


def _saves(model, data, epochs, variant):
    import tempfile

    from keras_callbacks.keras_leaks import save_weights
    model.fit(data, epochs=1, verbose=0)
    if variant == "save-skip":
        from keras.src.saving import saving_lib  # objects_to_skip: not in the public API

        def save_one(path):
            saving_lib.save_weights_only(model, path, objects_to_skip=[model.optimizer])
    else:
        save_one = model.save_weights if variant == "save" else lambda p: save_weights(model, p)
    with tempfile.TemporaryDirectory() as directory:
        def save(n):
            for i in range(n):
                save_one(f"{directory}/{i % 3}.weights.h5")
        return _kept_per_epoch(save, epochs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--legacy", action="store_true", help="tf_keras (TF_USE_LEGACY_KERAS=1)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a variant, in this process
    args = parser.parse_args()
    if args.one:
        print(measure(args.one, args.epochs))
        return
    env = dict(os.environ, **({"TF_USE_LEGACY_KERAS": "1"} if args.legacy else {}))
    versions = subprocess.run(
        [sys.executable, "-c", "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'; "
         "import tensorflow as tf; print(tf.__version__, tf.keras.__name__, "
         "getattr(tf.keras, '__version__', ''))"],
        env=env, capture_output=True, text=True, check=True).stdout.split()
    print(f"TensorFlow {versions[0]}, {' '.join(versions[1:])}; {args.epochs} epochs of 32 "
          f"batches after 30 of warm-up; median of {args.runs} processes per variant")
    print(f"{'variant':55s} {'kB kept per epoch':>18s}   runs")
    for name, variant in VARIANTS.items():
        if args.legacy and variant in KERAS_3_ONLY:
            continue
        runs = [float(subprocess.run(
            [sys.executable, __file__, "--one", variant, "--epochs", str(args.epochs)],
            env=env, capture_output=True, text=True, check=True).stdout.split()[-1])
            for _ in range(args.runs)]
        print(f"{name:55s} {statistics.median(runs):18.1f}   "
              + " ".join(f"{r:.1f}" for r in runs), flush=True)


if __name__ == "__main__":
    main()
