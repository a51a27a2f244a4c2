"""Reading and setting an optimizer's learning rate, momentum and variables, for every
Keras flavour (Keras 3, tf_keras, Keras 2): the callbacks, the membership handlers and
the training state (:mod:`.training_state`) all go through these."""

from collections.abc import Sequence
from typing import Any


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The optimizer's variables as a list (``variables`` is a method in Keras 2)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def build_optimizer(optimizer: Any, model: Any) -> None:
    """Create the optimizer's slots now (Keras 3 and Keras 2 build them at the first
    step), so that state can be loaded into them before training.  Keras 2's optimizer
    says it is built in ``_built``, not ``built`` (reading only ``built`` left it
    unbuilt: a restart failed to load 5 saved variables into 1)."""
    if hasattr(optimizer, "build") and not getattr(optimizer, "built",
                                                   getattr(optimizer, "_built", False)):
        optimizer.build(model.trainable_variables)


def get_lr(optimizer: Any) -> float:
    """The learning rate as a Python float (a variable or a plain number)."""
    lr = optimizer.learning_rate
    return float(lr.numpy() if hasattr(lr, "numpy") else lr)


def set_lr(optimizer: Any, value: float) -> None:
    """Set the learning rate: assigned in place when it is a variable, so that compiled
    train steps see the new value."""
    lr = optimizer.learning_rate
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        optimizer.learning_rate = value


def _momentum(optimizer: Any) -> float | None:
    momentum = getattr(optimizer, "momentum", None)
    if momentum is None:
        return None
    return float(momentum.numpy() if hasattr(momentum, "numpy") else momentum)


def _set_momentum(optimizer: Any, value: float) -> None:
    if hasattr(optimizer.momentum, "assign"):
        optimizer.momentum.assign(value)
    else:
        optimizer.momentum = value


#: The optimizer's attribute that holds its momentum before the corrections of the
#: coming step (on the optimizer: it lives and is copied with it).
_UNCORRECTED = "_hvd_uncorrected_momentum"


def momentum_correct(optimizer: Any, old_lr: float, new_lr: float) -> None:
    """Momentum correction (Goyal et al. 2017): after the lr changes from a to b, the
    next step uses momentum * b / a, then :func:`momentum_restore` puts it back.

    Kept per optimizer, not per callback: when a schedule and a membership change
    correct the same step, the corrections compound for that step and the
    momentum still returns to its own value afterwards."""
    value = _momentum(optimizer)
    if value is None or old_lr <= 0 or new_lr == old_lr:
        return
    if getattr(optimizer, _UNCORRECTED, None) is None:
        setattr(optimizer, _UNCORRECTED, value)
    _set_momentum(optimizer, value * new_lr / old_lr)


def momentum_restore(optimizer: Any) -> None:
    """Undo the corrections once the corrected step ran (a no-op if there were none)."""
    value = getattr(optimizer, _UNCORRECTED, None)
    if value is not None:
        setattr(optimizer, _UNCORRECTED, None)
        _set_momentum(optimizer, value)


def momentum_state(optimizer: Any) -> tuple[float | None, float | None]:
    """(momentum now, momentum once the corrected step ran): a process that takes
    over the state must train its next step with the same momentum."""
    return _momentum(optimizer), getattr(optimizer, _UNCORRECTED, None)


def load_momentum_state(optimizer: Any, state: Sequence[float | None]) -> None:
    now, uncorrected = state
    if now is not None:
        _set_momentum(optimizer, now)
    setattr(optimizer, _UNCORRECTED, uncorrected)
