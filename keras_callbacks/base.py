"""The base of the membership-aware callbacks.

Membership events fire inside a collective, i.e. inside the running train step
(possibly inside a compiled graph), where Keras state must not be touched.  So
each callback queues the events it is told about and handles them at the next
batch or epoch boundary, on the main thread, before the next step starts.
"""

import tensorflow as tf

from elastic_hvd.core import runtime


class MembershipCallback(tf.keras.callbacks.Callback):
    """Calls ``handle(event)`` at the first batch/epoch boundary after each membership change."""

    def __init__(self):
        super().__init__()
        self._pending = []
        self._comm = None
        self.epoch = 0
        self.step = 0

    def _attach(self):
        if self._comm is None:
            self._comm = runtime.current(type(self).__name__)
            self._comm.listeners.add(self._pending.append)

    @property
    def comm(self):
        self._attach()
        return self._comm

    def on_train_begin(self, logs=None):
        self._attach()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.step = epoch, 0

    def on_train_batch_end(self, batch, logs=None):
        self.step = batch + 1
        self._drain()

    def on_epoch_end(self, epoch, logs=None):
        self._drain()

    def on_train_end(self, logs=None):
        self._drain()

    def _drain(self):
        while self._pending:
            self.handle(self._pending.pop(0))

    def handle(self, event):
        raise NotImplementedError

    def live_state(self):
        """What a rank joining mid-training takes over (see keras_callbacks.growth)."""
        return {"epoch": self.epoch, "step": self.step}

    def load_live_state(self, state):
        self.epoch, self.step = state["epoch"], state["step"]
