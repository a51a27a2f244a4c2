"""Agreements that prove they are fresh, and the anomalies they reveal.

Every decision of a collective rests on one value, the agreement's (``MPI_Comm_agree``,
a bitwise AND over the live ranks; see :mod:`.comm`).  Open MPI 5.0.x's agreement
(ERA) has answered with the value of *another* agreement (``mpi_env.retire``
closes the cause found).  An agreement that can return another's value can
return a stale "OK" as well, and then ranks go different ways without a word.

So every agreed value carries a **stamp** that all live members compute alike
and that any other agreement's value almost surely lacks: 27 bits mixed from the
communicator's *generation* (how many live communicators this job had before it:
every repair and every join replaces the live one on all members together, and a
joiner takes the count over with the book) and the agreement's *sequence number*
on it.  Every member contributes the same stamp, so the AND keeps it; a value
without it belongs to another agreement -- or the members disagree about where
they are, a bug of ours -- and is recognised, never acted on.

What a recognised value becomes is an **anomaly**: counted, said on stderr with
its evidence, given to listeners (the Keras event log), and then either repaired
and re-run with the exact signature check (the default) or, in strict mode
(``ELASTIC_HVD_STRICT``), the end of the whole job (``MPI_Abort`` with
:data:`ANOMALY_EXIT_STATUS`), because a strict run must never go on past
something nobody understands.  The same path takes every other outcome that the
protocol says cannot happen (an agreed error no rank holds; ranks that called
the same collective but predicted it differently).
"""

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .membership import Listeners
from ..log import get_logger

_log = get_logger(__name__)

#: Exit status of a job that strict mode ended on an anomaly (BSD's EX_SOFTWARE).
ANOMALY_EXIT_STATUS = 70
#: Where the stamp sits in the agreed int: above the 4 outcome bits of .comm,
#: below the sign bit.
SHIFT, BITS = 4, 27
OUTCOME_MASK = (1 << SHIFT) - 1
_MASK = (1 << BITS) - 1


def stamp(generation: int, sequence: int) -> int:
    """The stamp bits of agreement ``sequence`` on the ``generation``-th communicator.

    A multiplicative hash (Knuth's golden-ratio constant), so that values of nearby
    agreements -- the next one, or the same number on the previous communicator,
    which is what ERA's reused names produce -- differ in many bits."""
    mixed = ((generation << 32) ^ sequence) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
    return ((mixed >> 37) & _MASK) << SHIFT


class Stamps:
    """Where this process is in the sequence of agreements, alike on every member."""

    def __init__(self) -> None:
        self.generation, self.sequence = 0, 0

    def next(self) -> int:
        """The stamp for the next agreement on the live communicator."""
        self.sequence += 1
        return stamp(self.generation, self.sequence)

    def renew(self) -> None:
        """A new live communicator: the next generation, its agreements from 1."""
        self.generation, self.sequence = self.generation + 1, 0

    def state(self) -> tuple[int, int]:
        return (self.generation, self.sequence)

    def load_state(self, state: Sequence[int]) -> None:
        self.generation, self.sequence = state


class Anomalies:
    """The anomalies this process met, and what happens to each.

    ``abort(status)`` ends the whole job (the communicator's ``MPI_Abort``);
    ``strict`` decides whether it is called."""

    def __init__(self, strict: bool, abort: Callable[[int], object]) -> None:
        self.strict, self._abort = strict, abort
        self.seen: list[dict[str, Any]] = []
        self.listeners = Listeners()

    def __len__(self) -> int:
        return len(self.seen)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.seen)

    def record(self, kind: str, **evidence: Any) -> None:
        """Count, say and announce the anomaly ``kind``; in strict mode end the job."""
        entry = {"anomaly": kind, "time": time.time(), **evidence}
        self.seen.append(entry)
        said = ", ".join(f"{k}={v!r}" for k, v in evidence.items())
        verdict = ("strict mode: aborting the job" if self.strict
                   else "repaired, and the call is run again with its signature checked")
        _log.warning(f"elastic_hvd: ANOMALY #{len(self.seen)}: {kind} ({said}); {verdict}")
        try:
            self.listeners.notify(entry)
        except Exception as exc:  # a listener must not hide the anomaly itself
            _log.error(f"elastic_hvd: an anomaly listener failed: {exc!r}")
        if self.strict:
            self._abort(ANOMALY_EXIT_STATUS)
