"""Horovod's process-set API (``hvd.ProcessSet``, ``add_process_set``, ...) on the live
runtime's registry (:mod:`.process_sets`), framework-free: the TF layer and the torch layer
share it.  Apart from :mod:`.process_sets` because it reaches the runtime, which holds the
communicator, which holds the registry."""

import os
from collections.abc import Iterable, Sequence
from typing import Any, cast

from . import runtime
from .process_sets import (GLOBAL_ID, DuplicateProcessSetError, SetComm, UnknownProcessSetError,
                           add, register, remove)

#: Horovod's error when sets are added or removed without dynamic process sets.
_NOT_DYNAMIC = ("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow {} process sets after Horovod "
                "initialization.")


def _live_comm() -> Any:
    return runtime.current("a process set")


class ProcessSet:
    """Horovod's ``hvd.ProcessSet``: a set of ranks (or an mpi4py communicator's
    processes), registered by ``hvd.init(process_sets=...)`` or ``hvd.add_process_set``.

    ``process_set_id`` is None until registered (and after removal).  Once registered,
    ``ranks``, ``size()``, ``rank()`` and ``included()`` are read from the registry when
    asked: after a loss they are those of the set's survivors (docs/process-sets.md)."""

    process_set_id: int | None = None
    mpi_comm: Any = None
    _given: list[int] | None = None

    def __init__(self, ranks_or_comm: Any) -> None:
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks "
                             "or an mpi4py Comm object") from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks "
                             "or an mpi4py Comm object")
        self._given = ranks

    def _registered(self) -> int | None:
        """This set's id while it is registered on the live communicator, else None."""
        set_id = self.process_set_id
        if set_id is None:
            return None
        if set_id == GLOBAL_ID:
            return set_id
        try:
            if not runtime.is_initialized():
                return None
            _live_comm().process_sets.entry(set_id)
        except UnknownProcessSetError:
            return None
        return set_id

    @property
    def ranks(self) -> list[int] | None:
        """The current global ranks of the live members once registered, else as given."""
        set_id = self._registered()
        if set_id is None:
            return self._given
        comm = _live_comm()
        return comm.process_sets.ranks(comm, set_id)

    @ranks.setter
    def ranks(self, value: Iterable[int] | None) -> None:
        self._given = None if value is None else sorted(value)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        if self.process_set_id is None:
            return None
        comm = _live_comm()
        return comm.process_sets.size(comm, self.process_set_id)

    def rank(self) -> int | None:
        if self.process_set_id is None:
            return None
        comm = _live_comm()
        return comm.process_sets.rank(comm, self.process_set_id)

    def included(self) -> bool | None:
        if self.process_set_id is None:
            return None
        comm = _live_comm()
        return comm.process_sets.included(comm, self.process_set_id)

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


def _temp_process_set_object(process_set_id: int) -> ProcessSet:
    """Horovod's: a ProcessSet object for a known id."""
    ps = ProcessSet.__new__(ProcessSet)
    ps.process_set_id = process_set_id
    return ps


#: Horovod's ``hvd.global_process_set``: every live rank, always (id 0).
global_process_set = ProcessSet([])
global_process_set.process_set_id = GLOBAL_ID
global_process_set._given = None


def process_set_by_id(process_set_id: int) -> ProcessSet:
    return global_process_set if process_set_id == GLOBAL_ID else \
        _temp_process_set_object(process_set_id)


def init_process_sets(comm: Any, process_sets: Any, mpi_comm: Any = None) -> None:
    """Horovod's part of ``hvd.init(comm, process_sets=...)``: ``"dynamic"`` allows
    :func:`add_process_set` (``HOROVOD_DYNAMIC_PROCESS_SETS=1``); a list registers its
    sets (:func:`register`, a collective of every live rank) and gives each object its
    id, None for a duplicate (of an earlier entry, or of the global set): then
    ValueError, once every other set is registered, as Horovod.  ``mpi_comm``: the
    communicator given to ``init`` (``global_process_set.mpi_comm``)."""
    if hasattr(mpi_comm, "Get_group"):
        global_process_set.mpi_comm = mpi_comm
    if process_sets is None:
        return
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets: a list of ProcessSet, or 'dynamic', not "
                             f"{process_sets!r}")
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        return
    process_sets = list(process_sets)
    specs = [ps.mpi_comm if ps._given is None and ps.mpi_comm is not None else ps._given
             for ps in process_sets]
    ids = register(comm, comm.process_sets, specs)
    for ps, set_id in zip(process_sets, ids):
        ps.process_set_id = set_id
    for position, ps in enumerate(process_sets):
        if ps.process_set_id is None:
            raise ValueError(f"Horovod could not be initialized because process_sets entry "
                             f"number {position} is a duplicate: {ps}")


def _dynamic(what: str) -> None:
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").lower() in ("", "0", "false"):
        raise ValueError(_NOT_DYNAMIC.format(what))


def add_process_set(process_set: "ProcessSet | Sequence[int]") -> ProcessSet:
    """Horovod's ``hvd.add_process_set``: a collective of every live rank (all give the
    same ranks: :func:`add`); returns the registered ProcessSet."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set._given is None and process_set.mpi_comm is not None:
        raise NotImplementedError(
            "Dynamically adding process sets defined by an MPI communicator is not "
            "implemented. Please build the process set via a list of ranks.")
    _dynamic("adding")
    comm = _live_comm()
    try:
        process_set.process_set_id = add(comm, comm.process_sets, process_set._given or [])
    except DuplicateProcessSetError:
        raise DuplicateProcessSetError(
            f"Attempted to add a duplicate process set: {process_set}") from None
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Horovod's ``hvd.remove_process_set``: a collective of every live rank (:func:`remove`);
    False for an unregistered set or the global one; the object is invalidated."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == GLOBAL_ID:
        return False
    _dynamic("removing")
    process_set._invalidate()
    comm = _live_comm()
    return remove(comm, comm.process_sets, set_id)


def set_id_of(process_set: Any) -> int:
    """The registered id of ``process_set`` (a ProcessSet, or None: the global set);
    UnknownProcessSetError (a ValueError, as Horovod's) when it is not registered."""
    set_id = GLOBAL_ID if process_set is None else getattr(process_set, "process_set_id", None)
    if set_id != GLOBAL_ID:
        _live_comm().process_sets.entry(set_id)
    return cast(int, set_id)


def comm_of(comm: Any, set_id: int) -> Any:
    """What a collective on set ``set_id`` runs on: ``comm`` for the global set, else a
    :class:`SetComm` (EmptiedProcessSetError / NotInProcessSetError on its first use)."""
    return comm if set_id == GLOBAL_ID else SetComm(comm, comm.process_sets, set_id)
