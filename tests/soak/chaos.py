"""Fault injection from outside the job: real signals to real rank PIDs, at chosen moments.

Why from outside: a fault planned inside the job (``ELASTIC_HVD_FAULTS``) fires at
moments the library's own hooks define; a soak must also hit the moments nobody
planned.  So the driver picks, from a seeded random generator,

* a **kind**: ``KILL`` (SIGKILL), ``STOP`` (SIGSTOP, never continued: the heartbeat
  must evict the rank and a survivor fence it), ``TERM`` (SIGTERM: the job's handler
  calls ``sys.exit(0)``) or ``RAISE`` (SIGUSR1: the job raises inside its next step);
* a **moment**: ``random`` (now), ``burst`` (a second rank within 0-5 ms),
  ``repair`` (a SIGKILL, then a second fault 5-80 ms later, while the survivors
  repair), ``spawn`` (0-1.5 s after a process spawned to refill the job appears:
  the ranks are inside ``MPI_Comm_spawn`` and the merge, ~1.5 s), ``join`` (while a
  respawned process joins: it built its model and reports ready), ``checkpoint``
  (a new file appears in the checkpoint directory: a save is in progress) or
  ``copy`` (a connection to the launcher's state keeper is open: rank 0 is copying
  the training state);
* **victims** among the job's members, rank 0 included, never the launcher,
  ``mpirun`` or ``prted``: a PID is signalled only if it carries the job's marker
  and runs the soak job through ``elastic_hvd.runner``.

At least ``MIN_ALIVE`` members always stay untouched: a fault that would leave
fewer waits until respawned processes have refilled the job.

A ``STOP`` is always found: Open MPI's detector evicts a stopped world rank it
watches, and elastic_hvd kills a stopped one it does not watch (a spawned process,
the last rank of a world: ``elastic_hvd/core/stopped_peers.py``) from any running
member on its host -- here ``MIN_ALIVE`` untouched members always run on this host.
Before that watch, such a STOP hung the job, and the soak ran with
``--avoid-known-limits`` (sent it as a KILL).
"""

import dataclasses
import os
import re
import signal
import time

from elastic_hvd.core import procfs
from mpijob import job_processes, proc_entries

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM,
           "RAISE": signal.SIGUSR1}
KINDS = {"KILL": 0.4, "STOP": 0.15, "TERM": 0.2, "RAISE": 0.25}
MOMENTS = {"random": 0.25, "burst": 0.15, "repair": 0.15, "spawn": 0.1, "join": 0.15,
           "checkpoint": 0.1, "copy": 0.1}
MIN_ALIVE = 2
#: How long a special moment is waited for before the fault fires at a random moment.
MOMENT_WAIT_S = 12.0
_CKPT_FILE = re.compile(r"^ckpt-\d+-e\d+|^\.checkpoint\.json\..*\.tmp$")


@dataclasses.dataclass
class Fault:
    t: float
    kind: str
    moment: str
    pid: int
    id: int  # original id (None: a joiner that had not joined)
    rank: int
    alive: int  # untouched members just before it
    note: str = ""
    start: int | None = None  # the process's start time: (pid, start) is the process


def process_state(pid):
    """The state letter of ``/proc/PID/stat`` (R, S, T, Z...), or None if gone."""
    return (_stat(pid) or [None])[0]


def start_of(pid):
    """The start time of process ``pid`` (clock ticks since boot), None if gone: with
    the pid, what tells a process from a later one that got the same pid."""
    fields = _stat(pid)
    return int(fields[procfs.START]) if fields else None


def _stat(pid):
    """The fields of ``/proc/PID/stat`` after the command's name, or None if gone."""
    return procfs.stat_fields(f"/proc/{pid}/stat")


def spawned(pid):
    """Whether ``pid`` is a process spawned to refill the job (the join wrapper runs it)."""
    return b"elastic_hvd.runner.join" in proc_entries(pid, "cmdline")


def running(pid, start=None):
    """Whether ``pid`` runs (and is the process that started at ``start``, if given)."""
    fields = _stat(pid)
    return (fields is not None and fields[0] not in ("Z", "X")
            and (start is None or int(fields[procfs.START]) == start))


class Chaos:
    """Chooses and injects faults into the job marked ``marker`` (see module doc)."""

    def __init__(self, rng, records, marker, log):
        self.rng, self.records, self.marker, self.log = rng, records, marker, log
        self.faults = []
        self.touched = set()  # (pid, start) of the processes already given a fault
        self._ours = set()  # (pid, start) of the processes checked to be the job's ranks

    def alive(self):
        """Members (they committed a step) not given a fault and still running."""
        return sorted(pid for pid, r in self.records.latest.items()
                      if (pid, r["start"]) not in self.touched and running(pid, r["start"]))

    def is_rank(self, pid):
        process = (pid, start_of(pid))  # a pid checked once may belong to another process now
        if process in self._ours:
            return True
        if pid in job_processes(self.marker):
            argv = proc_entries(pid, "cmdline")
            if (any(a in argv for a in (b"elastic_hvd.runner.program", b"elastic_hvd.runner.join"))
                    and any(a.endswith(b"soak/job.py") for a in argv)):
                self._ours.add(process)
                return True
        return False

    def _pick(self, weights):
        return self.rng.choices(list(weights), list(weights.values()))[0]

    def fire(self, pid, kind, moment, alive, note=""):
        if not self.is_rank(pid):
            self.log(f"refused to signal pid {pid}: not one of the job's ranks")
            return None
        start = start_of(pid)
        latest = self.records.latest.get(pid, {})
        if latest.get("start") != start:
            latest = {}  # a joiner not yet a member (or the record of an earlier process)
        try:
            os.kill(pid, SIGNALS[kind])
        except ProcessLookupError:
            return None
        fault = Fault(time.time(), kind, moment, pid, latest.get("id"), latest.get("rank"),
                      alive, note, start)
        self.touched.add((pid, start))
        self.faults.append(fault)
        self.log(f"FAULT {kind:5s} {moment:10s} pid {pid} id {fault.id} rank {fault.rank} "
                 f"({alive} untouched before){' ' + note if note else ''}")
        return fault

    def inject(self):
        """One planned fault (one or two signals); False if the job is at its minimum
        (try again later)."""
        alive = self.alive()
        moment = self._pick(MOMENTS)
        if moment in ("burst", "repair") and len(alive) < MIN_ALIVE + 2:
            moment = "random"
        if len(alive) < MIN_ALIVE + 1:
            return False
        for pid in alive:
            self.is_rank(pid)  # checked now, not at the precise moment
        return getattr(self, "_" + moment)(alive)

    def _random(self, alive, moment="random", note=""):
        return self.fire(self.rng.choice(alive), self._pick(KINDS), moment, len(alive), note)

    def _burst(self, alive):
        first, second = self.rng.sample(alive, 2)
        gap = self.rng.uniform(0.0, 0.005)
        self.fire(first, self._pick(KINDS), "burst", len(alive))
        time.sleep(gap)
        return self.fire(second, self._pick(KINDS), "burst", len(alive) - 1,
                         f"{gap * 1e3:.1f} ms after pid {first}")

    def _repair(self, alive):
        first, second = self.rng.sample(alive, 2)
        gap = self.rng.uniform(0.005, 0.08)
        self.fire(first, "KILL", "repair", len(alive))
        time.sleep(gap)
        return self.fire(second, self._pick(KINDS), "repair", len(alive) - 1,
                         f"{gap * 1e3:.0f} ms after killing pid {first}")

    def _wait(self, found):
        """Poll ``found()`` (every ms) until it returns something or the wait is over."""
        deadline = time.monotonic() + MOMENT_WAIT_S
        while time.monotonic() < deadline:
            hit = found()
            if hit:
                return hit
            time.sleep(0.001)
        return None

    def _spawn(self, alive):
        def new_processes():
            time.sleep(0.02)  # a scan of /proc takes a few ms: not every ms
            return [pid for pid in job_processes(self.marker)
                    if (pid, start_of(pid)) not in self.records.procs and spawned(pid)]
        children = self._wait(new_processes)
        if not children:
            return self._random(alive, note="(no spawn seen)")
        delay = self.rng.uniform(0.0, 1.5)
        time.sleep(delay)
        alive = self.alive()
        if len(alive) < MIN_ALIVE + 1:
            return False
        return self.fire(self.rng.choice(alive), self._pick(KINDS), "spawn", len(alive),
                         f"{delay:.2f} s after spawned pid {children[0]} appeared")

    def _join(self, alive):
        def ready_joiner():
            self.records.poll()
            waiting = [p for p in self.records.joiners_waiting() if running(p)]
            time.sleep(0.05)
            return waiting
        joiners = self._wait(ready_joiner)
        if not joiners:
            return self._random(alive, note="(no joiner came)")
        delay = self.rng.uniform(0.0, 2.0)
        time.sleep(delay)
        alive = self.alive()
        note = f"{delay:.2f} s after joiner pid {joiners[0]} was ready"
        if self.rng.random() < 1 / 3 and running(joiners[0]) and joiners[0] not in alive:
            return self.fire(joiners[0], self._pick(KINDS), "join", len(alive),
                             "the joiner, " + note)
        if len(alive) < MIN_ALIVE + 1:
            return False
        return self.fire(self.rng.choice(alive), self._pick(KINDS), "join", len(alive), note)

    def _writer_or_any(self, alive, writer):
        if writer in alive and self.rng.random() < 2 / 3:
            return writer
        return self.rng.choice(alive)

    def _checkpoint(self, alive):
        directory = self.records.out / "ckpt"

        def listing():
            try:
                return {n for n in os.listdir(directory) if _CKPT_FILE.match(n)}
            except FileNotFoundError:
                return set()
        before = listing()
        new = self._wait(lambda: listing() - before)
        if not new:
            return self._random(alive, note="(no checkpoint save seen)")
        victim = self._writer_or_any(alive, self.records.rank_zero())
        return self.fire(victim, self._pick(KINDS), "checkpoint", len(alive),
                         f"while {sorted(new)[0]} was written")

    def _copy(self, alive):
        port = self._keeper_port(alive)
        if port is None:
            return self._random(alive, note="(no state keeper address)")
        sender = self._wait(lambda: self._copying(port, alive))
        if not sender:
            return self._random(alive, note="(no state copy seen)")
        victim = self._writer_or_any(alive, sender)
        return self.fire(victim, self._pick(KINDS), "copy", len(alive),
                         f"while pid {sender} copied the state to the launcher")

    @staticmethod
    def _keeper_port(alive):
        """The port of ``elastic-hvd-run``'s state keeper, from a rank's environment."""
        for pid in alive:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            for entry in env:
                if entry.startswith(b"ELASTIC_HVD_REPLICA="):
                    return int(entry.rsplit(b":", 1)[1])
        return None

    @staticmethod
    def _copying(port, alive):
        """PID of the member with an open connection to ``port`` (else None)."""
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    lines = f.readlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    inodes.add(f"socket:[{fields[9]}]")
        if not inodes:
            return None
        for pid in alive:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return pid
                except OSError:
                    continue
        return None
