"""Knowing, without talking, that every rank calls the same collective.

Checking shapes/dtypes/ops/roots before each collective would cost a round of
communication per call.  Instead each rank predicts the signature of its next
call from the history of calls (the signature that followed the same two
signatures last time).  The history is identical on every rank, because every
call in it was verified, so the prediction is identical too: when a rank's call
matches the prediction, every rank whose call matches it holds the *same*
signature and may go straight to the data transfer.  Only a call that differs
from the prediction takes the slow path (an agreement plus an exchange of
signatures); see ``ResilientComm.run``.
"""

from typing import Any


class SignaturePredictor:
    #: Forget everything past this many contexts (a program with ever-new signatures).
    MAX_CONTEXTS = 4096

    def __init__(self) -> None:
        self._context: tuple[Any, ...] = (None, None)
        self._next: dict[tuple[Any, ...], Any] = {}

    def expects(self, signature: Any) -> bool:
        """True when ``signature`` is this rank's (and so every rank's) prediction."""
        return self._next.get(self._context) == signature

    def record(self, signature: Any) -> None:
        """Remember a call whose signature every rank verified."""
        if len(self._next) >= self.MAX_CONTEXTS:
            self._next.clear()
        self._next[self._context] = signature
        self._context = (self._context[1], signature)

    def state(self) -> dict[str, Any]:
        """The history, for a process that joins the job later."""
        return {"context": self._context, "next": dict(self._next)}

    def load_state(self, state: dict[str, Any]) -> None:
        self._context, self._next = tuple(state["context"]), dict(state["next"])
