"""A session directory left by a killed mpirun stops a later plain mpirun, not ours.

prterun keeps its session directory in ``$TMPDIR/ompi.<its pid>`` and removes it only
when it ends by itself.  The CI failure (a plain-mpirun test: "The PMIx server's
listener thread failed to start", no rank ran) is a later prterun that got the pid of
a killed one: its PMIx server finds the stale ``pmix.<host>.tool`` file there and does
not start.  Here every pid mpirun can get has such a directory, so whatever pid it gets
is taken (on a host with a large pid_max, the pids it is steered to).
"""

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_hvd.runner.command import find_mpirun
from mpijob import job_processes, kill_tree, proc_entries, run_job, until

#: serial: the next pid is steered machine-wide (a pytest-xdist worker beside would fork into
#: the planted window, or steer it away).
pytestmark = [pytest.mark.multirank, pytest.mark.serial]

NOT_STARTED = "The PMIx server's listener thread failed to start"


#: Where the kernel keeps the last pid it gave: root may set it, the next fork gets the next.
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
#: Pids planted as root (whatever pid_max: a systemd host's is 4194304): the next mpirun's
#: pid, steered into them through ns_last_pid, with room for whatever forks meanwhile.
WINDOW = 1 << 13


@dataclasses.dataclass
class Planted:
    base: Path  # the TMPDIR to give mpirun
    dirs: set  # the stale session directories planted there
    pids: range  # the pids they stand for

    def steer(self):
        """Make the next pids the planted ones (where not every pid is planted)."""
        if self.pids.start > 1:
            NS_LAST_PID.write_text(str(self.pids.start - 1))


@pytest.fixture
def every_pid_taken(tmp_path):
    """A temporary directory holding a stale session directory for every pid the next
    mpirun can get: as root, the WINDOW pids after the point ns_last_pid is steered to
    before the launch (Planted.steer); else every pid, where pid_max <= 2^17
    (TEST_EVERY_PID=1: so as root too)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    steer = os.geteuid() == 0 and NS_LAST_PID.exists() and not os.environ.get("TEST_EVERY_PID")
    if steer:  # any pid_max, and fewer directories to plant
        window = min(WINDOW, pid_max // 4)
        start = (int(NS_LAST_PID.read_text()) + window) % (pid_max - 2 * window) + window // 2
        pids = range(start, start + window)
    elif pid_max <= 1 << 17:
        pids = range(1, pid_max + 1)
    else:
        pytest.skip(f"pid_max is {pid_max}: steering the next pid needs root")
    base = tmp_path / "tmp"
    base.mkdir()
    names = {socket.gethostname(), socket.gethostname().split(".")[0]}
    for pid in pids:
        session = base / f"ompi.{pid}"
        session.mkdir()
        for host in names:
            (session / f"pmix.{host}.tool").touch()
    planted = Planted(base, set(base.iterdir()), pids)
    yield planted
    shutil.rmtree(base)


def test_plain_mpirun_cannot_start_on_a_stale_session_dir(every_pid_taken):
    """The cause, shown: without this, the launcher's test below would prove nothing."""
    planted = every_pid_taken
    planted.steer()
    proc = subprocess.Popen(
        [find_mpirun(), "-np", "2", "--with-ft", "ulfm", "--allow-run-as-root",
         sys.executable, "-c", "print('started')"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "TMPDIR": str(planted.base)})
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.pid in planted.pids, (proc.pid, planted.pids)
    assert proc.returncode != 0 and NOT_STARTED in output and "started" not in output, output


def test_the_launcher_gives_mpirun_a_session_dir_of_its_own(every_pid_taken, tmp_path):
    planted = every_pid_taken
    mpiruns = []

    def note_mpirun(_out, marker):
        def found():
            mpiruns.extend(pid for pid in job_processes(marker) if (
                proc_entries(pid, "cmdline") or [b""])[0].endswith((b"prterun", b"mpirun")))
            return mpiruns
        until(found, 60, "mpirun started", every=0.01)

    planted.steer()
    job = run_job("exit_status.py", "ok", np=2, tmp_path=tmp_path, timeout=90,
                  launcher_env={"TMPDIR": str(planted.base)}, watcher=note_mpirun)
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    assert NOT_STARTED not in job.output
    assert mpiruns[0] in planted.pids, (mpiruns, planted.pids)  # its pid had a stale dir
    # ... and removed it: nothing of the launch is left beside the planted directories.
    assert set(planted.base.iterdir()) == planted.dirs
