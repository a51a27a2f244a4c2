"""Checkpoints that survive the death of whoever writes them.

The current lowest rank writes (rank 0 may be gone).  A checkpoint holds the
model's weights, the optimizer's variables, the epoch to resume at and, when
given, the data sampler's position.  How the files are named, written, committed
and kept is :mod:`keras_callbacks.ckpt_files`: a save never touches the files of
a committed checkpoint, so a writer that dies at any point (and the one that
takes over) leaves the last committed checkpoint loadable.  Names come from a
save counter that every rank counts (restored from the checkpoint, handed to
joining ranks), never from the writer's own history.

Not guaranteed: if the writer dies during the *final* checkpoint (too few
ranks), nobody writes it in its place: the previous committed one stays.
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

from elastic_hvd.core import runtime

from .ckpt_files import CheckpointFiles

#: Exit status of a job that stopped because too few ranks were left.
EXIT_BELOW_MIN_NP = 3


def optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _save_optimizer(optimizer, path):
    with open(path, "wb") as f:
        np.savez(f, *[v.numpy() for v in optimizer_variables(optimizer)])


class ElasticCheckpoint(tf.keras.callbacks.Callback):
    """Save at the end of every ``every`` epochs into ``directory``, keeping the newest
    ``keep`` committed checkpoints; ``restore()`` resumes from the newest."""

    def __init__(self, directory, sampler=None, every=1, keep=3):
        super().__init__()
        self.files = CheckpointFiles(directory, keep)
        self.directory, self.sampler, self.every = directory, sampler, every
        self.epoch = 0
        self.saves = 0  # saves so far, counted on every rank: the next one's sequence number

    @property
    def meta_path(self):
        return self.files.meta_path

    def live_state(self):  # a rank that joins counts on from here (see ElasticGrowth)
        return {"saves": self.saves}

    def load_live_state(self, state):
        self.saves = state["saves"]

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every == 0:
            self.save(epoch + 1, sampler_state=None)

    def save(self, resume_epoch, sampler_state=None):
        """Called on every rank (it counts the save); the lowest live rank writes.
        ``resume_epoch`` is where to restart."""
        seq, self.saves = self.saves, self.saves + 1
        if runtime.is_initialized() and runtime.current().rank != 0:
            return
        model = self.model
        self.files.write(seq, resume_epoch, {
            "weights": ("weights.h5", model.save_weights),
            "optimizer": ("optimizer.npz", lambda path: _save_optimizer(model.optimizer, path)),
        }, {"epoch": resume_epoch, "sampler": sampler_state})

    def restore(self, model):
        """Load the newest committed checkpoint into ``model``; returns the epoch to resume
        at (0: none).  A process joining a running job loads nothing: it receives the live state."""
        if runtime.is_initialized() and runtime.current().joining:
            return 0
        entries = self.files.entries()
        if not entries:
            return 0
        self.saves = max(self.saves, self.files.next_seq(entries))
        meta = self.files.load(lambda entry: self._read(model, entry))
        if self.sampler is not None:
            if meta.get("sampler"):  # an interrupted epoch: continue where it stopped
                self.sampler.load_state(meta["sampler"])
            else:  # a finished epoch: the next one starts afresh
                self.sampler.epoch = meta["epoch"] - 1
        return meta["epoch"]

    def _read(self, model, entry):
        optimizer = model.optimizer
        if hasattr(optimizer, "build") and not getattr(optimizer, "built", True):
            optimizer.build(model.trainable_variables)  # else Keras skips its variables
        model.load_weights(os.path.join(self.directory, entry["weights"]))
        with np.load(os.path.join(self.directory, entry["optimizer"])) as slots:
            values = [slots[f"arr_{i}"] for i in range(len(slots.files))]
        variables = optimizer_variables(optimizer)
        if len(values) == len(variables):
            for variable, value in zip(variables, values):
                variable.assign(value)

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
