"""Membership and repair of the resilient communicator: revoke, shrink to the
survivors, record and announce who was lost, make sure the lost are gone, and the
bookkeeping (hosts, pids, history) a joining process takes over.

Every method here is called on every live rank alike, from the agreed control flow
of :mod:`.comm`: a repair starts only once the ranks agreed that one is needed.
"""

import contextlib
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import announce, faults, mpi_env, process_sets, signals, workarounds
from .errors import ElasticHvdError, RanksBelowMinimumError
from .membership import Listeners, MembershipEvent
from ..log import get_logger

if TYPE_CHECKING:
    from .freshness import Stamps
    from .signature import SignaturePredictor

_log = get_logger(__name__)


class RepairMixin:
    """The membership and repair methods of :class:`~elastic_hvd.core.comm.ResilientComm`."""

    if TYPE_CHECKING:  # what ResilientComm provides: its state, the agreed transaction
        MPI: Any
        _comm: Any
        _ids: list[int]
        original_id: int | None
        initial_size: int
        min_np: int
        events: list[MembershipEvent]
        generation: int
        listeners: Listeners
        label: str
        _quiet: bool
        _procs: dict[int, tuple[str, signals.Identity]]
        _waiting: tuple[int, int] | None
        _below_min: RanksBelowMinimumError | None
        _verify_next: bool
        _stamps: Stamps
        _predictor: SignaturePredictor
        process_sets: process_sets.Registry

        def run(self, signature: Any, attempt: Callable[[Any], Any]) -> Any: ...

        def host_of(self, original_id: int) -> str | None: ...

        @property
        def rank(self) -> int: ...

        @property
        def size(self) -> int: ...

    def revoke(self, comm: Any) -> None:
        """Revoke an mpi4py communicator, so that every member blocked on it returns."""
        try:
            if not comm.Is_revoked():
                comm.Revoke()
        except self.MPI.Exception:
            pass

    def retire(self, comm: Any) -> None:
        """Be done with an mpi4py communicator without freeing it (see
        :func:`.mpi_env.retire`: a freed one makes later agreements unreliable)."""
        mpi_env.retire(comm)

    def settle(self, new: Any) -> None:
        """Wait until every live member of ``new``, a communicator just created, has
        finished activating it: call it on every member before anyone may revoke it.

        Open MPI 5.0.11 segfaults in a rank that receives a revoke for a communicator
        it is still activating (workarounds.TABLE 'settle').  A rank leaves an agreement
        only once every live member entered it; its outcome does not matter."""
        workarounds.used("settle")
        try:
            new.Agree(0)
        except self.MPI.Exception:
            pass

    def replace(self, new: Any, ids: Sequence[int]) -> None:
        """Make ``new`` (an mpi4py communicator) the live one, ``ids`` the original id
        of each of its ranks; the old one is retired."""
        old = self._comm
        self._comm, self._ids, self.original_id = new, list(ids), ids[new.rank]
        self._waiting = None
        self._stamps.renew()
        if old is not new:
            self.retire(old)

    def book(self) -> dict[str, Any]:
        """The bookkeeping a process that joins takes over (picklable): hosts and
        pids, membership history, sizes, the call history of :mod:`.signature`."""
        return {"procs": self._procs, "events": self.events, "generation": self.generation,
                "initial_size": self.initial_size,
                "min_np": self.min_np, "predictor": self._predictor.state(),
                "stamps": self._stamps.state(), "verify": self._verify_next,
                "process_sets": self.process_sets.book()}

    def load_book(self, book: Mapping[str, Any]) -> None:
        """Take over the :meth:`book` of the running ranks (in a process that joins)."""
        self._procs.update(book["procs"])
        self.events, self.generation = list(book["events"]), book["generation"]
        self.initial_size, self.min_np = book["initial_size"], book["min_np"]
        self._predictor.load_state(book["predictor"])
        self._stamps.load_state(book["stamps"])
        self._verify_next = book["verify"]
        self.process_sets.load_book(book["process_sets"])

    def meet(self, extra: Any = None) -> list[Any]:
        """Learn every live rank's host and identity (pid and start time: see
        :mod:`.signals`), with ``extra`` from each (a resilient collective); returns the
        ``extra`` of every rank, in rank order."""
        mine = (socket.gethostname(), signals.mine(), extra)
        everyone = self.run(None, lambda c: c.allgather(mine))
        self._procs.update((i, (host, who)) for i, (host, who, _) in zip(self._ids, everyone))
        return [e for *_, e in everyone]

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Collectives inside run under ``label`` (the ``during`` of a repair's event)."""
        saved, self.label = self.label, label
        try:
            yield
        finally:
            self.label = saved

    @contextlib.contextmanager
    def folded(self, label: str) -> Iterator[None]:
        """Collectives inside run under ``label``, and a repair inside records no event
        of its own: the caller must record one :meth:`record` for all of it, whose
        ``lost`` says who was lost meanwhile (a join's last step does).  Anywhere else a
        loss inside would go unreported: no announcement, no rescaled learning rate."""
        with self.labelled(label):
            self._quiet = True
            try:
                yield
            finally:
                self._quiet = False

    def record(self, event: MembershipEvent) -> None:
        """Append a membership event (the same on every rank) and announce it; raise
        :class:`RanksBelowMinimumError` on every rank if too few are left.

        Before the announcement, the process sets that lost members are derived again
        (:func:`.process_sets.after_loss`, a collective of every process here, joiners
        included): a listener may use them at once, and a derivation that fails fails
        the repair instead of being logged as a listener's error."""
        self.events.append(event)
        self.generation += 1
        if event.lost:
            process_sets.after_loss(self, self.process_sets, event.lost)
        try:
            self.listeners.notify(event)
        except Exception:  # a listener must not break the agreed control flow
            _log.error(f"elastic_hvd: a membership listener failed on rank {self.rank}:",
                       exc_info=True)
        if self.size < self.min_np:
            self._below_min = RanksBelowMinimumError(self.size, self.min_np,
                                                     [i for e in self.events for i in e.lost])
            raise self._below_min

    # -- repair -------------------------------------------------------------------
    def repair(self, started: float | None = None) -> None:
        """Revoke, shrink to the survivors, record and announce who was lost
        (collective; ``started``: when the failing call began, for the event)."""
        detected = time.perf_counter()
        old, old_ids = self._comm, self._ids
        self.revoke(old)
        new = self._shrink(old)
        positions = new.Get_group().Translate_ranks(list(range(new.size)), old.Get_group())
        repaired = time.perf_counter()
        self.replace(new, [old_ids[p] for p in positions])
        lost = tuple(sorted(set(old_ids) - set(self._ids)))
        if not lost:
            self._verify_next = True
            return
        self._fence(lost)
        if self._quiet:  # inside a join: reported in its event
            return
        self.record(MembershipEvent(
            old_size=len(old_ids), new_size=new.size, lost=lost,
            detect_s=detected - (started or detected), repair_s=repaired - detected,
            sequence=self.generation + 1, during=self.label))

    def _shrink(self, comm: Any) -> Any:
        """``comm.Shrink()``: the survivors, settled (see :meth:`settle`).  ULFM
        completes it uniformly despite failures; any other error is a broken MPI,
        said plainly."""
        try:
            new = comm.Shrink()
        except self.MPI.Exception as exc:
            raise ElasticHvdError(f"cannot repair the communicator: MPI_Comm_shrink failed on "
                                  f"{announce.who(None, self.original_id)}: "
                                  f"{exc.Get_error_string()}") from exc
        new.Set_errhandler(self.MPI.ERRORS_RETURN)
        faults.at_repair()
        self.settle(new)
        return new

    def _fence(self, lost: Iterable[int]) -> None:
        """Make sure evicted processes are gone (a hung rank must not come back).

        The lowest survivor on each host kills the lost processes of its host;
        that also lets ``mpirun`` exit once the survivors are done.  Only the process
        each one was (:func:`.signals.kill`): a lost rank long gone may have left its
        pid to any other process.
        """
        host = socket.gethostname()
        local = [i for i in self._ids if self.host_of(i) == host]
        if local and local[0] == self.original_id:
            for i in lost:
                lost_host, who = self._procs.get(i, (None, None))
                if lost_host == host and who is not None:
                    signals.kill(who, f"the lost {announce.who(None, i)}")
