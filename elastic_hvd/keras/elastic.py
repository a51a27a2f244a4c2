"""``horovod.keras.elastic``: the same as elastic_hvd.tensorflow.keras.elastic (one
Keras, ``tf.keras``)."""

from ..tensorflow.keras.elastic import (CommitStateCallback, KerasState,  # noqa: F401
                                        TensorFlowKerasState, UpdateBatchStateCallback,
                                        UpdateEpochStateCallback, run)
