"""Members stopped on this host: the freezes Open MPI's detector does not see.

Open MPI 5.0.11's heartbeat detector watches each ``MPI_COMM_WORLD`` only: a process
spawned into the job (``--respawn``, ``--max-np``, a spawned hot spare once adopted)
is never observed, nor is a world rank once no other rank of its world is left
(docs/openmpi-quirks.md).  Stop such a process (SIGSTOP) and every other rank waits
for it for ever.  What the detector cannot see, the kernel says: a stopped process
is in state ``T``.  So on each host the lowest-ranked member that is not stopped
looks at the job's other members there every heartbeat period, and kills one that
has stayed stopped for ``ELASTIC_HVD_STOPPED_PEER_PATIENCE`` heartbeat timeouts (1.5)
-- what the detector's eviction and the repair's fence do to a world rank (the
detector, where it watches, acts first) -- saying so in one line.  The others see a
crash within milliseconds and repair.

A process spawned to join the job counts too from its merge on, before it is a
member: it says its pid to every rank then (``invitation.hello``); stopped while it starts
up, it would never be ready, and the job would stay below its size for good.  Killed,
its join breaks, and the job spawns another.

Not covered: a member with no other member on its host (nobody there to look), one
frozen without being stopped (nothing tells it from a busy one), and one that a
debugger holds (state ``t``: left alone on purpose).
"""

import os
import socket
import threading
import time

from . import announce, config, process, signals, workarounds
from .procfs import START, stat_fields
from ..log import get_logger

_log = get_logger(__name__)

#: States of a process (``/proc/PID/stat``): stopped by a signal; and every state of
#: one that cannot look (stopped, held by a debugger, dead).
STOPPED, NOT_LOOKING = "T", "TtZX"


def state_of(who: signals.Identity) -> str | None:
    """The state letter of process ``who``, None if it is gone: its pid free, or held
    by a later process (its start time differs)."""
    fields = stat_fields(f"/proc/{who.pid}/stat")
    return fields[0] if fields and int(fields[START]) == who.start else None


class StoppedPeers:
    """The watch of one process (see the module doc); :meth:`look` is one round."""

    def __init__(self) -> None:
        self._host = socket.gethostname()
        #: When each stopped member was first seen stopped.
        self._since: dict[signals.Identity, float] = {}

    def start(self) -> None:
        """Look every heartbeat period from now on, in a thread of its own that makes
        no MPI call (for as long as the process lives: it reads the runtime's current
        communicator, if any, at each look)."""
        threading.Thread(target=self._run, name="elastic_hvd-stopped-peers",
                         daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(config.current().heartbeat_period)
            self.look(time.monotonic())

    def look(self, now: float) -> list[int]:
        """One round: kill the members of this host, and the processes waiting there to
        join, stopped for too long, if this process is the one to look; returns the pids
        killed."""
        comm = process.runtime().comm
        if comm is None or comm.joining:
            return []
        here = []  # (what, identity, state) of the members on this host, then joiners
        for rank, i in enumerate(comm.ids):
            host, who = comm.process_of(i)
            if host == self._host and who is not None and (state := state_of(who)):
                here.append((f"{announce.who(rank, i)}, pid {who.pid}", who, state))
        members = len(here)
        growth = process.runtime().growth
        for host, who in growth.pending_processes() if growth is not None else ():
            if host == self._host and (state := state_of(who)):
                here.append((f"process {who.pid}, spawned to join the job,", who, state))
        stopped = {who for _, who, letter in here if letter == STOPPED}
        self._since = {who: self._since.get(who, now) for who in stopped}
        looking = next((who.pid for _, who, letter in here[:members]
                        if letter not in NOT_LOOKING), None)
        if looking != os.getpid():
            return []
        # Past the detector's own eviction of a world rank: this acts where it does not.
        settings = config.current()
        timeout, patience = settings.heartbeat_timeout, settings.stopped_peer_patience
        killed = []
        for what, who, letter in here:
            if letter == STOPPED and now - self._since[who] >= patience * timeout:
                workarounds.used("stopped_peer_killed")
                _log.warning(f"elastic_hvd: {what} has been "
                      f"stopped for {now - self._since[who]:.1f}s, longer than "
                      f"{patience:g} x the heartbeat timeout ({timeout:g}s), and Open MPI's "
                      "detector has not evicted it (it watches no spawned process, nor the "
                      "last one of a world): killing it so that the others can go on")
                if signals.kill(who, what):
                    killed.append(who.pid)
                del self._since[who]
        return killed
