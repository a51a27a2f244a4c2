"""model.fit on elastic sharding with every keras_callbacks piece; ranks report JSON.

    python elastic_fit.py <epochs> [restart]

Each rank logs the sample ids of every batch it draws (TEST_OUT_DIR/ids<orig>.jsonl,
with the launch: a job that elastic-hvd-run relaunched writes there again).
With ``elastic-hvd-run --respawn`` / ``--max-np`` the job grows back (ElasticGrowth);
TEST_STEP_SLEEP slows every step down so that joiners arrive while it trains;
TEST_SLOW_UNTIL_SIZE=n slows it to 3 s a step while fewer than n ranks train, so that a
respawned process (TF import, compile: 3-4x slower on a loaded machine) arrives before
training ends however long it takes to start, and costs nothing once it has joined.
"""

import json
import os
import signal
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
from stepcheck import StepDigests  # noqa: E402
import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
import keras_callbacks as kc  # noqa: E402
from elastic_hvd.core import runtime  # noqa: E402
from elastic_hvd.sharding import ElasticSampler  # noqa: E402
from elastic_hvd.tensorflow.data import elastic_dataset  # noqa: E402

N, BATCH, BASE_LR = 100, 4, 0.02
OUT = os.environ["TEST_OUT_DIR"]
LAUNCH = int(os.environ.get("ELASTIC_HVD_LAUNCH", 0))  # n in elastic-hvd-run's n-th relaunch


class CrashingCheckpoint(kc.ElasticCheckpoint):
    """Dies (SIGKILL) half-way through writing the checkpoint of TEST_CRASH_IN_CHECKPOINT."""

    def save(self, resume_epoch):
        if (str(resume_epoch) == os.environ.get("TEST_CRASH_IN_CHECKPOINT")
                and runtime.current().rank == 0):
            os.makedirs(self.directory, exist_ok=True)
            self.model.save_weights(os.path.join(self.directory, "partial.tmp.weights.h5"))
            os.kill(os.getpid(), signal.SIGKILL)
        super().save(resume_epoch)


class SlowSteps(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        # Every rank sees the same agreed size: they slow down alike.
        waiting = hvd.size() < int(os.environ.get("TEST_SLOW_UNTIL_SIZE", 0))
        time.sleep(3.0 if waiting else float(os.environ.get("TEST_STEP_SLEEP", 0)))


def main(epochs):
    if os.environ.get("TEST_SIGTERM_EXITS"):  # what a preempted spot instance's script does
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    hvd.init()
    comm = runtime.current()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    sampler = ElasticSampler(comm, N, BATCH, seed=1)
    def load(ids, weights):  # a joiner learns its original id when it joins: open late
        with open(os.path.join(OUT, f"ids{comm.original_id}.jsonl"), "a") as ids_log:
            ids_log.write(json.dumps({"epoch": sampler.epoch, "step": sampler.step,
                                      "ids": ids[weights > 0].tolist(), "launch": LAUNCH}) + "\n")
        return x[ids], y[ids], weights

    dataset = elastic_dataset(sampler, load, (
        tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None, 1], tf.float32),
        tf.TensorSpec([None], tf.float32)))
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(8, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(BASE_LR * comm.size, momentum=0.5)), loss="mse")
    checkpoint = CrashingCheckpoint(os.path.join(OUT, "ckpt"), sampler=sampler,
                                    final_on_signal=os.environ.get("TEST_FINAL_ON_SIGNAL") == "1"
                                    or None)
    initial_epoch = checkpoint.restore(model)
    restored = {"step": runtime.session().step, "digest": StepDigests.digest(model)}
    rescaler = kc.LearningRateRescaler("linear")
    log = kc.MembershipEventLog(os.path.join(OUT, "events.jsonl"), rescaler=rescaler)
    with checkpoint.final_on_failure():
        kc.fit_elastic(model, dataset, epochs, initial_epoch=initial_epoch, verbose=0, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0), StepDigests(comm.original_id),
            kc.FaultInjection(), rescaler, log, checkpoint, hvd.callbacks.MetricAverageCallback(),
            kc.RankZeroProgbar(), kc.ElasticGrowth(sampler), SlowSteps()])
    loss = float(np.mean((model.predict(x, verbose=0) - y) ** 2))
    report.write(comm.original_id, ids=list(comm.ids), events=log.records,
                 lr=float(model.optimizer.learning_rate.numpy()), loss=loss,
                 initial_epoch=initial_epoch, requeued=sampler.requeued, restored=restored,
                 digest=str(hash(tuple(np.concatenate([w.ravel() for w in model.get_weights()])
                                       .tolist()))))


if __name__ == "__main__":
    main(int(sys.argv[1]))
