"""The agreed transaction of a resilient communicator, on any communicator: the global
one (:class:`.comm.ResilientComm`, whose module doc describes the protocol) or a
process set's (:class:`.process_sets.SetComm`).

:class:`TransactionMixin` runs collectives as transactions (transfer, then one stamped
``MPI_Comm_agree`` on the outcome bits), with the signature prediction and its slow path
(agreement with a timeout, exact exchange, :class:`MismatchError`), the anomaly checks
and their deadline, and the errors every member raises alike.  What differs between a
communicator and another it reads from the class that mixes it in: the communicator
(``_comm``), its members (``_ids``), its stamps and call history, its repair
(``repair``), and what must hold before a transaction (``_before_transaction``).
"""

import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import announce, config, faults, mpi_env
from .errors import ElasticHvdError, MismatchError, RemoteCollectiveError
from .freshness import OUTCOME_MASK

from .timings import LEAVE_TIMEOUT, WAIT_PAUSE_FIRST, WAIT_PAUSE_MAX

#: Signature of the last collective of a process that is done (see ``ResilientComm.leave``).
LEAVE = ("leave",)

# Bits of the agreement flag (MPI_Comm_agree computes their AND over survivors).
_OK = 1      # the attempt completed on this rank
_CLEAN = 2   # no error here other than a process failure or a revocation
_PRE = 4     # contributed before the data transfer (slow path)
_POST = 8    # contributed after the data transfer


class TransactionMixin:
    """Resilient collectives on ``self._comm`` among ``self._ids`` (see the module doc)."""

    if TYPE_CHECKING:  # what the class that mixes this in provides
        MPI: Any

        # Its state, read here: ``_comm``, ``_ids``, ``original_id``, ``label``,
        # ``mismatch_timeout``, ``anomalies`` (Anomalies), ``_failure_classes``, ``_stamps``
        # (Stamps), ``_predictor`` (SignaturePredictor), ``_verify_next`` and
        # ``_anomaly_deadline`` (threading.Timer | None): attributes of ResilientComm,
        # properties of a SetComm (its registry entry's), so typed by neither here.
        def __getattr__(self, name: str) -> Any: ...

        @property
        def rank(self) -> int: ...

        def repair(self, started: float | None = None) -> None: ...

        def revoke(self, comm: Any) -> None: ...

        def in_mpi(self) -> AbstractContextManager[None]: ...

    def _before_transaction(self, calls: Sequence[tuple[Any, Callable[[Any], Any]]]
                            ) -> list[Any] | None:
        """What must hold before a transaction runs (raise if not); results to return
        without running one, or None to run it."""
        return None

    # -- the transaction ----------------------------------------------------------
    def run(self, signature: Any, attempt: Callable[[Any], Any]) -> Any:
        """Run ``attempt(mpi_comm) -> result`` as one resilient collective: every
        survivor returns the same result or raises the same error.  ``signature``: equal
        on all ranks for a matching call (None: unchecked).  ``attempt`` communicates on
        the communicator given, never a duplicate (mpi4py's pickled reductions use a
        hidden one, which a revoke does not reach)."""
        return self.run_many([(signature, attempt)])[0]

    def run_many(self, calls: Sequence[tuple[Any, Callable[[Any], Any]]]) -> list[Any]:
        """Run several collectives, each ``(signature, attempt)`` as in :meth:`run`, as
        *one* transaction: their data transfers back to back, then one agreement on
        all their outcomes.  A step's 200 unfused gradients pay one agreement, not 200.

        As safe as an agreement per call: no result is returned unless every rank
        completed every call, and a call that fails on one rank fails on the others
        too (it revokes), so all of them meet in the same agreement.  Ranks stay
        in step because each call is checked as one alone is: from the prediction
        that its predecessors in ``calls`` make (see :mod:`.signature`), or on the
        slow path at the call that differs from it, whose agreement meets the
        others' at the end (after its timeout revoked their transfer of that call);
        the exchange of signatures then says where each rank stopped
        (:meth:`_same_calls`).  Signatures are all None or none is."""
        if not calls:
            return []
        early = self._before_transaction(calls)
        if early is not None:
            return early
        reached = [0]
        with self.in_mpi():
            while True:
                results = self._transaction(calls, time.perf_counter(), reached)
                if results is not None:
                    return results

    def _transaction(self, calls: Sequence[tuple[Any, Callable[[Any], Any]]],
                     started: float, reached: list[int]) -> list[Any] | None:
        """One try of :meth:`run_many`: the results, or None when the ranks must try
        again (after a repair, on the repaired communicator).  ``reached[0]``: how many
        calls earlier tries reached -- a fault plan counts each call once, when it is
        first reached, however often it runs (tests name "the Nth collective")."""
        comm, walk, plan = self._comm, self._predictor.walk(), faults.active()
        verify = calls[0][0] is not None and self._verified()
        results, flag, error, position = [], _OK | _CLEAN, None, 0
        for position, (signature, attempt) in enumerate(calls):
            if signature is not None:
                if position == reached[0]:
                    reached[0] += 1
                    if plan is not None:
                        plan.at_collective()
                if verify or not walk.expects(signature):
                    verify = False
                    if not self._checked(comm, position, signature, started):
                        return None
                    if self._comm is not comm:  # repaired: the calls before had the old members
                        return None
                walk.passed(signature)
            try:
                results.append(attempt(comm))
            except self.MPI.Exception as exc:
                # Errors on a communicator that another rank revoked are not always
                # reported as ERR_REVOKED (alltoall said ERR_OTHER here): count them clean.
                clean = exc.Get_error_class() in self._failure_classes or comm.Is_revoked()
                self.revoke(comm)
                flag, error = (_CLEAN if clean else 0), exc
            except Exception as exc:  # a local error must not leave the others blocked
                self.revoke(comm)
                flag, error = 0, exc
            if signature is not None and plan is not None:
                plan.after_transfer()
            if error is not None:
                break
        signature = calls[position][0]
        agreed = self._agree(comm, flag | _POST)
        if agreed is None:
            self.repair(started)
        elif agreed & _PRE or not agreed & _POST:
            self._mismatch(position, signature)
        elif agreed & _OK:
            walk.commit()
            return results
        elif not agreed & _CLEAN:
            self._application_error(error if not flag & _CLEAN else None, signature)
            # returned: an anomaly (see there); run again, verified
        else:
            self.repair(started)
        return None

    def _checked(self, comm: Any, position: int, signature: Any, started: float) -> bool:
        """The slow path of the call at ``position``, which this rank did not predict:
        True once every rank is known to call ``signature`` there; False when the
        ranks must try the transaction again (see :meth:`run_many`)."""
        wait = LEAVE_TIMEOUT if signature == LEAVE else self.mismatch_timeout
        pre = self._agree(comm, _OK | _CLEAN | _PRE, wait)
        if pre is None:
            self.repair(started)
            return False
        if pre & _POST or not pre & _PRE:
            self._mismatch(position, signature)
            return False
        return self._same_calls(position, signature)


    def _agree(self, comm: Any, flag: int, timeout: float | None = None) -> int | None:
        """Agreed AND of ``flag`` (its 4 outcome bits); None when a process failure
        interrupted it, or when the agreed value is not this agreement's (an
        anomaly: then ``comm`` is revoked, so that every member repairs).

        With ``timeout``, a rank that waits longer revokes ``comm`` (see module doc).
        """
        stamp = self._stamps.next()
        try:
            value = self._agreement(comm, flag | stamp, timeout)
        except self.MPI.Exception as exc:
            if exc.Get_error_class() in self._failure_classes:
                return None
            # Any other error is this rank's alone: the others may hold an agreed
            # value.  Revoke, so that none of them goes on with this rank unawares
            # (their next collective repairs), and raise here.
            self.revoke(comm)
            who = announce.who(None, self.original_id)
            raise ElasticHvdError(f"MPI_Comm_agree failed on {who}: "
                                  f"{exc.Get_error_string()}") from exc
        if value & ~OUTCOME_MASK == stamp:
            deadline = self._anomaly_deadline
            if deadline is not None:  # repaired: the ranks agree again
                self._state()._anomaly_deadline = None
                deadline.cancel()
            return value & OUTCOME_MASK
        self.revoke(comm)  # a member that waits in this agreement is freed by it
        self._anomaly("the agreed value belongs to another agreement",
                      expected=hex(stamp | flag), got=hex(value))
        return None

    def _agreement(self, comm: Any, value: int, timeout: float | None) -> int:
        """``MPI_Comm_agree(value)`` on ``comm``; with ``timeout``, a rank that waits
        longer revokes ``comm``.  Open MPI's blocking agreement is its non-blocking
        one plus a wait, with one sequence of agreement ids, so the two kinds match."""
        if timeout is None:
            return comm.Agree(value)
        buf = np.array([value], dtype=np.intc)
        request = comm.Iagree(buf)
        if not _wait(request, timeout):
            self.revoke(comm)
            request.Wait()
        return int(buf[0])

    def _anomaly(self, kind: str, **evidence: Any) -> None:
        """Record an anomaly (see :mod:`.freshness`; in strict mode the job ends here)
        with where it happened, and set this rank a deadline to agree again.

        The repair is exact when every member met the anomaly, or waited while one
        did (both seen).  If instead some member had *decided* on the genuine value
        and gone on, the repair's own agreement (inside ``MPI_Comm_shrink``) meets
        that member's next one: the stamp recognises the mixed value again, but the
        shrinks no longer match and would wait for ever (docs/measurements.md).  A failure is
        what ULFM's repair does handle, so a rank that has not agreed again within
        its deadline ends itself as a crash, and the others go on without it; the
        deadlines are staggered by rank so that one rank at a time goes."""
        generation, sequence = self._stamps.state()
        self.anomalies.record(kind, **evidence, original_rank=self.original_id,
                              communicator=f"generation {generation}, agreement {sequence}, "
                                           f"ids {list(self._ids)}",
                              call=self.label or None)
        if self._anomaly_deadline is None:
            limit = config.current().anomaly_timeout * (1 + self.rank)
            deadline = threading.Timer(limit, mpi_env.end_as_crash, args=(
                f"{announce.who(self.rank, self.original_id)} did not agree with the "
                f"others again within {limit:.0f}s of an anomaly",))
            deadline.daemon = True
            self._state()._anomaly_deadline = deadline
            deadline.start()

    def _verified(self) -> bool:
        """True (once) when the next call must take the slow path, its exact signature
        exchanged: after a repair that lost nobody -- a revocation by an anomaly, a
        local error or a mismatch -- so that ranks whose control flow split there
        raise MismatchError instead of pairing different calls.  Every member makes
        a repair and sees whom it lost alike, so all of them verify the same call."""
        verify, self._state()._verify_next = self._verify_next, False
        return verify

    def _state(self) -> Any:
        """``self``, for writing the state that the mixing class types (see above)."""
        return self

    # -- errors every rank raises ---------------------------------------------------
    def _mismatch(self, position: int, signature: Any) -> None:
        """Ranks called different collectives: raise MismatchError on all of them --
        unless some of them are *leaving* (see :meth:`leave`): those raise
        :class:`LeftEarly` and exit, and the others return to retry their call, in
        which the leavers are found gone like any lost rank."""
        self.repair()  # drop whatever a mismatched transfer left
        if not self._same_calls(position, signature):
            return
        # Every rank called the same collective, yet the agreement said otherwise:
        # predictions are equal on every rank by construction (see .signature).
        self._anomaly("ranks that called the same collective were told their calls differ",
                      signature=signature)
        self._predictor.load_state(self.run(None, lambda c: c.bcast(self._predictor.state())))

    def _same_calls(self, position: int, signature: Any) -> bool:
        """Whether every rank called ``signature`` as call ``position`` of its
        transaction (compared exactly, all ranks' in full).  If not: MismatchError on
        every rank, or, when some ranks are leaving, :class:`LeftEarly` on those and
        False on the others, which retry their call.

        Also False when ranks stopped at different calls of one transaction: a
        transfer completed on some ranks and was interrupted on the others (by a
        failure, or by the revocation of a slow path's timeout), and all of them
        then met in one agreement -- the per-call protocol's failed attempt, whose
        results nobody uses; the transaction runs again."""
        calls = self.run(None, lambda c: c.allgather((position, signature)))
        if all(call == (position, signature) for call in calls):
            return True
        if any(p != position for p, _ in calls):
            return False
        signatures = [s for _, s in calls]
        leaving = [s == LEAVE for s in signatures]
        if not any(leaving) or all(leaving):
            # Each rank's op name is said, not compared: Horovod lets ranks name a call alike
            # or not.
            raise MismatchError(signatures, self.run(None, lambda c: c.allgather(self.label)))
        if signature == LEAVE:
            raise LeftEarly(sum(leaving), len(signatures))
        return False

    def _application_error(self, error: BaseException | None, signature: Any) -> None:
        """The ranks agreed that the collective failed with an error other than a
        process failure: raise it on every rank (this rank's own, or the first
        holder's as RemoteCollectiveError).

        When no rank holds an error and none was lost meanwhile, the agreed value is
        one that no live rank contributed: an anomaly (see :mod:`.freshness`); this
        returns and the caller runs the collective again, verified."""
        before = set(self._ids)
        self.repair()  # the failing rank revoked the communicator
        report = None if error is None else (f"{type(error).__name__}: {error}",
                                             [c.__name__ for c in type(error).__mro__])
        reports = self.run(None, lambda c: c.allgather(report))
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(reports) if m is not None]
        if failed:
            rank, (text, types) = failed[0]
            raise RemoteCollectiveError(f"the collective failed on rank {rank}: {text}", types)
        if before - set(self._ids):  # the rank that had the error died before saying which
            raise RemoteCollectiveError("the collective failed on a rank that was lost "
                                        "before it could report the error")
        self._anomaly("the agreed outcome is an error that no rank holds, and no rank was lost",
                      signature=signature)



class LeftEarly(Exception):
    """This process left while other ranks go on training (see ``ResilientComm.leave``)."""

    def __init__(self, leaving: int, size: int) -> None:
        super().__init__(f"{leaving} of {size} ranks left while the others go on training")


def _wait(request: Any, timeout: float) -> bool:
    """Wait for ``request`` up to ``timeout`` seconds; True when it completed."""
    deadline = time.monotonic() + timeout
    pause = WAIT_PAUSE_FIRST
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, WAIT_PAUSE_MAX)
    return True
