"""One process of bench/vs_mwms.py: the same Keras training under TF's
MultiWorkerMirroredStrategy (``--impl mwms``, ``TF_CONFIG`` from the driver), under
elastic_hvd (``--impl elastic``, ``DistributedOptimizer`` + ``model.fit``, launched with
elastic-hvd-run) or alone with no communication (``--impl single``, the ideal's base).

Every process trains on its own synthetic batches of ``--batch`` samples a step: MWMS
gets them from ``distribute_datasets_from_function`` (one pipeline per worker, batch =
the per-worker batch), not from a dataset batched to the global size and auto-sharded,
so that all three count the same images per worker and step.  One intra-op and one
inter-op thread per process.

Throughput (``--models``): rank/worker 0 prints ``RESULT {json}`` with, per model, the
samples per second of the whole job over ``--steps`` steps after ``--warmup`` (also at
the pace of its median step), and its
own CPU seconds per step (compute, plus whatever waiting for the others costs: a
process that spins while it waits burns CPU its peers need on a busy machine).
Failure runs (``--log DIR``): every process appends ``wall_time step size`` after each
step to ``DIR/steps-<pid>.txt`` (``step`` counts from the start of training, so a step
MWMS redoes after a restore appears twice); ``--backup DIR`` adds MWMS's
``BackupAndRestore`` there, saving every ``--save-freq`` steps.
"""

import argparse
import contextlib
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MLP_LAYERS, MLP_WIDTH = 100, 64  # 100 Dense layers: 200 variables of 64x64 (+ biases)


def build(kind, keras):
    if kind == "mobilenet":
        return keras.applications.MobileNetV2(input_shape=(64, 64, 3), alpha=0.35, weights=None,
                                              classes=10)
    layers = [keras.layers.Dense(MLP_WIDTH, activation="relu") for _ in range(MLP_LAYERS - 1)]
    return keras.Sequential([keras.Input((MLP_WIDTH,)), *layers, keras.layers.Dense(10)])


def dataset(kind, batch, seed, pool=8):
    """``pool`` distinct batches of random samples, repeated: the input costs the
    same under every implementation and nearly nothing."""
    rng = np.random.default_rng(seed)
    shape = (64, 64, 3) if kind == "mobilenet" else (MLP_WIDTH,)
    x = rng.random((pool * batch, *shape), dtype=np.float32)
    y = rng.integers(0, 10, pool * batch)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()


class Clock:
    """Wall and CPU seconds (this process, all its threads) from the end of step
    ``warmup`` (the start, for 0) to the end of the last step: the steady state, without
    the end of the epoch; none after a restore that began past the warm-up.  Also each
    step's duration: a busy machine stalls some steps, and the median step shows the
    pace without them."""

    def __init__(self, keras, warmup):
        clock = self
        clock.ends = []

        def now():
            return time.perf_counter(), time.process_time()

        class Callback(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                if warmup == 0:
                    clock.start = now()

            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 == warmup:
                    clock.start = now()
                elif hasattr(clock, "start"):
                    clock.ends.append(now())
                    clock.seconds, clock.cpu_seconds = (
                        b - a for a, b in zip(clock.start, clock.ends[-1]))

        self.callback = Callback()

    def median_step(self):
        walls = [self.start[0]] + [end[0] for end in self.ends]
        return float(np.median(np.diff(walls)))


def step_log(keras, path, size):
    """``size()``: the job's size now (elastic_hvd's changes when a rank is lost)."""
    class StepLog(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            with open(path, "a") as f:  # batch counts from the start of training, also
                f.write(f"{time.time():.6f} {batch + 1} {size()}\n")  # after a restore

    return StepLog()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["mwms", "elastic", "single"], required=True)
    p.add_argument("--models", default="mobilenet,mlp")
    p.add_argument("--batch", type=int, default=16, help="samples per process and step")
    p.add_argument("--steps", type=int, default=40, help="timed MobileNetV2 steps (after --warmup)")
    p.add_argument("--mlp-steps", type=int, default=300, help="timed MLP steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--input", choices=["per-worker", "global"], default="per-worker",
                   help="MWMS: distribute_datasets_from_function, or one dataset batched to "
                        "the global batch and auto-sharded by Keras")
    p.add_argument("--log", help="step log directory (failure runs)")
    p.add_argument("--backup", help="MWMS BackupAndRestore directory")
    p.add_argument("--save-freq", type=int, default=10)
    args = p.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras = tf.keras  # Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1
    if args.impl == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = strategy.cluster_resolver.task_id
        size = strategy.num_replicas_in_sync
        scope = strategy.scope
    else:
        strategy = None
        if args.impl == "elastic":
            import elastic_hvd.tensorflow.keras as hvd
            hvd.init()
            rank, size = hvd.rank(), hvd.size()
        else:
            rank, size = 0, 1
        scope = contextlib.nullcontext
    result = {"impl": args.impl, "np": size, "tf": tf.__version__,
              "keras": "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras3"}
    for kind in args.models.split(","):
        keras.utils.set_random_seed(0)
        with scope():
            model = build(kind, keras)
            optimizer = keras.optimizers.SGD(0.01)
            if args.impl == "elastic":
                optimizer = hvd.DistributedOptimizer(optimizer)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=kind == "mlp")
            model.compile(optimizer=optimizer, loss=loss)
        if strategy is not None and args.input == "global":
            options = tf.data.Options()  # Keras distributes it; each worker keeps its share
            options.experimental_distribute.auto_shard_policy = \
                tf.data.experimental.AutoShardPolicy.DATA
            data = dataset(kind, args.batch * size, rank).with_options(options)
        elif strategy is not None:
            data = strategy.distribute_datasets_from_function(
                lambda ctx, kind=kind: dataset(
                    kind, ctx.get_per_replica_batch_size(args.batch * size),
                    ctx.input_pipeline_id))
        else:
            data = dataset(kind, args.batch, rank)
        steps = args.steps if kind == "mobilenet" else args.mlp_steps
        clock = Clock(keras, args.warmup)
        callbacks = [clock.callback]
        if args.impl == "elastic":
            callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
        if args.log:
            callbacks.append(step_log(keras, os.path.join(args.log, f"steps-{os.getpid()}.txt"),
                                      hvd.size if args.impl == "elastic" else lambda: size))
        if args.backup:
            callbacks.append(keras.callbacks.BackupAndRestore(args.backup,
                                                              save_freq=args.save_freq))
        model.fit(data, epochs=1, steps_per_epoch=args.warmup + steps, verbose=0,
                  callbacks=callbacks)
        if hasattr(clock, "seconds"):
            result[kind] = args.batch * size * steps / clock.seconds
            result[kind + "_cpu_per_step"] = clock.cpu_seconds / steps
            result[kind + "_at_median_step"] = args.batch * size / clock.median_step()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
