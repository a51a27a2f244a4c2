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

from . import announce, config, mpi_env, signals, workarounds
from .collectives import CollectivesMixin
from .errors import JoinOrderError, RanksBelowMinimumError
from .freshness import Anomalies, Stamps
from .membership import Listeners, MembershipEvent
from .process_sets import Registry
from .repair import RepairMixin
from .signature import SignaturePredictor
from .transaction import LEAVE, LeftEarly, TransactionMixin

if TYPE_CHECKING:
    from .heartbeat import Heartbeat
    from .invitation import Invitation
    from .spares import SpareInvitation

#: What a function given to ``ResilientComm.consistent`` returns.
_T = TypeVar("_T")


class ResilientComm(TransactionMixin, RepairMixin, CollectivesMixin):
    """An MPI communicator whose collectives survive the loss of ranks.

    ``ids`` maps each current rank to its *original id* (its rank when the
    communicator was created; processes that join later get the next free ids),
    which stays stable across repairs.  ``invitation``, the :class:`.invitation.Invitation`
    of a process spawned into a running job (or a hot spare's), makes it start as a
    *joiner* (:attr:`joining`), whose ``original_id`` is None and ``ids`` empty until
    it has joined.

    Cut along its concepts: the leave protocol and the membership it reports are
    here; the agreed transaction, on any communicator, in
    :class:`.transaction.TransactionMixin`; membership changes and repair in
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
        #: The registered process sets (see :mod:`.process_sets`); derived again in
        #: every repair that lost a member of one (:meth:`record`).
        self.process_sets = Registry()
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

    def _before_transaction(self, calls: Sequence[tuple[Any, Callable[[Any], Any]]]
                            ) -> list[Any] | None:
        if self._rehearsing:
            return [attempt(self.MPI.COMM_SELF) for _, attempt in calls]
        if self._below_min is not None:
            raise self._below_min
        if calls[0][0] is not None and self.joining:
            raise JoinOrderError(calls[0][0])
        return None

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


    def leave(self) -> None:
        """The last collective of a process that is done (``atexit``): a barrier when
        every rank leaves.  One that leaves while others train on (it returned, or called
        ``sys.exit``) interrupts their collective within :data:`LEAVE_TIMEOUT`; the
        signatures show who leaves, it raises :class:`LeftEarly`, and the others go on
        without it as after a crash, with no detection delay and no MismatchError."""
        self.run(LEAVE, lambda comm: comm.Barrier())


# LEAVE and LeftEarly are the transaction's (:mod:`.transaction`); named here too, where the
# runtime reads them.
__all__ = ["LEAVE", "LeftEarly", "ResilientComm"]
