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
id) and uses the communicator only through its public interface -- agree,
repair, revoke/retire, replace the live communicator, export/import its book --
so neither reaches into the other.

Why the ready signal is a point-to-point message and not a non-blocking barrier:
a failed schedule of Open MPI's non-blocking collectives (``libnbc``) prints
``NBC_Progress: an error 75 was found during schedule ...`` on every rank, and
an abandoned join always fails one (docs/measurements.md).  A failed receive is silent.
"""

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Collection, Iterable, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, cast

import numpy as np

from . import announce, config, faults, heartbeat, mpi_env, signals, spares, timings
from .errors import ElasticHvdError
from .membership import MembershipEvent
from .spares import Spare, SpareKey
from .spawn import MergeCall, SpawnCall
from ..log import get_logger

if TYPE_CHECKING:
    from .comm import ResilientComm

_log = get_logger(__name__)

#: ``ResilientComm.label`` while a join's bookkeeping is exchanged.
JOIN_LABEL = "ElasticJoin"
#: Tag of a joiner's "ready" message to the lowest rank, on the merged communicator.
_READY = 1
#: Tag of the running ranks' verdict when they give a join up: one byte, the reason.
_VERDICT = 2


class Verdict(IntEnum):
    """Why the running ranks gave a join up (sent to its joiners as one byte)."""
    ENDED = 1
    CHANGED = 2
    BROKE = 3


ENDED, CHANGED, BROKE = Verdict.ENDED, Verdict.CHANGED, Verdict.BROKE  # short names
#: How the joiners say each verdict.
_REASONS = {ENDED: "training ended before it was ready",
            CHANGED: "the job's ranks changed while it started (the job starts another "
                     "process for them)",
            BROKE: "another process joining with it failed"}
#: Running ranks (the lowest of the merged communicator) that send the verdict.
_VERDICT_SENDERS = 3
#: Tag of a joiner's first message to every running rank: its host and identity (pid and
#: start time), right after its merge, so that a stop before it joins is seen (see
#: :func:`_hello`).
_HELLO = 4
#: Bytes of that message: the pid and the start time (8 each, little-endian), then the
#: host name (NUL-padded).
_HELLO_BYTES = 16 + 256


def _hello() -> np.ndarray:
    """This process's (identity, host) as a joiner's hello.  Why: Open MPI's detector
    never watches a spawned process, and a member only learns a joiner's pid when it
    joins; a joiner stopped (SIGSTOP) while it starts up would never be ready, and the
    job would stay below its size for good.  With the pid known, the members' watch of
    stopped processes (:mod:`.stopped_peers`) covers it too; with the start time, that
    watch never kills a later process that got the pid (:mod:`.signals`)."""
    message = np.zeros(_HELLO_BYTES, dtype=np.uint8)
    message[:16] = np.array(signals.mine(), dtype="<i8").view(np.uint8)
    host = socket.gethostname().encode()[:_HELLO_BYTES - 16]
    message[16:16 + len(host)] = np.frombuffer(host, dtype=np.uint8)
    return message


def _read_hello(message: np.ndarray) -> tuple[str, signals.Identity]:
    pid, start = (int(v) for v in message[:16].view("<i8"))
    return (bytes(message[16:]).rstrip(b"\0").decode(errors="replace"),
            signals.Identity(pid, start))


class Readiness(IntEnum):
    """A pending join's joiners, as one rank knows them (the lowest over the ranks is
    the agreed one: an int, reduced by ``MPI_MIN``)."""
    BROKEN = -1  # a joiner died, or the merged communicator was revoked
    WAITING = 0  # not all of them said they are ready yet
    READY = 1    # every one said it is ready


class _SpareNews(NamedTuple):
    """What one training rank knows of the pool before an adoption (allgathered)."""
    world_rank: int  # this rank's rank in MPI_COMM_WORLD, -1 in a spawned rank
    ready: list[tuple[SpareKey, int]]  # spares that said they are ready, the slot each takes
    failed: list[SpareKey]  # spares this rank knows to have failed
    held: list[SpareKey]  # spawned spares this rank holds a channel to


class _Claim(NamedTuple):
    """Rank 0's claim of a vacant slot for a waiting spare (an in-place job)."""
    slot: int
    send: Any  # the claim message's send request (it keeps its buffer)


class _Pending:
    """A spawn whose joiners have not been adopted yet (running ranks' side): the
    merged communicator, on its rank 0 one receive per joiner's ready message, and for
    spawned processes one receive per joiner's hello (:func:`_hello`) on every rank."""

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
        self._ready = [merged.Irecv(buffer, source=r, tag=_READY)
                       for buffer, r in zip(self._buffers, joiners)]
        spawned = range(merged.size - count, merged.size) if spare is None else ()
        self._hellos = [(merged.Irecv(buffer, source=r, tag=_HELLO), buffer)
                        for r, buffer in ((r, np.zeros(_HELLO_BYTES, np.uint8)) for r in spawned)]
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
                self.processes += (_read_hello(buffer),)
            else:
                waiting.append((request, buffer))
        self._hellos = waiting
        try:
            return Readiness.READY if MPI.Request.Testall(self._ready) else Readiness.WAITING
        except MPI.Exception:
            return Readiness.BROKEN

    def close(self, comm: "ResilientComm", why: Verdict | None = None) -> None:
        """Revoke the merged communicator (its joiners give up) and retire it; first
        tell the joiners ``why`` (:data:`ENDED`, ...) when known, so that they can say it.

        The verdict is sent before the revoke from the same rank, and a message and a
        revoke from one rank arrive in order, so a joiner's receive from this rank
        completes before the revoke fails its other requests.  Without it (the lowest
        ranks died, or a rank left by itself first) a joiner names both causes."""
        sent = []
        if why is not None and self.merged.rank < _VERDICT_SENDERS:
            verdict = np.array([why], dtype=np.int8)
            for joiner in range(self.merged.size - self.count, self.merged.size):
                with contextlib.suppress(comm.MPI.Exception):
                    sent.append(self.merged.Isend(verdict, dest=joiner, tag=_VERDICT))
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


class JoinAbandoned(SystemExit):
    """Raised in the main thread of a spawned process that the running job gave up
    before adopting it: the process ends as a program that exits 0 does."""


class Invitation:
    """A spawned process's link to the running job until it joins: the communicator
    merged with it, watched.

    Between its merge and :meth:`Growth.join` the process runs its program's
    start-up (imports, model, the rehearsal step), which takes seconds to
    minutes.  If the job gives the join up meanwhile (it revokes the
    communicator), a thread notices within ``timings.JOIN_WATCH_PERIOD`` and ends the
    process at once rather than at ``join()``, so that it does not use a host for
    nothing, and above all is gone before the running ranks create communicators
    again: Open MPI 5.0.11 segfaults in a rank that learns of a process's end while
    it activates a communicator (docs/measurements.md).
    The thread raises :class:`JoinAbandoned` in the main thread, at its next
    Python instruction, which then exits the ordinary way (``MPI_Finalize`` at
    exit); the thread never finalizes MPI itself, which the main thread may be
    using.  A main thread inside a call that does not come back to Python (a C
    library's wait) never gets the exception (such a joiner kept mpirun from ending:
    docs/measurements.md).  So a process still here
    ``ELASTIC_HVD_EXIT_GRACE`` seconds later prints its main thread's stack and ends
    itself with SIGKILL (a joiner that dies is no failure of the job).
    """

    def __init__(self, MPI: Any, merged: Any) -> None:
        self.MPI, self.merged = MPI, merged
        # The running ranks' verdict, if they give this process up (see _Pending.close):
        # posted now, so that it completes on arrival, before the revoke that follows it.
        self._verdicts = [np.zeros(1, dtype=np.int8) for _ in range(min(_VERDICT_SENDERS,
                                                                         merged.rank))]
        self._verdict_requests = [merged.Irecv(buffer, source=sender, tag=_VERDICT)
                                  for sender, buffer in enumerate(self._verdicts)]
        # Its hello to each running rank (the merged communicator's first ranks; the
        # processes of this spawn make up this process's world).  Small: sent eagerly.
        self._hello = _hello()
        self._hello_requests = [merged.Isend(self._hello, dest=r, tag=_HELLO)
                                for r in range(merged.size - MPI.COMM_WORLD.size)]
        self._stop = threading.Event()
        #: Set when the running job gave this process up (it then exits through JoinAbandoned).
        self.given_up = False
        self._thread = threading.Thread(target=self._watch, args=(MPI, threading.main_thread()),
                                        name="elastic_hvd-join-watch", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # before MPI_Finalize (mpi4py's or runtime's)

    def _watch(self, MPI: Any, main: threading.Thread) -> None:
        while not self._stop.wait(timings.JOIN_WATCH_PERIOD):
            try:
                self.merged.Iprobe(0, _READY)  # never matches; fails once revoked
            except MPI.Exception:
                if self._stop.is_set():  # join() took the communicator over
                    return
                # print, not logging: the main thread, maybe stuck, may hold a handler's lock
                print(_leaving_line(self._reason(MPI)), file=sys.stderr, flush=True)
                self.given_up = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(main.ident),  # type: ignore[arg-type]  # started: an int
                    ctypes.py_object(JoinAbandoned))
                grace = config.current().exit_grace
                time.sleep(grace)  # the process normally ends meanwhile
                _end_stuck(main, grace)

    def _reason(self, MPI: Any) -> str:
        """Why the job gave this process up: the first verdict received, else both causes."""
        for request, buffer in zip(self._verdict_requests, self._verdicts):
            with contextlib.suppress(MPI.Exception):  # not received: failed by the revoke
                if request.Test() and int(buffer[0]) in _REASONS:
                    return _GIVEN_UP_BECAUSE + _REASONS[Verdict(int(buffer[0]))]
        return _GIVEN_UP

    @property
    def comm(self) -> Any:
        """The communicator that stands for the live one until the process joins."""
        return self.merged

    @property
    def initial_size(self) -> int:
        return self.merged.size

    def accept(self) -> Any:
        """Stop watching and hand the merged communicator over (in ``join()``)."""
        self.close()
        return self.merged

    def close(self) -> None:
        """Stop watching (local; idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            # It stops within a watch period, or it already told the main thread to go
            # and waits out ELASTIC_HVD_EXIT_GRACE (the process is exiting: leave it be).
            self._thread.join(timeout=timings.JOIN_WATCH_STOP)
        for request in self._verdict_requests:  # never sent once the job adopts it
            with contextlib.suppress(self.MPI.Exception):  # failed by a revoke: nothing to cancel
                if not request.Test():
                    request.Cancel()
                    request.Wait()
        self._verdict_requests = []
        for request in self._hello_requests:  # delivered long ago, or failed by a revoke
            with contextlib.suppress(self.MPI.Exception):
                request.Wait()
        self._hello_requests = []


class Growth:
    """The join protocol of ``comm`` (a :class:`ResilientComm`), which delegates its
    ``spawn``, ``poll_join``, ``abandon_join`` and ``join`` here.

    ``invitation``: in a process spawned into a running job, its :class:`Invitation`
    (see :mod:`elastic_hvd.runner.join`); in a hot spare, its
    :class:`.spares.SpareInvitation`.  The process is a *joiner* until :meth:`join`.
    ``pool``: the spares of the world, ``[(world rank, host)]`` (see :mod:`.spares`),
    the same on every rank; :attr:`pool` holds those not adopted yet, spawned ones
    included, as :class:`.spares.Spare`.  ``in_place``: the job's spares take a lost rank's
    number (its *slot*: the rank a plain script believes it has, see :mod:`.spares`).
    """

    def __init__(self, comm: "ResilientComm",
                 invitation: "Invitation | spares.SpareInvitation | None" = None,
                 pool: Iterable[tuple[int, str]] = (), in_place: bool = False) -> None:
        self.comm = comm
        self.in_place = in_place
        #: Original id -> slot, the same on every rank (a joiner gets it in the book).
        self.slots: dict[int, int]
        self.slots = {} if invitation is not None else {i: i for i in range(comm.initial_size)}
        self._claims: dict[SpareKey, _Claim] = {}  # rank 0 of an in-place job
        self._pending: _Pending | None = None
        # Any: an Invitation or a SpareInvitation (duck-typed: accept/connect, await_claim,
        # close), None once joined; only called where the protocol's state rules None out.
        self._invitation: Any = invitation
        self.spawns = 0  # spawns this job made (counted alike on every rank; joiners are told)
        self.next_id: int | None
        self.next_id = None if invitation is not None else comm.initial_size  # the next joiner's
        self.pool = [Spare(SpareKey.world(w), host) for w, host in pool]
        #: A process of mpirun's own job (a spawned one has a world of its own).
        self.in_world = getattr(invitation, "in_world", not isinstance(invitation, Invitation))
        #: Spawned spares this rank spawned: key -> the communicator merged with it.
        self.channels: dict[SpareKey, Any] = {}
        #: Spares that told this rank they are ready -> the slot each takes (-1: none) ...
        self._ready_spares: dict[SpareKey, int] = {}
        self._spare_ids: dict[SpareKey, signals.Identity] = {}  # ... -> who (see adopt_spare)

    @property
    def joining(self) -> bool:
        """True in a spawned process until it has joined."""
        return self._invitation is not None

    @property
    def given_up(self) -> bool:
        """True in a spawned process that the running job gave up before adopting it."""
        return bool(getattr(self._invitation, "given_up", False))

    @property
    def replacing(self) -> int | None:
        """In a claimed spare of an in-place job until it joins: the slot it takes."""
        return getattr(self._invitation, "slot", None)

    def vacant_slots(self) -> list[int]:
        """Slots of the starting ranks that no live rank holds (in-place jobs)."""
        taken = {self.slots.get(i, i) for i in self.comm.ids}
        return sorted(set(range(self.comm.initial_size)) - taken)

    @property
    def pending(self) -> bool:
        """True while spawned processes wait to be adopted (running ranks)."""
        return self._pending is not None

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
        call = SpawnCall(self.comm, count, hosts, oversubscribe, faults.for_joiner(self.spawns))
        return self._start_join(call, count, started, generation, f"spawning {count} process(es)")

    def spawn_spare(self, hosts: Sequence[str] = ()) -> bool:
        """Start one process that waits as a hot spare (collective): it refills the
        pool once a spare was adopted (``--spares K --respawn``, see :mod:`.spares`).
        True if it is on its way; never in a job whose spares take a lost rank's
        number (a plain script's spares wait in ``init()`` for a claim on the world)."""
        if self._pending is not None or self.in_place:
            return False
        generation = self.comm.generation
        self.spawns += 1
        extra = {**faults.for_joiner(self.spawns), config.env("spawned_spare"): "1"}
        call = SpawnCall(self.comm, 1, hosts, None, extra)
        merged = self._agreed_merge(call, generation, "spawning a hot spare")
        if merged is None:
            return False
        key = SpareKey.spawned(self.spawns)
        self.channels[key] = merged
        self.pool.append(Spare(key, hosts[0] if hosts else ""))
        return True

    def _start_join(self, call: MergeCall, count: int, started: float, generation: int, what: str,
                    slot: int | None = None, spare: SpareKey | None = None) -> bool:
        """Wait for ``call`` (a :class:`.spawn.MergeCall`) and agree on its outcome:
        True with the join pending, or False with its communicators revoked."""
        merged = self._agreed_merge(call, generation, what)
        if merged is None:
            return False
        self._pending = _Pending(merged, count, generation, started, slot, spare)
        return True

    def _agreed_merge(self, call: MergeCall, generation: int, what: str) -> Any:
        """Wait for ``call`` and agree on its outcome: the merged communicator, or None
        with its communicators revoked (and rank 0 saying why)."""
        comm = self.comm
        merged, error = call.result()
        # Done on every rank, and nobody lost meanwhile (``merged`` would hold the dead)?
        if comm.agree(1 if merged is not None else 0) == 1 and comm.generation == generation:
            return merged
        if merged is not None:
            comm.revoke(merged)  # the joiners waiting on it give up
            comm.retire(merged)
        if error is not None and comm.rank == 0:
            why = error.Get_error_string() if isinstance(error, comm.MPI.Exception) else error
            _log.warning(f"elastic_hvd: {what} failed: {why}")
        return None

    def adopt_spare(self, avoid_hosts: Collection[str] = ()) -> bool:
        """Connect a ready hot spare (collective, at a step boundary): True if it is on
        its way (a join is pending, as after :meth:`spawn`).  The pool loses the
        spares any rank knows to have failed, and the spawned ones no live rank holds
        a channel to; the spare chosen is the first ready one on a host not in
        ``avoid_hosts`` (a lost rank's host: its loss may take the host's spares too),
        else the first ready one -- in an in-place job, the ready claimed spare of the
        lowest vacant slot.  See :mod:`.spares`."""
        if self._pending is not None or not self.pool:
            return False
        comm, MPI = self.comm, self.comm.MPI
        started, generation = time.perf_counter(), comm.generation
        failed: set[SpareKey] = set()
        if self.in_world:
            self._take_ready(MPI.COMM_WORLD)
            failed = _world_keys(spares.failed_ranks(MPI)) & {s.key for s in self.pool}
        for key, channel in self.channels.items():
            self._take_ready(channel, key)
            if channel.size - 1 in spares.failed_ranks(MPI, channel):
                failed.add(key)
        mine = _SpareNews(MPI.COMM_WORLD.rank if self.in_world else -1,
                          sorted(self._ready_spares.items()), sorted(failed), sorted(self.channels))
        with comm.labelled(JOIN_LABEL):  # a loss meanwhile is an event of its own (not
            everyone = comm.allgather_object(mine)  # folded: no join event would report it)
        if comm.generation != generation:
            return False
        failed = {key for news in everyone for key in news.failed}
        held = {key for news in everyone for key in news.held}
        ready = {key: slot for news in everyone for key, slot in news.ready}
        self.pool = [s for s in self.pool
                     if s.key not in failed and (s.key.in_world or s.key in held)]
        for key in set(self.channels) - {s.key for s in self.pool}:
            comm.retire(self.channels.pop(key))  # it failed
        worlds = [news.world_rank for news in everyone]
        slot: int | None
        spare: SpareKey | None
        if self.in_place:
            vacant = self.vacant_slots()
            claimed = sorted((ready[s.key], s.key) for s in self.pool if ready.get(s.key) in vacant)
            slot, spare = claimed[0] if claimed else (None, None)
        else:
            candidates = [s for s in self.pool if ready.get(s.key) == -1
                          and (not s.key.in_world or max(worlds) >= 0)]
            slot, spare = None, next((s.key for s in candidates if s.host not in avoid_hosts),
                                     candidates[0].key if candidates else None)
        if spare is None or (spare.in_world and max(worlds) < 0):
            return False
        if spare.in_world:  # the lowest training rank of the world sends the port
            root, channel, rank = worlds.index(min(w for w in worlds if w >= 0)), \
                MPI.COMM_WORLD, spare.number
        else:  # a rank that spawned it
            root = next(i for i, news in enumerate(everyone) if spare in news.held)
            channel = self.channels.get(spare)
            rank = channel.size - 1 if channel is not None else -1
        call = spares.AdoptCall(comm, root, rank, channel)
        # The spare stays in the pool until the join commits: a join given up once the
        # connect completed sends it back to waiting, ready for the next adoption (see
        # poll()).  Given up inside the connect (on any live rank), it is dropped and
        # told so: its connect never returns (see "called off" in spares).  A spawned
        # one is dropped either way: Open MPI's detector never finds a frozen spawned
        # process dead (docs/openmpi-quirks.md), so one whose adoption failed could cost
        # every later try the whole spawn timeout; its channel is revoked, which sends
        # it away.
        if self._start_join(call, 1, started, generation,
                            f"adopting the spare ({spare})", slot, spare):
            return True
        connected = comm.agree(1 if call.connected else 0) == 1
        if not connected:
            call.call_off()
            if call.timed_out:  # stopped or stuck: it may never leave by itself
                call.end_spare(dict(self.pool).get(spare), self._spare_ids.get(spare))
        if not spare.in_world or not connected:
            self.pool = [s for s in self.pool if s.key != spare]
        if not spare.in_world and (given_up := self.channels.pop(spare, None)) is not None:
            comm.revoke(given_up)
            comm.retire(given_up)
        return False

    def _take_ready(self, channel: Any, key: SpareKey | None = None) -> None:
        """Note the spares that said on ``channel`` that they are ready (``key``: the
        pool's key of the spawned spare it leads to; None: the world's, whose key is
        the sender's rank)."""
        MPI = self.comm.MPI
        while (message := spares.receive(MPI, channel, spares.READY, 24)) is not None:
            if message[1] is not None:  # a dead one is found failed by the caller
                slot, pid, start = (int(v) for v in np.frombuffer(message[1], "<i8"))
                sender = SpareKey.world(message[0]) if key is None else key
                self._ready_spares[sender] = slot
                self._spare_ids[sender] = signals.Identity(pid, start)

    def claim_spares(self) -> None:
        """Rank 0 of an in-place job, after each commit (local, no collective): give
        each vacant slot to a waiting spare (a :data:`.spares.CLAIM`), one preferably
        on another host than the slot's last holder; again if a claimed spare died
        before it was adopted.  The spare then starts the script as that rank (see
        :mod:`.spares`) and is adopted when ready (:meth:`adopt_spare`)."""
        comm = self.comm
        if not (self.in_place and self.in_world and self.pool) or self.joining or comm.rank != 0:
            return
        vacant = self.vacant_slots()
        if not vacant:  # the usual case: a few set operations per step
            self._claims.clear()
            return
        failed = _world_keys(spares.failed_ranks(comm.MPI))
        pool = {key: host for key, host in self.pool if key not in failed}
        self._claims = {key: c for key, c in self._claims.items()
                        if key in pool and c.slot in vacant}
        claimed = {c.slot for c in self._claims.values()}
        free = [Spare(key, host) for key, host in pool.items() if key not in self._claims]
        for slot in vacant:
            if slot in claimed or not free:
                continue
            last = [i for i, s in self.slots.items() if s == slot]
            lost_host = comm.host_of(max(last)) if last else None
            spare, host = next((p for p in free if p.host != lost_host), free[0])
            free.remove(Spare(spare, host))
            send = spares.claim(comm.MPI, spare.number, slot, comm.initial_size)
            if send is not None:
                self._claims[spare] = _Claim(slot, send)
                lost = announce.who(slot, max(last) if last else slot)
                _log.info(f"elastic_hvd: a hot spare ({spare}, {host}) takes the "
                          f"place of the lost {lost}: it starts the script as rank {slot} and "
                          "joins at the next epoch's start once ready, with the next free id")

    def release_spares(self) -> None:
        """At the job's end: the spares not adopted may go (world processes tell the
        world's, the ranks that spawned a spare tell it)."""
        if self.joining:
            return
        MPI = self.comm.MPI
        targets = ([(MPI.COMM_WORLD, s.key.number) for s in self.pool if s.key.in_world]
                   if self.in_world else [])
        targets += [(channel, channel.size - 1) for channel in self.channels.values()]
        if targets:
            spares.release(MPI, targets)

    def poll(self) -> MembershipEvent | None:
        """At a step boundary (collective while a join is pending): adopt the joiners
        if they are all ready; returns the growth event then, else None."""
        pending = self._pending
        if pending is None:
            return None
        comm, MPI = self.comm, self.comm.MPI
        ready = Readiness.BROKEN
        if comm.generation == pending.generation:
            local = pending.test(MPI)
            ready = Readiness(comm.run(("poll_join",), lambda c: _minimum(MPI, c, local)))
        if comm.generation != pending.generation or ready is Readiness.BROKEN:
            self.abandon(CHANGED if comm.generation != pending.generation else BROKE)
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
                       pending.merged.Split(0, self.slots.get(me, me)))
            adopted.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception:
            pass
        agreed = comm.agree(1 if adopted is not None else 0) == 1
        if not agreed or comm.generation != pending.generation:
            if adopted is not None:
                comm.revoke(adopted)
                comm.retire(adopted)
            self.abandon(CHANGED if comm.generation != pending.generation else BROKE)
            return None
        self._pending = None
        pending.end_hellos(MPI)
        self.pool = [s for s in self.pool if s.key != pending.spare]
        if pending.spare in self.channels:
            comm.retire(self.channels.pop(pending.spare))
        old_ids = list(comm.ids)
        next_id = cast(int, self.next_id)  # None only in a joiner, which never gets here
        new_ids = list(range(next_id, next_id + pending.count))
        self.next_id = next_id + pending.count
        ids = old_ids + new_ids
        if pending.slot is not None:  # MPI_Comm_split's order: by key, then by merged rank
            self.slots[new_ids[0]] = pending.slot
            ids = sorted(ids, key=lambda i: (self.slots.get(i, i), ids.index(i)))
        comm.retire(pending.merged)
        comm.replace(adopted, ids)
        book = {"comm": comm.book(), "ids": ids, "old": old_ids, "slots": self.slots,
                "next_id": self.next_id, "spawns": self.spawns, "pool": self.pool}
        try:  # a plain broadcast: a joiner must never wait in an agreement for ranks
            # that might still send it away (see join())
            adopted.bcast(book, root=_book_root(pending.slot))
        except MPI.Exception:
            pass  # whoever died is repaired in the next (resilient) exchange
        comm.settle(adopted)
        return self._welcome(old_ids, pending.started, pending.spawn_s)

    def abandon(self, why: Verdict | None = None) -> None:
        """Give up the pending join (local; its joiners exit, saying ``why``: :data:`ENDED`,
        :data:`CHANGED` or :data:`BROKE`).  In a process that has not joined: stop
        watching for the job's verdict (it is about to exit)."""
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
        return self._invitation.wait(lambda why: leave_unjoined(why, who=_SPARE))

    def await_claim(self) -> tuple[int, int]:
        """In a spare of an in-place job: ``(slot, size)`` once rank 0 claims it."""
        return self._invitation.await_claim(lambda why: leave_unjoined(why, who=_SPARE))

    def join(self, adoption: tuple[str, int] | None = None) -> MembershipEvent | None:
        """Joiner side: meet the running job and take over its bookkeeping; returns
        the growth event.  If the job gave up on this process (its ranks changed, or
        training ended first), a spawned process exits: nobody needs it; a spare
        (``adoption``: where the adopting ranks accept, and their root) returns None
        and waits again."""
        if not self.joining:
            raise ElasticHvdError("join(): this process is not joining a running job")
        comm, MPI = self.comm, self.comm.MPI
        started = time.perf_counter()
        merged = adopted = None
        try:
            merged = (self._invitation.accept() if adoption is None else
                      self._invitation.connect(*adoption))
            merged.Send(np.ones(1, dtype=np.int8), dest=0, tag=_READY)
            slot = self.replacing  # "adopted": the ranks committed to this join
            adopted = merged.Dup() if slot is None else merged.Split(0, slot)
            adopted.Set_errhandler(MPI.ERRORS_RETURN)
            book = adopted.bcast(None, root=_book_root(slot))
        except MPI.Exception as exc:
            broken = [c for c in (adopted, merged) if c is not None]
            if adoption is None:
                leave_unjoined(_GIVEN_UP, *broken)
            _log.warning(f"elastic_hvd: {_SPARE} waits again: an adoption broke off "
                         f"({exc.Get_error_string()})")
            for c in broken:
                comm.revoke(c)
                comm.retire(c)
            return None
        self._invitation.close()
        self._invitation = None
        comm.replace(adopted, book["ids"])  # retires the merged communicator
        comm.load_book(book["comm"])
        self.next_id, self.spawns, self.pool = book["next_id"], book["spawns"], book["pool"]
        self.slots = book["slots"]
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


def _world_keys(ranks: Iterable[int]) -> set[SpareKey]:
    """The pool keys of the world's spares of ``ranks`` (world ranks)."""
    return {SpareKey.world(r) for r in ranks}


_GIVEN_UP_BECAUSE = "the running job gave it up before adopting it: "
_GIVEN_UP = (_GIVEN_UP_BECAUSE + "training ended first, or the "
             "job's ranks changed while it started (another process is started for them then)")
_SPAWNED = "spawned to join the running job"
_SPARE = "a hot spare"
_leaving = threading.Lock()


def _end_stuck(main: threading.Thread, grace: float) -> None:
    """End a given-up process whose main thread did not stop within ``grace`` seconds,
    loudly: where its main thread is, then SIGKILL (see :class:`Invitation`)."""
    frame = sys._current_frames().get(main.ident)  # type: ignore[arg-type]  # started: an int
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
    # print, not logging: the main thread, stuck, may hold a handler's lock
    print(f"elastic_hvd: process {os.getpid()}, given up by the running job, did not exit within "
          f"{grace:.0f}s: its main thread is inside a call that does not return to Python; "
          f"ending it with SIGKILL.  Its main thread:\n{stack}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _leaving_line(why: str, who: str = _SPAWNED) -> str:
    return f"elastic_hvd: process {os.getpid()}, {who}, exits without joining: {why}"


def leave_unjoined(why: str, *comms: Any, finalize: bool = True,
                   who: str = _SPAWNED) -> NoReturn:
    """End a spawned process that will never join: one line that says why, then
    ``MPI_Finalize`` (after freeing ``comms``) and exit status 0.

    Never a bare ``os._exit(0)`` after ``MPI_Init``: mpirun takes a process that
    exits with status 0 without finalizing for an abnormal termination, prints a
    long notice and kills every process of the job, the running ranks included
    (docs/measurements.md).  ``finalize=False``
    is for a process stuck before its merge, which cannot finalize."""
    _leaving.acquire()  # once: the start-up watchdog's thread or the main thread
    # print, not logging: on the watchdog's thread the main thread may hold a handler's lock
    print(_leaving_line(why, who), file=sys.stderr, flush=True)
    if finalize:
        for comm in comms:
            with contextlib.suppress(Exception):
                comm.Free()
        heartbeat.stop()
        mpi_env.finalize(config.current().connected_finalize_deadline, lambda: os._exit(0))
    os._exit(0)


def _book_root(slot: int | None) -> int:
    """The rank of the adopted communicator that sends the book: its rank 0, unless a
    spare took slot 0 (rank 0's place): then the spare is rank 0, and the next one sends."""
    return 1 if slot == 0 else 0
