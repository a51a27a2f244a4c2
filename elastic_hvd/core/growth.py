"""The join protocol: new processes join the live communicator in place.

Shrinking keeps a job alive; growing gives it back its speed.  A join has two
halves so that the ranks already training never wait for a new process to
start Python and import TensorFlow:

1. **Spawn** (every live rank together, at a step boundary; see :mod:`.spawn`):
   ``MPI_Comm_spawn`` of ``python -m elastic_hvd.runner.join <the same program>``,
   whose first act is ``MPI_Init`` and an intercommunicator merge, so this costs
   about one Python start-up (~1 s).  The spawn's outcome is agreed like any
   collective; a failure during it is repaired and the spawn is simply tried
   again later.  The ranks then train on while the joiners load their program.
2. **Adopt**: once per step while a join is pending, one agreed ``allreduce``
   asks whether every joiner has reached :meth:`Growth.join` (each sends the
   lowest rank a *ready* message).  When they all have, the merged communicator
   is duplicated into the live one -- old ranks first, in their order, joiners
   after them, so ranks stay stable -- and the bookkeeping (original ids, hosts,
   membership history, the call history of :mod:`.signature`) is handed over.
   One ``gained`` :class:`MembershipEvent` follows.

If the live ranks change while a join is pending, the join is abandoned (the
merged communicator is revoked, so the joiners exit) and a new one is spawned
for the new deficit.  Training state (weights, data position...) is the Keras
layer's business: see ``keras_callbacks.growth``.

Why an object beside the communicator rather than part of it: the protocol has
state of its own (the pending join, the spawn count, the next free original
id) and uses the communicator only through its public interface
(:class:`.comm_api.Communicator`: agree, repair, revoke/retire, replace the live
communicator, export/import its book), so neither reaches into the other.  The
pool of hot spares is :mod:`.spare_pool`; a spawned process's side until it
joins, :mod:`.invitation`.

Why the ready signal is a point-to-point message and not a non-blocking barrier:
a failed schedule of Open MPI's non-blocking collectives (``libnbc``) prints
``NBC_Progress: an error 75 was found during schedule ...`` on every rank, and
an abandoned join always fails one (docs/measurements.md).  A failed receive is silent.
"""

import contextlib
import os
import time
from collections.abc import Collection, Iterable, Sequence
from enum import IntEnum
from typing import Any, cast

import numpy as np

from . import announce, config, faults, signals, spares
from .comm_api import Communicator
from .errors import ElasticHvdError
from .invitation import (GIVEN_UP, HELLO, HELLO_BYTES, READY, SPARE, VERDICT, VERDICT_SENDERS,
                         Invitation, Verdict, leave_unjoined, read_hello)
from .membership import MembershipEvent
from .spare_pool import SparePool
from .spares import SpareKey
from .spawn import MergeCall, SpawnCall, agreed_merge
from ..log import get_logger

_log = get_logger(__name__)

#: ``ResilientComm.label`` while a join's bookkeeping is exchanged.
JOIN_LABEL = "ElasticJoin"


class Readiness(IntEnum):
    """A pending join's joiners, as one rank knows them (the lowest over the ranks is
    the agreed one: an int, reduced by ``MPI_MIN``)."""
    BROKEN = -1  # a joiner died, or the merged communicator was revoked
    WAITING = 0  # not all of them said they are ready yet
    READY = 1    # every one said it is ready


class _Pending:
    """A spawn whose joiners have not been adopted yet (running ranks' side): the
    merged communicator, on its rank 0 one receive per joiner's ready message, and for
    spawned processes one receive per joiner's hello (:func:`.invitation.hello`) on every rank."""

    def __init__(self, merged: Any, count: int, generation: int, started: float,
                 slot: int | None = None, spare: SpareKey | None = None) -> None:
        #: ``generation``: the communicator's when the spawn began (a change gives it up).
        self.merged, self.count, self.generation, self.started = (merged, count, generation,
                                                                   started)
        self.slot = slot  # the rank number a spare of a plain script takes, else None
        self.spare = spare  # the adopted spare's pool key; None for spawned joiners
        self.spawn_s = time.perf_counter() - started
        joiners = range(merged.size - count, merged.size) if merged.rank == 0 else ()
        self._buffers = [np.empty(1, dtype=np.int8) for _ in joiners]
        self._ready = [merged.Irecv(buffer, source=r, tag=READY)
                       for buffer, r in zip(self._buffers, joiners)]
        spawned = range(merged.size - count, merged.size) if spare is None else ()
        self._hellos = [(merged.Irecv(buffer, source=r, tag=HELLO), buffer)
                        for r, buffer in ((r, np.zeros(HELLO_BYTES, np.uint8)) for r in spawned)]
        #: (host, identity) of each joiner heard from; replaced, never changed in place:
        #: the watch of stopped processes reads it from its own thread.
        self.processes: tuple[tuple[str, signals.Identity], ...] = ()

    def test(self, MPI: Any) -> Readiness:
        """Whether every joiner said it is ready, as far as this rank knows; notes the
        joiners whose hello arrived meanwhile."""
        waiting = []
        for request, buffer in self._hellos:
            try:
                heard = request.Test()
            except MPI.Exception:  # a joiner that failed: the ready test says so
                heard = False
            if heard:
                self.processes += (read_hello(buffer),)
            else:
                waiting.append((request, buffer))
        self._hellos = waiting
        try:
            return Readiness.READY if MPI.Request.Testall(self._ready) else Readiness.WAITING
        except MPI.Exception:
            return Readiness.BROKEN

    def close(self, comm: Communicator, why: Verdict | None = None) -> None:
        """Revoke the merged communicator (its joiners give up) and retire it; first
        tell the joiners ``why`` (a :class:`.invitation.Verdict`) when known, so that
        they can say it.

        The verdict is sent before the revoke from the same rank, and a message and a
        revoke from one rank arrive in order, so a joiner's receive from this rank
        completes before the revoke fails its other requests.  Without it (the lowest
        ranks died, or a rank left by itself first) a joiner names both causes."""
        sent = []
        if why is not None and self.merged.rank < VERDICT_SENDERS:
            verdict = np.array([why], dtype=np.int8)
            for joiner in range(self.merged.size - self.count, self.merged.size):
                with contextlib.suppress(comm.MPI.Exception):
                    sent.append(self.merged.Isend(verdict, dest=joiner, tag=VERDICT))
        comm.revoke(self.merged)
        for request in sent:  # small: sent eagerly, complete, or failed by the revoke
            with contextlib.suppress(comm.MPI.Exception):
                request.Wait()
        for request in self._ready:
            with contextlib.suppress(comm.MPI.Exception):
                request.Cancel()
                request.Wait()
        self.end_hellos(comm.MPI)
        comm.retire(self.merged)

    def end_hellos(self, MPI: Any) -> None:
        """Cancel the receives of hellos not heard (local): the join is over."""
        for request, _ in self._hellos:
            with contextlib.suppress(MPI.Exception):
                request.Cancel()
                request.Wait()
        self._hellos = []


class Growth:
    """The join protocol of ``comm`` (a :class:`.comm_api.Communicator`), made beside it
    by ``runtime.init`` (``runtime.growth()``).  Each call that runs MPI collectives
    runs them as the main thread's MPI work (``comm.in_mpi()``: the heartbeat's
    progress loop pauses meanwhile).

    ``invitation``: in a process spawned into a running job, its
    :class:`.invitation.Invitation` (see :mod:`elastic_hvd.runner.join`); in a hot spare,
    its :class:`.spares.SpareInvitation`.  The process is a *joiner* until :meth:`join`.
    ``pool``: the spares of the world, ``[(world rank, host)]``, and ``in_place``: see
    :class:`.spare_pool.SparePool` (:attr:`pool`).
    """

    def __init__(self, comm: Communicator,
                 invitation: "Invitation | spares.SpareInvitation | None" = None,
                 pool: Iterable[tuple[int, str]] = (), in_place: bool = False) -> None:
        self.comm = comm
        self._pending: _Pending | None = None
        # Any: an Invitation or a SpareInvitation (duck-typed: accept/connect, await_claim,
        # close), None once joined; only called where the protocol's state rules None out.
        self._invitation: Any = invitation
        self.spawns = 0  # spawns this job made (counted alike on every rank; joiners are told)
        self.next_id: int | None
        self.next_id = None if invitation is not None else comm.initial_size  # the next joiner's
        #: A process of mpirun's own job (a spawned one has a world of its own).
        self.in_world = getattr(invitation, "in_world", not isinstance(invitation, Invitation))
        self.pool = SparePool(comm, pool, joining=invitation is not None,
                              in_world=self.in_world, in_place=in_place)

    @property
    def joining(self) -> bool:
        """True in a spawned process or a hot spare until it has joined."""
        return self._invitation is not None

    @property
    def given_up(self) -> bool:
        """True in a spawned process that the running job gave up before adopting it."""
        return bool(getattr(self._invitation, "given_up", False))

    @property
    def replacing(self) -> int | None:
        """In a claimed spare of an in-place job until it joins: the slot it takes."""
        return getattr(self._invitation, "slot", None)

    @property
    def pending(self) -> bool:
        """True while spawned processes wait to be adopted (running ranks)."""
        return self._pending is not None

    @property
    def spares_in_place(self) -> bool:
        """True when this job's spares take a lost rank's number (a plain script's
        spares wait in ``init()``, see :mod:`.spares`)."""
        return self.pool.in_place

    @property
    def spares_left(self) -> int:
        """Hot spares not adopted yet and not known to have failed (the same on every rank)."""
        return len(self.pool.spares)

    def vacant_slots(self) -> list[int]:
        """Rank numbers of the starting ranks that no live rank holds (in-place spares)."""
        return self.pool.vacant_slots()

    def pending_processes(self) -> tuple[tuple[str, signals.Identity], ...]:
        """(host, identity) of the spawned processes waiting to be adopted that this rank
        heard from (any thread: read without MPI)."""
        pending = self._pending
        return pending.processes if pending is not None else ()

    # -- running ranks ----------------------------------------------------------------
    def spawn(self, count: int, hosts: Sequence[str] = (),
              oversubscribe: bool | None = None) -> bool:
        """Start ``count`` joiners (collective); True if they are on their way.

        ``hosts``: host names to place them on (default: Open MPI's choice).  A
        failure during the spawn is repaired as in any collective and the spawn
        reported as not done (False), to be retried later.
        """
        if self._pending is not None or count <= 0:
            return False
        started, generation = time.perf_counter(), self.comm.generation
        self.spawns += 1
        with self.comm.in_mpi():
            call = SpawnCall(self.comm, count, hosts, oversubscribe,
                             faults.for_joiner(self.spawns))
            return self._start_join(call, count, started, generation,
                                    f"spawning {count} process(es)")

    def spawn_spare(self, hosts: Sequence[str] = ()) -> bool:
        """Start one process that waits as a hot spare (collective): a spare that arrives
        late.  It refills the pool once a spare was adopted (``--spares K --respawn``),
        and in a job whose spares take a lost rank's number it is how ``--respawn``
        replaces one: it waits in ``init()`` for a claim on its channel (see
        :mod:`.spares`).  True if it is on its way."""
        if self._pending is not None:
            return False
        generation = self.comm.generation
        self.spawns += 1
        extra = {**faults.for_joiner(self.spawns), config.env("spawned_spare"): "1"}
        with self.comm.in_mpi():
            call = SpawnCall(self.comm, 1, hosts, None, extra)
            merged = agreed_merge(self.comm, call, generation, "spawning a hot spare")
        if merged is None:
            return False
        self.pool.add_spawned(SpareKey.spawned(self.spawns), merged, hosts[0] if hosts else "")
        return True

    def _start_join(self, call: MergeCall, count: int, started: float, generation: int, what: str,
                    slot: int | None = None, spare: SpareKey | None = None) -> bool:
        """Wait for ``call`` (a :class:`.spawn.MergeCall`) and agree on its outcome:
        True with the join pending, or False with its communicators revoked."""
        merged = agreed_merge(self.comm, call, generation, what)
        if merged is None:
            return False
        self._pending = _Pending(merged, count, generation, started, slot, spare)
        return True

    def adopt_spare(self, avoid_hosts: Collection[str] = ()) -> bool:
        """Connect a ready hot spare (collective, at a step boundary): True if it is on
        its way (a join is pending, as after :meth:`spawn`).  The ranks exchange what
        they know of the pool, and the pool chooses the spare
        (:meth:`.spare_pool.SparePool.choose`).  See :mod:`.spares`."""
        if self._pending is not None or not self.pool.spares:
            return False
        with self.comm.in_mpi():
            return self._adopt_spare(avoid_hosts)

    def _adopt_spare(self, avoid_hosts: Collection[str]) -> bool:
        comm = self.comm
        started, generation = time.perf_counter(), comm.generation
        mine = self.pool.news()
        with comm.labelled(JOIN_LABEL):  # a loss meanwhile is an event of its own (not
            everyone = comm.allgather_object(mine)  # folded: no join event would report it)
        if comm.generation != generation:
            return False
        adoption = self.pool.choose(everyone, avoid_hosts)
        if adoption is None:
            return False
        if self._start_join(adoption.call, 1, started, generation,
                            f"adopting the spare ({adoption.spare})", adoption.slot,
                            adoption.spare):
            return True
        self.pool.not_adopted(adoption)
        return False

    def claim_spares(self) -> None:
        """Rank 0 of an in-place job, after each commit (local, no collective): give
        vacant slots to waiting spares (:meth:`.spare_pool.SparePool.claim`).  A spare
        then starts the script as that rank (see :mod:`.spares`) and is adopted when
        ready (:meth:`adopt_spare`)."""
        if self.joining:
            return
        for claimed in self.pool.claim():
            lost = announce.who(claimed.slot, claimed.last_id)
            _log.info(f"elastic_hvd: a hot spare ({claimed.spare.key}, {claimed.spare.host}) "
                      f"takes the place of the lost {lost}: it starts the script as rank "
                      f"{claimed.slot} and joins at the next epoch's start once ready, with "
                      "the next free id")

    def release_spares(self) -> None:
        """At the job's end: the spares not adopted may go."""
        if not self.joining:
            with self.comm.in_mpi():
                self.pool.release()

    def poll(self) -> MembershipEvent | None:
        """At a step boundary (collective while a join is pending): adopt the joiners
        if they are all ready; returns the growth event then, else None."""
        pending = self._pending
        if pending is None:
            return None
        with self.comm.in_mpi():
            return self._poll(pending)

    def _poll(self, pending: _Pending) -> MembershipEvent | None:
        comm, MPI = self.comm, self.comm.MPI
        ready = Readiness.BROKEN
        if comm.generation == pending.generation:
            local = pending.test(MPI)
            ready = Readiness(comm.run(("poll_join",), lambda c: _minimum(MPI, c, local)))
        if comm.generation != pending.generation or ready is Readiness.BROKEN:
            self.abandon(Verdict.CHANGED if comm.generation != pending.generation
                         else Verdict.BROKE)
            return None
        if ready is Readiness.WAITING:
            return None
        # Commit: a fresh communicator that the joiners also create.  Until it
        # exists a joiner may still be told to go (a revoked merged communicator).
        # A spare that takes a slot gets that place in the rank order (ranks by slot).
        adopted: Any = None
        me = cast(int, comm.original_id)  # None only in a joiner, which never gets here
        try:
            adopted = (pending.merged.Dup() if pending.slot is None else
                       pending.merged.Split(0, self.pool.slots.get(me, me)))
            adopted.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception:
            pass
        agreed = comm.agree(1 if adopted is not None else 0) == 1
        if not agreed or comm.generation != pending.generation:
            if adopted is not None:
                comm.revoke(adopted)
                comm.retire(adopted)
            self.abandon(Verdict.CHANGED if comm.generation != pending.generation
                         else Verdict.BROKE)
            return None
        self._pending = None
        pending.end_hellos(MPI)
        self.pool.adopted(pending.spare)
        old_ids = list(comm.ids)
        next_id = cast(int, self.next_id)  # None only in a joiner, which never gets here
        new_ids = list(range(next_id, next_id + pending.count))
        self.next_id = next_id + pending.count
        ids = old_ids + new_ids
        if pending.slot is not None:  # MPI_Comm_split's order: by key, then by merged rank
            slots = self.pool.slots
            slots[new_ids[0]] = pending.slot
            ids = sorted(ids, key=lambda i: (slots.get(i, i), ids.index(i)))
        comm.retire(pending.merged)
        comm.replace(adopted, ids)
        book = {"comm": comm.book(), "ids": ids, "old": old_ids, "slots": self.pool.slots,
                "next_id": self.next_id, "spawns": self.spawns, "pool": self.pool.spares}
        try:  # a plain broadcast: a joiner must never wait in an agreement for ranks
            # that might still send it away (see join())
            adopted.bcast(book, root=_book_root(pending.slot))
        except MPI.Exception:
            pass  # whoever died is repaired in the next (resilient) exchange
        comm.settle(adopted)
        return self._welcome(old_ids, pending.started, pending.spawn_s)

    def abandon(self, why: Verdict | None = None) -> None:
        """Give up the pending join (local; its joiners exit, saying ``why``, a
        :class:`.invitation.Verdict`).  In a process that has not joined: stop watching
        for the job's verdict (it is about to exit)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.close(self.comm, why)
        if self._invitation is not None:
            self._invitation.close()

    # -- a spawned process ----------------------------------------------------------------
    def await_adoption(self) -> tuple[str, int] | None:
        """In a hot spare: wait (outside MPI's collectives, see :mod:`.spares`) until
        training ranks adopt it; returns the port to connect to and the rank that sent
        it.  None elsewhere."""
        if not isinstance(self._invitation, spares.SpareInvitation):
            return None
        comm = self.comm
        if self.replacing is None:  # a claimed one's place was said when it was claimed
            name = (f"world rank {comm.MPI.COMM_WORLD.rank}" if self.in_world else
                    f"process {os.getpid()} (spawned)")
            _log.info(f"elastic_hvd: {name} is a hot spare, waiting to replace a lost rank: "
                      f"until it joins it reports rank {comm.rank} of {comm.size} (as if it had "
                      "joined last) and has no id; it gets the next free id when it joins")
        return self._invitation.wait(lambda why: leave_unjoined(why, who=SPARE))

    def await_claim(self) -> None:
        """In a spare of an in-place job, in ``init()``: wait (beating, outside MPI's
        collectives) until rank 0 gives it a lost rank's number; from then on the
        communicator reports that rank and the job's starting size."""
        slot, size = self._invitation.await_claim(lambda why: leave_unjoined(why, who=SPARE))
        self.comm.report_as(slot, size)

    def join(self) -> MembershipEvent:
        """In a spawned process or a hot spare: join the running job; returns the
        growth event.  A spare waits here until it is adopted, beating (outside
        ``comm.in_mpi()``), and again after an adoption that broke off."""
        if not self.joining:
            raise ElasticHvdError("join(): this process is not joining a running job")
        while True:
            adoption = self.await_adoption()
            with self.comm.in_mpi():
                event = self._join(adoption)
            if event is not None:
                return event

    def _join(self, adoption: tuple[str, int] | None) -> MembershipEvent | None:
        """Meet the running job and take over its bookkeeping; returns the growth event.
        If the job gave up on this process (its ranks changed, or training ended
        first), a spawned process exits: nobody needs it; a spare (``adoption``: where
        the adopting ranks accept, and their root) returns None and waits again."""
        comm, MPI = self.comm, self.comm.MPI
        started = time.perf_counter()
        merged = adopted = None
        try:
            merged = (self._invitation.accept() if adoption is None else
                      self._invitation.connect(*adoption))
            merged.Send(np.ones(1, dtype=np.int8), dest=0, tag=READY)
            slot = self.replacing  # "adopted": the ranks committed to this join
            adopted = merged.Dup() if slot is None else merged.Split(0, slot)
            adopted.Set_errhandler(MPI.ERRORS_RETURN)
            book = adopted.bcast(None, root=_book_root(slot))
        except MPI.Exception as exc:
            broken = [c for c in (adopted, merged) if c is not None]
            if adoption is None:
                leave_unjoined(GIVEN_UP, *broken)
            _log.warning(f"elastic_hvd: {SPARE} waits again: an adoption broke off "
                         f"({exc.Get_error_string()})")
            for c in broken:
                comm.revoke(c)
                comm.retire(c)
            return None
        self._invitation.close()
        self._invitation = None
        comm.joining = False
        comm.replace(adopted, book["ids"])  # retires the merged communicator
        comm.load_book(book["comm"])
        self.next_id, self.spawns = book["next_id"], book["spawns"]
        self.pool.spares, self.pool.slots = book["pool"], book["slots"]
        faults.configure(comm.original_id)  # ELASTIC_HVD_FAULTS may name the new id
        comm.settle(adopted)
        return self._welcome(book["old"], started, 0.0)

    # -- both ---------------------------------------------------------------------------
    def _welcome(self, old_ids: Sequence[int], started: float,
                 spawn_s: float) -> MembershipEvent:
        """Last step of a join, on old and new ranks: exchange hosts and pids (a
        resilient collective: a failure from here on is repaired like any other,
        and reported in this event) and record the one growth event."""
        comm = self.comm
        with comm.folded(JOIN_LABEL):
            spawn_times = comm.meet(spawn_s)
        ids = comm.ids
        event = MembershipEvent(
            old_size=len(old_ids), new_size=comm.size,
            lost=tuple(i for i in old_ids if i not in ids),
            gained=tuple(i for i in ids if i not in old_ids),
            repair_s=time.perf_counter() - started, sequence=comm.generation + 1,
            during=JOIN_LABEL, spawn_s=max(spawn_times))
        comm.record(event)
        return event


def _minimum(MPI: Any, comm: Any, value: int) -> int:
    """The minimum of the ints ``value`` over ``comm``, by ``MPI_Allreduce`` on ``comm``
    itself: mpi4py's pickled ``allreduce`` runs on a hidden duplicate that a revoke
    does not reach, and left the others spinning for ever (docs/measurements.md)."""
    buffer = np.array([value], dtype=np.intc)
    comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.MIN)
    return int(buffer[0])


def _book_root(slot: int | None) -> int:
    """The rank of the adopted communicator that sends the book: its rank 0, unless a
    spare took slot 0 (rank 0's place): then the spare is rank 0, and the next one sends."""
    return 1 if slot == 0 else 0
