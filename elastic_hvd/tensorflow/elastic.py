"""Horovod's elastic API (``hvd.elastic``), on a job that recovers in place.

Elastic Horovod restarts the training function from the last ``commit()`` after
a failure.  elastic_hvd's collectives survive the failure where it happens, so
``run`` just calls the function once; the state objects keep Horovod's meaning
(``commit`` saves a copy in memory, ``restore`` goes back to it, ``sync``
broadcasts from rank 0) for scripts that use them, e.g. to roll back on their
own terms.
"""

import copy
import functools

from ..core import runtime


def run(func):
    """Decorator for the training function ``func(state, ...)``: calls it once, after a sync."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        return func(state, *args, **kwargs)
    return wrapper


class State:
    """Named values (epoch, batch, ...) kept in sync across ranks."""

    def __init__(self, **kwargs):
        self._values = dict(kwargs)
        self._saved = copy.deepcopy(self._values)
        self._reset_callbacks = []

    def __getattr__(self, name):
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            super().__setattr__(name, value)
        else:
            self._values[name] = value

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        self.save()

    def check_host_updates(self):
        """Nothing to do: membership changes are handled inside the collectives."""

    def save(self):
        self._saved = copy.deepcopy(self._values)

    def restore(self):
        self._values = copy.deepcopy(self._saved)

    def sync(self):
        self._values = runtime.current("state.sync()").broadcast_object(self._values, 0)
        self.save()


ObjectState = State


class TensorFlowState(State):
    """State holding TF variables (broadcast from rank 0 on sync)."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise NotImplementedError("TF1 sessions are not supported by elastic_hvd's elastic state")
        super().__init__(**kwargs)
        self._variables = list(variables or [])
        self._saved_vars = [v.numpy() for v in self._variables]

    def save(self):
        super().save()
        self._saved_vars = [v.numpy() for v in getattr(self, "_variables", [])]

    def restore(self):
        super().restore()
        for v, value in zip(self._variables, self._saved_vars):
            v.assign(value)

    def sync(self):
        from . import broadcast_variables
        if self._variables:
            broadcast_variables(self._variables, 0)
        super().sync()


class TensorFlowKerasState(TensorFlowState):
    """State of a Keras model and its optimizer."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.__dict__["_model"] = model
        optimizer = optimizer or getattr(model, "optimizer", None)
        self.__dict__["_optimizer"] = optimizer
        super().__init__(variables=None, **kwargs)

    @property
    def model(self):
        return self._model

    def _all_variables(self):
        variables = list(self._model.variables)
        if self._optimizer is not None:
            opt_vars = self._optimizer.variables
            variables += list(opt_vars() if callable(opt_vars) else opt_vars)
        return variables

    def save(self):
        State.save(self)
        self._saved_vars = [v.numpy() for v in self._all_variables()]

    def restore(self):
        State.restore(self)
        for v, value in zip(self._all_variables(), self._saved_vars):
            v.assign(value)

    def sync(self):
        from . import broadcast_variables
        broadcast_variables(self._all_variables(), 0)
        State.sync(self)
        self.save()
