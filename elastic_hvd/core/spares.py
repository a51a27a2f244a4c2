"""Hot spares: processes of mpirun's own job that wait, ready to train, outside the
training communicator, and replace a lost rank at the next step boundary.

Why spares beside spawning (:mod:`.spawn`): a spawned process starts Python,
imports TensorFlow and compiles its model after the loss -- seconds during which
the job runs short -- and it lives outside the job ``--with-ft ulfm`` covers.  A
spare is one of the ``-np`` processes: covered by ULFM, its detector and its
finalize like any rank, and already through its start-up when it is needed.

With ``ELASTIC_HVD_SPARES=K`` the last K ranks of ``MPI_COMM_WORLD`` are spares.
``init()`` splits the world (:func:`split_world`); a spare starts as a *joiner*
(:class:`SpareInvitation`) and runs its program up to the growth point, where it
tells the training ranks once that it is ready and waits, out of every collective,
for one of two messages:

* *adopt* (with a port name): it connects (``MPI_Comm_connect``; the training ranks
  accept, see :class:`AdoptCall`) and from there joins exactly as a spawned
  process does (:mod:`.growth`): the merged communicator, the ready message, the
  commit, the book, the live training state.
* *release*: training ended without needing it; it exits 0.
* *called off*: the training ranks gave its adoption up before the connect completed
  (one of them died inside ``MPI_Comm_accept``).  The spare's ``MPI_Comm_connect``
  then never returns, and a second adoption of it breaks the job (docs/openmpi-quirks.md,
  "a training rank that dies inside an adoption's accept").  So the ranks drop it
  from the pool, and the spare, told so (or finding the root dead), leaves: as a
  crash if still inside its connect, else cleanly.

A spare that waits connects within milliseconds of the *adopt*; the ranks give an
adoption up after ``ELASTIC_HVD_ADOPT_TIMEOUT`` (5 s), not the spawn's minute: a
stopped *spawned* spare is never found failed (Open MPI's detector does not watch
it), and would otherwise cost every rank that minute and linger to the end.  The
adoption's root kills such a spare when it runs on its host (its pid came with its
*ready*), as the repair's fence kills an evicted rank.

A plain Horovod-style script has no growth point (it shards its data by
``hvd.rank()`` before anything else and trains with ``model.fit``), so there a
spare waits *inside* ``init()`` (``ELASTIC_HVD_SPARES_WAIT``; ``auto`` reads the
script: ``elastic_hvd.growth_policy.main_has_growth_point``) for a third message:

* *claim* (a slot and the job's size): after a loss, rank 0 gives the lost rank's
  number (its *slot*) to one spare (:meth:`.growth.Growth.claim_spares`, no
  collective), a spare of the world or a spawned one (on its channel, below);
  ``init()`` returns with that rank and size, the script loads that rank's data and
  builds its model while the others train on, and the Keras layer joins it at the
  start of the next epoch (``elastic_hvd.tensorflow.keras.replacement``), in the lost
  rank's place in the rank order.

Why a port and not ``MPI_Intercomm_create`` over ``MPI_COMM_WORLD``: once a world
rank has died, Open MPI 5.0.11's ``MPI_Intercomm_create`` with the world as its
bridge fails with ``MPI_ERR_INTERN`` on every side; connect/accept works
(docs/openmpi-quirks.md).  The port name travels on the world from the lowest
training rank that is a world process (a spawned rank has another world).

Waiting costs nothing: one ``MPI_Iprobe`` every :data:`SPARE_POLL` seconds (a fraction
of a percent of a core: docs/measurements.md), while the heartbeat's native loop keeps
the detector fed.  A spare also leaves once every training rank of the world is gone: nobody could
adopt or release it then.

**A spawned process is a spare that arrives late** (:meth:`.growth.Growth.spawn_spare`).
With ``--spares K --respawn``, once a spare has replaced a lost rank, the training ranks
spawn one that waits as a spare, so that the next loss too costs a step, not a
start-up.  In a plain script's job, ``--respawn`` replaces a lost rank that way (the
growth policy's ``refill``, after each step): the spawned process waits in ``init()``
for a *claim* like a spare of the world, and is adopted at an epoch's start.  It has
a world of its own, so its messages (ready, adopt, claim, release) travel on the
communicator merged with the ranks that spawned it, its *channel*, instead of
``MPI_COMM_WORLD``; the pool names it by its spawn's number (:class:`SpareKey`).
Only the ranks that spawned it hold that channel: one of them sends it the port (rank
0, the claim), and once all of them are gone nobody can adopt it -- it leaves, and the
pool drops it.
"""

import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import numpy as np

from . import config, signals, timings, workarounds
from .comm_api import Communicator
from .mpi_env import end_as_crash, retire
from .spawn import MergeCall, connect_all
from .timings import BROKEN_GRACE, SPARE_POLL
from ..log import get_logger

_log = get_logger(__name__)

#: Tags on a spare's channel (``MPI_COMM_WORLD``, or a spawned spare's merged communicator):
#: its "ready" (the slot it takes, -1 for none, its pid and start time: see :mod:`.signals`),
#: the training ranks' "adopt", "release", "claim" (slot, size) and "called off" (an
#: adoption given up inside the connect).
READY, ADOPT, RELEASE, CLAIM, CALLED_OFF = 32001, 32002, 32003, 32004, 32005
@dataclass(frozen=True, order=True)
class SpareKey:
    """A spare's name in the pool, the same on every rank: a process of mpirun's job
    by its world rank, or a spawned spare by the number of the spawn that started it."""
    in_world: bool
    number: int

    @classmethod
    def world(cls, rank: int) -> "SpareKey":
        return cls(True, rank)

    @classmethod
    def spawned(cls, spawn: int) -> "SpareKey":
        return cls(False, spawn)

    def __str__(self) -> str:
        return f"world rank {self.number}" if self.in_world else f"spawned spare {self.number}"


class Spare(NamedTuple):
    """A spare of the pool, not adopted yet."""
    key: SpareKey
    host: str  # where it runs ("" when not known: a spawned one placed by Open MPI)


#: Why a spare leaves when its adoption was called off.
_CALLED_OFF_WHY = ("the training ranks gave its adoption up before its connect completed (one "
                   "of them died inside it, or it did not connect in time), and dropped it")


def split_world(MPI: Any, count: int) -> tuple[Any, list[tuple[int, str]], int]:
    """At ``init()`` with ``count`` spares (collective over the world): ``(the
    training ranks' communicator, or None in a spare; the spares' pool as
    [(world rank, host)]; the number of training ranks)``."""
    world = MPI.COMM_WORLD
    trainers = world.size - count
    if trainers < 1:
        raise ValueError(f"{config.env('spares')}={count} leaves no training rank among the "
                         f"{world.size} processes (start -np training ranks + spares)")
    hosts = world.allgather(socket.gethostname())
    spare = world.rank >= trainers
    part = world.Split(1 if spare else 0, world.rank)
    pool = [(w, hosts[w]) for w in range(trainers, world.size)]
    if spare:
        part.Set_errhandler(MPI.ERRORS_RETURN)
        return None, pool, trainers
    return part, pool, trainers


def receive(MPI: Any, comm: Any, tag: int, size: int = 1) -> tuple[int, bytes | None] | None:
    """A waiting message with ``tag`` from any source, taken off the queue
    (``MPI_Improbe`` + ``MPI_Mrecv``): ``(source, bytes)``, ``(source, None)`` if its
    sender failed before it could be read (ULFM fails such a receive; a plain probe
    would then match it for ever), or None when there is none.  ``size``: the
    length of a message whose length is not known.  A receive from any source on
    a communicator with a failure not yet acknowledged fails
    (``MPI_ERR_PROC_FAILED_PENDING``): acknowledge and look again."""
    status = MPI.Status()
    for _ in range(2):
        try:
            message = comm.Improbe(MPI.ANY_SOURCE, tag, status)
            break
        except MPI.Exception:
            comm.Ack_failed()
    else:
        return None
    if message is None:
        return None
    buffer = bytearray(max(size, status.Get_count(MPI.BYTE)))
    try:
        message.Recv(buffer)
    except MPI.Exception:
        return status.Get_source(), None
    return status.Get_source(), bytes(buffer[:status.Get_count(MPI.BYTE)])


def failed_ranks(MPI: Any, comm: Any = None) -> set[int]:
    """Ranks of ``comm`` (default ``MPI_COMM_WORLD``) this process knows to have
    failed (local).  A revoked ``comm`` counts as all failed but this process: nobody
    sends on it any more."""
    comm = MPI.COMM_WORLD if comm is None else comm
    MPI.COMM_SELF.Iprobe()  # progress: the runtime's news of a death arrives through it
    if comm.Is_revoked():
        return set(range(comm.size)) - {comm.rank}
    failed = comm.Get_failed()
    try:
        return set(failed.Translate_ranks(list(range(failed.Get_size())), comm.Get_group()))
    finally:
        failed.Free()


class SpareInvitation:
    """A spare's link to the training ranks until it joins (see the module doc).
    ``comm`` stands for the live communicator meanwhile; ``initial_size`` is the
    number of training ranks.  ``channel``: a spawned spare's communicator merged
    with the ranks that spawned it (they are its ranks 0..size-2); None for a spare
    of the world, whose ranks 0..``trainers``-1 train."""

    def __init__(self, MPI: Any, trainers: int, channel: Any = None) -> None:
        self.MPI, self.comm, self.initial_size = MPI, MPI.COMM_SELF, trainers
        #: A process of mpirun's own job (a spawned spare has a world of its own).
        self.in_world = channel is None
        self._channel = MPI.COMM_WORLD if channel is None else channel
        #: The lost rank's number this spare takes (a claimed spare), else None.
        self.slot: int | None = None
        self._sends: list[Any] | None = None

    def await_claim(self, leave: Callable[[str], NoReturn]) -> tuple[int, int]:
        """In ``init()`` of a plain script: until claimed; returns ``(slot, size)``.
        Calls ``leave(why)`` (never returns) as :meth:`wait` does."""
        while True:
            claim = self._look(leave, CLAIM, 8)
            if claim is not None:
                self.slot, size = (int(v) for v in np.frombuffer(claim[1], np.int32))
                return self.slot, size

    def wait(self, leave: Callable[[str], NoReturn]) -> tuple[str, int]:
        """Until adopted; returns the port name to connect to and the channel's rank
        of the training rank that sent it (the adoption's root).  Calls ``leave(why)``
        (which never returns) when released, called off, or when no training rank is
        left."""
        MPI, channel = self.MPI, self._channel
        if self._sends is None:  # once: a spare stays ready after a broken adoption
            self._sends = []
            ready = np.array([-1 if self.slot is None else self.slot, *signals.mine()], "<i8")
            for r in range(channel.size):  # trainers, and world spares adopted since (not
                if r == channel.rank:      # waiting ones: they never look at this tag)
                    continue
                try:
                    self._sends.append(channel.Isend(ready, r, READY))
                except MPI.Exception:
                    pass  # a rank that died
        while True:
            adopt = self._look(leave, ADOPT, 1)
            if adopt is not None:
                return adopt[1].decode(), adopt[0]

    def _look(self, leave: Callable[[str], NoReturn], tag: int,
              size: int) -> tuple[int, bytes] | None:
        """One look for a message with ``tag`` (its sender and bytes, or None after a
        pause); leaves when released, called off, or when no training rank is left."""
        MPI, channel = self.MPI, self._channel
        if receive(MPI, channel, RELEASE) is not None:
            leave("training ended without needing it")
        if receive(MPI, channel, CALLED_OFF) is not None:
            leave(_CALLED_OFF_WHY)
        message = receive(MPI, channel, tag, size)
        if message is not None and message[1] is not None:
            return message[0], message[1]
        if set(range(self.initial_size)) <= failed_ranks(MPI, channel):
            leave("every training rank of the job is gone" if self.in_world else
                  "every rank that spawned it is gone (no other can adopt it)")
        time.sleep(SPARE_POLL)
        return None

    def connect(self, port: str, root: int) -> Any:
        """The communicator merged with the training ranks that adopt this spare
        (``root``: the channel's rank of the one that sent ``port``)."""
        MPI = self.MPI
        connected = threading.Event()
        threading.Thread(target=_end_if_called_off, args=(MPI, self._channel, root, connected),
                         name="elastic_hvd-connect-watch", daemon=True).start()
        try:
            inter = MPI.COMM_SELF.Connect(port)
        finally:
            connected.set()
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        adopters = set(inter.Get_remote_group().Translate_ranks(
            list(range(inter.Get_remote_size())), self._channel.Get_group())) - {MPI.UNDEFINED}
        stop = threading.Event()
        threading.Thread(target=_leave_if_broken_off,
                         args=(MPI, inter, adopters, self._channel, stop),
                         name="elastic_hvd-merge-watch", daemon=True).start()
        try:
            merged = inter.Merge(high=True)
            merged.Set_errhandler(MPI.ERRORS_RETURN)
        finally:
            stop.set()
            retire(inter)
        connect_all(merged)
        return merged

    def close(self) -> None:
        """Done with the channel (joined, or leaving); nothing is watched (the
        interface of :class:`.invitation.Invitation`)."""
        if not self.in_world and self._channel is not None:
            retire(self._channel)
            self._channel = None


def _end_if_called_off(MPI: Any, channel: Any, root: int, connected: threading.Event) -> None:
    """While a spare is inside ``MPI_Comm_connect``: if the adoption's root died or the
    training ranks called the adoption off, the connect never returns -- the spare
    ends as a crash (see *called off* in the module doc)."""
    while not connected.wait(SPARE_POLL):
        try:
            off = channel.Iprobe(root, CALLED_OFF)
        except MPI.Exception:
            off = True  # the root failed (or the channel was revoked)
        if off and not connected.is_set():
            workarounds.used("merge_death_crash", "a hot spare's connect")
            end_as_crash("a hot spare: its adoption was given up while it was inside "
                         "MPI_Comm_connect (a training rank died inside the accept, or it "
                         "did not connect in time), after which the connect never returns; "
                         "the ranks dropped it")


def _leave_if_broken_off(MPI: Any, inter: Any, adopters: set[int], channel: Any,
                         stop: threading.Event) -> None:
    """While a spare merges with the ranks that adopt it: if one of them dies, or
    they give the adoption up (they revoke), Open MPI 5.0.11's merge never returns
    and no communicator can be made in this process any more (see
    :meth:`.spawn.MergeCall._end_if_broken`); the spare then leaves as a crash rather
    than spin in the merge for ever."""
    while not stop.wait(SPARE_POLL):
        if (adopters & failed_ranks(MPI, channel) or inter.Is_revoked()) \
                and not stop.wait(BROKEN_GRACE):
            workarounds.used("merge_death_crash", "a hot spare's merge")
            end_as_crash("a hot spare: its merge with the ranks that adopt it broke off (one "
                         "died, or they gave it up), after which Open MPI makes no new "
                         "communicator here")


class AdoptCall(MergeCall):
    """The training ranks' side of an adoption (collective): the live rank ``root``
    opens a port, sends its name to the spare and accepts; every rank merges.  The
    spare is rank ``spare`` of ``channel`` (the root's: ``MPI_COMM_WORLD`` for a
    spare of the world, the communicator merged with a spawned spare).  Given up,
    like a spawn, when a member or the spare fails, or after ``adopt_timeout``: a spare
    that waits connects within milliseconds, but a frozen *spawned* one is never found
    failed (Open MPI's detector does not watch it), so the spawn's minute would stall
    every rank."""

    _stuck_connect_breaks = True
    timeout_setting = "adopt_timeout"

    def __init__(self, comm: Communicator, root: int, spare: int, channel: Any) -> None:
        MPI = comm.MPI
        self._port: str | None
        unreachable: BaseException | None
        self._spare, self._channel, self._port, unreachable = spare, channel, None, None
        if comm.rank == root:
            self._port = MPI.Open_port()
            try:
                channel.Send(bytearray(self._port.encode()), spare, ADOPT)
            except MPI.Exception as exc:  # the spare died: fail the call (the others are
                unreachable = exc         # freed from the accept by the revoke that follows)

        def accept(dup: Any) -> Any:
            if unreachable is not None:
                raise unreachable
            return dup.Accept(self._port, root=root)
        super().__init__(comm, accept)

    @property
    def connected(self) -> bool:
        """Whether this rank's ``MPI_Comm_accept`` returned: the spare's connect did too."""
        return self._inter is not None

    def call_off(self) -> None:
        """In the root: tell the spare that its adoption was given up before the connect
        completed (see *called off* in the module doc).  One byte, sent eagerly; a dead
        spare is no error."""
        if self._port is not None:
            try:
                self._channel.Send(np.ones(1, np.int8), self._spare, CALLED_OFF)
            except self._owner.MPI.Exception:
                pass

    def end_spare(self, host: str | None, spare: signals.Identity | None) -> None:
        """In the root, once the adoption timed out before the spare connected: SIGKILL
        the ``spare`` (the process that said so when ready, on ``host``) if it runs on
        this host.  A stopped spare never leaves by itself, and Open MPI's detector never
        evicts a spawned one, so it would linger, and keep mpirun from ending, for ever
        (the fence of :mod:`.repair` does the same for an evicted rank)."""
        if self._port is None:
            return
        if spare is None or host != socket.gethostname():
            done = f"it runs on {host}, where this rank cannot end it"
        elif signals.kill(spare, "a hot spare whose adoption timed out"):
            done = f"killed it (pid {spare.pid})"
        else:
            done = f"it had ended (pid {spare.pid})"
        _log.warning(f"elastic_hvd: a hot spare did not connect within {self.timeout_s:.0f}s "
                     f"when adopted (stopped or stuck): the ranks dropped it; {done}")

    def _partner_failed(self) -> bool:
        # The root knows the spare's rank before the accept ends.
        return super()._partner_failed() or (
            self._port is not None
            and self._spare in failed_ranks(self._owner.MPI, self._channel))

    def result(self) -> tuple[Any, BaseException | str | None]:
        try:
            return super().result()
        finally:
            if self._port is not None:
                self._owner.MPI.Close_port(self._port)


def claim(MPI: Any, channel: Any, spare: int, slot: int, size: int) -> Any:
    """Give the lost rank's number ``slot`` of a job of ``size`` ranks to the waiting
    spare of rank ``spare`` on ``channel`` (a plain script's spare, waiting in
    ``init()``: on the world, or a spawned one's channel): the send's request (it keeps
    its buffer), or None if the spare is known dead.  Never waits for the spare."""
    try:
        return channel.Isend(np.array([slot, size], np.int32), spare, CLAIM)
    except MPI.Exception:
        return None


def release(MPI: Any, spares: Iterable[tuple[Any, int]],
            deadline: float = timings.SPARE_RELEASE_WAIT) -> None:
    """Tell every spare (``(channel, its rank there)``) that training ended (this
    process's part of the job's end); waits up to ``deadline`` seconds for the sends."""
    sends = []
    for channel, rank in spares:
        try:
            sends.append(channel.Isend(np.ones(1, np.int8), rank, RELEASE))
        except MPI.Exception:
            pass  # a spare that died
    end = time.monotonic() + deadline
    while sends and time.monotonic() < end:
        try:
            if MPI.Request.Testall(sends):
                return
        except MPI.Exception:
            return
        time.sleep(timings.SPARE_RELEASE_PAUSE)
