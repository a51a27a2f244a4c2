"""The TF layer's own state, kept in the runtime's slots for layers (core reads none of it).

:func:`state` lives as long as the process (``process.runtime().layers``);
:func:`session_state` as long as the training session, from ``init()`` to
``shutdown()`` (``Session.layers``), as what a membership change did does.
"""

import dataclasses
from typing import TYPE_CHECKING, Any

from ..core import process, runtime

if TYPE_CHECKING:
    from ..growth_policy import GrowthPolicy


@dataclasses.dataclass
class State:
    """The TF layer's state for the whole process."""

    #: ``hvd.elastic.run``'s growth policy, made when first asked for.
    policy: "GrowthPolicy | None" = None
    #: The timeline being recorded (``hvd.start_timeline``), None when none is.
    timeline: Any = None
    #: Whether the collectives of TF1 graphs are chained in creation order (see
    #: :mod:`.ordering`); False leaves them as TF schedules them.
    order_graph_collectives: bool = True


@dataclasses.dataclass
class SessionState:
    """The Keras layer's state for one training session."""

    #: The product of the learning-rate rescalings of membership changes so far
    #: (``keras_callbacks.lr``); the schedule callbacks apply it too.  Saved in the
    #: training state's ``"session"`` part (see :mod:`.training_state`).
    lr_factor: float = 1.0


def state() -> State:
    """The TF layer's state in this process's runtime."""
    return process.runtime().layers.get(State)


def session_state(what: str = "this call") -> SessionState:
    """The Keras layer's state in the training session (after ``init()``)."""
    return runtime.session(what).layers.get(SessionState)
