"""The training session: one commit point per step, one place where membership changes land.

A collective is a transaction (see :mod:`.comm`), but an optimizer step is made of
several: one per dtype or fusion buffer, per gradient group, two gathers per
sparse gradient.  If a rank died between two of them, the first would hold its
contribution and the second not -- the step would mix two memberships, and the
data layer could not tell whether the dead rank's samples were trained.  So all
gradient traffic of a step is one *step transaction* (``reducer.reduce_step``): if
the membership changed anywhere inside it, the whole of it is run again by the
survivors on the same local inputs.  Its end is the step's **commit**
(:meth:`Session.commit`): the ranks whose gradients the step holds are exactly
``comm.ids`` at that moment, the same on every survivor, and commit listeners (the
data sampler) learn it there.

Membership changes are applied in one place too.  The session exists from
``init()`` on and the communicator keeps every event, so a handler registered
late (a callback attached at ``on_train_begin``, after a failure inside the first
broadcast) still gets every event; handlers are called at step boundaries
(:meth:`boundary`), event by event, in the order of their numbers (the layers
that register them declare theirs: data, learning rate, log, checkpoint...), and
each *kind* of handler applies an event once, even if the script builds a new
callback instance for a second ``fit()``.

A handler that raises does not end the rank as if it had been lost (the others
would announce "lost rank N" for a bug in a log writer).  Handlers ordered before
:data:`REPORT` change what every rank trains (data, learning rate): one that could
not apply a change cannot train alike with the others, so its error stops the rank,
as an error naming the handler.  From :data:`REPORT` on (logs, checkpoints, a
script's own callbacks) the rank says which handler failed, on which change, and
its traceback, and trains on: losing the job to a report is worse than the report.

The layers above keep their per-session state in :attr:`Session.layers` (the
learning-rate factor of the Keras layer): it lives from ``init()`` to ``shutdown()``.

What it does not cover: collectives outside a step transaction (metric
averaging, broadcasts) are each their own transaction, as before.
"""

import sys
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import process
from .announce import mid_line
from .errors import ElasticHvdError
from .membership import Listeners, MembershipEvent

if TYPE_CHECKING:
    from .comm import ResilientComm

#: Handlers see an event in the order of their numbers: below this one, those that
#: change what every rank trains (the data, the learning rate); from it on, those
#: that report or save (see the module doc for what an error does in each).
REPORT = 30


class Session:
    """Per-process training bookkeeping above the resilient communicator."""

    def __init__(self, comm: "ResilientComm") -> None:
        self.comm = comm
        self.step = 0             # committed optimizer steps, alike on every rank
        self.commits = Listeners()  # called with the ids of each committed step
        # kind -> (order, handler)
        self._handlers: dict[str, tuple[int, Callable[[MembershipEvent], Any]]] = {}
        self._applied: dict[str, int] = {}  # kind -> number of events that kind has applied
        self.layers = process.Layers()  # the layers' state for this session, by class

    # -- the step's commit point ---------------------------------------------------
    def commit(self) -> None:
        """The step transaction (``reducer.reduce_step``) completed: the step holds the
        gradients of exactly ``comm.ids``, alike on every survivor."""
        self.step += 1
        self.commits.notify(self.comm.ids)

    # -- membership handlers --------------------------------------------------------
    def register(self, kind: str, order: int,
                 handler: Callable[[MembershipEvent], Any]) -> None:
        """``handler(event)`` for every membership event (since ``init()``) that no
        handler of ``kind`` applied yet; replaces an earlier handler of that kind."""
        self._handlers[kind] = (order, handler)

    def boundary(self) -> None:
        """Apply the events not yet applied, each to every handler in order.

        Called between steps (never inside one), on every rank alike."""
        events = self.comm.events
        while True:
            pending = [(order, kind, handler) for kind, (order, handler) in self._handlers.items()
                       if self._applied.get(kind, 0) < len(events)]
            if not pending:
                return
            first = min(self._applied.get(kind, 0) for _, kind, _ in pending)
            event = events[first]
            for order, kind, handler in sorted(pending, key=lambda p: p[0]):
                if self._applied.get(kind, 0) == first:
                    self._applied[kind] = first + 1
                    self._apply(order, kind, handler, event)

    def _apply(self, order: int, kind: str, handler: Callable[[MembershipEvent], Any],
               event: MembershipEvent) -> None:
        """``handler(event)``; its error raised or reported as the module doc says."""
        try:
            handler(event)
        except Exception as exc:
            what = (f"the membership handler {kind} failed on rank {self.comm.rank} at the "
                    f"change {event.old_size} -> {event.new_size} ranks: "
                    f"{type(exc).__name__}: {exc}")
            if order < REPORT:
                raise ElasticHvdError(f"{what}; it changes what every rank trains, so this "
                                      "rank cannot go on with the others") from exc
            start = "\n" if mid_line() else ""  # after a half-drawn progress bar
            print(f"{start}elastic_hvd: {what}; training goes on without what it does for this "
                  f"change\n{traceback.format_exc()}", file=sys.stderr, end="", flush=True)

    # -- state ------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Part of the training state (see ``elastic_hvd.tensorflow.training_state``)."""
        return {"step": self.step, "applied": dict(self._applied)}

    def load_state(self, state: Mapping[str, Any], membership: bool = True) -> None:
        """The step always; which events were applied only from the same job
        (``membership``).  Other keys (a layer's) are left to that layer."""
        self.step = state["step"]
        if membership:
            self._applied = dict(state["applied"])
