"""A digest of the model's weights after every batch, for comparing ranks step by step.

Comparing only final weights hides ranks that diverge and are brought back
together later (a broadcast at the next epoch, say); the test compares the
weights of every rank after every committed optimizer step, numbered alike on
every rank, joiners included (see ``mpijob.assert_same_weights_every_step``).
"""

import hashlib
import json
import os
import time

import numpy as np
import tensorflow as tf

from elastic_hvd.core import runtime


class StepDigests(tf.keras.callbacks.Callback):
    """Appends ``{"step", "epoch", "batch", "digest", "launch", "time"}`` to
    ``TEST_OUT_DIR/steps<id>.jsonl`` (``launch``: 0, or n in the n-th relaunch)."""

    def __init__(self, original_id):
        super().__init__()
        self.path = os.path.join(os.environ["TEST_OUT_DIR"], f"steps{original_id}.jsonl")
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    @staticmethod
    def digest(model):
        h = hashlib.sha256()
        for w in model.get_weights():
            h.update(np.ascontiguousarray(w).tobytes())
        return h.hexdigest()

    def on_train_batch_end(self, batch, logs=None):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": runtime.session().step, "epoch": self.epoch,
                                "batch": batch, "digest": self.digest(self.model),
                                "launch": int(os.environ.get("ELASTIC_HVD_LAUNCH", 0)),
                                "time": time.time()}) + "\n")
