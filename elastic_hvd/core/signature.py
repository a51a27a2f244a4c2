"""Knowing, without talking, that every rank calls the same collective.

Checking shapes/dtypes/ops/roots before each collective would cost a round of
communication per call.  Instead each rank predicts the signature of its next
call from the history of calls (the signature that followed the same two
signatures last time).  The history is identical on every rank, because every
call in it was verified, so the prediction is identical too: when a rank's call
matches the prediction, every rank whose call matches it holds the *same*
signature and may go straight to the data transfer.  Only a call that differs
from the prediction takes the slow path (an agreement plus an exchange of
signatures); see ``ResilientComm.run_many``.

A transaction of several calls is predicted whole: call ``i`` as call ``i`` of the
last transaction that began after the same two calls (a training step repeats the
one before it, so none of its calls misses, runs of equal calls included).  Past
the end of that transaction, or when there is none, a :class:`Walk` predicts from
the two calls before, learning from each call as the history will once they
commit: a step's gradients whose last layer differs from the others would
otherwise miss half their predictions (the history says a bias is followed by
the last kernel until the step commits).
"""

from typing import Any


class SignaturePredictor:
    #: Forget everything past this many contexts (a program with ever-new signatures).
    MAX_CONTEXTS = 4096

    def __init__(self) -> None:
        self._context: tuple[Any, ...] = (None, None)
        self._next: dict[tuple[Any, ...], Any] = {}
        # context before a transaction -> that transaction's signatures
        self._transactions: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def walk(self) -> "Walk":
        """Predictions for the calls of one transaction, from the history so far."""
        return Walk(self)

    def record(self, signatures: tuple[Any, ...]) -> None:
        """Remember a transaction whose calls every rank completed (and so verified);
        one of internal exchanges only (no signatures) leaves no trace."""
        if not signatures:
            return
        if len(self._next) >= self.MAX_CONTEXTS or len(self._transactions) >= self.MAX_CONTEXTS:
            self._next.clear()
            self._transactions.clear()
        self._transactions[self._context] = signatures
        for signature in signatures:
            self._next[self._context] = signature
            self._context = (self._context[1], signature)

    def state(self) -> dict[str, Any]:
        """The history, for a process that joins the job later."""
        return {"context": self._context, "next": dict(self._next),
                "transactions": dict(self._transactions)}

    def load_state(self, state: dict[str, Any]) -> None:
        self._context, self._next = tuple(state["context"]), dict(state["next"])
        self._transactions = dict(state["transactions"])


class Walk:
    """Predictions along calls not recorded yet: call ``i`` as the last transaction
    from the same context made it, else from the two calls before, where each call
    :meth:`passed` is learned as :meth:`SignaturePredictor.record` would learn it.
    The calls are recorded (:meth:`commit`) only once every rank has completed them."""

    def __init__(self, predictor: SignaturePredictor) -> None:
        self._predictor = predictor
        self._context = predictor._context
        self._last = predictor._transactions.get(predictor._context, ())
        self._learned: dict[tuple[Any, ...], Any] = {}
        self._calls: list[Any] = []

    def expects(self, signature: Any) -> bool:
        """True when ``signature`` is this rank's (and so every rank's) prediction."""
        position, context = len(self._calls), self._context
        if position < len(self._last):
            return self._last[position] == signature
        return self._learned.get(context, self._predictor._next.get(context)) == signature

    def passed(self, signature: Any) -> None:
        """The next call was ``signature`` (predicted, or verified by the slow path)."""
        self._learned[self._context] = signature
        self._context = (self._context[1], signature)
        self._calls.append(signature)

    def commit(self) -> None:
        self._predictor.record(tuple(self._calls))
