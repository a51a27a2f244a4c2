"""A digest of the model's weights after every batch, for comparing ranks step by step.

Comparing only final weights hides ranks that diverge and are brought back
together later (a broadcast at the next epoch, say); the test compares the
weights of every rank after every committed optimizer step, numbered alike on
every rank, joiners included (see ``mpijob.assert_same_weights_every_step``).
"""

import hashlib
import json
import os

import numpy as np
import tensorflow as tf

from elastic_hvd.core import runtime


class StepDigests(tf.keras.callbacks.Callback):
    """Appends ``{"step", "epoch", "batch", "digest"}`` to ``TEST_OUT_DIR/steps<id>.jsonl``."""

    def __init__(self, original_id):
        super().__init__()
        self.path = os.path.join(os.environ["TEST_OUT_DIR"], f"steps{original_id}.jsonl")
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        h = hashlib.sha256()
        for w in self.model.get_weights():
            h.update(np.ascontiguousarray(w).tobytes())
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": runtime.session().step, "epoch": self.epoch,
                                "batch": batch, "digest": h.hexdigest()}) + "\n")
