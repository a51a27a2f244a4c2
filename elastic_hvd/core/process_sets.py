"""Process sets that survive the loss of their members (framework-free; docs/process-sets.md).

A *process set* is a set of members named by their **original ids** (the rank a process
had at ``init()``, or the id it got when it joined: ``ResilientComm.ids``), never by rank
numbers, which change after every shrink.  Horovod's API names sets by global ranks: they
are translated to ids when a set is registered and back to the *current* ranks whenever
``ranks`` is read.  The global set (id 0) is every live rank, always.

Each set a process belongs to has its own MPI communicator, so collectives on disjoint
sets need no ordering between them (MPI matches messages per communicator).  A set's
communicator is made in two ways, both uniform over the processes that take part:

* **derived** from the global communicator (one ``MPI_Comm_split`` per set, inside one
  resilient transaction of the global communicator: :func:`derive`), when sets are
  registered (``init(process_sets=...)``, :func:`add`) and after every change of the
  global membership (a repair or a join that lost members: :func:`after_loss`).  A set none of
  whose members was lost keeps its communicator.
* **repaired** by the set's own members when a collective *on the set* meets a failure
  (:class:`SetComm`: revoke, ``MPI_Comm_shrink`` of the set's communicator, agree): the
  survivors of the set finish the collective among themselves at once, as the global
  set's do.  Non-members are not involved; they learn of the loss at the next repair
  of the global communicator, whose derivation then gives every process the same view.

Why a set repairs alone instead of pulling every rank into one global repair: the ranks
outside the set are elsewhere in their programs (in a collective of another set, or
computing), and a repair of the global communicator needs all of them; a rank of the set
that waits for them in the global shrink while another member of one of its other sets
waits for it in that set's agreement would never return (docs/process-sets.md, "Why a
set repairs itself").

Everything here is called with the resilient communicator (``comm``, which holds the
:class:`Registry` as ``comm.process_sets``) as an argument; it uses only its public
surface (``ids``, ``original_id``, ``size``, ``MPI``, ``run``, ``revoke``, ``settle``,
``retire``, ``in_mpi``, ``label``, ``anomalies``, ``mismatch_timeout``).  A set's
collectives run comm.py's transaction (:mod:`.transaction`) on the set's communicator.
"""

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

import numpy as np

from .collectives import CollectivesMixin
from .errors import ElasticHvdError
from .freshness import Stamps
from .signature import SignaturePredictor
from .transaction import TransactionMixin

#: The id of the global process set: every live rank.
GLOBAL_ID = 0

_T = TypeVar("_T")


class UnknownProcessSetError(ValueError):
    """A process set id that is not registered (never was, or was removed)."""

    def __init__(self, set_id: Any) -> None:
        super().__init__(f"Process set does not exist or has not been registered "
                         f"(process_set_id={set_id}).")


class NotInProcessSetError(ValueError):
    """This process is not a member of the set it called a collective (or rank()) on."""

    def __init__(self, set_id: int, ranks: Sequence[int], rank: int) -> None:
        super().__init__(f"Process is not part of provided process set: rank {rank} is not "
                         f"among process set {set_id}'s ranks {list(ranks)}.")


class DuplicateProcessSetError(ValueError):
    """A process set with the same members is registered already (Horovod's duplicate)."""


class EmptiedProcessSetError(ElasticHvdError):
    """Every member of the set has been lost: it can hold no collective any more."""

    def __init__(self, set_id: int, members: Sequence[int]) -> None:
        super().__init__(f"process set {set_id} is empty: every one of its members "
                         f"(original ranks {list(members)}) has been lost; remove it "
                         "(hvd.remove_process_set) or add a new one with live ranks")


@dataclasses.dataclass(frozen=True)
class SetEvent:
    """One change of a set's live members, as this process saw it: ``during`` is
    ``"set repair"`` (its own collective met the loss) or ``"global repair"`` (derived
    again after the global membership changed); ``repair_s``: a set repair's revoke +
    shrink + settle."""
    set_id: int
    old_size: int
    new_size: int
    lost: tuple[int, ...] = ()
    during: str = ""
    repair_s: float = 0.0
    wall_time: float = dataclasses.field(default_factory=time.time)


class _Entry:
    """A registered set as this process knows it."""

    def __init__(self, set_id: int, members: Iterable[int]) -> None:
        self.set_id = set_id
        #: Original ids, fixed at registration (what the set *is*).
        self.members: tuple[int, ...] = tuple(sorted(members))
        #: Members alive as the last derivation found them, in global rank order: the
        #: same on every process (all take part in every derivation).
        self.derived: tuple[int, ...] = ()
        #: Members alive as this process knows now: ``derived``, or less on a member whose
        #: set repaired itself since (the set's own collectives met a loss).
        self.live: tuple[int, ...] = ()
        #: This process's communicator of the set (None: not a member, or not derived yet).
        self.mpi_comm: Any = None
        #: Grows with every change of ``live`` (a step transaction compares it).
        self.generation = 0
        self.events: list[SetEvent] = []
        self.predictor = SignaturePredictor()
        self.stamps = Stamps()
        self.verify_next = False
        #: While an anomaly of the set's transaction is repaired (see comm.py's _anomaly).
        self.anomaly_deadline: Any = None

    def settle_on(self, mpi_comm: Any, live: Sequence[int], during: str,
                  repair_s: float = 0.0) -> None:
        """``mpi_comm`` (None for a non-member) is the set's communicator now, ``live``
        its members; record a change of ``live``."""
        live = tuple(live)
        if live != self.live and during != "registration":
            lost = tuple(i for i in self.live if i not in live)
            self.events.append(SetEvent(self.set_id, len(self.live), len(live), lost, during,
                                        repair_s))
            self.generation += 1
        self.mpi_comm, self.live = mpi_comm, live
        self.stamps.renew()


class Registry:
    """The registered process sets of this process (the same on every process: every
    registration and removal is a collective of all ranks) and their ids, allocated as
    Horovod's ProcessSetTable does: the lowest never used, or the oldest freed first."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._next_id = 1
        self._free: collections.deque[int] = collections.deque()

    # -- the table ----------------------------------------------------------------
    def set_ids(self) -> list[int]:
        """Every registered id, the global set's 0 first."""
        return [GLOBAL_ID, *sorted(self._entries)]

    def entry(self, set_id: Any) -> _Entry:
        """The registered non-global set ``set_id``; UnknownProcessSetError if none."""
        entry = self._entries.get(set_id) if isinstance(set_id, int) else None
        if entry is None:
            raise UnknownProcessSetError(set_id)
        return entry

    def find(self, members: Iterable[int]) -> int | None:
        """The id of the set with exactly these members (original ids), if any."""
        wanted = tuple(sorted(members))
        for set_id, entry in self._entries.items():
            if entry.members == wanted:
                return set_id
        return None

    def _allocate(self, members: Iterable[int]) -> _Entry:
        set_id = self._free.popleft() if self._free else self._next_id
        if set_id == self._next_id:
            self._next_id += 1
        entry = self._entries[set_id] = _Entry(set_id, members)
        return entry

    def _release(self, set_id: int) -> _Entry:
        entry = self._entries.pop(set_id)
        self._free.append(set_id)
        return entry

    # -- what a process asks about a set (no communication) -----------------------------
    def ranks(self, comm: Any, set_id: int) -> list[int]:
        """The current global ranks of the set's live members, ascending."""
        if set_id == GLOBAL_ID:
            return list(range(comm.size))
        position = {i: r for r, i in enumerate(comm.ids)}
        return sorted(position[i] for i in self.entry(set_id).live if i in position)

    def size(self, comm: Any, set_id: int) -> int:
        """How many live members the set has (0 once all are lost)."""
        return comm.size if set_id == GLOBAL_ID else len(self.entry(set_id).live)

    def included(self, comm: Any, set_id: int) -> bool:
        return set_id == GLOBAL_ID or comm.original_id in self.entry(set_id).live

    def rank(self, comm: Any, set_id: int) -> int:
        """This process's rank in the set (its position among the live members, in global
        rank order); NotInProcessSetError for a non-member."""
        if set_id == GLOBAL_ID:
            return comm.rank
        entry = self.entry(set_id)
        if comm.original_id not in entry.live:
            raise NotInProcessSetError(set_id, self.ranks(comm, set_id), comm.rank)
        return entry.live.index(comm.original_id)

    def ids_and_ranks(self, comm: Any) -> dict[int, list[int]]:
        """``{set id: current global ranks}`` (Horovod's ``_get_process_set_ids_and_ranks``)."""
        return {set_id: self.ranks(comm, set_id) for set_id in self.set_ids()}

    def events(self, set_id: int) -> list[SetEvent]:
        return list(self.entry(set_id).events)

    # -- hand-over to a process that joins --------------------------------------------
    def book(self) -> dict[str, Any]:
        """What a joining process takes over (picklable): the table, not communicators."""
        return {"sets": {i: (e.members, e.derived) for i, e in self._entries.items()},
                "next_id": self._next_id, "free": list(self._free)}

    def load_book(self, book: dict[str, Any]) -> None:
        self._entries = {}
        for set_id, (members, derived) in book["sets"].items():
            entry = self._entries[set_id] = _Entry(set_id, members)
            entry.derived = entry.live = tuple(derived)
        self._next_id, self._free = book["next_id"], collections.deque(book["free"])


# -- registration, removal and derivation: collectives of every live rank ---------------

def members_of(comm: Any, ranks: Iterable[Any]) -> tuple[int, ...]:
    """The original ids of current global ``ranks`` (checked as Horovod checks them);
    no ranks at all is the global set (Horovod's ``ProcessSet([])``)."""
    ranks = list(ranks)
    if not ranks:
        return tuple(sorted(comm.ids))
    if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) for r in ranks):
        raise ValueError(f"a process set is a list of process ranks (ints), not {ranks!r}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"a process set names a rank twice: {sorted(ranks)}")
    bad = [r for r in ranks if not 0 <= r < comm.size]
    if bad:
        raise ValueError(f"a process set names ranks {bad}, which do not exist "
                         f"(there are {comm.size} ranks)")
    return tuple(sorted(comm.ids[int(r)] for r in ranks))


def ranks_of_mpi_comm(comm: Any, mpi_comm: Any) -> tuple[int, ...]:
    """The current global ranks of the processes of an mpi4py communicator of the
    application's (Horovod's ``ProcessSet(comm)``): translated through its group."""
    MPI = comm.MPI
    group, ours = mpi_comm.Get_group(), comm.mpi_comm.Get_group()
    try:
        ranks = group.Translate_ranks(list(range(mpi_comm.size)), ours)
    finally:
        group.Free()
        ours.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("a process set's communicator holds processes that are not live "
                         "ranks of this job")
    return tuple(sorted(ranks))


def derive(comm: Any, registry: Registry, set_ids: Iterable[int] | None = None,
           during: str = "global repair") -> list[int]:
    """Make each set's communicator anew from the global one (a collective of every live
    rank): the sets ``set_ids``, or, when None, every set some of whose members the
    global membership lost since its last derivation.  Returns the ids derived.

    One resilient transaction of the global communicator holds every ``MPI_Comm_split``
    (ULFM reports a failure inside one to some ranks only: its agreement makes the
    outcome uniform, and a failure repairs the global communicator and derives again);
    each new communicator is settled (workarounds.TABLE 'settle') before any use, and
    every old one retired, never freed (mpi_env.retire)."""
    chosen = None if set_ids is None else sorted(set(set_ids))

    def attempt(mpi_comm: Any) -> tuple[list[int], list[tuple[int, ...]], list[Any]]:
        MPI = comm.MPI
        ids, me = comm.ids, comm.original_id
        wanted = chosen if chosen is not None else [
            set_id for set_id in sorted(registry._entries)
            if tuple(i for i in ids if i in registry._entries[set_id].members)
            != registry._entries[set_id].derived]
        lives, made = [], []
        try:
            for set_id in wanted:
                members = set(registry.entry(set_id).members)
                live = tuple(i for i in ids if i in members)
                color = 0 if me in live else MPI.UNDEFINED
                new = mpi_comm.Split(color, mpi_comm.rank)
                lives.append(live)
                made.append(None if new == MPI.COMM_NULL else new)
            for new in made:
                if new is not None:
                    new.Set_errhandler(MPI.ERRORS_RETURN)
                    comm.settle(new)
        except Exception:
            for new in made:
                if new is not None:
                    comm.retire(new)
            raise
        return wanted, lives, made

    wanted, lives, made = comm.run(None, attempt)
    for set_id, live, new in zip(wanted, lives, made):
        entry = registry.entry(set_id)
        if entry.mpi_comm is not None:
            comm.retire(entry.mpi_comm)
        entry.derived = live
        entry.settle_on(new, live, during)
    return wanted


def after_loss(comm: Any, registry: Registry, lost: Iterable[int]) -> None:
    """Derive again the sets that lost members, when a change of the global membership
    lost ``lost`` (original ids): called by ``ResilientComm.record`` on every process of
    the communicator, inside the repair (or the join) and before the change is announced,
    so a listener may use the sets at once; a failed derivation fails the repair.

    Decided from ``lost``, the same on every process: a change that lost no member of a
    set (a join, a loss outside every set) makes no collective, which a join needs (the
    joiners are in no set yet)."""
    lost = set(lost)
    if any(lost & set(entry.members) for entry in registry._entries.values()):
        derive(comm, registry)


def register(comm: Any, registry: Registry, specs: Sequence[Any]) -> list[int | None]:
    """Horovod's ``hvd.init(process_sets=...)``: register the sets of ``specs`` (each a
    list of global ranks, or an mpi4py communicator of the application's) on every rank,
    derive their communicators, and return each spec's id.

    A collective of every live rank.  As Horovod: sets given by communicators first (in
    the order of the list, each position's distinct sets in the order of their lowest
    rank), then sets given by ranks, in the order of the list (every rank must give the
    same ones, in any order of ranks within a set); a set registered already keeps its
    id.  A spec that repeats an earlier one of the list, or the global set, gets None
    (Horovod's invalidated duplicate): the caller raises ValueError once all are known.
    """
    mine: list[tuple[str, tuple[int, ...]]] = []
    for spec in specs:
        if hasattr(spec, "Get_group"):
            mine.append(("comm", ranks_of_mpi_comm(comm, spec)))
        else:
            mine.append(("ranks", tuple(sorted(int(r) for r in spec))))
    everyone = comm.run(None, lambda c: c.allgather(mine))
    by_comm = [[s for kind, s in specs if kind == "comm"] for specs in everyone]
    by_ranks = [[s for kind, s in specs if kind == "ranks"] for specs in everyone]
    if len({len(c) for c in by_comm}) > 1 or any(r != by_ranks[0] for r in by_ranks):
        raise ValueError("hvd.init(process_sets=...) needs the same process sets on every "
                         f"rank; ranks gave {[[list(s) for _, s in e] for e in everyone]}")
    order: list[tuple[int, ...]] = []
    for position in range(len(by_comm[0])):
        for ranks in sorted({c[position] for c in by_comm}):
            order.append(ranks)
    order.extend(by_ranks[0])
    fresh = []
    for ranks in order:
        members = members_of(comm, ranks)
        if set(members) == set(comm.ids) or registry.find(members) is not None:
            continue
        fresh.append(registry._allocate(members).set_id)
    if fresh:
        derive(comm, registry, fresh, during="registration")
    seen: set[int | None] = {GLOBAL_ID}
    result: list[int | None] = []
    for _, ranks in mine:
        members = members_of(comm, ranks)
        set_id = GLOBAL_ID if set(members) == set(comm.ids) else registry.find(members)
        result.append(None if set_id in seen else set_id)
        seen.add(set_id)
    return result


def _same_everywhere(comm: Any, what: str, value: Any, said: Any) -> None:
    """Raise ValueError on every rank unless every rank gave ``value`` alike (``said``:
    how this rank's argument is told in the error)."""
    values = comm.run(None, lambda c: c.allgather((value, said)))
    if any(v != values[0][0] for v, _ in values):
        raise ValueError(f"{what} must be called by every rank with the same arguments; "
                         f"ranks 0..{len(values) - 1} gave {[s for _, s in values]}")


def add(comm: Any, registry: Registry, ranks: Iterable[Any]) -> int:
    """Horovod's ``hvd.add_process_set(ranks)`` (dynamic sets): a collective of every
    live rank, which must all give the same ranks; returns the new set's id.
    DuplicateProcessSetError (a ValueError, as Horovod's) if it is registered already."""
    ranks = list(ranks)
    members = members_of(comm, ranks)
    _same_everywhere(comm, "hvd.add_process_set", members, sorted(int(r) for r in ranks))
    if set(members) == set(comm.ids) or registry.find(members) is not None:
        raise DuplicateProcessSetError(
            f"Attempted to add a duplicate process set: ranks {sorted(ranks)}")
    set_id = registry._allocate(members).set_id
    derive(comm, registry, [set_id], during="registration")
    return set_id


def remove(comm: Any, registry: Registry, set_id: int) -> bool:
    """Horovod's ``hvd.remove_process_set`` (dynamic sets): a collective of every live
    rank, which must all name the same set; False for the global set or an id that is
    not registered, as Horovod's.  The set's id becomes free for a later set."""
    _same_everywhere(comm, "hvd.remove_process_set", set_id, set_id)
    if set_id == GLOBAL_ID or set_id not in registry._entries:
        return False
    entry = registry._release(set_id)
    if entry.mpi_comm is not None:
        comm.retire(entry.mpi_comm)
    return True


# -- collectives on a set ------------------------------------------------------------------

class SetComm(TransactionMixin, CollectivesMixin):
    """The collectives of one process set on this process (a member), with
    ``ResilientComm``'s guarantees inside the set: every surviving member returns the
    same result or raises the same error, and a member lost inside a collective is
    repaired away by the set's survivors, who run it again among themselves.

    The transaction is comm.py's (:class:`.transaction.TransactionMixin`), run on the
    set's communicator with the set's own stamps, call history and repair (:meth:`repair`);
    the set's state lives in its registry entry, so every ``SetComm`` of a set shares it.
    ``ids``, ``rank`` and ``size`` are the set's (ranks *within* the set: a broadcast's
    ``root_rank`` here is a set rank; the TF layer translates Horovod's global one).
    ``retries`` counts the transactions this object ran again (after a repair of the set,
    or a slow path that found the members at different calls)."""

    def __init__(self, comm: Any, registry: Registry, set_id: int) -> None:
        self.comm, self.registry, self.set_id = comm, registry, set_id
        self.retries = 0

    # -- membership -----------------------------------------------------------------
    @property
    def MPI(self) -> Any:  # noqa: N802 -- the name the collectives read
        return self.comm.MPI

    def _entry(self) -> _Entry:
        entry = self.registry.entry(self.set_id)
        if not entry.live:
            raise EmptiedProcessSetError(self.set_id, entry.members)
        if self.comm.original_id not in entry.live or entry.mpi_comm is None:
            raise NotInProcessSetError(self.set_id, self.registry.ranks(self.comm, self.set_id),
                                       self.comm.rank)
        return entry

    @property
    def ids(self) -> tuple[int, ...]:
        return self._entry().live

    @property
    def rank(self) -> int:
        return self._entry().live.index(self.comm.original_id)

    @property
    def size(self) -> int:
        return len(self._entry().live)

    @property
    def generation(self) -> int:
        return self._entry().generation

    @property
    def mpi_comm(self) -> Any:
        return self._entry().mpi_comm

    # -- what the transaction reads (TransactionMixin) --------------------------------
    @property
    def _comm(self) -> Any:
        return self._entry().mpi_comm

    @property
    def _ids(self) -> tuple[int, ...]:
        return self._entry().live

    @property
    def _stamps(self) -> Stamps:
        return self._entry().stamps

    @property
    def _predictor(self) -> SignaturePredictor:
        return self._entry().predictor

    @property
    def _verify_next(self) -> bool:
        return self._entry().verify_next

    @_verify_next.setter
    def _verify_next(self, value: bool) -> None:
        self._entry().verify_next = value

    @property
    def _anomaly_deadline(self) -> Any:
        return self._entry().anomaly_deadline

    @_anomaly_deadline.setter
    def _anomaly_deadline(self, value: Any) -> None:
        self._entry().anomaly_deadline = value

    @property
    def original_id(self) -> int | None:
        return self.comm.original_id

    @property
    def label(self) -> str:
        return f"{self.comm.label or 'a collective'} on process set {self.set_id}"

    @property
    def mismatch_timeout(self) -> float:
        return self.comm.mismatch_timeout

    @property
    def anomalies(self) -> Any:
        return self.comm.anomalies

    @property
    def _failure_classes(self) -> tuple[int, ...]:
        return self.comm._failure_classes

    def revoke(self, mpi_comm: Any) -> None:
        self.comm.revoke(mpi_comm)

    def in_mpi(self) -> AbstractContextManager[None]:
        """The global communicator's (the progress loop paused; an interruption inside
        the protocol ends this process as a crash, which the other members repair)."""
        return cast(AbstractContextManager[None], self.comm.in_mpi())

    def _before_transaction(self, calls: Sequence[tuple[Any, Callable[[Any], Any]]]
                            ) -> list[Any] | None:
        self._entry()  # an emptied set, or a non-member: raised before any MPI
        return None

    def _transaction(self, calls: Sequence[tuple[Any, Callable[[Any], Any]]],
                     started: float, reached: list[int]) -> list[Any] | None:
        results = super()._transaction(calls, started, reached)
        if results is None:
            self.retries += 1
        return results

    def consistent(self, attempt: Callable[[], _T]) -> _T:
        """``attempt()`` (several collectives on this set) until it ran without a change
        of the set's members (see :func:`consistent` for a step over several sets)."""
        return consistent([self], attempt)

    # -- the set's own repair ---------------------------------------------------------
    def repair(self, started: float | None = None) -> None:
        """The set's own repair (its members only): revoke, shrink to the survivors,
        settle; a loss is recorded in the set's events and grows its generation (a
        repair that lost nobody makes the next call verified, as comm.py's does)."""
        entry = self._entry()
        MPI, old, old_live = self.MPI, entry.mpi_comm, entry.live
        begun = time.perf_counter()
        self.comm.revoke(old)
        try:
            new = old.Shrink()
        except MPI.Exception as exc:
            raise ElasticHvdError(f"cannot repair process set {self.set_id}: MPI_Comm_shrink "
                                  f"failed: {exc.Get_error_string()}") from exc
        new.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm.settle(new)
        positions = new.Get_group().Translate_ranks(list(range(new.size)), old.Get_group())
        self.comm.retire(old)
        live = [old_live[p] for p in positions]
        if len(live) == len(old_live):
            entry.verify_next = True
        entry.settle_on(new, live, "set repair", time.perf_counter() - begun)


def consistent(sets: Sequence[Any], attempt: Callable[[], _T]) -> _T:
    """The step transaction over several sets: ``attempt()`` again until it ran without a
    change of the members of any of ``sets`` (each a :class:`SetComm`, or the global
    ``ResilientComm``), so that all its results come from one membership of each set.
    A set that was not hit does not make the step run again."""
    def generations() -> list[int]:
        return [s.generation for s in sets]

    while True:
        seen = generations()
        result = attempt()
        if generations() == seen:
            return result
