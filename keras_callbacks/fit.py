"""``fit_elastic``: ``model.fit`` for elastic datasets, one ``fit`` call per epoch.

Keras fixes the number of steps of an epoch of unknown length after the first
epoch and reuses it for all later ones.  An elastic epoch's length changes with
the membership (and with re-queued samples), so each epoch runs in its own
``model.fit`` call, which measures it afresh.  Compiled train functions are kept
between calls, so this costs no retracing.
"""

import warnings

import tensorflow as tf

from .progress import RankZeroProgbar


def fit_elastic(model, dataset, epochs, initial_epoch=0, callbacks=(), **kwargs):
    """Train from ``initial_epoch`` to ``epochs``; returns one History with every epoch."""
    callbacks = list(callbacks)
    for callback in callbacks:
        if isinstance(callback, RankZeroProgbar):
            callback.total_epochs = epochs
    history = tf.keras.callbacks.History()
    history.history, history.epoch = {}, []
    kwargs.setdefault("shuffle", False)  # the sampler shuffles
    for epoch in range(initial_epoch, epochs):
        with warnings.catch_warnings():  # the epoch ends when the data does: that is the point
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            step = model.fit(dataset, epochs=epoch + 1, initial_epoch=epoch, callbacks=callbacks,
                             **kwargs)
        history.epoch += step.epoch
        for key, values in step.history.items():
            history.history.setdefault(key, []).extend(values)
        if model.stop_training:
            break
    history.set_model(model)
    return history
