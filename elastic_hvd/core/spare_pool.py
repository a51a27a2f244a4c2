"""The pool of hot spares, the training ranks' side (the spares' own side is
:mod:`.spares`): which spares wait, the same on every rank; which one an adoption
takes; the claims of an in-place job's vacant slots; the release at the job's end.

The pool decides; :class:`.growth.Growth` runs the collectives around its decisions
(the exchange before an adoption, the join that adopts the spare).
"""

from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import signals, spares
from .comm_api import Communicator
from .spares import AdoptCall, Spare, SpareKey


class SpareNews(NamedTuple):
    """What one training rank knows of the pool before an adoption (allgathered)."""
    world_rank: int  # this rank's rank in MPI_COMM_WORLD, -1 in a spawned rank
    ready: list[tuple[SpareKey, int]]  # spares that said they are ready, the slot each takes
    failed: list[SpareKey]  # spares this rank knows to have failed
    held: list[SpareKey]  # spawned spares this rank holds a channel to


class Adoption(NamedTuple):
    """The spare an adoption takes, and the call that connects it."""
    call: AdoptCall
    spare: SpareKey
    slot: int | None  # the slot it takes in an in-place job, else None


class Claim(NamedTuple):
    """Rank 0's claim of a vacant slot for a waiting spare (an in-place job)."""
    slot: int
    send: Any  # the claim message's send request (it keeps its buffer)


class Claimed(NamedTuple):
    """A claim just sent, for the line that says it."""
    spare: Spare
    slot: int
    last_id: int  # the original id that held the slot last (the slot when not known)


class SparePool:
    """The spares of ``comm``'s job not adopted yet (:attr:`spares`) and the slots of
    an in-place job (:attr:`slots`), the same on every rank.

    ``world``: the spares of mpirun's job, ``[(world rank, host)]``; ``joining``: this
    process is not a member yet (it gets both in the join's book); ``in_world``: this
    process is one of mpirun's job (a spawned one has a world of its own);
    ``in_place``: the job's spares take a lost rank's number (its *slot*: the rank a
    plain script believes it has, see :mod:`.spares`).
    """

    def __init__(self, comm: Communicator, world: Iterable[tuple[int, str]] = (), *,
                 joining: bool = False, in_world: bool = True, in_place: bool = False) -> None:
        self.comm, self.in_world, self.in_place = comm, in_world, in_place
        #: The spares not adopted yet, spawned ones included.
        self.spares = [Spare(SpareKey.world(w), host) for w, host in world]
        #: Original id -> slot, the same on every rank (a joiner gets it in the book).
        self.slots: dict[int, int]
        self.slots = {} if joining else {i: i for i in range(comm.initial_size)}
        #: Spawned spares this rank spawned: key -> the communicator merged with it.
        self.channels: dict[SpareKey, Any] = {}
        #: Spares that told this rank they are ready -> the slot each takes (-1: none) ...
        self._ready: dict[SpareKey, int] = {}
        self._ids: dict[SpareKey, signals.Identity] = {}  # ... -> who (see not_adopted)
        self._claims: dict[SpareKey, Claim] = {}  # rank 0 of an in-place job

    def vacant_slots(self) -> list[int]:
        """Slots of the starting ranks that no live rank holds (in-place jobs)."""
        taken = {self.slots.get(i, i) for i in self.comm.ids}
        return sorted(set(range(self.comm.initial_size)) - taken)

    def add_spawned(self, key: SpareKey, channel: Any, host: str) -> None:
        """A spawned spare joins the pool (``channel``: the communicator merged with it)."""
        self.channels[key] = channel
        self.spares.append(Spare(key, host))

    # -- an adoption ------------------------------------------------------------------
    def news(self) -> SpareNews:
        """What this rank knows of the pool now (local), for :meth:`choose`."""
        MPI = self.comm.MPI
        failed: set[SpareKey] = set()
        if self.in_world:
            self._take_ready(MPI.COMM_WORLD)
            failed = _world_keys(spares.failed_ranks(MPI)) & {s.key for s in self.spares}
        for key, channel in self.channels.items():
            self._take_ready(channel, key)
            if channel.size - 1 in spares.failed_ranks(MPI, channel):
                failed.add(key)
        return SpareNews(MPI.COMM_WORLD.rank if self.in_world else -1,
                         sorted(self._ready.items()), sorted(failed), sorted(self.channels))

    def choose(self, everyone: Sequence[SpareNews],
               avoid_hosts: Collection[str] = ()) -> Adoption | None:
        """From every rank's :meth:`news` (the same on every rank): drop the spares any
        rank knows to have failed, and the spawned ones no live rank holds a channel to;
        then the adoption of the first ready spare on a host not in ``avoid_hosts`` (a
        lost rank's host: its loss may take the host's spares too), else of the first
        ready one -- in an in-place job, of the ready claimed spare of the lowest vacant
        slot.  None when no spare can be adopted now."""
        comm, MPI = self.comm, self.comm.MPI
        failed = {key for news in everyone for key in news.failed}
        held = {key for news in everyone for key in news.held}
        ready = {key: slot for news in everyone for key, slot in news.ready}
        self.spares = [s for s in self.spares
                       if s.key not in failed and (s.key.in_world or s.key in held)]
        for key in set(self.channels) - {s.key for s in self.spares}:
            comm.retire(self.channels.pop(key))  # it failed
        worlds = [news.world_rank for news in everyone]
        slot: int | None
        spare: SpareKey | None
        if self.in_place:
            vacant = self.vacant_slots()
            claimed = sorted((ready[s.key], s.key) for s in self.spares
                             if ready.get(s.key) in vacant)
            slot, spare = claimed[0] if claimed else (None, None)
        else:
            candidates = [s for s in self.spares if ready.get(s.key) == -1
                          and (not s.key.in_world or max(worlds) >= 0)]
            slot, spare = None, next((s.key for s in candidates if s.host not in avoid_hosts),
                                     candidates[0].key if candidates else None)
        if spare is None or (spare.in_world and max(worlds) < 0):
            return None
        if spare.in_world:  # the lowest training rank of the world sends the port
            root, channel, rank = worlds.index(min(w for w in worlds if w >= 0)), \
                MPI.COMM_WORLD, spare.number
        else:  # a rank that spawned it
            root = next(i for i, news in enumerate(everyone) if spare in news.held)
            channel = self.channels.get(spare)
            rank = channel.size - 1 if channel is not None else -1
        return Adoption(AdoptCall(comm, root, rank, channel), spare, slot)

    def not_adopted(self, adoption: Adoption) -> None:
        """After an adoption that did not start (collective): agree whether the spare
        connected; if not, call it off (and end it if it timed out: stopped or stuck,
        it may never leave by itself).

        The spare stays in the pool until the join commits: a join given up once the
        connect completed sends it back to waiting, ready for the next adoption.  Given
        up inside the connect (on any live rank), it is dropped and told so: its connect
        never returns (see "called off" in :mod:`.spares`).  A spawned one is dropped
        either way: Open MPI's detector never finds a frozen spawned process dead
        (docs/openmpi-quirks.md), so one whose adoption failed could cost every later
        try the whole spawn timeout; its channel is revoked, which sends it away."""
        comm, call, spare = self.comm, adoption.call, adoption.spare
        connected = comm.agree(1 if call.connected else 0) == 1
        if not connected:
            call.call_off()
            if call.timed_out:
                call.end_spare(dict(self.spares).get(spare), self._ids.get(spare))
        if not spare.in_world or not connected:
            self.spares = [s for s in self.spares if s.key != spare]
        if not spare.in_world and (given_up := self.channels.pop(spare, None)) is not None:
            comm.revoke(given_up)
            comm.retire(given_up)

    def adopted(self, spare: SpareKey | None) -> None:
        """A join committed: ``spare`` (None: the joiners were spawned) leaves the pool."""
        self.spares = [s for s in self.spares if s.key != spare]
        if spare in self.channels:
            self.comm.retire(self.channels.pop(spare))

    def _take_ready(self, channel: Any, key: SpareKey | None = None) -> None:
        """Note the spares that said on ``channel`` that they are ready (``key``: the
        pool's key of the spawned spare it leads to; None: the world's, whose key is
        the sender's rank)."""
        MPI = self.comm.MPI
        while (message := spares.receive(MPI, channel, spares.READY, 24)) is not None:
            if message[1] is not None:  # a dead one is found failed by the caller
                slot, pid, start = (int(v) for v in np.frombuffer(message[1], "<i8"))
                sender = SpareKey.world(message[0]) if key is None else key
                self._ready[sender] = slot
                self._ids[sender] = signals.Identity(pid, start)

    # -- in-place jobs, the job's end -----------------------------------------------------
    def claim(self) -> list[Claimed]:
        """Rank 0 of an in-place job, after each commit (local, no collective): give
        each vacant slot to a waiting spare (a :data:`.spares.CLAIM`), one preferably
        on another host than the slot's last holder; again if a claimed spare died
        before it was adopted.  Returns the claims sent now."""
        comm = self.comm
        if not (self.in_place and self.spares) or comm.rank != 0:
            return []
        vacant = self.vacant_slots()
        if not vacant:  # the usual case: a few set operations per step
            self._claims.clear()
            return []
        pool = {key: host for key, host in self.spares if self._reachable(key)}
        self._claims = {key: c for key, c in self._claims.items()
                        if key in pool and c.slot in vacant}
        claimed = {c.slot for c in self._claims.values()}
        free = [Spare(key, host) for key, host in pool.items() if key not in self._claims]
        sent = []
        for slot in vacant:
            if slot in claimed or not free:
                continue
            last = [i for i, s in self.slots.items() if s == slot]
            lost_host = comm.host_of(max(last)) if last else None
            chosen = next((p for p in free if p.host != lost_host), free[0])
            free.remove(chosen)
            send = spares.claim(comm.MPI, *self._address(chosen.key), slot, comm.initial_size)
            if send is not None:
                self._claims[chosen.key] = Claim(slot, send)
                sent.append(Claimed(chosen, slot, max(last) if last else slot))
        return sent

    def _address(self, key: SpareKey) -> tuple[Any, int]:
        """(channel, rank there) of a spare: the world's, or a spawned one's own channel."""
        if key.in_world:
            return self.comm.MPI.COMM_WORLD, key.number
        channel = self.channels[key]
        return channel, channel.size - 1

    def _reachable(self, key: SpareKey) -> bool:
        """Whether this rank can send to the spare ``key`` (local): a world spare from a
        world process, a spawned one from a rank that spawned it; not known to have failed."""
        if key.in_world and not self.in_world or not key.in_world and key not in self.channels:
            return False
        channel, rank = self._address(key)
        return rank not in spares.failed_ranks(self.comm.MPI, channel)

    def release(self) -> None:
        """At the job's end: the spares not adopted may go (world processes tell the
        world's, the ranks that spawned a spare tell it)."""
        MPI = self.comm.MPI
        targets = ([(MPI.COMM_WORLD, s.key.number) for s in self.spares if s.key.in_world]
                   if self.in_world else [])
        targets += [(channel, channel.size - 1) for channel in self.channels.values()]
        if targets:
            spares.release(MPI, targets)


def _world_keys(ranks: Iterable[int]) -> set[SpareKey]:
    """The pool keys of the world's spares of ``ranks`` (world ranks)."""
    return {SpareKey.world(r) for r in ranks}
