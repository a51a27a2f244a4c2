"""hvd.fit whose event log lies where nothing made a directory yet; ranks report JSON.

    python first_day.py <events path> [every|rank0|lr]

``every`` adds a membership callback whose handler raises at every change on every
rank, ``rank0`` one that raises on the current rank 0 only (as the event log's
writer did with a missing directory): a report that fails (a logging callback's
bug) must not cost the job, nor be taken for the loss of a rank.  ``lr``: one that
raises on every rank, ordered with the learning-rate handlers (what every rank
trains on: an error there stops the ranks, naming it).
"""

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
from elastic_hvd.core import runtime  # noqa: E402
from keras_callbacks.base import LEARNING_RATE, MembershipCallback  # noqa: E402


class BrokenReport(MembershipCallback):
    """A script's own report of each change, with a bug (on ``where`` ranks)."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        if where == "lr":
            self.ORDER = LEARNING_RATE

    def handle(self, event):
        if self.where != "rank0" or self.comm.rank == 0:
            raise ValueError(f"broken report of {event.old_size} -> {event.new_size} ranks")


def main(events, broken=None):
    hvd.init()
    x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
    y = (x.sum(axis=1) > 2).astype(np.int64)
    data = hvd.ElasticData((x, y), batch_size=4, seed=1)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hvd.fit(model, data, epochs=2, events=events, verbose=0,
            callbacks=[BrokenReport(broken)] if broken else [])
    report.write(runtime.current().original_id, size=hvd.size())


if __name__ == "__main__":
    main(*sys.argv[1:])
