"""Signals only to the process meant, never to a later one that got its pid.

A pid names a process only while it lives: once it ended and was reaped, the kernel
gives the pid to some later process (with pid_max 32768, soon on a busy host), and a
job run as root may signal any process.  The pids the ranks kill by -- a lost rank's
(the repair's fence), a hot spare's (its *ready*), a joiner's (its *hello*), a stopped
member's -- were told by those processes, maybe long before.  So each process tells
its :class:`Identity`, its pid with its start time, and :func:`kill` signals only the
process that has both.
"""

import os
import signal
from typing import NamedTuple

from .procfs import START, stat_fields
from ..log import get_logger

_log = get_logger(__name__)


class Identity(NamedTuple):
    """One process for good: its pid and its start time (clock ticks after boot)."""

    pid: int
    start: int


def start_of(pid: int | str) -> int | None:
    """Start time of process ``pid`` (``"self"``: this one), None if it is gone."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return int(fields[START]) if fields else None


def mine() -> Identity:
    """This process's identity, to tell the processes that may have to kill it."""
    start = start_of("self")
    assert start is not None  # /proc/self is always there
    return Identity(os.getpid(), start)


def kill(target: Identity, who: str, signum: int = signal.SIGKILL) -> bool:
    """Send ``signum`` to ``target`` (``who``: what it is, for the lines below); True if
    sent, False if not: it is gone, or (said in one line) its pid belongs to another
    process now, or the signal was refused.

    The check goes through a pidfd opened first, and the signal through the same
    pidfd: a pid reused between the check and the signal cannot take it.  Without
    pidfds (Linux before 5.3, a seccomp filter that refuses them): by pid, right
    after the check."""
    try:
        fd: int | None = os.pidfd_open(target.pid)
    except ProcessLookupError:
        return False
    except OSError:
        fd = None
    try:
        start = start_of(target.pid)
        if start is None:
            return False
        if start != target.start:
            _log.warning(f"elastic_hvd: {who}: not signalled: its pid {target.pid} was reused, "
                         f"it belongs to another process now (started at tick {start}, not "
                         f"{target.start})")
            return False
        if fd is None:
            os.kill(target.pid, signum)
        else:
            signal.pidfd_send_signal(fd, signum)
        return True
    except ProcessLookupError:
        return False
    except OSError as exc:
        _log.warning(f"elastic_hvd: {who}: could not signal pid {target.pid}: {exc.strerror}")
        return False
    finally:
        if fd is not None:
            os.close(fd)
