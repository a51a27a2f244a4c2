"""Watching a running job from the launcher: its status directory and ``/proc``.

mpirun waits for every process it started, also for one that will never end by
itself (one the ranks evicted, frozen on a host where no rank is left to fence it;
a spawned process stopped before it joined).  The launcher, which sees every
record and every local process, ends mpirun then, and after mpirun was killed it
ends what mpirun left running.
"""

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

from ..core import config, signals
from ..core.procfs import stat_fields
from . import reports
from .outcome import members_done, read_outcomes, strict_abort
from ..log import get_logger

_log = get_logger(__name__)

#: Seconds between two looks at the status directory.
LOOK_PERIOD = 0.5
#: Seconds mpirun has to end after SIGTERM before it gets SIGKILL.
TERM_GRACE = 10.0


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` of this host (``ps``'s STAT), '' if gone."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields[0] if fields else ""


def stopped_and_nothing_runs(status_dir: str | os.PathLike[str]) -> list[str] | None:
    """The job's stopped processes (``host-pid``) when no process of the job runs any
    more: each one that recorded itself (see :mod:`.program`) has ended or is stopped
    (SIGSTOP: it never goes on by itself, and only another process of the job could
    notice it).  None while one runs, while one lives on another host (its state
    cannot be read from here), or before any recorded itself.

    Why: when every rank is lost and a spawned process was stopped before it joined,
    nobody is left to evict it and mpirun would wait for ever (docs/openmpi-quirks.md:
    a frozen spawned process is never detected)."""
    host = socket.gethostname()
    stopped, found = [], False
    for path in Path(status_dir).glob("*.json"):
        found = True
        who, _, pid = path.stem.rpartition("-")
        if who != host:
            return None
        state = process_state(int(pid))
        if state in ("T", "t"):
            stopped.append(path.stem)
        elif state not in ("", "Z", "X"):
            return None
    return stopped if found else None


def end_strays(status_dir: str) -> list[str]:
    """SIGKILL the job's processes on this host that outlived a killed mpirun; their
    names (``host-pid``).

    mpirun ends what it started when it ends by itself (some may still be exiting as
    it returns: never call this then); killed (the OOM killer, docs/openmpi-quirks.md),
    it leaves them running without a job, writing into the status directory while it
    is removed.  A recorded pid is the job's only while that process has the status
    directory in its environment (mpirun's, passed on to every process it starts,
    spawned ones too): a pid reused since is left alone."""
    host, mark = socket.gethostname(), f"{config.env('status_dir')}={status_dir}".encode()
    ended = []
    for path in Path(status_dir).glob("*.json"):
        who, _, pid = path.stem.rpartition("-")
        if who != host or process_state(int(pid)) in ("", "Z", "X"):
            continue
        start = signals.start_of(pid)  # read before the check: the kill refuses any other
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
        except OSError:  # gone meanwhile
            continue
        if start is not None and signals.kill(signals.Identity(int(pid), start),
                                              f"process {path.stem}"):
            ended.append(path.stem)
    return ended


def end_when_members_done(proc: subprocess.Popen[bytes], status_dir: str, grace: float,
                          stopped: threading.Event, reporter: reports.Reporter) -> None:
    """End ``proc`` (mpirun) if it still runs ``grace`` seconds after every member
    finished, or after ``grace`` seconds in which no process of the job ran (see
    :func:`stopped_and_nothing_runs`), or at once when strict mode ends the job.
    Meanwhile the ``reporter`` tells of processes that raised or crashed; ``stopped``
    is set when mpirun has ended."""
    idle_since = None
    while not stopped.wait(LOOK_PERIOD):
        outcomes = read_outcomes(status_dir)
        reporter.news(outcomes)
        frozen = stopped_and_nothing_runs(status_dir)
        if frozen is None:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= grace:
            return _end_mpirun(proc, stopped, (
                f"no process of the job has run for {grace:.0f}s (each ended or is stopped), "
                f"and mpirun waits for {len(frozen)} stopped process(es) that no rank is left "
                f"to evict ({', '.join(sorted(frozen))}); ending it"))
        if strict_abort(outcomes):
            # MPI_Abort in a spawned process ends only its own (spawned) job
            # (docs/design.md); strict mode means the whole job.
            return _end_mpirun(proc, stopped,
                               "strict mode: a process met an anomaly; ending the whole job")
        if members_done(outcomes):
            if stopped.wait(grace):
                return
            return _end_mpirun(proc, stopped, (
                "every rank of the job has finished, but mpirun still waits for a process "
                "that will not end by itself (one the ranks evicted, frozen or hung, or a "
                "replacement still starting, given up when training ended); ending it"))


def _end_mpirun(proc: subprocess.Popen[bytes], stopped: threading.Event, why: str) -> None:
    """Say ``why`` and end mpirun: SIGTERM, then SIGKILL if it still runs
    :data:`TERM_GRACE` seconds later."""
    _log.warning(f"elastic-hvd-run: {why}")
    proc.terminate()
    if not stopped.wait(TERM_GRACE):
        proc.kill()
