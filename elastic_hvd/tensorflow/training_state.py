"""One training state: what a checkpoint saves, a joining process receives and
``hvd.elastic`` commits, syncs and restores.

Why one: with three formats (a checkpoint's files, the hand-over to a joiner,
``hvd.elastic``'s copies), a part added to one -- the momentum's pending
correction, the session's step -- was missing from the others.  A
:class:`TrainingState` names the parts a job has (model, optimizer, plain
variables, data sampler, growth policy, callbacks, a script's named values) and
its ``state()`` / ``load_state()`` are the only code that reads or writes them.
The state is plain Python and NumPy: broadcast as one object within the job,
written as data (:mod:`elastic_hvd.state_format`, never pickle) to a checkpoint
and to the launcher's copy.

Some parts describe the running job's *membership*: which membership events its
handlers applied and the learning-rate factor they produced (the training
session), the sampler's per-rank batch, the growth policy's counters, the
callbacks' live state -- and the learning rate, which the membership rescaled.
They are loaded with ``membership=True`` (a joiner, ``hvd.elastic``'s sync).  A
job restarted from a checkpoint, or a script rolling back with ``hvd.elastic``'s
``restore()``, keeps its own (``membership=False``): a restarted job trains at the
rate its script set for its own size (a schedule callback re-derives its
position from the epoch), and a rollback keeps the rescalings made since the
commit.  ``state()`` records the size it was taken at (``size``).
"""

import copy
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from ..core import runtime
from ..core.errors import ElasticHvdError
from . import layer
from .optimizer_state import (build_optimizer, get_lr, load_momentum_state, momentum_state,
                              optimizer_variables, set_lr)

if TYPE_CHECKING:
    from ..growth_policy import GrowthPolicy
    from ..sharding import ElasticSampler

FORMAT = 1


class TrainingState:
    """The parts of one training job; give the ones the job has.

    ``model``: a Keras model (its ``optimizer`` unless ``optimizer`` is given);
    ``variables``: TF variables besides a model; ``sampler``: the
    :class:`~elastic_hvd.sharding.ElasticSampler`; ``policy``: the
    :class:`~elastic_hvd.growth_policy.GrowthPolicy`; ``callbacks``: callbacks whose
    ``live_state()`` travels (membership only); ``values``: a dict of a script's values
    (``hvd.elastic.State``'s: copied in memory and broadcast, never written to a file).
    """

    def __init__(self, model: Any = None, optimizer: Any = None,
                 variables: Sequence[Any] | None = None, sampler: "ElasticSampler | None" = None,
                 policy: "GrowthPolicy | None" = None, callbacks: Sequence[Any] | None = None,
                 values: dict[str, Any] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.variables = variables
        self.sampler, self.policy, self.callbacks, self.values = sampler, policy, callbacks, values

    def state(self, epoch: int | None = None) -> dict[str, Any]:
        """Everything, as plain values; ``epoch``: the epoch to train (next)."""
        state: dict[str, Any] = {"format": FORMAT, "epoch": epoch}
        if runtime.is_initialized():
            # The learning-rate factor (the Keras layer's) travels in the session's part,
            # where checkpoints of every version have it.
            state["session"] = {**runtime.session().state(),
                                "lr_factor": layer.session_state().lr_factor}
            state["size"] = runtime.current().size
        if self.model is not None:
            state["model"] = [v.numpy() for v in self.model.variables]
        if self.variables is not None:
            state["variables"] = [v.numpy() for v in self.variables]
        if self.optimizer is not None:
            if self.model is not None:
                build_optimizer(self.optimizer, self.model)  # its slots are part of the state
            state["optimizer"] = [v.numpy() for v in optimizer_variables(self.optimizer)]
            state["lr"] = get_lr(self.optimizer)
            state["momentum"] = list(momentum_state(self.optimizer))  # as a file reads it
        if self.sampler is not None:
            state["sampler"] = {**self.sampler.state(), "batch_size": self.sampler.batch_size}
        if self.policy is not None:
            state["policy"] = self.policy.state()
        if self.callbacks is not None:
            state["callbacks"] = [c.live_state() if hasattr(c, "live_state") else None
                                  for c in self.callbacks]
        if self.values is not None:
            state["values"] = copy.deepcopy(self.values)
        return state

    def load_state(self, state: dict[str, Any], membership: bool = True) -> Any:
        """Load what ``state()`` returned (see the module doc for ``membership``);
        returns the state's epoch."""
        if state.get("format") != FORMAT:
            raise ElasticHvdError(f"not a training state of format {FORMAT}: "
                                  f"{sorted(state) if isinstance(state, dict) else type(state)}")
        if "session" in state and runtime.is_initialized():
            runtime.session().load_state(state["session"], membership)
            if membership:
                layer.session_state().lr_factor = state["session"]["lr_factor"]
        if self.model is not None:
            _assign(self.model.variables, state["model"], "model")
        if self.variables is not None:
            _assign(self.variables, state["variables"], "variables")
        if self.optimizer is not None:
            if self.model is not None:
                build_optimizer(self.optimizer, self.model)
            lr = state["lr"] if membership else get_lr(self.optimizer)
            _assign(optimizer_variables(self.optimizer), state["optimizer"], "optimizer")
            set_lr(self.optimizer, lr)  # (Keras 3 counts the rate among the variables)
            load_momentum_state(self.optimizer, state["momentum"])
        if self.sampler is not None:
            self._load_sampler(state["sampler"], state["epoch"], membership)
        if membership and self.policy is not None:
            self.policy.load_state(state["policy"])
        if membership and self.callbacks is not None:
            self._load_callbacks(state["callbacks"])
        if self.values is not None:
            self.values.clear()
            self.values.update(copy.deepcopy(state["values"]))
        return state["epoch"]

    def warm_up(self) -> None:
        """Assign the model's and the optimizer's variables their own values, once, in
        a joiner before it joins: a first assignment costs several times a later one,
        and the load of the live state is time the others wait (docs/measurements.md)."""
        parts = [self.model.variables if self.model is not None else [],
                 self.variables or []]
        if self.optimizer is not None:
            if self.model is not None:
                build_optimizer(self.optimizer, self.model)
            parts.append(optimizer_variables(self.optimizer))
        for variables in parts:
            variables = list(variables)
            _assign(variables, [v.numpy() for v in variables], "variables")

    def _load_sampler(self, saved, epoch, membership):
        if membership:
            self.sampler.batch_size = saved["batch_size"]
        if saved["epoch"] == epoch:  # mid-epoch: the rest of its queue
            self.sampler.load_state(saved)
        else:  # saved before the epoch's first batch was drawn: it starts afresh
            self.sampler.epoch = epoch - 1

    def _load_callbacks(self, saved):
        if len(saved) != len(self.callbacks):
            raise ElasticHvdError("a joining process must train with the same callbacks as "
                                  f"the job ({len(self.callbacks)} here, {len(saved)} there)")
        for callback, live in zip(self.callbacks, saved):
            if live is not None:
                callback.load_live_state(live)


def _assign(variables: Iterable[Any], values: Sequence[Any], what: str) -> None:
    variables = list(variables)
    if len(variables) != len(values) or any(
            tuple(v.shape) != tuple(x.shape) for v, x in zip(variables, values)):
        raise ElasticHvdError(
            f"the saved {what} does not match this process's ({len(variables)} variables here, "
            f"{len(values)} saved, or different shapes): build the same model")
    for variable, value in zip(variables, values):
        target = _tf_variable(variable)
        if target is None:
            variable.assign(value)
        else:
            target.assign(np.asarray(value, dtype=target.dtype.as_numpy_dtype), read_value=False)


def _tf_variable(variable: Any) -> Any:
    """The TF variable that holds ``variable`` (a Keras 3 variable's, or itself), or None:
    a joiner's load is the others' wait, and Keras 3's ``assign`` converts, checks and
    reads back each value, several times slower (docs/measurements.md)."""
    if isinstance(variable, tf.Variable):
        return variable
    held = getattr(variable, "value", None)
    return held if isinstance(held, tf.Variable) else None
