"""model.fit whose checkpoint writer is SIGKILLed at chosen points of chosen saves.

    python checkpoint_crash.py <epochs>

TEST_CRASH_PLAN="1:wrote weights;3:committed": the writer of save number 1 (the
save counter every rank counts) dies at ``CheckpointFiles.reached("wrote weights")``.
TEST_KEEP: ElasticCheckpoint's ``keep``.

Whoever writes a save logs to TEST_OUT_DIR/ckpt_log.jsonl, before writing:
the directory's file names, the sha256 of checkpoint.json and of every file it
references, the digest of the model it saves and of the committed checkpoint
restored into a scratch model; after a save that returned: the same hashes.
At the end every rank restores the newest checkpoint into a fresh model and
reports whether it equals the live one.
"""

import hashlib
import inspect
import json
import os
import signal
import sys
import warnings

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
import keras_callbacks as kc  # noqa: E402
from elastic_hvd.core import runtime  # noqa: E402
from elastic_hvd.sharding import ElasticSampler  # noqa: E402
from elastic_hvd.tensorflow.data import elastic_dataset  # noqa: E402
from elastic_hvd.tensorflow.optimizer_state import optimizer_variables  # noqa: E402

N, BATCH, BASE_LR = 100, 4, 0.02
OUT = os.environ["TEST_OUT_DIR"]
CKPT = os.path.join(OUT, "ckpt")
PLAN = {int(seq): point for seq, point in
        (item.split(":", 1) for item in os.environ.get("TEST_CRASH_PLAN", "").split(";") if item)}


def sha(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def referenced(meta):
    """File names the metadata references (either format), recursively."""
    names = set()
    if isinstance(meta, dict):
        for key, value in meta.items():
            if key in ("weights", "optimizer") and isinstance(value, str):
                names.add(value)
            elif key == "files":
                names.update(value)
            else:
                names |= referenced(value)
    elif isinstance(meta, list):
        for item in meta:
            names |= referenced(item)
    return names


def snapshot():
    meta_path = os.path.join(CKPT, "checkpoint.json")
    if not os.path.exists(meta_path):
        return {}
    with open(meta_path) as f:
        meta = json.load(f)
    snap = {name: sha(os.path.join(CKPT, name)) for name in referenced(meta)}
    snap["checkpoint.json"] = sha(meta_path)
    return {"hashes": snap, "newest": meta["files"],
            "seq": meta.get("seq"), "epoch": meta["epoch"]}


def digest(values):
    h = hashlib.sha256()
    for v in values:
        h.update(np.ascontiguousarray(np.asarray(v)).tobytes())
    return h.hexdigest()


def log(record):
    with open(os.path.join(OUT, "ckpt_log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def make_model(optimizer):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(8, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def restored(kwargs):
    """The newest committed checkpoint, restored into a fresh model: (epoch, weights
    digest, optimizer digest, Keras' 'Skipping variable loading' warnings)."""
    scratch = make_model(tf.keras.optimizers.SGD(BASE_LR, momentum=0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epoch = kc.ElasticCheckpoint(CKPT, **kwargs).restore(scratch)
    skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
    return (epoch, digest(scratch.get_weights()),
            digest(v.numpy() for v in optimizer_variables(scratch.optimizer)), skipped)


class CheckedCheckpoint(kc.ElasticCheckpoint):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kwargs = {k: v for k, v in kwargs.items() if k == "keep"}
        self.seq = None
        files = getattr(self, "files", None)  # the crash points (absent before issue 10)
        if files is not None:
            files.reached = self.reached

    def reached(self, point):
        if PLAN.get(self.seq) == point:
            log({"kind": "crash", "seq": self.seq, "point": point})
            os.kill(os.getpid(), signal.SIGKILL)

    def save(self, resume_epoch):
        self.seq = self.saves
        comm = runtime.current()
        writer = comm.rank == 0
        if writer:
            loaded = None
            if os.path.exists(self.meta_path):
                epoch, weights, slots, _ = restored(self.kwargs)
                loaded = {"epoch": epoch, "digest": weights, "optimizer": slots}
            log({"kind": "before", "seq": self.seq, "epoch": resume_epoch,
                 "writer": comm.original_id, "size": comm.size,
                 "present": sorted(os.listdir(CKPT)) if os.path.isdir(CKPT) else [],
                 "snap": snapshot(), "loaded": loaded, "digest": digest(self.model.get_weights()),
                 "optimizer": digest(v.numpy() for v in optimizer_variables(self.model.optimizer))})
        super().save(resume_epoch)
        if writer:
            log({"kind": "after", "seq": self.seq, "snap": snapshot()})


def main(epochs):
    hvd.init()
    comm = runtime.current()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    sampler = ElasticSampler(comm, N, BATCH, seed=1)
    dataset = elastic_dataset(sampler, lambda ids, weights: (x[ids], y[ids], weights), (
        tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None, 1], tf.float32),
        tf.TensorSpec([None], tf.float32)))
    model = make_model(hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(BASE_LR, momentum=0.5)))
    kwargs = {}
    if "keep" in inspect.signature(kc.ElasticCheckpoint).parameters:
        kwargs["keep"] = int(os.environ.get("TEST_KEEP", 3))
    checkpoint = CheckedCheckpoint(CKPT, sampler=sampler, **kwargs)
    initial_epoch = checkpoint.restore(model)
    restored_digest = digest(model.get_weights()) if initial_epoch else None
    with checkpoint.final_on_failure():
        kc.fit_elastic(model, dataset, epochs, initial_epoch=initial_epoch, verbose=0, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0), kc.FaultInjection(), checkpoint,
            hvd.callbacks.MetricAverageCallback()])
    epoch, weights, slots, skipped = restored(checkpoint.kwargs)
    live_slots = digest(v.numpy() for v in optimizer_variables(model.optimizer))
    report.write(comm.original_id, size=comm.size, initial_epoch=initial_epoch,
                 restored_digest=restored_digest, saves=checkpoint.saves, final_epoch=epoch,
                 final_weights_equal=weights == digest(model.get_weights()),
                 final_optimizer_equal=slots == live_slots, skipped=skipped)


if __name__ == "__main__":
    main(int(sys.argv[1]))
