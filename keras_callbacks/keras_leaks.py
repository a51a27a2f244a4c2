"""Two Keras 3 memory leaks that a long elastic job would hit at every epoch.

Both keep native memory for good (Keras 3.15.1, the newest; ``bench/fit_memory.py``
shows it without elastic_hvd; docs/measurements.md), so a job that runs for days grows
without end.  tf_keras has neither.

* ``model.fit`` on a dataset of unknown length without ``steps_per_epoch``
  keeps memory at every call, and ``fit_elastic`` calls it once per epoch.  Given a
  ``steps_per_epoch`` it keeps nothing, even when the data runs out first, so each
  call gets one that no epoch reaches (the epoch still ends when the sampler's data
  does), and callbacks still see ``steps`` None: the length is unknown.  tf_keras would
  log a warning at every epoch for the bound, so it gets none.
* ``model.save_weights`` of a compiled model keeps memory at every call (the
  checkpoint's writer saves once per epoch).  The cause: Keras' saving walks
  each object's attributes minus a "skip set" built from a reference object of
  the same type, and caches that set under one global-state key
  (``saving_attr_skipset_<type>``) while it reads another
  (``saving_attr_skiplist_<type>``).  The cache never hits, so every save
  builds a reference ``Optimizer(1.0)``, and each built optimizer keeps some.
  :func:`save_weights` stores the set under the key Keras reads first: the
  file is the same, the save keeps nothing.
"""

import sys
from typing import Any

import tensorflow as tf


def keras_3(model: Any) -> bool:
    """Whether ``model`` is a Keras 3 model (not tf_keras)."""
    return any(cls.__module__.startswith("keras.") for cls in type(model).__mro__)


#: A ``steps_per_epoch`` bound that no elastic epoch reaches.
NO_EPOCH_REACHES = sys.maxsize


def bound_fit(model: Any, kwargs: dict[str, Any], callbacks: list[Any]) -> list[Any]:
    """Give a Keras 3 ``fit`` call on elastic data the bound (in ``kwargs``, unless
    the caller set one); returns the callbacks to pass, which hide it again."""
    if not keras_3(model):
        return callbacks
    kwargs.setdefault("steps_per_epoch", NO_EPOCH_REACHES)
    if kwargs.get("validation_data") is not None:
        kwargs.setdefault("validation_steps", NO_EPOCH_REACHES)
    return [_StepsUnknown(), *callbacks]


class _StepsUnknown(tf.keras.callbacks.Callback):
    """First in the list: sets the ``steps`` that all callbacks share back to None
    (an elastic epoch's length is unknown; ``NO_EPOCH_REACHES`` is only a bound)."""

    def set_params(self, params: dict[str, Any]) -> None:
        if params.get("steps") == NO_EPOCH_REACHES:
            params["steps"] = None
        super().set_params(params)


def save_weights(model: Any, path: str) -> None:
    """``model.save_weights(path)``, without Keras 3's leak of a reference optimizer."""
    if keras_3(model):
        _cache_optimizer_skip_set()
    model.save_weights(path)


def _cache_optimizer_skip_set() -> None:
    """Store the optimizer's skip set where Keras 3 looks for it (see the module doc).

    Set again after ``keras.utils.clear_session()``, which empties the global state.
    Only the optimizer's: the other types' reference objects keep nothing
    (docs/measurements.md).
    """
    try:
        from keras.src.backend.common import global_state
        from keras.src.saving import saving_lib
    except ImportError:  # a Keras laid out otherwise: nothing to work around that we know of
        return
    read_key = "saving_attr_skiplist_Optimizer"
    if global_state.get_global_attribute(read_key) is None:
        global_state.set_global_attribute(read_key, saving_lib.get_attr_skipset("Optimizer"))
