"""``python -m elastic_hvd.runner.supervisor VARIABLE command [args]``: run any command as a
rank of ``elastic-hvd-run`` and record how it ended.

Why: the launcher returns the ranks' status, not mpirun's (``--with-ft ulfm`` says 0
even when every rank crashed), and only a Python program started through
:mod:`.program` records its own end.  Every other command -- a wrapper script that
execs Python (the usual form under a scheduler), a program that is not Python --
runs under this supervisor instead.  It starts the command as its child and writes
``<host>-<child pid>.json`` into the status directory (the environment variable
``VARIABLE`` names it; given by the launcher, so that this module imports nothing
of the core): ``"code": null`` at the start, then the child's exit code, or the
signal that ended it (``"signal"``, its name) and, for a fatal error (an abort, a
segfault...), ``"crashed"`` in :mod:`faulthandler`'s words, as :mod:`.program`
records them.  Keyed by the child's pid: a test or a fence that kills a rank's
process by the pid finds it there.  A child that execs ``python -m
elastic_hvd.runner.program`` keeps that pid, and that module's record, which says
more, is left as it is.

Transparent to the MPI runtime: the supervisor ends as its child did, with its
exit status or by the same signal (a rank that exits 137 instead of dying by
SIGKILL is taken by PRRTE for a normal end, and the survivors are not told); the
child dies with it (``PR_SET_PDEATHSIG``), so a killed supervisor leaves no
orphan; signals sent to the supervisor alone are passed on to the child.  Not
those from its parent: Open MPI's daemon signals a rank's whole process group
(``odls_default_kill_local``), which the child shares; passed on as well, they
would reach it twice.
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from typing import Any, NoReturn

from .program import identity, write_record
from ..log import get_logger

_log = get_logger("elastic_hvd.runner.supervisor")

#: Signals passed on to the child (SIGKILL and SIGSTOP cannot be caught).
FORWARDED = {signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT, signal.SIGTSTP}
#: Fatal errors, named as :mod:`faulthandler` names them for a rank under ``program``.
CRASHES: dict[int, str] = {
    signal.SIGSEGV: "Segmentation fault", signal.SIGFPE: "Floating-point exception",
    signal.SIGABRT: "Aborted", signal.SIGBUS: "Bus error", signal.SIGILL: "Illegal instruction"}
PR_SET_PDEATHSIG = 1


def start(argv: list[str], mask: set[int | signal.Signals]) -> subprocess.Popen[bytes]:
    """Start ``argv``, killed when this process dies, with the signal ``mask`` this
    process was started with (it blocks the forwarded ones itself)."""
    prctl, supervisor = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:  # it died before prctl: nobody would end this one
            os.kill(os.getpid(), signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    return subprocess.Popen(argv, preexec_fn=in_child, close_fds=False)


def supervise(child: subprocess.Popen[bytes], parent: int) -> int:
    """Wait for ``child``, passing on the signals meant for it (not those that
    ``parent``, the MPI daemon, sent to the whole process group); its returncode."""
    while child.poll() is None:
        info = signal.sigwaitinfo(FORWARDED | {signal.SIGCHLD})
        if info.si_signo != signal.SIGCHLD and info.si_pid != parent:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(info.si_signo)
    return child.returncode


def outcome(returncode: int) -> dict[str, Any]:
    """What the launcher reads of a child that ended with ``returncode`` (Popen's)."""
    if returncode >= 0:
        return {"code": returncode}
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:  # a real-time signal
        name = f"signal {number}"
    return {"code": None, "signal": name,
            **({"crashed": CRASHES[number]} if number in CRASHES else {})}


def ours(path: str) -> bool:
    """Whether the record at ``path`` is still the supervisor's: a child that exec'd
    ``elastic_hvd.runner.program`` keeps its pid, and wrote a record of its own."""
    try:
        with open(path) as f:
            return bool(json.load(f).get("supervised"))
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False


def end_as(returncode: int) -> NoReturn:
    """Exit as the child did: with its status, or killed by its signal (no core dump:
    the child's was the one that mattered)."""
    if returncode >= 0:
        sys.exit(returncode)
    number = -returncode
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if number not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
    os.kill(os.getpid(), number)
    os._exit(128 + number)  # a signal that does not end a process by default


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m elastic_hvd.runner.supervisor VARIABLE command [args]")
    parent = os.getppid()  # the MPI daemon, whose signals reach the child without us
    directory, argv = os.environ.get(sys.argv[1], ""), sys.argv[2:]
    where = os.path.isdir(directory) and os.path.join(directory, socket.gethostname())
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED | {signal.SIGCHLD})
    record = {"id": None, "rank": None, "members": None, **identity(), "supervised": True}
    try:
        child = start(argv, mask)
    except OSError as exc:  # as a shell says it: 127 not found, 126 not executable
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        _log.error(f"elastic-hvd-run: cannot run {argv[0]}: {exc.strerror}")
        if where:
            with contextlib.suppress(OSError):
                write_record(f"{where}-{os.getpid()}.json", {**record, "code": code})
        sys.exit(code)
    path = where and f"{where}-{child.pid}.json"
    if path:
        with contextlib.suppress(OSError):  # the child may have written its own already
            write_record(path, {**record, "code": None}, replace=False)
    returncode = supervise(child, parent)
    if path and ours(path):
        with contextlib.suppress(OSError):  # the status directory may be gone: the launcher
            write_record(path, {**record, **outcome(returncode)})  # ended, or another host
    end_as(returncode)


if __name__ == "__main__":
    main()
