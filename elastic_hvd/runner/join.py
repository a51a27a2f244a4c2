"""What a process spawned into a running job runs: ``python -m elastic_hvd.runner.join
<program...>``.

The running ranks wait inside ``MPI_Comm_spawn`` until this process has merged
with them, so it merges first -- before the program imports TensorFlow and
builds its model, which happens while the running ranks go on training -- and
only then runs the program, exactly as the original ranks ran it.  The merged
communicator is handed to core (``runtime.set_parent``), whose ``init()`` makes
this process a joiner.  The spawning rank's environment comes over the merged
communicator, before the program starts (``spawn.share_environment``; a spawned
process starts with ``mpirun``'s, in which ``-x`` variables would be missing):
never on the command line, which every local user can read.
"""

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from elastic_hvd.core import config, faults, mpi_env, runtime
from elastic_hvd.core.invitation import leave_unjoined
from elastic_hvd.core.spawn import connect_all, share_environment, spawn_timeout

from .program import run

#: Seconds a spawned process waits for its merge beyond twice the spawners' own wait.
START_UP_MARGIN = 10.0
#: Seconds after its watchdog that ``SIGALRM`` ends a spawned process still not merged.
ALARM_AFTER_WATCHDOG = 5.0


def merge_with_parent(MPI: Any) -> Any:
    """The communicator merged with the ranks that spawned this process (None if
    nobody did), every pair of processes connected, their environment taken on
    (see :func:`take_environment`).  A process whose spawners gave the spawn up
    meanwhile exits (``invitation.leave_unjoined``)."""
    intercomm = MPI.Comm.Get_parent()
    if intercomm == MPI.COMM_NULL:
        return None
    intercomm.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        merged = intercomm.Merge(high=True)
    except MPI.Exception as exc:  # the parents abandoned this spawn
        leave_unjoined(f"merge failed ({exc.Get_error_string()})", intercomm)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        connect_all(merged)
        take_environment(share_environment(merged))
    except MPI.Exception as exc:
        leave_unjoined(f"could not reach the running job ({exc.Get_error_string()})",
                       merged, intercomm)
    mpi_env.retire(intercomm)
    return merged


def take_environment(environ: dict[str, str]) -> None:
    """Add the spawning rank's variables to this process's environment (mpirun's and
    the spawn's early ones win), and read the settings again from it."""
    for name, value in environ.items():
        os.environ.setdefault(name, value)
    config.load()


@contextlib.contextmanager
def start_up_deadline(seconds: float) -> Iterator[None]:
    """A spawned process that is not merged within ``seconds`` exits: by then its
    spawners gave it up, and mpirun would wait for it for ever.

    A watchdog thread says why; ``SIGALRM`` (its default action ends the process)
    ends one that hangs in ``MPI_Init``, which holds the interpreter lock
    (docs/measurements.md).  Stuck before its merge, it cannot finalize MPI."""
    watchdog = threading.Timer(seconds, leave_unjoined,
                               (f"it was not merged with the running job within {seconds:.0f}s",),
                               {"finalize": False})
    watchdog.daemon = True
    watchdog.start()
    signal.alarm(int(seconds + ALARM_AFTER_WATCHDOG))
    try:
        yield
    finally:
        signal.alarm(0)
        watchdog.cancel()


def main() -> None:
    program = sys.argv[1:]
    os.environ[config.env("program")] = json.dumps(program)
    with start_up_deadline(2 * spawn_timeout() + START_UP_MARGIN):  # the spawners' wait
        faults.at_joiner_start()  # a fault planned for this process (tests)
        MPI = mpi_env.load_mpi()
        merged = merge_with_parent(MPI)
    if merged is not None:
        runtime.set_parent(MPI, merged)
    run(program)


if __name__ == "__main__":
    main()
