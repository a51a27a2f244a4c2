"""One launch of the job: mpirun started, watched and relayed, and what it left behind.

Each launch has a status directory (the ranks' records, :mod:`.outcome`) and an
mpirun session directory of its own, both removed after it.  A process that
outlives mpirun may still write into them while they go, which must not turn the
job's exit status into a traceback: removal errors are ignored.
"""

import argparse
import dataclasses
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ..core import config
from . import reports
from .command import session_dir_args
from .console import tf_logs_wanted
from .outcome import HOROVOD_HINT, horovod_missing, read_outcomes
from .relay import relay_stderr
from .watch import end_strays, end_when_members_done
from ..log import get_logger

_log = get_logger(__name__)

#: Seconds past the ranks' finalize deadline (``runtime._at_exit``: by then every
#: finished member has exited) before a lingering mpirun is ended.
FINALIZE_MARGIN = 3.0
#: Signals passed on to mpirun, which passes them on to every rank: SIGINT and SIGTERM
#: end the job; SIGUSR1 asks for a final checkpoint (``keras_callbacks.ElasticCheckpoint``;
#: Slurm's ``--signal=B:USR1@N`` sends it to the batch script, this launcher when the
#: script ``exec``s it: docs/slurm.md), SIGUSR2 is the script's own.  Without a handler
#: here either would kill the launcher, and mpirun with it.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@dataclasses.dataclass(frozen=True)
class Ended:
    """How one launch ended."""

    code: int  #: mpirun's exit status; killed by signal N: 128 + N, as a shell says it
    outcomes: list[dict[str, Any]]  #: what the processes recorded (:mod:`.outcome`)
    tail: bytes  #: the end of mpirun's stderr (:data:`.relay.TAIL` bytes)
    signal: int | None = None  #: the signal that killed mpirun itself, if one did


def run_mpirun(cmd: Sequence[str], status_dir: str | None = None, grace: float | None = None,
               reporter: reports.Reporter | None = None,
               quiet_tf: bool = False) -> tuple[int, bytes]:
    """Run ``cmd``, passing :data:`FORWARDED` signals on to it and its stderr through (see
    :mod:`.relay`); returns (exit status, the end of its stderr).  With ``status_dir``,
    it is watched (:func:`.watch.end_when_members_done`, ending it ``grace`` seconds
    after every member finished) and the ``reporter`` tells of failures."""
    reporter = reporter or reports.Reporter()
    env = None if status_dir is None else {**os.environ, config.env("status_dir"): status_dir}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)  # env: see end_strays

    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    stopped = threading.Event()
    if status_dir is not None:
        threading.Thread(target=end_when_members_done,
                         args=(proc, status_dir, grace, stopped, reporter), daemon=True).start()
    tail = relay_stderr(proc, reporter.lock, quiet_tf)
    code = proc.wait()
    stopped.set()
    return code, tail


def run_once(args: argparse.Namespace, cmd: Sequence[str], settings: Any) -> Ended:
    """Run the job once, with the ``args`` and ``settings`` :func:`.launch.checked`
    gave and the command :func:`.command.build_command` made of them."""
    with tempfile.TemporaryDirectory(prefix="elastic_hvd",
                                     ignore_cleanup_errors=True) as status_dir, \
            tempfile.TemporaryDirectory(prefix="elastic_hvd-mpi",
                                        ignore_cleanup_errors=True) as session_base:
        cmd = [cmd[0], *session_dir_args(cmd, session_base),
               "-x", f"{config.env('status_dir')}={status_dir}", *cmd[1:]]
        grace = settings.finalize_deadline + FINALIZE_MARGIN
        reporter = reports.Reporter()
        quiet_tf = not tf_logs_wanted(os.environ, args.env)
        code, tail = run_mpirun(cmd, status_dir, grace, reporter, quiet_tf)
        killed_by = -code if code < 0 else None
        if killed_by:  # what it started may run on (one that ends by itself waits for
            strays = end_strays(status_dir)  # its processes, still exiting)
            if strays:
                _log.warning(f"elastic-hvd-run: mpirun was killed by signal {killed_by} "
                             f"while {len(strays)} process(es) of the job still ran; killed "
                             f"them: {', '.join(sorted(strays))}")
            code = 128 + killed_by
        outcomes = read_outcomes(status_dir)
        reporter.news(outcomes)  # what the last look before the end did not see
    if not args.as_horovod and horovod_missing(outcomes):
        _log.warning(f"elastic-hvd-run: {HOROVOD_HINT}")
    return Ended(code, outcomes, tail, killed_by)
