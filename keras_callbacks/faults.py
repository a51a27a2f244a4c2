"""Fire the step-based faults of ``ELASTIC_HVD_FAULTS`` (``step=N``) from ``model.fit``."""

from typing import Any

import tensorflow as tf

from elastic_hvd.core import faults


class FaultInjection(tf.keras.callbacks.Callback):
    """Reports "step N is next" to the fault plan once N-1 steps are done (N from 1).

    It counts finished steps rather than started ones: with a dataset of unknown
    length Keras starts one more batch at the end of every epoch, finds no data
    and ends the epoch, so counting starts would drift by one per epoch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.steps_done = 0

    # step numbers stay global for processes that join later
    def live_state(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done}

    def load_live_state(self, state: dict[str, Any]) -> None:
        self.steps_done = state["steps_done"]

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.steps_done == 0:
            faults.at_step(1)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.steps_done += 1
        faults.at_step(self.steps_done + 1)
