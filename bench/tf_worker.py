"""Same TF workload under Horovod, elastic_hvd or plain Keras alone (``--impl``), one JSON
line from rank 0.  ``keras``: one process, no distribution (the baseline that shows what
a TF/Keras version costs by itself).

    allreduce: median time of an eager hvd.allreduce of a TF tensor at 1 KiB and 64 MiB
    fit:       Keras model.fit images/second (MobileNetV2 alpha 0.35, 100x100, synthetic data;
               ``--model mlp``: a 200-variable MLP, many small tensors)
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def allreduce(hvd, args):
    rows = []
    for nbytes in (1 << 10, 64 << 20):
        x = tf.ones([nbytes // 4], tf.float32)
        for _ in range(3):
            hvd.allreduce(x, op=hvd.Sum)
        times = []
        for _ in range(args.iterations if nbytes < (1 << 20) else max(5, args.iterations // 20)):
            t = time.perf_counter()
            hvd.allreduce(x, op=hvd.Sum)  # eager TF runs ops synchronously: done on return
            times.append(time.perf_counter() - t)
        rows.append({"bytes": nbytes, "median_s": float(np.median(times))})
    return {"allreduce": rows}


def fit(hvd, args):
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras = tf.keras
    side = args.size
    if args.model == "mlp":  # many small tensors: 100 Dense layers, 200 variables
        shape = (64,)
        model = keras.Sequential([keras.Input(shape)] + [
            keras.layers.Dense(64, activation="relu") for _ in range(99)] + [
            keras.layers.Dense(10)])
    else:
        shape = (side, side, 3)
        model = keras.applications.MobileNetV2(input_shape=shape, alpha=0.35, weights=None,
                                               classes=10)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(hvd.rank())
    n = args.batch * (args.steps + args.warmup)
    x = rng.random((n, *shape), dtype=np.float32)
    y = rng.integers(0, 10, n)

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == args.warmup:
                if args.start_together:
                    start_together(*args.start_together.split(":"))
                self.start, self.wall = time.perf_counter(), [time.time()]

        def on_train_end(self, logs=None):
            self.seconds = time.perf_counter() - self.start
            self.wall.append(time.time())

    clock = Clock()
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), clock])
    return {"fit_img_per_s": args.batch * args.steps * hvd.size() / clock.seconds,
            "step_ms": 1e3 * clock.seconds / args.steps, "timed_wall": clock.wall}


def start_together(directory, count):
    """Wait until ``count`` processes reached this point (a file each in ``directory``):
    independent processes, each timed alone, then run their timed steps side by side."""
    open(os.path.join(directory, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 300
    while len(os.listdir(directory)) < int(count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} processes never met in {directory}")
        time.sleep(0.001)


class Alone:
    """``--impl keras``: the few ``hvd`` names ``fit`` uses, for one process alone."""

    @staticmethod
    def init():
        pass

    @staticmethod
    def size():
        return 1

    @staticmethod
    def rank():
        return 0

    @staticmethod
    def DistributedOptimizer(optimizer):  # noqa: N802 - Horovod's name
        return optimizer

    class callbacks:  # noqa: N801 - Horovod's name
        @staticmethod
        def BroadcastGlobalVariablesCallback(root):  # noqa: N802 - Horovod's name
            return tf.keras.callbacks.Callback()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["horovod", "elastic", "keras"], required=True)
    p.add_argument("--what", choices=["allreduce", "fit"], required=True)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--size", type=int, default=100, help="image side (fit)")
    p.add_argument("--model", choices=["mobilenet", "mlp"], default="mobilenet")
    p.add_argument("--start-together", metavar="DIR:N",
                   help="after warm-up, wait until N processes given DIR got there (fit)")
    args = p.parse_args()
    if args.impl == "keras" and args.what != "fit":
        p.error("--impl keras (one process, no collectives) measures --what fit only")
    if args.impl == "horovod":
        import horovod.tensorflow.keras as hvd
    elif args.impl == "elastic":
        import elastic_hvd.tensorflow.keras as hvd
    else:
        hvd = Alone
    hvd.init()
    result = {"allreduce": allreduce, "fit": fit}[args.what](hvd, args)
    if hvd.rank() == 0:
        result.update(impl=args.impl, np=hvd.size(), tf=tf.__version__,
                      library=getattr(hvd, "__file__", None))
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
