"""The failures repaired by starting the job again: recognising them, and where.

**Node loss.** Open MPI 5.0.11's runtime (PRRTE 3.0.14) ends the whole job when it
loses a node's daemon -- unconditionally, before any survivor sees an MPI error --
and ``mpirun`` then exits 0.  Such a failure cannot be repaired in place: the
launcher says so in one line and starts the job again without that host.

**A job Open MPI broke on every rank.** A process that dies inside a merge or a
connect with new processes leaves Open MPI unable to make any new communicator on
the ranks that took part (its endless retry, docs/openmpi-quirks.md); each of them
then leaves as a crash (``mpi_env.end_broken``) and the others repair -- unless
there are no others.  When every rank left so, nothing is left to repair in place:
the launcher starts the job again, on the same hosts and at the same size.

**A crashed runtime.** ``mpirun`` (prterun) itself may die of a crash signal (SIGABRT,
SIGSEGV, ...) on a heap PRRTE 3.0.14 damaged: after a rank died inside a connect with
a hot spare, its ``connect_release`` writes past an array once the collective ends,
and glibc aborts prterun at some later allocation (workarounds.TABLE
``prrte_connect_release``).  The ranks go with it.  While they trained, the launcher
starts the job again, on the same hosts and at the same size; once they all had
finished, the job succeeded, and the line says that mpirun crashed after.

In each case the script resumes from the newest state (:mod:`elastic_hvd.state_replica`,
or its checkpoint).  :func:`run` is the launcher's loop: a launch, and another while
one of these ended it, at most ``--max-relaunches`` times.
"""

import argparse
import copy
import dataclasses
import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from .. import state_replica
from ..core import workarounds
from ..growth_policy import discover_hosts, parse_hosts, read_hostfile
from .command import build_command
from .job import Ended, run_once
from .outcome import exit_status, members_done
from ..log import get_logger

_log = get_logger(__name__)

#: Exit status of a job the runtime ended for a lost node, when it is not relaunched.
EXIT_NODE_LOST = 4
#: Exit status of a job that Open MPI broke on every rank, when it is not relaunched.
EXIT_BROKEN = 5
#: Exit status of a job whose mpirun crashed while it trained, when it is not relaunched.
EXIT_RUNTIME_CRASHED = 7
#: The signals by which a process crashes (not those a person or a runtime sends to end it).
CRASH_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
                           signal.SIGFPE})


@dataclasses.dataclass(frozen=True)
class Cause:
    """Why a job ended that a relaunch resumes: its runtime lost the daemon of
    ``lost_host``, or (None) Open MPI broke every rank or mpirun crashed."""

    lost_host: str | None = None


_TEARDOWN = re.compile(rb"PRTE has lost communication with a remote daemon\..*?"
                       rb"Remote daemon: *\[[^\]]*\] on node (\S+)", re.S)


def lost_daemon_host(output: bytes) -> str | None:
    """The host whose daemon the runtime lost, if ``output`` (mpirun's) says it
    ended the job for that; else None."""
    found = _TEARDOWN.search(output)
    return found.group(1).decode(errors="replace") if found else None


def broken_why(outcomes: Sequence[Mapping[str, Any]]) -> str | None:
    """What broke the job if Open MPI left every rank unable to go on (see the module
    doc): no rank ended by itself and at least one said it was broken (the status
    files of ``runner/program.py``); else None."""
    if any(o["code"] is not None and o.get("members") != [] for o in outcomes):
        return None  # a rank ended by itself: the script's end, or its own failure
    broken = [o for o in outcomes if o.get("broken")]
    if not broken:
        return None
    return (f"Open MPI left every rank unable to make a communicator ({len(broken)} of the "
            f"{len(outcomes)} processes ended so, the others were lost): {broken[0]['broken']}")


def verdict(ended: Ended) -> tuple[int, str | None, Cause | None]:
    """The exit status of a launch that ``ended`` so, the line saying why (None for a
    plain 0), and why a relaunch would resume it (None: it would not)."""
    lost = lost_daemon_host(ended.tail)
    # The same words also come while a job that has finished shuts down (a daemon
    # gone before mpirun asked): only a job whose members did not all finish was lost.
    if lost is not None and not members_done(ended.outcomes):
        return EXIT_NODE_LOST, (
            f"exit status {EXIT_NODE_LOST}: node loss: the MPI runtime lost the daemon "
            f"of host {lost} and ended the whole job (mpirun exit status {ended.code})"
        ), Cause(lost)
    broken = broken_why(ended.outcomes)
    if broken is not None:
        return EXIT_BROKEN, (f"exit status {EXIT_BROKEN}: {broken} "
                             f"(mpirun exit status {ended.code})"), Cause()
    crash = _crash_name(ended.signal)
    if crash is not None:
        workarounds.used("prrte_connect_release", crash)
    if crash is not None and not members_done(ended.outcomes):
        return EXIT_RUNTIME_CRASHED, (
            f"exit status {EXIT_RUNTIME_CRASHED}: the MPI runtime crashed: mpirun died of "
            f"{crash} while the ranks trained, and they with it (an Open MPI bug: see "
            "docs/openmpi-quirks.md)"), Cause()
    status, why = exit_status(ended.code, ended.outcomes)
    if crash is not None and status == 0:
        why = (f"mpirun crashed ({crash}: an Open MPI bug, docs/openmpi-quirks.md) after the "
               "program had exited 0 on every rank that finished")
    return status, why, None


def _crash_name(signum: int | None) -> str | None:
    """The name of ``signum`` if it is a crash signal (:data:`CRASH_SIGNALS`), else None."""
    return signal.Signals(signum).name if signum in CRASH_SIGNALS else None


def run(args: argparse.Namespace, cmd: Sequence[str], settings: Any) -> tuple[int, str | None]:
    """Launch the job, and again after each failure a relaunch repairs, at most
    ``args.max_relaunches`` times, each resuming from the newest state the
    :class:`state_replica.Keeper` holds; the exit status and the line saying why."""
    keeper = state_replica.Keeper(state_replica.listen_address(state_replica.job_hosts(args)))
    os.environ.update(keeper.environ())  # passed on by name: a secret stays off command lines
    relaunches = 0
    try:
        while True:
            this = [cmd[0], "-x", state_replica.ADDRESS_ENV, "-x", state_replica.SECRET_ENV,
                    "-x", f"{state_replica.LAUNCH_ENV}={relaunches}", *cmd[1:]]
            status, why, cause = verdict(run_once(args, this, settings))
            if cause is None or relaunches >= args.max_relaunches:
                return status, why
            again, why_not = arguments(args, cause)
            if again is None:
                return status, f"{why}; not relaunched: {why_not}"
            relaunches += 1
            kept = (f"the state of step {keeper.position[0]} kept in memory, or a newer "
                    "checkpoint" if keeper.position else "the script's checkpoint, if it has one")
            where = f"on {again.hosts} " if again.hosts else ""
            size = f"{again.np} ranks; " if again.np else ""
            _log.warning(f"elastic-hvd-run: {why}; relaunching {where}({size}relaunch "
                         f"{relaunches} of {args.max_relaunches}) from {kept}")
            args, cmd = again, build_command(again)
    finally:
        keeper.close()


def arguments(args: argparse.Namespace,
              cause: Cause) -> tuple[argparse.Namespace, None] | tuple[None, str]:
    """The launch arguments for a relaunch after ``cause`` and the reason there is
    none (``(args, None)`` or ``(None, why)``)."""
    return (args, None) if cause.lost_host is None else without_host(args, cause.lost_host)


def hosts_of(args: argparse.Namespace) -> dict[str, int]:
    """``{host: slots}`` to relaunch on: what the host discovery offers now, if the
    launch has one (it knows which hosts went bad: a relaunch must not return to
    them), else what the launch named (``-H`` or ``--hostfile``); {} if nothing."""
    if args.host_discovery_script:
        try:
            return discover_hosts(args.host_discovery_script)
        except (OSError, ValueError, subprocess.SubprocessError):
            pass  # a discovery that fails now: fall back on the hosts named
    if args.hosts:
        return parse_hosts(args.hosts.replace(",", "\n"))
    if args.hostfile:
        return read_hostfile(args.hostfile)
    return {}


def without_host(args: argparse.Namespace,
                 lost: str) -> tuple[argparse.Namespace, None] | tuple[None, str]:
    """The launch arguments for a relaunch without host ``lost`` and the reason
    there is none (``(args, None)`` or ``(None, why)``)."""
    hosts = hosts_of(args)
    if not hosts:
        return None, ("the hosts are not known to the launcher (give them with -H, "
                      "--hostfile or --host-discovery-script to have it relaunch without "
                      "the lost one)")
    hosts.pop(lost, None)
    slots = sum(hosts.values())
    size = min(args.np or slots, slots)
    if size < (args.min_np or 1):
        return None, f"the hosts left have {slots} slot(s), fewer than --min-np {args.min_np}"
    again = copy.copy(args)
    again.hosts = ",".join(f"{host}:{count}" for host, count in hosts.items())
    again.hostfile, again.np = None, size
    return again, None
