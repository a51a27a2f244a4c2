"""``fit_elastic``: ``model.fit`` for elastic datasets, one ``fit`` call per epoch.

Keras fixes the number of steps of an epoch of unknown length after the first
epoch and reuses it for all later ones.  An elastic epoch's length changes with
the membership (and with re-queued samples), so each epoch runs in its own
``model.fit`` call, which measures it afresh.  Compiled train functions are kept
between calls, so this costs no retracing.

On Keras 3 each call gets a ``steps_per_epoch`` bound that no epoch reaches:
without one, Keras 3 leaks at every such call (:mod:`keras_callbacks.keras_leaks`).
"""

import warnings
from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from elastic_hvd.core import ElasticHvdError, runtime

from .growth import ElasticGrowth
from .keras_leaks import bound_fit
from .progress import RankZeroProgbar


def fit_elastic(model: Any, dataset: Any, epochs: int, initial_epoch: int = 0,
                callbacks: Iterable[Any] = (), **kwargs: Any) -> Any:
    """Train from ``initial_epoch`` to ``epochs``; returns one History with every epoch.

    In a process spawned into the running job (an :class:`ElasticGrowth` among the
    callbacks replaced or added it), training starts where the job is: the
    callback takes over the live state first and sets the epoch.
    """
    callbacks = list(callbacks)
    for callback in callbacks:
        if isinstance(callback, RankZeroProgbar):
            callback.total_epochs = epochs
        if isinstance(callback, ElasticGrowth):
            callback.callbacks = callbacks
            if runtime.current("fit_elastic").joining:
                initial_epoch = callback.join(model, callbacks, dataset)
    if runtime.current("fit_elastic").joining:
        raise ElasticHvdError("this process was spawned into a running job, but fit_elastic got "
                              "no ElasticGrowth callback to hand it the live training state")
    in_fit = bound_fit(model, kwargs, callbacks)
    history = tf.keras.callbacks.History()
    history.history, history.epoch = {}, []
    kwargs.setdefault("shuffle", False)  # the sampler shuffles
    for epoch in range(initial_epoch, epochs):
        with warnings.catch_warnings():  # the epoch ends when the data does: that is the point
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            step = model.fit(dataset, epochs=epoch + 1, initial_epoch=epoch, callbacks=in_fit,
                             **kwargs)
        history.epoch += step.epoch
        for callback in callbacks:  # Keras' CSVLogger truncates its file at every fit:
            if isinstance(callback, tf.keras.callbacks.CSVLogger):  # one run, one file
                callback.append = True
        for key, values in step.history.items():
            history.history.setdefault(key, []).extend(values)
        if model.stop_training:
            break
    history.set_model(model)
    return history

