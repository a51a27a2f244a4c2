"""Fire the step-based faults of ``ELASTIC_HVD_FAULTS`` (``step=N``) from ``model.fit``."""

import tensorflow as tf

from elastic_hvd.core import faults


class FaultInjection(tf.keras.callbacks.Callback):
    """Counts training steps across epochs (from 1) and reports each to the fault plan."""

    def __init__(self):
        super().__init__()
        self.global_step = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.global_step += 1
        faults.at_step(self.global_step)
