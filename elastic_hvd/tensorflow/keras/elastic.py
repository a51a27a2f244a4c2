"""``hvd.elastic`` for Keras: state objects and the commit/update callbacks."""

from typing import TYPE_CHECKING

import tensorflow as tf

from ..elastic import TensorFlowKerasState as KerasState  # noqa: F401
from ..elastic import TensorFlowKerasState, run  # noqa: F401

if TYPE_CHECKING:
    from ..elastic import State


class CommitStateCallback(tf.keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches."""

    def __init__(self, state: "State", batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def commit(self) -> None:
        """Commit the state now (Horovod's callbacks have it too)."""
        self.state.commit()


class UpdateBatchStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.batch`` equal to the current batch."""

    def __init__(self, state: "State") -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.epoch`` equal to the current epoch."""

    def __init__(self, state: "State") -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = epoch + 1
