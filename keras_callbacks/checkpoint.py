"""Checkpoints that survive the death of whoever writes them.

The current lowest rank writes (rank 0 may be gone); every file is written to a
temporary name and renamed, so a crash mid-write leaves the last good checkpoint
intact.  A checkpoint holds the model's weights, the optimizer's variables, the
epoch to resume at and, when given, the data sampler's position.
"""

import contextlib
import json
import os
import sys

import numpy as np
import tensorflow as tf

from elastic_hvd.core import runtime

#: Exit status of a job that stopped because too few ranks were left.
EXIT_BELOW_MIN_NP = 3


def optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class ElasticCheckpoint(tf.keras.callbacks.Callback):
    """Save at the end of every ``every`` epochs into ``directory``; ``restore()`` resumes."""

    def __init__(self, directory, sampler=None, every=1):
        super().__init__()
        self.directory, self.sampler, self.every = directory, sampler, every
        self.epoch = 0
        self.saves = 0

    @property
    def meta_path(self):
        return os.path.join(self.directory, "checkpoint.json")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every == 0:
            self.save(epoch + 1, sampler_state=None)

    def save(self, resume_epoch, sampler_state=None):
        """Write the checkpoint (lowest live rank only); ``resume_epoch`` is where to restart."""
        if runtime.current("ElasticCheckpoint").rank != 0:
            return
        os.makedirs(self.directory, exist_ok=True)
        tag = f"epoch{resume_epoch:04d}-{self.saves}"
        weights = os.path.join(self.directory, f"{tag}.weights.h5")
        self.model.save_weights(weights + ".tmp.weights.h5")
        os.replace(weights + ".tmp.weights.h5", weights)
        slots = os.path.join(self.directory, f"{tag}.optimizer.npz")
        with open(slots + ".tmp", "wb") as f:
            np.savez(f, *[v.numpy() for v in optimizer_variables(self.model.optimizer)])
        os.replace(slots + ".tmp", slots)
        meta = {"epoch": resume_epoch, "weights": os.path.basename(weights),
                "optimizer": os.path.basename(slots), "sampler": sampler_state}
        with open(self.meta_path + ".tmp", "w") as f:
            json.dump(meta, f)
        os.replace(self.meta_path + ".tmp", self.meta_path)  # the commit point
        self.saves += 1

    def restore(self, model):
        """Load the last checkpoint into ``model``; returns the epoch to resume at (0: none).
        A process joining a running job loads nothing: it receives the live state."""
        if not os.path.exists(self.meta_path) or runtime.current("restore").joining:
            return 0
        with open(self.meta_path) as f:
            meta = json.load(f)
        model.load_weights(os.path.join(self.directory, meta["weights"]))
        optimizer = model.optimizer
        if hasattr(optimizer, "build") and not getattr(optimizer, "built", True):
            optimizer.build(model.trainable_variables)
        with np.load(os.path.join(self.directory, meta["optimizer"])) as slots:
            values = [slots[f"arr_{i}"] for i in range(len(slots.files))]
        variables = optimizer_variables(optimizer)
        if len(values) == len(variables):
            for variable, value in zip(variables, values):
                variable.assign(value)
        if self.sampler is not None:
            if meta.get("sampler"):  # an interrupted epoch: continue where it stopped
                self.sampler.load_state(meta["sampler"])
            else:  # a finished epoch: the next one starts afresh
                self.sampler.epoch = meta["epoch"] - 1
        return meta["epoch"]

    @contextlib.contextmanager
    def final_on_failure(self):
        """Around ``model.fit``: if too few ranks are left (``RanksBelowMinimumError``,
        however TF wrapped it), the survivors save and exit with EXIT_BELOW_MIN_NP.

        The checkpoint resumes the interrupted epoch where it stopped (the sampler's
        remaining queue), so no sample is lost or repeated.
        """
        try:
            yield
        except Exception:  # inside model.fit, TF re-wraps the core's error
            below_min = runtime.current().below_min_np
            if below_min is None:
                raise
            state = self.sampler.state() if self.sampler is not None else None
            self.save(self.epoch, sampler_state=state)
            if runtime.current().rank == 0:
                print(f"elastic_hvd: stopping: {below_min}. Final checkpoint written to "
                      f"{self.directory}; restart the job to resume at epoch {self.epoch + 1}.",
                      file=sys.stderr, flush=True)
            runtime.exit_with(EXIT_BELOW_MIN_NP)
