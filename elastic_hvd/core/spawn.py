"""Starting new processes for a running job: the command they run and the spawn itself.

Why a module of its own: *what* a spawned process runs (this program again,
behind the join wrapper, with this process's environment) and *how* the
running ranks survive a spawn that never completes are questions of their own,
apart from the join protocol (:mod:`.growth`) that decides when to spawn and
what happens with the processes once they are merged.

Nothing of the environment goes on the new processes' command line, which every
local user can read (``/proc/PID/cmdline``): the environment holds the job's secret
(:mod:`elastic_hvd.state_replica`) and whatever credentials the user's shell has.
It travels over the merged communicator (:func:`share_environment`); the few
variables needed before that, in the spawn's info (:func:`early_environment`).
"""

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import config, faults, mpi_env, workarounds
from .comm_api import Communicator
from .procfs import stat_fields
from .timings import BROKEN_GRACE, SPAWN_WATCH_PERIOD, SPIN_SAMPLE, SPIN_SHARE
from ..log import get_logger

_log = get_logger(__name__)

#: A tag no process sends on a merge's intercommunicator (see MergeCall._partner_failed).
NEVER_SENT = 32100
#: Variables of the MPI runtime: they describe the spawning process, not a joiner.
RUNTIME_PREFIXES = ("PMIX", "PRTE", "OMPI_")
#: Settings the join wrapper uses before it can receive the environment: its start-up
#: deadline, and the failure detector that ``MPI_Init`` sets up (``mpi_env``).
EARLY_SETTINGS = ("spawn_timeout", "heartbeat_period", "heartbeat_timeout")


def spawn_timeout() -> float:
    """Seconds the running ranks wait for a spawn (start, MPI_Init, merge) before they
    give it up (``config.spawn_timeout``, 60; normally it takes ~1.5 s)."""
    return config.current().spawn_timeout


#: The wrapper that records how a process ends, for elastic-hvd-run's exit status.
PROGRAM = ["-m", "elastic_hvd.runner.program"]


def program_argv() -> list[str]:
    """The command line that started this program, for joiners to run it too."""
    saved = config.read("program")
    if saved:
        return json.loads(saved)
    argv = list(sys.orig_argv[1:])
    while argv and argv[0].startswith("-") and argv[0] != "-m" and not argv[0].startswith("-c"):
        argv.pop(0)  # interpreter options (-u, -O...)
    if argv[:2] != [*PROGRAM]:  # every joiner records how it ends (see runner/program.py),
        argv[:0] = PROGRAM      # also one of a rank that the launcher's supervisor ran
    return argv


def joiner_command() -> tuple[str, list[str]]:
    """(executable, args) to spawn: the join wrapper around this program -- and
    nothing else of ours (see the module's docstring)."""
    return sys.executable, ["-m", "elastic_hvd.runner.join", *program_argv()]


def early_environment(extra_env: Mapping[str, str] | None = None) -> str:
    """The variables a spawned process needs before ``MPI_Init``, where the rest of
    the environment cannot reach it yet: ``extra_env`` (its fault, whether it is a
    spare), and the :data:`EARLY_SETTINGS` set here, as parsed (short).  For the
    spawn's info key ``PMIX_ENVAR`` (``NAME=VALUE`` lines): Open MPI puts them into
    the new processes' environment, over mpirun's; a value may have at most
    ``MPI_MAX_INFO_VAL`` (256) characters, too few for a whole environment."""
    settings = config.current()
    early = {config.env(name): repr(getattr(settings, name)) for name in EARLY_SETTINGS
             if config.env(name) in os.environ}
    early.update(extra_env or {})
    return "\n".join(f"{name}={value}" for name, value in early.items())


def share_environment(merged: Any) -> dict[str, str]:
    """The environment of the spawning root (rank 0 of a spawn's ``merged``
    communicator), less the MPI runtime's variables, for the processes it spawned:
    they start with mpirun's (variables given with ``-x``, or set by the program,
    would be missing).  Collective, right after :func:`connect_all`."""
    data = bytearray()
    if merged.Get_rank() == 0:
        data += json.dumps({name: value for name, value in os.environ.items()
                            if not name.startswith(RUNTIME_PREFIXES)}).encode()
    size = np.array([len(data)], np.int64)
    merged.Bcast(size, root=0)
    buffer = np.frombuffer(data, np.uint8) if data else np.empty(int(size[0]), np.uint8)
    merged.Bcast(buffer, root=0)
    environ: dict[str, str] = json.loads(buffer.tobytes())
    return environ


def connect_all(merged: Any) -> None:
    """Open a connection between every pair of the merged processes, now, while
    they are all alive (both sides of a spawn call it).  Open MPI connects lazily,
    and its first contact with a process of another job that has died since blocks
    for ever (in PMIx_Get of the peer's address), freezing the progress engine of
    the whole rank."""
    workarounds.used("connect_all")
    merged.Alltoall(np.zeros(merged.size, dtype=np.int8), np.empty(merged.size, dtype=np.int8))


def _spawn_info(MPI: Any, hosts: Sequence[str], oversubscribe: bool | None,
                early: str) -> Any:
    """Where the new processes start: this directory, on ``hosts`` if given (else
    where Open MPI puts them), oversubscribed if asked (default: as the launcher);
    with the ``early`` variables (:func:`early_environment`)."""
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    if early:
        info.Set("PMIX_ENVAR", early)
    if hosts:
        info.Set("host", ",".join(hosts))
    if oversubscribe if oversubscribe is not None else config.current().oversubscribe:
        info.Set("map_by", ":OVERSUBSCRIBE")
    return info


class MergeCall:
    """Making the communicator merged with new processes (``connect`` gives the
    intercommunicator, then merge + connect), in a thread of its own on a duplicate of
    the live communicator of ``comm`` (a :class:`.comm.ResilientComm`), so that the running
    ranks can give it up.  Collective.  :class:`SpawnCall` starts the processes;
    :class:`.spares.AdoptCall` connects to one that waits already.
    """

    #: Whether a connect step that does not end once given up breaks this process.
    _stuck_connect_breaks = False
    #: The setting that bounds the call, in seconds (see :meth:`result`).
    timeout_setting = "spawn_timeout"

    def __init__(self, comm: Communicator, connect: Callable[[Any], Any]) -> None:
        self._owner, self._lock, self._done = comm, threading.Lock(), threading.Event()
        self._made: list[Any]
        self._given_up, self._made = False, []  # communicators to revoke if given up
        self._merge_started = False  # the thread called MPI_Intercomm_merge
        self._merge_ended = False  # ... and it returned the merged communicator
        self._inter: Any = None  # the intercommunicator with the new processes, once made
        self._thread_id: int | None = None  # the call's thread (its CPU time: _end_if_broken)
        #: Given up because it took longer than :attr:`timeout_s` (see :meth:`result`).
        self.timed_out = False
        self.merged: Any
        self.error: BaseException | None
        self.merged = self.error = None
        try:
            self._comm = comm.mpi_comm.Dup()
        except comm.MPI.Exception as exc:  # e.g. a rank died just now
            self.error = exc
            self._done.set()
            return
        self._keep(self._comm)
        threading.Thread(target=self._run, args=(connect,), name="elastic_hvd-merge",
                         daemon=True).start()

    def _keep(self, comm: Any) -> None:
        comm.Set_errhandler(self._owner.MPI.ERRORS_RETURN)
        with self._lock:
            self._made.append(comm)
            if self._given_up:
                self._owner.revoke(comm)

    def _run(self, connect: Callable[[Any], Any]) -> None:
        self._thread_id = threading.get_native_id()
        owner, MPI = self._owner, self._owner.MPI
        inter = merged = None
        try:
            faults.at_connect()
            inter = connect(self._comm)
            self._keep(inter)
            self._inter = inter
            faults.at_spawn()
            # Every rank merges, or none: a merge that the new process does not finish
            # breaks the ranks inside it for good (see result()), so a process known
            # dead is not merged with -- the window is then the merge itself.
            dead = np.array([1 if self._partner_failed() else 0], np.int32)
            self._comm.Allreduce(MPI.IN_PLACE, dead, op=MPI.MAX)
            if dead[0]:
                raise ConnectionError("the process to connect failed before the merge")
            self._merge_started = True
            faults.at_merge()
            merged = inter.Merge(high=False)
            self._merge_ended = True
            self._keep(merged)
            connect_all(merged)
            self._welcome(merged)
        except Exception as exc:  # noqa: BLE001 - any failure: the merge did not happen
            self.error = exc
            owner.revoke(self._comm)  # free the ranks still inside the call
        with self._lock:
            if self.error is None and not self._given_up:
                self.merged, merged = merged, None  # handed over
            elif merged is not None:
                owner.revoke(merged)  # its new process gives up
            self._done.set()
        for comm in (merged, inter, self._comm):
            if comm is not None:
                owner.retire(comm)

    def _welcome(self, merged: Any) -> None:
        """What the new processes get right after the merge (collective on
        ``merged``): nothing here; see :class:`SpawnCall`."""

    @property
    def timeout_s(self) -> float:
        """Seconds the call may take: the value of :attr:`timeout_setting`."""
        return float(getattr(config.current(), self.timeout_setting))

    def result(self) -> tuple[Any, BaseException | str | None]:
        """``(merged communicator, None)``, or ``(None, why)`` if it failed here, a
        member of the job (or the process to connect) failed meanwhile, or it did not
        finish within the :attr:`timeout_setting`'s seconds.  The members are watched
        because ``MPI_Comm_spawn`` does not fail when a spawning rank dies inside it
        (workarounds.TABLE 'spawn_given_up'); the agreement that follows repairs."""
        deadline = time.monotonic() + self.timeout_s
        why = None
        while not self._done.wait(SPAWN_WATCH_PERIOD):
            if self._member_failed():
                why = "a rank of the job failed during it"
            elif self._partner_failed():
                why = "the process to connect failed"
            elif time.monotonic() >= deadline:
                self.timed_out = True
                why = f"not done after {self.timeout_s:.0f}s ({config.env(self.timeout_setting)})"
            else:
                continue
            break
        with self._lock:
            if not self._done.is_set():
                workarounds.used("spawn_given_up", why)  # type: ignore[arg-type]  # the loop broke
                self._given_up = True
                for comm in self._made:
                    self._owner.revoke(comm)
        if self._given_up or self.error is not None:
            self._end_if_broken()
        return (None, why) if self._given_up else (self.merged, self.error)

    def _end_if_broken(self) -> None:
        """After the call failed or was given up: end this process as a crash if Open
        MPI left it unable to make communicators (workarounds.TABLE 'merge_death_crash';
        docs/openmpi-quirks.md): a merge that a process died in, a connect whose partner
        died inside it (probed), or a given-up call whose thread spins
        (:data:`SPIN_SHARE`), Open MPI's endless retry.  A spawn that merely never ends
        leaves only a thread behind, and later spawns work."""
        stuck = not self._done.wait(BROKEN_GRACE)
        if self._merge_started and (stuck or not self._merge_ended):
            workarounds.used("merge_death_crash")
            mpi_env.end_broken("a process died inside its merge with a new process (or the "
                               "merge was given up), after which Open MPI makes no new "
                               "communicator here")
        if stuck and (spun := self._cpu_share()) >= SPIN_SHARE:
            workarounds.used("merge_death_crash", "spinning")
            mpi_env.end_broken(f"a call given up here (connecting new processes) never ended "
                               f"and keeps {spun:.0%} of a core busy inside Open MPI, its "
                               "endless retry after a death, after which Open MPI makes no "
                               "new communicator here")
        if self._stuck_connect_breaks and stuck and not self._can_make_communicators():
            workarounds.used("merge_death_crash", "inside MPI_Comm_connect")
            mpi_env.end_broken("the process it connected to died inside MPI_Comm_connect, "
                               "after which Open MPI makes no new communicator here")

    def _cpu_share(self) -> float:
        """The share of a core that this call's thread used over :data:`SPIN_SAMPLE` s
        (0 once it ended)."""
        before = _thread_cpu_s(self._thread_id)
        time.sleep(SPIN_SAMPLE)
        after = _thread_cpu_s(self._thread_id)
        return 0.0 if before is None or after is None else (after - before) / SPIN_SAMPLE

    def _can_make_communicators(self) -> bool:
        """Whether ``MPI_Comm_dup(MPI_COMM_SELF)`` ends within :data:`BROKEN_GRACE`
        (in a thread: it may never end)."""
        made = []
        done = threading.Event()

        def dup() -> None:
            made.append(self._owner.MPI.COMM_SELF.Dup())
            done.set()
        threading.Thread(target=dup, name="elastic_hvd-probe", daemon=True).start()
        if not done.wait(BROKEN_GRACE):
            return False
        self._owner.retire(made[0])
        return True

    def _partner_failed(self) -> bool:
        """Whether a process this call connects to is known to have failed, once
        connected: a probe for a message from it (one never sent) fails once the
        runtime reported its death (within ~0.1 s: docs/measurements.md)."""
        inter, MPI = self._inter, self._owner.MPI
        if inter is None:
            return False
        try:
            for source in range(inter.Get_remote_size()):
                inter.Iprobe(source=source, tag=NEVER_SENT)
        except MPI.Exception as exc:
            return exc.Get_error_class() == MPI.ERR_PROC_FAILED
        return False

    def _member_failed(self) -> bool:
        """Whether this rank knows that a member of the spawning communicator failed
        (``MPI_Comm_get_failed``: local, no communication)."""
        try:
            # Progress first: the runtime's news of a death is processed only by MPI
            # progress, and nobody else makes any now (the heartbeat's loop pauses while
            # we are in MPI; without this probe: docs/measurements.md).
            self._owner.MPI.COMM_SELF.Iprobe()
            failed = self._comm.Get_failed()
        except self._owner.MPI.Exception:
            return True  # the communicator is broken: the spawn cannot complete
        try:
            return failed.Get_size() > 0
        finally:
            failed.Free()


def _thread_cpu_s(thread_id: int | None) -> float | None:
    """CPU seconds (user + system) used so far by thread ``thread_id`` of this process,
    or None if it has ended (or not started)."""
    fields = None if thread_id is None else stat_fields(f"/proc/self/task/{thread_id}/stat")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None


class SpawnCall(MergeCall):
    """One spawn of ``count`` joiners (``MPI_Comm_spawn`` + merge + connect).
    ``extra_env``: variables for the joiners' environment on top of this process's,
    theirs from the start (:func:`early_environment`).

    A new process that never completes ``MPI_Init`` leaves ``MPI_Comm_spawn`` blocked
    for ever in the spawning root (workarounds.TABLE 'spawn_given_up'): after the
    timeout every rank revokes the duplicate and goes on; the root's thread stays
    behind, and a later spawn, from a new duplicate, works.
    """

    def __init__(self, comm: Communicator, count: int, hosts: Sequence[str] = (),
                 oversubscribe: bool | None = None,
                 extra_env: Mapping[str, str] | None = None) -> None:
        executable, args = joiner_command()
        early = early_environment(extra_env)

        def spawn(dup: Any) -> Any:
            # Made and freed by the call's thread alone: freed also by __init__ once
            # the call had failed, it was freed twice when the thread failed first.
            info = _spawn_info(comm.MPI, hosts, oversubscribe, early)
            try:
                return dup.Spawn(executable, args, maxprocs=count, info=info, root=0)
            finally:
                info.Free()
        super().__init__(comm, spawn)

    def _welcome(self, merged: Any) -> None:
        share_environment(merged)  # the joiners' environment (the join wrapper takes it)


def agreed_merge(comm: Communicator, call: MergeCall, generation: int, what: str) -> Any:
    """Wait for ``call`` and agree on its outcome (collective): the merged communicator,
    or None with its communicators revoked (and rank 0 saying why).  ``generation``: the
    communicator's when the call began (a member lost meanwhile fails it)."""
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
