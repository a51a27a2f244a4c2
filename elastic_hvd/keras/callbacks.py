"""``horovod.keras.callbacks``: elastic_hvd.tensorflow.keras's callbacks (one Keras,
``tf.keras``), with horovod.keras's parameters for BestModelCheckpoint."""

from ..tensorflow.keras import callbacks as _callbacks
from ..tensorflow.keras.callbacks import (BroadcastGlobalVariablesCallback,  # noqa: F401
                                          LearningRateScheduleCallback,
                                          LearningRateWarmupCallback, MetricAverageCallback)


class BestModelCheckpoint(_callbacks.BestModelCheckpoint):
    """horovod.keras's version keeps the whole model (no ``save_weights_only``)."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:

        super().__init__(monitor, verbose, False, mode, save_freq, filepath)
