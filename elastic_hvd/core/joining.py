"""The communicator's side of the join protocol (:mod:`.growth`): spawning processes,
adopting them or a hot spare at a step boundary, and a new process's own join.

Public so that the protocol never touches the communicator's fields: what it needs
from the communicator is here, documented, and nothing else.  Each call that runs MPI
collectives runs them as the main thread's MPI work (``_in_mpi``: the heartbeat's
progress loop pauses meanwhile).
"""

from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from .membership import MembershipEvent

if TYPE_CHECKING:
    from .growth import Growth
    from .invitation import Verdict
    from .signals import Identity


class JoiningMixin:
    """The join-protocol methods of :class:`~elastic_hvd.core.comm.ResilientComm`."""

    if TYPE_CHECKING:  # what ResilientComm provides: its join protocol, its MPI work
        _growth: Growth
        _waiting: tuple[int, int] | None

        def _in_mpi(self) -> AbstractContextManager[None]: ...

    @property
    def joining(self) -> bool:
        """True in a process spawned into a running job until it has joined."""
        return self._growth.joining

    @property
    def given_up(self) -> bool:
        """True in a spawned process that the running job gave up before adopting it:
        the ranks closed their side, so it may finalize (see ``runtime._leave_together``)."""
        return self._growth.given_up

    @property
    def join_pending(self) -> bool:
        """True while spawned processes wait to be adopted (see :meth:`poll_join`)."""
        return self._growth.pending

    def pending_processes(self) -> tuple[tuple[str, "Identity"], ...]:
        """(host, identity) of the spawned processes waiting to be adopted, as far as this
        rank heard (for the watch of stopped processes; any thread, no MPI)."""
        return self._growth.pending_processes()

    def spawn(self, count: int, hosts: Sequence[str] = (),
              oversubscribe: bool | None = None) -> bool:
        """Start ``count`` processes that will join (collective); True if they are on
        their way.  See :meth:`.growth.Growth.spawn`."""
        with self._in_mpi():
            return self._growth.spawn(count, hosts, oversubscribe)

    def spawn_spare(self, hosts: Sequence[str] = ()) -> bool:
        """Start a process that waits as a hot spare (collective); True if it is on its
        way.  See :meth:`.growth.Growth.spawn_spare`."""
        with self._in_mpi():
            return self._growth.spawn_spare(hosts)

    def poll_join(self) -> MembershipEvent | None:
        """At a step boundary (collective while a join is pending): adopt the spawned
        processes if they are all ready; returns the growth event then, else None."""
        with self._in_mpi():
            return self._growth.poll()

    def abandon_join(self, why: "Verdict | None" = None) -> None:
        """Give up the pending join (local; its processes exit without joining, saying
        ``why``: see :meth:`.growth.Growth.abandon`)."""
        self._growth.abandon(why)

    def join(self) -> MembershipEvent:
        """In a spawned process or a hot spare: join the running job; returns the
        growth event.  A spare waits here until it is adopted, beating (outside
        ``_in_mpi``), and again after an adoption that broke off."""
        while True:
            adoption = self._growth.await_adoption()
            with self._in_mpi():
                event = self._growth.join(adoption)
            if event is not None:
                return event

    def adopt_spare(self, avoid_hosts: Collection[str] = ()) -> bool:
        """Connect a ready hot spare (collective); True if it is on its way.  See
        :meth:`.growth.Growth.adopt_spare`."""
        with self._in_mpi():
            return self._growth.adopt_spare(avoid_hosts)

    @property
    def spares_in_place(self) -> bool:
        """True when this job's spares take a lost rank's number (a plain script's
        spares wait in ``init()``, see :mod:`.spares`)."""
        return self._growth.pool.in_place

    @property
    def replacing(self) -> int | None:
        """In a spare that was given a lost rank's number, until it joins: that number."""
        return self._growth.replacing

    def vacant_slots(self) -> list[int]:
        """Rank numbers of the starting ranks that no live rank holds (in-place spares)."""
        return self._growth.pool.vacant_slots()

    def await_claim(self) -> None:
        """In a spare of an in-place job, in ``init()``: wait (beating, outside MPI's
        collectives) until rank 0 gives it a lost rank's number; from then on it
        reports that rank and the job's starting size."""
        self._waiting = self._growth.await_claim()

    def claim_spares(self) -> None:
        """After each commit: rank 0 gives vacant rank numbers to waiting spares.
        See :meth:`.growth.Growth.claim_spares`."""
        self._growth.claim_spares()

    @property
    def spares_left(self) -> int:
        """Hot spares not adopted yet and not known to have failed (the same on every rank)."""
        return len(self._growth.pool.spares)

    def release_spares(self) -> None:
        """At the job's end: let the spares not adopted go."""
        with self._in_mpi():
            self._growth.release_spares()
