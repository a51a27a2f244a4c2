"""Horovod's elastic API (``hvd.elastic``), on a job that recovers in place.

Elastic Horovod restarts the training function from the last ``commit()`` after
a failure.  elastic_hvd's collectives survive the failure where it happens, so
``run`` does not restart anything for a failure; the state objects keep Horovod's
meaning (``commit`` saves a copy in memory, ``restore`` goes back to it, ``sync``
broadcasts from rank 0) for scripts that use them, e.g. to roll back on their
own terms.

Growing (``elastic-hvd-run --respawn`` / ``--max-np``) follows Horovod's model
for added hosts: ``commit()`` runs the growth policy; the commit at which new
processes are adopted raises :class:`HostsUpdatedInterrupt` on the running ranks,
``run`` calls the reset callbacks, syncs the state (the new processes receive
it) and calls the training function again -- from the committed state, which is
the current one, so nothing is redone.  A new process runs the script from the
top and, in ``run``, joins and receives the state before training.
"""

import copy
import functools

from ..core import runtime
from ..core.growth import GrowthPolicy

_policy = None


def growth_policy():
    """This process's growth policy (from elastic-hvd-run's flags)."""
    global _policy
    if _policy is None:
        _policy = GrowthPolicy.from_env()
    return _policy


class HostsUpdatedInterrupt(Exception):
    """Raised by ``State.commit()`` when new processes joined: ``run`` restarts training."""


def run(func):
    """Decorator for the training function ``func(state, ...)``: syncs the state and
    calls it; again after processes joined (see the module doc)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        comm = runtime.current("hvd.elastic.run")
        if comm.joining:
            growth_policy().step(comm)  # a joining process's first step joins
        while True:
            _sync(state, comm)
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                state.on_reset()
    return wrapper


def _sync(state, comm):
    state.sync()
    policy = growth_policy()
    policy.load_state(comm.broadcast_object(policy.state()))


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
        self.check_host_updates()

    def check_host_updates(self):
        """Failures need nothing here (they are handled inside the collectives); this
        is where the job grows: see the module doc."""
        policy = growth_policy()
        if policy:
            event = policy.step(runtime.current("state.commit()"))
            if event is not None and event.gained:
                raise HostsUpdatedInterrupt(f"rank(s) {list(event.gained)} joined")

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
        optimizer = self._optimizer
        if hasattr(optimizer, "build") and not getattr(optimizer, "built", True):
            optimizer.build(self._model.trainable_variables)  # a joiner, before its first step
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
