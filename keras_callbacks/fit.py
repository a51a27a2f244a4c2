"""``fit_elastic``: ``model.fit`` for elastic datasets, one ``fit`` call per epoch.

Keras fixes the number of steps of an epoch of unknown length after the first
epoch and reuses it for all later ones.  An elastic epoch's length changes with
the membership (and with re-queued samples), so each epoch runs in its own
``model.fit`` call, which measures it afresh.  Compiled train functions are kept
between calls, so this costs no retracing.

Keras 3 (3.15.1, measured) keeps 70-150 kB of native memory for good at each
``fit`` call whose dataset is of unknown length and has no ``steps_per_epoch``:
one call per epoch made every rank's RSS grow without end (+1.7 % in 7.5
minutes of 0.7 s epochs; ``bench/fit_memory.py`` reproduces it without
elastic_hvd).  Given a ``steps_per_epoch`` it keeps nothing, even when the data
runs out first, so each call gets one that no epoch reaches (the epoch still
ends when the sampler's data does), and callbacks still see ``steps`` None:
the length is unknown.  tf_keras keeps nothing either way and would log a
warning at every epoch, so it gets none.
"""

import sys
import warnings
from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from elastic_hvd.core import ElasticHvdError, runtime

from .growth import ElasticGrowth
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
    in_fit = callbacks
    if _keras_3(model):
        kwargs.setdefault("steps_per_epoch", _NO_EPOCH_REACHES)
        if kwargs.get("validation_data") is not None:
            kwargs.setdefault("validation_steps", _NO_EPOCH_REACHES)
        in_fit = [_StepsUnknown(), *callbacks]
    history = tf.keras.callbacks.History()
    history.history, history.epoch = {}, []
    kwargs.setdefault("shuffle", False)  # the sampler shuffles
    for epoch in range(initial_epoch, epochs):
        with warnings.catch_warnings():  # the epoch ends when the data does: that is the point
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            step = model.fit(dataset, epochs=epoch + 1, initial_epoch=epoch, callbacks=in_fit,
                             **kwargs)
        history.epoch += step.epoch
        for key, values in step.history.items():
            history.history.setdefault(key, []).extend(values)
        if model.stop_training:
            break
    history.set_model(model)
    return history


#: A ``steps_per_epoch`` bound that no elastic epoch reaches (see the module doc).
_NO_EPOCH_REACHES = sys.maxsize


def _keras_3(model: Any) -> bool:
    return any(cls.__module__.startswith("keras.") for cls in type(model).__mro__)


class _StepsUnknown(tf.keras.callbacks.Callback):
    """First in the list: sets the ``steps`` that all callbacks share back to None
    (an elastic epoch's length is unknown; ``_NO_EPOCH_REACHES`` is only a bound)."""

    def set_params(self, params: dict[str, Any]) -> None:
        if params.get("steps") == _NO_EPOCH_REACHES:
            params["steps"] = None
        super().set_params(params)
