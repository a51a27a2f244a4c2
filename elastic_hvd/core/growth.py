"""Growing a running job: new processes join the live communicator in place.

Shrinking keeps a job alive; growing gives it back its speed.  A join has two
halves so that the ranks already training never wait for a new process to
start Python and import TensorFlow:

1. **Spawn** (every live rank together, at a step boundary): ``MPI_Comm_spawn`` of
   ``python -m elastic_hvd.runner.join <the same program>``, whose first act is
   ``MPI_Init`` and an intercommunicator merge, so this costs about one Python
   start-up (~1 s).  The spawn's outcome is agreed like any collective; a
   failure during it is repaired and the spawn is simply tried again later.
   The ranks then train on while the joiners load their program.
2. **Adopt**: once per step while a join is pending, one agreed ``allreduce``
   asks whether every joiner has reached :meth:`GrowthMixin.join` (a non-blocking
   barrier on the merged communicator).  When they all have, the merged
   communicator becomes the live one -- old ranks first, in their order, joiners
   after them, so ranks stay stable -- and the bookkeeping (original ids, hosts,
   membership history, the call history of :mod:`.signature`) is handed over with
   resilient collectives.  One ``gained`` :class:`MembershipEvent` follows.

If the live ranks change while a join is pending, the join is abandoned (the
merged communicator is revoked, so the joiners exit) and a new one is spawned
for the new deficit.  Training state (weights, data position...) is the Keras
layer's business: see ``keras_callbacks.growth``.
"""

import base64
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time

import numpy as np

from . import config, faults
from .errors import ElasticHvdError, RanksBelowMinimumError
from .membership import MembershipEvent

#: ``ResilientComm.label`` while a join's bookkeeping is exchanged.
JOIN_LABEL = "ElasticJoin"


def spawn_timeout():
    """Seconds the running ranks wait for a spawn (start, MPI_Init, merge) before they
    give it up (``config.spawn_timeout``, 60; normally it takes ~1.5 s)."""
    return config.current().spawn_timeout


class _Join:
    """A spawn whose joiners have not been adopted yet (parents' side)."""

    def __init__(self, merged, barrier, count, events, started):
        self.merged, self.barrier, self.count, self.events = merged, barrier, count, events
        self.started = started
        self.spawn_s = time.perf_counter() - started


_merged = None


def merge_with_parent(MPI):
    """Joiner side, once: the communicator merged with the ranks that spawned this
    process (None if nobody did).  Called as early as possible: they wait for it."""
    global _merged
    if _merged is not None:
        return _merged
    intercomm = MPI.Comm.Get_parent()
    if intercomm == MPI.COMM_NULL:
        return None
    intercomm.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        merged = intercomm.Merge(high=True)
    except MPI.Exception as exc:  # the parents abandoned this spawn
        _give_up(f"merge failed ({exc.Get_error_string()})")
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        _connect_all(merged)
    except MPI.Exception as exc:
        _give_up(f"could not reach the running job ({exc.Get_error_string()})")
    intercomm.Free()
    _merged = merged
    return merged


@contextlib.contextmanager
def start_up_deadline():
    """A spawned process that is not merged in time exits: by then its spawners gave
    it up (after :func:`spawn_timeout`), and mpirun would wait for it for ever.

    ``MPI_Init`` runs while the interpreter lock is held, so a watchdog thread
    cannot act if it hangs there (seen once in about ten runs of the test suite);
    ``SIGALRM``, whose default action ends the process, can."""
    seconds = 2 * spawn_timeout() + 10
    watchdog = threading.Timer(seconds, _give_up, ("it was not merged with the running job "
                                                   f"within {seconds:.0f}s",))
    watchdog.daemon = True
    watchdog.start()
    signal.alarm(int(seconds) + 5)
    try:
        yield
    finally:
        signal.alarm(0)
        watchdog.cancel()


def _connect_all(merged):
    """Open a connection between every pair of the merged processes, now, while
    they are all alive.  Open MPI connects lazily, and its first contact with a
    process of another job that has died since blocks for ever (in PMIx_Get of
    the peer's address), freezing the progress engine of the whole rank."""
    merged.Alltoall(np.zeros(merged.size, dtype=np.int8), np.empty(merged.size, dtype=np.int8))


def _give_up(why):
    print(f"elastic_hvd: joining process {os.getpid()} exits: {why}", file=sys.stderr, flush=True)
    os._exit(0)


def program_argv():
    """The command line that started this program, for joiners to run it too."""
    saved = os.environ.get("ELASTIC_HVD_PROGRAM")
    if saved:
        return json.loads(saved)
    argv = list(sys.orig_argv[1:])
    while argv and argv[0].startswith("-") and argv[0] != "-m":
        argv.pop(0)  # interpreter options (-u, -O...)
    return argv


#: Variables of the MPI runtime: they describe the spawning process, not a joiner.
RUNTIME_PREFIXES = ("PMIX", "PRTE", "OMPI_")


def joiner_command(extra_env=None):
    """(executable, args) to spawn: the join wrapper around this program, carrying
    this process's environment (spawned processes get mpirun's, not ours)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(RUNTIME_PREFIXES)}
    environ.update(extra_env or {})
    env = base64.b64encode(json.dumps(environ).encode()).decode()
    return sys.executable, ["-m", "elastic_hvd.runner.join", env, *program_argv()]


class _SpawnCall:
    """One spawn (``MPI_Comm_spawn`` + merge + connect), in a thread of its own on a
    duplicate of the live communicator, so that the running ranks can give it up.

    A new process that never completes ``MPI_Init`` (seen here: one stuck in it;
    one that dies before it) leaves ``MPI_Comm_spawn`` blocked for ever in the
    spawning root.  After the timeout every rank revokes the duplicate, which frees
    the ranks waiting for the root, and goes on; the root's thread stays behind
    (measured: a later spawn, from a new duplicate, works).
    """

    def __init__(self, owner, executable, args, count, info):
        self._owner, self._lock, self._done = owner, threading.Lock(), threading.Event()
        self._given_up, self._made = False, []  # communicators to revoke if given up
        self.merged = self.error = None
        try:
            self._comm = owner._comm.Dup()
        except owner.MPI.Exception as exc:  # e.g. a rank died just now
            self.error = exc
            info.Free()
            self._done.set()
            return
        self._keep(self._comm)
        threading.Thread(target=self._run, args=(executable, args, count, info),
                         name="elastic_hvd-spawn", daemon=True).start()

    def _keep(self, comm):
        comm.Set_errhandler(self._owner.MPI.ERRORS_RETURN)
        with self._lock:
            self._made.append(comm)
            if self._given_up:
                self._owner._revoke(comm)

    def _run(self, executable, args, count, info):
        owner = self._owner
        inter = merged = None
        try:
            inter = self._comm.Spawn(executable, args, maxprocs=count, info=info, root=0)
            self._keep(inter)
            faults.at_spawn()
            merged = inter.Merge(high=False)
            self._keep(merged)
            _connect_all(merged)
        except Exception as exc:  # noqa: BLE001 - any failure: the spawn did not happen
            self.error = exc
            owner._revoke(self._comm)  # free the ranks still inside the spawn
        finally:
            info.Free()
        with self._lock:
            if self.error is None and not self._given_up:
                self.merged, merged = merged, None  # handed over
            elif merged is not None:
                owner._revoke(merged)  # its joiner gives up
            self._done.set()
        for comm in (merged, inter, self._comm):
            if comm is not None:
                owner._free(comm)

    def result(self, timeout):
        """``(merged communicator, None)``, or ``(None, why)`` if the spawn failed here
        or did not finish within ``timeout`` seconds."""
        self._done.wait(timeout)
        with self._lock:
            if not self._done.is_set():
                self._given_up = True
                for comm in self._made:
                    self._owner._revoke(comm)
                return None, f"not done after {timeout:.0f}s (ELASTIC_HVD_SPAWN_TIMEOUT)"
        return self.merged, self.error


class GrowthMixin:
    """Spawn/adopt (old ranks) and join (new ranks) for :class:`ResilientComm`."""

    # -- old ranks ------------------------------------------------------------------
    @property
    def join_pending(self):
        return self._join is not None

    def spawn(self, count, hosts=(), oversubscribe=None):
        """Start ``count`` joiners (collective); True if they are on their way.

        ``hosts``: host names to place them on (default: Open MPI's choice).  A
        failure during the spawn is repaired as in any collective and the spawn
        reported as not done (False), to be retried later.
        """
        if self._join is not None or count <= 0:
            return False
        MPI = self.MPI
        started = time.perf_counter()
        comm = self._comm
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())
        if hosts:
            info.Set("host", ",".join(hosts))
        if oversubscribe if oversubscribe is not None else config.current().oversubscribe:
            info.Set("map_by", ":OVERSUBSCRIBE")
        self._spawns += 1
        executable, args = joiner_command(faults.for_joiner(self._spawns))
        merged, error = _SpawnCall(self, executable, args, count, info).result(spawn_timeout())
        agreed = self._agree(comm, 1 if merged is not None else 0)
        if agreed == 1:
            self._join = _Join(merged, merged.Ibarrier(), count, len(self.events), started)
            return True
        if merged is not None:
            self._revoke(merged)  # the joiners waiting on it give up
        if agreed is None or comm.Is_revoked():
            self._repair(started)
        if error is not None and self.rank == 0:
            why = error.Get_error_string() if isinstance(error, MPI.Exception) else error
            print(f"elastic_hvd: spawning {count} process(es) failed: {why}",
                  file=sys.stderr, flush=True)
        return False

    def poll_join(self):
        """At a step boundary (collective while a join is pending): adopt the joiners
        if they are all ready; returns the growth event then, else None."""
        join = self._join
        if join is None:
            return None
        MPI = self.MPI
        ready = -1
        if len(self.events) == join.events:
            try:
                local = 1 if join.barrier.Test() else 0
            except MPI.Exception:
                local = -1
            ready = self.run(("poll_join",), lambda c: c.allreduce(local, op=MPI.MIN))
        if len(self.events) != join.events or ready < 0:
            self.abandon_join()
            return None
        if ready == 0:
            return None
        # Commit: a fresh communicator that the joiners also create.  Until it
        # exists a joiner may still be told to go (a revoked merged communicator).
        started = time.perf_counter()
        adopted = None
        try:
            adopted = join.merged.Dup()
            adopted.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception:
            pass
        agreed = self._agree(self._comm, 1 if adopted is not None else 0)
        if agreed != 1:
            if adopted is not None:
                self._revoke(adopted)
            self.abandon_join()
            if agreed is None:
                self._repair(started)
            return None
        self._join = None
        self._free(join.merged)
        old, old_ids = self._comm, self._ids
        new_ids = list(range(self._next_id, self._next_id + join.count))
        self._comm, self._ids = adopted, old_ids + new_ids
        self._next_id += join.count
        self._free(old)
        book = {"ids": self._ids, "old": old_ids, "procs": self._procs, "events": self.events,
                "initial_size": self.initial_size, "next_id": self._next_id,
                "min_np": self.min_np, "predictor": self._predictor.state(),
                "spawns": self._spawns}
        try:  # a plain broadcast: a joiner must never wait in an agreement for ranks
            adopted.bcast(book, root=0)  # that might still send it away (see join())
        except MPI.Exception:
            pass  # whoever died is repaired in the next (resilient) exchange
        return self._welcome(old_ids, join.started, join.spawn_s)

    def abandon_join(self):
        """Give up the pending join (local; its joiners exit)."""
        join, self._join = self._join, None
        if join is not None:
            self._revoke(join.merged)
            self._free(join.merged)

    # -- new ranks ------------------------------------------------------------------
    @contextlib.contextmanager
    def rehearsal(self):
        """Collectives inside run on this process alone (``COMM_SELF``).

        A joining process runs one throw-away training step in a rehearsal, so
        that it compiles its training function *before* it joins: otherwise the
        running ranks would wait inside its first step's gradient allreduce for
        the whole compilation (measured: 15 s for MobileNetV2 on 2 cores).  What
        the step computes is overwritten by the live state it receives next.
        """
        self._rehearsing = True
        try:
            yield
        finally:
            self._rehearsing = False

    def _init_joiner(self, merged):
        """State of a joiner before it joins: placeholder ids."""
        self._comm = merged
        self._ids = [-1 - r for r in range(merged.size)]
        self.original_id = self._ids[merged.rank]
        self.joining = True

    def join(self):
        """Joiner side: meet the running job and take over its bookkeeping; returns
        the growth event.  If the job gave up on this process (its ranks changed, or
        training ended first), the process exits quietly: nobody needs it."""
        if not self.joining:
            raise ElasticHvdError("join(): this process is not joining a running job")
        MPI = self.MPI
        started = time.perf_counter()
        merged = self._comm
        try:
            merged.Ibarrier().Wait()  # "ready"; a blocking Barrier would not match theirs
            adopted = merged.Dup()    # "adopted": the ranks committed to this join
            adopted.Set_errhandler(MPI.ERRORS_RETURN)
            book = adopted.bcast(None, root=0)
        except MPI.Exception as exc:
            _give_up(f"the running job no longer waits for it ({exc.Get_error_string()})")
        self._free(merged)
        self._comm = adopted
        self._ids = list(book["ids"])
        self._procs.update(book["procs"])
        self.events = list(book["events"])
        self.initial_size, self.min_np = book["initial_size"], book["min_np"]
        self._next_id, self._spawns = book["next_id"], book["spawns"]
        self._predictor.load_state(book["predictor"])
        self.original_id = self._ids[self.rank]
        event = self._welcome(book["old"], started, 0.0)
        self.joining = False
        faults.configure(self.original_id)  # ELASTIC_HVD_FAULTS may name the new id
        return event

    # -- both -------------------------------------------------------------------------
    def _welcome(self, old_ids, started, spawn_s):
        """Last step of a join, on old and new ranks: exchange hosts and pids (a
        resilient collective: a failure from here on is repaired like any other) and
        agree on the one growth event."""
        label, self.label = self.label, JOIN_LABEL
        self._quiet = True  # repairs inside the join fold into its one event
        try:
            mine = (socket.gethostname(), os.getpid(), spawn_s)
            everyone = self.run(None, lambda c: c.allgather(mine))
        finally:
            self._quiet, self.label = False, label
        self._procs.update((i, (host, pid)) for i, (host, pid, _) in zip(self._ids, everyone))
        event = MembershipEvent(
            old_size=len(old_ids), new_size=self.size,
            lost=tuple(i for i in old_ids if i not in self._ids),
            gained=tuple(i for i in self._ids if i not in old_ids),
            repair_s=time.perf_counter() - started, sequence=len(self.events) + 1,
            during=JOIN_LABEL, spawn_s=max(s for *_, s in everyone))
        self.events.append(event)
        self._notify(event)
        if self.size < self.min_np:
            self._below_min = RanksBelowMinimumError(self.size, self.min_np, event.lost)
            raise self._below_min
        return event
