"""The base of the membership-aware callbacks.

Membership events fire inside a collective, i.e. inside the running train step
(possibly inside a compiled graph), where Keras state must not be touched.  The
training session (:mod:`elastic_hvd.core.session`) keeps every event from
``init()`` on and hands them to its handlers at step boundaries, on the main
thread, in a fixed order (data, learning rate, reports, checkpoints).  A
callback is such a handler from ``on_train_begin`` on: it still gets the events
that happened before (e.g. inside the first variable broadcast), and a new
instance of the same class does not apply an event a former one applied.
"""

from typing import TYPE_CHECKING, Any

import tensorflow as tf

from elastic_hvd.core import runtime
from elastic_hvd.core import session as _session

if TYPE_CHECKING:
    from elastic_hvd.core.comm import ResilientComm
    from elastic_hvd.core.membership import MembershipEvent


#: The orders of this package's handlers (the session calls them by number, lowest
#: first; below the core's ``REPORT`` an error stops the rank, see its module doc):
#: the data first (what the next step trains on), then the learning rate, then
#: whoever reports or saves.
DATA, LEARNING_RATE = _session.REPORT - 20, _session.REPORT - 10
REPORT, CHECKPOINT = _session.REPORT, _session.REPORT + 10


class MembershipCallback(tf.keras.callbacks.Callback):
    """Calls ``handle(event)`` at the first step boundary after each membership change."""

    #: When this kind of handler sees an event, relative to the others.
    ORDER = REPORT

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self.step = 0

    @property
    def comm(self) -> "ResilientComm":
        return runtime.current(type(self).__name__)

    @property
    def kind(self) -> str:
        """Handlers of one kind apply each event once (see the module doc)."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def on_train_begin(self, logs: dict | None = None) -> None:
        session = runtime.session(type(self).__name__)
        session.register(self.kind, self.ORDER, self.handle)
        session.boundary()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch, self.step = epoch, 0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        # Set before the step: at its end, whichever callback reaches the boundary
        # first hands events to every handler, so all must know the step already.
        self.step = batch + 1

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        runtime.session().boundary()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        runtime.session().boundary()

    def on_train_end(self, logs: dict | None = None) -> None:
        runtime.session().boundary()

    def handle(self, event: "MembershipEvent") -> None:
        raise NotImplementedError

    def live_state(self) -> dict[str, Any]:
        """What a rank joining mid-training takes over (see keras_callbacks.growth)."""
        return {"epoch": self.epoch, "step": self.step}

    def load_live_state(self, state: dict[str, Any]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
