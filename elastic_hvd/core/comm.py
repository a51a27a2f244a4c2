"""The resilient communicator: collectives with one outcome on every survivor.

ULFM reports a process failure *non-uniformly*: a collective can complete on one
rank and fail on another.  So collectives run as small transactions -- one alone,
or several back to back (a step's gradient buffers: ``run_many``)::

    per call:  [slow path only] agree(PRE)  +  exact signature exchange
               attempt the MPI collective   (on error: revoke, so nobody stays blocked)
    once:      agree(POST | outcome bits)   (ULFM's fault-tolerant agreement: a bitwise AND)

and *every* decision after it -- return the result, repair and retry, raise --
is taken from the agreed value, never from local knowledge.  A process failure
makes the agreement fail on all survivors alike; they then revoke, shrink and
re-run the collective among themselves, so a result never mixes the dead rank's
contribution on one rank with a survivors-only result on another.

The slow path runs only when a call's signature differs from what the call
history predicts (see :mod:`.signature`); a rank on the slow path that waits too
long for the others revokes the communicator, which frees any rank that went on
to a data transfer: its agreement then shows the phase mix and every rank raises
:class:`MismatchError` instead of hanging.

Every agreed value is stamped and checked (see :mod:`.freshness`): a value that
belongs to another agreement, and every other outcome the protocol rules out, is
an *anomaly* -- never acted on, always said.
"""

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np

from . import announce, config, faults, mpi_env, signals, workarounds
from .collectives import CollectivesMixin
from .errors import (ElasticHvdError, JoinOrderError, MismatchError, RanksBelowMinimumError,
                     RemoteCollectiveError)
from .freshness import OUTCOME_MASK, Anomalies, Stamps
from .membership import Listeners, MembershipEvent
from .repair import RepairMixin
from .signature import SignaturePredictor
from .timings import LEAVE_TIMEOUT, WAIT_PAUSE_FIRST, WAIT_PAUSE_MAX

if TYPE_CHECKING:
    from .heartbeat import Heartbeat
    from .invitation import Invitation
    from .spares import SpareInvitation

#: Signature of the last collective of a process that is done (see ``leave``).
LEAVE = ("leave",)

# Bits of the agreement flag (MPI_Comm_agree computes their AND over survivors).
_OK = 1      # the attempt completed on this rank
_CLEAN = 2   # no error here other than a process failure or a revocation
_PRE = 4     # contributed before the data transfer (slow path)
_POST = 8    # contributed after the data transfer

#: What a function given to ``ResilientComm.consistent`` returns.
_T = TypeVar("_T")


class ResilientComm(RepairMixin, CollectivesMixin):
    """An MPI communicator whose collectives survive the loss of ranks.

    ``ids`` maps each current rank to its *original id* (its rank when the
    communicator was created; processes that join later get the next free ids),
    which stays stable across repairs.  ``invitation``, the :class:`.invitation.Invitation`
    of a process spawned into a running job (or a hot spare's), makes it start as a
    *joiner* (:attr:`joining`), whose ``original_id`` is None and ``ids`` empty until
    it has joined.

    Cut along its concepts: the agreed transaction, the leave protocol and the
    membership it reports are here; membership changes and repair in
    :class:`.repair.RepairMixin`; the collectives in
    :class:`.collectives.CollectivesMixin`.  The join protocol is not part of it:
    :class:`.growth.Growth` holds a communicator and uses it through
    :class:`.comm_api.Communicator`.
    """

    def __init__(self, MPI: Any, comm: Any, *, min_np: int = 1,
                 mismatch_timeout: float = config.DEFAULTS.mismatch_timeout,
                 elastic: bool = True, heartbeat: "Heartbeat | None" = None,
                 invitation: "Invitation | SpareInvitation | None" = None) -> None:
        self.MPI = MPI
        self._failure_classes = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                                 MPI.ERR_REVOKED)
        self._quiet, self._rehearsing = False, False
        self.min_np = int(min_np)
        self.mismatch_timeout = float(mismatch_timeout)
        self.elastic = elastic
        self.listeners = Listeners()
        self.events = []
        #: Membership changes so far: grows by one with each event recorded in ``events``
        #: (the same on every rank), so "the membership changed" is a changed generation.
        self.generation = 0
        self._predictor = SignaturePredictor()
        self._stamps = Stamps()
        #: Every anomaly this process met (see :mod:`.freshness`); list-like.
        self.anomalies = Anomalies(config.current().strict, lambda status: self._comm.Abort(status))
        self._verify_next = False  # after a repair that lost nobody: see _verified
        self._anomaly_deadline: threading.Timer | None = None  # while an anomaly is repaired
        self._below_min = None
        self._heartbeat = heartbeat
        #: What the collectives now running are for (set by callers, recorded in events).
        self.label = ""
        self._procs = {}
        #: (rank, size) a waiting spare reports: as if last in a communicator merged with
        #: every training rank, like a spawned joiner -- never rank 0, whose duties (logs,
        #: checkpoints) a program gives to one process.  None elsewhere.
        self._waiting = None
        #: True in a process spawned into a running job, or a hot spare, until it has
        #: joined (``Growth.join`` clears it).
        self.joining = invitation is not None
        if invitation is not None:  # a joiner: no id, no hosts yet (see Growth.join)
            self._comm, self._ids, self.original_id = invitation.comm, [], None
            self.initial_size = invitation.initial_size
            if invitation.comm.size == 1:
                self._waiting = (self.initial_size, self.initial_size + 1)
        else:
            with self.in_mpi():
                self._start(comm)
        if self.size < self.min_np:
            raise RanksBelowMinimumError(self.size, self.min_np, ())

    def _start(self, comm: Any) -> None:
        """Make our own communicator from ``comm`` and learn every rank's host and identity,
        leaving out ranks that die meanwhile.

        An elastic job starts with ``MPI_Comm_shrink``, which ULFM completes uniformly
        despite failures (workarounds.TABLE 'shrink_at_start').  Its agreement
        on ``comm`` takes ERA's first identifier, which no earlier agreement of this
        process may hold (see ``mpi_env.ulfm_compiled``): a stale entry of that name
        in ERA's history is what a late rank could answer a peer's query with."""
        MPI = self.MPI
        started = time.perf_counter()
        self.initial_size = comm.size
        if self.elastic:
            workarounds.used("shrink_at_start")
            own = self._shrink(comm)
            positions = own.Get_group().Translate_ranks(list(range(own.size)), comm.Get_group())
        else:
            own, positions = comm.Dup(), list(range(comm.size))
        own.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm, self._ids, self.original_id = own, list(positions), comm.rank
        if own.size < comm.size:
            self.events.append(MembershipEvent(
                old_size=comm.size, new_size=own.size,
                lost=tuple(sorted(set(range(comm.size)) - set(positions))),
                detect_s=time.perf_counter() - started, sequence=1, during="init"))
            self.generation += 1
        self.meet()

    # -- membership ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._comm.rank if self._waiting is None else self._waiting[0]

    @property
    def size(self) -> int:
        return self._comm.size if self._waiting is None else self._waiting[1]

    def report_as(self, rank: int, size: int) -> None:
        """In a hot spare given a lost rank's number: report ``rank`` and ``size`` until
        it joins (:meth:`replace` ends it)."""
        self._waiting = (rank, size)

    @property
    def ids(self) -> tuple[int, ...]:
        """Original id of each current rank."""
        return tuple(self._ids)

    @property
    def mpi_comm(self) -> Any:
        """The current (repaired) mpi4py communicator.  It changes after a failure."""
        return self._comm

    @property
    def below_min_np(self) -> RanksBelowMinimumError | None:
        """The RanksBelowMinimumError once too few ranks are left, else None.

        Errors raised inside TensorFlow ops reach the caller re-wrapped by TF; this
        tells every survivor alike that the job cannot go on.
        """
        return self._below_min

    def hosts(self) -> list[str | None]:
        """Host name of each current rank."""
        return [self.host_of(i) for i in self._ids]

    def emptied_hosts(self) -> list[str]:
        """Hosts where ranks of this job ran and none is left now, sorted."""
        now = set(self.hosts())
        return sorted({host for host, _ in self._procs.values() if host not in now})

    def host_of(self, original_id: int) -> str | None:
        """Host of a process, current or lost, by original id (None if unknown)."""
        return self.process_of(original_id)[0]

    def process_of(self, original_id: int) -> tuple[str | None, signals.Identity | None]:
        """(host, identity: pid and start time) of a process, current or lost, by
        original id ((None, None) if unknown)."""
        return self._procs.get(original_id, (None, None))

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
        if self._rehearsing:
            return [attempt(self.MPI.COMM_SELF) for _, attempt in calls]
        if self._below_min is not None:
            raise self._below_min
        if calls[0][0] is not None and self.joining:
            raise JoinOrderError(calls[0][0])
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

    @contextlib.contextmanager
    def in_mpi(self) -> Iterator[None]:
        """The main thread works in MPI: the heartbeat's progress loop pauses, since
        Open MPI's agreement is not safe beside it (see :mod:`.heartbeat`), and the
        stall watchdog counts it as progress.

        An exception that Python raises between any two instructions -- ``SystemExit``
        from a SIGTERM handler that calls ``sys.exit``, ``KeyboardInterrupt`` from
        Ctrl-C -- may land between two steps of the protocol (say, after the shrink
        of a repair and before the survivors settle on the new communicator): this
        rank's next agreement would then meet the others' next step, not theirs, and
        the job hangs (workarounds.TABLE 'interrupted_protocol_crash').  So this rank
        leaves as a crash, which every survivor repairs alike."""
        with self._heartbeat or contextlib.nullcontext():
            try:
                yield
            except BaseException as exc:
                if not isinstance(exc, Exception) and not self.joining:
                    workarounds.used("interrupted_protocol_crash")
                    mpi_env.end_as_crash(f"{announce.who(self.rank, self.original_id)} was "
                                         f"interrupted by {type(exc).__name__} inside a "
                                         "collective's protocol")
                raise

    def consistent(self, attempt: Callable[[], _T]) -> _T:
        """Run ``attempt()`` -- several collectives -- until it completes without a
        membership change, so that all its results come from one membership.

        Every survivor sees the same changes at the same collective (outcomes are
        agreed), so all of them run ``attempt`` again together.  ``attempt`` must
        not change its inputs.  The progress loop pauses once for all of it, not
        once per collective (a step of 200 unfused gradients makes 200)."""
        with self._heartbeat or contextlib.nullcontext():  # (see in_mpi)
            while True:
                seen = self.generation
                result = attempt()
                if self.generation == seen:
                    return result

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
            if self._anomaly_deadline is not None:  # repaired: the ranks agree again
                self._anomaly_deadline, deadline = None, self._anomaly_deadline
                deadline.cancel()  # type: ignore[attr-defined]  # mypy reads the None just set
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
            self._anomaly_deadline = threading.Timer(limit, mpi_env.end_as_crash, args=(
                f"{announce.who(self.rank, self.original_id)} did not agree with the "
                f"others again within {limit:.0f}s of an anomaly",))
            self._anomaly_deadline.daemon = True
            self._anomaly_deadline.start()

    def _verified(self) -> bool:
        """True (once) when the next call must take the slow path, its exact signature
        exchanged: after a repair that lost nobody -- a revocation by an anomaly, a
        local error or a mismatch -- so that ranks whose control flow split there
        raise MismatchError instead of pairing different calls.  Every member makes
        a repair and sees whom it lost alike, so all of them verify the same call."""
        verify, self._verify_next = self._verify_next, False
        return verify

    @contextlib.contextmanager
    def rehearsal(self) -> Iterator[None]:
        """Collectives inside run on this process alone (``COMM_SELF``).

        A joining process runs one throw-away training step in a rehearsal, so
        that it compiles its training function *before* it joins: otherwise the
        running ranks would wait inside its first step's gradient allreduce for
        the whole compilation (tens of seconds for MobileNetV2: docs/measurements.md).  What
        the step computes is overwritten by the live state it receives next.
        """
        self._rehearsing = True
        try:
            yield
        finally:
            self._rehearsing = False

    def agree(self, flag: int) -> int:
        """Bitwise AND of ``flag`` (an int >= 0) over the live ranks: a resilient
        collective, so a rank lost meanwhile is repaired away (``generation`` grows) and
        the AND is that of the survivors.

        Never a bare ``MPI_Comm_agree``: a rank that is leaving (see :meth:`leave`)
        may be in its own first agreement just then, and a bare one pairs with it
        without telling either side -- the leaver reads the value as a mismatch,
        the others as their outcome -- so they go on to different exchanges and
        every rank raises MismatchError (docs/measurements.md).  A transaction's
        agreement carries its phase, so both sides see the mismatch, and the signatures
        then show who leaves."""
        def attempt(comm: Any) -> int:
            result = np.empty(1, dtype=np.int64)  # fresh: a failed try may have written it
            comm.Allreduce(np.array([flag], dtype=np.int64), result, op=self.MPI.BAND)
            return int(result[0])
        return self.run(None, attempt)

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

    def leave(self) -> None:
        """The last collective of a process that is done (``atexit``): a barrier when
        every rank leaves.  One that leaves while others train on (it returned, or called
        ``sys.exit``) interrupts their collective within :data:`LEAVE_TIMEOUT`; the
        signatures show who leaves, it raises :class:`LeftEarly`, and the others go on
        without it as after a crash, with no detection delay and no MismatchError."""
        self.run(LEAVE, lambda comm: comm.Barrier())

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
