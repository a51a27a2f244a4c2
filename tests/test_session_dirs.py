"""A session directory left by a killed mpirun stops a later plain mpirun, not ours.

prterun keeps its session directory in ``$TMPDIR/ompi.<its pid>`` and removes it only
when it ends by itself.  The CI failure (a plain-mpirun test: "The PMIx server's
listener thread failed to start", no rank ran) is a later prterun that got the pid of
a killed one: its PMIx server finds the stale ``pmix.<host>.tool`` file there and does
not start.  Here every pid has such a directory, so whatever pid mpirun gets is taken.
"""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_hvd.runner.launch import find_mpirun
from mpijob import kill_tree, run_job

pytestmark = pytest.mark.multirank

NOT_STARTED = "The PMIx server's listener thread failed to start"


@pytest.fixture
def every_pid_taken(tmp_path):
    """A temporary directory holding a stale session directory for every possible pid."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    if pid_max > 1 << 17:
        pytest.skip(f"pid_max is {pid_max}: too many directories to plant")
    base = tmp_path / "tmp"
    base.mkdir()
    names = {socket.gethostname(), socket.gethostname().split(".")[0]}
    for pid in range(1, pid_max + 1):
        session = base / f"ompi.{pid}"
        session.mkdir()
        for host in names:
            (session / f"pmix.{host}.tool").touch()
    planted = set(base.iterdir())
    yield base, planted
    shutil.rmtree(base)


def test_plain_mpirun_cannot_start_on_a_stale_session_dir(every_pid_taken):
    """The cause, shown: without this, the launcher's test below would prove nothing."""
    base, _ = every_pid_taken
    proc = subprocess.Popen(
        [find_mpirun(), "-np", "2", "--with-ft", "ulfm", "--allow-run-as-root",
         sys.executable, "-c", "print('started')"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "TMPDIR": str(base)})
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode != 0 and NOT_STARTED in output and "started" not in output, output


def test_the_launcher_gives_mpirun_a_session_dir_of_its_own(every_pid_taken, tmp_path):
    base, planted = every_pid_taken
    job = run_job("exit_status.py", "ok", np=2, tmp_path=tmp_path, timeout=90,
                  launcher_env={"TMPDIR": str(base)})
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    assert NOT_STARTED not in job.output
    # ... and removed it: nothing of the launch is left beside the planted directories.
    assert set(base.iterdir()) == planted
