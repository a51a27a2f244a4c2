"""A final checkpoint on a signal: what :class:`~keras_callbacks.ElasticCheckpoint`
does when the job is told it is about to end (Slurm's ``--signal=B:USR1@N``).

A scheduler that ends a job sends SIGTERM, and Open MPI's runtime kills every rank
half a second later (docs/slurm.md): too soon to write anything.  A signal sent
*before* the end leaves time: ``elastic-hvd-run`` passes SIGUSR1 on to ``mpirun``,
which passes it to every rank (a plain ``mpirun`` does the same).  Each rank's
handler only sets a flag; the ranks then agree, after every training step, whether
any of them has it (one small resilient collective, :func:`agreed`), so all of them
act at the same step boundary although the signal reaches them at slightly
different steps: every rank saves (the usual committed, atomic checkpoint) and exits
with :data:`~elastic_hvd.runner.outcome.EXIT_PREEMPTED`.  The rank records where it
stopped (:func:`record`) for the launcher, which says so in one line.
"""

import json
import os
import signal
import socket
import threading
from types import FrameType
from typing import Any

from elastic_hvd.core import config

#: The signal that asks for a final checkpoint (what ``--signal=B:USR1@N`` sends).
SIGNAL = signal.SIGUSR1


class Requests:
    """Whether this process was sent :data:`SIGNAL` (:meth:`install` its handler)."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self.installed = False

    def _handler(self, _signum: int, _frame: FrameType | None) -> None:
        self.received.set()

    def install(self) -> bool:
        """Take :data:`SIGNAL` unless the script handles it itself (or this is not the main
        thread); whether this process now acts on it.  Idempotent."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None):
            return False  # the script's own handler: left alone
        signal.signal(SIGNAL, self._handler)
        self.installed = True
        return True


def agreed(comm: Any, requested: bool) -> bool:
    """Whether any live rank of ``comm`` has ``requested``: the communicator's own
    agreement (a bitwise AND of "not requested", resilient: a rank lost meanwhile is
    repaired away and the survivors agree among themselves).  Unsigned, as every
    ``agree``: it does not count as a collective for the fault plans' ``coll=N``."""
    return comm.agree(0 if requested else 1) == 0


def record(step: int, epoch: int, saved: bool, directory: str) -> None:
    """Tell ``elastic-hvd-run`` where this rank stopped: ``<host>-<pid>.preempted`` beside
    its record in the launcher's status directory (:mod:`elastic_hvd.runner.outcome`
    reads it), where that directory is on this host."""
    status_dir = config.read("status_dir") or ""
    if not os.path.isdir(status_dir):
        return
    path = os.path.join(status_dir, f"{socket.gethostname()}-{os.getpid()}.preempted")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step, "epoch": epoch, "saved": saved, "directory": directory}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher then says less
