"""Loading MPI with the settings a resilient job needs.

Open MPI reads its MCA parameters from ``OMPI_MCA_*`` environment variables when
``MPI_Init`` runs, so the defaults below are put into the environment *before*
``mpi4py.MPI`` is imported.  That way a plain ``mpirun --with-ft ulfm python
train.py`` gets the same failure detector and collective settings as our
launcher, without any extra flags.  Anything the user set explicitly wins.
"""

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from . import config, process, workarounds

def mca_defaults(settings: Any = None) -> dict[str, str]:
    """The MCA settings elastic_hvd wants, as ``{name: value}``, for ``settings``
    (a :class:`config.Config`; None: the loaded ones).

    The heartbeat (``config``: 1 s period, 10 s timeout) is what catches a *frozen*
    rank (SIGSTOP, a stuck node); a crash is reported by the runtime within
    milliseconds.  Heartbeats need no GIL (see .heartbeat), so a busy rank keeps
    beating; 10 s still leaves room for a process the OS does not schedule for a
    while (overloaded host, swapping).  Fast hang detection: 0.5 / 2 (docs/liveness.md).
    """
    settings = settings or config.current()
    period, timeout = settings.heartbeat_period, settings.heartbeat_timeout
    return {
        # The heartbeat detector.  Its own thread stays off: in Open MPI 5.0.11 it
        # crashes MPI_Init now and then and hangs MPI_Finalize (docs/liveness.md);
        # elastic_hvd.core.heartbeat drives it from a native loop that needs no GIL.
        "mpi_ft_detector": "true",
        "mpi_ft_detector_thread": "false",
        "mpi_ft_detector_period": repr(period),
        "mpi_ft_detector_timeout": repr(timeout),
        # han ignores errors of its sub-collectives and can deadlock after a failure.
        "coll": "^han",
        # MPI_Finalize without its closing job-wide PMIx fence: after a rank loss that
        # fence hung now and then (2 of 10 jobs that lost two ranks at their last
        # collective; tests/test_exit_paths.py) and would hang for ever after a host
        # lost all its ranks.  With fault tolerance on, MPI_Finalize first shrinks
        # COMM_WORLD to the survivors and runs a synchronous barrier among them,
        # which already flushes their traffic and syncs them -- the fence's purpose.
        # Without FT that barrier does not exist: the fence stays.
        **({"async_mpi_finalize": "true"} if ft_enabled() else {}),
    }


def _apply_env_defaults(settings: Any) -> None:
    for name, value in mca_defaults(settings).items():
        if "OMPI_MCA_" + name in os.environ:  # the user's wins
            continue
        os.environ["OMPI_MCA_" + name] = value
        if name == "coll":
            workarounds.used("han_off")
        elif name == "async_mpi_finalize":
            workarounds.used("async_finalize")


def load_mpi(settings: Any = None) -> Any:
    """Import and initialise ``mpi4py.MPI`` (once), after setting our MCA defaults
    for ``settings`` (None: the loaded ones)."""
    import sys
    if "mpi4py.MPI" not in sys.modules:
        _apply_env_defaults(settings)
        import mpi4py
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI
    if not MPI.Is_initialized():
        # The program set mpi4py.rc.initialize = False (Horovod's test_process_sets_static
        # does): MPI is ours to start, as Horovod starts it then; elastic_hvd finalizes it
        # at exit in any case (runtime._at_exit).
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def ft_enabled() -> bool:
    """True when the job was launched with fault tolerance (``--with-ft ulfm``).

    ``mpirun --with-ft ulfm`` exports ``OMPI_MCA_mpi_ft_enable=1`` to every rank; that
    is the only switch under which Open MPI keeps a job alive after a process dies.
    """
    value = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower()
    return value in ("1", "true", "yes", "on", "enabled")


def ulfm_compiled(MPI: Any) -> bool:
    """True when the MPI library implements the ULFM calls (revoke/shrink/agree)."""
    if not hasattr(MPI.Comm, "Revoke"):
        return False
    # On a private duplicate: an agreement on COMM_SELF itself takes ERA's identifier
    # (0.0).1, which Open MPI's own first agreement in a repair reuses -- it then warns
    # "removing old agreement (0.0).1 from history, due to cycling of identifiers".
    probe = MPI.COMM_SELF.Dup()
    try:
        probe.Agree(1)
    except NotImplementedError:
        return False
    except MPI.Exception as exc:  # an MPI without ULFM answers ERR_UNSUPPORTED_OPERATION
        return exc.Get_error_class() != MPI.ERR_UNSUPPORTED_OPERATION
    finally:
        retire(probe)
    return True


def end_as_crash(why: str) -> None:
    """End this process as a crash would: one line saying ``why``, then SIGKILL, which
    the other ranks detect within milliseconds and repair alike (an ordinary exit
    before ``MPI_Finalize`` would cost them the heartbeat timeout)."""
    # print, not logging: also called by watchdogs whose main thread may hang holding a lock
    print(f"elastic_hvd: {why}; it leaves the job as a crash", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def end_broken(why: str) -> None:
    """End this process as a crash because Open MPI left it unable to make any new
    communicator (a death inside a merge or a connect: docs/openmpi-quirks.md), having
    said so to ``elastic-hvd-run``'s wrapper first (``runtime.when_broken``): a job
    *every* rank of which ends so has nothing left to repair, and the launcher starts
    it again from the state it keeps (``runner/relaunch.py``)."""
    hook = process.runtime().on_broken
    if hook is not None:
        try:
            hook(why)
        except OSError:
            pass  # the status directory is gone: the crash is all there is to say
    end_as_crash(why)


def retire(comm: Any) -> None:
    """Be done with an mpi4py communicator but never ``MPI_Comm_free`` it: a freed
    communicator's context id, reused, lets a new agreement be answered with the old
    one's value (workarounds.TABLE 'never_free'; docs/openmpi-quirks.md).  The cost:
    one communicator's memory per repair or join, until the process exits."""
    process.runtime().retired.append(comm)
    workarounds.used("never_free")


def finalize(limit: float, exit_now: Callable[[], object]) -> None:
    """``MPI_Finalize``; if it has not returned within ``limit`` seconds, say so and
    call ``exit_now()``, which ends the process without it.

    With Open MPI 5.0.11 + ULFM, ``MPI_Finalize`` hung now and then in its closing
    PMIx fence after a rank had been killed (how often: docs/measurements.md),
    although every survivor had finished, and often after a join (the joiners are spawned
    jobs; ``MPI_Comm_disconnect`` first hung too).  All work is done when it is
    called, so a process that cannot finalize in time exits anyway (mpirun then
    still reports the job's status correctly).
    MPI_Finalize is called through ctypes because ctypes releases the GIL, which
    the deadline thread needs.
    """
    done = threading.Event()

    def deadline() -> None:
        if not done.wait(limit):
            workarounds.used("finalize_deadline")
            # print, not logging: the main thread, stuck, may hold a handler's lock
            print(f"elastic_hvd: MPI_Finalize did not return within {limit:.0f}s "
                  "(an Open MPI race after a rank loss or a join); exiting without it",
                  file=sys.stderr, flush=True)
            exit_now()

    threading.Thread(target=deadline, daemon=True).start()
    ctypes.CDLL(loaded_library("libmpi.so") or "libmpi.so.40").MPI_Finalize()
    done.set()


def loaded_library(prefix: str) -> str | None:
    """Path of an already loaded shared library whose file name starts with ``prefix``
    (found in this process's memory map), or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(prefix):
                return path
    return None
