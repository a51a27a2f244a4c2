"""The soak's training job: ``hvd.fit`` on ``ElasticData`` until a deadline, built to be watched.

    elastic-hvd-run -np 4 --respawn python tests/soak/job.py --out DIR --deadline UNIX_TIME

Why it looks like this: the driver (``driver.py``) checks the job from outside, so
the job only *reports*, one JSON line per committed step and per process
(``DIR/steps/<pid>-<start>.jsonl``), and decides nothing about correctness itself.

* **What the model applied, per sample.** Besides a small regression network
  (what a user trains; its loss is the plotted one), the model has one weight
  per sample id (the ``Counter``), whose gradient is +1 for each sample a rank
  trained in the step (0 for padding).  Whatever the learning rate or the
  averaging, every sample applied in a step lowers its own entry by the same
  amount, and no other entry moves; so the entries that moved between two
  committed steps *are* the samples that step applied (read from the weights,
  not from the sampler), and the driver checks each epoch applied each sample
  exactly once.
* **Faults from outside:** SIGTERM ends the program cleanly (``sys.exit(0)``, what a
  preempted instance's handler does); SIGUSR1 arms a tripwire that raises inside
  the next train step's forward pass (a ``tf.py_function`` in the model).
  SIGUSR2 prints every thread's Python stack (the driver's evidence of a hang).
* **Until the deadline:** epochs run until ``--deadline``; the ranks decide to stop
  together (an allreduce of "past the deadline" at each epoch's end), so none
  leaves an epoch the others still train.
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workers"))
from stepcheck import StepDigests  # noqa: E402

import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
from elastic_hvd import core  # noqa: E402
from elastic_hvd.core import procfs, runtime  # noqa: E402

keras = tf.keras
#: Per-rank learning rate; the script starts at BASE_LR x size (the linear rule).
BASE_LR = 2.0 ** -6
FEATURES = 8

TRIPPED = threading.Event()
#: This process's start time (clock ticks since boot, ``/proc/self/stat``): with the pid,
#: what names its files and records.  A pid alone is not a process: pids are reused
#: once the 32768 of ``pid_max`` wrap, which a 30-minute soak's TF threads make them do.
START = int(procfs.stat_fields("/proc/self/stat")[procfs.START])
ME = f"{os.getpid()}-{START}"


def on_sigterm(*_):
    sys.exit(0)


class Counter(keras.layers.Layer):
    """One weight per sample id: output ``w[id]``, so d(output)/dw is one-hot at ``id``."""

    def __init__(self, size, **kwargs):
        super().__init__(**kwargs)
        self.size = size

    def build(self, input_shape):
        self.w = self.add_weight(shape=(self.size,), initializer="zeros", name="w")

    def call(self, ids):
        return tf.reduce_sum(self.w * tf.one_hot(ids, self.size), axis=-1, keepdims=True)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 1)


def _trip():
    if TRIPPED.is_set():
        raise RuntimeError("soak: injected exception inside the train step (SIGUSR1)")
    return np.float32(0.0)


class Tripwire(keras.layers.Layer):
    """Identity, plus a Python call inside the step that raises once SIGUSR1 armed it."""

    def call(self, x):
        return x + tf.ensure_shape(tf.py_function(_trip, [], tf.float32), [])

    def compute_output_shape(self, input_shape):
        return input_shape


class SoakLoss(keras.losses.Loss):
    """Per sample: squared error / batch (the regression) + the counter's output."""

    def __init__(self, batch):
        super().__init__(reduction="sum", name="soak_loss")
        self.batch = batch

    def call(self, y_true, y_pred):
        return tf.square(y_pred[:, 0] - y_true[:, 0]) / self.batch + y_pred[:, 1]


def mse(y_true, y_pred):
    return tf.reduce_mean(tf.square(y_pred[:, 0] - y_true[:, 0]))


def build(samples, batch, size):
    inputs = keras.Input((FEATURES + 1,))
    features = keras.layers.Lambda(lambda t: t[:, :FEATURES])(inputs)
    ids = keras.layers.Lambda(lambda t: tf.cast(t[:, FEATURES], tf.int32))(inputs)
    hidden = keras.layers.Dense(16, activation="tanh")(Tripwire()(features))
    pred = keras.layers.Dense(1)(hidden)
    outputs = keras.layers.Concatenate()([pred, Counter(samples, name="counter")(ids)])
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(BASE_LR * size)),
                  loss=SoakLoss(batch), metrics=[mse])
    return model


class Reporter(keras.callbacks.Callback):
    """Writes, after every committed step, what the driver checks (see the module doc);
    at each epoch's end, stops the job (on every rank alike) once past the deadline."""

    def __init__(self, out, deadline):
        super().__init__()
        self.path = os.path.join(out, "steps", f"{ME}.jsonl")
        self.deadline = deadline
        self.epoch = 0
        self.before = None  # the counter after the previous committed step (on this rank)
        self.begin = {}

    def _write(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _counter(self):
        return self.model.get_layer("counter").w.numpy().astype(np.float64)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        comm = runtime.current()
        if self.before is None:  # first step of this process (a joiner: the state it took)
            self.before = self._counter()
        self.begin = {"size_begin": comm.size, "t_begin": time.time(),
                      "lr_begin": float(self.model.optimizer.learning_rate)}

    def on_train_batch_end(self, batch, logs=None):
        comm = runtime.current()
        counter = self._counter()
        moved = self.before - counter  # > 0 where the step applied a sample
        self.before = counter
        applied = np.flatnonzero(moved != 0)
        unit = float(moved[applied].min()) if len(applied) else 0.0
        ratios = moved[applied] / unit if unit else moved[applied]
        odd = {int(i): round(float(r), 4) for i, r in zip(applied, ratios) if abs(r - 1) > 1e-3}
        self._write({"step": runtime.session().step, "epoch": self.epoch, "batch": batch,
                     "t": time.time(), "pid": os.getpid(), "start": START,
                     "id": comm.original_id, "rank": comm.rank, "size": comm.size,
                     "lr": float(self.model.optimizer.learning_rate), **self.begin,
                     "digest": StepDigests.digest(self.model), "applied": applied.tolist(),
                     "unit": unit, "odd": odd, "mse": float((logs or {}).get("mse", np.nan))})

    def on_epoch_end(self, epoch, logs=None):
        now = time.time()  # what the record says is what this rank judged the deadline by
        self._write({"epoch_end": epoch, "t": now, "pid": os.getpid(),
                     "rank": runtime.current().rank})
        late = np.array([1.0 if now >= self.deadline else 0.0])
        if runtime.current().allreduce(late, op=core.Max)[0] > 0:
            self.model.stop_training = True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, required=True)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGUSR1, lambda *_: TRIPPED.set())
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    comm = runtime.current()
    procs = os.path.join(args.out, "procs")
    with open(os.path.join(procs, f"{ME}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "joining": bool(comm.joining), "t": time.time(),
                   "id": comm.original_id}, f)
    rng = np.random.default_rng(0)  # the same samples on every rank
    x = rng.normal(size=(args.samples, FEATURES)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(FEATURES, 1))).astype(np.float32)
    inputs = np.concatenate([x, np.arange(args.samples, dtype=np.float32)[:, None]], axis=1)
    data = hvd.ElasticData((inputs, y), batch_size=args.batch, seed=1)
    tf.keras.utils.set_random_seed(1)
    model = build(args.samples, args.batch, comm.size)
    open(os.path.join(procs, f"{ME}.ready"), "w").close()  # a joiner: joining next
    hvd.fit(model, data, epochs=10 ** 6, verbose=0, checkpoint_dir=os.path.join(args.out, "ckpt"),
            events=os.path.join(args.out, "events.jsonl"),
            callbacks=[Reporter(args.out, args.deadline)])
    anomalies = [str(a) for a in getattr(runtime.current(), "anomalies", [])]
    with open(os.path.join(procs, f"{ME}.end"), "w") as f:
        json.dump({"id": runtime.current().original_id, "anomalies": anomalies,
                   "step": runtime.session().step}, f)


if __name__ == "__main__":
    main()
