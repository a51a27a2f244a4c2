"""No secret on a command line (issue 41, finding 2): ``/proc/PID/cmdline`` is readable
by every local user, ``/proc/PID/environ`` only by the process's owner (checked as
uid 65534 when the tests run as root).

A job grows (a respawn, a spare refill) while a watcher reads the command line of
every process of the job -- the launcher's whole process tree (mpirun, the ranks,
the spawned process) and every process marked as the job's -- and looks for the
job's secret and for a credential the ranks put into their environment
(``MY_CLOUD_TOKEN``), as such and base64-encoded.  The spawned process must still
get that credential (mpirun never had it: only its spawner can hand it over) and
the launcher's settings (the failure detector's timeout, before ``MPI_Init``), and
the job must train correctly (workers/spawned_env.py, around growth_scenarios.py).
"""

import base64
import binascii
import json
import os
import secrets
import shutil
import subprocess

import pytest

from mpijob import _descendants, job_processes, proc_entries, run_job, until
from second_user import AS_NOBODY
from test_growth import DAEMON_ABORT, grown

pytestmark = pytest.mark.multirank

SECRET_ENV = "ELASTIC_HVD_JOB_SECRET"
HEARTBEAT = ["--heartbeat-period", "0.5", "--heartbeat-timeout", "7"]


def job_tree(marker):
    """PIDs of the job: the launcher and all its descendants, and every process
    marked as the job's (a simulated host's daemon detaches itself)."""
    marked = job_processes(marker)
    [launcher] = [pid for pid in marked
                  if b"elastic_hvd.runner.launch" in proc_entries(pid, "cmdline")]
    return sorted({launcher, *_descendants(launcher), *marked})


def leaks(argv, values):
    """What of ``values`` (``{what: bytes}``) the entries of ``argv`` hold, as such or
    inside a base64-encoded entry."""
    found = []
    for arg in argv:
        try:
            decoded = base64.b64decode(arg, validate=True)
        except (binascii.Error, ValueError):
            decoded = b""
        found += [f"{what}{' in base64' if v not in arg else ''}"
                  for what, v in values.items() if v in arg or v in decoded]
    return found


def read_as_another_user(path):
    """What uid 65534 reads of ``path`` (None if refused)."""
    done = subprocess.run([*AS_NOBODY, "cat", path], capture_output=True, timeout=10)
    return done.stdout if done.returncode == 0 else None


def scan_when_spawned(seen):
    """A watcher: once a spawned process has written what it sees of its environment,
    read every command line of the job into ``seen``, then let that process go on."""
    def spawned_entry(out):
        for path in out.glob("env-*.json"):
            entry = json.loads(path.read_text())
            if entry["spawned"]:
                return entry
        return None

    def watch(out, marker):
        seen["spawned"] = until(lambda: spawned_entry(out), 90,
                                "a spawned process wrote its environment")
        pids = job_tree(marker)
        seen["secret"] = next(e.split(b"=", 1)[1] for pid in pids
                              for e in proc_entries(pid, "environ")
                              if e.startswith(SECRET_ENV.encode() + b"="))
        # A process that ended between the listing and the read has no command line left
        # (it read as empty: argv[0] failed, 1 run seen): nothing of it can leak.
        seen["cmdlines"] = {pid: argv for pid in pids if (argv := proc_entries(pid, "cmdline"))}
        if os.geteuid() == 0:  # what another local user reads of the spawned process
            seen["as_another_user"] = {what: read_as_another_user(
                f"/proc/{seen['spawned']['pid']}/{what}") for what in ("cmdline", "environ")}
        (out / "scanned").touch()
    return watch


SIMULATED_HOSTS = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
    reason="simulated hosts need root, unshare and ip")


@pytest.mark.parametrize("launcher, faults, hosts", [
    (["--respawn"], "rank=2,step=10", None),               # a joiner replaces a lost rank
    (["--spares", "1", "--respawn"], "rank=1,step=10", None),  # the pool refilled by a spawn
    # A daemon per host; both ranks of hostB lost, two joiners grow the job back on hostC
    # (as tests/test_hosts.py's growth with host discovery).
    pytest.param(["--max-np", "4", "--host-discovery-script", "discover.sh",
                  "--discovery-interval", "0.5", "--max-relaunches", "0"],
                 "rank=2,step=10;rank=3,step=10", "hostA:2,hostB:2,hostC:2",
                 marks=[SIMULATED_HOSTS, pytest.mark.upstream(DAEMON_ABORT)]),
], ids=["respawn", "spare-refill", "max-np-on-hosts"])
def test_no_secret_and_no_environment_on_any_command_line(tmp_path, launcher, faults, hosts):
    token = secrets.token_hex(16)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "token").write_text(token)
    if "discover.sh" in launcher:
        script = tmp_path / "discover.sh"
        script.write_text("#!/bin/sh\necho hostA:2\necho hostC:2\n")
        script.chmod(0o755)
        launcher = [str(script) if a == "discover.sh" else a for a in launcher]
    seen = {}
    job = run_job("spawned_env.py", 200, np=4, faults=faults, launcher=[*launcher, *HEARTBEAT],
                  tmp_path=tmp_path, timeout=180, expect_rc=None, hosts=hosts,
                  watcher=scan_when_spawned(seen))
    grown(job, hosts)
    assert "cmdlines" in seen, job.output[-4000:]
    spawned, cmdlines = seen["spawned"], seen["cmdlines"]
    assert spawned["pid"] in cmdlines  # the tree read holds the spawned process ...
    assert any(argv[0].endswith((b"mpirun", b"prterun")) for argv in cmdlines.values())
    assert sum(b"elastic_hvd.runner.program" in argv for argv in cmdlines.values()) >= 4
    if hosts:
        daemons = [argv for argv in cmdlines.values() if argv[0].endswith(b"prted")]
        assert len(daemons) >= 3, [b" ".join(argv)[:300] for argv in daemons]  # one a host
    if "as_another_user" in seen:  # its command line, not its environment
        assert seen["as_another_user"] == {"cmdline": b"\0".join(cmdlines[spawned["pid"]]),
                                           "environ": None}
    values = {"the job's secret": seen["secret"], "MY_CLOUD_TOKEN": token.encode()}
    found = {pid: leaks(argv, values) for pid, argv in cmdlines.items()}
    assert not any(found.values()), {pid: f for pid, f in found.items() if f}
    # ... which got from its spawner what mpirun never had, and the launcher's settings
    # (given to the ranks with -x) before MPI_Init; the original ranks never saw the
    # credential before they set it.
    assert spawned["token"] == token, spawned
    assert spawned["detector_timeout"] == "7.0", spawned
    entries = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("env-*.json")]
    originals = [e["token"] for e in entries if not e["spawned"]]
    assert originals == [None] * (5 if "--spares" in launcher else 4), entries
